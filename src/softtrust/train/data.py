"""Datasets for ``--dataset``: JSONL, JSON, CSV, Parquet or a ``datasets.save_to_disk`` directory.

Every record becomes a ``problem.Problem``: the prompt column (``--prompt-column``, default
``prompt``) is a non-empty string or a conversation (a non-empty list of ``{"role",
"content"}`` messages, TRL's conversational format); the answer column (``--answer-column``,
default ``answer``) a string or a finite number (written as text); every other column is kept
and reaches a custom reward as a keyword argument. A bad record is a ``ValueError`` naming
``dataset``, the file and the line (JSONL) or row (other formats, counted from 1); a CSV or
TSV row with more or fewer fields than its header is one too. Text files are read as UTF-8 (a
leading byte-order mark is dropped); other bytes are an error naming the file and the line.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

from softtrust._optional import require

from .problem import Problem

ROLES = ("system", "user", "assistant", "tool")


def read_records(path: str | Path) -> list[tuple[str, object]]:
    """``(where, record)`` pairs of a dataset file or directory, in order.

    ``where`` names the file and the line (JSONL) or row (JSON, CSV, Parquet, a ``datasets``
    directory) for error messages. A ``datasets.DatasetDict`` directory uses its ``train``
    split (or its only split).
    """
    path = Path(path)
    if path.is_dir():
        return _read_datasets_directory(path)
    if not path.is_file():
        raise ValueError(f"dataset: {str(path)!r} is neither a file nor a directory")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        records = []
        # split on "\n" only: str.splitlines also breaks at U+2028 and other separators that a JSON
        # string may hold unescaped
        for number, line in enumerate(read_text(path).split("\n"), start=1):
            if not line.strip():
                continue
            records.append((f"{path}:{number}", _json(line, f"{path}:{number}")))
        return records
    if suffix == ".json":
        loaded = _json(read_text(path), str(path))
        if isinstance(loaded, dict) and all(isinstance(v, list) for v in loaded.values()) and loaded:
            lengths = {len(v) for v in loaded.values()}  # column-oriented {"prompt": [...], ...}
            if len(lengths) != 1:
                raise ValueError(f"dataset: {path}: columns of different lengths {sorted(lengths)}")
            loaded = [dict(zip(loaded, row, strict=True)) for row in zip(*loaded.values(), strict=True)]
        if not isinstance(loaded, list):
            raise ValueError(
                f"dataset: {path}: expected a JSON list of records (or an object of equal-length "
                f"columns), got {type(loaded).__name__}"
            )
        return [(f"{path} row {number}", record) for number, record in enumerate(loaded, start=1)]
    if suffix in (".csv", ".tsv"):
        return _read_delimited(path, "\t" if suffix == ".tsv" else ",")
    if suffix in (".parquet", ".pq"):
        require("pyarrow", f"reading {path} (Parquet)", name="dataset")
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [(f"{path} row {number}", row) for number, row in enumerate(rows, start=1)]
    raise ValueError(
        f"dataset: {str(path)!r} has an unknown extension {suffix!r}; expected .jsonl, .json, .csv, "
        ".tsv, .parquet or a directory written by datasets' save_to_disk"
    )


def read_text(path: Path) -> str:
    """The file's text as UTF-8, a leading byte-order mark dropped (spreadsheets write one); bytes
    that are not UTF-8 are a ``ValueError`` naming the file and the line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"dataset: {path}:{line}: not UTF-8 (byte {data[error.start]:#04x} at offset {error.start}: "
            f"{error.reason}); save the file as UTF-8"
        ) from None


