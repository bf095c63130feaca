"""The trainer: staleness semantics, async lag, resume, reliability, an end-to-end run.

Every run here uses a very small Qwen2 saved to a temporary directory (``--model``),
no warm start, and a handful of steps, so the whole file runs in about a minute.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import softtrust as st
from softtrust.train import checkpoint as checkpoint_module
from softtrust.train import staleness as staleness_module
from softtrust.train import trainer as trainer_module
from softtrust.train.checkpoint import find_checkpoint, load_checkpoint
from softtrust.train.config import TrainConfig
from softtrust.train.learner import Learner
from softtrust.train.options import load_resume_config
from softtrust.train.scoring import completion_logprobs_of
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from softtrust.train.trainer import TrainingStopped, train

from budgets import EPS32, MICRO_LOGPROB, adam_budget, rounding_budget

torch.set_num_threads(1)

MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


@pytest.fixture(scope="module")
def tiny_pair():
    """The char tokenizer and the micro Qwen2 (float32, eval mode), in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(write_micro_model(Path(tempfile.mkdtemp(prefix="tiny-pair-"))))
    return AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(
        directory
    ).float().eval()


def write_micro_model(directory: Path) -> str:
    """A ~10k-parameter Qwen2 and the char tokenizer, saved with ``save_pretrained``, plus a
    JSONL dataset of single-digit sums next to them (``sums.jsonl``)."""
    (directory / "sums.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{j}=", "answer": f"{i + j:02d}"}) + "\n"
            for i in range(10)
            for j in range(10)
        )
    )
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, MICRO, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def digit_reward(completion: str, answer: str) -> float:
    """The fraction of digit characters: random weights already earn varied rewards, so
    group advantages are non-zero from the first step and every update moves the model."""
    return sum(character.isdigit() for character in completion) / 3


def coarse_reward(completion: str, answer: str) -> float:
    """1 when the completion starts with a digit, else 0: about half the random micro model's
    completions do, so a group of 2 often has equal rewards (what --filter-groups drops)."""
    return float(completion[:1].isdigit())


def micro_config(model_dir: str, output_dir: Path, **overrides) -> TrainConfig:
    values = dict(
        model=model_dir,
        dataset=str(Path(model_dir) / "sums.jsonl"),
        reward=f"{__name__}:digit_reward",
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=3,
        staleness=1,
        max_steps=4,
        eval_every=0,
        eval_size=8,
        save_every=0,
        output_dir=str(output_dir),
        progress=False,
        lr=1e-2,
        seed=0,
    )
    values.update(overrides)
    return TrainConfig(**values)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def model_parameters(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "final" / "model.safetensors"))


# ---------------------------------------------------------------------- 1. staleness semantics
def test_staleness_four_means_four_steps_per_rollout_on_disjoint_minibatches(
    micro_model_dir, tmp_path, monkeypatch
):
    events = []
    real_behaviour = staleness_module.behaviour_logprobs
    real_update = Learner.update

    def counting_behaviour(*args, **kwargs):
        events.append("behaviour")
        return real_behaviour(*args, **kwargs)

    def counting_update(*args, **kwargs):
        events.append("update")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(staleness_module, "behaviour_logprobs", counting_behaviour)
    monkeypatch.setattr(Learner, "update", counting_update)
    config = micro_config(micro_model_dir, tmp_path / "run", staleness=4, max_steps=8, method="clip")
    train(config)
    metrics = read_metrics(tmp_path / "run")

    assert [m["rollout/index"] for m in metrics] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m["rollout/minibatch"] for m in metrics] == [0, 1, 2, 3] * 2
    rows_per_step = config.prompts_per_step * config.group_size
    assert [tuple(m["rollout/rows"]) for m in metrics[:4]] == [
        (i * rows_per_step, (i + 1) * rows_per_step) for i in range(4)
    ]
    assert [m["policy_version"] for m in metrics] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [m["lag"] for m in metrics] == [0, 1, 2, 3] * 2
    # Behaviour log-probs of a rollout are all computed before its first update, from θ_k.
    assert events == (["behaviour"] * 4 + ["update"] * 4) * 2
    # The producer's time is logged at the step its rollout arrived, and the learner waited for
    # all of it there (sampling and behaviour log-probs lie inside the step's collect interval).
    for m in metrics:
        assert (m["seconds/sample"] > 0) == (m["rollout/minibatch"] == 0), m
        assert m["seconds/sample"] <= m["seconds/collect"] + 1e-3, m
    # The first mini-batch of each rollout is on-policy; the later ones are not.
    for m in metrics:
        on_policy = m["loss/ratio/min"] == 1.0 and m["loss/ratio/max"] == 1.0
        assert on_policy == (m["rollout/minibatch"] == 0), m


@pytest.mark.parametrize("method", ["clip", "vespo"])
def test_staleness_one_is_on_policy_every_ratio_is_exactly_one(micro_model_dir, tmp_path, method):
    train(micro_config(micro_model_dir, tmp_path / "run", staleness=1, max_steps=4, method=method))
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 4
    for m in metrics:
        assert m["loss/ratio/min"] == 1.0 and m["loss/ratio/max"] == 1.0
        assert m["kl_behaviour"] == 0.0
        assert m["lag"] == 0
    # ... while the model did move (the ratios are 1 because old == current, not by accident).
    assert any(m["grad_norm"] > 0 for m in metrics)


@pytest.mark.numerics
def test_kl_mismatch_reads_the_samplers_numbers_against_the_learners(micro_model_dir, tmp_path):
    """kl_mismatch is the k3-KL of the sampler's log-probs against the trainer's for the same policy:
    fp32 sampling gives the learner's numbers up to rounding; bf16 scoring moves them."""
    exact = micro_config(micro_model_dir, tmp_path / "fp32", staleness=1, max_steps=2, method="clip")
    train(exact)
    bf16 = micro_config(micro_model_dir, tmp_path / "bf16", staleness=1, max_steps=2, method="clip")
    train(dataclasses.replace(bf16, mismatch="bf16"))
    fp32_kl = [m["kl_mismatch"] for m in read_metrics(tmp_path / "fp32")]
    bf16_kl = [m["kl_mismatch"] for m in read_metrics(tmp_path / "bf16")]
    # k3 = r - 1 - log r ≈ δ²/2 for a log-prob difference δ between the sampler's and the learner's
    # float32 paths, δ within MICRO_LOGPROB (6e-5): k3 < MICRO_LOGPROB² ≈ 3.6e-9; bf16 gives δ ~ 1e-3
    assert all(0.0 <= kl < MICRO_LOGPROB**2 for kl in fp32_kl), fp32_kl
    assert all(kl > 100 * max(max(fp32_kl), 1e-10) for kl in bf16_kl), (fp32_kl, bf16_kl)


