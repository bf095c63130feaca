"""The staleness study: ``softtrust sweep`` runs a grid of ``train`` runs and reports it.

One cell is one ``train(config)`` run (a method, a staleness N, a seed), executed in
its own process (``python -m softtrust.sweep <cell>/sweep-cell.yaml``), ``--jobs``
at a time. Every cell runs the same number of optimizer steps (``--max-steps``), so N
changes only how stale the samples are, and every cell of a seed starts from the same
cached warm start (the trainer keys the cache by the recipe and the seed).

The sweep directory holds:

| path | content |
| --- | --- |
| ``runs/<method>/N<N>/seed<s>/`` | each cell's run directory (see ``docs/training.md``), plus ``train.log`` and ``sweep-cell.json`` (``.../N<N>/lr<lr>/seed<s>/`` with ``--lrs``) |
| ``sweep.json`` | the grid and the shared overrides |
| ``sweep-log.jsonl`` | one line per cell executed (start, end, return code) |
| ``summary.json`` | one record per method x N: accuracy at the end, at its best, its area under the curve, mean / std / 95 % CI over seeds, collapses (a run still going counts in the collapses and curves only: its best so far is not a result) |
| ``summary.md`` | the table of the VESPO paper's Table 2 layout: rows N, columns methods |
| ``curves.png``, ``final_vs_staleness.png`` | the figures (with ``--lrs``: at the smallest learning rate) |
| ``lr_stability.png`` | with ``--lrs``: the largest stable learning rate against N, one line per method |

The learning-rate view (``--lrs 3e-4,1e-3,...``): a third grid axis. For every method and
N, the **largest stable learning rate** is the largest value of the grid at which, and at
every smaller value of which, every seed completed without collapsing (see
``largest_stable_lr``). It does not depend on one learning rate: a method that tolerates
staleness should keep its stable range as N grows.

Resumption: a cell is not run again when its run directory has a ``summary.json`` for
the requested number of steps, or when it stopped on its own (too many non-finite
updates, exit code 3: a deterministic outcome, reported as a collapse). A cell that was
interrupted resumes from its last checkpoint, or starts over when it has none. A cell
that was run with other settings (say another ``--lr``) stops the sweep with a message
naming them, rather than mixing old and new results in one table.

The collapse criterion (``CollapseCriterion``, applied per run) is documented there.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from softtrust.train.config import TrainConfig, parse_key_values

# The fields that a sweep sets per cell: shared overrides may not set them.
AXIS_FIELDS = ("method", "method_params", "level", "staleness", "seed", "output_dir", "resume", "config")
LR_AXIS_FIELD = "lr"  # a shared override unless --lrs makes it a grid axis

# Method-spec keys that go to TrainConfig fields instead of the method's parameters.
SPEC_CONFIG_KEYS = ("level", "aggregation")

# The first setup (short completions): 3-digit addition (`aaa+bbb=` -> 4 digits + eos), the
# embedded ~0.9 M-parameter Qwen2, G = 8, m = 32, AdamW 3e-4 (the trainer's defaults), 128
# optimizer steps for every N, and a warm start of 620 supervised steps, which puts seed 0 at
# 22 % held-out accuracy (the supervised curve is steep there: 550 steps give 7 %, 680 give 45 %).
# 256 held-out problems (standard error of one evaluation at most 0.031). Kept as
# `--preset addition` and for the learning-rate view, whose documented results used it.
ADDITION_SETUP = {"max_steps": 128, "sft_steps": 620, "eval_size": 256}

# The study's default setup (long completions): 3-digit addition with a written carry
# scratchpad (`123+459=` -> `3+9=12,2+5+1=8,1+4=5|0582`, ~26 tokens + eos; only the answer
# after `|` is graded), every seed warm-started to 30 % validation accuracy, 256 optimizer
# steps for every N (N = 64 is 4 rollouts), AdamW lr 1e-4 (at 3e-4 the first Adam step alone
# moves the sampled sequences by ~6 nats of log-probability, and VESPO's weights vanish at
# N = 64 before any staleness question arises), 2,000 held-out problems evaluated every 16
# steps (standard error of one evaluation at most 0.011).
STUDY_SETUP = {
    "task": "scratchpad",
    "max_new_tokens": 40,
    "lr": 1e-4,
    "max_steps": 256,
    "sft_steps": 3000,
    "sft_target_accuracy": 0.3,
    "eval_size": 2000,
    "eval_every": 16,
}

PRESETS = {
    # The paper's comparison (its Table 2: GRPO-style clip, GSPO, SAPO, VESPO) at N = 4, 16
    # and 64: 60 cells of 256 steps, 9-15 min a cell on one core (measured), so ~6.5 h on 2 cores
    # (resumable). CISPO, PSPO and the on-policy N = 1 are one flag away
    # (--methods ...,cispo,pspo --staleness 1,4,16,64: 120 cells).
    "full": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "4,16,64",
        "seeds": "5",
        "overrides": STUDY_SETUP,
    },
    # The paper's central contrast, clipping against VESPO, at its two extremes of staleness,
    # seed 0, 128 steps: the first half of 4 runs of the full study (every other setting is
    # the same, and nothing before step 128 depends on the step budget), 16 min 12 s
    # on 2 CPU cores with --jobs 2, from an empty warm-start cache (measured).
    "quick": {
        "methods": "clip,vespo",
        "staleness": "4,64",
        "seeds": "0,",
        "overrides": {**STUDY_SETUP, "max_steps": 128},
    },
    # The first, short-completion setup (docs/results.md, "Short completions").
    "addition": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "4,16,64",
        "seeds": "1",
        "overrides": ADDITION_SETUP,
    },
    # The learning-rate view: the largest stable lr of each method at N = 1 (on-policy: the lr
    # effect alone), 16 and 64, from a short sweep (64 steps; at N = 64 that is one rollout)
    # on the short-completion setup. 48 cells, about 25 minutes on 2 CPU cores with --jobs 2.
    "lr-stability": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "1,16,64",
        "seeds": "1",
        "lrs": [3e-4, 6e-4, 1e-3, 2e-3],
        "overrides": {**ADDITION_SETUP, "max_steps": 64},
    },
    # The learning-rate view on the long-completion setup: N = 4 against N = 64 (64 steps: at
    # N = 64 one rollout from the warm start, the purest staleness test), lr from the study's
    # 1e-4 up to 6e-4, 500 held-out problems (standard error at most 0.022, well inside the
    # collapse criterion's 0.10). 32 cells: 55 min on 2 cores with --jobs 2 (measured; docs/results.md).
    "lr-stability-long": {
        "methods": "clip,gspo,sapo,vespo",
        "staleness": "4,64",
        "seeds": "1",
        "lrs": [1e-4, 2e-4, 3e-4, 6e-4],
        "overrides": {**STUDY_SETUP, "max_steps": 64, "eval_size": 500},
    },
    # The paper's VESPO ablations: length normalisation (sequence-mean level) and symmetric kernels.
    "vespo-ablations": {
        "methods": "vespo,vespo[level=sequence-mean],vespo[k_neg=2,lambda_neg=3],vespo[k_pos=3,lambda_pos=2]",
        "staleness": "4,16,64",
        "seeds": "3",
        "overrides": STUDY_SETUP,
    },
}

# Exit codes of one cell's process (``python -m softtrust.sweep CELL.yaml``); any other is a crash.
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 3  # the trainer stopped itself (too many non-finite updates): a collapse, not a crash

# Two-sided 95 % Student t quantiles t_{0.975, df}; df > 30 uses the normal 1.96.
T_975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}


# ---------------------------------------------------------------------- the grid
@dataclass(frozen=True)
class MethodSpec:
    """One column of the study: a registry name plus parameters, e.g. ``vespo[k_neg=2,lambda_neg=3]``.

    ``level`` and ``aggregation`` in the brackets set those loss axes (``vespo[level=sequence-mean]``
    is the paper's length-normalisation ablation); every other key is a method parameter.
    """

    label: str
    method: str
    params: dict = field(default_factory=dict, hash=False)  # the label determines them
    config: dict = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        text = text.strip()
        name, bracket, rest = text.partition("[")
        values = {}
        if bracket:
            if not rest.endswith("]"):
                raise ValueError(f"methods: {text!r} has no closing ']'")
            values = parse_key_values(rest[:-1], "methods")
        params = {key: value for key, value in values.items() if key not in SPEC_CONFIG_KEYS}
        config = {key: value for key, value in values.items() if key in SPEC_CONFIG_KEYS}
        return cls(label=text, method=name.strip(), params=params, config=config)

    @property
    def slug(self) -> str:
        """A directory name: ``vespo[k_neg=2,lambda_neg=3]`` -> ``vespo-k_neg=2-lambda_neg=3``."""
        keep = "".join(ch if ch.isalnum() or ch in "._=-" else "-" for ch in self.label)
        return "-".join(filter(None, keep.split("-")))


def split_methods(text: str) -> list[MethodSpec]:
    """``'clip,vespo[k_neg=2,lambda_neg=3]'`` -> two specs (commas inside brackets stay)."""
    items, depth, current = [], 0, ""
    for character in text:
        depth += {"[": 1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += character
    items.append(current)
    specs = [MethodSpec.parse(item) for item in items if item.strip()]
    if not specs:
        raise ValueError("methods: give at least one method")
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"methods: repeated method {labels}")
    return specs


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"{name}: expected integers separated by commas, got {text!r}") from error
    if not values or any(value < 0 for value in values):
        raise ValueError(f"{name}: expected non-negative integers, got {text!r}")
    return values


def parse_lrs(text: str) -> list[float]:
    """``'3e-4,1e-3'`` -> ``[3e-4, 1e-3]`` (sorted, each > 0)."""
    try:
        values = sorted({float(part) for part in str(text).split(",") if part.strip()})
    except ValueError as error:
        raise ValueError(f"lrs: expected numbers separated by commas, got {text!r}") from error
    if not values or any(not (math.isfinite(value) and value > 0) for value in values):
        raise ValueError(f"lrs: expected finite learning rates > 0, got {text!r}")
    return values


def parse_seeds(text: str) -> list[int]:
    """``'3'`` -> seeds 0, 1, 2; ``'0,5'`` -> seeds 0 and 5; ``'1,'`` -> seed 1 alone."""
    values = parse_int_list(text, "seeds")
    if "," in str(text):
        return values
    if values[0] < 1:
        raise ValueError(f"seeds: a number of seeds must be >= 1 (got {text!r}; for seed 0 alone write '0,')")
    return list(range(values[0]))


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    spec: MethodSpec
    staleness: int  # N in sync mode, the lag bound K in async mode
    seed: int
    axis: str = "N"  # "K" in async mode
    lr: float | None = None  # set when the learning rate is a grid axis (--lrs)

    def directory(self, root: Path) -> Path:
        base = root / "runs" / self.spec.slug / f"{self.axis}{self.staleness}"
        if self.lr is not None:
            base = base / f"lr{self.lr:g}"
        return base / f"seed{self.seed}"

    @property
    def name(self) -> str:
        lr = "" if self.lr is None else f" lr={self.lr:g}"
        return f"{self.spec.label} {self.axis}={self.staleness}{lr} seed={self.seed}"


@dataclass
class Sweep:
    """The grid (methods x staleness x seeds) and the ``train`` settings shared by every cell."""

    methods: list[MethodSpec]
    staleness: list[int]
    seeds: list[int]
    output_dir: Path
    overrides: dict = field(default_factory=dict)
    jobs: int = 1
    progress: bool = True
    lrs: list[float] | None = None  # the learning-rate axis (None: lr is a shared setting)

    @property
    def mode(self) -> str:
        return self.overrides.get("mode", "sync")

    @property
    def axis(self) -> str:
        return "K" if self.mode == "async" else "N"

    def cells(self) -> list[Cell]:
        return [
            Cell(spec, staleness, seed, self.axis, lr)
            for staleness in self.staleness
            for lr in self.lrs or [None]
            for spec in self.methods
            for seed in self.seeds
        ]

    def cell_config(self, cell: Cell) -> TrainConfig:
        values = {
            **self.overrides,
            **cell.spec.config,
            "method": cell.spec.method,
            "method_params": dict(cell.spec.params),
            "seed": cell.seed,
            "output_dir": str(cell.directory(self.output_dir)),
            "progress": False,
        }
        values["max_lag" if self.mode == "async" else "staleness"] = cell.staleness
        if cell.lr is not None:
            values[LR_AXIS_FIELD] = cell.lr
        return TrainConfig.from_dict(values)

    def validate(self) -> None:
        bad = sorted(set(self.overrides) & set(AXIS_FIELDS))
        if bad:
            raise ValueError(f"sweep: {bad} are set per cell by --methods / --staleness / --seeds")
        if self.lrs is not None and LR_AXIS_FIELD in self.overrides:
            raise ValueError(
                f"sweep: lr={self.overrides[LR_AXIS_FIELD]} is given (by --lr or --config) while the "
                f"learning rate is a grid axis, lrs={self.lrs} (from --lrs or the preset); give one of them"
            )
        if self.mode == "sync" and any(n < 1 for n in self.staleness):
            raise ValueError(f"staleness: N must be >= 1 (got {self.staleness})")
        for cell in self.cells():
            self.cell_config(cell).validate()  # a bad method spec fails before any run
        if self.jobs < 1:
            raise ValueError(f"jobs: must be >= 1 (got {self.jobs})")


# ---------------------------------------------------------------------- running cells
def cell_status(directory: Path, max_steps: int) -> str:
    """``done`` (summary.json for max_steps), ``stopped`` (exited on its own), ``partial`` or ``new``."""
    summary = directory / "summary.json"
    if summary.is_file():
        try:
            if json.loads(summary.read_text()).get("steps") == max_steps:
                return "done"
        except json.JSONDecodeError:
            pass
    record = directory / "sweep-cell.json"
    if record.is_file():
        try:
            if json.loads(record.read_text()).get("returncode") == EXIT_STOPPED:
                return "stopped"
        except json.JSONDecodeError:
            pass
    return "partial" if directory.exists() else "new"


def start_cell(sweep: Sweep, cell: Cell) -> subprocess.Popen:
    """Launch one ``softtrust train`` process for ``cell`` (resuming its checkpoint if any)."""
    directory = cell.directory(sweep.output_dir)
    config = sweep.cell_config(cell)
    if directory.exists():
        if (directory / "checkpoints" / "latest").is_file():
            config = config.replace(resume=str(directory))
        else:
            shutil.rmtree(directory)  # interrupted before its first checkpoint: start over
    directory.mkdir(parents=True, exist_ok=True)
    request = directory / "sweep-cell.yaml"
    request.write_text(config.to_yaml())
    (directory / "sweep-cell.json").unlink(missing_ok=True)
    log = open(directory / "train.log", "a")  # noqa: SIM115 (closed when the process ends)
    process = subprocess.Popen(
        [sys.executable, "-m", "softtrust.sweep", str(request)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    process.log = log  # type: ignore[attr-defined]
    return process


# Fields that may differ between a cell's saved config and a rerun without changing its result.
SETTINGS_THAT_DO_NOT_MATTER = (
    "resume",
    "output_dir",
    "progress",
    "num_threads",
    "report_to",
    "save_every",
    "keep_checkpoints",
    "cache_dir",
    "max_steps",  # a longer run resumes the cell from its checkpoint
)


def check_same_settings(sweep: Sweep, cell: Cell) -> None:
    """Refuse to mix results: a cell already run with other settings fails the sweep by name."""
    saved = cell.directory(sweep.output_dir) / "config.yaml"
    if not saved.is_file():
        return
    before = TrainConfig.from_yaml(saved).to_dict()
    now = sweep.cell_config(cell).to_dict()
    changed = sorted(
        key for key in now if key not in SETTINGS_THAT_DO_NOT_MATTER and before.get(key) != now[key]
    )
    if changed:
        details = ", ".join(f"{key}: {before.get(key)!r} -> {now[key]!r}" for key in changed)
        raise ValueError(
            f"{cell.name} in {sweep.output_dir} was run with other settings ({details}); "
            "use another --output-dir or the same settings"
        )


def run_sweep(sweep: Sweep) -> dict:
    """Run every cell that is not done yet, then write the report. Returns the report plus
    ``ran`` / ``skipped`` (cell names) and ``failed`` (cells that crashed)."""
    sweep.validate()
    sweep.output_dir.mkdir(parents=True, exist_ok=True)
    max_steps = TrainConfig.from_dict(dict(sweep.overrides)).max_steps
    write_json(
        sweep.output_dir / "sweep.json",
        {
            "methods": [spec.label for spec in sweep.methods],
            "staleness": sweep.staleness,
            "seeds": sweep.seeds,
            "axis": sweep.axis,
            "lrs": sweep.lrs,
            "overrides": sweep.overrides,
        },
    )
    for n in sweep.staleness:
        if sweep.mode == "sync" and max_steps % n:
            print(
                f"softtrust sweep: note: max_steps={max_steps} is not a multiple of N={n}; "
                "the last rollout is only partly used",
                file=sys.stderr,
            )
    cells = sweep.cells()
    for cell in cells:
        check_same_settings(sweep, cell)
    todo = [
        c for c in cells if cell_status(c.directory(sweep.output_dir), max_steps) not in ("done", "stopped")
    ]
    skipped = [c.name for c in cells if c not in todo]
    started = time.time()
    ran, failed = execute(sweep, todo, len(cells), len(skipped), started)
    report = write_report(sweep, wall_seconds=time.time() - started)
    return {**report, "ran": ran, "skipped": skipped, "failed": failed}


def execute(sweep: Sweep, todo: list[Cell], total: int, already: int, started: float):
    """Run ``todo`` with at most ``sweep.jobs`` processes at once, under one progress bar."""
    from tqdm.auto import tqdm

    ran, failed, running = [], [], {}
    queue = list(todo)
    bar = tqdm(
        total=total,
        initial=already,
        desc="sweep",
        unit="cell",
        disable=not sweep.progress,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    log_path = sweep.output_dir / "sweep-log.jsonl"
    previous_handlers = stop_on_sigterm()
    last_refresh, refresh_every = 0.0, 1.0 if sys.stderr.isatty() else 60.0
    try:
        while queue or running:
            while queue and len(running) < sweep.jobs:
                cell = queue.pop(0)
                running[cell] = (start_cell(sweep, cell), time.time())
            finished = [cell for cell, (process, _) in running.items() if process.poll() is not None]
            for cell in finished:
                process, cell_started = running.pop(cell)
                process.log.close()
                directory = cell.directory(sweep.output_dir)
                record = {
                    "cell": cell.name,
                    "directory": str(directory),
                    "returncode": process.returncode,
                    "seconds": time.time() - cell_started,
                    "finished": time.time(),
                }
                write_json(directory / "sweep-cell.json", record)
                with open(log_path, "a") as handle:
                    handle.write(json.dumps(record) + "\n")
                ran.append(cell.name)
                if process.returncode == EXIT_BAD_CONFIG:
                    raise ValueError(f"{cell.name}: bad configuration; see {directory / 'train.log'}")
                if process.returncode not in (0, EXIT_STOPPED):
                    failed.append(cell.name)
                bar.write(cell_line(cell, directory, record))
                bar.update(1)
            now = time.time()
            if now - last_refresh >= refresh_every:  # the elapsed time moves even between cells
                bar.set_postfix(running=len(running), failed=len(failed), elapsed=f"{now - started:.0f}s")
                last_refresh = now
            if running:
                time.sleep(0.2)
    finally:
        for process, _ in running.values():  # interrupted: stop the children we started
            process.terminate()
            process.wait()
            process.log.close()
        bar.close()
        restore_signals(previous_handlers)
    return ran, failed


def stop_on_sigterm() -> dict:
    """``kill PID`` (SIGTERM) stops the sweep like Ctrl-C: its running cells are terminated
    too (they resume from their last checkpoint next time)."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background with '&'
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, handler)
    return previous


