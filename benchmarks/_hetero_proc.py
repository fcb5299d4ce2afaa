"""Child processes of ``bench_hetero.py``: a throttled standalone loop, or one DDP rank.

``plain``: the training loop a user writes without any distribution (the task's model,
``torch.optim.Adam`` at the task's learning rate, :class:`~swarmtrain.tasks.Shard` batches,
1 torch thread), throttled with the swarmtrain worker's rule (``hardware.Throttle``): after a
step's forward/backward took ``cpu`` seconds of the thread's CPU time, sleep
``cpu * (1/speed - 1)``. ``optimizer.step()`` is not stretched: in swarmtrain the optimizer runs
in the coordinator, unthrottled, so the limit a worker is measured against is its own throttled
forward/backward plus an unthrottled Adam step. Optionally waits for a "go" file so several loops
can be measured at the same time.

``ddp``: one rank of ``torch.nn.parallel.DistributedDataParallel`` (gloo, TCP store on
127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``), each rank on shard ``rank`` of ``world``, Adam on the
averaged gradient, throttled with the same rule on this rank's own compute: from the start
of the step to the moment DDP's last gradient bucket became ready (a comm hook records it;
the all-reduce starts there) -- so the time spent waiting for slower ranks or for the wire
is NOT multiplied by the throttle, and neither is ``optimizer.step()`` (as in the standalone
loop and in swarmtrain, whose Adam runs unthrottled in the coordinator).

All ranks must run the same number of steps; rank 0 decides when the measured window starts
and when training stops, and publishes the step numbers in the TCP store, which every rank
reads every ``--check-every`` steps (a boundary no rank can have passed yet, see
``_Schedule``). Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from swarmtrain.core import hardware
from swarmtrain.tasks import Shard, load_task


def _jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (the whole machine)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(vals[:8])
    return total - vals[3] - vals[4], total


def _machine_cores(a: tuple[int, int], b: tuple[int, int]) -> float:
    return (b[0] - a[0]) / max(1, b[1] - a[1]) * (os.cpu_count() or 1)


def _write(path: str, data: dict[str, Any]) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, p)


# ------------------------------------------------------------------------------------- plain


def run_plain(a: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    task = load_task(a.task)
    model = task.build_model(seed=0)
    shard = Shard(task.load_data().train, 0, 1, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=task.default_learning_rate)
    model.train()
    busy_total = [0.0, 0.0, 0.0]  # forward/backward wall s, throttle sleep s, opt.step() wall s
    accum = 1
    throttle = hardware.Throttle(a.speed)  # the swarmtrain worker's own

    def micro() -> None:
        (task.loss(model, shard.next_batch(a.batch)) / accum).backward()

    def step() -> None:
        # the throttle stretches forward/backward only, as the swarmtrain worker's does; Adam
        # runs unthrottled, as it does in swarmtrain's coordinator
        t0, cpu = time.perf_counter(), throttle.start()
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            micro()
        busy_total[0] += time.perf_counter() - t0
        busy_total[1] += throttle.pause(cpu)
        s0 = time.perf_counter()
        opt.step()
        busy_total[2] += time.perf_counter() - s0

    for _ in range(3):  # allocator and kernels warm before anyone starts the clock
        step()
    if not a.message_ms:  # the count given (the driver pins one per speed for every run)
        accum = a.accum
    else:
        # the worker's rule: its start-up probe (throttled forward + backward, timed by
        # hardware.probe_speed for the default probe_seconds), then as many micro-batches per
        # optimizer step as make one last message_ms
        def probe_step() -> int:
            cpu = throttle.start()
            opt.zero_grad(set_to_none=True)
            micro()
            throttle.pause(cpu)
            return a.batch

        rate = hardware.probe_speed(probe_step, seconds=1.0)
        accum = hardware.auto_accumulation(a.batch / rate, a.message_ms / 1000)
        opt.zero_grad(set_to_none=True)
    if a.go:
        Path(a.ready).write_text("ready")
        while not Path(a.go).exists():
            time.sleep(0.005)
    end = time.perf_counter() + a.warm
    while time.perf_counter() < end:
        step()
    busy_total[:] = [0.0, 0.0, 0.0]
    steps = 0
    j0, cpu0, t0 = _jiffies(), time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < a.window:
        step()
        steps += 1
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    machine = _machine_cores(j0, _jiffies())
    return {"speed": a.speed, "samples_per_s": steps * accum * a.batch / elapsed, "accum": accum,
            "steps_per_s": steps / elapsed, "steps": steps, "seconds": elapsed,
            "cpu_cores": cpu / elapsed, "machine_cores": machine,
            "busy_ms": 1e3 * busy_total[0] / max(1, steps),
            "sleep_ms": 1e3 * busy_total[1] / max(1, steps),
            "opt_ms": 1e3 * busy_total[2] / max(1, steps), "throttled": "forward/backward"}


# --------------------------------------------------------------------------------------- ddp


class _Schedule:
    """Step numbers rank 0 publishes in the store: ``t0_step`` (window start), ``stop_at``.

    Rank 0 fixes a value after finishing step ``i`` as the multiple of ``k`` at least ``k``
    steps ahead. Every rank reads the store before each step that is a multiple of ``k``.
    A rank can only start step ``s`` after the all-reduce of step ``s - 1`` >= i + 1, which
    needs rank 0 to have finished step ``i`` (and written the key); so every rank reads the
    value at the latest right at the step it names.
    """

    def __init__(self, store: Any, rank: int, k: int) -> None:
        self.store, self.rank, self.k = store, rank, max(1, k)
        self.values: dict[str, int] = {}

    def publish(self, key: str, done_steps: int) -> int:
        value = (done_steps // self.k + 2) * self.k
        self.store.set(key, str(value))
        self.values[key] = value
        return value

    def poll(self, step: int) -> None:
        if self.rank == 0 or step % self.k:
            return
        for key in ("t0_step", "stop_at"):
            if key not in self.values and self.store.check([key]):
                self.values[key] = int(self.store.get(key))

    def get(self, key: str) -> int | None:
        return self.values.get(key)


def _connect(a: argparse.Namespace) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    if a.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, a.world, True, timeout=timeout,
                              wait_for_workers=False)
        _write(a.store_file, {"port": store.port})
    else:
        deadline = time.monotonic() + 120
        while not Path(a.store_file).exists():
            if time.monotonic() > deadline:
                raise SystemExit("rank 0 never published the store port")
            time.sleep(0.02)
        port = json.loads(Path(a.store_file).read_text())["port"]
        store = dist.TCPStore("127.0.0.1", port, a.world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world, timeout=timeout)
    return store


def run_ddp(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    task = load_task(a.task)
    data = task.load_data()
    model = task.build_model(seed=0)
    shard = Shard(data.train, a.rank, a.world, seed=a.rank)
    store = _connect(a)
    ddp = DDP(model)
    ready = [0.0, 0.0]  # wall clock and thread CPU clock when the last bucket was ready
    throttle = hardware.Throttle(a.speed)

    def hook(state: Any, bucket: Any) -> Any:
        # buckets fire in order: the last one ends local compute (CPU autograd runs on the
        # thread that called backward, so this is the training thread's CPU clock)
        ready[:] = [time.perf_counter(), throttle.start()]
        return default_hooks.allreduce_hook(state, bucket)

    # DDP checks the annotations as objects; this module's are strings (future annotations)
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=task.default_learning_rate)
    ddp.train()
    sched = _Schedule(store, a.rank, a.check_every)
    acc = {"busy": 0.0, "opt": 0.0, "wait": 0.0, "sleep": 0.0, "n": 0}

    def step() -> None:
        t0, cpu0 = time.perf_counter(), throttle.start()
        ready[:] = [0.0, 0.0]
        opt.zero_grad(set_to_none=True)
        for _ in range(a.accum - 1):  # accumulate locally; only the last backward all-reduces
            with ddp.no_sync():
                (task.loss(ddp, shard.next_batch(a.batch)) / a.accum).backward()
        loss = task.loss(ddp, shard.next_batch(a.batch))
        (loss / a.accum).backward()
        t_bwd, cpu_bwd = time.perf_counter(), throttle.start()
        float(loss.detach())
        s0 = time.perf_counter()
        opt.step()
        s1 = time.perf_counter()
        compute_end, cpu_end = (ready[0], ready[1]) if ready[0] else (t_bwd, cpu_bwd)
        acc["busy"] += compute_end - t0
        acc["opt"] += s1 - s0
        acc["wait"] += t_bwd - compute_end
        # throttled on the CPU of its own forward/backward (to the last bucket), the worker's
        # rule; the all-reduce wait is not stretched, and neither is opt.step(), as in the
        # standalone loop and in swarmtrain's coordinator
        acc["sleep"] += throttle.sleep_for(cpu_end - cpu0)
        acc["n"] += 1

    dist.barrier()
    wall_start, start, cpu_start = time.time(), time.perf_counter(), time.process_time()
    evals: list[dict[str, float]] = []
    reached: float | None = None
    next_eval = start + a.eval_interval
    i = 0
    t0 = cpu0 = 0.0
    acc0: dict[str, float] = {}
    j0 = (0, 0)
    while True:
        sched.poll(i)
        if i == sched.get("t0_step"):
            t0, cpu0, acc0, j0 = time.perf_counter(), time.process_time(), dict(acc), _jiffies()
        if i == sched.get("stop_at"):
            break
        step()
        i += 1
        if a.rank != 0:
            continue
        now = time.perf_counter()
        if a.mode == "rate":
            if sched.get("t0_step") is None and now - start >= a.warm:
                sched.publish("t0_step", i)
            elif t0 and sched.get("stop_at") is None and now - t0 >= a.window:
                sched.publish("stop_at", i)
        elif sched.get("stop_at") is None:  # target mode: evaluate rank 0's replica
            if now >= next_eval:
                m = task.evaluate(model, data)
                t_eval = time.perf_counter() - start
                evals.append({"t": t_eval, "step": i, **m})
                next_eval = time.perf_counter() + a.eval_interval
                if reached is None and m[task.primary_metric] >= a.target:
                    reached = t_eval
                    sched.publish("stop_at", i)
            if now - start >= a.cap:
                sched.publish("stop_at", i)
    end, cpu1 = time.perf_counter(), time.process_time()
    machine = _machine_cores(j0, _jiffies()) if a.mode == "rate" else 0.0
    out: dict[str, Any] = {"rank": a.rank, "speed": a.speed, "steps": i, "wall_start": wall_start,
                           "seconds_total": end - start}
    if a.mode == "rate":
        n = max(1, acc["n"] - acc0["n"])
        steps = sched.get("stop_at") - sched.get("t0_step")  # type: ignore[operator]
        out.update({
            "window_steps": steps, "window_s": end - t0,
            "samples_per_s": a.world * a.batch * a.accum * steps / (end - t0),
            "steps_per_s": steps / (end - t0), "cpu_cores": (cpu1 - cpu0) / (end - t0),
            "machine_cores": machine,
            "busy_ms": 1e3 * (acc["busy"] - acc0["busy"]) / n,
            "wait_ms": 1e3 * (acc["wait"] - acc0["wait"]) / n,
            "sleep_ms": 1e3 * (acc["sleep"] - acc0["sleep"]) / n,
            "opt_ms": 1e3 * (acc["opt"] - acc0["opt"]) / n, "throttled": "forward/backward"})
    else:
        out.update({"evals": evals, "reached_s": reached, "target": a.target,
                    "cpu_cores": (cpu1 - cpu_start) / (end - start)})
    dist.barrier()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["plain", "ddp"])
    ap.add_argument("--task", required=True)
    ap.add_argument("--speed", type=float, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--warm", type=float, default=3.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--go", default="", help="plain: wait for this file before the warm-up")
    ap.add_argument("--ready", default="", help="plain: write this file when set up")
    ap.add_argument("--message-ms", type=float, default=0.0,
                    help="plain: micro-batches per optimizer step by the worker's rule for this "
                         "message_compute_ms (0 = one)")
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per optimizer step (ddp: no_sync for all but the last; "
                         "plain: without --message-ms)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--store-file", default="")
    ap.add_argument("--check-every", type=int, default=1)
    ap.add_argument("--mode", choices=["rate", "target"], default="rate")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--cap", type=float, default=120.0)
    ap.add_argument("--eval-interval", type=float, default=0.5)
    a = ap.parse_args(argv)
    res = run_plain(a) if a.kind == "plain" else run_ddp(a)
    _write(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
