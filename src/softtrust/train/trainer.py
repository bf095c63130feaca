"""The off-policy GRPO trainer: collect, compute advantages, update, log.

``train(config)`` reads top to bottom like the algorithm. The machinery lives in named
modules: the staleness schedules (``RolloutSource``) in ``staleness.py``, generation and
rewards in ``rollout.py``, the update and evaluation in ``learner.py``, what a checkpoint
saves (``TrainState``) in ``state.py`` and how (atomically) in ``checkpoint.py``, the warm
start in ``warmstart.py``, data parallelism (``torchrun``, DDP, FSDP2) in
``distributed.py``, and the run directory in ``runlog.py``.

Under ``torchrun`` every rank runs this same loop on its share of each rollout; the
collectives hide in ``World`` (``distributed.py``) and only rank 0 writes the run directory.
"""

from __future__ import annotations

import copy
import time
from typing import NamedTuple

import torch

import softtrust as st

from .advantage_config import advantages_of
from .checkpoint import find_checkpoint, restore_state, run_directory_of, save_state
from .config import DTYPES, TrainConfig, resolve_device
from .dapo import GroupFilter, check_group_filter, shape_rollout
from .distributed import (
    World,
    close_world,
    generation_model,
    init_world,
    pretrained_names,
    save_kept_names,
    wrap_policy,
)
from .learner import Learner, build_optimizer, evaluate
from .loss_config import build_kl_controller, build_method_loss
from .options import resume_config
from .rollout import (
    Evaluation,
    ProblemSampler,
    RewardScorer,
    RolloutBatch,
    cut_fraction,
    end_token_ids,
    generate_rollout,
    greedy_accuracy,
    group_uniforms,
    sampled_lengths,
)
from .runlog import RunLog
from .scoring import Scoring
from .staleness import (
    AsyncRollouts,
    GenerateFn,
    LaggedRollouts,
    MiniBatch,
    Rollout,
    RolloutSource,
    SyncRollouts,
)
from .state import TrainState
from .tasks import task_and_held_out
from .tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from .values import parse_mismatch
from .warmstart import EVAL_SEED, VALIDATION_SEED, VALIDATION_SIZE, warm_start, warmstart_recipe


class TrainingStopped(RuntimeError):
    """Training stopped early (too many non-finite updates); a checkpoint was saved."""


# ---------------------------------------------------------------------- the loop
def train(config: TrainConfig) -> dict:
    """Run RL as ``config`` describes; return the summary (also written to ``summary.json``).

    With ``config.resume``, the run continues its own stored config in its own directory
    (``resolve_resume``). Launched by ``torchrun`` with several processes, this is
    data-parallel training (DDP, or FSDP2 with ``fsdp``); see ``docs/distributed.md``.
    """
    config = resolve_resume(config).resolved().validate()
    loss_fn = build_method_loss(config)  # built once: a bad method parameter fails before any work
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    world = init_world(config.fsdp, resolve_device(config.device))
    try:
        summary = train_in_world(config, loss_fn, world)
    except BaseException:
        close_world(world, wait=False)  # a failing rank must not wait for the others
        raise
    close_world(world)
    return summary


class Session(NamedTuple):
    """What a run works with once it is set up (``set_up``)."""

    run: RunLog
    task: object
    eval_problems: list
    tokenizer: object
    model: torch.nn.Module  # the plain causal LM
    sampler_model: torch.nn.Module  # what samples rollouts (the plain model, or FSDP2's forward)
    scorer: RewardScorer
    learner: Learner
    rollouts: RolloutSource
    state: TrainState


def train_in_world(config: TrainConfig, loss_fn: st.PolicyLoss, world: World) -> dict:
    """``train`` once the process group (if any) is up: set up, then one ``train_step`` after
    another, then the final checkpoint, evaluation and summary."""
    started = time.time()
    session = set_up(config, loss_fn, world)
    run, state, learner = session.run, session.state, session.learner
    try:
        progress = run.progress_bar(config, initial=state.step)
        try:
            while state.step < config.max_steps:
                train_step(session, config, progress)
        finally:
            progress.close()
            session.rollouts.close()
        save_state(run.directory, state, config.to_yaml(), config.keep_checkpoints)
        run.note(f"evaluating {len(session.eval_problems)} held-out problems after RL (greedy)")
        after = evaluate_and_sample(session, config, state.step)
        run.log_event({"step": state.step, "eval/accuracy": after.accuracy, "eval/score": after.score})
        final_state = learner.model_state(for_pretrained=True)  # gathered under FSDP2 (every rank takes part)
        return run.finish(
            config, session.model, session.tokenizer, state, after, time.time() - started, final_state
        )
    finally:
        run.close()  # the directory is free for the next process (also after an error)


