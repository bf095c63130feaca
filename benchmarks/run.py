"""Run the benchmarks and write docs/benchmarks.md.

Usage:
    python benchmarks/run.py [--quick] [--skip-logprobs]

Sections: the policy loss (``bench_loss.py``), one end-to-end RL step on a small Qwen2
(``bench_e2e.py``), and the token log-probs (``bench_logprobs.py``, which writes
``docs/benchmarks_logprobs.md``; it takes about half an hour on 2 cores, so
``--skip-logprobs`` reuses the last file it wrote, whose own header says when and how),
then the GPU figures of ``docs/benchmarks_gpu.md`` as ``bench_gpu.py`` last wrote them on
a CUDA machine (this script does not run it).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs"
sys.path.insert(0, str(HERE))


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__}, Python {platform.python_version()}; "
        f"load average when written: {load}"
    )


GPU_MISSING = (
    "(run `python benchmarks/bench_gpu.py --output docs/benchmarks_gpu.md` on a CUDA machine, "
    "then this script)"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-logprobs", action="store_true")
    args = parser.parse_args(argv)
    import bench_e2e
    import bench_loss

    quick = ["--quick"] if args.quick else []
    loss_table, loss_reading = bench_loss.main(quick)
    e2e_table = bench_e2e.main(quick)
    logprobs_file = DOCS / "benchmarks_logprobs.md"
    gpu_file = DOCS / "benchmarks_gpu.md"  # written on a CUDA machine by bench_gpu.py --output
    if not args.skip_logprobs:
        subprocess.run([sys.executable, str(HERE / "bench_logprobs.py"), *quick], check=True)
    text = f"""# Benchmarks

Produced by `python benchmarks/run.py{" --quick" if args.quick else ""}{" --skip-logprobs" if args.skip_logprobs else ""}` on: {machine()}.
These are shared, noisy machines: read the ratios measured within one run, not absolute times.

## Policy loss, forward + backward

`python benchmarks/bench_loss.py` (1 thread; variants timed round-robin, median of 30 after
warm-up). `TRL VESPO` is `trl.GRPOTrainer.get_gamma_weights` plus TRL's loss expression on
TRL's int64 mask; `plain` columns are straightforward unfused implementations of the same
math on a precomputed float mask; softtrust gets a bool mask. The ratio column is
TRL time / softtrust time (above 1: softtrust is faster).

{loss_table}

How the fused path works (`PolicyLoss._fused_loss`, every method but GMPO, no KL term): all
the math runs on detached tensors and ends in the gradient `g = ∂L/∂logp` itself; one
contraction `Σ logp·g` carries it to autograd, so the backward is one multiply, whatever
the method (Clip's `minimum` and `clamp` backwards, the most expensive part of the plain
versions, never run). Kernels over the [B, T] inputs in softtrust's VESPO path (sequence-sum,
token-mean, no metrics): mask conversion, the mask's token count, `logp - old`, its extremes
(`aminmax`: the finiteness check and whether the ±20 clamp acts at all), the masked row sum
`Σ_t m·log r` (in place), `g = m·c` (into the same buffer), the contraction, and one multiply
in the backward: 9 kernels, 3 [B, T] allocations. TRL's path runs about 11 kernels and
allocates more; the plain version 11. Everything else is per-operation overhead: 10
operations on [B, 1] tensors (φ and the coefficient `c = -φ·A/N`), 5 views and 3 reads of a
number (the extremes and the token count; free on CPU), 26 dispatched operations in the
forward against TRL's 25. To get there the token count is read as a number on CPU (no clamp
and reciprocal operations), the sequence clamp is skipped when `T·max_t |log r_t|` already
lies inside it, φ takes its six constants from one cached lookup, and without metrics no
per-row counts are made. At the smallest shapes the call (about 0.2 ms) is these
operations, the input checks (about 9.5 µs at 16 × 256: dtypes, shapes, mask values, advantages) and the
backward's fixed cost, so the ratio there moves with machine noise: over eight runs on
2026-12-03 (a 2-core AMD EPYC, same code path), 8 × 128 gave 0.94–1.16× TRL, median 0.98×,
and 16 × 256 0.97–1.21×, median 1.04×; a microbenchmark of 2,000 round-robin repetitions on
2026-12-04 gave 1.05× and 1.08×: parity at the smallest shapes, not a margin.

Reading (written from this run's numbers, on the machine named at the top): {loss_reading}
The `+metrics` column adds ratio, log-weight, φ and ESS statistics: small reductions and one
host sync.

## One RL step on a small Qwen2

`python benchmarks/bench_e2e.py` (2 threads). Peak memory is read after a warm-up step with
glibc's mmap threshold fixed at 1 MiB (`benchmarks/_memory.py`); before that fix the warm-up
left freed blocks resident, and the same step read 306–538 MiB fused and 1,060–1,148 MiB
unfused from run to run (0.28–0.50×). Both variants' times come from one process, stepped
in turn.

{e2e_table}

## Token log-probs

{logprobs_file.read_text() if logprobs_file.exists() else "(run `python benchmarks/bench_logprobs.py`)"}

## On a GPU

{gpu_file.read_text() if gpu_file.exists() else GPU_MISSING}
"""
    (DOCS / "benchmarks.md").write_text(text)
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
