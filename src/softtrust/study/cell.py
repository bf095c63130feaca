"""One cell's process: ``python -m softtrust.study.cell CELL.yaml`` trains it and exits with a code
the runner reads (0 done, 2 bad config, 3 stopped by the trainer; anything else is a crash)."""

from __future__ import annotations

import sys

from softtrust.train.config import TrainConfig

from .runs import EXIT_BAD_CONFIG, EXIT_STOPPED


def run_cell(config_path: str) -> int:
    """Train one cell from its YAML; exit 0 done, 3 stopped by the trainer, 2 bad config."""
    from softtrust.train.trainer import TrainingStopped, train

    try:
        summary = train(TrainConfig.from_yaml(config_path))
    except ValueError as error:
        print(f"softtrust sweep: error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except TrainingStopped as error:
        print(f"softtrust sweep: {error}", file=sys.stderr)
        return EXIT_STOPPED
    print(f"held-out accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cell(sys.argv[1]))