def train_step(session: Session, config: TrainConfig, progress) -> None:
    """One step: collect, advantages, update, then log, evaluate and checkpoint."""
    state, rollouts, world = session.state, session.rollouts, session.learner.world
    collect_start = time.time()
    # 1. collect: a new rollout when the schedule needs one (sync: every N steps; async: every step)
    rollout = rollouts.collect(state.step, session.sampler_model)
    if rollout is not None:
        # 2. advantages: group-relative, from the rewards of the whole rollout
        lengths = rollout.batch.completion_mask.sum(dim=1)  # [rows] completion tokens
        rollouts.add(rollout, rollout_advantages(rollout.batch.rewards, config, world, lengths))
        warn_if_cut(session.run, rollout.batch, session.tokenizer, config, state.step)
    minibatch = rollouts.next(state.step)
    collect_seconds = time.time() - collect_start
    state.reward_failures = int(world.sum(session.scorer.failures))
    # 3. update: one optimizer step on the mini-batch
    update_metrics = session.learner.update(minibatch)
    state.count_update(skipped=bool(update_metrics["skipped"]))
    state.step += 1
    rollouts.publish(state.step, session.model)
    # 4. log, evaluate, checkpoint
    metrics = step_metrics(state, minibatch, update_metrics, rollouts, time.time() - collect_start, world)
    # where the step's time went: waiting for the mini-batch (sync: sampling + behaviour log-probs),
    # then the update; and the producer's time for a rollout that arrived now (async: spent while
    # the learner worked on earlier steps)
    metrics["seconds/collect"] = collect_seconds
    metrics["seconds/update"] = metrics["seconds"] - collect_seconds
    metrics["seconds/sample"] = 0.0 if rollout is None else rollout.seconds
    metrics.update(dynamic_sampling_metrics(session.run, rollout, state.step))
    log_evaluate_checkpoint(session, config, minibatch, metrics, progress)


def log_evaluate_checkpoint(
    session: Session, config: TrainConfig, minibatch, metrics: dict, progress
) -> None:
    """Samples, the held-out evaluation and the checkpoint when due; the metrics line; the stop
    after ``max_nonfinite`` non-finite updates in a row (with a checkpoint)."""
    run, state = session.run, session.state
    if config.samples_every and state.step % config.samples_every == 0:
        run.log_samples(
            state.step, "train", training_samples(session.tokenizer, minibatch, config.num_samples)
        )
    if config.eval_every and state.step % config.eval_every == 0 and state.step < config.max_steps:
        metrics["eval/accuracy"], metrics["eval/score"] = evaluate_and_sample(session, config, state.step)
    run.log_step(metrics, progress)
    if state.nonfinite_in_a_row >= config.max_nonfinite:
        save_state(run.directory, state, config.to_yaml(), config.keep_checkpoints)
        message = (
            f"stopped at step {state.step}: {state.nonfinite_in_a_row} non-finite losses or gradients "
            f"in a row (max_nonfinite={config.max_nonfinite}); the last checkpoint is in "
            f"{run.directory / 'checkpoints'}"
        )
        run.log_stop(state.step, message)
        raise TrainingStopped(message)
    if config.save_every and state.step % config.save_every == 0:
        save_state(run.directory, state, config.to_yaml(), config.keep_checkpoints)


