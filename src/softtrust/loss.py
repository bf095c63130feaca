"""PolicyLoss: a method, a ratio level, a behaviour correction, an aggregation and a KL term.

Data flows one way, and :meth:`PolicyLoss.__call__` reads in that order::

    inputs -> checked, cast, zeroed at masked positions          (_validation)
           -> token log-ratio -> level log-ratio                  (ratios)
           -> behaviour correction: folded into the ratio or a weight on ℓ   (corrections)
           -> method: per-token loss ℓ                            (methods)
           -> × high-entropy keep, × correction weight, + β·KL, − c·H   (entropy, kl)
           -> aggregate -> scalar; metrics as tensors             (aggregation, metrics)

No step reads a tensor's value on the host or branches on one, so a call never waits
for the device and ``torch.compile(loss_fn, fullgraph=True)`` works for every method
(value checks of the inputs run on the CPU by default; see ``check_values``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from softtrust._validation import (
    as_float,
    check_advantages,
    check_choice,
    check_count,
    check_finite_where_active,
    check_float_tensor,
    check_input_values,
    check_kl_coef,
    check_log_ratio_clamp,
    check_mask,
    check_number,
    check_scale,
    check_shape,
    compute_dtype,
    detached_as,
    upcast_saturating_grad,
    values_are_checked,
)
from softtrust.aggregation import AGGREGATIONS, aggregate
from softtrust.corrections import (
    IS_WEIGHT_MEAN,
    OPSM,
    Correction,
    ImportanceCorrection,
    Reject,
    as_corrections,
    fold_log_weight,
    is_weight_mean,
    rollout_log_ratio,
    self_normalized,
)
from softtrust.entropy import ENTROPY_THRESHOLD, entropy_threshold, high_entropy_mask
from softtrust.kl import KL, kl_estimate
from softtrust.methods import DetachedWeightMethod, LossContext, Method, make_method
from softtrust.metrics import loss_metrics
from softtrust.ratios import (
    DEFAULT_LOG_RATIO_CLAMP,
    LEVELS,
    clamp_log_ratio,
    clamped_log_ratio,
    level_log_ratio,
)


@dataclass
class LossOutput:
    """``loss``: scalar tensor, differentiable w.r.t. ``logprobs``. ``metrics``: 0-dim tensors, detached."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def metric_values(self) -> dict[str, float]:
        """The metrics as Python floats, read with one host transfer (call it when logging)."""
        if not self.metrics:
            return {}
        numbers = torch.stack([value.float().reshape(()) for value in self.metrics.values()]).tolist()
        return dict(zip(self.metrics, numbers, strict=True))


