"""Small shared helpers for the loss tests (not a test module)."""

from __future__ import annotations

import torch

import softtrust as st


def allowed_levels(method: str) -> tuple[str, ...]:
    return st.METHODS[method].levels


def method_level_pairs() -> list[tuple[str, str]]:
    return [(name, level) for name in st.METHODS for level in allowed_levels(name)]


def random_batch(batch=5, length=7, seed=0, spread=0.3, dtype=torch.float64, active=0.7):
    """Random (logprobs, old, advantages, mask) with at least one active token per row."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, length, generator=gen, dtype=dtype) * 3
    old = logprobs + spread * torch.randn(batch, length, generator=gen, dtype=dtype)
    advantages = torch.randn(batch, generator=gen, dtype=dtype)
    mask = torch.rand(batch, length, generator=gen) < active
    mask[:, 0] = True
    return logprobs, old, advantages, mask


def loss_and_grad(loss_fn, logprobs, *args, **kwargs):
    """(loss, d loss / d logprobs, metrics) for a PolicyLoss call."""
    leaf = logprobs.detach().clone().requires_grad_(True)
    out = loss_fn(leaf, *args, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf, allow_unused=False)
    return out.loss.detach(), grad, out.metric_values()


def single_token(method, log_r, advantage, **method_params):
    """ℓ and dℓ/dlogp for one token: B = T = 1, token-sum aggregation, logp = 0 - so old = -log r."""
    loss_fn = st.PolicyLoss(method, aggregation="token-sum", **method_params)
    logprobs = torch.zeros(1, 1, dtype=torch.float64)
    old = torch.full((1, 1), -float(log_r), dtype=torch.float64)
    adv = torch.tensor([float(advantage)], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, grad, _ = loss_and_grad(loss_fn, logprobs, old, adv, mask)
    return loss.item(), grad.item()
