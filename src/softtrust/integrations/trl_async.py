"""softtrust's losses inside TRL's experimental ``AsyncGRPOTrainer``: off-policy losses for async rollouts.

TRL 1.16.0's ``trl.experimental.async_grpo.AsyncGRPOTrainer`` trains on samples a vLLM server
generated with weights up to ``max_staleness`` updates old, with plain PPO clipping of
``π_θ / μ`` (μ: the sampler) and no other choice. :class:`SoftTrustAsyncGRPOTrainer` overrides
its ``compute_loss`` so that the loss is any :class:`~softtrust.PolicyLoss`; TRL's rollout
worker, weight sync, packing, accumulation, FSDP2 and logging run unchanged::

    import softtrust as st
    from softtrust.integrations.trl_async import SoftTrustAsyncGRPOTrainer

    trainer = SoftTrustAsyncGRPOTrainer(
        model="Qwen/Qwen3-1.7B", reward_funcs=reward, args=async_config, train_dataset=dataset,
        policy_loss=st.PolicyLoss("vespo"),  # default: from_async_config(args), TRL's own clip
    )

What the override takes from TRL's packed micro-batch (one row of samples per rank, a shared
prefix forwarded once; ``M`` loss terms, ``S`` samples, ``L`` the most terms of one sample):

| softtrust argument  | TRL                                                                    |
| ------------------- | ---------------------------------------------------------------------- |
| ``logprobs``        | the fused head's ``log_probs`` at ``token_index``, [M] regrouped to [S, L] by ``segment_id`` |
| ``old_logprobs``    | ``old_log_probs``: the sampler's (μ); ``logprobs.detach()`` with a TIS/MIS/Reject (see below) |
| ``rollout_logprobs``| ``old_log_probs`` (μ), only with a TIS/MIS/Reject                      |
| ``advantages``      | ``advantages`` (one per sample, repeated per term), [S, L]             |
| ``mask``            | the sample's loss terms, minus samples staler than ``max_staleness`` when trained |
| ``num_tokens`` / ``num_sequences`` | ``global_n_tokens`` / the micro-batch's sample count, per rank, × GA |

**Behaviour policy.** Nothing recomputes the stale generating policy, so μ (vLLM's log-probs)
is π_old and the trust region bounds ``π_θ / μ``, as in TRL. A TIS, MIS or Reject correction
needs two policies: the PolicyLoss then runs the decoupled objective (AReaL, arXiv 2505.24298)
with π_prox = the current weights, ``logprobs.detach()`` (exact, not an approximation: every
sample is trained once, and the weights are fixed within an accumulation window), and the
correction weighs ``π_prox / μ``.

**Staleness bound.** TRL drops a sample staler than ``max_staleness`` when it leaves the queue,
but the dataloader fetches a micro-batch ahead (accelerate's dispatcher; the token-budget
batcher keeps a sample for the next micro-batch), so a sample can be trained one or more
updates later than TRL measured. The trainer carries each sample's policy version to the loss
and masks the samples staler than ``max_staleness`` at the update itself (a zero-weight sample,
as a Reject: the normalisers keep TRL's counts).

**Refused** (``ValueError`` before TRL loads the model): a method that selects over a whole
mini-batch (``PolicyLoss.selects_over_batch``: M2PO, KL-Cov, Clip-Cov, BAPO; the async trainer
consumes one packed micro-batch at a time), a KL term (TRL's async trainer has no reference
model), ``seq-mean-token-sum-norm`` without ``max_completion_length``.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, NamedTuple

import torch

try:
    import trl
    from accelerate.utils import gather_object
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.trainer.utils import pad
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'softtrust.integrations.trl_async needs TRL and accelerate; install them with `pip install -e ".[trl]"` '
        "in the softtrust clone"
    ) from error

from softtrust.integrations.trl import check_trl_version, reduce_over_ranks
from softtrust.loss import LossOutput, PolicyLoss
from softtrust.methods import Clip

check_trl_version(trl.__version__)

__all__ = [
    "PackedRow",
    "SegmentLayout",
    "SoftTrustAsyncGRPOTrainer",
    "async_normalisers",
    "behaviour_logprobs",
    "check_async_supported",
    "from_async_config",
    "segment_layout",
    "to_segments",
    "unpack_row",
]

# A sample's policy version rides in its `metrics` from the rollout queue to the collator (TRL's dataset
# passes `metrics` on and drops `model_version`); the collator removes it before TRL logs the metrics.
_VERSION_KEY = "softtrust/model_version"


def from_async_config(config: Any) -> PolicyLoss:
    """The PolicyLoss that computes TRL's async loss: ``Clip(epsilon, epsilon_high)``, token-mean.

    TRL's ``AsyncGRPOTrainer`` clips ``π_θ / μ`` per token and divides each micro-batch's sum
    by its token count (:func:`async_normalisers`); ``epsilon_high=None`` means ``epsilon``.
    """
    epsilon = getattr(config, "epsilon", 0.2)
    epsilon_high = getattr(config, "epsilon_high", None)
    return PolicyLoss(
        Clip(eps_low=epsilon, eps_high=epsilon if epsilon_high is None else epsilon_high),
        aggregation="token-mean",
    )


def check_async_supported(policy_loss: PolicyLoss) -> None:
    """Refuse, before training, a PolicyLoss the async trainer cannot compute.

    Raises:
        ValueError: naming the setting, for: a ``policy_loss`` that is not a PolicyLoss; a
            method that selects over a whole mini-batch (``selects_over_batch``); a KL term;
            ``seq-mean-token-sum-norm`` without ``max_completion_length``.
    """
    if not isinstance(policy_loss, PolicyLoss):
        raise ValueError(f"policy_loss must be a softtrust.PolicyLoss, got {type(policy_loss).__name__}")
    if policy_loss.selects_over_batch:
        raise ValueError(
            f"method {policy_loss.method.name!r} selects over a whole mini-batch (Method.batch_state), but "
            "AsyncGRPOTrainer consumes one packed micro-batch at a time from the rollout queue, with no "
            "mini-batch to select over; use a method without batch state (e.g. 'clip', 'vespo', 'cispo'), or "
            "softtrust's own trainer (`softtrust train --mode async`)"
        )
    if policy_loss.kl is not None:
        raise ValueError(
            f"kl={policy_loss.kl!r}: TRL's AsyncGRPOTrainer has no reference model, so there are no reference "
            "log-probs for a KL term; use a PolicyLoss without kl"
        )
    if policy_loss.aggregation == "seq-mean-token-sum-norm" and policy_loss.max_completion_length is None:
        raise ValueError(
            "aggregation='seq-mean-token-sum-norm' needs PolicyLoss(max_completion_length=...) (e.g. the "
            "config's max_completion_length), got None"
        )


class PackedRow(NamedTuple):
    """This rank's row of TRL's packed micro-batch, the inter-rank padding stripped.

    ``model_inputs`` are the forward's (``input_ids`` etc. [1, N], the tree-attention
    indices); the loss terms are flat, [M]; ``sample_lag`` is [S], each sample's staleness
    (policy versions) when the micro-batch was collated.
    """

    model_inputs: dict[str, Any]
    token_index: torch.Tensor  # [M] the packed position whose prediction each term scores
    sampler_logprobs: torch.Tensor  # [M] μ: the generating policy's log-prob of each term
    advantages: torch.Tensor  # [M] the term's sample's advantage
    segment_id: torch.Tensor  # [M] the term's sample, 0..S-1
    sample_lag: torch.Tensor  # [S]


def unpack_row(inputs: dict[str, torch.Tensor]) -> PackedRow:
    """Read a rank's ``[1, ...]`` slice of TRL's collated micro-batch (padding: -1 in the index
    tensors, ``attention_mask`` 0 in the token tensors)."""
    real = inputs["attention_mask"].bool()  # [1, N_padded]
    model_inputs: dict[str, Any] = {
        name: inputs[name][real].unsqueeze(0) for name in ("input_ids", "position_ids", "shift_labels")
    }  # [1, N] each
    for name in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
        model_inputs[name] = inputs[name][inputs[name] >= 0]
    longest_segment, longest_path = inputs["tree_max_seqlens"][0].tolist()
    model_inputs.update(tree_max_seqlen_q=longest_segment, tree_max_seqlen_k=longest_path)
    terms = inputs["token_index"] >= 0  # [1, M_padded]
    lag = inputs["sample_lag"][0]  # [S_padded]
    return PackedRow(
        model_inputs=model_inputs,
        token_index=inputs["token_index"][terms],
        sampler_logprobs=inputs["old_log_probs"][terms],
        advantages=inputs["advantages"][terms],
        segment_id=inputs["segment_id"][terms],
        sample_lag=lag[lag >= 0],
    )


class SegmentLayout(NamedTuple):
    """Where each flat loss term goes in a [S, L] grid: row = its sample, column = its order
    among that sample's terms (packing order)."""

    row: torch.Tensor  # [M]
    column: torch.Tensor  # [M]
    shape: tuple[int, int]  # (S, L)


