"""The run directory: ``config.yaml``, ``metrics.jsonl``, ``events.jsonl``, TensorBoard events,
checkpoints, ``final/``, ``summary.json`` and the reward plot.

A run directory is owned by one run, and written by one live process at a time (rank 0 holds
``_runlock.DirectoryLock`` from ``RunLog.open`` to ``RunLog.close``; a killed owner's lock is
taken over with a note). A new run refuses a directory that already holds a run's files
(``RUN_FILES``) or lies inside another run's directory, and says how to resume it or where else
to go (a run that never trained a step is taken over instead: it cannot be resumed); the default name (``runs/<time>-<method>-N<N>-seed<seed>-<random>``) cannot collide. A resumed run
writes into the directory it resumes (whatever ``output_dir`` its config recorded), keeps
its metrics up to the checkpoint and drops any logged after it (they are logged again).
Under ``torchrun`` only rank 0 writes; the other ranks hold a silent ``RunLog``.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from softtrust._optional import MissingDependency, pyplot
from softtrust._provenance import provenance
from softtrust._runfiles import atomic_write_text, read_jsonl, remove_entries, trailing_mean
from softtrust._runlock import DirectoryLock

from .checkpoint import has_complete_checkpoint, never_trained
from .config import TrainConfig
from .distributed import World

if TYPE_CHECKING:
    from .rollout import Evaluation

# What a run writes into its directory: a directory holding any of them holds a run.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "events.jsonl",
    "samples.jsonl",
    "summary.json",
    "checkpoints",
    "final",
    "tensorboard",
    "reward_curve.png",
)


def schedule_parts(config: TrainConfig) -> list[tuple[str, int]]:
    """The staleness schedule as a run's name and progress line show it: ``[("N", N)]`` in sync
    mode, ``[("K", K)]`` in async mode and ``("U", U)`` after it for ``--updates-per-batch U > 1``."""
    if config.mode == "sync":
        return [("N", config.staleness)]
    return [("K", config.max_lag)] + (
        [("U", config.updates_per_batch)] if config.updates_per_batch > 1 else []
    )


def default_run_directory(config: TrainConfig) -> str:
    """``runs/<UTC time>-<method>-N<N>-seed<seed>-<6 random hex digits>`` (K<K>, and U<U> when
    U > 1, in async mode)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    schedule = "-".join(f"{name}{value}" for name, value in schedule_parts(config))
    return str(Path("runs") / f"{stamp}-{config.method}-{schedule}-seed{config.seed}-{secrets.token_hex(3)}")


def is_run_directory(directory: Path) -> bool:
    """Whether ``directory`` holds a softtrust run: a ``config.yaml`` that reads as a
    ``TrainConfig`` next to the run's own logs (``events.jsonl`` or ``metrics.jsonl``); a project
    folder with a ``config.yaml`` and a ``checkpoints/`` of its own is not one."""
    if not (directory / "config.yaml").is_file():
        return False
    if not ((directory / "events.jsonl").is_file() or (directory / "metrics.jsonl").is_file()):
        return False
    try:
        TrainConfig.from_yaml(directory / "config.yaml")
    except (OSError, ValueError, TypeError, yaml.YAMLError):
        return False
    return True


# What a run that never trained leaves that a new run in its directory replaces (``config.yaml``
# is rewritten): its events (warm start, the evaluation before RL), samples, an empty metrics
# file, TensorBoard events and a checkpoint directory without a complete checkpoint.
UNTRAINED_RUN_FILES = ("events.jsonl", "samples.jsonl", "metrics.jsonl", "tensorboard", "checkpoints")


def check_new_run_directory(directory: Path) -> bool:
    """Refuse a directory that already holds a run (``RUN_FILES``) or lies inside one (its pruning
    or a resume would delete or mix with the new run), naming how to go on. A run that never
    trained a step (``checkpoint.never_trained``: it crashed before, and cannot be resumed) is not
    refused: returns True, and the new run takes its directory over (``take_over_untrained``)."""
    if directory.is_file():
        raise ValueError(f"output_dir: {str(directory)!r} is a file, not a directory")
    for parent in directory.resolve().parents:
        if is_run_directory(parent):
            raise ValueError(
                f"output_dir: {str(directory)!r} lies inside the run directory {str(parent)!r}, whose "
                "checkpoint pruning and resumes would delete or mix with it; choose a directory outside it"
            )
    found = sorted(name for name in RUN_FILES if (directory / name).exists())
    if not found:
        return False
    if never_trained(directory):
        return True
    if not has_complete_checkpoint(directory):
        raise ValueError(
            f"output_dir: {str(directory)!r} already holds a run ({', '.join(found)}) that trained "
            f"{len(read_jsonl(directory / 'metrics.jsonl'))} step(s) and has no checkpoint, so it cannot be "
            "resumed; choose another --output-dir (or none, for a new unique one), or move its files away"
        )
    raise ValueError(
        f"output_dir: {str(directory)!r} already holds a run ({', '.join(found)}); resume it with "
        f"--resume {directory}, or choose another --output-dir (or none, for a new unique one)"
    )


