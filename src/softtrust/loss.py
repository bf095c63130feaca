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
from typing import NamedTuple

import torch

from softtrust._validation import (
    as_float,
    as_float_mask,
    check_choice,
    check_float_tensor,
    check_number,
    check_shape,
    compute_dtype,
    constant,
)
from softtrust.aggregation import AGGREGATIONS, aggregate, aggregation_weights
from softtrust.corrections import OPSM, Correction, ImportanceCorrection, fold_log_weight, rollout_log_ratio
from softtrust.kl import KL, kl_estimate
from softtrust.methods import DetachedWeightMethod, Method, MethodInputs, make_method
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
        fused: without a KL term, evaluate every method with a closed-form slope (all
            but GMPO) in one fused pass with a one-multiply backward (same value and
            gradient, fewer passes); False always takes the plain elementwise path.
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
        fused: bool = True,
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
        self.fused = fused

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
        batch = self._check(logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs)
        normalisers = {"num_tokens": num_tokens, "num_sequences": num_sequences}
        if self.fused and self.method.fusable and self.kl is None:
            out = self._fused_loss(batch, normalisers)
            if out is not None:
                return out
        if batch.num_active is None:
            batch = batch._replace(num_active=batch.mask.sum(dim=-1, keepdim=True))
        zero_masked = _mask_multiply if _all_finite(batch) else _mask_where
        return self._reference_loss(_zero_masked_positions(batch, zero_masked), normalisers)

    def _reference_loss(self, batch: _Batch, normalisers: dict) -> LossOutput:
        """Every step as a plain elementwise tensor expression (the readable path; any method).

        ``batch`` holds inputs already zeroed at masked positions.
        """
        method, clamp, mask, num_active = self.method, self.log_ratio_clamp, batch.mask, batch.num_active
        tok_log_ratio = token_log_ratio(batch.logprobs, batch.old, mask, clamp)  # [B, T]
        log_ratio = level_log_ratio(tok_log_ratio, mask, self.level, clamp, num_active)  # [B, T] or [B, 1]
        log_ratio, is_log_weight = self._apply_folded_correction(batch, log_ratio)

        inputs = MethodInputs(
            batch.logprobs, log_ratio, tok_log_ratio, batch.advantages, mask, num_active, self.compute_metrics
        )
        per_token_loss, stats = method.loss(inputs)  # broadcastable to [B, T]
        if is_log_weight is not None and not method.folds_correction:
            per_token_loss = per_token_loss * torch.exp(is_log_weight)  # weight in [0, ∞), finite
        keep = self._opsm_keep(batch)
        if keep is not None:
            per_token_loss = per_token_loss * as_float(keep, per_token_loss.dtype)
            stats = {**stats, "opsm/dropped": ~keep}
        per_token_kl = None
        if self.kl is not None:
            per_token_kl = kl_estimate(batch.logprobs, batch.ref, self.kl.estimator, clamp)  # [B, T]
            if self.kl.importance_corrected:
                per_token_kl = per_token_kl * torch.exp(tok_log_ratio)
            per_token_loss = per_token_loss + self.kl.coef * per_token_kl

        loss = aggregate(
            per_token_loss,
            mask,
            self.aggregation,
            max_completion_length=self.max_completion_length,
            num_active=num_active,
            **normalisers,
        )
        seq_log_weight = tok_log_ratio.detach().sum(dim=-1, keepdim=True) if self.compute_metrics else None
        metrics = self._metrics(log_ratio, seq_log_weight, is_log_weight, per_token_kl, stats, batch)
        return LossOutput(loss, metrics)

    def _fused_loss(self, batch: _Batch, normalisers: dict) -> LossOutput | None:
        """Methods with a closed-form slope, evaluated without autograd through the method.

        The loss is ``L = Σ_t q_t·ℓ_t`` with the detached per-token factor
        ``q = m·(aggregation weight)·(IS weight)·(OPSM keep)``. Everything is computed
        without recording a graph; one final contraction carries the gradient:

        * REINFORCE-style methods (``ℓ = -sg(w)·A·logp``): ``L = Σ_t c_t·logp_t`` with
          ``c = -q·w·A``: forward one contraction, backward one multiply.
        * Methods with a :meth:`~softtrust.methods.Method.surrogate` (Clip, GSPO,
          SAPO, PSPO, CFPO): the method gives ``ℓ`` and its slope ``ℓ' = ∂ℓ/∂log r``;
          ``∂L/∂logp_t = q_t·ℓ'_t`` at token level and ``m_t/n_i·Σ_s q_s·ℓ'_s`` at
          sequence-mean level (times 0 where the token log-ratio is clamped, as
          ``clamp`` does). ``L = value + (d - sg(d))`` with ``d = Σ_t logp_t·g_t``: the
          value is exact and the backward is one multiply.

        Inputs are used raw (not zeroed at masked positions), which is exact when they
        are finite everywhere. The extremes of ``logp - old`` (non-finite as soon as
        either holds an inf or NaN anywhere) and a sum of the other dense inputs check
        that; if not, this returns None and the call takes the reference path, which
        zeroes masked entries with ``where``. Equal to :meth:`_reference_loss` in value
        and gradient (tests check it for every method, level, aggregation and correction).
        """
        method, clamp, mask, num_active = self.method, self.log_ratio_clamp, batch.mask, batch.num_active
        # Every tensor until the final contraction is detached: no autograd graph is recorded.
        tok_log_ratio = batch.logprobs.detach() - batch.old  # [B, T], unmasked
        lowest, highest = tok_log_ratio.aminmax()  # one pass: finiteness and whether the clamp acts
        lowest, highest = lowest.item(), highest.item()
        others = [x for x in (batch.rollout, batch.advantages) if x is not None and x.shape[-1] != 1]
        if not (math.isfinite(lowest) and math.isfinite(highest) and _finite_sums(others)):
            return None
        unclamped = None  # [B, T] 0/1: where the clamp passes the gradient (None: everywhere)
        if lowest < -clamp or highest > clamp:
            if not isinstance(method, DetachedWeightMethod):
                unclamped = as_float(tok_log_ratio.abs() <= clamp, mask.dtype)
            tok_log_ratio = tok_log_ratio.clamp_(-clamp, clamp)
        seq_log_weight = None
        if self.level == "token":
            log_ratio = tok_log_ratio
        else:  # from here on only Σ_t m·log r_t is needed: mask the buffer in place, reuse it below
            seq_log_weight = tok_log_ratio.mul_(mask).sum(dim=-1, keepdim=True)  # [B, 1]: Σ_t m·log r_t
            if self.level == "sequence-sum":
                # |Σ_t m·log r_t| <= T·max_t |log r_t|: when that bound is inside the clamp, skip it
                inside = mask.shape[-1] * max(-lowest, highest) <= 0.99 * clamp
                log_ratio = seq_log_weight if inside else seq_log_weight.clamp(-clamp, clamp)
            else:
                log_ratio = seq_log_weight / num_active.clamp(min=1)
        spare = None if self.level == "token" else tok_log_ratio  # a free [B, T] buffer
        log_ratio, is_log_weight = self._apply_folded_correction(batch, log_ratio)
        if self.aggregation == "token-mean" and normalisers["num_tokens"] is None and mask.is_cpu:
            # this path reads host values anyway: the count as a number saves its clamp and reciprocal
            count = mask.sum() if num_active is None else num_active.sum()
            normalisers = {**normalisers, "num_tokens": count.item()}
        factor = aggregation_weights(
            mask,
            self.aggregation,
            max_completion_length=self.max_completion_length,
            num_active=num_active,
            **normalisers,
        )  # a number, [B, 1] or a 0-dim tensor
        if is_log_weight is not None and not method.folds_correction:
            factor = torch.exp(is_log_weight) * factor  # [B, T] or [B, 1]
        keep = self._opsm_keep(batch)
        if keep is not None:
            factor = as_float(keep, mask.dtype) * factor
        if isinstance(method, DetachedWeightMethod):
            weight, stats = method.weight(log_ratio, batch.advantages, self.compute_metrics)
            if isinstance(factor, float):  # c = -w·A·factor in one op (a Python-scalar multiply costs two)
                zero = constant(0.0, weight.dtype, weight.device)
                coefficient = torch.addcmul(zero, weight, batch.advantages, value=-factor)
            else:
                coefficient = (weight * batch.advantages * factor).neg_()
            # coefficient: [B, 1] (or [B, T]), a fresh tensor
            # not addcmul(0, m, c, value=-1): a broadcast 0-dim input makes it ~4× slower than mul at 64×4096
            grad = torch.mul(mask, coefficient, out=spare)  # [B, T]: ∂L/∂logp = m·c
            loss = _with_gradient(batch.logprobs, grad)
        else:
            value, slope, stats = method.surrogate(log_ratio, batch.advantages, self.compute_metrics)
            q = mask * factor  # [B, T]
            if self.level == "token":
                grad = q * slope  # [B, T]
            else:  # sequence-mean: ∂ log s_i / ∂ logp_t = m_t / n_i
                row = (
                    (q * slope).sum(dim=-1, keepdim=True) if slope.shape[-1] != 1 else q.sum(-1, True) * slope
                )
                grad = (row / num_active.clamp(min=1)) * mask  # [B, T]
            if unclamped is not None:
                grad = grad * unclamped
            loss = _with_gradient(batch.logprobs, grad, value=(q * value).sum())
        if keep is not None:
            stats = {**stats, "opsm/dropped": ~keep}
        metrics = {}
        if self.compute_metrics:
            if seq_log_weight is None:
                seq_log_weight = (tok_log_ratio * mask).sum(dim=-1, keepdim=True)
            metrics = self._metrics(log_ratio, seq_log_weight, is_log_weight, None, stats, batch)
        return LossOutput(loss, metrics)

    def _apply_folded_correction(self, batch: _Batch, log_ratio: torch.Tensor):
        """The IS correction's log-weight, folded into ``log_ratio`` for methods that fold it (VESPO)."""
        correction = self.is_correction
        if correction is None:
            return log_ratio, None
        old, rollout = batch.old, batch.rollout
        if (
            not batch.zeroed
        ):  # the fused path keeps raw inputs; the log-weight wants zeros at masked positions
            old, rollout = old * batch.mask, rollout * batch.mask
        log_rho = rollout_log_ratio(old, rollout, batch.mask, correction.level, self.log_ratio_clamp)
        is_log_weight = correction.log_weight(log_rho)  # [B, T] or [B, 1], detached
        if self.method.folds_correction:
            log_ratio = fold_log_weight(
                log_ratio, is_log_weight, correction.level, batch.mask, self.level, batch.num_active
            )
        return log_ratio, is_log_weight

    def _opsm_keep(self, batch: _Batch) -> torch.Tensor | None:
        if self.opsm is None:
            return None
        sampler = batch.old if batch.rollout is None else batch.rollout
        return self.opsm.keep(batch.logprobs, sampler, batch.advantages, batch.mask, batch.num_active)

    def _metrics(
        self, log_ratio, tok_log_ratio, is_log_weight, per_token_kl, stats, batch
    ) -> dict[str, float]:
        if not self.compute_metrics:
            return {}
        return _metrics(
            log_ratio, tok_log_ratio, is_log_weight, per_token_kl, stats, batch.mask, batch.num_active
        )

    def _only_token_count(self) -> bool:
        """True when the fused path needs no per-row token count, only the batch's total (one sum fewer)."""
        return (
            self.aggregation == "token-mean"
            and self.level != "sequence-mean"
            and not self.corrections
            and not self.compute_metrics
        )

    def _check(self, logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs) -> _Batch:
        """Check every input and cast it to the compute dtype (float32, or float64 for float64 input)."""
        check_float_tensor("logprobs", logprobs)
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must have shape (B, T), got {tuple(logprobs.shape)}")
        shape = tuple(logprobs.shape)
        dtype = compute_dtype(logprobs)
        mask = as_float_mask("mask", mask, shape, dtype)
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
        advantages = _detached(_check_advantages(advantages, shape), dtype)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)  # [B, 1]
        old, rollout, ref = (_detached(x, dtype) if x is not None else None for x in named.values())
        return _Batch(
            logprobs=_upcast_saturating_grad(logprobs, dtype),
            old=old,
            advantages=advantages,
            mask=mask,
            rollout=rollout,
            ref=ref,
            num_active=None if self._only_token_count() else mask.sum(dim=-1, keepdim=True),
            zeroed=False,
        )


