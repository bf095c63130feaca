"""The learner: the model as trained (plain, DDP or FSDP2), one policy-gradient update, evaluation."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

import softtrust as st
from softtrust._metrics import reduction_of

from .config import TrainConfig
from .distributed import World, full_model_state, full_tensor, policy_logprobs
from .rollout import Evaluation, greedy_evaluation, sequence_logprobs
from .staleness import MiniBatch, row_pieces


@dataclass
class Learner:
    """The model as the learner holds it: the plain causal LM, the wrapped forward (DDP or
    FSDP2 under torchrun), the optimizer and scheduler, and this process's ``World``."""

    model: torch.nn.Module
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    world: World
    kept_names: list[str]
    pretrained_names: list[str]

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
    # fused, and the data-parallel tests hold ranks to one process's numbers at 1e-6)
    fused = not torch.distributed.is_initialized() and all(type(p.data) is torch.Tensor for p in parameters)
    optimizer = torch.optim.AdamW(
        parameters, lr=config.lr, weight_decay=config.weight_decay, **({"fused": True} if fused else {})
    )
    warmup = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def policy_update(
    policy,
    optimizer,
    scheduler,
    loss_fn,
    minibatch: MiniBatch,
    reference,
    config: TrainConfig,
    state,
    world: World | None = None,
) -> dict:
    """One optimizer step on ``minibatch`` (its rows, behaviour log-probs and advantages); a non-finite loss or
    gradient skips it (counted in ``state.nonfinite_skips`` / ``nonfinite_in_a_row``).

    Under ``torchrun`` the mini-batch is this rank's share; the loss uses the global
    normalisers (tokens and rows summed over ranks) and is multiplied by the world size,
    because DDP and FSDP2 average gradients over ranks: the update equals one process's.
    A method that selects over the batch gets ``state=`` from the whole mini-batch, every
    rank's rows (``global_batch_state``). With ``config.proximal`` (async mode) the loss gets
    the decoupled objective: ``old_logprobs`` = π_prox (``proximal_logprobs``) and
    ``rollout_logprobs`` = the behaviour log-probs μ (the loss's IS correction weighs π_prox/μ).
    """
    started = time.perf_counter()
    world = world or World()
    batch = minibatch.batch
    device = next(policy.parameters()).device
    input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    mask = batch.completion_mask.to(device)  # [b, T]
    advantages = minibatch.advantages.to(device)
    old_all = None if minibatch.old_logprobs is None else minibatch.old_logprobs.to(device)
    rollout_all = None if minibatch.rollout_logprobs is None else minibatch.rollout_logprobs.to(device)
    width, temperature = batch.completion_length, config.temperature
    truncation = (config.top_k, config.top_p)  # the learner scores the sampler's truncated policy
    if config.gradient_checkpointing:
        checkpoint_layers(policy)
    # --micro-batch-size: forward/backward in pieces of rows, gradients accumulated
    pieces = row_pieces(mask.shape[0], config.micro_batch_size)
    normalisers = {}
    if (
        world.distributed or len(pieces) > 1
    ):  # the whole mini-batch's counts: the pieces' losses sum to its loss
        normalisers = {"num_tokens": world.sum(mask.sum()), "num_sequences": world.sum(mask.shape[0])}
    # whole-mini-batch quantities before the first piece's loss: a method's batch-wide state
    # (every rank's rows) needs every row's current log-probs: with micro-batches, a no-grad pass
    current = None
    if has_batch_state(loss_fn) and len(pieces) > 1:
        with torch.no_grad():
            current = torch.cat(
                [
                    policy_logprobs(policy, input_ids[p], attention_mask[p], width, temperature, *truncation)
                    for p in pieces
                ]
            )
    batch_state, proximal_metrics = None, {}
    optimizer.zero_grad(set_to_none=True)
    total_loss, finite, detached, piece_metrics = 0.0, True, [], []
    for index, rows in enumerate(pieces):
        logprobs = policy_logprobs(
            policy, input_ids[rows], attention_mask[rows], width, temperature, *truncation
        )  # [b, T]
        ref_logprobs = None
        if reference is not None:
            with torch.no_grad():
                ref_logprobs = sequence_logprobs(
                    reference, input_ids[rows], attention_mask[rows], width, temperature
                )
        # on-policy (sync, N = 1) the behaviour log-probs are the learner's own: ratio = 1 exactly
        old = logprobs.detach() if old_all is None else old_all[rows]
        rollout = None if rollout_all is None else rollout_all[rows]
        if config.proximal != "none":  # the decoupled objective: old = π_prox, sampler = the behaviour μ
            behaviour = old  # one piece: the configuration refuses --proximal with --micro-batch-size
            old, alpha = proximal_logprobs(
                config.proximal, policy, batch, logprobs, behaviour, minibatch.lag, temperature
            )
            rollout, proximal_metrics = behaviour, {"proximal/alpha": alpha}
        if batch_state is None and has_batch_state(loss_fn):  # M2PO, KL-Cov, Clip-Cov, BAPO
            generator = torch.Generator().manual_seed(step_seed(config.seed, state.step))
            whole = logprobs.detach() if current is None else current
            batch_state = global_batch_state(
                loss_fn,
                whole,
                old if current is None else (whole if old_all is None else old_all),
                advantages,
                mask,
                rollout if current is None else rollout_all,
                world,
                generator,
            )
        out = loss_fn(
            logprobs,
            old,
            advantages[rows],
            mask[rows],
            rollout_logprobs=rollout,
            ref_logprobs=ref_logprobs,
            state=batch_state,
            **normalisers,
        )
        detached.append(logprobs.detach())
        piece_metrics.append((out.metric_values(), float(mask[rows].sum())))
        total_loss += out.loss.detach()
        finite = world.all_true(bool(torch.isfinite(out.loss)))  # every rank updates, or none does
        if not finite:
            break
        with no_gradient_sync(policy, last=index == len(pieces) - 1):
            (out.loss * world.size).backward()  # DDP / FSDP2 average over ranks: P x mean = sum
    logprobs = torch.cat(detached)
    old_logprobs = logprobs if old_all is None else old_all[: logprobs.shape[0]]
    metrics = {f"loss/{name}": value for name, value in combine_metrics(piece_metrics).items()}
    metrics = world.reduce_metrics(metrics, weight=float(mask.sum()))
    metrics["loss"] = world.sum(total_loss)
    metrics["kl_behaviour"] = behaviour_kl(logprobs, old_logprobs, mask[: logprobs.shape[0]], world)
    if config.mode == "sync":  # the train/inference mismatch: the sampler's numbers μ against the
        # trainer's for the same policy (async trains on the sampler's own numbers: nothing to compare)
        sampler = batch.rollout_logprobs[: logprobs.shape[0]].to(device)
        metrics["kl_mismatch"] = behaviour_kl(old_logprobs, sampler, mask[: logprobs.shape[0]], world)
    grad_norm = math.nan
    if finite:
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)))
        metrics["grad_norm"] = grad_norm
    if math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
        state.nonfinite_in_a_row = 0
        metrics["skipped"] = 0
    else:
        optimizer.zero_grad(set_to_none=True)
        state.nonfinite_skips += 1
        state.nonfinite_in_a_row += 1
        metrics["skipped"] = 1
    metrics["lr"] = scheduler.get_last_lr()[0]
    metrics["time/update"] = time.perf_counter() - started
    return {**metrics, **proximal_metrics}


