"""The forward pass ``--proximal loglinear`` saves: one learner update per mode, timed round-robin.

The default main job's shapes (embedded tiny Qwen2, m = 32 prompts x G = 8, up to 6 new
tokens), one async mini-batch sampled by the initial weights at lag 2 (the learner took
two steps since), and ``policy_update`` (forward, loss, backward, AdamW step) under
``--proximal none``, ``recompute`` (an extra no-grad forward, which the trainer takes when the
batch is fetched: timed here with the update) and ``loglinear``. Modes are
interleaved so that machine load drifts equally over all three; each update starts from the
same weights and optimizer state. Prints the median of ``--repeats`` updates per mode.

    python benchmarks/bench_proximal.py [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from softtrust.train.config import TrainConfig
from softtrust.train.distributed import World
from softtrust.train.learner import Learner, build_optimizer
from softtrust.train.loss_config import build_method_loss
from softtrust.train.rollout import ProblemSampler, RewardScorer, generate_rollout, group_uniforms
from softtrust.train.scoring import Scoring
from softtrust.train.staleness import MiniBatch, behaviour_logprobs
from softtrust.train.tasks import build_task
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

MODES = ("none", "recompute", "loglinear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    base = TrainConfig(mode="async")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(), seed=0).eval()
    task = build_task(base.task, None, base.reward)
    problems = ProblemSampler(task, seed=0).draw(base.prompts_per_step)
    batch = generate_rollout(
        model,
        tokenizer,
        problems,
        RewardScorer(task),
        group_size=base.group_size,
        max_new_tokens=base.effective_max_new_tokens,
        temperature=base.temperature,
        policy_version=0,
        uniforms=group_uniforms(0, 0, range(len(problems)), base.group_size, base.effective_max_new_tokens),
    )
    minibatch = MiniBatch(
        batch=batch,
        old_logprobs=batch.rollout_logprobs,
        rollout_logprobs=batch.rollout_logprobs,
        advantages=torch.randn(batch.input_ids.shape[0], generator=torch.Generator().manual_seed(0)),
        rollout_index=2,
        minibatch_index=0,
        rows=(0, batch.input_ids.shape[0]),
        lag=2,
    )
    start = copy.deepcopy(model.state_dict())
    times = {mode: [] for mode in MODES}
    for repeat in range(arguments.repeats + 1):  # the first round warms up
        for mode in MODES:
            config = base.replace(proximal=mode)
            model.load_state_dict(start)
            optimizer, scheduler = build_optimizer(model, config)
            learner = Learner(
                model, model, optimizer, scheduler, World(), [], [], build_method_loss(config), config
            )
            began = time.perf_counter()
            taken = minibatch
            if mode == "recompute":  # pi_prox: the fetch's forward of the weights before the update
                proximal = behaviour_logprobs(model, batch, Scoring(config.temperature))
                taken = dataclasses.replace(minibatch, proximal_logprobs=proximal)
            learner.update(taken)
            if repeat:
                times[mode].append(time.perf_counter() - began)
    rows = batch.input_ids.shape[0]
    print(
        f"{rows} rows x {batch.completion_length} tokens, {arguments.threads} thread(s), {arguments.repeats} repeats"
    )
    none = statistics.median(times["none"])
    for mode in MODES:
        median = statistics.median(times[mode])
        print(f"{mode:>10}: {1000 * median:7.1f} ms per update ({median / none:.2f}x none)")


if __name__ == "__main__":
    main()
