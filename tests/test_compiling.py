"""``st.compile_loss``: many compiled losses in one process, each with its own recompile budget."""

from __future__ import annotations

import pytest
import torch

import softtrust as st

from helpers import loss_and_grad, random_batch


def _distinct_losses() -> list[st.PolicyLoss]:
    """More than dynamo's default recompile limit (8) of distinct losses: every method, then one
    method at several hyperparameter values (each value is a constant of its graph)."""
    return [st.PolicyLoss(name) for name in st.METHODS] + [
        st.PolicyLoss("clip", eps_high=0.2 + i / 100) for i in range(4)
    ]


def test_more_than_eight_distinct_losses_compile_whole_in_one_process():
    """``torch.compile(loss_fn, fullgraph=True)`` shares one cache among all callable objects (the
    9th distinct loss raised FailOnRecompileLimitHit); ``compile_loss`` gives each its own."""
    torch._dynamo.reset()
    losses = _distinct_losses()
    assert len(losses) > torch._dynamo.config.recompile_limit
    batch = random_batch(4, 6, seed=1, dtype=torch.float32)
    for loss_fn in losses:
        compiled = st.compile_loss(loss_fn, fullgraph=True, backend="aot_eager")
        value, grad, _ = loss_and_grad(compiled, *batch)
        expected_value, expected_grad, _ = loss_and_grad(loss_fn, *batch)
        torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_one_compiled_loss_recompiles_for_a_new_dtype_and_keeps_its_values():
    torch._dynamo.reset()
    loss_fn = st.PolicyLoss("vespo")
    compiled = st.compile_loss(loss_fn, fullgraph=True, backend="aot_eager")
    for dtype in (torch.float32, torch.float64):
        batch = random_batch(3, 5, seed=2, dtype=dtype)
        torch.testing.assert_close(loss_and_grad(compiled, *batch)[:2], loss_and_grad(loss_fn, *batch)[:2])


def test_compile_loss_refuses_a_non_callable():
    with pytest.raises(ValueError, match="loss_fn must be callable .*got str"):
        st.compile_loss("vespo")
