"""Covariance-based entropy control: KL-Cov and Clip-Cov (arXiv:2505.22617).

Both act on the few tokens whose centred covariance between log-probability and
advantage is largest, the tokens that drive the policy's entropy down::

    cov_t = (A_t - Ā)·(logp_t - \\bar{logp})      Ā, \\bar{logp}: means over the batch's active tokens

The selection is a property of the whole batch: :meth:`batch_state` computes the means
and a threshold once over the global batch (detached), and :meth:`loss` applies them
per token, so micro-batches given ``state=`` select exactly the tokens the whole batch
would. Selections use sorts with data-dependent indices read as tensors (no ``.item()``,
no boolean indexing), so the loss compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from softtrust._validation import check_number, check_scale
from softtrust.methods.base import LossContext, Method, MethodOutput, register_method, token_level_note
from softtrust.methods.trust_region import clipped_surrogate

__all__ = ["ClipCov", "KLCov"]

_COVARIANCE_REASON = "selects tokens by the covariance of their log-prob and advantage"


def _centred_covariance(ctx: LossContext, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(A - Ā)·(logp - mean logp)`` per token with the batch's means from ``state``, detached; [B, T]."""
    advantages = torch.broadcast_to(ctx.advantages, ctx.mask.shape)
    return (advantages - state["cov/mean_advantage"]) * (ctx.logprobs.detach() - state["cov/mean_logprob"])


def _batch_means(ctx: LossContext) -> dict[str, torch.Tensor]:
    """Means of A and logp over the active tokens of this (global) batch, 0-dim."""
    mask = ctx.mask
    count = mask.sum().clamp(min=1)
    advantages = torch.broadcast_to(ctx.advantages, mask.shape)
    return {
        "cov/mean_advantage": (advantages * mask).sum() / count,
        "cov/mean_logprob": (ctx.logprobs.detach() * mask).sum() / count,
    }


def _selection_size(ratio: float, mask: torch.Tensor) -> torch.Tensor:
    """``k = max(1, floor(ratio·N))`` for N active tokens, as a 0-dim int64 tensor.

    In float64 whatever the compute dtype: in float32, 2e-4 rounds below itself and
    ``floor(2e-4·10000)`` would be 1, not the reference's 2.
    """
    return torch.floor(mask.sum(dtype=torch.float64) * ratio).clamp(min=1).to(torch.int64)


def _kth(values: torch.Tensor, k: torch.Tensor, descending: bool, empty: float) -> torch.Tensor:
    """The k-th largest (``descending``) or smallest entry of ``values`` (k a 0-dim tensor >= 1), 0-dim.

    ``empty`` when ``values`` has no entry. ``k`` past the end reads the last entry.
    """
    flat = values.reshape(-1)
    if flat.numel() == 0:  # a static shape, not a value: no graph break
        return torch.full((), empty, dtype=values.dtype, device=values.device)
    ordered = torch.sort(flat, descending=descending).values
    index = (k - 1).clamp(max=flat.numel() - 1).reshape(1)
    return ordered.index_select(0, index).reshape(())


