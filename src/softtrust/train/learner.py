"""The learner: the model as trained (plain, DDP or FSDP2), one policy-gradient update, evaluation.

``Learner.update(minibatch)`` reads like the algorithm::

    log-probs -> (pi_prox, reference) -> loss per micro-batch -> backward -> guard -> step

with named helpers for the loss inputs (``loss_inputs``), a batch-wide method's state
(``batch_state``), the metrics (``update_metrics``) and the optimizer step
(``optimizer_step``). Every log-prob goes through ``scoring.completion_logprobs_of``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

import softtrust as st
from softtrust._metrics import reduction_of
from softtrust.kl import AdaptiveKLController
from softtrust.loss import PolicyLoss

from .config import TrainConfig
from .distributed import World, full_model_state, full_tensor
from .proximal import batch_versions, loglinear_alpha
from .rollout import Evaluation, greedy_evaluation
from .scoring import LogProbs, Scoring, completion_logprobs_of, row_pieces
from .staleness import MiniBatch


class UpdateBatch(NamedTuple):
    """A mini-batch as the update reads it, on the learner's device (this rank's rows)."""

    input_ids: torch.Tensor  # [b, L] prompt + completion
    attention_mask: torch.Tensor  # [b, L]
    mask: torch.Tensor  # [b, T] the completion tokens
    advantages: torch.Tensor  # [b]
    old_logprobs: torch.Tensor | None  # [b, T] behaviour log-probs; None on-policy (sync N = 1)
    rollout_logprobs: torch.Tensor | None  # [b, T] the sampler's, kept for a correction
    sampler_logprobs: torch.Tensor  # [b, T] the sampler's, always recorded (on the CPU: kl_mismatch)
    completion_length: int  # T
    policy_version: int  # the version of the weights that sampled the rows
    lag: int  # the learner's step minus policy_version
    minibatch_index: int  # the update's position in its rollout (fetched batch)
    proximal_logprobs: torch.Tensor | None  # [b, T] pi_prox taken when the batch was fetched

    @classmethod
    def of(cls, minibatch: MiniBatch, device: torch.device) -> UpdateBatch:
        batch = minibatch.batch

        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        return cls(
            batch.input_ids.to(device),
            batch.attention_mask.to(device),
            batch.completion_mask.to(device),
            minibatch.advantages.to(device),
            moved(minibatch.old_logprobs),
            moved(minibatch.rollout_logprobs),
            batch.rollout_logprobs,
            batch.completion_length,
            batch.policy_version,
            minibatch.lag,
            minibatch.minibatch_index,
            moved(minibatch.proximal_logprobs),
        )


class LossInputs(NamedTuple):
    """What the loss takes for one micro-batch besides the current log-probs."""

    old_logprobs: torch.Tensor  # [b, T] pi_old: the behaviour mu, or pi_prox (decoupled objective)
    rollout_logprobs: torch.Tensor | None  # [b, T] the correction's denominator (the sampler's mu)
    ref_logprobs: torch.Tensor | None  # [b, T] the KL reference's


class BatchTensors(NamedTuple):
    """The whole mini-batch (every rank's rows) a batch-wide method's state is computed from:
    ``[b, T]`` tensors except ``advantages`` ``[b]``; ``mask`` as the loss's dtype."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None
    entropy: torch.Tensor | None = None  # the policy's, for --entropy-quantile's threshold


@dataclass
class Learner:
    """The model as the learner holds it and the update it takes: the plain causal LM, the wrapped
    forward (DDP or FSDP2 under torchrun), the optimizer and scheduler, the loss, the KL
    reference (or None), the adaptive KL controller of ``--kl-target`` (or None) and this
    process's ``World``."""

    model: torch.nn.Module
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    world: World
    kept_names: list[str]
    pretrained_names: list[str]
    loss_fn: PolicyLoss
    config: TrainConfig
    reference: torch.nn.Module | None = None
    kl_controller: AdaptiveKLController | None = None
    proximal_model: torch.nn.Module | None = None  # --proximal held: the pi_prox snapshot
    proximal_step: int = -1  # the step whose weights the snapshot holds (-1: none yet)

    def update(self, minibatch: MiniBatch) -> dict:
        """One optimizer step on ``minibatch``; returns its metrics (``skipped`` = 1 when a
        non-finite loss or gradient skipped it).

        Under ``torchrun`` the mini-batch is this rank's share; the loss uses the global
        normalisers (tokens and rows summed over ranks) and is multiplied by the world size,
        because DDP and FSDP2 average gradients over ranks: the update equals one process's.
        """
        started = time.perf_counter()
        batch = UpdateBatch.of(minibatch, next(self.policy.parameters()).device)
        if self.config.proximal == "held":
            self.hold_proximal(batch.policy_version + batch.lag)
        pieces = row_pieces(batch.mask.shape[0], self.config.micro_batch_size)
        normalisers = self.normalisers(batch, len(pieces))
        if self.config.gradient_checkpointing:
            checkpoint_layers(self.policy)
        self.optimizer.zero_grad(set_to_none=True)
        state, results, finite = None, [], True
        for index, rows in enumerate(pieces):
            scored = self.logprobs(self.policy, batch, rows, with_entropy=self.scores_entropy)
            logprobs = scored.logprobs  # [b, T], differentiable (and scored.entropy [b, T] or None)
            inputs = self.loss_inputs(batch, rows, logprobs)  # pi_old (or pi_prox), mu, reference
            if index == 0:
                state = self.batch_state(batch, pieces, scored, inputs)
            out = self.loss_fn(
                logprobs,
                inputs.old_logprobs,
                batch.advantages[rows],
                batch.mask[rows],
                rollout_logprobs=inputs.rollout_logprobs,
                ref_logprobs=inputs.ref_logprobs,
                state=state,
                kl_coef=None if self.kl_controller is None else self.kl_controller.coef,
                entropy=scored.entropy,
                **normalisers,
            )
            results.append((logprobs.detach(), out, float(batch.mask[rows].sum())))
            finite = self.world.all_true(bool(torch.isfinite(out.loss)))  # every rank updates, or none
            if not finite:
                break
            with no_gradient_sync(self.policy, last=index == len(pieces) - 1):
                (out.loss * self.world.size).backward()  # DDP / FSDP2 average over ranks: P x mean = sum
        metrics = self.update_metrics(batch, results)
        metrics.update(self.optimizer_step(finite))
        metrics.update(self.adapt_kl(metrics, batch))
        metrics["time/update"] = time.perf_counter() - started
        return metrics

    # ------------------------------------------------------------------ the update's pieces
    @property
    def scoring(self) -> Scoring:
        """The sampler's (truncated) policy, which the learner scores."""
        return Scoring(self.config.temperature, self.config.top_k, self.config.top_p)

    @property
    def scores_entropy(self) -> bool:
        """Whether the learner's forward also returns the policy's per-token entropy (then logged
        as ``loss/entropy/*``): when the loss needs it (``--entropy-coef``, ``--entropy-quantile``)
        or ``--log-entropy`` (the default). Tiles of the same forward: no [b, T, V] logits, and
        on the CPU the same log-probs and gradients bit for bit (tested)."""
        return self.loss_fn.needs_entropy or self.config.log_entropy

    def logprobs(
        self,
        model: torch.nn.Module,
        batch: UpdateBatch,
        rows: slice,
        scoring: Scoring | None = None,
        with_entropy: bool = False,
    ) -> LogProbs:
        """``[b, T]`` completion log-probs of ``batch``'s ``rows`` under ``model`` (the policy, a
        proximal snapshot or the reference), scored as the sampler's policy unless ``scoring``,
        and their ``[b, T]`` entropies ``with_entropy``."""
        width = batch.completion_length
        return completion_logprobs_of(
            model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            width,
            scoring or self.scoring,
            with_entropy=with_entropy,
        )

    def normalisers(self, batch: UpdateBatch, pieces: int) -> dict:
        """The whole mini-batch's token and row counts (every rank's), so that the pieces' losses
        sum to its loss; empty for one piece in one process (the loss counts them itself)."""
        if not (self.world.distributed or pieces > 1):
            return {}
        tokens = self.world.sum(batch.mask.sum())
        return {
            # no active token anywhere (--mask-truncated cut every row): every piece's loss is 0 over
            # any normaliser, and the loss refuses a count of 0
            "num_tokens": tokens if tokens > 0 else 1.0,
            "num_sequences": self.world.sum(batch.mask.shape[0]),
        }

    def loss_inputs(self, batch: UpdateBatch, rows: slice, logprobs: torch.Tensor) -> LossInputs:
        """pi_old, the sampler's log-probs and the reference's for ``rows``.

        On-policy (sync, N = 1) the behaviour log-probs are the learner's own: ratio = 1 exactly.
        With ``--proximal`` (the decoupled objective, AReaL): pi_old = pi_prox
        (``proximal_logprobs``) and the sampler's log-probs are the behaviour mu, so the loss's
        IS correction weighs pi_prox/mu. The reference is scored untruncated (a truncated
        reference would put -inf on tokens outside its own support)."""
        old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs[rows]
        rollout = None if batch.rollout_logprobs is None else batch.rollout_logprobs[rows]
        if self.config.proximal != "none":  # one piece: the config refuses --proximal with micro-batches
            old, rollout = self.proximal_logprobs(batch, logprobs, old), old
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = self.logprobs(
                    self.reference, batch, rows, Scoring(self.config.temperature)
                ).logprobs
        return LossInputs(old, rollout, reference)

    def proximal_logprobs(
        self, batch: UpdateBatch, logprobs: torch.Tensor, behaviour: torch.Tensor
    ) -> torch.Tensor:
        """``[b, T]`` log pi_prox for the decoupled objective (AReaL, arXiv 2505.24298).

        ``recompute``: the no-grad forward of the weights before the fetched batch's first
        update, taken when it was fetched (``staleness.AsyncBatches.fetched``) and held over its
        updates, scored like the policy. ``held``: the same forward of the snapshot
        ``hold_proximal`` keeps. ``loglinear``: ``mu + alpha (sg(log pi_theta) - mu)`` with
        alpha from :func:`proximal.loglinear_alpha` (``proximal_alpha``), no forward: on a
        batch's first update alpha = 1 and the value equals ``recompute``'s."""
        if self.config.proximal == "recompute":
            if batch.proximal_logprobs is None:  # never silently on-policy
                raise RuntimeError("--proximal recompute: the mini-batch carries no pi_prox from its fetch")
            return batch.proximal_logprobs
        if self.config.proximal == "held":
            with torch.no_grad():
                return self.logprobs(self.proximal_model, batch, slice(None)).logprobs
        return behaviour + proximal_alpha(batch) * (logprobs.detach() - behaviour)

    def hold_proximal(self, step: int) -> None:
        """``--proximal held``: the snapshot pi_prox holds the weights of step ``M floor(step / M)``
        (M = ``proximal_every``): refreshed from the policy at every multiple of M, kept in between
        and across a resume (``state`` / ``load_state``)."""
        anchor = step - step % self.config.proximal_every
        if self.proximal_model is None:
            self.proximal_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.proximal_step != anchor:
            self.proximal_model.load_state_dict(self.model.state_dict())
            self.proximal_step = anchor

    def state(self) -> dict:
        """What a checkpoint keeps of the learner besides weights and optimizer: the held pi_prox
        snapshot and its step (empty without ``--proximal held``)."""
        if self.proximal_model is None:
            return {}
        return {"proximal_step": self.proximal_step, "proximal": dict(self.proximal_model.state_dict())}

    def load_state(self, state: dict) -> None:
        if "proximal" in state:
            self.proximal_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.proximal_model.load_state_dict(state["proximal"])
            self.proximal_step = int(state["proximal_step"])

    def batch_state(
        self, batch: UpdateBatch, pieces: list[slice], scored: LogProbs, inputs: LossInputs
    ) -> dict | None:
        """The loss's batch-wide state from the whole mini-batch, every rank's rows
        (``global_batch_state``): a selecting method's (M2PO, KL-Cov, Clip-Cov, BAPO), a
        self-normalised IS correction's mean and the ``--entropy-quantile`` threshold; None when
        the loss needs none. One piece: its own log-probs (``scored``) and loss inputs; several:
        every row's current log-probs (and entropies) from a no-grad pass, skipped when only a
        correction needs state and the behaviour log-probs are recorded (its mean reads those
        and the sampler's only)."""
        if not self.loss_fn.uses_batch_state:
            return None
        old, rollout = inputs.old_logprobs, inputs.rollout_logprobs
        logprobs, entropy = scored
        if len(pieces) > 1:
            by_entropy = self.loss_fn.selects_by_entropy
            if self.loss_fn.selects_over_batch or by_entropy or batch.old_logprobs is None:
                with torch.no_grad():
                    every = [
                        self.logprobs(self.policy, batch, rows, with_entropy=by_entropy) for rows in pieces
                    ]
                logprobs = torch.cat([piece.logprobs for piece in every])
                entropy = torch.cat([piece.entropy for piece in every]) if by_entropy else None
            else:  # a stand-in the correction never reads
                logprobs = batch.old_logprobs
            old = logprobs if batch.old_logprobs is None else batch.old_logprobs
            rollout = batch.rollout_logprobs
        entropy = None if entropy is None else entropy.detach()
        tensors = BatchTensors(logprobs.detach(), old, batch.advantages, batch.mask, rollout, entropy)
        step = batch.policy_version + batch.lag  # the learner's step
        generator = torch.Generator().manual_seed(step_seed(self.config.seed, step))
        return global_batch_state(self.loss_fn, tensors, self.world, generator)

    def update_metrics(self, batch: UpdateBatch, results: list) -> dict:
        """The loss metrics of the whole mini-batch (micro-batches combined, ranks reduced), the loss,
        the KL of the behaviour policy to the current one and, when the learner recomputes pi_old,
        the train/inference mismatch (the sampler's numbers against the trainer's for the same policy)."""
        world = self.world
        pieces = [(out.metric_values(), tokens) for _, out, tokens in results]
        metrics = {f"loss/{name}": value for name, value in combine_metrics(pieces).items()}
        metrics = world.reduce_metrics(metrics, weight=float(batch.mask.sum()))
        metrics["loss"] = world.sum(sum(out.loss.detach() for _, out, _ in results))
        logprobs = torch.cat([detached for detached, _, _ in results])
        rows = logprobs.shape[0]
        old = logprobs if batch.old_logprobs is None else batch.old_logprobs[:rows]
        metrics["kl_behaviour"] = behaviour_kl(logprobs, old, batch.mask[:rows], world)
        # pi_old taken from the sampler (async, --old-logprobs sampler): nothing to compare, so
        # kl_mismatch is absent (it would read 0, which says nothing about the mismatch)
        if self.config.effective_old_logprobs == "recompute":
            sampler = batch.sampler_logprobs[:rows].to(old.device)
            metrics["kl_mismatch"] = behaviour_kl(old, sampler, batch.mask[:rows], world)
        if self.config.proximal != "none":  # alpha; age: the updates since pi_prox's weights
            _, first, step = batch_versions(batch.policy_version, batch.lag, batch.minibatch_index)
            metrics["proximal/alpha"] = proximal_alpha(batch)
            metrics["proximal/age"] = step - (self.proximal_step if self.config.proximal == "held" else first)
        return metrics

    def adapt_kl(self, metrics: dict, batch: UpdateBatch) -> dict:
        """``kl_coef``, the β this step used; with ``--kl-target`` the controller then moves β for the
        next step from the step's measured KL, ``loss/kl`` (the mini-batch's token mean of the
        ``--kl-estimator`` estimate, every rank's), and its rows, every rank's."""
        if self.loss_fn.kl is None:
            return {}
        if self.kl_controller is None:
            return {"kl_coef": self.loss_fn.kl.coef}
        used = self.kl_controller.coef
        measured = metrics.get("loss/kl", math.nan)
        self.kl_controller.update(measured, int(self.world.sum(batch.mask.shape[0])))
        return {"kl_coef": used}

    def optimizer_step(self, finite: bool) -> dict:
        """Clip the gradient and step, unless the loss or the gradient norm is not finite (then the
        gradient is dropped and ``skipped`` is 1)."""
        metrics, grad_norm = {}, math.nan
        if finite:
            max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
            grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)))
            metrics["grad_norm"] = grad_norm
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            metrics["skipped"] = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            metrics["skipped"] = 1
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def model_state(self, for_pretrained: bool = False) -> dict[str, torch.Tensor] | None:
        """The full weights to write under FSDP2 (rank 0; tied weights once, named as
        ``save_model`` writes them, or as ``save_pretrained`` with ``for_pretrained``); ``None``
        otherwise (the plain model is written directly). Every rank must call this."""
        if not self.world.fsdp:
            return None
        state = full_model_state(self.policy, self.world)
        if not self.world.is_main:
            return None
        names = self.pretrained_names if for_pretrained else self.kept_names
        return {name: state[name].contiguous() for name in names}


