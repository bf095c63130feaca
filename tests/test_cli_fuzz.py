"""A fuzz of the command line (issue 37): a table of malformed ``softtrust train`` and
``softtrust sweep`` invocations, generated from the options themselves (every ``TrainConfig``
field and every sweep flag x the bad values of its kind: empty, negative, NaN, inf, huge, the
wrong type, YAML junk, an unknown choice, a path that is a file or lies under one), plus unknown
flags, abbreviations and flags without their value.

Each runs in-process through ``softtrust.cli.main`` and must end with exit code 2, one
``softtrust ...: error: ...`` line on stderr naming the option, no traceback, nothing created
(no run, sweep or cache directory) and no model loaded: the trainer's first file
(``RunLog.open``) and the sweep's first cell (``run_locked_sweep``) are replaced by a tripwire,
so an invalid value that got through the checks fails here instead of training.

The full table (several hundred cases) is behind the ``slow`` marker (``pytest -m slow``); a
sample of it runs by default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from softtrust.train.config import TrainConfig
from softtrust.train.values import _field_kind, _is_optional

# TRAIN, SWEEP: a tiny run and sweep (were a case accepted, the tripwire stops it before any work);
# HUGE: beyond int64 and any sane size
from test_cli_errors import HUGE, SWEEP, Hung, make_workdir, refused
from test_cli_errors import TINY as TRAIN

FLOAT32_OVERFLOW = "1e39"  # finite in Python, inf as a float32 (the model's and the optimizer's dtype)
CHOICE_FIELDS = (
    "task", "method", "level", "aggregation", "kl_estimator", "advantages", "advantage_scale", "mode",
    "proximal", "old_logprobs", "mismatch", "dtype", "device", "report_to",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One invocation: ``argv`` after the subcommand's base flags; ``names``: what the error line
    must name (a field, a flag or a sweep option), any one of them."""

    command: str
    argv: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.command} " + " ".join(self.argv)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def bad_numbers(f: dataclasses.Field, kind) -> list[str]:
    """Bad values of a numeric field: junk, non-finite, out of its declared range, huge."""
    low, high, low_open = f.metadata.get("low"), f.metadata.get("high"), f.metadata.get("low_open")
    values = ["", "x", "nan", "inf", "-inf", "true", "[1]", "1,2"]
    if kind is int:
        values += ["1.5", "1e3", HUGE]
    else:
        values += [FLOAT32_OVERFLOW, "0x1p2000", *(("1e-400", "1e-50") if low_open else ("-1e39",))]
    if low is not None:
        values.append(str(low if low_open else low - 1))
        values.append("-1" if low >= 0 else "-1e9")
    if high is not None:
        values.append(str(high * 2 + 1) if kind is int else str(high + 0.5))
    if _is_optional(TrainConfig, f.name):
        values.remove("")  # '' is refused too, but 'none' is the documented unset
    return list(dict.fromkeys(values))


PATH_VALUES = {
    "output_dir": ["", "/dev/null", "FILE", "FILE/run", "/proc/version/run"],
    "cache_dir": ["", "/dev/null", "FILE", "FILE/cache"],
    "dataset": ["", "MISSING", "EMPTY_DIR", "/dev/null", "JUNK", "FILE/x.jsonl"],
    "model": ["", "MISSING", "EMPTY_DIR", "FILE", "/dev/null"],
    "resume": ["", "MISSING", "EMPTY_DIR", "FILE", "/dev/null"],
}
CHOICE_VALUES = ["", "nonsense", " ", "NONE_OF_THEM"]
DICT_VALUES = [
    "k_pos=[1", "k_pos=!!python/object:os.system", "k_pos=!!python/name:os.system", "k_pos=@x",
    "k_pos=1,k_pos=2", "=1", "k_pos", "k_pos=", "nonsense=1", "k_pos={a: [1}", "k_pos=`x`", "k_pos=1]",
]  # fmt: skip
LIST_VALUES = ["x", "1,x", "nan", "inf", "[1", "1;2", "1,,x"]


