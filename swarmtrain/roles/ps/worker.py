"""The parameter-server worker: computes gradients on its shard and pushes them.

The forward/backward pass runs on a dedicated thread while the event loop keeps the
connection alive. With ``max_inflight = 1`` the next gradient may be computed while the
previous one is packed, sent and answered (the next computation starts first, so the
compute thread never waits for the encoding) -- but that gradient is then computed on
weights one round older, which doubles its staleness. So the worker overlaps only when it pays:
when the measured round trip is more than :data:`OVERLAP_MIN_FRACTION` of a step's compute
(a slow link); on a fast one it waits the few milliseconds for fresh weights. The worker's
replica changes only between two computations, by exactly what the coordinator sent (a delta
or full weights).

Only parameters that got a gradient travel (frozen ones never; see :mod:`swarmtrain.core.modelstate`),
each in its model's dtype; how the computation changed the model's buffers (BatchNorm statistics)
travels with it, and the coordinator's current buffer values come back with the answer. A float16
model scales its loss (:mod:`swarmtrain.core.precision`). Every batch is drawn (shuffling included)
from a random stream of this worker's own (:mod:`swarmtrain.roles.ps.randomness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import random
import secrets as _secrets
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from swarmtrain.compression import Compressed, ErrorFeedback
from swarmtrain.config import WorkerConfig, apply_kwargs, resolve_secret, resolve_tls
from swarmtrain.core import hardware
from swarmtrain.core.devices import batch_to, resolve_device
from swarmtrain.core.ema import MovingAverage
from swarmtrain.core.modelstate import ModelState, buffer_changes, snapshot_buffers
from swarmtrain.core.precision import LossScaler
from swarmtrain.errors import (
    AuthError,
    ConnectionLost,
    ProtocolError,
    RefusedError,
    StateError,
    SwarmError,
    SwarmTimeout,
)
from swarmtrain.roles.ps.cluster import split_address
from swarmtrain.roles.ps.common import (
    FUSED,
    codec_for_step,
    fuse_dense,
    pack_buffers,
    pack_compressed,
    payload_bytes,
)
from swarmtrain.roles.ps.partition import Partition, group_module, partition_model
from swarmtrain.roles.ps.randomness import CycledIterable, OwnRandomness, loader_generators, worker_seed
from swarmtrain.roles.ps.replica import Replica
from swarmtrain.roles.ps.serverlinks import ServerLink, ServerLost, total_norm
from swarmtrain.tasks import Dataset, Shard
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.transport.auth import cluster_secret
from swarmtrain.transport.direct import DirectLink
from swarmtrain.transport.identity import Identity, node_identity
from swarmtrain.wire import (
    Assign,
    Error,
    Gradients,
    Message,
    Pause,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    Start,
    Update,
    Weights,
)

__all__ = ["Worker", "WorkerState", "TRANSITIONS"]

#: overlap the next computation with the answer in flight only when the round trip is at
#: least this fraction of a step's compute; below it, fresher weights are worth more
OVERLAP_MIN_FRACTION = 0.1

#: a computation whose moving average is below this runs on the event loop itself, not on the
#: compute thread: handing a 0.5 ms step of a small model to a thread and back costs two
#: wake-ups and two hand-overs of the interpreter lock, a real fraction of the step, while
#: blocking the loop that long delays no heartbeat. Longer ones keep the thread, so the loop
#: reads answers and keeps the connection alive while a big model computes.
INLINE_COMPUTE_SEC = 0.002
#: steps shorter than this, of gradients no larger than :data:`DIRECT_MAX_BYTES`, run on the
#: compute thread with the socket lent to it (``[network] direct_io``): per message, one system
#: call each way and no hand-over between threads, which is a real fraction of such a step.
#: Longer steps keep the event loop, which takes answers in while a step computes (with the
#: socket lent, an answer waits in the kernel's buffers until the step is done) and sends
#: heartbeats during a step that outlasts their interval
DIRECT_ENTER_SEC = 0.010
#: ... until a step's moving average passes this
DIRECT_LEAVE_SEC = 2 * DIRECT_ENTER_SEC
#: the largest gradient (uncompressed bytes) trained on a lent socket
DIRECT_MAX_BYTES = 4 << 20

log = logging.getLogger("swarmtrain.worker")

LossFn = Callable[[nn.Module, Any], torch.Tensor]


#: what one computation hands back: compressed gradients, mean loss, samples, seconds
#: (throttle included), the error-feedback residual's norm after it, and how it changed the
#: buffers (empty gradients: a float16 overflow, dropped)
_Computed = tuple[dict[str, Compressed], float, int, float, float, dict[str, torch.Tensor]]

#: coordinator refusals after which a worker connects again instead of giving up (its
#: gradients were refused, not its model or config)
_RETRYABLE_REFUSALS = frozenset({"too_many_bad_gradients"})


# How much of the old average each smoothed quantity keeps (swarmtrain.core.ema):
#: compute and round-trip times decide whether to overlap sending with computing: they
#: follow a change of speed or of the link within a few messages
TIMING_KEEP = 0.8
#: the speed sent to the coordinator (it plans shards and weights from it), over about ten
#: messages: one slow step (a GC pause, another job) does not re-plan the work
SPEED_KEEP = 0.9

_MAX_SAMPLES_PER_SEC = Register.BOUNDS["samples_per_sec"].hi or 0.0
_MAX_LOSS = Gradients.BOUNDS["loss"].hi or 0.0


def _wire_float(x: float) -> float:
    """``x`` as GRADIENTS carries it: a loss or norm that is not finite or beyond the wire's
    bound (a diverged step) goes as NaN, which the coordinator refuses as "no finite loss"."""
    return x if math.isfinite(x) and abs(x) <= _MAX_LOSS else math.nan


class WorkerState(enum.Enum):
    """Where a worker is in its life; it moves only as :data:`TRANSITIONS` allows."""

    #: not registered: connecting, registering, or about to connect again
    CONNECTING = "connecting"
    #: registered; the coordinator waits for ``min_workers`` before training starts
    WAITING = "waiting for the start"
    #: registered, training not started, and the cluster paused
    WAITING_PAUSED = "paused before the start"
    TRAINING = "training"
    #: the coordinator paused the cluster: connected, computing nothing
    PAUSED = "paused"
    #: the connection failed under the reader (``_broken_by`` says how): the session ends
    BROKEN = "connection broken"
    #: stopped (:meth:`Worker.stop`, or the coordinator said SHUTDOWN)
    STOPPED = "stopped"


_S = WorkerState
_REGISTERED = (_S.WAITING, _S.WAITING_PAUSED, _S.TRAINING, _S.PAUSED)
#: every move a worker may make, from each state (a move not listed raises StateError)
TRANSITIONS: Mapping[WorkerState, frozenset[WorkerState]] = {
    _S.CONNECTING: frozenset({*_REGISTERED, _S.STOPPED}),
    _S.WAITING: frozenset({_S.TRAINING, _S.WAITING_PAUSED, _S.BROKEN, _S.CONNECTING, _S.STOPPED}),
    _S.WAITING_PAUSED: frozenset({_S.PAUSED, _S.WAITING, _S.BROKEN, _S.CONNECTING, _S.STOPPED}),
    _S.TRAINING: frozenset({_S.PAUSED, _S.BROKEN, _S.CONNECTING, _S.STOPPED}),
    _S.PAUSED: frozenset({_S.TRAINING, _S.BROKEN, _S.CONNECTING, _S.STOPPED}),
    _S.BROKEN: frozenset({_S.CONNECTING, _S.STOPPED}),
    _S.STOPPED: frozenset(),
}
#: where START, PAUSE and RESUME move a registered worker (absent: they change nothing)
_ON_CONTROL: Mapping[type[Message], Mapping[WorkerState, WorkerState]] = {
    Start: {_S.WAITING: _S.TRAINING, _S.WAITING_PAUSED: _S.PAUSED},
    Pause: {_S.WAITING: _S.WAITING_PAUSED, _S.TRAINING: _S.PAUSED},
    Resume: {_S.WAITING_PAUSED: _S.WAITING, _S.PAUSED: _S.TRAINING},
}
#: the state a REGISTER_ACK's (running, paused) puts a worker in
_REGISTERED_AS = {(False, False): _S.WAITING, (False, True): _S.WAITING_PAUSED,
                  (True, False): _S.TRAINING, (True, True): _S.PAUSED}


async def _wait_out(future: asyncio.Future[Any]) -> None:
    """Wait until ``future`` (a computation on the compute thread) is done, whatever it returns
    or raises: a reset must not find the thread still running. A cancellation meanwhile is
    not lost: it is raised once the computation is done."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            cancelled = exc
        except Exception:  # noqa: BLE001 - the computation is not wanted any more
            pass
    if not future.cancelled():
        future.exception()  # (retrieved: no "never retrieved" warning)
    if cancelled is not None:
        raise cancelled