def take_over_untrained(directory: Path) -> str:
    """Remove what a run that never trained left (``UNTRAINED_RUN_FILES``) for the new run in its
    directory; returns the note the new run gives."""
    remove_entries(directory, UNTRAINED_RUN_FILES)
    return (
        f"{directory} held a run that never trained a step (no metrics, no checkpoint); "
        "this run replaces its files"
    )


def lock_run_directory(directory: Path, new: bool) -> tuple[DirectoryLock, str | None]:
    """Create ``directory`` if needed and take its lock (a ``ValueError`` naming the live owner
    otherwise); a ``new`` run's directory is checked before and, under the lock, again (two new
    runs started at once into one directory: the second is refused), and a run there that never
    trained is replaced (``take_over_untrained``). Returns the lock and a note to give the user:
    a takeover from a killed owner or of a run that never trained (or None)."""
    if new:
        check_new_run_directory(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(directory, "output_dir")
    note = lock.acquire()
    if new:
        try:
            if check_new_run_directory(directory):
                note = "; ".join(filter(None, [note, take_over_untrained(directory)]))
        except ValueError:
            lock.release()
            raise
    return lock, note


class RunLog:
    """The run directory's writer (``RunLog.open``): metrics, events, summary, plot."""

    def __init__(self, directory: Path, config: TrainConfig, writes: bool = True):
        self.directory = directory
        self.writes = writes
        self.metrics_path = directory / "metrics.jsonl"
        self.events_path = directory / "events.jsonl"
        self.samples_path = directory / "samples.jsonl"
        self.rewards: list[tuple[int, float]] = []
        self.accuracies: list[tuple[int, float]] = []
        self.tensorboard = None
        if config.report_to == "tensorboard" and writes:  # installed: TrainConfig.validate checks it
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(directory / "tensorboard"))
        self.last_postfix: dict = {}
        self.warmstart: dict = {}  # what the warm start did (warmstart_* fields), for the summary
        self.warned: set[str] = set()  # the keys of the warnings given once (``warn``)
        self.lock: DirectoryLock | None = None  # rank 0's hold on the directory, until ``close``

    @classmethod
    def open(cls, config: TrainConfig, world: World | None = None) -> RunLog:
        """The run directory of ``config``: a new one (refused if it holds a run), or on
        ``resume`` the resumed run's own (``config.output_dir``, set by ``resume_config``).
        Sets ``config.output_dir`` to the directory used; writes ``config.yaml``."""
        world = world or World()
        if config.output_dir is None:
            config.output_dir = world.broadcast(default_run_directory(config))
        directory = Path(config.output_dir)
        problem, lock, took_over = None, None, None
        if world.is_main:
            try:
                lock, took_over = lock_run_directory(directory, new=config.resume is None)
            except ValueError as error:
                problem = str(error)
        problem = world.broadcast(problem)  # every rank fails alike, before a run file is written
        if problem is not None:
            if lock is not None:
                lock.release()
            raise ValueError(problem)
        if not world.is_main:
            return cls(directory, config, writes=False)
        run = cls(directory, config)
        run.lock = lock
        try:
            run._start(config, took_over)
        except BaseException:  # the directory is not left locked by a run that never started
            run.close()
            raise
        return run

    def _start(self, config: TrainConfig, took_over: str | None) -> None:
        """Write ``config.yaml``, say a takeover (stderr and ``events.jsonl``, step 0 so that a
        resume keeps it) and, on resume, read back what the run logged before."""
        atomic_write_text(self.directory / "config.yaml", config.to_yaml())
        if took_over is not None:
            self.warn(took_over, step=0)
        if config.resume is not None:
            self.rewards = [(r["step"], r["reward/mean"]) for r in read_jsonl(self.metrics_path)]
            self.accuracies = [
                (r["step"], r["eval/accuracy"]) for r in self._records() if "eval/accuracy" in r
            ]
            starts = [r for r in read_jsonl(self.events_path) if "warmstart_steps" in r]
            self.warmstart = (
                {k: v for k, v in starts[-1].items() if k.startswith("warmstart")} if starts else {}
            )

    def close(self) -> None:
        """Release the directory (the run's files stay); safe to call twice."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _records(self) -> list[dict]:
        return read_jsonl(self.events_path) + read_jsonl(self.metrics_path)

    def truncate_after(self, step: int) -> None:
        """Keep the metrics and events up to ``step`` (a resume's checkpoint); a torn last line goes too."""
        if not self.writes:
            return
        for path in (self.metrics_path, self.events_path, self.samples_path):
            if path.is_file():
                kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
                atomic_write_text(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))
        self.rewards = [(s, r) for s, r in self.rewards if s <= step]
        self.accuracies = sorted({s: a for s, a in self.accuracies if s <= step}.items())

    def log_event(self, record: dict) -> None:
        if not self.writes:
            return
        if "eval/accuracy" in record:
            self.accuracies.append((record["step"], record["eval/accuracy"]))
            self.last_postfix["acc"] = f"{record['eval/accuracy']:.3f}"
        with open(self.events_path, "a") as handle:
            handle.write(json.dumps({"time": time.time(), **record}) + "\n")

    def log_stop(self, step: int, message: str) -> None:
        """The run stops itself (too many non-finite updates; no ``summary.json`` follows): an
        event with the message and the code that made the run (``provenance``, as the summary
        has it), so that the study counts the stop as this code's failure."""
        self.log_event({"step": step, "stopped": message, "provenance": provenance()})

    def warn(self, message: str, step: int, once: str | None = None) -> None:
        """One line on stderr (``softtrust train: warning: ...``) and a ``{"warning": ...}`` line
        in ``events.jsonl``: something the user should know that does not stop the run.
        ``once``: a key; a second warning with the same key is dropped."""
        if not self.writes or once in self.warned:
            return
        if once is not None:
            self.warned.add(once)
        print(f"softtrust train: warning: {message}", file=sys.stderr, flush=True)
        self.log_event({"step": step, "warning": message})

    def log_samples(self, step: int, kind: str, samples: list[dict]) -> None:
        """Append ``samples`` (prompt as fed to the model, completion, rewards) to ``samples.jsonl``,
        one line each, tagged with the step and ``kind`` (``eval``: greedy held-out; ``train``: sampled)."""
        if not self.writes or not samples:
            return
        with open(self.samples_path, "a") as handle:
            for sample in samples:
                handle.write(json.dumps({"step": step, "kind": kind, **sample}, allow_nan=True) + "\n")

    def log_step(self, metrics: dict, progress) -> None:
        if not self.writes:
            return
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(metrics, allow_nan=True) + "\n")
        step = metrics["step"]
        self.rewards.append((step, metrics["reward/mean"]))
        if "eval/accuracy" in metrics:
            self.accuracies.append((step, metrics["eval/accuracy"]))
            self.last_postfix["acc"] = f"{metrics['eval/accuracy']:.3f}"
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(name, value, step)
        weight = metrics.get("loss/phi/mean", metrics.get("loss/ratio/mean", float("nan")))
        self.last_postfix.update(
            reward=f"{metrics['reward/mean']:.3f}",
            kl=f"{metrics['kl_behaviour']:.2e}",
            w=f"{weight:.3f}",
            lag=metrics["lag"],
            tok_s=f"{metrics['tokens_per_second']:.0f}",
        )
        progress.set_postfix(self.last_postfix, refresh=False)
        progress.update(1)

    def note(self, message: str) -> None:
        """One line on stderr (rank 0): what the run is doing while no progress bar runs."""
        if self.writes:
            print(message, file=sys.stderr, flush=True)

    def progress_bar(self, config: TrainConfig, initial: int):
        """The RL steps' progress: a live bar, or with ``--no-progress`` (a sweep cell) a plain
        line every few steps (``StepLines``), so that a log file fills as the run goes."""
        schedule = " ".join(f"{name}={value}" for name, value in schedule_parts(config))
        return self.simple_bar(
            config.max_steps, f"RL {config.method} {schedule} {config.mode}", initial, config.progress
        )

    def simple_bar(self, total: int, description: str, initial: int = 0, live: bool = True):
        """A tqdm bar when ``live``, else ``StepLines``; silent on the ranks that do not write."""
        if not live:
            return StepLines(total, description, initial, enabled=self.writes)
        from tqdm.auto import tqdm

        return tqdm(
            total=total, initial=initial, desc=description, disable=not self.writes, dynamic_ncols=True
        )

    def finish(
        self,
        config: TrainConfig,
        model,
        tokenizer,
        state,
        after: Evaluation,
        wall_seconds: float,
        model_state: dict[str, torch.Tensor] | None = None,
    ) -> dict:
        """Write ``final/`` (``model_state``: the gathered weights of an FSDP2 model) and the summary
        (``after``: the last held-out accuracy and mean score)."""
        final = self.directory / "final"
        if self.writes:
            save_final_model(final, model, tokenizer, model_state)
        rewards = [reward for _, reward in self.rewards]
        window = max(1, len(rewards) // 10)
        summary = {
            "accuracy_before": state.accuracy_before,
            "accuracy_after": after.accuracy,
            "score_before": state.score_before,
            "score_after": after.score,
            "reward_first": sum(rewards[:window]) / window if rewards else None,
            "reward_last": sum(rewards[-window:]) / window if rewards else None,
            "steps": state.step,
            "method": config.method,
            "staleness": config.staleness,
            "mode": config.mode,
            "max_lag": config.max_lag,
            "max_new_tokens": config.effective_max_new_tokens,
            "wall_seconds": wall_seconds,
            **self.warmstart,
            "nonfinite_skips": state.nonfinite_skips,
            "reward_failures": state.reward_failures,
            "completion_tokens": state.completion_tokens,
            "device": str(next(model.parameters()).device),  # where the learner ran
            "final_dir": str(final),
            "provenance": provenance(),  # the code that made it: the study pairs runs only of the same code
        }
        if not self.writes:
            return summary
        atomic_write_text(self.directory / "summary.json", json.dumps(summary, indent=2) + "\n")
        try:
            self.plot()
        except MissingDependency as missing:  # the run's results are saved: a figure is not worth a crash
            self.warn(f"reward_curve.png not written: {missing}", state.step)
        if self.tensorboard is not None:
            self.tensorboard.close()
        return summary

    def plot(self) -> None:
        """``reward_curve.png``: reward per step and held-out accuracy (``MissingDependency``
        without matplotlib)."""
        plt = pyplot("the reward plot")
        figure, axis = plt.subplots(figsize=(7, 4))
        if self.rewards:
            steps, rewards = zip(*self.rewards, strict=True)
            axis.plot(steps, rewards, alpha=0.35, label="reward (per step)")
            window = max(1, len(rewards) // 16)
            axis.plot(steps, trailing_mean(list(rewards), window), label=f"reward (mean of {window})")
        if self.accuracies:
            steps, accuracies = zip(*self.accuracies, strict=True)
            axis.plot(steps, accuracies, "o-", label="held-out greedy accuracy")
        axis.set_xlabel("optimizer step")
        axis.set_ylim(0, 1)
        axis.legend()
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(self.directory / "reward_curve.png", dpi=100)
        plt.close(figure)


class StepLines:
    """A progress bar's plain-text stand-in (tqdm's ``update``, ``set_postfix``, ``close``): a line
    on stderr, flushed, every ``total // LINES`` steps, at the last one and at least every
    ``SECONDS``, e.g. ``RL vespo N=8 sync: step 16/128, reward 0.312, kl 1.20e-03, ...``."""

    LINES, SECONDS = 16, 60.0

    def __init__(self, total: int, description: str, initial: int = 0, enabled: bool = True):
        self.total, self.description, self.n, self.enabled = total, description, initial, enabled
        self.every = max(1, total // self.LINES)
        self.postfix: dict = {}
        self.last_line = time.time()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = False, **values) -> None:
        self.postfix = {**(ordered_dict or {}), **values}

    def update(self, n: int = 1) -> None:
        self.n += n
        due = self.n % self.every == 0 or self.n >= self.total or time.time() - self.last_line >= self.SECONDS
        if self.enabled and due:
            values = "".join(f", {key} {value}" for key, value in self.postfix.items())
            print(f"{self.description}: step {self.n}/{self.total}{values}", file=sys.stderr, flush=True)
            self.last_line = time.time()

    def close(self) -> None:
        pass


def save_final_model(directory: Path, model, tokenizer, model_state: dict[str, torch.Tensor] | None) -> None:
    """``save_pretrained`` layout: the config, the weights (``model_state`` when the model is
    sharded with FSDP2) and the tokenizer."""
    model.save_pretrained(directory, state_dict=model_state)
    tokenizer.save_pretrained(directory)
