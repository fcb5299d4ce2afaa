"""Reading JSONL data files (one JSON object per line) with errors that point at the line.

Each task supplies a small ``parse`` function that turns one JSON object into a record and
raises ``TypeError``/``ValueError`` saying what is wrong; :func:`read_jsonl` adds the file
and the line number.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

from swarmtrain.errors import TaskError

__all__ = ["parse_digits_record", "parse_text_record", "read_jsonl", "require_key"]

T = TypeVar("T")


def read_jsonl(path: str | os.PathLike[str], parse: Callable[[dict[str, Any]], T]) -> list[T]:
    """Read every record of a JSONL file.

    Blank lines are skipped. Every other line must be a JSON object that ``parse`` accepts.

    Args:
        path: the JSONL file.
        parse: turns one JSON object into a record; raises ``TypeError`` or ``ValueError``
            saying what is wrong if the object is malformed.

    Returns:
        The parsed records in file order.

    Raises:
        TaskError: the file cannot be read, holds no records, or a line is malformed (the
            message names the file, the line number and what was wrong).
    """
    records: list[T] = []
    try:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                records.append(_parse_line(path, line_no, raw, parse))
    except OSError as e:
        raise TaskError(f"cannot read data file {os.fspath(path)!r}: {e.strerror or e}") from e
    if not records:
        raise TaskError(f"data file {os.fspath(path)!r} is empty: it holds no JSON records")
    return records


def _parse_line(
    path: str | os.PathLike[str], line_no: int, raw: bytes, parse: Callable[[dict[str, Any]], T]
) -> T:
    where = f"{os.fspath(path)}, line {line_no}"
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        raise TaskError(f"{where}: not valid UTF-8 ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: expected a JSON object, got {_json_type(obj)}")
    try:
        return parse(obj)
    except (TypeError, ValueError) as e:
        raise TaskError(f"{where}: {e}") from e


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def require_key(obj: dict[str, Any], key: str) -> Any:
    """``obj[key]``, or ``ValueError`` naming the missing key and the keys present."""
    if key not in obj:
        present = ", ".join(repr(k) for k in obj) or "none"
        raise ValueError(f"missing key {key!r} (keys present: {present})")
    return obj[key]


def parse_digits_record(obj: dict[str, Any]) -> tuple[list[float], int]:
    """Parse ``{"x": [64 numbers], "y": label 0..9}``; ``x`` uses load_digits' 0..16 scale."""
    x = require_key(obj, "x")
    y = require_key(obj, "y")
    if not isinstance(x, list):
        raise TypeError(f"'x' must be an array of 64 numbers, got {_json_type(x)}")
    if len(x) != 64:
        raise ValueError(f"'x' must have 64 numbers, got {len(x)}")
    for i, v in enumerate(x):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise TypeError(f"'x'[{i}] must be a finite number, got {v!r}")
    if isinstance(y, bool) or not isinstance(y, int):
        raise TypeError(f"'y' must be an integer label, got {y!r}")
    if not 0 <= y <= 9:
        raise ValueError(f"label 'y' = {y} out of range: must be in 0..9")
    return [float(v) for v in x], y


def parse_text_record(obj: dict[str, Any]) -> str:
    """Parse ``{"text": "..."}``."""
    text = require_key(obj, "text")
    if not isinstance(text, str):
        raise TypeError(f"'text' must be a string, got {_json_type(text)}")
    return text
