"""Closed forms of DPPO, DRO, TOPR, KL-Cov and Clip-Cov (METHODS.md "The wider catalogue")."""

from __future__ import annotations

import math

import pytest
import torch

import softtrust as st
from softtrust.methods.reweighting import binary_kl

from budgets import F64_ABS, F64_GRADIENT, F64_PARITY
from expected_methods import expected_loss
from helpers import loss_and_grad, random_batch


def one_token(method, p_old, p, advantage, **params):
    """ℓ and dℓ/dlogp for one token with probabilities p (current) and p_old, token-sum aggregation."""
    loss_fn = st.PolicyLoss(method, aggregation="token-sum", **params)
    logprobs = torch.full((1, 1), math.log(p), dtype=torch.float64)
    old = torch.full((1, 1), math.log(p_old), dtype=torch.float64)
    loss, grad, metrics = loss_and_grad(
        loss_fn,
        logprobs,
        old,
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
    )
    return loss.item(), grad.item(), metrics


def bernoulli_kl(q, p):
    def term(a, b):
        return 0.0 if a == 0 else a * math.log(a / b)

    return term(q, p) + term(1 - q, 1 - p)


# --- DPPO -------------------------------------------------------------------------------------------

# (p_old, p, A, valid under TV with δ = 0.15)
TV_CASES = [
    (0.5, 0.6, 1.0, True),  # moved up 0.1 <= 0.15
    (0.5, 0.7, 1.0, False),  # moved up 0.2 in the update's direction
    (0.5, 0.2, 1.0, True),  # moved down: against a positive update, always kept
    (0.5, 0.4, -1.0, True),
    (0.5, 0.3, -1.0, False),  # moved down 0.2 in the update's direction
    (0.5, 0.9, -1.0, True),
    (1e-5, 1e-3, 1.0, True),  # ratio 100, PPO would clip it; the probability barely moved
]


@pytest.mark.numerics
@pytest.mark.parametrize(("p_old", "p", "advantage", "valid"), TV_CASES)
def test_dppo_tv_masks_tokens_that_moved_too_far_in_the_update_direction(p_old, p, advantage, valid):
    loss, grad, metrics = one_token("dppo", p_old, p, advantage)
    weight = min(p / p_old, 20.0) * valid
    assert loss == pytest.approx(-weight * advantage * math.log(p), rel=F64_PARITY)
    assert grad == pytest.approx(-weight * advantage, rel=F64_PARITY)
    assert metrics["dppo/masked"] == (0.0 if valid else 1.0)


# (p_old, p, A): the binary-KL rule keeps a token when D <= δ or it moved against the update
KL_CASES = [
    (0.5, 0.6, 1.0),  # D = 0.020 <= 0.05
    (0.5, 0.75, 1.0),  # D = 0.144 > 0.05, moved up: masked
    (0.5, 0.1, 1.0),  # D large, moved down: kept
    (0.5, 0.25, -1.0),  # D = 0.144, moved down: masked
    (0.5, 0.95, -1.0),  # D large, moved up: kept
    (0.99, 0.8, -1.0),  # D = 0.181: masked (a small ratio change, a big move of mass)
    (1e-5, 1e-3, 1.0),  # D ≈ 0.001: kept
]


@pytest.mark.numerics
@pytest.mark.parametrize(("p_old", "p", "advantage"), KL_CASES)
def test_dppo_binary_kl_validity_rule(p_old, p, advantage):
    divergence = bernoulli_kl(p_old, p)
    moved_against_the_update = p <= p_old if advantage > 0 else p >= p_old
    valid = divergence <= 0.05 or moved_against_the_update
    _, grad, metrics = one_token("dppo", p_old, p, advantage, divergence="binary-kl")
    assert grad == pytest.approx(-min(p / p_old, 20.0) * valid * advantage, rel=F64_PARITY)
    assert metrics["dppo/masked"] == (0.0 if valid else 1.0)


