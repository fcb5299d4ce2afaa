"""Gradient compression on slow links — measured on a simulated LAN (needs root).

A coordinator on host h0 (link unlimited) and 3 workers on h1..h3, each a network namespace
whose link is limited to 10 Mbit/s each way (``tc tbf``, :meth:`Host.set_rate`). For every
codec (rows: none, fp16, topk 1 %, topk 10 %, qsgd 8-bit, qsgd 4-bit; the downlink is the
config default ``auto``), one fresh cluster per task:

- ``digits``: every codec runs to the same number of applied updates (``DIGITS_STEPS``); the
  wall-clock time to the first held-out evaluation with accuracy >= 0.95 is read from the
  coordinator's evaluation log, and the accuracy at ``DIGITS_STEPS`` updates is the
  "equal steps" figure;
- ``textlm`` (the task's default 875k-parameter byte-level transformer): run until the first
  held-out evaluation with loss <= ``TEXTLM_TARGET`` nats/byte, or ``TEXTLM_CAP_S`` seconds;
  the loss at an equal number of updates is interpolated along each trajectory.

Bytes per step each way and the compression ratios come from the coordinator's status; the
CPU time of the four processes (``/proc/<pid>/stat``) and the link occupancy tell whether a
run was wire-bound or CPU-bound (this machine has 2 cores for 4 processes). The bar from the
issue — ``topk`` 1 % reaches the target at least 5x sooner than ``none`` with final accuracy
within 1 point — is printed as PASS/FAIL with its numbers.

Run: ``python benchmarks/bench_compression.py [--quick] [--tasks digits,textlm]`` (as root;
~15 min in full, ~4 min with --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _util import RESULTS, compression_toml, machine, md_table, write_results

from swarmtrain.config import CompressionConfig
from swarmtrain.roles.ps.common import downlink_codec
from swarmtrain.testing import SimulatedLAN, netns_available
from swarmtrain.testing.cluster import COORDINATOR_TOML, WORKER_TOML, LanCluster

# ---------------------------------------------------------------- fixed before the measured runs
# Chosen from single-process plain-Adam pilots (1 thread, the task's lr) and from calibration
# runs of the `none` baseline alone, never from the results of a compressed codec:
# - digits, batch 32: plain Adam first shows >= 0.95 held-out accuracy after ~200 steps. On
#   the LAN, `none` alone (3 async workers, average staleness ~5, so Adam's lr is damped ~5x)
#   first showed >= 0.95 after 645 updates (20 s) and levelled off at 0.97-0.98 from ~1700.
#   Every codec runs DIGITS_STEPS = 2000 updates; its accuracy there is the equal-steps figure.
# - textlm, batch 16 (the task's default): plain Adam reaches a held-out loss of 3.0 nats/byte
#   (4.33 bits/byte; a unigram byte model of the corpus scores 3.29, a bigram one 2.44) after
#   ~50 steps. On the LAN, `none` alone manages 0.5 updates/s (3.5 MB each way per step) and
#   was at 3.54 after 120 updates / 240 s. The target stays 3.0 (a loss above the unigram
#   figure would only show that byte frequencies were learned). In the run published on
#   2026-11-29 the cap was 200 s and `none` missed the target (only 4-bit QSGD reached it, after
#   466 updates); the cap is now 1500 s so that `none` reaches the target and the ratio is a
#   measured one (~1000 s for `none` at 0.5 updates/s; a full run takes ~50 minutes). Where
#   `none` still misses it, the report keeps the same-loss column (time to the best loss
#   `none` reached within the cap).
# - TOPK_WARMUP was 50 in the first published run (top-k 1 % then needed ~1100 updates to
#   0.95 against ~650 for none). Changed to 200 after that run, from a single-process
#   simulation of 3 workers at staleness 5 (updates to 0.95: warm-up 50 -> 1020, 100 -> 980,
#   150 -> 900, 200 -> 750, 300 -> 710; none 760): Deep Gradient Compression's recipe warms
#   up over the first epochs, and 200 steps per worker is ~4 epochs of a worker's shard here.
# - TOPK_WARMUP for textlm was the same 200 steps in the 2026-11-29 run: more steps than a
#   worker takes to the target (4-bit QSGD got there after ~155 steps per worker), so top-k
#   spent the whole run warming up, sending near-dense gradients with indices (its uplink
#   averaged 5.2:1). textlm's epochs are thousands of steps, so "a few epochs" gives no length;
#   the warm-up is set to ~1/8 of the steps per worker the fastest codec needed in that run
#   (155 / 8 ~ 20), fixed before any top-k textlm run with it.
# - TOPK_WARMUP for digits re-checked after the coordinator began holding Adam's second moment
#   for top-k gradients (2026-11-30), on loopback (3 workers, 3 runs each, to 2500 updates):
#   updates to 0.95 with warm-up 32 -> 1162-1466, 100 -> 1057-1594, 200 -> 830-1095; mean
#   accuracy over updates 1500-2600: 0.964 / 0.970 / 0.981. 200 stays.
RATE_MBIT = 10.0
LINK_BYTES_PER_S = RATE_MBIT * 1e6 / 8  # 1.25 MB/s each way per worker link
TBF_BURST = max(int(LINK_BYTES_PER_S / 100), 16 * 1024)  # as swarmtrain.testing.lan._tbf_args
WORKERS = 3
DIGITS_TARGET = 0.95  # held-out accuracy
DIGITS_STEPS = 2000  # applied updates every codec runs ("equal steps")
DIGITS_CAP_S = 150.0  # wall-clock cap of one digits run (from the start of training)
DIGITS_EVAL_S = 0.25  # coordinator --eval-interval (an evaluation costs ~1 ms)
DIGITS_BATCH = 32
TEXTLM_TARGET = 3.0  # held-out loss, nats per byte
TEXTLM_CAP_S = 1500.0  # wall-clock cap of one textlm run (none needs ~1000 s to the target)
TEXTLM_EVAL_S = 4.0  # an evaluation costs ~1 core-second here; every 4 s is ~20 % of a core
TEXTLM_BATCH = 16
#: [compression] warmup_steps for the topk rows (per worker, dense -> ratio), per task
TOPK_WARMUP = {"digits": 200, "textlm": 20}

#: label -> [compression] keys (written to both the coordinator's and the workers' TOML)
CODECS: dict[str, dict[str, Any]] = {
    "none": {"type": "none"},
    "fp16": {"type": "fp16"},
    "topk 1%": {"type": "topk", "topk_ratio": 0.01},
    "topk 10%": {"type": "topk", "topk_ratio": 0.1},
    "qsgd 8-bit": {"type": "qsgd", "qsgd_bits": 8},
    "qsgd 4-bit": {"type": "qsgd", "qsgd_bits": 4},
}
QUICK_CODECS = ("none", "topk 1%")
QUICK = {"digits_steps": 400, "digits_cap": 60.0, "textlm_cap": 60.0}


def _print_run(r: dict[str, Any]) -> None:
    final = f", final {r['metric']} {r['final_metric']:.4f}" if r.get("final_metric") is not None else ""
    print(f"   target: {fmt_time(r)}, {r['updates']} updates, {r['updates_per_s']:.1f} upd/s, "
          f"up {fmt_bytes(r['bytes_up_per_step'])} down {fmt_bytes(r['bytes_down_per_step'])}, "
          f"cores busy {r['cores_busy']:.2f}, links {r['link_busy_up']:.0%}/{r['link_busy_down']:.0%}{final}",
          flush=True)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time to the target (a run that missed it counts as slowest),
    carrying every run's time to the target in ``times_s``."""
    def time_of(r: dict[str, Any]) -> float:
        return r["reached"]["time_s"] if r["reached"] else math.inf
    ordered = sorted(runs, key=time_of)
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["times_s"] = [None if math.isinf(time_of(r)) else time_of(r) for r in runs]
    return mid


