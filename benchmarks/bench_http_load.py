"""Training under a flood of HTTP requests: a coordinator's ops port must not slow it down.

A real coordinator and two workers (CLI processes, digits, loopback) train. Another process
floods the coordinator's HTTP port with ``/api/status`` requests (``--threads`` clients,
each sending its next request as soon as the last is answered) during every other short
window; the windows alternate in ABBA order (quiet-flooded, flooded-quiet, ...), so a drift
of the machine's load cancels out, and the updates/s of the quiet and the flooded windows
are compared side by side in one run. Versions are read over the framed port with the ctl
client at each window's edges (two requests per window, no HTTP). The coordinator's CPU use
per window and the flooding process's are reported too.

Results: ``benchmarks/results/http_load.json`` and ``http_load.md``.

    python benchmarks/bench_http_load.py             # 12 pairs of 3 s windows, 16 flooding clients
    python benchmarks/bench_http_load.py --quick     # 4 pairs of 2 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from swarmtrain.errors import SwarmError
from swarmtrain.testing.local import free_ports

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, md_table, write_results

HERE = Path(__file__).resolve().parent
SECRET = "bench-http-load-secret"


def _free_port() -> int:
    return free_ports(1)[0]


def _version(port: int) -> tuple[float, int]:
    """(when, the coordinator's version), asked with ``swarmtrain ctl status``'s client."""
    from swarmtrain.roles.ps.ctl import ctl_request

    reply = asyncio.run(ctl_request("127.0.0.1", port, "status", secret=SECRET.encode(), timeout=10))
    return time.monotonic(), int(reply.fields()["status"]["version"])


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _window(port: int, seconds: float, coordinator: psutil.Process) -> dict[str, float]:
    """Updates and seconds of the next ``seconds``, and the cores the coordinator used."""
    (t0, v0), cpu0 = _version(port), _cpu(coordinator)
    time.sleep(seconds)
    (t1, v1), cpu1 = _version(port), _cpu(coordinator)
    return {"updates": v1 - v0, "seconds": t1 - t0, "cores": (cpu1 - cpu0) / (t1 - t0)}


def _wait_for_training(port: int, updates: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _version(port)[1] >= updates:
                return
        except (SwarmError, OSError):  # not listening yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the cluster did not reach {updates} updates in {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=0, help="quiet + flooded window pairs")
    ap.add_argument("--window", type=float, default=0.0, help="seconds per window")
    ap.add_argument("--threads", type=int, default=16, help="flooding clients")
    ap.add_argument("--path", default="/api/status")
    args = ap.parse_args()
    pairs = args.pairs or (4 if args.quick else 12)
    window = args.window or (2.0 if args.quick else 3.0)
    env = {**os.environ, "SWARMTRAIN_SECRET": SECRET}
    load_before = os.getloadavg()[0]
    port, http_port = _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "swarmtrain", "coordinator", "--task", "digits", "--host", "127.0.0.1",
             "--port", str(port), "--http-port", str(http_port), "--min-workers", "2", "--run-log", "none",
             "--log-level", "warning", "--eval-interval", "5"], env=env))
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "swarmtrain", "worker", "--task", "digits", "--host", "127.0.0.1",
                 "--port", str(port), "--threads", "1", "--worker-id", f"w{i}", "--log-level", "error",
                 "--run-log", "none"], env=env))
        flooder = subprocess.Popen(
            [sys.executable, str(HERE / "_http_flood.py"), str(http_port), args.path, str(args.threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        procs.append(flooder)
        assert flooder.stdin is not None and flooder.stdout is not None
        _wait_for_training(port, 300, 120)
        coordinator = psutil.Process(procs[0].pid)

        def flooded() -> tuple[dict[str, float], dict[str, Any]]:
            assert flooder.stdin is not None and flooder.stdout is not None
            flooder.stdin.write(b"on\n")
            flooder.stdin.flush()
            time.sleep(0.3)  # the flood is under way
            w = _window(port, window, coordinator)
            flooder.stdin.write(b"off\n")
            flooder.stdin.flush()
            report = json.loads(flooder.stdout.readline())
            time.sleep(0.3)  # its last requests are answered
            return w, report

        for i in range(pairs):
            if i % 2 == 0:
                quiet = _window(port, window, coordinator)
                loaded, flood = flooded()
            else:
                loaded, flood = flooded()
                quiet = _window(port, window, coordinator)
            q, f = quiet["updates"] / quiet["seconds"], loaded["updates"] / loaded["seconds"]
            row = {"pair": i + 1, "quiet": quiet, "flooded": loaded, "ratio": f / q, "flood": flood,
                   "requests_per_sec": sum(flood["statuses"].values()) / flood["seconds"]}
            rows.append(row)
            print(f"pair {i + 1}: quiet {q:.0f} updates/s, flooded {f:.0f} (x{f / q:.3f}); "
                  f"{row['requests_per_sec']:.0f} requests/s answered {flood['statuses']}, "
                  f"errors {flood['errors'] or 'none'}; coordinator {quiet['cores']:.2f} -> "
                  f"{loaded['cores']:.2f} cores", flush=True)
        flooder.stdin.write(b"quit\n")
        flooder.stdin.flush()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()

    def pooled(kind: str) -> float:
        return sum(r[kind]["updates"] for r in rows) / sum(r[kind]["seconds"] for r in rows)

    quiet_rate, flood_rate = pooled("quiet"), pooled("flooded")
    ratio, median_ratio = flood_rate / quiet_rate, statistics.median(r["ratio"] for r in rows)
    statuses: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in rows:
        for k, v in r["flood"]["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        for k, v in r["flood"]["errors"].items():
            errors[k] = errors.get(k, 0) + v
    requests_per_sec = statistics.median(r["requests_per_sec"] for r in rows)
    cores = (statistics.median(r["quiet"]["cores"] for r in rows),
             statistics.median(r["flooded"]["cores"] for r in rows))
    summary = md_table(
        ["", "quiet", "flooded"],
        [["updates/s (all windows pooled)", quiet_rate, flood_rate],
         ["coordinator CPU (cores, median)", cores[0], cores[1]],
         ["HTTP requests answered per second (median)", "-", requests_per_sec],
         ["answers", "-", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))],
         ["resets and other errors", "-",
          ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "none"]])
    table = md_table(
        ["pair", "quiet updates/s", "flooded updates/s", "ratio", "requests/s",
         "coordinator cores quiet / flooded"],
        [[r["pair"], r["quiet"]["updates"] / r["quiet"]["seconds"],
          r["flooded"]["updates"] / r["flooded"]["seconds"], r["ratio"], r["requests_per_sec"],
          f"{r['quiet']['cores']:.2f} / {r['flooded']['cores']:.2f}"] for r in rows])
    md = (f"# Training under an HTTP flood\n\n"
          f"A coordinator and 2 digits workers (CLI processes, loopback); {args.threads} clients in another "
          f"process flood `{args.path}` in every other {window:g} s window ({pairs} pairs, ABBA order). "
          f"Flooded / quiet updates/s: **{ratio:.3f}** pooled over all windows (median of the pairs' "
          f"ratios {median_ratio:.3f}).\n\n{summary}\n\nPer pair:\n\n{table}\n\n"
          f"`python benchmarks/bench_http_load.py{' --quick' if args.quick else ''}`; machine: "
          f"{machine()['cpu']}, {os.cpu_count()} cores; 1-minute load average {load_before:.2f} before and "
          f"{os.getloadavg()[0]:.2f} after (the run's own 3 training processes make about 2; more is other "
          f"work on the machine, which makes single pairs noisy).\n")
    print(f"flooded / quiet updates/s: {ratio:.3f} pooled, {median_ratio:.3f} median of pairs")
    j, m = write_results("http_load", {
        "rows": rows, "pooled_ratio": ratio, "median_ratio": median_ratio,
        "quiet_updates_per_sec": quiet_rate, "flooded_updates_per_sec": flood_rate, "window_sec": window,
        "threads": args.threads, "path": args.path, "machine": machine()}, md)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
