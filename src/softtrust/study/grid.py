"""The grid of a study: method specs, the axes (methods x staleness x seeds, optionally x lr),
the cells, and each cell's ``TrainConfig``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from softtrust.train.config import TrainConfig
from softtrust.train.loss_config import build_method_loss
from softtrust.train.option_checks import MAX_SEED, MAX_SEEDS, check_directory_option
from softtrust.train.values import check_float32, parse_key_values

# The fields that a sweep sets per cell: shared overrides may not set them.
AXIS_FIELDS = ("method", "method_params", "level", "staleness", "seed", "output_dir", "resume", "config")
LR_AXIS_FIELD = "lr"  # a shared override unless --lrs makes it a grid axis

# Method-spec keys that go to TrainConfig fields instead of the method's parameters.
SPEC_CONFIG_KEYS = ("level", "aggregation", "correction", "proximal", "proximal_every")


@dataclass(frozen=True)
class MethodSpec:
    """One column of the study: a registry name plus parameters, e.g. ``vespo[k_neg=2,lambda_neg=3]``.

    ``level``, ``aggregation``, ``correction``, ``proximal`` and ``proximal_every`` in the
    brackets set those trainer fields (``vespo[level=sequence-mean]`` is the paper's
    length-normalisation ablation, ``clip[correction=tis]`` adds truncated importance sampling,
    a correction with one parameter at most, since commas separate keys;
    ``clip[proximal=held,proximal_every=16]`` is async clip with the decoupled objective's held
    π_prox); every other key is a method parameter.
    """

    label: str
    method: str
    params: dict = field(default_factory=dict, hash=False)  # the label determines them
    config: dict = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        text = text.strip()
        name, bracket, rest = text.partition("[")
        values = {}
        if bracket:
            if not rest.endswith("]"):
                raise ValueError(f"methods: {text!r} has no closing ']'")
            values = parse_key_values(rest[:-1], "methods")
        params = {key: value for key, value in values.items() if key not in SPEC_CONFIG_KEYS}
        config = {key: value for key, value in values.items() if key in SPEC_CONFIG_KEYS}
        return cls(label=text, method=name.strip(), params=params, config=config)

    @property
    def slug(self) -> str:
        """A directory name: ``vespo[k_neg=2,lambda_neg=3]`` -> ``vespo-k_neg=2-lambda_neg=3``."""
        keep = "".join(ch if ch.isalnum() or ch in "._=-" else "-" for ch in self.label)
        return "-".join(filter(None, keep.split("-")))


def split_methods(text: str) -> list[MethodSpec]:
    """``'clip,vespo[k_neg=2,lambda_neg=3]'`` -> two specs (commas inside brackets stay)."""
    items, depth, current = [], 0, ""
    for character in text:
        depth += {"[": 1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += character
    items.append(current)
    specs = [MethodSpec.parse(item) for item in items if item.strip()]
    if not specs:
        raise ValueError("methods: give at least one method")
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"methods: repeated method {labels}")
    by_slug: dict[str, str] = {}
    for spec in specs:  # two labels, one directory (e.g. 'vespo' and 'vespo[]'): their runs would mix
        if spec.slug in by_slug:
            raise ValueError(
                f"methods: {by_slug[spec.slug]!r} and {spec.label!r} are the same cell directory "
                f"({spec.slug!r}); give each method once"
            )
        by_slug[spec.slug] = spec.label
    return specs


def parse_int_list(text: str, name: str) -> list[int]:
    """``'1,2,4'`` -> ``[1, 2, 4]``: grid values, each >= 0 and given once (``'1,01'`` is 1 twice)."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"{name}: expected integers separated by commas, got {text!r}") from error
    if not values or any(value < 0 for value in values):
        raise ValueError(f"{name}: expected non-negative integers, got {text!r}")
    refuse_repeats([(value, str(value)) for value in values], name, text)
    return values


def refuse_repeats(keys: list[tuple], name: str, text: str) -> None:
    """Refuse two grid values with one ``key`` (their cell directory): the second cell would run
    in, or be skipped as, the first's. ``keys``: ``(key, value as written)`` pairs."""
    seen: dict = {}
    for key, shown in keys:
        if key in seen:
            same = (
                "is given twice" if seen[key] == shown else f"and {seen[key]} name one cell directory ({key})"
            )
            raise ValueError(f"{name}: {shown} {same}; give each value once (got {text!r})")
        seen[key] = shown


