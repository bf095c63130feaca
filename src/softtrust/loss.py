"""PolicyLoss: a method, a ratio level, a behaviour correction, an aggregation and a KL term.

Data flows one way::

    log-probs -> token log-ratio -> level log-ratio (+ folded correction)
              -> method: per-token loss -> × correction weight, × OPSM mask, + β·KL
              -> aggregate -> scalar (+ metrics)

Each step lives in its own module; this one only composes them and checks inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from softtrust._validation import (
    as_bool_mask,
    check_choice,
    check_float_tensor,
    check_number,
    check_shape,
    compute_dtype,
)
from softtrust.aggregation import AGGREGATIONS, aggregate
from softtrust.corrections import OPSM, Correction, ImportanceCorrection, fold_log_weight, rollout_log_ratio
from softtrust.kl import KL, kl_estimate
from softtrust.methods import Method, MethodInputs, make_method
from softtrust.ratios import DEFAULT_LOG_RATIO_CLAMP, LEVELS, level_log_ratio, token_log_ratio


@dataclass
class LossOutput:
    """``loss``: scalar tensor, differentiable w.r.t. ``logprobs``. ``metrics``: plain floats."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class PolicyLoss:
    """A policy-gradient loss composed from four independent choices (and an optional KL).

    Example::

        loss_fn = st.PolicyLoss(st.VESPO(), aggregation="token-mean")
        out = loss_fn(logprobs, old_logprobs, advantages, mask)
        out.loss.backward()

    Args:
        method: a :class:`~softtrust.methods.Method` instance or a registry name
            (``clip``, ``gspo``, ``cispo``, ``sapo``, ``pspo``, ``vespo``, ``cfpo``, ``gmpo``, ``reinforce``).
        level: ``"token"``, ``"sequence-mean"`` or ``"sequence-sum"``; None takes
            the method's default (VESPO: sequence-sum, GSPO/GMPO: sequence-mean, others: token).
        correction: None, a :class:`TIS`/:class:`MIS`/:class:`OPSM`, or a sequence of
            them (at most one IS correction). Needs ``rollout_logprobs`` for TIS/MIS.
        aggregation: one of :data:`~softtrust.aggregation.AGGREGATIONS`.
        kl: None or :class:`~softtrust.kl.KL`; needs ``ref_logprobs``.
        log_ratio_clamp: bound on every log-ratio before ``exp`` (default 20).
        max_completion_length: ``T_max`` for ``seq-mean-token-sum-norm`` (default: the batch's T).
        compute_metrics: set False to skip the metrics (saves a few reductions).
        **method_params: parameters for a method given by name (or overrides for an instance).

    Raises:
        ValueError: unknown names, invalid hyperparameters, or a level the method refuses.
    """

    def __init__(
        self,
        method: str | Method,
        level: str | None = None,
        correction: Correction | Sequence[Correction] | None = None,
        aggregation: str = "token-mean",
        kl: KL | None = None,
        *,
        log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP,
        max_completion_length: int | None = None,
        compute_metrics: bool = True,
        **method_params: object,
    ) -> None:
        self.method = make_method(method, **method_params)
        self.level = self.method.default_level if level is None else level
        check_choice("level", self.level, LEVELS)
        if self.level not in self.method.levels:
            raise ValueError(
                f"level={self.level!r} is not supported by method {self.method.name!r} "
                f"(supported: {list(self.method.levels)}): {self.method.level_note}"
            )
        check_choice("aggregation", aggregation, AGGREGATIONS)
        self.aggregation = aggregation
        self.corrections = _as_corrections(correction)
        self.is_correction = next((c for c in self.corrections if isinstance(c, ImportanceCorrection)), None)
        self.opsm = next((c for c in self.corrections if isinstance(c, OPSM)), None)
        if kl is not None and not isinstance(kl, KL):
            raise ValueError(f"kl must be None or a softtrust.KL, got {type(kl).__name__}")
        self.kl = kl
        check_number("log_ratio_clamp", log_ratio_clamp, low=0.0, low_inclusive=False)
        self.log_ratio_clamp = float(log_ratio_clamp)
        if max_completion_length is not None:
            check_number("max_completion_length", max_completion_length, low=1)
        self.max_completion_length = max_completion_length
        self.compute_metrics = compute_metrics

    def __repr__(self) -> str:
        return (
            f"PolicyLoss({self.method!r}, level={self.level!r}, correction={list(self.corrections) or None}, "
            f"aggregation={self.aggregation!r}, kl={self.kl!r})"
        )

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        num_tokens: float | torch.Tensor | None = None,
        num_sequences: float | torch.Tensor | None = None,
    ) -> LossOutput:
        """Compute the loss.

        Args:
            logprobs: [B, T] log π_θ of the sampled tokens, differentiable, any float dtype.
            old_logprobs: [B, T] log π_old (behaviour), or None for on-policy (``logprobs.detach()``).
            advantages: [B] (one per sequence) or [B, T].
            mask: [B, T] bool or 0/1: the completion tokens that count.
            rollout_logprobs: [B, T] log-probs from the sampler, for TIS/MIS (and OPSM).
            ref_logprobs: [B, T] reference-policy log-probs, for the KL term.
            num_tokens: global active-token count (``token-mean`` over micro-batches/ranks).
            num_sequences: global sequence count (``seq-mean-*`` over micro-batches/ranks).

        Returns:
            :class:`LossOutput`. The math runs in float32 (float64 stays float64).
        """
        batch = self._prepare(logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs)
        logprobs, old, advantages, mask, rollout, ref, num_active = batch
        method, clamp = self.method, self.log_ratio_clamp

        tok_log_ratio = token_log_ratio(logprobs, old, mask, clamp)  # [B, T]
        log_ratio = level_log_ratio(tok_log_ratio, mask, self.level, clamp, num_active)  # [B, T] or [B, 1]

        is_log_weight = None
        if self.is_correction is not None:
            log_rho = rollout_log_ratio(old, rollout, mask, self.is_correction.level, clamp)
            is_log_weight = self.is_correction.log_weight(log_rho)  # [B, T] or [B, 1], detached
        if is_log_weight is not None and method.folds_correction:
            log_ratio = fold_log_weight(
                log_ratio, is_log_weight, self.is_correction.level, mask, self.level, num_active
            )

        inputs = MethodInputs(logprobs, log_ratio, tok_log_ratio, advantages, mask, num_active)
        per_token_loss, stats = method.loss(inputs)  # broadcastable to [B, T]

        if is_log_weight is not None and not method.folds_correction:
            per_token_loss = per_token_loss * torch.exp(is_log_weight)  # weight in [0, ∞), finite
        if self.opsm is not None:
            sampler = old if rollout is None else rollout
            keep = self.opsm.keep(logprobs, sampler, advantages, mask, num_active)  # [B, 1] or [B, T]
            per_token_loss = torch.where(keep, per_token_loss, 0)
            stats = {**stats, "opsm/dropped": ~keep}
        per_token_kl = None
        if self.kl is not None:
            per_token_kl = kl_estimate(logprobs, ref, self.kl.estimator, clamp)  # [B, T]
            if self.kl.importance_corrected:
                per_token_kl = per_token_kl * torch.exp(tok_log_ratio)
            per_token_loss = per_token_loss + self.kl.coef * per_token_kl

        loss = aggregate(
            per_token_loss,
            mask,
            self.aggregation,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            max_completion_length=self.max_completion_length,
            num_active=num_active,
        )
        metrics = {}
        if self.compute_metrics:
            metrics = _metrics(log_ratio, tok_log_ratio, is_log_weight, per_token_kl, stats, mask, num_active)
        return LossOutput(loss, metrics)

    def _prepare(self, logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs):
        """Check every input, cast to the compute dtype, and zero every masked position."""
        check_float_tensor("logprobs", logprobs)
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must have shape (B, T), got {tuple(logprobs.shape)}")
        shape = tuple(logprobs.shape)
        mask = as_bool_mask("mask", mask, shape)
        dtype = compute_dtype(logprobs)
        if old_logprobs is None:
            old_logprobs = logprobs.detach()
        named = {
            "old_logprobs": old_logprobs,
            "rollout_logprobs": rollout_logprobs,
            "ref_logprobs": ref_logprobs,
        }
        for name, tensor in named.items():
            if tensor is not None:
                check_float_tensor(name, tensor)
                check_shape(name, tensor, shape, "(B, T) like logprobs")
        if self.is_correction is not None and rollout_logprobs is None:
            raise ValueError(
                f"correction {self.is_correction!r} needs rollout_logprobs (the sampler's log-probs), got None"
            )
        if self.kl is not None and ref_logprobs is None:
            raise ValueError(
                f"kl={self.kl!r} needs ref_logprobs (the reference policy's log-probs), got None"
            )
        advantages = _check_advantages(advantages, shape)

        def clean(x: torch.Tensor | None, detach: bool) -> torch.Tensor | None:
            if x is None:
                return None
            x = x.detach().to(dtype) if detach else _upcast_saturating_grad(x, dtype)
            return torch.where(mask, x, 0)  # masked inf/NaN never enter any arithmetic

        num_active = mask.sum(dim=-1, keepdim=True)  # [B, 1]
        if advantages.dim() == 1:
            advantages = advantages.to(dtype).unsqueeze(-1)  # [B, 1]
        else:
            advantages = clean(advantages, detach=True)  # [B, T]
        return (
            clean(logprobs, detach=False),
            clean(old_logprobs, detach=True),
            advantages.detach(),
            mask,
            clean(rollout_logprobs, detach=True),
            clean(ref_logprobs, detach=True),
            num_active,
        )


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


