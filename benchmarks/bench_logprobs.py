"""Benchmark: fused ``token_logprobs`` vs the unfused log-softmax, the bare GEMMs and TRL.

Usage::

    python benchmarks/bench_logprobs.py            # realistic shapes, writes docs/benchmarks_logprobs.md
    python benchmarks/bench_logprobs.py --quick    # small shapes, prints only
    python benchmarks/bench_logprobs.py --tiles 1024x8192,2048x2048,512x2048   # tile shapes, prints only
    python benchmarks/bench_logprobs.py --truncated   # top-k/top-p cost on the first shape, prints only

Each variant runs forward + backward of ``Σ log p(label)`` with gradients for the
hidden states and the LM-head weight (a bias-free head, as in Qwen2.5 and Llama):

- ``unfused``: ``log_softmax(hidden @ W.T, -1).gather(labels)`` (bf16 logits are
  upcast to fp32 before the log-softmax, as careful code does).
- ``GEMM floor``: the three GEMMs any exact method needs, ``hidden @ W.T`` forward,
  ``dZ @ W`` and ``dZᵀ @ hidden`` backward, and nothing else: the physical floor
  for a method that stores the logits (a recomputing method adds one more GEMM).
- ``softtrust``: ``softtrust.logprobs.token_logprobs`` with its default tiles.
- ``trl selective_log_softmax``: TRL 1.16.0's ``selective_log_softmax`` fed the
  logits (B, T, V) of an ordinary LM-head GEMM, which is counted in its time.
- ``trl ChunkedLogProbFunction``: TRL 1.16.0's fused LM head (the torch fallback
  it uses off GPU), called standalone with TRL's default vocabulary chunk.

Time is wall-clock and CPU time (``time.process_time``, all threads of the process;
steadier than wall time when other processes share the cores), each the median
over repeated rounds after a warm-up (every variant once on a
small shape, plus ``--warmup`` full-size rounds); the variants run
round-robin, and each ratio is the median of the per-round ratios to ``unfused``,
so that load from other processes on the machine hits numerator and denominator
alike. Peak memory is measured once per variant in a fresh interpreter: the
resident high-water mark during one forward + backward, above the resident size
after the inputs are allocated (so it includes the gradients of hidden and W).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _format import span
from bench_loss import trl_version

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "docs" / "benchmarks_logprobs.md"
HIDDEN_SIZE = 896  # Qwen2.5-0.5B
TRL_VOCAB_CHUNK = 32768  # TRL 1.16.0's _CHUNKED_LOGPROB_CHUNK_SIZE
TRL_BATCH_ROWS = 4  # selective_log_softmax loops over the leading dim of (B, T, V) logits


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration: N tokens, vocabulary V, input dtype."""

    tokens: int
    vocab: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        return f"N={self.tokens}, d={HIDDEN_SIZE}, V={self.vocab:,}, {self.dtype}"

    def short(self) -> str:
        """``float32, N = 2,048, V = 32,000``: the shape as the written reading names it."""
        return f"{self.dtype}, N = {self.tokens:,}, V = {self.vocab:,}"


FULL_SHAPES = (
    Shape(1024, 151936, "float32"),
    Shape(1024, 151936, "bfloat16"),
    Shape(2048, 32000, "float32"),
    Shape(2048, 32000, "bfloat16"),
)
QUICK_SHAPES = (Shape(256, 151936, "float32"), Shape(256, 32000, "bfloat16"))


# ---- the variants: each runs forward + backward ------------------------------------------


def run_unfused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    logits = (hidden @ weight.T).float()  # [N, V]
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)  # [N]
    logprobs.sum().backward()


