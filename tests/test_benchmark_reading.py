"""The benchmark's written reading follows the measured numbers (benchmarks/bench_loss.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_loss


def record(batch, length, st, trl):
    names = ["st_vespo", "trl_vespo", "plain_vespo", "st_clip", "plain_clip", "st_sapo", "plain_sapo"]
    ms = dict.fromkeys(names, 1.0)
    ms.update(st_vespo=st, trl_vespo=trl)
    return {"shape": (batch, length), "ms": ms}


def test_reading_reports_the_long_shape_ratio_and_where_softtrust_is_behind():
    text = bench_loss.reading(
        [record(8, 128, 0.25, 0.20), record(16, 256, 0.25, 0.21), record(64, 4096, 1.0, 2.0)], "1.16.0"
    )
    assert "2.00× faster than TRL 1.16.0's path" in text and "(target ≥ 1.5×: met)" in text
    assert "slower at 8 × 128 and 16 × 256, by 40.0–50.0 µs" in text and "not met" in text


def test_reading_says_when_the_targets_are_missed_or_met():
    text = bench_loss.reading([record(8, 128, 0.20, 0.25), record(64, 4096, 1.0, 1.2)])
    assert "1.20× faster" in text and "(target ≥ 1.5×: **not met**)" in text
    assert "no slower than TRL anywhere" in text


def test_a_ratio_printed_as_1_50_meets_the_target_and_short_grids_read_alone():
    text = bench_loss.reading([record(64, 4096, 0.2, 0.3)])  # 0.3 / 0.2 = 1.4999... in binary
    assert "1.50× faster" in text and "(target ≥ 1.5×: met)" in text
    text = bench_loss.reading([record(8, 128, 0.2, 0.3)])
    assert "On this grid it runs at 1.50× the speed" in text and "Below that" not in text


def test_reading_without_trl_still_reads_the_other_methods():
    results = [record(8, 128, 0.2, 0.2)]
    del results[0]["ms"]["trl_vespo"]
    text = bench_loss.reading(results)
    assert "TRL is not installed" in text and "Clip runs at 1.00×" in text
