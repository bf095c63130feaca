"""The learner: the model as trained (plain, DDP or FSDP2), one policy-gradient update, evaluation."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

import softtrust as st
from softtrust._metrics import reduction_of

from .config import TrainConfig
from .distributed import World, full_model_state, full_tensor, policy_logprobs
from .rollout import greedy_accuracy, sequence_logprobs
from .staleness import MiniBatch


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
    """
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
    size = config.micro_batch_size or mask.shape[0]
    pieces = [slice(start, start + size) for start in range(0, mask.shape[0], size)] or [slice(0, 0)]
    normalisers = {}
    if (
        world.distributed or len(pieces) > 1
    ):  # the whole mini-batch's counts: the pieces' losses sum to its loss
        normalisers = {"num_tokens": world.sum(mask.sum()), "num_sequences": world.sum(mask.shape[0])}
    loss_state = {}
    if len(pieces) > 1 and getattr(loss_fn, "_has_batch_state", False):
        with torch.no_grad():  # the method's batch-wide quantities over the whole mini-batch
            current = torch.cat(
                [
                    policy_logprobs(policy, input_ids[p], attention_mask[p], width, temperature, *truncation)
                    for p in pieces
                ]
            )
            loss_state = {
                "state": loss_fn.batch_state(
                    current,
                    current if old_all is None else old_all,
                    advantages,
                    mask,
                    rollout_all,
                    **normalisers,
                )
            }
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
        out = loss_fn(
            logprobs,
            old,
            advantages[rows],
            mask[rows],
            rollout_logprobs=None if rollout_all is None else rollout_all[rows],
            ref_logprobs=ref_logprobs,
            **normalisers,
            **loss_state,
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
    return metrics


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
) -> float:
    """Held-out greedy accuracy. DDP: each rank scores a strided share, counts are summed.
    FSDP2: every rank decodes every problem in lock-step (each forward gathers parameters).
    ``samples`` receives the first ``config.num_samples`` problems' completions (one process only)."""
    world, strict = learner.world, config.strict_reward
    if not world.distributed:
        return greedy_accuracy(
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
        return greedy_accuracy(
            learner.policy,
            tokenizer,
            task,
            problems,
            config.max_new_tokens,
            all_finished=world.all_true,
            strict=strict,
        )
    share = problems[world.rank :: world.size]
    correct = greedy_accuracy(learner.model, tokenizer, task, share, config.max_new_tokens, strict=strict)
    return world.sum(round(correct * len(share))) / len(problems)
