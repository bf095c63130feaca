"""The confirmation study's registered tests (docs/preregistration.md) on synthetic sweeps whose
answers are known: the values a run takes (a stopped run: final 0, accuracy 0 after the stop),
the difference-in-differences, the sign test when a run failed, TOST, Holm, the order."""

from __future__ import annotations

import itertools
import math

import pytest
import yaml

pytest.importorskip("scipy")

from softtrust.study import confirmation as c
from softtrust.study.stats import holm, paired_t_test, sign_test
from test_sweep import write_run

SEEDS = range(5, 15)
STEPS = list(range(0, 257, 16))


def curve(level: float, seed: int) -> list[tuple[int, float]]:
    """An accuracy curve from 0.30 rising linearly to ``level`` (plus a per-seed offset)."""
    top = level + 0.004 * (seed - 9)
    return [(s, 0.30 + (top - 0.30) * s / 256) for s in STEPS]


def area(points) -> float:
    return sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in itertools.pairwise(points)) / 256


def write_cell(root, slug, axis, value, seed, level=None, stopped_at=None, lr=None):
    """A run's directory; with ``lr``, under the learning-rate axis (``.../lr<lr>/seed<s>``, the
    lr in its ``config.yaml``) as ``softtrust sweep --lrs`` writes it."""
    points = curve(level, seed)
    directory = root / "runs" / slug / f"{axis}{value}" / (f"lr{lr:g}" if lr else "") / f"seed{seed}"
    if stopped_at is not None:
        kept = [(s, a) for s, a in points if s <= stopped_at]
        write_run(directory, kept, stopped_at, returncode=3)
    else:
        summary = {"steps": 256, "accuracy_before": 0.30, "accuracy_after": points[-1][1]}
        write_run(directory, points, 256, summary=summary, returncode=0)
    if lr:
        (directory / "config.yaml").write_text(
            yaml.safe_dump({"lr": lr, "seed": seed})
        )  # as the trainer writes it
    return points


def sync_sweep(root, levels):
    for (slug, n), level in levels.items():
        for seed in SEEDS:
            write_cell(root, slug, "N", n, seed, level + 0.003 * ((seed * 7 + n + len(slug)) % 5))
    return c.load_outcomes(root, registration=None)


LEVELS = {("clip", 4): 0.70, ("clip", 64): 0.55, ("vespo", 4): 0.71, ("vespo", 64): 0.66,
          ("dppo", 64): 0.655, ("clip-eps_high=0.28", 64): 0.56}  # fmt: skip


def test_registered_values_of_a_completed_and_a_stopped_run(tmp_path):
    done = write_cell(tmp_path / "a", "clip", "N", 4, 5, level=0.7)
    write_cell(tmp_path / "b", "clip", "N", 4, 5, level=0.7, stopped_at=64)
    (full,) = c.load_outcomes(tmp_path / "a", registration=None).values()
    (stopped,) = c.load_outcomes(tmp_path / "b", registration=None).values()
    assert full == {"final": pytest.approx(done[-1][1]), "area": pytest.approx(area(done)), "failed": False}
    zeroed = [(s, a) for s, a in done if s <= 64] + [(s, 0.0) for s in STEPS if s > 64]
    assert stopped == {"final": 0.0, "area": pytest.approx(area(zeroed)), "failed": True}


def test_h1_is_the_difference_in_differences_in_area_paired_by_seed(tmp_path):
    values = sync_sweep(tmp_path, LEVELS)
    family = c.primary_family(values, {})
    h1 = family[0]
    expected = [
        (values[("vespo", 64, s)]["area"] - values[("vespo", 4, s)]["area"])
        - (values[("clip", 64, s)]["area"] - values[("clip", 4, s)]["area"])
        for s in SEEDS
    ]
    reference = paired_t_test(expected)
    assert (h1["name"], h1["test"], h1["n"]) == ("H1", "t", 10)
    assert h1["mean"] == pytest.approx(reference["mean"]) and h1["p"] == pytest.approx(reference["p"])
    assert h1["mean"] > 0.03 and h1["positive"] == 10
    # H2, H3 have no cells here: p = 1 (counted in the family), never holding
    assert [e["name"] for e in family] == ["H1", "H2", "H3", "H4"]
    assert family[1]["p"] == 1.0 and not family[1]["holds"] and not family[2]["holds"]
    adjusted = holm([e["p"] for e in family])
    assert [e["p_holm"] for e in family] == pytest.approx(adjusted)
    assert h1["holds"]


