"""Policy-loss forward + backward: softtrust against TRL 1.16.0's VESPO path and plain implementations.

Usage:
    python benchmarks/bench_loss.py [--quick] [--threads N] [--reps R] [--out FILE]

For every B × T of the grid (the seed PR's 8×128 … 128×1024, then the long
completions of reasoning RL: 64×4096, 64×8192, 32×16384) it times forward +
backward of:

* ``softtrust VESPO``: ``PolicyLoss("vespo", compute_metrics=False)``;
* ``softtrust VESPO +metrics``: the same with its metrics (ratio, log W, φ, ESS);
* ``TRL VESPO``: ``trl.GRPOTrainer.get_gamma_weights`` plus TRL's loss expression
  ``-φ·A·logp`` masked-summed over the token count, on TRL's int64 mask;
* ``plain VESPO``: a straightforward unfused implementation of the same algorithm;
* ``softtrust Clip`` / ``plain Clip`` and ``softtrust SAPO`` / ``plain SAPO``.

The variants are timed round-robin (one repetition of each in turn) so that
machine noise hits them alike; each time is the median of ``--reps`` repetitions
after warm-up, and each ratio (against TRL for VESPO, the plain version for Clip and
SAPO) is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from _format import span

import softtrust as st

GRID = [(8, 128), (16, 256), (32, 512), (64, 512), (128, 512), (32, 1024), (64, 1024), (128, 1024)]
LONG = [(64, 4096), (64, 8192), (32, 16384)]


def plain_vespo(logprobs, old, advantages, mask_f):
    log_w = (
        ((logprobs.detach() - old).clamp(-20, 20) * mask_f).sum(-1, keepdim=True).clamp(math.log(1e-8), 20)
    )
    a = advantages[:, None]
    k = torch.where(a >= 0, 2.0, 3.0)
    lam = torch.where(a >= 0, 3.0, 2.0)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)
    return (-(phi * a) * logprobs * mask_f).sum() / mask_f.sum().clamp(min=1)


def plain_clip(logprobs, old, advantages, mask_f):
    ratio = torch.exp((logprobs - old).clamp(-20, 20))
    a = advantages[:, None]
    loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    return (loss * mask_f).sum() / mask_f.sum().clamp(min=1)


def plain_sapo(logprobs, old, advantages, mask_f):
    ratio = torch.exp((logprobs - old).clamp(-20, 20))
    a = advantages[:, None]
    tau = torch.where(a > 0, 1.0, 1.05)
    loss = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * a
    return ((loss * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)).mean()


def trl_vespo_path() -> Callable | None:
    try:
        from trl import GRPOTrainer
    except ImportError:  # pragma: no cover - the trl extra is optional
        return None

    def run(logprobs, old, advantages, mask_long):
        a = advantages[:, None]
        phi = GRPOTrainer.get_gamma_weights(a, logprobs - old, mask_long, None)
        per_token_loss = -phi * a * logprobs
        return (per_token_loss * mask_long).sum() / mask_long.sum().clamp(min=1.0)

    return run


def inputs(batch: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(batch, length, generator=gen)).requires_grad_(True)
    old = logprobs.detach() + 0.002 * torch.randn(batch, length, generator=gen)
    advantages = torch.randn(batch, generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]  # right-padded completions
    return logprobs, old, advantages, mask


def time_round_robin(
    variants: dict[str, Callable[[], torch.Tensor]], logprobs, reps: int
) -> dict[str, list[float]]:
    """Seconds of forward + backward per round, one list per variant (round-robin after warm-up)."""

    def once(fn):
        logprobs.grad = None
        start = time.perf_counter()
        fn().backward()
        return time.perf_counter() - start

    for fn in variants.values():  # warm-up
        for _ in range(3):
            once(fn)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(once(fn))
    return times


def make_variants(
    logprobs, old, advantages, mask, losses, trl_vespo
) -> dict[str, Callable[[], torch.Tensor]]:
    """Zero-argument closures, one per variant, bound to this shape's inputs."""
    args, mask_f = (logprobs, old, advantages), mask.float()
    variants = {
        "st_vespo": lambda: losses["vespo"](*args, mask).loss,
        "st_vespo_metrics": lambda: losses["vespo_m"](*args, mask).loss,
        "plain_vespo": lambda: plain_vespo(*args, mask_f),
        "st_clip": lambda: losses["clip"](*args, mask).loss,
        "plain_clip": lambda: plain_clip(*args, mask_f),
        "st_sapo": lambda: losses["sapo"](*args, mask).loss,
        "plain_sapo": lambda: plain_sapo(*args, mask_f),
    }
    if trl_vespo is not None:
        mask_long = mask.long()  # TRL's completion_mask dtype
        variants["trl_vespo"] = lambda: trl_vespo(*args, mask_long)
    return variants


def policy_losses() -> dict[str, st.PolicyLoss]:
    """The softtrust losses that :func:`make_variants` times."""
    return {
        "vespo": st.PolicyLoss("vespo", compute_metrics=False),
        "vespo_m": st.PolicyLoss("vespo"),
        "clip": st.PolicyLoss("clip", compute_metrics=False),
        "sapo": st.PolicyLoss("sapo", aggregation="seq-mean-token-mean", compute_metrics=False),
    }