def run_gemm_floor(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    with torch.no_grad():
        logits = hidden @ weight.T  # [N, V] forward GEMM
        grad_hidden = logits @ weight  # [N, d] backward GEMM (the logits stand in for dZ)
        grad_weight = logits.T @ hidden  # [V, d] backward GEMM
    del grad_hidden, grad_weight


def run_softtrust(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    from softtrust.logprobs import token_logprobs

    token_logprobs(hidden, weight, labels).sum().backward()


def run_trl_selective(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    from trl.trainer.utils import selective_log_softmax

    logits = (hidden @ weight.T).view(TRL_BATCH_ROWS, -1, weight.shape[0])  # [B, T, V]
    selective_log_softmax(logits, labels.view(TRL_BATCH_ROWS, -1)).sum().backward()


def run_trl_fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    from trl.kernels import ChunkedLogProbFunction

    outputs = ChunkedLogProbFunction.apply(
        hidden, weight, None, labels, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("log_probs",)
    )
    outputs[0].sum().backward()


SOFTTRUST, GEMM_FLOOR = "softtrust token_logprobs", "GEMM floor (3 GEMMs)"
VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
    "unfused": run_unfused,
    GEMM_FLOOR: run_gemm_floor,
    SOFTTRUST: run_softtrust,
    "trl selective_log_softmax": run_trl_selective,
    "trl ChunkedLogProbFunction": run_trl_fused,
}
VARIANT_NOTES = """Each variant: forward + backward of `sum(log p(label))`, gradients for hidden and W.
`unfused` is `log_softmax((hidden @ W.T).float(), -1).gather(labels)`; `GEMM floor` is
`hidden @ W.T`, `dZ @ W`, `dZ.T @ hidden` alone (what any method that stores the logits
must do; a method that recomputes them does one GEMM more). TRL variants are
TRL 1.16.0 `selective_log_softmax` on the logits (the GEMM counted in its time) and its
fused `ChunkedLogProbFunction` (torch fallback off GPU). Ratios are medians of per-round
ratios to `unfused`. Peak memory: resident high-water mark of one forward + backward in
a fresh process, above the inputs (it includes the hidden and W gradients)."""
NO_MEMORY = {GEMM_FLOOR}
STANDING_NOTES = """- **The tile shape matters at the smaller vocabulary.** The default, 2048 x 2048 logits
  (16 MiB in fp32: `TILE_ELEMENTS = 1 << 22`, `DEFAULT_VOCAB_CHUNK_SIZE = 2048`), was chosen
  with `python benchmarks/bench_logprobs.py --tiles 1024x8192,2048x2048,512x2048 --repeats 3`
  (prints only). Its run of 2026-12-03, time over unfused at the four shapes above in order:
  1024 x 8192 tiles (the old default) 0.96 / 0.95 / 1.27 / 1.12×, 2048 x 2048 0.93 / 0.95 /
  1.21 / 1.04×, 512 x 2048 0.99 / 1.03 / 1.27 / 1.10×; likely because a tile that stays in the
  last-level cache makes the elementwise passes over it (max, exp, sum; exp again in backward)
  and the GEMMs that read it cheaper. The tile shape is an argument (`chunk_size`,
  `vocab_chunk_size`); off the CPU the default is 16384 x 8192 (`default_tile`; see
  docs/benchmarks_gpu.md).
- **These machines are shared** (see the load lines above): a single round can vary by 2×
  and more, so every ratio is a median of same-round ratios, never a ratio of medians.
- TRL 1.16.0 `selective_log_softmax` needs the logits (it saves part of the unfused memory
  by looping its log-softmax over the batch rows). TRL's fused `ChunkedLogProbFunction` is
  written for GPUs: its CPU fallback uses 4096 x 32768 tiles, so at N = 2048, V = 32k it
  holds more than the unfused path."""  # holds the logits but no autograd state: not comparable


def truncated_variant(top_k: int | None, top_p: float | None) -> Callable:
    """``token_logprobs`` scoring the top-k/top-p truncated policy (default tiles of that path)."""

    def run(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
        from softtrust.logprobs import token_logprobs

        token_logprobs(hidden, weight, labels, top_k=top_k, top_p=top_p).sum().backward()

    return run


# Not in the default run (its tables stay as they are): `--truncated` and the memory child use them.
TRUNCATED_VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
    "softtrust top_k=50": truncated_variant(50, None),
    "softtrust top_p=0.9": truncated_variant(None, 0.9),
    "softtrust top_k=50, top_p=0.9": truncated_variant(50, 0.9),
}


def variant(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    return VARIANTS[name] if name in VARIANTS else TRUNCATED_VARIANTS[name]


def compare_truncated(shape: Shape, repeats: int, threads: int) -> None:
    """Print time and peak memory of the truncated variants against the default path and unfused.

    Memory twice: with glibc's default malloc (a freed block up to 32 MiB raises its mmap
    threshold, later blocks come from the heap and can stay resident), and with the
    threshold fixed at 1 MiB (``_memory.FIXED_MMAP_ENV``: resident memory tracks live tensors).
    """
    from _memory import FIXED_MMAP_ENV

    names = ["unfused", SOFTTRUST, *TRUNCATED_VARIANTS]
    times = time_variants(shape, names, 0, repeats)
    print(f"{shape.label()}, {repeats} rounds; ratios are medians of same-round ratios")
    print(
        "| variant | wall median (s) | CPU median (s) | wall / default path | CPU / default path "
        "| peak memory (MiB) | peak, fixed mmap threshold (MiB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        wall = statistics.median(t.wall for t in times[name])
        cpu = statistics.median(t.cpu for t in times[name])
        memory = measure_memory(name, shape, threads)["peak_mib"]
        live = measure_memory(name, shape, threads, FIXED_MMAP_ENV)["peak_mib"]
        print(
            f"| {name} | {wall:.2f} | {cpu:.2f} | {paired_ratio(times[name], times[SOFTTRUST], 'wall'):.2f} "
            f"| {paired_ratio(times[name], times[SOFTTRUST], 'cpu'):.2f} | {memory:,.0f} | {live:,.0f} |",
            flush=True,
        )


def tile_variant(tile: str) -> str:
    """Register ``token_logprobs`` with ``TOKENSxVOCAB`` tiles as a variant; return its name."""
    tokens, vocab = (int(x) for x in tile.lower().split("x"))

    def run(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
        from softtrust.logprobs import token_logprobs

        token_logprobs(hidden, weight, labels, chunk_size=tokens, vocab_chunk_size=vocab).sum().backward()

    name = f"softtrust tiles {tokens} x {vocab}"
    VARIANTS[name] = run
    return name


def compare_tiles(tiles: str, shapes: tuple[Shape, ...], repeats: int) -> None:
    """Print each tile shape's time over ``unfused`` (medians of same-round ratios), no memory."""
    names = [tile_variant(tile) for tile in tiles.split(",")]
    for shape in shapes:
        times = time_variants(shape, ["unfused", *names], 0, repeats)
        ratios = ", ".join(
            f"{name}: {paired_ratio(times[name], times['unfused'], 'wall'):.2f}" for name in names
        )
        print(f"{shape.label()}: wall / unfused: {ratios}", flush=True)


def trl_available() -> bool:
    try:
        import trl.kernels
        import trl.trainer.utils  # noqa: F401
    except Exception:
        return False
    return True


def make_inputs(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(shape.tokens, HIDDEN_SIZE, generator=generator)  # [N, d]
    weight = torch.randn(shape.vocab, HIDDEN_SIZE, generator=generator) / HIDDEN_SIZE**0.5  # [V, d]
    labels = torch.randint(0, shape.vocab, (shape.tokens,), generator=generator)  # [N]
    hidden = hidden.to(shape.torch_dtype).requires_grad_()
    weight = weight.to(shape.torch_dtype).requires_grad_()
    return hidden, weight, labels


@dataclass(frozen=True)
class Timing:
    """One forward + backward: wall-clock seconds and CPU seconds of this process (all threads)."""

    wall: float
    cpu: float


def timed_call(fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Timing:
    hidden.grad = weight.grad = None
    wall, cpu = time.perf_counter(), time.process_time()
    fn(hidden, weight, labels)
    timing = Timing(time.perf_counter() - wall, time.process_time() - cpu)
    hidden.grad = weight.grad = None
    return timing


def time_variants(shape: Shape, variants: list[str], warmup: int, repeats: int) -> dict[str, list[Timing]]:
    """Round-robin timings: ``repeats`` rounds, every variant once per round, after ``warmup`` rounds."""
    hidden, weight, labels = make_inputs(shape)
    times: dict[str, list[Timing]] = {name: [] for name in variants}
    for round_index in range(warmup + repeats):
        timings = {name: timed_call(variant(name), hidden, weight, labels) for name in variants}
        if round_index >= warmup:
            for name, timing in timings.items():
                times[name].append(timing)
        kind = "warm-up" if round_index < warmup else "round"
        print(
            f"  {kind}: "
            + ", ".join(f"{name} {t.wall:.2f}s (cpu {t.cpu:.2f}s)" for name, t in timings.items()),
            flush=True,
        )
    return times


def memory_child(variant_name: str, shape: Shape, threads: int) -> dict:
    """Run in a fresh interpreter: peak memory of one forward + backward above the inputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _memory import peak_delta_mib

    torch.set_num_threads(threads)
    fn = variant(variant_name)
    # Load the code paths (kernels, lazily imported modules) on a small shape first.
    fn(*make_inputs(Shape(8, 64, shape.dtype)))
    hidden, weight, labels = make_inputs(shape)
    peak_mib, method = peak_delta_mib(lambda: fn(hidden, weight, labels))
    return {"peak_mib": peak_mib, "method": method}


def measure_memory(variant: str, shape: Shape, threads: int, env: dict[str, str] | None = None) -> dict:
    """Peak memory of one forward + backward in a fresh interpreter (``env`` added to its environment)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory-child",
        json.dumps({"variant": variant, "shape": shape.__dict__, "threads": threads}),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})}
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- report ---------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_description(threads: int) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    trl = trl_version() or "not installed"
    return (
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical cores visible), torch threads: {threads}\n"
        f"- torch {torch.__version__}, trl {trl}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}\n"
        f"- load average at start (1, 5, 15 min): {load}"
    )


def median_ratio(samples: list[float], base: list[float]) -> float:
    """Median over rounds of ``sample / base`` within the same round."""
    return statistics.median(t / b for t, b in zip(samples, base, strict=True))


def paired_ratio(samples: list[Timing], base: list[Timing], field: str) -> float:
    """:func:`median_ratio` of one field (``wall`` or ``cpu``) of the timings."""
    return median_ratio([getattr(t, field) for t in samples], [getattr(b, field) for b in base])


def shape_table(shape: Shape, times: dict[str, list[Timing]], memory: dict[str, dict]) -> str:
    base = times["unfused"]
    base_memory = memory.get("unfused", {}).get("peak_mib")
    lines = [
        f"#### {shape.label()}",
        "",
        "| variant | wall median (s) | wall / unfused | CPU median (s) | CPU / unfused "
        "| peak memory (MiB) | memory / unfused |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, samples in times.items():
        peak = memory.get(name, {}).get("peak_mib")
        peak_text = "n/a" if peak is None else f"{peak:,.0f}"
        memory_ratio = "n/a" if peak is None or not base_memory else f"{peak / base_memory:.2f}"
        lines.append(
            f"| {name} | {statistics.median(t.wall for t in samples):.2f} | {paired_ratio(samples, base, 'wall'):.2f} "
            f"| {statistics.median(t.cpu for t in samples):.2f} | {paired_ratio(samples, base, 'cpu'):.2f} "
            f"| {peak_text} | {memory_ratio} |"
        )
    if SOFTTRUST in times and GEMM_FLOOR in times:
        ours, floor = times[SOFTTRUST], times[GEMM_FLOOR]
        lines += [
            "",
            f"softtrust / GEMM floor: wall {paired_ratio(ours, floor, 'wall'):.2f}, "
            f"CPU {paired_ratio(ours, floor, 'cpu'):.2f} (a recomputing method does 4 GEMMs: 1.33 at best)",
        ]
    return "\n".join(lines)


@dataclass(frozen=True)
class ShapeResult:
    """What the reading needs from one shape: wall time and peak memory of each variant over ``unfused``."""

    shape: Shape
    time: dict[str, float]  # variant -> median of same-round wall ratios to unfused
    memory: dict[str, float]  # variant -> peak memory / unfused peak (variants measured only)


def shape_result(shape: Shape, times: dict[str, list[Timing]], memory: dict[str, dict]) -> ShapeResult:
    base_memory = memory["unfused"]["peak_mib"]
    return ShapeResult(
        shape,
        {name: paired_ratio(samples, times["unfused"], "wall") for name, samples in times.items()},
        {name: m["peak_mib"] / base_memory for name, m in memory.items()},
    )


def _at(results: list[ShapeResult], values: list[float]) -> str:
    """``0.96× (float32, N = 1,024, V = 151,936), ...``: one value per shape, named."""
    return ", ".join(f"{v:.2f}× ({r.shape.short()})" for r, v in zip(results, values, strict=True))


def tile_text(device: str) -> str:
    """``2048 x 2048 logits (16 MiB in fp32, ...)``: softtrust's default tile on ``device``."""
    from softtrust.logprobs import default_tile

    elements, vocab = default_tile(torch.device(device))
    return (
        f"{elements // vocab} x {vocab} logits ({4 * elements / 2**20:,.0f} MiB in fp32, plus a bf16 copy "
        "for bf16 inputs)"
    )


def reading(results: list[ShapeResult], trl_version: str | None = None, device: str = "cpu") -> str:
    """Bullets that read a run's tables against issue #4's targets, written from the numbers.

    Targets: at V >= 32k, softtrust's peak memory at most 25% of the unfused path's and
    its time at most 1.2× (compared as printed, to 2 decimals). Where a shape misses the
    time target, the bullet gives the floor of any method that recomputes the logits in
    backward: 4 GEMMs instead of the 3 a storing method needs, ``4/3 x (3-GEMM floor /
    unfused)`` of the unfused time, measured in the same rounds. ``trl_version`` names
    the TRL whose variants were measured; ``device`` decides softtrust's default tile.
    """
    results = [r for r in results if r.shape.vocab >= 32000 and SOFTTRUST in r.time]
    if not results:
        return ""
    bullets = []
    memory = [r.memory[SOFTTRUST] for r in results if SOFTTRUST in r.memory]
    if memory:
        over = [r for r in results if round(r.memory.get(SOFTTRUST, 0.0), 2) > 0.25]
        verdict = "met" if not over else f"not met at {len(over)} of {len(results)} shapes"
        bullets.append(
            f"**Memory (target ≤ 25% of unfused): {verdict}.** softtrust's forward + backward peak is "
            f"{_at(results, memory)} of the unfused path's. Most of it is the weight gradient, which every "
            "variant allocates: "
            + ", ".join(
                f"{vocab * HIDDEN_SIZE * getattr(torch, dtype).itemsize / 2**20:,.0f} MiB ({dtype}, V = {vocab:,})"
                for dtype, vocab in dict.fromkeys((r.shape.dtype, r.shape.vocab) for r in results)
            )  # V x d: one entry per dtype and vocabulary
            + f". Above it softtrust holds one tile workspace of at most {tile_text(device)} and O(N d) "
            "buffers, whatever V and N are."
        )
    times = [r.time[SOFTTRUST] for r in results]
    slow = [r for r in results if round(r.time[SOFTTRUST], 2) > 1.2]
    verdict = (
        "met at every shape" if not slow else f"met at {len(results) - len(slow)} of {len(results)} shapes"
    )
    bullets.append(f"**Time (target ≤ 1.2× unfused): {verdict}:** {_at(results, times)}.")
    if GEMM_FLOOR in results[0].time:
        floors = [r.time[GEMM_FLOOR] for r in results]
        recompute = [4 / 3 * f for f in floors]
        over_floor = [t / f for t, f in zip(times, recompute, strict=True)]
        below = " (below 1: its tiled GEMMs beat the one large GEMM of the unfused path)"
        bullets.append(
            f"The 3-GEMM floor (what a method that stores the logits must do) ran at {_at(results, floors)} "
            "of the unfused time. softtrust recomputes the logits in backward instead of storing them, so "
            f"its own floor is 4 GEMMs, 4/3 of that: {_at(results, recompute)}; it ran at "
            f"{span(over_floor)} that 4-GEMM floor{below if round(min(over_floor), 2) < 1 else ''}."
        )
        for r in slow:
            floor = 4 / 3 * r.time[GEMM_FLOOR]
            where = r.shape.short()
            if round(floor, 2) > 1.2:
                bullets.append(
                    f"At {where} the unfused path is only {1 / r.time[GEMM_FLOOR]:.2f}× its own 3-GEMM "
                    f"floor, so no recomputing method can reach 1.2× there ({floor:.2f}× at best); "
                    "only keeping logits between forward and backward could."
                )
            else:
                bullets.append(
                    f"At {where} the 4-GEMM floor ({floor:.2f}×) is inside the target: softtrust ran at "
                    f"{r.time[SOFTTRUST] / floor:.2f}× that floor, and the excess is its own elementwise work."
                )
    trl = [name for name in results[0].time if name.startswith("trl")]
    for name in trl:
        memory_text = ""
        if all(name in r.memory for r in results):
            memory_text = f" and {span([r.memory[name] for r in results])} its memory"
        bullets.append(
            f"TRL{f' {trl_version}' if trl_version else ''} `{name[4:]}`: {span([r.time[name] for r in results])} the unfused time{memory_text}."
        )
    return "\n".join(f"- {b}" for b in bullets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats, print only")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3, quick 2)")
    parser.add_argument("--warmup", type=int, default=0, help="full-size warm-up rounds (default 0)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", type=Path, default=None, help=f"markdown file (default {DEFAULT_OUTPUT})")
    parser.add_argument(
        "--tiles", default=None, help="compare tile shapes TOKENSxVOCAB,... against unfused (prints only)"
    )
    parser.add_argument(
        "--truncated", action="store_true", help="top-k/top-p variants on the first shape (prints only)"
    )
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.memory_child is not None:
        spec = json.loads(args.memory_child)
        print(json.dumps(memory_child(spec["variant"], Shape(**spec["shape"]), spec["threads"])))
        return

    torch.set_num_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    repeats = args.repeats or (2 if args.quick else 3)
    if args.tiles:
        compare_tiles(args.tiles, shapes, repeats)
        return
    if args.truncated:
        compare_truncated(shapes[0], repeats, args.threads)
        return
    output = args.output or (None if args.quick else DEFAULT_OUTPUT)
    variants = [name for name in VARIANTS if trl_available() or not name.startswith("trl")]
    flags = [
        ("--quick", args.quick),
        (f"--repeats {args.repeats}", args.repeats),
        (f"--warmup {args.warmup}", args.warmup),
    ]
    command = " ".join(["python benchmarks/bench_logprobs.py"] + [flag for flag, given in flags if given])

    machine = machine_description(args.threads)
    # Warm-up: every variant once on a small shape loads its kernels and lazy imports.
    for name in variants:
        VARIANTS[name](*make_inputs(Shape(64, 4096, "float32")))
        VARIANTS[name](*make_inputs(Shape(64, 4096, "bfloat16")))
    sections, results = [], []
    for shape in shapes:
        print(f"{shape.label()}: timing {len(variants)} variants", flush=True)
        times = time_variants(shape, variants, args.warmup, repeats)
        memory = {}
        for name in variants:
            if name not in NO_MEMORY:
                memory[name] = measure_memory(name, shape, args.threads)
        methods = {m["method"] for m in memory.values()}
        section = shape_table(shape, times, memory)
        section += (
            f"\n\nMemory method: {', '.join(sorted(methods))}; {repeats} timed rounds"
            f" after a small-shape warm-up and {args.warmup} full-size warm-up rounds."
        )
        print(section + "\n", flush=True)
        sections.append(section)
        results.append(shape_result(shape, times, memory))

    end_load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    report = "\n".join(
        [
            "### Token log-probs: fused vs unfused (forward + backward)",
            "",
            f"Command: `{command}`",
            "",
            machine,
            f"- load average at end: {end_load}",
            "",
            VARIANT_NOTES,
            "",
            "\n\n".join(sections),
            "",
            "#### Reading the numbers (written from this run's tables)",
            "",
            reading(results, trl_version()),
            "",
            STANDING_NOTES,
            "",
        ]
    )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(report)
        print(f"wrote {output}")


if __name__ == "__main__":
    main()