def test_a_perturbed_sampler_records_its_own_logprobs_and_the_learner_scores_the_clean_policy(tiny_pair):
    """--mismatch logit-noise:σ: the sampler adds one fixed N(0, σ²) draw per vocabulary entry
    (from the seed) to every logit, so its recorded log-probs are log_softmax(z + ε) at the chosen
    tokens, where the learner's are log_softmax(z)."""
    from softtrust.train.rollout import group_uniforms, sample_completions

    tokenizer, model = tiny_pair
    prompts = tokenizer(["12+3=", "4+56="], return_tensors="pt", padding=True)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    sigma, seed, steps = 0.5, 7, 4
    uniforms = group_uniforms(0, 0, [0, 1], 1, steps)
    tokens, completion_mask, recorded = sample_completions(
        model, ids, mask, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=steps, temperature=1.0, uniforms=uniforms, logit_noise=(sigma, seed),
    )  # fmt: skip
    noise = sigma * torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    full = torch.cat([ids, tokens], dim=1)
    attention = torch.cat([mask, completion_mask], dim=1)
    with torch.no_grad():
        logits = model(full, attention_mask=attention).logits[:, ids.shape[1] - 1 : -1].float()  # [2, T, V]
    perturbed = torch.log_softmax(logits + noise, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    clean = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    active = completion_mask.bool()
    # the same float32 log-softmax through a KV cache and through one forward: MICRO_LOGPROB apart
    torch.testing.assert_close(recorded[active], perturbed[active], atol=MICRO_LOGPROB, rtol=0)
    assert (recorded[active] - clean[active]).abs().max() > 100 * MICRO_LOGPROB


def test_logit_noise_mismatch_grows_kl_mismatch_with_sigma_and_feeds_a_correction(micro_model_dir, tmp_path):
    kls = {}
    for sigma in (0.1, 1.0):
        run = tmp_path / f"sigma{sigma}"
        train(
            micro_config(
                micro_model_dir,
                run,
                method="clip",
                max_steps=2,
                mismatch=f"logit-noise:{sigma}",
                correction="mis",
            )
        )
        metrics = read_metrics(run)
        kls[sigma] = sum(m["kl_mismatch"] for m in metrics) / len(metrics)
        assert all(
            "loss/is_weight/mean" in m for m in metrics
        )  # the sampler's numbers reached the correction
    assert MICRO_LOGPROB**2 < kls[0.1] < kls[1.0]  # k3 ≈ E[δ²]/2 grows like σ²


@pytest.mark.parametrize(
    "value", ["logit-noise:0", "logit-noise:-1", "logit-noise:nan", "logit-noise:", "noise:0.1", "bf32"]
)
def test_error_bad_mismatch(micro_model_dir, tmp_path, value):
    with pytest.raises(ValueError, match=r"mismatch: expected none, bf16, fp16 or logit-noise:SIGMA"):
        micro_config(micro_model_dir, tmp_path / "run", mismatch=value).validate()


def test_old_logprobs_sampler_skips_the_behaviour_forward_and_trains_against_the_samplers_numbers(
    micro_model_dir, tmp_path, monkeypatch
):
    """--old-logprobs sampler (bypass mode) at N = 4: no behaviour forward runs, every mini-batch's
    pi_old is the log-probs the sampler recorded, and kl_mismatch (0 by construction) is absent."""

    def no_behaviour_forward(*args, **kwargs):
        raise AssertionError("the behaviour forward ran under --old-logprobs sampler")

    olds = []
    real_update = Learner.update

    def spy(learner, minibatch):
        olds.append((minibatch.old_logprobs, minibatch.batch.rollout_logprobs))
        return real_update(learner, minibatch)

    monkeypatch.setattr(staleness_module, "behaviour_logprobs", no_behaviour_forward)
    monkeypatch.setattr(Learner, "update", spy)
    config = micro_config(
        micro_model_dir, tmp_path / "run", staleness=4, max_steps=8, method="clip", old_logprobs="sampler"
    )
    train(config)
    assert len(olds) == 8
    for old, sampler in olds:
        assert old is not None and torch.equal(old, sampler)
    metrics = read_metrics(tmp_path / "run")
    assert all("kl_mismatch" not in m and "kl_behaviour" in m for m in metrics)
    assert [m["rollout/minibatch"] for m in metrics] == [0, 1, 2, 3] * 2
    assert TrainConfig.from_yaml(tmp_path / "run" / "config.yaml").old_logprobs == "sampler"


def test_old_logprobs_sampler_at_n_one_puts_the_mismatch_into_the_ratio(micro_model_dir, tmp_path):
    """N = 1 with a bf16 sampler: recompute trains at ratio exactly 1 (pi_old is the learner's own
    numbers) and logs kl_mismatch; sampler makes pi_old the bf16 numbers, so the ratio pi_theta/mu
    moves off 1 by the mismatch, as verl's bypass mode with ppo_clip."""
    config = micro_config(
        micro_model_dir, tmp_path / "recompute", mismatch="bf16", method="clip", max_steps=2
    )
    train(config)
    for m in read_metrics(tmp_path / "recompute"):
        assert m["loss/ratio/min"] == 1.0 and m["loss/ratio/max"] == 1.0 and m["kl_mismatch"] > 0
    train(config.replace(old_logprobs="sampler", output_dir=str(tmp_path / "sampler")))
    for m in read_metrics(tmp_path / "sampler"):
        assert m["loss/ratio/max"] - m["loss/ratio/min"] > 1e-4 and "kl_mismatch" not in m
        assert m["kl_behaviour"] > 0  # the k3 of the bf16 sampler against the fp32 learner


def test_old_logprobs_resolves_per_mode_and_is_recorded():
    assert TrainConfig().resolved().old_logprobs == "recompute"
    assert TrainConfig(mode="async").resolved().old_logprobs == "sampler"
    assert TrainConfig(old_logprobs="sampler").resolved().old_logprobs == "sampler"


# ---------------------------------------------------------------------- 2. asynchronous lag
@pytest.mark.numerics
def test_async_fixed_lag_schedule_bounds_lag_and_uses_generation_logprobs(
    micro_model_dir, tmp_path, monkeypatch
):
    seen = []
    real_update = Learner.update

    def spy(learner, minibatch):
        # The behaviour log-probs are the worker's own, recorded while sampling (the same memory) ...
        recorded = minibatch.batch.rollout_logprobs
        assert torch.equal(minibatch.old_logprobs, recorded)
        assert minibatch.old_logprobs.data_ptr() == recorded.data_ptr()
        # ... and they are the lagged weights' numbers, not the current learner's.
        with torch.no_grad():
            current = completion_logprobs_of(
                learner.model,
                minibatch.batch.input_ids,
                minibatch.batch.attention_mask,
                minibatch.batch.completion_length,
            ).logprobs
        mask = minibatch.batch.completion_mask.bool()
        seen.append((minibatch.lag, float((current - minibatch.old_logprobs)[mask].abs().max())))
        return real_update(learner, minibatch)

    monkeypatch.setattr(Learner, "update", spy)
    config = micro_config(
        micro_model_dir, tmp_path / "run", mode="async", max_lag=2, lag_schedule=[0, 3, 1, 2], max_steps=8
    )
    train(config)
    metrics = read_metrics(tmp_path / "run")
    expected = [min([0, 3, 1, 2][step % 4], 2, step) for step in range(8)]
    assert [m["lag"] for m in metrics] == expected
    assert max(m["lag"] for m in metrics) <= config.max_lag
    assert [m["policy_version"] for m in metrics] == [step - lag for step, lag in enumerate(expected)]
    grad_norms = [m["grad_norm"] for m in metrics]
    for step, (lag, difference) in enumerate(seen):
        if lag == 0:
            assert difference < MICRO_LOGPROB  # same weights: the sampler's and learner's float paths
        elif any(norm > 0 for norm in grad_norms[step - lag : step]):
            # stale weights: the recorded numbers differ from the learner's (by >> 6e-5)
            assert difference > 1e-3
    assert sum(lag > 0 and difference > 1e-3 for lag, difference in seen) >= 4


def independent_logprobs(model, batch) -> torch.Tensor:
    """``[B, T]`` log-probs of the completion tokens from one plain full forward (no KV cache,
    none of softtrust's log-prob code): log_softmax of the logits, gathered at the next token."""
    ids, attention = batch.input_ids, batch.attention_mask
    width = batch.completion_length
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.double()
    return torch.log_softmax(logits[:, -width - 1 : -1], -1).gather(-1, ids[:, -width:, None]).squeeze(-1)


@pytest.mark.numerics
def test_async_worker_stays_within_max_lag_and_its_logprobs_are_those_of_the_version_it_claims(
    micro_model_dir, tmp_path, monkeypatch
):
    """The concurrent worker: every batch's behaviour log-probs equal the log-probs of the weights
    of the version the batch claims (recomputed independently), and differ from other versions'."""
    from transformers import AutoModelForCausalLM

    weights, batches = {}, []
    real_update = Learner.update

    def spy(learner, minibatch):
        weights[len(batches)] = {
            k: v.detach().clone() for k, v in learner.policy.state_dict().items()
        }  # version s
        batches.append(minibatch)
        return real_update(learner, minibatch)

    monkeypatch.setattr(Learner, "update", spy)
    config = micro_config(micro_model_dir, tmp_path / "run", mode="async", max_lag=1, max_steps=8)
    train(config)
    metrics = read_metrics(tmp_path / "run")
    lags = [m["lag"] for m in metrics]
    assert len(lags) == 8 and max(lags) <= 1 and min(lags) >= 0
    assert all(m["seconds/sample"] > 0 for m in metrics)  # the worker's time, one rollout a step
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    distinguished = 0
    for step, minibatch in enumerate(batches):
        version = minibatch.batch.policy_version
        assert step - version == minibatch.lag == lags[step]
        mask = minibatch.batch.completion_mask.bool()
        model.load_state_dict(weights[version])
        claimed = independent_logprobs(model, minibatch.batch)
        # float32 sampling (KV cache) against a float64 full forward: the log-prob budget
        assert float((claimed - minibatch.old_logprobs.double())[mask].abs().max()) < MICRO_LOGPROB, step
        other = version + 1 if version + 1 in weights else version - 1
        if other >= 0:
            model.load_state_dict(weights[other])
            wrong = independent_logprobs(model, minibatch.batch)
            distinguished += float((wrong - minibatch.old_logprobs.double())[mask].abs().max()) > 1e-3
    assert distinguished >= 6  # the check tells versions apart (lr 1e-2 moves the weights)


@pytest.mark.numerics
def test_bf16_rollout_mismatch_feeds_the_correction_weights(micro_model_dir, tmp_path):
    # N = 1: the learner's ratio is exactly 1, but the bf16 sampler's log-probs differ from the
    # fp32 learner's, so the truncated-IS weight pi_old / pi_rollout is not 1.
    config = micro_config(
        micro_model_dir, tmp_path / "run", mismatch="bf16", correction="tis:cap=2", method="clip", max_steps=2
    )
    train(config)
    for m in read_metrics(tmp_path / "run"):
        assert m["loss/ratio/min"] == 1.0 and m["loss/ratio/max"] == 1.0
        assert m["loss/is_weight/max"] - m["loss/is_weight/min"] > 1e-3
    train(config.replace(mismatch="none", output_dir=str(tmp_path / "exact")))
    for m in read_metrics(tmp_path / "exact"):
        # Same numerics: the sampler and the learner agree up to float32 rounding, |log w| within
        # the log-prob budget (bf16 above: spread > 1e-3).
        assert (
            abs(m["loss/is_weight/min"] - 1) < MICRO_LOGPROB
            and abs(m["loss/is_weight/max"] - 1) < MICRO_LOGPROB
        )


@pytest.mark.numerics
def test_reject_with_tis_from_the_command_line_drops_the_tokens_past_its_bound(micro_model_dir, tmp_path):
    # bf16 sampler vs fp32 learner: token |log rho| ~ 1e-3, so k3 = rho - 1 - log rho ~ 5e-7.
    # A bound of 2e-7 rejects some tokens, not all; a bound of 1 rejects none. TIS still weighs
    # the kept ones (its weights are logged next to the rejected fraction).
    spec = "tis:cap=2+reject:divergence=k3,level=token,high={}"
    config = micro_config(
        micro_model_dir, tmp_path / "tight", mismatch="bf16", method="clip", correction=spec.format(2e-7)
    )
    config = config.replace(max_steps=2)
    train(config)
    dropped = [m["loss/reject/dropped"] for m in read_metrics(tmp_path / "tight")]
    assert all(0 < fraction < 1 for fraction in dropped), dropped
    assert all(m["loss/is_weight/max"] != 1.0 for m in read_metrics(tmp_path / "tight"))
    train(config.replace(correction=spec.format(1), output_dir=str(tmp_path / "loose")))
    assert [m["loss/reject/dropped"] for m in read_metrics(tmp_path / "loose")] == [0.0, 0.0]


# ---------------------------------------------------------------------- the decoupled objective (--proximal)
def test_loglinear_alpha_at_known_versions():
    from softtrust.train.proximal import loglinear_alpha

    # AReaL's own example: behaviour 3, proximal 7, current 8 -> 4/5
    assert loglinear_alpha(3, 7, 8) == pytest.approx(0.8)
    assert loglinear_alpha(0, 2, 4) == pytest.approx(0.5)
    assert loglinear_alpha(7, 7, 8) == 0.0  # behaviour = proximal: pi_prox = mu
    # softtrust's trainer: the forward runs with the weights before the update, v_theta = v_prox
    assert loglinear_alpha(3, 7, 7) == 1.0
    assert loglinear_alpha(5, 5, 5) == 1.0  # lag 0: 0/0, all three policies are one
    with pytest.raises(ValueError, match="behaviour <= proximal <= current"):
        loglinear_alpha(8, 7, 7)
    with pytest.raises(ValueError, match="current_version must be an integer >= 0"):
        loglinear_alpha(0, 1, 1.5)


def recording_loss(monkeypatch, calls: list):
    """Make the trainer's loss record what it is called with (and its loss)."""
    real_call = st.PolicyLoss.__call__

    def recorded(loss_fn, logprobs, old, advantages, mask, **kwargs):
        out = real_call(loss_fn, logprobs, old, advantages, mask, **kwargs)
        calls.append(
            (logprobs.detach(), old, advantages, mask, kwargs["rollout_logprobs"], out.loss.detach())
        )
        return out

    monkeypatch.setattr(st.PolicyLoss, "__call__", recorded)


@pytest.mark.numerics
def test_decoupled_objective_is_the_behaviour_weighted_policy_gradient(
    micro_model_dir, tmp_path, monkeypatch
):
    """--proximal recompute: old = pi_prox (a no-grad forward of the weights before the update,
    so r = 1 exactly), sampler = mu, weight pi_prox/mu uncapped. For Clip at r = 1 the token-mean
    loss is then -sum m exp(logp - mu) A / sum m, in closed form; at lag 0 it is the plain loss
    (the same weights as --proximal none), and loglinear (alpha = 1 here) is recompute without
    the forward: the same weights, bit for bit."""
    lags = dict(mode="async", max_lag=2, lag_schedule=[0, 2, 1], method="clip", max_steps=5)
    calls = []
    recording_loss(monkeypatch, calls)
    train(micro_config(micro_model_dir, tmp_path / "recompute", proximal="recompute", **lags))
    behaviour_lags = [m["lag"] for m in read_metrics(tmp_path / "recompute")]
    assert behaviour_lags == [0, 1, 1, 0, 2]
    moved = 0
    for (logprobs, old, advantages, mask, mu, loss), lag in zip(calls, behaviour_lags, strict=True):
        assert torch.equal(old * mask, logprobs * mask)  # pi_prox: the current weights' log-probs
        weight = torch.exp(logprobs - mu) * mask  # pi_prox / mu
        expected = -(weight * advantages[:, None]).sum() / mask.sum()
        # the same float32 numbers summed in another order: ~24 tokens of |w·A| <= ~2
        budget = rounding_budget(EPS32, terms=float(mask.sum()), scale=2.0)  # ≈ 1.2e-5
        torch.testing.assert_close(loss, expected, rtol=0, atol=budget)
        moved += lag > 0 and float((weight - mask).abs().max()) > 1e-3
    assert moved >= 2  # the behaviour weight is not 1 where the rows are stale
    recompute = model_parameters_from_dir(str(tmp_path / "recompute" / "final"))
    train(micro_config(micro_model_dir, tmp_path / "loglinear", proximal="loglinear", **lags))
    loglinear = model_parameters_from_dir(str(tmp_path / "loglinear" / "final"))
    for name, tensor in recompute.items():
        torch.testing.assert_close(loglinear[name], tensor, rtol=0, atol=0, msg=name)
    assert [m["proximal/alpha"] for m in read_metrics(tmp_path / "loglinear")] == [1.0] * 5

    at_lag_0 = {**lags, "lag_schedule": [0]}
    train(micro_config(micro_model_dir, tmp_path / "plain0", proximal="none", **at_lag_0))
    train(micro_config(micro_model_dir, tmp_path / "recompute0", proximal="recompute", **at_lag_0))
    # lag 0: mu is the same weights' log-probs (up to kernel rounding, ~5e-7), so r (plain) and
    # pi_prox/mu (decoupled) are the same numbers in another order: equal losses and gradients,
    # step by step, up to float32 rounding. Loss: a token-mean of ~24 terms |r·A| <= ~2; gradient
    # norm: sums of ~1e3 products; weights: 5 Adam steps at lr 1e-2 from gradients summing 8 rows
    # x 7 positions x 64 hidden units of products (budgets.adam_budget).
    loss_budget = rounding_budget(EPS32, terms=24, scale=2.0)  # ≈ 1.2e-5
    norm_budget = rounding_budget(EPS32, terms=1e3)  # relative, ≈ 3.8e-5
    for mine, theirs in zip(
        read_metrics(tmp_path / "recompute0"), read_metrics(tmp_path / "plain0"), strict=True
    ):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=loss_budget)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=norm_budget)
    plain = model_parameters_from_dir(str(tmp_path / "plain0" / "final"))
    decoupled = model_parameters_from_dir(str(tmp_path / "recompute0" / "final"))
    weights_budget = adam_budget(steps=5, lr=1e-2, gradient_terms=8 * 7 * 64)  # ≈ 2e-4
    initial = model_parameters_from_dir(micro_model_dir)
    assert max(float((plain[k] - initial[k]).abs().max()) for k in initial) > 100 * weights_budget
    for name, tensor in plain.items():
        torch.testing.assert_close(decoupled[name], tensor, rtol=0, atol=weights_budget, msg=name)