def run(shapes, reps: int) -> tuple[str, list[dict]]:
    """The table (markdown) and one record per shape: ``{"shape": (B, T), "ms": {variant: median ms},
    "rounds": {variant: [seconds per round]}}``; ratios are medians of per-round ratios (:func:`ratio`)."""
    trl_vespo = trl_vespo_path()
    losses = policy_losses()
    header = (
        "| B × T | softtrust VESPO (ms) | +metrics (ms) | TRL VESPO (ms) | plain VESPO (ms) | TRL / softtrust "
        "| softtrust Clip (ms) | plain Clip (ms) | softtrust SAPO (ms) | plain SAPO (ms) |"
    )
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    results = []
    for batch, length in shapes:
        logprobs, old, advantages, mask = inputs(batch, length)
        variants = make_variants(logprobs, old, advantages, mask, losses, trl_vespo)
        rounds = time_round_robin(variants, logprobs, reps)
        t = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
        record = {"shape": (batch, length), "ms": t, "rounds": rounds}
        results.append(record)
        trl_ms = t.get("trl_vespo", math.nan)
        trl_ratio = ratio(record, "trl_vespo", "st_vespo") if "trl_vespo" in t else math.nan
        rows.append(
            f"| {batch} × {length} | {t['st_vespo']:.3f} | {t['st_vespo_metrics']:.3f} | {trl_ms:.3f} "
            f"| {t['plain_vespo']:.3f} | **{trl_ratio:.2f}×** | {t['st_clip']:.3f} | {t['plain_clip']:.3f} "
            f"| {t['st_sapo']:.3f} | {t['plain_sapo']:.3f} |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows), results


def ratio(record: dict, slower: str, faster: str) -> float:
    """``slower / faster``: the median of the per-round ratios when the record has its rounds
    (the variants ran in turn, so a round's ratio cancels the machine's drift), else of the medians."""
    rounds = record.get("rounds")
    if rounds:
        return statistics.median(a / b for a, b in zip(rounds[slower], rounds[faster], strict=True))
    return record["ms"][slower] / record["ms"][faster]


def _shapes(records: list[dict]) -> str:
    names = [f"{b} × {t}" for b, t in (r["shape"] for r in records)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def reading(results: list[dict], trl_version: str | None = None) -> str:
    """The paragraph that reads this run's table against the targets (written from the numbers).

    Targets (issue #19): VESPO at least 1.5× TRL's VESPO path from B × T = 64 × 4096 up and
    at least 0.9× it at every smaller shape, metrics off; Clip and SAPO no more than 10 %
    slower than their plain autograd expressions. Ratios are compared as printed (2 decimals).
    """

    def ratios(records, slower, faster):
        return [ratio(r, slower, faster) for r in records]

    def below(records, slower, faster, floor):
        return [r for r in records if round(ratio(r, slower, faster), 2) < floor]

    parts = []
    if results and "trl_vespo" in results[0]["ms"]:
        trl = f"TRL {trl_version}'s path" if trl_version else "TRL's path"
        long = [r for r in results if r["shape"][0] * r["shape"][1] >= 64 * 4096]
        rest = [r for r in results if r not in long]
        if long:
            met = not below(long, "trl_vespo", "st_vespo", 1.5)
            parts.append(
                f"From 64 × 4096 up softtrust's VESPO is {span(ratios(long, 'trl_vespo', 'st_vespo'))} "
                f"faster than {trl} (target ≥ 1.5×: {'met' if met else '**not met**'})."
            )
        if rest:
            slow = below(rest, "trl_vespo", "st_vespo", 0.9)
            verdict = "met" if not slow else f"**not met** at {_shapes(slow)}"
            parts.append(
                f"{'Below that' if long else 'On this grid'} it runs at "
                f"{span(ratios(rest, 'trl_vespo', 'st_vespo'))} the speed of {trl} (target ≥ 0.9×: {verdict})."
            )
    else:
        parts.append("TRL is not installed: no comparison against its VESPO path.")
    if results:
        for name, slower, faster in (("Clip", "plain_clip", "st_clip"), ("SAPO", "plain_sapo", "st_sapo")):
            slow = below(results, slower, faster, 0.91)
            verdict = "met" if not slow else f"**not met** at {_shapes(slow)}"
            parts.append(
                f"{name} runs at {span(ratios(results, slower, faster))} the speed of its plain autograd "
                f"expression (target: no more than 10 % slower: {verdict})."
            )
        if "st_vespo_metrics" in results[0]["ms"]:
            parts.append(
                f"Metrics cost VESPO {span(ratios(results, 'st_vespo_metrics', 'st_vespo'))} its time "
                "without them; the plain VESPO expression (precomputed float mask, no checks) runs at "
                f"{span(ratios(results, 'st_vespo', 'plain_vespo'))} softtrust's speed."
            )
    return " ".join(parts)


def trl_version() -> str | None:
    try:
        import trl
    except ImportError:  # pragma: no cover - the trl extra is optional
        return None
    return trl.__version__


def main(argv: list[str] | None = None) -> tuple[str, str]:
    """Print and return the table and its reading."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few shapes and 10 repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per variant (median)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from _memory import heap_allocations

    heap = heap_allocations()  # no page faults from glibc's dynamic mmap threshold in the timings
    shapes = [(8, 128), (64, 1024), (64, 4096)] if args.quick else GRID + LONG
    reps = 10 if args.quick else args.reps
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {reps} after warm-up, "
        f"glibc heap allocations {'fixed' if heap else 'default'}"
    )
    table, results = run(shapes, reps)
    text = reading(results, trl_version())
    print(text)
    return table, text


if __name__ == "__main__":
    main()
