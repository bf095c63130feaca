"""Several optimizer updates per fetched batch in async mode (``--updates-per-batch U``, AReaL's
``ppo_n_minibatches``): the batch holds U x m prompts sampled by one version of the weights, its
U mini-batches are taken at consecutive steps, and pi_prox is held over them.

Runs use the micro model of ``test_train.py`` (a handful of steps each).
"""

from __future__ import annotations

import pytest
import torch

from softtrust.cli import main
from softtrust.train import staleness as staleness_module
from softtrust.train.checkpoint import find_checkpoint
from softtrust.train.config import TrainConfig
from softtrust.train.learner import Learner
from softtrust.train.options import load_resume_config
from softtrust.train.runlog import default_run_directory
from softtrust.train.scoring import completion_logprobs_of
from softtrust.train.trainer import train
from test_train import (
    micro_config,
    model_parameters,
    read_metrics,
    recording_loss,
    write_micro_model,
)

torch.set_num_threads(1)

# batch 0 (steps 0-2) sampled at lag 0 by version 0; batch 1 (steps 3-5) at lag 2 by version 1
BATCHES = dict(
    mode="async", max_lag=2, lag_schedule=[0, 2, 1], method="clip", max_steps=6, updates_per_batch=3
)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


def test_recomputed_proximal_policy_is_the_batchs_first_update_held_over_its_updates(
    micro_model_dir, tmp_path, monkeypatch
):
    """--updates-per-batch 3 --proximal recompute: each fetched batch of 3 x m prompts is 3
    updates at consecutive steps; pi_prox in each is a forward of the weights before the
    batch's first update (recomputed here from the weights recorded then), computed once at the
    fetch (before that update), and the behaviour weight's denominator is the sampler's mu. The
    clip acts on pi_theta / pi_prox: never on a batch's first update (ratio 1), and on later ones."""
    weights, minibatches, calls, events = [], [], [], []
    real_update, real_forward = Learner.update, staleness_module.behaviour_logprobs

    def spy(learner, minibatch):
        events.append("update")
        weights.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
        minibatches.append(minibatch)
        return real_update(learner, minibatch)

    def counting_forward(*args, **kwargs):
        events.append("forward")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(Learner, "update", spy)
    monkeypatch.setattr(staleness_module, "behaviour_logprobs", counting_forward)
    recording_loss(monkeypatch, calls)
    config = micro_config(micro_model_dir, tmp_path / "run", proximal="recompute", **BATCHES)
    train(config)
    metrics = read_metrics(tmp_path / "run")
    assert [m["rollout/index"] for m in metrics] == [0, 0, 0, 1, 1, 1]
    assert [m["rollout/minibatch"] for m in metrics] == [0, 1, 2] * 2
    rows = config.prompts_per_step * config.group_size  # m x G rows per update
    assert [tuple(m["rollout/rows"]) for m in metrics[:3]] == [
        (0, rows),
        (rows, 2 * rows),
        (2 * rows, 3 * rows),
    ]
    assert [m["policy_version"] for m in metrics] == [0, 0, 0, 1, 1, 1]
    assert [m["lag"] for m in metrics] == [0, 1, 2, 2, 3, 4]  # the first update's lag <= K, then +1 each
    assert [m["proximal/age"] for m in metrics] == [0, 1, 2] * 2
    assert events == (["forward"] * 3 + ["update"] * 3) * 2  # pi_prox: at the fetch, one forward a mini-batch

    from transformers import AutoModelForCausalLM

    snapshot = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    apart = 0
    for step, (logprobs, old, _, mask, mu, _) in enumerate(calls):
        snapshot.load_state_dict(weights[step - step % 3])  # the batch's first update
        batch = minibatches[step].batch
        with torch.no_grad():
            expected = completion_logprobs_of(
                snapshot, batch.input_ids, batch.attention_mask, batch.completion_length
            ).logprobs
        torch.testing.assert_close(old * mask, expected * mask, rtol=0, atol=0)
        assert torch.equal(mu, minibatches[step].old_logprobs)  # weight pi_prox / mu, mu the sampler's
        apart += step % 3 > 0 and float(((old - logprobs) * mask).abs().max()) > 1e-4
    assert apart == 4  # after the first update pi_prox is not the current policy
    clipped = [m["loss/clip/low"] + m["loss/clip/high"] for m in metrics]
    assert clipped[0] == clipped[3] == 0.0 and sum(c > 0 for c in clipped) >= 2


