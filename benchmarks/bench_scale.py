"""One coordinator, 1 / 4 / 16 / 64 light workers: apply rate and memory against the worker count.

For each codec and each worker count N, measured in one run:

- ONE coordinator as its own process (``_scale_load.py coordinator``): the real
  :class:`~swarmtrain.roles.ps.coordinator.Coordinator` on bench_apply.py's ~10M-parameter
  textlm model, real TCP on 127.0.0.1, a cluster secret, evaluation off, no checkpoints,
  ``OMP_NUM_THREADS=1`` and 1 torch thread; ``max_staleness`` raised above anything N workers
  reach, so every gradient is applied (the default 16 would drop most of 64 workers'
  gradients as stale and measure the staleness policy instead);
- N light workers, up to ``--per-process`` in one asyncio process (``_scale_load.py workers``):
  real registration, then a real compressed gradient of the model (computed once per process)
  sent again and again with a new msg_id and the version of the last answer, at most
  ``--inflight`` (2) in flight per worker, offered at ``--rate`` gradients/s in total (divided
  over the workers); every answer is read off the socket, none is applied (see
  ``_scale_load.py``). With one in flight, 4 workers left the coordinator idle during each
  round trip (its threads were under half busy while 64 workers kept them busier), so the
  ratio to N=4 measured the offered load; with 2, the next gradient of each worker is on its
  way while one is applied, and the coordinator's admission counters say whether gradients
  waited for it (then its capacity, not the load, is measured).

The counts of one codec are measured interleaved: one cluster (coordinator and light workers)
per N, all started and joined first, each paused once warm (``swarmtrain ctl pause``: the
light workers stop sending, as real workers stop stepping); then each pass resumes one N's
cluster at a time for a window (after ``RESUME_WARM_S`` and one more gradient applied for every
worker) and pauses it again, the others connected and idle meanwhile. Joining N clusters one
after the other and measuring each in one block left 16-46 % between one N's two passes
(2026-12-06): the box's speed drifts over minutes, and a window per N some minutes apart
measured the drift; interleaved, the N of one pass are seconds apart and no join falls between
(the box's noise within seconds is left: one N's four passes still sat 36-80 % apart on
2026-12-07, the hypervisor taking up to 0.6 of the 2 cores in a window; the median of four
absorbs more of it than two did).

The coordinators run on the first half of the CPUs, the light workers and this driver on the
rest (``--no-pin``: all share them), as if the workers were other machines: unpinned, what a
64-worker load generator costs beyond a 4-worker one came out of the coordinator's cores, and
the rate measured the box.

In a window, the coordinator's status (an in-process ctl request) is taken twice, a window
apart: applied updates/s = version difference / uptime difference (the coordinator's clock); staleness from
its staleness counts in the window; its RSS (VmRSS) and peak (VmHWM) from /proc/PID/status
before any worker joined (idle), after the warm-up and at the end; its CPU (cores, from
/proc/PID/stat; the event-loop thread apart from the others, whose busiest is the apply
thread); the light-worker processes' CPU and the whole machine's busy cores; the workers'
mean answer latency (gradient sent -> its answer read) over answers read in the window.
The coordinator's capacity: 1000 / the CPU ms per update of its busier thread (event loop or
apply thread), i.e. the rate it sustains when each thread has a core; on this shared 2-core box
the applied rate also shows the other load, the capacity much less so. Then: the apply rate and
the capacity relative to N=4, and RSS growth per added worker, as the slope of the
RSS between N=4 and the largest N (MB and as a fraction of the model's fp32 size); the RSS of a
run is the median of samples taken every 0.5 s through the window (the end-of-window figure is
reported beside it).

Each N is measured in ``--passes`` (4) passes per codec, ascending then descending in N, and
the verdict is on each N's median over its passes: on this shared box one N's rate moved by up
to a third between runs, and a single window per N made the ratio to N=4 follow the box.

Run: ``python benchmarks/bench_scale.py [--quick] [--workers 1,4,16,64]
[--compression none,fp16,topk] [--rate 200] [--per-process 16] [--inflight 2] [--passes 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _util import machine, machine_jiffies, md_table, report

from swarmtrain.errors import SwarmError
from swarmtrain.roles.ps.ctl import ctl_request

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
CODECS = ("none", "fp16", "topk")
#: (warm-up s after the join, window s): full and --quick
WINDOWS = {False: (8.0, 8.0), True: (1.5, 3.0)}
#: after each RESUME, at least this long (full, --quick) and until every worker of the count has
#: had one more gradient applied (its queue of gradients has gone round once) before the window
RESUME_WARM_S = {False: 2.0, True: 0.5}
#: the issue's targets (#20, must-have 3)
RATE_TOLERANCE = 0.10
RSS_FRACTION = 0.05
#: before each run, wait up to this long (full, --quick) for the machine's other load to fall
#: below QUIET_CORES busy cores
QUIET_MAX_WAIT_S = {False: 20.0, True: 2.0}
QUIET_CORES = 0.3
#: warm-up: at least this many gradients applied for every worker (full, --quick)
MIN_ANSWERS = {False: 3, True: 1}
#: gradients in flight per light worker (a real worker's training.max_inflight): with one, 4
#: workers leave the coordinator idle while each round trip completes (the answer is written,
#: read, the next gradient sent and read), so N=4 measured the offered load, not the
#: coordinator; with 2, the next gradient of every worker is on its way while one is applied
INFLIGHT = 2
#: a run stops (and is reported as stopped) when the machine has less memory available
MIN_AVAILABLE_MB = 3000


@dataclasses.dataclass(frozen=True)
class Timing:
    """The waits and windows of a run (seconds), full or ``--quick``; a test passes shorter."""

    warm_s: float  # after the join, before the first pause
    window_s: float
    resume_warm_s: float  # after each RESUME (and one more gradient applied for every worker)
    quiet_max_wait_s: float  # before a codec's clusters start, for the machine's load to fall
    min_answers: int  # gradients applied for every worker after the join

    @classmethod
    def of(cls, quick: bool) -> Timing:
        warm_s, window_s = WINDOWS[quick]
        return cls(warm_s, window_s, RESUME_WARM_S[quick], QUIET_MAX_WAIT_S[quick], MIN_ANSWERS[quick])


# -------------------------------------------------------------------------------- /proc


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _jiffies_to_s(j: int) -> float:
    return j / os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return _jiffies_to_s(int(fields[11]) + int(fields[12]))


def _thread_cpu(pid: int) -> dict[int, float]:
    """utime + stime of every thread of a process, seconds by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(task.name)] = _jiffies_to_s(int(fields[11]) + int(fields[12]))
    return out


def _memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class OutOfMemory(RuntimeError):
    """The machine's available memory fell below :data:`MIN_AVAILABLE_MB` during a run."""