@pytest.mark.numerics
def test_binary_kl_closed_form_and_edges():
    q = torch.tensor([0.5, 0.99, 1e-5, 0.3, 0.7, 1.0], dtype=torch.float64)
    p = torch.tensor([0.75, 0.8, 1e-3, 0.3, 1.0, 0.5], dtype=torch.float64)
    got = binary_kl(torch.log(q), torch.log(p))
    expected = [bernoulli_kl(a, b) for a, b in zip(q.tolist()[:4], p.tolist()[:4], strict=True)]
    torch.testing.assert_close(
        got[:4], torch.tensor(expected, dtype=torch.float64), rtol=F64_PARITY, atol=F64_ABS
    )
    assert got[4] == math.inf  # all mass moved onto the token
    assert got[5] == pytest.approx(math.log(2.0))  # p_old = 1: the 0·log 0 term is 0, not NaN


def test_dppo_cap_truncates_the_detached_ratio():
    _, grad, _ = one_token("dppo", 0.01, 0.1, 1.0, cap=4.0)  # ratio 10, TV move 0.09: valid
    assert grad == pytest.approx(-4.0)


def test_dppo_token_at_probability_one_is_finite():
    loss, grad, _ = one_token("dppo", 0.5, 1.0, 1.0, divergence="binary-kl")
    assert (loss, grad) == (0.0, 0.0)  # D = inf, moved up: masked, and no NaN


# --- DRO, TOPR --------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize(("p_old", "p", "advantage"), [(0.5, 0.7, 1.3), (0.2, 0.1, -0.6), (0.4, 0.4, 0.9)])
def test_dro_value_and_gradient(p_old, p, advantage):
    beta = 0.3
    loss, grad, _ = one_token("dro", p_old, p, advantage, beta=beta)
    log_r = math.log(p / p_old)
    assert loss == pytest.approx(-(advantage * math.log(p) - beta / 2 * log_r**2), rel=F64_PARITY)
    assert grad == pytest.approx(-(advantage - beta * log_r), rel=F64_PARITY)


