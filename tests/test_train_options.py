"""The trainer options of issue 35 on the main job: each runs a few steps on the micro model and
does what it says (self-normalised corrections, the adaptive KL controller, the entropy terms,
the advantage estimators)."""

from __future__ import annotations

import itertools

import pytest
import torch

import softtrust as st
from softtrust.train import trainer as trainer_module
from softtrust.train.trainer import train
from test_train import micro_config, read_metrics, write_micro_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


@pytest.mark.parametrize("micro_batch_size", [0, 3])
def test_self_normalized_tis_weights_average_one_over_each_mini_batch(
    micro_model_dir, tmp_path, micro_batch_size
):
    config = micro_config(
        micro_model_dir,
        tmp_path / "run",
        method="clip",
        correction="tis:cap=2,self_normalize=true",
        mismatch="bf16",
        staleness=2,
        micro_batch_size=micro_batch_size,
    )
    train(config)
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 4 and all(m["skipped"] == 0 for m in metrics)
    for m in metrics:  # token-weighted over the micro-batches: the whole mini-batch's mean weight
        assert m["loss/is_weight/mean"] == pytest.approx(1.0, abs=1e-5)
    assert any(m["loss/is_weight/batch_mean"] != pytest.approx(1.0, abs=1e-7) for m in metrics)


# ---------------------------------------------------------------------- KL: estimators, adaptive coefficient
def test_kl_target_moves_the_coefficient_by_the_ppo_rule_each_step(micro_model_dir, tmp_path):
    target, horizon, rows = 1e-3, 50.0, 8  # rows: prompts_per_step 2 x group_size 4
    config = micro_config(
        micro_model_dir,
        tmp_path / "run",
        method="clip",
        staleness=2,
        max_steps=5,
        kl_coef=0.2,
        kl_estimator="k3+",
        kl_target=target,
        kl_horizon=horizon,
    )
    train(config)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[0]["kl_coef"] == 0.2
    for before, after in itertools.pairwise(metrics):
        error = min(max(before["loss/kl"] / target - 1, -0.2), 0.2)
        assert after["kl_coef"] == pytest.approx(before["kl_coef"] * (1 + error * rows / horizon), rel=1e-12)
    assert metrics[-1]["kl_coef"] != metrics[0]["kl_coef"]


