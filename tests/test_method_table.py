"""Every registered method against its expected formula (tests/expected_methods.py), and compiled."""

from __future__ import annotations

import pytest
import torch

import softtrust as st

from budgets import F32_METRIC, F64_ABS, F64_GRADIENT, F64_PARITY
from expected_methods import EXPECTED, expected_loss
from helpers import loss_and_grad, method_level_pairs, random_batch

pytestmark = (
    pytest.mark.numerics
)  # every method against its formula, and compiled: the outcome depends on float paths


def test_every_registered_method_has_an_expected_formula():
    assert set(EXPECTED) == set(st.METHODS)


@pytest.mark.parametrize("aggregation", st.AGGREGATIONS)
@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_value_and_gradient_equal_the_expected_formula(method, level, aggregation):
    # spread 0.8: ratios far from 1, so clips, gates and kernels are active; 0.3 of tokens masked
    logprobs, old, advantages, mask = random_batch(batch=6, length=8, seed=31, spread=0.8)
    mask[5] = False  # a row with no active token
    loss_fn = st.PolicyLoss(method, level=level, aggregation=aggregation)
    loss, grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    leaf = logprobs.clone().requires_grad_(True)
    expected = expected_loss(loss_fn.method, level, aggregation, leaf, old, advantages, mask)
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert loss.item() == pytest.approx(expected.item(), rel=F64_PARITY, abs=F64_ABS)
    torch.testing.assert_close(grad, expected_grad, rtol=F64_GRADIENT, atol=F64_ABS)


@pytest.mark.costly  # ~40 s: one compilation per method and level
@pytest.mark.parametrize(("method", "level"), method_level_pairs())
def test_compiled_loss_equals_eager_in_value_gradient_and_metrics(method, level):
    """``torch.compile(fullgraph=True)`` (backend ``aot_eager``: no compiler needed) for every method
    and level, with a correction and a KL term: no host sync or data-dependent branch breaks the graph."""
    logprobs, old, advantages, mask = random_batch(batch=3, length=5, seed=32, spread=0.5)
    rollout = old + 0.1
    loss_fn = st.PolicyLoss(method, level=level, correction=st.TIS(cap=1.5), kl=st.KL(0.05))
    torch._dynamo.reset()  # every PolicyLoss compiles the same __call__: start each from an empty cache
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    kwargs = {"rollout_logprobs": rollout, "ref_logprobs": old - 0.2}
    loss, grad, metrics = loss_and_grad(loss_fn, logprobs, old, advantages, mask, **kwargs)
    loss_c, grad_c, metrics_c = loss_and_grad(compiled, logprobs, old, advantages, mask, **kwargs)
    assert loss_c.item() == pytest.approx(loss.item(), rel=F64_PARITY)
    torch.testing.assert_close(grad_c, grad, rtol=F64_PARITY, atol=F64_ABS)
    assert metrics_c == pytest.approx(metrics, rel=F32_METRIC, nan_ok=True)
