"""SoftTrustGRPOTrainer inside TRL 1.16.0's real training loop (CPU, tiny local Qwen2, no network).

1. Parity: for every TRL ``loss_type`` (token and sequence level), ``SoftTrustGRPOTrainer``
   with ``from_trl_config(args)`` and TRL's own ``GRPOTrainer`` log the same losses and
   reach the same parameters after 3 off-policy steps (GA = 2 < steps_per_generation = 6).
2. Methods TRL lacks train inside the trainer, and every micro-batch loss equals a direct
   ``PolicyLoss`` call on the captured inputs with independently computed normalisers.
3. Unsupported settings and TRL versions are refused before training, naming the field.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

import trl
from datasets import Dataset
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer

import softtrust as st
import softtrust.integrations.trl as st_trl
from softtrust.integrations.trl import SoftTrustGRPOTrainer, from_trl_config
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

from budgets import EPS32, MICRO_LOGPROB, rounding_budget

GA, SPG = 2, 6  # 6 micro-batches per generation, an optimizer step every 2: steps 2 and 3 are off-policy
B, T_MAX = 4, 8  # per_device_train_batch_size, max_completion_length
TINY = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def text_reward(completions, **kwargs) -> list[float]:
    """Deterministic, varied within a group (so advantages are non-zero), uses no RNG."""
    return [(sum(map(ord, completion)) % 11) / 10 for completion in completions]


def grpo_config(output_dir, **overrides) -> GRPOConfig:
    settings = {
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "per_device_train_batch_size": B,
        "num_generations": 2,
        "max_completion_length": T_MAX,
        "gradient_accumulation_steps": GA,
        "steps_per_generation": SPG,
        "max_steps": 3,
        "seed": 0,
        "optim": "sgd",  # SGD: a float32 rounding difference in a gradient stays a rounding difference
        "learning_rate": 1.0,  # large enough that ratios move far from 1 (and clipping happens)
        **overrides,
    }
    return GRPOConfig(output_dir=str(output_dir), **settings)


class RecordsMicroBatchLosses:
    """Test mixin for both trainers alike: keeps the loss of every micro-batch, unrounded."""

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro_losses.append(loss.item())
        return loss


class RecordingTRLTrainer(RecordsMicroBatchLosses, GRPOTrainer):
    pass


class CapturingTrainer(RecordsMicroBatchLosses, SoftTrustGRPOTrainer):
    """Also captures each ``_compute_loss``'s inputs, the policy's log-probs and the returned loss."""

    def _compute_loss(self, model, inputs):
        self._logprobs = []
        loss = super()._compute_loss(model, inputs)
        (logprobs,) = self._logprobs
        self.captured.append({"inputs": inputs, "logprobs": logprobs, "loss": loss.detach().clone()})
        self._logprobs = None
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if getattr(self, "_logprobs", None) is not None:  # only the call made inside _compute_loss
            self._logprobs.append(out[0].detach().clone())
        return out


class FakeVLLMTrainer(CapturingTrainer):
    """Adds the ``sampling_per_token_logps`` vLLM would return: old log-probs + noise (own generator)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        old = out["old_per_token_logps"]  # [B, T]; present because GA % SPG != 0
        generator = torch.Generator().manual_seed(len(self.captured))
        sampling = old + 0.3 * torch.randn(old.shape, generator=generator)  # [B, T]
        sampling[0, 0] = math.nan  # a token vLLM could not score: no correction (ratio 1), as in TRL
        out["sampling_per_token_logps"] = sampling * out["completion_mask"]
        return out