def test_h4_equivalence_by_tost_and_a_failed_run_makes_it_untestable(tmp_path):
    values = sync_sweep(tmp_path / "a", LEVELS)
    h4 = c.primary_family(values, {})[3]
    differences = [values[("vespo", 64, s)]["final"] - values[("dppo", 64, s)]["final"] for s in SEEDS]
    error = paired_t_test(differences)["std"] / math.sqrt(10)
    from scipy import stats

    mean = sum(differences) / 10
    expected = max(stats.t.sf((mean + 0.03) / error, 9), stats.t.sf((0.03 - mean) / error, 9))
    assert h4["test"] == "tost" and h4["p"] == pytest.approx(expected) and h4["p"] < 0.001
    # far apart: not equivalent
    apart = sync_sweep(tmp_path / "b", {**LEVELS, ("dppo", 64): 0.55})
    assert c.primary_family(apart, {})[3]["p"] > 0.5
    # one stopped DPPO run: the sign test cannot show equivalence; registered as not holding
    values[("dppo", 64, 7)] = {"final": 0.0, "area": 0.1, "failed": True}
    failed = c.primary_family(values, {})[3]
    assert failed["p"] == 1.0 and not failed["holds"] and "not testable" in failed["note"]


def test_a_stopped_run_switches_h1_to_the_sign_test_with_its_registered_value(tmp_path):
    for (slug, n), level in LEVELS.items():
        for seed in SEEDS:
            stop = 48 if (slug, n, seed) == ("clip", 64, 6) else None
            write_cell(tmp_path, slug, "N", n, seed, level, stopped_at=stop)
    values = c.load_outcomes(tmp_path, registration=None)
    h1 = c.primary_family(values, {})[0]
    differences = [
        (values[("vespo", 64, s)]["area"] - values[("vespo", 4, s)]["area"])
        - (values[("clip", 64, s)]["area"] - values[("clip", 4, s)]["area"])
        for s in SEEDS
    ]
    assert h1["test"] == "sign" and h1["p"] == pytest.approx(sign_test(differences)["p"])
    assert h1["p"] == pytest.approx(2 / 1024)  # 10 of 10 seeds positive


def test_h2_h3_from_the_async_sweep_and_the_secondary_family(tmp_path):
    levels = {("clip", 1): 0.70, ("clip", 16): 0.50, ("vespo", 1): 0.70, ("vespo", 16): 0.64,
              (c.DECOUPLED, 16): 0.52}  # fmt: skip
    for (slug, k), level in levels.items():
        for seed in SEEDS:
            write_cell(tmp_path / "async", slug, "K", k, seed, level + 0.002 * (seed % 3))
    asynchronous = c.load_outcomes(tmp_path / "async", registration=None)
    sync = sync_sweep(tmp_path / "sync", LEVELS)
    family = c.primary_family(sync, asynchronous)
    assert all(e["holds"] for e in family[:2]) and family[2]["mean"] > 0
    secondary = c.secondary_family(sync, None)
    assert [e["name"] for e in secondary] == ["S1"] and secondary[0]["test"] == "tost"
    text = c.markdown(family)
    assert text.index("| H1 |") < text.index("| H2 |") < text.index("| H3 |") < text.index("| H4 |")


def test_the_command_refuses_a_missing_directory_and_writes_the_tables(tmp_path, capsys):
    sync_sweep(tmp_path / "sync", LEVELS)
    (tmp_path / "async").mkdir()
    with pytest.raises(SystemExit) as error:
        c.main(["--sync", str(tmp_path / "nope"), "--async", str(tmp_path / "async")])
    assert error.value.code == 2 and "--sync: " in capsys.readouterr().err
    out = tmp_path / "tables.md"
    assert (
        c.main(["--sync", str(tmp_path / "sync"), "--async", str(tmp_path / "async"), "--output", str(out)])
        == 0
    )
    assert "Primary family" in out.read_text() and "| H1 |" in out.read_text()


