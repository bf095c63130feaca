"""Data-parallel training under ``torchrun`` (gloo, CPU): exactness across world sizes,
checkpoints that resume with another number of processes, FSDP2.

Each check compares final weights (``final/model.safetensors``) against a one-process run
with the same global batch and seed, to a float32 error budget (``weights_budget``: ~5e-5 for 6
steps), and first checks that training moved the weights about 100x further, so a wrong data
split or sampling stream fails; the logged loss and gradient norm, compared too, catch a wrong
normaliser or gradient average (which Adam's step would hide). Every run uses a ~10k-parameter Qwen2 and a few steps; the
two-process runs are real ``torchrun`` subprocesses on free ports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from softtrust.train.config import TrainConfig
from softtrust.train.distributed import World
from softtrust.train.rollout import group_uniforms
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from softtrust.train.trainer import train

from budgets import EPS32, MICRO_LOGPROB, adam_budget, rounding_budget

torch.set_num_threads(1)

TESTS = Path(__file__).parent
MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
# Float error budgets (tests/budgets.py). Two processes compute the same numbers as one up to
# float32 rounding: each forward runs on 2 rows instead of 4, gloo sums the partial gradients
# and metrics in another order, and torchrun's AdamW is foreach where one process's is fused.
# A weight's gradient sums ~16 rows x 7 positions x 64 hidden units of products.
GRADIENT_TERMS = 16 * 7 * 64
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
    num_threads=1,  # every process, the one-process reference included, on one fixed thread count
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


# How torchrun fails when the machine, not softtrust, is the problem: a thread or process that
# could not start, a rendezvous that could not bind or connect (seen on a loaded 2-core machine:
# "can't start new thread"). Such a run is retried; any other failure, a softtrust traceback or
# a numeric mismatch found after the run, fails at once.
LOAD_FAILURES = (
    "can't start new thread",
    "Resource temporarily unavailable",
    "Thread creation failed",
    "unable to allocate necessary resources",
    "pthread_create",
    "Cannot allocate memory",
    "RendezvousConnectionError",
    "RendezvousTimeoutError",
    "DistNetworkError",
    "Address already in use",
)
TORCHRUN_ATTEMPTS = 3
# One thread per process in every library that could start a pool: the numbers are those of one
# fixed float path, and two processes never oversubscribe two cores.
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def load_failure(output: str) -> str | None:
    """The first line of ``output`` naming a failure of the machine (``LOAD_FAILURES``), else None."""
    for line in output.splitlines():
        if any(pattern in line for pattern in LOAD_FAILURES):
            return line.strip()
    return None


def torchrun(values: dict, processes: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node P -m softtrust train --flags``, each process on
    one thread (``--num-threads 1``, ``ONE_THREAD``).

    ``--standalone``: the rendezvous binds a free port itself (choosing one here and passing
    it as ``--master_port`` could race with another process taking it meanwhile). A run that
    fails for the machine's sake (``load_failure``) is retried from the same starting state (the
    output directory as it was before the attempt), up to ``TORCHRUN_ATTEMPTS`` times, with a
    warning; every other failure fails the test with the processes' output."""
    values = {"num_threads": 1, **values}
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
        **ONE_THREAD,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    output_dir = Path(values["output_dir"])
    with tempfile.TemporaryDirectory() as saved:
        before = Path(saved) / "before"
        if output_dir.exists():  # a resumed run: each attempt starts from the same checkpoint
            shutil.copytree(output_dir, before)
        for attempt in range(1, TORCHRUN_ATTEMPTS + 1):
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
            if result.returncode == 0:
                return result
            output = result.stdout[-3000:] + result.stderr[-6000:]
            reason = load_failure(result.stdout + result.stderr)
            if reason is None:
                pytest.fail(f"torchrun failed (exit {result.returncode}):\n{output}")
            if attempt == TORCHRUN_ATTEMPTS:
                pytest.fail(
                    f"torchrun could not run on this machine in {attempt} attempts ({reason}); "
                    f"rerun when it is less loaded:\n{output}"
                )
            warnings.warn(
                f"torchrun attempt {attempt} failed for the machine's sake ({reason}); retrying", stacklevel=2
            )
            time.sleep(5 * attempt)  # let the load that starved it pass
            shutil.rmtree(output_dir, ignore_errors=True)
            if before.exists():
                shutil.copytree(before, output_dir)
    raise AssertionError("unreachable")


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run) / "final" / "model.safetensors"))


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def weights_budget(steps: int) -> float:
    """``steps`` AdamW steps at ``RUN``'s lr from gradients of ``GRADIENT_TERMS`` float32
    products: 10 · steps · lr · eps32 · terms ≈ 8.5e-6 a step (measured on default, avx2 and
    avx512: at most 2.5e-6 after 6 steps)."""
    return adam_budget(steps, RUN["lr"], gradient_terms=GRADIENT_TERMS)


