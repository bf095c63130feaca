"""softtrust's methods as verl policy losses: ``loss_mode=softtrust.<method>``, every method.

verl (0.9.1) picks its policy loss by name from ``verl.trainer.ppo.core_algos``'s
registry (``actor_rollout_ref.actor.policy_loss.loss_mode``) and, on ``import verl``,
loads every entry point in the group ``verl.plugins``. softtrust's entry point is this
module: importing it registers one loss per entry of :data:`softtrust.METHODS`, named
``softtrust.<name>`` (``softtrust.vespo``, ``softtrust.clip``, ...), so every Ray worker
that imports verl has them. Each registered function has verl's keyword signature and
returns ``(loss, metrics)``; inside it is a :class:`~softtrust.PolicyLoss`.

What verl hands the loss, and where it goes:

| verl                                   | softtrust                                                  |
| -------------------------------------- | ---------------------------------------------------------- |
| ``log_prob``, ``old_log_prob``         | ``logprobs``, ``old_logprobs``                             |
| ``advantages`` [B, T], ``response_mask`` | ``advantages``, ``mask``                                 |
| ``loss_agg_mode``                      | ``aggregation`` (the caller's choice, for every method)   |
| ``global_batch_info``                  | ``num_tokens = batch_num_tokens``, ``num_sequences = global_batch_size``, ``max_completion_length = loss_scale_factor``; the loss times ``dp_size`` |
| ``rollout_is_weights``                 | a behaviour-correction weight, as the method's ``engine_token_weights`` says: multiplies the per-token loss, or their geometric mean per sequence multiplies the sequence's loss (GMPO, as verl's ``geo_mean``); folded into W by a method with ``folds_correction`` (VESPO) |

Parameters, lowest precedence first: the method's defaults; verl's own fields, read as
verl reads them for the matching built-in loss (:data:`VERL_FIELDS`); the dict
``policy_loss.softtrust`` (any method parameter, plus ``level``, ``log_ratio_clamp``
and ``rollout_is``). verl's ``PolicyLossConfig`` refuses keys it does not know, so that
dict needs the config class :class:`SoftTrustPolicyLossConfig` (a ``PolicyLossConfig``
with one more field), chosen with Hydra's ``_target_``; see docs/verl.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from softtrust.corrections import MIS
from softtrust.loss import PolicyLoss
from softtrust.methods import METHODS
from softtrust.ratios import DEFAULT_LOG_RATIO_CLAMP

SUPPORTED_VERL_VERSIONS = ("0.9.1",)
_logger = logging.getLogger(__name__)


def _version_message(version: str) -> str:
    return (
        f"softtrust's verl losses support verl {', '.join(SUPPORTED_VERL_VERSIONS)}, but verl {version} is "
        f"installed: the softtrust.* loss modes refuse to run; install verl=={SUPPORTED_VERL_VERSIONS[-1]}"
    )


def _warn(message: str) -> None:
    """Say it twice (a warning and a log line): verl logs a plugin's own errors at debug level only."""
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    _logger.warning(message)


try:
    import verl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "softtrust.integrations.verl needs verl (and what it imports: ray, tensordict, hydra-core, "
        'codetiming); install verl 0.9.1 with `pip install -e ".[verl]"` in the softtrust clone (docs/verl.md)'
    ) from error
try:
    from verl.trainer.ppo import core_algos
    from verl.workers.config import PolicyLossConfig
except ImportError as error:  # pragma: no cover - a verl whose layout differs from 0.9.1's
    _warn(f"{_version_message(getattr(verl, '__version__', 'unknown'))} ({error})")
    raise

PREFIX = "softtrust."
#: keys of ``policy_loss.softtrust`` that are not method parameters
OPTIONS = ("level", "log_ratio_clamp", "rollout_is")
ROLLOUT_IS_LEVELS = ("token", "sequence")
#: verl's ``geo_mean`` takes ``exp(mean_t log(w_t + 1e-10))`` for a method whose
#: ``engine_token_weights`` is ``"geometric-mean"``: a zero token weight only shrinks the mean
GEO_MEAN_EPS = 1e-10

