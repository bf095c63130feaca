"""Behaviour corrections: self-normalised TIS/MIS (verl's ``rollout_is_batch_normalize``).

The weight a correction applies is read through the public loss: REINFORCE under ``token-sum``
with advantages 1 has ``∂L/∂logp_t = -w_t`` at every active token.
"""

from __future__ import annotations

import math

import pytest
import torch

import softtrust as st
from softtrust.corrections import IS_WEIGHT_MEAN
from softtrust.train.loss_config import build_correction

from helpers import loss_and_grad, random_batch

CORRECTIONS = [
    ("tis", "token"),
    ("tis", "sequence"),
    ("mis", "token"),
    ("mis", "sequence"),
]


def make(kind: str, level: str, self_normalize: bool = True):
    if kind == "tis":
        return st.TIS(cap=1.2, level=level, self_normalize=self_normalize)
    return st.MIS(low=0.8, high=1.3, level=level, self_normalize=self_normalize)


def sampler_batch(seed=3, batch=7, length=6):
    """A batch whose sampler log-probs differ from the old ones enough that TIS truncates and MIS
    masks some weights, with one row that has no active token."""
    logprobs, old, _, mask = random_batch(batch, length, seed=seed, spread=0.2)
    generator = torch.Generator().manual_seed(seed + 100)
    rollout = old + 0.3 * torch.randn(batch, length, generator=generator, dtype=old.dtype)
    mask[-1] = False  # a row with no active token: verl's sequence mean leaves it out
    return logprobs, old, rollout, mask


def applied_weights(correction, logprobs, old, rollout, mask, **kwargs):
    """[B, T] the weight the loss applies to each active token (0 elsewhere)."""
    loss_fn = st.PolicyLoss("reinforce", correction=correction, aggregation="token-sum")
    ones = torch.ones(logprobs.shape[0], dtype=logprobs.dtype)
    _, grad, _ = loss_and_grad(loss_fn, logprobs, old, ones, mask, rollout_logprobs=rollout, **kwargs)
    return -grad


