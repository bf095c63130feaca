"""KL estimators (verl's names, the straight-through ``+`` forms) and the adaptive KL controller.

Oracles: verl 0.9.1's ``kl_penalty`` and ``AdaptiveKLController``, run at test time, and the
closed forms of the module docstring."""

from __future__ import annotations

import math

import pytest
import torch

import softtrust as st

from helpers import loss_and_grad, random_batch

# verl's names for softtrust's estimators (verl also spells k2 "mse", k3 "low_var_kl", k1 "kl")
VERL_NAMES = {"k1": "k1", "k2": "mse", "k3": "low_var_kl", "abs": "abs", "k1+": "k1+", "k3+": "low_var_kl+"}


def pair(seed=0, shape=(6, 9)):
    """Log-probs and reference log-probs 0.8 apart at most: verl's k3 clamps its value at 10."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = -3 * torch.rand(shape, generator=generator, dtype=torch.float64)
    ref = logprobs + 0.8 * (2 * torch.rand(shape, generator=generator, dtype=torch.float64) - 1)
    return logprobs, ref


def value_and_grad(fn, logprobs, *args):
    leaf = logprobs.clone().requires_grad_(True)
    value = fn(leaf, *args)
    (grad,) = torch.autograd.grad(value.sum(), leaf)
    return value.detach(), grad


@pytest.mark.parametrize("estimator", st.KL_ESTIMATORS)
def test_estimators_equal_verl_kl_penalty_in_value_and_gradient(estimator):
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import kl_penalty

    logprobs, ref = pair()
    value, grad = value_and_grad(st.kl_estimate, logprobs, ref, estimator)
    expected, expected_grad = value_and_grad(kl_penalty, logprobs, ref, VERL_NAMES[estimator])
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("estimator", "value"), [("k1+", lambda d: -d), ("k3+", lambda d: math.exp(d) - d - 1)]
)
def test_straight_through_estimators_take_their_value_and_the_k2_gradient(estimator, value):
    logprobs, ref = pair(seed=1)
    values, grad = value_and_grad(st.kl_estimate, logprobs, ref, estimator)
    expected = torch.tensor(
        [
            [value(r - lp) for lp, r in zip(*rows, strict=True)]
            for rows in zip(logprobs.tolist(), ref.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    assert torch.equal(values, st.kl_estimate(logprobs, ref, estimator[:-1]))  # exactly the value
    torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, logprobs - ref, rtol=1e-12, atol=1e-14)  # ∂k2/∂logp = logp - ref


def test_abs_is_the_absolute_log_ratio_with_sign_gradient():
    logprobs, ref = pair(seed=2)
    values, grad = value_and_grad(st.kl_estimate, logprobs, ref, "abs")
    torch.testing.assert_close(values, (logprobs - ref).abs(), rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.sign(logprobs - ref), rtol=0, atol=0)


def test_importance_corrected_k3_plus_equals_importance_corrected_k3():
    """Corrected, the + estimators weigh k2's gradient by a detached r: value r·k3, gradient
    r·(logp - ref), which is exactly the gradient of the corrected k3 with r in the graph."""
    logprobs, old, advantages, mask = random_batch(seed=31, spread=0.5)
    _, ref = pair(seed=3, shape=logprobs.shape)
    ref = logprobs + (ref - ref.mean())  # near logprobs
    losses = {}
    for estimator in ("k3", "k3+"):
        loss_fn = st.PolicyLoss(
            "clip", aggregation="token-sum", kl=st.KL(0.7, estimator, importance_corrected=True)
        )
        losses[estimator] = loss_and_grad(loss_fn, logprobs, old, advantages, mask, ref_logprobs=ref)
    torch.testing.assert_close(losses["k3+"][0], losses["k3"][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(losses["k3+"][1], losses["k3"][1], rtol=1e-10, atol=1e-12)
    # k1+ corrected: value r·k1, gradient r·(logp - ref); k1 corrected adds r (its own ∇ of r·k1)
    policy = st.PolicyLoss("reinforce", aggregation="token-sum")
    corrected = st.PolicyLoss(
        "reinforce", aggregation="token-sum", kl=st.KL(1.0, "k1+", importance_corrected=True)
    )
    _, base_grad, _ = loss_and_grad(policy, logprobs, old, advantages, mask)
    _, grad, metrics = loss_and_grad(corrected, logprobs, old, advantages, mask, ref_logprobs=ref)
    ratio = torch.exp(logprobs - old)
    torch.testing.assert_close(grad - base_grad, ratio * (logprobs - ref) * mask, rtol=1e-10, atol=1e-12)
    assert metrics["kl"] == pytest.approx(float((ratio * (logprobs - ref))[mask].mean()), rel=1e-6)


@pytest.mark.parametrize("estimator", ["k1+", "k3+", "abs"])
def test_new_estimators_compile_whole(estimator):
    logprobs, old, advantages, mask = random_batch(seed=5)
    _, ref = pair(seed=5, shape=logprobs.shape)
    loss_fn = st.PolicyLoss("vespo", kl=st.KL(0.2, estimator, importance_corrected=True), check_values=False)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager = loss_and_grad(loss_fn, logprobs, old, advantages, mask, ref_logprobs=ref)
    value = loss_and_grad(compiled, logprobs, old, advantages, mask, ref_logprobs=ref)
    torch.testing.assert_close(value[0], eager[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(value[1], eager[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad", ["k2+", "abs+", "low_var_kl", "K3", ""])
def test_error_unknown_estimator(bad):
    with pytest.raises(
        ValueError, match=r"estimator must be one of \['k1', 'k2', 'k3', 'abs', 'k1\+', 'k3\+'\]"
    ):
        st.KL(0.1, bad)


# ---------------------------------------------------------------------- the adaptive controller
def test_controller_follows_verl_adaptive_kl_controller():
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import AdaptiveKLController as VerlController

    ours = st.AdaptiveKLController(coef=0.05, target=0.02, horizon=500)
    theirs = VerlController(init_kl_coef=0.05, target_kl=0.02, horizon=500)
    for kl, n in [(0.05, 64), (0.021, 64), (0.0, 32), (0.019, 64), (1.0, 128), (0.02, 64), (1e-4, 7)]:
        ours.update(kl, n)
        theirs.update(kl, n)
        assert ours.coef == pytest.approx(theirs.value, rel=1e-15)


def test_controller_closed_form_and_its_bounds():
    controller = st.AdaptiveKLController(coef=1.0, target=0.1, horizon=100)
    assert controller.update(0.12, 10) == pytest.approx(1.0 * (1 + 0.2 * 10 / 100))  # 0.12/0.1 - 1 = 0.2
    assert controller.update(0.105, 10) == pytest.approx(1.02 * (1 + 0.05 * 0.1))
    before = controller.coef
    assert controller.update(100.0, 10) == pytest.approx(before * 1.02)  # clipped at +0.2
    before = controller.coef
    assert controller.update(0.0, 10) == pytest.approx(before * 0.98)  # clipped at -0.2
    before = controller.coef
    assert controller.update(math.nan, 10) == before  # a non-finite measurement changes nothing
    state = controller.state_dict()
    restored = st.AdaptiveKLController(coef=5.0, target=0.1, horizon=100)
    restored.load_state_dict(state)
    assert restored.coef == controller.coef


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coef": 0.0, "target": 0.1}, "coef must be > 0"),
        ({"coef": 0.1, "target": 0.0}, "target must be > 0"),
        ({"coef": 0.1, "target": math.inf}, "target must be a finite number"),
        ({"coef": 0.1, "target": 0.1, "horizon": -1}, "horizon must be > 0"),
    ],
)
def test_error_controller_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        st.AdaptiveKLController(**kwargs)


def test_kl_coef_replaces_the_coefficient_for_one_call():
    logprobs, old, advantages, mask = random_batch(seed=8)
    _, ref = pair(seed=8, shape=logprobs.shape)
    fixed = st.PolicyLoss("clip", kl=st.KL(0.3, "k3+"))
    chosen = st.PolicyLoss("clip", kl=st.KL(0.1, "k3+"))
    expected = loss_and_grad(fixed, logprobs, old, advantages, mask, ref_logprobs=ref)
    for coef in (0.3, torch.tensor(0.3, dtype=torch.float64)):
        value = loss_and_grad(chosen, logprobs, old, advantages, mask, ref_logprobs=ref, kl_coef=coef)
        torch.testing.assert_close(value[0], expected[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(value[1], expected[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("loss_fn", "coef", "message"),
    [
        (st.PolicyLoss("clip"), 0.1, "kl_coef=0.1 needs a KL term"),
        (st.PolicyLoss("clip", kl=st.KL(0.1)), -0.5, "kl_coef must be >= 0.0"),
        (st.PolicyLoss("clip", kl=st.KL(0.1)), torch.ones(2), "kl_coef must be a number or a 0-dim"),
    ],
)
def test_error_bad_kl_coef(loss_fn, coef, message):
    logprobs, old, advantages, mask = random_batch(seed=8)
    with pytest.raises(ValueError, match=message):
        loss_fn(logprobs, old, advantages, mask, ref_logprobs=logprobs, kl_coef=coef)


@pytest.mark.parametrize("corrected", [False, True])
@pytest.mark.parametrize("estimator", st.KL_ESTIMATORS)
def test_kl_term_over_micro_batches_adds_up_to_the_whole_batch(estimator, corrected):
    """With the global token count, micro-batch losses (KL term included) sum to the whole batch's."""
    logprobs, old, advantages, mask = random_batch(8, 6, seed=21)
    ref = logprobs.detach() + 0.3 * torch.randn(
        logprobs.shape, generator=torch.Generator().manual_seed(4), dtype=logprobs.dtype
    )
    loss_fn = st.PolicyLoss("clip", kl=st.KL(coef=0.2, estimator=estimator, importance_corrected=corrected))
    whole, whole_grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, ref_logprobs=ref)
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 8)):
        piece = loss_and_grad(
            loss_fn,
            logprobs[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            ref_logprobs=ref[rows],
            num_tokens=mask.sum(),
        )
        total, grads = total + piece[0], [*grads, piece[1]]
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-14)