__all__ = [
    "OPTIONS",
    "PREFIX",
    "SUPPORTED_VERL_VERSIONS",
    "VERL_FIELDS",
    "VERL_NAMES",
    "SoftTrustPolicyLossConfig",
    "in_verl_terms",
    "loss_mode",
    "method_settings",
    "policy_loss_fn",
    "register",
]


@dataclasses.dataclass
class SoftTrustPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``softtrust``: softtrust settings for ``softtrust.*`` loss modes.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=softtrust.integrations.verl.
    SoftTrustPolicyLossConfig``, then set ``+actor_rollout_ref.actor.policy_loss.softtrust.<key>=...``.
    """

    softtrust: dict = dataclasses.field(default_factory=dict)


def _get(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` for verl's dataclass configs, DictConfigs and plain dicts alike."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _clip_low(config: Any) -> float:
    """verl's lower clip: ``clip_ratio_low``, else ``clip_ratio``."""
    low = _get(config, "clip_ratio_low")
    return _get(config, "clip_ratio") if low is None else low


def _clip_high(config: Any) -> float:
    """verl's upper clip: ``clip_ratio_high``, else ``clip_ratio``."""
    high = _get(config, "clip_ratio_high")
    return _get(config, "clip_ratio") if high is None else high


def _symmetric_clip(config: Any) -> float:
    """GMPO's one ε from verl's two ``geo_mean`` bounds, which must then be equal."""
    low, high = _clip_low(config), _clip_high(config)
    if low != high:
        raise ValueError(
            f"softtrust.gmpo has one log-space bound ε, but clip_ratio_low={low!r} != clip_ratio_high={high!r} "
            "(verl's geo_mean takes two); set them equal, or set policy_loss.softtrust.eps"
        )
    return low


def _actor(name: str) -> Callable[[Any], Any]:
    return lambda config: _get(config, name)


def _policy_loss_field(name: str) -> Callable[[Any], Any]:
    return lambda config: _get(_get(config, "policy_loss"), name)


#: verl field -> softtrust parameter, per method, as verl reads the field for its matching
#: built-in loss (clip: vanilla; gspo; sapo; cispo; gmpo: geo_mean; dppo: dppo_tv/dppo_kl;
#: dro; kl-cov; clip-cov). A getter receives the actor config. Entries for methods not in
#: softtrust.METHODS are ignored; tests check every other entry names real parameters.
VERL_FIELDS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "clip": {"eps_low": _clip_low, "eps_high": _clip_high, "dual_clip": _actor("clip_ratio_c")},
    "gspo": {"eps_low": _clip_low, "eps_high": _clip_high},
    # verl clips CISPO's weight to [1 - ε_low, 1 + ε_high]; softtrust's bounds are ratio values
    "cispo": {"ratio_low": lambda c: 1.0 - _clip_low(c), "ratio_high": lambda c: 1.0 + _clip_high(c)},
    "sapo": {"tau_pos": _actor("tau_pos"), "tau_neg": _actor("tau_neg")},
    "gmpo": {"eps": _symmetric_clip},
    # verl's DPPO reads clip_ratio_* as the divergence thresholds δ and clip_ratio_c as the ratio cap
    "dppo": {"delta_low": _clip_low, "delta_high": _clip_high, "cap": _actor("clip_ratio_c")},
    "dro": {"beta": _policy_loss_field("dro_beta")},
    "kl-cov": {"ratio": _policy_loss_field("kl_cov_ratio"), "coef": _policy_loss_field("ppo_kl_coef")},
    "clip-cov": {
        "ratio": _policy_loss_field("clip_cov_ratio"),
        "cov_low": _policy_loss_field("clip_cov_lb"),
        "cov_high": _policy_loss_field("clip_cov_ub"),
        "eps_low": _clip_low,
        "eps_high": _clip_high,
    },
}


def loss_mode(method: str) -> str:
    """The verl ``loss_mode`` of a softtrust method: ``softtrust.<name>``."""
    return PREFIX + method