def parse_lrs(text: str) -> list[float]:
    """``'3e-4,1e-3'`` -> ``[3e-4, 1e-3]`` (sorted, each > 0 and a float32, each its own cell
    directory: ``lr{value:g}``, 6 significant digits)."""
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"lrs: expected numbers separated by commas, got {text!r}") from error
    if not values or any(not (math.isfinite(value) and value > 0) for value in values):
        raise ValueError(f"lrs: expected finite learning rates > 0, got {text!r}")
    for value in values:
        check_float32("lrs", value, text, positive=True)
    refuse_repeats([(f"lr{value:g}", repr(value)) for value in values], "lrs", text)
    return sorted(values)


def parse_seeds(text: str) -> list[int]:
    """``'3'`` -> seeds 0, 1, 2; ``'0,5'`` -> seeds 0 and 5; ``'1,'`` -> seed 1 alone. At most
    ``MAX_SEEDS`` seeds, each at most ``MAX_SEED``."""
    values = parse_int_list(text, "seeds")
    if "," in str(text):
        if max(values) > MAX_SEED:
            raise ValueError(f"seeds: a seed is at most {MAX_SEED} (2^32 - 1), got {text!r}")
        return values
    if values[0] < 1:
        raise ValueError(f"seeds: a number of seeds must be >= 1 (got {text!r}; for seed 0 alone write '0,')")
    if values[0] > MAX_SEEDS:
        raise ValueError(
            f"seeds: at most {MAX_SEEDS} seeds in one sweep (got {text!r}; for one seed S alone write 'S,')"
        )
    return list(range(values[0]))


# Cell.layout's form, loosely (Cell.run_directories keeps a match only if Cell.layout writes it back)
_RUN_LAYOUT = re.compile(
    r"runs/(?P<slug>[^/]+)/(?P<axis>[NK])(?P<value>[0-9]+)(?:/lr(?P<lr>[^/]+))?/seed(?P<seed>[0-9]+)"
)


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    spec: MethodSpec
    staleness: int  # N in sync mode, the lag bound K in async mode
    seed: int
    axis: str = "N"  # "K" in async mode
    lr: float | None = None  # set when the learning rate is a grid axis (--lrs)

    @staticmethod
    def layout(slug: str, axis: str, value: int, lr: float | None, seed: int) -> str:
        """A run's directory relative to the sweep directory,
        ``runs/<slug>/<axis><value>[/lr<lr>]/seed<seed>``, the learning rate as ``f"{lr:g}"``."""
        lr_level = "" if lr is None else f"/lr{lr:g}"
        return f"runs/{slug}/{axis}{value}{lr_level}/seed{seed}"

    def directory(self, root: Path) -> Path:
        return root / self.layout(self.spec.slug, self.axis, self.staleness, self.lr, self.seed)

    @staticmethod
    def run_directories(root: Path) -> list[tuple[Path, dict]]:
        """Every run directory under the sweep directory ``root`` that ``layout`` writes, sorted,
        each with its parsed parts (``slug``, ``axis``, ``value``, ``lr`` as written or None,
        ``seed``). A folder that ``layout`` would not write back as it is (a copy named ``N64-old``,
        ``N064``, ``seed5-old`` or ``lr2e-04``, say), one with a learning rate that is not finite and
        positive, or a file, is not a run of the sweep and is left out."""
        found = []
        for path in sorted([*root.glob("runs/*/*/seed*"), *root.glob("runs/*/*/*/seed*")]):
            relative = path.relative_to(root).as_posix()
            match = _RUN_LAYOUT.fullmatch(relative)
            if match is None or not path.is_dir():
                continue
            parts = {**match.groupdict(), "value": int(match["value"]), "seed": int(match["seed"])}
            try:  # a rate as --lrs takes it (lrfoo, lrnan, lr-0.001: no grid writes them)
                lr = None if parts["lr"] is None else parse_lrs(parts["lr"])[0]
            except ValueError:
                continue
            if Cell.layout(parts["slug"], parts["axis"], parts["value"], lr, parts["seed"]) == relative:
                found.append((path, parts))
        return found

    @property
    def name(self) -> str:
        lr = "" if self.lr is None else f" lr={self.lr:g}"
        return f"{self.spec.label} {self.axis}={self.staleness}{lr} seed={self.seed}"


