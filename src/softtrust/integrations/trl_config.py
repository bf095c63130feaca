"""Map TRL's ``GRPOConfig`` loss settings onto softtrust objects (no TRL import needed).

TRL's ``loss_type`` mixes three choices; softtrust keeps them apart:

| TRL ``loss_type`` | method                    | aggregation (softtrust)       | TRL normaliser per micro-batch |
| ----------------- | ------------------------- | ----------------------------- | ------------------------------ |
| ``grpo``          | ``Clip``                  | ``seq-mean-token-mean``       | ``B_local · GA``               |
| ``bnpo``          | ``Clip``                  | ``token-mean`` (local count)  | ``Σm_local · GA``              |
| ``dr_grpo``       | ``Clip``                  | ``seq-mean-token-sum-norm``   | ``B_local · GA · T_max``       |
| ``dapo``          | ``Clip``                  | ``token-mean`` (global count) | ``num_items · GA / (spg · P)`` |
| ``cispo``         | ``CISPO(ratio_high=ε_high)`` | ``token-mean`` (global)    | as dapo                        |
| ``sapo``          | ``SAPO``                  | ``seq-mean-token-mean``       | as grpo                        |
| ``luspo``         | ``Clip``                  | ``seq-mean-token-sum``        | ``B_local · GA``               |
| ``vespo``         | ``VESPO`` (sequence-sum)  | ``token-mean`` (global)       | as dapo                        |

``importance_sampling_level="sequence"`` maps to ``level="sequence-mean"`` (TRL's
sequence ratio is the geometric mean); VESPO always uses its own sequence-sum.
``epsilon_high=None`` means ``epsilon`` (only ``None``: ``epsilon_high=0.0`` is 0, as in TRL). TRL's ``cispo`` reads ``epsilon_high`` as the
raw cap on the ratio. The vLLM importance-sampling correction maps to ``TIS``
(``*_truncate``) or ``MIS`` (``*_mask``) at token or sequence level;
``off_policy_mask_threshold`` to ``OPSM``; ``beta`` to ``KL(coef=beta, "k3")``;
``top_entropy_quantile`` to ``entropy_quantile`` and ``entropy_coef`` to TRL's own bonus
(:func:`trl_entropy_terms`).
"""

from __future__ import annotations

from typing import Any

import torch

