"""Methods whose per-token rule depends on the whole batch: M2PO's token mask, BAPO's clip bounds.

Each computes its batch-wide quantity in :meth:`~softtrust.methods.Method.batch_state`
as a few 0-dim tensors (a threshold, two bounds) and applies it per token in
:meth:`~softtrust.methods.Method.loss`. A trainer that splits the batch into micro-batches
(or ranks) calls :meth:`softtrust.PolicyLoss.batch_state` once on the global batch and
passes the result as ``state=`` to every micro-batch call: each token then gets the
decision the whole batch would give it, whatever the split. Without ``state=`` the
quantity is computed from the batch the call sees (exact when that is the whole batch).

Both searches use static shapes only (a sort, cumulative sums, a fixed grid of
candidates), so they compile with ``fullgraph=True`` and never wait for the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from softtrust._validation import check_number
from softtrust.methods.base import LossContext, Method, MethodOutput, register_method, token_level_note
from softtrust.methods.trust_region import clipped_surrogate

__all__ = ["BAPO", "M2PO"]


def m2po_threshold(second_moment: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO's batch-wide cut: mask a token iff its ``d²`` is ``>=`` the returned value.

    Sort the active tokens' ``d²`` in descending order, ``s_0 >= s_1 >= ... >= s_{n-1}``;
    ``k*`` is the smallest ``k`` in ``[0, n)`` with ``mean(s_k, ..., s_{n-1}) < τ`` (the
    fewest largest tokens to drop), or ``n`` when there is none (even the smallest
    ``d²`` alone is ``>= τ``: every token is masked). The cut is ``s_{k*-1}`` (``+inf``
    for ``k* = 0``: nothing masked). Tokens tied with ``s_{k*-1}`` are all masked, so
    the mask is a function of a token's own ``d²`` and this one number: it does not
    depend on the order of the tokens, on the micro-batch split or on the rank layout,
    and the mean over the kept tokens is still ``< τ`` (dropping a value at least as
    large as every kept one never raises their mean).

    Static shapes: a sort, a suffix cumulative sum (summed from the small end, so a
    long batch keeps the small values' precision) and a count.

    Args:
        second_moment: [B, T] ``d²``, finite >= 0 where active (NaN propagates).
        mask: [B, T] 0/1 float mask.
        tau: τ > 0.

    Returns:
        0-dim tensor in ``second_moment``'s dtype; ``+inf`` when nothing is masked.
    """
    active = mask.reshape(-1) > 0
    sentinel = torch.full((1,), -1.0, dtype=second_moment.dtype, device=second_moment.device)
    # inactive entries (and one sentinel, so that an empty batch still gathers) sort after every active one
    values = torch.cat([torch.where(active, second_moment.reshape(-1), -1.0), sentinel])
    ordered = torch.sort(values, descending=True).values  # [N + 1]
    n = active.sum()  # active tokens
    position = torch.arange(ordered.numel(), device=ordered.device)
    in_batch = position < n
    suffix_sum = torch.where(in_batch, ordered, 0.0).flip(0).cumsum(0).flip(0)  # Σ_{j >= k} s_j over active
    suffix_count = (n - position).to(ordered.dtype)  # n - k
    below = in_batch & (suffix_sum < tau * suffix_count)  # mean(s_k..s_{n-1}) < τ
    # k* = index of the first True (the suffix mean falls as k grows, but take the first to be exact)
    first = torch.argmax(below.to(torch.int8))
    k = torch.where(below.any(), first, n)
    cut = ordered.gather(0, (k - 1).clamp(min=0).reshape(1)).reshape(())
    return torch.where(k > 0, cut, math.inf)


