"""A pipeline stage server: holds a range of layers and serves forwards, backwards, inference.

Requests arrive over authenticated transport connections (role ``pipeline`` for trainers
and generation clients, ``stage`` for replicas of the same stage). Each request becomes a
:class:`WorkPacket` in an inbound :class:`ActivationBuffer`, ordered by priority.

Training work (forward before backward before replica sync) goes to the training buffer,
and ONE compute thread takes it a packet at a time, runs it on a :class:`StageCompute` and
hands the answer to an :class:`OutboundBuffer` whose send loop writes it to the asking
connection. Inference (urgent before normal) has its own buffer and thread, so a request
never waits for the training micro-batch in progress, and its answer goes straight to the
connection, not behind queued training answers. The training thread runs at a lower OS
priority (``training_nice``), so when a machine's cores are all busy training, inference
still gets a core at once: on a 2-core box with three busy stages this is what keeps
generation latency near its idle value.

Replicas: a server given ``sync_peers`` averages its trainable parameters and buffers with
each of them every ``sync_every`` optimizer steps (see :mod:`swarmtrain.roles.stage.replicas`); it also serves
the other side of such rounds (STAGE_SYNC, at gradient-sync priority).

Hardening (as on the coordinator): a frame from a replica may carry at most the stage's
synced tensors (trainable parameters, buffers) twice over, one from a trainer at most
``max_request_mb``; connections are capped in total and per address; and a connection whose
requests are refused ``max_bad_in_row`` times in a row for what it sent is closed with ERROR
``too_many_bad``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import logging
import os
import secrets
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from swarmtrain.config import StageLimitsConfig
from swarmtrain.errors import RemoteProtocolError, SwarmError
from swarmtrain.roles.stage.buffers import ActivationBuffer, BufferClosed, Priority, WorkPacket
from swarmtrain.roles.stage.codes import SENDERS_FAULT, StageErrorCode
from swarmtrain.roles.stage.compute import (
    BadInput,
    CacheMiss,
    ComputeConfig,
    StageCompute,
    StageOutcome,
    StateMismatch,
    UnknownMicrobatch,
)
from swarmtrain.roles.stage.monitor import BufferMonitor
from swarmtrain.roles.stage.outbound import OfferResult, OutboundBuffer
from swarmtrain.roles.stage.partition import LossFn
from swarmtrain.roles.stage.replicas import ReplicaState, ReplicaSync, fetch_replica_state, sync_fractions
from swarmtrain.transport import Connection, Server, Timeouts, start_server
from swarmtrain.transport.auth import cluster_secret
from swarmtrain.transport.endpoints import payload_limit, peer_ip
from swarmtrain.transport.refusals import RefusalCounter, merge_refusals
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import (
    MAX_GRAD_SQ,
    Error,
    Limits,
    Message,
    StageBackward,
    StageError,
    StageForward,
    StageGrad,
    StageInfer,
    StageResult,
    StageStep,
    StageSync,
    Status,
    StatusRequest,
)

__all__ = ["StageServer", "StageServerConfig"]

log = logging.getLogger("swarmtrain.roles.stage")

_FORWARD_PRIORITIES = {Priority.INFERENCE_URGENT, Priority.INFERENCE_NORMAL, Priority.TRAINING_FORWARD}
_INFER_PRIORITIES = {Priority.INFERENCE_URGENT, Priority.INFERENCE_NORMAL}
_ROLES = ("pipeline", "stage")
#: header bytes any stage frame may carry, beyond its tensors' names (a StageForward's is ~200)
_HEADER_BYTES = 1 << 16
#: header bytes per tensor descriptor besides its name (measured ~24: dtype, shape, offsets)
_HEADER_BYTES_PER_TENSOR = 64
#: addresses the per-sender refusal record keeps (the oldest is forgotten first)
_MAX_SENDER_RECORDS = 1024
#: characters of a refusal kept in the record (a message may quote a client's session id)
_MAX_REFUSAL_CHARS = 200


@dataclass(frozen=True)
class StageServerConfig(StageLimitsConfig):
    """Where a stage listens, how it queues work, and what it admits (the limits are the
    [stage] section's: :class:`~swarmtrain.config.StageLimitsConfig`).

    Attributes:
        host: address to listen on.
        port: TCP port (0 = any free port).
        buffer_capacity: inbound packets queued at most; more are refused as ``overloaded``.
        outbound_capacity: answers queued for sending before the compute thread waits.
        reply_timeout: seconds an answer may wait for room in a client's send queue.
        sync_every: optimizer steps between parameter averages with ``sync_peers`` (0 = never).
        sync_timeout: seconds a sync round may take before it counts as failed.
        monitor_interval: seconds between buffer samples (0 = no monitor thread).
        infer_capacity: inference requests queued at most; more are refused as ``overloaded``.
        training_nice: how much lower the training thread's OS scheduling priority is than
            the rest of the stage (Linux per-thread nice value, 0-19; 0 = the same). Raising
            niceness needs no privileges.
        timeouts: transport timeouts of the server and of its connections to sync peers.

    Of the limits: ``max_request_mb`` is what one frame from a trainer or generation client
    (role ``pipeline``) may carry: an activation, its gradient, token ids and targets. A
    frame's activation is micro-batch x context x width x 4 bytes; the default fits 64 x 1024
    x 1024 in fp32 (256 MiB), 256 times the default textlm's. A bigger micro-batch, context or
    width needs a bigger value, or the stage closes the connection with ``oversize_payload``.
    ``max_bad_in_row`` requests of one connection refused in a row for what it sent
    (``bad_input``, ``unexpected``) close it with ERROR ``too_many_bad``; an answered request
    starts the count again.
    """

    host: str = "127.0.0.1"
    port: int = 0
    buffer_capacity: int = 100
    outbound_capacity: int = 256
    reply_timeout: float = 10.0
    sync_every: int = 0
    sync_timeout: float = 30.0
    monitor_interval: float = 0.0
    infer_capacity: int = 32
    training_nice: int = 10
    timeouts: Timeouts = Timeouts()


@dataclass
class _Sender:
    """Refusals of one connection's requests (its ``bad_in_row`` decides a disconnect)."""

    address: str
    bad_in_row: int = 0
    disconnecting: bool = False


class JobKind(enum.Enum):
    """What a compute thread does with a :class:`_Job`. The first six come from a connection
    and are answered on it; the last four come from the stage itself (its replica rounds,
    its state export and import) and are answered through the job's future."""

    FORWARD = "forward"  #: a training micro-batch's forward (STAGE_FORWARD)
    BACKWARD = "backward"  #: its backward (STAGE_BACKWARD)
    INFER = "infer"  #: an inference step (STAGE_INFER), on the inference thread
    STEP = "step"  #: an optimizer step over a named group of micro-batches (STAGE_STEP)
    JOIN_SERVE = "join_serve"  #: a joining replica copies this stage's whole state
    SYNC_SERVE = "sync_serve"  #: a replica's averaging round, served here
    SNAPSHOT = "snapshot"  #: this stage's synced tensors, for its own averaging round
    SYNC_APPLY = "sync_apply"  #: the result of its own averaging round, applied
    EXPORT = "export"  #: the whole state, for a checkpoint
    IMPORT = "import"  #: a whole state taken over (a checkpoint, a replica)


#: the kinds a compute thread answers through the job's future, not on a connection
_INTERNAL_KINDS = frozenset({JobKind.SNAPSHOT, JobKind.SYNC_APPLY, JobKind.EXPORT, JobKind.IMPORT})


@dataclass(frozen=True, eq=False)
class _Job(WorkPacket):
    """A packet with what the compute thread needs to answer it (``kind``: what that is)."""

    kind: JobKind = field(kw_only=True)
    req: int = 0
    conn: Connection | None = None
    targets: torch.Tensor | None = None
    theirs: dict[str, torch.Tensor] = field(default_factory=dict)
    mine: dict[str, torch.Tensor] = field(default_factory=dict)
    result: concurrent.futures.Future[Any] | None = None
    sync_round: int = 0
    sync_step: int = 0  # the optimizer step a replica's sync was taken at
    step: bool | None = None  # the trainer's step decision (None: the stage counts)
    group: tuple[int, int] | None = None  # the micro-batches the step covers (first, size)
    cache_start: int | None = None  # a cached inference step from this position (None: no cache)
    scale: float = 1.0  # a step's gradient scale (the trainer's global clipping)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.result is None) == (self.kind in _INTERNAL_KINDS):
            raise TypeError(f"a {self.kind.value} job is answered "
                            + ("through its result future: give it one" if self.result is None
                               else "on its connection: it takes no result future"))


@dataclass(frozen=True, eq=False)
class _Reply(WorkPacket):
    message: Message | None = None
    conn: Connection | None = None


class StageServer:
    """Serves one stage's layers to trainers and generation clients.

    Args:
        layers: the stage's layers (e.g. from :func:`~swarmtrain.roles.stage.build_stage`).
        stage: index of the stage in the pipeline (0 takes token ids).
        layer_range: the model layers ``[start, stop)`` the stage holds.
        loss_fn: the loss, on the last stage only.
        compute: optimizer and cache settings.
        config: network and queue settings.
        secret: the cluster secret (None = open cluster).
        sync_peers: ``(host, port)`` of replicas of the same stage this server averages with.
        name: how logs and the status name this server.
        tls: mutual TLS for every connection, served and to sync peers (None = plain TCP).
        device: where the layers compute (e.g. ``resolve_device("auto")``); activations
            arrive on and leave from the CPU.
    """

    def __init__(
        self,
        layers: nn.Module,
        *,
        stage: int,
        layer_range: tuple[int, int],
        loss_fn: LossFn | None,
        compute: ComputeConfig = ComputeConfig(),
        config: StageServerConfig = StageServerConfig(),
        secret: bytes | str | None,
        sync_peers: Sequence[tuple[str, int]] = (),
        name: str = "",
        tls: TLSConfig | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.stage = stage
        self.layer_range = layer_range
        self.config = config
        self.secret = cluster_secret(secret)
        self.tls = tls
        self.name = name or f"stage{stage}"
        self.compute = StageCompute(layers, is_first=stage == 0, loss_fn=loss_fn, config=compute,
                                    device=device)
        self.inbound = ActivationBuffer(config.buffer_capacity)
        self.infer_inbound = ActivationBuffer(config.infer_capacity)
        self.outbound = OutboundBuffer(self._send_reply, capacity=config.outbound_capacity,
                                       max_retries=0, on_failed=self._reply_lost)
        self.monitor: BufferMonitor | None = None
        self.replicas = ReplicaSync(sync_peers, on_compute_thread=self._on_compute_thread,
                                    step=lambda: self.compute.steps,
                                    trained=lambda: self.compute.trained_since_sync, secret=self.secret,
                                    timeouts=config.timeouts, round_timeout=config.sync_timeout,
                                    name=self.name, tls=tls)
        self.sync_served = 0
        self.joins_served = 0
        #: the last state a joining replica copied from here, and what this one copied
        self.last_join_served: dict[str, Any] | None = None
        self.joined: dict[str, Any] | None = None
        #: drawn when the server is built: a trainer that sees it change knows the stage
        #: restarted (and lost what it held only in memory)
        self.incarnation = secrets.token_hex(6)
        #: where this replica's starting state came from ("seed", "checkpoint PATH",
        #: "replica HOST:PORT"): set by whoever loads one
        self.started_from = "seed"
        self.refused = 0
        self.bad_input = 0  # requests refused for what they carried, all senders
        self.sender_disconnects = 0
        #: requests refused, by their STAGE_ERROR code (``overloaded``, ``bad_input``...);
        #: ``status()["refusals"]`` adds the connections the server turned away
        self.refusals = RefusalCounter()
        self._senders: dict[Connection, _Sender] = {}  # open connections being served
        self._sender_log: OrderedDict[str, dict[str, Any]] = OrderedDict()  # by address, bounded
        self._senders_lock = threading.Lock()  # the compute threads count refusals too
        self._server: Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._infer_thread: threading.Thread | None = None
        self._stopping = False
        #: called on the event loop with the optimizer step count after each step
        self._step_listeners: list[Callable[[int], None]] = []
        #: the optimizer step of the newest state kept outside this process (a checkpoint
        #: written, a sync round with a replica): steps past it die with the process
        self.durable_step = 0

    def on_step(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(steps)`` on the event loop after every optimizer step."""
        self._step_listeners.append(listener)

    @property
    def at_risk(self) -> int:
        """Optimizer steps applied here that no checkpoint and no replica holds yet."""
        return max(0, self.compute.steps - max(self.durable_step, self.replicas.last_synced_step))

    async def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The stage's whole state (:meth:`StageCompute.export_state`), taken on the compute
        thread between two requests."""
        result: tuple[dict[str, torch.Tensor], dict[str, Any]] = await self._on_compute_thread("export")
        return result

    async def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                           source: str = "") -> None:
        """Take over a stage state (:meth:`StageCompute.import_state`): directly before
        :meth:`start`, on the compute thread after it. ``source`` says where it came from
        (``status()["started_from"]``: "checkpoint PATH", "replica HOST:PORT").

        Raises:
            StateMismatch: it does not fit these layers (nothing was changed).
        """
        if self._thread is None:
            self.compute.import_state(tensors, meta)
        else:
            await self._on_compute_thread("import", theirs=tensors, meta=meta)
        self.durable_step = self.compute.steps
        if source:
            self.started_from = source

    async def join(self, peers: Sequence[tuple[str, int]] | None = None) -> ReplicaState | None:
        """Copy the whole state (weights, optimizer state, steps, lineage) of the live replica
        among ``peers`` (default: the sync peers) that trained most, if it trained more than
        this one has; call it before :meth:`start`, so the stage serves nothing before. None
        (and nothing changed) when no peer answered or none is ahead.

        Raises:
            StateMismatch: the peer's state does not fit these layers (another model or
                layer range: the message says what differs).
        """
        asked = list(self.replicas.peers if peers is None else peers)
        if not asked:
            return None
        own = sum(t.numel() * t.element_size() for t in self.compute.layers.state_dict().values())
        state = await fetch_replica_state(asked, secret=self.secret, timeouts=self.config.timeouts,
                                          timeout=self.config.sync_timeout, max_bytes=8 * own + (1 << 20),
                                          tls=self.tls, name=self.name)
        if state is None or state.steps <= self.compute.steps:
            if state is not None:
                log.info("%s: the replica at %s:%d is at optimizer step %d, this one at %d: keeping its own",
                         self.name, *state.peer, state.steps, self.compute.steps)
            return None
        try:
            await self.import_state(state.tensors, state.meta, source="replica {}:{}".format(*state.peer))
        except StateMismatch as exc:
            raise StateMismatch(f"{self.name}: the replica at {state.peer[0]}:{state.peer[1]} holds another "
                                f"stage: {exc}") from exc
        self.replicas.last_synced_step = self.compute.steps  # a copy: nothing here only
        self.joined = {"from": "{}:{}".format(*state.peer), "steps": state.steps,
                       "fingerprint": self.compute.fingerprint()}
        log.info("%s: copied the state of the replica at %s:%d before serving: optimizer step %d, weights "
                 "fingerprint %s", self.name, *state.peer, state.steps, self.compute.fingerprint())
        return state

    @property
    def port(self) -> int:
        """The port the server listens on.

        Raises:
            SwarmError: not started.
        """
        if self._server is None:
            raise SwarmError(f"{self.name} is not listening yet")
        return self._server.port

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` to give routers and replicas."""
        return self.config.host, self.port

    async def start(self) -> None:
        """Listen, and start the compute thread and the answer send loop."""
        self._loop = asyncio.get_running_loop()
        await self.outbound.start()
        self._thread = threading.Thread(target=self._compute_loop, name=f"{self.name}-compute", daemon=True)
        self._thread.start()
        self._infer_thread = threading.Thread(target=self._infer_loop, name=f"{self.name}-infer", daemon=True)
        self._infer_thread.start()
        if self.config.monitor_interval > 0:
            # (not the inference buffer: empty is its normal state, not starvation)
            self.monitor = BufferMonitor({f"{self.name}.in": self.inbound, f"{self.name}.out": self.outbound},
                                         interval=self.config.monitor_interval)
            self.monitor.start()
        cfg = self.config
        self._server = await start_server(
            cfg.host, cfg.port, self._handle, secret=self.secret, tls=self.tls, timeouts=cfg.timeouts,
            role_limits=self.role_limits(), server_limits=cfg.server_limits())
        log.info("%s serving layers [%d, %d) on %s:%d", self.name, *self.layer_range,
                 self.config.host, self.port)

    def role_limits(self) -> dict[str, Limits]:
        """What one frame from each role may carry. A replica's STAGE_SYNC holds this stage's
        parameters: at most twice their bytes (plus 1 MiB) and a few tensors more than there
        are parameters. A trainer's or generation client's request holds at most an
        activation (or its gradient) and targets: ``max_request_mb`` and 4 tensors. Headers
        hold tensor names and a few fields: 64 KiB plus what the parameters' names need.
        (A sync's "parameters" are what replicas average: trainable parameters, float32
        masters of half-precision ones, and buffers.)"""
        params = self.compute.sync_tensors()
        names = sum(len(n.encode()) + _HEADER_BYTES_PER_TENSOR for n in params)
        return {
            "stage": Limits(max_header_bytes=_HEADER_BYTES + names,
                            max_payload_bytes=payload_limit(params.values()), max_tensors=len(params) + 8),
            "pipeline": Limits(max_header_bytes=_HEADER_BYTES,
                               max_payload_bytes=int(self.config.max_request_mb * (1 << 20)), max_tensors=4),
        }

    async def close(self) -> None:
        """Stop serving: close connections, drop queued work, stop the compute thread."""
        await self._shutdown(abrupt=False)

    def abort(self) -> None:
        """Crash now, synchronously: stop listening, reset every connection, answer nothing
        more (work in progress may finish, but its answer is not sent). Then await
        :meth:`close` to release the threads."""
        self._stopping = True
        if self._server is not None:
            self._server.server.close()
            for conn in list(self._server.connections):
                conn.abort(SwarmError(f"{self.name} killed"))
        for buf in (self.inbound, self.infer_inbound):
            buf.close()
            buf.clear()

    async def kill(self) -> None:
        """Stop as a crash would (:meth:`abort`), then release the threads."""
        self.abort()
        await self._shutdown(abrupt=True)

    def status(self) -> dict[str, Any]:
        """Layers held and their device, optimizer steps, micro-batches, cache and sync
        counters, loss scale (float16 stages), refusals
        (full buffer, failed handshakes, bad input; ``senders``: the last
        1024 addresses refused for their input, by address) and the metrics of both buffers."""
        with self._senders_lock:
            senders = {addr: dict(rec) for addr, rec in self._sender_log.items()}
        return {
            "name": self.name, "stage": self.stage, "layers": list(self.layer_range),
            "device": str(self.compute.device),
            **self.compute.status(),
            "incarnation": self.incarnation, "started_from": self.started_from,
            "shape": self.compute.shape, "origin": self.compute.origin,
            # (while training, at most every 30 s: it reads every weight under the weights lock,
            # which inference and the optimizer wait for, and statuses are asked for every second)
            "fingerprint": self.compute.fingerprint(max_age=30.0), "at_risk": self.at_risk,
            "durable_step": max(self.durable_step, self.replicas.last_synced_step),
            "sync_rounds": self.replicas.rounds, "sync_served": self.sync_served,
            "joins_served": self.joins_served, "last_join_served": self.last_join_served,
            "joined": self.joined,
            "sync_failures": self.replicas.failures, "refused": self.refused,
            "bad_input": self.bad_input, "sender_disconnects": self.sender_disconnects,
            "senders": senders,
            "failed_handshakes": 0 if self._server is None else self._server.failed_handshakes,
            # everything refused, by reason: connections (handshakes, caps) and requests
            "refusals": merge_refusals([self.refusals, *([self._server.refused] if self._server else [])]),
            "traffic": self._server.traffic() if self._server is not None else {},
            "inbound": dataclasses.asdict(self.inbound.metrics()),
            "infer_inbound": dataclasses.asdict(self.infer_inbound.metrics()),
            "outbound": dataclasses.asdict(self.outbound.metrics()),
        }

    async def sync_now(self) -> int:
        """Average parameters with every sync peer once, now.

        Returns:
            How many peers the round succeeded with (failures are logged and counted).
        """
        return await self.replicas.sync_now()

    # -- network side ----------------------------------------------------------------------

    async def _handle(self, conn: Connection, role: str) -> None:
        if role not in _ROLES:
            await conn.close(Error(code="bad_role", message=f"a stage server serves roles {_ROLES}, "
                                   f"not {role!r}"))
            return
        with self._senders_lock:
            self._senders[conn] = _Sender(peer_ip(conn.transport))  # as the connection limits count it
        try:
            while True:
                try:
                    msg = await conn.recv()
                except RemoteProtocolError as exc:
                    self._log_bad_frame(conn, role, exc)
                    return
                except SwarmError:
                    return
                refusal = self._admit(conn, role, msg)
                if refusal is None:
                    continue
                if self._count_answer(conn, refusal):
                    await self._disconnect(conn, refusal)
                    return
                with contextlib.suppress(SwarmError):
                    await conn.send(refusal, timeout=self.config.reply_timeout)
        finally:
            with self._senders_lock:
                del self._senders[conn]

    def _log_bad_frame(self, conn: Connection, role: str, exc: RemoteProtocolError) -> None:
        """The transport has told the sender what was wrong with its frame, logged it and
        dropped the connection; for a frame over this stage's limits, say what to do."""
        if exc.code != "oversize_payload":
            return
        if role == "pipeline":
            hint = (f"a request carries micro-batch x context x width x 4 bytes: a bigger one needs a "
                    f"bigger max_request_mb (--max-request-mb, now {self.config.max_request_mb:g})")
        else:
            hint = "a replica's sync carries this stage's parameters: is it the same model and stage?"
        log.warning("%s: dropped the connection of the %s at %s (%s); %s", self.name, role, conn.peer,
                    exc, hint)

    def _count_answer(self, conn: Connection, answer: Message) -> bool:
        """Count a refusal that ``conn``'s input earned (an answered request starts the count
        again); True once it has ``max_bad_in_row`` in a row, when the caller must
        :meth:`_disconnect` it (True once per connection). Any thread."""
        if isinstance(answer, StageError):
            self.refusals.count(answer.code)
        refused = isinstance(answer, StageError) and answer.code in SENDERS_FAULT
        if not refused and not isinstance(answer, StageResult | StageGrad | StageSync | StageStep):
            return False
        with self._senders_lock:
            sender = self._senders.get(conn)
            if sender is None or sender.disconnecting:
                return False
            if not refused:
                sender.bad_in_row = 0
                return False
            assert isinstance(answer, StageError)
            why = answer.message[:_MAX_REFUSAL_CHARS]
            sender.bad_in_row += 1
            self.bad_input += 1
            rec = self._sender_log.pop(sender.address, None) or {"refused": 0, "disconnected": 0}
            rec["refused"] += 1
            rec["last_refusal"] = f"{answer.code}: {why}"
            if sender.bad_in_row >= self.config.max_bad_in_row:
                sender.disconnecting = True
                rec["disconnected"] += 1
                self.sender_disconnects += 1
            self._sender_log[sender.address] = rec  # now the newest
            if len(self._sender_log) > _MAX_SENDER_RECORDS:
                self._sender_log.popitem(last=False)
            return sender.disconnecting

    async def _disconnect(self, conn: Connection, refusal: Message) -> None:
        """Answer ``refusal``, then close ``conn`` with ERROR ``too_many_bad`` (event loop)."""
        last = refusal.message[:_MAX_REFUSAL_CHARS] if isinstance(refusal, StageError) else ""
        why = (f"{self.name}: disconnected: {self.config.max_bad_in_row} requests in a row were refused "
               f"for what they carried (last: {last}); check that the client runs the same --task, "
               "model flags and swarmtrain version as the stages, and sends finite values")
        log.warning("%s: closing the connection of %s: %s", self.name, conn.peer, why)
        with contextlib.suppress(SwarmError):
            await conn.send(refusal, timeout=self.config.reply_timeout)
        await conn.close(Error(code="too_many_bad", message=why))

    def _admit(self, conn: Connection, role: str, msg: Message) -> Message | None:
        """Queue the work ``msg`` asks for; an answer to send at once, or None."""
        req = getattr(msg, "req", 0)
        if isinstance(msg, StatusRequest):
            return Status(status=self.status())
        if isinstance(msg, StageSync) and role != "stage":  # only replicas move our weights
            return StageError(req=req, code=StageErrorCode.UNEXPECTED,
                              message=f"{self.name}: replica sync is for role 'stage', not {role!r}")
        try:
            job = self._job_for(conn, msg)
        except (BadInput, ValueError) as exc:  # WorkPacket refuses negative ids with ValueError
            return StageError(req=req, code=StageErrorCode.BAD_INPUT, message=f"{self.name}: {exc}")
        if job is None:
            return StageError(req=req, code=StageErrorCode.UNEXPECTED,
                              message=f"{self.name} does not serve {msg.TYPE.name} messages")
        buf = self.infer_inbound if job.kind is JobKind.INFER else self.inbound
        try:
            queued = buf.put_nowait(job)
        except BufferClosed:
            return StageError(req=req, code=StageErrorCode.CLOSING, message=f"{self.name} is shutting down")
        if not queued:
            self.refused += 1
            what = "inference" if buf is self.infer_inbound else "inbound"
            return StageError(req=req, code=StageErrorCode.OVERLOADED,
                              message=f"{self.name}: {what} buffer full ({buf.capacity} packets)")
        return None

    def _job_for(self, conn: Connection, msg: Message) -> _Job | None:
        first = self.layer_range[0]
        peer = conn.peer
        if isinstance(msg, StageForward | StageInfer):
            x = _tensor(msg.tensors, "x")
            allowed = _FORWARD_PRIORITIES if isinstance(msg, StageForward) else _INFER_PRIORITIES
            if msg.priority not in allowed:
                raise BadInput(f"priority {msg.priority} not allowed for {msg.TYPE.name}; "
                               f"use one of {sorted(int(p) for p in allowed)}")
            if isinstance(msg, StageForward):
                return _Job(Priority(msg.priority), msg.session, msg.microbatch, x, peer, first,
                            "forward", kind=JobKind.FORWARD, req=msg.req, conn=conn,
                            targets=msg.tensors.get("targets"), step=msg.step if msg.sync else None,
                            group=_group(msg))
            return _Job(Priority(msg.priority), msg.session, 0, x, peer, first, "forward",
                        kind=JobKind.INFER, req=msg.req, conn=conn,
                        cache_start=msg.start if msg.cache else None)
        if isinstance(msg, StageBackward):
            grad = _tensor(msg.tensors, "grad")
            return _Job(Priority.TRAINING_BACKWARD, msg.session, msg.microbatch, grad, peer, first,
                        "backward", grad=grad, kind=JobKind.BACKWARD, req=msg.req, conn=conn,
                        step=msg.step if msg.sync else None, group=_group(msg))
        if isinstance(msg, StageStep) and not msg.reply:
            if msg.group < 0 or msg.group_size < 1:
                raise BadInput(f"a step needs its group (group >= 0, group_size >= 1), got {msg.group}, "
                               f"{msg.group_size}")
            return _Job(Priority.TRAINING_BACKWARD, msg.session, msg.group, torch.zeros(()), peer, first,
                        "forward", kind=JobKind.STEP, req=msg.req, conn=conn,
                        group=(msg.group, msg.group_size), scale=msg.scale)
        if isinstance(msg, StageSync) and msg.join and not msg.reply:
            return _Job(Priority.GRADIENT_SYNC, "sync", msg.round, torch.zeros(()), peer, first,
                        "forward", kind=JobKind.JOIN_SERVE, req=msg.req, conn=conn, sync_round=msg.round)
        if isinstance(msg, StageSync) and not msg.reply:
            return _Job(Priority.GRADIENT_SYNC, "sync", msg.round, torch.zeros(()), peer, first,
                        "forward", kind=JobKind.SYNC_SERVE, req=msg.req, conn=conn, theirs=dict(msg.tensors),
                        sync_round=msg.round, meta=dict(msg.meta), sync_step=msg.step)
        return None

    async def _send_reply(self, packet: WorkPacket) -> None:
        assert isinstance(packet, _Reply) and packet.conn is not None and packet.message is not None
        await packet.conn.send(packet.message, timeout=self.config.reply_timeout)

    def _reply_lost(self, packet: WorkPacket) -> None:
        log.info("%s: answer for %s/%d not delivered (client gone)", self.name, packet.session_id,
                 packet.microbatch_id)

    async def _on_compute_thread(self, kind: JobKind | str, **extra: Any) -> Any:
        """Run a job of one of the :data:`_INTERNAL_KINDS` (or its value: the replica rounds
        name theirs) on the training compute thread, between two requests; its result."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        job = _Job(Priority.GRADIENT_SYNC, "sync", 0, torch.zeros(()), self.name, self.layer_range[0],
                   "forward", kind=JobKind(kind), result=done, **extra)
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self.inbound.put, job, self.config.sync_timeout):
            raise SwarmError(f"{self.name}: inbound buffer stayed full; sync skipped")
        return await asyncio.wrap_future(done)

    async def _shutdown(self, abrupt: bool) -> None:
        self._stopping = True
        if self._server is not None and not abrupt:
            await self._server.close()
        for buf in (self.inbound, self.infer_inbound):
            buf.close()
            buf.clear()
        for thread in (self._thread, self._infer_thread):
            if thread is not None:
                await asyncio.get_running_loop().run_in_executor(None, thread.join, 30.0)
        await self.replicas.close()
        if self.monitor is not None:
            self.monitor.stop()
        await self.outbound.close()

    # -- compute thread --------------------------------------------------------------------

    def _compute_loop(self) -> None:
        _lower_thread_priority(self.config.training_nice, self.name)
        self._work_loop(self.inbound, self._answer)

    def _infer_loop(self) -> None:
        self._work_loop(self.infer_inbound, self._answer_now)

    def _work_loop(self, buffer: ActivationBuffer, answer_with: Any) -> None:
        while True:
            job = buffer.get(timeout=1.0)
            if job is None:
                if buffer.closed:
                    return
                continue
            assert isinstance(job, _Job)
            if self._stopping:
                if job.result is not None:
                    job.result.set_exception(SwarmError(f"{self.name} is shutting down"))
                continue
            try:
                answer = self._run(job)
            except Exception as exc:  # noqa: BLE001 - every failure is answered, none kills the stage
                if job.result is not None:
                    job.result.set_exception(exc)
                    continue
                answer = self._failure(job, exc)
            if answer is not None and job.conn is not None and not self._stopping:
                try:
                    if self._count_answer(job.conn, answer):
                        assert self._loop is not None
                        asyncio.run_coroutine_threadsafe(self._disconnect(job.conn, answer), self._loop)
                    else:
                        answer_with(job, answer)
                except RuntimeError:  # the event loop is gone: close() was never awaited
                    log.error("%s: event loop closed under a running stage; stopping", self.name)
                    return

    def _failure(self, job: _Job, exc: Exception) -> StageError:
        code: StageErrorCode
        if isinstance(exc, BadInput):
            code = StageErrorCode.BAD_INPUT
        elif isinstance(exc, UnknownMicrobatch):
            code = StageErrorCode.UNKNOWN_MICROBATCH
        elif isinstance(exc, CacheMiss):
            code = StageErrorCode.CACHE_MISS
        else:  # a bug: log it, tell the client, keep serving
            code = StageErrorCode.INTERNAL
            log.error("%s: %s of %s/%d failed", self.name, job.kind.value, job.session_id, job.microbatch_id,
                      exc_info=exc)
        return StageError(req=job.req, code=code, message=f"{self.name}: {exc}")

    def _run(self, job: _Job) -> Message | None:
        c = self.compute
        if job.kind is JobKind.FORWARD:
            steps = c.steps
            out = c.forward(job.session_id, job.microbatch_id, job.tensor, job.targets, job.step, job.group)
            self._after(steps)
            tensors = {"y": out.y} if out.y is not None else {}
            if out.grad is not None:
                tensors["grad"] = out.grad
            return StageResult(req=job.req, session=job.session_id, microbatch=job.microbatch_id,
                               done=out.done, tensors=tensors, **self._training_answer(out))
        if job.kind is JobKind.BACKWARD:
            assert job.grad is not None
            steps = c.steps
            out = c.backward(job.session_id, job.microbatch_id, job.grad, job.step, job.group)
            self._after(steps)
            return StageGrad(req=job.req, session=job.session_id, microbatch=job.microbatch_id,
                             duplicate=out.cached, tensors={} if out.grad is None else {"grad": out.grad},
                             **self._training_answer(out))
        if job.kind is JobKind.INFER:
            y = c.infer(job.tensor) if job.cache_start is None else c.infer_cached(
                job.session_id, job.tensor, job.cache_start)
            return StageResult(req=job.req, session=job.session_id, microbatch=0, tensors={"y": y})
        if job.kind is JobKind.STEP:
            assert job.group is not None
            steps = c.steps
            missing = c.step_group(job.session_id, job.group, job.scale)
            self._after(steps)
            return StageStep(req=job.req, session=job.session_id, group=job.group[0], group_size=job.group[1],
                             scale=job.scale, reply=True, missing=list(missing),
                             **self._training_answer())
        if job.kind is JobKind.JOIN_SERVE:
            tensors, meta = c.export_state()
            self.joins_served += 1
            self.last_join_served = {"to": str(job.source), "steps": meta["steps"],
                                     "fingerprint": meta["fingerprint"]}
            log.info("%s: a replica joining from %s copies this stage's state (optimizer step %d, "
                     "fingerprint %s)", self.name, job.source, meta["steps"], meta["fingerprint"])
            return StageSync(req=job.req, round=job.sync_round, step=c.steps, reply=True, join=True,
                             tensors=tensors, meta=meta)
        if job.kind is JobKind.SYNC_SERVE:
            mine = c.parameters_snapshot()
            theirs_trained = job.meta.get("trained")
            ours, their_share = sync_fractions(c.trained_since_sync,
                                               theirs_trained if isinstance(theirs_trained, int) else None)
            c.move_towards(mine, job.theirs, fraction=ours)
            if ours == 1.0:  # took the other's state: and its place in the run
                c.adopt_steps(job.sync_step)
            c.synced_at_step()
            self.sync_served += 1
            self.durable_step = max(self.durable_step, c.steps)
            return StageSync(req=job.req, round=job.sync_round, step=c.steps, reply=True, tensors=mine,
                             meta={"fraction": their_share})
        assert job.result is not None
        if job.kind is JobKind.EXPORT:
            job.result.set_result(c.export_state())
        elif job.kind is JobKind.IMPORT:
            c.import_state(job.theirs, job.meta)
            job.result.set_result(None)
        elif job.kind is JobKind.SNAPSHOT:
            job.result.set_result(c.parameters_snapshot())
        elif job.kind is JobKind.SYNC_APPLY:
            fraction = job.meta.get("fraction", 0.5)
            fraction = float(fraction) if fraction in (0.0, 0.5, 1.0) else 0.5
            c.move_towards(job.mine, job.theirs, fraction=fraction)
            if fraction == 1.0:
                c.adopt_steps(int(job.meta.get("their_step", 0)))
                c.synced_at_step()
            else:
                c.synced_at_step(int(job.meta.get("at_step", c.steps)))
            job.result.set_result(None)
        return None

    def _training_answer(self, out: StageOutcome | None = None) -> dict[str, Any]:
        """The fields every training answer carries besides its tensors (see STAGE_RESULT)."""
        fields: dict[str, Any] = {"steps": self.compute.steps, "at_risk": self.at_risk,
                                  "incarnation": self.incarnation}
        if out is not None:
            fields["missing"] = list(out.missing)
            if out.grad_sq is not None:  # (an overflowed or NaN norm: the cap, so the step is ~0)
                finite = out.grad_sq == out.grad_sq
                fields["grad_sq"] = min(out.grad_sq, MAX_GRAD_SQ) if finite else MAX_GRAD_SQ
        return fields

    def _after(self, steps_before: int) -> None:
        every, steps = self.config.sync_every, self.compute.steps
        if steps == steps_before or self._stopping:
            return
        assert self._loop is not None
        if every and steps % every == 0:
            self._loop.call_soon_threadsafe(self.replicas.start_round)
        for listener in self._step_listeners:
            self._loop.call_soon_threadsafe(listener, steps)

    def _reply(self, job: _Job, answer: Message) -> _Reply:
        return _Reply(job.priority, job.session_id, job.microbatch_id, job.tensor, job.source,
                      job.target_layer, "forward", message=answer, conn=job.conn)

    def _answer_now(self, job: _Job, answer: Message) -> None:
        """Inference answers skip the outbound queue (training answers may be waiting there)."""
        self._send_from_thread(self._reply(job, answer), wait=False)

    def _answer(self, job: _Job, answer: Message) -> None:
        reply = self._reply(job, answer)
        try:
            if self.outbound.offer(reply) is not OfferResult.REFUSED:
                return
        except BufferClosed:
            return
        # The send loop is behind: send it from here and wait (backpressure on compute).
        self._send_from_thread(reply, wait=True)

    def _send_from_thread(self, reply: _Reply, *, wait: bool) -> None:
        """Send ``reply`` on the event loop from the compute thread, waiting for it or not; an
        answer that cannot be delivered is reported (:meth:`_reply_lost`), never dropped quietly."""
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._send_reply(reply), self._loop)
        if not wait:
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is None
                                  else self._reply_lost(reply))
            return
        try:
            fut.result(self.config.reply_timeout)
        except Exception:  # noqa: BLE001 - any failure to deliver is the same to the client
            fut.cancel()
            self._reply_lost(reply)


def _group(msg: StageForward | StageBackward) -> tuple[int, int] | None:
    named = msg.sync and msg.group >= 0 and msg.group_size > 0
    return (msg.group, msg.group_size) if named else None


def _tensor(tensors: Any, name: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise BadInput(f"the request lacks the tensor {name!r} (it carries {sorted(tensors)})")
    return t


def _lower_thread_priority(nice: int, name: str) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux schedules threads one by one;
    elsewhere this would renice the whole process, so it is left alone there)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.info("%s: could not lower the training thread's priority (%s); inference may wait "
                 "behind training when the cores are busy", name, exc)