@pytest.mark.parametrize("truncation", [{"top_k": 3}, {"top_p": 0.5}])
def test_recomputed_proximal_policy_is_scored_like_the_policy_under_truncation(
    micro_model_dir, tmp_path, monkeypatch, truncation
):
    """--proximal recompute with top-k / top-p sampling: pi_prox is the same weights scored the same
    way (the truncated policy), so r = pi_theta / pi_prox is 1 exactly on every token. Scoring
    pi_prox untruncated (as before the learner's one log-prob function) gives r != 1 wherever
    the truncation renormalises."""
    calls = []
    recording_loss(monkeypatch, calls)
    lags = dict(mode="async", max_lag=1, lag_schedule=[1], method="clip", max_steps=3)
    train(micro_config(micro_model_dir, tmp_path / "run", proximal="recompute", **truncation, **lags))
    for logprobs, old, _, mask, mu, _ in calls:
        assert torch.equal(old * mask, logprobs * mask)  # pi_prox = the policy's own log-probs
        assert float(((logprobs - mu) * mask).abs().max()) > 0  # while mu (the lagged sampler) differs


def test_held_proximal_policy_is_a_forward_of_the_snapshot_refreshed_every_m_updates(
    micro_model_dir, tmp_path, monkeypatch
):
    """--proximal held --proximal-every 2: at step s, pi_prox is the log-probs of the policy's weights
    at step 2 floor(s / 2) (recomputed here from the weights recorded before each update), so the
    clip's anchor stays put between refreshes: at odd steps it differs from the current policy."""
    weights, batches, calls = [], [], []
    real_update = Learner.update

    def spy(learner, minibatch):
        weights.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
        batches.append(minibatch.batch)
        return real_update(learner, minibatch)

    monkeypatch.setattr(Learner, "update", spy)
    recording_loss(monkeypatch, calls)
    lags = dict(mode="async", max_lag=2, lag_schedule=[0, 2, 1], method="clip", max_steps=5)
    train(micro_config(micro_model_dir, tmp_path / "run", proximal="held", proximal_every=2, **lags))
    metrics = read_metrics(tmp_path / "run")
    assert [m["proximal/age"] for m in metrics] == [0, 1, 0, 1, 0]
    from transformers import AutoModelForCausalLM

    snapshot = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    assert len(calls) == 5
    apart = 0
    for step, (logprobs, old, _, mask, _, _) in enumerate(calls):
        snapshot.load_state_dict(weights[step - step % 2])
        minibatch = batches[step]
        with torch.no_grad():
            expected = completion_logprobs_of(
                snapshot, minibatch.input_ids, minibatch.attention_mask, minibatch.completion_length
            ).logprobs
        torch.testing.assert_close(old * mask, expected * mask, rtol=0, atol=0)
        apart += step % 2 == 1 and float(((old - logprobs) * mask).abs().max()) > 1e-4
    assert apart == 2  # between refreshes pi_prox is not the current policy