def train_field_cases() -> list[Case]:
    """Every ``TrainConfig`` field x the bad values of its kind."""
    cases = []
    for f in dataclasses.fields(TrainConfig):
        kind, name = _field_kind(TrainConfig, f.name), f.name
        if kind is bool:
            cases += [Case("train", (f"{flag(name)}=yes",), (flag(name),))]
            cases += [Case("train", (f"--no-{flag(name)[2:]}=1",), (flag(name),))]
            continue
        if kind in (int, float):
            values = bad_numbers(f, kind)
        elif name in PATH_VALUES:
            values = PATH_VALUES[name]
        elif name in CHOICE_FIELDS:
            values = CHOICE_VALUES
        elif kind is dict:
            values = DICT_VALUES if name == "method_params" else [*DICT_VALUES[:5], "nonsense=1"]
        elif kind is list:
            extra = ["-1", "0,-2", HUGE] if name == "lag_schedule" else [FLOAT32_OVERFLOW, "1,-1e39"]
            values = [*LIST_VALUES, *extra]
        else:
            continue  # free text (prompt_column, system_prompt, reward, ...): below, with a dataset
        cases += [Case("train", (f"{flag(name)}={value}",), (name, flag(name))) for value in values]
        cases.append(Case("train", (flag(name),), (flag(name),)))  # the flag without its value
    return cases


def train_special_cases() -> list[Case]:
    """Invalid combinations, rewards and correction specs, config files, unknown flags."""
    d = ("--dataset", "DATASET")
    special = [
        (("--mode", "async", "--lag-schedule", "-1"), "lag_schedule"),
        (("--mode", "async", "--lag-schedule", "0,-3"), "lag_schedule"),
        (("--seed", "99999999999999999999"), "seed"),
        (("--correction", "tis:cap=@x"), "correction"),
        (("--correction", "tis:cap=[1"), "correction"),
        (("--correction", "tis:cap=!!python/name:os.system"), "correction"),
        (("--correction", "tis:cap=1,cap=2"), "correction"),
        (("--correction", "tis:cap=nan"), "correction"),
        (("--correction", "tis:cap=inf"), "correction"),
        (("--correction", "tis:cap=1e39"), "correction"),
        (("--correction", "+"), "correction"),
        (("--correction", "tis+"), "correction"),
        (("--correction", ":cap=2"), "correction"),
        (("--correction", "tis:cap"), "correction"),
        (("--correction", "nonsense"), "correction"),
        (("--correction", "reject:divergence=k3,nonsense=1"), "correction"),
        (("--method-params", "eps_high=1e39", "--method", "clip"), "method_params"),
        (("--method-params", "eps_high=nan", "--method", "clip"), "method_params"),
        (("--method-params", "eps_high=x", "--method", "clip"), "method_params"),
        (("--method-params", "eps_high=[1]", "--method", "clip"), "method_params"),
        (("--task-config", "size=1"), "task_config"),
        (("--task", "reasoning-gym:"), "task"),
        (("--reward", ".rel:f", *d), "reward"),
        (("--reward", ":f", *d), "reward"),
        (("--reward", "os:", *d), "reward"),
        (("--reward", "os:path", *d), "reward"),  # a module, not callable
        (("--reward", "no_such_module_xyz:f", *d), "reward"),
        (("--reward", "a b:c", *d), "reward"),
        (("--reward", "..:f", *d), "reward"),
        (("--reward", "os.:f", *d), "reward"),
        (("--reward", "nonsense", *d), "reward"),
        (("--reward", ",", *d), "reward"),
        (("--reward", "exact", "--reward-weights", "1,2", *d), "reward_weights"),
        (("--reward", "exact", "--reward-weights", "nan", *d), "reward_weights"),
        (("--reward", "exact", "--reward-weights", "1e39", *d), "reward_weights"),
        (("--reward", "exact", "--correctness-reward", "math", *d), "correctness_reward"),
        (("--prompt-column", "nope", *d), "dataset"),  # the message names the file, line and column
        (("--answer-column", "nope", *d), "dataset"),
        (("--prompt-column", "", *d), "dataset"),
        (("--passk-k", "2", "--advantages", "passk"), "passk_k"),  # k < G = 2
        (("--group-size", "2", "--prompts-per-step", "3", "--filter-groups", "--filter-groups-max-draws", "0"),
         "filter_groups_max_draws"),
        (("--proximal", "held", "--mode", "async"), "proximal"),
        (("--proximal-every", "2"), "proximal_every"),
        (("--kl-target", "0.1"), "kl_target"),
        (("--top-p", "0"), "top_p"),
        (("--overlong-penalty", "2,1", "--max-new-tokens", "1"), "overlong_penalty"),
        (("--config", "MISSING"), "config"),
        (("--config", "EMPTY_DIR"), "config"),
        (("--config", "JUNK"), "config"),
        (("--config", "LIST_YAML"), "config"),
        (("--config", "UNKNOWN_FIELD_YAML"), "config"),
        (("--config", "BAD_VALUE_YAML"), "lr"),
        (("--config", "PYTHON_TAG_YAML"), "config"),
        (("--config",), "--config"),
    ]  # fmt: skip
    cases = [Case("train", argv, (name, flag(name))) for argv, name in special]
    for unknown in ("--stalenes", "--learning-rate", "--stal", "--max-st", "--lr-", "--seeds", "--jobs", "-x",
                    "--", "--=1", "positional", "--method-param", "--no-fsdp-x", "--preset"):  # fmt: skip
        cases.append(Case("train", (unknown, "1"), (unknown if unknown != "--" else "1",)))
    return cases


