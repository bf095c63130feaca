"""The off-policy GRPO trainer: collect, compute advantages, update, log.

``train(config)`` reads top to bottom like the algorithm. The machinery lives in named
helpers: the staleness schedules in ``staleness.py``, generation and rewards in
``rollout.py``, atomic checkpoints in ``checkpoint.py``, the warm start in
``warmstart.py``, data parallelism (``torchrun``, DDP, FSDP2) in ``distributed.py``, and
the run directory (config, metrics, plots, summary) in ``RunLog``.

Under ``torchrun`` every rank runs this same loop on its share of each rollout; the
collectives hide in ``World`` (``distributed.py``) and only rank 0 writes the run directory.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

import softtrust as st

from .checkpoint import (
    atomic_write_text,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from .config import TrainConfig, build_method_loss, resolve_device
from .distributed import (
    World,
    close_world,
    full_model_state,
    full_optimizer_state,
    full_tensor,
    generation_model,
    init_world,
    load_full_model_state,
    load_full_optimizer_state,
    policy_logprobs,
    pretrained_names,
    save_kept_names,
    wrap_policy,
)
from .rollout import (
    ProblemSampler,
    RewardScorer,
    generate_rollout,
    greedy_accuracy,
    group_uniforms,
    sequence_logprobs,
)
from .staleness import AsyncRollouts, LaggedRollouts, MiniBatch, SyncRollouts
from .tasks import build_task, held_out_problems
from .tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from .warmstart import warm_start

EVAL_SEED = 1_234_567  # the held-out set does not depend on the training seed
VALIDATION_SEED, VALIDATION_SIZE = 7_654_321, 256  # --sft-target-accuracy's stopping set


class TrainingStopped(RuntimeError):
    """Training stopped early (too many non-finite updates); a checkpoint was saved."""


@dataclass
class Counters:
    """Running totals that a checkpoint carries."""

    nonfinite_skips: int = 0
    nonfinite_in_a_row: int = 0
    reward_failures: int = 0
    completion_tokens: int = 0
    accuracy_before: float = float("nan")


# ---------------------------------------------------------------------- the loop
def train(config: TrainConfig) -> dict:
    """Run RL as ``config`` describes; return the summary (also written to ``summary.json``).

    Launched by ``torchrun`` with several processes, this is data-parallel training
    (DDP, or FSDP2 with ``fsdp``); see ``docs/distributed.md``.
    """
    config = resolve_resume_config(config).validate()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    world = init_world(config.fsdp, resolve_device(config.device))
    try:
        summary = train_in_world(config, world)
    except BaseException:
        close_world(world, wait=False)  # a failing rank must not wait for the others
        raise
    close_world(world)
    return summary


def train_in_world(config: TrainConfig, world: World) -> dict:
    """``train`` once the process group (if any) is up: the loop itself."""
    started = time.time()
    world.check_divides(config.prompts_per_step)
    run = RunLog.open(config, world)
    tokenizer, model, task, eval_problems = load_policy_and_task(config, run, world)
    reference = copy.deepcopy(model).eval().to(world.device) if config.kl_coef > 0 else None
    # The file layouts (tied weights once), read before any sharding.
    kept_names, final_names = save_kept_names(model), pretrained_names(model)
    policy = wrap_policy(model, world)  # the learner's forward: plain, DDP or FSDP2
    sampler_model = generation_model(policy, model, world)  # what samples rollouts
    sampler = ProblemSampler(task, seed=config.seed, exclude=eval_problems)
    scorer = RewardScorer(task, strict=config.strict_reward)
    generator = torch.Generator().manual_seed(config.seed)  # kept for the checkpoint layout
    loss_fn = build_method_loss(config)
    optimizer, scheduler = build_optimizer(model, config)
    counters = Counters()
    rollouts = build_rollout_source(config, model, tokenizer, sampler, scorer, world)
    learner = Learner(model, policy, optimizer, scheduler, world, kept_names, final_names)
    step = 0
    if config.resume is not None:
        step = restore(config, learner, rollouts, counters, generator, sampler, run)
        run.truncate_after(step)  # metrics logged after the checkpoint will be logged again
    rollouts = start_worker_if_async(config, rollouts, model, step)

    if step == 0:
        counters.accuracy_before = evaluate(learner, tokenizer, task, eval_problems, config)
        run.log_event({"step": 0, "eval/accuracy": counters.accuracy_before})
        rollouts.publish(0, model)
    progress = run.progress_bar(config, initial=step)
    try:
        while step < config.max_steps:
            # 1. collect: a mini-batch from the staleness schedule (generates when needed)
            collect_start = time.time()
            minibatch = rollouts.next(step, sampler_model)
            counters.reward_failures = int(world.sum(scorer.failures))
            # 2-3. update: one optimizer step on the mini-batch (advantages came with it)
            update_metrics = policy_update(
                policy, optimizer, scheduler, loss_fn, minibatch, reference, config, counters, world
            )
            step += 1
            rollouts.publish(step, model)
            # 4. log, evaluate, checkpoint
            metrics = step_metrics(
                step, minibatch, update_metrics, counters, rollouts, time.time() - collect_start, world
            )
            if config.eval_every and step % config.eval_every == 0 and step < config.max_steps:
                metrics["eval/accuracy"] = evaluate(learner, tokenizer, task, eval_problems, config)
            run.log_step(metrics, progress)
            if counters.nonfinite_in_a_row >= config.max_nonfinite:
                save(run, config, step, learner, rollouts, counters, generator, sampler)
                raise TrainingStopped(
                    f"stopped at step {step}: {counters.nonfinite_in_a_row} non-finite losses or gradients in a row "
                    f"(max_nonfinite={config.max_nonfinite}); the last checkpoint is in {run.directory / 'checkpoints'}"
                )
            if config.save_every and step % config.save_every == 0:
                save(run, config, step, learner, rollouts, counters, generator, sampler)
    finally:
        progress.close()
        rollouts.close()

    save(run, config, step, learner, rollouts, counters, generator, sampler)
    accuracy_after = evaluate(learner, tokenizer, task, eval_problems, config)
    run.log_event({"step": step, "eval/accuracy": accuracy_after})
    final_state = learner.model_state(for_pretrained=True)  # gathered under FSDP2 (every rank takes part)
    return run.finish(
        config, model, tokenizer, counters, accuracy_after, step, time.time() - started, final_state
    )


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


def policy_update(
    policy,
    optimizer,
    scheduler,
    loss_fn,
    minibatch: MiniBatch,
    reference,
    config: TrainConfig,
    counters: Counters,
    world: World | None = None,
) -> dict:
    """One optimizer step; a non-finite loss or gradient skips it (counted).

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
    if world.all_true(bool(torch.isfinite(out.loss))):  # every rank updates, or none does
        (out.loss * world.size).backward()  # DDP / FSDP2 average over ranks: P x mean = sum
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)))
        metrics["grad_norm"] = grad_norm
    else:
        grad_norm = float("nan")
    if math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
        counters.nonfinite_in_a_row = 0
        metrics["skipped"] = 0
    else:
        optimizer.zero_grad(set_to_none=True)
        counters.nonfinite_skips += 1
        counters.nonfinite_in_a_row += 1
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


