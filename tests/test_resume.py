"""Run directories and resume: one run per directory, resume continues the run's own config in
the directory given, k + k steps with a resume equal 2k straight, the async worker resumes.

Every run uses the micro Qwen2 of ``test_train`` (``--model``), no warm start, a few steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from softtrust.cli import main
from softtrust.train.checkpoint import find_checkpoint
from softtrust.train.config import TrainConfig
from softtrust.train.options import load_resume_config
from softtrust.train.runlog import default_run_directory
from softtrust.train.trainer import train
from test_train import micro_config, model_parameters, read_metrics, write_micro_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


def cli_flags(config: TrainConfig) -> list[str]:
    """``config`` as ``softtrust train`` flags (every field, as the CLI would read them)."""
    flags = []
    for name, value in config.to_dict().items():
        if value is None or value in ({}, []):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


# ---------------------------------------------------------------------- one run per directory
def test_a_new_run_refuses_a_directory_that_holds_a_run(micro_model_dir, tmp_path):
    config = micro_config(micro_model_dir, tmp_path / "run", max_steps=3)
    train(config)
    before = {path.name: path.read_bytes() for path in (tmp_path / "run").glob("*.json*")}
    with pytest.raises(
        ValueError, match=r"output_dir: .* already holds a run .*--resume .*another --output-dir"
    ):
        train(config.replace(max_steps=2))
    after = {path.name: path.read_bytes() for path in (tmp_path / "run").glob("*.json*")}
    assert after == before  # metrics, events and summary untouched
    assert find_checkpoint(tmp_path / "run").name == "step-000003"


def test_default_run_directories_never_collide():
    config = TrainConfig(method="clip", staleness=4, seed=7)
    first, second = default_run_directory(config), default_run_directory(config)
    assert first != second  # the same second, the same method: still two directories
    assert Path(first).name.split("-")[2:5] == ["clip", "N4", "seed7"]


def test_empty_output_dir_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("mine: 1\n")
    assert main(["train", "--output-dir", "", "--max-steps", "1"]) == 2
    assert "softtrust train: error: output_dir: must not be empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert (tmp_path / "config.yaml").read_text() == "mine: 1\n"


# ---------------------------------------------------------------------- resume semantics
def test_resume_continues_the_stored_config_and_refuses_training_changes(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, method="clip", max_steps=2))
    # --method vespo (the default) on a clip run: refused naming the field, not continued as clip
    assert main(["train", "--resume", str(run), "--method", "vespo", "--max-steps", "4"]) == 2
    message = capsys.readouterr().err
    assert "softtrust train: error: method: a resumed run continues its own config" in message
    assert "method='vespo' (the run has 'clip')" in message
    assert len(read_metrics(run)) == 2
    # only the resumable fields given: the run goes on with its own settings (lr 1e-2, not the default)
    assert main(["train", "--resume", str(run), "--max-steps", "4", "--no-progress"]) == 0
    stored = TrainConfig.from_yaml(run / "config.yaml")
    assert (stored.method, stored.lr, stored.max_steps, stored.group_size) == ("clip", 1e-2, 4, 4)
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


def test_resume_writes_into_the_directory_given_not_the_recorded_one(micro_model_dir, tmp_path, capsys):
    original, copy = tmp_path / "original", tmp_path / "copy"
    train(micro_config(micro_model_dir, original, max_steps=2))
    shutil.copytree(original, copy)
    shutil.rmtree(original / "checkpoints")  # the original must not be needed, nor written
    snapshot = sorted(p.relative_to(original) for p in original.rglob("*"))
    summary = train(load_resume_config({"resume": str(copy), "max_steps": 4}))
    assert summary["final_dir"] == str(copy / "final") and summary["steps"] == 4
    assert sorted(p.relative_to(original) for p in original.rglob("*")) == snapshot
    assert [m["step"] for m in read_metrics(copy)] == [1, 2, 3, 4]
    assert TrainConfig.from_yaml(copy / "config.yaml").output_dir == str(copy)
    # a different --output-dir on resume is refused, naming the field
    assert main(["train", "--resume", str(copy), "--output-dir", str(tmp_path / "elsewhere")]) == 2
    assert "error: output_dir: a resumed run writes into its own directory" in capsys.readouterr().err


def test_resume_from_a_checkpoint_directory_uses_its_run(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, max_steps=4, save_every=2, keep_checkpoints=3))
    summary = train(load_resume_config({"resume": str(run / "checkpoints" / "step-000002"), "max_steps": 4}))
    assert summary["steps"] == 4
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]  # steps 3-4 dropped, then logged again


def test_a_torn_last_metrics_line_does_not_stop_a_resume(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, max_steps=2))
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "reward/me')  # killed while writing step 3
    summary = train(load_resume_config({"resume": str(run), "max_steps": 4}))
    assert summary["steps"] == 4
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------- k + k = 2k
DAPO = dict(reward="test_train:coarse_reward", group_size=2, mask_truncated=True, overlong_penalty=[2, 0.5])


def assert_same_run(straight: Path, resumed: Path) -> None:
    """Bitwise: the final weights and the per-step rewards, losses and gradient norms."""
    a, b = model_parameters(straight), model_parameters(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for key in ("step", "reward/mean", "loss", "grad_norm", "lag", "policy_version"):
        assert [m[key] for m in read_metrics(resumed)] == [m[key] for m in read_metrics(straight)], key


@pytest.mark.parametrize(
    "schedule",
    [
        dict(staleness=3, method="vespo"),  # sync: the checkpoint falls inside a rollout
        dict(staleness=3, method="clip", old_logprobs="sampler"),  # bypass: pi_old from the sampler
        dict(mode="async", max_lag=2, lag_schedule=[0, 2, 1], method="clip"),  # lagged async
        # the adaptive KL coefficient is in the checkpoint (a short horizon: it moves every step)
        dict(staleness=2, method="clip", kl_coef=0.5, kl_target=1e-4, kl_horizon=8.0),
        # the KL reference is the warm-started policy, which no checkpoint holds: a resume rebuilds it
        # (it was the model before the warm start: step 4's loss differed)
        dict(staleness=2, method="clip", kl_coef=0.5, sft_steps=20, sft_target_accuracy=None),
        # dynamic sampling: extra passes draw problems (the sampler's state is in the checkpoint)
        # and sample with keys of (rollout, pass, group); a 0/1 reward on groups of 2 drops many
        dict(staleness=3, method="clip", filter_groups=True, **DAPO),
        dict(mode="async", max_lag=2, lag_schedule=[0, 2, 1], method="clip", filter_groups=True, **DAPO),
        # the held pi_prox snapshot (taken before update 1, checkpoint after update 3) is restored, not
        # retaken from the resumed weights (update 4's advantages are all 0 here, update 5's are not)
        dict(
            mode="async", max_lag=2, lag_schedule=[0, 2, 1], method="clip", proximal="held", proximal_every=5
        ),
        # two updates per fetched batch: the checkpoint after update 3 falls inside batch 1, whose
        # pending second mini-batch keeps the pi_prox taken at its fetch (before update 3), not
        # one retaken from the resumed weights
        dict(
            mode="async",
            max_lag=2,
            lag_schedule=[0, 2, 1],
            method="clip",
            proximal="recompute",
            updates_per_batch=2,
        ),
    ],
    ids=[
        "sync",
        "sync-sampler-old-logprobs",
        "lagged-async",
        "adaptive-kl",
        "kl-after-warm-start",
        "sync-dapo",
        "lagged-async-dapo",
        "held-proximal",
        "updates-per-batch-mid-batch",
    ],
)
def test_k_plus_k_steps_with_a_resume_equal_2k_straight(micro_model_dir, tmp_path, schedule):
    train(micro_config(micro_model_dir, tmp_path / "straight", max_steps=6, **schedule))
    train(micro_config(micro_model_dir, tmp_path / "resumed", max_steps=3, **schedule))
    train(load_resume_config({"resume": str(tmp_path / "resumed"), "max_steps": 6}))
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")
    if schedule.get("sft_steps"):  # the resume rebuilt the KL reference without logging a second warm start
        events = [
            json.loads(line) for line in (tmp_path / "resumed" / "events.jsonl").read_text().splitlines()
        ]
        (start,) = [e for e in events if "warmstart_steps" in e]
        summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
        assert {k: summary[k] for k in start if k.startswith("warmstart")} == {
            k: v for k, v in start.items() if k.startswith("warmstart")
        }  # the run's own record, not the rebuild's
    if "kl_target" in schedule:
        coefs = [m["kl_coef"] for m in read_metrics(tmp_path / "straight")]
        assert [m["kl_coef"] for m in read_metrics(tmp_path / "resumed")] == coefs
        assert len(set(coefs)) == len(coefs)  # moved every step: a resume without it would differ
    if schedule.get("filter_groups"):  # the passes after the resume are those of the straight run
        keys = ("filter/draws", "filter/groups_dropped")
        assert [[m.get(k) for k in keys] for m in read_metrics(tmp_path / "resumed")] == [
            [m.get(k) for k in keys] for m in read_metrics(tmp_path / "straight")
        ]
        assert sum(m.get("filter/groups_dropped", 0) for m in read_metrics(tmp_path / "straight")) > 0


def test_concurrent_async_worker_resumes_from_the_learner_weights(micro_model_dir, tmp_path):
    """What a resume preserves for the concurrent worker: the step, weights, optimizer and
    scheduler, the counters and the lag bound; the worker restarts from the restored weights
    (so the first rollout after the resume has lag 0) and keeps its sync count."""
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, mode="async", max_lag=1, max_steps=3, method="clip"))
    state = torch.load(find_checkpoint(run) / "state.pt", weights_only=True)
    assert state["rollouts"]["kind"] == "async"
    syncs_before = state["rollouts"]["syncs"]
    resumed_at = model_parameters_at(find_checkpoint(run))
    train(load_resume_config({"resume": str(run), "max_steps": 6}))
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= m["lag"] <= 1 for m in metrics)
    assert (metrics[3]["policy_version"], metrics[3]["lag"]) == (3, 0)
    assert metrics[3]["rollout/syncs"] >= syncs_before
    final_state = torch.load(find_checkpoint(run) / "state.pt", weights_only=True)
    assert final_state["step"] == 6 and final_state["scheduler"]["last_epoch"] == 6
    after = model_parameters_at(find_checkpoint(run))
    assert any(not torch.equal(resumed_at[name], after[name]) for name in after)  # it trained on


def model_parameters_at(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_resume_with_no_complete_checkpoint_is_a_clear_error(micro_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, max_steps=1))
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "softtrust train: error: resume: no complete checkpoint under" in err and "Traceback" not in err
    assert main(["train", "--resume", str(tmp_path)]) == 2  # not a run directory
    assert "error: resume:" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"has no checkpoint, so it cannot be resumed; choose another"):
        train(micro_config(micro_model_dir, run, max_steps=1))  # not "resume it": no dead end
    json.loads((run / "summary.json").read_text())  # the run's files are intact


def crashed_before_training(run: Path, config: TrainConfig) -> None:
    """What a run that crashed before its first step leaves (while loading the model, in the warm
    start or in its first rollout): its config, the warm start's and the first evaluation's events,
    an empty metrics file and a checkpoint directory with only a save's temporary leftover."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config.to_yaml())
    old_events = [{"warmstart_steps": 0, "marker": "old run"}, {"step": 0, "eval/accuracy": 0.125}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old_events))
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints" / ".tmp-step-000001-x").mkdir(parents=True)


