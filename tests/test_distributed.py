"""Data-parallel training under ``torchrun`` (gloo, CPU): exactness across world sizes,
checkpoints that resume with another number of processes, FSDP2.

Each check compares final weights (``final/model.safetensors``) against a one-process run
with the same global batch and seed, to 1e-5, and first checks that training moved the
weights much further than that, so a wrong data split, sampling stream, normaliser or
gradient average fails. Every run uses a ~10k-parameter Qwen2 and a few steps; the
two-process runs are real ``torchrun`` subprocesses on free ports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from softtrust.train.config import TrainConfig
from softtrust.train.distributed import World
from softtrust.train.rollout import group_uniforms
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from softtrust.train.trainer import train

torch.set_num_threads(1)

TESTS = Path(__file__).parent
MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
TOLERANCE = 1e-5
# N = 2, m = 4 prompts (2 per rank), G = 4; 6 steps = 3 rollouts; VESPO (off-policy weights
# matter at N = 2) with batch-scaled advantages (the std of the whole rollout is needed).
RUN = dict(
    group_size=4,
    prompts_per_step=4,
    max_new_tokens=3,
    staleness=2,
    method="vespo",
    advantage_scale="batch",
    eval_every=0,
    eval_size=8,
    save_every=0,
    progress=False,
    lr=1e-3,  # Adam turns summation-order rounding of near-zero gradients into ~lr-sized noise
    seed=0,
)


def digit_reward(completion: str, answer: str) -> float:
    """The fraction of digit characters: random weights already earn varied rewards, so
    every update moves the model."""
    return sum(character.isdigit() for character in completion) / 3


def coarse_reward(completion: str, answer: str) -> float:
    """1 when the completion starts with a digit: groups of 2 often score alike (--filter-groups)."""
    return float(completion[:1].isdigit())


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 with the char tokenizer (``save_pretrained``) and ``sums.jsonl``."""
    directory = tmp_path_factory.mktemp("micro_model")
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


def run_config(model_dir: str, output_dir: Path, **overrides) -> dict:
    return {
        **RUN,
        "model": model_dir,
        "dataset": str(Path(model_dir) / "sums.jsonl"),
        "reward": "test_distributed:digit_reward",
        "output_dir": str(output_dir),
        **overrides,
    }


