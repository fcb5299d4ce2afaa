"""Robust aggregation (``training.robust``, docs/robustness.md): one attacker of five on the
digits task, for the parameter server and for peers (per-step averaging and DiLoCo).

For every mode (``none``, ``clip``, ``trimmed_mean``, ``median``) a clean run (the 4 honest
members alone) and one run per attack (``swarmtrain/testing/attackers.py``: ``scaled`` x100,
``sign_flip`` -10x, ``growing`` x1.3 per contribution, ``huge_samples`` -g claiming 2**20
samples, ``ratchet`` 1e-4 x 30**k up to 1e18), each with the same honest samples (PS: the
honest workers' applied samples reach the budget; peers: the same rounds). Cells: the final
held-out loss, its ratio to the clean run *of the same mode* (the issue's bar: within 2 %),
and the accuracy. PS runs are asynchronous, so the clean run is repeated to show its spread.

Also measured side by side: the peers' bytes and seconds per round with the gather against
the plain all-reduce, and the coordinator's cost of combining 5 slots of 1M parameters per
mode against the plain mean. Then the same on a Hugging Face ``GPT2LMHeadModel`` built from a
tiny config (2 layers, width 32, bytes of the Python standard library's source: the
conformance zoo's ``gpt2`` case, nothing downloaded), fewer modes and attacks.

Run: ``python benchmarks/bench_robust.py [--quick] [--skip-hf]`` (~10 min; quick ~4 min).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _util import machine, md_table, write_results

from swarmtrain.roles.aggregation import GradientWindow, RobustWindow, robust_combine
from swarmtrain.testing.attackers import ATTACKS, run_peers, run_ps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the conformance zoo's gpt2

MODES = ("none", "clip", "trimmed_mean", "median")


class _CaseTask:
    """A conformance-zoo case under the names the runs expect (``DigitsTask``'s)."""

    def __init__(self, name: str) -> None:
        from tests.conformance.zoo import case

        self.case = case(name)
        self._data = self.case.data()

    def build_model(self) -> Any:
        return self.case.build(0)

    def loss(self, model: Any, batch: Any) -> Any:
        return self.case.loss(model, batch)

    def load_data(self) -> Any:
        return self._data

    def evaluate(self, model: Any, data: Any) -> dict[str, float]:
        return self.case.evaluate(model, data)


def _cells(results: dict[str, dict[str, Any]], clean: str = "clean") -> list[str]:
    base = results[clean]["loss"]
    out = []
    for name, m in results.items():
        ratio = "" if name == clean else f" ({m['loss'] / base:.2f}x)"
        out.append(f"{m['loss']:.3f}{ratio} / {m['accuracy']:.3f}")
    return out


def bench_ps(repeats: int, budget: int, modes: tuple[str, ...] = MODES,
             attacks: tuple[str, ...] = ATTACKS, **run: Any) -> tuple[dict[str, Any], str]:
    data: dict[str, Any] = {}
    rows = []
    for mode in modes:
        results: dict[str, dict[str, Any]] = {}
        cleans = [run_ps(mode, None, budget=budget, **run)[0] for _ in range(repeats)]
        results["clean"] = {"loss": statistics.median(m["loss"] for m in cleans),
                            "accuracy": statistics.median(m["accuracy"] for m in cleans),
                            "runs": cleans}
        for attack in attacks:
            runs = [run_ps(mode, attack, budget=budget, **run)[0] for _ in range(repeats)]
            results[attack] = {"loss": statistics.median(m["loss"] for m in runs),
                               "accuracy": statistics.median(m["accuracy"] for m in runs), "runs": runs}
        spread = max(m["loss"] for m in cleans) / min(m["loss"] for m in cleans)
        data[mode] = results
        rows.append([mode, *_cells(results), f"{spread:.2f}x"])
        print(mode, rows[-1][1:], flush=True)
    table = md_table(["robust", "clean", *attacks, "clean max/min"], rows)
    return data, table


def bench_peers(rounds: int, mode: str, attacks: tuple[str, ...], modes: tuple[str, ...] = MODES,
                **run: Any) -> tuple[dict[str, Any], str, str]:
    data: dict[str, Any] = {}
    rows, cost_rows = [], []
    base_bytes = base_sec = 0.0
    for robust in modes:
        results: dict[str, dict[str, Any]] = {}
        for attack in (None, *attacks):
            t0 = time.perf_counter()
            m, trainers = run_peers(robust, attack, rounds=rounds, mode=mode, **run)
            sec = time.perf_counter() - t0
            same = len({b"".join(p.detach().numpy().tobytes() for p in t.strategy.params)
                        for t in trainers}) == 1
            sent = sum(t.backend.bytes_sent for t in trainers) / len(trainers) / rounds
            results[attack or "clean"] = {**m, "identical_on_every_member": same,
                                          "bytes_per_member_round": sent, "sec": sec}
            if attack is None:
                if robust == "none":
                    base_bytes, base_sec = sent, sec
                cost_rows.append([robust, f"{sent / 1e3:.0f} kB", f"{sent / base_bytes:.1f}x",
                                  f"{sec / rounds * 1e3:.0f} ms", f"{sec / base_sec:.2f}x"])
        data[robust] = results
        rows.append([robust, *_cells(results),
                     all(r["identical_on_every_member"] for r in results.values())])
        print(mode, robust, rows[-1][1:], flush=True)
    table = md_table(["robust", "clean", *attacks, "same bits everywhere"], rows)
    cost = md_table(["robust", "sent per member per round", "vs none", "wall per round (5 peers, "
                     "one process)", "vs none"], cost_rows)
    return data, table, cost


def bench_combine(numel: int = 1_000_000, slots: int = 5, iters: int = 9) -> tuple[dict[str, Any], str]:
    """Per mode, the coordinator's whole cost of one window of ``slots`` workers: each gradient
    added (``RobustWindow.add``) and the window closed (``take``: the slots' means, the
    combination and the member scores), against the plain window (``GradientWindow``) doing
    the same; beside it the combination alone."""
    gen = torch.Generator().manual_seed(0)
    members = [{"g": torch.randn(numel, generator=gen)} for _ in range(slots)]
    params = {"g": torch.zeros(numel)}

    def timed(fn: Any) -> float:  # the median call (the first one not counted)
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    plain = GradientWindow(params)  # made once: its buffers are reused window after window
    windows = {mode: RobustWindow(params, mode) for mode in MODES[1:]}

    def plain_window() -> None:
        for m in members:
            plain.add(m, 1.0, 32, sparse=False)
        plain.take()

    def robust_window(mode: str) -> None:
        win = windows[mode]
        for i, m in enumerate(members):
            win.add(f"w{i}", m, 1.0, 32, sparse=False)
        win.take()

    out: dict[str, dict[str, float]] = {"none (mean)": {"window": timed(plain_window)}}
    for mode in MODES[1:]:
        out[mode] = {"window": timed(lambda mode=mode: robust_window(mode)),
                     "combine": timed(lambda mode=mode: robust_combine(members, mode))}
    base = out["none (mean)"]["window"]
    rows = [[n, f"{t['window'] * 1e3:.1f} ms", f"{t['window'] / base:.1f}x",
             f"{t['combine'] * 1e3:.1f} ms" if "combine" in t else "-"] for n, t in out.items()]
    return out, md_table([f"one window of {slots} workers x {numel:,} float32 (adds + take)", "time",
                          "vs the plain window", "of which the combination"], rows)


def bench_spread(seeds: int = 4, rounds: int = 150) -> None:
    """How far clean per-step peer runs on digits part when only the order the samples are
    drawn in changes (the shards' seed): the noise floor under the 2 % bar. Writes
    ``results/robust_spread.md``."""
    import functools

    import swarmtrain.testing.attackers as attackers
    from swarmtrain.tasks import Shard

    started = time.time()
    rows, data = [], {}
    for robust in MODES:
        losses = []
        for seed in range(seeds):
            attackers.Shard = functools.partial(Shard, seed=seed)  # type: ignore[assignment,misc]
            losses.append(run_peers(robust, None, rounds=rounds, mode="step")[0]["loss"])
        attackers.Shard = Shard  # type: ignore[misc]
        data[robust] = losses
        rows.append([robust, ", ".join(f"{v:.3f}" for v in losses), f"{max(losses) / min(losses):.2f}x"])
        print(robust, rows[-1][1:], flush=True)
    table = md_table(["robust", f"clean held-out loss, data-order seeds 0-{seeds - 1}", "max/min"], rows)
    md = f"""# The noise floor under the robustness bar: clean runs, other data orders

`python benchmarks/bench_robust.py --spread` — {time.time() - started:.0f} s. Per-step peers on
digits ({rounds} rounds of batch 32, 4 honest peers, no attacker), only the shards' sampling seed
changed. The attacked cells of `robust.md` are compared with the seed-0 run.

{table}
"""
    print(md)
    write_results("robust_spread", {"machine": machine(), "peers_step_clean": data}, md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one PS repeat, fewer peer rounds")
    ap.add_argument("--skip-hf", action="store_true", help="no Hugging Face GPT-2 runs")
    ap.add_argument("--spread", action="store_true",
                    help="only the clean runs' spread over data orders (results/robust_spread.md)")
    args = ap.parse_args()
    logging.disable(logging.ERROR)
    torch.set_num_threads(1)
    if args.spread:
        bench_spread()
        return
    started = time.time()
    repeats, rounds = (1, 100) if args.quick else (2, 150)
    ps, ps_table = bench_ps(repeats, budget=25_600)
    step, step_table, step_cost = bench_peers(rounds, "step", ATTACKS)
    diloco, diloco_table, diloco_cost = bench_peers(max(10, rounds // 10), "diloco",
                                                    ("scaled", "sign_flip", "huge_samples"),
                                                    inner_steps=10)
    combine, combine_table = bench_combine()
    hf: dict[str, Any] = {}
    hf_md = ""
    if not args.skip_hf:
        gpt2 = _CaseTask("gpt2")
        hf_modes, hf_attacks = ("none", "clip", "median"), ("scaled", "sign_flip", "huge_samples")
        hf_budget = 6_400 if args.quick else 12_800
        hf["ps"], hf_ps = bench_ps(1, hf_budget, hf_modes, hf_attacks, batch=16, aggregate_samples=64,
                                   task=gpt2)
        hf["peers_step"], hf_step, hf_cost = bench_peers(rounds, "step", hf_attacks, hf_modes, batch=16,
                                                         task=gpt2)
        hf_rounds = max(10, rounds // 7)
        hf["peers_diloco"], hf_diloco, _ = bench_peers(hf_rounds, "diloco", hf_attacks, hf_modes, batch=16,
                                                       task=gpt2, inner_steps=10, timeout=600)
        hf_md = f"""
## Hugging Face GPT-2 (tiny config: 2 layers, width 32, 256 byte tokens, context 32)

Held-out loss is nats per byte; accuracy is next-byte accuracy. Parameter server: batch 16,
`aggregate_samples = 64`, {hf_budget:,} honest samples, one run each:

{hf_ps}

Peers, per-step averaging, {rounds} rounds of batch 16:

{hf_step}

{hf_cost}

Peers, DiLoCo ({hf_rounds} rounds of 10 inner steps of batch 16, the default outer step):

{hf_diloco}
"""
    md = f"""# Robust aggregation: one attacker of five (digits; a tiny GPT-2)

`python benchmarks/bench_robust.py{' --quick' if args.quick else ''}` — {time.time() - started:.0f} s.
Cells: final held-out loss (ratio to the clean run of the same mode) / accuracy. The bar
(issue #17): within 2 % of the clean run of the same mode.

## Parameter server

4 honest workers + 1 attacker, batch 32, `aggregate_samples = 128`, Adam lr 3e-3,
{25_600:,} honest samples; median of {repeats} runs.

{ps_table}

## Peers, per-step averaging ({rounds} rounds, batch 32, AdamW lr 3e-3)

{step_table}

{step_cost}

## Peers, DiLoCo ({max(10, rounds // 10)} rounds of 10 inner steps)

Digits is small: each peer's shard is 287 samples and a round's 10 inner steps of 32 go
through it more than once, so with the default outer step (lr 0.7, Nesterov momentum 0.9)
the clean run's held-out loss *rises* with rounds (1.01 at 15 rounds, 1.68 at 40, accuracy
staying at 0.96): these cells mostly measure overfitting, and anything that shrinks the
outer step looks better than clean. The GPT-2 DiLoCo table below (a large corpus) is the
one that measures learning.

{diloco_table}

{diloco_cost}

## Coordinator: the cost of one window

{combine_table}
{hf_md}"""
    print(md)
    write_results("robust", {"machine": machine(), "ps": ps, "peers_step": step,
                             "peers_diloco": diloco, "combine_sec": combine, "gpt2": hf}, md)


if __name__ == "__main__":
    main()