@pytest.mark.parametrize(("kind", "level"), CORRECTIONS)
def test_self_normalized_weights_equal_verl_rollout_is_batch_normalize(kind, level):
    pytest.importorskip("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    logprobs, old, rollout, mask = sampler_batch()
    correction = make(kind, level)
    threshold = correction.cap if kind == "tis" else f"{correction.low}_{correction.high}"
    expected, verl_metrics = compute_rollout_correction_weights(
        old - rollout, mask.double(), level, threshold, rollout_is_batch_normalize=True
    )
    weights = applied_weights(correction, logprobs, old, rollout, mask)
    # verl's masked_mean divides by (count + 1e-8): relative differences up to 1e-8 / count
    torch.testing.assert_close(weights[mask], expected[mask], rtol=1e-8, atol=0)
    # the data exercises what the convention is about: truncated or zeroed weights in the mean
    raw = applied_weights(make(kind, level, self_normalize=False), logprobs, old, rollout, mask)
    if kind == "tis":
        assert (raw[mask] == correction.cap).any()
    else:
        assert (raw[mask] == 0).any()
    assert verl_metrics["rollout_is_batch_norm_factor"] != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(("kind", "level"), CORRECTIONS)
def test_self_normalized_weights_are_the_raw_weights_over_their_batch_mean(kind, level):
    logprobs, old, rollout, mask = sampler_batch(seed=3)
    raw = applied_weights(make(kind, level, self_normalize=False), logprobs, old, rollout, mask)
    # token: over active tokens; sequence: one weight per row with an active token (token 0 is)
    mean = raw[mask].mean() if level == "token" else raw[mask.any(dim=1), 0].mean()
    assert 0 < mean < 1 or mean > 1
    weights = applied_weights(make(kind, level), logprobs, old, rollout, mask)
    torch.testing.assert_close(weights[mask], raw[mask] / mean, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("kind", "level"), CORRECTIONS)
@pytest.mark.parametrize("method", ["clip", "vespo", "m2po"])
def test_micro_batches_with_the_global_state_add_up_to_the_whole_batch(kind, level, method):
    logprobs, old, rollout, mask = sampler_batch(seed=7, batch=8)
    advantages = torch.linspace(-1, 1, 8, dtype=torch.float64)
    if method == "vespo" and level == "sequence":
        level = "token"  # either folds; keep both corrections' levels in the other methods
    loss_fn = st.PolicyLoss(method, correction=make(kind, level))
    assert loss_fn.uses_batch_state
    whole, whole_grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    state = loss_fn.batch_state(logprobs, old, advantages, mask, rollout)
    assert IS_WEIGHT_MEAN in state
    pieces, grads, local = 0.0, [], 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        args = (logprobs[rows], old[rows], advantages[rows], mask[rows])
        loss, grad, _ = loss_and_grad(
            loss_fn, *args, rollout_logprobs=rollout[rows], num_tokens=mask.sum(), state=state
        )
        pieces, grads = pieces + loss, [*grads, grad]
        local += loss_and_grad(loss_fn, *args, rollout_logprobs=rollout[rows], num_tokens=mask.sum())[0]
    torch.testing.assert_close(pieces, whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-14)
    assert not torch.isclose(local, whole, rtol=1e-6, atol=0), "each piece's own mean should differ"


def test_vespo_folds_the_self_normalized_token_weights_into_w():
    """Untruncated token TIS: w_t / mean = exp(old_t - (rollout_t + log mean)), so VESPO's
    W with self-normalised weights is W with every sampler log-prob raised by log mean:
    log W drops by n_i·log mean for a sequence of n_i tokens."""
    logprobs, old, rollout, mask = sampler_batch(seed=11)
    advantages = torch.linspace(-1, 1, old.shape[0], dtype=torch.float64)
    cap = 1e6  # never truncates
    raw = applied_weights(st.TIS(cap=cap), logprobs, old, rollout, mask)
    log_mean = math.log(raw[mask].mean().item())
    normalized = st.PolicyLoss("vespo", correction=st.TIS(cap=cap, self_normalize=True))
    shifted = st.PolicyLoss("vespo", correction=st.TIS(cap=cap))
    loss, grad, metrics = loss_and_grad(normalized, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    expected, expected_grad, _ = loss_and_grad(
        shifted, logprobs, old, advantages, mask, rollout_logprobs=rollout + log_mean
    )
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert metrics[IS_WEIGHT_MEAN] == pytest.approx(math.exp(log_mean), rel=1e-6)  # metrics read as float32


def test_a_vanishing_batch_mean_leaves_the_weights_as_they_are():
    """verl divides only when the mean exceeds 1e-8: every weight masked out stays 0, not 0/0."""
    logprobs, old, _, mask = sampler_batch()
    far = old - 5.0  # ρ = e^5 everywhere: outside MIS's band
    weights = applied_weights(
        st.MIS(low=0.5, high=2.0, level="token", self_normalize=True), logprobs, old, far, mask
    )
    assert torch.equal(weights, torch.zeros_like(weights))


def test_self_normalized_correction_compiles_whole():
    logprobs, old, rollout, mask = sampler_batch()
    advantages = torch.linspace(-1, 1, old.shape[0], dtype=torch.float64)
    loss_fn = st.PolicyLoss("clip", correction=st.TIS(cap=1.5, self_normalize=True), check_values=False)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager, eager_grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    value, grad, _ = loss_and_grad(compiled, logprobs, old, advantages, mask, rollout_logprobs=rollout)
    torch.testing.assert_close(value, eager, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad", ["yes", 1, None])
@pytest.mark.parametrize("factory", [st.TIS, st.MIS])
def test_error_self_normalize_not_a_bool(factory, bad):
    with pytest.raises(ValueError, match="self_normalize must be True or False"):
        factory(self_normalize=bad)


def test_corrections_take_their_parameters_by_position():
    assert st.TIS(3.0) == st.TIS(cap=3.0)
    assert st.MIS(0.5, 5.0, "token", True) == st.MIS(low=0.5, high=5.0, level="token", self_normalize=True)


def test_correction_spec_takes_self_normalize():
    assert build_correction("tis:cap=2,self_normalize=true") == st.TIS(cap=2.0, self_normalize=True)
    assert build_correction("mis:level=token,self_normalize=true+reject") == [
        st.MIS(level="token", self_normalize=True),
        st.Reject(),
    ]
    with pytest.raises(ValueError, match=r"^correction: .*self_normalize must be True or False"):
        build_correction("tis:self_normalize=maybe")
