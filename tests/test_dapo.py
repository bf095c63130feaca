"""DAPO's rollout rules in the trainer (``softtrust.train.dapo``): the soft overlong penalty,
masking truncated completions, dynamic sampling (``--filter-groups``).

Oracles: the penalty in closed form and through verl 0.9.1's own ``DAPORewardManager``; the
truncation mask through TRL 1.16.0's own ``_generate_and_score_completions``; the group filter
on hand-made passes (which groups, in which order, on which rank). Trainer runs use the micro
Qwen2 of ``test_train`` for a few steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from softtrust.train.config import TrainConfig
from softtrust.train.dapo import GroupFilter, check_group_filter, mask_truncated, overlong_penalty
from softtrust.train.distributed import World
from softtrust.train.learner import Learner
from softtrust.train.rollout import RolloutBatch, truncated_rows
from softtrust.train.tiny import build_char_tokenizer
from softtrust.train.trainer import train
from test_train import micro_config, model_parameters, read_metrics, write_micro_model

torch.set_num_threads(1)
EOS, PAD = 2, 0  # the char tokenizer's end-of-sequence and padding tokens


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


def coarse(model_dir: str, output_dir, **overrides) -> TrainConfig:
    """The micro run with a 0/1 reward and groups of 2: many groups have equal rewards."""
    values = dict(reward="test_train:coarse_reward", group_size=2, prompts_per_step=2, method="clip")
    return micro_config(model_dir, output_dir, **{**values, **overrides})


def groups_of(rewards: torch.Tensor, size: int) -> list[list[float]]:
    return rewards.reshape(-1, size).tolist()


# ---------------------------------------------------------------------- the soft overlong penalty
def test_overlong_penalty_is_zero_then_linear_in_the_buffer_then_minus_penalty_at_the_limit():
    # L_max = 10, L_cache = 4, penalty 0.5: free up to 6 tokens, -0.5 (L - 6) / 4 after
    lengths = torch.arange(0, 11)
    expected = [0.0] * 7 + [-0.125, -0.25, -0.375, -0.5]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == expected
    # the whole range as the buffer: linear from 0, -penalty at the limit
    assert overlong_penalty(torch.tensor([0, 3, 6]), 6, 6, 1.0).tolist() == [0.0, -0.5, -1.0]


def test_overlong_penalty_equals_verls_dapo_reward_manager():
    """verl 0.9.1's ``DAPORewardManager`` (``overlong_buffer``) with a zero task score: its reward
    is the penalty alone, for lengths counted as it counts them (the response's attention mask)."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    limit, rows = 10, 10
    lengths = torch.arange(1, rows + 1)  # [B] 1..10 response tokens
    response_mask = (torch.arange(limit)[None] < lengths[:, None]).long()  # [B, L_max]
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.full((rows, 2), 5),
            "responses": torch.full((rows, limit), 5),
            "attention_mask": torch.cat([torch.ones(rows, 2, dtype=torch.long), response_mask], 1),
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": "0"}] * rows, dtype=object),
            "data_source": np.array(["sums"] * rows, dtype=object),
        },
    )
    for cache, penalty in ((4, 0.5), (10, 1.0), (1, 2.0)):
        buffer = OmegaConf.create({"enable": True, "len": cache, "penalty_factor": penalty, "log": False})
        manager = DAPORewardManager(
            build_char_tokenizer(),
            0,
            compute_score=lambda **_: 0.0,
            max_resp_len=limit,
            overlong_buffer_cfg=buffer,
        )
        verl_rewards = manager(data).sum(dim=1)  # [B] the reward sits on the last response token
        ours = overlong_penalty(lengths, limit, cache, penalty)
        torch.testing.assert_close(ours, verl_rewards, rtol=0, atol=1e-7)


def test_overlong_penalty_shifts_the_trained_rewards_by_the_closed_form(micro_model_dir, tmp_path):
    """The same first rollout with and without the penalty; with L_cache = L_max = 3 it is linear,
    -0.3 L / 3 per completion, so the mean reward moves by -0.1 x the mean completion length."""
    plain = micro_config(micro_model_dir, tmp_path / "plain", max_steps=1)
    train(plain)
    train(plain.replace(overlong_penalty=[3, 0.3], output_dir=str(tmp_path / "penalised")))
    (without,) = read_metrics(tmp_path / "plain")
    (shaped,) = read_metrics(tmp_path / "penalised")
    assert shaped["completion/length"] == without["completion/length"] > 0
    expected = without["reward/mean"] - 0.1 * without["completion/length"]
    assert shaped["reward/mean"] == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------- masking truncated completions
