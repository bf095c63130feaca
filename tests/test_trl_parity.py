"""Peer parity: softtrust against TRL 1.16.0's own code, called at run time.

TRL's configuration is mapped onto softtrust objects with
``softtrust.integrations.trl_config.from_trl_config`` and ``trl_normalisers``; TRL's
``GRPOTrainer._compute_loss`` runs on the same crafted float64 tensors through the
harness in ``trl_oracle.py``. Loss values and gradients must agree to 1e-6 (they agree
to ~1e-15 in practice).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer

import softtrust as st
from softtrust.integrations.trl_config import from_trl_config, trl_normalisers

from budgets import EPS32, F64_PARITY, rounding_budget
from trl_oracle import make_trl_trainer, trl_loss_and_grad

pytestmark = pytest.mark.numerics  # peer parity: the outcome depends on float paths

B, T = 4, 8  # the harness's per_device_train_batch_size and max_completion_length
GA, SPG = 2, 4  # gradient accumulation < steps_per_generation: samples are really off-policy


def crafted(seed: int, spread: float = 0.35):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -3 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    old = logprobs + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    sampling = old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logprobs + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.2, -0.8, 0.5, -1.5], dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) < 0.8).long()
    mask[:, 0] = 1
    mask[2, 5:] = 0
    # A few entries far off-policy, so that clipping, dual regions and φ's tail are all exercised.
    old[0, 1] -= 1.0
    old[1, 2] += 1.0
    return logprobs, old, sampling, ref, advantages, mask


def softtrust_loss_and_grad(policy_loss, normalisers, logprobs, old, advantages, mask, **kwargs):
    leaf = logprobs.clone().requires_grad_(True)
    out = policy_loss(leaf, old, advantages, mask.bool(), **normalisers, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach(), grad


def check_parity(tmp_path, seed=0, trl_kwargs=None, st_kwargs=None, mapping_overrides=None, **config):
    trainer = make_trl_trainer(tmp_path, gradient_accumulation_steps=GA, steps_per_generation=SPG, **config)
    logprobs, old, sampling, ref, advantages, mask = crafted(seed)
    inputs = {"ref": ref, "sampling": sampling, "old": old}
    trl_kwargs = {k: (inputs[v] if isinstance(v, str) else v) for k, v in (trl_kwargs or {}).items()}
    st_kwargs = {k: (inputs[v] if isinstance(v, str) else v) for k, v in (st_kwargs or {}).items()}
    num_items = mask.sum() * SPG
    expected_loss, expected_grad = trl_loss_and_grad(
        trainer, logprobs, old, advantages, mask, num_items_in_batch=num_items, **trl_kwargs
    )
    mapping_config = types.SimpleNamespace(**{**vars(trainer.args), **(mapping_overrides or {})})
    policy_loss = from_trl_config(mapping_config)
    normalisers = trl_normalisers(mapping_config, mask.bool(), num_items, GA)
    loss, grad = softtrust_loss_and_grad(
        policy_loss, normalisers, logprobs, old, advantages, mask, **st_kwargs
    )
    # TRL's own float64 loss (exact scalars) against softtrust's: budgets.F64_PARITY (measured 4e-16)
    assert loss.item() == pytest.approx(expected_loss.item(), abs=F64_PARITY, rel=F64_PARITY)
    torch.testing.assert_close(grad, expected_grad, atol=F64_PARITY, rtol=F64_PARITY)
    assert expected_grad.abs().sum() > 0
    return policy_loss


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trl_loss_type_parity(tmp_path, loss_type, level):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {"epsilon_high": 0.28}
    for seed in range(3):
        check_parity(tmp_path, seed, loss_type=loss_type, importance_sampling_level=level, **extra)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_trl_delta_parity(tmp_path, loss_type):
    policy_loss = check_parity(tmp_path, loss_type=loss_type, delta=1.5)
    assert policy_loss.method.delta == 1.5


@pytest.mark.parametrize("corrected", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "vespo", "sapo"])
def test_trl_k3_kl_parity(tmp_path, loss_type, corrected):
    check_parity(
        tmp_path,
        loss_type=loss_type,
        beta=0.05,
        use_bias_correction_kl=corrected,
        trl_kwargs={"ref_logprobs": "ref"},
        st_kwargs={"ref_logprobs": "ref"},
    )


@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
def test_trl_off_policy_sequence_mask_parity(tmp_path, loss_type):
    check_parity(
        tmp_path,
        loss_type=loss_type,
        off_policy_mask_threshold=0.05,
        trl_kwargs={"sampling_logprobs": "sampling"},
        st_kwargs={"rollout_logprobs": "sampling"},
    )


def vllm_ratio(old, sampling, mask, mode, clip_max, clip_min=None):
    """The vLLM IS ratio as TRL's rollout code prepares it (input construction, not the loss)."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    return ratio.masked_fill((ratio < low) | (ratio > clip_max), 0.0)


