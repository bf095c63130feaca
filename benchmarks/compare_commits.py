"""The policy loss's forward + backward time at two commits of softtrust, in alternating processes.

    git worktree add --detach /tmp/before <commit>
    python benchmarks/compare_commits.py /tmp/before/src src [--rounds 4] [--output FILE.md]

Each round runs one process per tree, in A-B order on even rounds and B-A on odd ones (the
second process of a pair reads slower on a shared machine: alternating cancels that), each
timing ``PolicyLoss(method, compute_metrics=False)`` on float32 inputs (bool mask, 90 % active,
log-ratios ~0.1) at six shapes, one thread, median of 40 calls after 20 warm-up calls. Prints
per-shape medians over the rounds and their ratio (B / A: above 1, B is slower). Also prints
whether both trees dispatch the same ATen operations (names and counts) in one call, counted
with a ``TorchDispatchMode``: the same operations mean any time difference is Python or noise.
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

SHAPES = [(8, 128), (32, 512), (64, 512), (32, 1024), (64, 4096), (32, 16384)]
METHODS = ("vespo", "clip", "sapo")

_CHILD = r"""
import collections, json, statistics, time
import torch
import softtrust as st
from torch.utils._python_dispatch import TorchDispatchMode

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func)] += 1
        return func(*args, **(kwargs or {}))

torch.set_num_threads(1)
times, ops = {}, {}
for method in METHODS:
    loss_fn = st.PolicyLoss(method, compute_metrics=False)
    for b, t in SHAPES:
        g = torch.Generator().manual_seed(0)
        logprobs = -3 * torch.rand(b, t, generator=g)
        old = logprobs + 0.1 * torch.randn(b, t, generator=g)
        advantages = torch.randn(b, generator=g)
        mask = torch.rand(b, t, generator=g) < 0.9
        leaf = logprobs.clone().requires_grad_(True)
        samples = []
        for i in range(60):
            started = time.perf_counter()
            loss_fn(leaf, old, advantages, mask).loss.backward()
            samples.append(time.perf_counter() - started)
            leaf.grad = None
        times[f"{method} {b}x{t}"] = statistics.median(samples[20:])
        with Ops() as counter:
            loss_fn(leaf, old, advantages, mask).loss.backward()
        ops[f"{method} {b}x{t}"] = sorted(counter.names.items())
        leaf.grad = None
print(json.dumps({"times": times, "ops": ops}))
"""


def run(tree: str) -> dict:
    code = f"SHAPES = {SHAPES!r}\nMETHODS = {METHODS!r}\n" + _CHILD
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", help="tree A's import path (its src/ directory)")
    parser.add_argument("b", help="tree B's import path")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output", help="also write the report to this Markdown file")
    arguments = parser.parse_args(argv)
    results: dict[str, list[dict]] = {"a": [], "b": []}
    for round_index in range(arguments.rounds):
        order = ("a", "b") if round_index % 2 == 0 else ("b", "a")
        for name in order:
            results[name].append(run(getattr(arguments, name)))
    lines = [
        f"A = `{describe(arguments.a)}`, B = `{describe(arguments.b)}`; {arguments.rounds} rounds in "
        f"alternating order, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
        "| method, B × T | A (µs) | B (µs) | B / A | same ATen operations |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for key in results["a"][0]["times"]:
        a = statistics.median(r["times"][key] for r in results["a"]) * 1e6
        b = statistics.median(r["times"][key] for r in results["b"]) * 1e6
        same = results["a"][0]["ops"][key] == results["b"][0]["ops"][key]
        lines.append(
            f"| {key.replace('x', ' × ')} | {a:.1f} | {b:.1f} | {b / a:.3f} | {'yes' if same else 'no'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if arguments.output:
        Path(arguments.output).write_text(text)
    return 0


def describe(tree: str) -> str:
    """The commit a tree's ``src`` directory belongs to (``git describe``-like: short hash, ``+`` if
    its ``src`` has changes), else the path."""
    root = Path(tree).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return tree
    return commit + ("+" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    raise SystemExit(main())