@pytest.mark.parametrize(
    ("values", "field"),
    [({"proximal": "held"}, "proximal"), ({"proximal": "recompute", "proximal_every": 2}, "proximal_every")],
)
def test_proximal_every_goes_with_held_only(values, field):
    with pytest.raises(ValueError, match=f"^{field}: --proximal held needs --proximal-every"):
        TrainConfig(mode="async", **values).validate()


# ---------------------------------------------------------------------- 3. resume and killed saves
def test_resume_mid_rollout_equals_straight_run(micro_model_dir, tmp_path):
    # N = 3 and k = 4: the checkpoint falls inside a rollout, so pending mini-batches must be saved.
    common = dict(staleness=3, method="vespo")
    train(micro_config(micro_model_dir, tmp_path / "straight", max_steps=8, **common))
    train(micro_config(micro_model_dir, tmp_path / "resumed", max_steps=4, **common))
    train(
        micro_config(
            micro_model_dir, tmp_path / "resumed", max_steps=8, resume=str(tmp_path / "resumed"), **common
        )
    )

    straight, resumed = model_parameters(tmp_path / "straight"), model_parameters(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 9))
    assert [m["reward/mean"] for m in read_metrics(tmp_path / "resumed")] == [
        m["reward/mean"] for m in read_metrics(tmp_path / "straight")
    ]


