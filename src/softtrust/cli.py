"""The ``softtrust`` command line: ``softtrust train [--flags]`` and ``softtrust sweep [--flags]``.

Every ``train`` flag comes from a ``TrainConfig`` field and its help text, so
``softtrust train --help`` documents the whole configuration. ``sweep`` takes its own
grid flags and passes any other ``train`` flag to every cell of the grid.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from softtrust.train.options import add_config_arguments

    parser = argparse.ArgumentParser(
        prog="softtrust",
        description="Off-policy RL of language models with trust-region policy losses.",
        allow_abbrev=False,  # '--stal' is refused, not read as --staleness (in every parser here)
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
        allow_abbrev=False,
    )
    add_config_arguments(train_parser)
    # command_parser: an unknown flag is reported with this subcommand's usage, not the top level's
    train_parser.set_defaults(handler=run_train, command_parser=train_parser)
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
    sweep_parser.set_defaults(
        handler=run_sweep_command, accepts_train_flags=True, command_parser=sweep_parser
    )


def run_train(arguments: argparse.Namespace) -> int:
    from softtrust.train.options import config_from_arguments
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
    print(result_line(summary))
    return 0


def result_line(summary: dict) -> str:
    """The run's last line: held-out accuracy before and after, whether it rose, and the mean
    score beside it (a reward with partial credit moves the score before the accuracy)."""
    schedule = f"N={summary['staleness']}" if summary["mode"] == "sync" else f"async, K={summary['max_lag']}"
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    change = 100 * (after - before)
    verdict = f"rose by {change:.1f} points" if change > 0 else f"did not rise ({change:+.1f} points)"
    return (
        f"held-out accuracy {before:.3f} -> {after:.3f} ({verdict}; mean score "
        f"{summary['score_before']:.3f} -> {summary['score_after']:.3f}) after {summary['steps']} steps of "
        f"{summary['method']} ({schedule}) in {summary['wall_seconds']:.0f} s; "
        f"run directory: {summary['final_dir'].rsplit('/final', 1)[0]}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``softtrust COMMAND``; a module of an extra that is not installed (a core-only
    ``pip install -e .`` has no trainer) is one error line naming the extra, exit code 2."""
    from softtrust._optional import missing_module_message

    try:
        return run_command(argv)
    except ModuleNotFoundError as error:
        message = missing_module_message(error)
        if message is None:
            raise
        print(f"softtrust: error: {message}", file=sys.stderr)
        return 2


def run_command(argv: list[str] | None) -> int:
    """Parse ``argv`` and call the subcommand's handler."""
    parser = build_parser()
    arguments, extra = parser.parse_known_args(argv)
    if getattr(arguments, "handler", None) is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 0 if argv == [] else 2
    if getattr(arguments, "accepts_train_flags", False):
        return arguments.handler(arguments, extra)  # it checks ``extra`` against the train flags
    if extra:
        arguments.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return arguments.handler(arguments)


if __name__ == "__main__":
    sys.exit(main())