def codec_keys(label: str, task: str) -> dict[str, Any]:
    """The [compression] keys of one row for one task (top-k rows get the task's warm-up)."""
    keys = dict(CODECS[label])
    if keys["type"] == "topk":
        keys["warmup_steps"] = TOPK_WARMUP[task]
    return keys

CLK_TCK = os.sysconf("SC_CLK_TCK")
POLL_S = 0.2


# ---------------------------------------------------------------- helpers


def downlink_name(keys: dict[str, Any]) -> str:
    """What the default downlink (``auto``) resolves to for these [compression] keys."""
    codec = downlink_codec(CompressionConfig(**keys))
    inner = getattr(codec, "large", codec)  # SizeAdaptive wraps the real codec
    if inner.name == "qsgd":
        return f"qsgd {inner.bits}-bit"  # type: ignore[attr-defined]
    if inner.name == "topk":
        return f"topk {inner.ratio:g}"  # type: ignore[attr-defined]
    return str(inner.name)


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), seconds; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / CLK_TCK, sum(vals[:8]) / CLK_TCK


class LogReader:
    """Follow the coordinator's ``--log-json`` output: training start and evaluations."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.buf = path, 0, b""
        self.start: float | None = None
        self.evals: list[dict[str, Any]] = []  # {"time", "version", metric: value}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        lines = (self.buf + data).split(b"\n")
        self.buf = lines.pop()
        for raw in lines:
            try:
                rec = json.loads(raw)
                msg = rec["message"]
            except (ValueError, KeyError, TypeError):
                continue
            if self.start is None and "connected: starting training" in msg:
                self.start = float(rec["time"])
            elif msg.startswith("version ") and ":" in msg:
                head, tail = msg.split(":", 1)
                point: dict[str, Any] = {"time": float(rec["time"]), "version": int(head.split()[1])}
                for part in tail.split(","):
                    k, _, v = part.strip().partition(" ")
                    point[k] = float(v)
                self.evals.append(point)


def _first_reaching(evals: list[dict[str, Any]], metric: str, target: float, higher: bool,
                    t0: float) -> dict[str, Any] | None:
    for e in evals:
        if (e[metric] >= target) if higher else (e[metric] <= target):
            return {"time_s": e["time"] - t0, "version": e["version"], "value": e[metric]}
    return None


def interpolate(traj: list[dict[str, Any]], metric: str, version: float) -> float | None:
    """The metric at ``version`` updates, linear between the two evaluations around it."""
    pts = sorted((e["version"], e[metric]) for e in traj)
    for (v0, m0), (v1, m1) in zip(pts, pts[1:]):
        if v0 <= version <= v1:
            return m0 if v1 == v0 else m0 + (m1 - m0) * (version - v0) / (v1 - v0)
    return None


def wire_limit(up: float, down: float) -> float:
    """Most updates/s the links allow: with max_inflight 1 a worker sends its next gradient only
    once the answer to the previous one has arrived, so its two transfers never overlap; a
    transfer after an idle gap may start with a full tbf bucket (TBF_BURST bytes at once), and
    over a whole cycle neither direction can move more than the rate."""
    cycle = max((max(0.0, up - TBF_BURST) + max(0.0, down - TBF_BURST)) / LINK_BYTES_PER_S,
                up / LINK_BYTES_PER_S, down / LINK_BYTES_PER_S)
    return WORKERS / cycle if cycle > 0 else math.inf


# ---------------------------------------------------------------- one run


def run_one(task: str, label: str, keys: dict[str, Any], *, max_steps: int, cap_s: float,
            stop_at_target: bool, tmp: Path) -> dict[str, Any]:
    """One fresh LAN and cluster; returns the trajectory, bytes, CPU and timing of the run."""
    metric, target, higher = (("accuracy", DIGITS_TARGET, True) if task == "digits"
                              else ("loss", TEXTLM_TARGET, False))
    eval_s = DIGITS_EVAL_S if task == "digits" else TEXTLM_EVAL_S
    batch = DIGITS_BATCH if task == "digits" else TEXTLM_BATCH
    with SimulatedLAN(1 + WORKERS) as lan:
        for host in lan.hosts[1:]:
            host.set_rate(RATE_MBIT)
        c = LanCluster(lan, tmp)
        # Composition: the same [compression] keys for both sides (else the worker is refused).
        (tmp / "coordinator.toml").write_text(COORDINATOR_TOML + compression_toml(keys))
        (tmp / "worker.toml").write_text(WORKER_TOML + compression_toml(keys))
        # Four single-threaded processes on 2 cores: no intra-op thread pool oversubscribing.
        c.env["OMP_NUM_THREADS"] = "1"
        log = LogReader(tmp / "coordinator.log")
        try:
            c.start_coordinator("--task", task, "--min-workers", str(WORKERS), "--eval-interval",
                                str(eval_s), "--checkpoint-interval", "0", "--log-json",
                                *(["--max-steps", str(max_steps)] if max_steps else []))
            for i in range(1, WORKERS + 1):
                c.start_worker(i, f"w{i}", "--task", task, "--batch-size", str(batch),
                               "--accumulation-steps", "1")
            deadline = time.monotonic() + 180
            while log.start is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"training did not start within 180 s\n{c.logs()}")
                if c.procs["coordinator"].poll() is not None:
                    raise AssertionError(f"coordinator exited before training started\n{c.logs()}")
                time.sleep(POLL_S)
                log.poll()
            t0 = log.start
            pids = {n: p.pid for n, p in c.procs.items()}
            cpu0 = {n: proc_cpu_s(pid) or 0.0 for n, pid in pids.items()}
            mach0, cpu_last, mach_last, t_last = machine_busy_s(), dict(cpu0), machine_busy_s(), time.time()
            status: dict[str, Any] | None = None
            reached = None
            ended = "cap"
            while time.time() - t0 < cap_s:
                time.sleep(POLL_S)
                log.poll()
                now = {n: proc_cpu_s(pid) for n, pid in pids.items()}
                if all(v is not None for v in now.values()):
                    cpu_last, mach_last, t_last = dict(now), machine_busy_s(), time.time()  # type: ignore[arg-type]
                status = c.status() or status
                reached = _first_reaching(log.evals, metric, target, higher, t0)
                if stop_at_target and reached is not None:
                    ended = "target"
                    break
                if c.procs["coordinator"].poll() is not None:
                    ended = "max_steps"
                    break
            if ended == "max_steps":
                log.poll()
                status = c.status() or status  # the final status, written at exit
                for p in c.procs.values():
                    try:
                        p.wait(timeout=15)
                    except Exception:  # noqa: BLE001 - a worker slow to exit is killed below
                        pass
            reached = _first_reaching(log.evals, metric, target, higher, t0)
        finally:
            c.stop_all()
    assert status is not None
    wall = t_last - t0
    cpu = {n: cpu_last[n] - cpu0[n] for n in pids}
    rows = [w for w in status["workers"] if w["id"].startswith("w")]
    grads = [w["steps"] + w["stale"] + w["rejected"] for w in rows]
    mean = lambda key: sum(w[key] for w in rows) / len(rows)  # noqa: E731
    up, down = mean("bytes_up_per_step"), mean("bytes_down_per_step")
    version = status["version"]
    final_eval = log.evals[-1] if log.evals else None
    t_end = (final_eval["time"] if ended == "max_steps" and final_eval else t_last) - t0
    out = {
        "task": task, "codec": label, "compression": keys, "downlink": downlink_name(keys),
        "ended": ended, "cap_s": cap_s, "max_steps": max_steps, "metric": metric, "target": target,
        "reached": reached, "updates": version, "duration_s": t_end,
        "updates_per_s": version / t_end if t_end > 0 else 0.0,
        "bytes_up_per_step": up, "bytes_down_per_step": down,
        "raw_bytes_per_step": status["raw_bytes_per_step"],
        "up_ratio": mean("up_ratio"), "down_ratio": mean("down_ratio"),
        "wire_s_up": up / LINK_BYTES_PER_S, "wire_s_down": down / LINK_BYTES_PER_S,
        "wire_limit_updates_per_s": wire_limit(up, down),
        "link_busy_up": sum(up * g for g in grads) / len(rows) / LINK_BYTES_PER_S / wall,
        "link_busy_down": sum(down * g for g in grads) / len(rows) / LINK_BYTES_PER_S / wall,
        "cpu_s": cpu, "cpu_window_s": wall,
        "cores_busy": sum(cpu.values()) / wall,
        "machine_cores_busy": (mach_last[0] - mach0[0]) / wall,
        "resyncs": sum(w["resyncs"] for w in rows), "stale": sum(w["stale"] for w in rows),
        "final": final_eval, "trajectory": [{**e, "time": e["time"] - t0} for e in log.evals],
        "workers": [{k: w[k] for k in ("id", "steps", "samples", "stale", "rejected", "resyncs",
                                        "bytes_up_per_step", "bytes_down_per_step", "drift",
                                        "avg_staleness")} for w in rows],
    }
    if final_eval is not None and max_steps:
        tail = [e[metric] for e in log.evals if e["version"] >= 0.9 * max_steps]
        out["final_metric"] = final_eval[metric]
        out["final_version"] = final_eval["version"]
        out["last10pct_mean"] = sum(tail) / len(tail) if tail else None
        out["last10pct_evals"] = len(tail)
    return out


# ---------------------------------------------------------------- report


def fmt_bytes(b: float) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB"


def fmt_time(r: dict[str, Any]) -> str:
    return f"{r['reached']['time_s']:.1f} s" if r["reached"] else f"not reached in {r['duration_s']:.0f} s"


def speedup(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    if base is None:
        return "–"
    if r["reached"] and base["reached"]:
        return f"{base['reached']['time_s'] / r['reached']['time_s']:.2f}×"
    if r["reached"]:
        return f"> {base['duration_s'] / r['reached']['time_s']:.1f}×"
    return "–"


def bytes_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        rows.append([
            r["codec"], r["downlink"], fmt_bytes(r["bytes_up_per_step"]), f"{r['up_ratio']:.1f}×",
            fmt_bytes(r["bytes_down_per_step"]), f"{r['down_ratio']:.1f}×",
            f"{r['wire_s_up'] * 1e3:.0f} + {r['wire_s_down'] * 1e3:.0f}",
            f"{r['wire_limit_updates_per_s']:.1f}", f"{r['updates_per_s']:.1f}",
            f"{r['link_busy_up']:.0%} / {r['link_busy_down']:.0%}",
            f"{r['cores_busy']:.2f} ({r['cpu_s']['coordinator'] / r['cpu_window_s']:.2f})",
            f"{r['machine_cores_busy']:.2f}", r["resyncs"],
        ])
    return md_table(["codec", "downlink (auto)", "up/step", "up ratio", "down/step", "down ratio",
                     "wire ms/step up + down", "wire limit upd/s", "achieved upd/s",
                     "link busy up / down", "cores busy: ours (coord.)", "machine cores busy",
                     "full resyncs"], rows)


def digits_table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["codec"] == "none"), None)
    rows = []
    for r in results:
        acc_n = r.get("final_metric")
        tail = r.get("last10pct_mean")
        d_n = (acc_n - base["final_metric"]) * 100 if base and acc_n is not None else None
        d_t = (tail - base["last10pct_mean"]) * 100 if base and tail is not None and base.get(
            "last10pct_mean") is not None else None
        times = r.get("times_s") or []
        each = ", ".join("–" if t is None else f"{t:.1f}" for t in times) if len(times) > 1 else "–"
        rows.append([
            r["codec"], fmt_time(r), each, speedup(r, base), r["reached"]["version"] if r["reached"] else "–",
            f"{acc_n:.4f} @ {r.get('final_version', '?')}" if acc_n is not None else "–",
            f"{d_n:+.2f}" if d_n is not None else "–",
            f"{tail:.4f}" if tail is not None else "–", f"{d_t:+.2f}" if d_t is not None else "–",
            f"{r['duration_s']:.1f}",
        ])
    return md_table(["codec", f"time to {DIGITS_TARGET} (s; median run)", "each run (s)", "sooner than none",
                     "updates at target", f"accuracy at {results[0]['max_steps']} updates",
                     "Δ vs none (points)", "mean accuracy, last 10 % of updates", "Δ (points)",
                     "run time (s)"], rows)


def add_matched_loss(results: list[dict[str, Any]]) -> float | None:
    """Give every textlm run the time to the best loss `none` reached (a measured ratio even
    when `none` misses the target within the cap); returns that loss."""
    base = next((r for r in results if r["codec"] == "none" and r["trajectory"]), None)
    if base is None:
        return None
    best = min(e["loss"] for e in base["trajectory"])
    for r in results:
        hit = next((e for e in r["trajectory"] if e["loss"] <= best), None)
        r["matched"] = {"loss": best, "time_s": hit["time"], "version": hit["version"]} if hit else None
    return best


def textlm_table(results: list[dict[str, Any]]) -> tuple[str, int]:
    base = next((r for r in results if r["codec"] == "none"), None)
    best = add_matched_loss(results)
    equal = min(r["trajectory"][-1]["version"] for r in results if r["trajectory"])
    rows = []
    for r in results:
        at_eq = interpolate(r["trajectory"], "loss", equal)
        r["loss_at_equal_updates"] = at_eq
        m, bm = r.get("matched"), base.get("matched") if base else None
        rows.append([  # one run per codec: no "each run" column
            r["codec"], fmt_time(r), speedup(r, base), r["reached"]["version"] if r["reached"] else "–",
            f"{r['reached']['value']:.3f}" if r["reached"] else f"{r['trajectory'][-1]['loss']:.3f} (last)",
            f"{m['time_s']:.1f} s ({m['version']} upd.)" if m else "not reached",
            f"{bm['time_s'] / m['time_s']:.2f}×" if m and bm else "–",
            f"{at_eq:.3f}" if at_eq is not None else "–", f"{r['updates_per_s']:.2f}",
        ])
    return md_table(["codec", f"time to loss {TEXTLM_TARGET}", "sooner than none",
                     "updates at target", "loss seen (at target, else last)",
                     f"time to none's best loss ({best:.3f})" if best is not None else "time to none's best",
                     "sooner than none (same loss)", f"loss at {equal} updates (interpolated)",
                     "upd/s"], rows), equal


def bar_check(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    checks = []
    for task, rs in results.items():
        by = {r["codec"]: r for r in rs}
        none, top = by.get("none"), by.get("topk 1%")
        if none is None or top is None:
            continue
        if top["reached"] and none["reached"]:
            ratio = none["reached"]["time_s"] / top["reached"]["time_s"]
            ok = ratio >= 5.0
            text = (f"{task}: topk 1% reached the target in {top['reached']['time_s']:.1f} s, none in "
                    f"{none['reached']['time_s']:.1f} s: {ratio:.2f}× sooner (bar ≥ 5×)")
        elif top["reached"]:
            ratio = none["duration_s"] / top["reached"]["time_s"]
            ok = ratio >= 5.0
            text = (f"{task}: topk 1% reached the target in {top['reached']['time_s']:.1f} s, none not in "
                    f"{none['duration_s']:.0f} s: > {ratio:.2f}× sooner (bar ≥ 5×)")
        else:
            ratio, ok = 0.0, False
            text = f"{task}: topk 1% did not reach the target in {top['duration_s']:.0f} s"
        checks.append({"check": f"{task} time", "pass": ok, "ratio": ratio, "text": text})
        if task == "textlm" and not none["reached"]:
            add_matched_loss(rs)
            m, bm = top.get("matched"), none.get("matched")
            if m and bm:
                checks.append({"check": "textlm same-loss time (information)", "pass": None,
                               "ratio": bm["time_s"] / m["time_s"],
                               "text": (f"textlm, for information: to none's best loss in the cap "
                                        f"({bm['loss']:.3f}), topk 1% took {m['time_s']:.1f} s, none "
                                        f"{bm['time_s']:.1f} s: {bm['time_s'] / m['time_s']:.2f}× sooner")})
        if task == "digits" and top.get("final_metric") is not None and none.get("final_metric") is not None:
            for key, what in (("final_metric", f"at {top['max_steps']} updates"),
                              ("last10pct_mean", "mean over the last 10 % of updates")):
                if top.get(key) is None or none.get(key) is None:
                    continue
                d = (top[key] - none[key]) * 100
                checks.append({
                    "check": f"digits accuracy {key}", "pass": d >= -1.0, "delta_points": d,
                    "text": (f"digits accuracy {what}: topk 1% {top[key]:.4f}, none {none[key]:.4f} "
                             f"({d:+.2f} points; bar: no more than 1 point below)")})
    return checks


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    tasks = list(results)
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 9), squeeze=False)
    colors = dict(zip(CODECS, ["black", "tab:blue", "tab:red", "tab:orange", "tab:green", "tab:purple"]))
    for col, task in enumerate(tasks):
        metric = "accuracy" if task == "digits" else "loss"
        target = DIGITS_TARGET if task == "digits" else TEXTLM_TARGET
        for row, xkey in enumerate(("time", "version")):
            ax = axes[row][col]
            for r in results[task]:
                traj = r["trajectory"]
                if not traj:
                    continue
                ax.plot([e[xkey] for e in traj], [e[metric] for e in traj], lw=1.3,
                        color=colors.get(r["codec"]), label=r["codec"])
                if r["reached"] and xkey == "time":
                    ax.plot([r["reached"]["time_s"]], [r["reached"]["value"]], "o", ms=7, mec="black",
                            mew=0.8, color=colors.get(r["codec"]), zorder=5)
            ax.axhline(target, color="gray", ls="--", lw=1)
            ax.annotate(f"target {target}", (0.01, target), xycoords=("axes fraction", "data"),
                        va="bottom", ha="left", color="dimgray", fontsize=9)
            if xkey == "time":
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.set_xlabel("wall-clock seconds since training started (log scale)")
            else:
                ax.set_xlabel("applied updates")
            if task == "digits":
                ax.set_ylim(0.70, 1.0)
                ax.set_ylabel("held-out accuracy")
            else:
                ax.set_ylim(2.3, 5.0)
                ax.set_ylabel("held-out loss (nats/byte)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right" if task == "digits" else "upper right")
            against = "wall time" if xkey == "time" else "updates"
            ax.set_title(f"{task}: 3 workers on 10 Mbit/s links — against {against}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _warmup(constants: dict[str, Any], task: str) -> int:
    """The top-k warm-up of a saved run (one number for every task before 2026-11-30)."""
    w = constants["topk_warmup_steps"]
    return int(w[task] if isinstance(w, dict) else w)


def markdown(data: dict[str, Any]) -> str:
    """The report: bar check, tables, plot reference and how it was measured."""
    results, checks, k = data["results"], data["bar"], data["constants"]
    digits_steps, textlm_cap = k["digits_steps"], k["textlm_cap_s"]
    load = (f" {data['loadavg_start'][0]:.2f} at the start," if "loadavg_start" in data else "")
    load += f" {data['machine']['loadavg'][0]:.2f} at the end; other jobs share this machine"
    md = ["## Compression on 10 Mbit/s links (`benchmarks/bench_compression.py`)", "",
          f"Coordinator on h0 (unlimited link), {WORKERS} workers on h1–h3 whose links are limited to "
          f"{RATE_MBIT:g} Mbit/s each way (= {LINK_BYTES_PER_S / 1e6:.2f} MB/s; `tc tbf` on a simulated "
          f"LAN of network namespaces). One fresh cluster per codec and task; downlink = the default "
          f"`auto`. Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores for all four "
          f"processes (1-minute load average{load}).", ""]
    for task, date in data.get("kept", {}).items():
        md += [f"**{task}** rows: from the run of {date} (kept with `--keep`; this run measured "
               f"the other task only).", ""]
    for task, rows in data.get("kept_rows", {}).items():
        by_date: dict[str, list[str]] = {}
        for codec, date in rows.items():
            by_date.setdefault(date, []).append(codec)
        md += [f"**{task}**: the rows of " + "; ".join(
            f"{', '.join(codecs)} are from the run of {date}" for date, codecs in by_date.items())
            + " (kept with `--keep`: this run re-measured the other codecs only).", ""]
    if data["quick"]:
        md += ["**--quick run** (fewer codecs, shorter runs): not the figures to quote.", ""]
    md += ["**The bar** (topk 1 % reaches the target ≥ 5× sooner than none, final accuracy within 1 "
           "point):", ""]
    md += [f"- **{ {True: 'PASS', False: 'FAIL', None: 'info'}[c['pass']] }** — {c['text']}"
           for c in checks] or ["- not run"]
    md.append("")
    if "digits" in results:
        md += [f"### digits (MLP, {results['digits'][0]['raw_bytes_per_step'] / 4:.0f} parameters, "
               f"{fmt_bytes(results['digits'][0]['raw_bytes_per_step'])} per dense fp32 step), "
               f"batch {DIGITS_BATCH}, to {digits_steps} updates; top-k warm-up "
               f"{_warmup(k, 'digits')} steps per worker", "",
               digits_table(results["digits"]), "", bytes_table(results["digits"]), ""]
    if "textlm" in results:
        table, equal = textlm_table(results["textlm"])
        md += [f"### textlm (default byte-level transformer, "
               f"{results['textlm'][0]['raw_bytes_per_step'] / 4:.0f} parameters, "
               f"{fmt_bytes(results['textlm'][0]['raw_bytes_per_step'])} per dense fp32 step), batch "
               f"{TEXTLM_BATCH}, until held-out loss ≤ {TEXTLM_TARGET} nats/byte or {textlm_cap:.0f} s; "
               f"top-k warm-up {_warmup(k, 'textlm')} steps per worker",
               "", table, "", bytes_table(results["textlm"]), ""]
    md += ["![held-out metric against wall time and against updates, per codec](compression.png)", "",
           "**How measured.** Time zero is the coordinator's log line saying all 3 workers are "
           "connected and training starts (process start-up is excluded). The coordinator evaluates "
           f"on the held-out split every {DIGITS_EVAL_S:g} s (digits; ~1 ms each) / {TEXTLM_EVAL_S:g} s "
           "(textlm; ~1 s each) after the previous evaluation, and logs each result (`--log-json`) "
           "with the version of the weights it evaluated; time to target is the time of the first "
           "logged evaluation at or past the target, so it is late by up to one evaluation period "
           "plus the evaluation itself. digits runs stop at a fixed number of updates (the "
           "coordinator evaluates once more at the end: the accuracy at that many updates); textlm "
           "runs stop at the target or the cap, and their loss at equal updates is interpolated "
           "along each trajectory at the largest update count every run reached; where `none` misses "
           "the target, the same-loss column times every codec to the best loss `none` reached in "
           "its run (a rule fixed before the run). Bytes per step are "
           "the coordinator's per-worker averages of tensor payload (headers and TCP/IP framing add "
           "a few %); ratios are dense fp32 bytes over them. *Wire limit*: with `max_inflight` 1 a "
           "worker's next gradient leaves only after the answer to the previous one arrived, so its "
           "two transfers never overlap; each may start with a full tbf bucket "
           f"({TBF_BURST // 1024} KiB at once), so a cycle takes at least (up − burst)⁺ + (down − "
           "burst)⁺ at 1.25 MB/s (and no less than either direction's bytes at that rate); the "
           "limit is 3 workers ÷ that cycle. "
           "*Link busy* = payload bytes moved ÷ (1.25 MB/s × run time), per worker link and "
           "direction. *Cores busy* = user + system CPU seconds of the 4 processes (from "
           "`/proc/<pid>/stat`) ÷ run time, out of 2 (coordinator alone in brackets; every process "
           "has one torch thread, `OMP_NUM_THREADS=1`); *machine* is the same from `/proc/stat` for "
           "everything on the box. Near 2 cores busy a run is CPU-bound; near 100 % link busy it is "
           "wire-bound; below both, a worker's cycle is wire time plus the CPU time of both ends in "
           "series (latency-bound). digits: each codec ran `--digits-repeats` times, round-robin over "
           "the codecs; the row is the run with the median time to 0.95 (each run's time is listed), "
           "because single evaluations of digits accuracy (359 held-out images) scatter by ±1 point "
           "and the update at which 0.95 is first seen by ~25 % between runs. textlm: one run per "
           "codec (each takes minutes to half an hour); on this shared machine times moved by up to "
           "~1.7× between runs when other jobs loaded it (compare the two *cores busy* columns).", ""]
    return "\n".join(md)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="none and topk 1%% only, shorter runs")
    parser.add_argument("--tasks", default="digits,textlm")
    parser.add_argument("--codecs", default="", help="comma-separated labels, e.g. 'none,topk 1%%'")
    parser.add_argument("--textlm-cap", type=float, default=None,
                        help=f"seconds per textlm run (default {TEXTLM_CAP_S:g}, "
                             f"--quick {QUICK['textlm_cap']:g})")
    parser.add_argument("--digits-repeats", type=int, default=3,
                        help="runs of each codec on digits (its time to 0.95 scatters by ~25%% from run "
                             "to run); the median run is reported (default 3, --quick 1)")
    parser.add_argument("--keep", metavar="JSON", help="take the tasks this run does not measure "
                        "from a saved compression.json (the report says which run they come from)")
    parser.add_argument("--render", metavar="JSON", help="only redraw the markdown and plot from a saved "
                        "compression.json (no runs)")
    args = parser.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        plot(data["results"], RESULTS / "compression.png")
        md = markdown(data)
        write_results("compression", data, md)
        print(md)
        return 0
    ok, why = netns_available()
    if not ok:
        print(f"bench_compression needs the simulated LAN: {why}", file=sys.stderr)
        return 2
    if args.quick:
        args.digits_repeats = 1
    if args.digits_repeats < 1:
        parser.error("--digits-repeats must be >= 1")
    labels = [c for c in args.codecs.split(",") if c] or list(QUICK_CODECS if args.quick else CODECS)
    unknown = [c for c in labels if c not in CODECS]
    if unknown:
        parser.error(f"unknown codec label(s) {unknown}; choose from {list(CODECS)}")
    tasks = [t for t in args.tasks.split(",") if t]
    digits_steps = QUICK["digits_steps"] if args.quick else DIGITS_STEPS
    digits_cap = QUICK["digits_cap"] if args.quick else DIGITS_CAP_S
    textlm_cap = args.textlm_cap or (QUICK["textlm_cap"] if args.quick else TEXTLM_CAP_S)
    results: dict[str, list[dict[str, Any]]] = {}
    started, load_start = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="swarmtrain-compression-") as tmpdir:
        for task in tasks:
            repeats = args.digits_repeats if task == "digits" else 1
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
            for rep in range(repeats):  # round-robin over the codecs: drifting load hits all alike
                for label in labels:
                    tmp = Path(tmpdir) / f"{task}-{label.replace(' ', '_').replace('%', 'pct')}-{rep}"
                    tmp.mkdir()
                    print(f"{task} / {label}" + (f" (run {rep + 1}/{repeats})" if repeats > 1 else "")
                          + " ...", flush=True)
                    r = run_one(task, label, codec_keys(label, task),
                                max_steps=digits_steps if task == "digits" else 0,
                                cap_s=digits_cap if task == "digits" else textlm_cap,
                                stop_at_target=task != "digits", tmp=tmp)
                    runs[label].append(r)
                    _print_run(r)
            results[task] = [median_run(runs[label]) for label in labels]
    kept: dict[str, str] = {}
    kept_rows: dict[str, dict[str, str]] = {}
    if args.keep:
        saved = json.loads(Path(args.keep).read_text())
        for task, rows in saved["results"].items():
            if task not in results:
                results[task] = rows
                kept[task] = saved.get("kept", {}).get(task) or saved["machine"]["date"]
                continue
            # this run measured some codecs of the task: the others come from the saved run
            # (in the standard order), each row labelled with its run's date
            fresh = {r["codec"]: r for r in results[task]}
            dates = saved.get("kept_rows", {}).get(task, {})
            for row in rows:
                if row["codec"] not in fresh:
                    fresh[row["codec"]] = row
                    kept_rows.setdefault(task, {})[row["codec"]] = (
                        dates.get(row["codec"]) or saved.get("kept", {}).get(task)
                        or saved["machine"]["date"])
            results[task] = [fresh[c] for c in CODECS if c in fresh]
    checks = bar_check(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, RESULTS / "compression.png")
    example = {label: {"uplink": k, "downlink": downlink_name(k)} for label, k in CODECS.items()}
    data = {"machine": machine(), "loadavg_start": load_start, "quick": args.quick,
            "total_s": time.time() - started,
            "constants": {"rate_mbit": RATE_MBIT, "workers": WORKERS, "digits_target": DIGITS_TARGET,
                          "digits_steps": digits_steps, "digits_cap_s": digits_cap,
                          "digits_eval_s": DIGITS_EVAL_S, "digits_batch": DIGITS_BATCH,
                          "textlm_target": TEXTLM_TARGET, "textlm_cap_s": textlm_cap,
                          "textlm_eval_s": TEXTLM_EVAL_S, "textlm_batch": TEXTLM_BATCH,
                          "topk_warmup_steps": TOPK_WARMUP},
            "codecs": example, "bar": checks, "results": results, "kept": kept,
            "kept_rows": kept_rows}
    md = markdown(data)
    write_results("compression", data, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