def restore_signals(previous: dict) -> None:
    import signal

    for signum, handler in previous.items():
        signal.signal(signum, handler)


def cell_line(cell: Cell, directory: Path, record: dict) -> str:
    summary_path = directory / "summary.json"
    if record["returncode"] == 0 and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        outcome = f"accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}"
    elif record["returncode"] == EXIT_STOPPED:
        outcome = "stopped (non-finite updates)"
    else:
        outcome = f"failed (exit {record['returncode']}; see {directory / 'train.log'})"
    return f"{cell.name}: {outcome} in {record['seconds']:.0f} s"


# ---------------------------------------------------------------------- collapse
@dataclass(frozen=True)
class CollapseCriterion:
    """When a run counts as collapsed (checked in this order; the earliest step is reported).

    1. ``stopped`` / ``nonfinite``: the run stopped itself after too many non-finite losses
       or gradients in a row, or any update was skipped as non-finite. (A crash, e.g. an
       exception in a reward function, is reported as a failed cell, not a collapse.)
    2. ``accuracy``: a held-out greedy accuracy (any evaluation after step 0) fell more
       than ``accuracy_margin`` (absolute) below the warm start's accuracy. With 256
       held-out problems the standard error of one evaluation is at most 0.031 (0.022
       with 512), so the default 0.10 is over three standard errors: evaluation noise
       alone rarely triggers it.
    3. ``reward``: the training reward, averaged over a trailing window of
       ``reward_window`` steps, fell more than ``reward_margin`` (absolute; rewards are in
       [0, 1]) below its average over the first ``reward_window`` steps.

    Reported per run as ``collapsed`` (bool), ``collapse_step`` and ``collapse_reason``.
    """

    accuracy_margin: float = 0.10
    reward_margin: float = 0.15
    reward_window: int = 8

    def check(
        self,
        accuracy_before: float,
        accuracies: list[tuple[int, float]],
        rewards: list[tuple[int, float]],
        stopped: bool = False,
        nonfinite_steps: list[int] = (),
    ) -> tuple[bool, int | None, str | None]:
        """``(collapsed, step, reason)`` for one run's curves (``[(step, value), ...]``)."""
        if stopped or nonfinite_steps:
            step = min(nonfinite_steps) if nonfinite_steps else (rewards[-1][0] if rewards else 0)
            return True, step, "stopped" if stopped else "nonfinite"
        events = []
        for step, accuracy in accuracies:
            if step > 0 and not (accuracy >= accuracy_before - self.accuracy_margin):
                events.append((step, "accuracy"))
                break
        values = [value for _, value in rewards]
        window = self.reward_window
        if len(values) >= 2 * window:
            baseline = sum(values[:window]) / window
            for index in range(window, len(values) - window + 1):
                trailing = sum(values[index : index + window]) / window
                if not (trailing >= baseline - self.reward_margin):
                    events.append((rewards[index + window - 1][0], "reward"))
                    break
        if not events:
            return False, None, None
        step, reason = min(events)
        return True, step, reason

    def describe(self) -> str:
        return (
            "a run collapsed if it stopped or skipped a non-finite update; or if a held-out "
            f"accuracy fell more than {self.accuracy_margin:.2f} below the warm start's; or if the "
            f"training reward averaged over {self.reward_window} steps fell more than "
            f"{self.reward_margin:.2f} below its average over the first {self.reward_window} steps"
        )


