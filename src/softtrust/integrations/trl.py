"""softtrust's losses inside TRL's ``GRPOTrainer``: TRL's machinery, softtrust's trust region.

TRL's ``GRPOTrainer`` adds a method only by copying its ``_compute_loss``.
:class:`SoftTrustGRPOTrainer` overrides that one method and nothing else, so TRL's
generation (transformers or vLLM), reward scoring, advantages, accelerate / DeepSpeed,
gradient accumulation, checkpointing and logging run unchanged; the loss is any
:class:`~softtrust.PolicyLoss`::

    import softtrust as st
    from softtrust.integrations.trl import SoftTrustGRPOTrainer

    trainer = SoftTrustGRPOTrainer(
        model=model, reward_funcs=reward, args=grpo_config, train_dataset=dataset,
        policy_loss=st.PolicyLoss("pspo", alpha=0.1),  # default: from_trl_config(grpo_config)
    )
    trainer.train()

What the override takes from TRL, per micro-batch (``inputs`` of TRL's ``_compute_loss``):

| softtrust argument  | TRL                                                       |
| ------------------- | --------------------------------------------------------- |
| ``logprobs``        | ``_get_per_token_logps_and_entropies`` (TRL's arguments)  |
| ``old_logprobs``    | ``old_per_token_logps`` (absent on-policy: ``logprobs.detach()``) |
| ``advantages``      | ``advantages``, [B] (or [B, T] from a subclass)            |
| ``mask``            | ``completion_mask × tool_mask``                           |
| ``rollout_logprobs``| ``sampling_per_token_logps`` (vLLM), for TIS/MIS/OPSM     |
| ``ref_logprobs``    | ``ref_per_token_logps`` (computed by TRL when ``beta != 0``) |
| ``num_tokens`` / ``num_sequences`` | ``num_items_in_batch``, GA, ``steps_per_generation`` (:func:`micro_batch_normalisers`) |

The KL term lives in the PolicyLoss; TRL computes reference log-probs only when
``beta != 0``, so the PolicyLoss's ``kl.coef`` must equal ``args.beta`` (no KL when
``beta == 0``): a mismatch is refused, not silently mapped. TRL's entropy settings run as
TRL runs them (:func:`~softtrust.integrations.trl_config.trl_entropy_terms`):
``top_entropy_quantile`` is the PolicyLoss's ``entropy_quantile`` with TRL's threshold (this
call's active entropies, gathered over processes), and ``entropy_coef`` TRL's bonus (the
token mean of H over the kept tokens, divided by the accumulation steps). Settings whose
effect the override would drop (adaptive entropy control, an ``off_policy_mask_threshold``
or a vLLM importance correction the PolicyLoss does not carry) are refused in ``__init__``
with a ``ValueError`` naming the field (:func:`check_supported`).
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Any

import torch

try:
    import trl
    from accelerate.utils import gather_object
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'softtrust.integrations.trl needs TRL and accelerate; install them with `pip install -e ".[trl]"` '
        "in the softtrust clone"
    ) from error

from softtrust._metrics import reduction_of
from softtrust.integrations.trl_config import from_trl_config, trl_entropy_terms, trl_normalisers
from softtrust.loss import LossOutput, PolicyLoss

SUPPORTED_TRL_VERSIONS = ("1.16.0",)

__all__ = [
    "SUPPORTED_TRL_VERSIONS",
    "SoftTrustGRPOTrainer",
    "check_supported",
    "check_trl_version",
    "from_trl_config",
    "micro_batch_normalisers",
    "reduce_over_ranks",
]


def check_trl_version(version: str) -> None:
    """Raise ``ImportError`` unless ``version`` is a TRL version this integration is tested against.

    The override mirrors TRL's private ``_compute_loss`` contract (its input keys, its
    normalisers, ``_get_per_token_logps_and_entropies``), which changes between releases.
    """
    if version not in SUPPORTED_TRL_VERSIONS:
        raise ImportError(
            f"softtrust.integrations.trl supports TRL {', '.join(SUPPORTED_TRL_VERSIONS)}, but TRL {version} is "
            f'installed; install a supported one with `pip install -e ".[trl]"` in the softtrust clone '
            f"(trl=={SUPPORTED_TRL_VERSIONS[-1]})"
        )


check_trl_version(trl.__version__)

# Which TRL loss_type normalises each aggregation as TRL does (see trl_config.trl_normalisers).
_TRL_NORMALISER = {
    "token-mean": "dapo",  # the global token count of the accumulation window (bnpo: see below)
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "dr_grpo",
}

# Extra model inputs TRL's `_compute_loss` forwards to `_get_per_token_logps_and_entropies` (multimodal).
_FORWARD_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def micro_batch_normalisers(
    config: Any,
    aggregation: str,
    mask: torch.Tensor,
    num_items_in_batch: float | torch.Tensor | None,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
    train: bool = True,
) -> dict[str, Any]:
    """``num_tokens`` / ``num_sequences`` for one micro-batch, scaled as TRL scales its losses.

    The micro-batch losses of an accumulation window (and of all ranks) then add up to
    the window's loss. By aggregation:

    | aggregation                 | normaliser (TRL's loss_type)                               |
    | --------------------------- | ---------------------------------------------------------- |
    | ``token-mean``              | ``num_items_in_batch / P · GA / spg`` (dapo: global count); ``Σm_local · GA`` when ``config.loss_type == "bnpo"`` |
    | ``seq-mean-token-mean``     | ``B_local · GA`` (grpo)                                    |
    | ``seq-mean-token-sum``      | ``B_local · GA`` (luspo)                                   |
    | ``seq-mean-token-sum-norm`` | ``B_local · GA`` (dr_grpo; ``T_max`` is the PolicyLoss's)  |
    | ``token-sum``               | none: the micro-batch sums add up to the window's sum      |

    Args:
        config: the ``GRPOConfig`` (reads ``loss_type`` and ``steps_per_generation``).
        aggregation: the PolicyLoss's aggregation (it decides, not ``config.loss_type``).
        mask: [B, T] the micro-batch's loss mask.
        num_items_in_batch: TRL's loss-token count of the generation batch over all ranks.
        gradient_accumulation_steps: TRL's ``current_gradient_accumulation_steps``.
        num_processes: P.
        train: False in evaluation (no accumulation, no split).
    """
    if aggregation == "token-sum":
        return {}
    bnpo = aggregation == "token-mean" and getattr(config, "loss_type", None) == "bnpo"
    proxy = SimpleNamespace(
        loss_type="bnpo" if bnpo else _TRL_NORMALISER[aggregation],
        steps_per_generation=getattr(config, "steps_per_generation", None),
    )
    return trl_normalisers(proxy, mask, num_items_in_batch, gradient_accumulation_steps, num_processes, train)


def check_supported(config: Any, policy_loss: PolicyLoss) -> None:
    """Refuse, before training, a ``GRPOConfig`` setting the override would silently drop.

    Raises:
        ValueError: naming the field, for: a ``top_entropy_quantile`` other than the
            PolicyLoss's ``entropy_quantile``; a PolicyLoss ``entropy_coef`` (TRL's bonus is
            ``GRPOConfig.entropy_coef``); adaptive entropy control (``use_adaptive_entropy``); a KL that
            disagrees with ``beta``; an ``off_policy_mask_threshold`` without the same
            ``OPSM`` in the PolicyLoss; a vLLM importance correction
            (``use_vllm`` and ``vllm_importance_sampling_correction``) without a TIS/MIS in
            the PolicyLoss, or a TIS/MIS without ``use_vllm`` (only vLLM records the
            sampler's log-probs); ``seq-mean-token-sum-norm`` without ``max_completion_length``.
    """
    if not isinstance(policy_loss, PolicyLoss):
        raise ValueError(f"policy_loss must be a softtrust.PolicyLoss, got {type(policy_loss).__name__}")
    if config.top_entropy_quantile != policy_loss.entropy_quantile:
        raise ValueError(
            f"top_entropy_quantile={config.top_entropy_quantile!r} disagrees with the PolicyLoss's "
            f"entropy_quantile={policy_loss.entropy_quantile!r}; give both the same value"
        )
    if policy_loss.entropy_coef != 0.0:
        raise ValueError(
            f"the PolicyLoss's entropy_coef={policy_loss.entropy_coef!r}: inside TRL the bonus is "
            "GRPOConfig.entropy_coef, applied as TRL applies it; set it there and entropy_coef=0.0 in the PolicyLoss"
        )
    if config.use_adaptive_entropy:
        raise ValueError(
            "use_adaptive_entropy=True (Skywork-OR1's adaptive entropy control) is not supported by "
            "SoftTrustGRPOTrainer; set use_adaptive_entropy=False (a fixed entropy_coef is supported)"
        )
    kl, beta = policy_loss.kl, config.beta
    if (kl is None and beta != 0.0) or (kl is not None and kl.coef != beta):
        raise ValueError(
            f"beta={beta!r} disagrees with the PolicyLoss's kl={kl!r}: TRL computes the reference log-probs only "
            "when beta != 0, and the KL term is the PolicyLoss's; set beta to kl.coef (beta=0.0 for no KL)"
        )
    threshold = config.off_policy_mask_threshold
    opsm_delta = policy_loss.opsm.delta if policy_loss.opsm is not None else None
    if threshold is not None and opsm_delta != threshold:
        raise ValueError(
            f"off_policy_mask_threshold={threshold!r} but the PolicyLoss has "
            f"{'no OPSM' if opsm_delta is None else f'OPSM(delta={opsm_delta!r})'}; add "
            f"correction=st.OPSM(delta={threshold!r}) to the PolicyLoss or set off_policy_mask_threshold=None"
        )
    vllm_correction = config.use_vllm and config.vllm_importance_sampling_correction
    if vllm_correction and policy_loss.is_correction is None:
        raise ValueError(
            "use_vllm=True with vllm_importance_sampling_correction=True, but the PolicyLoss has no TIS/MIS "
            "correction, so TRL's correction would be dropped; add one (e.g. correction=st.TIS(cap="
            f"{config.vllm_importance_sampling_clip_max!r})) or set vllm_importance_sampling_correction=False"
        )
    if policy_loss.is_correction is not None and not config.use_vllm:
        raise ValueError(
            f"the PolicyLoss's correction {policy_loss.is_correction!r} needs the sampler's log-probs, which TRL "
            "records only with use_vllm=True; set use_vllm=True or drop the correction"
        )
    if policy_loss.aggregation == "seq-mean-token-sum-norm" and policy_loss.max_completion_length is None:
        raise ValueError(
            "aggregation='seq-mean-token-sum-norm' needs PolicyLoss(max_completion_length=...) (TRL's dr_grpo "
            f"divides by max_completion_length={config.max_completion_length!r}), got None"
        )


class SoftTrustGRPOTrainer(trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose loss is a softtrust :class:`~softtrust.PolicyLoss`.

    Only ``_compute_loss`` is overridden; everything else is TRL's.

    Args:
        *args, **kwargs: as for ``trl.GRPOTrainer`` (``model``, ``reward_funcs``, ``args``, ...).
        policy_loss: the loss; default :func:`from_trl_config` of the ``GRPOConfig``, which
            reproduces TRL's own ``loss_type`` (tests check parity of losses and parameters).

    Raises:
        ValueError: from :func:`check_supported` (and :func:`from_trl_config` for the
            default), before TRL loads a reference model or starts vLLM when ``args`` is given.

    Logged metrics: ``softtrust/<name>`` for every PolicyLoss metric (means over ranks; min
    and max over ranks for ``*/min`` and ``*/max``) and TRL's ``entropy``. They replace
    TRL's loss-specific ``clip_ratio/*``, ``kl``, ``cispo_clip_ratio`` and ``vespo/*``.
    """

    def __init__(self, *args: Any, policy_loss: PolicyLoss | None = None, **kwargs: Any) -> None:
        config = inspect.signature(trl.GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments.get("args")
        if config is not None:  # fail fast, before TRL builds models or starts vLLM
            policy_loss = from_trl_config(config) if policy_loss is None else policy_loss
            check_supported(config, policy_loss)
        super().__init__(*args, **kwargs)
        if config is None:  # TRL built a default GRPOConfig
            policy_loss = from_trl_config(self.args) if policy_loss is None else policy_loss
            check_supported(self.args, policy_loss)
        self.policy_loss = policy_loss

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's per-token log-probs and batch -> ``self.policy_loss`` -> the micro-batch loss."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]  # [B, P], [B, T]
        completion_mask = inputs["completion_mask"]  # [B, T]
        mask = completion_mask  # [B, T]
        if "tool_mask" in inputs:  # multi-turn: tool output tokens are not trained on
            mask = completion_mask * inputs["tool_mask"]  # [B, T]
        logprobs, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),  # [B, P + T]
            torch.cat([inputs["prompt_mask"], completion_mask], dim=1),  # [B, P + T]
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{name: inputs.get(name) for name in _FORWARD_INPUTS},
        )  # [B, T], [B, T], scalar or None
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        state, bonus = trl_entropy_terms(
            self.args,
            self.policy_loss,
            entropies,
            mask,
            accumulation,
            self._gathered_entropies(entropies, mask),
        )
        out = self.policy_loss(
            logprobs,
            inputs.get("old_per_token_logps"),
            inputs["advantages"],
            mask,
            rollout_logprobs=self._rollout_logprobs(inputs, logprobs),
            ref_logprobs=inputs.get("ref_per_token_logps") if self.policy_loss.kl is not None else None,
            state=state,
            entropy=entropies if self.policy_loss.needs_entropy else None,
            **micro_batch_normalisers(
                self.args,
                self.policy_loss.aggregation,
                mask,
                inputs["num_items_in_batch"],
                accumulation,
                self.accelerator.num_processes,
                train=mode == "train",
            ),
        )
        loss = out.loss - bonus  # TRL's entropy bonus (0 without entropy_coef)
        if self.aux_loss_enabled:  # MoE load balancing, scaled for accumulation as TRL does
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            gathered_aux_loss = self.accelerator.gather_for_metrics(aux_loss)  # [ranks]
            self._metrics[mode]["aux_loss"].append(gathered_aux_loss.mean().item())
        self._log_softtrust_metrics(mode, out, entropies, mask)
        return loss

    def _gathered_entropies(self, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Every process's active entropies (1-D), for TRL's ``top_entropy_quantile`` threshold;
        None when it is 1 or in one process (the call's own are used)."""
        if not self.policy_loss.selects_by_entropy or self.accelerator.num_processes == 1:
            return None
        local = entropies.detach()[mask.bool()].float()  # [n_local]
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=math.nan)
        gathered = self.accelerator.gather(padded)  # [P · max n]
        return gathered[~torch.isnan(gathered)]

    def _rollout_logprobs(self, inputs: dict[str, Any], logprobs: torch.Tensor) -> torch.Tensor | None:
        """vLLM's log-probs when the PolicyLoss reads them (TIS/MIS need them; OPSM prefers them)."""
        if self.policy_loss.is_correction is None and self.policy_loss.opsm is None:
            return None
        sampling = inputs.get("sampling_per_token_logps")  # [B, T] or absent
        if sampling is None:
            if self.policy_loss.is_correction is not None:
                raise ValueError(
                    f"the PolicyLoss's correction {self.policy_loss.is_correction!r} needs the sampler's log-probs, "
                    "but TRL's batch has no 'sampling_per_token_logps' (TRL records them only with use_vllm=True)"
                )
            return None  # OPSM falls back to the old log-probs, as TRL's does
        old = inputs.get("old_per_token_logps")
        old = logprobs.detach() if old is None else old  # [B, T]
        # vLLM marks tokens it could not score with NaN; TRL gives them ratio 1 (no correction): so do we.
        return torch.where(torch.isnan(sampling), old, sampling)  # [B, T]

    def _log_softtrust_metrics(
        self, mode: str, out: LossOutput, entropies: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """PolicyLoss metrics under ``softtrust/`` (reduced over ranks) and TRL's masked-mean ``entropy``."""
        per_rank = [out.metric_values()]
        if self.accelerator.num_processes > 1:  # objects: key sets may differ between ranks
            per_rank = gather_object(per_rank)
        for name, value in reduce_over_ranks(per_rank).items():
            self._metrics[mode][f"softtrust/{name}"].append(value)
        mask = mask.to(entropies.dtype)  # [B, T]
        local = torch.stack([(entropies.detach() * mask).sum(), mask.sum()])  # [2]: Σ m·H, Σ m
        totals = self.accelerator.reduce(local, reduction="sum")  # [2]
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())


def reduce_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric name: min of ``*/min``, max of ``*/max``, mean of the rest.

    The rule per name is ``softtrust._metrics.reduction_of`` (the trainer's too). NaN (a rank
    with nothing to measure, e.g. no active sequence) is ignored; a name
    that is NaN or absent everywhere else gives NaN, which TRL's ``log`` skips.
    """
    values: dict[str, list[float]] = {}
    for metrics in per_rank:
        for name, value in metrics.items():
            present = values.setdefault(name, [])
            if not math.isnan(value):
                present.append(value)
    reduce = {"min": min, "max": max, "mean": lambda present: sum(present) / len(present)}
    return {
        name: reduce[reduction_of(name)](present) if present else math.nan for name, present in values.items()
    }
