"""The real Coordinator answering light workers through one slow outbound link, on a simulated clock.

What ``benchmarks/bench_shards.py`` measures with one server (its 100 Mbit/s link the limit),
without the LAN and in a few seconds of CPU per thousand answers: the coordinator's own
choices (downlink tracks, moves, copies held, waiting answers) against a link model.

- The model: six 512 x 512 linear layers (1.6 M parameters, above the size whose copies of
  the weights are pooled and bounded). Downlink: top-k's (uniform 2-bit deltas). Every worker
  sends the same top-k 1 % gradient each time, as the benchmark's light workers do.
- The link: every answer in flight (a welcome, a chain, the full weights) shares the server's
  outbound rate equally, as TCP flows through one bottleneck do; ``--full-seconds`` is the time
  the full weights take alone (3.2 s: 40 MB at 100 Mbit/s, the benchmark's).
- A worker registers ``--stagger`` seconds after the one before, gets its welcome over the
  link, and sends its next gradient ``--step`` seconds after its answer has arrived (5 ms:
  nothing computed, as the benchmark's light workers).
  Answers refer to their copies of the weights until they have arrived, so the coordinator's
  bound on copies (``MAX_HELD_SNAPSHOTS``) acts as on the LAN; an answer that waits for a copy
  is asked for again each time an answer arrives.

Prints per 100 answers the full answers and the moves between tracks, and over the last two
thirds: updates/s, *fresh* updates/s (answers that brought newer weights), and how far behind
the weights each gradient was computed on were, in versions and in seconds (a coarse track's
"no change" answers cost no link and raise the first; the second is what training feels).

Run: ``python scripts/sim_link.py [--workers 8] [--answers 3000] [--stagger 4] [--step 0.005]
[--max-staleness N]`` (by default every gradient is applied; with N, those staler are dropped
and counted, and updates/s counts the applied ones)
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmtrain.compression import make_codec
from swarmtrain.config import load_coordinator_config
from swarmtrain.roles.ps.common import pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator, WorkerRecord
from swarmtrain.wire import Gradients, Update, UpdateStatus, encode_bytes


def simulate(workers: int, answers: int, stagger: float, full_seconds: float, seed: int,
             step: float = 0.005, max_staleness: int = 100_000) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    cfg = load_coordinator_config(overrides={
        "compression.type": "topk", "compression.topk_ratio": 0.01, "compression.downlink_bits": 2,
        "training.learning_rate": 1e-3, "training.max_staleness": max_staleness,
        "checkpointing.interval": 0})
    c = Coordinator(model, cfg, task_name="sim")
    c._connected = lambda: list(c.workers.values())  # type: ignore[method-assign]  # (no sockets here)
    full_bytes = 4 * sum(p.numel() for p in c.params.values())
    rate = full_bytes / full_seconds
    g = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 1e-2
         for n, p in c.params.items()}
    up = make_codec("topk", topk_ratio=0.01)
    codecs, tensors = pack_compressed({n: up.compress(t) for n, t in g.items()})
    recs = [WorkerRecord(f"w{i}", "sim", {}, 32, 0.0, [0]) for i in range(workers)]
    flows: dict[int, list[Any]] = {}  # worker -> [bytes left, the message (holding its copy)]
    events = [(i * stagger, i, "join") for i in range(workers)]  # (time, worker, what)
    waiting: dict[int, int] = {}  # worker -> the msg_id whose answer waits for a copy
    holds = [0] * workers
    msg_ids = [0] * workers
    now, done = 0.0, 0
    per100: list[collections.Counter[str]] = []
    fresh_at: list[float] = []
    answered_at: list[float] = []
    applied_at: list[float] = []
    made_at = {0: 0.0}  # version -> when it was made
    stale: list[tuple[float, int, float]] = []  # (when, versions behind, seconds old) per gradient

    def send(i: int, reply: Update) -> None:
        kind = "full" if reply.full else "chain" if reply.deltas else "no change"
        per100[-1][kind] += 1
        if reply.version > holds[i]:
            fresh_at.append(now)
        answered_at.append(now)
        holds[i] = reply.version
        flows[i] = [len(encode_bytes(reply)), reply]

    while done < answers:
        events.sort()
        share = rate / len(flows) if flows else 0.0
        finish = min(((left / share, i) for i, (left, _) in flows.items()), default=(float("inf"), -1))
        if events and events[0][0] <= now + finish[0]:
            at, i, what = events.pop(0)
        else:
            at, i, what = now + finish[0], finish[1], "arrived"
        for flow in flows.values():
            flow[0] -= (at - now) * share
        now = at
        if what == "arrived":
            del flows[i]
            events.append((now + step, i, "gradient"))
            for j, msg_id in list(waiting.items()):  # an answer arrived: a copy may be free
                reply = c._answer_deferred(recs[j], msg_id, UpdateStatus.APPLIED, False)
                if reply is not None:
                    del waiting[j]
                    send(j, reply)
            continue
        rec = recs[i]
        if what == "join":
            c.workers[rec.worker_id] = rec
            welcome = c._snapshot_for(rec)
            holds[i] = welcome.version
            flows[i] = [full_bytes, welcome]
            continue
        if done % 100 == 0:
            per100.append(collections.Counter())
        before = rec.track
        msg_ids[i] += 1
        msg = Gradients(msg_id=msg_ids[i], version=rec.holds_version, samples=32, loss=1.0, codecs=codecs,
                        tensors=tensors)
        stale.append((now, c.version - rec.holds_version, now - made_at[rec.holds_version]))
        status, reply = c._apply_gradient(rec, msg)
        made_at[c.version] = now
        done += 1
        if status == UpdateStatus.APPLIED:
            applied_at.append(now)
        elif status != UpdateStatus.STALE:
            raise SystemExit(f"gradient {status}")
        if reply is None:
            waiting[i] = msg_ids[i]
            per100[-1]["waits"] += 1
            continue
        if rec.track != before:
            per100[-1]["moves"] += 1
        send(i, reply)
    start = answered_at[len(answered_at) // 3]
    span = max(now - start, 1e-9)
    late = [(v, age) for t, v, age in stale if t >= start]
    return {"per100": per100, "rate": sum(1 for t in applied_at if t >= start) / span,
            "dropped": 1 - sum(1 for t in applied_at if t >= start) / max(1, len(late)),
            "staleness": sum(v for v, _ in late) / len(late), "age": sum(a for _, a in late) / len(late),
            "fresh": sum(1 for t in fresh_at if t >= start) / span, "switches": c.downlink.switches,
            "tracks": collections.Counter(r.track for r in recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--answers", type=int, default=3000)
    ap.add_argument("--stagger", type=float, default=4.0, help="seconds between two workers' joins")
    ap.add_argument("--full-seconds", type=float, default=3.2,
                    help="the full weights' time on the link alone")
    ap.add_argument("--step", type=float, default=0.005,
                    help="seconds a worker computes between its answer and its next gradient")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-staleness", type=int, default=100_000,
                    help="the coordinator's (default: every gradient applied)")
    args = ap.parse_args()
    r = simulate(args.workers, args.answers, args.stagger, args.full_seconds, args.seed, args.step,
                 args.max_staleness)
    print("per 100 answers, full weights:", [b["full"] for b in r["per100"]])
    print("per 100 answers, moves between tracks:", [b["moves"] for b in r["per100"]])
    print(f"last two thirds: {r['rate']:.2f} updates/s (applied; {100 * r['dropped']:.0f} % dropped as "
          f"stale), {r['fresh']:.2f} answers with newer weights/s; "
          f"moves in all {r['switches']}; tracks at the end {dict(r['tracks'])}")
    print(f"gradients computed on weights {r['staleness']:.1f} versions behind the master, "
          f"made {r['age']:.2f} s before (means over the last two thirds)")


if __name__ == "__main__":
    main()
