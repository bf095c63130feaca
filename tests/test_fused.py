"""The fused path (closed-form slopes, one contraction) equals the reference (autograd) path."""

from __future__ import annotations

import pytest
import torch

import softtrust as st

from helpers import loss_and_grad, method_level_pairs, random_batch

FUSED_METHODS = [name for name, cls in st.METHODS.items() if cls().fusable]
FUSED_PAIRS = [(name, level) for name, level in method_level_pairs() if name in FUSED_METHODS]
CORRECTIONS = [None, st.TIS(cap=1.5), st.TIS(level="sequence"), st.MIS(low=0.8, high=1.25), st.OPSM(0.05)]


def test_every_method_but_gmpo_is_fused():
    assert sorted(FUSED_METHODS) == ["cfpo", "cispo", "clip", "gspo", "pspo", "reinforce", "sapo", "vespo"]


@pytest.mark.parametrize("token_advantages", [False, True])
@pytest.mark.parametrize("correction", CORRECTIONS, ids=repr)
@pytest.mark.parametrize("aggregation", st.AGGREGATIONS)
@pytest.mark.parametrize("method", FUSED_METHODS)
def test_fused_equals_reference_value_and_gradient(method, aggregation, correction, token_advantages):
    for level in st.METHODS[method].levels:
        logprobs, old, advantages, mask = random_batch(batch=6, length=9, seed=31, spread=0.4)
        gen = torch.Generator().manual_seed(32)
        rollout = old + 0.3 * torch.randn(old.shape, generator=gen, dtype=old.dtype)
        if token_advantages:
            advantages = torch.randn(old.shape, generator=gen, dtype=old.dtype)
        kwargs = {
            "level": level,
            "aggregation": aggregation,
            "correction": correction,
            "max_completion_length": 12,
        }
        fused = st.PolicyLoss(method, **kwargs)
        reference = st.PolicyLoss(method, fused=False, **kwargs)
        args = (old, advantages, mask)
        loss_f, grad_f, metrics_f = loss_and_grad(
            fused, logprobs, *args, rollout_logprobs=rollout, num_tokens=40
        )
        loss_r, grad_r, metrics_r = loss_and_grad(
            reference, logprobs, *args, rollout_logprobs=rollout, num_tokens=40
        )
        assert loss_f.item() == pytest.approx(loss_r.item(), rel=1e-12, abs=1e-14)
        torch.testing.assert_close(grad_f, grad_r, rtol=1e-12, atol=1e-14)
        assert metrics_f == pytest.approx(metrics_r, rel=1e-6, nan_ok=True)


def assert_fused_equals_reference(method, logprobs, old, advantages, mask, **kwargs):
    fused = st.PolicyLoss(method, **kwargs)
    reference = st.PolicyLoss(method, fused=False, **kwargs)
    loss_f, grad_f, metrics_f = loss_and_grad(fused, logprobs, old, advantages, mask)
    loss_r, grad_r, metrics_r = loss_and_grad(reference, logprobs, old, advantages, mask)
    assert loss_f.item() == pytest.approx(loss_r.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad_f, grad_r, rtol=1e-12, atol=1e-14)
    assert metrics_f == pytest.approx(metrics_r, rel=1e-6, nan_ok=True)
    return grad_f


CLIP_VARIANTS = [
    {"dual_clip": 3.0},
    {"delta": 1.5},
    {"delta": 1.1, "eps_high": 0.3},  # δ below 1 + ε_high: the cap binds before the clip
    {"dual_clip": 2.0, "delta": 1.5, "eps_low": 0.1, "eps_high": 0.28},
]


@pytest.mark.parametrize("level", ["token", "sequence-mean"])
@pytest.mark.parametrize("params", CLIP_VARIANTS, ids=repr)
def test_fused_clip_variants_equal_reference(params, level):
    # spread 1.0: many ratios beyond every bound, on both sides, with both advantage signs
    logprobs, old, advantages, mask = random_batch(batch=12, length=10, seed=36, spread=1.0)
    assert_fused_equals_reference("clip", logprobs, old, advantages, mask, level=level, **params)