class _ShutdownRequested(SwarmError):
    """The coordinator said SHUTDOWN: wakes any wait of the training loop."""


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return _batch_len(batch[0])
    return 1


class Worker:
    """Trains a replica of the model on one shard and pushes gradients to a coordinator.

    Args:
        model: a plain PyTorch model, the same architecture as the coordinator's.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        data: a dataset with ``__len__`` and ``get_batch(indices)`` (sharded by the
            coordinator), or any iterable of batches (e.g. a DataLoader; cycled).
        config: a :class:`WorkerConfig` (defaults if None).
        task_name: the task name, checked against the coordinator's.
        secret: the cluster secret; default from config / SWARMTRAIN_SECRET.
        **overrides: config keys by name, e.g. ``coordinator_host="10.0.0.2", batch_size=32``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        data: Dataset | Iterable[Any],
        config: WorkerConfig | None = None,
        *,
        task_name: str = "",
        secret: bytes | str | None = None,
        sample_bytes: int | None = None,
        identity: Identity | None = None,
        **overrides: Any,
    ) -> None:
        # the caller loads files and the environment (load_worker_config); keywords adjust
        # (``host``/``port`` are the flags of coordinator_host/coordinator_port)
        cfg = apply_kwargs(config if config is not None else WorkerConfig(), overrides)
        self.config = cfg
        self.model = model
        self.loss_fn = loss_fn
        self.data = data
        self.task_name = task_name
        self.secret = cluster_secret(secret) if secret is not None else resolve_secret(cfg.security)
        self.tls = resolve_tls(cfg.security)
        t = cfg.training
        self.device = resolve_device(t.device)
        if self.device.type != "cpu":
            model.to(self.device)  # in place: the caller's model computes on the device
        self.state = ModelState(model)
        self._modules = list(model.modules())
        #: Module.zero_grad(set_to_none=True) without walking the module tree every step (the
        #: model's own, if it has one)
        self._param_list = list(model.parameters())
        self._own_zero_grad = type(model).zero_grad is not torch.nn.Module.zero_grad
        #: the trainable parameters (the model's own tensors; gradients travel for these)
        self.params: dict[str, torch.Tensor] = self.state.trainable
        self.buffers = self.state.synced_buffers
        self.scaler = LossScaler.for_model(self.params.values())
        self.worker_id = t.worker_id or f"w-{_secrets.token_hex(4)}"
        #: what this worker's random streams derive from, beside the seed: the id it was given,
        #: else its number at the coordinator (the order workers first joined in), set by the
        #: first REGISTER_ACK. Not the generated id: a run of one seed draws the same batches
        #: every time, and workers started alike still draw different ones.
        self._stream: tuple[object, ...] | None = (t.worker_id,) if t.worker_id else None
        #: this machine's node key: the coordinator binds the worker id to its peer id
        self.identity = identity or node_identity(
            "this worker's id cannot be reclaimed by a restarted worker until the coordinator forgets it")
        self.randomness = OwnRandomness(worker_seed(t.seed, *self._stream_parts), loader_generators(data),
                                        cuda=self.device.type == "cuda")
        self._cycled = CycledIterable(data)  # type: ignore[arg-type]
        self.hw = hardware.detect()
        self.plan = hardware.recommend(
            self.hw, batch_size=t.batch_size, accumulation_steps=t.accumulation_steps,
            num_threads=cfg.hardware.num_threads, max_memory_mb=cfg.hardware.max_memory_mb,
            sample_bytes=sample_bytes,
        )
        if sample_bytes is not None:  # refuse now what would swap or be killed mid-run
            hardware.check_fits(
                self.hw, batch_size=self.plan.batch_size, sample_bytes=sample_bytes,
                model_bytes=sum(p.numel() * p.element_size() for p in self.state.full_state().values()),
                max_memory_mb=cfg.hardware.max_memory_mb)
        if cfg.hardware.num_threads:  # only when asked: the API must not surprise its host program
            torch.set_num_threads(cfg.hardware.num_threads)
        c = cfg.compression
        self.codec = codec_for_step(c, step=c.warmup_steps)  # the codec after warm-up
        # QSGD is unbiased and needs no memory; what topk and fp16 drop is sent later instead.
        self.feedback = ErrorFeedback(self.codec) if c.type in ("topk", "fp16") else None
        self.bytes_up = 0
        self.bytes_down = 0
        self.raw_bytes_per_step = sum(p.numel() * 4 for p in self.params.values())
        #: the replica the (leader) coordinator's answers change; in a sharded cluster, of the
        #: leader's group, and each other server has its own (:attr:`servers`)
        self._whole = self._replica = Replica(self.state, self.device)
        #: the other parameter servers of a sharded cluster (empty: one coordinator)
        self.servers: list[ServerLink] = []
        self._partition: Partition | None = None  # the sharded cluster's, once the leader said
        self.msg_id = 0
        self.steps = 0
        self.samples = 0
        self.speed = MovingAverage(SPEED_KEEP)  # samples/s, measured
        self.shards: list[int] = []
        self.num_shards = 0
        self.statuses: dict[str, int] = {}
        self._shard_cache: dict[tuple[int, int], Shard] = {}
        self._active_shards: list[Shard] = []
        self._turn = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="swarm-compute")
        self._replies: asyncio.Queue[Message | BaseException] = asyncio.Queue()
        self._changed = asyncio.Event()
        #: where the worker is in its life; changed by :meth:`_enter` alone
        self.lifecycle = WorkerState.CONNECTING
        self._broken_by: BaseException | None = None  # why it is BROKEN
        self._inflight = 0
        self._sent_at: dict[int, float] = {}
        self.round_trip_time = MovingAverage(TIMING_KEEP)  # gradient sent -> its answer arrived
        self.compute_time = MovingAverage(TIMING_KEEP)  # one message's compute, throttle included
        self.inline_computes = 0  # computations run on the event loop (quick steps)
        self.direct_bursts = 0  # times the socket was lent to the compute thread
        self._own_loop = False  # set by run(): the event loop is ours alone to block
        self.coordinator_aggregates = False  # training.aggregate_samples > 0 there: never overlap
        self.throttle = hardware.Throttle(self.config.training.speed)
        self._conn: Connection | None = None
        self._gen = torch.Generator().manual_seed(t.seed)
        self.shutdown_reason = ""
        self._largest_batch = 0  # samples of the largest batch computed (a DataLoader's may vary)
        self._claim_cap = 0  # the most samples a gradient may claim, as registered
        self._last_tick = self._connected_at = time.monotonic()
        #: (seconds, when noticed) of the last stretch this process was frozen (_watch_clock)
        self._frozen: tuple[float, float] = (0.0, 0.0)

    # -- lifecycle ---------------------------------------------------------------------------

    def _enter(self, state: WorkerState) -> None:
        """Move to ``state``: the one place the lifecycle changes (each move logged once).

        Raises:
            StateError: :data:`TRANSITIONS` has no move from the current state to ``state``.
        """
        old = self.lifecycle
        StateError.check_move("worker", TRANSITIONS, old, state)
        self.lifecycle = state
        log.debug("worker %s: %s -> %s", self.worker_id, old.value, state.value)
        self._changed.set()

    def _reconnecting(self) -> None:
        """The session is over (not by a stop): register again on the next connection."""
        if self.lifecycle not in (WorkerState.CONNECTING, WorkerState.STOPPED):
            self._enter(WorkerState.CONNECTING)

    # -- public ----------------------------------------------------------------------------

    def run(self) -> None:
        """Train until the coordinator says SHUTDOWN (blocking), on an event loop of its own
        (``run_async(own_loop=True)``)."""
        asyncio.run(self.run_async(own_loop=True))

    async def run_async(self, *, own_loop: bool = False) -> None:
        """Connect (reconnecting with backoff), train, and return after SHUTDOWN.

        Args:
            own_loop: the running event loop does nothing that a millisecond or two of
                blocking would hurt (the CLI's, :meth:`run`'s): quick steps are then computed
                on it rather than handed to the compute thread (:data:`INLINE_COMPUTE_SEC`).
                Off by default, so a worker in the caller's loop never blocks it.

        Raises:
            RefusedError: the coordinator refused this worker (model or config mismatch).
            AuthError: the cluster secrets differ, or a TLS certificate is refused.
            SwarmError: the coordinator stayed unreachable for ``reconnect_attempts`` tries.
        """
        self._own_loop = own_loop
        net = self.config.network
        failures = 0
        if self.config.training.probe_seconds > 0 and self.samples_per_sec == 0:
            loop = asyncio.get_running_loop()
            self.speed.value = await loop.run_in_executor(self._pool, self.probe) or None
            log.info("probe: %.0f samples/s at batch %d (profile %s)", self.samples_per_sec,
                     self.plan.batch_size, self.hw.profile.value)
            t = self.config.training
            if t.accumulation_steps == 0 and t.message_compute_ms > 0 and self.samples_per_sec > 0:
                accum = hardware.auto_accumulation(
                    self.plan.batch_size / self.samples_per_sec,
                    self.config.training.message_compute_ms / 1000)
                if accum != self.plan.accumulation_steps:
                    log.info("accumulating %d micro-batches per gradient (automatic: a batch takes "
                             "%.1f ms, a message should carry %.0f ms)", accum,
                             1000 * self.plan.batch_size / self.samples_per_sec,
                             self.config.training.message_compute_ms)
                    self.plan = dataclasses.replace(self.plan, accumulation_steps=accum)
        clock = asyncio.create_task(self._watch_clock())
        try:
            while self.lifecycle is not WorkerState.STOPPED:
                try:
                    conn = await connect(
                        net.coordinator_host, net.coordinator_port, secret=self.secret, tls=self.tls,
                        role="worker", identity=self.identity,
                        timeouts=Timeouts(connect=net.connect_timeout_sec,
                                          handshake=net.handshake_timeout_sec,
                                          heartbeat_interval=net.heartbeat_interval_sec,
                                          heartbeat_timeout=net.heartbeat_timeout_sec),
                    )
                    self._conn = conn
                    self._connected_at = time.monotonic()
                    await self._session(conn)
                    failures = 0
                except RefusedError as exc:
                    if exc.code not in _RETRYABLE_REFUSALS:
                        raise
                    # our gradients were refused in a row (a diverging step, a bad batch): the
                    # coordinator sends fresh weights when we register again
                    failures = 1
                    self._reconnecting()
                    delay = net.reconnect_delay_sec * random.uniform(0.8, 1.2)
                    log.warning("the coordinator disconnected us (%s); registering again in %.1f s "
                                "with fresh weights", exc, delay)
                    await asyncio.sleep(delay)
                except AuthError:
                    raise
                except _ShutdownRequested:
                    break
                except (ConnectionLost, SwarmTimeout, ProtocolError, ConnectionError) as exc:
                    if self.lifecycle is WorkerState.STOPPED:
                        break
                    # a session that got as far as registering starts the count afresh
                    was_registered = self.lifecycle is not WorkerState.CONNECTING
                    failures = 1 if was_registered else failures + 1
                    self._reconnecting()
                    if failures > net.reconnect_attempts:
                        raise SwarmError(
                            f"gave up reaching the coordinator at {net.coordinator_host}:"
                            f"{net.coordinator_port} after {net.reconnect_attempts} attempts: {exc}; "
                            "is it running, and is the address/port right?"
                        ) from exc
                    delay = net.reconnect_delay_sec * min(2 ** (failures - 1), 8) * random.uniform(0.8, 1.2)
                    self._say_disconnected(exc, was_registered, delay, failures)
                    await asyncio.sleep(delay)
                finally:
                    if self._conn is not None:
                        await self._conn.close()
                        self._conn = None
        finally:
            clock.cancel()
            await asyncio.gather(clock, return_exceptions=True)
            self._pool.shutdown(wait=True)
            self._apply_final()

    async def _watch_clock(self) -> None:
        """Note when this process did not run for longer than the heartbeat timeout (frozen by
        SIGSTOP, a suspended machine or VM, or starved of CPU): the event loop's ticks stop, the
        monotonic clock does not. :meth:`_frozen_for` reads it."""
        interval = self.config.network.heartbeat_interval_sec
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - self._last_tick - interval > self.config.network.heartbeat_timeout_sec:
                self._frozen = (now - self._last_tick - interval, now)
            self._last_tick = now

    def _frozen_for(self, since: float) -> float:
        """Seconds this process was frozen in one stretch ending now (the clock watch has not
        ticked since), or noticed after ``since`` (monotonic) and lately enough to be why a
        connection failed now (within three heartbeat timeouts); 0.0 if it was not."""
        net, now = self.config.network, time.monotonic()
        gap = now - self._last_tick - net.heartbeat_interval_sec
        frozen = gap if gap > net.heartbeat_timeout_sec else 0.0
        seconds, at = self._frozen
        recent = since <= at and now - at <= 3 * net.heartbeat_timeout_sec
        return max(frozen, seconds if recent else 0.0)

    def _say_disconnected(self, exc: BaseException, was_registered: bool, delay: float,
                          attempt: int) -> None:
        """The line for a lost or unreachable coordinator: this process frozen (its connection
        timed out, not the coordinator), a coordinator lost, or one never reached."""
        net = self.config.network
        where = f"{net.coordinator_host}:{net.coordinator_port}"
        retry = f"reconnecting in {delay:.1f} s (attempt {attempt} of {net.reconnect_attempts})"
        frozen = self._frozen_for(self._connected_at)
        if isinstance(exc, ServerLost) and not frozen:
            log.warning("parameter server %d at %s is %s; training waits until it is back: "
                        "registering again with the leader at %s and every server, %s", exc.index,
                        exc.address, exc.why, where, retry)
        elif frozen:
            log.warning("this process was paused or frozen for %.0f s (SIGSTOP, a suspended machine "
                        "or VM, or starved of CPU), longer than the heartbeat timeout of %g s, so its "
                        "connection to the coordinator at %s timed out (%s); %s", frozen,
                        net.heartbeat_timeout_sec, where, exc, retry)
        elif was_registered:
            log.warning("lost the coordinator at %s (%s); %s", where, exc, retry)
        else:
            log.warning("could not reach the coordinator at %s (%s); is it running? check --host/"
                        "--port (coordinator_host/coordinator_port); %s", where, exc, retry)

    def _apply_final(self) -> None:
        """Apply what arrived with SHUTDOWN (the final weights), so that :meth:`run` returns
        holding the coordinator's final state."""
        while not self._replies.empty():
            item = self._replies.get_nowait()
            if isinstance(item, Weights):
                self._load_full(item.tensors, item.version)

    def stop(self) -> None:
        """Stop after the current step (safe to call from a signal handler on the loop)."""
        if self.lifecycle is not WorkerState.STOPPED:
            self._enter(WorkerState.STOPPED)
        if self._conn is not None:
            self._conn.abort(SwarmError("worker stopped"))
        for link in self.servers:
            if link.conn is not None:
                link.conn.abort(SwarmError("worker stopped"))

    # -- one connection's life -------------------------------------------------------------

    async def _session(self, conn: Connection) -> None:
        self._reset_session()
        comp = self.config.compression
        # the most samples a gradient of ours claims is batch x accumulation: a DataLoader's
        # batches may be larger than the plan's (the largest seen is registered)
        batch = max(self.plan.batch_size, self._largest_batch)
        await conn.send(Register(
            worker_id=self.worker_id, task=self.task_name,
            fingerprint=self.state.fingerprint(), hardware=self.hw.to_dict(),
            batch_size=batch, accumulation_steps=self.plan.accumulation_steps,
            shard_index=self.config.data.shard_index,
            compression={k: getattr(comp, k) for k in comp.SHARED_KEYS},
            samples_per_sec=min(max(self.samples_per_sec, 0.0), _MAX_SAMPLES_PER_SEC)
            if math.isfinite(self.samples_per_sec) else 0.0, last_msg_id=self.msg_id,
            partition=self._partition.fingerprint if self._partition is not None else "",
        ))
        self._claim_cap = batch * self.plan.accumulation_steps
        ack = await conn.recv(timeout=conn.timeouts.handshake, phase="register")
        if isinstance(ack, Error):
            raise RefusedError(ack.code, ack.message)
        if not isinstance(ack, RegisterAck):
            raise ProtocolError("unexpected", f"expected REGISTER_ACK, got {ack.TYPE.name}")
        if self._stream is None:
            self._number_streams(ack.info.get("member"))
        self._use_shards(ack.shards or [ack.shard_index], ack.num_shards)
        # A restarted process reusing this worker id starts counting at 0; continue after the
        # last id the coordinator applied, or our new gradients would be taken for old ones.
        self.msg_id = max(self.msg_id, ack.last_applied_msg_id)
        self._place_in_cluster(ack.info)
        weights = await conn.recv(timeout=conn.timeouts.heartbeat_timeout, phase="weights")
        if not isinstance(weights, Weights):
            raise ProtocolError("unexpected", f"expected WEIGHTS, got {weights.TYPE.name}")
        self._load_full(weights.tensors, weights.version)
        try:
            await self._join_other_servers()
        except BaseException:
            await self._leave_other_servers()
            raise
        # a coordinator that aggregates holds answers until a window closes: a gradient computed
        # while one is in flight would always miss that window's update
        self.coordinator_aggregates = bool(ack.info.get("aggregate_samples"))
        if self.lifecycle is not WorkerState.STOPPED:  # (stopped meanwhile: it trains no more)
            self._enter(_REGISTERED_AS[ack.running, ack.paused])
        log.info("registered as %s: shards %s of %d, version %d, batch %d x %d",
                 self.worker_id, self.shards, self.num_shards, self.version,
                 self.plan.batch_size, self.plan.accumulation_steps)
        reader = asyncio.create_task(self._reader(conn))
        try:
            await (self._train_sharded(conn) if self.servers else self._train(conn))
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await self._leave_other_servers()

    # -- a sharded cluster (roles/ps/serverlinks.py) ---------------------------------------

    def _place_in_cluster(self, info: Mapping[str, Any]) -> None:
        """From the leader's REGISTER_ACK: one coordinator (the replica is the whole model), or
        a sharded cluster: the partition (computed here, checked against the leader's), the
        leader's group as the replica its answers change, and a link per other server.

        Raises:
            RefusedError: this worker splits the model differently from the leader.
        """
        servers = info.get("servers")
        if not isinstance(servers, list) or len(servers) < 2:
            self._partition, self._replica, self.servers = None, self._whole, []
            return
        partition = partition_model(self.model, len(servers))
        if partition.fingerprint != info.get("partition"):
            raise RefusedError("partition_mismatch", (
                f"this worker splits the model over {len(servers)} parameter servers with fingerprint "
                f"{partition.fingerprint}, the leader with {info.get('partition')}: run the same "
                "swarmtrain version and task settings on every machine"))
        self._partition = partition

        def replica(index: int) -> Replica:
            part = group_module(self.model, partition.groups[index], with_rest=index == 0)
            return Replica(ModelState(part), self.device)

        self._replica = replica(0)
        self.servers = [ServerLink(j, str(servers[j]), replica(j)) for j in range(1, len(servers))]

    async def _join_other_servers(self) -> None:
        """Register with every server but the leader (concurrently), load each one's weights
        and start its reader.

        Raises:
            ConnectionLost: a server cannot be reached (the worker tries again with backoff,
                from the leader on: training waits until every server is there).
            RefusedError: a server refused this worker (another partition, another model).
        """
        await asyncio.gather(*(self._join_server(link) for link in self.servers))

    async def _join_server(self, link: ServerLink) -> None:
        net, comp = self.config.network, self.config.compression
        host, port = split_address(link.address)
        try:
            conn = await connect(
                host, port, secret=self.secret, tls=self.tls, role="worker", identity=self.identity,
                timeouts=Timeouts(connect=net.connect_timeout_sec, handshake=net.handshake_timeout_sec,
                                  heartbeat_interval=net.heartbeat_interval_sec,
                                  heartbeat_timeout=net.heartbeat_timeout_sec))
        except (ConnectionLost, SwarmTimeout, ConnectionError, OSError) as exc:
            raise ServerLost(link.index, link.address, f"unreachable ({exc})") from exc
        link.conn = conn
        assert self._partition is not None
        await conn.send(Register(
            worker_id=self.worker_id, task=self.task_name, fingerprint=self.state.fingerprint(),
            hardware=self.hw.to_dict(), batch_size=max(self.plan.batch_size, self._largest_batch),
            accumulation_steps=self.plan.accumulation_steps, shard_index=-1,
            compression={k: getattr(comp, k) for k in comp.SHARED_KEYS},
            samples_per_sec=min(max(self.samples_per_sec, 0.0), _MAX_SAMPLES_PER_SEC)
            if math.isfinite(self.samples_per_sec) else 0.0, last_msg_id=self.msg_id,
            partition=self._partition.fingerprint))
        ack = await conn.recv(timeout=conn.timeouts.handshake, phase="register")
        if isinstance(ack, Error):
            raise RefusedError(ack.code, f"parameter server {link.index} at {link.address}: {ack.message}")
        if not isinstance(ack, RegisterAck):
            raise ProtocolError("unexpected", f"expected REGISTER_ACK, got {ack.TYPE.name}")
        if ack.info.get("server") != link.index:
            raise RefusedError("server_mismatch", (
                f"the leader lists {link.address} as parameter server {link.index}, and it says it "
                f"is server {ack.info.get('server', '(none: an unsharded coordinator)')}: list the "
                "servers in cluster.servers in --shard index order"))
        self.msg_id = max(self.msg_id, ack.last_applied_msg_id)
        weights = await conn.recv(timeout=conn.timeouts.heartbeat_timeout, phase="weights")
        if not isinstance(weights, Weights):
            raise ProtocolError("unexpected", f"expected WEIGHTS, got {weights.TYPE.name}")
        link.replica.load_full(weights.tensors, weights.version)
        link.replies = asyncio.Queue()
        link.reader = asyncio.create_task(link.read())

    async def _leave_other_servers(self) -> None:
        for link in self.servers:
            link.apply_ready()  # the final weights, if they came
        await asyncio.gather(*(link.close() for link in self.servers), return_exceptions=True)

    async def _train_sharded(self, conn: Connection) -> None:
        """Compute, send each server its slice of the gradient (concurrently), apply each
        server's answer to its group; one gradient at a time (no overlap with the answers)."""
        loop = asyncio.get_running_loop()
        timeout = self.config.network.heartbeat_timeout_sec * 3
        while True:
            if not await self._wait_active():
                return
            versions = [self.version, *(link.replica.version for link in self.servers)]
            future = self._start_compute(loop, inline=self._compute_is_quick())
            compressed, loss, samples, seconds, residual, changes = await future
            self._record_speed(samples, seconds)
            self.compute_time.update(seconds)
            await self._apply_ready()
            if not compressed:
                continue
            self._check_claim(samples)
            if self.lifecycle is WorkerState.STOPPED:
                return
            norm = _wire_float(total_norm(compressed))
            self.msg_id += 1
            sends, answered = [], []
            for index, replica in enumerate([self._replica, *(link.replica for link in self.servers)]):
                part = {n: c for n, c in compressed.items() if n in replica.params}
                if not part:
                    continue  # (no gradient for this group on this step: nothing to send)
                codecs, tensors = pack_compressed(part)
                names: list[str] = []
                if index == 0:  # buffers live with the leader
                    names, buffer_tensors = pack_buffers(changes)
                    tensors.update(buffer_tensors)
                self.bytes_up += payload_bytes(tensors)
                target = conn if index == 0 else self.servers[index - 1].conn
                assert target is not None
                sends.append(target.send(Gradients(
                    msg_id=self.msg_id, version=versions[index], samples=samples,
                    loss=_wire_float(loss), codecs=codecs, residual_norm=_wire_float(residual),
                    total_norm=norm, buffers=names, tensors=tensors)))
                answered.append(index)
            self._sent_at[self.msg_id] = time.monotonic()
            await asyncio.gather(*sends)
            self.steps += 1
            self.samples += samples
            if 0 in answered:
                self._inflight += 1
                while self._inflight:
                    await self._apply_next()
            for index in answered:
                if index:
                    await self.servers[index - 1].next_answer(timeout)

    def _reset_session(self) -> None:
        self._replies = asyncio.Queue()
        self._inflight = 0
        self._sent_at.clear()
        self._broken_by = None
        if self.feedback is not None:
            self.feedback.reset()

    async def _reader(self, conn: Connection) -> None:
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, (Update, Weights)):
                    if isinstance(msg, Update):
                        self._note_round_trip(msg.msg_id)
                    self._replies.put_nowait(msg)
                elif isinstance(msg, Assign):
                    self._use_shards(msg.shards, msg.num_shards)
                    log.info("now training on shards %s of %d", msg.shards, msg.num_shards)
                elif isinstance(msg, Start | Pause | Resume):
                    target = _ON_CONTROL[type(msg)].get(self.lifecycle)
                    if target is not None:  # (else it changes nothing: e.g. a START when training)
                        self._enter(target)
                        if isinstance(msg, Pause | Resume):
                            log.info("paused by the coordinator" if isinstance(msg, Pause)
                                     else "unpaused by the coordinator: training again")
                elif isinstance(msg, Shutdown):
                    self.shutdown_reason = msg.reason
                    log.info("coordinator says shut down: %s", msg.reason)
                    if self.lifecycle is not WorkerState.STOPPED:
                        self._enter(WorkerState.STOPPED)
                    self._replies.put_nowait(_ShutdownRequested(msg.reason))
                elif isinstance(msg, Error):
                    if msg.fatal:
                        raise RefusedError(msg.code, msg.message)
                    log.warning("coordinator reports: %.300s [%s]", msg.message, msg.code)
                self._changed.set()
        except (SwarmError, ConnectionError) as exc:
            if self.lifecycle in _REGISTERED:
                self._broken_by = exc
                self._enter(WorkerState.BROKEN)
            self._replies.put_nowait(exc)
            self._changed.set()

    async def _wait_active(self) -> bool:
        """Wait until training runs and is not paused; False once stopped."""
        while self.lifecycle not in (WorkerState.TRAINING, WorkerState.STOPPED):
            self._raise_if_broken()
            await self._apply_ready()  # stay current while paused: answers still arrive
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._changed.wait()
        return self.lifecycle is not WorkerState.STOPPED

    def _raise_if_broken(self) -> None:
        if self.lifecycle is WorkerState.BROKEN and self._broken_by is not None:
            raise self._broken_by

    async def _train(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        limit = self.config.training.max_inflight
        # When overlapping, the next computation starts before this gradient is packed and
        # sent, so encoding and writing it cost the compute thread nothing: (future, version).
        ahead: tuple[asyncio.Future[_Computed], int] | None = None
        lendable = self.config.network.direct_io
        try:
            while True:
                if ahead is None and lendable and self._direct_pays():
                    if not await self._wait_active():
                        return
                    lendable, left = await self._train_direct(conn)
                    if left is not None:  # a gradient computed and not sent when the thread stopped
                        done: asyncio.Future[_Computed] = loop.create_future()
                        done.set_result(left[0])
                        ahead = (done, left[1])
                if ahead is not None:
                    future, base_version = ahead
                    ahead = None
                else:
                    if not await self._wait_active():
                        return
                    # The gradient belongs to the weights it was computed on: take the version
                    # now, before updates arriving during the computation are applied.
                    base_version = self.version
                    future = self._start_compute(loop, inline=self._compute_is_quick())
                computed = await future
                compressed, samples = computed[0], computed[2]
                self._record_speed(samples, computed[3])
                self.compute_time.update(computed[3])
                await self._apply_ready()
                if not compressed:  # float16 overflow: the loss scale was halved, compute again
                    continue
                self._check_claim(samples)
                while self._inflight >= max(1, limit):
                    await self._apply_next()
                if self.lifecycle is WorkerState.STOPPED:
                    return
                overlap = limit > 0 and self.overlaps()
                inline = self._compute_is_quick()
                if overlap and not inline and self.lifecycle is WorkerState.TRAINING:
                    # the replica is now exactly what the next gradient is computed on; it
                    # changes again only once that computation is back
                    ahead = (self._start_compute(loop, inline=False), self.version)
                await conn.send(self._gradient_message(computed, base_version))
                if overlap and inline and self.lifecycle is WorkerState.TRAINING:
                    # a quick step computes on the loop: let the writer put this gradient on
                    # the wire first (a turn or two of the loop), then compute the next while
                    # its answer is in flight
                    for _ in range(2):
                        await asyncio.sleep(0)
                    ahead = (self._start_compute(loop, inline=True), self.version)
                if not overlap:
                    while self._inflight:
                        await self._apply_next()
        finally:
            if ahead is not None:  # never leave the compute thread running into a reset
                await _wait_out(ahead[0])

    def _gradient_message(self, computed: _Computed, base_version: int) -> Gradients:
        """The GRADIENTS message of a computation on weights ``base_version``, counted as sent
        (its answer is awaited from now on)."""
        compressed, loss, samples, _, residual, changes = computed
        codecs, tensors = pack_compressed(compressed)
        buffer_names, buffer_tensors = pack_buffers(changes)
        tensors.update(buffer_tensors)
        self.msg_id += 1
        self.bytes_up += payload_bytes(tensors)
        self._sent_at[self.msg_id] = time.monotonic()
        self._inflight += 1
        self.steps += 1
        self.samples += samples
        return Gradients(msg_id=self.msg_id, version=base_version, samples=samples,
                         loss=_wire_float(loss), codecs=codecs, residual_norm=_wire_float(residual),
                         buffers=buffer_names, tensors=tensors)

    # -- quick steps on the lent socket (transport/direct.py) ------------------------------

    def _direct_pays(self) -> bool:
        """Quick steps of a small model: the compute thread then trains on the socket itself
        (:meth:`_burst`; :data:`DIRECT_ENTER_SEC`)."""
        compute = self.compute_time.value
        return (compute is not None and compute < DIRECT_ENTER_SEC and not self.servers
                and self.raw_bytes_per_step <= DIRECT_MAX_BYTES)

    async def _train_direct(self, conn: Connection) -> tuple[bool, tuple[_Computed, int] | None]:
        """Lend the socket to the compute thread and train there (:meth:`_burst`) until it
        stops. Returns (whether the connection could be lent: not with TLS, what the burst left:
        a gradient computed and not sent yet, with its version)."""
        # one turn of the loop first: the reader takes the messages already received (those
        # still in the inbox would move to the link, and a control message there ends a burst
        # at once, every time)
        await asyncio.sleep(0)
        link = await conn.start_direct()
        if link is None:
            log.debug("the connection cannot be lent to the compute thread: steps go through the loop")
            return False, None
        try:
            await self._apply_ready()  # what the reader took before the socket was lent
            self.direct_bursts += 1
            left = await asyncio.get_running_loop().run_in_executor(self._pool, self._burst, link)
        finally:
            conn.end_direct(link)
        return True, left

    def _burst(self, link: DirectLink) -> tuple[_Computed, int] | None:
        """Train on ``link`` (on the compute thread): compute, send, take the answers, with
        :meth:`_train`'s rules for ``max_inflight`` and for overlapping. Stops when the
        worker is no longer training, a message other than an answer arrives (the connection's
        reader takes it; :meth:`Connection.end_direct`) or the steps stop being quick;
        returns the gradient computed and not sent then, with its version, if any."""
        limit = self.config.training.max_inflight
        ahead: tuple[_Computed, int] | None = None
        while True:
            if ahead is not None:
                computed, base_version = ahead
                ahead = None
            else:
                if not self._burst_goes_on():
                    return None
                base_version = self.version
                computed = self._compute()
            compressed, samples = computed[0], computed[2]
            self._record_speed(samples, computed[3])
            self.compute_time.update(computed[3])
            if not self._take_arrived(link):
                return computed, base_version
            if not compressed:  # float16 overflow: the loss scale was halved, compute again
                continue
            self._check_claim(samples)
            # an answer that frees the window is applied after this gradient is sent, not
            # before: the gradient was computed on the older weights either way, and the
            # coordinator starts on it while this thread brings the replica up to date
            held: list[Update] = []
            while self._inflight - len(held) >= max(1, limit):
                if not self._await_answer(link, hold=held):
                    self._take_held(held)
                    return computed, base_version
            if self.lifecycle is not WorkerState.TRAINING:
                self._take_held(held)
                return computed, base_version
            overlap = limit > 0 and self.overlaps()
            try:
                link.send(self._gradient_message(computed, base_version))
            finally:
                self._take_held(held)
            while not overlap and self._inflight:
                if not self._await_answer(link):
                    return None
            if overlap and self._burst_goes_on():
                ahead = (self._compute(), self.version)

    def _burst_goes_on(self) -> bool:
        compute = self.compute_time.value
        return (self.lifecycle is WorkerState.TRAINING and compute is not None
                and compute < DIRECT_LEAVE_SEC)

    def _take_arrived(self, link: DirectLink) -> bool:
        """Apply the answers that have arrived; False at a message that is not one (it stays
        first on the link for the connection's reader)."""
        while (msg := link.recv(0.0)) is not None:
            if not self._take_direct(link, msg):
                return False
        return True

    def _await_answer(self, link: DirectLink, *, hold: list[Update] | None = None) -> bool:
        """Wait for one answer and apply it, or with ``hold`` add it there to apply later
        (:meth:`_take_held`). False: a message that is not one came first.

        Raises:
            SwarmTimeout: no answer within three heartbeat timeouts (as :meth:`_apply_next`).
        """
        limit = self.config.network.heartbeat_timeout_sec * 3
        msg = link.recv(limit)
        if msg is None:
            raise SwarmTimeout("update", limit, "no answer to our gradient")
        return self._take_direct(link, msg, hold=hold)

    def _take_direct(self, link: DirectLink, msg: Message, *, hold: list[Update] | None = None) -> bool:
        """Apply an UPDATE (or add it to ``hold``); anything else stays first on the link for
        the reader, and ends the burst: full WEIGHTS come with the end of the run (before
        SHUTDOWN), and no step may be computed after them (it would move the BatchNorm
        statistics they set)."""
        if not isinstance(msg, Update):
            link.pending.appendleft(msg)
            return False
        self._note_round_trip(msg.msg_id)
        if hold is None:
            self._take_answer(msg)
        else:
            hold.append(msg)
        return True

    def _take_held(self, held: list[Update]) -> None:
        for msg in held:
            self._take_answer(msg)
        held.clear()

    def _compute_is_quick(self) -> bool:
        compute = self.compute_time.value
        return self._own_loop and compute is not None and compute < INLINE_COMPUTE_SEC

    def _start_compute(self, loop: asyncio.AbstractEventLoop, *, inline: bool) -> asyncio.Future[_Computed]:
        """:meth:`_compute` on the compute thread, or with ``inline`` here and now (a quick
        step: :data:`INLINE_COMPUTE_SEC`); either way a future of its result."""
        if not inline:
            return loop.run_in_executor(self._pool, self._compute)
        self.inline_computes += 1
        future: asyncio.Future[_Computed] = loop.create_future()
        future.set_result(self._compute())  # (what it raises, it raises here, in _train's try)
        return future

    def _check_claim(self, samples: int) -> None:
        """Raise ConnectionLost (register again) when a gradient has more samples than this
        worker registered: the data's batches are larger (a DataLoader's own batch size), and
        the coordinator would refuse the claim."""
        if samples > self._claim_cap:
            raise ConnectionLost(
                f"a gradient of {samples} samples is more than the {self._claim_cap} this "
                f"worker registered (batch_size x accumulation_steps); registering again "
                f"with batches of {self._largest_batch}")

    def overlaps(self) -> bool:
        """Compute the next gradient while this one's answer is in flight? Only when the round
        trip is a real fraction of the compute (see the module docstring); not before the first
        round trip has been measured, and never when the coordinator aggregates."""
        round_trip, compute = self.round_trip_time.value, self.compute_time.value
        if round_trip is None or compute is None or self.coordinator_aggregates:
            return False
        return round_trip >= OVERLAP_MIN_FRACTION * compute

    def _note_round_trip(self, msg_id: int) -> None:
        sent = self._sent_at.pop(msg_id, None)
        if sent is not None:
            self.round_trip_time.update(time.monotonic() - sent)

    async def _apply_ready(self) -> None:
        while not self._replies.empty():
            await self._apply_next()

    async def _apply_next(self) -> None:
        limit = self.config.network.heartbeat_timeout_sec * 3
        try:
            async with asyncio.timeout(limit):
                item = await self._replies.get()
        except TimeoutError:
            raise SwarmTimeout("update", limit, "no answer to our gradient") from None
        if isinstance(item, BaseException):
            raise item
        self._take_answer(item)

    def _take_answer(self, item: Message) -> None:
        """Bring the replica to what an UPDATE or a full WEIGHTS message carries."""
        self.bytes_down += payload_bytes(item.tensor_map())
        if isinstance(item, Weights):
            self._load_full(item.tensors, item.version)
        elif isinstance(item, Update):
            self._inflight = max(0, self._inflight - 1)
            self.statuses[item.status] = self.statuses.get(item.status, 0) + 1
            self._replica.apply_update(item)

    def _add_chain(self, chain: list[dict[str, Any]], tensors: Mapping[str, torch.Tensor],
                   version: int) -> None:
        """Add the update log's entries to the replica (:meth:`Replica.add_chain`)."""
        self._replica.add_chain(chain, tensors, version)

    def _load_full(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load full weights into the replica (:meth:`Replica.load_full`)."""
        self._replica.load_full(tensors, version)

    @property
    def version(self) -> int:
        """The weights version the replica holds (in a sharded cluster: the leader's group's)."""
        return self._replica.version

    @version.setter
    def version(self, value: int) -> None:
        self._replica.version = value

    # -- compute (runs on the compute thread) ----------------------------------------------

    @property
    def _stream_parts(self) -> tuple[object, ...]:
        """What the random streams derive from beside the seed (before the first registration
        of a worker without an id, e.g. the probe's draws: its generated id)."""
        return self._stream or (self.worker_id,)

    def _number_streams(self, member: object) -> None:
        """Derive this worker's random streams from the seed and ``member``, its number at the
        coordinator (from a coordinator that sends none: from its generated id, as before).
        Once: a worker that registers again keeps drawing where it was."""
        ok = isinstance(member, int) and not isinstance(member, bool) and member >= 0
        self._stream = ("member", member) if ok else (self.worker_id,)
        self.randomness.reseed(worker_seed(self.config.training.seed, *self._stream))
        self._shard_cache.clear()  # (none drawn from yet: shards are made after registering)

    def _use_shards(self, shards: list[int], count: int) -> None:
        """Train on ``shards`` of ``count`` from now on (batches rotate over them). An iterable
        (e.g. a DataLoader) cannot be sliced: it is cycled in this worker's own order instead."""
        self.shards, self.num_shards = list(shards), count
        if not (hasattr(self.data, "get_batch") and hasattr(self.data, "__len__")):
            return
        active = []
        for index in shards:
            key = (index, count)
            if key not in self._shard_cache:
                # workers sharing a shard (more workers than shards) walk it in different orders
                seed = worker_seed(self.config.training.seed, index, count, *self._stream_parts)
                self._shard_cache[key] = Shard(self.data, index, count, seed=seed)  # type: ignore[arg-type]
            active.append(self._shard_cache[key])
        self._active_shards = active  # one assignment: the compute thread sees old or new list

    def _next_batch(self) -> Any:
        shards = self._active_shards
        if shards:
            self._turn += 1
            return shards[self._turn % len(shards)].next_batch(self.plan.batch_size)
        return self._cycled.next()

    def probe(self) -> float:
        """Samples/second of this machine on the real task at the chosen batch (throttle
        included), timed for ``probe_seconds``; weights and error feedback are untouched."""
        shards = self._active_shards
        if not shards and hasattr(self.data, "get_batch") and hasattr(self.data, "__len__"):
            shards = [Shard(self.data, 0, 1, seed=worker_seed(self.config.training.seed, "probe"))]  # type: ignore[arg-type]
        before = snapshot_buffers(self.buffers)  # the probe must not move BatchNorm statistics

        def step() -> int:
            cpu = self.throttle.start()
            with self.randomness:
                batch = shards[0].next_batch(self.plan.batch_size) if shards else self._next_batch()
            self.model.zero_grad(set_to_none=True)
            self.loss_fn(self.model, batch_to(batch, self.device)).backward()
            self.throttle.pause(cpu)
            n = _batch_len(batch)
            self._largest_batch = max(self._largest_batch, n)
            return n

        try:
            return hardware.probe_speed(step, seconds=self.config.training.probe_seconds)
        finally:
            self.model.zero_grad(set_to_none=True)
            self.state.load(before)

    def _compute(self) -> _Computed:
        start, cpu = time.perf_counter(), self.throttle.start()
        if not all(m.training for m in self._modules):  # (train() walks the tree: only when needed)
            self.model.train()
        if self._own_zero_grad:
            self.model.zero_grad(set_to_none=True)
        else:
            for p in self._param_list:
                p.grad = None
        before = snapshot_buffers(self.buffers)
        accum = self.plan.accumulation_steps
        total_loss, samples = 0.0, 0
        for _ in range(accum):
            with self.randomness:
                batch = self._next_batch()
            loss = self.loss_fn(self.model, batch_to(batch, self.device))
            factor = self.scaler.scale / accum
            (loss * factor if factor != 1.0 else loss).backward()
            total_loss += float(loss.detach())
            n = _batch_len(batch)
            samples += n
            self._largest_batch = max(self._largest_batch, n)
        changes = buffer_changes(self.buffers, before)
        # only what was computed travels: a frozen parameter, or one unused on this step, has
        # no gradient and must not be stepped as if it had a zero one
        names = [n for n, p in self.params.items() if p.grad is not None]
        grads = self.scaler.unscale([self.params[n].grad for n in names])  # type: ignore[misc]
        if grads is None:
            log.info("float16 gradients overflowed: loss scale halved to %g, step dropped",
                     self.scaler.scale)
            self.state.load(before)
            self.throttle.pause(cpu)
            return {}, total_loss / accum, 0, time.perf_counter() - start, 0.0, {}
        c = self.config.compression
        feedback = self.feedback
        whole = None if self.servers else fuse_dense(  # (one entry, one copy: common.fuse_gradients)
            dict(zip(names, grads)), self.params, c.type,
            None if feedback is None else lambda flat: feedback.compress(FUSED, flat, generator=self._gen))
        if whole is not None:
            residual = feedback.residual_norm() if feedback else 0.0
            self.throttle.pause(cpu)
            return whole, total_loss / accum, samples, time.perf_counter() - start, residual, changes
        codec = codec_for_step(c, self.steps) if self.steps < c.warmup_steps else self.codec
        if self.feedback is not None:
            self.feedback.codec = codec
        out: dict[str, Compressed] = {}
        for name, g in zip(names, grads):
            g = g.detach().to("cpu")  # the wire is CPU-only (a no-op on the CPU)
            out[name] = (self.feedback.compress(name, g, generator=self._gen) if self.feedback
                         else codec.compress(g, generator=self._gen))
        residual = self.feedback.residual_norm() if self.feedback else 0.0
        self.throttle.pause(cpu)  # rehearse a slower machine (speed < 1)
        return out, total_loss / accum, samples, time.perf_counter() - start, residual, changes

    def _record_speed(self, samples: int, seconds: float) -> None:
        if seconds > 0:
            self.speed.update(samples / seconds)

    @property
    def samples_per_sec(self) -> float:
        """Its measured speed, smoothed (0.0 before the probe or the first gradient)."""
        return self.speed.get(0.0)

    def status(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id, "state": self.lifecycle.name.lower(),
            "version": self.version, "steps": self.steps, "inline_computes": self.inline_computes,
            "direct_bursts": self.direct_bursts,
            "samples": self.samples, "samples_per_sec": self.samples_per_sec,
            "shards": list(self.shards), "statuses": dict(self.statuses),
            "residual_norm": self.feedback.residual_norm() if self.feedback else 0.0,
            "bytes_up_per_step": self.bytes_up / self.steps if self.steps else 0.0,
            "bytes_down_per_step": self.bytes_down / self.steps if self.steps else 0.0,
            "raw_bytes_per_step": self.raw_bytes_per_step,
            "batch_size": self.plan.batch_size, "accumulation_steps": self.plan.accumulation_steps,
            "round_trip_ms": 1000 * rt if (rt := self.round_trip_time.value) is not None else None,
            "overlapping": self.overlaps(),
            "servers": [{"index": link.index, "address": link.address, "version": link.replica.version}
                        for link in self.servers],
            "loss": math.nan,
        }