def completion_batch(completions: list[list[int]], width: int) -> RolloutBatch:
    """Completions as the sampler returns them: ``width`` columns, pad after the first end token."""
    ids = torch.full((len(completions), width), PAD)
    mask = torch.zeros(len(completions), width, dtype=torch.long)
    for row, tokens in enumerate(completions):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    prompt = torch.full((len(completions), 2), 5)
    return RolloutBatch(
        input_ids=torch.cat([prompt, ids], 1),
        attention_mask=torch.cat([torch.ones_like(prompt), mask], 1),
        completion_mask=mask,
        rollout_logprobs=torch.zeros(len(completions), width),
        rewards=torch.zeros(len(completions)),
    )


def trl_completion_mask(completions: list[list[int]], limit: int, tmp_path) -> torch.Tensor:
    """TRL 1.16.0's completion mask under ``mask_truncated_completions=True``: its own
    ``_generate_and_score_completions`` on these completions (generation replaced by them)."""
    pytest.importorskip("trl")
    from trl_oracle import make_trl_trainer

    trainer = make_trl_trainer(tmp_path, mask_truncated_completions=True, max_completion_length=limit)
    assert trainer.eos_token_ids == [EOS] and trainer._tokenizer.pad_token_id == PAD
    trainer._generate_single_turn = lambda *args, **kwargs: ([list(c) for c in completions], None)
    trainer.model.train()
    prompts = [{"prompt": prompt} for prompt in ("1+1=", "1+1=", "2+3=", "2+3=")][: len(completions)]
    return trainer._generate_and_score_completions(prompts)["completion_mask"].cpu()


def test_mask_truncated_zeroes_the_completions_trl_masks(tmp_path):
    """Ended early, ended at the limit with its end token, cut at the limit: the loss mask is
    TRL's, row for row (an untouched mask would differ in the cut row)."""
    limit = 4
    completions = [[5, EOS], [5, 6, 7, EOS], [5, 6, 7, 8], [9, 9, 9, 9]]
    batch = completion_batch(completions, limit)
    ours = mask_truncated(batch, [EOS], limit).completion_mask
    assert torch.equal(ours, trl_completion_mask(completions, limit, tmp_path).to(ours.dtype))
    assert ours[2].sum() == 0 and batch.completion_mask[2].sum() == limit  # the input is untouched
    assert torch.equal(mask_truncated(batch, [EOS], limit).attention_mask, batch.attention_mask)


def test_mask_truncated_counts_a_sampled_pad_at_the_limit_as_cut_where_trl_keeps_it(tmp_path):
    """The one documented difference: TRL treats a last token equal to the pad token as an ending;
    softtrust's sampler never stops at the pad token, so that completion was cut."""
    limit = 4
    completions = [[5, 6, 7, PAD], [5, EOS]]
    ours = mask_truncated(completion_batch(completions, limit), [EOS], limit).completion_mask
    theirs = trl_completion_mask(completions, limit, tmp_path)
    assert ours[0].sum() == 0 and theirs[0].sum() == limit
    assert torch.equal(ours[1], theirs[1].to(ours.dtype))


def test_mask_truncated_run_trains_only_on_completions_that_ended(micro_model_dir, tmp_path, monkeypatch):
    """2 new tokens: the random micro model rarely ends in time, so most rows are cut. Every
    mini-batch's loss mask is zero exactly on the cut rows, and completion/masked says how many."""
    seen = []
    real_update = Learner.update

    def spy(learner, minibatch):
        seen.append(minibatch.batch)
        return real_update(learner, minibatch)

    monkeypatch.setattr(Learner, "update", spy)
    train(micro_config(micro_model_dir, tmp_path / "run", max_new_tokens=2, mask_truncated=True, max_steps=3))
    metrics = read_metrics(tmp_path / "run")
    for batch, m in zip(seen, metrics, strict=True):
        cut = truncated_rows(batch, [EOS], 2)
        assert torch.equal(batch.completion_mask.sum(dim=1) == 0, cut)
        assert m["completion/masked"] == pytest.approx(float(cut.float().mean()))
    assert any(m["completion/masked"] > 0 for m in metrics)
    assert any(m["completion/masked"] < 1 for m in metrics)  # not a degenerate all-masked run


def test_a_mini_batch_with_every_completion_masked_trains_nothing_in_micro_batches(micro_model_dir, tmp_path):
    """One new token: nearly every row is cut and masked. A mini-batch with no token left has a
    global token count of 0, which the loss refuses as a normaliser (the error a two-process run
    met); its loss and gradient are 0 instead."""
    config = micro_config(
        micro_model_dir, tmp_path / "run", max_new_tokens=1, mask_truncated=True, micro_batch_size=3
    )
    train(config.replace(max_steps=3, method="clip"))
    empty = [m for m in read_metrics(tmp_path / "run") if m["completion/masked"] == 1.0]
    assert empty and all(m["loss"] == 0.0 and m["grad_norm"] == 0.0 for m in empty)


