"""What a person sees: status tables, hardware profile, progress."""

from __future__ import annotations

import math
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["print_status", "print_pipeline_status", "print_profile", "format_metrics"]


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


def print_pipeline_status(statuses: list[list[dict[str, Any]]], console: Console | None = None) -> None:
    """Print one row per stage replica: layers, optimizer steps, micro-batches applied, forwards
    waiting for their backward, inbound queue (size/capacity, mean wait), outbound queue (size,
    and its pressure when not ok), refused requests and parameter-sync rounds (run+served)."""
    # Too narrow a table truncates every column (80 when not a terminal); a wide one at worst
    # wraps on a narrow terminal.
    console = console or Console(width=max(Console().width, 120))
    table = Table(title="pipeline stages", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("stage", "replica", "layers", "steps", "applied", "pending", "in", "wait ms", "out",
                "refused", "syncs"):
        table.add_column(col, justify="left" if col in ("replica", "out") else "right",
                         no_wrap=col in ("replica", "layers"))
    for i, replicas in enumerate(statuses):
        for s in replicas:
            if "error" in s:
                table.add_row(str(i), s["replica"], "[red]down[/]", *["-"] * 8)
                continue
            inb, out = s.get("inbound", {}), s.get("outbound", {})
            layers = s.get("layers", ["?", "?"])
            pressure = out.get("pressure", "ok")
            table.add_row(
                str(i), s["replica"], f"{layers[0]}:{layers[1]}", str(s.get("steps")),
                str(s.get("microbatches")), str(s.get("pending_forwards")),
                f"{inb.get('size', 0)}/{inb.get('capacity', 0)}", _num(inb.get("avg_wait_ms"), ".1f"),
                f"{out.get('size', 0)}" + ("" if pressure == "ok" else f" {pressure}"),
                str(s.get("refused")), f"{s.get('sync_rounds', 0)}+{s.get('sync_served', 0)}",
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
