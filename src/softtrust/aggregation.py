"""Reducing a per-token loss to a scalar: the five aggregation modes.

Names follow verl; TRL's ``loss_type`` names are in brackets.

| mode                        | value                               |
| --------------------------- | ----------------------------------- |
| ``token-mean``              | ``Σ m·ℓ / N_tokens`` [dapo, cispo, vespo; bnpo per micro-batch] |
| ``token-sum``               | ``Σ m·ℓ``                           |
| ``seq-mean-token-mean``     | ``Σ_i (Σ_t m·ℓ / Σ_t m) / N_seq`` [grpo, sapo] |
| ``seq-mean-token-sum``      | ``Σ m·ℓ / N_seq`` [luspo]           |
| ``seq-mean-token-sum-norm`` | ``Σ m·ℓ / (N_seq · T_max)`` [dr_grpo] |

``N_tokens`` and ``N_seq`` default to the counts in this batch. When a batch is
split across micro-batches or ranks, pass the **global** counts (``num_tokens`` =
active tokens in the whole batch, ``num_sequences`` = rows in the whole batch):
then the sum of the micro-batch losses equals the whole-batch loss, in value and
gradient, for every mode. (Averaging per-micro-batch token-means instead weights
tokens by the inverse size of their micro-batch: the DAPO normaliser bug class.)
"""

from __future__ import annotations

import torch

from softtrust._validation import check_choice

AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregation_divisor(
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_active: torch.Tensor | None = None,
) -> torch.Tensor | float:
    """The divisor ``d`` with ``aggregate(ℓ) = Σ_i (Σ_t m_t·ℓ_t) / d``: a number, a 0-dim tensor or [B, 1].

    | mode                        | d                   |
    | --------------------------- | ------------------- |
    | ``token-mean``              | ``N_tokens``        |
    | ``token-sum``               | ``1``               |
    | ``seq-mean-token-mean``     | ``n_i · N_seq``     |
    | ``seq-mean-token-sum``      | ``N_seq``           |
    | ``seq-mean-token-sum-norm`` | ``N_seq · T_max``   |

    Every count is clamped to at least 1, so nothing active means loss 0, not 0/0.
    Arguments as in :func:`aggregate`.
    """
    check_choice("aggregation", mode, AGGREGATIONS)
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    if mode == "token-sum":
        return 1.0
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum() if num_active is None else num_active.sum()
        return _at_least_one(num_tokens, dtype)
    num_sequences = _at_least_one(mask.shape[0] if num_sequences is None else num_sequences, dtype)
    if mode == "seq-mean-token-mean":
        if num_active is None:
            num_active = mask.sum(dim=-1, keepdim=True)  # [B, 1]
        return num_active.clamp(min=1) * num_sequences  # [B, 1]
    if mode == "seq-mean-token-sum":
        return num_sequences
    # max(., 1): with T = 0 the loss is 0, not 0/0
    return num_sequences * max(mask.shape[-1] if max_completion_length is None else max_completion_length, 1)


def aggregation_weights(mask: torch.Tensor, mode: str, **counts) -> torch.Tensor | float:
    """The weight ``c = 1 / d`` with ``aggregate(ℓ) = Σ_t m_t·ℓ_t·c`` (see :func:`aggregation_divisor`)."""
    divisor = aggregation_divisor(mask, mode, **counts)
    return divisor.reciprocal() if isinstance(divisor, torch.Tensor) else 1.0 / divisor


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_active: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar: ``Σ_i (Σ_t m_t·ℓ_t) / d`` with ``d`` from :func:`aggregation_divisor`.

    Args:
        per_token_loss: broadcastable to [B, T] (a [B, 1] sequence-level loss counts
            once per active token of its row); finite at masked positions (PolicyLoss
            guarantees it).
        mask: [B, T] bool or 0/1 float mask.
        mode: one of :data:`AGGREGATIONS`.
        num_tokens: global active-token count for ``token-mean`` (default ``Σ m``).
        num_sequences: global sequence count for the ``seq-mean-*`` modes (default B).
        max_completion_length: ``T_max`` for ``seq-mean-token-sum-norm`` (default T).
            Use the configured maximum, not the batch's padded length, so that
            micro-batches of different padding agree.
        num_active: optional [B, 1] active tokens per row (saves a pass).

    Returns:
        Scalar tensor. Zero (with zero gradient) when nothing is active.
    """
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8).to(
            per_token_loss.dtype
        )  # via uint8: much faster than bool -> float on CPU
    divisor = aggregation_divisor(
        mask,
        mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        max_completion_length=max_completion_length,
        num_active=num_active,
    )
    if per_token_loss.shape[-1] == 1 and mask.shape[-1] != 1:  # one loss per sequence: Σ_t m·ℓ_i = n_i·ℓ_i
        per_row = per_token_loss * (mask.sum(dim=-1, keepdim=True) if num_active is None else num_active)
        return (per_row / divisor).sum()
    if per_token_loss.shape != mask.shape:
        per_token_loss = per_token_loss.expand(mask.shape)
    if isinstance(divisor, torch.Tensor) and divisor.dim() > 0:  # per-row divisors
        per_row = (per_token_loss * mask).sum(
            dim=-1, keepdim=True
        )  # [B, 1]: Σ_t m·ℓ (a batched GEMV is slower)
        return (per_row / divisor).sum()
    # one divisor for every token: a single dot product, whose backward is one multiply
    total = torch.dot(per_token_loss.reshape(-1), mask.reshape(-1))
    return total if mode == "token-sum" else total / divisor


def _at_least_one(count: float | torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    """max(count, 1) (a tensor count in ``dtype``): an empty batch gives loss 0 instead of 0/0."""
    if isinstance(count, torch.Tensor):
        return (count if count.dtype == dtype else count.to(dtype)).clamp(min=1)
    return max(count, 1)