def test_process_killed_during_save_leaves_previous_checkpoint_loadable(micro_model_dir, tmp_path):
    output_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os, torch
        from softtrust.train import checkpoint
        from softtrust.train.config import TrainConfig
        from softtrust.train.options import load_resume_config
        from softtrust.train.trainer import train

        real_save, calls = torch.save, []
        def dying_save(obj, path, *args, **kwargs):
            calls.append(path)
            if len(calls) == 2:  # the second checkpoint: die half-way through writing it
                with open(path, "wb") as handle:
                    handle.write(b"partial")
                os._exit(9)
            return real_save(obj, path, *args, **kwargs)
        checkpoint.torch.save = dying_save
        train(TrainConfig(model={micro_model_dir!r}, task="addition-1digit", group_size=2, prompts_per_step=2,
                          max_new_tokens=3, staleness=1, max_steps=6, eval_every=0, eval_size=8, save_every=2,
                          output_dir={str(output_dir)!r}, progress=False))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 9, result.stderr[-2000:]
    found = find_checkpoint(output_dir)
    assert found.name == "step-000002"
    model = build_tiny_model(build_char_tokenizer(), MICRO, seed=123)
    state = load_checkpoint(found, model)
    assert state["step"] == 2
    # ... and the run resumes from it to the end.
    summary = train(load_resume_config({"resume": str(output_dir), "max_steps": 4}))
    assert summary["steps"] == 4
    assert summary["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # --device auto
    assert not list((output_dir / "checkpoints").glob(".tmp-*"))


def test_checkpoint_loads_with_weights_only(micro_model_dir, tmp_path):
    train(micro_config(micro_model_dir, tmp_path / "run", staleness=2, max_steps=3))
    checkpoint = find_checkpoint(tmp_path / "run")
    state = torch.load(checkpoint / checkpoint_module.STATE_FILE, weights_only=True)
    assert (
        state["step"] == 3 and len(state["rollouts"]["pending"]) == 1
    )  # one mini-batch of rollout 2 pending


# ---------------------------------------------------------------------- reliability
def test_nonfinite_losses_are_skipped_then_stop_with_a_loadable_checkpoint(
    micro_model_dir, tmp_path, monkeypatch
):
    real_call = st.PolicyLoss.__call__

    def poisoned(loss_fn, logprobs, *args, **kwargs):
        out = real_call(loss_fn, logprobs, *args, **kwargs)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(st.PolicyLoss, "__call__", poisoned)
    config = micro_config(micro_model_dir, tmp_path / "run", max_steps=10, max_nonfinite=3)
    before = model_parameters_from_dir(micro_model_dir)
    with pytest.raises(TrainingStopped, match="3 non-finite"):
        train(config)
    metrics = read_metrics(tmp_path / "run")
    assert [m["skipped"] for m in metrics] == [1, 1, 1]
    assert metrics[-1]["nonfinite_skips"] == 3
    model = build_tiny_model(build_char_tokenizer(), MICRO, seed=99)
    state = load_checkpoint(find_checkpoint(tmp_path / "run"), model)
    assert state["step"] == 3
    for name, tensor in model.state_dict().items():  # no update was applied
        if name in before:
            torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    # no summary.json: the stop event records the code, so the study pairs the stop as this code's
    from softtrust.study.runs import load_run

    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (stop,) = [event for event in events if "stopped" in event]
    assert stop["step"] == 3 and "3 non-finite" in stop["stopped"] and "git_commit" in stop["provenance"]
    assert not (tmp_path / "run" / "summary.json").exists()
    assert load_run(tmp_path / "run")["provenance"] == stop["provenance"]


def model_parameters_from_dir(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "model.safetensors"))


