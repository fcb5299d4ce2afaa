"""The model zoo x modes: held-out metric and samples/s of every mode against one plain
PyTorch process, at equal training samples.

The zoo and the modes are the conformance suite's (``tests/conformance/zoo.py`` and
``harness.py``, imported, not copied): Hugging Face GPT-2 (tied embeddings) and BERT built
from configs, a ResNet with BatchNorm, a frozen-backbone fine-tune, LayerDrop, an LSTM and a
bf16 MLP. Each case is trained

- in one process: ``torch.optim.Adam``, ``steps`` updates of ``batch`` samples, 1 thread;
- through the parameter server: a coordinator and 2 (and 4) workers in one process over
  loopback TCP, default settings (staleness damping on, one gradient in flight), ``steps``
  gradients of ``batch`` samples;
- in peer mode: 2 peers on loopback, ``batch / 2`` samples each per step, per-step
  averaging (``steps`` rounds) and DiLoCo (H = 10, ``steps / 10`` rounds);
- through the pipeline (``nn.Sequential`` cases): 2 stage servers, the synchronous schedule,
  ``steps`` optimizer steps of 2 micro-batches of ``batch / 2``, AdamW without decay or
  clipping; and, as its second reference, one process accumulating the same 2 micro-batches
  per step (with BatchNorm that is not one process at the whole batch).

Every mode's metric is measured on a fresh model loaded from the state the mode hands back.
samples/s is training samples over wall time, start-up included (roles connecting, peers
agreeing an epoch), with every role on 1 torch thread on this 2-core machine; "vs 1 proc"
divides by the one-process rate. ``--quick`` runs the conformance suite's sizes and skips
the 4-worker parameter server; the full run uses larger ones (GPT-2: 300 updates of 16
sequences; the others twice the suite's updates).

Run: ``python benchmarks/bench_models.py [--quick] [--cases gpt2,resnet] [--modes ps2,peer-step]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _util import machine, md_table, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conformance.harness import (
    Case,
    Outcome,
    state_problems,
    train_one_process,
    train_peer,
    train_pipeline,
    train_ps,
)
from tests.conformance.zoo import CASES, SEQUENTIAL, scaled

#: micro-batches per optimizer step in the pipeline's synchronous schedule (the harness's default)
PIPELINE_CHUNKS = 2
MODES: dict[str, Callable[[Case, Any], Outcome]] = {
    "ps2": lambda c, d: train_ps(c, d, workers=2, timeout=600),
    "ps4": lambda c, d: train_ps(c, d, workers=4, timeout=600),
    "peer-step": lambda c, d: train_peer(c, d, mode="step", timeout=600),
    "peer-diloco": lambda c, d: train_peer(c, d, mode="diloco", inner_steps=10, timeout=600),
    "pipeline": lambda c, d: train_pipeline(c, d, stages=2, chunks=PIPELINE_CHUNKS, timeout=600),
}
FULL_STEPS = {"gpt2": 300}  # others: twice the conformance suite's


def sizes(name: str, quick: bool) -> Case:
    if quick:
        return CASES[name]
    return scaled(name, steps=FULL_STEPS.get(name, 2 * CASES[name].steps))


def run(names: list[str], modes: list[str], quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for name in names:
        case = sizes(name, quick)
        data = case.data()
        ref = train_one_process(case, data)
        print(f"{name}: one process {case.metric} {ref.metrics[case.metric]:.4f}, "
              f"{ref.samples_per_sec:.0f} samples/s", flush=True)
        rows.append(_row(case, ref, ref))
        micro_ref = None
        if "pipeline" in modes and name in SEQUENTIAL:
            # what the pipeline's synchronous schedule computes: the same micro-batches
            # accumulated in one process (BatchNorm normalises each on its own)
            micro_ref = train_one_process(case, data, chunks=PIPELINE_CHUNKS)
            rows.append(_row(case, micro_ref, ref))
        for mode in modes:
            if mode == "pipeline" and name not in SEQUENTIAL:
                continue
            t0 = time.monotonic()
            try:
                out = MODES[mode](case, data)
            except Exception as exc:  # noqa: BLE001 - a mode that fails is a row of the table
                print(f"{name} {mode}: failed: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"case": name, "mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                             "steps": case.steps, "batch": case.batch_size, "metric": case.metric})
                continue
            out.mode = mode
            row = _row(case, out, ref)
            if mode == "pipeline" and micro_ref is not None:
                row["vs_micro"] = _compare(case, out, micro_ref)
            rows.append(row)
            print(f"{name} {mode}: {case.metric} {row['value']:.4f} (one process {row['reference']:.4f}), "
                  f"{row['samples_per_sec']:.0f} samples/s = {row['speed_vs_one']:.2f}x; "
                  f"{len(row['problems'])} state problem(s); {time.monotonic() - t0:.1f} s", flush=True)
    return {"machine": machine(), "quick": quick, "rows": rows}


def _row(case: Case, out: Outcome, ref: Outcome) -> dict[str, Any]:
    value, want = out.metrics[case.metric], ref.metrics[case.metric]
    return {"case": case.name, "mode": out.mode, "steps": case.steps, "batch": case.batch_size,
            "metric": case.metric, "value": value, "reference": want,
            "delta": value - want, "ratio": value / want if want else float("nan"),
            "samples": out.samples, "seconds": out.seconds, "samples_per_sec": out.samples_per_sec,
            "speed_vs_one": out.samples_per_sec / ref.samples_per_sec,
            "problems": state_problems(case, out), "extra": out.extra}


def _compare(case: Case, out: Outcome, ref: Outcome) -> str:
    """``out``'s metric against ``ref``'s: a difference for accuracy, a ratio for loss."""
    value, want = out.metrics[case.metric], ref.metrics[case.metric]
    if case.metric == "accuracy":
        return f"{value - want:+.3f}"
    return f"{value / want:.3f}x" if want else "-"


def report(res: dict[str, Any]) -> str:
    rows = []
    for r in res["rows"]:
        if "error" in r:
            rows.append([r["case"], r["mode"], f"{r['steps']}x{r['batch']}", r["metric"], "-", "-", "-", "-",
                         f"failed: {r['error']}"])
            continue
        cmp = f"{r['delta']:+.3f}" if r["metric"] == "accuracy" else f"{r['ratio']:.3f}x"
        rows.append([r["case"], r["mode"], f"{r['steps']}x{r['batch']}", r["metric"], f"{r['value']:.4f}",
                     cmp, r.get("vs_micro", "-"), f"{r['samples_per_sec']:.0f}", f"{r['speed_vs_one']:.2f}",
                     "; ".join(r["problems"])[:160] or "ok"])
    m = res["machine"]
    return "\n".join([
        "# Model zoo x modes" + (" (--quick)" if res["quick"] else ""),
        "",
        f"{m['cpu']}, {m['cores']} cores, load {m['loadavg']}, torch {m['torch']}, {m['date']}.",
        "Metric of a fresh model loaded from what each mode hands back, at the samples one process "
        "trains on (updates x batch); accuracy: difference to one process, loss: ratio to it. "
        "samples/s includes start-up; every role on 1 thread. State: missing keys, strict load, "
        "frozen parameters, BatchNorm statistics, tied weights, replicas (see "
        "tests/conformance/harness.py). The pipeline's synchronous schedule steps once per "
        f"{PIPELINE_CHUNKS} micro-batches of batch / {PIPELINE_CHUNKS}: \"vs same micro-batches\" compares "
        f"it with one process accumulating those micro-batches (the row \"one-process, {PIPELINE_CHUNKS} "
        "micro-batches\"), which BatchNorm tells apart from one process at the whole batch.",
        "",
        md_table(["case", "mode", "updates x batch", "metric", "value", "vs 1 proc", "vs same micro-batches",
                  "samples/s",
                  "speed vs 1 proc", "state"], rows),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the conformance suite's sizes, no ps4")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--modes", default="", help=f"comma-separated, of {','.join(MODES)} (default all)")
    args = ap.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = set(names) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; the zoo has {', '.join(CASES)}")
    modes = [m for m in args.modes.split(",") if m] or [m for m in MODES if not (args.quick and m == "ps4")]
    if set(modes) - set(MODES):
        ap.error(f"unknown mode(s) {sorted(set(modes) - set(MODES))}; modes: {', '.join(MODES)}")
    res = run(names, modes, args.quick)
    md = report(res)
    print(md)
    j, m = write_results("models", res, md)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