class _Batch(NamedTuple):
    """Checked inputs in the compute dtype; ``zeroed``: every masked entry replaced by exactly 0."""

    logprobs: torch.Tensor  # [B, T] compute dtype, differentiable
    old: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, 1] or [B, T]
    mask: torch.Tensor  # [B, T] 0/1 float
    rollout: torch.Tensor | None  # [B, T]
    ref: torch.Tensor | None  # [B, T]
    num_active: torch.Tensor | None  # [B, 1] Σ_t m_t; None when only the total is needed (fused path)
    zeroed: bool


def _zero_masked_positions(batch: _Batch, zero_masked) -> _Batch:
    """Replace every masked entry by exactly 0; after this every value computed at a masked position is finite."""
    clean = [
        zero_masked(x, batch.mask) if x is not None else None
        for x in (batch.logprobs, batch.old, batch.rollout, batch.ref)
    ]
    advantages = batch.advantages
    if (
        advantages.shape == batch.mask.shape
    ):  # per-token advantages (harmless for per-sequence ones when T = 1)
        advantages = zero_masked(advantages, batch.mask)
    logprobs, old, rollout, ref = clean
    return batch._replace(
        logprobs=logprobs, old=old, rollout=rollout, ref=ref, advantages=advantages, zeroed=True
    )