from softtrust.corrections import MIS, OPSM, TIS
from softtrust.entropy import ENTROPY_THRESHOLD, entropy_threshold, high_entropy_mask
from softtrust.kl import KL
from softtrust.loss import PolicyLoss
from softtrust.methods import CISPO, SAPO, VESPO, Clip

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
_AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
}
_GLOBAL_TOKEN_COUNT = ("dapo", "cispo", "vespo")


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def from_trl_config(config: Any) -> PolicyLoss:
    """The :class:`~softtrust.PolicyLoss` that computes what TRL's ``_compute_loss`` computes.

    Args:
        config: a ``trl.GRPOConfig`` (or any object with its attribute names).

    Returns:
        A PolicyLoss. Its normalisers per micro-batch come from :func:`trl_normalisers`.
        ``top_entropy_quantile`` becomes ``entropy_quantile`` (the loss then needs
        ``entropy=`` and, for TRL's threshold, ``state=`` from :func:`trl_entropy_terms`);
        TRL's ``entropy_coef`` is not part of it: TRL adds its bonus outside the loss's
        normaliser, and :func:`trl_entropy_terms` computes it as TRL does.

    Raises:
        ValueError: for settings softtrust cannot reproduce exactly, naming the field:
            an unknown ``loss_type``;
            TRL's ``cispo`` with a cap ``epsilon_high < 1`` (it clips on-policy samples);
            ``use_bias_correction_kl`` with a sequence-level ratio and ``beta != 0``;
            a VESPO rollout correction at sequence level (TRL refuses it too);
            ``vllm_importance_sampling_clip_min`` with a ``*_truncate`` mode.
    """
    loss_type = _get(config, "loss_type", "dapo")
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {list(TRL_LOSS_TYPES)}, got {loss_type!r}")
    level_name = _get(config, "importance_sampling_level", "token")
    if level_name not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level_name!r}")
    epsilon = _get(config, "epsilon", 0.2)
    epsilon_high = _get(config, "epsilon_high")
    if epsilon_high is None:  # TRL: `epsilon_high if not None else epsilon` (0.0 is a value, kept)
        epsilon_high = epsilon
    level = "sequence-mean" if level_name == "sequence" else "token"

    if loss_type == "cispo":
        if epsilon_high < 1.0:
            raise ValueError(
                f"epsilon_high={epsilon_high!r} with loss_type='cispo' caps the raw ratio below 1, which clips "
                "on-policy samples; TRL recommends epsilon_high=5.0 (softtrust: CISPO(ratio_high=...))"
            )
        method = CISPO(ratio_high=float(epsilon_high))
    elif loss_type == "sapo":
        method = SAPO(
            tau_pos=_get(config, "sapo_temperature_pos", 1.0),
            tau_neg=_get(config, "sapo_temperature_neg", 1.05),
        )
    elif loss_type == "vespo":
        method = VESPO(
            k_pos=_get(config, "vespo_k_pos", 2.0),
            lambda_pos=_get(config, "vespo_lambda_pos", 3.0),
            k_neg=_get(config, "vespo_k_neg", 3.0),
            lambda_neg=_get(config, "vespo_lambda_neg", 2.0),
        )
        level = "sequence-sum"  # TRL's VESPO always sums the token log-ratios, whatever the level setting
    else:
        method = Clip(eps_low=epsilon, eps_high=epsilon_high, delta=_get(config, "delta"))

    beta = _get(config, "beta", 0.0)
    kl = None
    if beta:
        corrected = bool(_get(config, "use_bias_correction_kl", False))
        if corrected and level_name == "sequence":
            raise ValueError(
                "use_bias_correction_kl=True with importance_sampling_level='sequence' and beta != 0: TRL multiplies "
                "the KL by the sequence ratio; softtrust's importance-corrected KL uses the token ratio"
            )
        kl = KL(coef=float(beta), estimator="k3", importance_corrected=corrected)

    corrections: list = []
    if _get(config, "use_vllm", False) and _get(config, "vllm_importance_sampling_correction", False):
        corrections.append(_vllm_correction(config, loss_type))
    threshold = _get(config, "off_policy_mask_threshold")
    if threshold is not None:
        corrections.append(OPSM(delta=float(threshold)))

    return PolicyLoss(
        method,
        level=level,
        correction=corrections or None,
        aggregation=_AGGREGATION[loss_type],
        kl=kl,
        max_completion_length=_get(config, "max_completion_length") if loss_type == "dr_grpo" else None,
        entropy_quantile=_get(config, "top_entropy_quantile", 1.0),
    )


def _vllm_correction(config: Any, loss_type: str) -> TIS | MIS:
    mode = _get(config, "vllm_importance_sampling_mode", "sequence_mask")
    clip_min = _get(config, "vllm_importance_sampling_clip_min")
    clip_max = _get(config, "vllm_importance_sampling_clip_max", 3.0)
    level, kind = mode.split("_") if isinstance(mode, str) and mode.count("_") == 1 else (None, None)
    if level not in ("token", "sequence") or kind not in ("truncate", "mask"):
        raise ValueError(
            "vllm_importance_sampling_mode must be one of 'token_truncate', 'token_mask', 'sequence_truncate', "
            f"'sequence_mask', got {mode!r}"
        )
    if loss_type == "vespo" and level == "sequence":
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: VESPO folds only token-level corrections")
    if kind == "truncate":
        if clip_min is not None:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={clip_min!r} with a truncate mode (a floor on the IS weight) "
                "has no softtrust equivalent; TIS only caps"
            )
        return TIS(cap=float(clip_max), level=level)
    return MIS(low=float(clip_min or 0.0), high=float(clip_max), level=level)


