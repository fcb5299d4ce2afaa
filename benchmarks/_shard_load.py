"""The processes of ``bench_shards.py``: parameter servers, and light workers of a sharded cluster.

``python benchmarks/_shard_load.py server --shard i/S --servers A0 A1 ...`` runs parameter
server ``i`` of ``S``: the real :class:`Coordinator` over its group of bench_apply.py's
~10M-parameter textlm model (:func:`swarmtrain.roles.ps.cluster.shard_of_model`), listening
on port 7100 of its host, evaluation off, no checkpoints, 1 torch thread, until SIGTERM.

``python benchmarks/_shard_load.py worker --leader HOST:PORT ...`` runs one light worker
(``_scale_load.py``'s, made sharded): it speaks the real protocol (REGISTER to the leader,
whose REGISTER_ACK lists the servers; the partition computed here and checked; REGISTER with
every other server; WEIGHTS from each), then sends one real compressed gradient of the model
(one forward/backward on a real batch, computed once) split by the partition: each server
its slice, all at once, with that server's version, and waits for every server's answer (a
*round*, one whole-gradient update) before the next, paced at ``--rate`` rounds/s. Answers
are read and decoded, not applied. On SIGTERM or ``--seconds`` it writes a JSON file with
every round's (sent, all answered, fresh) on the machine's monotonic clock: *fresh* when every
server's answer brought newer weights (not "no change"), *applied* when every server applied
its slice (none dropped it as staler than the servers' ``--max-staleness``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _scale_load import BATCH, LR, MAX_STALENESS, TASK, WAIT_SEC, real_load, registered, task_for

from swarmtrain.config import load_coordinator_config
from swarmtrain.core import hardware
from swarmtrain.errors import SwarmError
from swarmtrain.roles.ps.cluster import shard_of_model, split_address
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.partition import parse_server_spec, partition_model
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.wire import Gradients, Register, RegisterAck, Start, Update, UpdateStatus, Weights

PORT = 7100
HEARTBEAT_TIMEOUT_SEC = 120.0


def server_config(args: argparse.Namespace, leader: bool) -> Any:
    return load_coordinator_config(overrides={
        "compression.type": args.compression, "compression.topk_ratio": args.topk_ratio,
        "compression.downlink_bits": args.downlink_bits,
        "training.learning_rate": LR, "training.max_staleness": args.max_staleness,
        "training.min_workers": args.min_workers if leader else 1,
        "network.host": "0.0.0.0", "network.port": PORT,
        "network.heartbeat_timeout_sec": HEARTBEAT_TIMEOUT_SEC, "network.handshake_timeout_sec": 60.0,
        "cluster.shard": args.shard, "cluster.servers": tuple(args.servers),
        "cluster.follow_leader": not args.no_follow_leader,
    })


async def serve(args: argparse.Namespace) -> None:
    spec = parse_server_spec(args.shard, args.servers)
    cfg = server_config(args, spec.leader)
    model = task_for(args.model).build_model(seed=0)
    secret = os.environ["SWARMTRAIN_SECRET"].encode()
    if spec.count == 1:
        coord = Coordinator(model, cfg, task_name=TASK, secret=secret)
    else:
        part, place = shard_of_model(model, spec, tuple(args.servers))
        coord = Coordinator(part, cfg, task_name=TASK, secret=secret, cluster=place)
    del model
    await coord.start()
    Path(args.ready_file).write_text(str(coord.port))

    def stop() -> None:
        if args.status_file:  # what the server did, for the benchmark's table
            st = coord.status()
            use = resource.getrusage(resource.RUSAGE_SELF)
            out = {"version": st["version"], "downlink": st["downlink"], "traffic": st["traffic"],
                   "apply": st["apply"], "staleness_counts": st["staleness_counts"], "stats": st["stats"],
                   "cpu_sec": use.ru_utime + use.ru_stime, "uptime_sec": st["uptime_sec"],
                   "stale": sum(w["stale"] for w in st["workers"]),
                   "verdicts": (st.get("cluster") or {}).get("verdicts")}
            tmp = Path(args.status_file + ".tmp")
            tmp.write_text(json.dumps(out, default=str))
            tmp.rename(args.status_file)
        coord.stop()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    await coord.run()


@dataclasses.dataclass
class _Link:
    index: int
    conn: Connection
    message: Gradients  # this server's slice
    version: int = 0
    answered: asyncio.Queue[Update | BaseException] = dataclasses.field(default_factory=asyncio.Queue)


class ShardedLightWorker:
    """One light worker of a sharded cluster (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.load = real_load(args.model, args.compression, topk_ratio=args.topk_ratio)
        self.model = task_for(args.model).build_model(seed=0)
        self.rounds: list[tuple[float, float]] = []
        self.error = ""
        self.started = asyncio.Event()

    async def _open(self, address: str, partition: str) -> tuple[Connection, RegisterAck, Weights]:
        host, port = split_address(address)
        secret = os.environ["SWARMTRAIN_SECRET"].encode()
        conn = await connect(host, port, secret=secret, role="worker",
                             timeouts=Timeouts(connect=WAIT_SEC, handshake=WAIT_SEC,
                                               heartbeat_timeout=HEARTBEAT_TIMEOUT_SEC))
        await conn.send(Register(
            worker_id=self.args.worker_id, task=TASK, fingerprint=self.load.fingerprint,
            hardware=hardware.detect().to_dict(), batch_size=BATCH, accumulation_steps=1,
            shard_index=-1, compression=self.load.compression, samples_per_sec=0.0,
            partition=partition))
        ack, weights = await registered(conn)
        return conn, ack, weights

    def _slice(self, names: tuple[str, ...]) -> Gradients:
        g = self.load.gradient
        codecs = {n: c for n, c in g.codecs.items() if n in names}
        tensors = {k: t for k, t in g.tensors.items() if k.split("/", 1)[0] in names}
        return dataclasses.replace(g, codecs=codecs, tensors=tensors)

    async def run(self, stop: asyncio.Event) -> None:
        conn, ack, weights = await self._open(self.args.leader, "")
        servers = ack.info.get("servers") or []
        links = [_Link(0, conn, self.load.gradient, weights.version)]
        if len(servers) > 1:
            partition = partition_model(self.model, len(servers))
            if partition.fingerprint != ack.info.get("partition"):
                raise SwarmError("partition mismatch with the leader")
            links[0].message = self._slice(partition.groups[0])
            for j in range(1, len(servers)):
                c, _, w = await self._open(servers[j], partition.fingerprint)
                links.append(_Link(j, c, self._slice(partition.groups[j]), w.version))
        if ack.running:
            self.started.set()
        readers = [asyncio.create_task(self._read(link)) for link in links]
        try:
            await self._rounds(links, stop)
        finally:
            for r in readers:
                r.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            await asyncio.gather(*(link.conn.close() for link in links), return_exceptions=True)

    async def _read(self, link: _Link) -> None:
        try:
            while True:
                msg = await link.conn.recv()
                if isinstance(msg, Update):
                    link.answered.put_nowait(msg)
                elif isinstance(msg, Start) and link.index == 0:
                    self.started.set()
        except (SwarmError, ConnectionError) as exc:
            link.answered.put_nowait(exc)

    async def _rounds(self, links: list[_Link], stop: asyncio.Event) -> None:
        async with asyncio.timeout(WAIT_SEC):
            await self.started.wait()
        period, next_at, msg_id = 1.0 / self.args.rate, time.monotonic(), 0
        while not stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            msg_id += 1
            sent = time.monotonic()
            await asyncio.gather(*(link.conn.send(dataclasses.replace(
                link.message, msg_id=msg_id, version=link.version)) for link in links))
            newer, applied, nbytes, full = 0, 0, 0, False
            for link in links:
                async with asyncio.timeout(WAIT_SEC):
                    answer = await link.answered.get()
                if isinstance(answer, BaseException):
                    raise answer
                # ("no change": the server had no copy of the weights it could send, or nothing new)
                newer += answer.version > link.version
                applied += answer.status == UpdateStatus.APPLIED
                nbytes += sum(t.numel() * t.element_size() for t in answer.tensors.values())
                full = full or answer.full
                link.version = answer.version
            # (sent, answered, every server's answer newer, the share of answers newer, bytes, a full
            # one, every server applied its slice: none dropped it as staler than max_staleness)
            self.rounds.append((sent, time.monotonic(), newer == len(links), newer / len(links), nbytes,
                                full, applied == len(links)))
            if len(self.rounds) == 1:
                Path(self.args.started_file).write_text("1")
            next_at = max(next_at + period, time.monotonic())


async def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    worker = ShardedLightWorker(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if args.seconds:
        loop.call_later(args.seconds, stop.set)
    task = asyncio.create_task(worker.run(stop))
    done, _ = await asyncio.wait([task, asyncio.create_task(stop.wait())],
                                 return_when=asyncio.FIRST_COMPLETED)
    if task in done and task.exception() is not None:
        worker.error = f"{type(task.exception()).__name__}: {task.exception()}"
    else:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    out = {"rounds": worker.rounds, "error": worker.error, "wire_bytes": worker.load.wire_bytes}
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(args.out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("server")
    s.add_argument("--shard", required=True)
    s.add_argument("--servers", nargs="*", default=[])
    s.add_argument("--min-workers", type=int, default=1)
    s.add_argument("--ready-file", required=True, help="written once the server listens")
    s.add_argument("--status-file", default="", help="written at exit: the server's status, CPU time")
    s.add_argument("--max-staleness", type=int, default=MAX_STALENESS,
                   help="the coordinator's (default: every gradient applied)")
    s.add_argument("--no-follow-leader", action="store_true",
                   help="cluster.follow_leader = false: each server judges staleness on its own")
    w = sub.add_parser("worker")
    w.add_argument("--leader", required=True)
    w.add_argument("--worker-id", required=True)
    w.add_argument("--rate", type=float, default=50.0)
    w.add_argument("--seconds", type=float, default=0.0)
    w.add_argument("--out", required=True)
    w.add_argument("--started-file", required=True, help="written once the first round is answered")
    for p in (s, w):
        p.add_argument("--model", default="bench")
        p.add_argument("--compression", default="topk", choices=("none", "fp16", "topk"))
        p.add_argument("--topk-ratio", type=float, default=0.01)
        p.add_argument("--downlink-bits", type=int, default=2)
    args = ap.parse_args(argv)
    hardware.tune_allocator()
    torch.set_num_threads(1)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args) if args.what == "server" else run_worker(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