# ---------------------------------------------------------------------- dynamic sampling: the filter
def group_pass(groups: list[tuple[int, list[float]]], index: int) -> RolloutBatch:
    """One pass's rows for the groups ``(global group, rewards)``; token 0 names (pass, group)."""
    rows = [(100 * index + group, reward) for group, rewards in groups for reward in rewards]
    return RolloutBatch(
        input_ids=torch.tensor([[tag, 7] for tag, _ in rows]),
        attention_mask=torch.ones(len(rows), 2, dtype=torch.long),
        completion_mask=torch.ones(len(rows), 1, dtype=torch.long),
        rollout_logprobs=torch.zeros(len(rows), 1),
        rewards=torch.tensor([reward for _, reward in rows]),
    )


PASSES = [  # the rewards of 4 groups of 2, pass by pass
    [[1, 1], [0, 1], [0, 0], [1, 0]],  # keeps groups 1, 3
    [[0, 1], [1, 1], [1, 0], [0, 1]],  # keeps 0, 2, 3 (one more than needed)
    [[0, 1]] * 4,
]


def fill(passes, max_draws: int, world: World | None = None) -> RolloutBatch:
    world = world or World()
    group_filter = GroupFilter(max_draws, group_size=2, groups_per_step=2, world=world)
    mine = world.local_groups(4, 2)
    return group_filter.fill(lambda i: group_pass([(g, passes[i][g]) for g in mine], i), num_groups=4)


def tags(batch: RolloutBatch) -> list[int]:
    return batch.input_ids[::2, 0].tolist()


def test_group_filter_keeps_the_first_groups_with_unequal_rewards_in_draw_order():
    batch = fill(PASSES, max_draws=10)
    assert tags(batch) == [1, 3, 100, 102]  # pass 0's groups 1 and 3, then pass 1's 0 and 2
    assert all(len(set(group)) > 1 for group in groups_of(batch.rewards, 2))
    assert batch.sampling == {"draws": 2, "groups_drawn": 8, "groups_dropped": 3, "groups_filled": 0}


def test_group_filter_fills_with_the_first_dropped_groups_after_its_last_pass():
    batch = fill(PASSES, max_draws=1)  # one pass: the pass unchanged, its 2 equal groups kept
    assert tags(batch) == [0, 1, 2, 3]
    assert batch.sampling == {"draws": 1, "groups_drawn": 4, "groups_dropped": 2, "groups_filled": 2}
    hopeless = [[[1, 1]] * 4] * 3
    batch = fill(hopeless, max_draws=3)
    assert tags(batch) == [0, 1, 2, 3] and batch.sampling["groups_filled"] == 4


class TwoRanks(World):
    """A two-rank World without a process group: gathering a pass returns both ranks' rows."""

    def __init__(self, rank: int, passes):
        super().__init__(rank=rank, size=2)
        self.passes = passes

    def gather_objects(self, obj) -> list:
        index = int(obj.input_ids[0, 0]) // 100
        return [
            group_pass([(g, self.passes[index][g]) for g in self.local_groups(4, 2, rank=r)], index)
            for r in range(2)
        ]


def test_group_filter_under_two_ranks_keeps_the_groups_one_process_keeps_in_its_layout():
    """Each rank takes m/P = 1 group of each mini-batch of the kept rollout: rank 0 the 1st and 3rd
    kept groups, rank 1 the 2nd and 4th, so the ranks' shares interleave to one process's rollout."""
    whole = tags(fill(PASSES, max_draws=10))
    shares = [tags(fill(PASSES, max_draws=10, world=TwoRanks(rank, PASSES))) for rank in range(2)]
    assert shares == [[whole[0], whole[2]], [whole[1], whole[3]]]


def test_filter_groups_is_refused_for_the_concurrent_worker_under_torchrun():
    world = World(rank=0, size=2)
    check_group_filter(TrainConfig(filter_groups=True), world)  # sync: fine
    check_group_filter(TrainConfig(filter_groups=True, mode="async", lag_schedule=[0, 1]), world)
    check_group_filter(TrainConfig(filter_groups=True, mode="async"), World())  # one process: fine
    with pytest.raises(ValueError, match="^filter_groups: under torchrun"):
        check_group_filter(TrainConfig(filter_groups=True, mode="async"), world)


# ---------------------------------------------------------------------- dynamic sampling: the trainer
def trained_groups(monkeypatch) -> list:
    seen = []
    real_update = Learner.update

    def spy(learner, minibatch):
        seen.append(groups_of(minibatch.batch.rewards, learner.config.group_size))
        return real_update(learner, minibatch)

    monkeypatch.setattr(Learner, "update", spy)
    return seen


