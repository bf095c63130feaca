"""The benchmarks' written readings follow the measured numbers; the GPU benchmark's correctness check."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_logprobs
import bench_loss


def record(batch, length, st, trl):
    names = ["st_vespo", "trl_vespo", "plain_vespo", "st_clip", "plain_clip", "st_sapo", "plain_sapo"]
    ms = dict.fromkeys(names, 1.0)
    ms.update(st_vespo=st, trl_vespo=trl)
    return {"shape": (batch, length), "ms": ms}


def test_reading_reports_the_long_shape_ratio_and_the_small_shapes_below_target():
    text = bench_loss.reading(
        [record(8, 128, 0.25, 0.20), record(16, 256, 0.25, 0.24), record(64, 4096, 1.0, 2.0)], "1.16.0"
    )
    assert "2.00× faster than TRL 1.16.0's path" in text and "(target ≥ 1.5×: met)" in text
    assert "0.80–0.96× the speed" in text and "(target ≥ 0.9×: **not met** at 8 × 128)" in text


def test_reading_says_when_the_targets_are_missed_or_met():
    text = bench_loss.reading([record(8, 128, 0.20, 0.19), record(64, 4096, 1.0, 1.2)])
    assert "1.20× faster" in text and "(target ≥ 1.5×: **not met**)" in text
    assert "(target ≥ 0.9×: met)" in text


def test_a_ratio_printed_as_1_50_meets_the_target_and_short_grids_read_alone():
    text = bench_loss.reading([record(64, 4096, 0.2, 0.3)])  # 0.3 / 0.2 = 1.4999... in binary
    assert "1.50× faster" in text and "(target ≥ 1.5×: met)" in text
    text = bench_loss.reading([record(8, 128, 0.2, 0.3)])
    assert "On this grid it runs at 1.50× the speed" in text and "Below that" not in text


def test_reading_checks_clip_and_sapo_against_their_plain_expressions():
    fast, slow = record(8, 128, 0.2, 0.2), record(16, 256, 0.2, 0.2)
    slow["ms"].update(st_clip=1.2, st_sapo=1.05)  # plain = 1.0: Clip 0.83× (missed), SAPO 0.95× (met)
    text = bench_loss.reading([fast, slow])
    assert "Clip runs at 0.83–1.00×" in text and "**not met** at 16 × 256" in text
    assert (
        "SAPO runs at 0.95–1.00× the speed of its plain autograd expression (target: no more than 10 % slower: met)"
        in text
    )


def test_reading_without_trl_still_reads_the_other_methods():
    results = [record(8, 128, 0.2, 0.2)]
    del results[0]["ms"]["trl_vespo"]
    text = bench_loss.reading(results)
    assert "TRL is not installed" in text and "Clip runs at 1.00×" in text


# ---- benchmarks/bench_logprobs.py ---------------------------------------------------------


def logprob_result(vocab, dtype, softtrust, floor, memory=0.14):
    time = {"unfused": 1.0, bench_logprobs.GEMM_FLOOR: floor, bench_logprobs.SOFTTRUST: softtrust}
    time["trl selective_log_softmax"] = 1.1
    memory_ratios = {"unfused": 1.0, bench_logprobs.SOFTTRUST: memory, "trl selective_log_softmax": 0.5}
    return bench_logprobs.ShapeResult(bench_logprobs.Shape(2048, vocab, dtype), time, memory_ratios)


def test_logprob_reading_meets_both_targets_when_every_shape_does():
    text = bench_logprobs.reading(
        [logprob_result(151936, "float32", 0.96, 0.70, 0.23), logprob_result(32000, "bfloat16", 1.20, 0.69)],
        "1.16.0",
    )
    assert "**Memory (target ≤ 25% of unfused): met.**" in text
    assert "0.23× (float32, N = 2,048, V = 151,936), 0.14× (bfloat16, N = 2,048, V = 32,000)" in text
    assert "519 MiB (float32, V = 151,936), 55 MiB (bfloat16, V = 32,000)" in text  # V x d gradient
    assert "**Time (target ≤ 1.2× unfused): met at every shape:**" in text
    assert "its own floor is 4 GEMMs, 4/3 of that: 0.93×" in text and "0.92× (bfloat16" in text
    assert "TRL 1.16.0 `selective_log_softmax`: 1.10× the unfused time and 0.50× its memory." in text
    assert "1.03–1.30× that 4-GEMM floor." in text  # 0.96 / (4/3 x 0.70), 1.20 / (4/3 x 0.69)
    text = bench_logprobs.reading([logprob_result(32000, "float32", 0.80, 0.70)])
    assert "0.86× that 4-GEMM floor (below 1: its tiled GEMMs beat" in text


def test_logprob_reading_tells_a_floor_bound_miss_from_an_avoidable_one():
    text = bench_logprobs.reading(
        [
            logprob_result(32000, "float32", 1.24, 0.91, 0.30),  # 4/3 x 0.91 = 1.21: out of reach
            logprob_result(151936, "float32", 1.25, 0.75),  # 4/3 x 0.75 = 1.00: softtrust's own cost
        ]
    )
    assert "**Memory (target ≤ 25% of unfused): not met at 1 of 2 shapes.**" in text
    assert "(below 1" not in text
    assert "met at 0 of 2 shapes" in text
    assert "At float32, N = 2,048, V = 32,000 the unfused path is only 1.10× its own 3-GEMM floor" in text
    assert "(1.21× at best)" in text
    assert "- TRL `selective_log_softmax`: 1.10×" in text  # no version given
    assert (
        "At float32, N = 2,048, V = 151,936 the 4-GEMM floor (1.00×) is inside the target: softtrust ran at 1.25× that floor"
        in text
    )


def test_logprob_reading_skips_small_vocabularies():
    assert bench_logprobs.reading([logprob_result(4096, "float32", 2.0, 0.5)]) == ""


# ---- benchmarks/bench_gpu.py --------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.costly
def test_gpu_benchmark_correctness_check_passes_on_cpu_and_can_fail(monkeypatch):
    """The device check's verdicts: all within tolerance for the real kernel, FAILED for a broken one."""
    import bench_gpu

    import softtrust.logprobs

    text = bench_gpu.correctness_section(torch.device("cpu"))
    assert "FAILED" not in text and text.count("within max(") == 8  # 4 softtrust rows per dtype

    real = softtrust.logprobs.token_logprobs

    def off_by_a_little(*args, **kwargs):
        result = real(*args, **kwargs)
        return (result[0] + 1e-3, result[1]) if kwargs.get("with_entropy") else result + 1e-3

    monkeypatch.setattr(softtrust.logprobs, "token_logprobs", off_by_a_little)
    text = bench_gpu.correctness_section(torch.device("cpu"))
    assert "(**a check FAILED**)" in text and text.count("**FAILED**:") == 4  # the fp32 rows only