def trl_normalisers(
    config: Any,
    mask: torch.Tensor,
    num_items_in_batch: float | torch.Tensor | None,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
    train: bool = True,
) -> dict[str, Any]:
    """``num_tokens`` / ``num_sequences`` that make a micro-batch's loss equal TRL's.

    TRL scales each micro-batch loss for gradient accumulation itself (GA = the
    current accumulation steps, ``spg`` = ``steps_per_generation``, P = processes,
    ``num_items_in_batch`` = loss tokens of the whole generation batch over all
    processes). Passing these to :class:`PolicyLoss` reproduces that scaling.

    Args:
        config: the ``GRPOConfig``.
        mask: [B, T] the micro-batch's loss mask.
        num_items_in_batch: TRL's count (needed for dapo, cispo, vespo).
        gradient_accumulation_steps: GA (1 in evaluation).
        num_processes: P.
        train: False in evaluation, where TRL neither accumulates nor splits the batch.
    """
    loss_type = _get(config, "loss_type", "dapo")
    if not train:
        gradient_accumulation_steps = 1
    if loss_type in _GLOBAL_TOKEN_COUNT:
        if num_items_in_batch is None:
            raise ValueError(f"num_items_in_batch is required for loss_type={loss_type!r}, got None")
        steps_per_generation = (
            (_get(config, "steps_per_generation") or gradient_accumulation_steps) if train else 1
        )
        count = torch.as_tensor(num_items_in_batch).clamp(min=1.0) / num_processes
        return {"num_tokens": count * gradient_accumulation_steps / steps_per_generation}
    if loss_type == "bnpo":
        return {"num_tokens": mask.sum().clamp(min=1) * gradient_accumulation_steps}
    return {"num_sequences": mask.shape[0] * gradient_accumulation_steps}


def trl_entropy_terms(
    config: Any,
    policy_loss: PolicyLoss,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    gradient_accumulation_steps: int,
    gathered: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | float]:
    """TRL's two entropy settings for one ``_compute_loss`` call: ``(state, bonus)``.

    * ``top_entropy_quantile = ρ < 1`` (the PolicyLoss's ``entropy_quantile``): TRL's threshold is
      the ``(1 - ρ)``-quantile (``torch.quantile``'s linear rule) of this call's active
      entropies gathered over processes, per micro-batch, not per mini-batch as
      ``softtrust train`` takes it. ``state = {"entropy/threshold": q}`` for
      ``policy_loss(..., entropy=entropies, state=state)``; None when ρ = 1.
    * ``entropy_coef = c``: TRL subtracts ``bonus = c · Σ_t H_t m'_t / max(Σ_t m'_t, 1) / GA``
      from the loss, ``m'`` the mask times the kept tokens: a token mean over the kept
      tokens of this micro-batch, whatever the loss type's normaliser (the PolicyLoss's own
      ``entropy_coef`` would aggregate it as the policy loss). 0 when ``c = 0``.

    Args:
        config: the ``GRPOConfig`` (reads ``entropy_coef``).
        policy_loss: the loss (its ``entropy_quantile`` is TRL's ``top_entropy_quantile``).
        entropies: [B, T] per-token entropies of this micro-batch (differentiable).
        mask: [B, T] the loss mask.
        gradient_accumulation_steps: GA (1 in evaluation).
        gathered: every process's active entropies, 1-D (default: this call's own).
    """
    active = mask.bool()  # [B, T]
    state, keep = None, active
    if policy_loss.selects_by_entropy:
        # in float32, as TRL takes its quantile (a float64 entropy at the threshold compares as in TRL)
        pool = (entropies.detach()[active] if gathered is None else gathered).float()  # [n]
        threshold = entropy_threshold(
            pool, torch.ones_like(pool, dtype=torch.bool), policy_loss.entropy_quantile
        )
        state = {ENTROPY_THRESHOLD: threshold}
        keep = high_entropy_mask(entropies.float(), active, threshold)  # [B, T]; float32 as TRL compares
    coef = _get(config, "entropy_coef", 0.0)
    if not coef:
        return state, 0.0
    kept = keep.to(
        torch.promote_types(entropies.dtype, torch.float32)
    )  # a float32 sum, as TRL's (mask.float())
    mean = (entropies * kept).sum() / kept.sum().clamp(min=1.0)
    return state, coef * mean / gradient_accumulation_steps
