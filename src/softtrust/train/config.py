"""The trainer's configuration: one dataclass (its values read by ``values.py``; the command line
and resuming in ``options.py``, which builds on this module, never the reverse).

Every field carries its help text in its metadata; ``softtrust train --help`` is built
from them, so the documentation cannot drift from the code. Precedence: field default
< ``--config FILE.yaml`` < command-line flags. ``TrainConfig.validate()`` checks every
value before any work and names the offending field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from softtrust._optional import require
from softtrust.aggregation import AGGREGATIONS
from softtrust.kl import KL_ESTIMATORS
from softtrust.methods import METHODS
from softtrust.ratios import LEVELS

from . import option_checks as limits
from .advantage_config import check_advantage_options
from .machine import check_causal_lm_directory, check_device, resolve_device
from .proximal import check_proximal_options
from .tasks import check_task, default_reward
from .values import check_field_value, coerce, load_yaml_mapping, parse_mismatch

MODES = ("sync", "async")
MISMATCH = ("none", "bf16", "fp16")
REPORT_TO = ("none", "tensorboard")
OLD_LOGPROBS = ("recompute", "sampler")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The embedded default's warm start: to 20 % validation accuracy, at most 1,000 steps (measured,
# docs/main_job.md: seeds 0-4 under the default, avx2 and avx512 kernels reach it after 260-800
# steps, where a fixed 300 steps gave 1-32 % depending on the kernels), then 512 RL steps
# (from ~20 % the slowest seed gained 13 points in 256 steps).
EMBEDDED_SFT_STEPS, DEFAULT_SFT_TARGET = 1000, 0.2
EMBEDDED_MAX_NEW_TOKENS, MODEL_MAX_NEW_TOKENS = 6, 256  # TrainConfig.effective_max_new_tokens


def _field(
    default,
    help: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    resumable: bool = False,
):
    """A dataclass field (immutable default) with everything the command line and the checks need.

    Args:
        help: the ``--help`` text.
        low, high: the allowed range of a numeric field (``low_open``: ``> low`` instead of
            ``>= low``); every float is also checked finite. ``validate`` reads these, so a
            new numeric option is declared, checked and documented in this one place.
        resumable: may change when a run is resumed (cadence, device, display); every other
            field would change what is trained and is refused on ``--resume``.
    """
    metadata = {"help": help, "low": low, "high": high, "low_open": low_open, "resumable": resumable}
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Everything a ``softtrust train`` run needs (saved as ``config.yaml`` in the run directory)."""

    # --- task and model
    task: str = _field(
        "addition",
        "Built-in task (addition, addition-1digit, scratchpad), or reasoning-gym:NAME, a reasoning-gym "
        "generator scored by its own verifier (pip install -e '.[tasks]'); ignored when --dataset is given.",
    )
    task_config: dict = field(
        default_factory=dict,
        metadata={
            "help": "Options of a reasoning-gym:NAME generator (its config's fields) as k=v pairs, e.g. "
            "'min_terms=2,max_terms=3' (a YAML mapping in --config); size: the entries of its training and "
            "of its held-out generator (default 10000)."
        },
    )
    dataset: str | None = _field(
        None,
        "A dataset (replaces --task): .jsonl, .json, .csv, .parquet or a datasets save_to_disk directory; "
        "prompts are strings or conversations ([{role, content}, ...], rendered with the chat template).",
    )
    prompt_column: str = _field("prompt", "--dataset's prompt column.")
    answer_column: str = _field(
        "answer", "--dataset's answer column (what the built-in rewards compare with)."
    )
    system_prompt: str | None = _field(
        None,
        "A system message put first in every conversational prompt that has none (a reasoning-gym task's "
        "chat prompts: instead of reasoning-gym's own).",
    )
    reward: str | None = _field(
        None,
        "Reward(s) for --dataset or a reasoning-gym task, comma-separated: exact | numeric | math | "
        "task (a reasoning-gym generator's own score) | module:function (per sample (completion, answer, "
        "**columns) or TRL's batched (prompts, completions, completion_ids, **columns) -> list of float "
        "or None) (default: exact for --dataset, task for reasoning-gym:NAME).",
    )
    reward_weights: list[float] = field(
        default_factory=list,
        metadata={"help": "Weights of the --reward functions, e.g. '1,0.1' (default: 1 each)."},
    )
    correctness_reward: str | None = _field(
        None,
        "The --reward whose value >= 1 counts as correct in held-out accuracy (default: the first; "
        "a reasoning-gym task's is always task).",
    )
    strict_reward: bool = _field(
        False, "Re-raise reward-function errors instead of scoring 0 and counting them."
    )
    model: str | None = _field(
        None, "A local Hugging Face causal LM directory with its tokenizer; default: the embedded tiny Qwen2."
    )
    # --- supervised warm start (cached under the cache directory, keyed by its config)
    sft_steps: int | None = _field(
        None,
        f"Warm-start steps of supervised training, the most when --sft-target-accuracy stops it first "
        f"(default: {EMBEDDED_SFT_STEPS} for the embedded model, 0 for --model).",
        low=0,
    )
    sft_target_accuracy: float | None = _field(
        DEFAULT_SFT_TARGET,
        "Stop the warm start as soon as greedy accuracy on a validation set (256 problems, disjoint "
        "from the held-out set, checked every 10 steps) reaches this value; --sft-steps is then "
        "the maximum, and a warm start that ends below it says so. 'none': train all --sft-steps. "
        "A target makes warm starts comparable across seeds and machines (a fixed step count lands "
        "them far apart where the supervised curve is steep).",
        low=0,
        low_open=True,
        high=1,
    )
    sft_lr: float = _field(2e-3, "Warm-start learning rate.", low=0, low_open=True)
    sft_batch_size: int = _field(
        64,
        f"Warm-start problems per step (at most {limits.MAX_SFT_BATCH}).",
        low=1,
        high=limits.MAX_SFT_BATCH,
    )
    cache_dir: str | None = _field(
        None,
        "Where warm starts are cached (default: $SOFTTRUST_CACHE or ~/.cache/softtrust).",
        resumable=True,
    )
    # --- policy loss
    method: str = _field(
        "vespo",
        "Policy-loss method, one of: " + ", ".join(METHODS) + ".",
    )
    method_params: dict = field(
        default_factory=dict,
        metadata={"help": "Method parameters as k=v pairs, e.g. 'k_pos=2,lambda_pos=3' or 'eps_high=0.28'."},
    )
    level: str | None = _field(
        None,
        "Ratio level: token | sequence-mean | sequence-sum | sequence-mean-token (GSPO-token) (default: the method's own).",
    )
    aggregation: str = _field("token-mean", "Loss aggregation: " + " | ".join(AGGREGATIONS) + ".")
    correction: str | None = _field(
        None,
        "Behaviour correction: tis | mis | opsm | reject, with parameters, e.g. 'tis:cap=2,level=token' "
        "(self_normalize=true: the weights divided by their mini-batch mean) or "
        "'reject:divergence=k3,level=sequence-mean,high=0.01'; join one IS correction (tis, mis) with opsm "
        "and/or reject by '+', e.g. 'tis:cap=2+reject:divergence=ratio,low=0.999,high=1.001'; 'none' is no bound.",
    )
    kl_coef: float = _field(
        0.0, "KL penalty coefficient towards the initial (warm-start) policy; 0 disables it.", low=0
    )
    kl_estimator: str = _field(
        "k3",
        "KL estimator: " + " | ".join(KL_ESTIMATORS) + " (k1+, k3+: that value with k2's gradient, the "
        "unbiased KL gradient; abs: |log-ratio|).",
    )
    kl_target: float | None = _field(
        None,
        "Adaptive KL (PPO): steer the KL coefficient, starting at --kl-coef, towards this KL: after each "
        "step beta <- beta (1 + clip(KL / target - 1, -0.2, 0.2) n / --kl-horizon), KL the step's loss/kl "
        "(its --kl-estimator's token mean), n its rows; logged as kl_coef. 'none': a fixed coefficient.",
        low=0,
        low_open=True,
    )
    kl_horizon: float = _field(
        10_000, "Adaptive KL: the horizon (in rows) of --kl-target's controller.", low=0, low_open=True
    )
    entropy_coef: float = _field(
        0.0,
        "Entropy bonus: -c H_t added to each token's loss (the --entropy-quantile tokens only) and "
        "aggregated with it; 0 disables it. The policy's entropy is logged as loss/entropy/*.",
        low=0,
    )
    log_entropy: bool = _field(
        True,
        "Log the policy's per-token entropy, loss/entropy/{mean,min,max}, from the learner's forward (about a hundredth "
        "of its time on the CPU; on CUDA it runs the PyTorch tiles, not the Triton kernels); "
        "--no-log-entropy skips it unless --entropy-coef or --entropy-quantile needs it.",
        resumable=True,
    )
    entropy_quantile: float = _field(
        1.0,
        "Train on the high-entropy tokens only: keep the policy loss on this fraction of each mini-batch's "
        "active tokens with the highest entropy (arXiv 2506.01939); 1 keeps every token.",
        low=0,
        high=1,
    )
    advantages: str = _field(
        "group",
        "Advantage estimator: group (R - group mean, scaled by --advantage-scale: GRPO) | rloo (R - mean of "
        "the other G-1) | reinforce++ (R - group mean, whitened over the rollout's tokens) | passk (Pass@k "
        "training: the best-of-k subsets' advantage, --passk-k).",
    )
    advantage_scale: str | None = _field(
        None,
        "Advantage scaling of --advantages group or rloo: group (the group's reward std: GRPO) | batch (the "
        "rollout's) | none (Dr. GRPO) (default: group for group, none for rloo; reinforce++ and passk "
        "normalise themselves and refuse it).",
    )
    passk_k: int | None = _field(
        None, "--advantages passk: k, the size of the subsets (1 <= k < --group-size).", low=1
    )
    # --- staleness
    staleness: int = _field(
        8,
        "Synchronous staleness N: one rollout of N x m prompts, then N optimizer steps on disjoint mini-batches (N = 1 is on-policy).",
        low=1,
    )
    mode: str = _field(
        "sync", "sync (staleness N) | async (a concurrent rollout worker lagging by at most --max-lag steps)."
    )
    max_lag: int = _field(
        2,
        "Async: the most optimizer steps the worker's weights may lag the learner (K) at a fetched "
        "batch's first update.",
        low=0,
    )
    proximal: str = _field(
        "none",
        "Async: the decoupled objective (AReaL). none: old = the behaviour policy. recompute: old = "
        "pi_prox, the policy before the fetched batch's first update (one no-grad forward when it is "
        "fetched; with --updates-per-batch U held over its U updates, else the policy before this "
        "update), and an uncapped IS weight pi_prox / behaviour (or the IS correction given in "
        "--correction). loglinear: the same, with log pi_prox = log mu + alpha (log pi_theta - log mu), "
        "alpha from policy versions (= 1 on a batch's first update: exact, no extra forward). held: "
        "pi_prox is a snapshot of the policy refreshed every --proximal-every updates (saved in "
        "checkpoints), so the clip bounds the movement since the snapshot, not since the last update.",
    )
    proximal_every: int = _field(
        0,
        "--proximal held: refresh the pi_prox snapshot every this many updates (M >= 1; M = --max-lag "
        "holds the anchor over K steps).",
        low=0,
    )
    updates_per_batch: int = _field(
        1,
        "Async: optimizer updates per fetched batch, U (AReaL's ppo_n_minibatches): the worker samples "
        "U x m prompts with one version of the weights, split into U mini-batches of m prompts taken at "
        "consecutive steps; --proximal recompute takes pi_prox once, when the batch is fetched, and holds "
        "it over its U updates. --max-lag bounds the lag of a batch's first update (update u lags u more). "
        "Sync mode splits rollouts by --staleness N.",
        low=1,
    )
    lag_schedule: list = field(
        default_factory=list,
        metadata={
            "help": "Async, deterministic variant: a fixed lag per step (>= 0), cycled and capped by K (e.g. "
            "'0,1,2'); no concurrency.",
            "low": 0,
        },
    )
    old_logprobs: str | None = _field(
        None,
        "Where pi_old comes from. recompute: the learner's own no-grad forward of each rollout before "
        "any update (N = 1: the update's own detached log-probs). sampler: the log-probs the sampler "
        "recorded, no behaviour forward (verl's bypass mode); the ratio then carries the "
        "train/inference mismatch and kl_mismatch is not logged. Default: recompute in sync mode; "
        "async mode always takes the sampler's.",
    )
    mismatch: str = _field(
        "none",
        "Train/inference mismatch: sample and score rollouts with other numerics (bf16 | fp16 autocast) than the "
        "fp32 learner, or logit-noise:SIGMA (a fixed N(0, SIGMA^2) draw per vocabulary entry, from --seed, added "
        "to every logit the sampler computes: a perturbed sampler; the learner scores the clean policy).",
    )
    # --- precision and memory
    dtype: str = _field(
        "fp32", "Weights' dtype: fp32 | bf16 (bf16 halves memory; sampling and learning both use it)."
    )
    gradient_checkpointing: bool = _field(
        False, "Recompute activations in the backward pass (less memory, about a third more compute)."
    )
    micro_batch_size: int = _field(
        0,
        "Rows per forward/backward in the update (0: the whole mini-batch); exact: the loss keeps the "
        "mini-batch's global normalisers.",
        low=0,
    )
    # --- batch shape
    group_size: int = _field(8, "G, completions per prompt (group-relative advantages need >= 2).", low=2)
    prompts_per_step: int = _field(
        32,
        "m, prompts per optimizer step (mini-batch); a sync rollout holds N x m prompts, N x m x G completions "
        "(at most 2^20; (K + 1) x m x G in async mode). Alias: --prompts-per-rollout.",
        low=1,
    )
    max_new_tokens: int | None = _field(
        None,
        "Most tokens sampled per completion (end of sequence included) (default: 6 for the embedded "
        "model, whose answers are short; 256 for --model, room for a chat model's reply). A completion "
        "cut at the limit has no end token and usually scores 0: the trainer warns once when most are. "
        f"At most {limits.MAX_NEW_TOKENS}.",
        low=1,
        high=limits.MAX_NEW_TOKENS,
    )
    temperature: float = _field(
        1.0, "Sampling temperature (the learner scales logits by it too).", low=0, low_open=True
    )
    top_k: int | None = _field(
        None,
        "Sample from the k most likely tokens only; the learner scores the same truncated policy.",
        low=1,
    )
    top_p: float | None = _field(
        None,
        "Sample from the smallest set of tokens holding probability >= p (nucleus); the learner "
        "scores the same truncated policy.",
        low=0,
        low_open=True,
        high=1,
    )
    # --- DAPO's rollout rules (dapo.py)
    filter_groups: bool = _field(
        False,
        "Dynamic sampling (DAPO; verl's filter_groups): drop every group whose G rewards are all "
        "equal (zero advantage) and sample more groups until the rollout is full, in sync and async "
        "mode; the rewards compared are those the advantages use (--overlong-penalty included).",
    )
    filter_groups_max_draws: int = _field(
        10,
        "--filter-groups: the most generation passes per rollout, the first included; when they "
        "leave too few groups, the rollout is filled up with dropped groups (zero advantage) and the "
        "trainer warns once.",
        low=1,
    )
    mask_truncated: bool = _field(
        False,
        "Completions cut at --max-new-tokens (no end token) add no loss: their completion mask is "
        "zeroed, while their rewards still count in their group (TRL's mask_truncated_completions).",
    )
    overlong_penalty: list[float] = field(
        default_factory=list,
        metadata={
            "help": "DAPO's soft overlong punishment 'L_cache,penalty': a completion of L sampled tokens "
            "(end token included) gets -penalty * (L - (L_max - L_cache)) / L_cache added to its reward "
            "when L > L_max - L_cache, L_max = --max-new-tokens (-penalty at the limit; verl's "
            "overlong_buffer len and penalty_factor). Empty: off."
        },
    )
    # --- optimisation
    lr: float = _field(3e-4, "AdamW learning rate.", low=0, low_open=True)
    weight_decay: float = _field(0.0, "AdamW weight decay.", low=0)
    warmup_steps: int = _field(0, "Linear learning-rate warm-up steps (then constant).", low=0)
    max_grad_norm: float = _field(1.0, "Gradient clipping norm (0 disables clipping).", low=0)
    max_steps: int = _field(512, "Optimizer steps of RL.", low=0, resumable=True)
    max_nonfinite: int = _field(
        5,
        "Stop (with a checkpoint) after this many non-finite losses or gradients in a row.",
        low=1,
        resumable=True,
    )
    seed: int = _field(
        0, "Random seed (model init, problems, sampling), 0 to 2^32 - 1.", low=0, high=limits.MAX_SEED
    )
    num_threads: int = _field(
        1,
        f"torch intra-op CPU threads (a tiny model gains little from more; 0 keeps torch's default; at most "
        f"{limits.MAX_THREADS}).",
        low=0,
        high=limits.MAX_THREADS,
        resumable=True,
    )
    device: str = _field(
        "auto",
        "Device of a one-process run: auto (cuda when available, else cpu) | cpu | cuda | cuda:N. "
        "Under torchrun each rank takes cuda:LOCAL_RANK when CUDA is available, else the CPU.",
        resumable=True,
    )
    # --- distributed (under torchrun; see docs/distributed.md)
    fsdp: bool = _field(
        False,
        "Under torchrun: shard the model with FSDP2 (fully_shard) instead of replicating it with DDP; sync mode only.",
        resumable=True,  # the same update, sharded (a checkpoint resumes with any layout)
    )
    # --- evaluation, logging, checkpoints
    eval_every: int = _field(
        32,
        "Greedy held-out accuracy every this many steps (0: only before and after).",
        low=0,
        resumable=True,
    )
    samples_every: int = _field(
        0,
        "Also write sampled training completions to samples.jsonl every this many steps "
        "(0: only the greedy held-out ones at each evaluation).",
        low=0,
        resumable=True,
    )
    num_samples: int = _field(4, "Completions written to samples.jsonl each time.", low=0, resumable=True)
    eval_size: int = _field(
        512,
        f"Held-out problems for evaluation (the task must have more distinct problems; at most {limits.MAX_EVAL_SIZE}).",
        low=1,
        high=limits.MAX_EVAL_SIZE,
    )
    save_every: int = _field(
        64, "Checkpoint every this many steps (0: only at the end).", low=0, resumable=True
    )
    keep_checkpoints: int = _field(2, "Most recent checkpoints kept.", low=1, resumable=True)
    output_dir: str | None = _field(
        None,
        "Run directory, owned by this run: a new run refuses one that already holds a run "
        "(default: runs/<time>-<method>-N<staleness>-seed<seed>-<random suffix>).",
    )
    resume: str | None = _field(
        None,
        "Resume the run in this directory (or in the run directory of this checkpoint directory) from its "
        "latest complete checkpoint, with its own stored config; only the fields marked 'may change on "
        "resume' may be given differently.",
    )
    report_to: str = _field(
        "none", "Extra metrics sink: none | tensorboard (metrics.jsonl is always written).", resumable=True
    )
    progress: bool = _field(
        True,
        "Show a live progress bar (--no-progress: a plain line every few steps instead, for log files).",
        resumable=True,
    )

    # ------------------------------------------------------------------ YAML
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"config: unknown field(s) {unknown}; known fields: {sorted(names)}")
        return cls(**{key: coerce(cls, key, value) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(load_yaml_mapping(path))

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def resolved(self) -> TrainConfig:
        """A copy with the defaults that depend on other fields filled in (``effective_*``, the
        reward: ``tasks.default_reward``): what a run trains with and records in ``config.yaml``,
        so a rerun or a resume from it uses the same values whatever the defaults become."""
        return self.replace(
            reward=self.reward if self.reward is not None else default_reward(self),
            sft_steps=self.effective_sft_steps,
            max_new_tokens=self.effective_max_new_tokens,
            advantage_scale=self.effective_advantage_scale,
            old_logprobs=self.effective_old_logprobs,
        )

    # ------------------------------------------------------------------ checks
    def validate(self) -> TrainConfig:
        """Check every field; raise ``ValueError`` naming the first bad one. Returns self."""

        def need(condition: bool, name: str, message: str) -> None:
            if not condition:
                raise ValueError(f"{name}: {message} (got {getattr(self, name)!r})")

        for f in dataclasses.fields(self):
            check_field_value(f, getattr(self, f.name))
        for module in ("transformers", "tokenizers"):  # the train extra (a core-only install has neither)
            require(module, "the trainer")
        need(self.method in METHODS, "method", f"unknown method; choose one of {sorted(METHODS)}")
        need(self.mode in MODES, "mode", f"choose one of {MODES}")
        check_proximal_options(self, need)
        need(self.level is None or self.level in LEVELS, "level", f"choose one of {LEVELS}")
        need(self.aggregation in AGGREGATIONS, "aggregation", f"choose one of {AGGREGATIONS}")
        self._check_old_logprobs(need)
        limits.check_overlong_penalty(self)
        parse_mismatch(self.mismatch)  # none | bf16 | fp16 | logit-noise:SIGMA, or a ValueError naming it
        need(self.report_to in REPORT_TO, "report_to", f"choose one of {REPORT_TO}")
        if self.report_to == "tensorboard":  # asked for: refused before any work, not after
            require("tensorboard", "--report-to tensorboard", name="report_to")
        check_advantage_options(self, need)
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"choose one of {KL_ESTIMATORS}")
        need(
            self.kl_target is None or self.kl_coef > 0,
            "kl_target",
            "the adaptive KL controller starts from --kl-coef and scales it, so it needs --kl-coef > 0",
        )
        check_device(self.device)
        need(
            not (self.fsdp and self.mode == "async"),
            "fsdp",
            "FSDP2 is supported in sync mode only (an async rollout worker needs a full replica of the "
            "weights); use DDP for async mode (drop --fsdp) or --mode sync",
        )
        need(self.dtype in DTYPES, "dtype", f"choose one of {tuple(DTYPES)}")
        if self.dataset is not None:
            need(Path(self.dataset).exists(), "dataset", "no such file or directory")
        check_task(self)
        if self.model is not None:
            check_causal_lm_directory(self.model)
        if self.resume is not None:
            need(Path(self.resume).is_dir(), "resume", "not a directory")
        limits.check_options(self)  # directories to create, reward specs, the rollout's size
        return self

    @property
    def effective_advantage_scale(self) -> str | None:
        """``advantage_scale`` when given; else ``group`` for ``--advantages group`` (GRPO), ``none``
        for ``rloo`` (RLOO as published), None for the estimators that normalise themselves."""
        if self.advantage_scale is not None:
            return self.advantage_scale
        return {"group": "group", "rloo": "none"}.get(self.advantages)

    def _check_old_logprobs(self, need) -> None:
        """``--old-logprobs``: a known source; async mode's pi_old is the sampler's; a correction that
        compares pi_old with the sampler's log-probs has nothing to weigh when they are the same."""
        need(
            self.old_logprobs is None or self.old_logprobs in OLD_LOGPROBS,
            "old_logprobs",
            f"choose one of {OLD_LOGPROBS}",
        )
        need(
            not (self.mode == "async" and self.old_logprobs == "recompute"),
            "old_logprobs",
            "async mode takes pi_old from the sampler (the worker's own log-probs); for an anchor "
            "recomputed by the learner use --proximal recompute",
        )
        compared = {part.partition(":")[0].strip() for part in (self.correction or "").split("+")}
        bypass = self.mode == "sync" and self.old_logprobs == "sampler"
        need(
            not (bypass and compared & {"tis", "mis", "reject"}),
            "old_logprobs",
            "with --old-logprobs sampler pi_old is the sampler's log-probs, so --correction tis, mis or "
            "reject would weigh pi_old/mu = 1 (no effect); the ratio pi_theta/mu already carries the "
            "mismatch (verl's bypass mode with ppo_clip): drop them (opsm still applies)",
        )

    @property
    def effective_old_logprobs(self) -> str:
        """``old_logprobs`` when given; else ``recompute`` in sync mode and ``sampler`` in async
        mode (whose pi_old is the worker's log-probs). Read this, never the field."""
        if self.old_logprobs is not None:
            return self.old_logprobs
        return "sampler" if self.mode == "async" else "recompute"

    @property
    def uses_embedded_model(self) -> bool:
        return self.model is None

    @property
    def effective_sft_steps(self) -> int:
        if self.sft_steps is not None:
            return self.sft_steps
        return EMBEDDED_SFT_STEPS if self.uses_embedded_model else 0

    @property
    def effective_max_new_tokens(self) -> int:
        """``max_new_tokens`` when given; else 6 for the embedded model (a 3-digit sum, its end
        token and a spare) and 256 for ``--model`` (a chat model's reply: with 6, every completion
        was cut, so every reward and gradient was 0). Read this, never the field."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return EMBEDDED_MAX_NEW_TOKENS if self.uses_embedded_model else MODEL_MAX_NEW_TOKENS


RESUMABLE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("resumable"))

__all__ = ["RESUMABLE_FIELDS", "TrainConfig", "check_causal_lm_directory", "resolve_device"]
