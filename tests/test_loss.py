"""PolicyLoss composition: masking, micro-batch normalisers, corrections, KL, metrics, robustness, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

import softtrust as st

from budgets import F32_METRIC, F64_ABS, F64_GRADIENT, F64_PARITY
from helpers import loss_and_grad, method_level_pairs, random_batch

CORRECTIONS = [
    None,
    st.TIS(cap=2.0),
    st.TIS(cap=1.5, level="sequence"),
    st.MIS(),
    st.MIS(level="token"),
    st.OPSM(0.1),
    st.Reject(),
    [st.TIS(), st.Reject("ratio", "sequence-mean", low=0.9, high=1.1, veto=0.5)],
    st.Reject("k1", "token", low=-0.2, high=0.2),
    st.Reject("k2", "sequence-max", high=0.05),
]


# --- masked positions never matter -----------------------------------------------------------------


@pytest.mark.parametrize("poison", [1e30, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("correction", CORRECTIONS, ids=repr)
@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_masked_positions_never_matter(method, level, correction, poison):
    logprobs, old, _, mask = random_batch(seed=11)
    gen = torch.Generator().manual_seed(12)
    rollout = old + 0.2 * torch.randn(old.shape, generator=gen, dtype=old.dtype)
    ref = logprobs + 0.1 * torch.randn(old.shape, generator=gen, dtype=old.dtype)
    advantages = torch.randn(old.shape, generator=gen, dtype=old.dtype)  # per-token advantages, poisoned too
    loss_fn = st.PolicyLoss(method, level=level, correction=correction, kl=st.KL(0.1))

    def run(lp, o, ro, rf, adv):
        return loss_and_grad(loss_fn, lp, o, adv, mask, rollout_logprobs=ro, ref_logprobs=rf)

    loss, grad, metrics = run(logprobs, old, rollout, ref, advantages)
    poisoned = [torch.where(mask, x, poison) for x in (logprobs, old, rollout, ref, advantages)]
    loss_p, grad_p, metrics_p = run(*poisoned)
    assert torch.isfinite(loss_p)
    assert loss_p.item() == loss.item()
    assert torch.equal(grad_p, grad)
    assert torch.all(grad_p[~mask] == 0)
    assert metrics_p == pytest.approx(metrics, nan_ok=True)


# --- micro-batches with the global normaliser reproduce the whole batch ----------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("aggregation", st.AGGREGATIONS)
@pytest.mark.parametrize("method", list(st.METHODS))
def test_micro_batches_with_global_normaliser_reproduce_whole_batch(method, aggregation):
    logprobs, old, advantages, mask = random_batch(batch=9, length=6, seed=13)
    mask[4] = False  # a row with no active token inside a micro-batch
    loss_fn = st.PolicyLoss(method, aggregation=aggregation, max_completion_length=6)
    whole_loss, whole_grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    state = loss_fn.batch_state(logprobs, old, advantages, mask)  # batch-wide selections: global
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):
        loss, grad, _ = loss_and_grad(
            loss_fn,
            logprobs[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            num_tokens=mask.sum(),
            num_sequences=mask.shape[0],
            state=state,
        )
        total += loss.item()
        grads.append(grad)
    assert total == pytest.approx(whole_loss.item(), rel=F64_PARITY, abs=F64_PARITY)
    torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=F64_PARITY, atol=F64_ABS)


def test_averaging_local_token_means_is_not_the_global_token_mean():
    # The normaliser bug class the global count avoids: micro-batches of different sizes.
    logprobs, old, advantages, mask = random_batch(batch=6, length=6, seed=14)
    mask[:2, 1:] = False
    loss_fn = st.PolicyLoss("reinforce")
    whole = loss_fn(logprobs, old, advantages, mask).loss.item()
    local = sum(
        loss_fn(logprobs[r], old[r], advantages[r], mask[r]).loss.item() for r in (slice(0, 2), slice(2, 6))
    )
    assert local / 2 != pytest.approx(whole)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", lambda lm, m: lm.sum() / m.sum()),
        ("token-sum", lambda lm, m: lm.sum()),
        ("seq-mean-token-mean", lambda lm, m: (lm.sum(-1) / m.sum(-1)).mean()),
        ("seq-mean-token-sum", lambda lm, m: lm.sum(-1).mean()),
        ("seq-mean-token-sum-norm", lambda lm, m: lm.sum() / (m.shape[0] * m.shape[1])),
    ],
)
def test_aggregation_closed_forms(aggregation, expected):
    logprobs, _, advantages, mask = random_batch(seed=15)
    out = st.PolicyLoss("reinforce", aggregation=aggregation)(logprobs, None, advantages, mask)
    per_token = -advantages[:, None] * logprobs * mask
    assert out.loss.item() == pytest.approx(expected(per_token, mask.double()).item(), rel=F64_PARITY)


@pytest.mark.numerics
@pytest.mark.parametrize("aggregation", st.AGGREGATIONS)
def test_aggregate_reads_no_host_values_so_vmap_batches_it(aggregation):
    """``st.aggregate`` stays a pure tensor function (no ``.item()``): vmap over a stack of
    batches equals aggregating each batch alone."""
    logprobs, _, _, mask = random_batch(batch=4, length=6, seed=18)
    losses = torch.stack([logprobs.detach(), 2 * logprobs.detach()])
    masks = torch.stack([mask.double(), torch.roll(mask, 1, dims=1).double()])
    batched = torch.func.vmap(lambda loss, m: st.aggregate(loss, m, aggregation))(losses, masks)
    expected = torch.stack(
        [st.aggregate(loss, m, aggregation) for loss, m in zip(losses, masks, strict=True)]
    )
    torch.testing.assert_close(batched, expected)


# --- corrections -----------------------------------------------------------------------------------


@pytest.mark.numerics
def test_tis_weight_multiplies_the_per_token_loss():
    logprobs, old, advantages, mask = random_batch(seed=16)
    rollout = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    base = st.PolicyLoss("reinforce", aggregation="token-sum")
    _, grad_plain, _ = loss_and_grad(base, logprobs, old, advantages, mask)
    corrected = st.PolicyLoss("reinforce", aggregation="token-sum", correction=st.TIS(cap=1.3))
    _, grad, metrics = loss_and_grad(corrected, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    weight = torch.exp(old - rollout).clamp(max=1.3)
    torch.testing.assert_close(grad, grad_plain * weight * mask)
    assert metrics["is_weight/max"] <= 1.3 + 1e-6


@pytest.mark.numerics
def test_sequence_mis_drops_sequences_outside_the_band():
    logprobs, old, advantages, mask = random_batch(batch=3, length=4, seed=17, active=1.0)
    rollout = old.clone()
    rollout[0] += 0.5  # ρ = e^{-2} over 4 tokens: masked
    rollout[1] -= 0.05  # ρ = e^{0.2}: kept with weight e^{0.2}
    loss_fn = st.PolicyLoss("reinforce", aggregation="token-sum", correction=st.MIS(low=0.5, high=2.0))
    _, grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    expected = -advantages[:, None] * torch.tensor([[0.0], [math.exp(0.2)], [1.0]], dtype=old.dtype)
    torch.testing.assert_close(grad, expected.expand_as(grad))


@pytest.mark.numerics
def test_opsm_drops_only_negative_samples_that_drifted():
    logprobs = torch.zeros(3, 2, dtype=torch.float64)
    old = torch.tensor([[0.8, 0.8], [0.8, 0.8], [0.1, 0.1]], dtype=torch.float64)  # mean drift 0.8, 0.8, 0.1
    advantages = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.bool)
    loss_fn = st.PolicyLoss("reinforce", aggregation="token-sum", correction=st.OPSM(delta=0.5))
    _, grad, metrics = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    assert grad[0].abs().sum() == 0
    torch.testing.assert_close(grad[1:], -advantages[1:, None].expand(2, 2))
    assert metrics["opsm/dropped"] == pytest.approx(1 / 3)  # counted per sequence


@pytest.mark.numerics
def test_vespo_folds_the_correction_into_w():
    logprobs, old, advantages, mask = random_batch(seed=18)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2), dtype=old.dtype)
    loss_fn = st.PolicyLoss("vespo", correction=st.TIS(cap=1.2), aggregation="token-sum")
    _, grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    m = mask.double()
    log_w = ((logprobs - old) * m).sum(-1) + ((old - rollout).clamp(max=math.log(1.2)) * m).sum(-1)
    phi = st.VESPO().phi(log_w[:, None], advantages[:, None])
    torch.testing.assert_close(grad, -(phi * advantages[:, None]) * m)


def test_importance_correction_requires_rollout_logprobs():
    logprobs, old, advantages, mask = random_batch()
    with pytest.raises(ValueError, match="rollout_logprobs"):
        st.PolicyLoss("clip", correction=st.TIS())(logprobs, old, advantages, mask)


# --- KL --------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("estimator", "formula"),
    [
        ("k1", lambda d: -d),
        ("k2", lambda d: 0.5 * d**2),
        ("k3", lambda d: math.exp(d) - d - 1),
    ],
)
def test_kl_estimators_closed_form(estimator, formula):
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.1, -2.0]], dtype=torch.float64)
    values = st.kl_estimate(logprobs, ref, estimator)
    expected = [formula(r - lp) for lp, r in zip(logprobs[0].tolist(), ref[0].tolist(), strict=True)]
    assert values[0].tolist() == pytest.approx(expected, abs=F64_ABS)


@pytest.mark.numerics
def test_kl_term_adds_coef_times_k3_and_its_gradient():
    logprobs, _, advantages, mask = random_batch(seed=19)
    ref = logprobs + 0.4
    base = st.PolicyLoss("reinforce", aggregation="token-sum")
    with_kl = st.PolicyLoss("reinforce", aggregation="token-sum", kl=st.KL(coef=0.3))
    loss0, grad0, _ = loss_and_grad(base, logprobs, None, advantages, mask)
    loss1, grad1, metrics = loss_and_grad(with_kl, logprobs, None, advantages, mask, ref_logprobs=ref)
    k3 = math.exp(0.4) - 0.4 - 1
    assert (loss1 - loss0).item() == pytest.approx(0.3 * k3 * mask.sum().item())
    torch.testing.assert_close(
        grad1 - grad0, 0.3 * (1 - math.exp(0.4)) * mask.double()
    )  # dk3/dlogp = 1 - e^d
    assert metrics["kl"] == pytest.approx(k3, rel=F32_METRIC)


def test_kl_k3_never_overflows():
    logprobs = torch.tensor([[-1e4, 0.0]])
    ref = torch.tensor([[0.0, -1e4]])
    assert torch.isfinite(st.kl_estimate(logprobs, ref, "k3")).all()


@pytest.mark.numerics
@pytest.mark.parametrize("check_values", [True, False])
def test_token_log_ratio_clamp_keeps_the_gradient_inside_and_zeroes_it_beyond(check_values):
    """PSPO's ℓ = -((1-α)·r + α)·A has slope -(1-α)·r·A in logp: exact inside ±c, zero beyond
    (the clamp's value e^c stays). Both masking paths (checked values: multiply; unchecked: where)."""
    alpha, clamp = 0.1, 5.0
    loss_fn = st.PolicyLoss(
        "pspo", aggregation="token-sum", alpha=alpha, log_ratio_clamp=clamp, check_values=check_values
    )
    log_r = torch.tensor([[4.5, -4.5, 5.5, -7.0]], dtype=torch.float64)
    logprobs = torch.zeros_like(log_r)
    advantages = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.ones_like(log_r, dtype=torch.bool)
    loss, grad, _ = loss_and_grad(loss_fn, logprobs, -log_r, advantages, mask)
    ratio = torch.exp(log_r.clamp(-clamp, clamp))
    assert loss.item() == pytest.approx((-((1 - alpha) * ratio + alpha) * 2.0).sum().item())
    inside = -(1 - alpha) * ratio * 2.0
    assert grad[0].tolist() == pytest.approx(
        [inside[0, 0].item(), inside[0, 1].item(), 0.0, 0.0], abs=F64_PARITY
    )


def test_clamp_log_ratio_has_clamp_values_and_a_slope_of_one_strictly_inside():
    x = torch.tensor([-math.inf, -25.0, -20.0, -3.0, 0.0, 19.5, 20.0, 21.0, math.inf], requires_grad=True)
    clamped = st.ratios.clamp_log_ratio(x, 20.0)
    assert clamped.tolist() == x.detach().clamp(-20.0, 20.0).tolist()
    clamped.sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.numerics
def test_importance_corrected_kl_multiplies_by_token_ratio():
    logprobs, old, advantages, mask = random_batch(seed=20)
    ref = logprobs - 0.3
    plain = st.PolicyLoss("reinforce", aggregation="token-sum", kl=st.KL(1.0))
    corrected = st.PolicyLoss("reinforce", aggregation="token-sum", kl=st.KL(1.0, importance_corrected=True))
    policy = st.PolicyLoss("reinforce", aggregation="token-sum")(logprobs, old, advantages, mask).loss
    kl_plain = plain(logprobs, old, advantages, mask, ref_logprobs=ref).loss - policy
    kl_corrected = corrected(logprobs, old, advantages, mask, ref_logprobs=ref).loss - policy
    k3 = math.exp(-0.3) + 0.3 - 1
    assert kl_plain.item() == pytest.approx(k3 * mask.sum().item())
    assert kl_corrected.item() == pytest.approx((k3 * torch.exp(logprobs - old) * mask).sum().item())


@pytest.mark.numerics
@pytest.mark.parametrize("estimator", st.KL_ESTIMATORS)
@pytest.mark.parametrize("method", list(st.METHODS))
def test_kl_term_gradient_is_the_estimators_gradient_for_every_method(method, estimator):
    """The KL term adds coef·∇k (times r, with the ratio's own gradient, when importance-corrected),
    whatever the method: a detached-weight method's ratio must still carry the KL's gradient.
    The straight-through estimators (k1+, k3+) add k2's gradient, times a detached r when corrected."""
    logprobs, old, advantages, mask = random_batch(seed=23, spread=0.5)
    ref = logprobs + 0.4 * torch.randn(
        logprobs.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    m = mask.double()
    estimate = {
        "k1": lambda lp: lp - ref,
        "k2": lambda lp: 0.5 * (ref - lp) ** 2,
        "k3": lambda lp: torch.exp(ref - lp) - (ref - lp) - 1,
        "abs": lambda lp: (lp - ref).abs(),
        "k1+": lambda lp: 0.5 * (ref - lp) ** 2,  # the gradient's estimator: k2
        "k3+": lambda lp: 0.5 * (ref - lp) ** 2,
    }[estimator]
    straight_through = estimator.endswith("+")
    for corrected in (False, True):
        kl = st.KL(0.3, estimator=estimator, importance_corrected=corrected)
        with_kl = st.PolicyLoss(method, aggregation="token-sum", kl=kl)
        _, grad, _ = loss_and_grad(with_kl, logprobs, old, advantages, mask, ref_logprobs=ref)
        _, policy_grad, _ = loss_and_grad(
            st.PolicyLoss(method, aggregation="token-sum"), logprobs, old, advantages, mask
        )
        leaf = logprobs.clone().requires_grad_(True)
        ratio = torch.exp((leaf.detach() if straight_through else leaf) - old)
        term = estimate(leaf) * (ratio if corrected else 1.0)
        (expected,) = torch.autograd.grad((0.3 * term * m).sum(), leaf)
        torch.testing.assert_close(grad - policy_grad, expected, rtol=F64_GRADIENT, atol=F64_PARITY)


# --- metrics ---------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_clip_fractions_count_the_tokens_whose_gradient_is_zeroed():
    logprobs = torch.zeros(2, 3, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    metrics = st.PolicyLoss("clip")(logprobs, -ratios.log(), advantages, mask).metric_values()
    assert metrics["clip/high"] == pytest.approx(1 / 6)  # r = 1.5 with A > 0
    assert metrics["clip/low"] == pytest.approx(1 / 6)  # r = 0.5 with A < 0
    assert metrics["ratio/max"] == pytest.approx(1.5)
    assert metrics["ratio/min"] == pytest.approx(0.5)


@pytest.mark.numerics
def test_ess_is_one_for_equal_weights_and_one_over_n_for_a_single_dominant_weight():
    logprobs = torch.zeros(4, 2, dtype=torch.float64)
    advantages = torch.ones(4, dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    equal = st.PolicyLoss("vespo")(logprobs, logprobs - 0.1, advantages, mask).metric_values()
    assert equal["ess"] == pytest.approx(1.0)
    old = torch.zeros(4, 2, dtype=torch.float64)
    old[0] = -15.0  # W_0 = e^30 dominates
    dominated = st.PolicyLoss("vespo")(logprobs, old, advantages, mask).metric_values()
    assert dominated["ess"] == pytest.approx(0.25, rel=F32_METRIC)
    assert dominated["seq_log_weight/max"] == pytest.approx(30.0)


# --- robustness (property tests) -------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pair=hs.sampled_from(method_level_pairs()),
    aggregation=hs.sampled_from(st.AGGREGATIONS),
    dtype=hs.sampled_from(DTYPES),
    batch=hs.integers(1, 4),
    length=hs.integers(1, 5),
    log_ratio_scale=hs.sampled_from([0.0, 1.0, 50.0, 1e4]),
    empty_rows=hs.sampled_from(["none", "some", "all"]),
    seed=hs.integers(0, 2**16),
)
def test_property_loss_and_gradient_are_finite(
    pair, aggregation, dtype, batch, length, log_ratio_scale, empty_rows, seed
):
    method, level = pair
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(batch, length, generator=gen)).to(dtype)
    old = (logprobs.float() - log_ratio_scale * torch.randn(batch, length, generator=gen)).to(dtype)
    advantages = torch.randn(batch, generator=gen).to(dtype)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    if empty_rows == "some":
        mask[0] = False
    elif empty_rows == "all":
        mask[:] = False
    leaf = logprobs.clone().requires_grad_(True)
    out = st.PolicyLoss(method, level=level, aggregation=aggregation)(leaf, old, advantages, mask)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    assert out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(grad.float()).all()
    assert torch.all(grad[~mask] == 0)
    if empty_rows == "all":
        assert out.loss.item() == 0.0
        assert torch.all(grad == 0)


@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_batch_with_no_active_token_gives_zero_loss_and_gradient(method, level):
    logprobs, old, advantages, mask = random_batch(seed=21)
    mask[:] = False
    for aggregation in st.AGGREGATIONS:
        loss, grad, _ = loss_and_grad(
            st.PolicyLoss(method, level=level, aggregation=aggregation), logprobs, old, advantages, mask
        )
        assert loss.item() == 0.0
        assert torch.all(grad == 0)


@pytest.mark.numerics
def test_empty_row_contributes_nothing():
    logprobs, old, advantages, mask = random_batch(seed=22)
    loss_fn = st.PolicyLoss("gspo", aggregation="token-mean")
    with_row, _, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    mask_extra = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])
    extended = [torch.cat([x, x[:1]]) for x in (logprobs, old)]
    loss, grad, _ = loss_and_grad(
        loss_fn, extended[0], extended[1], torch.cat([advantages, advantages[:1]]), mask_extra
    )
    assert loss.item() == pytest.approx(with_row.item())
    assert torch.all(grad[-1] == 0)


