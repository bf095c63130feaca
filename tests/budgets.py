"""Float error budgets: where the tolerance of a test that compares two float paths comes from
(not a test module).

Two float paths compute the same value with different roundings: another instruction set's
kernels (``ATEN_CPU_CAPABILITY``), another thread count, another number of processes, another
summation order, a peer's code. A result built from ``terms`` rounded operations on values of
size ``scale`` then differs by about ``eps · √terms · scale`` (independent roundings; ``eps ·
terms · scale`` at worst). ``rounding_budget`` is that estimate times a margin: a tolerance
says which computation it covers, and stays orders of magnitude below what a wrong normaliser,
gradient average or data split changes (a factor, or whole terms).
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2^-23 ≈ 1.19e-7
EPS64 = torch.finfo(torch.float64).eps  # 2^-52 ≈ 2.22e-16


def rounding_budget(eps: float, terms: float, scale: float = 1.0, margin: float = 10.0) -> float:
    """``margin · eps · √terms · scale``: the rounding difference allowed between two float paths
    that each accumulate about ``terms`` rounded operations on values of size ``scale``."""
    return margin * eps * math.sqrt(terms) * scale


def adam_budget(steps: int, lr: float, gradient_terms: float = 1e3, margin: float = 10.0) -> float:
    """The difference allowed between weights trained by two float paths for ``steps`` Adam(W)
    steps at ``lr``. Adam divides each step by the gradient's running scale, so a gradient known
    to relative rounding ρ moves a weight by about lr·ρ per step; a float32 gradient summed over
    ``gradient_terms`` products (tokens × hidden units), with cancellation, has ρ ≲ eps32 ·
    terms. Adam also hides a wrong gradient *scale* (2× the gradient, same step): compare a
    gradient norm or a loss as well."""
    return margin * steps * lr * EPS32 * gradient_terms


# A token log-prob of the tests' micro Qwen2s (1-2 layers, d = 32, a 99-character vocabulary):
# the log-softmax sums ~100 exponentials and log p ≈ -5, so two float32 paths differ by up to
# eps32·√100·5 ≈ 6e-6; ×10 margin ≈ 6e-5 (measured float32 against float64: 6e-7 on every ISA).
MICRO_LOGPROB = rounding_budget(EPS32, terms=100, scale=5)

# float64 losses and gradients of the tests' small batches (<= ~100 tokens of terms <= ~3) from
# another code: a peer (TRL, verl, the official VESPO), a closed form, another op order, another
# ISA's exp/log (<= 1 ulp): eps64·√100·3 ≈ 6.7e-15, ×150 for the ops each code adds ≈ 1e-12,
# relative above 1, absolute below (measured: <= 7e-15 relative).
F64_PARITY = rounding_budget(EPS64, terms=100, scale=3, margin=150)
# verl divides by token counts + 1e-8 and takes log(w + 1e-10): its numbers differ from exact
# ones by up to ~1e-8 relative (a one-token row), ×10 (measured: 1.3e-10 relative).
VERL_EPSILON = 1e-7
# The absolute floor of such a comparison, for values near 0: float64 sums of <= ~30 terms of
# size <= ~1, eps64·√30 ≈ 1.2e-15, ×10.
F64_ABS = rounding_budget(EPS64, terms=30)
# A gradient through another formula can be a difference of terms ~100x its size: 100·F64_PARITY.
F64_GRADIENT = 100 * F64_PARITY
# A metric is computed in float32 (a mean, max or ratio over <= ~64 tokens) and compared with a
# float64 value or another path's float32 one: eps32·√64, ×10 ≈ 9.5e-6 relative.
F32_METRIC = rounding_budget(EPS32, terms=64)