def loglinear_alpha(behaviour_version: int, proximal_version: int, current_version: int) -> float:
    """AReaL's interpolation weight ``α = (v_prox − v_μ) / (v_θ − v_μ)`` (arXiv 2505.24298's
    decoupled objective, AReaL ``prox_logp_method="loglinear"``), so that
    ``log π_prox ≈ log μ + α·(log π_θ − log μ)`` without a forward of π_prox.

    ``v_θ`` is the version of the weights the learner's forward ran with, ``v_prox`` the
    version before this optimizer step, ``v_μ`` the behaviour (sampler) version;
    ``v_μ <= v_prox <= v_θ``. softtrust's trainer takes one optimizer step per batch and
    runs its forward with the weights before the step, so ``v_θ = v_prox`` and
    ``α = (v_prox − v_μ)/(v_prox − v_μ) = 1``: ``log π_prox = sg(log π_θ)``, exact. At
    ``v_μ = v_θ`` (lag 0, ``0/0``) all three policies are one, so every α gives the same
    value; α = 1 is returned (the limit of the lag > 0 case). AReaL instead labels the
    training policy ``v_θ = v_prox + 1`` (``current_version − 1`` is its proximal
    version), which gives ``α = lag/(lag + 1)`` and, when ``π_θ`` is in fact still ``π_prox``,
    an error ``(log π_prox − log μ)/(lag + 1)`` per token.

    Raises:
        ValueError: versions not integers >= 0 in the order ``v_μ <= v_prox <= v_θ``.
    """
    versions = {"behaviour_version": behaviour_version, "proximal_version": proximal_version}
    versions["current_version"] = current_version
    for name, value in versions.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not behaviour_version <= proximal_version <= current_version:
        raise ValueError(
            f"versions must satisfy behaviour <= proximal <= current, got {behaviour_version}, "
            f"{proximal_version}, {current_version}"
        )
    if current_version == behaviour_version:
        return 1.0
    return (proximal_version - behaviour_version) / (current_version - behaviour_version)