# --- bad input fails fast, naming the argument -----------------------------------------------------


def good_inputs():
    logprobs, old, advantages, mask = random_batch(batch=2, length=3, dtype=torch.float32)
    return logprobs, old, advantages, mask


def test_error_mismatched_old_logprobs_shape():
    logprobs, _, advantages, mask = good_inputs()
    with pytest.raises(ValueError, match=r"old_logprobs must have shape .*\(2, 3\).*got \(2, 4\)"):
        st.PolicyLoss("clip")(logprobs, torch.zeros(2, 4), advantages, mask)


def test_error_mismatched_mask_shape():
    logprobs, old, advantages, _ = good_inputs()
    with pytest.raises(ValueError, match=r"mask must have shape .*got \(3, 2\)"):
        st.PolicyLoss("clip")(logprobs, old, advantages, torch.ones(3, 2, dtype=torch.bool))


def test_error_integer_logprobs():
    _, old, advantages, mask = good_inputs()
    with pytest.raises(ValueError, match=r"logprobs must be a floating-point tensor.*torch.int64"):
        st.PolicyLoss("clip")(torch.zeros(2, 3, dtype=torch.long), old, advantages, mask)


def test_error_integer_old_logprobs():
    logprobs, _, advantages, mask = good_inputs()
    with pytest.raises(ValueError, match=r"old_logprobs must be a floating-point tensor"):
        st.PolicyLoss("clip")(logprobs, torch.zeros(2, 3, dtype=torch.int32), advantages, mask)


