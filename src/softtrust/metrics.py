"""Diagnostics of a policy-loss call: ratio, weight, clip and KL statistics, as tensors.

Nothing here reads a value on the host: every statistic is a 0-dim tensor, so a call
never waits for the device and compiles whole. The caller decides when to read them
(:meth:`softtrust.LossOutput.metric_values` reads them all with one transfer).

| metric | over | meaning |
| --- | --- | --- |
| ``ratio/{mean,min,max}`` | active tokens (token level) or active sequences | the ratio at the loss's level |
| ``seq_log_weight/{mean,min,max}`` | active sequences | ``log W_i = Σ_t m·log r_t`` (staleness shows here first) |
| ``ess`` | active sequences | normalised effective sample size of ``W_i``: ``(Σ W)² / (n·Σ W²)`` |
| ``is_weight/{mean,min,max}`` | as its level | the behaviour correction's weight |
| ``kl`` | active tokens | the KL estimate's mean |
| ``entropy/{mean,min,max}`` | active tokens | the policy's entropy, when the call gets ``entropy=`` |
| ``entropy/kept`` | active tokens | the fraction ``entropy_quantile`` keeps |
| method stats | as their shape | bool: the fraction where it holds (``clip/high``); float: mean/min/max (``phi``) |

A statistic over an empty set is NaN.
"""

from __future__ import annotations

import math

import torch

from softtrust._validation import as_float


@torch.no_grad()
def loss_metrics(
    log_ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    is_log_weight: torch.Tensor | None,
    per_token_kl: torch.Tensor | None,
    stats: dict[str, torch.Tensor],
    mask: torch.Tensor,
    num_active: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Every statistic of one call, 0-dim tensors.

    Args:
        log_ratio: [B, T] or [B, 1] log-ratio at the loss's level.
        token_log_ratio: [B, T] clamped token log-ratio, 0 at masked positions.
        is_log_weight: [B, T] or [B, 1] behaviour-correction log-weight, or None.
        per_token_kl: [B, T] KL estimate, or None.
        stats: the method's and corrections' diagnostics (see :class:`~softtrust.methods.MethodOutput`).
        mask: [B, T] 0/1 float mask. num_active: [B, 1] active tokens per row.

    A [B, 1] statistic counts once per sequence with at least one active token, a
    [B, T] one once per active token.
    """
    active_rows = num_active > 0  # [B, 1]
    active = mask > 0  # [B, T]
    values: dict[str, torch.Tensor] = {}

    def describe(name: str, x: torch.Tensor, with_extremes: bool = True) -> None:
        where = active_rows if x.shape[-1] == 1 else active  # [B, 1] or [B, T]
        x, where = torch.broadcast_tensors(as_float(x, mask.dtype), where)
        count = where.sum()
        values[f"{name}/mean" if with_extremes else name] = torch.where(where, x, 0).sum() / count
        if with_extremes and x.numel() == 0:  # a shape, not a value: amin/amax refuse empty tensors
            values[f"{name}/min"] = values[f"{name}/max"] = x.new_full((), math.nan)
        elif with_extremes:
            empty = torch.where(count > 0, 0.0, math.nan)  # NaN for an empty set, not ±inf
            values[f"{name}/min"] = torch.where(where, x, math.inf).amin() + empty
            values[f"{name}/max"] = torch.where(where, x, -math.inf).amax() + empty

    describe("ratio", torch.exp(log_ratio))
    seq_log_weight = token_log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
    describe("seq_log_weight", seq_log_weight)
    # ESS/n = (Σ W)² / (n·Σ W²) = exp(2·LSE(log W) - LSE(2·log W) - log n), in log space
    log_w = torch.where(active_rows, seq_log_weight, -math.inf)
    n = active_rows.sum().to(mask.dtype)
    values["ess"] = torch.exp(
        2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0) - n.log()
    ).squeeze()
    for name, x in stats.items():
        describe(name, x, with_extremes=x.dtype != torch.bool)
    if is_log_weight is not None:
        describe("is_weight", torch.exp(is_log_weight))
    if per_token_kl is not None:
        describe("kl", per_token_kl, with_extremes=False)
    return values
