"""What the SmolLM2 recipe changed (docs/training.md): on the recipe's 300 held-out sums, greedy,
each model's share right by the recipe's reward (the last number of the completion), by the
first result it states (the number after the first ``=``, "equals" or "is"), and the share of
completions that end within the 32 new tokens.

    python examples/smollm2_stated.py MODEL_DIR [MODEL_DIR ...]   # e.g. the base and RUN/final

A gain in "last number" alone could come from stopping after the sum (a rambling completion's
last number is some other number); a gain in "first stated" is arithmetic.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

STATED = re.compile(r"(?:=|\bequals\b|\bis\b)\s*(-?\d+)")
HELD_OUT = 300
NEW_TOKENS = 32


def main(paths: list[str]) -> int:
    from real_model import cache_root, small_addition_records
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from softtrust.train.rewards import math_reward
    from softtrust.train.tasks import build_task, held_out_problems
    from softtrust.train.warmstart import EVAL_SEED

    torch.set_num_threads(1)
    data = cache_root() / "smollm2-addition-0to29" / "add.jsonl"  # as `real_model.py recipe` writes it
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in small_addition_records()))
    problems = held_out_problems(build_task("addition", str(data), "math"), HELD_OUT, seed=EVAL_SEED)
    for path in paths:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        last = stated = ended = 0
        for start in range(0, len(problems), 20):
            batch = problems[start : start + 20]
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": role, "content": content} for role, content in p.prompt],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for p in batch
            ]
            encoded = tokenizer(texts, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(
                    **encoded, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            for problem, row in zip(batch, out[:, encoded["input_ids"].shape[1] :].tolist(), strict=True):
                text = tokenizer.decode(row, skip_special_tokens=True)
                last += math_reward(text, problem.answer)
                match = STATED.search(text)
                stated += match is not None and match.group(1) == problem.answer
                ended += bool(ends & set(row))
        shares = {"last number": last, "first stated": stated, "ended": ended}
        print(json.dumps({"model": path, **{k: round(v / len(problems), 4) for k, v in shares.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