def test_held_every_u_equals_recompute_and_loglinear_interpolates_by_update(micro_model_dir, tmp_path):
    """--proximal held --proximal-every 3 refreshes its snapshot at every batch's first update:
    the same pi_prox as recompute, so the same weights bit for bit. loglinear's alpha on update u
    of a batch whose first update lagged lag0 is lag0 / (lag0 + u) (1 on the first update; 0 after
    a lag-0 fetch, where mu is already pi_prox)."""
    train(micro_config(micro_model_dir, tmp_path / "recompute", proximal="recompute", **BATCHES))
    train(micro_config(micro_model_dir, tmp_path / "held", proximal="held", proximal_every=3, **BATCHES))
    recompute, held = model_parameters(tmp_path / "recompute"), model_parameters(tmp_path / "held")
    assert all(torch.equal(held[name], recompute[name]) for name in recompute)
    assert [m["proximal/age"] for m in read_metrics(tmp_path / "held")] == [0, 1, 2] * 2
    train(micro_config(micro_model_dir, tmp_path / "loglinear", proximal="loglinear", **BATCHES))
    alphas = [m["proximal/alpha"] for m in read_metrics(tmp_path / "loglinear")]
    assert alphas == pytest.approx([1.0, 0.0, 0.0, 1.0, 2 / 3, 2 / 4], rel=1e-15)


def test_concurrent_worker_with_several_updates_per_batch_trains_and_resumes_mid_batch(
    micro_model_dir, tmp_path
):
    """The concurrent worker (no --lag-schedule), U = 2, K = 1: batches of 2 x m prompts, the
    first update of each lagging at most K and the second one more; 3 steps, then a resume
    mid-batch: step 4 is the pending second half of batch 1 (same version as step 3), then the
    worker restarts at batch 2 from the restored weights."""
    values = dict(mode="async", max_lag=1, method="clip", updates_per_batch=2, proximal="recompute")
    config = micro_config(micro_model_dir, tmp_path / "run", max_steps=3, **values)
    assert "-K1-U2-seed0-" in default_run_directory(config)
    train(config)
    state = torch.load(find_checkpoint(tmp_path / "run") / "state.pt", weights_only=True)
    assert len(state["rollouts"]["pending"]) == 1  # batch 1's second mini-batch, with its pi_prox
    assert state["rollouts"]["pending"][0]["proximal_logprobs"] is not None
    assert TrainConfig.from_yaml(tmp_path / "run" / "config.yaml").updates_per_batch == 2
    train(load_resume_config({"resume": str(tmp_path / "run"), "max_steps": 6}))
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and all(m["skipped"] == 0 for m in metrics)
    assert [m["rollout/index"] for m in metrics] == [0, 0, 1, 1, 2, 2]
    assert [m["rollout/minibatch"] for m in metrics] == [0, 1] * 3
    lags = [m["lag"] for m in metrics]
    assert all(0 <= lags[i] <= 1 and lags[i + 1] == lags[i] + 1 for i in (0, 2, 4)), lags
    assert metrics[3]["policy_version"] == metrics[2]["policy_version"]
    assert (metrics[4]["policy_version"], metrics[4]["lag"]) == (3, 1)  # restarted from step 3's weights
    assert [m["proximal/age"] for m in metrics] == [0, 1] * 3


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "async", "updates_per_batch": 0}, r"^updates_per_batch: must be >= 1 \(got 0\)$"),
        (
            {"updates_per_batch": 2},
            "^updates_per_batch: several updates per fetched batch are for --mode async",
        ),
    ],
)
def test_bad_updates_per_batch_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values).validate()


def test_updates_per_batch_in_sync_mode_is_a_one_line_cli_error(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--updates-per-batch", "4", "--output-dir", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("softtrust train: error: updates_per_batch: several updates per fetched batch")
    assert "use --staleness" in err and "(got 4)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not run.exists()