@pytest.mark.parametrize(
    ("loss_type", "mode", "clip_min"),
    [
        ("dapo", "token_truncate", None),
        ("dapo", "sequence_truncate", None),
        ("grpo", "token_mask", 0.5),
        ("dapo", "sequence_mask", 0.5),
        ("vespo", "token_truncate", None),  # folded into W
        ("vespo", "token_mask", 0.6),  # masked tokens floor W at 1e-8
    ],
)
def test_trl_vllm_importance_correction_parity(tmp_path, loss_type, mode, clip_min):
    _, old, sampling, _, _, mask = crafted(0)
    ratio = vllm_ratio(old, sampling, mask, mode, clip_max=2.0, clip_min=clip_min)
    policy_loss = check_parity(
        tmp_path,
        loss_type=loss_type,
        trl_kwargs={"importance_sampling_ratio": ratio, "sampling_logprobs": "sampling"},
        st_kwargs={"rollout_logprobs": "sampling"},
        mapping_overrides={
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_max": 2.0,
            "vllm_importance_sampling_clip_min": clip_min,
        },
    )
    assert policy_loss.is_correction is not None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_is_ratio", [False, True])
def test_vespo_phi_matches_trl_get_gamma_weights(seed, with_is_ratio):
    logprobs, old, sampling, _, advantages, mask = crafted(seed, spread=0.6)
    mask = mask.bool()
    is_ratio = torch.clamp(torch.exp((old - sampling) * mask), max=2.0) if with_is_ratio else None
    trl_phi = GRPOTrainer.get_gamma_weights(
        advantages=advantages[:, None],
        log_ratio_per_token=logprobs - old,
        mask=mask.double(),
        importance_sampling_ratio=is_ratio,
    )
    correction = st.TIS(cap=2.0) if with_is_ratio else None
    loss_fn = st.PolicyLoss("vespo", correction=correction, aggregation="seq-mean-token-sum")
    leaf = logprobs.clone().requires_grad_(True)
    out = loss_fn(leaf, old, advantages, mask, rollout_logprobs=sampling if with_is_ratio else None)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    # seq-mean-token-sum: ∂L/∂logp_it = -φ_i·A_i·m_it / B, and every row's first token is active.
    st_phi = -(grad[:, 0] * B) / advantages
    torch.testing.assert_close(st_phi, trl_phi[:, 0], rtol=F64_PARITY, atol=F64_PARITY)  # float64
    # the metric is read as float32: its mean of B values carries ~eps32·√B, ×10 ≈ 2.4e-6
    assert out.metric_values()["phi/mean"] == pytest.approx(
        trl_phi.mean().item(), rel=rounding_budget(EPS32, terms=B)
    )


def test_trl_cispo_default_cap_below_one_is_refused():
    config = types.SimpleNamespace(loss_type="cispo", epsilon=0.2, epsilon_high=None)
    with pytest.raises(ValueError, match="epsilon_high=0.2"):
        from_trl_config(config)


