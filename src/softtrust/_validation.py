"""One-line input checks shared by every public function.

Each check raises ``ValueError`` with a message that names the argument, what was
received and what was expected, so that a caller can fix the call from the message
alone. Hyperparameter checks run at construction time (in ``__post_init__``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Raise unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


#: the float32 range a hyperparameter must lie in: the loss computes in float32 (float64 stays float64)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4028e38
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # 1.1755e-38, the smallest normal magnitude
#: the largest factor a hyperparameter may put on a loss term (and the reciprocal of the smallest
#: one that divides it): with ratios up to e^20 (the default clamp), squared ratios (CFPO, an
#: importance-corrected k3) and advantages of any usual size, every term stays far inside float32
SCALE_MAX = 1e12


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    low_name: str | None = None,
) -> None:
    """Raise unless ``value`` is a finite real number inside the given bounds, representable in float32.

    ``low_name`` names the parameter the lower bound comes from (``cov_high > cov_low``), for the message.

    Representable: 0 or a magnitude in ``[FLOAT32_TINY, FLOAT32_MAX]`` (1.18e-38 to 3.40e38).
    A hyperparameter beyond that (``eps_high=1e39``, ``tau=1e-300``) would overflow or
    flush to 0 where the loss casts it to float32, so it is refused here, at construction.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        bound = (">=" if low_inclusive else ">") + ("" if low_name is None else f" {low_name} =")
        raise ValueError(f"{name} must be {bound} {low!r}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        bound = "<=" if high_inclusive else "<"
        raise ValueError(f"{name} must be {bound} {high}, got {value!r}")
    if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be 0 or of a magnitude in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] "
            f"(representable in float32, where the loss computes), got {value!r}"
        )


def check_scale(
    name: str,
    value: object,
    *,
    multiplies: bool = True,
    divides: bool = False,
    low: float = 0.0,
    low_inclusive: bool = False,
) -> None:
    """Raise unless ``value`` is a number ``> low`` (``>=`` if ``low_inclusive``) that keeps a loss
    term inside float32: at most :data:`SCALE_MAX` where it ``multiplies`` a term (DRO's β, a KL
    coefficient, SAPO's τ inside the gate), at least ``1/SCALE_MAX`` where it ``divides`` one
    (SAPO's ``4/τ``, CFPO's ``1/(2ε)``). The message names the parameter and the range."""
    check_number(name, value, low=low, low_inclusive=low_inclusive)
    too_large = multiplies and abs(value) > SCALE_MAX
    too_small = divides and abs(value) < 1.0 / SCALE_MAX
    if too_large or too_small:
        bounds = {(True, False): f"<= {SCALE_MAX:g}", (False, True): f">= {1 / SCALE_MAX:g}"}.get(
            (multiplies, divides), f"in [{1 / SCALE_MAX:g}, {SCALE_MAX:g}]"
        )
        role = " and ".join(word for word, on in (("multiplies", multiplies), ("divides", divides)) if on)
        raise ValueError(
            f"{name} must be {bounds}: it {role} a loss term, which beyond that overflows float32 "
            f"(largest {FLOAT32_MAX:.4g}), got {value!r}"
        )


def check_log_ratio_clamp(value: object) -> None:
    """Raise unless the log-ratio clamp c is > 0 and at most ``ln SCALE_MAX`` (27.6): the ratio
    ``e^c`` is a factor on the loss (``r·A``, CFPO's ``(r-1)²``), so beyond it a far off-policy
    token overflows float32."""
    check_number("log_ratio_clamp", value, low=0.0, low_inclusive=False)
    if value > math.log(SCALE_MAX):
        raise ValueError(
            f"log_ratio_clamp must be <= {math.log(SCALE_MAX):.4g} (= ln {SCALE_MAX:g}): the ratio "
            f"e^clamp multiplies loss terms, which beyond that overflow float32, got {value!r}"
        )


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