@register_method
@dataclass(frozen=True)
class KLCov(Method):
    """KL-Cov: a |log r| penalty on the top ``ratio`` fraction of tokens by covariance.

    With ``S`` the ``k = max(1, ⌊ratio·N⌋)`` active tokens of largest ``cov_t`` in the
    (global) batch of N active tokens::

        ℓ_t = -A·r + coef·|log r|·[t ∈ S]

    with the token ratio r in the graph and no clip. The gradient is ``-A·r`` plus
    ``coef·sign(log r)·`` on the selected tokens, so on-policy (``log r = 0``, where
    ``d|x|/dx = 0``) it is REINFORCE's. Tokens tied with the k-th covariance are all
    selected (the reference picks an arbitrary subset of a tie).

    Args:
        ratio: fraction of active tokens penalised, in (0, 1] (paper: 2e-4).
        coef: penalty weight in (0, 1e12] (paper: 1).

    References:
        Cui et al., The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models, arXiv:2505.22617; verl 0.9.1 ``kl_cov``.
    """

    name: ClassVar[str] = "kl-cov"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_note: ClassVar[str] = token_level_note("KL-Cov", _COVARIANCE_REASON)

    ratio: float = 2e-4
    coef: float = 1.0

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, low=0.0, high=1.0, low_inclusive=False)
        check_scale("coef", self.coef)

    def batch_state(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        state = _batch_means(ctx)
        cov = torch.where(ctx.mask > 0, _centred_covariance(ctx, state), -math.inf)
        k = _selection_size(self.ratio, ctx.mask)
        state["cov/threshold"] = _kth(cov, k, descending=True, empty=math.inf)
        return state

    def loss(self, ctx: LossContext) -> MethodOutput:
        selected = (_centred_covariance(ctx, ctx.state) >= ctx.state["cov/threshold"]) & (ctx.mask > 0)
        log_ratio = ctx.token_log_ratio  # [B, T]
        loss = -ctx.advantages * torch.exp(log_ratio) + self.coef * log_ratio.abs() * selected
        return MethodOutput(loss, {"cov/selected": selected} if ctx.with_stats else {})


# The salt of Clip-Cov's pick when no generator is given (any fixed number works).
_CLIP_COV_SALT = 0.5


@register_method
@dataclass(frozen=True)
class ClipCov(Method):
    """Clip-Cov: the PPO clipped loss, with a random few high-covariance tokens' gradient cut.

    Candidates are the active tokens the clip leaves unclipped (``-clip(r)·A <= -r·A``)
    whose ``cov_t`` lies in ``(cov_low, cov_high)``. Of them, ``min(k, #candidates)``
    with ``k = max(1, ⌊ratio·N⌋)`` are picked uniformly at random over the whole batch,
    and their loss is zeroed (so is their gradient)::

        ℓ_t = max(-r·A, -clip(r, 1-ε_low, 1+ε_high)·A)·(1 - [t picked])

    **The random pick.** Each token gets a key ``u_t = frac(43758.5453·sin(...))``, a
    hash (in float64) of its values ``(logp, old, A)`` and a salt; the picked tokens are
    the candidates with the k smallest keys. The salt is drawn from ``generator`` in
    :meth:`batch_state` (a fresh pick per batch, reproducible from the generator's seed),
    or fixed when no generator is given (then the pick is a deterministic function of
    the batch). Keying by values rather than by position is what lets each micro-batch
    recognise its share of the global pick. Tokens with identical values share a key,
    so a tie at the k-th key is picked together. A compiled loss cannot take a
    generator: draw the state eagerly with ``PolicyLoss.batch_state(..., generator=)``
    and pass ``state=``.

    Because of the zeroing, the on-policy gradient differs from REINFORCE's on the
    picked tokens (by design).

    Args:
        ratio: fraction of active tokens whose gradient is cut, in (0, 1] (paper: 2e-4).
        cov_low, cov_high: the covariance band of candidates (paper: 1, 5).
        eps_low, eps_high: the PPO clip range (0.2, 0.2).

    References:
        Cui et al., The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models, arXiv:2505.22617; verl 0.9.1 ``clip_cov``.
    """

    name: ClassVar[str] = "clip-cov"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_note: ClassVar[str] = token_level_note("Clip-Cov", _COVARIANCE_REASON)

    ratio: float = 2e-4
    cov_low: float = 1.0
    cov_high: float = 5.0
    eps_low: float = 0.2
    eps_high: float = 0.2

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, low=0.0, high=1.0, low_inclusive=False)
        check_number("cov_low", self.cov_low)
        check_number("cov_high", self.cov_high, low=self.cov_low, low_inclusive=False, low_name="cov_low")
        check_number("eps_low", self.eps_low, low=0.0, high=1.0, high_inclusive=False)
        check_number("eps_high", self.eps_high, low=0.0)

    def _candidates(self, ctx: LossContext, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Active tokens in the covariance band that the clip leaves unclipped, [B, T] bool, detached.

        "Unclipped" compares the two terms as verl's ``clip_cov`` does, ``-clip(r)·A <= -r·A``
        (not the clip fractions of :func:`clipped_surrogate`, which round differently where
        ``r`` is within an ulp of a bound).
        """
        ratio = torch.exp(ctx.token_log_ratio.detach())  # [B, T]
        negative = -ctx.advantages  # [B, 1] or [B, T]
        unclipped = negative * ratio
        clipped = negative * ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        cov = _centred_covariance(ctx, state)
        in_band = (cov > self.cov_low) & (cov < self.cov_high)
        return in_band & (clipped <= unclipped) & (ctx.mask > 0)  # [B, T] bool

    @staticmethod
    def _keys(ctx: LossContext, salt: torch.Tensor) -> torch.Tensor:
        """A pseudo-random key in [0, 1) per token from its values and the salt (float64), detached."""
        mix = (
            ctx.logprobs.detach().double() * 12.9898
            + ctx.old_logprobs.double() * 78.233
            + torch.broadcast_to(ctx.advantages, ctx.mask.shape).double() * 37.719
            + salt.double() * 1000.0
        )
        return torch.frac(torch.sin(mix) * 43758.5453).abs()

    def batch_state(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        state = _batch_means(ctx)
        dtype, device = ctx.logprobs.dtype, ctx.logprobs.device
        if ctx.generator is None:
            salt = torch.full((), _CLIP_COV_SALT, dtype=dtype, device=device)
        else:
            salt = torch.rand((), generator=ctx.generator, dtype=dtype, device=ctx.generator.device).to(
                device
            )
        state["cov/salt"] = salt
        candidates = self._candidates(ctx, state)
        keys = torch.where(candidates, self._keys(ctx, salt), 2.0)  # non-candidates sort last
        k = _selection_size(self.ratio, ctx.mask)
        state["cov/key_threshold"] = _kth(keys, k, descending=False, empty=-1.0)
        return state

    def loss(self, ctx: LossContext) -> MethodOutput:
        state = ctx.state
        candidates = self._candidates(ctx, state)
        picked = candidates & (self._keys(ctx, state["cov/salt"]) <= state["cov/key_threshold"])
        loss, stats = clipped_surrogate(
            ctx.ratio, ctx.advantages, 1.0 - self.eps_low, 1.0 + self.eps_high, ctx.with_stats
        )  # [B, T]
        if ctx.with_stats:
            stats["cov/picked"] = picked
        return MethodOutput(torch.where(picked, 0.0, loss), stats)