def step_metrics(
    step: int,
    minibatch: MiniBatch,
    update_metrics: dict,
    counters: Counters,
    rollouts,
    seconds: float,
    world: World | None = None,
) -> dict:
    """One ``metrics.jsonl`` line (rewards, advantages and tokens of the whole mini-batch)."""
    world = world or World()
    batch = minibatch.batch
    tokens = int(world.sum(batch.completion_mask.sum()))
    counters.completion_tokens += tokens
    rewards = torch.cat(world.gather_objects(batch.rewards))  # [m x G], every rank's rows
    advantages = torch.cat(world.gather_objects(minibatch.advantages.cpu()))
    return {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/exact": float((rewards >= 1).float().mean()),
        "advantage/abs_mean": float(advantages.abs().mean()),
        "completion/length": tokens / max(rewards.shape[0], 1),
        "lag": minibatch.lag,
        "policy_version": batch.policy_version,
        "rollout/index": minibatch.rollout_index,
        "rollout/minibatch": minibatch.minibatch_index,
        "rollout/rows": list(minibatch.rows),
        "rollout/count": getattr(rollouts, "rollouts", minibatch.rollout_index + 1),
        "rollout/syncs": getattr(rollouts, "syncs", None),
        "reward_failures": counters.reward_failures,
        "nonfinite_skips": counters.nonfinite_skips,
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "seconds": seconds,
        **update_metrics,
    }