@pytest.mark.parametrize(
    "schedule",
    [
        dict(staleness=2, max_steps=4),  # sync: two rollouts of N x m = 4 groups
        dict(mode="async", max_lag=1, lag_schedule=[0, 1], max_steps=3),  # a rollout of m per step
        dict(mode="async", max_lag=1, max_steps=3),  # the concurrent worker draws the passes
    ],
    ids=["sync", "lagged-async", "async-worker"],
)
def test_filter_groups_trains_only_on_groups_with_unequal_rewards(
    micro_model_dir, tmp_path, monkeypatch, schedule
):
    seen = trained_groups(monkeypatch)
    train(coarse(micro_model_dir, tmp_path / "run", filter_groups=True, **schedule))
    metrics = read_metrics(tmp_path / "run")
    assert seen and all(len(set(group)) > 1 for groups in seen for group in groups), seen
    arrivals = [m for m in metrics if m["rollout/minibatch"] == 0]
    assert all("filter/draws" not in m for m in metrics if m["rollout/minibatch"] != 0)
    for m in arrivals:
        needed = 2 * schedule.get("staleness", 1) if schedule.get("mode") != "async" else 2
        assert m["filter/groups_drawn"] == m["filter/draws"] * needed
        assert m["filter/groups_filled"] == 0
    assert sum(m["filter/groups_dropped"] for m in arrivals) > 0  # it did drop groups


def test_every_pass_samples_with_its_own_keys(micro_model_dir, tmp_path, monkeypatch):
    """Pass p of rollout r samples global group g with the key (seed, r, p x N m + g): pass 0's keys
    are an unfiltered run's, and no two passes of a run share a key."""
    from softtrust.train import trainer as trainer_module

    keys = []
    real = trainer_module.group_uniforms

    def recording(seed, rollout_index, group_indices, *args):
        keys.append((rollout_index, list(group_indices)))
        return real(seed, rollout_index, group_indices, *args)

    monkeypatch.setattr(trainer_module, "group_uniforms", recording)
    train(coarse(micro_model_dir, tmp_path / "run", staleness=2, max_steps=4, filter_groups=True))
    draws = [m["filter/draws"] for m in read_metrics(tmp_path / "run") if "filter/draws" in m]
    expected = [(r, [p * 4 + g for g in range(4)]) for r, passes in enumerate(draws) for p in range(passes)]
    assert keys == expected and max(draws) > 1


def test_filter_groups_with_one_draw_trains_on_the_unfiltered_rollout_and_warns(
    micro_model_dir, tmp_path, capsys
):
    """One pass per rollout: the dropped groups fill the rollout back, so the run is the unfiltered
    run bit for bit (pass 0's sampling keys are the unfiltered ones), and the trainer warns once."""
    plain = coarse(micro_model_dir, tmp_path / "plain", staleness=2, max_steps=4)
    train(plain)
    capsys.readouterr()
    capped = plain.replace(output_dir=str(tmp_path / "capped"), filter_groups=True, filter_groups_max_draws=1)
    train(capped)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--filter-groups:" in line]
    arrivals = [m for m in read_metrics(tmp_path / "capped") if "filter/draws" in m]
    assert [m["filter/groups_filled"] for m in arrivals] == [m["filter/groups_dropped"] for m in arrivals]
    assert sum(m["filter/groups_filled"] for m in arrivals) > 0 and len(warnings) == 1, warnings
    a, b = model_parameters(tmp_path / "plain"), model_parameters(tmp_path / "capped")
    assert all(torch.equal(a[name], b[name]) for name in a)
    for key in ("reward/mean", "loss", "grad_norm"):
        assert [m[key] for m in read_metrics(tmp_path / "capped")] == [
            m[key] for m in read_metrics(tmp_path / "plain")
        ]


def test_every_dapo_option_runs_together_on_the_main_job_path(micro_model_dir, tmp_path):
    """--filter-groups, --mask-truncated and --overlong-penalty with --old-logprobs sampler at N = 2,
    written to config.yaml and read back as given."""
    config = coarse(
        micro_model_dir,
        tmp_path / "run",
        staleness=2,
        max_steps=4,
        filter_groups=True,
        filter_groups_max_draws=4,
        mask_truncated=True,
        overlong_penalty=[2, 0.5],
        old_logprobs="sampler",
    )
    summary = train(config)
    assert summary["steps"] == 4 and len(read_metrics(tmp_path / "run")) == 4
    stored = TrainConfig.from_yaml(tmp_path / "run" / "config.yaml")
    assert (stored.filter_groups, stored.filter_groups_max_draws, stored.mask_truncated) == (True, 4, True)
    assert stored.overlong_penalty == [2.0, 0.5]