def set_up(config: TrainConfig, loss_fn: st.PolicyLoss, world: World) -> Session:
    """The task and held-out set, the run directory, the (warm-started) policy and its learner,
    the rollout source and the state: restored from the latest checkpoint on resume, else
    evaluated once before RL."""
    world.check_divides(config.prompts_per_step)
    check_group_filter(config, world)
    task, eval_problems = task_and_held_out(config, EVAL_SEED)
    checkpoint = find_checkpoint(config.resume) if config.resume is not None else None
    run = RunLog.open(config, world)  # the first file written; the directory is this process's
    try:
        return set_up_run(config, loss_fn, world, task, eval_problems, checkpoint, run)
    except BaseException:
        run.close()
        raise


def set_up_run(config, loss_fn, world, task, eval_problems, checkpoint, run: RunLog) -> Session:
    """``set_up`` once the run directory is open: the policy, learner, rollouts and state."""
    tokenizer, model = load_policy(config, run, task, eval_problems, world)
    reference = copy.deepcopy(model).eval().to(world.device) if config.kl_coef > 0 else None
    # The file layouts (tied weights once), read before any sharding.
    kept_names, final_names = save_kept_names(model), pretrained_names(model)
    policy = wrap_policy(model, world)  # the learner's forward: plain, DDP or FSDP2
    sampler = ProblemSampler(task, seed=config.seed, exclude=eval_problems)
    scorer = RewardScorer(task, strict=config.strict_reward)
    optimizer, scheduler = build_optimizer(model, config)
    learner = Learner(
        model, policy, optimizer, scheduler, world, kept_names, final_names, loss_fn, config, reference,
        build_kl_controller(config),
    )  # fmt: skip
    rollouts = build_rollout_source(config, model, tokenizer, sampler, scorer, world)
    state = TrainState(learner, rollouts, sampler)
    session = Session(
        run, task, eval_problems, tokenizer, model, generation_model(policy, model, world), scorer,
        learner, rollouts, state,
    )  # fmt: skip
    if checkpoint is not None:
        restore_state(checkpoint, state)
        run.log_event({"resumed_from": str(checkpoint), "step": state.step})
        run.truncate_after(state.step)  # metrics logged after the checkpoint will be logged again
    else:
        run.note(f"evaluating {len(eval_problems)} held-out problems before RL (greedy)")
        state.accuracy_before, state.score_before = evaluate_and_sample(session, config, 0)
        run.log_event({"step": 0, "eval/accuracy": state.accuracy_before, "eval/score": state.score_before})
    rollouts.start(state.step, model)
    return session


CUT_WARNING = 0.5  # warn (once) when more than this share of a rollout's completions is cut
CUT_WARNING_KEY = "cut completions"


def warn_if_cut(run: RunLog, batch: RolloutBatch, tokenizer, config: TrainConfig, step: int) -> None:
    """Warn once (``RunLog.warn``) when most of a rollout's completions reached ``max_new_tokens``
    without an end token (``rollout.cut_fraction``): a cut completion usually scores 0, so reward
    and gradient vanish without any error (a chat model with the embedded model's 6 tokens)."""
    if CUT_WARNING_KEY in run.warned:
        return
    limit = config.effective_max_new_tokens
    share = cut_fraction(batch, end_token_ids(tokenizer), limit)
    if share > CUT_WARNING:
        run.warn(
            f"{share:.0%} of the completions sampled at step {step} reached --max-new-tokens {limit} "
            "without an end token; a cut completion usually scores 0 (no reward, no gradient): "
            "raise --max-new-tokens",
            step,
            once=CUT_WARNING_KEY,
        )


FILTER_WARNING_KEY = "filter groups cap"


def dynamic_sampling_metrics(run: RunLog, rollout: Rollout | None, step: int) -> dict:
    """``filter/*``: what ``--filter-groups`` did for a rollout that arrived at this step (absent
    otherwise): generation passes, groups drawn, dropped (all rewards equal) and filled (dropped
    groups trained on because ``--filter-groups-max-draws`` passes left too few), with a warning
    the first time a rollout is filled."""
    counts = {} if rollout is None else rollout.batch.sampling
    if counts.get("groups_filled"):
        run.warn(
            f"--filter-groups: {counts['draws']} generation passes (--filter-groups-max-draws) left "
            f"{counts['groups_filled']} of the rollout's groups with all rewards equal; it trains with "
            "them (zero advantage, as without filtering): raise --filter-groups-max-draws, or the task "
            "is too easy or too hard for the policy",
            step,
            once=FILTER_WARNING_KEY,
        )
    return {f"filter/{name}": value for name, value in counts.items()}