def test_error_mask_not_binary():
    logprobs, old, advantages, _ = good_inputs()
    with pytest.raises(ValueError, match=r"mask must be bool or contain only 0 and 1, got a value 2"):
        st.PolicyLoss("clip")(logprobs, old, advantages, torch.full((2, 3), 2.0))


def test_error_advantages_wrong_shape():
    logprobs, old, _, mask = good_inputs()
    with pytest.raises(
        ValueError, match=r"advantages must have shape \(B,\) = \(2,\) or \(B, T\) = \(2, 3\), got \(3,\)"
    ):
        st.PolicyLoss("clip")(logprobs, old, torch.zeros(3), mask)


def test_error_logprobs_not_2d():
    _, old, advantages, mask = good_inputs()
    with pytest.raises(ValueError, match=r"logprobs must have shape \(B, T\), got \(6,\)"):
        st.PolicyLoss("clip")(torch.zeros(6), old, advantages, mask)


@pytest.mark.parametrize(
    ("method", "level"),
    [("vespo", "token"), ("clip", "sequence-sum"), ("gmpo", "token"), ("sapo", "sequence-sum")],
)
def test_error_level_the_method_does_not_support(method, level):
    with pytest.raises(ValueError, match=rf"level='{level}' is not supported by method '{method}'"):
        st.PolicyLoss(method, level=level)


