"""Atomic checkpoints: a complete directory appears by rename, or not at all.

Layout under ``<run>/checkpoints/``::

    step-000064/model.safetensors   the policy weights (safetensors)
    step-000064/state.pt            optimizer, scheduler, RNG states, step, the rollout source's state,
                                    counters, the adaptive KL coefficient (tensors and plain Python only:
                                    weights_only=True loads it)

``save_state`` / ``restore_state`` take the trainer's ``TrainState`` (``state.py``).
    latest                          the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, flushed to disk, then renamed;
``latest`` is replaced the same way. A process killed at any point leaves the previous
checkpoint and a ``latest`` that names a complete directory.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_model, save_file, save_model

from softtrust._runfiles import atomic_write_text, fsync_directory, read_jsonl

from .distributed import full_optimizer_state, load_full_model_state, load_full_optimizer_state

if TYPE_CHECKING:
    from .state import TrainState

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
LATEST_FILE = "latest"
CHECKPOINT_NAME = re.compile(r"step-\d+")  # checkpoint_name(step); what ``latest`` may hold


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    checkpoint_root: Path,
    step: int,
    model,
    state: dict,
    keep: int = 2,
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` and ``state`` as ``checkpoint_root/step-XXXXXX`` atomically; prune old ones.

    Args:
        model_state: the weights to write instead of ``model``'s own (a model sharded with
            FSDP2 passes its gathered full state dict, tied weights once, so that the file
            is the one ``save_model`` would write).

    Returns:
        The final checkpoint directory.
    """
    checkpoint_root = Path(checkpoint_root)
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_root / checkpoint_name(step)
    temporary = Path(tempfile.mkdtemp(dir=checkpoint_root, prefix=f".tmp-{final.name}-"))
    try:
        if model_state is None:
            save_model(model, str(temporary / MODEL_FILE))
        else:
            save_file(model_state, str(temporary / MODEL_FILE), metadata={"format": "pt"})
        torch.save(state, temporary / STATE_FILE)
        for name in (MODEL_FILE, STATE_FILE):
            _fsync_file(temporary / name)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    fsync_directory(checkpoint_root)
    atomic_write_text(checkpoint_root / LATEST_FILE, final.name + "\n")
    _prune(checkpoint_root, keep)
    return final