def test_only_registered_seeds_of_descendant_commits_count(tmp_path):
    """Every counted cell's commit descends from the registration (git merge-base --is-ancestor);
    a pilot seed, an older commit or a run without a recorded commit is left out, and listed."""
    import json
    import subprocess

    def commit_of(revision: str) -> str:
        return subprocess.run(
            ["git", "rev-parse", revision], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        registered, older = commit_of(c.REGISTRATION), commit_of(f"{c.REGISTRATION}~1")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout with the registration commit")
    cases = {5: registered, 6: older, 7: None, 0: registered}
    for seed, commit in cases.items():
        write_cell(tmp_path, "clip", "N", 4, seed, level=0.7)
        summary_path = tmp_path / "runs" / "clip" / "N4" / f"seed{seed}" / "summary.json"
        summary = json.loads(summary_path.read_text())
        if commit is not None:
            summary["provenance"] = {"git_commit": commit}
        summary_path.write_text(json.dumps(summary))
    excluded: list[str] = []
    values = c.load_outcomes(tmp_path, excluded=excluded)
    assert list(values) == [("clip", 4, 5)]
    reasons = "\n".join(excluded)
    assert "clip N=4 seed 0: seed 0 is not a registered seed" in reasons
    assert f"clip N=4 seed 6: commit {older[:12]} does not descend from the registration" in reasons
    assert "clip N=4 seed 7: no recorded commit" in reasons


def test_a_failed_run_switches_the_test_for_its_cell_even_when_its_seed_does_not_pair(tmp_path):
    """VESPO N = 64 stopped at seed 5 and DPPO's seed 5 missing: the seed does not pair, but the cell
    has a stopped run, so H4 (an equivalence) does not hold, as registered."""
    values = sync_sweep(tmp_path, LEVELS)
    values[("vespo", 64, 5)] = {"final": 0.0, "area": 0.1, "failed": True}
    del values[("dppo", 64, 5)]
    h4 = c.primary_family(values, {})[3]
    assert h4["n"] == 9 and h4["p"] == 1.0 and not h4["holds"]
    assert "not testable" in h4["note"]


def test_the_exported_per_cell_data_gives_the_same_tables(tmp_path, capsys):
    """docs/data/ (issue 36 item 4): --export writes each run's registered values, curves, commit
    and settings; the analysis reads that file exactly as it reads the sweep directory."""
    import json

    for (slug, n), level in LEVELS.items():
        for seed in SEEDS:
            write_cell(
                tmp_path / "sweep",
                slug,
                "N",
                n,
                seed,
                level,
                stopped_at=48 if seed == 6 and slug == "dppo" else None,
            )
    data = tmp_path / "data" / "confirm.json"
    assert c.main(["--export", str(tmp_path / "sweep"), str(data)]) == 0
    records = json.loads(data.read_text())
    assert len(records) == len(LEVELS) * 10 and data.stat().st_size < 200_000
    stopped = next(r for r in records if (r["cell"], r["seed"]) == ("dppo", 6))
    assert stopped["status"] == "stopped" and stopped["final"] == 0.0 and len(stopped["reward"]) == 48
    from_files = c.load_outcomes(data, registration=None)
    assert from_files == c.load_outcomes(tmp_path / "sweep", registration=None)
    assert c.primary_family(from_files, {}) == c.primary_family(
        c.load_outcomes(tmp_path / "sweep", registration=None), {}
    )


def test_export_adds_each_sittings_finished_runs_to_one_file(tmp_path, capsys):
    """The cells run over several sittings, each from a sweep directory of its own: --export adds a
    sitting's finished runs to the data file and leaves an unfinished one for the next sitting; a
    run already in the file with other values (a rerun on another float path) is refused."""
    import json

    first, second, data = tmp_path / "s1", tmp_path / "s2", tmp_path / "data" / "confirm.json"
    for seed in SEEDS:
        write_cell(first if seed < 10 else second, "clip", "N", 4, seed, 0.7)
    write_run(first / "runs" / "clip" / "N4" / "seed10", curve(0.7, 10)[:3], 40)  # cut at the sitting's end
    assert c.main(["--export", str(first), str(data)]) == 0
    assert "5 finished runs in" in capsys.readouterr().out and len(json.loads(data.read_text())) == 5
    assert c.main(["--export", str(second), str(data)]) == 0
    assert c.main(["--export", str(second), str(data)]) == 0  # again: nothing changes
    assert "5 finished runs in" in capsys.readouterr().out.splitlines()[-1]
    whole = tmp_path / "whole"
    for seed in SEEDS:
        write_cell(whole, "clip", "N", 4, seed, 0.7)
    assert c.load_outcomes(data, registration=None) == c.load_outcomes(whole, registration=None)
    before = data.read_text()
    write_cell(tmp_path / "s3", "clip", "N", 4, 5, 0.71)
    with pytest.raises(SystemExit):
        c.main(["--export", str(tmp_path / "s3"), str(data)])
    assert "already holds clip N=4 seed 5 with other values" in capsys.readouterr().err
    assert data.read_text() == before


def test_the_lr_sensitivity_table_from_the_lr_axis_runs(tmp_path, capsys):
    """confirm-lr (descriptive, no test): its runs sit one level deeper (``N64/lr<lr>/seed<s>``);
    --export keeps each learning rate's run apart, and the table gives VESPO − clip at N = 64 per
    seed and learning rate, in final and area, exactly as the runs' values differ."""
    import json

    levels = {("clip", 5e-5): 0.50, ("vespo", 5e-5): 0.60, ("clip", 2e-4): 0.58, ("vespo", 2e-4): 0.55}
    expected = {}
    for (slug, lr), level in levels.items():
        for seed in range(5, 10):
            points = write_cell(tmp_path / "lr", slug, "N", 64, seed, level + 0.01 * (seed % 2), lr=lr)
            expected[slug, lr, seed] = {"final": points[-1][1], "area": area(points)}
    data = tmp_path / "confirm-lr.json"
    assert c.main(["--export", str(tmp_path / "lr"), str(data)]) == 0
    records = json.loads(data.read_text())
    assert len(records) == 20 and {(r["cell"], r["axis"], r["value"]) for r in records} == {
        ("clip", "N", 64),
        ("vespo", "N", 64),
    }
    rows = c.lr_sensitivity(c.counted_records(data, registration=None))
    assert [(row["lr"], row["measure"]) for row in rows] == [
        (5e-5, "final"), (5e-5, "area"), (2e-4, "final"), (2e-4, "area"),
    ]  # fmt: skip
    for row in rows:
        want = [expected["vespo", row["lr"], s][row["measure"]] - expected["clip", row["lr"], s][row["measure"]]
                for s in range(5, 10)]  # fmt: skip
        assert row["seeds"] == list(range(5, 10)) and row["differences"] == pytest.approx(want, abs=1e-12)
        assert row["mean"] == pytest.approx(sum(want) / 5, abs=1e-12)
    assert rows[0]["mean"] > 0 > rows[2]["mean"]  # VESPO ahead at 5e-5, behind at 2e-4 by construction
    table = c.lr_markdown(rows)
    assert (
        "| 5e-05 | final | 5: +10.0, 6: +10.0, 7: +10.0, 8: +10.0, 9: +10.0 | +10.0 ± 0.0 (n = 5) | yes |"
        in table
    )
    assert "| 0.0002 | final | 5: -3.0," in table and table.count("\n") == 6
    sync_sweep(tmp_path / "sync", LEVELS)
    (tmp_path / "async").mkdir()
    assert (
        c.main(["--sync", str(tmp_path / "sync"), "--async", str(tmp_path / "async"), "--lr", str(data)]) == 0
    )
    text = capsys.readouterr().out  # the runs here record no commit: listed as left out, by learning rate
    assert text.index("Sensitivity to the learning rate") < text.index("Runs left out")
    assert (
        "- vespo N=64 seed 9 (lr 5e-05): no recorded commit" in text
        and "clip N=64 seed 5 (lr 0.0002)" in text
    )
    unfinished = tmp_path / "lr" / "runs" / "clip" / "N64" / "lr5e-05" / "seed7"
    (unfinished / "summary.json").unlink()
    (unfinished / "sweep-cell.json").unlink()  # cut at a sitting's end: no value, its seed leaves the pairs
    rows = c.lr_sensitivity(c.counted_records(tmp_path / "lr", registration=None))
    assert [row["seeds"] for row in rows] == [[5, 6, 8, 9], [5, 6, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