def torchrun(values: dict, processes: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node P -m softtrust train --flags``.

    ``--standalone``: the rendezvous binds a free port itself (choosing one here and passing
    it as ``--master_port`` could race with another process taking it meanwhile)."""
    flags = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        "-m",
        "softtrust",
        "train",
        *flags,
    ]
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run) / "final" / "model.safetensors"))


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(got: dict, expected: dict, initial: dict) -> None:
    """Equal to ``expected`` to 1e-5, after training moved the weights by far more than that."""
    assert got.keys() == expected.keys()
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 100 * TOLERANCE, f"training barely moved the weights ({moved}): the check would be vacuous"
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def straight_run(micro_model_dir, tmp_path_factory) -> Path:
    """The reference: one process, 6 steps."""
    sys.path.insert(0, str(TESTS))  # the reward is named as test_distributed:digit_reward
    run = tmp_path_factory.mktemp("straight") / "run"
    train(TrainConfig(**run_config(micro_model_dir, run, max_steps=6)))
    return run


@pytest.fixture(scope="module")
def initial_weights(micro_model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(micro_model_dir) / "model.safetensors"))


# ---------------------------------------------------------------------- the data layout
def test_groups_are_whole_and_every_global_group_has_exactly_one_owner():
    # 2 mini-batches of m = 4 groups over 2 ranks: each rank owns 2 consecutive groups of each.
    assert World(rank=0, size=2).local_groups(8, 4) == [0, 1, 4, 5]
    assert World(rank=1, size=2).local_groups(8, 4) == [2, 3, 6, 7]
    owners = sorted(g for rank in range(4) for g in World(rank=rank, size=4).local_groups(24, 8))
    assert owners == list(range(24))
    with pytest.raises(ValueError, match="prompts_per_step: m must be a multiple"):
        World(rank=0, size=3).check_divides(4)


def test_sampling_draws_are_keyed_by_global_group_not_by_process():
    whole = group_uniforms(seed=0, rollout_index=3, group_indices=range(8), group_size=4, max_new_tokens=5)
    share = group_uniforms(
        seed=0, rollout_index=3, group_indices=[2, 3, 6, 7], group_size=4, max_new_tokens=5
    )
    assert torch.equal(share, torch.cat([whole[8:16], whole[24:32]]))
    other_rollout = group_uniforms(
        seed=0, rollout_index=4, group_indices=range(8), group_size=4, max_new_tokens=5
    )
    assert not torch.equal(whole, other_rollout)


def test_fsdp_is_refused_in_async_mode_naming_the_field():
    with pytest.raises(ValueError, match="fsdp: FSDP2 is supported in sync mode only"):
        TrainConfig(fsdp=True, mode="async").validate()


# ---------------------------------------------------------------------- 1. exactness across world sizes
def test_two_processes_reach_the_same_weights_as_one(
    micro_model_dir, straight_run, initial_weights, tmp_path
):
    run = tmp_path / "ddp"
    torchrun(run_config(micro_model_dir, run, max_steps=6))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights)
    # The same completions were sampled (whole-batch rewards logged by rank 0 agree) ...
    ours, reference = read_metrics(run), read_metrics(straight_run)
    assert [m["reward/mean"] for m in ours] == [m["reward/mean"] for m in reference]
    # ... and the all-reduced loss and metrics describe the whole mini-batch.
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert mine["loss/ratio/max"] == pytest.approx(theirs["loss/ratio/max"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    # Only rank 0 wrote the run directory (one line per step, one checkpoint).
    assert [m["step"] for m in ours] == list(range(1, 7))
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000006"]


# ---------------------------------------------------------------------- 2. resume with another world size
def test_checkpoint_of_two_processes_resumes_in_one(micro_model_dir, straight_run, initial_weights, tmp_path):
    # Step 3 falls inside a rollout (N = 2): the pending mini-batch is saved whole.
    run = tmp_path / "two_then_one"
    torchrun(run_config(micro_model_dir, run, max_steps=3))
    train(TrainConfig(**run_config(micro_model_dir, run, max_steps=6, resume=str(run))))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights)
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 7))


def test_checkpoint_of_one_process_resumes_in_two(micro_model_dir, straight_run, initial_weights, tmp_path):
    run = tmp_path / "one_then_two"
    train(TrainConfig(**run_config(micro_model_dir, run, max_steps=3)))
    torchrun(run_config(micro_model_dir, run, max_steps=6, resume=str(run)))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights)
    assert [m["reward/mean"] for m in read_metrics(run)] == [
        m["reward/mean"] for m in read_metrics(straight_run)
    ]


# ---------------------------------------------------------------------- 3. FSDP2
def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not _has_fully_shard(),
    reason="this torch has no torch.distributed.fsdp.fully_shard (FSDP2); on GPUs use torch >= 2.6 "
    "and torchrun ... -m softtrust train --fsdp (docs/distributed.md)",
)
def test_fsdp2_on_cpu_with_gloo_matches_one_process(micro_model_dir, straight_run, initial_weights, tmp_path):
    """torch 2.13 runs ``fully_shard`` on the CPU with gloo; the sharded run (3 steps, then
    resumed from its own checkpoint for 3 more) must equal one process, and its checkpoint
    must have the single-process layout."""
    run = tmp_path / "fsdp"
    torchrun(run_config(micro_model_dir, run, max_steps=3, fsdp=True))
    torchrun(run_config(micro_model_dir, run, max_steps=6, fsdp=True, resume=str(run)))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights)
    checkpoint = load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))
    straight_checkpoint = load_file(str(straight_run / "checkpoints" / "step-000006" / "model.safetensors"))
    assert checkpoint.keys() == straight_checkpoint.keys()
    state = torch.load(run / "checkpoints" / "step-000006" / "state.pt", weights_only=True)
    straight_state = torch.load(straight_run / "checkpoints" / "step-000006" / "state.pt", weights_only=True)
    # The optimizer state is gathered into the one-process layout (keyed by parameter position).
    assert state["optimizer"]["state"].keys() == straight_state["optimizer"]["state"].keys()
    for index, moments in straight_state["optimizer"]["state"].items():
        torch.testing.assert_close(
            state["optimizer"]["state"][index]["exp_avg"], moments["exp_avg"], rtol=0, atol=1e-6
        )


# ---------------------------------------------------------------------- async mode with data-parallel learners
def test_async_lagged_rollouts_on_two_processes_match_one(micro_model_dir, initial_weights, tmp_path):
    """Async mode under DDP: each rank's rollout source (here the deterministic lag schedule)
    samples its share with the lagged weights; the result equals one process's."""
    values = dict(mode="async", max_lag=2, lag_schedule="0,2,1", max_steps=5)
    train(
        TrainConfig(**run_config(micro_model_dir, tmp_path / "one", **{**values, "lag_schedule": [0, 2, 1]}))
    )
    torchrun(run_config(micro_model_dir, tmp_path / "two", **values))

    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights)
    assert [m["lag"] for m in read_metrics(tmp_path / "two")] == [0, 1, 1, 0, 2]