def test_error_unknown_level():
    with pytest.raises(ValueError, match=r"level must be one of .*got 'sequence'"):
        st.PolicyLoss("clip", level="sequence")


def test_error_unknown_aggregation():
    with pytest.raises(ValueError, match=r"aggregation must be one of .*got 'mean'"):
        st.PolicyLoss("clip", aggregation="mean")


def test_error_unknown_method_name():
    with pytest.raises(ValueError, match=r"method must be one of .*got 'ppo'"):
        st.PolicyLoss("ppo")


def test_error_unknown_method_parameter():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['tau'\] for method 'sapo'"):
        st.PolicyLoss("sapo", tau=1.0)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: st.Clip(eps_low=-0.1), r"eps_low must be >= 0.0, got -0.1"),
        (lambda: st.Clip(eps_high=-0.2), r"eps_high must be >= 0.0, got -0.2"),
        (lambda: st.Clip(dual_clip=0.5), r"dual_clip must be > 1.0, got 0.5"),
        (lambda: st.Clip(delta=1.0), r"delta must be > 1.0, got 1.0"),
        (lambda: st.GSPO(eps_low=-3e-4), r"eps_low must be >= 0.0"),
        (lambda: st.SAPO(tau_pos=0.0), r"tau_pos must be > 0.0, got 0.0"),
        (lambda: st.SAPO(tau_neg=-1.0), r"tau_neg must be > 0.0, got -1.0"),
        (lambda: st.PSPO(alpha=1.5), r"alpha must be <= 1.0, got 1.5"),
        (lambda: st.PSPO(alpha=-0.1), r"alpha must be >= 0.0, got -0.1"),
        (lambda: st.VESPO(lambda_pos=0.0), r"lambda_pos must be > 0.0, got 0.0"),
        (lambda: st.VESPO(lambda_neg=-2.0), r"lambda_neg must be > 0.0, got -2.0"),
        (lambda: st.VESPO(k_pos=-1.0), r"k_pos must be >= 0.0, got -1.0"),
        (lambda: st.VESPO(k_neg=-3.0), r"k_neg must be >= 0.0, got -3.0"),
        (lambda: st.CISPO(ratio_high=0.5), r"ratio_high must be >= 1.0, got 0.5"),
        (lambda: st.CFPO(eps=0.0), r"eps must be > 0.0, got 0.0"),
        (lambda: st.GMPO(eps=-0.4), r"eps must be > 0.0, got -0.4"),
        (lambda: st.MIS(low=2.0, high=2.0), r"MIS needs low < high, got low=2.0, high=2.0"),
        (lambda: st.MIS(low=3.0, high=2.0), r"MIS needs low < high, got low=3.0, high=2.0"),
        (lambda: st.TIS(cap=0.0), r"cap must be > 0.0, got 0.0"),
        (lambda: st.TIS(level="batch"), r"level must be one of \['token', 'sequence'\], got 'batch'"),
        (lambda: st.OPSM(delta=-0.5), r"delta must be >= 0.0, got -0.5"),
        (lambda: st.KL(coef=-0.1), r"coef must be >= 0.0, got -0.1"),
        (lambda: st.KL(coef=0.1, estimator="k4"), r"estimator must be one of .*got 'k4'"),
        (lambda: st.Clip(eps_low=float("nan")), r"eps_low must be a finite number, got nan"),
    ],
)
def test_error_invalid_hyperparameter(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_error_two_importance_corrections():
    with pytest.raises(ValueError, match="at most one importance correction"):
        st.PolicyLoss("clip", correction=[st.TIS(), st.MIS()])


def test_error_kl_without_ref_logprobs():
    logprobs, old, advantages, mask = good_inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        st.PolicyLoss("clip", kl=st.KL(0.1))(logprobs, old, advantages, mask)


def test_float16_gradient_saturates_instead_of_overflowing():
    # r = e^15 with A < 0 on the unclipped branch: dℓ/dlogp = -r·A ≈ 3.3e6 > float16 max 65504.
    logprobs = torch.zeros(1, 1, dtype=torch.float16, requires_grad=True)
    old = torch.full((1, 1), -15.0, dtype=torch.float16)
    out = st.PolicyLoss("clip", aggregation="token-sum")(
        logprobs, old, torch.tensor([-1.0]), torch.ones(1, 1)
    )
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    assert grad.dtype == torch.float16
    assert grad.item() == torch.finfo(torch.float16).max


# --- invalid values: an error when values are checked, a non-finite loss when they are not -----------


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_empty_batch_gives_zero_loss_and_zero_gradient(method, level, shape):
    logprobs = torch.zeros(shape, dtype=torch.float64)
    for aggregation in st.AGGREGATIONS:
        loss_fn = st.PolicyLoss(method, level=level, aggregation=aggregation)
        loss, grad, _ = loss_and_grad(
            loss_fn, logprobs, logprobs, torch.zeros(shape[0], dtype=torch.float64), torch.ones(shape)
        )
        assert loss.item() == 0.0
        assert grad.shape == shape
        assert torch.all(grad == 0)


@pytest.mark.parametrize("name", ["num_tokens", "num_sequences"])
@pytest.mark.parametrize(
    "value",
    [-5, 0, 0.0, True, math.nan, math.inf, torch.tensor(-5.0), torch.tensor(math.nan), torch.tensor(True)],
)
def test_error_global_count_not_a_positive_finite_number(name, value):
    logprobs, old, advantages, mask = good_inputs()
    with pytest.raises(ValueError, match=name):
        st.PolicyLoss("clip")(logprobs, old, advantages, mask, **{name: value})


@pytest.mark.numerics
def test_fractional_global_count_is_accepted():
    logprobs, old, advantages, mask = good_inputs()
    loss_fn = st.PolicyLoss("reinforce", aggregation="token-sum")
    plain = loss_fn(logprobs, old, advantages, mask).loss
    mean = st.PolicyLoss("reinforce")(logprobs, old, advantages, mask, num_tokens=2.5).loss
    assert mean.item() == pytest.approx(plain.item() / 2.5)


BAD_VALUES = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("name", ["old_logprobs", "rollout_logprobs", "ref_logprobs", "advantages"])
def test_error_non_finite_value_at_an_active_position_when_values_are_checked(name, bad):
    logprobs, old, advantages, mask = good_inputs()
    inputs = {"old_logprobs": old, "rollout_logprobs": old, "ref_logprobs": old, "advantages": advantages}
    inputs[name] = inputs[name].clone()
    inputs[name].view(-1)[0] = bad  # row 0, token 0: active (random_batch keeps token 0 active)
    loss_fn = st.PolicyLoss("vespo", correction=st.TIS(), kl=st.KL(0.1))
    with pytest.raises(ValueError, match=rf"{name} must be finite at active"):
        loss_fn(
            logprobs,
            inputs["old_logprobs"],
            inputs["advantages"],
            mask,
            rollout_logprobs=inputs["rollout_logprobs"],
            ref_logprobs=inputs["ref_logprobs"],
        )


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize(
    "correction", [None, st.TIS(), st.MIS(level="token"), st.OPSM(0.1), st.Reject("k3", "token")], ids=repr
)
@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_unchecked_non_finite_recorded_logprob_gives_a_non_finite_loss(method, level, correction, bad):
    """Never a silently finite number: an inf is not clamped to a ratio of e^±20, a NaN does not zero φ."""
    if method == "reinforce" and correction is None:
        pytest.skip("REINFORCE reads no recorded log-prob: its loss is right whatever they hold")
    logprobs, old, advantages, mask = random_batch(seed=41)
    loss_fn = st.PolicyLoss(method, level=level, correction=correction, check_values=False)
    rollout = old.clone()
    broken = rollout if correction is not None else old.clone()
    broken[1, 0] = bad  # an active position
    if correction is None:
        out = loss_fn(logprobs, broken, advantages, mask)
    else:
        out = loss_fn(logprobs, old, advantages, mask, rollout_logprobs=rollout)
    assert not torch.isfinite(out.loss)


def test_unchecked_mask_is_read_as_nonzero():
    logprobs, old, advantages, mask = good_inputs()
    loss_fn = st.PolicyLoss("clip", check_values=False)
    as_bool = loss_fn(logprobs, old, advantages, mask).loss
    assert loss_fn(logprobs, old, advantages, mask.float() * 1.0).loss.item() == as_bool.item()


def test_error_check_values_not_a_bool():
    with pytest.raises(ValueError, match="check_values"):
        st.PolicyLoss("clip", check_values="yes")


@pytest.mark.numerics
@pytest.mark.parametrize("method", ["clip", "gspo", "sapo", "pspo", "cfpo"])
def test_gspo_token_level_equals_sequence_mean_unless_a_factor_varies_within_a_row(method):
    """sequence-mean-token (GSPO-token) has sequence-mean's value; its gradient differs only with a per-token factor.

    Per-sequence advantages and no correction: value and gradient equal. With a token-level
    TIS weight w_t (token-sum): sequence-mean gives token u of row i
    ``(Σ_t w_t)·ℓ'(s_i)·s_i / n_i`` (the gradient reaches u through the mean), GSPO-token
    gives ``w_u·ℓ'(s_i)·s_i``: the ratio of the two is ``w_u / mean_t w_t``."""
    wide = {"eps_low": 0.5, "eps_high": 0.5} if method in ("clip", "gspo") else {}
    logprobs, old, advantages, mask = random_batch(spread=0.05, seed=3)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    plain, weighted = {}, {}
    for level in ("sequence-mean", "sequence-mean-token"):
        plain[level] = loss_and_grad(
            st.PolicyLoss(method, level=level, **wide), logprobs, old, advantages, mask
        )
        loss_fn = st.PolicyLoss(
            method, level=level, correction=st.TIS(cap=2.0), aggregation="token-sum", **wide
        )
        weighted[level] = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    (value_mean, grad_mean, _), (value_token, grad_token, _) = plain.values()
    assert value_token.item() == pytest.approx(value_mean.item(), abs=F64_PARITY)
    torch.testing.assert_close(grad_token, grad_mean, atol=F64_PARITY, rtol=F64_PARITY)

    m = mask.double()
    w = torch.exp(old - rollout).clamp(max=2.0) * m  # token TIS weights, cap 2
    row_mean_weight = w.sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    (value_mean, grad_mean, _), (value_token, grad_token, _) = weighted.values()
    assert value_token.item() == pytest.approx(value_mean.item(), abs=F64_PARITY)
    # the expected side divides by a row mean of exp/clamp values: F64_GRADIENT (1e-10)
    torch.testing.assert_close(
        grad_token, grad_mean * w / row_mean_weight, atol=F64_PARITY, rtol=F64_GRADIENT
    )
    assert (grad_token - grad_mean).abs().max() > 1e-4