@pytest.mark.parametrize("estimator", ["abs", "k1+", "k3+", "k2"])
def test_each_kl_estimator_trains_on_the_main_job(micro_model_dir, tmp_path, estimator):
    """The policy starts as the reference (the KL is exactly 0 at step 1) and moves away from it; the
    logged loss/kl is that estimator's (abs, k2 >= 0; k3+ is k3's value >= 0)."""
    config = micro_config(
        micro_model_dir,
        tmp_path / "run",
        method="clip",
        staleness=2,
        max_steps=4,
        kl_coef=0.1,
        kl_estimator=estimator,
    )
    train(config)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[0]["loss/kl"] == 0.0 and all(m["kl_coef"] == 0.1 for m in metrics)
    assert any(m["loss/kl"] != 0.0 for m in metrics[1:])
    if estimator != "k1+":  # k1's value is a signed mean
        assert all(m["loss/kl"] >= 0.0 for m in metrics)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kl_target": 0.01}, "kl_target: the adaptive KL controller starts from --kl-coef"),
        ({"kl_coef": 0.1, "kl_target": 0.0}, "kl_target: must be > 0"),
        ({"kl_coef": 0.1, "kl_target": 0.01, "kl_horizon": 0.0}, "kl_horizon: must be > 0"),
        ({"kl_coef": 0.1, "kl_estimator": "k2+"}, "kl_estimator: choose one of"),
    ],
)
def test_error_bad_kl_options(micro_model_dir, tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        micro_config(micro_model_dir, tmp_path / "run", **values).validate()


# ---------------------------------------------------------------------- entropy: bonus, high-entropy tokens
def test_entropy_options_train_on_the_main_job_with_the_mini_batchs_threshold(micro_model_dir, tmp_path):
    """--entropy-quantile 0.5 keeps half of each mini-batch's active tokens, also when the
    mini-batch runs in micro-batches (one threshold over the whole mini-batch: the same kept
    fraction and loss as in one piece); --entropy-coef enters the loss; the entropy is logged."""
    runs = {}
    for pieces in (0, 3):
        config = micro_config(
            micro_model_dir,
            tmp_path / f"run{pieces}",
            method="clip",
            staleness=2,
            max_new_tokens=5,
            entropy_quantile=0.5,
            entropy_coef=0.01,
            micro_batch_size=pieces,
        )
        train(config)
        runs[pieces] = read_metrics(tmp_path / f"run{pieces}")
    whole, split = runs[0], runs[3]
    assert all(m["skipped"] == 0 for m in whole + split)
    for m in whole + split:  # half of the active tokens (ties aside), each mini-batch
        assert 0.4 <= m["loss/entropy/kept"] <= 0.6
        assert 0 < m["loss/entropy/min"] <= m["loss/entropy/mean"] <= m["loss/entropy/max"]
    # the first step starts from the same weights and rollout: micro-batches change only the rounding
    # (the kept fraction is the token-weighted mean of the pieces' fractions: float32 rounding)
    assert split[0]["loss/entropy/kept"] == pytest.approx(whole[0]["loss/entropy/kept"], rel=1e-6)
    assert split[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-5, abs=1e-7)
    assert split[0]["loss/entropy/mean"] == pytest.approx(whole[0]["loss/entropy/mean"], rel=1e-6)


def test_entropy_is_logged_by_default_and_logging_it_changes_no_number(micro_model_dir, tmp_path):
    """--log-entropy (default) adds loss/entropy/* and leaves the run bit for bit as it is without."""
    runs = {}
    for log in (True, False):
        train(micro_config(micro_model_dir, tmp_path / str(log), method="clip", staleness=2, log_entropy=log))
        runs[log] = read_metrics(tmp_path / str(log))
    assert all("loss/entropy/mean" in m and "loss/entropy/kept" not in m for m in runs[True])
    assert not any(name.startswith("loss/entropy") for m in runs[False] for name in m)
    for logged, plain in zip(runs[True], runs[False], strict=True):
        for name in ("loss", "grad_norm", "loss/ratio/mean", "kl_behaviour"):
            assert logged[name] == plain[name], name


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"entropy_quantile": 1.5}, "entropy_quantile: must be <= 1"),
        ({"entropy_quantile": -0.1}, "entropy_quantile: must be >= 0"),
        ({"entropy_coef": -0.01}, "entropy_coef: must be >= 0"),
    ],
)
def test_error_bad_entropy_options(micro_model_dir, tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        micro_config(micro_model_dir, tmp_path / "run", **values).validate()


# ---------------------------------------------------------------------- advantage estimators
def _lengths_mask(lengths):
    return torch.arange(int(lengths.max())) < lengths[:, None]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, lambda r, n: st.group_advantages(r, 4)),  # GRPO
        ({"advantage_scale": "none"}, lambda r, n: st.group_advantages(r, 4, scale="none")),  # Dr. GRPO
        ({"advantages": "rloo"}, lambda r, n: st.rloo_advantages(r, 4)),
        ({"advantages": "rloo", "advantage_scale": "batch"}, lambda r, n: st.rloo_advantages(r, 4, "batch")),
        ({"advantages": "reinforce++"}, lambda r, n: st.reinforce_pp_advantages(r, 4, _lengths_mask(n))),
        ({"advantages": "passk", "passk_k": 2}, lambda r, n: st.passk_advantages(r, 4, 2)),
    ],
    ids=["group", "dr-grpo", "rloo", "rloo-batch", "reinforce++", "passk"],
)
def test_advantage_estimators_train_on_the_main_job(micro_model_dir, tmp_path, monkeypatch, values, expected):
    calls = []
    real = trainer_module.rollout_advantages

    def recorded(rewards, config, world=None, lengths=None):
        advantages = real(rewards, config, world, lengths)
        calls.append((rewards.clone(), lengths.clone(), advantages))
        return advantages

    monkeypatch.setattr(trainer_module, "rollout_advantages", recorded)
    train(micro_config(micro_model_dir, tmp_path / "run", method="clip", max_steps=3, **values))
    metrics = read_metrics(tmp_path / "run")
    assert len(calls) == 3 and all(m["skipped"] == 0 for m in metrics)
    for (rewards, lengths, advantages), step in zip(calls, metrics, strict=True):
        assert lengths.tolist() == [int(n) for n in lengths] and lengths.min() >= 1
        torch.testing.assert_close(advantages, expected(rewards, lengths))
        # N = 1: the mini-batch is the rollout, so the logged advantages are these
        assert step["advantage/abs_mean"] == pytest.approx(float(advantages.abs().mean()), rel=1e-6)
    assert any(advantages.abs().sum() > 0 for _, _, advantages in calls)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"advantages": "ppo"}, "advantages: choose one of"),
        (
            {"advantages": "reinforce++", "advantage_scale": "batch"},
            "advantage_scale: --advantages reinforce",
        ),
        (
            {"advantages": "passk", "passk_k": 2, "advantage_scale": "group"},
            "advantage_scale: --advantages passk",
        ),
        ({"advantages": "passk"}, "passk_k: --advantages passk needs --passk-k"),
        ({"passk_k": 2}, "passk_k: --advantages passk needs --passk-k"),
        ({"advantages": "passk", "passk_k": 4}, "passk_k: must be below --group-size 4"),
        ({"advantages": "passk", "passk_k": 0}, "passk_k: must be >= 1"),
        ({"advantage_scale": "std"}, "advantage_scale: choose one of"),
    ],
)
def test_error_bad_advantage_options(micro_model_dir, tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        micro_config(micro_model_dir, tmp_path / "run", **values).validate()


def test_the_resolved_config_records_the_scale_each_estimator_uses(micro_model_dir, tmp_path):
    resolved = {
        name: micro_config(micro_model_dir, tmp_path, **values).resolved().advantage_scale
        for name, values in {
            "group": {},
            "rloo": {"advantages": "rloo"},
            "reinforce++": {"advantages": "reinforce++"},
            "passk": {"advantages": "passk", "passk_k": 2},
        }.items()
    }
    assert resolved == {"group": "group", "rloo": "none", "reinforce++": None, "passk": None}