def test_a_run_that_never_trained_is_no_dead_end(micro_model_dir, tmp_path, capsys):
    """Issue 37: after a crash before the first checkpoint a new run said "resume it" and the
    resume "start again in a new dir". A run that never trained a step: the resume says to start
    again in the same directory, and a new run there takes it over (its old events go)."""
    run = tmp_path / "run"
    config = micro_config(micro_model_dir, run, max_steps=2)
    crashed_before_training(run, config)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"a new run with --output-dir {run} takes it over" in err
    summary = train(config)
    assert summary["steps"] == 2 and [m["step"] for m in read_metrics(run)] == [1, 2]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert not any(e.get("marker") == "old run" for e in events)
    assert any("never trained a step" in e.get("warning", "") for e in events)
    assert "softtrust train: warning:" in capsys.readouterr().err
    assert not (run / "checkpoints" / ".tmp-step-000001-x").exists()


def test_a_run_that_trained_without_a_checkpoint_points_to_a_new_directory(micro_model_dir, tmp_path, capsys):
    """Trained steps but no checkpoint: neither a resume nor a new run in it, and both say so
    (the new run no longer says "resume it"); its files stay."""
    run = tmp_path / "run"
    config = micro_config(micro_model_dir, run, max_steps=2)
    crashed_before_training(run, config)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert main(["train", "--resume", str(run)]) == 2
    assert "start it again in a new --output-dir" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=r"trained 1 step\(s\) and has no checkpoint, so it cannot be resumed"
    ):
        train(config)
    assert (run / "events.jsonl").read_text().count("old run") == 1  # nothing removed


