"""The demo's learning-rate schedule: `swarmtrain demo` (a coordinator and 2 workers as
processes on this machine, digits, 2000 updates) with a constant learning rate and with the
default warm-up + cosine decay to 0.1 x, run alternately so that both see the same load,
optionally beside ``--load K`` busy processes (a busy CI machine).

Per run: the final held-out accuracy and loss (what the demo prints and its target checks)
and the lowest held-out accuracy the run log records from update 1400 on (a dip late in a
run is what leaves a run below the target when it lands at the end). Beside them, the same
model in one plain process at equal samples, fed as the demo's cluster feeds the coordinator:
updates alternate between two "workers", each walking its own half of the training set in
epochs, each gradient computed on the weights ``s`` updates back and its step damped by
1/s (as ``staleness_damping`` does), for s = 1 and for the demo's typical staleness.

Run: ``python benchmarks/bench_demo_lr.py [--runs N] [--load K] [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _util import machine, md_table, report

from swarmtrain.core.schedule import LRSchedule
from swarmtrain.tasks import DigitsTask

ROOT = Path(__file__).resolve().parent.parent
STEPS, BATCH, LR, LATE = 2000, 47, 3e-3, 1400


def demo(schedule: str, workdir: Path) -> dict[str, Any]:
    """One `swarmtrain demo` run; its final metrics and the run log's late minimum."""
    env = {**os.environ, "SWARMTRAIN_RUNS_DIR": str(workdir / "runs"), "COLUMNS": "120"}
    env.pop("SWARMTRAIN_SECRET", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "swarmtrain", "demo", "--lr-schedule", schedule],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    evals: list[tuple[int, float, float]] = []
    for log in (workdir / "runs").glob("*/coordinator.jsonl"):
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "metrics" and "eval" in rec:
                evals.append((rec.get("eval_version", rec["version"]), rec["eval"]["accuracy"],
                              rec["eval"]["loss"]))
    if proc.returncode not in (0, 1) or not evals:
        raise RuntimeError(f"the demo failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    late = [a for v, a, _ in evals if v >= LATE]
    return {"schedule": schedule, "exit": proc.returncode, "final_accuracy": evals[-1][1],
            "final_loss": evals[-1][2], "late_min_accuracy": min(late) if late else evals[-1][1],
            "seconds": time.monotonic() - t0}


def one_process(schedule: LRSchedule, seed: int, staleness: int) -> dict[str, float]:
    """The demo's cluster as one process sees it (see the module docstring)."""
    torch.set_num_threads(1)
    task = DigitsTask()
    data = task.load_data()
    model = task.build_model()
    probe = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    n = len(data.train)
    halves = [torch.arange(0, n // 2), torch.arange(n // 2, n)]
    gens = [torch.Generator().manual_seed(2 * seed + k) for k in (0, 1)]
    orders = [h[torch.randperm(len(h), generator=g)] for h, g in zip(halves, gens)]
    pos = [0, 0]
    history = [copy.deepcopy(model.state_dict())] * (staleness + 1)
    late = 1.0
    for step in range(STEPS):
        k = step % 2
        if pos[k] + BATCH > len(orders[k]):
            orders[k], pos[k] = halves[k][torch.randperm(len(halves[k]), generator=gens[k])], 0
        idx = orders[k][pos[k]:pos[k] + BATCH]
        pos[k] += BATCH
        probe.load_state_dict(history[-1 - staleness])
        probe.zero_grad(set_to_none=True)
        task.loss(probe, data.train.get_batch(idx)).backward()
        for p, q in zip(model.parameters(), probe.parameters()):
            p.grad = q.grad
        for group in opt.param_groups:
            group["lr"] = LR * schedule.factor(step) / max(1, staleness)
        opt.step()
        history = (history + [copy.deepcopy(model.state_dict())])[-(staleness + 1):]
        if step >= LATE and step % 20 == 19:
            late = min(late, task.evaluate(model, data)["accuracy"])
    final = task.evaluate(model, data)
    return {"final_accuracy": final["accuracy"], "final_loss": final["loss"],
            "late_min_accuracy": min(late, final["accuracy"])}


def summarize(rows: list[dict[str, Any]]) -> list[Any]:
    acc = [r["final_accuracy"] for r in rows]
    return [len(rows), statistics.mean(acc), min(acc), statistics.mean(r["final_loss"] for r in rows),
            min(r["late_min_accuracy"] for r in rows), sum(a < 0.95 for a in acc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="demo runs per schedule")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the demo")
    ap.add_argument("--staleness", type=int, default=3, help="the one-process rows' typical staleness")
    ap.add_argument("--quick", action="store_true", help="2 runs per schedule, 2 one-process seeds")
    args = ap.parse_args()
    runs, seeds = (2, 2) if args.quick else (args.runs, 8)
    t0 = time.monotonic()
    info = machine()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, list[dict[str, Any]]] = {"constant": [], "cosine": []}
    try:
        for i in range(runs):
            for schedule in results:
                with tempfile.TemporaryDirectory(prefix="bench-demo-lr-") as tmp:
                    r = demo(schedule, Path(tmp))
                results[schedule].append(r)
                print(f"demo {schedule:8s} run {i + 1}/{runs}: final {r['final_accuracy']:.4f} "
                      f"(loss {r['final_loss']:.4f}), late minimum {r['late_min_accuracy']:.4f}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    plain: dict[str, list[dict[str, float]]] = {}
    cosine = LRSchedule("cosine", STEPS, STEPS // 20, 0.1)
    for schedule, sched in (("constant", LRSchedule()), ("cosine", cosine)):
        for s in sorted({1, args.staleness}):
            plain[f"{schedule}, staleness {s}"] = [one_process(sched, seed, s) for seed in range(seeds)]
            print(f"one process {schedule}, staleness {s}: done", flush=True)
    headers = ["run", "schedule", "runs", "final accuracy mean", "final accuracy min",
               "final loss mean", "lowest accuracy from update 1400", "runs below 0.95"]
    rows = [["swarmtrain demo", s, *summarize(r)] for s, r in results.items()]
    rows += [["one process, halves alternating, damped", name, *summarize(r)] for name, r in plain.items()]
    md = (f"## The demo's learning-rate schedule (`benchmarks/bench_demo_lr.py`)\n\n"
          f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}; load average at start "
          f"{' / '.join(f'{x:.2f}' for x in info['loadavg'])}, plus {args.load} busy processes during the "
          f"demo runs. `swarmtrain demo` (2 workers, digits, {STEPS} updates of batch {BATCH}, Adam {LR}) "
          f"with `--lr-schedule constant` and with the default (warm-up over {STEPS // 20} updates, cosine "
          f"to 0.1 x at the last), alternately. One-process rows: the same model and samples, two halves "
          f"of the training set alternating, each gradient s updates stale and damped 1/s, {seeds} seeds. "
          f"\"Lowest accuracy from update 1400\": the lowest held-out accuracy of any evaluation from "
          f"update {LATE} on (the demo evaluates every second).\n\n" + md_table(headers, rows))
    report("demo_lr", {"machine": info, "load": args.load, "demo": results, "one_process": plain,
                       "seconds": time.monotonic() - t0}, md)


if __name__ == "__main__":
    main()
