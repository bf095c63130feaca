"""The trainer's configuration: one dataclass (YAML and command-line parsing in ``options.py``).

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

from softtrust.aggregation import AGGREGATIONS
from softtrust.methods import METHODS
from softtrust.ratios import LEVELS

# The YAML / command-line side (options.py) imports this module only inside its functions;
# its names stay importable from here.
from .options import (
    _coerce,
    add_config_arguments,
    check_field_value,
    config_from_arguments,
    load_resume_config,
    load_yaml_mapping,
    parse_key_values,
    resume_config,
)

MODES = ("sync", "async")
PROXIMAL = ("none", "recompute", "loglinear")
MISMATCH = ("none", "bf16", "fp16")
REPORT_TO = ("none", "tensorboard")
ADVANTAGE_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
        "Warm-start steps of supervised training (default: 300 for the embedded model, 0 for --model).",
        low=0,
    )
    sft_target_accuracy: float | None = _field(
        None,
        "Stop the warm start as soon as greedy accuracy on a validation set (256 problems, disjoint "
        "from the held-out set, checked every 10 steps) reaches this value; --sft-steps is then "
        "the maximum. Makes warm starts of different seeds comparable.",
        low=0,
        low_open=True,
        high=1,
    )
    sft_lr: float = _field(2e-3, "Warm-start learning rate.", low=0, low_open=True)
    sft_batch_size: int = _field(64, "Warm-start problems per step.", low=1)
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
        "Behaviour correction: tis | mis | opsm | reject, with parameters, e.g. 'tis:cap=2,level=token' or "
        "'reject:divergence=k3,level=sequence-mean,high=0.01'; join one IS correction (tis, mis) with opsm "
        "and/or reject by '+', e.g. 'tis:cap=2+reject:divergence=ratio,low=0.999,high=1.001'; 'none' is no bound.",
    )
    kl_coef: float = _field(
        0.0, "KL penalty coefficient towards the initial (warm-start) policy; 0 disables it.", low=0
    )
    kl_estimator: str = _field("k3", "KL estimator: k1 | k2 | k3.")
    advantage_scale: str = _field("group", "Advantage scaling: group (GRPO) | batch | none (Dr. GRPO).")
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
        2, "Async: the most optimizer steps the worker's weights may lag the learner (K).", low=0
    )
    proximal: str = _field(
        "none",
        "Async: the decoupled objective (AReaL). none: old = the behaviour policy. recompute: old = "
        "pi_prox, the policy before this update, from a no-grad forward, and an uncapped IS weight "
        "pi_prox / behaviour (or the IS correction given in --correction). loglinear: the same, with "
        "log pi_prox = log mu + alpha (log pi_theta - log mu), alpha from policy versions (= 1 here: "
        "exact, no extra forward).",
    )
    lag_schedule: list = field(
        default_factory=list,
        metadata={
            "help": "Async, deterministic variant: a fixed lag per step, cycled and capped by K (e.g. '0,1,2'); "
            "no concurrency."
        },
    )
    mismatch: str = _field(
        "none",
        "Train/inference mismatch: score rollouts with other numerics (bf16 | fp16 autocast) than the fp32 learner.",
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
        "m, prompts per optimizer step (mini-batch); a sync rollout holds N x m prompts. Alias: --prompts-per-rollout.",
        low=1,
    )
    max_new_tokens: int = _field(6, "Most tokens sampled per completion (end of sequence included).", low=1)
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
    # --- optimisation
    lr: float = _field(3e-4, "AdamW learning rate.", low=0, low_open=True)
    weight_decay: float = _field(0.0, "AdamW weight decay.", low=0)
    warmup_steps: int = _field(0, "Linear learning-rate warm-up steps (then constant).", low=0)
    max_grad_norm: float = _field(1.0, "Gradient clipping norm (0 disables clipping).", low=0)
    max_steps: int = _field(128, "Optimizer steps of RL.", low=0, resumable=True)
    max_nonfinite: int = _field(
        5,
        "Stop (with a checkpoint) after this many non-finite losses or gradients in a row.",
        low=1,
        resumable=True,
    )
    seed: int = _field(0, "Random seed (model init, problems, sampling).", low=0)
    num_threads: int = _field(
        1,
        "torch intra-op CPU threads (a tiny model gains little from more; 0 keeps torch's default).",
        low=0,
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
        512, "Held-out problems for evaluation (the task must have more distinct problems).", low=1
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
    progress: bool = _field(True, "Show a live progress bar.", resumable=True)

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
        return cls(**{key: _coerce(cls, key, value) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(load_yaml_mapping(path))

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checks
    def validate(self) -> TrainConfig:
        """Check every field; raise ``ValueError`` naming the first bad one. Returns self."""

        def need(condition: bool, name: str, message: str) -> None:
            if not condition:
                raise ValueError(f"{name}: {message} (got {getattr(self, name)!r})")

        for f in dataclasses.fields(self):
            check_field_value(f, getattr(self, f.name))
        need(self.method in METHODS, "method", f"unknown method; choose one of {sorted(METHODS)}")
        need(self.mode in MODES, "mode", f"choose one of {MODES}")
        need(self.proximal in PROXIMAL, "proximal", f"choose one of {PROXIMAL}")
        need(
            self.proximal == "none" or self.mode == "async",
            "proximal",
            "the decoupled objective is for --mode async (there the behaviour policy is the rollout "
            "worker's); in sync mode use --proximal none",
        )
        need(
            self.proximal == "none" or self.method != "m2po",
            "proximal",
            "M2PO computes d = log pi_old - log pi_prox with old = the behaviour policy; the decoupled "
            "objective sets old = pi_prox, so d = 0 and nothing would be masked. Use --proximal none with "
            "m2po (its second-moment mask is its own off-policy treatment)",
        )
        need(
            self.proximal == "none" or not self.micro_batch_size,
            "proximal",
            "the decoupled objective takes the whole mini-batch in one forward; drop --micro-batch-size",
        )
        need(self.level is None or self.level in LEVELS, "level", f"choose one of {LEVELS}")
        need(self.aggregation in AGGREGATIONS, "aggregation", f"choose one of {AGGREGATIONS}")
        need(self.mismatch in MISMATCH, "mismatch", f"choose one of {MISMATCH}")
        need(self.report_to in REPORT_TO, "report_to", f"choose one of {REPORT_TO}")
        need(self.advantage_scale in ADVANTAGE_SCALES, "advantage_scale", f"choose one of {ADVANTAGE_SCALES}")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"choose one of {KL_ESTIMATORS}")
        need(_known_device(self.device), "device", "choose auto, cpu, cuda or cuda:N")
        need(
            not self.device.startswith("cuda") or torch.cuda.is_available(),
            "device",
            "CUDA was asked for but torch.cuda.is_available() is False (a CPU build of torch, or no GPU); "
            "pass --device cpu (also to resume a GPU run here)",
        )
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
        from .loss_config import build_method_loss

        build_method_loss(self)  # unknown method parameters, levels or corrections fail here
        return self

    @property
    def uses_embedded_model(self) -> bool:
        return self.model is None

    @property
    def effective_sft_steps(self) -> int:
        if self.sft_steps is not None:
            return self.sft_steps
        return 300 if self.uses_embedded_model else 0


def check_task(config: TrainConfig) -> None:
    """The task the config trains on exists, and ``task_config`` applies to it: a reasoning-gym
    generator's name and options are checked here (``reasoning_gym_task.check_options``), before
    any work. Raises ``ValueError`` naming ``task`` or ``task_config``."""
    from .tasks import REASONING_GYM, TASKS

    if config.dataset is None and config.task.startswith(REASONING_GYM):
        from .reasoning_gym_task import check_options

        check_options(config.task[len(REASONING_GYM) :], config.task_config)
        return
    if config.task_config:
        used = "--dataset" if config.dataset is not None else f"task {config.task!r}"
        raise ValueError(
            f"task_config: options of a reasoning-gym generator, for --task {REASONING_GYM}NAME; this run "
            f"uses {used} (got {config.task_config!r})"
        )
    if config.dataset is None and config.task not in TASKS:
        raise ValueError(
            f"task: unknown task {config.task!r}; expected a built-in task {sorted(TASKS)} or "
            f"{REASONING_GYM}NAME (a reasoning-gym generator)"
        )


def check_causal_lm_directory(path: str) -> None:
    """Fail with a message naming ``model`` unless ``path`` holds a causal LM config and a tokenizer."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"model: {path!r} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as error:
        raise ValueError(f"model: cannot read the config in {path!r} ({error})") from error
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model: {path!r} holds a {config.model_type!r} model, which is not a causal LM")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / name).is_file() for name in tokenizer_files):
        raise ValueError(
            f"model: {path!r} has no tokenizer files (save the tokenizer with save_pretrained too)"
        )


# ---------------------------------------------------------------------- command line
def _known_device(device: str) -> bool:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    return device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())


def resolve_device(device: str) -> torch.device:
    """The ``torch.device`` of a one-process run: ``auto`` is ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


RESUMABLE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("resumable"))

__all__ = [
    "RESUMABLE_FIELDS",
    "TrainConfig",
    "add_config_arguments",
    "check_causal_lm_directory",
    "config_from_arguments",
    "load_resume_config",
    "load_yaml_mapping",
    "parse_key_values",
    "resolve_device",
    "resume_config",
]
