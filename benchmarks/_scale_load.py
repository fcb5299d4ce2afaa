"""The two processes of ``bench_scale.py``: one coordinator, and a process of light workers.

``python benchmarks/_scale_load.py coordinator ...`` runs the real :class:`Coordinator` on the
benchmark model (evaluation off, no checkpoints, 1 torch thread) until a ctl SHUTDOWN or
SIGTERM, after writing its port to ``--port-file``.

``python benchmarks/_scale_load.py workers ...`` runs ``--count`` light workers in one asyncio
loop. A light worker speaks the real protocol through swarmtrain's transport and wire messages:
REGISTER (the model's real fingerprint and compression settings), REGISTER_ACK, WEIGHTS, START,
then GRADIENTS answered by UPDATE. What it sends is a real gradient of the model: one forward /
backward on a real textlm batch, compressed once by the codec a worker uses after warm-up and
packed once (shared by every worker of the process); each send is that message with a new
``msg_id`` and the version of the last update received, so the coordinator really decodes,
screens, steps Adam and answers every one. The transport encodes the header of each send; the
tensor memory is written without a copy. Every answer is read off the socket (and decoded by
the transport) but not applied: the replica is not needed, only the coordinator's work is
measured. At most ``--inflight`` gradients are in flight per worker (a real worker's
``training.max_inflight``), and sends are paced at ``--rate`` gradients/s per worker (no burst
to catch up after a slow answer). A PAUSE from the coordinator (``swarmtrain ctl pause``) stops
the sends until a RESUME, as it stops a real worker's steps; the gradients in flight are still
answered. bench_scale.py pauses the clusters of the worker counts it is not measuring.

On exit (SHUTDOWN from the coordinator, SIGTERM, or ``--seconds``) the process writes one JSON
file: per worker, every answer as (sent, answered, status, version sent, version answered,
full), times on the machine's monotonic clock (shared by all processes), and any error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from swarmtrain.config import CompressionConfig, load_coordinator_config
from swarmtrain.core import hardware
from swarmtrain.core.heap import settle_heap
from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import ProtocolError, RefusedError, SwarmError
from swarmtrain.roles.ps.common import codec_for_step, fuse_dense, pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.tasks import Shard, TextLMConfig, TextLMTask
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.wire import (
    Error,
    Gradients,
    Pause,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    Start,
    Update,
    Weights,
)
from swarmtrain.wire.pool import PAYLOADS

#: model name -> shape: ``bench`` is bench_apply.py's ~10M-parameter model, ``tiny`` the test's
MODELS = {
    "bench": TextLMConfig(context=128, d_model=320, n_heads=8, n_layers=8),
    "tiny": TextLMConfig(context=16, d_model=16, n_heads=2, n_layers=1),
}
TASK = "textlm"
BATCH = 8  # samples per gradient (the batch of the one real forward/backward)
LR = 1e-3
#: max_staleness on the coordinator: above any staleness N workers can reach, so that every
#: gradient is applied (with the default of 16, 64 workers' gradients would mostly be dropped
#: as stale and the benchmark would measure the staleness policy, not the apply capacity)
MAX_STALENESS = 100_000
#: how long any one wait of a light worker may last (registration, weights, an answer)
WAIT_SEC = 300.0
#: heartbeat timeout on both sides (the default is 10 s): when 64 workers of a 10M-parameter
#: model join at once (64 x 40 MB of weights) or the run ends (64 x 40 MB of final weights),
#: the coordinator sent nothing on some connections for over 10 s (measured on this 2-core box
#: under other load), and those workers dropped it; the benchmark measures the steady state
#: in between, so a join or a shutdown storm must not end the run. The silences are reported.
HEARTBEAT_TIMEOUT_SEC = 120.0


def task_for(model: str) -> TextLMTask:
    if model not in MODELS:
        raise SystemExit(f"unknown --model {model!r}: choose one of {', '.join(MODELS)}")
    return TextLMTask(MODELS[model])


def coordinator_config(compression: str, min_workers: int, connections: int) -> Any:
    """The coordinator's config: the codec, every gradient applied (see MAX_STALENESS), room
    for ``connections`` workers from 127.0.0.1 (the default allows 32 per address)."""
    return load_coordinator_config(overrides={
        "compression.type": compression, "training.learning_rate": LR,
        "training.min_workers": min_workers, "training.max_staleness": MAX_STALENESS,
        "network.host": "127.0.0.1", "network.port": 0,
        "network.max_connections": connections + 16,
        "network.max_connections_per_address": connections + 8,
        "network.heartbeat_timeout_sec": HEARTBEAT_TIMEOUT_SEC,
        "network.handshake_timeout_sec": 60.0,
        # 64 gradients in arrival order wait for room in turn: allowed as long as an answer
        "network.admission_timeout_sec": WAIT_SEC,
    })


# -------------------------------------------------------------------------------- coordinator


async def serve(args: argparse.Namespace) -> None:
    task = task_for(args.model)
    cfg = coordinator_config(args.compression, args.min_workers, args.connections)
    coord = Coordinator(task.build_model(seed=0), cfg, task_name=TASK,
                        secret=os.environ["SWARMTRAIN_SECRET"].encode())
    await coord.start()
    settle_heap()  # (as `swarmtrain coordinator` does once started)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, coord.stop)
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(coord.port))
    tmp.rename(args.port_file)  # the reader never sees a half-written port
    await coord.run()


# -------------------------------------------------------------------------------- light workers


async def registered(conn: Connection) -> tuple[RegisterAck, Weights]:
    """The coordinator's REGISTER_ACK and WEIGHTS after a REGISTER sent on ``conn``.

    Raises:
        RefusedError: it refused the registration.
        ProtocolError: it answered with something else.
    """
    ack = await conn.recv(timeout=WAIT_SEC, phase="register")
    if isinstance(ack, Error):
        raise RefusedError(ack.code, ack.message)
    if not isinstance(ack, RegisterAck):
        raise ProtocolError("unexpected", f"expected REGISTER_ACK, got {ack.TYPE.name}")
    weights = await conn.recv(timeout=WAIT_SEC, phase="weights")
    if not isinstance(weights, Weights):
        raise ProtocolError("unexpected", f"expected WEIGHTS, got {weights.TYPE.name}")
    return ack, weights


@dataclasses.dataclass
class Load:
    """What every light worker of a process sends: REGISTER's model and compression fields,
    and one real compressed gradient as a GRADIENTS message."""

    fingerprint: list[Any]
    compression: dict[str, Any]
    gradient: Gradients
    wire_bytes: int
    model_bytes: int  # the trainable parameters in fp32: the WEIGHTS, the largest answer


def real_load(model: str, compression: str, topk_ratio: float | None = None) -> Load:
    """One forward/backward of the model on a real textlm batch, compressed by the codec a
    worker uses after warm-up (:func:`codec_for_step`), packed as the worker packs it
    (``topk_ratio``: top-k's, default the config's)."""
    task = task_for(model)
    net = task.build_model(seed=0)
    state = ModelState(net)
    batch = Shard(task.load_data().train, 0, 1, seed=0).next_batch(BATCH)
    net.train()
    loss = task.loss(net, batch)
    loss.backward()
    comp = CompressionConfig(type=compression, **({"topk_ratio": topk_ratio} if topk_ratio else {}))
    codec = codec_for_step(comp, step=comp.warmup_steps)
    gen = torch.Generator().manual_seed(0)
    grads = {n: p.grad.detach() for n, p in state.trainable.items() if p.grad is not None}
    items = (fuse_dense(grads, state.trainable, compression, codec.compress)
             or {n: codec.compress(g, generator=gen) for n, g in grads.items()})
    codecs, tensors = pack_compressed(items)
    msg = Gradients(msg_id=0, version=0, samples=BATCH, loss=float(loss.detach()), codecs=codecs,
                    tensors=tensors)
    return Load(fingerprint=state.fingerprint(),
                compression={k: getattr(comp, k) for k in comp.SHARED_KEYS}, gradient=msg,
                wire_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                model_bytes=sum(4 * p.numel() for p in state.trainable.values()))


class LightWorker:
    """One worker that sends ``load.gradient`` at ``rate`` per second, ``inflight`` in flight
    at most."""

    def __init__(self, worker_id: str, load: Load, rate: float, hw: dict[str, Any],
                 inflight: int = 1) -> None:
        self.worker_id = worker_id
        self.load = load
        self.period = 1.0 / rate
        self.hw = hw
        self.inflight = inflight
        self.version = 0
        self.msg_id = 0
        #: (sent, answered, status, version sent, version answered, full)
        self.answers: list[tuple[float, float, str, int, int, bool]] = []
        self.error = ""
        self.error_at = 0.0  # time.monotonic() when the error happened
        self.shutdown = False
        self._started = asyncio.Event()
        self._answered = asyncio.Event()
        self._done = asyncio.Event()  # SHUTDOWN or a broken connection: stop sending
        self._resumed = asyncio.Event()  # no PAUSE since registering or the last RESUME
        #: gradients sent and not answered yet: msg_id -> (sent at, version it was computed on)
        self._unanswered: dict[int, tuple[float, int]] = {}

    async def run(self, host: str, port: int, secret: bytes, stop: asyncio.Event) -> None:
        try:
            conn = await connect(host, port, secret=secret, role="worker",
                                 timeouts=Timeouts(connect=WAIT_SEC, handshake=WAIT_SEC,
                                                   heartbeat_timeout=HEARTBEAT_TIMEOUT_SEC))
        except SwarmError as exc:
            self._fail(f"connect: {exc}")
            return
        try:
            await self._session(conn, stop)
        except (SwarmError, ConnectionError) as exc:
            if not self.shutdown:
                self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            await conn.close()

    async def _session(self, conn: Connection, stop: asyncio.Event) -> None:
        await conn.send(Register(
            worker_id=self.worker_id, task=TASK, fingerprint=self.load.fingerprint,
            hardware=self.hw, batch_size=BATCH, accumulation_steps=1, shard_index=-1,
            compression=self.load.compression, samples_per_sec=0.0))
        ack, weights = await registered(conn)
        self.version = weights.version
        if ack.running:
            self._started.set()
        if not ack.paused:
            self._resumed.set()
        reader = asyncio.create_task(self._read(conn))
        try:
            await self._send_loop(conn, stop)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _send_loop(self, conn: Connection, stop: asyncio.Event) -> None:
        if not await self._wait_for(self._started, WAIT_SEC, stop):
            return
        next_at = time.monotonic()
        while not stop.is_set() and not self._done.is_set():
            if not self._resumed.is_set():
                # paused for as long as the coordinator says (a real worker waits so too); a
                # SIGTERM, --seconds, SHUTDOWN or a lost connection (heartbeats) ends the wait
                await self._wait_for(self._resumed, None, stop, self._done)
                next_at = time.monotonic()  # no burst to make up for the pause
                continue
            delay = next_at - time.monotonic()
            if delay > 0:
                await self._wait_for(stop, delay, self._done)
                if stop.is_set() or self._done.is_set():
                    return
            while len(self._unanswered) >= self.inflight:
                self._answered.clear()
                if not await self._wait_for(self._answered, WAIT_SEC, self._done):
                    if self._done.is_set():
                        return
                    raise SwarmError(f"no answer to gradient {min(self._unanswered)} in {WAIT_SEC:.0f} s")
            self.msg_id += 1
            self._unanswered[self.msg_id] = (time.monotonic(), self.version)
            await conn.send(dataclasses.replace(self.load.gradient, msg_id=self.msg_id,
                                                version=self.version))
            next_at = max(next_at + self.period, time.monotonic())

    @staticmethod
    async def _wait_for(event: asyncio.Event, timeout: float | None, *others: asyncio.Event) -> bool:
        """Wait up to ``timeout`` (None: until one is set) for ``event`` or any of ``others``;
        True if ``event`` is set."""
        waits = [asyncio.ensure_future(e.wait()) for e in (event, *others)]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return event.is_set()

    async def _read(self, conn: Connection) -> None:
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, Update):
                    sent = self._unanswered.pop(msg.msg_id, None)
                    if sent is None:  # never, unless the protocol broke
                        raise ProtocolError("unexpected", f"an answer to gradient {msg.msg_id}, "
                                            f"which is not in flight ({sorted(self._unanswered)} are)")
                    self.answers.append((sent[0], time.monotonic(), str(msg.status), sent[1],
                                         msg.version, msg.full))
                    self.version = msg.version
                    self._answered.set()
                elif isinstance(msg, Start):
                    self._started.set()
                elif isinstance(msg, Pause):
                    self._resumed.clear()
                elif isinstance(msg, Resume):
                    self._resumed.set()
                elif isinstance(msg, Shutdown):
                    self.shutdown = True
                    self._done.set()
                    return
                elif isinstance(msg, Error) and msg.fatal:
                    raise RefusedError(msg.code, msg.message)
                # WEIGHTS (the final ones), ASSIGN: read and dropped
        except (SwarmError, ConnectionError) as exc:
            if not self.shutdown:
                self._fail(f"{type(exc).__name__}: {exc}")
            self._done.set()

    def _fail(self, why: str) -> None:
        if not self.error:  # the first error is the cause
            self.error, self.error_at = why, time.monotonic()


async def _port_from(path: Path, timeout: float = WAIT_SEC) -> int:
    """The port written to ``path`` (by the benchmark, once it has measured the idle coordinator)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear in {timeout:.0f} s")
        await asyncio.sleep(0.05)
    return int(path.read_text())


