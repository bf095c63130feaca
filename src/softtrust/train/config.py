"""The trainer's configuration: one dataclass, a YAML file, command-line overrides.

Every field carries its help text in its metadata; ``softtrust train --help`` is built
from them, so the documentation cannot drift from the code. Precedence: field default
< ``--config FILE.yaml`` < command-line flags. ``TrainConfig.validate()`` checks every
value before any work and names the offending field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
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
PROXIMAL = ("none", "recompute", "loglinear")
MISMATCH = ("none", "bf16", "fp16")
REPORT_TO = ("none", "tensorboard")
ADVANTAGE_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")


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
        None, "Ratio level: token | sequence-mean | sequence-sum (default: the method's own)."
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
        if self.dataset is not None:
            need(Path(self.dataset).is_file(), "dataset", "not a file")
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
    """``'a=1,b=x'`` -> ``{'a': 1, 'b': 'x'}``, values read as YAML scalars (and ``1e-6``,
    which PyYAML reads as text, as the number)."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{name}: expected key=value pairs separated by commas, got {text!r}")
        values[key.strip()] = _number_if_float(yaml.safe_load(value))
    return values


def _number_if_float(value):
    """A YAML string that Python reads as a float (``1e-6``, ``.5e3``) as that float; else ``value``."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


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


def _is_optional(cls, name: str) -> bool:
    hint = typing.get_type_hints(cls)[name]
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _coerce(cls, name: str, value):
    """A YAML or command-line value as the field's type, strictly: a value the flag would refuse
    is refused from YAML too (``2.7`` or ``true`` for an int, a number for a string, ...).
    Strings are parsed as the command line parses them."""
    kind = _field_kind(cls, name)
    if value is None:
        if _is_optional(cls, name):
            return None
        raise ValueError(f"{name}: expected {_kind_name(kind)}, got null")
    if kind is dict:
        if isinstance(value, str):
            return parse_key_values(value, name)
        if isinstance(value, dict):
            return dict(value)
    elif kind is list:
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)):
            return [
                _strict_int(name, item) for item in items if not (isinstance(item, str) and not item.strip())
            ]
    elif kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return BOOL_WORDS[value.lower()]
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    elif kind is int:
        return _strict_int(name, value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    raise ValueError(f"{name}: expected {_kind_name(kind)}, got {value!r} ({type(value).__name__})")


BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def _strict_int(name: str, value) -> int:
    """An int from an int or a decimal string; a bool, a float or anything else is refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{name}: expected an integer, got {value!r}")


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        kind, "key=value pairs" if kind is dict else "integers separated by commas"
    )


def check_field_value(f: dataclasses.Field, value) -> None:
    """The declared checks of one field (``_field``'s ``low``/``high``; floats finite; a path-like
    string option not empty). Raises ``ValueError`` naming the field."""
    if value is None:
        return
    name, low, high = f.name, f.metadata.get("low"), f.metadata.get("high")
    numbers = value if isinstance(value, list) else [value]
    for number in numbers:
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            if isinstance(number, str) and not number.strip() and f.default is None:  # a path option
                raise ValueError(f"{name}: must not be empty (got {value!r})")
            continue
        if not math.isfinite(number):
            raise ValueError(f"{name}: must be a finite number (got {value!r})")
        if low is not None and (number < low or (f.metadata.get("low_open") and number == low)):
            bound = f"> {low}" if f.metadata.get("low_open") else f">= {low}"
            raise ValueError(f"{name}: must be {bound} (got {value!r})")
        if high is not None and number > high:
            raise ValueError(f"{name}: must be <= {high} (got {value!r})")


def load_yaml_mapping(path: str | Path) -> dict:
    """The mapping in a YAML config file; a missing file, malformed YAML or another type is a
    ``ValueError`` naming ``config``."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"config: cannot read {str(path)!r} ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        raise ValueError(f"config: {str(path)!r} is not valid YAML ({error})") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(
            f"config: {str(path)!r} must hold a mapping of field: value, got {type(loaded).__name__}"
        )
    return loaded


RESUMABLE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("resumable"))


def resume_config(stored: TrainConfig, changes: dict, run_directory: Path) -> TrainConfig:
    """The config a resumed run continues with: its ``stored`` one, ``changes`` on top.

    ``changes``: the fields given now. Only ``RESUMABLE_FIELDS`` may differ from the stored
    values; any other difference is refused naming the field. The run keeps writing into
    ``run_directory`` (the directory resumed, whatever ``output_dir`` its config recorded).
    """
    changes = {key: _coerce(TrainConfig, key, value) for key, value in changes.items()}
    directory = str(run_directory)
    given_dir = changes.pop("output_dir", None)
    if given_dir is not None and Path(given_dir).resolve() != Path(directory).resolve():
        raise ValueError(
            f"output_dir: a resumed run writes into its own directory {directory!r}, not {given_dir!r} "
            "(copy the run directory there and resume the copy, or drop --output-dir)"
        )
    changes.pop("resume", None)
    base = stored.to_dict()
    refused = sorted(
        key for key, value in changes.items() if key not in RESUMABLE_FIELDS and value != base.get(key)
    )
    if refused:
        details = ", ".join(f"{key}={changes[key]!r} (the run has {base.get(key)!r})" for key in refused)
        raise ValueError(
            f"{refused[0]}: a resumed run continues its own config; {details} would change what it trains. "
            f"On resume only {', '.join(RESUMABLE_FIELDS)} may change; to train otherwise, start a new run "
            "in another --output-dir"
        )
    return TrainConfig.from_dict({**base, **changes, "output_dir": directory, "resume": directory})


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
        if f.metadata.get("resumable"):
            help_text += " (may change on --resume)"
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
    """Defaults < ``--config`` YAML < flags given on the command line. With ``--resume``: the
    run's stored config < the YAML and flags given (``resume_config`` refuses those that would
    change what it trains)."""
    values = {}
    config_path = getattr(arguments, "config", None)
    if config_path is not None:
        values.update(load_yaml_mapping(config_path))
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({key: value for key, value in vars(arguments).items() if key in names})
    if values.get("resume") is not None:
        TrainConfig.from_dict(values)  # unknown fields and malformed values first
        return load_resume_config(values)
    return TrainConfig.from_dict(values)


def load_resume_config(values: dict) -> TrainConfig:
    """``resume_config`` for ``values["resume"]`` (a run or checkpoint directory)."""
    from .checkpoint import run_directory_of

    directory = run_directory_of(str(values["resume"]))
    stored = TrainConfig.from_yaml(directory / "config.yaml")
    return resume_config(stored, values, directory)
