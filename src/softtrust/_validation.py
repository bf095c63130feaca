"""One-line input checks shared by every public function.

Each check raises ``ValueError`` with a message that names the argument, what was
received and what was expected, so that a caller can fix the call from the message
alone. Hyperparameter checks run at construction time (in ``__post_init__``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Raise unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
    """Raise unless ``value`` is a finite real number inside the given bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"{name} must be {bound} {low}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        bound = "<=" if high_inclusive else "<"
        raise ValueError(f"{name} must be {bound} {high}, got {value!r}")


def check_float_tensor(name: str, x: object) -> None:
    """Raise unless ``x`` is a floating-point ``torch.Tensor``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (log-probabilities), got dtype {x.dtype}")


def check_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    """Raise unless ``x.shape == expected``; ``meaning`` spells the expected shape, e.g. ``"(B, T)"``."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(expected)}, got {tuple(x.shape)}")


def as_float_mask(name: str, mask: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return ``mask`` as a 0.0/1.0 tensor of ``dtype``; raise unless it is bool or holds only 0 and 1.

    A bool mask is converted through ``uint8``, which is many times faster than a
    direct bool -> float conversion on CPU.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    check_shape(name, mask, shape, "(B, T)")
    if mask.dtype == torch.bool:
        return mask.contiguous().view(torch.uint8).to(dtype)
    values = mask.to(dtype)
    if not torch.equal(values * values, values):  # v² = v exactly for 0 and 1 only (NaN ≠ NaN)
        bad = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
        raise ValueError(f"{name} must be bool or contain only 0 and 1, got a value {bad!r}")
    return values


def as_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, through ``uint8`` for a bool tensor (much faster on CPU)."""
    if x.dtype == torch.bool:
        return x.contiguous().view(torch.uint8).to(dtype)
    return x.to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the math runs in: float64 stays float64, every other float runs in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=256)
def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-dim tensor holding ``value``: building one per call costs more than the small
    op that uses it, and a tensor operand is cheaper than a Python scalar (no wrapping per call)."""
    return torch.tensor(value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def constants(
    values: tuple[float, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """:func:`constant` for several values with one cache lookup (a function's whole set of constants)."""
    return tuple(constant(value, dtype, device) for value in values)