def _complete_checkpoints(checkpoint_root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (temporary ones never match)."""
    found = [
        path
        for path in checkpoint_root.glob("step-*")
        if path.is_dir() and (path / MODEL_FILE).is_file() and (path / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda path: path.name)


def _prune(checkpoint_root: Path, keep: int) -> None:
    for path in _complete_checkpoints(checkpoint_root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for leftover in checkpoint_root.glob(".tmp-*"):  # from a process killed mid-save
        shutil.rmtree(leftover, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint to resume from: ``path`` itself, or the newest under a run directory.

    Accepts a checkpoint directory, a ``checkpoints/`` directory or a run directory.
    ``latest`` is trusted when it names a complete checkpoint; otherwise the newest
    complete one is used. ``latest`` may only hold a ``step-*`` name inside the same
    ``checkpoints/`` (``latest_name``): a path to elsewhere is refused, never followed.
    """
    path = Path(path)
    if (path / STATE_FILE).is_file() and (path / MODEL_FILE).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    latest = root / LATEST_FILE
    if latest.is_file():
        named = root / latest_name(latest)
        if (named / STATE_FILE).is_file() and (named / MODEL_FILE).is_file():
            return named
    complete = _complete_checkpoints(root)
    if not complete:
        if never_trained(path):
            remedy = (
                f"it never trained a step, so start it again in the same directory: a new run with "
                f"--output-dir {path} takes it over"
            )
        else:
            remedy = "start it again in a new --output-dir"
        raise ValueError(
            f"resume: no complete checkpoint under {str(path)!r} (the run stopped before its first save); {remedy}"
        )
    return complete[-1]


def has_complete_checkpoint(run_directory: Path) -> bool:
    """Whether ``run_directory/checkpoints`` holds a complete checkpoint (one a resume loads)."""
    return bool(_complete_checkpoints(Path(run_directory) / "checkpoints"))


def never_trained(run_directory: Path) -> bool:
    """A run directory whose run stopped before its first optimizer step: no metrics line, no
    complete checkpoint, no ``summary.json`` nor ``final/`` (it crashed while loading the model,
    in the warm start or in its first rollout). Nothing in it is lost when a new run replaces it."""
    directory = Path(run_directory)
    return not (
        read_jsonl(directory / "metrics.jsonl")
        or has_complete_checkpoint(directory)
        or (directory / "summary.json").exists()
        or (directory / "final").exists()
    )


def latest_name(latest: Path) -> str:
    """The checkpoint name ``latest`` holds: ``step-`` and digits, a directory of the same
    ``checkpoints/`` (not a link out of it); anything else (a path such as
    ``../../OTHER/checkpoints/step-000003``, an absolute path) is a ``ValueError`` naming the file,
    since following it would resume from another run's weights."""
    name = latest.read_text().strip()
    named = latest.parent / name
    inside = not named.exists() or named.resolve().parent == latest.parent.resolve()
    if not (CHECKPOINT_NAME.fullmatch(name) and inside):
        raise ValueError(
            f"resume: {str(latest)!r} names {name!r}; expected the name of a checkpoint in the same "
            f"directory (step-XXXXXX): correct it to the newest of its own step-* directories, or delete it"
        )
    return name


def load_checkpoint(checkpoint: Path, model) -> dict:
    """Load the weights into ``model`` (in place) and return the state dict (weights_only)."""
    checkpoint = Path(checkpoint)
    load_model(model, str(checkpoint / MODEL_FILE))
    # On the CPU whatever device wrote it: a GPU run resumes on a CPU machine (or another GPU);
    # optimizer.load_state_dict moves the state to its parameters' device.
    return torch.load(checkpoint / STATE_FILE, weights_only=True, map_location="cpu")


def run_directory_of(path: str | Path) -> Path:
    """The run directory of ``--resume PATH``: PATH itself (a run directory holds ``config.yaml``),
    or the run that holds PATH when PATH is its ``checkpoints/`` or one checkpoint directory."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        return path
    if path.name == "checkpoints" and (path.parent / "config.yaml").is_file():
        return path.parent
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent
    raise ValueError(
        f"resume: {str(path)!r} is not a run directory (no config.yaml) nor a checkpoint inside one"
    )


def save_state(directory: Path, state: TrainState, config_yaml: str, keep: int) -> Path | None:
    """Checkpoint ``state`` under ``directory/checkpoints``: every rank takes part in gathering
    the weights and optimizer state, rank 0 writes. Returns the checkpoint (rank 0) or None."""
    learner = state.learner
    payload = {
        "step": state.step,
        "optimizer": full_optimizer_state(learner.policy, learner.optimizer, learner.world),
        "scheduler": learner.scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "problems": state.sampler.rng.getstate()},
        "rollouts": state.rollouts.state(),
        "counters": state.counters(),
        "learner": learner.state(),
        "config": config_yaml,
    }
    if learner.kl_controller is not None:  # --kl-target: the coefficient it has moved to
        payload["kl_controller"] = learner.kl_controller.state_dict()
    model_state = learner.model_state()
    path = None
    if learner.world.is_main:
        path = save_checkpoint(
            directory / "checkpoints", state.step, learner.model, payload, keep=keep, model_state=model_state
        )
    learner.world.barrier()  # the checkpoint is complete before anyone moves on
    return path


def restore_state(checkpoint: Path, state: TrainState) -> None:
    """Load ``checkpoint`` (written by any number of processes) into ``state`` on every rank:
    weights, optimizer, scheduler, random streams, the rollout source, step and counters."""
    learner = state.learner
    if learner.world.fsdp:
        from safetensors.torch import load_file

        load_full_model_state(learner.policy, load_file(str(checkpoint / MODEL_FILE)))
        payload = torch.load(checkpoint / STATE_FILE, weights_only=True, map_location="cpu")
    else:
        payload = load_checkpoint(checkpoint, learner.model)
    load_full_optimizer_state(learner.policy, learner.optimizer, payload["optimizer"], learner.world)
    learner.scheduler.load_state_dict(payload["scheduler"])
    torch.set_rng_state(payload["rng"]["torch"])
    version, internal, gauss = payload["rng"]["problems"]
    state.sampler.rng.setstate((version, tuple(internal), gauss))
    state.rollouts.load_state(payload["rollouts"])
    state.load_counters(payload["counters"])
    if learner.kl_controller is not None and "kl_controller" in payload:
        learner.kl_controller.load_state_dict(payload["kl_controller"])
    learner.load_state(payload.get("learner", {}))
    state.step = int(payload["step"])
