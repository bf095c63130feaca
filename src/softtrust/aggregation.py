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
    """Aggregate a per-token loss into a scalar.

    Args:
        per_token_loss: broadcastable to [B, T] (a [B, 1] sequence-level loss counts
            once per active token of its row). Values at masked positions are ignored
            even if non-finite.
        mask: [B, T] bool.
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
    check_choice("aggregation", mode, AGGREGATIONS)
    masked = torch.where(mask, per_token_loss, 0)  # [B, T]; `where`: masked inf/NaN never count
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-mean":
        denominator = mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / _at_least_one(denominator)
    num_sequences = mask.shape[0] if num_sequences is None else num_sequences
    if mode == "seq-mean-token-mean":
        if num_active is None:
            num_active = mask.sum(dim=-1, keepdim=True)  # [B, 1]
        per_sequence = masked.sum(dim=-1, keepdim=True) / num_active.clamp(min=1)  # [B, 1]
        return per_sequence.sum() / _at_least_one(num_sequences)
    if mode == "seq-mean-token-sum":
        return masked.sum() / _at_least_one(num_sequences)
    length = mask.shape[-1] if max_completion_length is None else max_completion_length
    return masked.sum() / (_at_least_one(num_sequences) * length)


def _at_least_one(count: float | torch.Tensor) -> float | torch.Tensor:
    """max(count, 1): an empty batch gives loss 0 instead of 0/0."""
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(count, 1)
