"""Training a 1.3 M-parameter Hugging Face GPT-2 through slow links, against one process.

Where the parameter server's slow-link machinery acts: a model above 2^20 parameters (its
copies of the weights pooled and bounded, answers waiting for a copy; see
docs/architecture.md) and links slow enough that an answer takes longer than an update. The
model is ``_slowlink_task.py``'s (the conformance zoo's GPT-2 case, 4 layers of width 160,
tied embeddings, byte vocabulary, stdlib source bytes), trained

- in one plain PyTorch process: ``torch.optim.Adam``, ``--steps`` updates of 16 sequences,
  1 thread (the yardstick: the same samples, the same held-out evaluation);
- through the parameter server on a simulated LAN (network namespaces, needs root): the
  coordinator on one host and ``--workers`` workers on others, each a real process started
  with the CLI (``--task _slowlink_task:factory``), every host's link limited to each rate of
  ``--rates`` each way (``unlimited``: no limit). Bounded asynchrony (``aggregate_samples`` =
  16, the setting docs/python-api.md gives for quality): each worker computes gradients of
  16 / workers sequences and the coordinator steps once per 16 samples, ``--steps`` updates
  in all, the samples of one process. Top-k 1 % up, the default downlink (uniform 4-bit
  deltas). The coordinator's final evaluation (on the case's held-out set, as one process's)
  is read from its status at exit.

Printed and written (``results/slowlink.md``): held-out loss of each run and its ratio to one
process (bound: 1.05), wall time to the end (every run trains the same samples, so this is
the time to its final loss), updates/s, and from the coordinator's status what its answers
were (chains, full weights, "no change", answers that waited for a copy), moves between
downlink tracks, MB it sent per update.

``--compression fp16`` (or ``none``) runs another uplink codec, ``--set KEY=VALUE`` adds a
[compression] key on both sides (``topk_ratio=0.1``, ``warmup_steps=30``, ``downlink=fp16``),
``--on-arrival`` trains with plain asynchrony instead (``aggregate_samples`` = 0: every
worker computes gradients of 16 sequences, each applied one an update of its own, so the
weights a gradient was computed on are about ``workers - 1`` updates old, and on slow links
older: where the downlink's tracks and answers waiting for a copy act), ``--train KEY=VALUE``
adds a [training] key on the coordinator (``max_staleness=64``), ``--servers 1,2,4`` runs
every rate with each number of parameter servers (a sharded coordinator: the servers each on
a host of their own, the workers on the hosts after them; the table adds each run's speed-up
over one server at the same rate), ``--tag NAME`` writes ``results/slowlink-NAME.md`` instead.

Run: ``python benchmarks/bench_slowlink.py [--quick] [--steps 300] [--workers 4] [--rates unlimited,100,20]
[--servers 1]``
(about 15 minutes; needs root)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _slowlink_task import BATCH, case
from _util import compression_toml, machine, md_table, report, toml_section, wait_files, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmtrain.testing import SimulatedLAN, netns_available
from swarmtrain.testing.cluster import LanCluster
from tests.conformance.harness import train_one_process

HERE = Path(__file__).resolve().parent
BOUND = 1.05  # held-out loss within 5 % of one process's
#: the uplink codecs, and the downlink `auto` gives each
UPLINK = {"topk": "top-k 1 % (downlink: uniform 4-bit deltas)",
          "fp16": "fp16 (downlink: the weights in fp16)", "none": "fp32 (downlink: fp32)"}
CAP_S = 3600.0  # one run's wall-clock cap
NETWORK_TOML = """
[network]
heartbeat_interval_sec = 1.0
heartbeat_timeout_sec = 30.0
handshake_timeout_sec = 30.0
"""


def lan_run(rate: float | None, servers: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One cluster on a fresh LAN, every link at ``rate`` Mbit/s (None: unlimited): ``servers``
    parameter servers on hosts 0.. (server 0 leads, on host 0), the workers on the hosts after."""
    with SimulatedLAN(servers + args.workers) as lan:
        if rate is not None:
            for host in lan.hosts:
                host.set_rate(rate)
        c = LanCluster(lan, tmp)
        compression = compression_toml({"type": args.compression, "topk_ratio": 0.01,
                                        **_keys(args.set, "--set")})
        training = {"aggregate_samples": 0 if args.on_arrival else BATCH, **_keys(args.train, "--train")}
        (tmp / "coordinator.toml").write_text(NETWORK_TOML + toml_section("training", training) + compression)
        (tmp / "worker.toml").write_text(NETWORK_TOML + "reconnect_attempts = 0\n" + compression)
        c.env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
        task = ("--task", "_slowlink_task:factory")
        status_files = [c.server_status_file(i) for i in range(1, servers)]
        try:
            # the other servers first: a worker registers with every server at once
            others = [c.start_server(i, servers, *task, "--checkpoint-interval", "0",
                                     *(["--no-follow-leader"] if args.alone else []))
                      for i in range(1, servers)]
            wait_files(status_files, 120, "the parameter servers", others)
            c.start_coordinator(*task, *c.leader_args(servers), "--min-workers", str(args.workers),
                                "--max-steps", str(args.steps), "--eval-interval", "3600",
                                "--checkpoint-interval", "0")
            started = time.monotonic()
            for i in range(args.workers):
                c.start_worker(servers + i, f"w{i + 1}", *task, "--batch-size", str(_worker_batch(args)),
                               "--accumulation-steps", "1")
            try:
                c.procs["coordinator"].wait(timeout=CAP_S)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"rate {rate}: not done in {CAP_S:.0f} s\n{c.logs()}") from None
            wall = time.monotonic() - started
            status = c.status()
            for proc in others:  # the leader tells them to finish; their statuses are final then
                proc.wait(timeout=60)
            finals = [json.loads(f.read_text()) for f in status_files]
        finally:
            c.stop_all()
    if status is None or "loss" not in (status.get("metrics") or {}):
        raise SystemExit(f"rate {rate}: no final evaluation in the coordinator's status\n{c.logs()}")
    every = [status, *finals]
    downlinks = [st["downlink"] for st in every]
    answers: dict[str, int] = {}
    for dl in downlinks:
        for kind, n in dl["answers"].items():
            answers[kind] = answers.get(kind, 0) + n
    workers = [w for w in status["workers"] if w["id"].startswith("w")]
    out_bytes = sum(sum(st["traffic"].get("bytes_out", {}).values()) for st in every)
    return {"rate_mbit": rate, "servers": servers, "loss": status["metrics"]["loss"],
            "version": status["version"], "versions": [st["version"] for st in every],
            "wall_s": wall, "updates_per_s": status["version"] / wall, "answers": answers,
            "switches": sum(dl.get("switches", 0) for dl in downlinks),
            "deferred": sum(dl.get("deferred", 0) for dl in downlinks),
            "instead_of_weights": sum(dl.get("instead_of_weights", 0) for dl in downlinks),
            "tracks": [t["interval"] for t in downlinks[0].get("tracks", [])],
            "mb_out_per_update": out_bytes / max(status["version"], 1) / 1e6,
            "stale": sum(w["stale"] for w in workers),
            "stale_by_server": [sum(w["stale"] for w in st["workers"] if w["id"].startswith("w"))
                                for st in every],
            "mean_staleness": sum(w["avg_staleness"] for w in workers) / max(len(workers), 1)}


