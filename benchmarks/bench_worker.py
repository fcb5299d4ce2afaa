"""One worker through swarmtrain over loopback vs the same training loop without swarmtrain.

(a) plain: one process, the task's model and ``torch.optim.Adam``, forward / backward / step
    on batches drawn by the same :class:`~swarmtrain.tasks.Shard`, 1 torch thread;
(b) swarmtrain: ``python -m swarmtrain coordinator`` and ONE ``python -m swarmtrain worker``
    as separate processes on 127.0.0.1, the worker with ``--threads 1`` and the same batch
    size, the coordinator with ``OMP_NUM_THREADS=1`` (it has no thread flag); with
    ``max_inflight`` 1 (the default: the next gradient is computed while the previous one
    travels) and 0 (wait for each answer), set through a worker ``--config`` file since the
    CLI has no flag for it; and max_inflight 1 once more with ``[network] direct_io = false``,
    the data path through the worker's event loop (what quick steps took before their socket
    was lent to the compute thread).

The swarmtrain rate is measured on the coordinator's clock: once the worker has applied
updates for a warm-up period, this script asks the coordinator for its status twice (an
in-process ``ctl status`` request, so no extra Python process competes for the CPU), and
the rate is the difference of the worker's applied samples divided by the difference of the
coordinator's ``uptime_sec`` between the two answers. Start-up, registration and shutdown
are outside the window. The limit for one asynchronous worker is the plain loop's rate
(async PS: the sum of the standalone worker throughputs); the plain loop runs before and
after the swarmtrain runs of a task and the mean is the reference.

Run: ``python benchmarks/bench_worker.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
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

from swarmtrain.roles.ps.ctl import ctl_request
from swarmtrain.tasks import Shard, load_task

#: task -> batch size (each task's default batch)
TASKS = {"digits": 32, "textlm": 16}
#: task -> (warm-up s, window s), full and --quick; textlm steps take ~0.2-0.3 s each
WINDOWS = {"digits": ((3.0, 6.0), (1.0, 3.0)), "textlm": ((3.0, 10.0), (2.0, 5.0))}
HOST = "127.0.0.1"
#: the swarmtrain runs of each task: (label, max_inflight, [network] direct_io); the last is
#: the data path through the event loop that quick steps took before the socket was lent
RUNS = [("max_inflight 1", 1, True), ("max_inflight 0", 0, True),
        ("max_inflight 1, via the loop", 1, False)]


# -------------------------------------------------------------------------------- (a) plain


def plain_run(task_name: str, batch: int, warm_s: float, window_s: float) -> dict[str, Any]:
    """The loop a user writes without swarmtrain; samples/s over ``window_s`` after a warm-up."""
    torch.set_num_threads(1)
    task = load_task(task_name)
    model = task.build_model(seed=0)
    shard = Shard(task.load_data().train, 0, 1, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=task.default_learning_rate)
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, shard.next_batch(batch))
        loss.backward()
        float(loss.detach())  # the worker reads the loss too
        opt.step()

    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        step()
    steps = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < window_s:
        step()
        steps += 1
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"samples_per_s": steps * batch / elapsed, "steps_per_s": steps / elapsed,
            "steps": steps, "seconds": elapsed, "cpu_cores": cpu / elapsed,
            "samples_per_cpu_s": steps * batch / cpu}


# -------------------------------------------------------------------------------- (b) swarmtrain


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(port: int, secret: bytes) -> dict[str, Any]:
    reply = asyncio.run(ctl_request(HOST, port, "status", secret=secret, timeout=30))
    return reply.fields()["status"]


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def swarm_run(task_name: str, batch: int, inflight: int, warm_s: float, window_s: float,
              tmp: Path, direct: bool = True) -> dict[str, Any]:
    """Coordinator + one worker as processes; the worker's applied samples/s in steady state."""
    secret = secrets.token_hex(16)
    env = {**os.environ, "SWARMTRAIN_SECRET": secret}
    tag = f"{task_name}-inflight{inflight}-{'direct' if direct else 'loop'}"
    port_file, summary = tmp / f"{tag}.port", tmp / f"{tag}.summary.json"
    wcfg = tmp / f"{tag}.worker.toml"
    wcfg.write_text(f"[training]\nmax_inflight = {inflight}\n[network]\n"
                    f"direct_io = {'true' if direct else 'false'}\n")
    clog, wlog = tmp / f"{tag}.coordinator.log", tmp / f"{tag}.worker.log"
    py = [sys.executable, "-m", "swarmtrain"]
    coord = subprocess.Popen(
        [*py, "coordinator", "--task", task_name, "--host", HOST, "--port", "0",
         "--port-file", str(port_file), "--summary-file", str(summary), "--min-workers", "1",
         "--max-steps", "10000000", "--checkpoint-interval", "0", "--eval-interval", "1e9",
         "--log-level", "warning"],
        env={**env, "OMP_NUM_THREADS": "1"}, stdout=clog.open("wb"), stderr=subprocess.STDOUT)
    worker: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start:\n{_tail(clog)}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        worker = subprocess.Popen(
            [*py, "worker", "--config", str(wcfg), "--task", task_name, "--host", HOST,
             "--port", str(port), "--threads", "1", "--batch-size", str(batch), "--accumulation-steps", "1",
             "--worker-id", "bench", "--log-level", "warning"],
            env=env, stdout=wlog.open("wb"), stderr=subprocess.STDOUT)
        sb, sa = secret.encode(), None
        while True:  # wait for the first applied update, then the warm-up
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start training:\n{_tail(wlog)}")
            st = _status(port, sb)
            if st["version"] > 0:
                break
            time.sleep(0.2)
        time.sleep(warm_s)
        sa, ca = _status(port, sb), (_cpu_seconds(coord.pid), _cpu_seconds(worker.pid))
        time.sleep(window_s)
        sb_, cb = _status(port, sb), (_cpu_seconds(coord.pid), _cpu_seconds(worker.pid))
        wa, wb = sa["workers"][0], sb_["workers"][0]
        dt = sb_["uptime_sec"] - sa["uptime_sec"]
        asyncio.run(ctl_request(HOST, port, "shutdown", secret=sb, timeout=30))
        rc_c = _stop(coord, 60)
        rc_w = _stop(worker, 60)
    finally:
        for p in (worker, coord):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    final = json.loads(summary.read_text()) if summary.exists() else {}
    samples = wb["samples"] - wa["samples"]
    return {
        "samples_per_s": samples / dt,
        "samples_per_worker_cpu_s": samples / max(1e-9, cb[1] - ca[1]),
        "steps_per_s": (wb["steps"] - wa["steps"]) / dt,
        "window_s": dt, "steps_in_window": wb["steps"] - wa["steps"],
        "coordinator_cpu_cores": (cb[0] - ca[0]) / dt, "worker_cpu_cores": (cb[1] - ca[1]) / dt,
        "avg_staleness": wb["avg_staleness"], "stats": final.get("stats", sb_["stats"]),
        "direct_io": direct,
        "exit_codes": {"coordinator": rc_c, "worker": rc_w},
    }


