"""What a person sees: status tables, hardware profile, progress."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_status", "print_profile", "format_metrics"]


def _num(v: Any, fmt: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt) if isinstance(v, (int, float)) else str(v)


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {_num(v)}" for k, v in metrics.items())


def print_status(status: dict[str, Any], console: Console | None = None) -> None:
    """Print a coordinator's status: step, loss, metrics, and the workers table."""
    console = console or Console()
    state = "finished" if status.get("finished") else "paused" if status.get("paused") else (
        "running" if status.get("running") else "waiting for workers")
    console.print(
        f"[bold]task[/] {status.get('task') or 'custom'}  [bold]state[/] {state}  "
        f"[bold]step[/] {status.get('step')}  [bold]version[/] {status.get('version')}  "
        f"[bold]loss[/] {_num(status.get('loss'))}  {format_metrics(status.get('metrics', {}))}"
    )
    stats = status.get("stats", {})
    console.print(f"applied {stats.get('applied', 0)}  stale-dropped {stats.get('stale', 0)}  "
                  f"duplicates {stats.get('duplicates', 0)}  rejected {stats.get('rejected', 0)}  "
                  f"workers {status.get('workers_connected', 0)} connected / "
                  f"min {status.get('min_workers')}")
    table = Table(title="workers")
    for col in ("id", "address", "profile", "shards", "batch", "steps", "share", "samples/s",
                "probe", "weight", "staleness", "up x", "down x", "last seen"):
        table.add_column(col, justify="right" if col not in ("id", "address", "profile") else "left")
    for w in status.get("workers", []):
        seen = "connected" if w.get("connected") else f"{w.get('last_seen_sec', 0):.0f} s ago"
        if w.get("connected"):
            seen = f"{w.get('last_seen_sec', 0):.1f} s ago"
        table.add_row(
            str(w.get("id")), str(w.get("address")), str(w.get("profile")),
            ",".join(str(s) for s in w.get("shards", [])), str(w.get("batch_size")), str(w.get("steps")),
            f"{100 * w.get('share', 0):.0f}%", _num(w.get("samples_per_sec"), ".0f"),
            _num(w.get("probe_samples_per_sec"), ".0f"), _num(w.get("weight"), ".2f"),
            _num(w.get("avg_staleness"), ".1f"), _num(w.get("up_ratio"), ".1f"),
            _num(w.get("down_ratio"), ".1f"), seen + ("" if w.get("connected") else " (gone)"),
        )
    console.print(table)


def print_profile(task_spec: str, probe_seconds: float, console: Console | None = None) -> None:
    """Detect the hardware, recommend settings for ``task_spec`` and probe its real speed."""
    import torch

    from swarmtrain import hardware
    from swarmtrain.tasks import Shard, load_task

    console = console or Console()
    info = hardware.detect()
    task = load_task(task_spec)
    rec = hardware.recommend(info, sample_bytes=task.sample_bytes_estimate())
    torch.set_num_threads(rec.num_threads)
    model = task.build_model(seed=0)
    data = task.load_data()
    shard = Shard(data.train, 0, 1)
    opt = torch.optim.Adam(model.parameters(), lr=task.default_learning_rate)

    def step() -> int:
        batch = shard.next_batch(rec.batch_size)
        opt.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        opt.step()
        return rec.batch_size

    started = time.perf_counter()
    speed = hardware.probe_speed(step, seconds=probe_seconds)
    table = Table(title=f"swarmtrain profile ({task.name})", show_header=False)
    for k, v in hardware.describe(info, rec):
        table.add_row(k, v)
    table.add_row("Probe", f"{speed:.0f} samples/s at batch {rec.batch_size} "
                           f"({time.perf_counter() - started:.1f} s)")
    console.print(table)