# ---------------------------------------------------------------------- dynamic sampling (--filter-groups)
def test_filter_groups_on_two_processes_keeps_the_groups_one_process_keeps(
    micro_model_dir, initial_weights, tmp_path
):
    """Every rank gathers every rank's groups of each pass, so both ranks keep the groups one
    process keeps (the same passes, drops and fills) and take their share of them in the usual
    layout: the weights equal one process's. Groups of 2 with a 0/1 reward: many are dropped."""
    values = dict(
        filter_groups=True,
        filter_groups_max_draws=3,
        group_size=2,
        reward="test_distributed:coarse_reward",
        mask_truncated=True,
        max_steps=4,
    )
    train(TrainConfig(**run_config(micro_model_dir, tmp_path / "one", **values)))
    torchrun(run_config(micro_model_dir, tmp_path / "two", **values))

    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights)
    keys = ("filter/draws", "filter/groups_dropped", "filter/groups_filled", "reward/mean")
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [[m.get(key) for key in keys] for m in two] == [[m.get(key) for key in keys] for m in one]
    assert sum(m.get("filter/groups_dropped", 0) for m in one) > 0


# ---------------------------------------------------------------------- batch-wide selections over ranks
class _TwoRanks(World):
    """Rank 0 of two, with rank 1's share handed in: ``gather_objects`` returns both."""

    def __init__(self, other):
        super().__init__(rank=0, size=2)
        self.other = other

    def gather_objects(self, obj) -> list:
        return [obj, self.other]


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("m2po", {"tau": 0.05}),
        ("kl-cov", {"ratio": 0.1}),
        ("clip-cov", {"ratio": 0.2, "cov_low": -1.0}),
        ("bapo", {}),
    ],
)
def test_global_batch_state_over_ranks_equals_the_whole_batch(method, params):
    """Two ranks' shares with different padded lengths give the whole batch's state."""
    import softtrust as st
    from softtrust.train.learner import BatchTensors, global_batch_state

    generator = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(8, 5, generator=generator, dtype=torch.float64) * 2
    old = logprobs + 0.4 * torch.randn(8, 5, generator=generator, dtype=torch.float64)
    advantages = torch.randn(8, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4, 2, 3, 1, 2, 3])  # rank 1's rows (4..7) are at most 3 long
    mask = (torch.arange(5) < lengths[:, None]).double()
    loss_fn = st.PolicyLoss(method, **params)
    whole = loss_fn.batch_state(logprobs, old, advantages, mask, generator=torch.Generator().manual_seed(7))
    rank1 = BatchTensors(logprobs[4:, :3], old[4:, :3], advantages[4:], mask[4:, :3], None)
    state = global_batch_state(
        loss_fn,
        BatchTensors(logprobs[:4], old[:4], advantages[:4], mask[:4], None),
        _TwoRanks(rank1),
        torch.Generator().manual_seed(7),
    )
    assert state.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(state[name], whole[name], rtol=1e-12, atol=0, msg=name)
    # the rank's own share alone selects differently: the check can fail
    alone = loss_fn.batch_state(
        logprobs[:4], old[:4], advantages[:4], mask[:4], generator=torch.Generator().manual_seed(7)
    )
    assert any(not torch.equal(alone[name], whole[name]) for name in whole)


@pytest.mark.parametrize(("method", "params"), [("m2po", {"tau": 1e-5}), ("kl-cov", {"ratio": 0.1})])
def test_batch_wide_selection_under_torchrun_equals_one_process(
    micro_model_dir, initial_weights, tmp_path, method, params
):
    """M2PO's cut and KL-Cov's top-k over both ranks' tokens: two processes train as one.
    (At N = 2 the second mini-batch of each rollout is off-policy; tau = 1e-5 masks about
    two thirds of its tokens, ratio = 0.1 penalises a tenth: a per-rank selection differs.)"""
    values = dict(method=method, max_steps=4)
    train(TrainConfig(**run_config(micro_model_dir, tmp_path / "one", method_params=params, **values)))
    flag = ",".join(f"{key}={value}" for key, value in params.items())
    torchrun(run_config(micro_model_dir, tmp_path / "two", method_params=flag, **values))

    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights)
    name = {"m2po": "loss/m2po/masked", "kl-cov": "loss/cov/selected"}[method]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [m[name] for m in two] == pytest.approx([m[name] for m in one], abs=1e-6)  # float32 means
    assert any(0 < m[name] < 1 for m in one[1::2])  # the selection is not trivial where it counts


def test_decoupled_objective_on_two_processes_matches_one(micro_model_dir, initial_weights, tmp_path):
    """--proximal recompute under DDP: the extra no-grad forward of pi_prox runs on each rank's
    share (outside DDP's gradient bookkeeping) and the update equals one process's."""
    values = dict(
        mode="async", max_lag=2, lag_schedule="0,2,1", max_steps=5, method="clip", proximal="recompute"
    )
    train(
        TrainConfig(**run_config(micro_model_dir, tmp_path / "one", **{**values, "lag_schedule": [0, 2, 1]}))
    )
    torchrun(run_config(micro_model_dir, tmp_path / "two", **values))

    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights)
    weights = [m["loss/is_weight/max"] for m in read_metrics(tmp_path / "two")]
    assert weights == pytest.approx(
        [m["loss/is_weight/max"] for m in read_metrics(tmp_path / "one")], abs=1e-6
    )
    assert max(weights) > 1.01  # pi_prox / mu is not 1 at lag > 0: the decoupled weight is in use