def sweep_cases() -> list[Case]:
    """Every sweep flag x its bad values, duplicate grid values, and train flags passed through."""
    values = {
        "--methods": ["", ",", "nonsense", "clip[", "clip[k=1", "clip]", "clip,clip", "clip,clip[]",
                      "vespo[k_pos=[1]", "vespo[k_pos=@x]", "vespo[k_pos=1,k_pos=2]", "clip[eps_high=nan]",
                      "clip[eps_high=1e39]", "clip[nonsense=1]", "clip[level=nonsense]", "[k=1]"],
        "--staleness": ["", "x", "-1", "0", "1.5", "1,1", "1,x", HUGE, "nan", "1;2", "01,1"],
        "--max-lag": ["x", "-1", "1.5", HUGE, ""],
        "--seeds": ["", "x", "-1", "0", "0,0", "1000000000", HUGE, "1.5", "0,x", HUGE + ",", "-1,", "0,00"],
        "--lrs": ["", "x", "0", "-1", "nan", "inf", "1e39", "3e-4,3.0000001e-4", "3e-4,3e-4", "3e-4,x", "1e-400",
                  "1e-50"],
        "--jobs": ["", "x", "0", "-1", "1.5", "nan"],
        "--preset": ["", "nonsense"],
        "--reference": ["", "nonsense"],
        "--output-dir": ["", "/dev/null", "FILE", "FILE/sweep"],
    }  # fmt: skip
    cases = []
    for option, bad in values.items():
        name = {"--output-dir": "output_dir", "--max-lag": "max_lag"}.get(option, option[2:])
        names = (option, name)
        cases += [Case("sweep", (f"{option}={value}",), names) for value in bad]
        cases.append(Case("sweep", (option,), (option,)))
    special = [
        (("--mode", "async", "--max-lag", "1,1"), "max_lag"),
        (("--mode", "async", "--staleness", "1,1"), "staleness"),
        (("--lrs", "3e-4", "--lr", "1e-3"), "lr"),
        (("--report-only", "--output-dir", "FILE"), "output_dir"),
        (("--report-only", "--output-dir", "FILE/sweep"), "output_dir"),
        (("--report-only", "--output-dir", "/dev/null"), "output_dir"),
        (("--report-only", "--output-dir", "MISSING"), "output_dir"),
        (("--report-only=1",), "--report-only"),
        (("--seed", "1"), "seed"),  # set per cell
        (("--method", "clip"), "method"),
        (("--resume", "EMPTY_DIR"), "resume"),
        (("--config", "JUNK"), "config"),
        (("--config", "UNKNOWN_FIELD_YAML"), "config"),
        (("--stalenes", "1"), "--stalenes"),
        (("--meth", "clip"), "--meth"),
        (("--seed-s", "1"), "--seed-s"),
        (("positional",), "positional"),
    ]
    cases += [
        Case("sweep", argv, (name, flag(name) if not name.startswith("-") else name))
        for argv, name in special
    ]
    # a train flag passed through the sweep is checked as train checks it (one bad value per option)
    per_cell = (
        "--output-dir",
        "--resume",
        "--seed=",
        "--method=",
        "--method-params",
    )  # refused as such above
    cases += [
        Case("sweep", case.argv, case.names)
        for case in train_field_cases()
        if not case.argv[0].startswith(per_cell) and case.argv[0].partition("=")[2] in ("nan", "x")
    ]
    return cases


