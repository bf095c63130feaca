"""One RL update on a small Qwen2: forward, completion log-probs, VESPO loss, backward.

Usage:
    python benchmarks/bench_e2e.py [--quick] [--threads N] [--out FILE]

``fused``: the model body's hidden states go through ``softtrust.completion_logprobs``
(``token_logprobs``, never the (N, V) logits). ``unfused``: ``model(..., logits_to_keep=T+1)``
(logits for the completion positions only, as TRL asks for them), ``log_softmax`` in
float32 and a gather. Both then take the same
``PolicyLoss("vespo")`` and ``backward``. Each variant's peak resident memory is
measured in a fresh process after a warm-up step, with glibc's mmap threshold fixed
(``benchmarks/_memory.py``: otherwise the warm-up leaves freed blocks resident and the
peak is understated, by a different amount each run). Times come from one more fresh
process with the default allocator: both variants stepped in turn, after a warm-up step
each; the time ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VOCAB, HIDDEN, LAYERS = 32_000, 512, 4


def build(batch: int, prompt: int, completion: int, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=prompt + completion,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    input_ids = torch.randint(0, VOCAB, (batch, prompt + completion))
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.rand(batch, completion) < 0.9
    old = -torch.rand(batch, completion) * 5
    advantages = torch.randn(batch)
    return model, input_ids, attention_mask, completion_mask, old, advantages


def step(variant: str, model, input_ids, attention_mask, completion_mask, old, advantages) -> None:
    import softtrust as st

    completion = completion_mask.shape[1]
    if variant == "fused":
        logprobs = st.completion_logprobs(
            model, input_ids, attention_mask, completion, completion_mask=completion_mask
        )  # [B, T]
    else:
        # logits_to_keep: only the positions that predict completion tokens (as TRL does)
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion + 1
        ).logits[:, :-1]
        labels = input_ids[:, -completion:]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)  # [B, T]
    loss = st.PolicyLoss("vespo")(logprobs, old, advantages, completion_mask).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


VARIANTS = ("unfused", "fused")


def child(variant: str, shape: tuple[int, int, int], threads: int, repeats: int) -> dict:
    """In a fresh process, after a warm-up step of each variant it runs: ``variant`` "time"
    times ``repeats`` rounds of one step of every variant in turn (median step time and the
    median of the per-round time ratios); a variant's name measures its peak memory of one step."""
    sys.path.insert(0, str(HERE))
    from _memory import peak_delta_mib

    torch.set_num_threads(threads)
    tensors = build(*shape)
    if variant != "time":
        step(variant, *tensors)  # warm-up (and allocator steady state)
        peak, method = peak_delta_mib(lambda: step(variant, *tensors))
        return {"peak_mib": peak, "memory_method": method}
    for name in VARIANTS:
        step(name, *tensors)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):  # round-robin: machine noise hits both variants alike
        for name in VARIANTS:
            start = time.perf_counter()
            step(name, *tensors)
            times[name].append(time.perf_counter() - start)
    ratios = [fused / unfused for fused, unfused in zip(times["fused"], times["unfused"], strict=True)]
    return {
        "seconds": {name: statistics.median(values) for name, values in times.items()},
        "ratio": statistics.median(ratios),
    }


def run_child(variant: str, shape: tuple[int, int, int], threads: int, repeats: int, env=None) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--shape", ",".join(map(str, shape))]
    command += ["--threads", str(threads), "--repeats", str(repeats)]
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])


def run(shape: tuple[int, int, int], threads: int, repeats: int) -> str:
    sys.path.insert(0, str(HERE))
    from _memory import FIXED_MMAP_ENV

    memory_env = {**os.environ, **FIXED_MMAP_ENV}
    results = {name: run_child(name, shape, threads, 0, memory_env) for name in VARIANTS}
    timing = run_child("time", shape, threads, repeats)
    for name in VARIANTS:
        results[name]["seconds"] = timing["seconds"][name]
    results["fused"]["ratio"] = timing["ratio"]
    results["unfused"]["ratio"] = 1.0
    batch, prompt, completion = shape
    base = results["unfused"]
    lines = [
        f"Small Qwen2 (hidden {HIDDEN}, {LAYERS} layers, vocabulary {VOCAB:,}, untied LM head), "
        f"B = {batch}, prompt {prompt} + completion {completion} tokens, {threads} thread(s), "
        f"median of {repeats} round-robin steps (the time ratio: median of the per-round ratios); peak resident memory of one step above the inputs and model "
        f"({base['memory_method']}, glibc mmap threshold fixed at 1 MiB).",
        "",
        "| variant | step time (s) | time / unfused | peak memory (MiB) | memory / unfused |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for variant, label in (("unfused", "logits + log_softmax"), ("fused", "softtrust completion_logprobs")):
        r = results[variant]
        lines.append(
            f"| {label} | {r['seconds']:.3f} | {r['ratio']:.2f} | {r['peak_mib']:,.0f} "
            f"| {r['peak_mib'] / base['peak_mib']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    return table


def main(argv: list[str] | None = None) -> str | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smaller batch and 2 repetitions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        shape = tuple(int(x) for x in args.shape.split(","))
        print(json.dumps(child(args.child, shape, args.threads, args.repeats)))
        return None
    shape = (4, 32, 128) if args.quick else (8, 32, 224)
    return run(shape, args.threads, 2 if args.quick else args.repeats)


if __name__ == "__main__":
    main()
