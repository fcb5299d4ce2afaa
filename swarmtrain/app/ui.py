"""What a person sees: status tables, hardware profile, progress."""

from __future__ import annotations

import math
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["STALE_AFTER_SEC", "format_metrics", "print_pipeline_status", "print_profile", "print_status",
           "stale_note"]

STALE_AFTER_SEC = 5.0
"""A status file this much older than its ``time`` is stale: it is rewritten every second
(``--status-file``), so a few missed writes mean its writer has stopped."""


def _num(v: Any, fmt: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt) if isinstance(v, (int, float)) else str(v)


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {_num(v)}" for k, v in metrics.items())


_ESSENTIAL = ("id", "address", "profile", "steps", "last seen")
"""Worker columns always shown and never cut: long values fold onto a second line instead."""
_OPTIONAL = ("samples/s", "share", "staleness", "shards", "batch", "weight", "probe", "up x", "down x")
"""The other worker columns, most useful first: on a narrow console they are dropped from the end."""
_ORDER = ("id", "address", "profile", "shards", "batch", "steps", "share", "samples/s", "probe",
          "weight", "staleness", "up x", "down x", "last seen")
_LEFT = ("id", "address", "profile", "last seen")
_WIDE = 160
"""Console width when the output is not a terminal (a pipe or a file): room for every column."""


def stale_note(status: dict[str, Any], now: float, after: float = STALE_AFTER_SEC) -> str:
    """"" for a status written within ``after`` seconds before ``now`` (unix seconds) or
    of a finished run; else what to say: how long ago it was written and what to check (a
    status without ``time``, from before it was recorded, cannot tell)."""
    written = status.get("time")
    if not isinstance(written, (int, float)) or status.get("finished"):
        return ""
    age = now - written
    if age <= after:
        return ""
    return f"stale (last written {age:.0f} s ago; is the coordinator still running?)"


def _print_cluster(console: Console, cluster: dict[str, Any]) -> None:
    """A sharded cluster's parameter servers (the leader's status has a row for each)."""
    if not cluster:
        return
    console.print(f"[bold]parameter server[/] {cluster.get('shard')} of a sharded cluster "
                  f"(partition {cluster.get('partition')}, {cluster.get('group_tensors')} tensors, "
                  f"{_num(cluster.get('group_bytes', 0) / 1e6)} MB here)")
    rows = cluster.get("shards") or []
    if not rows:
        return
    table = Table(title="parameter servers", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("shard", "address", "state", "version", "workers", "applied", "loss", "verdicts"):
        table.add_column(col)
    for r in rows:
        if not r.get("reachable"):
            table.add_row(str(r.get("index")), str(r.get("address")),
                          f"[bold red]unreachable[/] {str(r.get('error', ''))[:60]}", "", "", "", "", "")
            continue
        table.add_row(str(r.get("shard") or r.get("index")), str(r.get("address")), str(r.get("state")),
                      str(r.get("version")), str(r.get("workers_connected")),
                      str((r.get("stats") or {}).get("applied", "")), _num(r.get("loss")),
                      _verdicts(r.get("verdicts")))
    console.print(table)


def _verdicts(v: dict[str, Any] | None) -> str:
    """A server's part in the leader's verdicts on gradients (roles/ps/cluster.py)."""
    if not v:
        return ""
    if "sent" in v:  # the leader
        return f"sends ({v.get('sent', 0)} sent, {v.get('dropped', 0)} dropped)"
    decided = f"{100 * v.get('followed_share', 0.0):.1f} % followed"
    if v.get("streams"):
        return f"follows ({decided})"
    return f"[yellow]decides alone[/] (no stream from the leader; {decided})"


def print_status(status: dict[str, Any], console: Console | None = None, *,
                 now: float | None = None) -> None:
    """Print a coordinator's status: step, loss, metrics, and the workers table.

    The id, address, profile, steps and last-seen columns are never cut. Other columns are
    left out, least useful first, until the table fits the console; a caption names them. If
    even the five essential columns do not fit, each worker gets a line of its own.

    Args:
        status: a coordinator's ``status()`` dict (as ``swarmtrain ctl status`` receives it).
        console: where to print; by default the terminal, or a wide console when the output
            is not a terminal, so that a pipe or a file gets every column.
        now: for a status read from a file, the time now (unix seconds): a status written
            more than :data:`STALE_AFTER_SEC` before it is shown as stale (:func:`stale_note`).
    """
    console = console or _default_console()
    state = "finished" if status.get("finished") else "paused" if status.get("paused") else (
        "running" if status.get("running") else "waiting for workers")
    stale = stale_note(status, now) if now is not None else ""
    if stale:
        state = f"[bold red]{stale}[/] (it said: {state})"
    # two losses: the running mean of what the workers report with their gradients, and the
    # held-out evaluation's (metrics) on the coordinator
    held_out = "  ".join(f"held-out {k} {_num(v)}" for k, v in status.get("metrics", {}).items())
    console.print(
        f"[bold]task[/] {status.get('task') or 'custom'}  [bold]state[/] {state}  "
        f"[bold]step[/] {status.get('step')}  [bold]version[/] {status.get('version')}  "
        f"[bold]loss[/] (EMA of workers' training loss) {_num(status.get('loss'))}  {held_out}"
    )
    stats = status.get("stats", {})
    console.print(f"applied {stats.get('applied', 0)}  stale-dropped {stats.get('stale', 0)}  "
                  f"duplicates {stats.get('duplicates', 0)}  rejected {stats.get('rejected', 0)}  "
                  f"workers {status.get('workers_connected', 0)} connected / "
                  f"min {status.get('min_workers')}")
    if refusals := status.get("refusals"):
        console.print("refused " + "  ".join(f"{reason} {n}" for reason, n in sorted(refusals.items())))
    _print_cluster(console, status.get("cluster") or {})
    # connected workers first; a gone one keeps its steps and share, not a speed or shards
    workers = sorted(status.get("workers", []), key=lambda w: not w.get("connected"))
    rows = [_worker_cells(w) for w in workers]
    if not rows:
        console.print("no workers have joined yet")
        return
    shown = list(_ESSENTIAL)
    if not _fits(console, _worker_table(shown, rows)):
        console.print("[bold]workers[/] (use a wider terminal or --json for the other columns)")
        for c in rows:
            console.print(Text(f"{c['id']}  {c['address']}", overflow="fold"))
            console.print(Text(f"    {c['profile']}  steps {c['steps']}  last seen {c['last seen']}",
                               overflow="fold"))
        return
    for col in _OPTIONAL:
        if not _fits(console, _worker_table([*shown, col], rows)):
            break
        shown.append(col)
    table = _worker_table(shown, rows)
    hidden = [c for c in _ORDER if c not in shown]
    if hidden:
        table.caption = f"not shown at this width: {', '.join(hidden)} (widen the terminal or use --json)"
    console.print(table)


def _default_console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, _WIDE))