def assert_same_weights(
    got: dict, expected: dict, initial: dict, steps: int, moved_over_budget: float = 100
) -> None:
    """Equal to ``expected`` within ``weights_budget(steps)``, after training moved the weights
    ``moved_over_budget`` (100) times further (Adam moves a weight by ~lr a step; a wrong data
    split moves it as far)."""
    assert got.keys() == expected.keys()
    budget = weights_budget(steps)
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > moved_over_budget * budget, (
        f"training barely moved the weights ({moved}): the check would be vacuous"
    )
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=budget, msg=name)


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


def test_torchrun_retries_failures_of_the_machine_and_fails_at_once_on_any_other(monkeypatch, tmp_path):
    """A thread that could not start is retried from the same output directory; a softtrust
    traceback is not retried."""
    runs = []

    def fake_run(outputs):
        def run(command, **kwargs):
            (tmp_path / "run").mkdir(exist_ok=True)
            (tmp_path / "run" / f"partial-{len(runs)}").write_text("")  # what the attempt left
            runs.append(command)
            returncode, stderr = outputs[len(runs) - 1]
            return subprocess.CompletedProcess(command, returncode, "", stderr)

        return run

    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    thread = "RuntimeError: can't start new thread"
    monkeypatch.setattr(subprocess, "run", fake_run([(1, thread), (0, "")]))
    with pytest.warns(UserWarning, match="can't start new thread"):
        torchrun({"output_dir": str(tmp_path / "run")})
    assert len(runs) == 2 and "--num-threads" in runs[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["partial-1"]  # attempt 1's files gone

    runs.clear()
    monkeypatch.setattr(subprocess, "run", fake_run([(1, "ValueError: loss mismatch"), (0, "")]))
    with pytest.raises(pytest.fail.Exception, match="loss mismatch"):
        torchrun({"output_dir": str(tmp_path / "other")})
    assert len(runs) == 1
    runs.clear()
    monkeypatch.setattr(subprocess, "run", fake_run([(1, thread)] * TORCHRUN_ATTEMPTS))
    with (
        pytest.warns(UserWarning),
        pytest.raises(pytest.fail.Exception, match="could not run on this machine"),
    ):
        torchrun({"output_dir": str(tmp_path / "third")})
    assert len(runs) == TORCHRUN_ATTEMPTS


# ---------------------------------------------------------------------- 1. exactness across world sizes
@pytest.mark.numerics
def test_two_processes_reach_the_same_weights_as_one(
    micro_model_dir, straight_run, initial_weights, tmp_path
):
    run = tmp_path / "ddp"
    torchrun(run_config(micro_model_dir, run, max_steps=6))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights, steps=6)
    # The same completions were sampled (whole-batch rewards logged by rank 0 agree) ...
    ours, reference = read_metrics(run), read_metrics(straight_run)
    assert [m["reward/mean"] for m in ours] == [m["reward/mean"] for m in reference]
    # ... and the all-reduced loss and metrics describe the whole mini-batch, up to float32
    # rounding: a ratio exp(logp - old) carries two log-prob budgets (relative 1.2e-4); the loss,
    # a token-mean of r·A with |A| <~ 1 on average, as much (abs); the gradient norm the ratios'
    # budget plus its own sums' (measured: 9e-7, 5e-7 relative, 3e-7 relative). A wrong
    # normaliser or gradient average moves the loss (|loss| ~ 0.1) and the norm by a factor.
    ratio_budget = 2 * MICRO_LOGPROB
    norm_budget = ratio_budget + rounding_budget(EPS32, terms=GRADIENT_TERMS)
    assert max(abs(m["loss"]) for m in reference) > 100 * ratio_budget  # the loss check can fail
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=ratio_budget)
        assert mine["loss/ratio/max"] == pytest.approx(theirs["loss/ratio/max"], rel=ratio_budget)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=norm_budget)
    # Only rank 0 wrote the run directory (one line per step, one checkpoint).
    assert [m["step"] for m in ours] == list(range(1, 7))
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000006"]