async def run_workers(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    load = real_load(args.model, args.compression)
    hw = hardware.detect().to_dict()
    port = args.port or await _port_from(Path(args.port_file))
    secret = os.environ["SWARMTRAIN_SECRET"].encode()
    workers = [LightWorker(f"{args.prefix}{i:03d}", load, args.rate, hw, args.inflight)
               for i in range(args.count)]
    # every connection of this process can be receiving an answer at once, and a payload the
    # process has no idle buffer of that size for lands in fresh pages (a page fault per 4 KiB:
    # 26-30 ms of kernel time for 40 MB, see swarmtrain.wire.pool). The pool keeps twice the
    # largest payload idle, enough for one worker per process (a real one); with 16 here half
    # of the answers of a 64-worker run found none (measured, 2026-12-07) and the process spent
    # twice the CPU per answer it spent at 4 workers, on the box it shares with the coordinator
    # it measures. So it keeps two answers' buffers per worker: its cost per answer does not
    # follow N, and the coordinator's share of the machine does not either.
    PAYLOADS.max_idle_bytes = 2 * args.count * load.model_bytes
    settle_heap()  # (as `swarmtrain worker` does)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if args.seconds:
        loop.call_later(args.seconds, stop.set)
    started = time.monotonic()
    await asyncio.gather(*(w.run(args.host, port, secret, stop) for w in workers))
    out = {"pid": os.getpid(), "wire_bytes": load.wire_bytes, "started": started,
           "ended": time.monotonic(),
           # answers received into a payload buffer used before / a new one (page faults)
           "payload_buffers": {"reused": PAYLOADS.reused, "allocated": PAYLOADS.allocated},
           "workers": {w.worker_id: {"answers": w.answers, "error": w.error, "error_at": w.error_at,
                                     "shutdown": w.shutdown}
                       for w in workers}}
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(args.out)


class _MonotonicFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.mono = time.monotonic()
        return super().format(record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("coordinator", help="the coordinator (SWARMTRAIN_SECRET in the environment)")
    c.add_argument("--port-file", required=True)
    c.add_argument("--min-workers", type=int, required=True)
    c.add_argument("--connections", type=int, default=64, help="workers it must admit at once")
    w = sub.add_parser("workers", help="light workers (SWARMTRAIN_SECRET in the environment)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0)
    w.add_argument("--port-file", default="", help="wait for this file and read the port from it "
                   "(when --port is not given): the gradient is computed meanwhile")
    w.add_argument("--count", type=int, required=True, help="light workers in this process")
    w.add_argument("--prefix", default="light-", help="worker ids are PREFIX000, PREFIX001, ...")
    w.add_argument("--rate", type=float, required=True, help="gradients/s offered per worker")
    w.add_argument("--inflight", type=int, default=1, help="gradients in flight per worker at most")
    w.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0 = at SHUTDOWN)")
    w.add_argument("--out", required=True, help="JSON file written on exit")
    for p in (c, w):
        p.add_argument("--model", default="bench", choices=list(MODELS))
        p.add_argument("--compression", default="none", choices=("none", "fp16", "topk"))
    args = ap.parse_args(argv)
    if "SWARMTRAIN_SECRET" not in os.environ:
        raise SystemExit("set SWARMTRAIN_SECRET (the cluster secret) in the environment")
    if args.what == "workers" and (args.count < 1 or args.rate <= 0 or args.inflight < 1):
        raise SystemExit("--count and --inflight must be >= 1 and --rate > 0")
    if args.what == "workers" and not (args.port or args.port_file):
        raise SystemExit("give --port or --port-file")
    # stamped with the machine's monotonic clock, to line the logs up with the answers
    handler = logging.StreamHandler()
    handler.setFormatter(_MonotonicFormatter("%(mono).3f %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO if args.what == "coordinator" else logging.WARNING,
                        handlers=[handler])
    hardware.tune_allocator()  # as every `swarmtrain` command does at start-up
    torch.set_num_threads(1)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args) if args.what == "coordinator" else run_workers(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