@pytest.mark.parametrize(("quantile", "coef"), [(0.4, 0.0), (1.0, 0.05), (0.3, 0.05), (0.0, 0.02)])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo", "dr_grpo"])
def test_adapter_entropy_quantile_and_bonus_match_trl(tmp_path, loss_type, quantile, coef):
    """SoftTrustGRPOTrainer._compute_loss against TRL's with top_entropy_quantile and
    entropy_coef, on the same crafted inputs and entropies (float32 values, as TRL's forward
    returns them: its quantile runs in float32)."""
    from softtrust.integrations.trl import SoftTrustGRPOTrainer

    config = dict(
        loss_type=loss_type,
        top_entropy_quantile=quantile,
        entropy_coef=coef,
        gradient_accumulation_steps=GA,
        steps_per_generation=SPG,
    )
    theirs = make_trl_trainer(tmp_path / "trl", **config)
    ours = make_trl_trainer(tmp_path / "softtrust", trainer_class=SoftTrustGRPOTrainer, **config)
    assert ours.policy_loss.entropy_quantile == quantile
    for seed in range(2):
        logprobs, old, _, _, advantages, mask = crafted(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        entropies = (2 * torch.rand(B, T, generator=gen)).double()  # [B, T], float32 values
        call = dict(num_items_in_batch=mask.sum() * SPG, entropies=entropies)
        expected_loss, expected_grad = trl_loss_and_grad(theirs, logprobs, old, advantages, mask, **call)
        loss, grad = trl_loss_and_grad(ours, logprobs, old, advantages, mask, **call)
        assert loss.item() == pytest.approx(expected_loss.item(), abs=F64_PARITY, rel=F64_PARITY)
        torch.testing.assert_close(grad, expected_grad, atol=F64_PARITY, rtol=F64_PARITY)
        # the settings change the loss (zero entropies: every token kept, no bonus)
        plain_loss, plain_grad = trl_loss_and_grad(ours, logprobs, old, advantages, mask, entropies=None)
        assert abs(plain_loss.item() - loss.item()) > 1e-6 or not torch.allclose(plain_grad, grad)


def test_adapter_refuses_entropy_settings_it_would_change(tmp_path):
    from softtrust.integrations.trl import check_supported

    config = types.SimpleNamespace(
        top_entropy_quantile=0.5, entropy_coef=0.0, use_adaptive_entropy=False, beta=0.0
    )
    with pytest.raises(
        ValueError, match=r"top_entropy_quantile=0.5 disagrees with the PolicyLoss's entropy_quantile=1.0"
    ):
        check_supported(config, st.PolicyLoss("clip"))
    with pytest.raises(
        ValueError,
        match=r"the PolicyLoss's entropy_coef=0.1: inside TRL the bonus is GRPOConfig.entropy_coef",
    ):
        check_supported(config, st.PolicyLoss("clip", entropy_quantile=0.5, entropy_coef=0.1))
    adaptive = types.SimpleNamespace(**{**vars(config), "use_adaptive_entropy": True})
    with pytest.raises(ValueError, match="use_adaptive_entropy=True"):
        check_supported(adaptive, st.PolicyLoss("clip", entropy_quantile=0.5))


def test_adapter_threshold_takes_every_processs_active_entropies():
    """Under several processes the adapter pads and gathers each process's active entropies (TRL's
    gather), drops the padding, and takes the quantile of all of them, not of its own."""
    from softtrust.integrations.trl import SoftTrustGRPOTrainer
    from softtrust.integrations.trl_config import trl_entropy_terms

    gen = torch.Generator().manual_seed(9)
    mine, theirs = 2 * torch.rand(B, T, generator=gen), 3 * torch.rand(B, T, generator=gen)
    mask, their_mask = crafted(1)[-1], crafted(2)[-1]
    their_active = theirs[their_mask.bool()]

    class TwoProcesses:  # accelerate's pad_across_processes and gather, for this process and one other
        num_processes = 2

        def pad_across_processes(self, tensor, dim=0, pad_index=0):
            width = max(tensor.shape[0], their_active.shape[0])
            return torch.nn.functional.pad(tensor, (0, width - tensor.shape[0]), value=pad_index)

        def gather(self, tensor):
            return torch.cat([tensor, self.pad_across_processes(their_active, pad_index=math.nan)])

    loss_fn = st.PolicyLoss("clip", entropy_quantile=0.3)
    stub = types.SimpleNamespace(policy_loss=loss_fn, accelerator=TwoProcesses())
    gathered = SoftTrustGRPOTrainer._gathered_entropies(stub, mine, mask)
    pool = torch.cat([mine[mask.bool()], their_active])
    assert torch.equal(gathered.sort().values, pool.sort().values)
    state, _ = trl_entropy_terms(types.SimpleNamespace(entropy_coef=0.0), loss_fn, mine, mask, 1, gathered)
    assert state["entropy/threshold"] == torch.quantile(pool.float(), 0.7)
    alone, _ = trl_entropy_terms(types.SimpleNamespace(entropy_coef=0.0), loss_fn, mine, mask, 1)
    assert alone["entropy/threshold"] != state["entropy/threshold"]


def test_trl_entropy_selection_compares_bf16_entropies_in_float32():
    """TRL compares ``entropies * mask.float() >= threshold`` (float32); a bf16 comparison would round
    the threshold to bf16 first and keep a token just below it."""
    from softtrust.integrations.trl_config import trl_entropy_terms

    entropies = torch.tensor([[1.0, 0.5, 2.0, 1.0078125]], dtype=torch.bfloat16)  # exact in bf16
    mask = torch.ones(1, 4, dtype=torch.long)
    loss_fn = st.PolicyLoss("clip", entropy_quantile=0.6)
    state, bonus = trl_entropy_terms(types.SimpleNamespace(entropy_coef=1.0), loss_fn, entropies, mask, 1)
    threshold = torch.quantile(entropies.float()[0], 0.4)  # 1.0015625, a fifth of the way to 1.0078125
    assert state["entropy/threshold"] == threshold and threshold.to(torch.bfloat16) == 1.0  # bf16 rounds down
    kept = entropies.float() >= threshold  # float32, as TRL: 1.0078125 and 2.0, not 1.0
    assert int(kept.sum()) == 2
    assert float(bonus) == pytest.approx(float(entropies.float()[kept].mean()), rel=1e-6)


def test_trl_entropy_bonus_gradient_is_the_kept_token_mean():
    """trl_entropy_terms' bonus: c · Σ H m' / Σ m' / GA, so d bonus / d H = c m' / (Σ m' · GA)."""
    from softtrust.integrations.trl_config import trl_entropy_terms

    _, _, _, _, _, mask = crafted(3)
    entropies = (
        (2 * torch.rand(B, T, generator=torch.Generator().manual_seed(3))).double().requires_grad_(True)
    )
    loss_fn = st.PolicyLoss("clip", entropy_quantile=0.5)
    config = types.SimpleNamespace(entropy_coef=0.07)
    state, bonus = trl_entropy_terms(config, loss_fn, entropies, mask, 2)
    active = entropies.detach()[mask.bool()]
    kept = mask.bool() & (entropies.detach() >= torch.quantile(active.float(), 0.5))
    (grad,) = torch.autograd.grad(bonus, entropies)
    torch.testing.assert_close(grad, 0.07 * kept.double() / (kept.sum() * 2), rtol=1e-12, atol=0)
    assert state["entropy/threshold"] == torch.quantile(active.float(), 0.5)


def test_trl_epsilon_high_zero_is_an_upper_clip_of_zero_not_epsilon():
    """TRL reads ``epsilon_high if epsilon_high is not None else epsilon``: 0.0 is a value. It was
    mapped through ``epsilon_high or epsilon``, so ``epsilon_high=0.0`` became 0.2."""
    config = types.SimpleNamespace(loss_type="dapo", epsilon=0.2, epsilon_high=0.0)
    method = from_trl_config(config).method
    assert (method.eps_low, method.eps_high) == (0.2, 0.0)
    unset = from_trl_config(types.SimpleNamespace(loss_type="dapo", epsilon=0.3, epsilon_high=None)).method
    assert (unset.eps_low, unset.eps_high) == (0.3, 0.3)