@pytest.mark.numerics
@pytest.mark.costly
def test_adaptive_kl_over_two_processes_counts_every_ranks_rows(micro_model_dir, tmp_path):
    """--kl-target under torchrun: the controller's n is the mini-batch's rows over all ranks and its
    KL the all-reduced loss/kl. With the target far from every measured KL (0 at step 1, the policy
    still the reference; above 1e-9 after) the error term saturates at -0.2 or +0.2, so beta moves
    by exactly 1 -/+ 0.2 n / H a step whatever the rounding: n = 8 (both ranks' rows), where one
    rank's 4 would give half the step."""
    target, horizon = 1e-9, 8.0
    overrides = dict(max_steps=4, method="clip", kl_coef=0.5, kl_target=target, kl_horizon=horizon)
    run = tmp_path / "ddp"
    torchrun(run_config(micro_model_dir, run, **overrides))
    train(TrainConfig(**run_config(micro_model_dir, tmp_path / "one", **overrides)))
    ours, reference = read_metrics(run), read_metrics(tmp_path / "one")
    config = run_config(micro_model_dir, run)
    rows = config["prompts_per_step"] * config["group_size"]  # the whole mini-batch, both ranks
    for metrics in (ours, reference):
        expected = [0.5]
        for m in metrics[:-1]:
            assert m["loss/kl"] == 0.0 or m["loss/kl"] > 100 * target  # saturated either way
            error = -0.2 if m["loss/kl"] < target else 0.2
            expected.append(expected[-1] * (1 + error * rows / horizon))
        assert [m["kl_coef"] for m in metrics] == pytest.approx(expected, rel=1e-12)
    assert [m["kl_coef"] for m in ours] == [m["kl_coef"] for m in reference]


# ---------------------------------------------------------------------- 2. resume with another world size
@pytest.mark.numerics
@pytest.mark.costly
def test_checkpoint_of_two_processes_resumes_in_one(micro_model_dir, straight_run, initial_weights, tmp_path):
    # Step 3 falls inside a rollout (N = 2): the pending mini-batch is saved whole.
    run = tmp_path / "two_then_one"
    torchrun(run_config(micro_model_dir, run, max_steps=3))
    train(TrainConfig(**run_config(micro_model_dir, run, max_steps=6, resume=str(run))))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights, steps=6)
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 7))


@pytest.mark.numerics
@pytest.mark.costly
def test_checkpoint_of_one_process_resumes_in_two(micro_model_dir, straight_run, initial_weights, tmp_path):
    run = tmp_path / "one_then_two"
    train(TrainConfig(**run_config(micro_model_dir, run, max_steps=3)))
    torchrun(run_config(micro_model_dir, run, max_steps=6, resume=str(run)))

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights, steps=6)
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


@pytest.mark.numerics
@pytest.mark.costly
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

    assert_same_weights(final_weights(run), final_weights(straight_run), initial_weights, steps=6)
    checkpoint = load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))
    straight_checkpoint = load_file(str(straight_run / "checkpoints" / "step-000006" / "model.safetensors"))
    assert checkpoint.keys() == straight_checkpoint.keys()
    state = torch.load(run / "checkpoints" / "step-000006" / "state.pt", weights_only=True)
    straight_state = torch.load(straight_run / "checkpoints" / "step-000006" / "state.pt", weights_only=True)
    # The optimizer state is gathered into the one-process layout (keyed by parameter position);
    # exp_avg averages gradients: their float32 sums' budget at its size (measured: 9e-9 of 0.02).
    assert state["optimizer"]["state"].keys() == straight_state["optimizer"]["state"].keys()
    size = max(
        float(moments["exp_avg"].abs().max()) for moments in straight_state["optimizer"]["state"].values()
    )
    budget = rounding_budget(EPS32, terms=GRADIENT_TERMS, scale=size)  # ≈ 2e-6
    for index, moments in straight_state["optimizer"]["state"].items():
        torch.testing.assert_close(
            state["optimizer"]["state"][index]["exp_avg"], moments["exp_avg"], rtol=0, atol=budget
        )


# ---------------------------------------------------------------------- async mode with data-parallel learners
@pytest.mark.numerics
def test_async_lagged_rollouts_on_two_processes_match_one(micro_model_dir, initial_weights, tmp_path):
    """Async mode under DDP: each rank's rollout source (here the deterministic lag schedule)
    samples its share with the lagged weights; the result equals one process's."""
    values = dict(mode="async", max_lag=2, lag_schedule="0,2,1", max_steps=5)
    train(
        TrainConfig(**run_config(micro_model_dir, tmp_path / "one", **{**values, "lag_schedule": [0, 2, 1]}))
    )
    torchrun(run_config(micro_model_dir, tmp_path / "two", **values))

    assert_same_weights(
        final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights, steps=5
    )
    assert [m["lag"] for m in read_metrics(tmp_path / "two")] == [0, 1, 1, 0, 2]