def test_logprob_reading_tells_shapes_apart_by_n_and_lists_each_weight_gradient_once():
    small, large = logprob_result(151936, "bfloat16", 1.9, 0.4), logprob_result(151936, "bfloat16", 0.8, 0.36)
    large = bench_logprobs.ShapeResult(
        bench_logprobs.Shape(16384, 151936, "bfloat16"), large.time, large.memory
    )
    text = bench_logprobs.reading([small, large])
    assert "1.90× (bfloat16, N = 2,048, V = 151,936), 0.80× (bfloat16, N = 16,384, V = 151,936)" in text
    assert text.count("260 MiB (bfloat16, V = 151,936)") == 1  # V x d, whatever N


def test_ratios_are_medians_of_per_round_ratios_when_rounds_are_recorded():
    """Round-robin timing: a round's ratio cancels the machine's drift; the median of ratios is read."""
    rounds = {"trl_vespo": [1.0, 2.0, 4.0], "st_vespo": [1.0, 1.0, 4.0]}  # per-round ratios 1, 2, 1
    record = {"shape": (8, 128), "ms": {"trl_vespo": 2.0, "st_vespo": 1.0}, "rounds": rounds}
    assert bench_loss.ratio(record, "trl_vespo", "st_vespo") == 1.0  # the ratio of medians would be 2
    assert bench_loss.ratio({"ms": record["ms"]}, "trl_vespo", "st_vespo") == 2.0