def segment_layout(segment_id: torch.Tensor, num_samples: int) -> SegmentLayout:
    """The [S, L] layout of the terms of ``num_samples`` samples, L = the most terms of one.

    Sequence-level ratios (GSPO's mean, VESPO's sum over a sample) and ``seq-mean-*``
    aggregations reduce over a row, so every sample must be one row; a packed row holds
    several samples, and shared prefixes are forwarded once, so positions alone do not say
    which sample a term belongs to: ``segment_id`` does.
    """
    counts = torch.bincount(segment_id, minlength=num_samples)  # [S] terms per sample
    order = torch.argsort(segment_id, stable=True)  # [M] terms grouped by sample, packing order kept
    first = counts.cumsum(0) - counts  # [S] the sample's first slot in `order`
    column = torch.empty_like(segment_id)  # [M]
    column[order] = torch.arange(segment_id.numel(), device=segment_id.device) - first[segment_id[order]]
    width = int(counts.max()) if segment_id.numel() else 0
    return SegmentLayout(segment_id, column, (num_samples, width))


def to_segments(values: torch.Tensor, layout: SegmentLayout, fill: float = 0.0) -> torch.Tensor:
    """[M] -> [S, L] (``fill`` where a sample has fewer terms); differentiable in ``values``."""
    grid = values.new_full(layout.shape, fill)  # [S, L]
    return grid.index_put((layout.row, layout.column), values)


