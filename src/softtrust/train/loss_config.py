"""The loss a ``softtrust train`` config describes: method, level, aggregation, KL, and the
``--correction`` spec (with the decoupled objective's behaviour weight under ``--proximal``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .values import parse_key_values

if TYPE_CHECKING:
    from .config import TrainConfig

# --correction names -> softtrust classes, and the kind each is (at most one of each kind per run)
CORRECTIONS = {
    "tis": ("TIS", "is"),
    "mis": ("MIS", "is"),
    "opsm": ("OPSM", "opsm"),
    "reject": ("Reject", "reject"),
}


def build_correction(spec: str | None):
    """The corrections a ``--correction`` spec names, for ``softtrust.PolicyLoss(correction=...)``.

    ``'name:k=v,...'`` is one correction (``tis``, ``mis``, ``opsm``, ``reject`` ->
    ``softtrust.TIS``, ``MIS``, ``OPSM``, ``Reject``); specs joined by ``+`` combine them,
    at most one of each kind (one IS correction, one OPSM, one Reject), e.g.
    ``'tis:cap=2+reject:divergence=k3,high=0.01'``. Values are YAML scalars; ``none`` (or
    ``null``) is Python ``None`` (``reject:low=none,high=2``: no lower bound). Returns None,
    one correction, or a list of them. Every error is a ``ValueError`` naming ``correction``.
    """
    if spec is None:
        return None
    import softtrust as st

    corrections, kinds = [], {}
    for part in (piece.strip() for piece in spec.split("+")):
        name, _, params = part.partition(":")
        if name not in CORRECTIONS:
            raise ValueError(
                f"correction: unknown correction {name!r} in {spec!r}; choose one of {sorted(CORRECTIONS)} "
                "(join several with '+')"
            )
        class_name, kind = CORRECTIONS[name]
        if kind in kinds:
            raise ValueError(
                f"correction: {spec!r} holds two {'IS corrections' if kind == 'is' else name} "
                f"({kinds[kind]!r} and {name!r}); give at most one IS correction (tis or mis), one opsm "
                "and one reject"
            )
        kinds[kind] = name
        values = parse_key_values(params, "correction")
        values = {k: None if isinstance(v, str) and v.lower() == "none" else v for k, v in values.items()}
        try:
            corrections.append(getattr(st, class_name)(**values))
        except (TypeError, ValueError) as error:
            raise ValueError(f"correction: {part!r}: {error}") from error
    return corrections[0] if len(corrections) == 1 else corrections


def build_method_loss(config: TrainConfig):
    """The ``softtrust.PolicyLoss`` the config describes (with ``--entropy-coef`` and
    ``--entropy-quantile``: the learner then passes the policy's entropy)."""
    import softtrust as st

    kl = st.KL(coef=config.kl_coef, estimator=config.kl_estimator) if config.kl_coef > 0 else None
    correction = build_correction(config.correction)
    if config.proximal != "none":
        correction = with_behaviour_weight(correction)
    try:
        return st.PolicyLoss(
            config.method,
            level=config.level,
            correction=correction,
            aggregation=config.aggregation,
            kl=kl,
            # T_max of seq-mean-token-sum-norm: the configured maximum, so that ranks and
            # mini-batches with different padded lengths share one normaliser
            max_completion_length=config.effective_max_new_tokens,
            entropy_coef=config.entropy_coef,
            entropy_quantile=config.entropy_quantile,
            **config.method_params,
        )
    except (TypeError, ValueError) as error:
        if str(error).split(":")[0] in {"method", "level", "correction", "aggregation", "kl"}:
            raise
        raise ValueError(
            f"method_params: {config.method} rejects {config.method_params} ({error})"
        ) from error


def with_behaviour_weight(correction):
    """The corrections of the decoupled objective: ``correction`` plus an uncapped token TIS
    (the weight π_prox/μ), unless it already holds an IS correction (TIS or MIS), which then
    weighs π_prox/μ itself (a capped or masked behaviour weight, AReaL's
    ``behave_imp_weight_cap``). "Uncapped": ``TIS(cap=e^20)``; every log-ratio is clamped at
    ±20 (``softtrust.ratios.DEFAULT_LOG_RATIO_CLAMP``), so ``min(ρ, e^20) = ρ`` exactly."""
    import softtrust as st
    from softtrust.ratios import DEFAULT_LOG_RATIO_CLAMP

    items = [] if correction is None else list(correction) if isinstance(correction, list) else [correction]
    if any(isinstance(item, st.corrections.ImportanceCorrection) for item in items):
        return correction
    return [st.TIS(cap=math.exp(DEFAULT_LOG_RATIO_CLAMP), level="token"), *items]


def build_kl_controller(config: TrainConfig):
    """The adaptive KL controller of ``--kl-target`` (``softtrust.AdaptiveKLController``), or None."""
    import softtrust as st

    if config.kl_target is None:
        return None
    return st.AdaptiveKLController(coef=config.kl_coef, target=config.kl_target, horizon=config.kl_horizon)
