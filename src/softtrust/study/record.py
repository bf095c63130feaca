"""The sweep's own record of what ran: ``sweep.json`` (the grid and the shared settings, written
when the sweep starts) and each cell's ``config.yaml`` (the settings its run trained with, written
by the trainer at every start and resume).

``--report-only`` describes the runs by this record, not by the flags of the day: the grid and
the shared settings it is not given come from ``sweep.json`` (``record_as_preset``), and every
cell's ``config.yaml`` must agree with the settings the report is built with
(``check_report_settings``): a report of 2-step runs "with max_steps=500, lr=0.5", every cell
missing, was written over the right one before.
"""

from __future__ import annotations

from pathlib import Path

from softtrust._runfiles import atomic_write_json, read_json_object
from softtrust.train.config import TrainConfig

from .grid import Cell, Sweep

RECORD_FILE = "sweep.json"

# Fields of a cell's config that say how it ran, not what it trained: never compared.
RUNTIME_SETTINGS = (
    "resume",
    "output_dir",
    "progress",
    "num_threads",
    "report_to",
    "save_every",
    "keep_checkpoints",
    "cache_dir",
)


def write_sweep_record(sweep: Sweep) -> None:
    """``sweep.json``: the grid and the shared settings of the sweep that starts in its directory."""
    record = {
        "methods": sweep.labels,
        "staleness": sweep.staleness,
        "seeds": sweep.seeds,
        "axis": sweep.axis,
        "lrs": sweep.lrs,
        "overrides": sweep.overrides,
        "reference": sweep.reference,
    }
    atomic_write_json(sweep.output_dir / RECORD_FILE, record)


def read_sweep_record(directory: Path) -> dict | None:
    """``sweep.json`` of a sweep directory (None if there is none): ``{"methods": [labels],
    "staleness": [ints], "seeds": [ints], "lrs": [floats] or None, "overrides": {train fields},
    "reference": label or None}``; a ``ValueError`` naming the file and the key when it is not that."""
    path = Path(directory) / RECORD_FILE
    record = read_json_object(path)
    if record is None:
        return None
    expected = {
        "methods": (str, "a list of method labels"),
        "staleness": (int, "a list of integers"),
        "seeds": (int, "a list of integers"),
    }
    for key, (kind, meaning) in expected.items():
        values = record.get(key)
        if not (
            isinstance(values, list)
            and values
            and all(isinstance(v, kind) and not isinstance(v, bool) for v in values)
        ):
            raise ValueError(f"{path}: {key!r} is {values!r}; expected {meaning}")
    lrs = record.get("lrs")
    if lrs is not None and not (
        isinstance(lrs, list)
        and lrs
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in lrs)
    ):
        raise ValueError(f"{path}: 'lrs' is {lrs!r}; expected a list of learning rates or null")
    overrides = record.get("overrides", {})
    if not isinstance(overrides, dict):
        raise ValueError(f"{path}: 'overrides' is {overrides!r}; expected an object of train settings")
    try:
        TrainConfig.from_dict(overrides)
    except ValueError as error:
        raise ValueError(f"{path}: 'overrides' are not train settings ({error})") from error
    return record


def record_as_preset(record: dict) -> dict:
    """The record in a preset's shape (``presets.PRESETS``): what a ``--report-only`` that names
    no ``--preset`` builds its grid and shared settings from, flags given on top."""
    return {
        "methods": ",".join(record["methods"]),
        "staleness": ",".join(str(value) for value in record["staleness"]),
        "seeds": ",".join(str(seed) for seed in record["seeds"]) + ",",  # a list, even of one seed
        "lrs": record.get("lrs"),
        "overrides": dict(record.get("overrides", {})),
        "reference": record.get("reference"),
    }


def setting_differences(saved: Path, now: TrainConfig, ignore: tuple[str, ...]) -> list[tuple]:
    """``[(field, value in the run's config.yaml, value now)]`` for every field outside
    ``ignore`` that differs, each side resolved (a default means what it resolves to)."""
    try:
        before = TrainConfig.from_yaml(saved).resolved().to_dict()
    except ValueError as error:
        raise ValueError(f"{saved}: not a run's config ({error})") from error
    after = now.resolved().to_dict()
    return [
        (key, before.get(key), after[key])
        for key in after
        if key not in ignore and before.get(key) != after[key]
    ]


def check_report_settings(sweep: Sweep) -> None:
    """Refuse (``ValueError``) a report whose settings differ from those its runs were made with
    (each cell's ``config.yaml``): it names the settings, the values of the runs and those
    given, and the cells. ``max_steps`` counts: it decides which runs finished."""
    mismatched: list[Cell] = []
    differences: dict[str, tuple] = {}
    for cell in sweep.cells():
        saved = cell.directory(sweep.output_dir) / "config.yaml"
        if not saved.is_file():
            continue
        found = setting_differences(saved, sweep.cell_config(cell), RUNTIME_SETTINGS)
        if found:
            mismatched.append(cell)
            for key, before, now in found:
                differences.setdefault(key, (before, now))
    if not mismatched:
        return
    details = "; ".join(
        f"{key}: the runs have {before!r}, given {now!r}" for key, (before, now) in differences.items()
    )
    more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
    if (sweep.output_dir / RECORD_FILE).is_file():
        remedy = f"give the settings the sweep ran with, or leave them out (read from its {RECORD_FILE})"
    else:
        remedy = f"give the --preset and train flags the sweep ran with (it has no {RECORD_FILE})"
    raise ValueError(
        f"output_dir: the runs in {str(sweep.output_dir)!r} were made with other settings than the report's "
        f"({details}; {mismatched[0].name}{more}); {remedy}"
    )