def check_mask(name: str, mask: object, shape: tuple[int, ...]) -> None:
    """Raise unless ``mask`` is a tensor of ``shape``.

    A non-bool mask is read as ``mask != 0``; that it holds only 0 and 1 is a value
    check (:func:`check_mask_values`), run only when values are checked.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    check_shape(name, mask, shape, "(B, T)")


def check_mask_values(name: str, mask: torch.Tensor) -> None:
    """Raise unless a non-bool ``mask`` holds only 0 and 1 (reads values: a device sync)."""
    if mask.dtype == torch.bool:
        return
    bad = (mask != 0) & (mask != 1)  # NaN != 0 and != 1: caught too
    if bad.any():
        raise ValueError(f"{name} must be bool or contain only 0 and 1, got a value {mask[bad][0].item()!r}")


def check_finite_where_active(name: str, x: torch.Tensor, active: torch.Tensor) -> None:
    """Raise unless ``x`` is finite wherever ``active`` (broadcastable) is True (reads values: a sync)."""
    bad = ~torch.isfinite(x) & active
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"{name} must be finite at active (unmasked) positions, got {x[where].item()!r} at index {where}"
        )


def check_count(name: str, value: object, check_values: bool) -> None:
    """Raise unless ``value`` is None, a finite number > 0, or a one-element float/int tensor.

    A tensor's value is read only when ``check_values`` (a device sync). Booleans are
    refused: ``True`` is not a count. A fractional count is fine (TRL scales its counts).
    """
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(
                f"{name} must be a positive number or a one-element numeric tensor, "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        if not check_values:
            return
        value = value.item()
    check_number(name, value, low=0.0, low_inclusive=False)


def check_input_values(
    mask: torch.Tensor,
    inputs: Mapping[str, torch.Tensor | None],
    sums: Sequence[torch.Tensor | None],
    counts: Mapping[str, float | torch.Tensor | None],
) -> tuple[bool, dict[str, float | None]]:
    """Every value check of one loss call; reads values on the host (a device sync).

    Raises a ``ValueError`` naming the input: a non-bool ``mask`` holding a value other than
    0 and 1, a count that is not a finite number > 0, or an entry of ``inputs`` that is not
    finite at an active position (an input whose last dimension is 1 holds one value per
    row: checked on rows with an active token).

    The costly part, the per-position check, runs only when needed: each tensor of ``sums``
    is summed first (its sum is non-finite as soon as one of its terms is, masked or not), and
    only a non-finite sum leads to the per-position check of ``inputs``. (On the CPU a read
    costs less than one more operation to combine the sums.)

    Args:
        mask: [B, T] bool or 0/1.
        inputs: name -> tensor as the caller gave it ([B, T] or [B, 1]), None for absent ones.
        sums: tensors whose finiteness stands for every input's (``logp - old`` stands for both
            log-probs), None for absent ones.
        counts: name -> None, a number or a one-element tensor.

    Returns:
        ``(finite, numbers)``: whether every summed tensor is finite everywhere (the rare
        overflow of finite terms reports False, which costs the caller only its exact path),
        and each count as a Python number (None stays None).
    """
    check_mask_values("mask", mask)
    numbers = {}
    for name, value in counts.items():
        check_count(name, value, True)
        numbers[name] = value.item() if isinstance(value, torch.Tensor) else value
    finite = all(math.isfinite(x.sum().item()) for x in sums if x is not None)
    if not finite:
        active = mask if mask.dtype == torch.bool else mask != 0
        for name, x in inputs.items():
            if x is not None:
                check_finite_where_active(name, x, active if x.shape[-1] != 1 else active.any(-1, True))
    return finite, numbers


def values_are_checked(check_values: bool | None, is_cpu: bool) -> bool:
    """Whether value checks run: as asked, else on the CPU only; never while compiling.

    Value checks read tensor values on the host (a device sync). On the CPU that costs
    a few microseconds; on an accelerator it would stall every call, so there they run
    only on request (``check_values=True``). Inside ``torch.compile`` they cannot run
    (a graph has no host reads); bad values then give a non-finite loss instead.
    """
    if torch.compiler.is_compiling():
        return False
    return is_cpu if check_values is None else check_values


def as_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, through ``uint8`` for a bool tensor (much faster on CPU)."""
    if x.dtype == torch.bool:
        return (x if x.is_contiguous() else x.contiguous()).view(torch.uint8).to(dtype)
    return x.to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the math runs in: float64 stays float64, every other float runs in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _UpcastSaturatingGrad(torch.autograd.Function):
    """``x.to(dtype)`` whose backward saturates the gradient at the input dtype's largest finite value.

    The math runs in float32, where a far off-policy ratio (up to e^20) gives a
    large but finite gradient; cast back to a float16 input it would overflow to
    inf. Saturating keeps the gradient finite and its sign intact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.input_dtype = x.dtype
        return x.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        largest = torch.finfo(ctx.input_dtype).max
        return grad.clamp(-largest, largest).to(ctx.input_dtype), None


def detached_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.detach().to(dtype)``, skipping the calls that would change nothing (each costs µs per call)."""
    if x.requires_grad:
        x = x.detach()
    return x if x.dtype == dtype else x.to(dtype)


def upcast_saturating_grad(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` whose gradient saturates at ``x``'s dtype (see ``_UpcastSaturatingGrad``)."""
    if x.dtype == dtype:
        return x
    if torch.finfo(x.dtype).max >= torch.finfo(dtype).max:
        return x.to(dtype)
    return _UpcastSaturatingGrad.apply(x, dtype)


def check_kl_coef(kl_coef: object, kl: object) -> None:
    """Raise unless ``kl_coef`` is a number >= 0 or a 0-dim float tensor, and ``kl`` (a KL term) is set."""
    if kl is None:
        raise ValueError(f"kl_coef={kl_coef!r} needs a KL term (PolicyLoss(kl=st.KL(...))), got kl=None")
    if isinstance(kl_coef, torch.Tensor):
        if kl_coef.dim() != 0 or not kl_coef.is_floating_point():
            raise ValueError(
                f"kl_coef must be a number or a 0-dim float tensor, got shape {tuple(kl_coef.shape)}"
            )
    else:
        check_scale("kl_coef", kl_coef, low_inclusive=True)


def check_advantages(advantages: object, shape: tuple[int, int]) -> torch.Tensor:
    """Raise unless ``advantages`` is a float tensor of shape (B,) or (B, T); return it."""
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got dtype {advantages.dtype}")
    if tuple(advantages.shape) not in ((shape[0],), shape):
        raise ValueError(
            f"advantages must have shape (B,) = ({shape[0]},) or (B, T) = {shape}, got {tuple(advantages.shape)}"
        )
    return advantages
