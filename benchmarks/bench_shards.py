"""A sharded coordinator: aggregate updates/s with S = 1, 2, 4 parameter servers on a simulated
LAN, and a short real training run sharded vs not vs a plain PyTorch loop.

**The LAN.** A :class:`~swarmtrain.testing.SimulatedLAN` (network namespaces, needs root) of
S server hosts and 8 worker hosts, every host's link limited to 100 Mbit/s each way (tbf). Each
server host runs one parameter server (``_shard_load.py server``: the real Coordinator over its
group of bench_apply.py's ~10M-parameter textlm model); each worker host one light worker
(``_shard_load.py worker``): real registration with every server, then one real compressed
gradient of the model, split by the partition and sent slice by slice to every server at once,
the next only when every server has answered (one *round* = one whole-gradient update). Rounds
are offered faster than the links carry them, so the links are what is measured: with one
server its link carries every worker's gradient in and every answer out; with S servers each
carries 1/S of it. Compression: top-k (``--topk-ratio``, 0.01) up, uniform 2-bit down (the
downlink a top-k uplink gets, at 2 bits), so that the S = 1 run makes a few updates per second.
Measured: after every worker's first answered round and ``--warmup`` seconds, rounds completed
in ``--window`` seconds, summed over workers: aggregate updates/s; the ratio to S = 1; the bar
(issue 20, must-have 4): ratio >= 0.8 x S. Beside it the *fresh* rate: rounds in which every
server's answer brought newer weights (a round answered "no change" by a server updated the
model without updating the worker: its next gradient is staler). And from each server's status
at exit (``_shard_load.py server --status-file``) what its answers were over the whole run:
chains, full weights, "no change" for want of a copy (withheld), moves between downlink tracks
(each the full weights), MB per answer. (Until 2026-12-07 the server told a worker due the full
weights "no change" whenever it held as many copies of them as it may; a light worker, which
computes nothing, then came straight back, and with one server 43-61 % of the rounds counted
were such rounds: the S = 1 rate measured 5.0-5.7 updates/s of which 1.0 brought newer weights.)

**The training run** (one process, loopback TCP): digits, one worker of batch 32, 300 updates,
Adam lr 3e-3, with one coordinator, with two parameter servers, and as a plain PyTorch loop
(the same model, batches and optimizer at equal samples); held-out accuracy of each, and the
bound: sharded within 0.03 of both.

Run: ``python benchmarks/bench_shards.py [--quick] [--servers 1,2,4]`` (about 8 minutes; --quick
shortens the windows).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _util import machine, machine_jiffies, md_table, report, wait_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmtrain.testing import SimulatedLAN, netns_available
from swarmtrain.wire import Update

HERE = Path(__file__).resolve().parent
WORKERS = 8
RATE_MBIT = 100.0
#: (warm-up s, window s): full and --quick (the S = 1 run makes one or two updates per second:
#: a short window counts a few dozen rounds)
WINDOWS = {False: (20.0, 60.0), True: (10.0, 25.0)}
BAR = 0.8
QUALITY_BOUND = 0.03


def lan_run(count: int, args: argparse.Namespace, tmp: Path, follow: bool = True) -> dict[str, Any]:
    """S = ``count`` servers and 8 light workers on a 100 Mbit/s LAN: aggregate updates/s
    (``follow``: the servers follow the leader's verdicts, else each judges on its own)."""
    warm, window = WINDOWS[args.quick]
    env = {"SWARMTRAIN_SECRET": secrets.token_hex(16), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run_dir = tmp / f"s{count}{'' if follow else '-alone'}"
    run_dir.mkdir()
    codec = ["--topk-ratio", str(args.topk_ratio), "--downlink-bits", "2"]
    bound = ["--max-staleness", str(args.max_staleness)] if args.max_staleness is not None else []
    if not follow:
        bound.append("--no-follow-leader")
    with SimulatedLAN(count + WORKERS, rate_mbit=RATE_MBIT) as lan:
        addresses = [f"{lan.hosts[i].address}:7100" for i in range(count)]
        procs, ready = [], []
        for i in reversed(range(count)):  # the leader last: it polls the others
            ready.append(run_dir / f"server{i}.ready")
            procs.append(lan.hosts[i].run(
                [sys.executable, str(HERE / "_shard_load.py"), "server", "--shard", f"{i}/{count}",
                 "--servers", *addresses, "--min-workers", str(WORKERS), "--ready-file", str(ready[-1]),
                 "--status-file", str(run_dir / f"server{i}.status.json"), *codec, *bound],
                env=env, stdout=open(run_dir / f"server{i}.log", "ab"), stderr=-2))
        wait_files(ready, 180, f"S={count}: servers", procs)
        outs, started, workers = [], [], []
        for k in range(WORKERS):
            outs.append(run_dir / f"w{k}.json")
            started.append(run_dir / f"w{k}.started")
            workers.append(lan.hosts[count + k].run(
                [sys.executable, str(HERE / "_shard_load.py"), "worker", "--leader", addresses[0],
                 "--worker-id", f"w{k}", "--out", str(outs[-1]), "--started-file", str(started[-1]),
                 *codec], env=env, stdout=open(run_dir / f"w{k}.log", "ab"), stderr=-2))
        wait_files(started, 300, f"S={count}: workers' first rounds", [*procs, *workers])
        t0 = time.monotonic() + warm
        time.sleep(warm)
        busy0, total0, _ = machine_jiffies()
        time.sleep(window)
        t1 = time.monotonic()
        busy1, total1, _ = machine_jiffies()
        for w in workers:
            w.terminate()
        wait_files(outs, 60, f"S={count}: workers' results", [])
        for p in procs:
            p.terminate()
        for p in [*workers, *procs]:
            p.wait(timeout=60)
        statuses = [json.loads(f.read_text()) for f in sorted(run_dir.glob("server*.status.json"))]
    results = [json.loads(o.read_text()) for o in outs]
    errors = [r["error"] for r in results if r["error"]]
    inside = [r for res in results for r in res["rounds"] if t0 <= r[1] <= t1]
    done = len(inside)
    latencies = [a - s for s, a, *_ in inside]
    # an update is a round every server applied (none dropped its slice as staler than the bound)
    applied = sum(1 for r in inside if r[6])
    rate = applied / (t1 - t0)
    fresh_rate = sum(1 for r in inside if r[2]) / (t1 - t0)
    # per round in the window: the share of servers' answers that brought newer weights, the MB
    # a worker received, and the rounds with a full answer among them
    newer_share = sum(r[3] for r in inside) / max(done, 1)
    mb_per_round = sum(r[4] for r in inside) / max(done, 1) / 1e6
    full_rounds = sum(1 for r in inside if r[5]) / max(done, 1)
    print(f"S={count}: {rate:.2f} updates/s, {fresh_rate:.2f} answered with newer weights "
          f"({done} rounds in {t1 - t0:.1f} s, {done - applied} dropped as stale; "
          f"{'errors: ' + '; '.join(errors) if errors else 'no errors'})", flush=True)
    servers = [_server_summary(st) for st in statuses]
    for i, sv in enumerate(servers):
        print(f"   server {i}: {sv}", flush=True)
    return {"servers": count, "follow_leader": follow, "updates_per_sec": rate,
            "fresh_updates_per_sec": fresh_rate,
            "rounds": done, "stale_rounds": done - applied, "window_sec": t1 - t0,
            "mean_round_sec": sum(latencies) / len(latencies) if latencies else None,
            "newer_share": newer_share, "mb_per_round": mb_per_round, "full_round_share": full_rounds,
            # the box's busy cores in the window (all of them: the machine, not the links, is the limit)
            "machine_busy_cores": (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1),
            "gradient_wire_bytes": results[0]["wire_bytes"], "errors": errors, "server_status": servers}


def _server_summary(st: dict[str, Any]) -> dict[str, Any]:
    """What one server did over its whole run (its status at exit): answers by kind, entries
    per chain answer, MB sent per answer, CPU seconds per second up."""
    dl = st["downlink"]
    answers = dl["answers"]
    total = sum(answers.values())
    out_bytes = st["traffic"].get("bytes_out", {})
    kind = Update.TYPE.name  # (how the transport counts a message by its type)
    updates = st["traffic"].get("messages_out", {}).get(kind, 0)
    stale = {int(k): n for k, n in (st.get("staleness_counts") or {}).items()}
    return {"version": st["version"], "answers": answers,
            "mean_staleness": sum(k * n for k, n in stale.items()) / max(sum(stale.values()), 1),
            "entries_per_chain": dl["entries_sent"] / max(answers.get("chain", 0), 1),
            "tracks": [(t["interval"], t["entries"]) for t in dl.get("tracks", [])],
            "switches": dl.get("switches"), "forgotten": dl.get("forgotten"),
            "resets": [(t["interval"], t["resets"]) for t in dl.get("tracks", [])],
            "mb_out_per_answer": out_bytes.get(kind, 0) / max(updates, 1) / 1e6,
            "mb_out": sum(out_bytes.values()) / 1e6, "answers_total": total,
            "cpu_per_sec": st["cpu_sec"] / max(st["uptime_sec"], 1e-9),
            "stale": st.get("stale"), "verdicts": st.get("verdicts")}


def training_run(steps: int = 300) -> dict[str, float]:
    """Digits, one worker of batch 32, ``steps`` updates: S = 1, S = 2 and a plain loop."""
    import torch

    from swarmtrain.config import load_coordinator_config, load_worker_config
    from swarmtrain.roles.ps.cluster import shard_of_model
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.roles.ps.partition import ServerSpec
    from swarmtrain.roles.ps.randomness import worker_seed
    from swarmtrain.roles.ps.worker import Worker
    from swarmtrain.tasks import DigitsTask, Shard

    task, secret, lr = DigitsTask(), b"bench-shards", 3e-3
    data = task.load_data()

    def server(spec: ServerSpec, servers: tuple[str, ...]) -> Coordinator:
        leader = spec.leader
        cfg = load_coordinator_config(overrides={
            "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
            "training.learning_rate": lr, "training.eval_interval_sec": 3600.0,
            "training.max_steps": steps if leader else 0, "training.min_workers": 1})
        model = task.build_model()
        if spec.count == 1:
            return Coordinator(model, cfg, evaluate=lambda m: task.evaluate(m, data),
                               task_name="digits", secret=secret)
        part, place = shard_of_model(model, spec, servers)
        return Coordinator(part, cfg, task_name="digits", secret=secret, cluster=place,
                           evaluate=(lambda m: task.evaluate(m, data)) if leader else None,
                           eval_model=copy.deepcopy(model) if leader else None)

    async def swarm(count: int) -> float:
        others = [server(ServerSpec(i, count), ()) for i in range(1, count)]
        for c in others:
            await c.start()
        leader = server(ServerSpec(0, count),
                        ("127.0.0.1:1", *(f"127.0.0.1:{c.port}" for c in others)) if count > 1 else ())
        await leader.start()
        wcfg = load_worker_config(overrides={
            "network.coordinator_port": leader.port, "hardware.num_threads": 1,
            "training.batch_size": 32, "training.accumulation_steps": 1, "training.probe_seconds": 0.0,
            "training.worker_id": "w0", "network.reconnect_attempts": 0})
        w = Worker(task.build_model(), task.loss, data.train, wcfg, task_name="digits", secret=secret)
        try:
            run = asyncio.create_task(w.run_async())
            await asyncio.wait_for(leader.run(), 300)
            await asyncio.wait_for(run, 60)
        finally:
            for c in [leader, *others]:
                await c.close()
        return float(leader.metrics["accuracy"])

    def plain() -> float:
        model = task.build_model()
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        shard = Shard(data.train, 0, 1, seed=worker_seed(0, 0, 1, "w0"))
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            task.loss(model, shard.next_batch(32)).backward()
            opt.step()
        return float(task.evaluate(model, data)["accuracy"])

    out = {"plain_loop": plain(), "one_server": asyncio.run(swarm(1)), "two_servers": asyncio.run(swarm(2))}
    print("digits held-out accuracy: " + ", ".join(f"{k} {v:.4f}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter warm-up and window")
    ap.add_argument("--servers", default="1,2,4", help="comma-separated S values (S = 1 first)")
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--skip-training", action="store_true", help="the LAN part only")
    ap.add_argument("--max-staleness", type=int, default=None,
                    help="the servers' (default: every gradient applied); results go to "
                    "shards-staleness<N>.md")
    ap.add_argument("--compare-alone", action="store_true",
                    help="run every S > 1 a second time with cluster.follow_leader = false (each server "
                    "judges staleness on its own), side by side")
    args = ap.parse_args()
    counts = [int(s) for s in args.servers.split(",")]
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"needs network namespaces (root): {why}")
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(s, True) for s in counts] + [(s, False) for s in counts if args.compare_alone and s > 1]
        lan = [lan_run(s, args, Path(tmp), follow) for s, follow in runs]
    one = next((r for r in lan if r["servers"] == 1), None)
    for r in lan:
        r["bar"] = BAR * r["servers"]
        for key, rate in (("", "updates_per_sec"), ("fresh_", "fresh_updates_per_sec")):
            ratio = r[rate] / one[rate] if one and one[rate] else None
            r[f"{key}ratio_to_one"] = ratio
            r[f"{key}meets_bar"] = ratio is not None and ratio >= r["bar"]
        sv = r["server_status"]
        answers = sum(x["answers_total"] for x in sv)
        r["withheld_share"] = sum(x["answers"].get("withheld", 0) for x in sv) / max(answers, 1)
        r["full_share"] = sum(x["answers"].get("full", 0) for x in sv) / max(answers, 1)
        r["switches"] = sum(x["switches"] or 0 for x in sv)
        r["mb_out_per_answer"] = sum(x["mb_out_per_answer"] for x in sv) / max(len(sv), 1)
        r["mean_staleness"] = sum(x["mean_staleness"] for x in sv) / max(len(sv), 1)
    quality = {} if args.skip_training else training_run()
    warm, window = WINDOWS[args.quick]

    def ratio(r: dict[str, Any], key: str) -> str:
        met = "" if r[f"{key}meets_bar"] else " **(no)**"
        return f"{r[f'{key}ratio_to_one']:.2f}{met}" if r[f"{key}ratio_to_one"] is not None else "-"

    rows = [[r["servers"] if r.get("follow_leader", True) else f"{r['servers']}, each alone",
             f"{r['updates_per_sec']:.2f}", ratio(r, ""), f"{r['fresh_updates_per_sec']:.2f}",
             ratio(r, "fresh_"), f"{r['bar']:.1f}", r["rounds"],
             f"{100 * r['stale_rounds'] / max(r['rounds'], 1):.0f} %",
             f"{r['mean_round_sec']:.2f} s" if r["mean_round_sec"] else "-",
             f"{100 * r['newer_share']:.0f} %", f"{r['mb_per_round']:.2f}",
             f"{100 * r['full_round_share']:.1f} %", f"{r['mean_staleness']:.1f}",
             f"{100 * r['withheld_share']:.0f} %", f"{100 * r['full_share']:.0f} %", r["switches"],
             f"{r['mb_out_per_answer']:.2f}", f"{r['machine_busy_cores']:.2f}",
             f"{sum(x['cpu_per_sec'] for x in r['server_status']):.2f}"] for r in lan]
    md = (
        "## A sharded coordinator (`benchmarks/bench_shards.py`)\n\n"
        f"{WORKERS} light workers and S parameter servers, each on its own host of a simulated LAN "
        f"(network namespaces, every link {RATE_MBIT:g} Mbit/s each way), bench_apply.py's 10.1 M-parameter "
        f"textlm model, top-k {args.topk_ratio:g} up ({lan[0]['gradient_wire_bytes'] / 1e6:.2f} MB per "
        "gradient) and uniform 2-bit deltas down; a worker sends every server its slice of a real "
        "gradient at once and the next gradient once all have answered. Updates/s = whole-gradient "
        f"updates completed by all workers in a {window:g} s window after {warm:g} s of warm-up "
        f"({'--quick' if args.quick else 'full'} run), "
        + ("every gradient applied (the servers' max_staleness above any staleness reached)"
           if args.max_staleness is None else
           f"with the servers' max_staleness at {args.max_staleness}: a round some server dropped as "
           "staler than that (*dropped stale*) is no update")
        + f". Bar (issue 20): ratio to S = 1 >= {BAR} x S. "
        + ("The servers follow the leader's verdict on every gradient (cluster.follow_leader, the "
           "default since 2026-12-08): a gradient is dropped on every server or on none; *each alone*: "
           "each server judges staleness on its own (follow_leader = false). "
           if args.compare_alone else "")
        + "*Fresh*: rounds in which every server's answer brought newer weights; the others were "
        "answered \"no change\" (mostly *withheld*: the weights were due in full, and the server "
        "already held as many copies of them for answers still on its link as it may, or the "
        "worker's downlink track had not published since). In the window, per round: the share of "
        "servers' answers that brought newer weights, the MB a worker received (all servers' "
        "answers), and the rounds with a full answer among them. The last columns are each server's "
        "whole run (its status at exit), averaged or summed over servers: the mean staleness of the "
        "gradients it applied (versions), answers withheld and full, workers moved between downlink "
        "tracks (each with the full weights), MB per answer. Then the machine's busy cores in the "
        f"window (of {os.cpu_count()}: near all of them, the box, not the links, is the limit) and the "
        "servers' CPU in cores, summed (their whole run).\n\n"
        + md_table(["S", "updates/s", "ratio to S=1", "fresh updates/s", "fresh ratio", "bar", "rounds",
                    "dropped stale", "mean round", "answers newer", "MB in / round", "rounds with full",
                    "staleness", "withheld", "full", "track moves", "MB/answer", "box busy cores",
                    "servers' cores"],
                   rows) + "\n")
    if quality:
        gap = max(abs(quality["two_servers"] - quality["one_server"]),
                  abs(quality["two_servers"] - quality["plain_loop"]))
        md += ("\nDigits, one worker of batch 32, 300 updates, Adam lr 3e-3, held-out accuracy: plain "
               f"PyTorch loop **{quality['plain_loop']:.4f}**, one coordinator "
               f"**{quality['one_server']:.4f}**, "
               f"two parameter servers **{quality['two_servers']:.4f}** (largest gap {gap:.4f}; bound "
               f"{QUALITY_BOUND}: {'met' if gap <= QUALITY_BOUND else '**not met**'}).\n")
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "quick": args.quick,
            "rate_mbit": RATE_MBIT, "workers": WORKERS, "topk_ratio": args.topk_ratio, "lan": lan,
            "max_staleness": args.max_staleness, "quality": quality, "seconds": time.monotonic() - began}
    name = "shards" if args.max_staleness is None else f"shards-staleness{args.max_staleness}"
    report(name + ("-follow" if args.compare_alone else ""), data, md)


if __name__ == "__main__":
    main()