# ---------------------------------------------------------------------- setup helpers
def resolve_resume_config(config: TrainConfig) -> TrainConfig:
    """On ``--resume DIR``: the run's saved config, with the fields given now on top."""
    if config.resume is None:
        return config
    saved = Path(config.resume) / "config.yaml"
    if not saved.is_file():
        return config
    base = TrainConfig.from_yaml(saved).to_dict()
    defaults = TrainConfig().to_dict()
    changed = {key: value for key, value in config.to_dict().items() if value != defaults[key]}
    return TrainConfig.from_dict({**base, **changed, "output_dir": base.get("output_dir") or config.resume})


def load_policy_and_task(config: TrainConfig, run: RunLog, world: World | None = None):
    """Tokenizer, model (embedded + cached warm start, or ``--model``), task, held-out set.

    Under ``torchrun`` rank 0 runs (or loads) the warm start first; the other ranks then
    find it in the cache (the same weights: it is deterministic and saved exactly).
    """
    world = world or World()
    task = build_task(config.task, config.dataset, config.reward)
    eval_problems = held_out_problems(task, config.eval_size, seed=EVAL_SEED)
    if config.uses_embedded_model:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, TinyModelConfig(), seed=config.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(config.model, local_files_only=True, dtype=torch.float32)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model: the tokenizer of {config.model!r} has no end-of-sequence token")
    model.eval()  # dropout off everywhere: behaviour and learner log-probs use the same numerics
    steps = config.effective_sft_steps
    if steps and config.resume is None:
        for turn in ("main", "others"):  # rank 0 first, then the rest read its cache entry
            if world.is_main == (turn == "main"):
                warm_start_policy(config, run, model, tokenizer, task, eval_problems, steps)
            world.barrier()
    return tokenizer, model, task, eval_problems


def warm_start_policy(
    config: TrainConfig, run: RunLog, model, tokenizer, task, eval_problems, steps: int
) -> None:
    """The cached supervised warm start (``warmstart.py``), with a progress bar."""
    bar = run.simple_bar(steps, "warm start (supervised)") if config.progress and run.writes else None
    target = None
    if config.sft_target_accuracy is not None:
        validation = ProblemSampler(task, seed=VALIDATION_SEED, exclude=eval_problems).draw(VALIDATION_SIZE)
        target = (
            config.sft_target_accuracy,
            lambda trained: greedy_accuracy(trained, tokenizer, task, validation, config.max_new_tokens),
        )
    cache_file, cached, taken = warm_start(
        model,
        tokenizer,
        task,
        steps=steps,
        lr=config.sft_lr,
        batch_size=config.sft_batch_size,
        seed=config.seed,
        key_extra={
            "model": config.model or TinyModelConfig().__repr__(),
            "eval": (EVAL_SEED, config.eval_size),
            "dataset": config.dataset,
            # the stopping rule's validation set and decoding length shape a target-accuracy warm start
            **(
                {"validation": (VALIDATION_SEED, VALIDATION_SIZE, config.max_new_tokens)}
                if target is not None
                else {}
            ),
        },
        cache_dir=config.cache_dir,
        exclude=eval_problems,
        progress=(lambda step, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}"))) if bar else None,
        target=target,
    )
    if bar:
        bar.close()
    run.log_event({"warmstart": str(cache_file), "warmstart_cached": cached, "warmstart_steps": taken})