@pytest.mark.numerics
def test_topr_weights_negative_sequences_by_their_clipped_sequence_ratio():
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-1.0, -0.5, -2.0], [-1.0, -0.5, -2.0]], dtype=torch.float64)
    old = logprobs + torch.tensor([[0.2, 0.1, 0.0], [-0.3, -0.4, 0.0], [0.2, 0.1, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([-1.5, -1.5, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 3, dtype=torch.bool)
    _, grad, _ = loss_and_grad(
        st.PolicyLoss("topr", aggregation="token-sum"), logprobs, old, advantages, mask
    )
    weights = [math.exp(-0.3), 1.0, 1.0]  # r_seq = e^-0.3 < 1; e^0.7 > 1 clipped to 1; A > 0: 1 whatever r
    expected = torch.tensor(
        [[-w * a] * 3 for w, a in zip(weights, advantages.tolist(), strict=True)], dtype=torch.float64
    )
    torch.testing.assert_close(grad, expected, rtol=F64_PARITY, atol=F64_ABS)


# --- KL-Cov -----------------------------------------------------------------------------------------


def covariance(logprobs, advantages, mask):
    a = advantages[:, None].expand_as(logprobs)[mask]
    lp = logprobs[mask]
    cov = torch.full(logprobs.shape, -math.inf, dtype=logprobs.dtype)
    cov[mask] = (a - a.mean()) * (lp - lp.mean())
    return cov


@pytest.mark.numerics
def test_kl_cov_penalises_exactly_the_top_k_covariance_tokens():
    logprobs, old, advantages, mask = random_batch(batch=6, length=8, seed=5, spread=0.4)
    ratio = 0.1
    k = max(1, int(ratio * mask.sum().item()))
    top = torch.zeros(mask.numel(), dtype=torch.bool)
    top[torch.topk(covariance(logprobs, advantages, mask).reshape(-1), k).indices] = True
    top = top.reshape(mask.shape)
    out_cov = loss_and_grad(
        st.PolicyLoss("kl-cov", aggregation="token-sum", ratio=ratio), logprobs, old, advantages, mask
    )
    out_plain = loss_and_grad(
        st.PolicyLoss("pspo", aggregation="token-sum", alpha=0.0), logprobs, old, advantages, mask
    )  # -A·r, unclipped
    log_r = logprobs - old
    expected_grad = out_plain[1] + torch.where(top, torch.sign(log_r), 0.0)
    torch.testing.assert_close(out_cov[1], expected_grad, rtol=F64_PARITY, atol=F64_ABS)
    assert out_cov[2]["cov/selected"] == pytest.approx(k / mask.sum().item())


@pytest.mark.numerics
def test_kl_cov_micro_batches_need_the_global_state():
    """Selected per micro-batch (what a per-micro-batch peer call does), the batch's top-k is not kept."""
    logprobs, old, advantages, mask = random_batch(batch=8, length=6, seed=6, spread=0.4)
    loss_fn = st.PolicyLoss("kl-cov", aggregation="token-sum", ratio=0.05)
    whole = loss_fn(logprobs, old, advantages, mask).loss
    state = loss_fn.batch_state(logprobs, old, advantages, mask)
    with_state = sum(
        loss_fn(logprobs[r], old[r], advantages[r], mask[r], state=state).loss
        for r in (slice(0, 4), slice(4, 8))
    )
    local = sum(loss_fn(logprobs[r], old[r], advantages[r], mask[r]).loss for r in (slice(0, 4), slice(4, 8)))
    assert with_state.item() == pytest.approx(whole.item(), rel=F64_PARITY)
    assert local.item() != pytest.approx(whole.item(), rel=1e-6)


# --- Clip-Cov ---------------------------------------------------------------------------------------


def clip_cov_batch():
    return random_batch(batch=8, length=10, seed=7, spread=0.3)


@pytest.mark.numerics
def test_clip_cov_picks_min_k_candidates_and_zeroes_only_them():
    batch = clip_cov_batch()
    logprobs, old, advantages, mask = batch
    method = st.ClipCov(ratio=0.05, cov_low=0.05, cov_high=5.0)
    cov = covariance(logprobs, advantages, mask)
    ratio = torch.exp(logprobs - old)
    a = advantages[:, None]
    unclipped, clipped = -a * ratio, -a * ratio.clamp(0.8, 1.2)
    candidates = mask & (cov > 0.05) & (cov < 5.0) & (clipped <= unclipped)
    k = max(1, int(0.05 * mask.sum().item()))
    assert candidates.sum() > k  # a real random pick
    loss_fn = st.PolicyLoss(method, aggregation="token-sum")
    gen = torch.Generator().manual_seed(0)
    _, grad, metrics = loss_and_grad(loss_fn, *batch, generator=gen)
    reference = torch.where(mask, -a * ratio * (unclipped >= clipped), 0.0)  # PPO's gradient: -r·A unclipped
    zeroed = (grad == 0) & (reference != 0)
    assert zeroed.sum() == k and bool((zeroed <= candidates).all())
    torch.testing.assert_close(torch.where(zeroed, 0.0, reference), grad, rtol=F64_PARITY, atol=F64_ABS)
    assert metrics["cov/picked"] * mask.sum().item() == pytest.approx(k)


def test_clip_cov_pick_is_reproducible_from_the_seed_and_changes_with_it():
    batch = clip_cov_batch()
    loss_fn = st.PolicyLoss(st.ClipCov(ratio=0.05, cov_low=0.05), aggregation="token-sum")

    def grad(seed):
        return loss_and_grad(loss_fn, *batch, generator=torch.Generator().manual_seed(seed))[1]

    assert torch.equal(grad(1), grad(1))
    assert any(not torch.equal(grad(1), grad(seed)) for seed in range(2, 6))


@pytest.mark.numerics
def test_clip_cov_micro_batches_with_the_state_reproduce_the_whole_pick():
    batch = clip_cov_batch()
    loss_fn = st.PolicyLoss(st.ClipCov(ratio=0.05, cov_low=0.05), aggregation="token-sum")
    state = loss_fn.batch_state(*batch, generator=torch.Generator().manual_seed(3))
    whole, whole_grad, _ = loss_and_grad(loss_fn, *batch, state=state)
    parts = [loss_and_grad(loss_fn, *(x[r] for x in batch), state=state) for r in (slice(0, 3), slice(3, 8))]
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), rel=F64_PARITY)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_grad, rtol=0, atol=0)


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: st.DPPO(divergence="kl"), "divergence"),
        (lambda: st.DPPO(delta_low=0.0), "delta_low"),
        (lambda: st.DPPO(delta_high=-0.1), "delta_high"),
        (lambda: st.DPPO(cap=0.5), "cap"),
        (lambda: st.DRO(beta=0.0), "beta"),
        (lambda: st.KLCov(ratio=0.0), "ratio"),
        (lambda: st.KLCov(ratio=1.5), "ratio"),
        (lambda: st.KLCov(coef=-1.0), "coef"),
        (lambda: st.ClipCov(cov_low=2.0, cov_high=1.0), "cov_high"),
        (lambda: st.ClipCov(eps_low=1.0), "eps_low"),
    ],
)
def test_error_invalid_catalogue_hyperparameter(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


@pytest.mark.parametrize("method", ["dppo", "dro", "kl-cov", "clip-cov"])
def test_catalogue_token_methods_refuse_sequence_levels(method):
    with pytest.raises(ValueError, match="not supported"):
        st.PolicyLoss(method, level="sequence-mean")


@pytest.mark.numerics
def test_clip_cov_table_formula_with_a_real_pick():
    """The table's independent statement of the keyed pick (tests/expected_methods.py), with k < #candidates."""
    logprobs, old, advantages, mask = clip_cov_batch()
    loss_fn = st.PolicyLoss(st.ClipCov(ratio=0.05, cov_low=0.05), aggregation="token-mean")
    loss, grad, metrics = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    assert metrics["cov/picked"] > 0
    leaf = logprobs.clone().requires_grad_(True)
    expected = expected_loss(loss_fn.method, "token", "token-mean", leaf, old, advantages, mask)
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert loss.item() == pytest.approx(expected.item(), rel=F64_PARITY)
    torch.testing.assert_close(grad, expected_grad, rtol=F64_GRADIENT, atol=F64_ABS)


@pytest.mark.numerics
@pytest.mark.costly
def test_clip_cov_compiles_with_a_state_drawn_from_a_generator():
    """A Generator cannot enter a fullgraph compile: draw the state eagerly, pass it to the compiled loss."""
    batch = clip_cov_batch()
    loss_fn = st.PolicyLoss(st.ClipCov(ratio=0.05, cov_low=0.05))
    state = loss_fn.batch_state(*batch, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss, grad, metrics = loss_and_grad(loss_fn, *batch, state=state)
    loss_c, grad_c, _ = loss_and_grad(compiled, *batch, state=state)
    assert metrics["cov/picked"] > 0
    assert loss_c.item() == pytest.approx(loss.item(), rel=F64_PARITY)
    torch.testing.assert_close(grad_c, grad, rtol=F64_PARITY, atol=F64_ABS)


def test_selection_size_is_the_float64_floor_even_for_float32_inputs():
    from softtrust.methods.covariance import _selection_size

    mask = torch.ones(100, 100, dtype=torch.float32)  # N = 10000: 2e-4·N = 2 exactly in float64
    assert _selection_size(2e-4, mask).item() == 2 == max(1, int(2e-4 * 10000))
    assert _selection_size(2e-4, mask[:10]).item() == 1  # floor(0.2) -> at least 1