def _with_gradient(
    logprobs: torch.Tensor, grad: torch.Tensor, value: torch.Tensor | None = None
) -> torch.Tensor:
    """A scalar whose gradient w.r.t. ``logprobs`` is ``grad`` (detached, [B, T]).

    ``d = Σ logp·g`` is one contraction whose backward is one multiply. With no
    ``value`` the result is ``d`` itself (a loss linear in ``logp``); otherwise it is
    ``value + (d - sg(d))``, exactly ``value`` in the forward (``d - d = 0``).
    Measured on CPU: faster than ``(logp * g).sum()``, than a masked row sum
    followed by a dot, and than a custom ``autograd.Function`` (Python backward).
    """
    contraction = torch.dot(logprobs.reshape(-1), grad.reshape(-1))
    if value is None:
        return contraction
    return value + (contraction - contraction.detach())


def _all_finite(batch: _Batch) -> bool:
    """True when no input holds an inf or NaN anywhere (one sum per tensor, one sync; always False off CPU).

    A sum is non-finite as soon as one term is (a rare overflow of finite terms only
    costs the slower exact path). On accelerators ``torch.where`` is as fast as a
    multiply, so the check and its sync are skipped there.
    """
    if batch.logprobs.device.type != "cpu":
        return False
    return _finite_sums([batch.logprobs, batch.old, batch.advantages, batch.rollout, batch.ref])