def _user_settings(config: Any) -> dict[str, Any]:
    """The ``policy_loss.softtrust`` dict (empty when absent), as a plain dict."""
    settings = _get(_get(config, "policy_loss"), "softtrust")
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ValueError(
            f"policy_loss.softtrust must be a mapping of settings, got {type(settings).__name__}"
        )
    return {str(key): value for key, value in settings.items()}


def method_settings(method: str, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(method parameters, options)`` for ``softtrust.<method>`` from verl's actor config.

    Method parameters: verl's fields mapped by :data:`VERL_FIELDS` (unset ones keep
    softtrust's defaults), overridden by the ``policy_loss.softtrust`` dict; options: its
    keys in :data:`OPTIONS`.

    Raises:
        ValueError: an unknown method, a ``policy_loss.softtrust`` that is not a mapping,
            or asymmetric verl bounds for GMPO (see :func:`_symmetric_clip`). Unknown
            parameters are refused when the PolicyLoss is built, naming them.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    user = _user_settings(config)
    options = {key: user.pop(key) for key in OPTIONS if key in user}
    params = {
        name: getter(config) for name, getter in VERL_FIELDS.get(method, {}).items() if name not in user
    }
    # a verl field left unset (None, e.g. dro_beta) keeps softtrust's default
    params = {name: value for name, value in params.items() if value is not None}
    return {**params, **user}, options


def _rollout_is_level(config: Any, options: dict[str, Any]) -> str:
    """The level of verl's ``rollout_is_weights``: token or sequence (needed by methods that fold them).

    Read from ``policy_loss.softtrust.rollout_is``, else from verl's own
    ``policy_loss.rollout_correction.rollout_is`` when that was set (verl copies
    ``algorithm.rollout_correction`` there in bypass mode; otherwise interpolate it, see
    docs/verl.md). verl's untouched default cannot be told from a real setting, so it is
    refused rather than guessed.
    """
    level = options.get("rollout_is")
    if level is None:
        correction = _get(_get(config, "policy_loss"), "rollout_correction")
        untouched = (
            type(correction).__name__ == "RolloutCorrectionConfig" and correction == type(correction)()
        )
        if correction is not None and not untouched:
            level = _get(correction, "rollout_is")
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            "rollout_is_weights arrived, and this method folds them into its sequence weight, so it needs their "
            f"level ('token' or 'sequence'), got {level!r}: set "
            "+actor_rollout_ref.actor.policy_loss.softtrust.rollout_is=${algorithm.rollout_correction.rollout_is}"
        )
    return level


def _weights_as_rollout_logprobs(
    old: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, level: str, clamp: float, eps: float = 0.0
) -> torch.Tensor:
    """Sampler log-probs whose correction ratio ``exp(old - rollout)`` is verl's weight.

    Token level: ``log ρ_t = log w_t``. Sequence level (verl repeats ``w_i`` on every active
    token): ``log w_i`` spread evenly over the row, so the row sums to ``log w_i`` once.
    A weight of 0 becomes ``log ρ = -clamp``, which the correction turns back into 0;
    with ``eps`` > 0 the weights are read as ``w + eps`` first (verl's geometric mean).
    """
    weights = weights.detach().to(old.dtype) + eps
    mask = mask.to(old.dtype)
    positive = weights > 0
    log_w = torch.where(positive, torch.log(torch.where(positive, weights, 1.0)), -clamp)  # [B, T]
    if level == "sequence":
        count = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
        log_w = (log_w * mask).sum(dim=-1, keepdim=True) / count.square()  # [B, 1]: log w_i / n_i
    return old.detach() - log_w * mask  # [B, T]