@register_method
@dataclass(frozen=True)
class M2PO(Method):
    """M2PO: mask the fewest tokens with the largest ``d²`` so the batch's second moment stays < τ.

    ``d_t = log π_old(y_t) − log π_prox(y_t)``, detached, where ``π_prox`` is the policy
    just before this optimizer step: in softtrust's loss, the current log-probs of the
    step's first forward pass, detached (within one optimizer step of a synchronous
    trainer the parameters do not change, so every micro-batch's ``logprobs`` are
    ``π_prox``; with several PPO epochs over one batch, recompute the state at each
    step). So ``d = -log r`` with ``r = π_θ/π_old`` at the token level (``old_logprobs``
    must be the behaviour policy's: with the decoupled wiring, where ``old_logprobs`` is
    π_prox itself, d would be 0). The mask ``M``
    keeps a token iff ``d² <`` the cut of :func:`m2po_threshold` (the fewest largest
    ``d²`` dropped so that the mean ``d²`` over the kept active tokens is ``< τ``), and

        ``ℓ = -M·r·A``

    with r in the graph and **no ε clip**: the paper's objective (Zheng et al., Eq. for
    J_M2PO; its point is that the second-moment mask *replaces* the clip, which prunes
    informative high-entropy tokens under staleness). AReaL 1.0.4 instead applies its
    usual PPO ε-clip loss to the kept tokens (``grpo_loss_fn`` masks ``loss_mask`` with
    ``_apply_m2po_masking``, then calls ``ppo_actor_loss_fn`` with ``eps_clip``). Two
    further differences from AReaL: AReaL computes the mask per micro-batch call (so it
    depends on the split) where softtrust takes the global batch's cut through
    ``state=``; and when no suffix mean is below τ AReaL keeps the single smallest token
    while softtrust masks every token (no set satisfies the constraint). At r = 1 (``d = 0``,
    nothing masked) the gradient is the plain policy gradient ``-A·∇logp``.

    Micro-batches and ranks: the cut is one number over the global batch,
    ``state = loss_fn.batch_state(logprobs, old, advantages, mask)`` on all tokens (a
    rank-split batch needs the ``d²`` of every rank's tokens, e.g. an all-gather, to
    find it); every micro-batch call with ``state=state`` then masks exactly the tokens
    the whole-batch call would. Without ``state=``, each call uses its own batch's cut
    (what TRL and verl get, as they call the loss once per micro-batch).

    Args:
        tau: τ > 0, the bound on the mean ``d²`` of the kept tokens (paper: 0.04).

    References:
        Zheng, Zhao, Chen, Prosperity before Collapse: How Far Can Off-Policy RL Reach
        with Stale Data on LLMs?, arXiv:2510.01161; AReaL ``actor.m2_threshold``.
    """

    name: ClassVar[str] = "m2po"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_note: ClassVar[str] = token_level_note("M2PO", "selects tokens by their own token ratio")
    supports_proximal: ClassVar[bool] = False
    proximal_note: ClassVar[str] = (
        "M2PO computes d = log pi_old - log pi_prox with old = the behaviour policy; the decoupled "
        "objective sets old = pi_prox, so d = 0 and nothing would be masked (M2PO's second-moment "
        "mask is its own off-policy treatment)"
    )

    tau: float = 0.04

    def __post_init__(self) -> None:
        check_number("tau", self.tau, low=0.0, low_inclusive=False)

    def batch_state(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        second_moment = ctx.token_log_ratio.detach().square()  # d² = (old - logp)², 0 where masked
        return {"m2po/cut": m2po_threshold(second_moment, ctx.mask, self.tau)}

    def loss(self, ctx: LossContext) -> MethodOutput:
        second_moment = ctx.token_log_ratio.detach().square()  # [B, T]
        masked = second_moment >= ctx.state["m2po/cut"]  # False for NaN: the NaN ratio keeps the loss NaN
        keep = (~masked).to(second_moment.dtype)
        # keep multiplies (not where): a NaN ratio at a masked token still makes the loss NaN
        loss = -(keep * ctx.ratio) * ctx.advantages  # [B, T]
        stats = {"m2po/masked": masked} if ctx.with_stats else {}
        return MethodOutput(loss, stats)


#: the most ``(c_low, c_high)`` candidates BAPO's search may hold: its ``batch_state`` builds
#: ``[K, B, T]`` tensors, so an unbounded K (``low_step=1e-9``) exhausts memory
BAPO_MAX_CANDIDATES = 1000


def _steps(start: float, stop: float, step: float) -> int:
    """How many ``step`` increments from ``start`` stay ``<= stop`` (1e-9 relative slack for decimal steps)."""
    if step <= 0:
        return 0
    return max(0, math.floor((stop - start) / step + 1e-9))


@register_method
@dataclass(frozen=True)
class BAPO(Method):
    """BAPO: per-batch clip bounds ``[c_low, c_high]``, moved until positive tokens carry ρ₀ of the loss.

    The loss is the clipped surrogate with ratio bounds (not ε's):
    ``ℓ = -min(r·A, clip(r, c_low, c_high)·A)``. The bounds come from the batch
    (the paper's Algorithm 1): start at ``c_low = a⁻``, ``c_high = a⁺``; while
    ``ρ < ρ₀`` and ``c_low + δ₂ <= b⁻``, raise ``c_high`` by ``δ₁`` if
    ``c_high + δ₁ <= b⁺``, else raise ``c_low`` by ``δ₂``. The positive share is
    (the paper's Eq. 8, as the authors' code evaluates it)

        ``ρ = P / (P + N)``, ``P = Σ_{A>0} m·min(r, c_high)·A``, ``N = Σ_{A<0} m·max(r, c_low)·|A|``

    (the value of each token's clipped term), and ``ρ = 1`` when ``P + N = 0``. The
    walk visits a fixed grid of ``1 + n⁺ + n⁻`` candidates (``n⁺ = ⌊(b⁺-a⁺)/δ₁⌋``,
    ``n⁻ = ⌊(b⁻-a⁻)/δ₂⌋``; when ``n⁻ = 0`` the loop never runs); :meth:`batch_state`
    evaluates ρ at all of them at once and takes the first that reaches ρ₀, else the
    last: no host sync. The bounds are ``a + k·δ`` (not repeated additions).

    Notes: raising ``c_high`` admits more low-probability positive tokens (larger P);
    raising ``c_low`` clips more negative tokens' gradient but, measured by value as
    in Eq. 8 and the authors' code, also raises N, so once ``c_high`` is at ``b⁺`` the
    walk usually runs to ``b⁻``. The authors' verl recipe (WooooDyy/BAPO,
    ``recipe/bapo/policy_loss.py``) differs from the paper: it raises the lower bound
    first, then the upper; compares ``P/N`` with a target (1 in its yaml, i.e. ρ₀ = 0.5);
    and adds verl's dual clip (c = 3). softtrust follows the paper. The bounds are
    searched on the ratio at the token level. At r = 1 every token is inside
    ``[c_low, c_high]`` (a⁻ <= b⁻ < 1 < a⁺), so the gradient is ``-A·∇logp``.

    Micro-batches and ranks: ``state = loss_fn.batch_state(...)`` on the global batch
    gives the two bounds (0-dim tensors); pass it to every micro-batch call. Across
    ranks, P and N per candidate are sums: an all-reduce of a ``[2, K]`` tensor.

    Args:
        target: ρ₀ in (0, 1] (paper: 0.4).
        low_start, low_max: a⁻, b⁻, the lower bound's range, 0 < a⁻ <= b⁻ < 1 (paper: 0.6, 0.9).
        high_start, high_max: a⁺, b⁺, the upper bound's range, 1 < a⁺ <= b⁺ (paper: 1.2, 3.0).
        high_step: δ₁ > 0 (paper: 0.05).
        low_step: δ₂ > 0 (paper: 0.02). The grid may hold at most :data:`BAPO_MAX_CANDIDATES`
            (1000) candidates: :meth:`batch_state` evaluates all of them at once, as ``[K, B, T]``.

    References:
        Xi et al., BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via
        Balanced Policy Optimization with Adaptive Clipping, arXiv:2510.18927.
    """

    name: ClassVar[str] = "bapo"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_note: ClassVar[str] = token_level_note(
        "BAPO", "searches its bounds on token ratios (the paper's objective)"
    )

    target: float = 0.4
    low_start: float = 0.6
    low_max: float = 0.9
    high_start: float = 1.2
    high_max: float = 3.0
    high_step: float = 0.05
    low_step: float = 0.02

    def __post_init__(self) -> None:
        check_number("target", self.target, low=0.0, high=1.0, low_inclusive=False)
        check_number(
            "low_start", self.low_start, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
        )
        check_number(
            "low_max", self.low_max, low=self.low_start, high=1.0, high_inclusive=False, low_name="low_start"
        )
        check_number("high_start", self.high_start, low=1.0, low_inclusive=False)
        check_number("high_max", self.high_max, low=self.high_start, low_name="high_start")
        check_number("high_step", self.high_step, low=0.0, low_inclusive=False)
        check_number("low_step", self.low_step, low=0.0, low_inclusive=False)
        n_high = _steps(self.high_start, self.high_max, self.high_step)
        n_low = _steps(self.low_start, self.low_max, self.low_step)
        if n_low > 0 and 1 + n_high + n_low > BAPO_MAX_CANDIDATES:  # n_low = 0: one candidate
            raise ValueError(
                f"BAPO's bounds grid has K = 1 + floor((high_max - high_start) / high_step) + floor((low_max "
                f"- low_start) / low_step) = 1 + {n_high} + {n_low} candidates, more than {BAPO_MAX_CANDIDATES} "
                f"(batch_state holds [K, B, T] tensors; the paper's grid has 52): raise high_step or low_step, "
                f"or narrow the ranges (got high_start={self.high_start!r}, high_max={self.high_max!r}, "
                f"high_step={self.high_step!r}, low_start={self.low_start!r}, low_max={self.low_max!r}, "
                f"low_step={self.low_step!r})"
            )

    def bounds_grid(self) -> tuple[list[float], list[float]]:
        """The candidate ``(c_low, c_high)`` pairs of the walk, in order (Python numbers)."""
        n_high = _steps(self.high_start, self.high_max, self.high_step)
        n_low = _steps(self.low_start, self.low_max, self.low_step)
        if n_low == 0:  # the loop condition c_low + δ₂ <= b⁻ fails at once: the bounds never move
            return [self.low_start], [self.high_start]
        steps = range(n_high + n_low + 1)
        lows = [self.low_start + max(0, k - n_high) * self.low_step for k in steps]
        highs = [self.high_start + min(k, n_high) * self.high_step for k in steps]
        return lows, highs

    def batch_state(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        like = ctx.log_ratio
        lows, highs = (torch.tensor(v, dtype=like.dtype, device=like.device) for v in self.bounds_grid())
        ratio = ctx.ratio.detach().unsqueeze(0)  # [1, B, T]
        advantages = (ctx.advantages * ctx.mask).unsqueeze(0)  # [1, B, T]; 0 where masked
        positive = (torch.minimum(ratio, highs[:, None, None]) * advantages.clamp(min=0)).sum((1, 2))  # [K]
        negative = (torch.maximum(ratio, lows[:, None, None]) * (-advantages).clamp(min=0)).sum((1, 2))  # [K]
        total = positive + negative
        share = torch.where(total > 0, positive / total.clamp(min=torch.finfo(like.dtype).tiny), 1.0)
        reached = share >= self.target
        k = torch.where(reached.any(), torch.argmax(reached.to(torch.int8)), lows.numel() - 1).reshape(1)
        chosen = torch.stack([lows, highs, share]).gather(1, k.expand(3, 1)).reshape(3)  # no host read of k
        return {"bapo/low": chosen[0], "bapo/high": chosen[1], "bapo/positive_share": chosen[2]}

    def loss(self, ctx: LossContext) -> MethodOutput:
        state = ctx.state
        loss, stats = clipped_surrogate(
            ctx.ratio, ctx.advantages, state["bapo/low"], state["bapo/high"], ctx.with_stats
        )
        if ctx.with_stats:  # the batch's bounds and share, as [1, 1] (one value for every sequence)
            for key in ("bapo/low", "bapo/high", "bapo/positive_share"):
                stats[key] = state[key].reshape(1, 1)
        return MethodOutput(loss, stats)