# -------------------------------------------------------------------------------- driver


def run(quick: bool, tasks: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine(), "quick": quick, "tasks": {}}
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as d:
        tmp = Path(d)
        for name in tasks:
            batch = TASKS[name]
            warm_s, window_s = WINDOWS[name][quick]
            print(f"-- {name}, batch {batch}", flush=True)
            before = plain_run(name, batch, warm_s, window_s)
            print(f"   plain         {before['samples_per_s']:9.0f} samples/s", flush=True)
            swarm = {}
            for key, inflight, direct in RUNS:
                r = swarm_run(name, batch, inflight, warm_s, window_s, tmp, direct=direct)
                swarm[key] = r
                print(f"   {key:24s} {r['samples_per_s']:9.0f} samples/s "
                      f"(coordinator {r['coordinator_cpu_cores']:.2f} cores, worker "
                      f"{r['worker_cpu_cores']:.2f})", flush=True)
            after = plain_run(name, batch, warm_s, window_s)
            print(f"   plain again   {after['samples_per_s']:9.0f} samples/s", flush=True)
            ref = (before["samples_per_s"] + after["samples_per_s"]) / 2
            res["tasks"][name] = {
                "batch_size": batch, "warm_s": warm_s, "window_s": window_s,
                "plain_before": before, "plain_after": after,
                "plain_samples_per_s": ref, "swarmtrain": swarm,
                "ratio": {k: v["samples_per_s"] / ref for k, v in swarm.items()},
            }
    return res


