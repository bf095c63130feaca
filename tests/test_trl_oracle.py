"""Tests of the TRL oracle harness (tests/trl_oracle.py) against closed forms.

Each expected value is derived by hand from the GRPO-family formulas, not from TRL's
code, so a broken harness (wrong normaliser, wrong mode, lost gradient, float32
leakage) fails here before any parity test relies on it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("trl")

import trl

from budgets import EPS64, F64_PARITY, rounding_budget
from trl_oracle import TRL_VERSION, make_trl_trainer, trl_loss_and_grad

pytestmark = pytest.mark.numerics  # TRL's own loss against closed forms: the outcome depends on float paths

F64 = torch.float64
# TRL's float64 loss against a closed form over <= ~30 tokens of terms <= ~1: eps64·√30 ≈ 1.2e-15
# absolute, ×10; relative: budgets.F64_PARITY (measured: 1.4e-17 absolute)
EXACT = {"rtol": F64_PARITY, "atol": rounding_budget(EPS64, terms=30)}

# Completion lengths of the crafted micro-batch; the 0 row checks empty sequences.
LENGTHS = (6, 3, 1, 5)
LENGTHS_WITH_EMPTY = (6, 0, 2, 5)


def _batch(lengths=LENGTHS, seed: int = 0, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    logprobs = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    advantages = torch.randn(B, generator=g, dtype=F64)
    advantages = torch.where(advantages.abs() < 0.1, torch.full_like(advantages, 0.5), advantages)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    return logprobs, advantages, mask


def test_trl_version():
    assert trl.__version__ == TRL_VERSION


def test_trainer_is_real_and_cpu(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", gradient_accumulation_steps=3)
    assert isinstance(trainer, trl.GRPOTrainer)
    assert trainer.loss_type == "bnpo"
    assert trainer.args.gradient_accumulation_steps == 3
    assert trainer.args.steps_per_generation == 3  # TRL default: = gradient_accumulation_steps
    assert trainer.accelerator.device.type == "cpu"
    assert not trainer.use_vllm
    assert not trainer.args.bf16 and not trainer.args.fp16
    assert trainer.ref_model is None


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_bnpo_on_policy_closed_form(tmp_path, grad_accum):
    # On-policy r = 1 lies inside the clip range, so the per-token loss is -A with
    # d/d logp = -A; bnpo divides by the tokens of the micro-batch and by grad_accum.
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", gradient_accumulation_steps=grad_accum)
    logprobs, adv, mask = _batch()
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask)
    norm = mask.sum() * grad_accum
    assert loss.dtype == F64 and grad.dtype == F64 and grad.shape == logprobs.shape
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / norm, **EXACT)
    torch.testing.assert_close(grad, -adv[:, None] * mask / norm, **EXACT)


def test_eval_mode_has_no_accumulation_divisor(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", gradient_accumulation_steps=4)
    logprobs, adv, mask = _batch()
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask, train=False)
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / mask.sum(), **EXACT)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum(), **EXACT)


def test_grpo_per_sequence_mean_with_empty_row(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="grpo", gradient_accumulation_steps=2)
    logprobs, adv, mask = _batch(LENGTHS_WITH_EMPTY)
    B = mask.shape[0]
    lengths = mask.sum(-1)
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask)
    # Each non-empty sequence contributes -A_i; the empty one 0 but still counts in the mean.
    torch.testing.assert_close(loss, -(adv * (lengths > 0)).sum() / B / 2, **EXACT)
    expected = -adv[:, None] * mask / lengths.clamp(min=1)[:, None] / B / 2
    torch.testing.assert_close(grad, expected, **EXACT)


def test_dr_grpo_constant_normaliser(tmp_path):
    trainer = make_trl_trainer(
        tmp_path, loss_type="dr_grpo", max_completion_length=7, gradient_accumulation_steps=2
    )
    logprobs, adv, mask = _batch()
    B = mask.shape[0]
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask)
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / (B * 7) / 2, **EXACT)
    torch.testing.assert_close(grad, -adv[:, None] * mask / (B * 7) / 2, **EXACT)


def test_dapo_normaliser_uses_num_items_in_batch(tmp_path):
    # N = num_items_in_batch / num_processes * grad_accum / steps_per_generation.
    trainer = make_trl_trainer(
        tmp_path, loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4
    )
    logprobs, adv, mask = _batch()
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask, num_items_in_batch=37)
    norm = 37 * 2 / 4
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / norm, **EXACT)
    torch.testing.assert_close(grad, -adv[:, None] * mask / norm, **EXACT)
    # Default num_items_in_batch: this micro-batch's tokens times steps_per_generation.
    loss, _ = trl_loss_and_grad(trainer, logprobs, None, adv, mask)
    norm = mask.sum() * 4 * 2 / 4
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / norm, **EXACT)
    # Eval mode: the count alone.
    loss, _ = trl_loss_and_grad(trainer, logprobs, None, adv, mask, num_items_in_batch=37, train=False)
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / 37, **EXACT)


def test_grpo_token_clipping_off_policy(tmp_path):
    eps_low, eps_high = 0.2, 0.28
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", epsilon=eps_low, epsilon_high=eps_high)
    logprobs, adv, mask = _batch()
    g = torch.Generator().manual_seed(1)
    old = logprobs + (torch.rand(logprobs.shape, generator=g, dtype=F64) - 0.5) * 1.2
    loss, grad = trl_loss_and_grad(trainer, logprobs, old, adv, mask)
    r = torch.exp(logprobs - old)
    a = adv[:, None]
    objective = torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
    clipped = ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low))
    assert clipped[mask.bool()].any() and (~clipped)[mask.bool()].any()  # both branches exercised
    torch.testing.assert_close(loss, -(objective * mask).sum() / mask.sum(), **EXACT)
    torch.testing.assert_close(grad, -a * r * (~clipped) * mask / mask.sum(), **EXACT)


def test_cispo_off_policy(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="cispo", epsilon_high=1.1)
    logprobs, adv, mask = _batch()
    g = torch.Generator().manual_seed(2)
    old = logprobs + (torch.rand(logprobs.shape, generator=g, dtype=F64) - 0.5) * 0.8
    loss, grad = trl_loss_and_grad(trainer, logprobs, old, adv, mask)
    weight = torch.exp(logprobs - old).clamp(max=1.1)  # detached in CISPO
    norm = mask.sum()  # default num_items_in_batch, grad_accum = steps_per_generation = 1
    torch.testing.assert_close(loss, -(weight * adv[:, None] * logprobs * mask).sum() / norm, **EXACT)
    torch.testing.assert_close(grad, -weight * adv[:, None] * mask / norm, **EXACT)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_term(tmp_path, bias_correction):
    beta = 0.3
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", beta=beta, use_bias_correction_kl=bias_correction)
    logprobs, adv, mask = _batch()
    g = torch.Generator().manual_seed(3)
    ref = logprobs + torch.randn(logprobs.shape, generator=g, dtype=F64) * 0.5
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask, ref_logprobs=ref)
    d = ref - logprobs
    kl = torch.exp(d) - d - 1  # k3 estimator
    dkl = 1 - torch.exp(d)
    if bias_correction:  # kl * r with r = 1 on-policy but d r / d logp = 1
        dkl = dkl + kl
    a = adv[:, None]
    torch.testing.assert_close(loss, ((-a + beta * kl) * mask).sum() / mask.sum(), **EXACT)
    torch.testing.assert_close(grad, (-a + beta * dkl) * mask / mask.sum(), **EXACT)


def test_sapo_on_policy_and_float64_constants(tmp_path):
    tau_pos, tau_neg = 1.0, 1.05
    trainer = make_trl_trainer(
        tmp_path, loss_type="sapo", sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg
    )
    logprobs, adv, mask = _batch()
    assert (adv < 0).any()
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
    B = mask.shape[0]
    # sigmoid(tau (r - 1)) * 4 / tau at r = 1 is 2 / tau; its d/d logp is sigmoid'(0) * 4 = 1.
    expected_loss = -(2 / tau * adv).sum() / B
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask)
    torch.testing.assert_close(loss, expected_loss, **EXACT)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum(-1, keepdim=True) / B, **EXACT)
    # Without exact_scalars TRL's temperatures are float32 (1.05 -> 1.0499999523...).
    loss32, _ = trl_loss_and_grad(trainer, logprobs, None, adv, mask, exact_scalars=False)
    assert loss32.dtype == F64
    assert loss32 != expected_loss
    # each term's temperature is rounded once to float32 (relative <= eps32/2 ≈ 6e-8), ×16
    torch.testing.assert_close(loss32, expected_loss, rtol=1e-6, atol=0)


def test_vespo_on_policy(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="vespo", gradient_accumulation_steps=2)
    logprobs, adv, mask = _batch()
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask)
    norm = mask.sum() * 2  # phi(w = 1) = 1; N = num_items * G / S = mask.sum() * G
    torch.testing.assert_close(loss, -(adv[:, None] * logprobs * mask).sum() / norm, **EXACT)
    torch.testing.assert_close(grad, -adv[:, None] * mask / norm, **EXACT)


def test_vllm_importance_sampling_correction(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo")
    logprobs, adv, mask = _batch()
    g = torch.Generator().manual_seed(4)
    rho = torch.rand(logprobs.shape, generator=g, dtype=F64) + 0.5
    loss, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask, importance_sampling_ratio=rho)
    a = adv[:, None]
    torch.testing.assert_close(loss, -(a * rho * mask).sum() / mask.sum(), **EXACT)
    torch.testing.assert_close(grad, -a * rho * mask / mask.sum(), **EXACT)
    assert trainer.use_vllm is False  # restored
    loss_off, _ = trl_loss_and_grad(
        trainer, logprobs, None, adv, mask, importance_sampling_ratio=rho, apply_vllm_is_correction=False
    )
    torch.testing.assert_close(loss_off, -(a * mask).sum() / mask.sum(), **EXACT)


def test_off_policy_sequence_mask(tmp_path):
    threshold = 0.5
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", off_policy_mask_threshold=threshold)
    logprobs, _, mask = _batch()
    adv = torch.tensor([1.0, -1.0, -2.0, 0.5], dtype=F64)
    shift = torch.tensor([2.0, 2.0, 0.1, 2.0], dtype=F64)  # mean KL(sampler || current) per sequence
    sampling = logprobs + shift[:, None]
    _, grad = trl_loss_and_grad(trainer, logprobs, None, adv, mask, sampling_logprobs=sampling)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)  # dropped: A < 0 and KL > threshold
    torch.testing.assert_close(grad, -(adv * keep)[:, None] * mask / mask.sum(), **EXACT)


def test_harness_restores_trainer_state(tmp_path):
    trainer = make_trl_trainer(tmp_path, loss_type="bnpo", gradient_accumulation_steps=2)
    trainer.model.eval()
    logprobs, adv, mask = _batch()
    trl_loss_and_grad(trainer, logprobs, None, adv, mask, importance_sampling_ratio=torch.ones_like(logprobs))
    assert "_get_per_token_logps_and_entropies" not in vars(trainer)
    assert "current_gradient_accumulation_steps" not in vars(trainer)
    assert trainer.use_vllm is False
    assert trainer.model.training is False
    assert torch.get_default_dtype() == torch.float32
    assert all(p.grad is None for p in trainer.model.parameters())


def test_get_gamma_weights_is_static_and_per_sequence():
    assert isinstance(inspect.getattr_static(trl.GRPOTrainer, "get_gamma_weights"), staticmethod)
    B, T = 3, 5
    mask = torch.ones(B, T, dtype=F64)
    adv = torch.tensor([[1.0], [-1.0], [0.5]], dtype=F64)
    phi = trl.GRPOTrainer.get_gamma_weights(adv, torch.zeros(B, T, dtype=F64), mask, None)
    assert phi.shape == (B, 1)
    torch.testing.assert_close(phi, torch.ones(B, 1, dtype=F64), **EXACT)  # phi(w = 1) = 1
    # phi(w) = exp(lam + k log w - lam w) with w = exp(sum_t log r_t), k/lam chosen by sign(A).
    log_ratio = torch.full((B, T), 0.05, dtype=F64)
    phi = trl.GRPOTrainer.get_gamma_weights(adv, log_ratio, mask, None, 2.0, 3.0, 3.0, 2.0)
    log_w = torch.tensor(0.25, dtype=F64)
    k = torch.tensor([[2.0], [3.0], [2.0]], dtype=F64)
    lam = torch.tensor([[3.0], [2.0], [3.0]], dtype=F64)
    # float64, a few terms of size ~5 in another order (measured: equal): budgets.F64_PARITY
    torch.testing.assert_close(
        phi, torch.exp(lam + k * log_w - lam * torch.exp(log_w)), rtol=F64_PARITY, atol=0
    )
