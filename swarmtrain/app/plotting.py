"""`swarmtrain plot`: PNG charts of a run log (see :mod:`swarmtrain.app.runlog`).

Up to five charts, each written only when the log has data for it:

* ``<stem>-loss.png`` — training loss over time;
* ``<stem>-heldout.png`` — every held-out metric (accuracy, loss...) over time;
* ``<stem>-throughput.png`` — samples/s over time, one line per worker for a coordinator;
* ``<stem>-bytes.png`` — bytes sent and received so far, in MB;
* ``<stem>-lr.png`` — the learning rate over time, when it changes (a warm-up or decay).

Membership changes (workers joining or leaving, peer epochs, broken rings) are drawn as
dotted vertical lines on the loss and throughput charts. Matplotlib draws off-screen (Agg),
so no display is needed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from swarmtrain.app.runlog import RunLogError, read_run_log
from swarmtrain.fsutil import FileWriteError, write_atomic

__all__ = ["plot_run_log"]

_MEMBERSHIP_EVENTS = frozenset({"joined", "left", "worker_refused", "epoch", "ring_broken",
                                "resumed_from_checkpoint"})
Series = tuple[list[float], list[float]]


def plot_run_log(path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Draw the charts of the run log at ``path`` into ``out_dir`` (default: its directory).

    Returns:
        The PNG files written, in the order listed in the module docstring.

    Raises:
        RunLogError: the log is missing, empty, not JSONL, or has no metrics to draw, or a
            chart cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    src = Path(path)
    records = read_run_log(src)
    out = Path(out_dir) if out_dir is not None else src.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunLogError(f"cannot create the output directory {out}: {exc}; choose another --out") from exc
    t0 = min(_number(r.get("time")) or math.inf for r in records)
    metrics = [r for r in records if r.get("kind") == "metrics"]
    span = max((_number(r.get("time")) or t0) - t0 for r in records)
    unit, scale = ("min", 60.0) if span > 600 else ("s", 1.0)

    def at(r: Mapping[str, Any]) -> float:
        return ((_number(r.get("time")) or t0) - t0) / scale

    marks = [at(r) for r in records if r.get("kind") == "event" and r.get("event") in _MEMBERSHIP_EVENTS]
    role = next((str(r["role"]) for r in metrics if "role" in r), src.stem)
    charts: list[tuple[str, str, str, dict[str, Series], bool]] = [
        ("loss", f"training loss ({role})", "loss", {"loss": _series(metrics, at, ("loss",))}, True),
        ("heldout", f"held-out metrics ({role})", "value", _eval_series(metrics, at), False),
        ("throughput", f"throughput ({role})", "samples/s", _throughput(metrics, at), True),
        ("bytes", f"traffic ({role})", "MB so far", _bytes(metrics, at), False),
        ("lr", f"learning rate ({role})", "learning rate",
         _changing(_series(metrics, at, ("learning_rate",))), True),
    ]
    written = []
    for name, title, ylabel, series, with_marks in charts:
        series = {label: s for label, s in series.items() if s[0]}
        if not series:
            continue
        target = out / f"{src.stem}-{name}.png"
        _draw(target, title, f"time ({unit})", ylabel, series, marks if with_marks else [])
        written.append(target)
    if not written:
        raise RunLogError(f"{src} has {len(records)} lines but no metrics to draw (no loss, held-out "
                          "metrics, samples/s or bytes); is the run still starting?")
    return written


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _series(records: Iterable[Mapping[str, Any]], at: Any, keys: tuple[str, ...]) -> Series:
    """(x, y) of the value found at the nested ``keys`` of each record that has a number there."""
    xs, ys = [], []
    for r in records:
        value: Any = r
        for k in keys:
            value = value.get(k) if isinstance(value, Mapping) else None
        y = _number(value)
        if y is not None:
            xs.append(at(r))
            ys.append(y)
    return xs, ys


def _changing(series: Series) -> dict[str, Series]:
    """The learning rate's series if it changes at all (a constant one is not worth a chart)."""
    return {"learning rate": series} if len(set(series[1])) > 1 else {}


def _eval_series(metrics: list[dict[str, Any]], at: Any) -> dict[str, Series]:
    names = sorted({k for r in metrics if isinstance(r.get("eval"), Mapping) for k in r["eval"]})
    return {name: _series(metrics, at, ("eval", name)) for name in names}


def _throughput(metrics: list[dict[str, Any]], at: Any) -> dict[str, Series]:
    workers = sorted({w for r in metrics if isinstance(r.get("workers"), Mapping) for w in r["workers"]})
    if workers:
        per = {w: _series(metrics, at, ("workers", w, "samples_per_sec")) for w in workers}
        return {**per, "total": _series(metrics, at, ("samples_per_sec",))} if len(workers) > 1 else per
    return {"samples/s": _series(metrics, at, ("samples_per_sec",))}


def _bytes(metrics: list[dict[str, Any]], at: Any) -> dict[str, Series]:
    labels = {"bytes_up": "up (gradients)", "bytes_down": "down (updates)",
              "bytes_sent": "sent", "bytes_received": "received"}
    found = {}
    for key, label in labels.items():
        xs, ys = _series(metrics, at, (key,))
        found[label] = (xs, [y / 1e6 for y in ys])
    return found


def _draw(target: Path, title: str, xlabel: str, ylabel: str, series: Mapping[str, Series],
          marks: list[float]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.4, marker="o" if len(xs) < 30 else None, markersize=3)
    for i, x in enumerate(marks):
        ax.axvline(x, color="0.6", linestyle=":", linewidth=1,
                   label="membership change" if i == 0 else None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1 or marks:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    try:
        write_atomic(target, lambda f: fig.savefig(f, format="png"))
    except FileWriteError as exc:
        raise RunLogError(f"{exc} with --out") from exc