# ---------------------------------------------------------------------- statistics
def mean_std_ci(values: list[float]) -> dict:
    """Mean, sample std and the 95 % Student t half-width over seeds (None with one value)."""
    values = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "ci95": None, "n": 0, "values": []}
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "std": None, "ci95": None, "n": 1, "values": values}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    df = n - 1
    t = T_975.get(df) or (T_975[max(k for k in T_975 if k <= df)] if df <= 30 else 1.96)
    return {"mean": mean, "std": std, "ci95": t * std / math.sqrt(n), "n": n, "values": values}


def area_under_curve(points: list[tuple[int, float]], max_steps: int) -> float | None:
    """Trapezoid area of accuracy against step (evaluations from step 0 to ``max_steps``),
    divided by the steps spanned: the mean accuracy along the run, in [0, 1]."""
    points = sorted(points)
    if len(points) < 2 or max_steps <= 0:
        return None
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in itertools.pairwise(points))
    return area / (points[-1][0] - points[0][0]) if points[-1][0] != points[0][0] else None


# ---------------------------------------------------------------------- reading runs
def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
    return records


def read_run(directory: Path, max_steps: int, criterion: CollapseCriterion) -> dict | None:
    """One run's curves and outcome, from its run directory (None if it never started)."""
    metrics = read_jsonl(directory / "metrics.jsonl")
    events = read_jsonl(directory / "events.jsonl")
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    evaluations = {}
    for record in events + metrics:
        if "eval/accuracy" in record:
            evaluations[int(record["step"])] = float(record["eval/accuracy"])
    if not metrics and not evaluations:
        return None
    rewards = [(int(r["step"]), float(r["reward/mean"])) for r in metrics]
    accuracies = sorted(evaluations.items())
    accuracy_before = summary["accuracy_before"] if summary else evaluations.get(0, float("nan"))
    record_path = directory / "sweep-cell.json"
    returncode = json.loads(record_path.read_text()).get("returncode") if record_path.is_file() else None
    complete = summary is not None and summary.get("steps") == max_steps
    stopped = not complete and returncode == EXIT_STOPPED
    crashed = not complete and returncode not in (None, 0, EXIT_STOPPED)
    nonfinite = [int(r["step"]) for r in metrics if r.get("skipped")]
    collapsed, collapse_step, reason = criterion.check(
        accuracy_before, accuracies, rewards, stopped=stopped, nonfinite_steps=nonfinite
    )
    # the best of a run still going (or crashed) is not comparable to a finished run's;
    # a stopped run (the trainer gave up on it) keeps its best, since it will not go on
    after = [(step, value) for step, value in accuracies if step > 0 and (complete or stopped)]
    best_step, best = max(after, key=lambda item: item[1]) if after else (None, None)
    final = summary["accuracy_after"] if complete else None
    window = max(1, len(rewards) // 10)
    return {
        "run_dir": str(directory),
        "status": "complete"
        if complete
        else ("stopped" if stopped else "crashed" if crashed else "incomplete"),
        "steps": rewards[-1][0] if rewards else 0,
        "accuracy_before": accuracy_before,
        "final_accuracy": final,
        "best_accuracy": best,
        "best_step": best_step,
        "auc_accuracy": area_under_curve(accuracies, max_steps) if complete else None,
        "final_reward": sum(v for _, v in rewards[-window:]) / window if rewards else None,
        "collapsed": collapsed,
        "collapse_step": collapse_step,
        "collapse_reason": reason,
        "wall_seconds": summary.get("wall_seconds") if summary else None,
        "curves": {"reward": rewards, "accuracy": accuracies},
    }


# ---------------------------------------------------------------------- the report
def collect(sweep: Sweep, criterion: CollapseCriterion) -> list[dict]:
    """One record per method x staleness (x learning rate with ``--lrs``), aggregating its seeds."""
    max_steps = TrainConfig.from_dict(dict(sweep.overrides)).max_steps
    records = []
    for staleness, lr, spec in itertools.product(sweep.staleness, sweep.lrs or [None], sweep.methods):
        runs = []
        for seed in sweep.seeds:
            cell = Cell(spec, staleness, seed, sweep.axis, lr)
            run = read_run(cell.directory(sweep.output_dir), max_steps, criterion)
            if run is not None:
                runs.append({"seed": seed, **run})
        collapse_steps = [run["collapse_step"] for run in runs if run["collapsed"]]
        records.append(
            {
                "method": spec.label,
                sweep.axis: staleness,
                "staleness": staleness,
                "lr": lr,
                "seeds": [run["seed"] for run in runs],
                "runs_complete": sum(run["status"] == "complete" for run in runs),
                "final_accuracy": mean_std_ci([run["final_accuracy"] for run in runs]),
                "best_accuracy": mean_std_ci([run["best_accuracy"] for run in runs]),
                "auc_accuracy": mean_std_ci([run["auc_accuracy"] for run in runs]),
                "final_reward": mean_std_ci([run["final_reward"] for run in runs]),
                "accuracy_before": mean_std_ci([run["accuracy_before"] for run in runs]),
                "collapsed_runs": len(collapse_steps),
                "first_collapse_step": min(collapse_steps) if collapse_steps else None,
                "runs": runs,
            }
        )
    return records


def largest_stable_lr(records: list[dict], seeds: int) -> float | None:
    """The largest learning rate of one method x N at which, and below which, every run is stable.

    ``records``: that method x N's records, one per learning rate. A learning rate is
    stable when all ``seeds`` runs completed and none collapsed (``CollapseCriterion``).
    Scanning upwards from the smallest, the answer is the last stable value before the
    first unstable one; None when the smallest is already unstable (or not run).
    """
    stable = None
    for record in sorted(records, key=lambda r: r["lr"]):
        if record["runs_complete"] < seeds or record["collapsed_runs"] > 0:
            break
        stable = record["lr"]
    return stable


def lr_stability(report: dict) -> list[dict]:
    """Per method x N: the largest stable learning rate and the final accuracy at each one."""
    axis, seeds = report["axis"], len(report["seeds"])
    rows = []
    for value in report["staleness"]:
        for method in report["methods"]:
            records = [r for r in report["records"] if r["method"] == method and r[axis] == value]
            rows.append(
                {
                    "method": method,
                    axis: value,
                    "largest_stable_lr": largest_stable_lr(records, seeds),
                    "final_accuracy_by_lr": {f"{r['lr']:g}": r["final_accuracy"]["mean"] for r in records},
                    "collapsed_by_lr": {f"{r['lr']:g}": r["collapsed_runs"] for r in records},
                }
            )
    return rows


PAIRED_MEASURES = (("final_accuracy", "final accuracy"), ("auc_accuracy", "area under the curve"))


def paired_differences(report: dict) -> list[dict]:
    """Differences between cells paired by seed, with a 95 % interval over seeds.

    Every cell of one seed shares its warm start and its held-out set, so the difference
    ``x[a, seed] - x[b, seed]`` removes the spread between seeds that widens the per-cell
    intervals. Two families of comparisons, for the final accuracy and the area under
    the accuracy curve:

    * per method, the largest N minus the smallest (does staleness hurt it?);
    * per N, the reference method minus every other one (``vespo`` when it is in the
      grid, else the last method listed).

    Each entry: ``{"comparison", "measure", "mean", "std", "ci95", "n", "values",
    "excludes_zero"}`` (values are fractions, like the accuracies; ``n``: the seeds that
    both cells completed). ``excludes_zero`` is the sweep's rule for claiming a difference.
    """
    axis, methods, values = report["axis"], report["methods"], report["staleness"]
    runs = {}
    for record in report["records"]:
        for run in record["runs"]:
            runs[(record["method"], record[axis], run["seed"])] = run
    reference = "vespo" if "vespo" in methods else methods[-1]
    pairs = []
    if len(values) > 1:
        low, high = min(values), max(values)
        pairs += [(f"{m}: {axis} = {high} − {axis} = {low}", (m, high), (m, low)) for m in methods]
    pairs += [
        (f"{reference} − {m} at {axis} = {v}", (reference, v), (m, v))
        for v in values
        for m in methods
        if m != reference
    ]
    entries = []
    for comparison, first, second in pairs:
        for key, _ in PAIRED_MEASURES:
            differences = []
            for seed in report["seeds"]:
                a, b = runs.get((*first, seed)), runs.get((*second, seed))
                if a and b and a[key] is not None and b[key] is not None:
                    differences.append(a[key] - b[key])
            stat = mean_std_ci(differences)
            excludes_zero = stat["ci95"] is not None and abs(stat["mean"]) > stat["ci95"]
            entries.append({"comparison": comparison, "measure": key, **stat, "excludes_zero": excludes_zero})
    return entries


def _paired_table(report: dict) -> list[str]:
    """The paired differences as a table (points), bold where the interval excludes 0."""
    entries = report.get("paired") or []
    if len(report["seeds"]) < 2 or not entries:
        return []
    by_comparison: dict[str, dict] = {}
    for entry in entries:
        by_comparison.setdefault(entry["comparison"], {})[entry["measure"]] = entry
    lines = [
        "## Paired differences (points; mean ± 95 % CI over seeds; bold: the interval excludes 0)",
        "",
        "| comparison | " + " | ".join(title for _, title in PAIRED_MEASURES) + " |",
        "| --- | " + " | ".join("---" for _ in PAIRED_MEASURES) + " |",
    ]
    for comparison, measures in by_comparison.items():
        cells = []
        for key, _ in PAIRED_MEASURES:
            entry = measures[key]
            text = format_stat(entry, len(report["seeds"]))
            cells.append(f"**{text}**" if entry["excludes_zero"] else text)
        lines.append(f"| {comparison} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def write_report(sweep: Sweep, wall_seconds: float | None = None, criterion: CollapseCriterion | None = None):
    """``summary.json``, ``summary.md``, ``curves.png``, ``final_vs_staleness.png``."""
    criterion = criterion or CollapseCriterion()
    records = collect(sweep, criterion)
    run_seconds = [
        run["wall_seconds"] for record in records for run in record["runs"] if run["wall_seconds"] is not None
    ]
    report = {
        "methods": [spec.label for spec in sweep.methods],
        "staleness": sweep.staleness,
        "axis": sweep.axis,
        "seeds": sweep.seeds,
        "lrs": sweep.lrs,
        "overrides": sweep.overrides,
        "collapse_criterion": {**dataclasses.asdict(criterion), "rule": criterion.describe()},
        "wall_seconds": wall_seconds,
        "run_seconds_total": sum(run_seconds),
        "records": records,
    }
    if sweep.lrs:
        report["lr_stability"] = lr_stability(report)
    else:
        report["paired"] = paired_differences(report)
    write_json(sweep.output_dir / "summary.json", report)
    (sweep.output_dir / "summary.md").write_text(markdown_table(report))
    first = at_lr(report, sweep.lrs[0]) if sweep.lrs else report  # the figures: the smallest lr
    plot_curves(first, sweep.output_dir / "curves.png")
    plot_final_vs_staleness(first, sweep.output_dir / "final_vs_staleness.png")
    if sweep.lrs:
        plot_lr_stability(report, sweep.output_dir / "lr_stability.png")
    return report


def at_lr(report: dict, lr: float | None) -> dict:
    """The report restricted to the records of one learning rate."""
    return {**report, "records": [r for r in report["records"] if r.get("lr") == lr]}


def format_stat(stat: dict, seeds: int | None = None) -> str:
    """``mean ± ci`` in points; `` (n = k)`` when fewer than ``seeds`` runs (but some) went into it."""
    if stat["mean"] is None:
        return "—"
    text = (
        f"{100 * stat['mean']:.1f}"
        if stat["ci95"] is None
        else f"{100 * stat['mean']:.1f} ± {100 * stat['ci95']:.1f}"
    )
    return text + (f" (n = {stat['n']})" if seeds is not None and stat["n"] < seeds else "")


def markdown_table(report: dict) -> str:
    """Rows N, columns methods (the VESPO paper's Table 2 layout), one table per measure;
    with a learning-rate axis, one set of tables per learning rate and the stability table."""
    lines = _report_header(report)
    lrs = report.get("lrs")
    if lrs:
        lines += _lr_stability_table(report)
    for lr in lrs or [None]:
        if lr is not None:
            lines += [f"## Learning rate {lr:g}", ""]
        lines += _measure_tables(at_lr(report, lr), heading="###" if lr is not None else "##")
    lines += _paired_table(report)
    warm_starts = {}
    for record in report["records"]:
        for run in record["runs"]:
            if run["accuracy_before"] is not None and math.isfinite(run["accuracy_before"]):
                warm_starts.setdefault(run["seed"], run["accuracy_before"])
    lines += [
        "Warm start (held-out accuracy before RL, shared by every cell of a seed): "
        + (", ".join(f"seed {s}: {100 * a:.1f} %" for s, a in sorted(warm_starts.items())) or "not measured")
        + ".",
        f"Collapse criterion: {report['collapse_criterion']['rule']}.",
        "",
    ]
    return "\n".join(lines)


def _report_header(report: dict) -> list[str]:
    axis, seeds = report["axis"], len(report["seeds"])
    return [
        "# Staleness sweep",
        "",
        f"Held-out greedy accuracy (%), mean over {seeds} seed(s)"
        + (" ± 95 % CI (Student t; `(n = k)`: only k of them ran)" if seeds > 1 else "")
        + f"; {axis} = "
        + ("synchronous staleness" if axis == "N" else "async lag bound")
        + ". Shared settings: "
        + (", ".join(f"`{k}={v}`" for k, v in report["overrides"].items()) or "trainer defaults")
        + ".",
        "",
    ]


def _lr_stability_table(report: dict) -> list[str]:
    axis, methods = report["axis"], report["methods"]
    rows = {(row["method"], row[axis]): row for row in report["lr_stability"]}
    tried, smallest = ", ".join(f"{lr:g}" for lr in report["lrs"]), f"{report['lrs'][0]:g}"
    lines = [
        "## Largest stable learning rate",
        "",
        f"Learning rates tried: {tried}. Stable: every seed completed without collapsing at that "
        f"rate and at every smaller one; `< {smallest}` means the smallest already failed.",
        "",
        "| " + " | ".join([axis, *methods]) + " |",
        "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
    ]
    for value in report["staleness"]:
        cells = []
        for m in methods:
            stable = rows[(m, value)]["largest_stable_lr"]
            cells.append(f"< {smallest}" if stable is None else f"{stable:g}")
        lines.append("| " + " | ".join([str(value), *cells]) + " |")
    return [*lines, ""]


def _measure_tables(report: dict, heading: str = "##") -> list[str]:
    axis, methods = report["axis"], report["methods"]
    by_cell = {(r["method"], r[axis]): r for r in report["records"]}
    seeds = len(report["seeds"])
    lines = []
    tables = [
        ("Final accuracy", "final_accuracy"),
        ("Best accuracy during the run", "best_accuracy"),
        ("Area under the accuracy curve (mean accuracy along the run)", "auc_accuracy"),
    ]
    for title, key in tables:
        lines += [f"{heading} {title}", "", "| " + " | ".join([axis, *methods]) + " |"]
        lines.append("| " + " | ".join(["---"] * (len(methods) + 1)) + " |")
        for value in report["staleness"]:
            cells = [format_stat(by_cell[(m, value)][key], seeds) for m in methods]
            lines.append("| " + " | ".join([str(value), *cells]) + " |")
        lines.append("")
    lines += [f"{heading} Collapsed runs (collapsed / runs, first collapse step)", ""]
    lines += [
        "| " + " | ".join([axis, *methods]) + " |",
        "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
    ]
    for value in report["staleness"]:
        cells = []
        for m in methods:
            record = by_cell[(m, value)]
            text = f"{record['collapsed_runs']}/{len(record['runs'])}"
            if record["first_collapse_step"] is not None:
                reasons = sorted({run["collapse_reason"] for run in record["runs"] if run["collapsed"]})
                text += f" (step {record['first_collapse_step']}, {'/'.join(reasons)})"
            cells.append(text)
        lines.append("| " + " | ".join([str(value), *cells]) + " |")
    if seeds > 1:
        lines += [
            "",
            f"{heading} Final accuracy per seed (" + " / ".join(f"seed {s}" for s in report["seeds"]) + ")",
            "",
        ]
        lines += [
            "| " + " | ".join([axis, *methods]) + " |",
            "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
        ]
        for value in report["staleness"]:
            cells = []
            for m in methods:
                by_seed = {run["seed"]: run["final_accuracy"] for run in by_cell[(m, value)]["runs"]}
                cells.append(
                    " / ".join(
                        "—" if by_seed.get(s) is None else f"{100 * by_seed[s]:.1f}" for s in report["seeds"]
                    )
                )
            lines.append("| " + " | ".join([str(value), *cells]) + " |")
    return [*lines, ""]


def _mean_curve(curves: list[list[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """Average curves over seeds at the steps they share."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            by_step.setdefault(step, []).append(value)
    steps = sorted(step for step, values in by_step.items() if len(values) == len(curves))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def _smooth(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot_curves(report: dict, path: Path) -> None:
    """Reward (top) and held-out accuracy (bottom) against step; one panel per N, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis_name, values, methods = report["axis"], report["staleness"], report["methods"]
    figure, axes = plt.subplots(
        2, len(values), figsize=(3.2 * len(values) + 1, 5.5), squeeze=False, sharey="row"
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_cell = {(r["method"], r[axis_name]): r for r in report["records"]}
    for column, value in enumerate(values):
        for index, method in enumerate(methods):
            runs = by_cell[(method, value)]["runs"]
            if not runs:
                continue
            color = colors[index % len(colors)]
            steps, rewards = _mean_curve([run["curves"]["reward"] for run in runs])
            if steps:
                window = max(1, len(steps) // 16)
                axes[0][column].plot(steps, _smooth(rewards, window), color=color, label=method)
            steps, accuracies = _mean_curve([run["curves"]["accuracy"] for run in runs])
            if steps:
                axes[1][column].plot(steps, accuracies, "o-", markersize=3, color=color, label=method)
        axes[0][column].set_title(f"{axis_name} = {value}")
        axes[1][column].set_xlabel("optimizer step")
        for row in (0, 1):
            axes[row][column].grid(alpha=0.3)
    axes[0][0].set_ylabel("training reward (smoothed)")
    axes[1][0].set_ylabel("held-out accuracy")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_final_vs_staleness(report: dict, path: Path) -> None:
    """Final held-out accuracy (mean ± 95 % CI over seeds) against staleness, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis_name = report["axis"]
    figure, axis = plt.subplots(figsize=(6, 4))
    for method in report["methods"]:
        points = [
            (r[axis_name], r["final_accuracy"]["mean"], r["final_accuracy"]["ci95"] or 0.0)
            for r in report["records"]
            if r["method"] == method and r["final_accuracy"]["mean"] is not None
        ]
        if points:
            xs, ys, errors = zip(*points, strict=True)
            axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=method)
    before = [
        r["accuracy_before"]["mean"] for r in report["records"] if r["accuracy_before"]["mean"] is not None
    ]
    if before:
        axis.axhline(sum(before) / len(before), color="gray", linestyle="--", label="warm start")
    if all(value > 0 for value in report["staleness"]):
        axis.set_xscale("log", base=2)
    axis.set_xticks(report["staleness"])
    axis.set_xticklabels([str(v) for v in report["staleness"]])
    axis.set_xlabel("staleness N" if axis_name == "N" else "async lag bound K")
    axis.set_ylabel("final held-out accuracy")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_lr_stability(report: dict, path: Path) -> None:
    """The largest stable learning rate against staleness, one line per method (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis_name, lrs = report["axis"], report["lrs"]
    floor = lrs[0] / 2  # where "unstable even at the smallest" is drawn
    figure, axis = plt.subplots(figsize=(6, 4))
    for offset, method in enumerate(report["methods"]):
        rows = [row for row in report["lr_stability"] if row["method"] == method]
        xs = [row[axis_name] * (1 + 0.04 * offset) for row in rows]  # a small shift: no hidden lines
        ys = [row["largest_stable_lr"] or floor for row in rows]
        axis.plot(xs, ys, marker="o", label=method)
    axis.axhline(floor, color="gray", linestyle=":", label=f"< {lrs[0]:g} (none stable)")
    if all(value > 0 for value in report["staleness"]):
        axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_yticks(lrs)
    axis.set_yticklabels([f"{lr:g}" for lr in lrs])
    axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_xticks(report["staleness"])
    axis.set_xticklabels([str(v) for v in report["staleness"]])
    axis.set_xlabel("staleness N" if axis_name == "N" else "async lag bound K")
    axis.set_ylabel("largest stable learning rate")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def write_json(path: Path, value) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=2, allow_nan=True) + "\n")
    os.replace(temporary, path)


# ---------------------------------------------------------------------- command line
def add_sweep_arguments(parser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="A predefined grid and setup (default: full, the long-completion study, ~6.5 h on 2 cores, "
        "resumable; quick: the first half of 4 of its runs, ~16 min; addition: the short-completion setup; "
        "lr-stability: the largest stable learning rate per method and N, ~25 min; lr-stability-long: the same "
        "on the long-completion setup, ~55 min; "
        "vespo-ablations: the paper's VESPO ablations); flags override it.",
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
        help="A number of seeds S (seeds 0..S-1), or a comma-separated list ('1,' is seed 1 alone). [default: "
        + PRESETS["full"]["seeds"]
        + "]",
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
        "--report-only", action="store_true", help="Only rewrite the report from the runs already there."
    )
    parser.add_argument(
        "--no-progress", dest="sweep_progress", action="store_false", help="No progress bar for the grid."
    )


def sweep_from_arguments(arguments, extra: list[str]) -> Sweep:
    """The ``Sweep`` for the parsed sweep flags plus ``extra`` (any ``train`` flag, shared by every cell)."""
    import argparse

    from softtrust.train.config import add_config_arguments, config_from_arguments

    train_parser = argparse.ArgumentParser(prog="softtrust sweep", add_help=False, allow_abbrev=False)
    add_config_arguments(train_parser)
    train_arguments, unknown = train_parser.parse_known_args(extra)
    if unknown:
        raise ValueError(
            f"sweep: unrecognised arguments {unknown} (see softtrust sweep --help / train --help)"
        )
    given = set(vars(train_arguments)) - {"config"}  # flags default to SUPPRESS: only those given
    overrides_config = config_from_arguments(train_arguments)
    from_file = set()
    if train_arguments.config:
        from_file = set(yaml.safe_load(Path(train_arguments.config).read_text()) or {})
    overrides = {
        key: value
        for key, value in overrides_config.to_dict().items()
        if key in (given | from_file) and key != "config"
    }
    name = arguments.preset or "full"
    preset = PRESETS[name]
    setup = dict(preset["overrides"])
    if arguments.lrs or preset.get("lrs"):  # an lr axis replaces the preset's lr (a given --lr is refused)
        setup.pop(LR_AXIS_FIELD, None)
    overrides = {**setup, **overrides}  # flags override the preset's setup
    overrides.setdefault("num_threads", 1)
    mode = overrides.get("mode", "sync")
    axis_text = arguments.staleness or preset["staleness"]
    if mode == "async" and arguments.max_lag_axis:
        axis_text = arguments.max_lag_axis
    elif arguments.max_lag_axis:
        overrides["max_lag"] = parse_int_list(arguments.max_lag_axis, "max_lag")[0]
    jobs = arguments.jobs if arguments.jobs is not None else (os.cpu_count() or 1)
    return Sweep(
        methods=split_methods(arguments.methods or preset["methods"]),
        staleness=parse_int_list(axis_text, "staleness"),
        seeds=parse_seeds(arguments.seeds or preset["seeds"]),
        output_dir=Path(arguments.sweep_dir or Path("sweeps") / name),
        overrides=overrides,
        jobs=jobs,
        progress=arguments.sweep_progress,
        lrs=parse_lrs(arguments.lrs) if arguments.lrs else preset.get("lrs"),
    )


# ---------------------------------------------------------------------- one cell's process
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