def check_memory() -> None:
    """Raise :class:`OutOfMemory` when MemAvailable is below :data:`MIN_AVAILABLE_MB`: the
    coordinator's memory grows with N (today ~4x the model per worker), and this box is
    shared, so the run stops before the kernel's OOM killer picks a victim."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            mb = int(line.split()[1]) / 1024
            if mb < MIN_AVAILABLE_MB:
                raise OutOfMemory(f"only {mb:.0f} MB of memory left on the machine")
            return


def wait_quiet(max_wait: float) -> dict[str, Any]:
    """Wait (up to ``max_wait`` s) until the machine's load, sampled over 1 s, is below
    :data:`QUIET_CORES` busy cores: this box is shared, a run should at least start quiet."""
    t0 = time.monotonic()
    while True:
        a = machine_jiffies()
        time.sleep(1.0)
        b = machine_jiffies()
        busy = (b[0] - a[0]) / max(1, b[1] - a[1]) * (os.cpu_count() or 1)
        waited = time.monotonic() - t0
        if busy < QUIET_CORES or waited >= max_wait:
            return {"waited_s": waited, "busy_cores": busy, "quiet": busy < QUIET_CORES}


def split_cpus(pin: bool) -> tuple[set[int], set[int]] | None:
    """(the coordinators' CPUs, the light workers' and this driver's): the first half of the
    CPUs this process may use, and the rest; None without ``pin`` or with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """This (single-threaded) driver on ``cpus`` meanwhile, so that what it starts inherits them."""
    if cpus is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def _cpus_allowed(pid: int) -> list[int]:
    """The CPUs any thread of ``pid`` may run on (the union over its threads)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    for part in line.split(":", 1)[1].strip().split(","):
                        lo, _, hi = part.partition("-")
                        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# -------------------------------------------------------------------------------- one run


class Run:
    """A coordinator and the light-worker processes of one (codec, N) measurement."""

    def __init__(self, codec: str, n: int, rate: float, per_process: int, tmp: Path,
                 model: str = "bench", inflight: int = 1, coordinator_cpus: set[int] | None = None
                 ) -> None:
        self.codec, self.n, self.rate, self.tmp, self.model = codec, n, rate, tmp, model
        self.coordinator_cpus = coordinator_cpus  # None: wherever the driver runs
        self.inflight = inflight
        self.secret = secrets.token_hex(16)
        self.env = {**os.environ, "SWARMTRAIN_SECRET": self.secret, "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1"}
        self.tag = f"{codec}-{n}"
        self.counts = [min(per_process, n - i) for i in range(0, n, per_process)]
        self.coord: subprocess.Popen[bytes] | None = None
        self.workers: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
        self.port = 0
        self.status_failures = 0  # ctl status requests that failed (retried)
        self._go = tmp / f"{self.tag}.go"  # the port, for the workers, once written

    def _script(self, *args: str) -> list[str]:
        return [sys.executable, str(HERE / "_scale_load.py"), *args, "--model", self.model,
                "--compression", self.codec]

    def start(self, timeout: float = 120.0) -> None:
        port_file = self.tmp / f"{self.tag}.port"
        clog = self.tmp / f"{self.tag}.coordinator.log"
        with on_cpus(self.coordinator_cpus):
            self.coord = subprocess.Popen(
                self._script("coordinator", "--port-file", str(port_file), "--min-workers",
                             str(self.n), "--connections", str(self.n)),
                env=self.env, stdout=clog.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start:\n{_tail(clog)}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def start_workers(self) -> None:
        """Start the light-worker processes; they compute their gradient, then wait for
        :meth:`release_workers` (so the idle coordinator can be measured meanwhile)."""
        for j, count in enumerate(self.counts):
            out = self.tmp / f"{self.tag}.workers{j}.json"
            log = self.tmp / f"{self.tag}.workers{j}.log"
            proc = subprocess.Popen(
                self._script("workers", "--host", HOST, "--port-file", str(self._go), "--count",
                             str(count), "--prefix", f"p{j}-", "--rate", str(self.rate / self.n),
                             "--inflight", str(self.inflight), "--out", str(out)),
                env=self.env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            self.workers.append((proc, out, log))

    def release_workers(self) -> None:
        tmp = self._go.with_suffix(".tmp")
        tmp.write_text(str(self.port))
        tmp.rename(self._go)

    def ctl(self, command: str, tries: int = 5) -> Any:
        """``swarmtrain ctl COMMAND`` (status, pause, resume), the reply's fields; asked again up
        to ``tries`` times (a ctl handshake gives up after 10 s, and a coordinator busy with 64
        workers has missed that), each failure counted."""
        for attempt in range(tries):
            try:
                return asyncio.run(ctl_request(HOST, self.port, command, secret=self.secret.encode(),
                                               timeout=60)).fields()
            except SwarmError:
                self.status_failures += 1
                if attempt == tries - 1:
                    raise
        raise AssertionError("unreachable")

    def status(self, tries: int = 1) -> dict[str, Any]:
        """The coordinator's status (see :meth:`ctl`)."""
        status: dict[str, Any] = self.ctl("status", tries)["status"]
        return status

    def settle(self, timeout: float = 300.0) -> int:
        """After a pause: until the version has not moved for 1 s (every gradient in flight
        applied and answered); returns it."""
        deadline = time.monotonic() + timeout
        last = self.status(tries=5)["version"]
        while True:
            check_memory()
            time.sleep(1.0)
            now = self.status(tries=5)["version"]
            if now == last:
                return int(now)
            if time.monotonic() > deadline:
                raise RuntimeError(f"still applying {timeout:.0f} s after the pause")
            last = now

    def fewest_steps(self, tries: int = 5) -> int:
        """The fewest gradients applied for any connected worker."""
        return int(min((w["steps"] for w in self.status(tries)["workers"] if w["connected"]),
                       default=0))

    def wait_training(self, timeout: float = 300.0) -> dict[str, Any]:
        """Until all N are connected and an update is applied. While many workers register at
        once the coordinator's loop may be too busy to finish a ctl handshake in time: that
        status is asked again. Stops early if the machine runs short of memory."""
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {"workers_connected": 0, "version": 0}
        while True:
            for proc, _, log in self.workers:
                if proc.poll() is not None:
                    raise RuntimeError(f"a light-worker process exited ({proc.returncode}):\n{_tail(log)}")
            check_memory()
            with contextlib.suppress(SwarmError):
                st = self.status()
                if st["workers_connected"] >= self.n and st["version"] > 0:
                    return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"{st['workers_connected']} of {self.n} workers connected, "
                                   f"version {st['version']} after {timeout:.0f} s")
            time.sleep(0.5)

    def wait_answers(self, least: int, timeout: float = 600.0) -> int:
        """Until every worker has had ``least`` gradients applied (each has then been answered
        with a delta, and its shadow is in use); returns the fewest any worker has."""
        deadline = time.monotonic() + timeout
        while True:
            check_memory()
            with contextlib.suppress(SwarmError):
                fewest = self.fewest_steps(tries=1)
                if fewest >= least:
                    return int(fewest)
            if time.monotonic() > deadline:
                raise RuntimeError(f"a worker had fewer than {least} gradients applied after "
                                   f"{timeout:.0f} s of warm-up")
            time.sleep(0.5)

    def sample(self) -> dict[str, Any]:
        """Everything one end of the window needs, taken as close together as possible."""
        if self.coord is None:
            raise RuntimeError("not started")
        t = time.monotonic()
        threads = _thread_cpu(self.coord.pid)
        cpu = _proc_cpu(self.coord.pid)
        workers_cpu = sum(_proc_cpu(p.pid) for p, _, _ in self.workers)
        mach = machine_jiffies()
        mem = _memory(self.coord.pid)
        st = self.status(tries=5)
        return {"t": t, "pid": self.coord.pid, "threads": threads, "cpu": cpu,
                "coordinator_cpus": _cpus_allowed(self.coord.pid),
                "workers_cpus": sorted({c for p, _, _ in self.workers for c in _cpus_allowed(p.pid)}),
                "workers_cpu": workers_cpu, "machine": mach,
                "memory": mem, "version": st["version"], "uptime": st["uptime_sec"],
                "stats": st["stats"], "staleness_counts": st["staleness_counts"],
                "raw_bytes_per_step": st["raw_bytes_per_step"],
                "answer_bytes": _mean([w["bytes_down_per_step"] for w in st["workers"]
                                       if w["connected"]]),
                "connected": st["workers_connected"], "admission": st["admission"],
                "downlink": {"tracks": len(st["downlink"]["tracks"]),
                             "log_bytes": st["downlink"]["log_bytes"],
                             "answers": st["downlink"]["answers"],
                             "switches": st["downlink"]["switches"],
                             "per_track": [{k: t.get(k) for k in ("interval", "answers", "head")}
                                           for t in st["downlink"]["tracks"]]},
                # copies of the weights held by answers and the downlink (MB), and the answers
                # that said "no change" while the most allowed were held
                "snapshots_held_mb": st["snapshots"]["held_mb"],
                "snapshots_withheld": st["snapshots"]["withheld"],
                # freed memory the coordinator gave back to the system after bursts (MB, times)
                "allocator": st.get("memory", {})}

    def finish(self, timeout: float = 180.0) -> list[dict[str, Any]]:
        """ctl SHUTDOWN, wait for every process, read the light workers' files."""
        asyncio.run(ctl_request(HOST, self.port, "shutdown", secret=self.secret.encode(), timeout=60))
        deadline = time.monotonic() + timeout
        outs = []
        for proc, out, log in self.workers:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc or not out.exists():
                raise RuntimeError(f"a light-worker process exited {rc}:\n{_tail(log)}")
            outs.append(json.loads(out.read_text()))
        if self.coord is not None:
            self.coord.wait(timeout=max(1.0, deadline - time.monotonic()))
        return outs

    def _logs(self) -> list[Path]:
        return [self.tmp / f"{self.tag}.coordinator.log", *(log for _, _, log in self.workers)]

    def log_tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{_tail(log, 8)}" for log in self._logs())

    def warnings(self) -> dict[str, Any]:
        """WARNING lines in the coordinator's and the light workers' logs (first few of each)."""
        out: dict[str, Any] = {}
        for log in self._logs():
            lines = [ln for ln in _tail(log, 100_000).splitlines() if " WARNING " in ln]
            out[log.name.removeprefix(f"{self.tag}.")] = {"count": len(lines), "first": lines[:3]}
        return out

    def kill(self) -> None:
        for proc in [*(p for p, _, _ in self.workers), *([self.coord] if self.coord else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _sleep_watching_memory(seconds: float, pid: int | None = None,
                           rss: list[float] | None = None) -> None:
    """Sleep, checking the machine's memory every 0.5 s; with ``pid``, append that process's
    VmRSS (MB) to ``rss`` each time."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        check_memory()
        if pid is not None and rss is not None:
            with contextlib.suppress(OSError, KeyError):
                rss.append(_memory(pid)["VmRSS"])
        time.sleep(min(0.5, left))


def join(run: Run, timing: Timing) -> dict[str, Any]:
    """Start ``run``'s coordinator and workers, measure the idle coordinator, release the
    workers, wait until all are connected and every one has had gradients applied, then pause
    the cluster (``ctl pause``) until the gradients in flight are answered."""
    run.start_workers()
    run.start()
    if run.coord is None:
        raise RuntimeError("not started")
    time.sleep(0.5)  # the listening coordinator settles: its idle memory
    idle = _memory(run.coord.pid)
    t_join = time.monotonic()
    run.release_workers()
    run.wait_training()
    joined_s = time.monotonic() - t_join
    _sleep_watching_memory(timing.warm_s)
    warm_answers = run.wait_answers(timing.min_answers)
    run.ctl("pause")
    run.settle()
    return {"idle": idle, "join_s": joined_s, "warmup_min_answers": warm_answers}


def window(run: Run, timing: Timing) -> dict[str, Any]:
    """One window of a joined, paused cluster: ``ctl resume``; the warm-up (RESUME_WARM_S and
    one more gradient applied for every worker); two samples a window apart, the coordinator's
    RSS every 0.5 s between them; ``ctl pause`` and wait until the gradients in flight are
    answered, so that the next window (another N) has the machine to itself."""
    if run.coord is None:
        raise RuntimeError("not started")
    fewest = run.fewest_steps()
    run.ctl("resume")
    _sleep_watching_memory(timing.resume_warm_s)
    run.wait_answers(fewest + 1)
    a = run.sample()
    rss: list[float] = []  # the coordinator's VmRSS every 0.5 s through the window
    _sleep_watching_memory(timing.window_s, run.coord.pid, rss)
    b = run.sample()
    run.ctl("pause")
    run.settle()
    return {"a": a, "b": b, "rss": rss}


def measure_codec(codec: str, counts: list[int], passes: int, rate: float, per_process: int,
                  timing: Timing, tmp: Path, inflight: int = 1, model: str = "bench",
                  coordinator_cpus: set[int] | None = None
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every worker count of one codec, interleaved: one cluster (coordinator and light
    workers) per N, all joined first and paused; then ``passes`` passes over the counts
    (ascending, then descending, ...), each resuming one cluster for a window while the others
    stay paused. Returns the rows (one per window) and the counts that could not be measured."""
    quiet = wait_quiet(timing.quiet_max_wait_s)
    runs: dict[int, Run] = {}
    joined: dict[int, dict[str, Any]] = {}
    stopped: list[dict[str, Any]] = []
    windows: list[tuple[int, int, dict[str, Any]]] = []

    def drop(n: int, why: str) -> None:
        print(f"   {why}", flush=True)
        stopped.append({"codec": codec, "workers": n, "why": why})
        run = runs.pop(n)
        print(run.log_tails(), flush=True)
        run.kill()

    try:
        for n in sorted(counts):
            print(f"-- {codec}: {n} worker(s) join", flush=True)
            runs[n] = Run(codec, n, rate, per_process, tmp, model=model, inflight=inflight,
                          coordinator_cpus=coordinator_cpus)
            try:
                joined[n] = join(runs[n], timing)
            except OutOfMemory as exc:
                drop(n, f"stopped: {exc}; no larger N for {codec}")
                break
            except RuntimeError as exc:
                drop(n, f"failed: {str(exc)[:300]}")
            else:
                print(f"   joined in {joined[n]['join_s']:.1f} s, paused", flush=True)
        for p, order in enumerate(pass_orders(list(runs), passes), start=1):
            for n in order:
                if n not in runs:
                    continue
                print(f"-- {codec}, {n} worker(s), pass {p} of {passes}", flush=True)
                try:
                    w = window(runs[n], timing)
                except OutOfMemory as exc:
                    for m in [m for m in runs if m >= n]:
                        drop(m, f"stopped in pass {p}: {exc}")
                    continue
                except RuntimeError as exc:
                    drop(n, f"failed in pass {p}: {str(exc)[:300]}")
                    continue
                a, b = w["a"], w["b"]
                print(f"   applied {(b['version'] - a['version']) / (b['uptime'] - a['uptime']):.1f}/s",
                      flush=True)
                windows.append((n, p, w))
        outs = {}
        for n, run in list(runs.items()):
            try:
                outs[n] = run.finish()
            except (RuntimeError, SwarmError, subprocess.TimeoutExpired) as exc:
                drop(n, f"failed at the shutdown: {str(exc)[:300]}")
    finally:
        for run in runs.values():
            run.kill()
    rows = []
    for n, p, w in windows:
        if n not in outs:
            continue
        # the other clusters were paused: any answer they read inside this window would mean
        # two loads at once (0 in every window, or the figures are not of one N alone)
        others = sum(w["a"]["t"] <= ans[1] <= w["b"]["t"]
                     for m, o in outs.items() if m != n
                     for out in o for wk in out["workers"].values() for ans in wk["answers"])
        run, j = runs[n], joined[n]
        row = summarize(codec, n, rate, j["idle"], w["a"], w["b"], outs[n], j["join_s"], run.counts)
        row["rss_mb"]["window_median"] = statistics.median(w["rss"]) if w["rss"] else row["rss_mb"]["end"]
        row["rss_mb"]["window_samples"] = len(w["rss"])
        row.update({"pass": p, "inflight": inflight, "before_run": quiet,
                    "coordinator_cpus": w["b"]["coordinator_cpus"], "workers_cpus": w["b"]["workers_cpus"],
                    "other_clusters_answers_in_window": others,
                    "warmup_min_answers": j["warmup_min_answers"],
                    "status_failures": run.status_failures, "log_warnings": run.warnings()})
        rows.append(row)
    return rows, stopped


def summarize(codec: str, n: int, rate: float, idle: dict[str, float], a: dict[str, Any],
              b: dict[str, Any], outs: list[dict[str, Any]], joined_s: float,
              counts: list[int]) -> dict[str, Any]:
    dt = b["uptime"] - a["uptime"]
    wall = b["t"] - a["t"]
    applied = (b["version"] - a["version"]) / dt
    threads_a, threads_b = a["threads"], b["threads"]
    per_thread = {tid: (threads_b[tid] - threads_a.get(tid, 0.0)) / wall for tid in threads_b}
    pid_thread = b["pid"]  # the main thread's id is the process id: the event loop's thread
    loop_cores = per_thread.get(pid_thread, 0.0)
    others = sorted((v for tid, v in per_thread.items() if tid != pid_thread), reverse=True)
    counts_a, counts_b = a["staleness_counts"], b["staleness_counts"]
    stale_n = {int(k): v - counts_a.get(k, 0) for k, v in counts_b.items()}
    stale_total = sum(stale_n.values())
    latencies: list[float] = []
    errors: list[str] = []
    statuses: dict[str, int] = {}
    answers = 0
    errors_in_window = 0
    for out in outs:
        for w in out["workers"].values():
            if w["error"]:
                errors.append(f"at {w['error_at'] - b['t']:+.1f} s from the window's end: {w['error']}")
                errors_in_window += w["error_at"] <= b["t"]
            for sent, answered, status, _, _, _ in w["answers"]:
                answers += 1
                statuses[status] = statuses.get(status, 0) + 1
                if a["t"] <= answered <= b["t"]:
                    latencies.append(answered - sent)
    stats = {k: b["stats"][k] - a["stats"][k] for k in b["stats"]}
    updates = max(1, b["version"] - a["version"])
    # CPU per update of the event-loop thread and of the busiest other (the apply thread): the
    # busier one bounds the rate the coordinator can sustain when each of its threads has a
    # core; unlike the applied rate, other load on this shared box barely moves it
    loop_ms = 1e3 * loop_cores * wall / updates
    apply_ms = 1e3 * (others[0] if others else 0.0) * wall / updates
    adm_a, adm_b = a["admission"], b["admission"]
    span = max(1, b["machine"][1] - a["machine"][1])
    busy = (b["machine"][0] - a["machine"][0]) / span
    stolen = (b["machine"][2] - a["machine"][2]) / span if len(b["machine"]) > 2 else math.nan
    return {
        "codec": codec, "workers": n, "processes": len(counts), "per_process": counts,
        "offered_per_s": rate, "applied_per_s": applied, "window_s": dt,
        "updates_in_window": b["version"] - a["version"], "stats_in_window": stats,
        "connected": [a["connected"], b["connected"]],
        "mean_staleness": sum(k * v for k, v in stale_n.items()) / stale_total if stale_total else 0.0,
        "max_staleness": max((k for k, v in stale_n.items() if v), default=0),
        "latency_ms": 1e3 * sum(latencies) / len(latencies) if latencies else math.nan,
        "answers_in_window": len(latencies),
        "coordinator_cpu_cores": (b["cpu"] - a["cpu"]) / wall,
        "cpu_ms_per_update": 1e3 * (b["cpu"] - a["cpu"]) / max(1, b["version"] - a["version"]),
        "event_loop_cores": loop_cores, "busiest_other_thread_cores": others[0] if others else 0.0,
        "loop_ms_per_update": loop_ms, "apply_ms_per_update": apply_ms,
        "capacity_per_s": 1e3 / max(loop_ms, apply_ms, 1e-9),
        "threads": len(threads_b),
        "workers_cpu_cores": (b["workers_cpu"] - a["workers_cpu"]) / wall,
        "machine_busy_cores": busy * (os.cpu_count() or 1),
        "machine_stolen_cores": stolen * (os.cpu_count() or 1),
        "rss_mb": {"idle": idle.get("VmRSS", math.nan), "after_warmup": a["memory"]["VmRSS"],
                   "end": b["memory"]["VmRSS"]},
        "hwm_mb": {"idle": idle.get("VmHWM", math.nan), "after_warmup": a["memory"]["VmHWM"],
                   "end": b["memory"]["VmHWM"]},
        "model_mb": b["raw_bytes_per_step"] / 2**20,
        "wire_bytes_per_gradient": outs[0]["wire_bytes"] if outs else 0,
        "answer_bytes_mean": b["answer_bytes"],
        "join_s": joined_s, "answers_total": answers, "statuses_total": statuses,
        "worker_errors": errors[:5], "worker_error_count": len(errors),
        "worker_errors_before_window_end": errors_in_window,
        "window_monotonic": [a["t"], b["t"]],
        # the coordinator's bound on gradients received and not yet applied: its counters at the
        # window's end, and the gradients that waited for room during the window (> 0: the
        # offered load was more than the coordinator took, so its capacity is what is measured)
        "admission": b["admission"],
        "admission_waited_in_window": adm_b["waited"] - adm_a["waited"],
        "admission_admitted_in_window": adm_b["admitted"] - adm_a["admitted"],
        # the shared downlink's published tracks (each O(model): its published weights, a log
        # of at most the model's size, a snapshot) at the window's end: a worker that lags far
        # is answered from a coarser track, so more workers (more lag) use more of them
        "downlink_tracks": b["downlink"]["tracks"], "downlink_log_mb": b["downlink"]["log_bytes"] / 2**20,
        "downlink_answers_in_window": {k: v - a["downlink"]["answers"].get(k, 0)
                                       for k, v in b["downlink"]["answers"].items()},
        "downlink_switches_in_window": b["downlink"]["switches"] - a["downlink"]["switches"],
        "downlink_per_track": b["downlink"]["per_track"],
        "snapshots_held_mb": b["snapshots_held_mb"],
        "snapshots_withheld_in_window": b["snapshots_withheld"] - a["snapshots_withheld"],
        "memory_released": b["allocator"],
    }


# -------------------------------------------------------------------------------- driver


#: the figures of a (codec, N) that the verdict takes as the median over its passes
MEDIAN_OF_PASSES = ("applied_per_s", "cpu_ms_per_update", "capacity_per_s")


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One (codec, N)'s passes as one row: the median of each pass's rate, CPU per update,
    capacity and window-median RSS (end and peak RSS alike); the rest from the last pass."""
    m = dict(rows[-1])
    for key in MEDIAN_OF_PASSES:
        m[key] = statistics.median(r[key] for r in rows)
    m["rss_mb"] = {**rows[-1]["rss_mb"], **{
        k: statistics.median(r["rss_mb"][k] for r in rows) for k in ("window_median", "end")}}
    m["hwm_mb"] = {**rows[-1]["hwm_mb"], "end": statistics.median(r["hwm_mb"]["end"] for r in rows)}
    m["passes"] = len(rows)
    return m


def derive(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per codec: apply rate relative to N=4, RSS slope per added worker from N=4 on.

    Each row's own ratios are to N=4 in the same pass; the verdict is on the median over the
    passes of each N's rate, capacity, CPU per update and RSS."""
    out: dict[str, Any] = {}
    for codec in dict.fromkeys(r["codec"] for r in rows):
        ours = [r for r in rows if r["codec"] == codec]
        for r in ours:
            ref_row = next((x for x in ours if x["workers"] == 4 and x["pass"] == r["pass"]), None)
            _ratios(r, ref_row)
        by_n: dict[int, list[dict[str, Any]]] = {}
        for r in ours:
            by_n.setdefault(r["workers"], []).append(r)
        mine = {n: _median_rows(rs) for n, rs in sorted(by_n.items())}
        ref = mine.get(4)
        for r in mine.values():
            _ratios(r, ref)
        big = max(mine)
        d: dict[str, Any] = {"largest": big, "passes": {n: len(rs) for n, rs in by_n.items()},
                             "median": {n: {k: r[k] for k in (*MEDIAN_OF_PASSES, "rate_vs_4",
                                                              "capacity_vs_4", "cpu_per_update_vs_4")}
                                        | {"rss_window_median_mb": r["rss_mb"]["window_median"]}
                                        for n, r in mine.items()},
                             "per_pass_applied_per_s": {n: [r["applied_per_s"] for r in rs]
                                                        for n, rs in by_n.items()}}
        if ref is not None and big > 4:
            # the steady state: the median of the window's samples, which one allocator move at
            # the window's end (glibc keeps up to 128 MB freed) does not swing
            slope = (mine[big]["rss_mb"]["window_median"] - ref["rss_mb"]["window_median"]) / (big - 4)
            end_slope = (mine[big]["rss_mb"]["end"] - ref["rss_mb"]["end"]) / (big - 4)
            hwm_slope = (mine[big]["hwm_mb"]["end"] - ref["hwm_mb"]["end"]) / (big - 4)
            model = mine[big]["model_mb"]
            # what a worker with a gradient in flight can hold there: the gradient received and
            # waiting for the apply thread, and the answer waiting to be sent
            in_flight = (mine[big]["wire_bytes_per_gradient"] + mine[big]["answer_bytes_mean"]) / 2**20
            spread = [mine[k]["rate_vs_4"] for k in mine if k >= 4]
            capacity = [mine[k]["capacity_vs_4"] for k in mine if k >= 4]
            # how far one N's passes sit apart (max / min applied/s): the box's noise on one figure
            noise = [max(x) / min(x) - 1 for x in d["per_pass_applied_per_s"].values()
                     if len(x) > 1 and min(x) > 0]
            d.update({
                "rss_slope_mb_per_worker": slope, "rss_slope_fraction_of_model": slope / model,
                "rss_end_slope_mb_per_worker": end_slope,
                "hwm_slope_mb_per_worker": hwm_slope,
                "gradient_answer_mb": in_flight,
                "rate_min_vs_4": min(spread), "rate_max_vs_4": max(spread),
                "cpu_per_update_max_vs_4": max(mine[k]["cpu_per_update_vs_4"] for k in mine if k >= 4),
                "rate_within_tolerance": all(abs(x - 1) <= RATE_TOLERANCE for x in spread),
                # the bar read one way only: no count slower than N=4 by more than the tolerance
                # (a rise comes from the downlink: lagging workers move to coarser tracks,
                # published less often, so the apply thread's cost per update falls with N)
                "rate_not_slower": min(spread) >= 1 - RATE_TOLERANCE,
                "capacity_min_vs_4": min(capacity), "capacity_max_vs_4": max(capacity),
                "capacity_within_tolerance": all(abs(x - 1) <= RATE_TOLERANCE for x in capacity),
                "rss_within_target": slope / model <= RSS_FRACTION,
                "pass_spread_max": max(noise) if noise else math.nan,
            })
        out[codec] = d
    return out


def _ratios(r: dict[str, Any], ref: dict[str, Any] | None) -> None:
    """``r``'s rate, CPU per update and capacity relative to ``ref`` (N=4), and its RSS per worker."""
    r["rate_vs_4"] = r["applied_per_s"] / ref["applied_per_s"] if ref else math.nan
    r["cpu_per_update_vs_4"] = r["cpu_ms_per_update"] / ref["cpu_ms_per_update"] if ref else math.nan
    r["capacity_vs_4"] = r["capacity_per_s"] / ref["capacity_per_s"] if ref else math.nan
    rss = r["rss_mb"]
    r["rss_growth_per_worker_mb"] = (rss["window_median"] - rss["idle"]) / r["workers"]


def pass_orders(counts: list[int], passes: int) -> list[list[int]]:
    """The order of the worker counts in each pass: ascending, then descending, and so on, so
    that a drift in the machine's other load over a codec's passes weighs on every N alike
    (with two passes, N=4 and N=64 are measured once early and once late)."""
    up = sorted(counts)
    return [up if p % 2 == 0 else up[::-1] for p in range(passes)]


def run(codecs: list[str], counts: list[int], rate: float, per_process: int, quick: bool,
        inflight: int = 1, passes: int = 1, timing: Timing | None = None,
        model: str = "bench", pin: bool = True) -> dict[str, Any]:
    timing = timing or Timing.of(quick)
    split = split_cpus(pin)
    res: dict[str, Any] = {"machine": machine(), "quick": quick, "warm_s": timing.warm_s,
                           "window_s": timing.window_s, "resume_warm_s": timing.resume_warm_s,
                           "offered_per_s": rate, "per_process": per_process,
                           "inflight": inflight, "passes": passes, "interleaved": True,
                           "rows": [], "stopped": [],
                           "cpus": None if split is None else {"coordinator": sorted(split[0]),
                                                               "others": sorted(split[1])}}
    with tempfile.TemporaryDirectory(prefix="swarm-scale-") as d, on_cpus(split and split[1]):
        for codec in codecs:
            rows, stopped = measure_codec(codec, counts, passes, rate, per_process, timing, Path(d),
                                          inflight, model, split and split[0])
            for r in rows:
                _print_row(r, rate)
            res["rows"] += rows
            res["stopped"] += stopped
    res["derived"] = derive(res["rows"])
    return res


def _print_row(r: dict[str, Any], rate: float) -> None:
    print(f"   {r['codec']}, N={r['workers']}, pass {r['pass']}: applied {r['applied_per_s']:.1f}/s "
          f"of {rate:.0f}/s offered (capacity "
          f"{r['capacity_per_s']:.1f}/s: loop {r['loop_ms_per_update']:.0f} ms, apply "
          f"{r['apply_ms_per_update']:.0f} ms per update); latency "
          f"{r['latency_ms']:.0f} ms; staleness {r['mean_staleness']:.1f}; RSS "
          f"{r['rss_mb']['idle']:.0f} -> {r['rss_mb']['end']:.0f} MB; coordinator "
          f"{r['coordinator_cpu_cores']:.2f} cores, workers "
          f"{r['workers_cpu_cores']:.2f}, machine {r['machine_busy_cores']:.2f}"
          + (f"; {r['worker_error_count']} worker errors: {r['worker_errors'][:1]}"
             if r["worker_error_count"] else ""), flush=True)


def _warnings(row: dict[str, Any], coordinator: bool) -> int:
    return sum(v["count"] for k, v in row["log_warnings"].items()
               if k.startswith("coordinator") == coordinator)


def _ratio(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "-"


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else ("**yes**" if ok else "**no**")


def _answers(row: dict[str, Any]) -> str:
    """Mean answer MB (chains / full weights / moves between tracks in the window)."""
    a = row.get("downlink_answers_in_window")
    if a is None:  # (results written before these were recorded)
        return f"{row['answer_bytes_mean'] / 2**20:.1f}"
    return (f"{row['answer_bytes_mean'] / 2**20:.1f} ({a['chain']} / {a['full']} / "
            f"{row['downlink_switches_in_window']})")


def _released(row: dict[str, Any]) -> str:
    """Freed memory given back by the window's end, MB (releases)."""
    m = row.get("memory_released") or {}
    if "released_mb" not in m:  # (results written before it was recorded)
        return "-"
    return f"{m['released_mb']:.0f} ({m['releases']})"


def _busy(row: dict[str, Any]) -> str:
    """The machine's busy cores (stolen by the hypervisor)."""
    stolen = row.get("machine_stolen_cores", math.nan)  # (not in results before 2026-12-07)
    return f"{row['machine_busy_cores']:.2f}" + (f" ({stolen:.2f})" if math.isfinite(stolen) else "")


def _cpu_list(cpus: list[int]) -> str:
    return ", ".join(str(c) for c in cpus)


def _last_window(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (codec, N)'s last window, in the order of the rows' first windows: a cluster's join
    and its errors and warnings over the whole run are in every row of it."""
    last = {(r["codec"], r["workers"]): r for r in rows}
    return list(last.values())


def _method(res: dict[str, Any]) -> str:
    """How the windows were taken."""
    if not res.get("interleaved"):  # (results written before 2026-12-07)
        return (f"After all N joined and a {res['warm_s']:.0f} s warm-up, a "
                f"{res['window_s']:.0f} s window, one cluster at a time. ")
    cpus = res.get("cpus")
    pinned = ("Unpinned: the coordinator, the light workers and this driver share every CPU. "
              if not cpus else
              f"Pinned: every coordinator on CPU {_cpu_list(cpus['coordinator'])} (both its busy "
              "threads, the event loop and the apply thread, on that one core), the light "
              f"workers and this driver on CPU {_cpu_list(cpus['others'])}, as if the workers "
              "were other machines: what the load generator costs (64 connections reading "
              "answers) does not take the coordinator's core, so the rate is the coordinator's "
              "CPU per update on one core, not its share of a saturated box. (The light-worker "
              "processes keep two answer buffers per worker: with a real worker's pool, one "
              "connection's worth, half of a 64-worker run's answers landed in fresh pages and "
              "the load generator's CPU per answer doubled against 4 workers.) ")
    return pinned + (
        "Interleaved: for each codec, one cluster per N (its coordinator and light workers) is "
        f"started and joined (all N connected, a {res['warm_s']:.0f} s warm-up and gradients "
        "applied for every worker), then paused with `swarmtrain ctl pause` (the light workers "
        "stop sending, as real workers stop stepping; what is in flight is answered). Then the "
        f"passes: each resumes one N's cluster, waits {res['resume_warm_s']:.0f} s and until "
        "every worker of it has had one more gradient applied (its queue of gradients has gone "
        f"round once), takes a {res['window_s']:.0f} s window and pauses it again until its "
        "version stops moving, while the other clusters stay connected and paused (heartbeats "
        "only). The N are thus measured a few seconds apart, and the machine's drift weighs on "
        "all of them alike; no join or shutdown falls in a window. ")


def _isolation(res: dict[str, Any]) -> str:
    """Whether the paused clusters stayed quiet through the others' windows."""
    if not res.get("interleaved"):
        return ""
    leaked = sum(r["other_clusters_answers_in_window"] for r in res["rows"])
    return (f". Answers read by the paused clusters inside another cluster's window: {leaked} "
            "in all" + ("" if leaked == 0 else " (**the windows were not of one N alone**)"))


def to_markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    first = res["rows"][0]
    rows = []
    for r in res["rows"]:
        rows.append([
            r["codec"], r["workers"], r["pass"], f"{r['offered_per_s']:.0f}", r["applied_per_s"],
            f"{r['rate_vs_4']:.2f}" if math.isfinite(r["rate_vs_4"]) else "-",
            r["cpu_ms_per_update"],
            f"{r['cpu_per_update_vs_4']:.2f}" if math.isfinite(r["cpu_per_update_vs_4"]) else "-",
            f"{r['capacity_per_s']:.1f} ({r['loop_ms_per_update']:.0f} / {r['apply_ms_per_update']:.0f})",
            f"{r['capacity_vs_4']:.2f}" if math.isfinite(r["capacity_vs_4"]) else "-",
            r["latency_ms"], f"{r['mean_staleness']:.1f} (max {r['max_staleness']})",
            " / ".join(f"{r['rss_mb'][k]:.0f}" for k in ("idle", "after_warmup", "window_median", "end")),
            f"{r['hwm_mb']['end']:.0f}", r["rss_growth_per_worker_mb"],
            f"{r['coordinator_cpu_cores']:.2f} ({r['event_loop_cores']:.2f} / "
            f"{r['busiest_other_thread_cores']:.2f})",
            f"{r['workers_cpu_cores']:.2f}",
            _busy(r),
            f"{r['admission']['peak_held_bytes'] / 2**20:.0f} / {r['admission']['limit_bytes'] / 2**20:.0f}",
            f"{r['admission_waited_in_window']} of {r['admission_admitted_in_window']}",
            f"{r['downlink_tracks']} / {r['downlink_log_mb']:.0f}",
            _answers(r),
            f"{r['snapshots_held_mb']:.0f} ({r['snapshots_withheld_in_window']})",
            _released(r),
        ])
    medians = []
    for codec, d in res["derived"].items():
        for n, mr in d["median"].items():
            medians.append([
                codec, n, " / ".join(f"{x:.1f}" for x in d["per_pass_applied_per_s"][n]),
                f"{mr['applied_per_s']:.1f}", _ratio(mr["rate_vs_4"]),
                f"{mr['cpu_ms_per_update']:.1f}", _ratio(mr["cpu_per_update_vs_4"]),
                f"{mr['capacity_per_s']:.1f}", _ratio(mr["capacity_vs_4"]),
                f"{mr['rss_window_median_mb']:.0f}"])
    verdict = []
    for codec, d in res["derived"].items():
        if "rss_slope_mb_per_worker" not in d:
            verdict.append([codec, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        verdict.append([
            codec, f"{d['rate_min_vs_4']:.2f} .. {d['rate_max_vs_4']:.2f}",
            _yes(d["rate_within_tolerance"]), _yes(d.get("rate_not_slower")),
            f"{d['capacity_min_vs_4']:.2f} .. {d['capacity_max_vs_4']:.2f}",
            _yes(d["capacity_within_tolerance"]), f"{d['cpu_per_update_max_vs_4']:.2f}",
            f"{d['rss_slope_mb_per_worker']:.1f} ({d['rss_end_slope_mb_per_worker']:.1f})",
            f"{d['rss_slope_fraction_of_model']:.1%}",
            _yes(d["rss_within_target"]), f"{d['gradient_answer_mb']:.1f}",
            f"{d['pass_spread_max']:.0%}" if math.isfinite(d["pass_spread_max"]) else "-",
        ])
    return "\n".join([
        "## One coordinator, many workers (`benchmarks/bench_scale.py`)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average at start "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg'])} (shared machine). Model: bench_apply.py's "
        f"textlm (context 128, d_model 320, 8 heads, 8 layers; {first['model_mb']:.1f} MB in fp32). "
        "One coordinator process (the real `Coordinator`, 127.0.0.1, cluster secret, evaluation "
        "off, no checkpoints, `OMP_NUM_THREADS=1` and 1 torch thread, `max_staleness` "
        "100000 so that every gradient is applied) and N light workers, up to "
        f"{res['per_process']} per asyncio process, registering for real and sending a real "
        "compressed gradient of the model (one forward/backward on a textlm batch of 8, "
        "compressed and packed once, re-sent with a new msg_id and the last answer's version), "
        f"at most {res['inflight']} in flight per worker (as a worker's `training.max_inflight`), "
        f"{res['offered_per_s']:.0f} gradients/s offered in total. "
        "Every answer is read off the socket, none applied. "
        + _method(res) +
        "In each window: applied/s from the coordinator's version and uptime; staleness from its counts; "
        "latency = gradient sent -> answer read, mean over the window's answers; RSS = VmRSS "
        "before any worker joined / after the warm-up / the median of samples every 0.5 s through "
        "the window / at the end (MB); HWM = VmHWM at the end; "
        "RSS per worker = (window median - idle) / N; coordinator CPU in cores (event-loop thread / busiest "
        "other thread, the apply thread); light workers' and the whole machine's busy cores "
        "(2 cores: near 2.0 the box, not the coordinator, is the limit; in brackets the time "
        "the hypervisor gave this machine's CPUs to something else while they had work, part of "
        "busy). Coordinator CPU ms per "
        "update = its CPU time in the window / updates applied: the cost per update, which other "
        "load on the machine moves less than the rate (when the machine is busy the coordinator "
        "gets less than the core it could use, and the rate shows the machine). Capacity = "
        "1000 / the CPU ms per update of the coordinator's busier thread (event loop / apply "
        "thread, ms per update in brackets): the rate it sustains when each of its threads has a "
        "core; if it fell with N the coordinator itself would slow down as workers are added, "
        "whatever the machine's other load. Admission = the coordinator's bound on gradients "
        "received and not yet applied (`network.max_held_gradient_mb`, default twice the largest "
        "gradient): "
        "peak MB held / the bound, and gradients that waited for room / all admitted in the "
        "window (waits: the workers offered more than it took, so its capacity, not the offered "
        "load, is what is measured). Downlink tracks = the shared update log's published tracks in "
        "use (intervals 1, 4, 16, 64 versions; a worker lagging far is answered from a coarser "
        "one), each O(model): its published weights, a log of at most the model's size and a "
        "snapshot (a lossless codec: the snapshot alone); at most four whatever N, and a coarse "
        "one no connected worker is on is dropped, so more workers (more lag) move the tracks in "
        "use to coarser ones rather than adding to them; with a lossy downlink a worker answered "
        "on average at least a coarser track's interval apart joins it when other workers are on "
        "it, so workers alike share one. "
        "Snapshots held = the MB of copies of the "
        "weights (a lossless track's snapshots, every track's full answers) that answers still "
        "being sent and the downlink hold at the window's end, at most 4 copies whatever N "
        "(`MAX_HELD_SNAPSHOTS`); in brackets the answers in the window that said \"no change\" "
        "because that many were held. Answer MB = the mean bytes of an answer (the workers' "
        "`bytes_down_per_step`), and the window's answers that were chains of log entries / the "
        "full weights / moves to another track (each a full answer). The answers' size, and with "
        "it the event loop's cost, follows each worker's lag against the tracks' intervals: an "
        "fp16 entry is half the weights, so a chain of two is as large as the weights; a worker "
        "the weights go to anyway is put on the coarsest track whose interval is at most its lag, "
        "where one entry covers it (at the cost of up to that interval's staleness). "
        "Freed MB given back = memory malloc held free and resident that the coordinator returned "
        "to the system by the window's end (`FreedMemory`: checked every 5 s, released once the "
        "resident set outgrew malloc's use by twice the model's size since the last release; "
        "the joins of many workers at once leave such memory). MB = 2^20 bytes.",
        "",
        md_table(["codec", "N", "pass", "offered/s", "applied/s", "vs N=4", "coordinator CPU ms / update",
                  "vs N=4", "capacity /s (loop / apply ms)", "vs N=4", "latency ms", "staleness",
                  "RSS MB idle / warm / window median / end", "HWM MB", "RSS per worker MB",
                  "coordinator cores (loop / apply)", "workers cores", "machine cores (stolen)",
                  "admission peak / bound MB", "waited for room", "downlink tracks / log MB",
                  "answer MB (chains / full / moves)", "snapshots held MB (withheld)",
                  "freed MB given back (times)"], rows),
        "",
        f"Targets (#20, must-have 3): apply rate within {RATE_TOLERANCE:.0%} of N=4 from 4 to the "
        f"largest N; RSS growth per added worker (slope of the window-median RSS from N=4 to the "
        f"largest N; in brackets the slope of the end-of-window RSS, the statistic until "
        f"2026-12-06, which one allocator move swings by ~100 MB) at most {RSS_FRACTION:.0%} of the "
        f"model's fp32 size.",
        "",
        "What one worker with a gradient in flight would hold in the coordinator without its "
        "bounds: \"gradient + answer\" = its gradient received and waiting for the apply thread "
        "(bytes on the wire) and its answer waiting to be sent (mean bytes per answer, from the "
        "status). The coordinator holds neither per worker: a gradient is read off the socket "
        "only once it fits under the admission bound (shared by all workers, in arrival order), "
        "and an answer is written in 256 KiB slices as the socket drains (asyncio would copy "
        "whatever the kernel does not take at once into a buffer per connection); the answers' "
        "tensors are the shared update log's and the published snapshot, encoded once.",
        "",
        f"Each N was measured in {res['passes']} pass(es) per codec, in ascending then "
        "descending order of N (so that a drift in the machine's other load over a codec's "
        "passes weighs on every N alike); the rows above are the passes, each row's \"vs N=4\" "
        "against N=4 of the same pass. The verdict below is on each N's median over its passes "
        "(of an even number, the mean of the middle two)" + _isolation(res) + ":",
        "",
        md_table(["codec", "N", "applied/s, each pass", "median", "vs N=4", "CPU ms / update",
                  "vs N=4", "capacity /s", "vs N=4", "RSS MB (window median)"], medians),
        "",
        md_table(["codec", "rate vs N=4 (N >= 4)", "within 10 %", "none more than 10 % slower",
                  "capacity vs N=4", "within 10 %",
                  "CPU per update vs N=4, worst", "RSS MB per added worker",
                  "of model size", "within 5 %", "gradient + answer MB (unbounded)",
                  "passes of one N apart, at most (max / min - 1)"], verdict),
        "",
        *[f"**Not measured:** {x['codec']} with {x['workers']} workers: {x['why']}"
          for x in res["stopped"]],
        "",
        "Joining and leaving (outside the windows; seconds from releasing the workers to all N "
        "connected and the first update; worker errors = connections a light worker lost, with "
        "when, relative to the window's end; warnings = WARNING lines in the coordinator's / the "
        "light workers' logs, e.g. a connection silent past the heartbeat timeout; ctl = status "
        "requests that failed and were asked again):",
        "",
        md_table(["codec", "N", "join s", "worker errors (before the last window's end)",
                  "warnings coordinator / workers", "ctl retries", "first worker error"],
                 [[r["codec"], r["workers"], f"{r['join_s']:.1f}",
                   f"{r['worker_error_count']} ({r['worker_errors_before_window_end']})",
                   f"{_warnings(r, True)} / {_warnings(r, False)}", r["status_failures"],
                   (r["worker_errors"][0][:120] if r["worker_errors"] else "-")]
                  for r in _last_window(res["rows"])]),
        "",
        "Bytes per gradient on the wire: "
        + ", ".join(f"{r['codec']} {r['wire_bytes_per_gradient'] / 1e6:.1f} MB"
                    for r in {r["codec"]: r for r in res["rows"]}.values())
        + ". Offered is above applied in every row, so the coordinator's capacity is what is "
        "measured, except at N=1, where one gradient in flight leaves it idle during each round "
        "trip." if all(r["applied_per_s"] < 0.9 * r["offered_per_s"] for r in res["rows"])
        else "Bytes per gradient on the wire: see the json. **Some rows applied at least 90 % "
        "of what was offered: raise --rate, the coordinator was not saturated there.**",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="short windows, workers 1,4,16 unless --workers (smoke run, < 3 min)")
    ap.add_argument("--workers", default="", help="comma-separated worker counts (default 1,4,16,64)")
    ap.add_argument("--compression", default=",".join(CODECS),
                    help="comma-separated codecs: none,fp16,topk")
    ap.add_argument("--rate", type=float, default=200.0, help="gradients/s offered in total")
    ap.add_argument("--per-process", type=int, default=16, help="light workers per process")
    ap.add_argument("--inflight", type=int, default=INFLIGHT,
                    help="gradients in flight per light worker at most")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin the coordinators to the first half of the CPUs and the light "
                         "workers and this driver to the rest")
    ap.add_argument("--passes", type=int, default=0,
                    help="passes over the worker counts per codec, ascending then descending "
                         "(default 4, 1 with --quick); the verdict is on each N's median")
    args = ap.parse_args(argv)
    counts = [int(x) for x in (args.workers or ("1,4,16" if args.quick else "1,4,16,64")).split(",") if x]
    codecs = [c for c in args.compression.split(",") if c]
    bad = [c for c in codecs if c not in CODECS]
    if bad or not codecs:
        ap.error(f"--compression {args.compression!r}: choose from {', '.join(CODECS)}")
    passes = args.passes or (1 if args.quick else 4)
    if (not counts or min(counts) < 1 or args.rate <= 0 or args.per_process < 1 or args.inflight < 1
            or args.passes < 0):
        ap.error("--workers needs counts >= 1, --rate > 0, --per-process >= 1, --inflight >= 1, "
                 "--passes >= 1")
    start = time.perf_counter()
    res = run(codecs, counts, args.rate, args.per_process, args.quick, args.inflight, passes,
              pin=not args.no_pin)
    res["seconds"] = time.perf_counter() - start
    report("scale", res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
