"""``softtrust sweep``: its flags, the ``Sweep`` they describe, and the command itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .grid import LR_AXIS_FIELD, Sweep, parse_int_list, parse_lrs, parse_seeds, split_methods
from .presets import PRESETS
from .record import record_as_preset


def add_sweep_arguments(parser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="A predefined grid and setup (default: full, the long-completion study, ~6.5 h on 2 cores, "
        "resumable; quick: the first half of 4 of its runs, ~16 min; addition: the short-completion setup; "
        "lr-stability: the largest stable learning rate per method and N, ~25 min; lr-stability-long: the same "
        "on the long-completion setup, ~55 min; "
        "vespo-ablations: the paper's VESPO ablations; controls, ceiling, head-to-head, async, mismatch, "
        "mismatch-pilot: the next runs, docs/results.md; confirm-*: the confirmation study, docs/preregistration.md; "
        "pilot-smollm2: clip and VESPO at N = 1 and 8 on SmolLM2-135M-Instruct, needs --model and --dataset, "
        "examples/real_model.py pilot); flags override it.",
    )
    parser.add_argument(
        "--methods",
        help="Methods, comma-separated; a method may carry parameters, e.g. 'clip,vespo[k_neg=2,lambda_neg=3]' "
        "('level=' and 'aggregation=' in brackets set those loss axes). [default: "
        + PRESETS["full"]["methods"]
        + "]",
    )
    parser.add_argument(
        "--staleness",
        help="Staleness values N, comma-separated (in --mode async: the lag bounds K). [default: "
        + PRESETS["full"]["staleness"]
        + "]",
    )
    parser.add_argument(
        "--max-lag",
        dest="max_lag_axis",
        help="Async mode: the lag bounds K, comma-separated (replaces --staleness as the grid axis).",
    )
    parser.add_argument(
        "--seeds",
        help="A number of seeds S (seeds 0..S-1), or a comma-separated list ('1,' is seed 1 alone); a confirm-* "
        "preset warns of seeds it did not register. [default: " + PRESETS["full"]["seeds"] + "]",
    )
    parser.add_argument(
        "--lrs",
        help="Learning rates, comma-separated: a third grid axis, and the report's largest stable "
        "learning rate per method and N (replaces --lr). [default: the preset's; none for full, where --lr is shared]",
    )
    parser.add_argument("--output-dir", dest="sweep_dir", help="Sweep directory [default: sweeps/<preset>].")
    parser.add_argument(
        "--jobs", type=int, default=None, help="Cells run in parallel [default: the number of CPU cores]."
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="Only rewrite the report from the runs already there (a missing directory, or one "
        "without a run of the grid, is an error).",
    )
    parser.add_argument(
        "--allow-mixed-code",
        action="store_true",
        help="Report (and pair) runs made by different code (git commit or package versions); "
        "by default the report refuses them, naming the cells of each code.",
    )
    parser.add_argument(
        "--reference",
        help="The method every other is tested against in the report (a --methods label) "
        "[default: the preset's; else vespo when in the grid, else the last method].",
    )
    parser.add_argument(
        "--no-progress", dest="sweep_progress", action="store_false", help="No progress bar for the grid."
    )


class UnknownArguments(ValueError):
    """A flag that is neither a sweep flag nor a train flag (reported with the sweep's usage)."""


def sweep_from_arguments(arguments, extra: list[str], record: dict | None = None) -> Sweep:
    """The ``Sweep`` for the parsed sweep flags plus ``extra`` (any ``train`` flag, shared by every cell).

    The grid and shared settings not given come from the ``--preset`` (default ``full``), or,
    with no ``--preset``, from ``record`` (a sweep directory's ``sweep.json``: ``--report-only``)."""
    import argparse

    from softtrust.train.options import add_config_arguments, config_from_arguments
    from softtrust.train.values import load_yaml_mapping

    train_parser = argparse.ArgumentParser(prog="softtrust sweep", add_help=False, allow_abbrev=False)
    add_config_arguments(train_parser)
    train_arguments, unknown = train_parser.parse_known_args(extra)
    if unknown:
        raise UnknownArguments(
            f"unrecognized arguments: {' '.join(unknown)} (neither a sweep flag nor a train flag: see "
            "softtrust sweep --help and softtrust train --help)"
        )
    given = set(vars(train_arguments)) - {"config"}  # flags default to SUPPRESS: only those given
    overrides_config = config_from_arguments(train_arguments)
    from_file = set()
    if train_arguments.config:
        from_file = set(load_yaml_mapping(train_arguments.config))
    overrides = {
        key: value
        for key, value in overrides_config.to_dict().items()
        if key in (given | from_file) and key != "config"
    }
    name = arguments.preset or "full"
    preset = PRESETS[name] if record is None or arguments.preset else record_as_preset(record)
    setup = dict(preset["overrides"])
    if arguments.lrs is not None or preset.get(
        "lrs"
    ):  # an lr axis replaces the preset's lr (a given --lr is refused)
        setup.pop(LR_AXIS_FIELD, None)
    overrides = {**setup, **overrides}  # flags override the preset's setup
    recorded, missing = (record or {}).get("overrides", {}), []  # --report-only: the record has them
    for key in preset.get("requires", ()):
        if overrides.get(key) is None:
            overrides[key] = recorded.get(key)
        if overrides[key] is None:
            missing.append(key)
    if missing:
        flags = " and ".join("--" + key.replace("_", "-") for key in missing)
        raise ValueError(
            f"--preset {name}: needs {flags} (its setup is for a model and data of your own; {preset['requires_hint']})"
        )
    overrides.setdefault("num_threads", 1)
    mode = overrides.get("mode", "sync")
    axis_text, axis_name = given_or(arguments.staleness, preset["staleness"]), "staleness"
    if mode == "async" and arguments.max_lag_axis is not None:
        axis_text, axis_name = arguments.max_lag_axis, "max_lag"
    elif arguments.max_lag_axis is not None:
        lags = parse_int_list(arguments.max_lag_axis, "max_lag")
        if len(lags) > 1:
            raise ValueError(
                f"max_lag: several lag bounds are a grid axis of --mode async; in sync mode give one "
                f"(got {arguments.max_lag_axis!r})"
            )
        overrides["max_lag"] = lags[0]
    jobs = arguments.jobs if arguments.jobs is not None else preset.get("jobs", os.cpu_count() or 1)
    seeds = parse_seeds(given_or(arguments.seeds, preset["seeds"]))
    if arguments.seeds is not None and name.startswith("confirm-"):
        warn_unregistered_seeds(name, arguments.seeds, seeds, parse_seeds(preset["seeds"]))
    return Sweep(
        methods=split_methods(given_or(arguments.methods, preset["methods"])),
        staleness=parse_int_list(axis_text, axis_name),
        seeds=seeds,
        output_dir=sweep_directory(arguments.sweep_dir, name),
        overrides=overrides,
        jobs=jobs,
        progress=arguments.sweep_progress,
        lrs=parse_lrs(arguments.lrs) if arguments.lrs is not None else preset.get("lrs"),
        allow_mixed_code=getattr(arguments, "allow_mixed_code", False),
        reference=given_or(getattr(arguments, "reference", None), preset.get("reference")),
    )


def warn_unregistered_seeds(name: str, text: str, seeds: list[int], registered: list[int]) -> None:
    """Warn on stderr when ``--seeds`` (``text``) runs seeds that a ``confirm-*`` preset did not
    register (docs/preregistration.md): their cells run, but they are no part of its registered
    analysis. A bare number is a count, so ``--seeds 14`` is seeds 0-13, not seed 14 (``14,``)."""
    extra = [seed for seed in seeds if seed not in registered]
    if not extra:
        return
    named = f"seed {extra[0]} is" if len(extra) == 1 else f"seeds {', '.join(map(str, extra))} are"
    hint = ""
    if "," not in text:
        hint = f"; {text!r} is a number of seeds (0-{seeds[-1]}): for seed {text} alone write '{text},'"
    print(
        f"softtrust sweep: warning: {named} not among the registered seeds of --preset {name} "
        f"({registered[0]}-{registered[-1]}, docs/preregistration.md) and no part of its registered "
        f"analysis{hint}",
        file=sys.stderr,
    )


def given_or(value, default):
    """A flag's ``value`` when it was given, even empty (``--seeds ''`` is refused by its parser,
    never read as the preset's), else the preset's ``default``."""
    return default if value is None else value


def sweep_directory(given: str | None, preset: str) -> Path:
    """``--output-dir`` (refused when empty), else ``sweeps/<preset>``."""
    if given is None:
        return Path("sweeps") / preset
    if not given.strip():
        raise ValueError(f"output_dir: must not be empty (got {given!r})")
    return Path(given)


def report_only(arguments, extra: list[str]) -> Sweep:
    """``--report-only``: rewrite the report of the sweep directory, described by its own record
    (``record.read_sweep_record``) where the flags leave something out; returns the sweep."""
    from softtrust._runlock import holding
    from softtrust.train.option_checks import check_directory_option

    from .record import read_sweep_record
    from .report import rewrite_report

    directory = sweep_directory(arguments.sweep_dir, arguments.preset or "full")
    check_directory_option(directory, "output_dir")  # a file, or a path under one
    record = read_sweep_record(directory) if directory.is_dir() else None
    sweep = sweep_from_arguments(arguments, extra, record)
    if directory.is_dir():  # not while a sweep writes it (a missing one: the report refuses it)
        with holding(directory, "output_dir", "softtrust sweep"):
            rewrite_report(sweep)
    else:
        rewrite_report(sweep)
    return sweep


def run_sweep_command(arguments, extra: list[str]) -> int:
    """``softtrust sweep``: run the grid (or only rewrite its report); exit 0, 1 (a cell
    failed), 2 (bad arguments) or 130 (interrupted: the same command resumes)."""
    from .runner import run_sweep

    try:
        if arguments.report_only:
            sweep = report_only(arguments, extra)
            print(f"report written to {sweep.output_dir}")
            return 0
        sweep = sweep_from_arguments(arguments, extra)
        result = run_sweep(sweep)
    except UnknownArguments as error:  # with the sweep's usage, as argparse reports its own flags
        arguments.command_parser.print_usage(sys.stderr)
        print(f"softtrust sweep: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"softtrust sweep: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("softtrust sweep: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(
        f"{len(result['ran'])} cell(s) run, {len(result['skipped'])} already done, "
        f"{len(result['failed'])} failed; report: {sweep.output_dir / 'summary.md'}"
    )
    return 1 if result["failed"] else 0
