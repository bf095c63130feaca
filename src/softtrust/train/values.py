"""Reading one configuration value strictly: the field's declared type, range and finiteness.

``coerce`` turns a YAML or command-line value into a dataclass field's type (a value the flag
would refuse is refused from YAML too); ``check_field_value`` applies a field's declared
range; ``parse_key_values`` reads ``k=v,...`` options; ``load_yaml_mapping`` reads a config
file. These know nothing of ``TrainConfig`` (they take the dataclass and field), so the
dataclass (``config.py``) and the command line (``options.py``) both build on them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import types
import typing
from pathlib import Path

import yaml

MISMATCH_DTYPES = {"none": None, "bf16": "bfloat16", "fp16": "float16"}


def parse_mismatch(value: object) -> tuple[str | None, float]:
    """``--mismatch``: ``(autocast dtype name or None, the sampler's logit-noise σ or 0)``:
    ``none``, ``bf16``, ``fp16`` or ``logit-noise:σ`` (σ > 0, finite). A ``ValueError`` naming
    ``mismatch`` otherwise."""
    if value in MISMATCH_DTYPES:
        return MISMATCH_DTYPES[value], 0.0
    name, colon, sigma = str(value).partition(":")
    if name == "logit-noise" and colon:
        number = _real_number(sigma)
        if number is not None and math.isfinite(number) and number > 0:
            return None, number
    raise ValueError(
        "mismatch: expected none, bf16, fp16 or logit-noise:SIGMA with SIGMA > 0 (the standard deviation of "
        f"the noise on the sampler's logits), got {value!r}"
    )


def parse_key_values(text: str, name: str) -> dict:
    """``'a=1,b=x'`` -> ``{'a': 1, 'b': 'x'}``, values read as YAML (and ``1e-6``, which PyYAML
    reads as text, as the number); commas inside brackets stay in their value
    (``'ops=[+, -],n=2'`` -> ``{'ops': ['+', '-'], 'n': 2}``); a key given twice is refused."""
    values = {}
    for item in filter(None, (part.strip() for part in _split_outside_brackets(text))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{name}: expected key=value pairs separated by commas, got {text!r}")
        if key in values:
            raise ValueError(f"{name}: {key!r} is given twice (give each key once), got {text!r}")
        try:
            values[key] = _number_if_float(yaml.safe_load(value))
        except yaml.YAMLError as error:
            raise ValueError(
                f"{name}: cannot read the value of {key!r}, {value!r} (quote special characters, "
                f'e.g. \'["+", "*"]\'): {str(error).splitlines()[0]}'
            ) from error
    return values


def _split_outside_brackets(text: str) -> list[str]:
    """``text`` split at the commas that are not inside ``[...]`` or ``{...}``."""
    parts, depth, current = [], 0, ""
    for character in text:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(character, 0)
        if character == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += character
    return [*parts, current]


def _number_if_float(value):
    """A YAML string that Python reads as a float (``1e-6``, ``.5e3``) as that float; else ``value``."""
    number = _real_number(value) if isinstance(value, str) else None
    return value if number is None else number


@functools.cache
def _type_hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, once per class: it evaluates every annotation of the
    dataclass, and ``coerce`` asks for one field at a time (a config of ~100 fields read
    10 times a second was 0.14 s a read)."""
    return typing.get_type_hints(cls)


def _field_kind(cls, name: str):
    """The field's base type: int, float, str, bool, list or dict (Optional unwrapped)."""
    hint = _type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.get_origin(hint) or hint


def _is_optional(cls, name: str) -> bool:
    hint = _type_hints(cls)[name]
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def coerce(cls, name: str, value):
    """A YAML or command-line value as the field's type, strictly: a value the flag would refuse
    is refused from YAML too (``2.7`` or ``true`` for an int, a number for a string, ...).
    Strings are parsed as the command line parses them."""
    kind = _field_kind(cls, name)
    if value is None:
        if _is_optional(cls, name):
            return None
        raise ValueError(f"{name}: expected {_kind_name(kind)}, got null")
    optional_number = kind in (int, float) and _is_optional(cls, name)
    if optional_number and isinstance(value, str) and value.strip().lower() in NULL_WORDS:
        return None  # an optional number unset from the command line: --flag none
    if kind is dict:
        if isinstance(value, str):
            return parse_key_values(value, name)
        if isinstance(value, dict):
            return dict(value)
    elif kind is list:
        items = value.split(",") if isinstance(value, str) else value
        element = _list_element(cls, name)
        if isinstance(items, (list, tuple)):
            return [element(name, item) for item in items if not (isinstance(item, str) and not item.strip())]
    elif kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return BOOL_WORDS[value.lower()]
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    elif kind is int:
        return _strict_int(name, value)
    elif kind is float:
        number = _real_number(value)
        if number is not None:
            return number
    elif kind is str and isinstance(value, str):
        return value
    raise ValueError(f"{name}: expected {_kind_name(kind)}, got {value!r} ({type(value).__name__})")


def _list_element(cls, name: str):
    """The strict reader of a list field's items: ``list[float]`` reads numbers, else integers."""
    args = typing.get_args(_type_hints(cls)[name])
    return _strict_float if args and args[0] is float else _strict_int


def _real_number(value) -> float | None:
    """A float from a real number or a decimal string; None for a bool or anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _strict_float(name: str, value) -> float:
    """A float from a real number or a decimal string; a bool or anything else is refused."""
    number = _real_number(value)
    if number is None:
        raise ValueError(f"{name}: expected numbers separated by commas, got {value!r}")
    return number


NULL_WORDS = ("none", "null")
BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def _strict_int(name: str, value) -> int:
    """An int from an int or a decimal string; a bool, a float or anything else is refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{name}: expected an integer, got {value!r}")


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        kind, "key=value pairs" if kind is dict else "integers separated by commas"
    )