def _worker_cells(w: dict[str, Any]) -> dict[str, str]:
    connected = bool(w.get("connected"))
    seen = w.get("last_seen_sec", 0)
    return {
        "id": str(w.get("id")), "address": str(w.get("address") or "-"),
        "profile": str(w.get("profile")), "steps": str(w.get("steps")),
        "last seen": f"{seen:.1f} s ago" if connected else f"{seen:.0f} s ago (gone)",
        "shards": (",".join(str(s) for s in w.get("shards", [])) or "-") if connected else "-",
        "batch": str(w.get("batch_size")), "share": f"{100 * w.get('share', 0):.0f}%",
        "samples/s": _num(w.get("samples_per_sec"), ".0f") if connected else "-",
        "probe": _num(w.get("probe_samples_per_sec"), ".0f") if connected else "-",
        "weight": _num(w.get("weight"), ".2f"),
        "staleness": _num(w.get("avg_staleness"), ".1f"), "up x": _num(w.get("up_ratio"), ".1f"),
        "down x": _num(w.get("down_ratio"), ".1f"),
    }


def _worker_table(columns: list[str], rows: list[dict[str, str]]) -> Table:
    table = Table(title="workers", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    shown = [c for c in _ORDER if c in columns]
    for col in shown:
        longest = max(len(col), *(len(r[col]) for r in rows))
        if col in _ESSENTIAL:  # folded rather than cut if it ever has to be narrower
            table.add_column(col, justify="left" if col in _LEFT else "right", min_width=longest,
                             overflow="fold")
        else:
            table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(r[c] for c in shown))
    return table


def _fits(console: Console, table: Table) -> bool:
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    return natural <= console.width


def print_pipeline_status(statuses: list[list[dict[str, Any]]], console: Console | None = None) -> None:
    """Print one row per stage replica: layers, optimizer steps, micro-batches applied, forwards
    waiting for their backward, inbound queue (size/capacity, mean wait), outbound queue (size,
    and its pressure when not ok), refused requests, parameter-sync rounds (run+served), the
    weights' fingerprint (its first 8 hex digits; replicas with equal ones hold the same
    weights) and where its state came from (seed, checkpoint, replica)."""
    # Too narrow a table truncates every column (80 when not a terminal); a wide one at worst
    # wraps on a narrow terminal.
    console = console or Console(width=max(Console().width, 120))
    table = Table(title="pipeline stages", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("stage", "replica", "layers", "steps", "applied", "pending", "in", "wait ms", "out",
                "refused", "syncs", "weights", "from"):
        table.add_column(col, justify="left" if col in ("replica", "out", "weights", "from") else "right",
                         no_wrap=col in ("replica", "layers", "weights"))
    for i, replicas in enumerate(statuses):
        for s in replicas:
            if "error" in s:
                table.add_row(str(i), s["replica"], "[red]down[/]", *["-"] * 10)
                continue
            origin = str(s.get("started_from", "-")).split(" ")[0]
            inb, out = s.get("inbound", {}), s.get("outbound", {})
            layers = s.get("layers", ["?", "?"])
            pressure = out.get("pressure", "ok")
            table.add_row(
                str(i), s["replica"], f"{layers[0]}:{layers[1]}", str(s.get("steps")),
                str(s.get("microbatches")), str(s.get("pending_forwards")),
                f"{inb.get('size', 0)}/{inb.get('capacity', 0)}", _num(inb.get("avg_wait_ms"), ".1f"),
                f"{out.get('size', 0)}" + ("" if pressure == "ok" else f" {pressure}"),
                str(s.get("refused")), f"{s.get('sync_rounds', 0)}+{s.get('sync_served', 0)}",
                str(s.get("fingerprint", "-"))[:8], origin,
            )
    console.print(table)


def print_profile(task_spec: str, probe_seconds: float, console: Console | None = None) -> None:
    """Detect the hardware, recommend settings for ``task_spec`` and probe its real speed."""
    import torch

    from swarmtrain.core import hardware
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