def _check_rollout_is_weights(weights: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming ``rollout_is_weights`` unless every weight at an active
    (``response_mask``) position is finite and >= 0 (0 is verl's rejection). Without this a NaN
    or negative weight became 0 (its row silently dropped) and an inf one an error about
    ``rollout_logprobs``, which a verl user never passes. Reads values on the host (one sync;
    the metrics that follow read every value anyway)."""
    active = mask.bool()
    bad = active & ~(torch.isfinite(weights) & (weights >= 0))  # NaN fails both tests
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"rollout_is_weights must be finite and >= 0 at active (response_mask) positions, got "
            f"{weights[where].item()!r} at index {where} ({int(bad.sum())} such position(s)); check "
            "algorithm.rollout_correction and the rollout log-probs it is computed from"
        )


#: softtrust's argument names -> verl's, for the messages of errors raised inside the loss
VERL_NAMES = {
    "old_logprobs": "old_log_prob",
    "rollout_logprobs": "rollout_is_weights",
    "logprobs": "log_prob",
    "mask": "response_mask",
    "num_tokens": "global_batch_info.batch_num_tokens",
    "num_sequences": "global_batch_info.global_batch_size",
}
_SOFTTRUST_NAME = re.compile(r"\b(" + "|".join(VERL_NAMES) + r")\b")


def in_verl_terms(message: str) -> str:
    """``message`` with softtrust's argument names replaced by verl's (``logprobs`` ->
    ``log_prob``, ``mask`` -> ``response_mask``, ...): a verl error names what verl passed."""
    return _SOFTTRUST_NAME.sub(lambda match: VERL_NAMES[match.group(1)], message)


def _correction(level: str, clamp: float) -> MIS:
    """ρ·1[ρ >= low]: verl's weight itself; weights below ``low`` (and verl's zeros) exactly 0.

    ``low = max(1e-8, e^-clamp)`` (just above): a zero arrives as ``log ρ = -clamp``, and a
    weight below ``e^-clamp`` would be clamped up to it, so both become 0 rather than
    ``e^-clamp``. ``ρ <= e^clamp`` always (log-ratios are clamped): the upper bound never acts.
    """
    low = max(1e-8, math.exp(-clamp) * (1.0 + 1e-6))
    return MIS(low=low, high=math.exp(clamp + 1.0), level=level)


_CACHE: dict[tuple, PolicyLoss] = {}


def _clamp(options: dict[str, Any]) -> float:
    return float(options.get("log_ratio_clamp", DEFAULT_LOG_RATIO_CLAMP))


def _build(
    method: str, params: dict, options: dict, aggregation: str, horizon, correction_level
) -> PolicyLoss:
    """One PolicyLoss per distinct setting (construction checks every argument; kept, not rebuilt per call)."""
    clamp = _clamp(options)
    key = (
        method,
        repr(sorted(params.items())),
        options.get("level"),
        clamp,
        aggregation,
        horizon,
        correction_level,
    )
    if key not in _CACHE:
        _CACHE[key] = PolicyLoss(
            method,
            level=_level(method, options),
            correction=None if correction_level is None else _correction(correction_level, clamp),
            aggregation=aggregation,
            log_ratio_clamp=clamp,
            max_completion_length=horizon,
            **params,
        )
    return _CACHE[key]


def _level(method: str, options: dict) -> str | None:
    """The ratio level: the user's ``softtrust.level``, else verl's reading of the method.

    verl's sequence-level ratio is GSPO-token (``sg(s_i)·π_t/sg(π_t)``), so a method whose
    own level is ``sequence-mean`` runs at ``sequence-mean-token`` when it accepts it: the
    same value and gradient as ``sequence-mean`` unless a per-token factor (token-level IS
    weights) multiplies the loss, where token t then carries its own weight, as in verl.
    """
    if options.get("level") is not None:
        return options["level"]
    cls = METHODS[method]
    if cls.default_level == "sequence-mean" and "sequence-mean-token" in cls.levels:
        return "sequence-mean-token"
    return None


def _metric_value(value: Any) -> float:
    """A metric as a float: softtrust returns floats or 0-dim tensors; verl's Metric takes numbers."""
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def policy_loss_fn(method: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """verl policy-loss function for softtrust method ``method`` (what ``softtrust.<method>`` is registered as).

    The returned function computes, for one micro-batch on one rank,
    ``L = dp_size · PolicyLoss(...)(log_prob, old_log_prob, A, m, num_tokens=N, num_sequences=G)``
    with ``N``, ``G`` and ``dp_size`` from ``config.global_batch_info``: the form verl's
    ``agg_loss`` has (FSDP averages gradients over ranks, hence ``dp_size``), so that the
    losses of all micro-batches and ranks add up to the loss of the whole mini-batch. Without
    that information (``dp_size`` 1), ``N`` is the micro-batch's token count and ``G`` its
    number of sequences with an active token, as in verl.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")

    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"{loss_mode(method)} needs verl's actor config (config=None)")
        params, options = method_settings(method, config)
        info = {k: v for k, v in dict(_get(config, "global_batch_info") or {}).items() if v is not None}
        dp_size = int(info.get("dp_size", 1))
        num_tokens, num_sequences = info.get("batch_num_tokens"), info.get("global_batch_size")
        if dp_size > 1 and (num_tokens is None or num_sequences is None):
            raise ValueError(
                f"global_batch_info has dp_size={dp_size} but batch_num_tokens={num_tokens!r}, "
                f"global_batch_size={num_sequences!r}: both are needed across data-parallel ranks"
            )
        if num_sequences is None and loss_agg_mode.startswith("seq-mean"):
            active = int((response_mask.sum(dim=-1) > 0).sum())  # verl counts sequences with an active token
            num_sequences = active if active > 0 else None
        rollout, level = None, None
        geometric_mean = METHODS[method].engine_token_weights == "geometric-mean"
        if rollout_is_weights is not None:  # folded into W (VESPO) at their level, else a factor on ℓ
            if METHODS[method].folds_correction:
                level = _rollout_is_level(config, options)
            else:  # per token, or their geometric mean per sequence (a sequence-level weight)
                level = "sequence" if geometric_mean else "token"
        loss_fn = _build(method, params, options, loss_agg_mode, info.get("loss_scale_factor"), level)
        if rollout_is_weights is not None:
            _check_rollout_is_weights(rollout_is_weights, response_mask)
            rollout = _weights_as_rollout_logprobs(
                old_log_prob,
                rollout_is_weights,
                response_mask,
                level,
                _clamp(options),
                GEO_MEAN_EPS if geometric_mean else 0.0,
            )
        try:
            out = loss_fn(
                log_prob,
                old_log_prob,
                advantages,
                response_mask,
                rollout_logprobs=rollout,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
            )
        except ValueError as error:  # softtrust's argument names -> the ones the verl user passed
            raise ValueError(f"{loss_mode(method)}: {in_verl_terms(str(error))}") from None
        metrics = {}
        for name, value in out.metrics.items():
            number = _metric_value(value)
            if not math.isnan(number):  # NaN: nothing to measure in this micro-batch
                metrics[f"actor/softtrust/{name}"] = number
        return out.loss * dp_size, metrics

    compute_policy_loss.__name__ = f"softtrust_{method.replace('-', '_')}"
    compute_policy_loss.__qualname__ = compute_policy_loss.__name__
    compute_policy_loss.__doc__ = (
        f"verl loss_mode {loss_mode(method)!r}: see softtrust.integrations.verl.policy_loss_fn."
    )
    return compute_policy_loss


def _refuse(message: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    return refuse


def register() -> list[str]:
    """Register ``softtrust.<name>`` for every method in :data:`softtrust.METHODS`; return the names.

    All functions are built before the registry is touched, then added in one update, so
    an error leaves nothing half-registered. With an unsupported verl version (or if
    building fails) every name is registered to a function that raises a ``RuntimeError``
    saying why (naming both versions), and a warning says so at load: verl logs a plugin's
    own errors only at debug level.
    Idempotent: registering again replaces the same names.
    """
    version = getattr(verl, "__version__", "unknown")
    message = None if version in SUPPORTED_VERL_VERSIONS else _version_message(version)
    if message is None:
        try:
            functions = {loss_mode(name): policy_loss_fn(name) for name in METHODS}
        except Exception as error:  # verl would swallow it at debug level: say it, refuse at use
            message = f"softtrust's verl losses could not be built ({error!r}): the softtrust.* loss modes refuse to run"
    if message is not None:
        _warn(message)
        functions = {loss_mode(name): _refuse(message) for name in METHODS}
    core_algos.POLICY_LOSS_REGISTRY.update(functions)
    return sorted(functions)


REGISTERED = register()