def flaky_reward(completion: str, answer: str):
    """A user reward that fails on some completions: raises on '1...', returns a string on
    '0...', inf on '2...', True on '3...'; otherwise the completion's length / 3."""
    if completion.startswith("1"):
        raise RuntimeError("boom")
    special = {"0": "not a number", "2": float("inf"), "3": True}
    return special.get(completion[:1], len(completion) / 3)


def flaky_expected(completion: str) -> float:
    """What the scorer must make of ``flaky_reward``: 0 for every failure, else the value."""
    return 0.0 if completion[:1] in ("0", "1", "2", "3") else len(completion) / 3


def test_rewards_are_the_task_reward_of_the_decoded_completions_and_failures_score_zero(
    micro_model_dir, tmp_path, monkeypatch
):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": f"{2 * i:02d}"}) + "\n" for i in range(10))
    )
    tokenizer = build_char_tokenizer()
    batches = []
    real_update = Learner.update

    def spy(learner, minibatch):
        batches.append(minibatch.batch)
        return real_update(learner, minibatch)

    monkeypatch.setattr(Learner, "update", spy)
    # Random weights emit every character: completions start with every digit.
    config = micro_config(
        micro_model_dir,
        tmp_path / "run",
        dataset=str(dataset),
        reward=f"{__name__}:flaky_reward",
        group_size=8,
        prompts_per_step=4,
        max_steps=3,
        eval_size=4,
    )
    summary = train(config)
    failures = 0
    for batch, logged in zip(batches, read_metrics(tmp_path / "run"), strict=True):
        mask = batch.completion_mask.bool()
        completion_ids = batch.input_ids[:, -batch.completion_length :]
        # the completions decoded again from the token ids, up to their first end of sequence
        texts = [
            tokenizer.decode(
                [t for t, m in zip(ids, row, strict=True) if m and t != tokenizer.eos_token_id],
                skip_special_tokens=True,
            )
            for ids, row in zip(completion_ids.tolist(), mask.tolist(), strict=True)
        ]
        assert texts == batch.completions
        expected = torch.tensor([flaky_expected(text) for text in texts])
        torch.testing.assert_close(batch.rewards, expected, rtol=0, atol=0)
        assert logged["reward/mean"] == pytest.approx(float(expected.mean()), abs=1e-7)
        failures += sum(text[:1] in ("0", "1", "2", "3") for text in texts)
    assert failures > 0 and summary["reward_failures"] == failures
    with pytest.raises((RuntimeError, TypeError)):
        train(config.replace(output_dir=str(tmp_path / "strict"), strict_reward=True))


@pytest.mark.parametrize("value", [float("inf"), "1.0", True, torch.tensor(1.0)], ids=repr)
def test_an_invalid_reward_scores_zero_in_rl_and_counts_as_wrong_in_evaluation(micro_model_dir, value):
    from transformers import AutoModelForCausalLM

    from softtrust.train.problem import Problem
    from softtrust.train.rollout import RewardScorer, greedy_accuracy

    class Task:
        def reward(self, completion, answer):
            return value

    scorer = RewardScorer(Task())
    assert scorer("x", "y") == 0.0 and scorer.failures == 1
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True)
    problems = [Problem(f"{i}+1=", "x") for i in range(4)]
    assert greedy_accuracy(model, build_char_tokenizer(), Task(), problems, 3) == 0.0
    with pytest.raises(TypeError, match="expected a finite number"):
        greedy_accuracy(model, build_char_tokenizer(), Task(), problems, 3, strict=True)


