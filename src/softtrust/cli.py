"""The ``softtrust`` command line: ``softtrust train [--flags]`` and ``softtrust sweep [--flags]``.

Every ``train`` flag comes from a ``TrainConfig`` field and its help text, so
``softtrust train --help`` documents the whole configuration. ``sweep`` takes its own
grid flags and passes any other ``train`` flag to every cell of the grid.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from softtrust.train.config import add_config_arguments

    parser = argparse.ArgumentParser(
        prog="softtrust", description="Off-policy RL of language models with trust-region policy losses."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train_parser = subcommands.add_parser(
        "train",
        help="Off-policy GRPO training (default: a tiny Qwen2 on 3-digit addition, VESPO, staleness N = 8).",
        description=(
            "Off-policy GRPO training. With no flags: the embedded tiny Qwen2, warm-started on "
            "3-digit addition (cached), then RL with VESPO at staleness N = 8, offline, in minutes. "
            "Precedence: field defaults < --config FILE.yaml < flags."
        ),
    )
    add_config_arguments(train_parser)
    train_parser.set_defaults(handler=run_train)
    add_sweep_parser(subcommands)
    return parser


def add_sweep_parser(subcommands) -> None:
    from softtrust.study.cli import add_sweep_arguments, run_sweep_command

    sweep_parser = subcommands.add_parser(
        "sweep",
        help="The staleness study: a grid of train runs (methods x staleness N x seeds) and its report.",
        description=(
            "Run one `softtrust train` per method x staleness x seed (each in its own process, --jobs "
            "at a time, resumable), then write summary.json, summary.md, curves.png and "
            "final_vs_staleness.png in the sweep directory. Any `softtrust train` flag (e.g. --max-steps, "
            "--task, --lr, --mode async) is shared by every cell."
        ),
        allow_abbrev=False,
    )
    add_sweep_arguments(sweep_parser)
    sweep_parser.set_defaults(handler=run_sweep_command, accepts_train_flags=True)


def run_train(arguments: argparse.Namespace) -> int:
    from softtrust.train.config import config_from_arguments
    from softtrust.train.trainer import TrainingStopped, train

    try:
        config = config_from_arguments(arguments)
        summary = train(config)
    except ValueError as error:
        print(f"softtrust train: error: {error}", file=sys.stderr)
        return 2
    except TrainingStopped as error:
        print(f"softtrust train: {error}", file=sys.stderr)
        return 1
    schedule = f"N={summary['staleness']}" if summary["mode"] == "sync" else f"async, K={summary['max_lag']}"
    print(
        f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} "
        f"(mean score {summary['score_before']:.3f} -> {summary['score_after']:.3f}) "
        f"after {summary['steps']} steps of {summary['method']} ({schedule}) "
        f"in {summary['wall_seconds']:.0f} s; run directory: {summary['final_dir'].rsplit('/final', 1)[0]}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    arguments, extra = parser.parse_known_args(argv)
    if getattr(arguments, "handler", None) is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 0 if argv == [] else 2
    if getattr(arguments, "accepts_train_flags", False):
        return arguments.handler(arguments, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return arguments.handler(arguments)


if __name__ == "__main__":
    sys.exit(main())
