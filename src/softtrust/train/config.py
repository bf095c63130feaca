"""The trainer's configuration: one dataclass, a YAML file, command-line overrides.

Every field carries its help text in its metadata; ``softtrust train --help`` is built
from them, so the documentation cannot drift from the code. Precedence: field default
< ``--config FILE.yaml`` < command-line flags. ``TrainConfig.validate()`` checks every
value before any work and names the offending field.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from softtrust.aggregation import AGGREGATIONS
from softtrust.methods import METHODS
from softtrust.ratios import LEVELS

MODES = ("sync", "async")
CORRECTIONS = ("tis", "mis", "opsm")
MISMATCH = ("none", "bf16", "fp16")
REPORT_TO = ("none", "tensorboard")
ADVANTAGE_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _field(default, help: str):
    """A dataclass field (immutable default) whose help text is kept for ``--help``."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Everything a ``softtrust train`` run needs (saved as ``config.yaml`` in the run directory)."""

    # --- task and model
    task: str = _field(
        "addition", "Built-in task (addition, addition-1digit, scratchpad); ignored when --dataset is given."
    )
    dataset: str | None = _field(None, "A JSONL file with 'prompt' and 'answer' fields (replaces --task).")
    reward: str = _field("exact", "Reward for --dataset: exact | numeric | module:function.")
    strict_reward: bool = _field(
        False, "Re-raise reward-function errors instead of scoring 0 and counting them."
    )
    model: str | None = _field(
        None, "A local Hugging Face causal LM directory with its tokenizer; default: the embedded tiny Qwen2."
    )
    # --- supervised warm start (cached under the cache directory, keyed by its config)
    sft_steps: int | None = _field(
        None, "Warm-start steps of supervised training (default: 300 for the embedded model, 0 for --model)."
    )
    sft_target_accuracy: float | None = _field(
        None,
        "Stop the warm start as soon as greedy accuracy on a validation set (256 problems, disjoint "
        "from the held-out set, checked every 10 steps) reaches this value; --sft-steps is then "
        "the maximum. Makes warm starts of different seeds comparable.",
    )
    sft_lr: float = _field(2e-3, "Warm-start learning rate.")
    sft_batch_size: int = _field(64, "Warm-start problems per step.")
    cache_dir: str | None = _field(
        None, "Where warm starts are cached (default: $SOFTTRUST_CACHE or ~/.cache/softtrust)."
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
        None, "Ratio level: token | sequence-mean | sequence-sum (default: the method's own)."
    )
    aggregation: str = _field("token-mean", "Loss aggregation: " + " | ".join(AGGREGATIONS) + ".")
    correction: str | None = _field(
        None, "Behaviour correction: tis | mis | opsm, with parameters, e.g. 'tis:cap=2,level=token'."
    )
    kl_coef: float = _field(
        0.0, "KL penalty coefficient towards the initial (warm-start) policy; 0 disables it."
    )
    kl_estimator: str = _field("k3", "KL estimator: k1 | k2 | k3.")
    advantage_scale: str = _field("group", "Advantage scaling: group (GRPO) | batch | none (Dr. GRPO).")
    # --- staleness
    staleness: int = _field(
        8,
        "Synchronous staleness N: one rollout of N x m prompts, then N optimizer steps on disjoint mini-batches (N = 1 is on-policy).",
    )
    mode: str = _field(
        "sync", "sync (staleness N) | async (a concurrent rollout worker lagging by at most --max-lag steps)."
    )
    max_lag: int = _field(2, "Async: the most optimizer steps the worker's weights may lag the learner (K).")
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
    # --- batch shape
    group_size: int = _field(8, "G, completions per prompt.")
    prompts_per_step: int = _field(
        32,
        "m, prompts per optimizer step (mini-batch); a sync rollout holds N x m prompts. Alias: --prompts-per-rollout.",
    )
    max_new_tokens: int = _field(6, "Most tokens sampled per completion (end of sequence included).")
    temperature: float = _field(1.0, "Sampling temperature (the learner scales logits by it too).")
    # --- optimisation
    lr: float = _field(3e-4, "AdamW learning rate.")
    weight_decay: float = _field(0.0, "AdamW weight decay.")
    warmup_steps: int = _field(0, "Linear learning-rate warm-up steps (then constant).")
    max_grad_norm: float = _field(1.0, "Gradient clipping norm (0 disables clipping).")
    max_steps: int = _field(128, "Optimizer steps of RL.")
    max_nonfinite: int = _field(
        5, "Stop (with a checkpoint) after this many non-finite losses or gradients in a row."
    )
    seed: int = _field(0, "Random seed (model init, problems, sampling).")
    num_threads: int = _field(
        1, "torch intra-op CPU threads (a tiny model gains little from more; 0 keeps torch's default)."
    )
    device: str = _field(
        "auto",
        "Device of a one-process run: auto (cuda when available, else cpu) | cpu | cuda | cuda:N. "
        "Under torchrun each rank takes cuda:LOCAL_RANK when CUDA is available, else the CPU.",
    )
    # --- distributed (under torchrun; see docs/distributed.md)
    fsdp: bool = _field(
        False,
        "Under torchrun: shard the model with FSDP2 (fully_shard) instead of replicating it with DDP; sync mode only.",
    )
    # --- evaluation, logging, checkpoints
    eval_every: int = _field(32, "Greedy held-out accuracy every this many steps (0: only before and after).")
    eval_size: int = _field(512, "Held-out problems for evaluation.")
    save_every: int = _field(64, "Checkpoint every this many steps (0: only at the end).")
    keep_checkpoints: int = _field(2, "Most recent checkpoints kept.")
    output_dir: str | None = _field(None, "Run directory (default: runs/<timestamp>-<method>-N<staleness>).")
    resume: str | None = _field(
        None, "Resume from a run directory (its latest checkpoint) or a checkpoint directory."
    )
    report_to: str = _field(
        "none", "Extra metrics sink: none | tensorboard (metrics.jsonl is always written)."
    )
    progress: bool = _field(True, "Show a live progress bar.")

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
        values = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"config: {path} must hold a mapping of field: value")
        return cls.from_dict(values)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checks
    def validate(self) -> TrainConfig:
        """Check every field; raise ``ValueError`` naming the first bad one. Returns self."""

        def need(condition: bool, name: str, message: str) -> None:
            if not condition:
                raise ValueError(f"{name}: {message} (got {getattr(self, name)!r})")

        need(self.method in METHODS, "method", f"unknown method; choose one of {sorted(METHODS)}")
        need(self.staleness >= 1, "staleness", "N must be >= 1")
        need(self.max_lag >= 0, "max_lag", "K must be >= 0")
        need(all(int(lag) >= 0 for lag in self.lag_schedule), "lag_schedule", "lags must be >= 0")
        need(
            self.group_size >= 2,
            "group_size",
            "group-relative advantages need at least 2 completions per prompt",
        )
        need(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        need(self.mode in MODES, "mode", f"choose one of {MODES}")
        need(self.level is None or self.level in LEVELS, "level", f"choose one of {LEVELS}")
        need(self.aggregation in AGGREGATIONS, "aggregation", f"choose one of {AGGREGATIONS}")
        need(
            self.correction is None or self.correction.split(":")[0] in CORRECTIONS,
            "correction",
            f"choose one of {CORRECTIONS}",
        )
        need(self.mismatch in MISMATCH, "mismatch", f"choose one of {MISMATCH}")
        need(self.report_to in REPORT_TO, "report_to", f"choose one of {REPORT_TO}")
        need(self.advantage_scale in ADVANTAGE_SCALES, "advantage_scale", f"choose one of {ADVANTAGE_SCALES}")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"choose one of {KL_ESTIMATORS}")
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        need(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        need(self.temperature > 0, "temperature", "sampling needs a temperature > 0")
        need(self.lr > 0, "lr", "must be > 0")
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")
        need(self.max_steps >= 0, "max_steps", "must be >= 0")
        need(self.num_threads >= 0, "num_threads", "must be >= 0")
        need(_known_device(self.device), "device", "choose auto, cpu, cuda or cuda:N")
        need(
            not self.device.startswith("cuda") or torch.cuda.is_available(),
            "device",
            "CUDA was asked for but torch.cuda.is_available() is False (a CPU build of torch, or no GPU); "
            "pass --device cpu (also to resume a GPU run here)",
        )
        need(self.max_nonfinite >= 1, "max_nonfinite", "must be >= 1")
        need(
            self.eval_every >= 0 and self.save_every >= 0,
            "eval_every" if self.eval_every < 0 else "save_every",
            "must be >= 0",
        )
        need(self.eval_size >= 1, "eval_size", "must be >= 1")
        need(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        need(self.sft_steps is None or self.sft_steps >= 0, "sft_steps", "must be >= 0")
        need(
            self.sft_target_accuracy is None or 0 < self.sft_target_accuracy <= 1,
            "sft_target_accuracy",
            "must be in (0, 1]",
        )
        need(
            not (self.fsdp and self.mode == "async"),
            "fsdp",
            "FSDP2 is supported in sync mode only (an async rollout worker needs a full replica of the "
            "weights); use DDP for async mode (drop --fsdp) or --mode sync",
        )
        if self.dataset is not None:
            need(Path(self.dataset).is_file(), "dataset", "not a file")
        if self.model is not None:
            check_causal_lm_directory(self.model)
        if self.resume is not None:
            need(Path(self.resume).is_dir(), "resume", "not a directory")
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


def parse_key_values(text: str, name: str) -> dict:
    """``'a=1,b=x'`` -> ``{'a': 1, 'b': 'x'}``, values read as YAML scalars."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{name}: expected key=value pairs separated by commas, got {text!r}")
        values[key.strip()] = yaml.safe_load(value)
    return values


def build_correction(spec: str | None):
    """``'tis:cap=2,level=token'`` -> ``softtrust.TIS(cap=2, level='token')`` (or MIS, OPSM)."""
    if spec is None:
        return None
    import softtrust as st

    name, _, params = spec.partition(":")
    classes = {"tis": "TIS", "mis": "MIS", "opsm": "OPSM"}
    if name not in classes:
        raise ValueError(f"correction: unknown correction {name!r}; choose one of {sorted(classes)}")
    try:
        return getattr(st, classes[name])(**parse_key_values(params, "correction"))
    except TypeError as error:
        raise ValueError(f"correction: {error}") from error


def build_method_loss(config: TrainConfig):
    """The ``softtrust.PolicyLoss`` the config describes."""
    import softtrust as st

    kl = st.KL(coef=config.kl_coef, estimator=config.kl_estimator) if config.kl_coef > 0 else None
    try:
        return st.PolicyLoss(
            config.method,
            level=config.level,
            correction=build_correction(config.correction),
            aggregation=config.aggregation,
            kl=kl,
            # T_max of seq-mean-token-sum-norm: the configured maximum, so that ranks and
            # mini-batches with different padded lengths share one normaliser
            max_completion_length=config.max_new_tokens,
            **config.method_params,
        )
    except (TypeError, ValueError) as error:
        if str(error).split(":")[0] in {"method", "level", "correction", "aggregation", "kl"}:
            raise
        raise ValueError(
            f"method_params: {config.method} rejects {config.method_params} ({error})"
        ) from error


# ---------------------------------------------------------------------- command line
def _known_device(device: str) -> bool:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    return device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())


def resolve_device(device: str) -> torch.device:
    """The ``torch.device`` of a one-process run: ``auto`` is ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _field_kind(cls, name: str):
    """The field's base type: int, float, str, bool, list or dict (Optional unwrapped)."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.get_origin(hint) or hint


def _coerce(cls, name: str, value):
    """A YAML or command-line value as the field's type (strings are parsed)."""
    kind = _field_kind(cls, name)
    if value is None:
        return None
    if kind is dict:
        return parse_key_values(value, name) if isinstance(value, str) else dict(value)
    if kind is list:
        if isinstance(value, str):
            return [int(part) for part in value.split(",") if part.strip()]
        return [int(part) for part in value]
    if kind is bool:
        if isinstance(value, str):
            lowered = value.lower()
            if lowered not in {"true", "false", "1", "0", "yes", "no"}:
                raise ValueError(f"{name}: expected true or false, got {value!r}")
            return lowered in {"true", "1", "yes"}
        return bool(value)
    if kind in (int, float):
        try:
            number = kind(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from error
        return number
    return str(value)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``TrainConfig`` field (help from the field), plus ``--config``."""
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="Read fields from a YAML file; flags override it."
    )
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = _field_kind(TrainConfig, f.name)
        flags = [_flag(f.name)]
        if f.name == "prompts_per_step":
            flags.append("--prompts-per-rollout")
        help_text = f"{f.metadata['help']} [default: {default!r}]"
        if kind is bool:
            parser.add_argument(
                *flags,
                dest=f.name,
                default=argparse.SUPPRESS,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            metavar = {int: "INT", float: "FLOAT", dict: "K=V,...", list: "INT,..."}.get(kind, "STR")
            parser.add_argument(
                *flags, dest=f.name, default=argparse.SUPPRESS, metavar=metavar, help=help_text
            )


def config_from_arguments(arguments: argparse.Namespace) -> TrainConfig:
    """Defaults < ``--config`` YAML < flags given on the command line."""
    values = {}
    config_path = getattr(arguments, "config", None)
    if config_path is not None:
        loaded = yaml.safe_load(Path(config_path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config: {config_path} must hold a mapping of field: value")
        values.update(loaded)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({key: value for key, value in vars(arguments).items() if key in names})
    return TrainConfig.from_dict(values)