def test_training_never_draws_a_held_out_problem_and_a_pool_too_small_is_refused(
    micro_model_dir, tmp_path, monkeypatch
):
    from softtrust.train.rollout import ProblemSampler
    from softtrust.train.tasks import build_task, held_out_problems

    drawn = []
    real_draw = ProblemSampler.draw

    def spy(self, count):
        problems = real_draw(self, count)
        drawn.extend(problem.prompt for problem in problems)
        return problems

    monkeypatch.setattr(ProblemSampler, "draw", spy)
    config = micro_config(micro_model_dir, tmp_path / "run", eval_size=90, max_steps=3, staleness=2)
    train(config)
    task = build_task(None, config.dataset, "exact")
    held_out = {p.prompt for p in held_out_problems(task, 90, seed=trainer_module.EVAL_SEED)}
    assert len(drawn) == 4 * 2 and not set(drawn) & held_out  # 10 training problems left of 100
    with pytest.raises(ValueError, match="eval_size: the task has 100 distinct problems"):
        train(config.replace(eval_size=100, output_dir=str(tmp_path / "all-held-out")))
    assert not (tmp_path / "all-held-out").exists()


# ---------------------------------------------------------------------- outputs and --model
def test_run_directory_holds_config_metrics_checkpoints_final_summary_and_plot(micro_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = train(
        micro_config(micro_model_dir, tmp_path / "run", max_steps=3, save_every=2, report_to="tensorboard")
    )
    run = tmp_path / "run"
    assert TrainConfig.from_yaml(run / "config.yaml").max_steps == 3
    assert len(read_metrics(run)) == 3
    assert (run / "reward_curve.png").stat().st_size > 0
    assert find_checkpoint(run).name == "step-000003"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    saved = json.loads((run / "summary.json").read_text())
    for key in (
        "accuracy_before",
        "accuracy_after",
        "score_before",
        "score_after",
        "steps",
        "method",
        "staleness",
        "wall_seconds",
    ):
        assert key in saved
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["eval/score"] for e in events if "eval/score" in e] == [
        saved["score_before"],
        saved["score_after"],
    ]
    # digit_reward gives partial credit: the score is its mean, the accuracy the share >= 1
    assert 0 <= saved["accuracy_after"] <= saved["score_after"] <= 1
    assert saved == json.loads(json.dumps(summary))
    model = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(run / "final", local_files_only=True)
    assert model.config.model_type == "qwen2" and tokenizer.eos_token == "</s>"


def test_without_a_progress_bar_a_line_is_printed_every_few_steps(capsys):
    """``--no-progress`` (every sweep cell) printed nothing until the run ended."""
    from softtrust.train.runlog import StepLines

    lines = StepLines(total=32, description="RL vespo N=8 sync")
    for step in range(32):
        lines.set_postfix({"reward": f"{step / 32:.3f}"})
        lines.update(1)
    printed = capsys.readouterr().err.splitlines()
    assert len(printed) >= 16  # every 32 // 16 = 2 steps (and at least once a minute)
    assert printed[0] == "RL vespo N=8 sync: step 2/32, reward 0.031"
    assert printed[-1] == "RL vespo N=8 sync: step 32/32, reward 0.969"


# ---------------------------------------------------------------------- completion length
def test_a_model_run_without_max_new_tokens_gets_room_for_a_chat_reply(micro_model_dir, tmp_path):
    """Old behaviour: ``--model`` runs without ``--max-new-tokens`` kept the embedded model's 6
    tokens, so a chat model's every completion was cut (reward and gradient 0, no warning)."""
    assert TrainConfig().effective_max_new_tokens == 6  # the embedded model: a 3-digit sum and its end
    assert TrainConfig(model=micro_model_dir).effective_max_new_tokens == 256
    assert TrainConfig(model=micro_model_dir, max_new_tokens=24).effective_max_new_tokens == 24
    run = tmp_path / "run"
    summary = train(micro_config(micro_model_dir, run, max_new_tokens=None, max_steps=1, eval_size=2))
    # recorded as the value used, so that a rerun from config.yaml or a resume uses the same
    assert summary["max_new_tokens"] == 256
    assert TrainConfig.from_yaml(run / "config.yaml").max_new_tokens == 256
    (metrics,) = read_metrics(run)
    assert metrics["completion/length"] > 6  # the random micro model rarely ends: it used the room


def test_the_trainer_warns_once_when_most_completions_are_cut(micro_model_dir, tmp_path, capsys):
    """Old behaviour: completions cut at ``max_new_tokens`` (no end token) scored 0 silently. The
    random micro model almost never samples its end token within 2 tokens: every rollout is cut."""
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, max_new_tokens=2, max_steps=3))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--max-new-tokens 2" in line]
    assert len(warnings) == 1, warnings  # three rollouts, one warning
    assert warnings[0].startswith("softtrust train: warning: ") and "without an end token" in warnings[0]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert sum("--max-new-tokens 2" in event.get("warning", "") for event in events) == 1


def test_cut_fraction_counts_full_length_completions_without_an_end_token():
    from softtrust.train.rollout import RolloutBatch, cut_fraction

    eos, pad = 2, 0
    completions = torch.tensor([[5, 6, 7], [5, eos, pad], [5, 6, eos], [7, 7, 7]])  # cut, ended, ended, cut
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    batch = RolloutBatch(
        input_ids=torch.cat([torch.ones(4, 2, dtype=torch.long), completions], dim=1),
        attention_mask=torch.cat([torch.ones(4, 2, dtype=torch.long), mask], dim=1),
        completion_mask=mask,
        rollout_logprobs=torch.zeros(4, 3),
        rewards=torch.zeros(4),
    )
    assert cut_fraction(batch, [eos], max_new_tokens=3) == 0.5
    assert cut_fraction(batch, [eos, 7], max_new_tokens=3) == 0.0  # 7 ends a turn too
    assert cut_fraction(batch, [eos], max_new_tokens=4) == 0.0  # every row ended before the limit


# ---------------------------------------------------------------------- 4. learning
LEARNING_MARGIN = 0.02  # about a third of the smallest gain measured over seeds x ISAs (0.057)