# ---------------------------------------------------------------------- dynamic sampling (--filter-groups)
@pytest.mark.numerics
@pytest.mark.costly
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

    # most groups are dropped and cut rows masked, so the weights move ~50x the budget (measured
    # 52x), not 100x: a wrong split of the kept groups still moves them by the whole step
    assert_same_weights(
        final_weights(tmp_path / "two"),
        final_weights(tmp_path / "one"),
        initial_weights,
        steps=4,
        moved_over_budget=20,
    )
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


class _GatheringRanks(World):
    """Rank ``rank`` of two whose ``gather_objects`` returns what both ranks hand in: the other
    rank's objects are computed from the whole rollout by ``share_of(other_rank, call_index)``."""

    def __init__(self, rank: int, share_of):
        super().__init__(rank=rank, size=2)
        self.share_of, self.calls = share_of, 0

    def gather_objects(self, obj) -> list:
        other = self.share_of(1 - self.rank, self.calls)
        self.calls += 1
        return [obj, other] if self.rank == 0 else [other, obj]


@pytest.mark.parametrize(
    "values",
    [
        {"advantages": "reinforce++"},
        {"advantages": "passk", "passk_k": 2},
        {"advantages": "group", "advantage_scale": "batch"},
        {"advantages": "rloo", "advantage_scale": "batch"},
    ],
    ids=["reinforce++", "passk", "group-batch", "rloo-batch"],
)
def test_rollout_advantages_over_two_ranks_equal_one_process(values):
    """Each rank's advantages from its share of a rollout (4 prompts a step, N = 2: 8 groups of 4)
    equal one process's on the whole rollout: the batch-wide ones (REINFORCE++'s token-weighted
    whitening, a batch scale) need every rank's rewards and lengths, which rollout_advantages gathers."""
    from softtrust.train.config import TrainConfig
    from softtrust.train.trainer import rollout_advantages

    config = TrainConfig(group_size=4, prompts_per_step=4, staleness=2, **values)
    generator = torch.Generator().manual_seed(5)
    rewards = torch.rand(32, generator=generator).round(decimals=1)  # [8 groups x 4]
    lengths = torch.randint(1, 9, (32,), generator=generator)
    whole = rollout_advantages(rewards, config, None, lengths)

    def rows_of(rank: int) -> list[int]:
        groups = World(rank=rank, size=2).local_groups(8, config.prompts_per_step)
        return [group * 4 + member for group in groups for member in range(4)]

    def share_of(rank: int, call: int):  # rollout_advantages gathers the rewards, then the lengths
        index = torch.as_tensor(rows_of(rank))
        return index, (rewards if call == 0 else lengths)[index]

    mine = []
    for rank in (0, 1):
        rows = rows_of(rank)
        local = rollout_advantages(rewards[rows], config, _GatheringRanks(rank, share_of), lengths[rows])
        torch.testing.assert_close(local, whole[rows], rtol=0, atol=0)
        mine.append(rollout_advantages(rewards[rows], config, None, lengths[rows]))
    if values.get("advantages") != "passk":  # per group: the same without the gather
        assert not torch.equal(mine[0], whole[rows_of(0)])  # one rank alone normalises otherwise


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("m2po", {"tau": 0.05}),
        ("kl-cov", {"ratio": 0.1}),
        ("clip-cov", {"ratio": 0.2, "cov_low": -1.0}),
        ("bapo", {}),
        # a self-normalised IS correction's mean (alone, and next to a method's selection)
        ("clip", {"correction": "tis:cap=1.2,self_normalize=true"}),
        ("m2po", {"tau": 0.05, "correction": "mis:low=0.7,high=1.4,level=sequence,self_normalize=true"}),
        # the --entropy-quantile threshold (alone, and next to a method's selection)
        ("clip", {"entropy_quantile": 0.3}),
        ("kl-cov", {"ratio": 0.1, "entropy_quantile": 0.6}),
    ],
)
def test_global_batch_state_over_ranks_equals_the_whole_batch(method, params):
    """Two ranks' shares with different padded lengths give the whole batch's state."""
    import softtrust as st
    from softtrust.train.learner import BatchTensors, global_batch_state
    from softtrust.train.loss_config import build_correction

    generator = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(8, 5, generator=generator, dtype=torch.float64) * 2
    old = logprobs + 0.4 * torch.randn(8, 5, generator=generator, dtype=torch.float64)
    advantages = torch.randn(8, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4, 2, 3, 1, 2, 3])  # rank 1's rows (4..7) are at most 3 long
    mask = (torch.arange(5) < lengths[:, None]).double()
    params = dict(params)
    correction = build_correction(params.pop("correction", None))
    rollout = None if correction is None else old + 0.3 * torch.randn(8, 5, generator=generator).double()
    loss_fn = st.PolicyLoss(method, correction=correction, **params)
    entropy = (
        3 * torch.rand(8, 5, generator=generator, dtype=torch.float64) if loss_fn.needs_entropy else None
    )
    whole = loss_fn.batch_state(
        logprobs, old, advantages, mask, rollout, generator=torch.Generator().manual_seed(7), entropy=entropy
    )
    share = lambda x, rows, width=5: None if x is None else x[rows, :width]  # noqa: E731
    rank1 = BatchTensors(
        logprobs[4:, :3],
        old[4:, :3],
        advantages[4:],
        mask[4:, :3],
        share(rollout, slice(4, 8), 3),
        share(entropy, slice(4, 8), 3),
    )
    rank0 = BatchTensors(
        logprobs[:4],
        old[:4],
        advantages[:4],
        mask[:4],
        share(rollout, slice(0, 4)),
        share(entropy, slice(0, 4)),
    )
    state = global_batch_state(loss_fn, rank0, _TwoRanks(rank1), torch.Generator().manual_seed(7))
    assert state.keys() == whole.keys()
    for name in whole:  # float64 sums of ~40 tokens in another order: 10·eps64·√40 ≈ 1.4e-14, ×70
        torch.testing.assert_close(state[name], whole[name], rtol=1e-12, atol=0, msg=name)
    # the rank's own share alone selects differently: the check can fail
    alone = loss_fn.batch_state(
        logprobs[:4],
        old[:4],
        advantages[:4],
        mask[:4],
        share(rollout, slice(0, 4)),
        generator=torch.Generator().manual_seed(7),
        entropy=share(entropy, slice(0, 4)),
    )
    assert any(not torch.equal(alone[name], whole[name]) for name in whole)


