"""The long-run soak: a real coordinator and 3 real workers for 200,000 updates, checked for
refused gradients and lost workers, against a single-process loop at equal samples.

Why: the outlier screen once compared each gradient's norm with a running mean of *accepted*
norms; as digits converged that mean ratcheted down (1e-5 after ~58,000 updates) until
ordinary gradients were refused and every honest worker was disconnected. Short benchmarks
never see it. This one runs long enough to.

(a) swarmtrain: ``python -m swarmtrain coordinator`` (``--max-steps N``, ``--status-file``)
    and ``--workers`` ``python -m swarmtrain worker`` processes on 127.0.0.1 (1 torch thread
    each, the task's batch for digits, ``--textlm-batch`` for textlm), a random cluster
    secret in ``SWARMTRAIN_SECRET``. Every ``--poll`` seconds this script reads the
    coordinator's status file (no extra process competing for the CPU) and records the
    version, updates/s, held-out metrics, ``stats`` (``rejected`` = refused gradients),
    per-worker refusals, clips and connection, and the coordinator's events (``left``,
    ``worker_refused``).
(b) the reference: one process, the task's model and ``torch.optim.Adam`` at the task's
    learning rate, the same batch size, 1 torch thread, for as many samples as the swarm
    applied; held-out metrics at the same fractions of the run.

The verdict (in the report, not asserted as a test): every worker connected at the last
status before the end, no ``worker_refused`` event, no refused gradient.

Run: ``python benchmarks/bench_soak.py [--quick] [--updates 200000] [--textlm-updates 6000]
[--workers 3] [--tasks digits,textlm]``; about 12 + 13 minutes on the 2-core dev box in full
(``--quick``: under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _util import machine, md_table, report

from swarmtrain.tasks import Shard, load_task

HOST = "127.0.0.1"
#: task -> (eval interval s of the coordinator, metric reported: name, higher is better)
TASKS = {"digits": (2.0, ("accuracy", True)), "textlm": (15.0, ("bits_per_byte", False))}
QUICK = {"digits": 5000, "textlm": 200}


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet (it is replaced atomically once it is)
        return None
    return data if isinstance(data, dict) else None


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


# -------------------------------------------------------------------------------- (a) swarmtrain


def _worker_row(w: dict[str, Any]) -> dict[str, Any]:
    return {"id": w.get("id"), "connected": w.get("connected"), "steps": w.get("steps", 0),
            "samples": w.get("samples", 0), "rejected": w.get("rejected", 0),
            "clipped": w.get("clipped"), "stale": w.get("stale", 0),
            "last_refusal": w.get("last_refusal", "")}


def swarm_run(task: str, updates: int, workers: int, batch: int, poll_s: float, timeout_s: float,
              tmp: Path) -> dict[str, Any]:
    """Coordinator + ``workers`` workers as processes until ``updates`` updates are applied."""
    eval_s = TASKS[task][0]
    env = {**os.environ, "SWARMTRAIN_SECRET": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
    port_file, status_file = tmp / f"{task}.port", tmp / f"{task}.status.json"
    summary_file, clog = tmp / f"{task}.summary.json", tmp / f"{task}.coordinator.log"
    py = [sys.executable, "-m", "swarmtrain"]
    coord = subprocess.Popen(
        [*py, "coordinator", "--task", task, "--host", HOST, "--port", "0",
         "--port-file", str(port_file), "--status-file", str(status_file),
         "--summary-file", str(summary_file), "--min-workers", str(workers),
         "--max-steps", str(updates), "--checkpoint-interval", "0", "--eval-interval", str(eval_s),
         "--log-level", "warning", "--run-log", "none"],
        env=env, stdout=clog.open("wb"), stderr=subprocess.STDOUT, cwd=tmp)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    snapshots: list[dict[str, Any]] = []
    events: dict[tuple[Any, ...], dict[str, Any]] = {}
    last_running: dict[str, Any] | None = None
    t0 = time.monotonic()
    try:
        deadline = t0 + 60
        while not port_file.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start:\n{_tail(clog)}")
            time.sleep(0.05)
        port = port_file.read_text().strip()
        for i in range(workers):
            wid = f"soak{i}"
            procs[wid] = subprocess.Popen(
                [*py, "worker", "--task", task, "--host", HOST, "--port", port, "--threads", "1",
                 "--batch-size", str(batch), "--accumulation-steps", "1", "--worker-id", wid,
                 "--log-level", "warning", "--run-log", "none"],
                env=env, stdout=(tmp / f"{task}.{wid}.log").open("wb"), stderr=subprocess.STDOUT,
                cwd=tmp)
        deadline = t0 + timeout_s
        prev: dict[str, Any] | None = None
        while coord.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{task}: {updates} updates not reached in {timeout_s:.0f} s "
                                   f"(last status version {prev and prev.get('version')})")
            time.sleep(poll_s)
            st = _read_status(status_file)
            if st is None or (prev is not None and st.get("uptime_sec") == prev.get("uptime_sec")):
                continue
            for e in st.get("events", []):
                events[(e.get("time"), e.get("event"), e.get("worker"))] = e
            if not st.get("finished"):
                last_running = st
            rate = 0.0
            if prev is not None and st.get("uptime_sec", 0) > prev.get("uptime_sec", 0):
                rate = ((st.get("version", 0) - prev.get("version", 0))
                        / (st["uptime_sec"] - prev["uptime_sec"]))
            stats = st.get("stats", {})
            rows = [_worker_row(w) for w in st.get("workers", [])]
            snapshots.append({
                "wall_s": time.monotonic() - t0, "uptime_s": st.get("uptime_sec"),
                "version": st.get("version", 0), "updates_per_s": rate,
                "metrics": dict(st.get("metrics", {})), "loss_ema": st.get("loss"),
                "workers_connected": st.get("workers_connected"),
                "rejected": stats.get("rejected", 0),
                "clipped": stats.get("clipped", sum(r["clipped"] or 0 for r in rows)),
                "workers": rows})
            prev = st
            print(f"   {task} v{st.get('version', 0):>7} {rate:6.0f} upd/s "
                  f"{st.get('workers_connected')} connected, refused {stats.get('rejected', 0)}, "
                  f"clipped {snapshots[-1]['clipped']}, {dict(st.get('metrics', {}))}", flush=True)
        rc_c = coord.wait(timeout=10)
        rc_w = {wid: _stop(p, 120) for wid, p in procs.items()}
    finally:
        for p in (*procs.values(), coord):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    wall = time.monotonic() - t0
    final = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    if not final:
        raise RuntimeError(f"{task}: no summary written:\n{_tail(clog)}")
    for e in final.get("events", []):
        events[(e.get("time"), e.get("event"), e.get("worker"))] = e
    stats = final.get("stats", {})
    rows = [_worker_row(w) for w in final.get("workers", [])]
    ever = sorted(events.values(), key=lambda e: e.get("time") or 0)
    end = next((e.get("time") or 0 for e in ever if e.get("event") == "shutdown"), float("inf"))
    training = [x for x in snapshots
                if x["uptime_s"] is not None and 0 < x["version"] < updates]
    steady = ((training[-1]["version"] - training[0]["version"])
              / (training[-1]["uptime_s"] - training[0]["uptime_s"])
              if len(training) > 1 and training[-1]["uptime_s"] > training[0]["uptime_s"] else None)
    connected_at_end = [w.get("id") for w in (last_running or {}).get("workers", []) if w.get("connected")]
    return {
        "workers": workers, "batch_size": batch, "max_steps": updates, "wall_s": wall,
        "version": final.get("version"), "uptime_s": final.get("uptime_sec"),
        "updates_per_s": (final.get("version") or 0) / max(1e-9, final.get("uptime_sec") or wall),
        "samples": sum(r["samples"] for r in rows), "final_metrics": final.get("metrics", {}),
        "stats": stats, "rejected": stats.get("rejected", 0),
        "clipped": stats.get("clipped", sum(r["clipped"] or 0 for r in rows)),
        "clipped_reported": any(r["clipped"] is not None for r in rows) or "clipped" in stats,
        "per_worker": rows,
        "connected_at_last_status": connected_at_end,
        "last_status_version": (last_running or {}).get("version"),
        "all_connected_at_end": len(connected_at_end) == workers,
        "worker_refused_events": [e for e in ever if e.get("event") == "worker_refused"],
        "updates_per_s_training": steady,
        "left_events": [e for e in ever if e.get("event") == "left" and (e.get("time") or 0) < end],
        "joined_events": sum(1 for e in ever if e.get("event") == "joined"),
        "events_seen": len(ever),
        "exit_codes": {"coordinator": rc_c, **rc_w},
        "snapshots": snapshots,
        "coordinator_log_tail": _tail(clog, 10),
    }


# -------------------------------------------------------------------------------- (b) reference


def plain_run(task_name: str, batch: int, samples: int, points: int = 10) -> dict[str, Any]:
    """The loop a user writes without swarmtrain, for ``samples`` samples; metrics at
    ``points`` evenly spaced steps."""
    torch.set_num_threads(1)
    task = load_task(task_name)
    model = task.build_model(seed=0)
    data = task.load_data()
    shard = Shard(data.train, 0, 1, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=task.default_learning_rate)
    steps = max(1, samples // batch)
    marks = {max(1, round(steps * (k + 1) / points)) for k in range(points)}
    curve = []
    model.train()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        task.loss(model, shard.next_batch(batch)).backward()
        opt.step()
        if step in marks:
            curve.append({"step": step, "samples": step * batch, **task.evaluate(model, data)})
            model.train()
    wall = time.perf_counter() - t0
    return {"steps": steps, "samples": steps * batch, "lr": task.default_learning_rate,
            "wall_s": wall, "steps_per_s": steps / wall, "final_metrics": curve[-1], "curve": curve}


# -------------------------------------------------------------------------------- driver


def run(tasks: dict[str, int], workers: int, textlm_batch: int, poll_s: float, quick: bool
        ) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine(), "quick": quick, "tasks": {}}
    with tempfile.TemporaryDirectory(prefix="swarm-soak-") as d:
        for name, updates in tasks.items():
            batch = textlm_batch if name == "textlm" else load_task(name).default_batch_size
            print(f"-- {name}: {updates} updates, {workers} workers, batch {batch}", flush=True)
            swarm = swarm_run(name, updates, workers, batch, poll_s,
                              timeout_s=300 + updates / 5, tmp=Path(d))
            print(f"   swarm: {swarm['version']} updates in {swarm['wall_s']:.0f} s, refused "
                  f"{swarm['rejected']}, clipped {swarm['clipped']}, connected at end "
                  f"{swarm['connected_at_last_status']}", flush=True)
            plain = plain_run(name, batch, swarm["samples"])
            print(f"   plain: {plain['steps']} steps in {plain['wall_s']:.0f} s, "
                  f"{plain['final_metrics']}", flush=True)
            res["tasks"][name] = {"swarmtrain": swarm, "plain": plain}
    return res


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def findings(res: dict[str, Any]) -> list[str]:
    out = []
    for name, t in res["tasks"].items():
        s, p = t["swarmtrain"], t["plain"]
        metric, higher = TASKS[name][1]
        sm, pm = s["final_metrics"].get(metric), p["final_metrics"].get(metric)
        ok = s["all_connected_at_end"] and not s["worker_refused_events"]
        out.append(f"- **{name}: {'PASS' if ok else 'FAIL'}** — {len(s['connected_at_last_status'])}"
                   f"/{s['workers']} workers connected at the last status before the end (version "
                   f"{s['last_status_version']}), {len(s['worker_refused_events'])} disconnected for "
                   f"refused gradients, {len(s['left_events'])} `left` events before the shutdown, "
                   f"{s['joined_events']} `joined` events (of {s['events_seen']} events seen; the "
                   "status keeps the last 20).")
        refusals = ", ".join(f"{w['id']} {w['rejected']}" for w in s["per_worker"])
        out.append(f"- {name}: {s['rejected']} gradients refused ({refusals}), {s['clipped']} clipped"
                   + ("" if s["clipped_reported"] else " (the status reports no clip count)") + ".")
        first = next((e for e in s["worker_refused_events"]), None)
        if first is not None:
            out.append(f"- {name}: first disconnect: {first.get('worker')}: {first.get('reason')}")
        if sm is not None and pm is not None:
            better = (sm >= pm) if higher else (sm <= pm)
            out.append(f"- {name}: held-out {metric} {sm:.4g} (swarmtrain) vs {pm:.4g} (one process, "
                       f"Adam, {p['samples']} samples): swarmtrain is "
                       f"{'as good or better' if better else 'worse'}.")
    return out


def to_markdown(res: dict[str, Any]) -> str:
    rows = []
    for name, t in res["tasks"].items():
        s, p = t["swarmtrain"], t["plain"]
        metric = TASKS[name][1][0]
        rows.append([name, f"swarmtrain, {s['workers']} workers", s["version"], s["samples"],
                     s["wall_s"], s["updates_per_s_training"] or s["updates_per_s"],
                     _fmt(s["final_metrics"].get(metric)),
                     _fmt(s["final_metrics"].get("loss")), s["rejected"], s["clipped"],
                     f"{len(s['connected_at_last_status'])}/{s['workers']}",
                     len(s["worker_refused_events"])])
        rows.append([name, "one process, Adam", p["steps"], p["samples"], p["wall_s"],
                     p["steps_per_s"], _fmt(p["final_metrics"].get(metric)),
                     _fmt(p["final_metrics"].get("loss")), "-", "-", "-", "-"])
    curves = []
    for name, t in res["tasks"].items():
        s, p = t["swarmtrain"], t["plain"]
        metric = TASKS[name][1][0]
        snaps = [x for x in s["snapshots"] if x["metrics"]]
        step = max(1, len(snaps) // 8)
        for x in [*snaps[:-1:step], *snaps[-1:]]:
            frac = x["version"] / max(1, s["version"] or 1)
            ref = min(p["curve"], key=lambda c: abs(c["step"] / p["steps"] - frac))
            curves.append([name, x["version"], f"{x['wall_s']:.0f}", f"{x['updates_per_s']:.0f}",
                           _fmt(x["metrics"].get(metric)), _fmt(x["metrics"].get("loss")),
                           x["rejected"], x["clipped"], x["workers_connected"],
                           f"{ref['step']}: {_fmt(ref.get(metric))}"])
    m = res["machine"]
    return "\n".join([
        "## Long-run soak (`benchmarks/bench_soak.py`)" + (" — quick run" if res["quick"] else ""),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average at start "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg'])} (shared machine). swarmtrain: a "
        "coordinator and the workers as processes on 127.0.0.1 (1 torch thread each, "
        "compression none, default outlier screen), until `--max-steps` updates. Reference: one "
        "process, the task's model, `torch.optim.Adam` at the task's learning rate, the same "
        "batch, as many samples as the swarm applied. `refused` = the coordinator's "
        "`stats.rejected`; `clipped` = the sum of the workers' `clipped` (the outlier screen "
        "scaled the gradient down); `connected` = workers connected at the last status before "
        "the end. swarmtrain updates/s: between the first and last status samples of training "
        "(start-up excluded); metric over time: the latest evaluation at each status sample.",
        "",
        md_table(["task", "run", "updates", "samples", "wall s", "updates/s", "final metric",
                  "final loss", "refused", "clipped", "connected", "disconnects"], rows),
        "",
        "Over time (swarmtrain status samples; the reference at the same fraction of its run):",
        "",
        md_table(["task", "version", "wall s", "updates/s", "metric", "loss", "refused",
                  "clipped", "connected", "reference step: metric"], curves),
        "",
        "metric: held-out accuracy for digits, bits per byte for textlm.",
        "",
        "Findings:",
        "",
        *findings(res),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK['digits']} digits and {QUICK['textlm']} textlm updates")
    ap.add_argument("--updates", type=int, default=200_000, help="digits updates (default 200000)")
    ap.add_argument("--textlm-updates", type=int, default=6000, help="textlm updates (default 6000)")
    ap.add_argument("--textlm-batch", type=int, default=4, help="textlm batch per worker (default 4)")
    ap.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    ap.add_argument("--tasks", default="digits,textlm", help="comma-separated: digits,textlm")
    ap.add_argument("--poll", type=float, default=3.0, help="seconds between status reads")
    args = ap.parse_args(argv)
    counts = QUICK if args.quick else {"digits": args.updates, "textlm": args.textlm_updates}
    names = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    start = time.perf_counter()
    res = run({t: counts[t] for t in names}, args.workers, args.textlm_batch,
              args.poll / 3 if args.quick else args.poll, args.quick)
    res["seconds"] = time.perf_counter() - start
    res["argv"] = sys.argv[1:] if argv is None else argv
    report("soak", res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