def _worker_batch(args: argparse.Namespace) -> int:
    """A worker's batch: one update's samples split over the workers (bounded asynchrony), or
    the whole update's (``--on-arrival``: every gradient is an update)."""
    return BATCH if args.on_arrival else BATCH // args.workers


def _keys(pairs: list[str], flag: str = "--set") -> dict[str, Any]:
    """``flag key=value`` pairs as a dict (``--set``: more [compression] keys, e.g.
    warmup_steps=30; ``--train``: [training] keys): a value that reads as a JSON number or
    boolean is one, anything else a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes key=value, got {pair!r}")
        try:
            out[key.strip()] = json.loads(value.strip())
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def _name(data: dict[str, Any]) -> str:
    codec = data.get("compression", "topk")
    tag = data.get("tag") or ("" if codec == "topk" else codec)
    return f"slowlink-{tag}" if tag else "slowlink"


def _uplink(data: dict[str, Any]) -> str:
    """The uplink codec as the run had it (``--set topk_ratio`` changes top-k's ratio)."""
    codec = data.get("compression", "topk")
    ratio = (data.get("set") or {}).get("topk_ratio", 0.01)
    return UPLINK[codec].replace("1 %", f"{float(ratio) * 100:g} %") if codec == "topk" else UPLINK[codec]


def render(data: dict[str, Any]) -> str:
    """The markdown of a run (``--render`` rebuilds it from the JSON)."""
    ref, steps, workers, runs = data["one_process"]["loss"], data["steps"], data["workers"], data["runs"]
    sharded = any(r.get("servers", 1) > 1 for r in runs)

    def alike(r: dict[str, Any], **what: Any) -> dict[str, Any] | None:
        """The run with ``r``'s settings but ``what``."""
        want = {"rate_mbit": r["rate_mbit"], "servers": r.get("servers", 1), **what}
        return next((o for o in runs if all(o.get(k, 1) == v for k, v in want.items())), None)

    def kinds(a: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(a.items()) if v)

    def row(r: dict[str, Any]) -> list[Any]:
        free, lone = alike(r, rate_mbit=None), alike(r, servers=1)
        out = [f"{workers} workers" + (f", {r['servers']} servers" if r.get("servers", 1) > 1 else ""),
               "unlimited" if r["rate_mbit"] is None else f"{r['rate_mbit']:g} Mbit/s",
               f"{r['loss']:.4f}", f"{r['ratio']:.3f}" + ("" if r["ratio"] <= BOUND else " **(over)**"),
               f"{r['loss'] / free['loss']:.3f}" if free else "-", f"{r['wall_s']:.0f} s"]
        if sharded:
            out.append(f"{lone['wall_s'] / r['wall_s']:.2f}" if lone else "-")
        return out + [f"{r['updates_per_s']:.2f}", f"{r['mean_staleness']:.2f}",
                      f"{r['stale'] / max(r['stale'] + r['version'], 1):.0%}",
                      kinds(r["answers"]), r["switches"], r["deferred"], f"{r['mb_out_per_update']:.2f}"]

    rows = [["one process", "-", f"{ref:.4f}", "1.000", "-", f"{data['one_process']['seconds']:.0f} s",
             *(["-"] if sharded else []),
             f"{steps / data['one_process']['seconds']:.1f}", "-", "-", "-", "-", "-", "-"]]
    rows += [row(r) for r in runs]
    mode = ("plain asynchrony (`aggregate_samples` = 0: each worker computes gradients of "
            f"{BATCH} sequences and each applied one is an update)" if data.get("on_arrival") else
            f"bounded asynchrony (`aggregate_samples` = {BATCH})")
    return ("## Training through slow links against one process (`benchmarks/bench_slowlink.py`)\n\n"
            "Hugging Face GPT-2 from a config (4 layers, width 160, tied embeddings, 1.28 M parameters), "
            f"stdlib source bytes, {steps} updates of {BATCH} sequences in every run (equal samples), "
            "held-out next-byte loss. One process: `torch.optim.Adam`, 1 thread. Parameter server: the "
            f"coordinator and {workers} worker processes started with the CLI, each on its own host of "
            f"a simulated LAN, every link at the rate shown each way; {mode}"
            + "".join(f", `{k} = {v}`" for k, v in (data.get("train") or {}).items())
            + f", {_uplink(data)} up, the default downlink for it"
            + "".join(f", `{k} = {v}`" for k, v in (data.get("set") or {}).items()) + ". *vs "
            "unlimited*: the loss against the same cluster's on unlimited links (what the link costs; "
            "what the codec and asynchrony cost is in the unlimited row's ratio to one process). Wall "
            "time is from the workers' start to the coordinator's exit (after its final evaluation): "
            f"the time to the final loss. Bound: held-out loss within {BOUND}x one process's. "
            "Staleness: the workers' mean, in versions, of the gradients applied; dropped: the "
            "gradients dropped as staler than `max_staleness` (their samples are not in the "
            "updates: every run applies the same samples); with several servers both are the "
            "leader's (server 0's) figures. Answers: the coordinator's, by kind (chain of "
            "deltas, full weights, current: \"no change\", withheld); moves between downlink tracks; "
            "answers that waited for a copy of the weights; MB the coordinator sent per update.\n\n"
            + ("*Speed-up*: the time to the end of one server's run at the same rate over this run's "
               "(the parameter servers each on a host of their own, each carrying its group's "
               "gradients in and answers out; the workers send every server its slice at once). "
               "Answers, moves, waits and MB out are summed over the servers. "
               + ("The other servers followed the leader's verdict on every gradient (`cluster."
                  "follow_leader`, the default since 2026-12-08; `--alone` turns it off)"
                  if "alone" in data and not data["alone"] else
                  "Each server judged every gradient's staleness on its own (`cluster.follow_leader = "
                  "false`, `--alone`; before 2026-12-08 there was nothing else)")
               + ".\n\n" if sharded else "")
            + md_table(["run", "links", "held-out loss", "vs one process", "vs unlimited", "wall",
                        *(["speed-up"] if sharded else []), "updates/s", "staleness", "dropped", "answers",
                        "track moves", "waited", "MB out / update"],
                       rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="updates of 16 sequences (every run)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", default="1",
                    help="comma-separated counts of parameter servers (a sharded coordinator, --shard i/S, "
                    "each server on its own host): every rate is run with each")
    ap.add_argument("--rates", default="unlimited,100,20",
                    help="comma-separated Mbit/s per link, or unlimited")
    ap.add_argument("--quick", action="store_true", help="100 updates, links unlimited and 100 Mbit/s")
    ap.add_argument("--compression", default="topk", choices=("topk", "fp16", "none"),
                    help="the uplink codec (top-k: 1 %%); results of another go to slowlink-<codec>.md")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another [compression] key for both sides, e.g. warmup_steps=30 or downlink=fp16")
    ap.add_argument("--on-arrival", action="store_true",
                    help="plain asynchrony: aggregate_samples = 0, every worker's gradient of 16 sequences "
                    "is an update of its own (staleness about workers - 1)")
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="another [training] key for the coordinator, e.g. max_staleness=64")
    ap.add_argument("--alone", action="store_true",
                    help="the servers other than the leader judge each gradient on their own "
                    "(cluster.follow_leader = false) instead of following the leader's verdicts")
    ap.add_argument("--tag", default="", help="results go to slowlink-<tag>.md")
    ap.add_argument("--render", default="", help="rebuild results/slowlink.md from this JSON; run nothing")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        write_results(_name(data), data, render(data))
        return
    if args.quick:
        args.steps, args.rates = 100, "unlimited,100"
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"needs network namespaces (root): {why}")
    began = time.monotonic()
    cs = case(args.steps)
    one = train_one_process(cs)
    ref = one.metrics["loss"]
    print(f"one process: held-out loss {ref:.4f} in {one.seconds:.1f} s", flush=True)
    runs = []
    counts = [int(n) for n in args.servers.split(",")]
    for r in args.rates.split(","):
        rate = None if r == "unlimited" else float(r)
        for servers in counts:
            with tempfile.TemporaryDirectory() as tmp:
                run = lan_run(rate, servers, args, Path(tmp))
            run["ratio"] = run["loss"] / ref
            print(f"{r} Mbit/s, {servers} server(s): held-out loss {run['loss']:.4f} "
                  f"({run['ratio']:.3f}x one process) in "
                  f"{run['wall_s']:.1f} s; answers {run['answers']}, moves {run['switches']}", flush=True)
            runs.append(run)

    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "steps": args.steps,
            "workers": args.workers, "servers": counts,
            "one_process": {"loss": ref, "seconds": one.seconds}, "runs": runs,
            "compression": args.compression, "set": _keys(args.set), "tag": args.tag,
            "alone": args.alone,
            "on_arrival": args.on_arrival, "train": _keys(args.train, "--train"),
            "bound": BOUND, "seconds": time.monotonic() - began}
    report(_name(data), data, render(data))
    print(json.dumps({"ratios": [round(r["ratio"], 4) for r in runs]}))


if __name__ == "__main__":
    main()
