"""The run log: one JSON object per line, metrics and events of a run, for `swarmtrain plot`.

Every line is ``{"time": <unix seconds>, "kind": "metrics" | "event", ...}``:

* ``metrics`` lines come at most once per ``min_interval`` seconds (1 s by default) unless
  forced (a held-out evaluation, the end of a run), so a week-long run grows its log by
  about 80,000 lines a day per node;
* ``event`` lines (``"event": "joined"``, ``"checkpoint"``, ``"shutdown"``...) are always
  written.

Each line is flushed as it is written, so a crash loses at most the line being written and
the log can be plotted while the run goes on. Non-finite floats are written as ``null``
(JSON has no NaN). A failing write (disk full) is logged once and turns the log off: the
run log never stops training.

Where it goes is the ``[logging] run_log`` setting: ``"auto"`` (the default) writes
``runs/<YYYYmmdd-HHMMSS>/<role>.jsonl`` under the working directory (or under
``$SWARMTRAIN_RUNS_DIR``), ``""`` or ``"none"`` writes none, anything else is the file's path.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from swarmtrain.errors import ConfigError, SwarmError

__all__ = [
    "RUNS_DIR_ENV_VAR",
    "RunLog",
    "RunLogError",
    "json_safe",
    "open_run_log",
    "read_run_log",
    "resolve_run_log_path",
    "safe_file_part",
]

log = logging.getLogger("swarmtrain.app.runlog")

RUNS_DIR_ENV_VAR = "SWARMTRAIN_RUNS_DIR"
_DISABLED = ("", "none")
_MAX_LINE_BYTES = 1 << 20  # a line longer than this is not a run log line (reading)


def is_disabled(setting: str) -> bool:
    """True for the settings that turn a file output off: ``""`` and ``"none"``."""
    return setting.strip().lower() in _DISABLED


class RunLogError(SwarmError):
    """A run log cannot be read: missing, empty, or not JSON lines."""


class RunLog:
    """Appends metrics and events to a JSONL file, one flushed line each. Thread-safe.

    Args:
        path: the file; its directory is created, an existing file is appended to.
        min_interval: seconds between unforced metrics lines.

    Raises:
        ConfigError: if the file cannot be created or opened for writing.
    """

    def __init__(self, path: str | os.PathLike[str], *, min_interval: float = 1.0) -> None:
        self.path = Path(path)
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._last_metrics = -math.inf
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"cannot write the run log {self.path}: {exc}; choose another path with --run-log "
                "PATH (or [logging] run_log), or turn it off with --run-log none") from exc

    @property
    def closed(self) -> bool:
        """True once closed (or turned off by a failed write)."""
        return self._file is None

    def event(self, event: str, **data: Any) -> None:
        """Write an event line ``{"time", "kind": "event", "event": event, **data}``."""
        self._write({"time": time.time(), "kind": "event", "event": event, **data})

    def metrics(self, *, force: bool = False, **data: Any) -> bool:
        """Write a metrics line unless one was written less than ``min_interval`` ago.

        Args:
            force: write even if the last line is recent (evaluations, the final line).
            **data: the values; nested dicts and lists are fine.

        Returns:
            True if the line was written.
        """
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_metrics < self.min_interval:
                return False
            self._last_metrics = now
        self._write({"time": time.time(), "kind": "metrics", **data})
        return True

    def close(self) -> None:
        """Close the file (later writes are ignored)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(json_safe(record), separators=(",", ":"))
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as exc:
                log.error("run log %s: write failed (%s); no more run log lines this run", self.path, exc)
                self._file.close()
                self._file = None


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None and tuples/sets as lists, so strict JSON
    (and a browser's ``JSON.parse``) accepts it; other odd types become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    return str(value)


def resolve_run_log_path(setting: str, file_name: str, *, now: float | None = None) -> Path | None:
    """Where a run log goes for the ``run_log`` setting.

    Args:
        setting: ``"auto"``, ``""``/``"none"`` (no run log), or a path.
        file_name: the file name used by ``"auto"``, e.g. ``"coordinator.jsonl"``.
        now: the run's start time for ``"auto"`` (default: now).

    Returns:
        The path, or None for no run log. ``"auto"`` gives
        ``<runs dir>/<YYYYmmdd-HHMMSS>/<file_name>`` (``-2``, ``-3``... added to the file
        name if it exists), the runs dir being ``$SWARMTRAIN_RUNS_DIR`` or ``./runs``.
    """
    if is_disabled(setting):
        return None
    if setting != "auto":
        return Path(setting)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    folder = Path(os.environ.get(RUNS_DIR_ENV_VAR) or "runs") / stamp
    path = folder / file_name
    stem, suffix = Path(file_name).stem, Path(file_name).suffix
    n = 2
    while path.exists():
        path = folder / f"{stem}-{n}{suffix}"
        n += 1
    return path


def safe_file_part(name: str) -> str:
    """``name`` with everything but letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``
    (a worker id or peer id made safe as part of a file name)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"


def open_run_log(setting: str, file_name: str) -> RunLog | None:
    """A :class:`RunLog` for the ``run_log`` setting (see :func:`resolve_run_log_path`), or None.

    Raises:
        ConfigError: if the file cannot be written.
    """
    path = resolve_run_log_path(setting, file_name)
    if path is None:
        return None
    run_log = RunLog(path)
    log.info("run log: %s", path)
    return run_log


def read_run_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a run log, in file order.

    A last line without its newline (a run that is still writing, or crashed mid-line) is
    ignored if it does not parse.

    Raises:
        RunLogError: the file is missing, unreadable, empty, or a line is not a JSON object
            with ``time`` and ``kind``; the message names the file and the line.
    """
    p = Path(path)
    expected = ('a JSONL run log written by swarmtrain (one JSON object per line, each with '
                '"time" and "kind"), e.g. runs/<date-time>/coordinator.jsonl')
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunLogError(f"{p} does not exist; expected {expected}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunLogError(f"cannot read {p} ({exc}); expected {expected}") from exc
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        unfinished = number == len(lines)  # the text did not end with a newline here
        try:
            if len(line) > _MAX_LINE_BYTES:
                raise ValueError(f"line is over {_MAX_LINE_BYTES} characters")
            record = json.loads(line)
        except ValueError as exc:
            if unfinished and records:
                break
            raise RunLogError(f"{p} line {number} is not JSON ({exc}); expected {expected}") from None
        if not isinstance(record, dict) or "time" not in record or "kind" not in record:
            raise RunLogError(f'{p} line {number} is not an object with "time" and "kind"; '
                              f"expected {expected}")
        records.append(record)
    if not records:
        raise RunLogError(f"{p} is empty; expected {expected}")
    return records
