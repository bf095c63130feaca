"""The learner: the model as trained (plain, DDP or FSDP2), one policy-gradient update, evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import softtrust as st

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
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
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
    logprobs = policy_logprobs(
        policy, input_ids, attention_mask, batch.completion_length, config.temperature
    )  # [b, T]
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = sequence_logprobs(
                reference, input_ids, attention_mask, batch.completion_length, config.temperature
            )
    normalisers = {}
    if world.distributed:  # the whole mini-batch's counts, so the per-rank losses sum to its loss
        normalisers = {"num_tokens": world.sum(mask.sum()), "num_sequences": world.sum(mask.shape[0])}
    out = loss_fn(
        logprobs,
        minibatch.old_logprobs.to(device),
        minibatch.advantages.to(device),
        mask,
        rollout_logprobs=None
        if minibatch.rollout_logprobs is None
        else minibatch.rollout_logprobs.to(device),
        ref_logprobs=ref_logprobs,
        **normalisers,
    )
    optimizer.zero_grad(set_to_none=True)
    metrics = {f"loss/{name}": value for name, value in out.metric_values().items()}
    metrics = world.reduce_metrics(metrics, weight=float(mask.sum()))
    metrics["loss"] = world.sum(out.loss.detach())
    metrics["kl_behaviour"] = behaviour_kl(logprobs.detach(), minibatch.old_logprobs.to(device), mask, world)
    grad_norm = math.nan
    if world.all_true(bool(torch.isfinite(out.loss))):  # every rank updates, or none does
        (out.loss * world.size).backward()  # DDP / FSDP2 average over ranks: P x mean = sum
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


def evaluate(learner: Learner, tokenizer, task, problems, config: TrainConfig) -> float:
    """Held-out greedy accuracy. DDP: each rank scores a strided share, counts are summed.
    FSDP2: every rank decodes every problem in lock-step (each forward gathers parameters)."""
    world, strict = learner.world, config.strict_reward
    if not world.distributed:
        return greedy_accuracy(learner.model, tokenizer, task, problems, config.max_new_tokens, strict=strict)
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