ALL_CASES = list(
    {case.id: case for case in [*train_field_cases(), *train_special_cases(), *sweep_cases()]}.values()
)
# The default run's sample: one of every kind of failure (about 20).
SAMPLE = {
    "train --method-params=k_pos=[1",
    "train --method-params=k_pos=1,k_pos=2",
    "train --correction tis:cap=@x",
    "train --mode async --lag-schedule -1",
    "train --seed 99999999999999999999",
    f"train --max-new-tokens={HUGE}",
    f"train --num-threads={HUGE}",
    "train --output-dir=/dev/null",
    "train --output-dir=FILE/run",
    "train --cache-dir=/dev/null",
    "train --reward .rel:f --dataset DATASET",
    "train --reward :f --dataset DATASET",
    f"train --lr={FLOAT32_OVERFLOW}",
    "train --stal 1",
    "train --strict-reward=yes",
    "sweep --seeds=1000000000",
    "sweep --seeds=0,0",
    "sweep --staleness=1,1",
    "sweep --lrs=3e-4,3.0000001e-4",
    "sweep --report-only --output-dir FILE",
    "sweep --methods=vespo[k_pos=1,k_pos=2]",
}


def _param(case: Case):
    marks = [] if case.id in SAMPLE else [pytest.mark.slow]
    return pytest.param(case, id=case.id, marks=marks)


class Tripwire(BaseException):
    """Raised where a run would start: the invocation got through every check."""


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """``make_workdir`` (a file ``FILE``, a dataset, the cache inside) with the other files the
    cases name, relative to it, and the tripwires."""
    from softtrust.study import runner
    from softtrust.train import trainer

    def tripwire(*args, **kwargs):
        raise Tripwire("accepted: it would create a run directory and train")

    monkeypatch.setattr(trainer.RunLog, "open", tripwire)
    monkeypatch.setattr(runner, "run_locked_sweep", tripwire)
    workdir = make_workdir(tmp_path, monkeypatch)
    (workdir / "JUNK").write_text("method: [unclosed\n\x00\x01")
    (workdir / "EMPTY_DIR").mkdir()
    (workdir / "LIST_YAML").write_text("- 1\n- 2\n")
    (workdir / "UNKNOWN_FIELD_YAML").write_text("stalenes: 4\n")
    (workdir / "BAD_VALUE_YAML").write_text("lr: .inf\n")
    (workdir / "PYTHON_TAG_YAML").write_text("lr: !!python/object/apply:os.system ['true']\n")
    return workdir


def check_refused(case: Case, root: Path, capsys) -> str:
    """Run ``case``: ``refused`` (exit 2, one error line, nothing created), and the line names
    the option. Returns the line."""
    base = TRAIN if case.command == "train" else SWEEP
    argv = [*base, *(item.replace("DATASET", "data.jsonl") for item in case.argv)]
    try:
        line = refused(argv, root, capsys)
    except AssertionError:
        raise
    except Hung:
        pytest.fail(f"{case.id!r} hung")
    except Tripwire:
        pytest.fail(f"{case.id!r} was accepted (exit 0 on invalid input)")
    except Exception as error:  # a traceback: the failure this looks for
        pytest.fail(f"{case.id!r} raised {type(error).__name__}: {error}")
    assert any(name in line for name in case.names), (case.names, line)
    return line


@pytest.mark.parametrize("case", [_param(case) for case in ALL_CASES])
def test_malformed_invocation_is_one_error_line_naming_the_option(case, sandbox, capsys):
    check_refused(case, sandbox, capsys)


def test_the_table_is_large_and_the_sample_is_in_it():
    """The issue asks for >= 300 malformed invocations; the default run's sample is a subset."""
    ids = [case.id for case in ALL_CASES]
    assert len(ids) >= 300 and len(set(ids)) == len(ids)
    assert set(ids) >= SAMPLE, sorted(SAMPLE - set(ids))
