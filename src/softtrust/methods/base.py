"""The method interface: :class:`LossContext`, :class:`Method`, the registry :data:`METHODS`.

A method states its per-token (or per-sequence) loss ℓ **once**, in :meth:`Method.loss`,
as a plain differentiable expression of a :class:`LossContext`. It knows nothing of
masks' reductions, corrections, KL or normalisers: :class:`softtrust.PolicyLoss`
composes those around it.

Rules a method's formula follows, so that ``torch.compile(fullgraph=True)`` works and
no call waits for the device: no ``.item()``, no Python ``if`` on a tensor's value
(select with ``torch.where``), no boolean indexing (shapes stay static).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from softtrust.ratios import SEQUENCE_LEVELS

__all__ = [
    "METHODS",
    "DetachedWeightMethod",
    "LossContext",
    "Method",
    "MethodOutput",
    "make_method",
    "register_method",
]


class LossContext(NamedTuple):
    """Everything a method may read, in one object (all float tensors share one dtype).

    Every entry at a masked position is finite, so a method never needs the mask to guard
    a value: the aggregation masks the per-token loss. ``token_log_ratio`` and per-token
    ``advantages`` are exactly 0 there; ``logprobs`` and ``old_logprobs`` may hold any
    finite value there, so a method that reduces over tokens itself weights by ``mask``
    (GMPO reduces ``token_log_ratio``).

    Attributes:
        logprobs: [B, T] log π_θ of the sampled tokens, differentiable.
        old_logprobs: [B, T] log π_old (the behaviour policy), detached.
        (for both: a reduction over tokens must weight by ``mask``)
        log_ratio: [B, T] (token level) or [B, 1] (sequence levels): the clamped log-ratio
            at the loss's level, differentiable; for methods with ``folds_correction``,
            the behaviour correction's log-weight is already added.
        token_log_ratio: [B, T] clamped token log-ratio ``logp - old``, differentiable.
        advantages: [B, 1] (one per sequence) or [B, T], detached.
        mask: [B, T] 0/1 float completion mask.
        num_active: [B, 1] active tokens per row.
        num_tokens: global active-token count (over every micro-batch and rank), >= 1: a
            number or a 0-dim tensor.
        num_sequences: global sequence count, >= 1: a number or a 0-dim tensor.
        level: the ratio level, one of :data:`~softtrust.ratios.LEVELS`.
        state: batch-wide quantities from :meth:`Method.batch_state`, computed over the
            whole (global) batch; empty for methods that need none.
        generator: the random generator for methods that draw (None: torch's default).
        with_stats: whether the caller wants ``MethodOutput.stats`` (metrics).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    log_ratio: torch.Tensor
    token_log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    num_active: torch.Tensor
    num_tokens: float | torch.Tensor
    num_sequences: float | torch.Tensor
    level: str
    state: dict[str, torch.Tensor]
    generator: torch.Generator | None = None
    with_stats: bool = True

    @property
    def ratio(self) -> torch.Tensor:
        """``exp(log_ratio)``, finite (the log-ratio is clamped), differentiable."""
        return torch.exp(self.log_ratio)


class MethodOutput(NamedTuple):
    """A method's per-token loss (broadcastable to [B, T]) and its diagnostics.

    ``stats`` maps a metric name to a tensor broadcastable to [B, T]: bool tensors
    are reported as the fraction of active positions where they hold (e.g. clip
    fractions), float tensors as their mean/min/max over active positions.
    """

    loss: torch.Tensor
    stats: dict[str, torch.Tensor] = {}  # noqa: RUF012 - a NamedTuple default, never mutated


METHODS: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: add ``cls`` to :data:`METHODS` under ``cls.name``."""
    if cls.name in METHODS:
        raise ValueError(f"a method named {cls.name!r} is already registered ({METHODS[cls.name].__name__})")
    METHODS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Method:
    """Base class: the contract every method follows."""

    name: ClassVar[str] = "method"
    #: level used when PolicyLoss(level=None)
    default_level: ClassVar[str] = "token"
    #: levels the method accepts; others are refused at construction with a reason
    #: (``sequence-mean-token`` only where the ratio sits in the graph: it changes only the gradient)
    levels: ClassVar[tuple[str, ...]] = ("token", *SEQUENCE_LEVELS)
    #: why the other levels are refused (shown in the error)
    level_note: ClassVar[str] = ""
    #: True: a behaviour correction's log-weight is added to the log-ratio (VESPO);
    #: False: the correction weight multiplies the per-token loss
    folds_correction: ClassVar[bool] = False
    #: whether the method may run under the decoupled objective (the trainer's ``--proximal``),
    #: which passes π_prox as ``old_logprobs`` and the behaviour weight π_prox/μ as a correction;
    #: read by the training config, which refuses the pair with ``proximal_note``
    supports_proximal: ClassVar[bool] = True
    #: why the decoupled objective is refused (shown in the error)
    proximal_note: ClassVar[str] = ""
    #: how a per-token behaviour weight w_t handed over by an engine (verl's
    #: ``rollout_is_weights``) enters the loss: ``"per-token"``, w_t multiplies ℓ_t (softtrust's
    #: own TIS/MIS do this); ``"geometric-mean"``, ``exp(mean_t log w_t)`` multiplies the
    #: sequence's ℓ (a method whose ratio is a geometric mean of token ratios: GMPO, as verl's
    #: ``geo_mean``). Read by :mod:`softtrust.integrations.verl`; methods with
    #: ``folds_correction`` fold the weights into their ratio instead
    engine_token_weights: ClassVar[str] = "per-token"

    def loss(self, ctx: LossContext) -> MethodOutput:  # pragma: no cover - interface
        """The per-token loss ℓ (broadcastable to [B, T]) and diagnostics: the method's one formula."""
        raise NotImplementedError

    def batch_state(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        """Quantities a method needs from the whole batch (a selection threshold, a mean), detached.

        :class:`~softtrust.PolicyLoss` computes them from the batch it is given, which is
        exact when that is the whole batch. A trainer that splits a batch into
        micro-batches (or ranks) computes them once over the global batch with
        :meth:`PolicyLoss.batch_state` and passes ``state=`` to every micro-batch call,
        so the micro-batch losses add up to the whole-batch loss. Default: none.
        """
        return {}


@dataclass(frozen=True)
class DetachedWeightMethod(Method):
    """REINFORCE-style methods: ``ℓ = -sg(w)·A·logp`` with a detached weight w.

    The gradient is ``-w·A·∇logp``: no ratio enters the graph. Subclasses define only
    :meth:`weight`, computed from a detached context.
    """

    def weight(self, ctx: LossContext) -> MethodOutput:  # pragma: no cover - interface
        """The weight w (broadcastable to [B, T]; gradients are cut) and its diagnostics."""
        raise NotImplementedError

    def loss(self, ctx: LossContext) -> MethodOutput:
        weight, stats = self.weight(ctx)  # PolicyLoss computes the ratio without a graph for these methods
        if weight.requires_grad:  # a weight built from logprobs (DPPO's p): cut its gradient
            weight = weight.detach()
        return MethodOutput(
            -(weight * ctx.advantages) * ctx.logprobs, stats
        )  # [B, T]; the [B, 1] factor first


def token_level_note(name: str, reason: str) -> str:
    """The ``level_note`` of a method defined at the ``token`` level only: one text for all of them.

    >>> token_level_note("DRO", "penalises each token's log-ratio")
    "DRO penalises each token's log-ratio, so it is defined at the 'token' level only"
    """
    return f"{name} {reason}, so it is defined at the 'token' level only"


def choose(
    condition: torch.Tensor,
    if_true: float | torch.Tensor,
    if_false: float | torch.Tensor,
    like: torch.Tensor,
) -> torch.Tensor:
    """``where(condition, if_true, if_false)`` for Python numbers (or 0-dim tensors), in ``like``'s dtype.

    (``torch.where`` with two Python scalars gives the default dtype: in float64 math a float32
    1.05 would lose its digits, so a Python first value is built in ``like``'s dtype then.)
    """
    if like.dtype == torch.get_default_dtype() or isinstance(if_true, torch.Tensor):
        return torch.where(condition, if_true, if_false)  # one op: the common float32 case
    return torch.where(condition, torch.full((), if_true, dtype=like.dtype, device=like.device), if_false)


def make_method(method: str | Method, **params: object) -> Method:
    """A method instance from a registry name (plus parameters) or an instance (plus overrides).

    >>> make_method("sapo", tau_neg=1.1)
    SAPO(tau_pos=1.0, tau_neg=1.1)
    """
    if isinstance(method, Method):
        if not params:
            return method
        cls = type(method)
        current = {f.name: getattr(method, f.name) for f in dataclasses.fields(cls)}
        method_cls, params = cls, {**current, **params}
    elif isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)} or a Method instance, got {method!r}")
        method_cls = METHODS[method]
    else:
        raise ValueError(f"method must be a registry name or a Method instance, got {type(method).__name__}")
    fields = {f.name for f in dataclasses.fields(method_cls)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for method {method_cls.name!r}; it takes {sorted(fields) or 'none'}"
        )
    return method_cls(**params)
