"""What a config points at on this machine: a ``--model`` directory (checked by
``TrainConfig.validate`` before any work) and a ``--device`` (checked, then resolved for a
one-process run). ``config`` re-exports ``check_causal_lm_directory`` and ``resolve_device``."""

from __future__ import annotations

from pathlib import Path

import torch


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


def check_device(device: str) -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, and CUDA only where torch has it. Raises
    ``ValueError`` naming ``device``."""
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device: choose auto, cpu, cuda or cuda:N (got {device!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            "device: CUDA was asked for but torch.cuda.is_available() is False (a CPU build of torch, or no "
            f"GPU); pass --device cpu (also to resume a GPU run here) (got {device!r})"
        )


def resolve_device(device: str) -> torch.device:
    """The ``torch.device`` of a one-process run: ``auto`` is ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
