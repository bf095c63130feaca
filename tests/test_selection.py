"""M2PO and BAPO (batch-wide selections) and the Reject correction: closed forms on hand-made inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import softtrust as st

from budgets import F32_METRIC, F64_ABS, F64_PARITY
from helpers import loss_and_grad, random_batch


def tokens(log_ratios, advantages=None):
    """One row per list: logprobs 0, old = -log r, per-sequence advantages (default 1), all active."""
    log_r = torch.tensor(log_ratios, dtype=torch.float64)
    adv = torch.ones(log_r.shape[0], dtype=torch.float64) if advantages is None else torch.tensor(advantages)
    return torch.zeros_like(log_r), -log_r, adv.double(), torch.ones_like(log_r, dtype=torch.bool)


# --- M2PO ------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_m2po_masks_the_fewest_largest_second_moments_and_trains_the_rest_unclipped():
    # d² = 0.25, 0.01, 0.01, 0.0025: mean 0.068 >= 0.04; without the largest, 0.0075 < 0.04
    logprobs, old, adv, mask = tokens([[0.5, 0.1, -0.1, 0.05]], [2.0])
    loss_fn = st.PolicyLoss("m2po", aggregation="token-sum")
    loss, grad, metrics = loss_and_grad(loss_fn, logprobs, old, adv, mask)
    r = torch.exp(torch.tensor([0.5, 0.1, -0.1, 0.05], dtype=torch.float64))
    keep = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert loss.item() == pytest.approx(-(keep * r * 2.0).sum().item(), rel=F64_PARITY)
    # gradient -M·r·A: 0 for the dropped token, -r·A for the kept ones
    torch.testing.assert_close(grad[0], -keep * r * 2.0)
    assert metrics["m2po/masked"] == pytest.approx(0.25)


@pytest.mark.numerics
def test_m2po_keeps_a_far_token_unclipped_when_the_batch_second_moment_allows_it():
    # one token at r = e^0.3 (outside PPO's 1.2) among many on-policy ones: mean d² = 0.09/10 < 0.04
    logprobs, old, adv, mask = tokens([[0.3] + [0.0] * 9], [1.0])
    _, grad, metrics = loss_and_grad(st.PolicyLoss("m2po", aggregation="token-sum"), logprobs, old, adv, mask)
    assert metrics["m2po/masked"] == 0.0
    assert grad[0, 0].item() == pytest.approx(-math.exp(0.3))  # a PPO clip would give 0 here


def test_m2po_masks_every_tie_at_the_cut():
    # d² = 0.09, 0.09, 0, 0: mean 0.045 >= 0.04, dropping one 0.09 leaves 0.03 < 0.04. The tie
    # cannot be split by a rule on d² alone, so both go (AReaL drops one, chosen by sort order).
    logprobs, old, adv, mask = tokens([[0.3, -0.3, 0.0, 0.0]])
    _, grad, metrics = loss_and_grad(st.PolicyLoss("m2po", aggregation="token-sum"), logprobs, old, adv, mask)
    assert metrics["m2po/masked"] == 0.5
    assert grad[0, :2].tolist() == [0.0, 0.0]


def test_m2po_masks_everything_when_even_the_smallest_second_moment_reaches_tau():
    logprobs, old, adv, mask = tokens([[0.3, -0.25, 0.4]])  # every d² >= 0.0625 > 0.04
    loss, grad, metrics = loss_and_grad(st.PolicyLoss("m2po"), logprobs, old, adv, mask)
    assert loss.item() == 0.0
    assert torch.all(grad == 0)
    assert metrics["m2po/masked"] == 1.0


def test_m2po_mask_does_not_depend_on_the_micro_batch_split():
    logprobs, old, advantages, mask = random_batch(batch=12, length=9, seed=61, spread=0.25)
    loss_fn = st.PolicyLoss("m2po", aggregation="token-sum")
    state = loss_fn.batch_state(logprobs, old, advantages, mask)
    _, whole_grad, whole = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    assert 0.05 < whole["m2po/masked"] < 0.95  # the mask is active on this batch
    split_grads, local_grads = [], []
    for rows in (slice(0, 3), slice(3, 4), slice(4, 12)):
        args = (logprobs[rows], old[rows], advantages[rows], mask[rows])
        split_grads.append(loss_and_grad(loss_fn, *args, state=state)[1])
        local_grads.append(loss_and_grad(loss_fn, *args)[1])  # each micro-batch's own cut (AReaL's way)
    torch.testing.assert_close(torch.cat(split_grads), whole_grad, rtol=0, atol=0)
    assert not torch.equal(torch.cat(local_grads), whole_grad)  # what state= prevents


AREAL_CASES = json.loads((Path(__file__).parent / "data" / "m2po_areal.json").read_text())["cases"]


@pytest.mark.numerics
@pytest.mark.parametrize("case", AREAL_CASES, ids=lambda case: f"seed{case['seed']}")
def test_m2po_mask_equals_areal_on_one_batch(case):
    """AReaL 1.0.4's own ``_apply_m2po_masking`` output, recorded by tests/data/make_m2po_areal.py.

    One whole batch, no ties, not every d² >= τ: there the two agree token for token
    (they differ only in ties, in the all-masked case, and in AReaL's per-micro-batch use).
    """
    old, prox = torch.tensor(case["old"]), torch.tensor(case["prox"])  # π_prox = the current log-probs
    mask = torch.tensor(case["mask"])
    advantages = torch.ones(old.shape[0], dtype=torch.float64)
    loss_fn = st.PolicyLoss("m2po", aggregation="token-sum", tau=case["tau"])
    _, grad, _ = loss_and_grad(loss_fn, prox, old, advantages, mask)
    assert torch.equal(grad != 0, torch.tensor(case["areal_keep"]))


def test_m2po_threshold_is_the_sorted_suffix_rule():
    gen = torch.Generator().manual_seed(62)
    d2 = torch.rand(7, 11, generator=gen, dtype=torch.float64) * 0.2
    mask = (torch.rand(7, 11, generator=gen) < 0.6).double()
    cut = st.methods.selection.m2po_threshold(d2, mask, 0.04)
    kept = d2[(mask > 0) & (d2 < cut)]
    dropped = d2[(mask > 0) & (d2 >= cut)]
    assert kept.mean() < 0.04
    assert dropped.numel() > 0
    # the fewest: putting back the smallest dropped value breaks the bound
    assert torch.cat([kept, dropped.min().reshape(1)]).mean() >= 0.04


# --- BAPO ------------------------------------------------------------------------------------------


def bapo_state(log_ratios, advantages, **params):
    logprobs, old, adv, mask = tokens(log_ratios, advantages)
    state = st.PolicyLoss("bapo", **params).batch_state(logprobs, old, adv, mask)
    return state["bapo/low"].item(), state["bapo/high"].item(), state["bapo/positive_share"].item()


@pytest.mark.numerics
def test_bapo_raises_the_upper_bound_until_positive_tokens_carry_the_target_share():
    # positive token r = 2, A = 1: P = min(2, c_high); negative token r = 1, A = -1: N = 1.
    # ρ = P/(P+1) >= 0.58 needs P >= 1.381: c_high = 1.2 + 4·0.05 = 1.4 (1.35 gives 0.574)
    low, high, share = bapo_state([[math.log(2.0)], [0.0]], [1.0, -1.0], target=0.58)
    assert (low, high) == pytest.approx((0.6, 1.4))
    assert share == pytest.approx(1.4 / 2.4)


@pytest.mark.numerics
def test_bapo_walks_the_lower_bound_after_the_upper_reaches_its_maximum():
    # P <= 2 so ρ <= 2/3 < 0.9: c_high goes to 3.0, then c_low to 0.9, and the walk stops there
    low, high, share = bapo_state([[math.log(2.0)], [0.0]], [1.0, -1.0], target=0.9)
    assert (low, high) == pytest.approx((0.9, 3.0))
    assert share == pytest.approx(2 / 3)


def test_bapo_keeps_the_start_bounds_when_the_target_is_met_or_nothing_is_negative():
    assert bapo_state([[0.0], [0.0]], [1.0, -1.0])[:2] == pytest.approx((0.6, 1.2))  # ρ = 0.5 >= 0.4
    assert bapo_state([[1.0], [0.5]], [1.0, 2.0], target=1.0)[:2] == pytest.approx((0.6, 1.2))  # ρ = 1


@pytest.mark.numerics
def test_bapo_loss_is_the_clip_at_the_searched_bounds():
    logprobs, old, adv, mask = tokens([[math.log(2.0)], [math.log(0.5)]], [1.0, -1.0])
    # N = max(0.5, c_low) = 0.6; ρ = P/(P + 0.6) >= 0.69 needs P >= 1.3355: c_high = 1.35
    loss, grad, _ = loss_and_grad(
        st.PolicyLoss("bapo", aggregation="token-sum", target=0.69), logprobs, old, adv, mask
    )
    # bounds [0.6, 1.35]: the positive token is clipped at 1.35 (no gradient), the negative one at 0.6
    assert loss.item() == pytest.approx(-1.35 + 0.6)
    assert grad.tolist() == [[0.0], [0.0]]
    loss, grad, _ = loss_and_grad(
        st.PolicyLoss("bapo", aggregation="token-sum", target=0.9), logprobs, old, adv, mask
    )
    # bounds [0.9, 3.0]: the positive token is inside (gradient -r·A = -2), the negative one still clipped
    assert loss.item() == pytest.approx(-2.0 + 0.9)
    assert grad.tolist() == [[-2.0], [0.0]]


@pytest.mark.numerics
def test_bapo_grid_follows_the_paper_defaults():
    lows, highs = st.BAPO().bounds_grid()
    assert len(lows) == 1 + 36 + 15
    assert (lows[0], highs[0], lows[36], highs[36], lows[-1], highs[-1]) == pytest.approx(
        (0.6, 1.2, 0.6, 3.0, 0.9, 3.0)
    )
    assert st.BAPO(low_max=0.61).bounds_grid() == ([0.6], [1.2])  # c_low + δ₂ > b⁻: the loop never runs


# --- Reject ----------------------------------------------------------------------------------------


def reject_weight(correction, log_rho, mask=None):
    """The Reject keep weight through PolicyLoss: REINFORCE with logprobs 0 and A = -1 per row, token-sum."""
    log_rho = torch.tensor(log_rho, dtype=torch.float64)
    mask = torch.ones_like(log_rho, dtype=torch.bool) if mask is None else torch.tensor(mask)
    old = torch.zeros_like(log_rho)
    loss_fn = st.PolicyLoss("reinforce", correction=correction, aggregation="token-sum")
    _, grad, _ = loss_and_grad(
        loss_fn,
        torch.zeros_like(log_rho),
        old,
        -torch.ones(log_rho.shape[0], dtype=torch.float64),
        mask,
        rollout_logprobs=old - log_rho,
    )
    return grad  # dℓ/dlogp = w·m per token (A = -1, so -w·A = w)


LOG_RHO = [[0.1, -0.3, 0.05], [0.02, -0.01, 0.0], [0.6, 0.0, 0.0]]


def k3(x):
    return math.exp(x) - 1 - x


@pytest.mark.parametrize(
    ("correction", "expected_rows"),
    [
        # k3 per token: 0.0052, 0.0408, 0.0013 | 0.0002, 0.00005, 0 | 0.222, 0, 0
        (st.Reject("k3", "token", high=0.01), [[1, 0, 1], [1, 1, 1], [0, 1, 1]]),
        # sequence-sum k3: 0.0473 | 0.00025 | 0.222 -> high 0.05 keeps rows 0 and 1
        (st.Reject("k3", "sequence-sum", high=0.05), [[1] * 3, [1] * 3, [0] * 3]),
        # sequence-mean k3: 0.0158 | 0.00008 | 0.074
        (st.Reject("k3", "sequence-mean", high=0.01), [[0] * 3, [1] * 3, [0] * 3]),
        # sequence-max k2 = ½(log ρ)²: 0.045 | 0.0002 | 0.18
        (st.Reject("k2", "sequence-max", high=0.05), [[1] * 3, [1] * 3, [0] * 3]),
        # k1 = -log ρ, two-sided on the sequence sum: 0.15 | -0.01 | -0.6
        (st.Reject("k1", "sequence-sum", low=-0.1, high=0.2), [[1] * 3, [1] * 3, [0] * 3]),
        # geometric-mean ratio exp(mean log ρ): e^-0.05 | e^0.0033 | e^0.2
        (st.Reject("ratio", "sequence-mean", low=0.97, high=1.1), [[0] * 3, [1] * 3, [0] * 3]),
        # veto: any token ρ < 0.8 (e^-0.3 = 0.74) drops the whole sequence
        (st.Reject("k3", "token", high=1.0, veto=0.8), [[0] * 3, [1] * 3, [1] * 3]),
    ],
    ids=repr,
)
def test_reject_closed_form(correction, expected_rows):
    assert reject_weight(correction, LOG_RHO).tolist() == expected_rows


def test_reject_statistics_match_the_hand_values_at_the_bounds():
    mean_k3 = sum(k3(x) for x in LOG_RHO[0]) / 3
    assert reject_weight(st.Reject("k3", high=mean_k3 * (1 + 1e-9)), [LOG_RHO[0]]).tolist() == [[1] * 3]
    assert reject_weight(st.Reject("k3", high=mean_k3 * (1 - 1e-9)), [LOG_RHO[0]]).tolist() == [[0] * 3]


def test_reject_sequence_statistics_use_active_tokens_only():
    # the masked 0.6 token would break the bound; masked, it does not count (and its weight is 0)
    grad = reject_weight(st.Reject("k2", "sequence-max", high=0.05), [[0.1, 0.6]], mask=[[True, False]])
    assert grad.tolist() == [[1.0, 0.0]]


@pytest.mark.numerics
def test_reject_is_a_mask_on_the_loss_never_folded_into_vespo_w():
    logprobs, old, advantages, mask = random_batch(batch=4, length=5, seed=63, spread=0.2)
    rollout = old.clone()
    rollout[0] -= 1.0  # row 0: log ρ = +1 per token, far past any k3 bound
    loss_fn = st.PolicyLoss("vespo", correction=st.Reject("k3", high=0.01), aggregation="token-sum")
    loss, grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    plain = st.PolicyLoss("vespo", aggregation="token-sum")
    kept = mask.clone()
    kept[0] = False
    expected, expected_grad, _ = loss_and_grad(plain, logprobs, old, advantages, kept)
    assert loss.item() == pytest.approx(expected.item(), rel=F64_PARITY)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.numerics
def test_reject_combines_with_one_importance_correction():
    logprobs, old, advantages, mask = random_batch(batch=3, length=4, seed=64, spread=0.2)
    rollout = old + 0.05
    both = st.PolicyLoss(
        "clip", correction=[st.TIS(cap=2.0), st.Reject("k3", high=1.0)], aggregation="token-sum"
    )
    tis = st.PolicyLoss("clip", correction=st.TIS(cap=2.0), aggregation="token-sum")
    kwargs = {"rollout_logprobs": rollout}
    assert both(logprobs, old, advantages, mask, **kwargs).loss.item() == pytest.approx(
        tis(logprobs, old, advantages, mask, **kwargs).loss.item(), rel=F64_PARITY
    )  # nothing rejected: the TIS loss unchanged


def test_reject_non_finite_sampler_value_gives_a_non_finite_loss():
    logprobs, old, advantages, mask = random_batch(batch=3, length=4, seed=65)
    rollout = old.clone()
    rollout[1, 0] = math.nan
    loss_fn = st.PolicyLoss("clip", correction=st.Reject("k3", "sequence-max"), check_values=False)
    assert not torch.isfinite(loss_fn(logprobs, old, advantages, mask, rollout_logprobs=rollout).loss)


def test_reject_needs_rollout_logprobs():
    logprobs, old, advantages, mask = random_batch(batch=2, length=3)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        st.PolicyLoss("clip", correction=st.Reject())(logprobs, old, advantages, mask)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: st.Reject("k4"), r"divergence must be one of \['k1', 'k2', 'k3', 'ratio'\], got 'k4'"),
        (lambda: st.Reject(level="sequence"), r"level must be one of .*got 'sequence'"),
        (lambda: st.Reject("ratio", low=0.0, high=2.0), r"low must be > 0.0, got 0.0"),
        (lambda: st.Reject("k3", high=-0.1), r"high must be >= 0.0, got -0.1"),
        (lambda: st.Reject("k1", low=0.2, high=0.1), r"Reject needs low < high, got low=0.2, high=0.1"),
        (lambda: st.Reject(high=None), r"Reject needs at least one of low, high or veto"),
        (lambda: st.Reject(veto=1.5), r"veto must be < 1.0, got 1.5"),
        (lambda: st.PolicyLoss("clip", correction=[st.Reject(), st.Reject()]), r"at most one Reject"),
        (lambda: st.M2PO(tau=0.0), r"tau must be > 0.0, got 0.0"),
        (lambda: st.BAPO(target=0.0), r"target must be > 0.0, got 0.0"),
        (lambda: st.BAPO(low_start=1.0), r"low_start must be < 1.0, got 1.0"),
        (lambda: st.BAPO(high_start=0.9), r"high_start must be > 1.0, got 0.9"),
        (lambda: st.BAPO(high_max=1.1), r"high_max must be >= high_start = 1.2, got 1.1"),
        (lambda: st.BAPO(low_step=0.0), r"low_step must be > 0.0, got 0.0"),
        (lambda: st.PolicyLoss("m2po", level="sequence-mean"), r"not supported by method 'm2po'"),
    ],
)
def test_error_invalid_parameters(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


VERL = json.loads((Path(__file__).parent / "data" / "reject_verl.json").read_text())
VERL_LEVELS = {
    "token": "token",
    "seq_sum": "sequence-sum",
    "seq_mean": "sequence-mean",
    "seq_max": "sequence-max",
}


def reject_from_verl(option: str, spec: str) -> st.Reject:
    """docs/methods.md's mapping: ``*_k1 "L_U"`` -> k1 in [log L, log U]; k2/k3 "U" -> high=U."""
    level, divergence = option.rsplit("_", 1)
    if divergence == "k1":
        low, high = (float(v) for v in spec.split("_"))
        return st.Reject("k1", VERL_LEVELS[level], low=math.log(low), high=math.log(high))
    return st.Reject(divergence, VERL_LEVELS[level], high=float(spec))


@pytest.mark.numerics
@pytest.mark.parametrize("option", list(VERL["thresholds"]))
def test_reject_equals_verl_rollout_rs(option):
    """verl 0.9.1's own masks, recorded by tests/data/make_reject_verl.py (float64, 16 x 12, 25% masked)."""
    log_rho = torch.tensor(VERL["log_rho"])
    mask = torch.tensor(VERL["mask"])
    weight = reject_weight(
        reject_from_verl(option, VERL["thresholds"][option]), log_rho.tolist(), mask.tolist()
    )
    verl_mask = torch.tensor(VERL["verl_masks"][option])
    assert 0 < (verl_mask.sum() / mask.sum()) < 1  # the bound is active on this batch
    assert torch.equal(weight, verl_mask)


@pytest.mark.numerics
@pytest.mark.costly
@pytest.mark.parametrize(
    ("level", "high"),
    [("token", 0.02), ("sequence-sum", 0.02), ("sequence-mean", 0.004), ("sequence-max", 0.02)],
)
def test_reject_compiles_with_fullgraph(level, high):
    logprobs, old, advantages, mask = random_batch(batch=3, length=5, seed=72, spread=0.3)
    rollout = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(73), dtype=old.dtype)
    correction = [st.TIS(cap=1.5), st.Reject("k3", level, low=0.0, high=high, veto=0.8)]
    loss_fn = st.PolicyLoss("m2po", correction=correction)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss, grad, metrics = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    loss_c, grad_c, metrics_c = loss_and_grad(
        compiled, logprobs, old, advantages, mask, rollout_logprobs=rollout
    )
    assert 0 < metrics["reject/dropped"] < 1
    assert loss_c.item() == pytest.approx(loss.item(), rel=F64_PARITY)
    torch.testing.assert_close(grad_c, grad, rtol=F64_PARITY, atol=F64_ABS)
    assert metrics_c == pytest.approx(metrics, rel=F32_METRIC, nan_ok=True)