@pytest.mark.numerics
def test_short_run_raises_mean_reward_on_easy_task(tmp_path):
    """The embedded tiny Qwen2 on single-digit addition, after a fixed 100-step warm start
    (cached in a temporary directory): 60 on-policy steps of VESPO raise the mean reward of the
    last 10 steps above the first 10 by more than ``LEARNING_MARGIN``.

    Measured gains (this computation, seeds 0-4 under ATEN_CPU_CAPABILITY=default, avx2 and
    avx512, 1 thread; with 2 threads seeds 0 and 1 gave the same runs bit for bit): 0.057-0.21,
    median 0.11. Each float path is another trajectory (rounding changes a sampled token, then
    everything after it), so the margin is set from the spread over seeds and instruction sets,
    not from one run. It
    fails a trainer that lowers the reward (a flipped advantage sign, a wrong-signed loss); the
    same statistic for a run without updates (lr 1e-12, same problems and draws) lay in
    -0.05..0.05, so one short run cannot tell no learning from little: multi-seed figures
    (``softtrust sweep``) do that."""
    config = TrainConfig(
        task="addition-1digit",
        sft_steps=100,
        sft_target_accuracy=None,  # exactly 100 warm-start steps, whatever the embedded default
        cache_dir=str(tmp_path / "cache"),
        group_size=8,
        prompts_per_step=16,
        max_new_tokens=3,
        staleness=1,
        max_steps=60,
        lr=5e-4,
        eval_every=0,
        eval_size=16,
        output_dir=str(tmp_path / "run"),
        progress=False,
        seed=0,
    )
    train(config)
    rewards = [m["reward/mean"] for m in read_metrics(tmp_path / "run")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + LEARNING_MARGIN, (first, last)
    assert list((tmp_path / "cache" / "warmstart").glob("*.safetensors"))  # the warm start was cached


def test_warm_start_stops_at_the_target_accuracy_and_caches_the_steps_it_took(tmp_path):
    """``sft_target_accuracy``: the supervised phase checks greedy accuracy on its own validation
    set every 10 steps and stops once it reaches the target; the cached entry remembers how many
    steps that took, and a different target is a different cache entry."""
    from softtrust.train.rollout import ProblemSampler, greedy_accuracy
    from softtrust.train.tasks import build_task, held_out_problems
    from softtrust.train.trainer import EVAL_SEED, VALIDATION_SEED, VALIDATION_SIZE, warm_start_policy

    def warm(target, cache):
        config = TrainConfig(
            task="addition-1digit",
            sft_steps=300,
            sft_target_accuracy=target,
            cache_dir=str(cache),
            max_new_tokens=3,
            eval_size=16,
            output_dir=str(tmp_path / "run"),
            progress=False,
            seed=0,
        )
        task = build_task(config.task, None, "exact")
        eval_problems = held_out_problems(task, config.eval_size, seed=EVAL_SEED)
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, TinyModelConfig(), seed=0)
        events = []
        run = type(
            "Run",
            (),
            {"writes": False, "log_event": lambda self, record: events.append(record), "warn": print},
        )()
        warm_start_policy(config, run, model, tokenizer, task, eval_problems, config.effective_sft_steps)
        validation = ProblemSampler(task, seed=VALIDATION_SEED, exclude=eval_problems).draw(VALIDATION_SIZE)
        return events[-1], greedy_accuracy(model, tokenizer, task, validation, 3)

    event, accuracy = warm(0.3, tmp_path / "cache")
    steps = event["warmstart_steps"]
    assert not event["warmstart_cached"] and steps % 10 == 0 and 0 < steps < 300
    assert accuracy >= 0.3  # the stopping rule held when it stopped
    again, accuracy_again = warm(0.3, tmp_path / "cache")
    assert again["warmstart_cached"] and again["warmstart_steps"] == steps and accuracy_again == accuracy
    higher, accuracy_higher = warm(0.6, tmp_path / "cache")
    assert not higher["warmstart_cached"] and higher["warmstart_steps"] > steps  # another entry, trained on
    assert accuracy_higher >= 0.6


def test_a_shorter_step_budget_is_a_prefix_of_a_longer_run(micro_model_dir, tmp_path):
    """The sweep's quick preset reads its runs as the first half of the full study's: nothing
    before step S may depend on max_steps (rollouts, sampling, evaluation)."""
    common = dict(staleness=2, method="vespo", eval_every=2)
    short = train(micro_config(micro_model_dir, tmp_path / "short", max_steps=2, **common))
    train(micro_config(micro_model_dir, tmp_path / "long", max_steps=4, **common))
    short_metrics, long_metrics = read_metrics(tmp_path / "short"), read_metrics(tmp_path / "long")
    assert [m["reward/mean"] for m in short_metrics] == [m["reward/mean"] for m in long_metrics[:2]]
    assert [m["loss"] for m in short_metrics] == [m["loss"] for m in long_metrics[:2]]
    assert long_metrics[1]["eval/accuracy"] == short["accuracy_after"]


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CUDA", ""])
def test_unknown_device_is_refused_naming_the_field(device):
    with pytest.raises(ValueError, match=r"device: choose auto, cpu, cuda or cuda:N \(got"):
        TrainConfig(device=device).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused_before_any_work(device):
    with pytest.raises(
        ValueError, match=r"device: CUDA was asked for but torch.cuda.is_available\(\) is False"
    ):
        TrainConfig(device=device).validate()


def test_one_process_world_takes_the_resolved_device(monkeypatch):
    from softtrust.train.config import resolve_device
    from softtrust.train.distributed import init_world

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    current = []  # torch.cuda.set_device calls: Triton launches on the current device
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert init_world(device=resolve_device("cpu")).device == torch.device("cpu")
    assert current == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")  # auto takes a GPU when there is one
    assert init_world(device=resolve_device("cuda:1")).device == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_config_refuses_the_decoupled_objective_for_a_method_whose_class_says_so(monkeypatch):
    """The config reads ``Method.supports_proximal`` and its ``proximal_note``, not a method name:
    M2PO (which declares it) is refused; SAPO is accepted until its class declares the same.
    Fails if config.py tests for "m2po" by name again."""
    import softtrust as st

    with pytest.raises(ValueError, match="proximal: M2PO computes d"):
        TrainConfig(mode="async", proximal="loglinear", method="m2po").validate()
    config = TrainConfig(mode="async", proximal="loglinear", method="sapo")
    config.validate()
    monkeypatch.setattr(st.SAPO, "supports_proximal", False)
    monkeypatch.setattr(st.SAPO, "proximal_note", "SAPO refuses pi_prox here")
    with pytest.raises(ValueError, match="proximal: SAPO refuses pi_prox here; use --proximal none"):
        config.validate()
    assert all(cls.supports_proximal or cls.proximal_note for cls in st.METHODS.values())