@pytest.mark.parametrize(("method", "level"), FUSED_PAIRS)
def test_fused_on_policy_ties_equal_reference(method, level):
    """r = 1 exactly: Clip's two branches tie, every clamp sits inside its interval."""
    logprobs, _, advantages, mask = random_batch(batch=6, length=8, seed=37)
    grad = assert_fused_equals_reference(method, logprobs, logprobs, advantages, mask, level=level)
    scale = 0.9 if method == "pspo" else 1.0  # PSPO: (1-α)·A·∇logp on-policy
    count = mask.sum()
    expected = -scale * advantages[:, None] * mask / count
    torch.testing.assert_close(grad, expected.to(grad.dtype), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("method", "level"), FUSED_PAIRS)
def test_fused_log_ratios_beyond_the_clamp_equal_reference(method, level):
    """Token log-ratios of ±30 (clamped at ±20): zero gradient there, as ``clamp`` gives."""
    logprobs, old, advantages, mask = random_batch(batch=6, length=8, seed=38)
    old = old.clone()
    old[0, 0], old[1, 0], old[2, 3] = logprobs[0, 0] + 30, logprobs[1, 0] - 30, logprobs[2, 3] - 25
    mask[2, 3] = True
    assert_fused_equals_reference(method, logprobs, old, advantages, mask, level=level)


@pytest.mark.parametrize("compute_metrics", [False, True])
@pytest.mark.parametrize("shift", [0.0, 4.0], ids=["inside-the-clamp", "sequence-sums-beyond-it"])
@pytest.mark.parametrize(("method", "level"), FUSED_PAIRS)
def test_fused_token_mean_equals_reference(method, level, shift, compute_metrics):
    """Token-mean with the default token count: without metrics the fused path keeps no per-row
    counts and takes the count as a number; at sequence-sum it skips the clamp only when
    ``T·max|log r_t|`` proves it the identity (a wrong skip shows in the log W metrics).

    ``shift = 4`` puts every token log-ratio near +4, so long rows of 8 sum past the clamp of 20;
    with no shift the bound ``8·max|log r_t|`` is inside it.
    """
    logprobs, old, advantages, mask = random_batch(batch=6, length=8, seed=39)
    old = old - shift
    log_ratio = logprobs.detach() - old
    assert ((log_ratio * mask).sum(-1).max() > 20) == (shift > 0)  # the case the parameter names
    assert (8 * log_ratio.abs().max() <= 0.99 * 20) == (shift == 0)
    assert_fused_equals_reference(
        method, logprobs, old, advantages, mask, level=level, compute_metrics=compute_metrics
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_equals_reference_in_low_precision(dtype):
    logprobs, old, advantages, mask = random_batch(batch=8, length=32, seed=33, dtype=torch.float32)
    logprobs, old = logprobs.to(dtype), old.to(dtype)
    fused, reference = st.PolicyLoss("vespo"), st.PolicyLoss("vespo", fused=False)
    loss_f, grad_f, _ = loss_and_grad(fused, logprobs, old, advantages, mask)
    loss_r, grad_r, _ = loss_and_grad(reference, logprobs, old, advantages, mask)
    assert grad_f.dtype == dtype
    assert loss_f.item() == pytest.approx(loss_r.item(), rel=1e-5)
    torch.testing.assert_close(grad_f.float(), grad_r.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("compute_metrics", [True, False])
def test_fused_path_is_taken_for_finite_inputs_and_left_for_non_finite_ones(compute_metrics):
    logprobs, old, advantages, mask = random_batch(seed=34)
    leaf = logprobs.clone().requires_grad_(True)
    loss_fn = st.PolicyLoss("vespo", compute_metrics=compute_metrics)
    out = loss_fn(leaf, old, advantages, mask)
    assert type(out.loss.grad_fn).__name__ == "DotBackward0"  # the fused contraction
    poisoned = torch.where(mask, old, float("nan"))
    out = loss_fn(leaf, poisoned, advantages, mask)
    assert type(out.loss.grad_fn).__name__ != "DotBackward0"
    expected = st.PolicyLoss("vespo", fused=False)(leaf, old, advantages, mask).loss
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-12)  # masked NaN changes nothing


def test_fused_flag_off_uses_the_elementwise_path():
    logprobs, old, advantages, mask = random_batch(seed=35)
    out = st.PolicyLoss("vespo", fused=False)(logprobs.clone().requires_grad_(True), old, advantages, mask)
    assert type(out.loss.grad_fn).__name__ != "DotBackward0"