def _finite_sums(tensors: list[torch.Tensor | None]) -> bool:
    """True when every given tensor's sum is finite (so no entry is inf or NaN)."""
    return all(math.isfinite(x.detach().sum().item()) for x in tensors if x is not None)


def _mask_multiply(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x * m``: exact for finite ``x`` (several times faster than ``where`` with a bool mask on CPU)."""
    return x * mask


def _mask_where(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``where(m, x, 0)``: masked inf/NaN become 0 (``x * m`` would give ``0 * inf = NaN``)."""
    return torch.where(mask != 0, x, 0)


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


def _detached(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.detach().to(dtype)``, skipping the calls that would change nothing (they cost µs per call)."""
    if x.requires_grad:
        x = x.detach()
    return x if x.dtype == dtype else x.to(dtype)


def _upcast_saturating_grad(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    if torch.finfo(x.dtype).max >= torch.finfo(dtype).max:
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
    log_ratio, seq_log_weight, is_log_weight, per_token_kl, stats, mask, num_active
) -> dict[str, float]:
    """Ratio, weight, clip and KL statistics over active tokens (or active sequences).

    A [B, 1] statistic counts once per sequence with at least one active token; a
    [B, T] one once per active token. Statistics of an empty set are NaN. Values
    at masked positions are finite (any path guarantees it before computing metrics),
    so they can be pushed out of min/max by adding a large offset.
    """
    active_rows = (num_active > 0).to(mask.dtype)  # [B, 1]
    far = 1e30  # every statistic here is far below it
    offsets = {1: (1 - active_rows) * far}  # [B, 1]; the [B, T] one is built on first use
    values: dict[str, torch.Tensor] = {}

    def describe(name: str, x: torch.Tensor, with_extremes: bool = True) -> None:
        per_row = x.shape[-1] == 1
        weight = active_rows if per_row else mask  # [B, 1] or [B, T]
        x = as_float(x, mask.dtype)
        count = torch.broadcast_tensors(x, weight)[1].sum()
        values[f"{name}/mean" if with_extremes else name] = (x * weight).sum() / count
        if with_extremes:
            if not per_row and "token" not in offsets:
                offsets["token"] = (1 - mask) * far
            offset = offsets[1 if per_row else "token"]
            values[f"{name}/min"] = (x + offset).amin() if count else x.new_tensor(math.nan)
            values[f"{name}/max"] = (x - offset).amax() if count else x.new_tensor(math.nan)

    describe("ratio", torch.exp(log_ratio))
    describe("seq_log_weight", seq_log_weight)
    # Normalised effective sample size of W_i = exp(log W_i) over active sequences, in log space:
    # ESS/n = (Σ W)² / (n·Σ W²) = exp(2·LSE(log W) - LSE(2·log W) - log n).
    log_w = seq_log_weight[num_active > 0]
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
        describe("kl", per_token_kl.detach(), with_extremes=False)
    names = list(values)
    numbers = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
    return dict(zip(names, numbers, strict=True))