def proximal_logprobs(
    mode: str,
    policy,
    batch,
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    lag: int,
    temperature: float,
) -> tuple[torch.Tensor, float]:
    """``([b, T] log π_prox, α)`` for the decoupled objective (AReaL, arXiv 2505.24298).

    ``recompute``: a no-grad forward of the current policy (the weights before this update),
    α reported as 1. ``loglinear``: ``μ + α·(sg(log π_θ) − μ)`` with α from
    :func:`loglinear_alpha` (v_μ = step − lag, v_prox = v_θ = step), no forward; with one
    optimizer step per batch α = 1 and the value equals ``recompute``'s (same forward, same
    numbers). ``logprobs``: the learner's ``[b, T]`` forward (differentiable); ``behaviour``:
    μ, ``[b, T]``.
    """
    if mode == "recompute":
        device = logprobs.device
        with torch.no_grad():
            prox = policy_logprobs(
                policy,
                batch.input_ids.to(device),
                batch.attention_mask.to(device),
                batch.completion_length,
                temperature,
            )
        return prox, 1.0
    step = batch.policy_version + lag
    alpha = loglinear_alpha(batch.policy_version, step, step)
    return behaviour + alpha * (logprobs.detach() - behaviour), alpha


def has_batch_state(loss_fn) -> bool:
    """True when the loss's method selects over the batch (``Method.batch_state`` overridden);
    False for a loss that is not a ``softtrust.PolicyLoss``."""
    method = getattr(loss_fn, "method", None)
    return isinstance(method, st.Method) and type(method).batch_state is not st.Method.batch_state


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s random draws in the loss (Clip-Cov's pick): a function of
    (run seed, step) only, so every rank, a resumed run and a rerun draw the same."""
    return (seed * 0x9E3779B1 + step) % 2**63


def global_batch_state(
    loss_fn,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    world: World | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """``loss_fn.batch_state`` over the whole optimizer mini-batch: every rank's rows.

    One process: this batch. Under ``torchrun``: every rank's ``[b, T_r]`` log-probs
    (detached), behaviour and sampler log-probs, advantages and mask are gathered in rank
    order (global row order), padded to the longest ``T`` with masked zeros, and every rank
    computes the state from the same global batch, so it is identical on all ranks and
    equal to one process's (up to the summation order of KL-Cov's/Clip-Cov's means). This
    is exact for any method, whatever its statistic (M2PO's cut needs every token's
    ``d²``; KL-Cov's and Clip-Cov's thresholds are order statistics of the global batch;
    BAPO's sums could be all-reduced, but one gather serves all). The gather moves
    ``4 b T`` numbers per rank, small next to the gradient all-reduce.

    Args:
        logprobs: ``[b, T]`` the current policy's log-probs, detached (π_prox for M2PO).
        old_logprobs, rollout_logprobs: ``[b, T]`` (rollout: or None).
        advantages: ``[b]``. mask: ``[b, T]`` 0/1.
        generator: for methods that draw (Clip-Cov); the same seed on every rank.

    Returns:
        The state (0-dim tensors) on ``logprobs``' device, for ``loss_fn(..., state=)``.
    """
    world = world or World()
    if not world.distributed:
        return loss_fn.batch_state(
            logprobs, old_logprobs, advantages, mask, rollout_logprobs, generator=generator
        )
    device = logprobs.device
    local = (logprobs, old_logprobs, rollout_logprobs, mask.to(logprobs.dtype), advantages)
    shares = world.gather_objects(tuple(None if x is None else x.detach().cpu() for x in local))
    width = max(share[0].shape[1] for share in shares)

    def stacked(position: int) -> torch.Tensor | None:
        if shares[0][position] is None:
            return None
        pad = (
            (lambda x: x)
            if position == 4
            else (lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1])))
        )
        return torch.cat([pad(share[position]) for share in shares]).to(device)

    every = [stacked(position) for position in range(5)]
    state = loss_fn.batch_state(every[0], every[1], every[4], every[3], every[2], generator=generator)
    return {name: value.to(device) for name, value in state.items()}


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
            config.max_new_tokens,
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
            config.max_new_tokens,
            all_finished=world.all_true,
            strict=strict,
        )
    share = problems[world.rank :: world.size]
    mine = greedy_evaluation(learner.model, tokenizer, task, share, config.max_new_tokens, strict=strict)
    return Evaluation(
        world.sum(round(mine.accuracy * len(share))) / len(problems),
        world.sum(mine.score * len(share)) / len(problems),
    )