def to_markdown(res: dict[str, Any]) -> str:
    rows = []
    for name, t in res["tasks"].items():
        ref = t["plain_samples_per_s"]
        pb, pa = t["plain_before"], t["plain_after"]
        ref_cpu = (pb["samples_per_cpu_s"] + pa["samples_per_cpu_s"]) / 2
        rows.append([name, t["batch_size"], "plain PyTorch loop, 1 thread", ref,
                     ref / t["batch_size"], 1.0, ref_cpu, 1.0, f"{pb['cpu_cores']:.2f}", "-",
                     f"before {pb['samples_per_s']:.0f}, after {pa['samples_per_s']:.0f}; "
                     f"{t['window_s']:.0f} s windows"])
        for k, r in t["swarmtrain"].items():
            rows.append([name, t["batch_size"], f"swarmtrain, {k}",
                         r["samples_per_s"], r["steps_per_s"], r["samples_per_s"] / ref,
                         r["samples_per_worker_cpu_s"], r["samples_per_worker_cpu_s"] / ref_cpu,
                         f"{r['worker_cpu_cores']:.2f}", f"{r['coordinator_cpu_cores']:.2f}",
                         f"{r['steps_in_window']} steps in {r['window_s']:.1f} s, staleness "
                         f"{r['avg_staleness']:.2f}, {r['stats']}"])
    m = res["machine"]
    return "\n".join([
        "## One worker through swarmtrain vs no swarmtrain (`benchmarks/bench_worker.py`)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average at start "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg'])} (shared machine). Plain loop: the "
        "task's model, `torch.optim.Adam` (default implementation), the same `Shard` batches, "
        "1 torch thread, in one process. swarmtrain: coordinator and one worker as processes "
        "on 127.0.0.1, worker `--threads 1`, coordinator `OMP_NUM_THREADS=1`, same batch size, "
        "compression none, evaluation off during the run. Both share this 2-core machine, so "
        "the coordinator's work competes with the worker's only through the second core. "
        "Rates: plain over a timed window after a warm-up; swarmtrain from two coordinator "
        "status snapshots a window apart after the same warm-up of training (applied samples / "
        "coordinator uptime). Limit: the plain loop (one async worker can at best match it). "
        "\"per CPU-s\" divides samples by the CPU time the training process (plain) or the "
        "worker process (swarmtrain) used in the window: a figure less sensitive to other load "
        "on the machine, and the worker's CPU overhead. Quick steps of a small model train with "
        "the connection's socket lent to the worker's compute thread (`[network] direct_io`, "
        "one `sendmsg` and one `recv_into` per message); the run \"via the loop\" turns that off, "
        "so gradients and answers go through the worker's event loop as slow steps' do.",
        "",
        md_table(["task", "batch", "run", "samples/s", "steps/s", "ratio to plain",
                  "samples per CPU-s", "ratio per CPU-s", "worker CPU (cores)",
                  "coordinator CPU (cores)", "detail"], rows),
        "",
        "textlm is the task's default model (context 128, d_model 128, 4 layers); digits is "
        "the 64-128-64-10 MLP.",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows (smoke run)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: digits,textlm")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    res = run(args.quick, [t for t in args.tasks.split(",") if t])
    res["seconds"] = time.perf_counter() - start
    report("worker", res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
