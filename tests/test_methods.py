"""Closed-form values and analytic gradients of every method (METHODS.md)."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

import softtrust as st

from budgets import F64_GRADIENT, F64_PARITY
from helpers import loss_and_grad, method_level_pairs, random_batch, single_token

RATIOS = [0.3, 0.7, 0.95, 1.0, 1.1, 1.5, 4.0]
ADVANTAGES = [1.3, -0.7]


def sech2(x: float) -> float:
    return 1.0 / math.cosh(x) ** 2


# --- every method is the plain policy gradient on-policy -------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("aggregation", st.AGGREGATIONS)
@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_every_method_gradient_equals_policy_gradient_at_ratio_one(method, level, aggregation):
    logprobs, _, advantages, mask = random_batch(seed=3)
    reference = st.PolicyLoss("reinforce", aggregation=aggregation)
    _, expected, _ = loss_and_grad(reference, logprobs, logprobs, advantages, mask)
    loss_fn = st.PolicyLoss(method, level=level, aggregation=aggregation)
    _, grad, _ = loss_and_grad(loss_fn, logprobs, logprobs, advantages, mask)
    scale = 1.0 - st.PSPO().alpha if method == "pspo" else 1.0
    if method == "clip-cov":  # exempt by design: its random pick zeroes k = max(1, ⌊ratio·N⌋) = 1 token
        zeroed = (grad == 0) & (expected != 0)
        assert zeroed.sum() == 1
        expected = torch.where(zeroed, 0.0, expected)
    torch.testing.assert_close(grad, scale * expected, rtol=F64_PARITY, atol=F64_PARITY)
    assert grad.abs().sum() > 0


def test_on_policy_none_old_logprobs_means_ratio_one():
    logprobs, _, advantages, mask = random_batch(seed=4)
    loss_fn = st.PolicyLoss("clip")
    _, grad_a, metrics = loss_and_grad(loss_fn, logprobs, None, advantages, mask)
    _, grad_b, _ = loss_and_grad(loss_fn, logprobs, logprobs, advantages, mask)
    torch.testing.assert_close(grad_a, grad_b)
    assert metrics["ratio/min"] == metrics["ratio/max"] == 1.0


# --- Clip, dual-clip, delta ------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("advantage", ADVANTAGES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_clip_value_and_gradient_closed_form(ratio, advantage):
    eps_low, eps_high = 0.2, 0.28
    loss, grad = single_token("clip", math.log(ratio), advantage, eps_low=eps_low, eps_high=eps_high)
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    assert loss == pytest.approx(-min(ratio * advantage, clipped * advantage), abs=F64_PARITY)
    gradient_flows = (advantage > 0 and ratio < 1 + eps_high) or (advantage < 0 and ratio > 1 - eps_low)
    assert grad == pytest.approx(-ratio * advantage if gradient_flows else 0.0, abs=F64_PARITY)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("ratio", "expected_loss", "expected_grad"),
    [
        (5.0, 3.0, 0.0),  # -min(-5, -1.2) = 5 > c|A| = 3: capped, no pull
        (2.0, 2.0, 2.0),  # below the cap: ordinary unclipped branch, grad -r·A = 2
        (0.5, 0.8, 0.0),  # low clip unaffected by the dual clip
    ],
)
def test_dual_clip_caps_negative_advantage_loss_at_c(ratio, expected_loss, expected_grad):
    loss, grad = single_token("clip", math.log(ratio), -1.0, dual_clip=3.0)
    assert loss == pytest.approx(expected_loss, abs=F64_PARITY)
    assert grad == pytest.approx(expected_grad, abs=F64_PARITY)


def test_dual_clip_never_touches_positive_advantages():
    for ratio in RATIOS:
        assert single_token("clip", math.log(ratio), 1.0, dual_clip=1.5) == pytest.approx(
            single_token("clip", math.log(ratio), 1.0)
        )


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "expected_grad"),
    [
        (5.0, -1.0, 4.0, 0.0),  # r̃ = min(5, δ=4): the loss is capped at δ|A| and the gradient vanishes
        (3.0, -1.0, 3.0, 3.0),  # below δ: unchanged
        (5.0, 1.0, -1.2, 0.0),  # positive advantage: the ordinary clip already binds
    ],
)
def test_delta_caps_the_unclipped_ratio(ratio, advantage, expected_loss, expected_grad):
    loss, grad = single_token("clip", math.log(ratio), advantage, delta=4.0)
    assert loss == pytest.approx(expected_loss, abs=F64_PARITY)
    assert grad == pytest.approx(expected_grad, abs=F64_PARITY)


@pytest.mark.numerics
def test_gspo_is_clip_on_geometric_mean_ratio():
    logprobs, old, advantages, mask = random_batch(seed=5, spread=0.01)
    gspo = st.PolicyLoss("gspo", aggregation="seq-mean-token-mean")
    loss, grad, _ = loss_and_grad(gspo, logprobs, old, advantages, mask)
    m = mask.double()
    log_s = ((logprobs - old) * m).sum(-1) / m.sum(-1)
    s = log_s.exp()
    clipped = s.clamp(1 - 3e-4, 1 + 4e-4)
    per_seq = -torch.minimum(s * advantages, clipped * advantages)
    assert loss.item() == pytest.approx(per_seq.mean().item(), abs=F64_PARITY)
    flows = torch.where(advantages > 0, s < 1 + 4e-4, s > 1 - 3e-4)
    expected = torch.where(flows, -s * advantages, 0)[:, None] * m / m.sum(-1, keepdim=True) / len(s)
    torch.testing.assert_close(grad, expected)


# --- CISPO -----------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("advantage", ADVANTAGES)
@pytest.mark.parametrize("ratio", [*RATIOS, 7.0])
def test_cispo_weight_is_clipped_and_detached(ratio, advantage):
    loss, grad = single_token("cispo", math.log(ratio), advantage, ratio_high=5.0)
    assert loss == pytest.approx(0.0, abs=F64_PARITY)  # ℓ = -w·A·logp and logp = 0 here
    assert grad == pytest.approx(-min(ratio, 5.0) * advantage, abs=F64_PARITY)


@pytest.mark.numerics
def test_cispo_lower_bound_raises_small_weights():
    _, grad = single_token("cispo", math.log(0.3), 1.0, ratio_low=0.8)
    assert grad == pytest.approx(-0.8, abs=F64_PARITY)


# --- SAPO ------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("advantage", ADVANTAGES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_sapo_value_and_sech2_gradient_weight(ratio, advantage):
    tau_pos, tau_neg = 1.0, 1.05
    loss, grad = single_token("sapo", math.log(ratio), advantage)
    tau = tau_pos if advantage > 0 else tau_neg
    sigmoid = 1 / (1 + math.exp(-tau * (ratio - 1)))
    assert loss == pytest.approx(-(4 / tau) * sigmoid * advantage, abs=F64_PARITY)
    assert grad == pytest.approx(-sech2(tau * (ratio - 1) / 2) * ratio * advantage, abs=F64_PARITY)


def test_sapo_loss_offset_is_two_over_tau_at_ratio_one():
    loss, _ = single_token("sapo", 0.0, 1.0, tau_pos=0.5)
    assert loss == pytest.approx(-2 / 0.5)


# --- PSPO ------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("advantage", ADVANTAGES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_pspo_gradient_is_one_minus_alpha_times_unclipped(ratio, advantage):
    alpha = 0.25
    loss, grad = single_token("pspo", math.log(ratio), advantage, alpha=alpha)
    assert loss == pytest.approx(-((1 - alpha) * ratio + alpha) * advantage, abs=F64_PARITY)
    assert grad == pytest.approx(-(1 - alpha) * ratio * advantage, abs=F64_PARITY)


# --- CFPO ------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("advantage", ADVANTAGES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_cfpo_value_and_gradient(ratio, advantage):
    eps = 0.2
    loss, grad = single_token("cfpo", math.log(ratio), advantage, eps=eps)
    assert loss == pytest.approx(
        -(ratio * advantage - abs(advantage) * (ratio - 1) ** 2 / (2 * eps)), abs=F64_PARITY
    )
    assert grad == pytest.approx(-(advantage - abs(advantage) * (ratio - 1) / eps) * ratio, abs=F64_PARITY)


@pytest.mark.numerics
@pytest.mark.parametrize("advantage", ADVANTAGES)
def test_cfpo_is_stationary_at_one_plus_sign_eps(advantage):
    eps = 0.3
    stationary = 1 + math.copysign(eps, advantage)
    _, grad = single_token("cfpo", math.log(stationary), advantage, eps=eps)
    assert grad == pytest.approx(0.0, abs=F64_PARITY)
    _, inside = single_token("cfpo", math.log(1 + 0.5 * math.copysign(eps, advantage)), advantage, eps=eps)
    assert inside * -advantage > 0  # before the stationary point the loss still pushes r away from 1


# --- GMPO ------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_gmpo_geometric_mean_of_sign_aware_clipped_ratios():
    log_r = torch.tensor([[0.1, 0.6, -0.7, 0.0]], dtype=torch.float64)  # one sequence, eps = 0.4
    logprobs = torch.zeros_like(log_r)
    mask = torch.ones_like(log_r, dtype=torch.bool)
    for advantage, clipped in [(2.0, [0.1, 0.4, -0.7, 0.0]), (-2.0, [0.1, 0.6, -0.4, 0.0])]:
        loss_fn = st.PolicyLoss("gmpo", aggregation="seq-mean-token-mean")
        adv = torch.tensor([advantage], dtype=torch.float64)
        loss, grad, _ = loss_and_grad(loss_fn, logprobs, -log_r, adv, mask)
        geometric = math.exp(sum(clipped) / 4)
        assert loss.item() == pytest.approx(-advantage * geometric, abs=F64_PARITY)
        flows = torch.tensor(
            [c == v for c, v in zip(clipped, log_r[0].tolist(), strict=True)], dtype=torch.float64
        )
        torch.testing.assert_close(grad[0], -advantage * geometric * flows / 4)


# --- REINFORCE -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", RATIOS)
def test_reinforce_ignores_the_ratio(ratio):
    assert single_token("reinforce", math.log(ratio), 0.8) == pytest.approx((0.0, -0.8))


# --- VESPO (METHODS.md "VESPO exactly") -------------------------------------------------------------


def phi(w: float, advantage: float, **params) -> float:
    method = st.VESPO(**params)
    log_w = torch.tensor([[math.log(w)]], dtype=torch.float64)
    return method.phi(log_w, torch.tensor([[advantage]], dtype=torch.float64)).item()


@pytest.mark.numerics
@pytest.mark.parametrize(("k", "lam"), [(2.0, 3.0), (3.0, 2.0), (0.0, 1.0), (5.0, 0.5)])
def test_vespo_phi_is_one_on_policy(k, lam):
    assert phi(1.0, 1.0, k_pos=k, lambda_pos=lam) == pytest.approx(1.0, abs=F64_PARITY)
    assert phi(1.0, -1.0, k_neg=k, lambda_neg=lam) == pytest.approx(1.0, abs=F64_PARITY)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("w", "advantage", "expected"),
    [
        (0.5, 1.0, 1.120422),
        (2.0, 1.0, 0.199148),
        (3.0, 1.0, 0.0223088),
        (2 / 3, 1.0, 1.208125),  # peak of (2, 3) at W = k/λ
        (0.5, -1.0, 0.339785),
        (2.0, -1.0, 1.082682),
        (1.5, -1.0, 1.241593),  # peak of (3, 2)
        (1.0, 0.0, 1.0),  # A = 0 uses the A >= 0 kernel
    ],
)
def test_vespo_phi_listed_values(w, advantage, expected):
    assert phi(w, advantage) == pytest.approx(expected, rel=1e-5)  # the table's 6-7 printed digits


@pytest.mark.parametrize(("advantage", "peak"), [(1.0, 2 / 3), (-1.0, 1.5)])
def test_vespo_phi_peaks_at_k_over_lambda(advantage, peak):
    at_peak = phi(peak, advantage)
    for w in (0.5 * peak, 0.95 * peak, 1.05 * peak, 2 * peak):
        assert phi(w, advantage) < at_peak


@pytest.mark.numerics
def test_vespo_token_mean_gradient_is_minus_phi_a_m_over_count_and_phi_has_no_gradient():
    logprobs, old, advantages, mask = random_batch(seed=7, spread=0.2)
    loss_fn = st.PolicyLoss("vespo", aggregation="token-mean")
    _, grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    m = mask.double()
    log_w = ((logprobs - old) * m).sum(-1)
    w = log_w.exp()
    k = torch.where(advantages >= 0, 2.0, 3.0)
    lam = torch.where(advantages >= 0, 3.0, 2.0)
    phi_seq = w**k * torch.exp(lam * (1 - w))
    expected = -(phi_seq * advantages)[:, None] * m / m.sum()
    torch.testing.assert_close(grad, expected, rtol=F64_GRADIENT, atol=F64_PARITY)


def test_vespo_product_distinguishes_lengths_that_gspo_does_not():
    # Two sequences with the same per-token log-ratio 0.1 but lengths 2 and 6.
    logprobs = torch.zeros(2, 6, dtype=torch.float64)
    old = torch.full_like(logprobs, -0.1)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, :] = True
    advantages = torch.ones(2, dtype=torch.float64)
    vespo = st.PolicyLoss("vespo")(logprobs, old, advantages, mask).metric_values()
    gspo = st.PolicyLoss("gspo")(logprobs, old, advantages, mask).metric_values()
    assert vespo["ratio/min"] == pytest.approx(math.exp(0.2))
    assert vespo["ratio/max"] == pytest.approx(math.exp(0.6))
    assert gspo["ratio/min"] == pytest.approx(gspo["ratio/max"])


def test_vespo_log_w_floor_and_nonfinite_phi_is_zero():
    # log W = -1e4 (clamped to -20, then floored at log 1e-8): φ = e^λ·W^k is tiny but finite.
    value = phi(math.exp(-50), 1.0)
    assert 0.0 <= value < 1e-10
    assert phi(math.exp(20), 1.0) == 0.0  # e^{λ(1-W)} underflows to exactly 0, never NaN


@pytest.mark.numerics
def test_vespo_sequence_mean_is_the_length_normalised_ablation():
    logprobs, old, advantages, mask = random_batch(seed=8)
    m = mask.double()
    out = st.PolicyLoss("vespo", level="sequence-mean")(logprobs, old, advantages, mask)
    mean_log_w = ((logprobs - old) * m).sum(-1) / m.sum(-1)
    assert out.metric_values()["ratio/mean"] == pytest.approx(mean_log_w.exp().mean().item())


# --- registry --------------------------------------------------------------------------------------


def test_registry_holds_every_method_by_name():
    exported = {
        value for value in vars(st).values() if isinstance(value, type) and issubclass(value, st.Method)
    } - {st.Method, st.DetachedWeightMethod}
    assert set(st.METHODS.values()) == exported  # every public method class is registered, and only those
    for name, cls in st.METHODS.items():
        assert cls.name == name
        assert cls.default_level in cls.levels


def test_name_plus_overrides_builds_the_method():
    loss_fn = st.PolicyLoss("sapo", tau_neg=1.1)
    assert loss_fn.method == st.SAPO(tau_pos=1.0, tau_neg=1.1)
    assert st.PolicyLoss(st.VESPO(), k_pos=1.5).method == st.VESPO(k_pos=1.5)
    assert st.PolicyLoss("vespo").level == "sequence-sum"
    assert st.PolicyLoss("gspo").level == "sequence-mean"
    assert st.PolicyLoss("clip").level == "token"


def test_methods_are_frozen():
    with pytest.raises(AttributeError):
        st.Clip().eps_low = 0.5


# --- the package: exports and shared texts ---------------------------------------------------------


def test_every_registered_method_is_exported_by_its_family_module_and_the_package():
    """Exports flow from each family module's ``__all__`` through ``softtrust.methods.__all__``
    to ``softtrust.__all__``: a method missing from its module's ``__all__`` fails here."""
    assert set(st.methods.__all__) <= set(st.__all__)
    for cls in st.METHODS.values():
        family = sys.modules[cls.__module__]
        assert cls.__name__ in family.__all__, cls
        assert cls.__name__ in st.methods.__all__, cls
        assert getattr(st, cls.__name__) is cls, cls


def test_every_token_only_method_gives_the_one_token_level_note():
    """One text for every method defined at the token level only (``token_level_note``), shown
    in the error that refuses another level."""
    token_only = [name for name, cls in st.METHODS.items() if cls.levels == ("token",)]
    assert {"dro", "dppo", "kl-cov", "clip-cov", "m2po", "bapo"} <= set(token_only)
    for name in token_only:
        note = st.METHODS[name].level_note
        assert note.endswith(", so it is defined at the 'token' level only"), name
        with pytest.raises(ValueError, match=f"not supported by method '{name}'.*{re.escape(note)}"):
            st.PolicyLoss(name, level="sequence-mean")