def rollout_advantages(
    rewards: torch.Tensor,
    config: TrainConfig,
    world: World | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's advantages ``[rows]`` from its rows' ``rewards`` (and completion ``lengths``,
    which REINFORCE++ whitens over; default: one token a row), normalised over the whole rollout
    (``advantage_config.advantages_of``: ``--advantages``, ``--advantage-scale``), with every
    rank's rewards and lengths gathered in global order under ``torchrun``."""
    world = world or World()
    lengths = torch.ones_like(rewards, dtype=torch.long) if lengths is None else lengths.cpu()
    if not world.distributed:
        return advantages_of(rewards, lengths, config)
    group_size = config.group_size
    num_groups = rewards.shape[0] * world.size // group_size
    groups = world.local_groups(num_groups, config.prompts_per_step)
    rows = [group * group_size + member for group in groups for member in range(group_size)]
    everyone = world.gather_rows(rewards, rows, num_groups * group_size)  # [N x m x G]
    all_lengths = world.gather_rows(lengths, rows, num_groups * group_size)
    return advantages_of(everyone, all_lengths, config)[rows]


def step_metrics(
    state: TrainState,
    minibatch: MiniBatch,
    update_metrics: dict,
    rollouts: RolloutSource,
    seconds: float,
    world: World | None = None,
) -> dict:
    """One ``metrics.jsonl`` line (rewards, advantages and tokens of the whole mini-batch)."""
    world = world or World()
    batch = minibatch.batch
    lengths = sampled_lengths(batch)  # [b] tokens sampled (the trained ones unless --mask-truncated)
    tokens = int(world.sum(lengths.sum()))
    masked = world.sum(((batch.completion_mask.sum(dim=1) == 0) & (lengths > 0)).sum())
    state.completion_tokens += tokens
    rewards = torch.cat(world.gather_objects(batch.rewards))  # [m x G], every rank's rows
    advantages = torch.cat(world.gather_objects(minibatch.advantages.cpu()))
    return {
        "step": state.step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/exact": float((rewards >= 1).float().mean()),
        "advantage/abs_mean": float(advantages.abs().mean()),
        "completion/length": tokens / max(rewards.shape[0], 1),
        "completion/masked": masked / max(rewards.shape[0], 1),  # --mask-truncated: no loss
        "lag": minibatch.lag,
        "policy_version": batch.policy_version,
        "rollout/index": minibatch.rollout_index,
        "rollout/minibatch": minibatch.minibatch_index,
        "rollout/rows": list(minibatch.rows),
        "rollout/count": getattr(rollouts, "rollouts", minibatch.rollout_index + 1),
        "rollout/syncs": getattr(rollouts, "syncs", None),
        "reward_failures": state.reward_failures,
        "nonfinite_skips": state.nonfinite_skips,
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "seconds": seconds,
        **update_metrics,
    }


def evaluate_and_sample(session: Session, config: TrainConfig, step: int) -> Evaluation:
    """Held-out greedy accuracy and mean score (``learner.evaluate``); the first ``num_samples``
    held-out problems' prompts, completions and rewards go to ``samples.jsonl``."""
    samples = [] if config.num_samples else None
    evaluation = evaluate(
        session.learner, session.tokenizer, session.task, session.eval_problems, config, samples=samples
    )
    session.run.log_samples(step, "eval", samples or [])
    return evaluation


def training_samples(tokenizer, minibatch: MiniBatch, count: int) -> list[dict]:
    """The first ``count`` rows of this step's mini-batch: the prompt exactly as fed to the model
    (its tokens decoded with special tokens), the completion text and the reward."""
    batch, samples = minibatch.batch, []
    prompt_length = batch.input_ids.shape[1] - batch.completion_length
    for row in range(min(count, batch.input_ids.shape[0])):
        ids = batch.input_ids[row, :prompt_length][batch.attention_mask[row, :prompt_length].bool()]
        samples.append(
            {
                "prompt": tokenizer.decode(ids.tolist(), skip_special_tokens=False),
                "completion": batch.completions[row] if row < len(batch.completions) else None,
                "reward": float(batch.rewards[row]),
                "advantage": float(minibatch.advantages[row]),
            }
        )
    return samples


# ---------------------------------------------------------------------- setup helpers
def resolve_resume(config: TrainConfig) -> TrainConfig:
    """On ``resume``: the run's stored config with ``config``'s values on top, refusing those that
    would change what it trains (``config.resume_config``); the run writes into its own directory."""
    if config.resume is None:
        return config
    directory = run_directory_of(config.resume)
    stored = TrainConfig.from_yaml(directory / "config.yaml").resolved()  # older runs recorded None
    given = config.resolved()  # a default (None) means the value it resolves to
    changes = {key: value for key, value in given.to_dict().items() if value != getattr(stored, key)}
    return resume_config(stored, {**changes, "resume": config.resume}, directory)


def load_policy(config: TrainConfig, run: RunLog, task, eval_problems, world: World | None = None):
    """Tokenizer and model (embedded + cached warm start, or ``--model``).

    Under ``torchrun`` rank 0 runs (or loads) the warm start first; the other ranks then
    find it in the cache (the same weights: it is deterministic and saved exactly).
    """
    world = world or World()
    if config.uses_embedded_model:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, TinyModelConfig(), seed=config.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            config.model, local_files_only=True, dtype=DTYPES[config.dtype]
        )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model: the tokenizer of {config.model!r} has no end-of-sequence token")
    if config.uses_embedded_model:
        model.to(DTYPES[config.dtype])
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # the sampler asks for its cache explicitly
    model.eval()  # dropout off everywhere: behaviour and learner log-probs use the same numerics
    steps = config.effective_sft_steps
    # a resume restores the policy from its checkpoint, but a KL reference is the warm-started
    # policy, which no checkpoint holds: rebuild it (the cache entry, or the same deterministic run)
    if steps and (config.resume is None or config.kl_coef > 0):
        record = dict(run.warmstart)  # a resume keeps the run's own warm-start record
        for turn in ("main", "others"):  # rank 0 first, then the rest read its cache entry
            if world.is_main == (turn == "main"):
                warm_start_policy(
                    config, run, model, tokenizer, task, eval_problems, steps, log=config.resume is None
                )
            world.barrier()
        if config.resume is not None:
            run.warmstart = record
    return tokenizer, model