def _upcast_saturating_grad(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype or torch.finfo(x.dtype).max >= torch.finfo(dtype).max:
        return x.to(dtype)
    return _UpcastSaturatingGrad.apply(x, dtype)


def _as_corrections(correction: object) -> tuple[Correction, ...]:
    if correction is None:
        return ()
    items = tuple(correction) if isinstance(correction, (list, tuple)) else (correction,)
    for item in items:
        if not isinstance(item, (ImportanceCorrection, OPSM)):
            raise ValueError(
                f"correction must be TIS, MIS, OPSM or a list of them, got {type(item).__name__}"
            )
    if sum(isinstance(item, ImportanceCorrection) for item in items) > 1:
        raise ValueError(
            f"correction may hold at most one importance correction (TIS or MIS), got {list(items)}"
        )
    if sum(isinstance(item, OPSM) for item in items) > 1:
        raise ValueError(f"correction may hold at most one OPSM, got {list(items)}")
    return items


def _check_advantages(advantages: object, shape: tuple[int, int]) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got dtype {advantages.dtype}")
    if tuple(advantages.shape) not in ((shape[0],), shape):
        raise ValueError(
            f"advantages must have shape (B,) = ({shape[0]},) or (B, T) = {shape}, got {tuple(advantages.shape)}"
        )
    return advantages


@torch.no_grad()
def _metrics(
    log_ratio, tok_log_ratio, is_log_weight, per_token_kl, stats, mask, num_active
) -> dict[str, float]:
    """Ratio, weight, clip and KL statistics over active tokens (or active sequences)."""
    active_rows = num_active > 0  # [B, 1]
    values: dict[str, torch.Tensor] = {}

    def describe(name: str, x: torch.Tensor, with_extremes: bool = True) -> None:
        where = active_rows if x.shape[-1] == 1 else mask  # sequence-level values count once per sequence
        x = x.float() if x.dtype == torch.bool else x
        x, where = torch.broadcast_tensors(x, where)
        count = where.sum()
        values[f"{name}/mean" if with_extremes else name] = torch.where(where, x, 0).sum() / count
        if with_extremes:
            values[f"{name}/min"] = (
                torch.where(where, x, math.inf).amin() if count else x.new_tensor(math.nan)
            )
            values[f"{name}/max"] = (
                torch.where(where, x, -math.inf).amax() if count else x.new_tensor(math.nan)
            )

    describe("ratio", torch.exp(log_ratio))
    seq_log_weight = tok_log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
    describe("seq_log_weight", seq_log_weight)
    # Normalised effective sample size of W_i = exp(log W_i) over active sequences, in log space:
    # ESS/n = (Σ W)² / (n·Σ W²) = exp(2·LSE(log W) - LSE(2·log W) - log n).
    log_w = seq_log_weight[active_rows]
    if log_w.numel():
        ess = torch.exp(
            2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0) - math.log(log_w.numel())
        )
        values["ess"] = ess
    for name, x in stats.items():
        describe(name, x, with_extremes=x.dtype != torch.bool)
    if is_log_weight is not None:
        describe("is_weight", torch.exp(is_log_weight))
    if per_token_kl is not None:
        describe("kl", per_token_kl, with_extremes=False)
    names = list(values)
    numbers = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
    return dict(zip(names, numbers, strict=True))