def build_trainer(cls, config: GRPOConfig, prompts: int = 12, **kwargs):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TINY)
    if config.beta != 0.0:  # TRL loads the reference model from the policy's path (local files only)
        policy_dir = os.path.join(config.output_dir, "tiny_policy")
        model.save_pretrained(policy_dir)
        model.config._name_or_path = policy_dir
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(prompts)]})
    trainer = cls(
        model=model,
        reward_funcs=text_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.micro_losses, trainer.captured = [], []
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [
        entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry
    ]


# Float error budgets (tests/budgets.py) for TRL against softtrust: one float32 model, two loss
# codes whose sums run in other orders. A token log-prob of the tiny Qwen2 within MICRO_LOGPROB
# (6e-5): the losses (|A| <= 1, r ≈ 1: relative 6e-5 of their size, absolute below 1) and the
# entropy (~4.6, the same log-softmax) within it (measured: 1e-6 and 5e-7); a wrong normaliser
# or aggregation moves a loss by a factor. Parameters after SGD steps at lr 1 move by lr · the
# gradients' rounding, sums of ~B·T_MAX·GA·64 ≈ 4e3 products: 10·eps32·√4e3 ≈ 7.6e-5 of how far
# they moved (measured 3e-8 absolute after moving ~1).
PARAMETER_TERMS = B * T_MAX * GA * 64


def assert_same_training(trl_trainer, st_trainer, config) -> None:
    """Same micro-batch losses, logged losses, entropy and final parameters, within the budgets."""
    assert len(st_trainer.micro_losses) == len(trl_trainer.micro_losses) == config.max_steps * GA
    torch.testing.assert_close(
        torch.tensor(st_trainer.micro_losses),
        torch.tensor(trl_trainer.micro_losses),
        atol=MICRO_LOGPROB,
        rtol=MICRO_LOGPROB,
    )
    assert len(logged(st_trainer, "loss")) == config.max_steps
    torch.testing.assert_close(
        torch.tensor(logged(st_trainer, "loss")),
        torch.tensor(logged(trl_trainer, "loss")),
        atol=MICRO_LOGPROB,
        rtol=MICRO_LOGPROB,
    )
    torch.testing.assert_close(
        torch.tensor(logged(st_trainer, "entropy")),
        torch.tensor(logged(trl_trainer, "entropy")),
        atol=MICRO_LOGPROB,
        rtol=0,
    )
    initial = dict(build_tiny_model(build_char_tokenizer(), TINY).named_parameters())
    parameters = dict(trl_trainer.model.named_parameters())
    moved = max((parameters[name] - initial[name]).abs().max().item() for name in parameters)
    assert moved > 1e-2  # training moved the weights: the comparison below is not vacuous
    budget = rounding_budget(EPS32, terms=PARAMETER_TERMS, scale=moved)
    for name, parameter in parameters.items():
        other = dict(st_trainer.model.named_parameters())[name]
        torch.testing.assert_close(other, parameter, atol=budget, rtol=0, msg=name)


@pytest.mark.numerics
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trainer_matches_trl_losses_and_parameters_for_every_loss_type(tmp_path, loss_type, level):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {"epsilon_high": 0.28}
    config = grpo_config(tmp_path, loss_type=loss_type, importance_sampling_level=level, **extra)
    trl_trainer = build_trainer(RecordingTRLTrainer, config)
    trl_trainer.train()
    st_trainer = build_trainer(CapturingTrainer, config)
    assert repr(st_trainer.policy_loss) == repr(from_trl_config(config))  # the default policy_loss
    st_trainer.train()
    assert_same_training(trl_trainer, st_trainer, config)
    # Really off-policy: the stale micro-batches saw ratios away from 1 (the first step is on-policy).
    ratio_min, ratio_max = (
        logged(st_trainer, "softtrust/ratio/min"),
        logged(st_trainer, "softtrust/ratio/max"),
    )
    assert ratio_min[0] == pytest.approx(1.0) and ratio_max[0] == pytest.approx(1.0)
    assert min(ratio_min[1:]) < 0.97 and max(ratio_max[1:]) > 1.02


@pytest.mark.numerics
def test_trainer_matches_trl_with_a_k3_kl_in_training_and_evaluation(tmp_path):
    config = grpo_config(
        tmp_path, loss_type="dapo", beta=0.5, epsilon_high=0.28, per_device_eval_batch_size=B
    )
    eval_dataset = Dataset.from_dict({"prompt": ["1+2=", "3+4="]})
    trl_trainer = build_trainer(RecordingTRLTrainer, config, eval_dataset=eval_dataset)
    trl_trainer.train()
    st_trainer = build_trainer(CapturingTrainer, config, eval_dataset=eval_dataset)
    assert st_trainer.policy_loss.kl == st.KL(0.5, "k3", importance_corrected=config.use_bias_correction_kl)
    st_trainer.train()
    assert_same_training(trl_trainer, st_trainer, config)
    assert all(value > 0 for value in logged(st_trainer, "softtrust/kl")[1:])
    # k3 = e^x - x - 1 of the log-ratio x to the reference moves by |e^x - 1|·δ <= δ (|x| < log 2;
    # the KL here is ~7e-3) for a log-prob rounding δ <= MICRO_LOGPROB (measured 6.5e-9)
    torch.testing.assert_close(
        torch.tensor(logged(st_trainer, "softtrust/kl")),
        torch.tensor(logged(trl_trainer, "kl")),
        atol=MICRO_LOGPROB,
        rtol=0,
    )
    # Evaluation: on-policy, no accumulation, the whole eval batch (num_items_in_batch) normalises.
    st_trainer.captured.clear()
    losses = []
    for trainer in (trl_trainer, st_trainer):
        set_seed(1)  # evaluation samples too: draw the same completions
        losses.append(trainer.evaluate()["eval_loss"])
    trl_loss, st_loss = losses
    # the loss budget above (measured 2e-9); |loss| ~ 1e-2, so a wrong factor moves it by far more
    assert st_loss == pytest.approx(trl_loss, abs=MICRO_LOGPROB) and abs(st_loss) > 10 * MICRO_LOGPROB
    (record,) = st_trainer.captured
    inputs = record["inputs"]
    direct = from_trl_config(config)(
        record["logprobs"],
        None,
        inputs["advantages"],
        inputs["completion_mask"],
        ref_logprobs=inputs["ref_per_token_logps"],
        num_tokens=inputs["num_items_in_batch"],
    )
    assert st_loss == pytest.approx(direct.loss.item(), abs=1e-6)  # the same float32 code (measured 0)


@pytest.mark.numerics
@pytest.mark.costly
def test_parity_check_detects_a_different_loss(tmp_path):
    """The comparison above can fail: TRL's dapo vs a softtrust loss that differs only in aggregation."""
    config = grpo_config(tmp_path, loss_type="dapo", epsilon_high=0.28)
    trl_trainer = build_trainer(RecordingTRLTrainer, config)
    trl_trainer.train()
    other = st.PolicyLoss(st.Clip(eps_low=0.2, eps_high=0.28), aggregation="seq-mean-token-mean")
    st_trainer = build_trainer(CapturingTrainer, config, policy_loss=other)
    st_trainer.train()
    with pytest.raises(AssertionError):
        assert_same_training(trl_trainer, st_trainer, config)


@pytest.mark.parametrize("train", [True, False])
def test_micro_batch_normalisers_follow_the_policy_loss_aggregation(train):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    num_items, procs, ga, spg = torch.tensor(24), 2, 3, 6
    config = grpo_config("unused", loss_type="dapo", gradient_accumulation_steps=ga, steps_per_generation=spg)
    g = ga if train else 1
    expected = {
        "token-mean": {"num_tokens": 24 / procs * (g / spg if train else 1)},
        "seq-mean-token-mean": {"num_sequences": 2 * g},
        "seq-mean-token-sum": {"num_sequences": 2 * g},
        "seq-mean-token-sum-norm": {"num_sequences": 2 * g},
        "token-sum": {},
    }
    for aggregation, want in expected.items():
        got = st_trl.micro_batch_normalisers(config, aggregation, mask, num_items, g, procs, train)
        assert {k: float(v) for k, v in got.items()} == pytest.approx(want), aggregation
    config.loss_type = "bnpo"  # TRL's bnpo: the local token count, whatever num_items_in_batch says
    got = st_trl.micro_batch_normalisers(config, "token-mean", mask, num_items, g, procs, train)
    assert float(got["num_tokens"]) == 3 * g


def test_metrics_reduce_over_ranks_by_kind():
    per_rank = [
        {"ratio/mean": 1.0, "ratio/min": 0.5, "ratio/max": 2.0, "ess": math.nan},
        {"ratio/mean": 3.0, "ratio/min": 0.7, "ratio/max": 1.5, "ess": 0.8, "clip/low": math.nan},
    ]
    reduced = st_trl.reduce_over_ranks(per_rank)
    assert reduced == {
        "ratio/mean": 2.0,
        "ratio/min": 0.5,
        "ratio/max": 2.0,
        "ess": 0.8,
        "clip/low": reduced["clip/low"],
    }
    assert math.isnan(reduced["clip/low"])


# --- 2. methods TRL lacks, at any aggregation --------------------------------------------------

NEW_METHODS = {
    "pspo-token-mean": (lambda: st.PolicyLoss("pspo", alpha=0.1), {}),
    "pspo-token-mean-bnpo-local-count": (lambda: st.PolicyLoss("pspo", alpha=0.1), {"loss_type": "bnpo"}),
    "cfpo-seq-mean-token-sum": (lambda: st.PolicyLoss("cfpo", aggregation="seq-mean-token-sum"), {}),
    "gmpo-seq-mean-token-mean": (lambda: st.PolicyLoss("gmpo", aggregation="seq-mean-token-mean"), {}),
    "gspo-seq-mean-token-sum-norm": (
        lambda: st.PolicyLoss("gspo", aggregation="seq-mean-token-sum-norm", max_completion_length=T_MAX),
        {},
    ),
    "dual-clip-token-sum": (lambda: st.PolicyLoss(st.Clip(dual_clip=3.0), aggregation="token-sum"), {}),
    "sapo-k2-kl": (lambda: st.PolicyLoss("sapo", kl=st.KL(coef=0.1, estimator="k2")), {"beta": 0.1}),
}


def expected_normalisers(aggregation: str, loss_type: str, inputs: dict, mask: torch.Tensor) -> dict:
    """Written out from TRL's scaling (one process, full accumulation windows), not from the module."""
    if aggregation == "token-sum":
        return {}
    if aggregation == "token-mean" and loss_type == "bnpo":
        return {"num_tokens": mask.sum() * GA}
    if aggregation == "token-mean":
        return {"num_tokens": inputs["num_items_in_batch"] * GA / SPG}
    return {"num_sequences": mask.shape[0] * GA}


def check_against_direct_calls(trainer, fresh_policy_loss: st.PolicyLoss, steps: int) -> None:
    """Each micro-batch loss = a direct PolicyLoss call on its inputs; logged loss = the window's sum."""
    assert len(trainer.captured) == steps * GA
    direct_ratio_means, drift = [], 0.0
    for record in trainer.captured:
        inputs, logprobs = record["inputs"], record["logprobs"]
        mask = inputs["completion_mask"]
        rollout = inputs.get("sampling_per_token_logps")
        if rollout is not None:
            rollout = torch.where(torch.isnan(rollout), inputs["old_per_token_logps"], rollout)
        direct = fresh_policy_loss(
            logprobs,
            inputs.get("old_per_token_logps"),
            inputs["advantages"],
            mask,
            rollout_logprobs=rollout if fresh_policy_loss.is_correction is not None else None,
            ref_logprobs=inputs.get("ref_per_token_logps"),
            **expected_normalisers(fresh_policy_loss.aggregation, trainer.args.loss_type, inputs, mask),
        )
        torch.testing.assert_close(record["loss"], direct.loss, atol=1e-6, rtol=1e-6)
        direct_ratio_means.append(direct.metric_values()["ratio/mean"])
        drift = max(
            drift, -direct.metric_values()["seq_log_weight/min"], direct.metric_values()["seq_log_weight/max"]
        )
    window_sums = torch.tensor(trainer.micro_losses).view(steps, GA).sum(-1)
    direct_sums = torch.stack([record["loss"] for record in trainer.captured]).view(steps, GA).sum(-1)
    torch.testing.assert_close(torch.tensor(logged(trainer, "loss")), window_sums, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(window_sums, direct_sums, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.tensor(logged(trainer, "softtrust/ratio/mean")),
        torch.tensor(direct_ratio_means).view(steps, GA).mean(-1),
        atol=1e-6,
        rtol=0,
    )
    assert drift > 0.05  # some micro-batches were off-policy: |Σ_t log r_t| > 0.05 for some sequence


@pytest.mark.numerics
@pytest.mark.costly
@pytest.mark.parametrize("case", list(NEW_METHODS))
def test_methods_trl_lacks_train_and_match_a_direct_policy_loss_call(tmp_path, case):
    make_loss, overrides = NEW_METHODS[case]
    config = grpo_config(tmp_path, max_steps=5, learning_rate=0.5, **overrides)
    trainer = build_trainer(CapturingTrainer, config, policy_loss=make_loss())
    trainer.train()
    losses = logged(trainer, "loss")
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    check_against_direct_calls(trainer, make_loss(), steps=5)


def test_vespo_with_tis_folded_into_w_reads_the_sampler_logprobs(tmp_path):
    """VESPO + TIS (vLLM's log-probs faked by a subclass hook): the correction changes the loss, exactly."""
    config = grpo_config(tmp_path, max_steps=5, learning_rate=0.5)
    trainer = build_trainer(FakeVLLMTrainer, config, policy_loss=st.PolicyLoss("vespo"))
    # TIS needs use_vllm=True at construction (only vLLM records sampler log-probs); swap it in afterwards.
    trainer.policy_loss = st.PolicyLoss("vespo", correction=st.TIS(cap=2.0))
    trainer.train()
    check_against_direct_calls(trainer, st.PolicyLoss("vespo", correction=st.TIS(cap=2.0)), steps=5)
    assert logged(trainer, "softtrust/is_weight/max")[0] > 1.0  # the correction is active
    record = trainer.captured[0]
    without_correction = st.PolicyLoss("vespo")(
        record["logprobs"],
        record["inputs"].get("old_per_token_logps"),
        record["inputs"]["advantages"],
        record["inputs"]["completion_mask"],
        num_tokens=record["inputs"]["num_items_in_batch"] * GA / SPG,
    )
    assert abs(without_correction.loss.item() - record["loss"].item()) > 1e-4


def test_a_correction_without_sampler_logprobs_fails_clearly(tmp_path):
    config = grpo_config(tmp_path, max_steps=1)
    trainer = build_trainer(CapturingTrainer, config, policy_loss=st.PolicyLoss("vespo"))
    trainer.policy_loss = st.PolicyLoss("vespo", correction=st.TIS(cap=2.0))
    with pytest.raises(ValueError, match="sampling_per_token_logps"):
        trainer.train()


# --- 3. refusals before training, and the TRL version check -------------------------------------


@pytest.mark.parametrize(
    ("overrides", "policy_loss", "field"),
    [
        ({"top_entropy_quantile": 0.5}, st.PolicyLoss("pspo"), "top_entropy_quantile=0.5 disagrees"),
        ({}, st.PolicyLoss("pspo", entropy_coef=0.01), "entropy_coef=0.01"),
        ({"use_adaptive_entropy": True}, None, "use_adaptive_entropy"),
        ({"beta": 0.04}, st.PolicyLoss("pspo"), "beta=0.04"),
        ({}, st.PolicyLoss("pspo", kl=st.KL(coef=0.04)), "beta=0.0"),
        ({"beta": 0.1}, st.PolicyLoss("pspo", kl=st.KL(coef=0.04)), "beta=0.1"),
        ({"off_policy_mask_threshold": 0.5}, st.PolicyLoss("pspo"), "off_policy_mask_threshold"),
        ({}, st.PolicyLoss("pspo", correction=st.TIS(cap=2.0)), "use_vllm"),
        ({"use_vllm": True}, st.PolicyLoss("pspo"), "vllm_importance_sampling_correction"),
        ({}, st.PolicyLoss("clip", aggregation="seq-mean-token-sum-norm"), "max_completion_length"),
        ({"loss_type": "cispo", "epsilon_high": None}, None, "epsilon_high"),
        ({}, "pspo", "policy_loss"),
    ],
)
def test_unsupported_settings_are_refused_before_training(
    tmp_path, monkeypatch, overrides, policy_loss, field
):
    config = grpo_config(tmp_path, **overrides)
    original_init = GRPOTrainer.__init__
    trl_init_calls = []

    @functools.wraps(original_init)
    def spy_init(self, *args, **kwargs):  # pragma: no cover - must not be reached
        trl_init_calls.append(True)
        return original_init(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "__init__", spy_init)
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        build_trainer(SoftTrustGRPOTrainer, config, policy_loss=policy_loss)
    assert not trl_init_calls  # refused before TRL loads a reference model or starts vLLM


def test_matching_opsm_and_kl_are_accepted(tmp_path):
    config = grpo_config(tmp_path, off_policy_mask_threshold=0.5, beta=0.0)
    policy_loss = st.PolicyLoss("pspo", correction=st.OPSM(delta=0.5))
    st_trl.check_supported(config, policy_loss)  # no error
    with pytest.raises(ValueError, match=r"OPSM\(delta=0.3\)"):
        st_trl.check_supported(config, st.PolicyLoss("pspo", correction=st.OPSM(delta=0.3)))


def test_trl_version_check_names_installed_and_supported_versions():
    assert st_trl.SUPPORTED_TRL_VERSIONS == ("1.16.0",)
    st_trl.check_trl_version("1.16.0")  # no error
    with pytest.raises(ImportError, match=r"TRL 1\.15\.2 is installed") as error:
        st_trl.check_trl_version("1.15.2")
    assert "1.16.0" in str(error.value)


def test_importing_with_an_unsupported_trl_raises_import_error(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(ImportError, match=r"supports TRL 1\.16\.0, but TRL 1\.17\.0 is installed"):
        importlib.reload(st_trl)
    monkeypatch.undo()
    importlib.reload(st_trl)  # leave a fully initialised module behind
    assert st_trl.from_trl_config is from_trl_config


# --- examples ----------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(("name", "weight_metric"), [("trl_vespo", "phi"), ("trl_pspo", "ratio")])
def test_examples_train_and_print_the_logged_loss(capsys, name, weight_metric):
    example = runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=name)
    trainer = example["main"](max_steps=2)
    printed = capsys.readouterr().out
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    for step, loss in enumerate(losses, start=1):
        assert f"step {step}: loss {loss:+.4f}" in printed
    assert logged(trainer, "softtrust/ratio/max")[1] > 1.0  # step 2 is off-policy
    assert f"softtrust/{weight_metric}/mean" in trainer.state.log_history[0]
    assert trainer.args.bf16 is False and trainer.accelerator.mixed_precision == "no"  # as in trl.md