def build_optimizer(model, config: TrainConfig):
    """AdamW with a linear warm-up of ``warmup_steps`` (then constant)."""
    parameters = list(model.parameters())
    # one process: the fused kernel (one pass over each tensor), 5x faster than foreach on CPU
    # for a 135M model; under torchrun the default (its rounding differs slightly from
    # fused, and the data-parallel tests hold ranks to one process's numbers)
    fused = not torch.distributed.is_initialized() and all(type(p.data) is torch.Tensor for p in parameters)
    optimizer = torch.optim.AdamW(
        parameters, lr=config.lr, weight_decay=config.weight_decay, **({"fused": True} if fused else {})
    )
    warmup = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def global_batch_state(
    loss_fn: PolicyLoss,
    tensors: BatchTensors,
    world: World | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """``loss_fn.batch_state`` over the whole optimizer mini-batch: every rank's rows.

    One process: ``tensors`` as they are. Under ``torchrun``: every rank's ``BatchTensors``
    (``[b, T_r]``, detached) are gathered in rank order (global row order), padded to the
    longest ``T`` with masked zeros, and every rank computes the state from the same global
    batch, so it is identical on all ranks and equal to one process's (up to the summation
    order of KL-Cov's/Clip-Cov's means). This is exact for any method, whatever its statistic
    (M2PO's cut needs every token's ``d²``; KL-Cov's and Clip-Cov's thresholds are order
    statistics of the global batch; BAPO's sums and a self-normalised IS correction's mean
    could be all-reduced, but one gather serves all). The gather moves ``4 b T`` numbers per rank, small next to the gradient all-reduce.

    Args:
        tensors: this rank's ``BatchTensors`` (``logprobs``: the current policy's, detached).
        generator: for methods that draw (Clip-Cov); the same seed on every rank.

    Returns:
        The state (0-dim tensors) on ``tensors.logprobs``' device, for ``loss_fn(..., state=)``.
    """
    world = world or World()
    device = tensors.logprobs.device
    if world.distributed:
        local = tensors._replace(mask=tensors.mask.to(tensors.logprobs.dtype))
        shares = world.gather_objects(BatchTensors(*(None if x is None else x.detach().cpu() for x in local)))
        width = max(share.logprobs.shape[1] for share in shares)

        def stacked(name: str) -> torch.Tensor | None:
            parts = [getattr(BatchTensors(*share), name) for share in shares]
            if parts[0] is None:
                return None
            if name != "advantages":  # [b, T_r] -> [b, T]: masked zeros on the right
                parts = [torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts]
            return torch.cat(parts).to(device)

        tensors = BatchTensors(*(stacked(name) for name in BatchTensors._fields))
    state = loss_fn.batch_state(
        tensors.logprobs,
        tensors.old_logprobs,
        tensors.advantages,
        tensors.mask,
        tensors.rollout_logprobs,
        generator=generator,
        entropy=tensors.entropy,
    )
    return {name: value.to(device) for name, value in state.items()}


def proximal_alpha(batch: UpdateBatch) -> float:
    """The decoupled objective's alpha for ``batch``: ``loglinear_alpha`` with v_mu = the rows'
    version, v_prox = the step of the fetched batch's first update, v_theta = the learner's step
    (1 on a batch's first update; ``recompute`` and ``held`` report the same number)."""
    return loglinear_alpha(*batch_versions(batch.policy_version, batch.lag, batch.minibatch_index))


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s random draws in the loss (Clip-Cov's pick): a function of
    (run seed, step) only, so every rank, a resumed run and a rerun draw the same."""
    return (seed * 0x9E3779B1 + step) % 2**63


def combine_metrics(pieces: list[tuple[dict, float]]) -> dict:
    """The loss metrics of a mini-batch from its micro-batches' ``(metrics, active tokens)``:
    ``.../max`` by max, ``.../min`` by min, the rest by the token-weighted mean."""
    if len(pieces) == 1:
        return pieces[0][0]
    combined = {}
    for name in pieces[0][0]:
        values = [(metrics[name], weight) for metrics, weight in pieces if name in metrics]
        how = reduction_of(name)
        if how in ("max", "min"):
            combined[name] = (max if how == "max" else min)(value for value, _ in values)
        else:
            total = sum(weight for _, weight in values)
            combined[name] = sum(v * w for v, w in values) / total if total else values[0][0]
    return combined


def checkpoint_layers(policy) -> None:
    """Let transformers' gradient checkpointing act in the learner's forward: it checkpoints a
    decoder layer only when that layer is in training mode, and the trainer keeps the model in
    eval mode (no dropout). Only the layers' own flag is set; their submodules stay in eval."""
    for module in policy.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(
            module, "_gradient_checkpointing_func"
        ):
            module.training = True


@contextlib.contextmanager
def no_gradient_sync(policy, last: bool):
    """DDP: synchronise gradients only in the last micro-batch's backward."""
    if last or not hasattr(policy, "no_sync"):
        yield
    else:
        with policy.no_sync():
            yield


def behaviour_kl(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, world: World | None = None
) -> float:
    """Token-mean k3 estimate of KL(behaviour || current) on the sampled tokens (all ranks')."""
    world = world or World()
    mask = mask.bool()
    # k3 with d = log(π/μ) on samples from μ: e^d - 1 - d, the library's estimator with the roles swapped
    k3 = torch.where(mask, st.kl_estimate(old_logprobs, logprobs, "k3"), 0)  # [b, T], >= 0
    if not world.distributed:
        return float(k3[mask].mean()) if mask.any() else 0.0
    tokens = world.sum(mask.sum())
    return world.sum(k3[mask].sum()) / tokens if tokens else 0.0


def evaluate(
    learner: Learner, tokenizer, task, problems, config: TrainConfig, samples: list | None = None
) -> Evaluation:
    """Held-out greedy accuracy and mean score (``rollout.Evaluation``). DDP: each rank scores a
    strided share, counts and score sums are summed. FSDP2: every rank decodes every problem in
    lock-step (each forward gathers parameters). ``samples`` receives the first
    ``config.num_samples`` problems' completions (one process only)."""
    world, strict = learner.world, config.strict_reward
    if not world.distributed:
        return greedy_evaluation(
            learner.model,
            tokenizer,
            task,
            problems,
            config.effective_max_new_tokens,
            strict=strict,
            samples=samples,
            num_samples=config.num_samples,
        )
    if world.fsdp:
        return greedy_evaluation(
            learner.policy,
            tokenizer,
            task,
            problems,
            config.effective_max_new_tokens,
            all_finished=world.all_true,
            strict=strict,
        )
    share = problems[world.rank :: world.size]
    mine = greedy_evaluation(
        learner.model, tokenizer, task, share, config.effective_max_new_tokens, strict=strict
    )
    return Evaluation(
        world.sum(round(mine.accuracy * len(share))) / len(problems),
        world.sum(mine.score * len(share)) / len(problems),
    )