def behaviour_logprobs(
    policy_loss: PolicyLoss, logprobs: torch.Tensor, sampler: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(old_logprobs, rollout_logprobs)`` for the PolicyLoss from the sampler's log-probs μ.

    Without a TIS/MIS/Reject correction: π_old = μ (no rollout log-probs; an OPSM measures
    against π_old = μ). With one, the decoupled objective: π_old = π_prox =
    ``logprobs.detach()`` (the weights this update starts from) and the correction weighs
    ``π_prox / μ``.
    """
    if policy_loss.is_correction is None and policy_loss.reject is None:
        return sampler, None
    return logprobs.detach(), sampler


def async_normalisers(
    aggregation: str,
    inputs: dict[str, torch.Tensor],
    gradient_accumulation_steps: int,
    num_processes: int,
) -> dict[str, torch.Tensor]:
    """``num_tokens`` / ``num_sequences`` for one rank's micro-batch loss, scaled as TRL scales it.

    TRL normalises each micro-batch by its own count (over all ranks, divided by P: the
    gradients are averaged over ranks) and by GA (it scales for accumulation itself):

    | aggregation | normaliser |
    | --- | --- |
    | ``token-mean`` | ``max(global_n_tokens / P, 1) · GA`` (TRL's own loss) |
    | ``seq-mean-*`` | ``max(samples / P, 1) · GA``, samples = the micro-batch's, every rank's |
    | ``token-sum`` | none |
    """
    if aggregation == "token-sum":
        return {}
    if aggregation == "token-mean":
        per_rank = (inputs["global_n_tokens"][0] / num_processes).clamp(min=1.0)
        return {"num_tokens": per_rank * gradient_accumulation_steps}
    per_rank = (inputs["global_n_samples"][0] / num_processes).clamp(min=1.0)
    return {"num_sequences": per_rank * gradient_accumulation_steps}


class _VersionStampedQueue:
    """The rollout queue, each sample's ``model_version`` copied into its ``metrics``."""

    def __init__(self, rollout_queue: Any) -> None:
        self.rollout_queue = rollout_queue

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self.rollout_queue.get(*args, **kwargs)
        return dataclasses.replace(sample, metrics={**sample.metrics, _VERSION_KEY: sample.model_version})

    def __getattr__(self, name: str) -> Any:  # qsize, put_nowait, ...: the queue's own
        return getattr(self.rollout_queue, name)


class _StalenessCollator:
    """TRL's collator plus, per micro-batch: ``sample_lag`` [P, S] (each sample's staleness now,
    -1 padded), ``syncs_at_collate`` [P] (weight syncs so far) and ``global_n_samples`` [P]."""

    def __init__(self, collate: Any, trainer: SoftTrustAsyncGRPOTrainer) -> None:
        self.collate, self.trainer = collate, trainer

    def __call__(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        (rows,) = examples  # one planned micro-batch: a TreeRow per rank
        now, ranks = self.trainer.model_version, len(rows)
        lags = [
            torch.tensor([now - sample["metrics"].pop(_VERSION_KEY) for sample in row.samples])
            for row in rows
        ]
        batch = self.collate(examples)
        batch["sample_lag"] = pad(lags, padding_value=-1)  # [P, S]
        batch["syncs_at_collate"] = torch.full((ranks,), self.trainer.weight_syncs)  # [P]
        samples = sum(len(row.samples) for row in rows)
        batch["global_n_samples"] = torch.full((ranks,), float(samples))  # [P]
        return batch


class SoftTrustAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's experimental ``AsyncGRPOTrainer`` whose loss is a softtrust :class:`~softtrust.PolicyLoss`.

    Overrides ``compute_loss`` (the loss, its metrics, TRL's per-step counters) and, to bound
    staleness at the update, ``get_train_dataloader`` and ``_sync_weight`` (each calls TRL's).

    Args:
        *args, **kwargs: as for ``AsyncGRPOTrainer`` (``model``, ``reward_funcs``, ``args``,
            ``rollout_worker``, ``weight_transfer``, ...).
        policy_loss: the loss; default :func:`from_async_config` of the config, TRL's own loss.

    Raises:
        ValueError: from :func:`check_async_supported`, before TRL loads the model.

    Logged metrics: ``softtrust/<name>`` for every PolicyLoss metric (over ranks: min of
    ``*/min``, max of ``*/max``, mean of the rest), ``softtrust/staleness/mean`` and
    ``/max`` (policy versions, at the update, of the samples trained),
    ``softtrust/stale_dropped_total`` (samples masked by the bound) and TRL's ``entropy``.
    They replace TRL's ``ratio``, ``kl`` and ``clip_ratio/*``.
    """

    def __init__(self, *args: Any, policy_loss: PolicyLoss | None = None, **kwargs: Any) -> None:
        bound = inspect.signature(AsyncGRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if config is not None:  # fail fast, before TRL loads the model
            policy_loss = from_async_config(config) if policy_loss is None else policy_loss
            check_async_supported(policy_loss)
        super().__init__(*args, **kwargs)
        if config is None:  # TRL built a default AsyncGRPOConfig
            policy_loss = from_async_config(self.args) if policy_loss is None else policy_loss
            check_async_supported(policy_loss)
        self.policy_loss = policy_loss
        self.weight_syncs = 0  # counted on every rank (TRL's model_version lives on rank 0 only)

    def _sync_weight(self) -> None:
        super()._sync_weight()
        self.weight_syncs += 1

    def get_train_dataloader(self) -> Any:
        """TRL's dataloader, carrying each sample's policy version to ``compute_loss``."""
        if self.accelerator.is_main_process and not isinstance(self.rollout_queue, _VersionStampedQueue):
            self.rollout_queue = _VersionStampedQueue(self.rollout_queue)
        dataloader = super().get_train_dataloader()
        if self.accelerator.is_main_process:  # only rank 0 collates; the others receive the batch
            loader = getattr(dataloader, "base_dataloader", dataloader)
            loader.collate_fn = _StalenessCollator(loader.collate_fn, self)
        return dataloader

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """Packed forward -> each sample's terms on one row, stale samples masked -> ``self.policy_loss``."""
        row = unpack_row(inputs)
        started = time.perf_counter()
        logprobs, entropy, aux_loss = self._packed_logprobs(model, row)  # [M], [M], scalar or None
        forward_s = time.perf_counter() - started
        lag = row.sample_lag + (self.weight_syncs - inputs["syncs_at_collate"][0])  # [S] at this update
        fresh = lag <= self.args.max_staleness  # [S]
        layout = segment_layout(row.segment_id, lag.numel())
        terms = to_segments(torch.ones_like(row.segment_id, dtype=torch.bool), layout, fill=False)  # [S, L]
        logprobs = to_segments(logprobs, layout)  # [S, L]
        sampler = to_segments(row.sampler_logprobs, layout)  # [S, L]
        old, rollout = behaviour_logprobs(self.policy_loss, logprobs, sampler)
        accumulation = self.current_gradient_accumulation_steps
        processes = self.accelerator.num_processes
        out = self.policy_loss(
            logprobs,
            old,
            to_segments(row.advantages, layout),  # [S, L]
            terms & fresh[:, None],  # [S, L]
            rollout_logprobs=rollout,
            # an entropy bonus / quantile: this rank's packed micro-batch's entropies (its threshold too)
            entropy=to_segments(entropy, layout) if self.policy_loss.needs_entropy else None,
            **async_normalisers(self.policy_loss.aggregation, inputs, accumulation, processes),
        )
        loss = out.loss
        if aux_loss is not None:  # MoE load balancing, scaled for accumulation as TRL does
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._log_softtrust_metrics(out, entropy, lag[fresh], fresh, aux_loss)
        self._count_step_tokens(inputs, forward_s)
        return loss

    def _packed_logprobs(
        self, model: torch.nn.Module, row: PackedRow
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The policy's log-prob and entropy of each loss term ([M] each), from one packed forward
        through TRL's fused head, and the MoE auxiliary loss (None when disabled)."""
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(**row.model_inputs, fused_lm_head=True, **router)
        logprobs = outputs.log_probs.flatten()[row.token_index]  # [M]
        entropy = outputs.entropy.flatten()[row.token_index]  # [M]
        return logprobs, entropy, outputs.aux_loss if self.aux_loss_enabled else None

    def _log_softtrust_metrics(
        self,
        out: LossOutput,
        entropy: torch.Tensor,
        trained_lag: torch.Tensor,
        fresh: torch.Tensor,
        aux_loss: torch.Tensor | None,
    ) -> None:
        """PolicyLoss metrics under ``softtrust/``, staleness at the update, TRL's ``entropy``
        (mean over every rank's terms) and ``aux_loss``; every value over all ranks."""
        metrics = self._metrics["train"]
        per_rank = [out.metric_values()]
        if self.accelerator.num_processes > 1:  # objects: key sets may differ between ranks
            per_rank = gather_object(per_rank)
        for name, value in reduce_over_ranks(per_rank).items():
            metrics[f"softtrust/{name}"].append(value)
        entropy = entropy.detach()
        local = torch.stack(
            [
                entropy.sum(),
                torch.tensor(float(entropy.numel()), device=entropy.device),
                trained_lag.sum().to(entropy.dtype),
                fresh.sum().to(entropy.dtype),
                (~fresh).sum().to(entropy.dtype),
            ]
        )  # [5]
        entropy_sum, terms, lag_sum, trained, dropped = self.accelerator.reduce(local, "sum").tolist()
        local_max = torch.cat([trained_lag, trained_lag.new_full((1,), -1)]).max()  # -1: none trained here
        lag_max = float(self.accelerator.gather(local_max.reshape(1)).max())
        metrics["entropy"].append(entropy_sum / max(terms, 1.0))
        metrics["softtrust/staleness/mean"].append(lag_sum / trained if trained else float("nan"))
        metrics["softtrust/staleness/max"].append(lag_max if trained else float("nan"))
        metrics["softtrust/stale_dropped_total"].append(dropped)
        if aux_loss is not None:
            total = self.accelerator.reduce(aux_loss.detach().float(), reduction="sum")
            metrics["aux_loss"].append(float(total) / self.accelerator.num_processes)

    def _count_step_tokens(self, inputs: dict[str, torch.Tensor], forward_s: float) -> None:
        """The per-step counters TRL's ``_log_step_metrics`` reads (its ``compute_loss`` fills them);
        the counts are the micro-batch's, the same on every rank."""
        forwarded = float(inputs["global_n_forward_tokens"][0])
        self._step_forward_tokens += forwarded
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += float(inputs["mean_seq_len"][0]) * forwarded
        self._step_samples += float(inputs["global_n_samples"][0])
        self._step_forward_s += forward_s
