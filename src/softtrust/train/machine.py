"""What a config points at on this machine: a ``--model`` directory (checked by
``TrainConfig.validate`` before any work) and a ``--device`` (checked, then resolved for a
one-process run). ``config`` re-exports ``check_causal_lm_directory`` and ``resolve_device``."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import torch

#: the weight files ``from_pretrained`` reads, one of which a ``--model`` directory must hold
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: the first bytes of a pre-1.6 ``torch.save`` file (a pickle protocol 2 of the magic number)
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\nl\xfc\x9c"


def check_causal_lm_directory(path: str) -> None:
    """Fail with a one-line message naming ``model`` unless ``path`` holds a decoder-only causal LM
    config, readable weights (``check_weights``) and a tokenizer: what ``from_pretrained`` and the
    sampler need, checked before any run directory exists."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"model: {path!r} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as error:
        raise ValueError(f"model: cannot read the config in {path!r} ({error})") from error
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model: {path!r} holds a {config.model_type!r} model, which is not a causal LM")
    # BERT, RoBERTa, BART, ... have a causal-LM head class too, but are encoders or encoder-decoders
    encoder = {**MODEL_FOR_MASKED_LM_MAPPING_NAMES, **MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}
    if config.model_type in encoder:
        raise ValueError(
            f"model: {path!r} holds a {config.model_type!r} model, an encoder (or encoder-decoder) "
            "architecture; softtrust samples from and trains decoder-only causal LMs (Qwen2, Llama, GPT-2, ...)"
        )
    check_weights(directory)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / name).is_file() for name in tokenizer_files):
        raise ValueError(
            f"model: {path!r} has no tokenizer files (save the tokenizer with save_pretrained too)"
        )


def check_weights(directory: Path) -> None:
    """Raise a ``ValueError`` naming ``model`` unless ``directory`` holds a weight file of
    :data:`WEIGHT_FILES` that reads: a safetensors file whose header parses and whose tensors
    lie inside the file (a truncated or overwritten file fails), a sharded index whose every
    shard does, or a ``.bin`` that is a whole zip archive (``torch.save``) or a legacy one.
    Reads headers and directories only, never the tensors."""
    present = [name for name in WEIGHT_FILES if (directory / name).is_file()]
    if not present:
        raise ValueError(
            f"model: {str(directory)!r} holds no weights (none of {', '.join(WEIGHT_FILES)}); "
            "save the model with save_pretrained"
        )
    name = present[0]
    if name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads((directory / name).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"model: {directory / name} is not a readable weight index ({error!r})"
            ) from error
        files = [directory / shard for shard in shards]
    else:
        files = [directory / name]
    for file in files:
        problem = _safetensors_problem(file) if file.suffix == ".safetensors" else _torch_file_problem(file)
        if problem:
            raise ValueError(f"model: the weights {file} cannot be read: {problem}; save the model again")


def _safetensors_problem(file: Path) -> str:
    """Why ``file`` is not a whole safetensors file (its 8-byte header length, the JSON header,
    every tensor's byte range inside the data that follows), or ``""``."""
    if not file.is_file():
        return "the file is missing"
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            return f"its header claims {length} bytes but the file holds {size}"
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError) as error:
            return f"its header is not JSON ({error})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [entry.get("data_offsets", [0, 0])[1] for key, entry in header.items() if key != "__metadata__"]
    if not ends or not all(isinstance(end, int) for end in ends):
        return "its header lists no tensors"
    if max(ends) > size - 8 - length:
        return f"truncated: its tensors need {max(ends)} bytes of data, the file holds {size - 8 - length}"
    return ""


def _torch_file_problem(file: Path) -> str:
    """Why ``file`` is not a readable ``torch.save`` file (a zip whose directory reads, or the legacy
    format), or ``""``."""
    if not file.is_file():
        return "the file is missing"
    with file.open("rb") as handle:
        if handle.read(len(_LEGACY_TORCH_MAGIC)) == _LEGACY_TORCH_MAGIC:
            return ""
    try:
        with zipfile.ZipFile(file) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        return f"not a torch.save archive ({error})"
    return ""


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
