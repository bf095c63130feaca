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
    trainer_file = DOCS / "benchmarks_trainer.md"  # bench_trainer.py's reading (slow: run on its own)
    if not args.skip_logprobs:
        subprocess.run([sys.executable, str(HERE / "bench_logprobs.py"), *quick], check=True)
    text = f"""# Benchmarks

Produced by `python benchmarks/run.py{" --quick" if args.quick else ""}{" --skip-logprobs" if args.skip_logprobs else ""}` on: {machine()}.
These are shared, noisy machines: read the ratios measured within one run, not absolute times.

## Policy loss, forward + backward

`python benchmarks/bench_loss.py` (1 thread; variants timed round-robin, median of 30 after
warm-up; every block served from glibc's heap, `_memory.heap_allocations`, so that page faults
of freshly mapped blocks do not land on whichever variant allocates next). `TRL VESPO` is `trl.GRPOTrainer.get_gamma_weights` plus TRL's loss expression on
TRL's int64 mask; `plain` columns are straightforward unfused implementations of the same
math on a precomputed float mask; softtrust gets a bool mask. The ratio column (and every
ratio in the reading) is the median over rounds of TRL time / softtrust time in the same
round (above 1: softtrust is faster).

{loss_table}

How the call is built (`PolicyLoss.__call__`, the same composition for every method: no
fused twin): on CPU tensors the value checks read one sum per input (and the token count) on
the host; when they are finite the token log-ratio is masked by a multiply (PyTorch's CPU
bool selects run 5-20× slower than a multiply), a detached-weight method (VESPO, CISPO) gets
its log-ratio without an autograd graph and clamps and masks it in place (a method whose ratio
is differentiated clamps it with `hardtanh`: the same value as `torch.clamp`, and one fused
backward kernel where `clamp`'s runs four passes over bool tensors), the method's one
formula gives ℓ (Clip as `-A·clamp(r, low_A, high_A)` with the bound that binds for A's
sign, SAPO with its constants on the [B, 1] advantages), and the aggregation is one dot
product with the mask (its backward is one multiply) or a masked row sum for per-row weights.
Kernels over the [B, T] inputs in the VESPO column (sequence-sum, token-mean, no metrics):
mask conversion, the row counts, `logp - old`, the check's sum, the in-place clamp and mask
multiply, the row sum of `log r`, `-(φ·A)·logp`, the dot; the backward is two multiplies.
At the smallest shapes the call is fixed overhead: 36 ATen calls in the VESPO forward against
29 on TRL's path (counted with a `TorchDispatchMode`, views, detaches and the three host reads
included) plus the Python of the composition (the input checks, the context,
the method and the aggregation as separate calls, roughly 100 Python calls), so softtrust
trails TRL and the plain expressions by tens of microseconds there; as the shape grows
memory traffic dominates and the composition wins. SAPO's plain expression is already
minimal: softtrust makes passes over [B, T] that it does not (the mask conversion, as the
plain columns get a precomputed float mask; the check's sum; the multiply that zeroes the
token log-ratio at masked positions, which sequence levels, metrics and batch-wide methods
read), and wins them back with the clamp's fused backward.

Reading (written from this run's numbers, on the machine named at the top): {loss_reading}
Before and after a change: `python benchmarks/compare_commits.py BEFORE/src src` times the loss
at two commits in alternating processes and says where their ATen operations differ
([the reading after the learner's restructure](benchmarks_compare.md)).
The `+metrics` column adds ratio, log-weight, φ and ESS statistics as 0-dim tensors (no host
sync in the call; `LossOutput.metric_values()` reads them with one transfer).

## One RL step on a small Qwen2

`python benchmarks/bench_e2e.py` (2 threads). Peak memory is read after a warm-up step with
glibc's mmap threshold fixed at 1 MiB (`benchmarks/_memory.py`); before that fix the warm-up
left freed blocks resident, and the same step read 306–538 MiB fused and 1,060–1,148 MiB
unfused from run to run (0.28–0.50×). Both variants' times come from one process, stepped
in turn.

{e2e_table}

## softtrust train against TRL's GRPOTrainer on SmolLM2-135M-Instruct (CPU)

{trainer_file.read_text() if trainer_file.exists() else "(run `python benchmarks/bench_trainer.py`)"}
## Token log-probs

{logprobs_file.read_text() if logprobs_file.exists() else "(run `python benchmarks/bench_logprobs.py`)"}

## On a GPU

{gpu_file.read_text() if gpu_file.exists() else GPU_MISSING}
"""
    (DOCS / "benchmarks.md").write_text(text)
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