# ---------------------------------------------------------------------- checkpoints/latest
@pytest.mark.parametrize("where", ["relative", "absolute", "link"])
def test_latest_naming_a_checkpoint_outside_the_run_is_refused_not_followed(
    micro_model_dir, tmp_path, capsys, where
):
    """``checkpoints/latest`` was followed as a path anywhere: a resume loaded another run's
    weights (``../../other/checkpoints/step-000003``, an absolute path) with no warning."""
    run, other = tmp_path / "run", tmp_path / "other"
    train(micro_config(micro_model_dir, other, max_steps=3))
    train(micro_config(micro_model_dir, run, max_steps=2))
    foreign = other / "checkpoints" / "step-000003"
    latest = run / "checkpoints" / "latest"
    if where == "relative":
        latest.write_text("../../other/checkpoints/step-000003\n")
    elif where == "absolute":
        latest.write_text(f"{foreign}\n")
    else:  # a step-* name that is a link out of the run
        (run / "checkpoints" / "step-000003").symlink_to(foreign)
        latest.write_text("step-000003\n")
    before = read_metrics(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"softtrust train: error: resume: {str(latest)!r} names ")
    assert "expected the name of a checkpoint in the same directory" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert read_metrics(run) == before
    latest.unlink()  # without it, the newest of the run's own checkpoints
    if where == "link":
        (run / "checkpoints" / "step-000003").unlink()
    assert find_checkpoint(run) == run / "checkpoints" / "step-000002"