def warm_start_policy(
    config: TrainConfig, run: RunLog, model, tokenizer, task, eval_problems, steps: int, log: bool = True
) -> None:
    """The cached supervised warm start (``warmstart.py``), with a progress bar (or lines) while it
    trains; one warning line when it stops below its target. ``log=False`` (a resume rebuilding the
    KL reference): no event, no warning, ``run.warmstart`` left to the caller."""
    target = None
    if config.sft_target_accuracy is not None:
        validation = ProblemSampler(task, seed=VALIDATION_SEED, exclude=eval_problems).draw(VALIDATION_SIZE)
        target = (
            config.sft_target_accuracy,
            lambda trained: greedy_accuracy(
                trained,
                tokenizer,
                task,
                validation,
                config.effective_max_new_tokens,
                strict=config.strict_reward,
            ),
        )
    bar = None

    def progress(step: int, loss: float) -> None:
        nonlocal bar
        if bar is None:  # created on the first trained step: a cached warm start shows no bar
            bar = run.simple_bar(steps, "warm start (supervised)", live=config.progress)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    try:
        done = warm_start(
            model,
            tokenizer,
            task,
            steps=steps,
            lr=config.sft_lr,
            batch_size=config.sft_batch_size,
            seed=config.seed,
            key_extra=warmstart_recipe(config, with_target=target is not None),
            cache_dir=config.cache_dir,
            exclude=eval_problems,
            progress=progress if run.writes else None,
            target=target,
        )
    finally:
        if bar is not None:
            bar.close()
    run.warmstart = {
        "warmstart": None if done.cache_file is None else str(done.cache_file),
        "warmstart_cached": done.cached,
        "warmstart_steps": done.steps,
        "warmstart_accuracy": done.accuracy,
        "warmstart_target": done.target,
        "warmstart_reached": done.reached,
    }
    if not log:
        return
    run.log_event(dict(run.warmstart))
    if not done.reached:
        run.warn(
            f"the warm start stopped at its cap of {steps} steps with validation accuracy "
            f"{done.accuracy:.3f}, below its target {done.target} (--sft-target-accuracy); RL starts "
            "from there (raise --sft-steps to let it reach the target)",
            step=0,
        )


