"""Reading a ``TrainConfig`` from YAML and the command line, and the config a resumed run continues.

Values are coerced strictly to each field's declared type (``values.coerce``): a value the
flag would refuse is refused from YAML too. ``add_config_arguments`` builds one ``--flag`` per
field with the field's help text; ``config_from_arguments`` applies the precedence
field default < ``--config FILE.yaml`` < flags; ``resume_config`` refuses changes a resumed
run may not take. The dataclass itself and its checks live in ``config.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .checkpoint import run_directory_of
from .config import RESUMABLE_FIELDS, TrainConfig
from .values import _field_kind, _list_element, _strict_float, coerce, load_yaml_mapping


def resume_config(stored: TrainConfig, changes: dict, run_directory: Path) -> TrainConfig:
    """The config a resumed run continues with: its ``stored`` one, ``changes`` on top.

    ``changes``: the fields given now. Only ``RESUMABLE_FIELDS`` may differ from the stored
    values; any other difference is refused naming the field. The run keeps writing into
    ``run_directory`` (the directory resumed, whatever ``output_dir`` its config recorded).
    """

    changes = {key: coerce(TrainConfig, key, value) for key, value in changes.items()}
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
            metavar = {int: "INT", float: "FLOAT", dict: "K=V,..."}.get(kind, "STR")
            if kind is list:  # --reward-weights 1,0.2 takes numbers, --lag-schedule 0,1,2 integers
                metavar = "FLOAT,..." if _list_element(TrainConfig, f.name) is _strict_float else "INT,..."
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

    directory = run_directory_of(str(values["resume"]))
    stored = TrainConfig.from_yaml(directory / "config.yaml").resolved()  # older runs recorded None
    return resume_config(stored, values, directory)
