"""Entropy terms of a policy loss: the high-entropy token selection and its threshold.

``PolicyLoss(..., entropy_quantile=ρ)``, ρ in [0, 1], keeps the policy loss only on the fraction ρ of
active tokens with the highest entropy under π_θ ("Beyond the 80/20 rule", Wang et al.,
arXiv:2506.01939: the gradient of the few high-entropy "forking" tokens carries the learning;
TRL's ``top_entropy_quantile``). The threshold is the ``(1 - ρ)``-quantile of the active
tokens' entropies, interpolated linearly as ``torch.quantile`` does, and a token is kept iff
``H_t >= threshold``. ``PolicyLoss(..., entropy_coef=c)`` adds ``-c·H_t`` to the per-token loss
(an entropy bonus, on the kept tokens only when a quantile is set).

The threshold is an order statistic of the whole batch: a trainer that splits the batch
computes it once over the global batch (``PolicyLoss.batch_state(..., entropy=)``, key
:data:`ENTROPY_THRESHOLD`) and passes it as ``state=``.
"""

from __future__ import annotations

import math

import torch

#: the key of the entropy threshold in ``PolicyLoss.batch_state`` / ``state=``
ENTROPY_THRESHOLD = "entropy/threshold"


def entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The ``(1 - quantile)``-quantile of the active tokens' entropies, 0-dim, detached.

    With the ``n`` active entropies sorted ascending, ``h_(0) <= … <= h_(n-1)``, and
    ``p = (1 - quantile)·(n - 1)``: ``lerp(h_(⌊p⌋), h_(⌈p⌉), p - ⌊p⌋)``, ``torch.quantile``'s
    ``"linear"`` rule, computed with static shapes (masked entries sort last as +inf), so no
    value is read on the host. ``+inf`` when no token is active (nothing is kept).

    Args:
        entropy: [B, T] per-token entropies (any finite values at masked positions).
        mask: [B, T] bool or 0/1 float: the tokens that count.
        quantile: ρ in [0, 1], the fraction of active tokens to keep (0: the largest
            entropy only, ties included).
    """
    active = mask > 0  # [B, T]
    values = torch.where(active, entropy.detach(), math.inf).reshape(-1)  # [B·T]
    if values.numel() == 0:  # a static shape, not a value: no graph break
        return torch.full((), math.inf, dtype=entropy.dtype, device=entropy.device)
    ordered = torch.sort(values).values  # [B·T] ascending, inactive (+inf) last
    count = active.sum().to(entropy.dtype)
    position = (1.0 - quantile) * (count - 1).clamp(min=0)  # 0-dim, in [0, n - 1]
    below = position.floor()
    low = ordered.index_select(0, below.long().reshape(1)).reshape(())
    high = ordered.index_select(0, position.ceil().long().reshape(1)).reshape(())
    # lerp(a, b, 0) = a even when b = +inf (a single active token, or none: then a = +inf too)
    return torch.where(position > below, torch.lerp(low, high, position - below), low)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the active tokens (``mask``, bool or 0/1) whose entropy is at least
    ``threshold`` (0-dim, from :func:`entropy_threshold`)."""
    return (entropy.detach() >= threshold) & (mask > 0)
