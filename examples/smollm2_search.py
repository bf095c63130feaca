"""The search behind the SmolLM2 recipe (issue 34, docs/training.md): how often SmolLM2-135M-Instruct
answers candidate tasks right before any training, greedy and sampled at temperature 1 (the
sampled share is the signal RL starts from; a group of 8 needs some right and some wrong).

    python examples/smollm2_search.py            # prints a Markdown table (about 5 minutes, one core)

reasoning-gym tasks are scored by their own verifier (``extract_answer``: the text inside
``<answer>`` tags, with reasoning-gym's system prompt); "What is a + b?" by the recipe's reward,
the last number of the completion (``softtrust``'s ``math`` reward). 32 new tokens.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROBLEMS = 48
NEW_TOKENS = 32
TAGS = "Answer with only the final number inside answer tags, like this: <answer>7</answer>"


def sums(count: int, low: int, high: int, seed: int = 1) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = [(rng.randrange(low, high), rng.randrange(low, high)) for _ in range(count)]
    return [(f"What is {a} + {b}?", str(a + b)) for a, b in pairs]


def gym(name: str, **options):
    """``(question, entry)`` pairs and the verifier of a reasoning-gym generator."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    dataset = reasoning_gym.create_dataset(name, size=PROBLEMS, seed=123, **options)
    entries = list(dataset)
    return [(e["question"], e) for e in entries], lambda text, e: float(
        dataset.score_answer(extract_answer(text), e) == 1.0
    )


def main() -> int:
    from real_model import smollm2_directory
    from reasoning_gym.utils import SYSTEM_PROMPTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from softtrust.train.rewards import math_reward

    torch.set_num_threads(1)
    path = smollm2_directory()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    candidates = [
        ("reasoning-gym:basic_arithmetic (defaults)", *gym("basic_arithmetic"), SYSTEM_PROMPTS["default"]),
        ("reasoning-gym:chain_sum (2 terms, 1 digit)", *gym("chain_sum", **small), SYSTEM_PROMPTS["default"]),
        ("the same, a short tag instruction", *gym("chain_sum", **small), TAGS),
        (
            "reasoning-gym:leg_counting (1-2 animals)",
            *gym("leg_counting", min_animals=1, max_animals=2, max_instances=2),
            SYSTEM_PROMPTS["default"],
        ),
        ("a + b, a, b < 10 (100 problems in all)", sums(PROBLEMS, 0, 10), math_reward, None),
        ("a + b, a, b < 30 (the recipe's)", sums(PROBLEMS, 0, 30), math_reward, None),
        ("a + b, 10 <= a, b < 100", sums(PROBLEMS, 10, 100), math_reward, None),
    ]
    print(f"| task ({PROBLEMS} problems) | greedy right | sampled (T = 1) right |\n| --- | --- | --- |")
    for label, problems, score, system in candidates:
        shares = []
        for sample in (False, True):
            torch.manual_seed(0)
            right = 0
            for start in range(0, len(problems), 16):
                batch = problems[start : start + 16]
                texts = [
                    tokenizer.apply_chat_template(
                        ([{"role": "system", "content": system}] if system else [])
                        + [{"role": "user", "content": question}],
                        tokenize=False,
                        add_generation_prompt=True,
                    )
                    for question, _ in batch
                ]
                encoded = tokenizer(texts, return_tensors="pt", padding=True)
                with torch.no_grad():
                    out = model.generate(
                        **encoded, max_new_tokens=NEW_TOKENS, do_sample=sample, temperature=1.0 if sample else None,
                        top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id,
                    )  # fmt: skip
                for (_, answer), row in zip(batch, out[:, encoded["input_ids"].shape[1] :], strict=True):
                    right += score(tokenizer.decode(row, skip_special_tokens=True), answer) == 1.0
            shares.append(right / len(problems))
        print(f"| {label} | {shares[0]:.0%} | {shares[1]:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