class PolicyLoss:
    """A policy-gradient loss composed from four independent choices (and an optional KL).

    Example::

        loss_fn = st.PolicyLoss(st.VESPO(), aggregation="token-mean")
        out = loss_fn(logprobs, old_logprobs, advantages, mask)
        out.loss.backward()

    Args:
        method: a :class:`~softtrust.methods.Method` instance or a name in :data:`~softtrust.METHODS`.
        level: ``"token"``, ``"sequence-mean"`` or ``"sequence-sum"``; None takes
            the method's default (VESPO: sequence-sum, GSPO/GMPO: sequence-mean, others: token).
        correction: None, a :class:`TIS`/:class:`MIS`/:class:`OPSM`/:class:`Reject`, or a
            sequence of them (at most one of each kind: one IS correction, one OPSM, one
            Reject). Needs ``rollout_logprobs`` for TIS/MIS/Reject.
        aggregation: one of :data:`~softtrust.aggregation.AGGREGATIONS`.
        kl: None or :class:`~softtrust.kl.KL`; needs ``ref_logprobs``.
        log_ratio_clamp: bound on every log-ratio before ``exp`` (default 20, at most ln 1e12).
        max_completion_length: ``T_max`` for ``seq-mean-token-sum-norm`` (default: the batch's T).
        entropy_coef: c in [0, 1e12], an entropy bonus: ``-c·H_t`` is added to the per-token loss
            (on the kept tokens when ``entropy_quantile < 1``) and aggregated with it, so
            its gradient raises the policy's entropy. Needs ``entropy=`` in the call. (TRL's
            ``entropy_coef`` always takes the token mean of H over the kept tokens,
            whatever the aggregation; :mod:`softtrust.integrations.trl` applies that.)
        entropy_quantile: ρ in [0, 1]: keep the policy loss only on the fraction ρ of active
            tokens with the highest entropy (H_t >= the (1 - ρ)-quantile of the batch's
            active entropies; "Beyond the 80/20 rule", Wang et al., arXiv:2506.01939; TRL's
            ``top_entropy_quantile``); 1 keeps every token. The KL term is not masked. The
            threshold is a statistic of the whole batch (:meth:`batch_state`). Needs ``entropy=``.
        compute_metrics: set False to skip the metrics (saves a few reductions).
        check_values: check input values (mask is 0/1; old, rollout and reference log-probs
            and advantages finite at active positions; counts > 0), raising ``ValueError``.
            None (default): on CPU tensors only, where reading values costs microseconds;
            on an accelerator it would wait for the device on every call. Never while
            compiling. Unchecked, a non-finite recorded log-prob gives a non-finite loss.
            Shape, dtype and name errors are always raised.
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
        entropy_coef: float = 0.0,
        entropy_quantile: float = 1.0,
        compute_metrics: bool = True,
        check_values: bool | None = None,
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
        self.corrections = as_corrections(correction)
        self.is_correction = next((c for c in self.corrections if isinstance(c, ImportanceCorrection)), None)
        self.opsm = next((c for c in self.corrections if isinstance(c, OPSM)), None)
        self.reject = next((c for c in self.corrections if isinstance(c, Reject)), None)
        self._self_normalizes = self.is_correction is not None and self.is_correction.self_normalize
        if kl is not None and not isinstance(kl, KL):
            raise ValueError(f"kl must be None or a softtrust.KL, got {type(kl).__name__}")
        self.kl = kl
        check_log_ratio_clamp(log_ratio_clamp)
        self.log_ratio_clamp = float(log_ratio_clamp)
        if max_completion_length is not None:
            check_number("max_completion_length", max_completion_length, low=1)
        self.max_completion_length = max_completion_length
        check_scale("entropy_coef", entropy_coef, low_inclusive=True)
        check_number("entropy_quantile", entropy_quantile, low=0.0, high=1.0)
        self.entropy_coef, self.entropy_quantile = float(entropy_coef), float(entropy_quantile)
        self.compute_metrics = bool(compute_metrics)
        if check_values is not None and not isinstance(check_values, bool):
            raise ValueError(f"check_values must be None, True or False, got {check_values!r}")
        self.check_values = check_values
        self._has_batch_state = type(self.method).batch_state is not Method.batch_state
        # a detached-weight method never differentiates the ratio; an importance-corrected KL does
        # (unless straight-through: its ratio is a detached weight)
        self._ratio_in_graph = not isinstance(self.method, DetachedWeightMethod) or bool(
            kl is not None and kl.importance_corrected and not kl.straight_through
        )

    def __repr__(self) -> str:
        return (
            f"PolicyLoss({self.method!r}, level={self.level!r}, correction={list(self.corrections) or None}, "
            f"aggregation={self.aggregation!r}, kl={self.kl!r})"
        )

    @property
    def selects_over_batch(self) -> bool:
        """True when the method selects over the whole mini-batch (``Method.batch_state``
        overridden: M2PO, KL-Cov, Clip-Cov, BAPO): a trainer that splits the mini-batch passes
        the whole batch's ``state=``."""
        return self._has_batch_state

    @property
    def uses_batch_state(self) -> bool:
        """True when part of the loss is a statistic of the whole mini-batch: a method that
        selects over it (:attr:`selects_over_batch`), a self-normalised IS correction (its
        batch mean) or the high-entropy selection (its threshold). A trainer that splits the
        mini-batch (micro-batches, ranks) computes :meth:`batch_state` once over the whole and
        passes it as ``state=`` to every call."""
        return self._has_batch_state or self._self_normalizes or self.selects_by_entropy

    @property
    def selects_by_entropy(self) -> bool:
        """True when ``entropy_quantile < 1``: the loss keeps the top-entropy tokens only."""
        return self.entropy_quantile < 1.0

    @property
    def needs_entropy(self) -> bool:
        """True when a call needs ``entropy=`` (an entropy bonus or the high-entropy selection)."""
        return self.entropy_coef > 0.0 or self.selects_by_entropy

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
        *,
        state: dict[str, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        kl_coef: float | torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> LossOutput:
        """Compute the loss.

        Args:
            logprobs: [B, T] log π_θ of the sampled tokens, differentiable, any float dtype.
            old_logprobs: [B, T] log π_old (behaviour), or None for on-policy (``logprobs.detach()``).
            advantages: [B] (one per sequence) or [B, T].
            mask: [B, T] bool or 0/1: the completion tokens that count.
            rollout_logprobs: [B, T] log-probs from the sampler, for TIS/MIS (and OPSM).
            ref_logprobs: [B, T] reference-policy log-probs, for the KL term.
            num_tokens: global active-token count (``token-mean`` over micro-batches/ranks), > 0.
            num_sequences: global sequence count (``seq-mean-*`` over micro-batches/ranks), > 0.
            state: the batch-wide quantities from :meth:`batch_state` over the global batch
                (a method's selection, a self-normalised IS correction's mean); a part it lacks
                (or None) is computed from this batch.
            generator: random generator for methods that draw.
            kl_coef: β for this call instead of ``kl.coef`` (an adaptive controller's,
                :class:`~softtrust.kl.AdaptiveKLController`), >= 0; needs ``kl``.
            entropy: [B, T] per-token entropy of π_θ (``completion_logprobs(...,
                with_entropy=True)``), differentiable for the bonus; needed by
                ``entropy_coef`` / ``entropy_quantile``, else only reported
                (``entropy/mean``). Masked positions may hold anything.

        Returns:
            :class:`LossOutput`. The math runs in float32 (float64 stays float64). An
            empty batch (B = 0 or T = 0, or no active token) gives loss 0 and gradient 0.
        """
        if kl_coef is not None:
            check_kl_coef(kl_coef, self.kl)
        batch = self._inputs(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            rollout_logprobs,
            ref_logprobs,
            num_tokens,
            num_sequences,
        )
        entropy = self._entropy(entropy, batch)  # [B, T] in the compute dtype, 0 at masked positions
        given = {} if state is None else state
        batch, is_mean = self._normalized_is(batch, given)
        ctx, loss_weight, stats = self._context(batch, generator)
        method_state = {key: value for key, value in given.items() if key not in _LOSS_STATE_KEYS}
        if not method_state and self._has_batch_state:
            with torch.no_grad():
                method_state = self.method.batch_state(ctx)
        if method_state:
            ctx = ctx._replace(state=method_state)
        per_token_loss, method_stats = self.method.loss(ctx)  # broadcastable to [B, T]
        keep, bonus = self._entropy_terms(entropy, ctx.mask, given, stats)  # None, None without entropy
        if keep is not None:  # the top-ρ entropy tokens only
            per_token_loss = per_token_loss * keep
        if loss_weight is not None:  # IS weight (unless folded) × OPSM keep × Reject keep; detached
            per_token_loss = per_token_loss * loss_weight
        per_token_kl = None
        if self.kl is not None:
            per_token_kl = kl_estimate(ctx.logprobs, batch.ref, self.kl.estimator, self.log_ratio_clamp)
            if self.kl.importance_corrected:  # × r; detached for k2's gradient (straight-through)
                ratio = torch.exp(ctx.token_log_ratio)  # [B, T]
                per_token_kl = per_token_kl * (ratio.detach() if self.kl.straight_through else ratio)
            coef = self.kl.coef if kl_coef is None else kl_coef
            per_token_loss = per_token_loss + coef * per_token_kl  # [B, T]
        if bonus is not None:  # c·H on the kept tokens
            per_token_loss = per_token_loss - bonus
        loss = aggregate(
            per_token_loss,
            ctx.mask,
            self.aggregation,
            num_tokens=ctx.num_tokens,
            num_sequences=ctx.num_sequences,
            max_completion_length=self.max_completion_length,
            num_active=ctx.num_active,
        )
        metrics = {}
        if self.compute_metrics:
            metrics = loss_metrics(
                ctx.log_ratio,
                ctx.token_log_ratio,
                batch.is_log_weight,
                per_token_kl,
                {**method_stats, **stats},
                ctx.mask,
                ctx.num_active,
            )
            if is_mean is not None:
                metrics[IS_WEIGHT_MEAN] = is_mean.detach()
        return LossOutput(loss, metrics)

    def batch_state(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None = None,
        num_tokens: float | torch.Tensor | None = None,
        num_sequences: float | torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        entropy: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The loss's batch-wide quantities, detached: the method's
        (:meth:`~softtrust.methods.Method.batch_state`), a self-normalised IS correction's
        mean (``"is_weight/batch_mean"``, :func:`~softtrust.corrections.is_weight_mean`) and
        the high-entropy selection's threshold (``"entropy/threshold"``,
        :func:`~softtrust.entropy.entropy_threshold`; needs ``entropy``).

        Call it once on the whole (global) batch, then pass ``state=`` to each
        micro-batch call: the micro-batch losses then add up to the whole-batch loss.
        Empty when the loss needs none (:attr:`uses_batch_state` is False).
        """
        with torch.no_grad():
            batch = self._inputs(
                logprobs, old_logprobs, advantages, mask, rollout_logprobs, None, num_tokens, num_sequences
            )
            batch, is_mean = self._normalized_is(batch, {})
            state = {} if is_mean is None else {IS_WEIGHT_MEAN: is_mean}
            if self.selects_by_entropy:
                entropy = self._entropy(entropy, batch)
                state[ENTROPY_THRESHOLD] = entropy_threshold(entropy, batch.mask, self.entropy_quantile)
            if self._has_batch_state:
                state.update(self.method.batch_state(self._context(batch, generator)[0]))
            return state

    def _normalized_is(self, batch: _Batch, given: dict) -> tuple[_Batch, torch.Tensor | None]:
        """``batch`` with its IS log-weight self-normalised (``log w - log mean``), and the mean:
        ``given``'s (the global batch's) or this batch's; ``(batch, None)`` without self-normalisation."""
        if not self._self_normalizes:
            return batch, None
        mean = given.get(IS_WEIGHT_MEAN)
        if mean is None:
            mean = is_weight_mean(batch.is_log_weight, self.is_correction.level, batch.mask, batch.num_active)
        return batch._replace(is_log_weight=self_normalized(batch.is_log_weight, mean)), mean

    def _entropy(self, entropy: torch.Tensor | None, batch: _Batch) -> torch.Tensor | None:
        """``entropy`` checked, in the compute dtype (gradient kept) and 0 at masked positions;
        a ``ValueError`` naming it when the loss needs it and it is absent, of another shape
        than ``logprobs``, not floating-point, or (values checked) not finite where active."""
        if entropy is None:
            if self.needs_entropy:
                raise ValueError(
                    f"entropy_coef={self.entropy_coef}, entropy_quantile={self.entropy_quantile} need entropy= "
                    "(the [B, T] per-token entropy, completion_logprobs(..., with_entropy=True)), got None"
                )
            return None
        check_float_tensor("entropy", entropy)
        check_shape("entropy", entropy, tuple(batch.logprobs.shape), "(B, T) like logprobs")
        active = batch.mask > 0  # [B, T]
        if values_are_checked(self.check_values, entropy.is_cpu):
            check_finite_where_active("entropy", entropy.detach(), active)
        entropy = upcast_saturating_grad(entropy, batch.mask.dtype)
        return torch.where(active, entropy, 0)  # a masked NaN never reaches the loss or its gradient

    def _entropy_terms(
        self, entropy: torch.Tensor | None, mask: torch.Tensor, given: dict, stats: dict
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keep, bonus)``: the ``[B, T]`` 0/1 high-entropy selection (None unless
        ``entropy_quantile < 1``; its threshold ``given``'s, the global batch's, or this batch's)
        and the ``[B, T]`` bonus ``c·keep·H`` (None unless ``entropy_coef > 0``). Records the
        entropy and the kept fraction in ``stats`` (metrics ``entropy/*``)."""
        if entropy is None:
            return None, None
        stats["entropy"] = entropy.detach()  # entropy/mean, /min, /max over the active tokens
        keep = bonus = None
        if self.selects_by_entropy:
            threshold = given.get(ENTROPY_THRESHOLD)
            if threshold is None:
                threshold = entropy_threshold(entropy, mask, self.entropy_quantile)
            keep = high_entropy_mask(entropy, mask, threshold).to(entropy.dtype)  # [B, T] 0/1
            stats["entropy/kept"] = keep > 0  # the fraction of active tokens kept
        if self.entropy_coef > 0.0:
            bonus = self.entropy_coef * (entropy if keep is None else entropy * keep)  # [B, T]
        return keep, bonus

    def _context(self, batch: _Batch, generator: torch.Generator | None):
        """Ratios at the level, the behaviour correction, and the method's context.

        Returns ``(ctx, loss_weight, stats)``: ``loss_weight`` multiplies the per-token
        loss (an IS weight the method does not fold, times the OPSM keep), or None.
        """
        clamp, mask = self.log_ratio_clamp, batch.mask
        log_ratio = level_log_ratio(
            batch.token_log_ratio, self.level, batch.num_active, clamp
        )  # [B, T] or [B, 1]
        loss_weight, stats = None, {}
        if batch.is_log_weight is not None:
            if self.method.folds_correction:
                level = self.is_correction.level
                log_ratio = fold_log_weight(
                    log_ratio, batch.is_log_weight, level, mask, self.level, batch.num_active
                )
            else:
                loss_weight = torch.exp(batch.is_log_weight)  # [B, T] or [B, 1], in [0, ∞)
        if self.opsm is not None:
            sampler = batch.old if batch.rollout is None else batch.rollout
            keep = self.opsm.weight(batch.logprobs, sampler, batch.advantages, mask, batch.num_active)
            loss_weight = keep if loss_weight is None else loss_weight * keep
            stats["opsm/dropped"] = keep == 0
        if self.reject is not None:  # a 0/1 (NaN) mask on the loss, like OPSM; never folded into W
            keep = self.reject.weight(batch.old, batch.rollout, mask, batch.num_active)
            loss_weight = keep if loss_weight is None else loss_weight * keep
            stats["reject/dropped"] = keep == 0
        ctx = LossContext(
            logprobs=batch.logprobs,
            old_logprobs=batch.old,
            log_ratio=log_ratio,
            token_log_ratio=batch.token_log_ratio,
            advantages=batch.advantages,
            mask=mask,
            num_active=batch.num_active,
            num_tokens=batch.num_tokens,
            num_sequences=batch.num_sequences,
            level=self.level,
            state={},
            generator=generator,
            with_stats=self.compute_metrics,
        )
        return ctx, loss_weight, stats

    def _check_arguments(self, logprobs, recorded: dict, advantages, mask, counts: dict) -> None:
        """The checks that read no value (types, shapes, names): raised on every call, on any device."""
        check_float_tensor("logprobs", logprobs)
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must have shape (B, T), got {tuple(logprobs.shape)}")
        shape = tuple(logprobs.shape)
        check_mask("mask", mask, shape)
        for name, tensor in recorded.items():
            if tensor is not None:
                check_float_tensor(name, tensor)
                check_shape(name, tensor, shape, "(B, T) like logprobs")
        for needs_sampler in (self.is_correction, self.reject):
            if needs_sampler is not None and recorded["rollout_logprobs"] is None:
                raise ValueError(
                    f"correction {needs_sampler!r} needs rollout_logprobs (the sampler's log-probs), got None"
                )
        if self.kl is not None and recorded["ref_logprobs"] is None:
            raise ValueError(
                f"kl={self.kl!r} needs ref_logprobs (the reference policy's log-probs), got None"
            )
        check_advantages(advantages, shape)
        for name, count in counts.items():
            check_count(name, count, False)  # its value is read with the other values, if at all

    def _inputs(
        self,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        rollout_logprobs,
        ref_logprobs,
        num_tokens,
        num_sequences,
    ) -> _Batch:
        """Check every input, cast it to the compute dtype, and make masked entries harmless.

        Masked entries may hold anything (inf, NaN). Two ways make them harmless, with
        the same values and gradients (tests check both):

        * values checked and every input finite everywhere (the usual case on the CPU,
          where the check reads one sum per input): masked entries are finite, so the
          token log-ratio is masked by a multiply and the other inputs are used as they
          are; the aggregation masks the per-token loss.
        * otherwise (a masked inf/NaN, an accelerator, ``torch.compile``): every input
          is zeroed at masked positions with ``torch.where`` (``x * m`` would give
          ``0 * inf = NaN``), and unless values were checked a non-finite recorded
          log-prob at an active position makes its log-ratio NaN.

        The choice reads values only where the value checks read them anyway (one
        :func:`~softtrust._validation.check_input_values` call, on the CPU by default).
        Why not the ``where`` path alone: on the CPU, PyTorch's bool selects run about 7x
        slower than a multiply (``where(m, x, 0)`` 1.52 ms against ``x * m`` 0.21 ms at
        64 × 8192, one thread, torch 2.13.0+cpu; forward + backward 4.24 against 0.73 ms), and
        that path makes two to four of them plus the ``isfinite`` guard. Measured with
        ``benchmarks/bench_loss.py``'s variants on 2 shared cores, 8 runs of each code
        interleaved (median [range] of the runs' ratios, each the median of 30 rounds),
        the ``where`` path alone took VESPO from 1.85× [1.67–1.94] TRL's speed to 1.17×
        [1.06–2.39] at 64 × 4096, 2.03× [1.78–3.32] to 1.08× [1.06–1.19] at 64 × 8192 and
        1.85× [1.28–2.21] to 1.07× [1.04–1.15] at 32 × 16384; Clip from 1.70×, 2.01×, 2.08×
        its plain expression to 1.44×, 1.65×, 1.71×; SAPO from 0.98×, 1.09×, 1.08× to 0.90×,
        0.96×, 0.97×. Not within noise: both paths stay.
        """
        if old_logprobs is None:
            old_logprobs = logprobs.detach()
        recorded = {
            "old_logprobs": old_logprobs,
            "rollout_logprobs": rollout_logprobs,
            "ref_logprobs": ref_logprobs,
        }
        counts = {"num_tokens": num_tokens, "num_sequences": num_sequences}
        self._check_arguments(logprobs, recorded, advantages, mask, counts)
        dtype = compute_dtype(logprobs)
        mask_f = as_float(mask if mask.dtype == torch.bool else mask != 0, dtype)  # [B, T] 0/1
        num_active = mask_f.sum(dim=-1, keepdim=True)  # [B, 1]
        logprobs = upcast_saturating_grad(logprobs, dtype)  # [B, T], differentiable
        old, rollout, ref = (None if x is None else detached_as(x, dtype) for x in recorded.values())
        advantages = detached_as(advantages, dtype)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)  # [B, 1]
        raw_log_ratio = (logprobs if self._ratio_in_graph else logprobs.detach()) - old  # [B, T]
        checked, clamp = values_are_checked(self.check_values, logprobs.is_cpu), self.log_ratio_clamp
        finite = False
        if checked:  # one host read per sum and count; logp - old stands for both log-probs
            differences = raw_log_ratio.detach() if raw_log_ratio.requires_grad else raw_log_ratio
            finite, counts = check_input_values(
                mask, {**recorded, "advantages": advantages}, (differences, rollout, ref, advantages), counts
            )
        if finite:  # masked entries are finite: a multiply masks the log-ratio, the other inputs stay
            if raw_log_ratio.requires_grad:
                token_log_ratio = clamp_log_ratio(raw_log_ratio, clamp) * mask_f  # [B, T]
            else:  # a fresh tensor outside autograd: in place
                token_log_ratio = raw_log_ratio.clamp_(-clamp, clamp).mul_(mask_f)
            rollout, ref = (None if x is None else x * mask_f for x in (rollout, ref))
            if advantages.shape[-1] != 1:
                advantages = advantages * mask_f
        else:  # anything may sit at a masked position: select zeros there (a multiply gives 0·inf = NaN)
            active = mask_f > 0  # [B, T]
            logprobs, old, rollout, ref = (
                None if x is None else torch.where(active, x, 0) for x in (logprobs, old, rollout, ref)
            )
            advantages = torch.where(active if advantages.shape[-1] != 1 else num_active > 0, advantages, 0)
            token_log_ratio = clamped_log_ratio(logprobs, old, clamp)  # [B, T]; NaN for a bad old
        is_log_weight = None
        if self.is_correction is not None:
            log_rho = rollout_log_ratio(old * mask_f, rollout, self.is_correction.level, clamp)
            is_log_weight = self.is_correction.log_weight(log_rho)  # [B, T] or [B, 1], detached
        num_tokens = counts["num_tokens"]
        # none given: this batch's count, read as a number where values are read anyway (a division
        # by a number costs the aggregation fewer operations than one by a 0-dim tensor)
        if num_tokens is None:
            num_tokens = num_active.sum().item() if checked else num_active.sum()
        return _Batch(
            logprobs=logprobs,
            old=old,
            token_log_ratio=token_log_ratio,
            advantages=advantages,
            mask=mask_f,
            rollout=rollout,
            ref=ref,
            is_log_weight=is_log_weight,
            num_active=num_active,
            num_tokens=_count(num_tokens, 1),
            num_sequences=_count(counts["num_sequences"], len(logprobs)),
        )


# keys of ``state`` that belong to the loss's own parts, not to the method
_LOSS_STATE_KEYS = (IS_WEIGHT_MEAN, ENTROPY_THRESHOLD)


class _Batch(NamedTuple):
    """Checked inputs in the compute dtype: masked entries finite (see ``PolicyLoss._inputs``)."""

    logprobs: torch.Tensor  # [B, T] differentiable
    old: torch.Tensor  # [B, T]
    token_log_ratio: torch.Tensor  # [B, T] clamped logp - old, 0 at masked positions
    advantages: torch.Tensor  # [B, 1] or [B, T]
    mask: torch.Tensor  # [B, T] 0/1 float
    rollout: torch.Tensor | None  # [B, T]
    ref: torch.Tensor | None  # [B, T]
    is_log_weight: torch.Tensor | None  # [B, T] or [B, 1]: the IS correction's log-weight
    num_active: torch.Tensor  # [B, 1]
    num_tokens: float | torch.Tensor  # >= 1
    num_sequences: float | torch.Tensor  # >= 1


def _count(given: float | torch.Tensor | None, default: int) -> float | torch.Tensor:
    """A global count of at least 1, a number or a 0-dim tensor (an empty batch gives loss 0, not 0/0)."""
    if given is None:
        return float(max(default, 1))
    return given.reshape(()).clamp(min=1) if isinstance(given, torch.Tensor) else max(float(given), 1.0)