@dataclass
class Sweep:
    """The grid (methods x staleness x seeds) and the ``train`` settings shared by every cell."""

    methods: list[MethodSpec]
    staleness: list[int]
    seeds: list[int]
    output_dir: Path
    overrides: dict = field(default_factory=dict)
    jobs: int = 1
    progress: bool = True
    lrs: list[float] | None = None  # the learning-rate axis (None: lr is a shared setting)
    allow_mixed_code: bool = False  # report runs made by different code (commit / versions) anyway
    reference: str | None = None  # the method every other is tested against (``reference_method``)

    @property
    def labels(self) -> list[str]:
        """The methods' labels (``MethodSpec.label``), in grid order."""
        return [spec.label for spec in self.methods]

    @property
    def reference_method(self) -> str:
        """The method the report compares every other with: ``reference`` when given, else
        ``vespo`` when it is in the grid, else the last method listed."""
        labels = self.labels
        if self.reference is not None and self.reference not in labels:
            raise ValueError(
                f"reference: {self.reference!r} is not a method of the sweep; expected one of {labels}"
            )
        return self.reference or ("vespo" if "vespo" in labels else labels[-1])

    @property
    def mode(self) -> str:
        return self.overrides.get("mode", "sync")

    @property
    def max_steps(self) -> int:
        """The optimizer steps of every cell (the shared ``max_steps``, or the trainer's default)."""
        return TrainConfig.from_dict(dict(self.overrides)).max_steps

    @property
    def axis(self) -> str:
        return "K" if self.mode == "async" else "N"

    def cells(self) -> list[Cell]:
        return [
            Cell(spec, staleness, seed, self.axis, lr)
            for staleness in self.staleness
            for lr in self.lrs or [None]
            for spec in self.methods
            for seed in self.seeds
        ]

    def cell_config(self, cell: Cell) -> TrainConfig:
        values = {
            **self.overrides,
            **cell.spec.config,
            "method": cell.spec.method,
            "method_params": dict(cell.spec.params),
            "seed": cell.seed,
            "output_dir": str(cell.directory(self.output_dir)),
            "progress": False,
        }
        values["max_lag" if self.mode == "async" else "staleness"] = cell.staleness
        if cell.lr is not None:
            values[LR_AXIS_FIELD] = cell.lr
        return TrainConfig.from_dict(values)

    def validate(self) -> None:
        """Check the grid and every cell's config before any cell runs (``ValueError`` naming the option)."""
        check_directory_option(self.output_dir, "output_dir")
        bad = sorted(set(self.overrides) & set(AXIS_FIELDS))
        if bad:
            raise ValueError(f"sweep: {bad} are set per cell by --methods / --staleness / --seeds")
        if self.lrs is not None and LR_AXIS_FIELD in self.overrides:
            raise ValueError(
                f"sweep: lr={self.overrides[LR_AXIS_FIELD]} is given (by --lr or --config) while the "
                f"learning rate is a grid axis, lrs={self.lrs} (from --lrs or the preset); give one of them"
            )
        if self.mode == "sync" and any(n < 1 for n in self.staleness):
            raise ValueError(f"staleness: N must be >= 1 (got {self.staleness})")
        for cell in self.cells():
            try:  # a bad method spec fails before any run
                build_method_loss(self.cell_config(cell).validate())
            except ValueError as error:  # naming --methods when the spec set the field refused
                field = str(error).partition(":")[0]
                if field in ("method", "method_params") or field in cell.spec.config:
                    raise ValueError(f"methods: {cell.spec.label!r}: {error}") from error
                raise
        if self.jobs < 1:
            raise ValueError(f"jobs: must be >= 1 (got {self.jobs})")
        _ = self.reference_method  # raises for a --reference that is not a method of the sweep