def build_optimizer(model, config: TrainConfig):
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(config.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def build_rollout_source(config: TrainConfig, model, tokenizer, sampler, scorer, world: World | None = None):
    """The staleness schedule: sync (N), or async with a fixed lag schedule (the worker starts later).

    Every rank draws the same global problems and samples only its own groups
    (``World.local_groups``); each group's random draws are keyed by (seed, rollout, global
    group index), so any number of processes samples the same completions as one.
    """
    world = world or World()
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[config.mismatch]
    group_size = config.group_size

    def generate(policy, num_prompts: int, version: int, rollout_index: int):
        problems = sampler.draw(num_prompts)  # the whole rollout's prompts, the same on every rank
        groups = world.local_groups(num_prompts, config.prompts_per_step)  # this rank's share
        return generate_rollout(
            policy,
            tokenizer,
            [problems[group] for group in groups],
            scorer,
            group_size=group_size,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            policy_version=version,
            dtype=dtype,
            uniforms=group_uniforms(config.seed, rollout_index, groups, group_size, config.max_new_tokens),
            all_finished=world.all_true if world.fsdp else None,
        )

    def advantages(rewards):
        """This rank's advantages, computed from the rewards of the whole rollout."""
        if not world.distributed:
            return st.group_advantages(rewards, group_size, scale=config.advantage_scale)
        num_groups = rewards.shape[0] * world.size // group_size
        groups = world.local_groups(num_groups, config.prompts_per_step)
        rows = [group * group_size + member for group in groups for member in range(group_size)]
        everyone = world.gather_rows(rewards, rows, num_groups * group_size)  # [N x m x G]
        return st.group_advantages(everyone, group_size, scale=config.advantage_scale)[rows]

    if config.mode == "sync":
        return SyncRollouts(
            generate,
            advantages,
            staleness=config.staleness,
            prompts_per_step=config.prompts_per_step,
            group_size=config.group_size,
            temperature=config.temperature,
            keep_rollout_logprobs=dtype is not None or config.correction is not None,
            world=world,
        )
    source = LaggedRollouts(
        generate,
        advantages,
        max_lag=config.max_lag,
        schedule=config.lag_schedule,
        prompts_per_step=config.prompts_per_step,
        model=model,
    )
    source.concurrent = not config.lag_schedule
    return source


def start_worker_if_async(config: TrainConfig, source, model, step: int):
    """Replace the lagged source by a concurrent worker thread unless a fixed schedule was asked."""
    if not getattr(source, "concurrent", False):
        return source
    return AsyncRollouts(
        source.generate,
        source.advantages,
        max_lag=config.max_lag,
        prompts_per_step=config.prompts_per_step,
        model=model,
        start_step=step,
    )


def evaluate(learner: Learner, tokenizer, task, problems, config: TrainConfig) -> float:
    """Held-out greedy accuracy. DDP: each rank scores a strided share, counts are summed.
    FSDP2: every rank decodes every problem in lock-step (each forward gathers parameters)."""
    world = learner.world
    if not world.distributed:
        return greedy_accuracy(learner.model, tokenizer, task, problems, config.max_new_tokens)
    if world.fsdp:
        return greedy_accuracy(
            learner.policy, tokenizer, task, problems, config.max_new_tokens, all_finished=world.all_true
        )
    share = problems[world.rank :: world.size]
    correct = greedy_accuracy(learner.model, tokenizer, task, share, config.max_new_tokens) * len(share)
    return world.sum(round(correct)) / len(problems)


# ---------------------------------------------------------------------- checkpoints
def save(run, config, step, learner: Learner, rollouts, counters, generator, sampler) -> Path | None:
    """Checkpoint ``step``: every rank takes part in gathering, rank 0 writes."""
    state = {
        "step": step,
        "optimizer": full_optimizer_state(learner.policy, learner.optimizer, learner.world),
        "scheduler": learner.scheduler.state_dict(),
        "rng": rng_state(generator, sampler.rng),
        "rollouts": rollouts.state(),
        "counters": dict(vars(counters)),
        "config": config.to_yaml(),
    }
    model_state = learner.model_state()
    path = None
    if learner.world.is_main:
        path = save_checkpoint(
            run.directory / "checkpoints",
            step,
            learner.model,
            state,
            keep=config.keep_checkpoints,
            model_state=model_state,
        )
    learner.world.barrier()  # the checkpoint is complete before anyone moves on
    return path


def restore(config, learner: Learner, rollouts, counters, generator, sampler, run) -> int:
    """Load the checkpoint (written by any number of processes) into every rank."""
    checkpoint = find_checkpoint(config.resume)
    if learner.world.fsdp:
        from safetensors.torch import load_file

        load_full_model_state(learner.policy, load_file(str(checkpoint / "model.safetensors")))
        state = torch.load(checkpoint / "state.pt", weights_only=True, map_location="cpu")
    else:
        state = load_checkpoint(checkpoint, learner.model)
    load_full_optimizer_state(learner.policy, learner.optimizer, state["optimizer"], learner.world)
    learner.scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"], generator, sampler.rng)
    rollouts.load_state(state["rollouts"])
    for name, value in state["counters"].items():
        setattr(counters, name, value)
    run.log_event({"resumed_from": str(checkpoint), "step": state["step"]})
    return int(state["step"])


# ---------------------------------------------------------------------- the run directory
class RunLog:
    """The run directory: ``config.yaml``, ``metrics.jsonl``, TensorBoard events, summary, plot.

    Under ``torchrun`` only rank 0 writes (``writes``); the other ranks hold a silent one.
    """

    def __init__(self, directory: Path, config: TrainConfig, writes: bool = True):
        self.directory = directory
        self.writes = writes
        self.metrics_path = directory / "metrics.jsonl"
        self.events_path = directory / "events.jsonl"
        self.rewards: list[tuple[int, float]] = []
        self.accuracies: list[tuple[int, float]] = []
        self.tensorboard = None
        if config.report_to == "tensorboard" and writes:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(directory / "tensorboard"))
        self.last_postfix: dict = {}

    @classmethod
    def open(cls, config: TrainConfig, world: World | None = None) -> RunLog:
        world = world or World()
        if config.output_dir is None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            config.output_dir = world.broadcast(
                str(Path("runs") / f"{stamp}-{config.method}-N{config.staleness}")
            )
        directory = Path(config.output_dir)
        if not world.is_main:
            return cls(directory, config, writes=False)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / "config.yaml", config.to_yaml())
        run = cls(directory, config)
        if config.resume is not None:
            run._reload_history()
        return run

    def _reload_history(self) -> None:
        """After a resume, keep the curves of the steps already run (and drop any after the checkpoint)."""
        if not self.metrics_path.is_file():
            return
        for line in self.metrics_path.read_text().splitlines():
            record = json.loads(line)
            self.rewards.append((record["step"], record["reward/mean"]))
            if "eval/accuracy" in record:
                self.accuracies.append((record["step"], record["eval/accuracy"]))

    def truncate_after(self, step: int) -> None:
        if not self.writes or not self.metrics_path.is_file():
            return
        kept = [
            line for line in self.metrics_path.read_text().splitlines() if json.loads(line)["step"] <= step
        ]
        atomic_write_text(self.metrics_path, "".join(line + "\n" for line in kept))
        self.rewards = [(s, r) for s, r in self.rewards if s <= step]
        self.accuracies = [(s, a) for s, a in self.accuracies if s <= step]

    def log_event(self, record: dict) -> None:
        if not self.writes:
            return
        if "eval/accuracy" in record:
            self.accuracies.append((record["step"], record["eval/accuracy"]))
            self.last_postfix["acc"] = f"{record['eval/accuracy']:.3f}"
        with open(self.events_path, "a") as handle:
            handle.write(json.dumps({"time": time.time(), **record}) + "\n")

    def log_step(self, metrics: dict, progress) -> None:
        if not self.writes:
            return
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(metrics, allow_nan=True) + "\n")
        step = metrics["step"]
        self.rewards.append((step, metrics["reward/mean"]))
        if "eval/accuracy" in metrics:
            self.accuracies.append((step, metrics["eval/accuracy"]))
            self.last_postfix["acc"] = f"{metrics['eval/accuracy']:.3f}"
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(name, value, step)
        weight = metrics.get("loss/phi/mean", metrics.get("loss/ratio/mean", float("nan")))
        self.last_postfix.update(
            reward=f"{metrics['reward/mean']:.3f}",
            kl=f"{metrics['kl_behaviour']:.2e}",
            w=f"{weight:.3f}",
            lag=metrics["lag"],
            tok_s=f"{metrics['tokens_per_second']:.0f}",
        )
        progress.set_postfix(self.last_postfix, refresh=False)
        progress.update(1)

    def progress_bar(self, config: TrainConfig, initial: int):
        from tqdm.auto import tqdm

        return tqdm(
            total=config.max_steps,
            initial=initial,
            desc=f"RL {config.method} N={config.staleness} {config.mode}",
            disable=not (config.progress and self.writes),
            dynamic_ncols=True,
        )

    def simple_bar(self, total: int, description: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=description, dynamic_ncols=True)

    def finish(
        self,
        config,
        model,
        tokenizer,
        counters: Counters,
        accuracy_after: float,
        step: int,
        wall_seconds: float,
        model_state: dict[str, torch.Tensor] | None = None,
    ) -> dict:
        """Write ``final/`` (``model_state``: the gathered weights of an FSDP2 model) and the summary."""
        final = self.directory / "final"
        if self.writes:
            save_final_model(final, model, tokenizer, model_state)
        rewards = [reward for _, reward in self.rewards]
        window = max(1, len(rewards) // 10)
        summary = {
            "accuracy_before": counters.accuracy_before,
            "accuracy_after": accuracy_after,
            "reward_first": sum(rewards[:window]) / window if rewards else None,
            "reward_last": sum(rewards[-window:]) / window if rewards else None,
            "steps": step,
            "method": config.method,
            "staleness": config.staleness,
            "mode": config.mode,
            "max_lag": config.max_lag,
            "wall_seconds": wall_seconds,
            "nonfinite_skips": counters.nonfinite_skips,
            "reward_failures": counters.reward_failures,
            "completion_tokens": counters.completion_tokens,
            "device": str(next(model.parameters()).device),  # where the learner ran
            "final_dir": str(final),
        }
        if not self.writes:
            return summary
        atomic_write_text(self.directory / "summary.json", json.dumps(summary, indent=2) + "\n")
        self.plot()
        if self.tensorboard is not None:
            self.tensorboard.close()
        return summary

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        if self.rewards:
            steps, rewards = zip(*self.rewards, strict=True)
            axis.plot(steps, rewards, alpha=0.35, label="reward (per step)")
            window = max(1, len(rewards) // 16)
            smoothed = [
                sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                for i in range(len(rewards))
            ]
            axis.plot(steps, smoothed, label=f"reward (mean of {window})")
        if self.accuracies:
            steps, accuracies = zip(*self.accuracies, strict=True)
            axis.plot(steps, accuracies, "o-", label="held-out greedy accuracy")
        axis.set_xlabel("optimizer step")
        axis.set_ylim(0, 1)
        axis.legend()
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(self.directory / "reward_curve.png", dpi=100)
        plt.close(figure)


def save_final_model(directory: Path, model, tokenizer, model_state: dict[str, torch.Tensor] | None) -> None:
    """``save_pretrained`` layout: the config, the weights (``model_state`` when the model is
    sharded with FSDP2) and the tokenizer."""
    model.save_pretrained(directory, state_dict=model_state)
    tokenizer.save_pretrained(directory)