def _json(text: str, where: str):
    """``json.loads(text)``; bad JSON, or an integer longer than Python converts (4,300 digits),
    is a ``ValueError`` naming ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"dataset: {where}: not valid JSON ({error})") from None
    except ValueError:  # int("9" * 5000) is refused by the interpreter (sys.get_int_max_str_digits)
        raise ValueError(
            f"dataset: {where}: a number of more than {sys.get_int_max_str_digits()} digits, which "
            "Python does not read as an integer; write it as a JSON string"
        ) from None


def _read_delimited(path: Path, delimiter: str) -> list[tuple[str, object]]:
    """The records of a CSV or TSV file; a row with more or fewer fields than the header is a
    ``ValueError`` naming the file and the row (``csv.DictReader`` would file the extra fields
    under a column named ``None`` and fill missing ones with ``None``)."""
    with io.StringIO(read_text(path), newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        header = next(reader, None)
        if header is None:
            return []
        records = []
        # row 1 is the first record (the header line is not counted); blank lines are skipped
        for number, row in enumerate((row for row in reader if row), start=1):
            if len(row) != len(header):
                raise ValueError(
                    f"dataset: {path} row {number}: {len(row)} fields, but the header has {len(header)} "
                    f"({', '.join(header)}); quote a field that holds the delimiter {delimiter!r}"
                )
            records.append((f"{path} row {number}", dict(zip(header, row, strict=True))))
    return records


def _read_datasets_directory(path: Path) -> list[tuple[str, object]]:
    require("datasets", f"reading the directory {path} (datasets' save_to_disk)", name="dataset")
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(str(path))
    except Exception as error:
        raise ValueError(
            f"dataset: {str(path)!r} is not a directory written by save_to_disk ({error})"
        ) from error
    if isinstance(loaded, DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise ValueError(f"dataset: {path} holds splits {sorted(loaded)} and none is 'train'")
    return [(f"{path} row {number}", row) for number, row in enumerate(loaded, start=1)]


def check_prompt(value, where: str, column: str):
    """A prompt as ``Problem`` holds it: the string, or the conversation as a tuple of
    ``(role, content)`` pairs (hashable). Anything else is a ``ValueError`` naming ``where``."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for index, message in enumerate(value):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise ValueError(
                    f"dataset: {where}: {column!r} message {index} must be an object with string 'role' "
                    f"and 'content', got {message!r}"
                )
            if message["role"] not in ROLES:
                raise ValueError(
                    f"dataset: {where}: {column!r} message {index} has role {message['role']!r}; "
                    f"expected one of {ROLES}"
                )
            messages.append((message["role"], message["content"]))
        return tuple(messages)
    raise ValueError(
        f"dataset: {where}: {column!r} must be a non-empty string or a non-empty list of "
        f"{{'role', 'content'}} messages, got {value!r}"
    )


def check_answer(value, where: str, column: str) -> str:
    """The answer as text: a string, or a finite number written as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"dataset: {where}: {column!r} must be a string or a finite number, got {value!r}")
    return value


def with_system_prompt(prompt, system_prompt: str | None, where: str):
    """A conversation with ``system_prompt`` first (unless it starts with a system message)."""
    if system_prompt is None:
        return prompt
    if isinstance(prompt, str):
        raise ValueError(
            f"system_prompt: applies to conversational prompts, and {where} holds a plain string "
            "(write the prompt as [{'role': 'user', 'content': ...}] to use the chat template)"
        )
    if prompt[0][0] == "system":
        return prompt
    return (("system", system_prompt), *prompt)


def problems_from_records(
    records: list[tuple[str, object]],
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    system_prompt: str | None = None,
    need_answer: bool = True,
) -> list:
    """``Problem`` s from ``read_records``' output; the first bad record is a ``ValueError``.

    Every record must have the prompt column, and the answer column when ``need_answer``
    (the built-in rewards compare with it); prompts must be all strings or all conversations.
    """

    problems, kind = [], None
    required = (("prompt_column", prompt_column), ("answer_column", answer_column))[: 2 if need_answer else 1]
    for index, (where, record) in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"dataset: {where}: expected an object (a record), got {str(record)[:80]!r}")
        for option, column in required:
            if column in record:
                continue
            has = ", ".join(map(repr, record)) or "no columns"
            if index == 0:  # the option names a column the data does not have
                raise ValueError(
                    f"{option}: {column!r} is not a column of the dataset (its first record, {where}, "
                    f"has {has}); pass --{option.replace('_', '-')} with one of them"
                )
            raise ValueError(
                f"dataset: {where}: no {column!r} column (the records before it have one); it has {has}"
            )
        prompt = with_system_prompt(
            check_prompt(record[prompt_column], where, prompt_column), system_prompt, where
        )
        this_kind = "a plain string" if isinstance(prompt, str) else "a conversation"
        if kind is not None and this_kind != kind:
            raise ValueError(
                f"dataset: {where}: {prompt_column!r} is {this_kind} but earlier records hold {kind}; "
                "use one prompt format per dataset"
            )
        kind = this_kind
        answer = check_answer(record[answer_column], where, answer_column) if answer_column in record else ""
        columns = {key: value for key, value in record.items() if key != prompt_column}
        problems.append(Problem(prompt, answer, columns))
    if not problems:
        raise ValueError("dataset: holds no records")
    return problems