@pytest.mark.numerics
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

    assert_same_weights(
        final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights, steps=4
    )
    name = {"m2po": "loss/m2po/masked", "kl-cov": "loss/cov/selected"}[method]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    # fractions of ~48 tokens: the same selection gives the same count, up to the float32 mean's
    # rounding (eps32·√48, ×10 ≈ 8e-6); one token selected differently moves it by 1/48
    budget = rounding_budget(EPS32, terms=48)
    assert [m[name] for m in two] == pytest.approx([m[name] for m in one], abs=budget)
    assert any(0 < m[name] < 1 for m in one[1::2])  # the selection is not trivial where it counts


@pytest.mark.numerics
@pytest.mark.parametrize("updates_per_batch", [1, 2])
def test_decoupled_objective_on_two_processes_matches_one(
    micro_model_dir, initial_weights, tmp_path, updates_per_batch
):
    """--proximal recompute under DDP: the extra no-grad forward of pi_prox runs on each rank's
    share (outside DDP's gradient bookkeeping) and the update equals one process's; with
    --updates-per-batch 2 each rank splits its share of a 2 x m batch into its two mini-batches
    and holds pi_prox over them."""
    values = dict(
        mode="async", max_lag=2, lag_schedule="0,2,1", max_steps=5, method="clip", proximal="recompute"
    )
    values["updates_per_batch"] = updates_per_batch
    train(
        TrainConfig(**run_config(micro_model_dir, tmp_path / "one", **{**values, "lag_schedule": [0, 2, 1]}))
    )
    torchrun(run_config(micro_model_dir, tmp_path / "two", **values))

    assert_same_weights(
        final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), initial_weights, steps=5
    )
    weights = [m["loss/is_weight/max"] for m in read_metrics(tmp_path / "two")]
    # pi_prox / mu = exp(log-prob - log-prob): two log-prob budgets, relative (1.2e-4; measured
    # 1.03e-6 on avx512, 0 on default and avx2); a weight from the wrong rows or version is off by
    # the 1.5-10 % the lag makes
    assert weights == pytest.approx(
        [m["loss/is_weight/max"] for m in read_metrics(tmp_path / "one")], rel=2 * MICRO_LOGPROB
    )
    assert max(weights) > 1.01  # pi_prox / mu is not 1 at lag > 0: the decoupled weight is in use