def rollout_generator(
    config: TrainConfig,
    tokenizer,
    sampler,
    scorer,
    world: World,
    dtype: torch.dtype | None = None,
    logit_noise: float = 0.0,
) -> GenerateFn:
    """``generate(policy, num_prompts, version, rollout_index)``: this rank's rows of a new rollout.

    A generation pass draws ``num_prompts`` problems (the same on every rank), samples this rank's
    groups (``World.local_groups``) with keys (seed, rollout, pass x num_prompts + global group),
    scores them and applies DAPO's length rules (``dapo.shape_rollout``). One pass makes the
    rollout; with ``--filter-groups``, ``dapo.GroupFilter`` runs passes until it is full (pass 0's
    keys are those of an unfiltered run).
    """
    end_ids = end_token_ids(tokenizer)
    groups_per_step, limit = config.prompts_per_step, config.effective_max_new_tokens
    group_filter = None
    if config.filter_groups:
        group_filter = GroupFilter(config.filter_groups_max_draws, config.group_size, groups_per_step, world)

    def generate(policy, num_prompts: int, version: int, rollout_index: int) -> RolloutBatch:
        def draw(index: int) -> RolloutBatch:
            problems = sampler.draw(num_prompts)  # the whole rollout's prompts, the same on every rank
            groups = world.local_groups(num_prompts, groups_per_step)  # this rank's share
            keys = [index * num_prompts + group for group in groups]  # pass 0: the groups themselves
            batch = generate_rollout(
                policy,
                tokenizer,
                [problems[group] for group in groups],
                scorer,
                group_size=config.group_size,
                max_new_tokens=limit,
                temperature=config.temperature,
                policy_version=version,
                dtype=dtype,
                logit_noise=(logit_noise, config.seed) if logit_noise else None,
                uniforms=group_uniforms(config.seed, rollout_index, keys, config.group_size, limit),
                all_finished=world.all_true if world.fsdp else None,
                top_k=config.top_k,
                top_p=config.top_p,
            )
            return shape_rollout(batch, config, end_ids)

        return draw(0) if group_filter is None else group_filter.fill(draw, num_prompts)

    return generate


def build_rollout_source(
    config: TrainConfig, model, tokenizer, sampler, scorer, world: World | None = None
) -> RolloutSource:
    """The staleness schedule: sync (N), async with a fixed lag schedule, or the concurrent worker.

    Every rank draws the same global problems and samples only its own groups
    (``World.local_groups``); each group's random draws are keyed by (seed, rollout, global
    group index), so any number of processes samples the same completions as one.
    """
    world = world or World()
    dtype_name, noise = parse_mismatch(config.mismatch)  # autocast, or the sampler's logit noise
    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    generate = rollout_generator(config, tokenizer, sampler, scorer, world, dtype, noise)
    scoring = Scoring(config.temperature, config.top_k, config.top_p)  # the policy the learner scores
    if config.mode == "sync":
        return SyncRollouts(
            generate,
            staleness=config.staleness,
            prompts_per_step=config.prompts_per_step,
            group_size=config.group_size,
            scoring=scoring,
            keep_rollout_logprobs=dtype is not None or noise > 0 or config.correction is not None,
            world=world,
            micro_batch_size=config.micro_batch_size,
            old_logprobs=config.effective_old_logprobs,
        )
    shape = dict(  # async: batches of U x m prompts, taken as U mini-batches at consecutive steps
        updates_per_batch=config.updates_per_batch,
        prompts_per_step=config.prompts_per_step,
        group_size=config.group_size,
        world=world,
        proximal=scoring if config.proximal == "recompute" else None,  # pi_prox taken at the fetch
    )
    if config.lag_schedule:
        return LaggedRollouts(
            generate, max_lag=config.max_lag, schedule=config.lag_schedule, model=model, **shape
        )
    return AsyncRollouts(generate, max_lag=config.max_lag, model=model, **shape)