def check_field_value(f: dataclasses.Field, value) -> None:
    """The declared checks of one field (``_field``'s ``low``/``high``; floats finite and
    representable in float32, the dtype they meet in the model and the optimizer; integers in
    int64; a path-like string option not empty). Raises ``ValueError`` naming the field."""
    if value is None:
        return
    name, low, high = f.name, f.metadata.get("low"), f.metadata.get("high")
    numbers = value if isinstance(value, list) else [value]
    for number in numbers:
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            if isinstance(number, str) and not number.strip() and f.default is None:  # a path option
                raise ValueError(f"{name}: must not be empty (got {value!r})")
            continue
        if not math.isfinite(number):
            raise ValueError(f"{name}: must be a finite number (got {value!r})")
        if low is not None and (number < low or (f.metadata.get("low_open") and number == low)):
            bound = f"> {low}" if f.metadata.get("low_open") else f">= {low}"
            raise ValueError(f"{name}: must be {bound} (got {value!r})")
        if high is not None and number > high:
            raise ValueError(f"{name}: must be <= {high} (got {value!r})")
        if isinstance(number, float):
            check_float32(name, number, value, positive=low == 0 and f.metadata.get("low_open"))
        elif abs(number) > INT64_MAX:  # torch, numpy and the samplers take int64
            raise ValueError(f"{name}: must be at most {INT64_MAX} (2^63 - 1) in magnitude (got {value!r})")


FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1


def check_float32(name: str, number: float, value, positive: bool) -> None:
    """``number`` is finite in float32 (``|x| <= 3.4e38``); a ``positive`` one (a field ``> 0``)
    does not round to 0 there (``1e-300``: a temperature dividing by 0, a learning rate doing nothing)."""
    if abs(number) > FLOAT32_MAX:
        raise ValueError(
            f"{name}: must be at most {FLOAT32_MAX:.7g} in magnitude, the largest float32 (got {value!r})"
        )
    if positive and struct.unpack("f", struct.pack("f", number))[0] == 0.0:
        raise ValueError(f"{name}: must be > 0, and {number!r} is 0 as a float32 (got {value!r})")


def load_yaml_mapping(path: str | Path) -> dict:
    """The mapping in a YAML config file; a missing file, malformed YAML or another type is a
    ``ValueError`` naming ``config``."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"config: cannot read {str(path)!r} ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        raise ValueError(f"config: {str(path)!r} is not valid YAML ({error})") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(
            f"config: {str(path)!r} must hold a mapping of field: value, got {type(loaded).__name__}"
        )
    return loaded
