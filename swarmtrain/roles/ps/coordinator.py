"""The parameter-server coordinator: master weights, Adam, asynchronous gradient apply.

Each worker's gradient is applied the moment it arrives (workers never wait for each
other). Every worker holds the same *published* weights at some version: after an update
the coordinator publishes once, whatever the number of workers, a compressed delta into a
shared log by version (:mod:`swarmtrain.roles.ps.downlink`); the answer to a gradient is
the chain of entries the worker lacks, or the published weights when that chain would be
larger. Whatever compression loses on the downlink stays in ``master − published`` and goes
out with the next entry; the coordinator's memory does not grow with the workers.

The model's state is more than its trainable parameters (:mod:`swarmtrain.core.modelstate`):
frozen parameters are sent once and never stepped; a parameter without a gradient in a
message is not stepped (as torch's optimizers skip ``grad is None``); buffers (BatchNorm
statistics) are kept current by adding each applied gradient's buffer changes to a master
copy and sending changed values back. A float16 or bfloat16 model gets float32 master
weights and Adam state here; its workers hold, bit for bit, the published weights rounded to
the model's dtype (the published copy is rounded so too).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import enum
import logging
import math
import re
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._utils import _unflatten_dense_tensors

from swarmtrain.compression.kernels import kernels
from swarmtrain.config import CoordinatorConfig, apply_kwargs, resolve_secret, resolve_tls
from swarmtrain.core.ema import MovingAverage
from swarmtrain.core.events import RunRecorder
from swarmtrain.core.hardware import FreedMemory
from swarmtrain.core.modelstate import ModelState, master_dtype
from swarmtrain.errors import (
    ConfigError,
    ModelMismatch,
    RemoteProtocolError,
    StateError,
    SwarmError,
)
from swarmtrain.roles.aggregation import GradientWindow, RobustWindow
from swarmtrain.roles.ps.adam import adam_step, is_sparse, make_adam, variance_steps
from swarmtrain.roles.ps.cluster import (
    VERDICT_STATUSES,
    ClusterPeers,
    ClusterPlace,
    LeaderVerdicts,
    Ruling,
    VerdictStream,
    split_address,
)
from swarmtrain.roles.ps.common import (
    FUSE_MAX_NUMEL,
    FUSED,
    KnownHeader,
    LazyGradient,
    check_compression_match,
    check_fingerprint,
    dense_gradient,
    downlink_codec,
    downlink_kind,
    entry_spec,
    global_norm,
    pack_buffers,
    payload_bytes,
    split_buffers,
    unpack_compressed,
    unpack_lazy,
)
from swarmtrain.roles.ps.downlink import AnswerGaps, Downlink, LogEntry, track_for_lag
from swarmtrain.roles.ps.flat_adam import COPY_PHASE, FlatAdam, phase_after
from swarmtrain.roles.ps.hooks import CheckpointHook
from swarmtrain.roles.ps.screen import NormScreen
from swarmtrain.roles.ps.shards import ShardPlanner
from swarmtrain.transport import Connection, Server, Timeouts, start_server
from swarmtrain.transport.auth import cluster_secret
from swarmtrain.transport.endpoints import payload_limit, peer_ip, require_secret
from swarmtrain.transport.payload_gate import PayloadGate
from swarmtrain.transport.refusals import RefusalCounter, merge_refusals
from swarmtrain.wire import (
    Assign,
    CheckpointMsg,
    Error,
    Gradients,
    Limits,
    Message,
    Pause,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    Start,
    Status,
    StatusRequest,
    Update,
    UpdateStatus,
    Verdict,
    Weights,
)
from swarmtrain.wire.pool import PAGE, PayloadPool, pooled_bytes

__all__ = ["Coordinator", "CoordinatorState", "TRANSITIONS", "WorkerRecord"]

log = logging.getLogger("swarmtrain.coordinator")

#: worker records kept at most (connected ones are never forgotten)
MAX_WORKER_RECORDS = 1024
_WORKER_ID = re.compile(r"[A-Za-z0-9._:@-]{1,64}")

#: how often an answer waiting for a copy of the weights asks again whether one may be made
COPY_WAIT_POLL_SEC = 0.02

#: copies of the weights (a larger model's snapshots: a lossless downlink's answers, a full
#: resync's) that answers not yet sent may hold at once, whatever the number of workers: past
#: it an answer shares the newest copy, or, to a worker that holds that one, waits for a copy
#: (Coordinator._deferred_answer)
MAX_HELD_SNAPSHOTS = 4

# How much of the old average each smoothed quantity keeps (swarmtrain.core.ema):
#: a worker's step time bounds how long an aggregation window waits for it: it follows a
#: change of speed (throttling, another job on the machine) within a few gradients
STEP_TIME_KEEP = 0.8
#: the loss in the status and the run log, over about twenty gradients: the workers' shards
#: give different losses, and which one arrived last must not make the curve jump
LOSS_KEEP = 0.95
#: the mean samples per gradient that fair weighting divides by, over about ten gradients:
#: one odd batch changes its own weight, not everyone's
SAMPLES_KEEP = 0.9
#: the time an apply (a gradient's, or its answer's) takes, over about ten of them
APPLY_TIME_KEEP = 0.9

#: a gradient's apply and its answer whose moving average is below this run on the event loop
#: itself: handing a 0.2 ms apply of a small model to the apply thread and back costs more
#: (two thread wake-ups, two hand-overs of the interpreter lock) than the apply, and blocking
#: the loop that long delays no heartbeat. Longer ones run on the apply thread, so the loop
#: keeps reading the other workers while a big model steps.
INLINE_APPLY_SEC = 0.002

Evaluate = Callable[[nn.Module], Mapping[str, float]]


class CoordinatorState(enum.Enum):
    """Where a coordinator is in its life; it moves only as :data:`TRANSITIONS` allows."""

    #: fewer than ``min_workers`` workers have joined: those that have wait, holding the weights
    WAITING = "waiting for workers"
    #: paused before training started: it starts paused once ``min_workers`` have joined
    WAITING_PAUSED = "paused while waiting for workers"
    RUNNING = "running"
    #: workers keep their connections and compute nothing (ctl pause)
    PAUSED = "paused"
    #: shutting the cluster down: last evaluation, checkpoint, final weights, SHUTDOWN
    FINISHING = "finishing"
    #: not serving any more
    STOPPED = "stopped"


_S = CoordinatorState
#: every move a coordinator may make, from each state (a move not listed raises StateError)
TRANSITIONS: Mapping[CoordinatorState, frozenset[CoordinatorState]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.WAITING_PAUSED, _S.FINISHING, _S.STOPPED}),
    _S.WAITING_PAUSED: frozenset({_S.WAITING, _S.PAUSED, _S.FINISHING, _S.STOPPED}),
    _S.RUNNING: frozenset({_S.PAUSED, _S.FINISHING, _S.STOPPED}),
    _S.PAUSED: frozenset({_S.RUNNING, _S.FINISHING, _S.STOPPED}),
    _S.FINISHING: frozenset({_S.STOPPED}),
    _S.STOPPED: frozenset(),
}
#: the event each move records (moves not listed record none)
_EVENTS: Mapping[tuple[CoordinatorState, CoordinatorState], str] = {
    (_S.WAITING, _S.RUNNING): "start", (_S.WAITING_PAUSED, _S.PAUSED): "start",
    (_S.WAITING, _S.WAITING_PAUSED): "paused", (_S.RUNNING, _S.PAUSED): "paused",
    (_S.WAITING_PAUSED, _S.WAITING): "unpaused", (_S.PAUSED, _S.RUNNING): "unpaused",
    **{(state, _S.FINISHING): "shutdown" for state in (_S.WAITING, _S.WAITING_PAUSED, _S.RUNNING, _S.PAUSED)},
}
#: where a pause (resume) moves from each state that allows one
_PAUSE = {_S.WAITING: _S.WAITING_PAUSED, _S.RUNNING: _S.PAUSED}
_RESUME = {_S.WAITING_PAUSED: _S.WAITING, _S.PAUSED: _S.RUNNING}
#: the counters of :attr:`Coordinator.stats`, and the record field behind each
_STATS = {"applied": "steps", "stale": "stale", "duplicates": "duplicates", "rejected": "rejected"}


@dataclass
class WorkerRecord:
    """What the coordinator knows of one worker (kept after it leaves, for idempotency)."""

    worker_id: str
    address: str
    hardware: dict[str, Any]
    batch_size: int
    samples_per_sec: float
    shards: list[int] = field(default_factory=list)
    conn: Connection | None = None
    welcomed: bool = False
    steps: int = 0
    samples: int = 0
    stale: int = 0
    rejected: int = 0
    bad_in_row: int = 0  # refused gradients since the last applied one
    last_refusal: str = ""  # why the last gradient was refused
    duplicates: int = 0
    last_msg_id: int = 0
    staleness_total: int = 0
    loss: float = math.nan
    last_seen: float = field(default_factory=time.monotonic)
    joined_at: float = field(default_factory=time.monotonic)
    first_applied_pending: bool = False
    bytes_up: int = 0
    bytes_down: int = 0
    samples_since_join: int = 0
    weight: float = 1.0
    gradients: int = 0
    updates: int = 0
    resyncs: int = 0
    drift: float = 0.0
    residual_norm: float = 0.0
    clipped: int = 0  # gradients scaled down by the outlier screen
    answered_at: float = 0.0  # when its last gradient was answered
    #: answer -> its next gradient (its compute, roughly), smoothed
    step_time: MovingAverage = field(default_factory=lambda: MovingAverage(STEP_TIME_KEEP))
    #: the weights version its replica holds (the one it computes its next gradient on)
    holds_version: int = -1
    #: the downlink track its replica is on (roles/ps/downlink.py; 0: the finest)
    track: int = 0
    #: its number: how many worker ids registered before it (kept by checkpoints; -1: none yet).
    #: A worker without an id of its own derives its random streams from it.
    member: int = -1
    #: the versions between its last few answers (Downlink.choose)
    gaps: AnswerGaps = field(default_factory=AnswerGaps)
    #: the track whose full weights its answer waits for (no copy of them may be made now:
    #: Coordinator._deferred_answer); None: no answer waits
    waits_for: int | None = None
    #: the worker holds the master buffers as of this version (changes after it are sent)
    buffers_version: int = -1
    #: its shard set changed while it (or another) was registering: an ASSIGN is owed
    assign_pending: bool = False
    #: micro-batches per gradient it registered: with ``batch_size``, the most samples one
    #: of its gradients may claim
    accumulation_steps: int = 1
    #: the verified node id (peer id of its identity key) this worker id belongs to; "" until
    #: a worker with a key registers it (then only that node may use the id)
    node: str = ""

    @property
    def step_sec(self) -> float | None:
        """Its smoothed step time in seconds (None until its second gradient)."""
        return self.step_time.value

    @property
    def connected(self) -> bool:
        """Connected and sent its weights (so it may receive broadcasts)."""
        return self.conn is not None and not self.conn.is_closed and self.welcomed

    @property
    def shard_index(self) -> int:
        """Its first shard (-1 while it holds none: restored from a checkpoint, not back yet)."""
        return self.shards[0] if self.shards else -1

    def counts(self) -> dict[str, int]:
        """Its gradients applied, dropped as stale, duplicates and rejected (as :attr:`Coordinator.stats`)."""
        return {key: getattr(self, name) for key, name in _STATS.items()}

    def summary(self, total_samples: int, raw_bytes: int) -> dict[str, Any]:
        up = self.bytes_up / self.gradients if self.gradients else 0.0
        connected_for = time.monotonic() - self.joined_at
        down = self.bytes_down / self.updates if self.updates else 0.0
        # samples applied per second since it joined (0 while it is gone)
        applied_rate = (self.samples_since_join / connected_for
                        if self.connected and connected_for > 0 else 0.0)
        return {
            "bytes_up_per_step": up, "bytes_down_per_step": down,
            "up_ratio": raw_bytes / up if up else 0.0, "down_ratio": raw_bytes / down if down else 0.0,
            "residual_norm": self.residual_norm, "drift": self.drift, "resyncs": self.resyncs,
            "weight": self.weight, "probe_samples_per_sec": self.samples_per_sec,
            "applied_samples_per_sec": applied_rate,
            "id": self.worker_id, "address": self.address, "connected": self.connected,
            "profile": self.hardware.get("profile", "?"), "batch_size": self.batch_size,
            "shard": self.shard_index, "shards": list(self.shards) if self.connected else [],
            "steps": self.steps,
            "samples": self.samples,
            "share": self.samples / total_samples if total_samples else 0.0,
            # connected: what it does now once it has applied samples, until then what its
            # probe said; gone: none
            "samples_per_sec": (applied_rate or self.samples_per_sec) if self.connected else 0.0,
            "stale": self.stale, "rejected": self.rejected, "last_refusal": self.last_refusal,
            "clipped": self.clipped,
            "avg_staleness": self.staleness_total / self.steps if self.steps else 0.0,
            "loss": self.loss, "last_seen_sec": time.monotonic() - self.last_seen,
        }


class WorkerIdTaken(SwarmError):
    """A REGISTER names a worker id that belongs to another node's identity key."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class Coordinator:
    """Holds the master weights and the optimizer; serves workers over TCP.

    Args:
        model: the plain PyTorch model whose parameters are the master weights.
        config: a :class:`CoordinatorConfig` (defaults if None).
        evaluate: optional held-out evaluation, ``evaluate(model) -> {"metric": value}``.
        task_name: the task name workers must also run (checked at registration).
        secret: the cluster secret; default from config / SWARMTRAIN_SECRET.
        cluster: this server's place in a sharded cluster (:mod:`swarmtrain.roles.ps.cluster`);
            ``model`` is then its parameter group only.
        eval_model: the model ``evaluate`` runs on (default: a copy of ``model``); the leader
            of a sharded cluster passes the whole model and fills it with every server's weights.
        **overrides: config keys by name, e.g. ``port=7100, min_workers=2``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: CoordinatorConfig | None = None,
        *,
        evaluate: Evaluate | None = None,
        task_name: str = "",
        secret: bytes | str | None = None,
        cluster: ClusterPlace | None = None,
        eval_model: nn.Module | None = None,
        **overrides: Any,
    ) -> None:
        # the caller loads files and the environment (load_coordinator_config); keywords adjust
        self.config = cfg = apply_kwargs(config if config is not None else CoordinatorConfig(), overrides)
        self.model = model
        self.task_name = task_name
        self.evaluate_fn = evaluate
        self.secret = cluster_secret(secret) if secret is not None else resolve_secret(cfg.security)
        self.tls = resolve_tls(cfg.security)
        self.state = ModelState(model)
        if not self.state.trainable:
            raise ConfigError("the model has no trainable parameters (every one has requires_grad "
                              "False): there is nothing to train")
        #: master weights of the trainable parameters (float32 for half-precision models)
        self.params, self._flat, self._lowp = _master_weights(self.state.trainable)
        #: name -> the trainable parameter's dtype as a gradient's header names it; FUSED (all
        #: of them in one vector) -> theirs if they share one, else float32
        self._dtype_names = {n: str(p.dtype).removeprefix("torch.") for n, p in self.state.trainable.items()}
        kinds = set(self._dtype_names.values())
        self._dtype_names[FUSED] = kinds.pop() if len(kinds) == 1 else "float32"
        #: master copies of the synced buffers (float32 for half-precision buffers)
        self.buffers: dict[str, torch.Tensor] = {
            n: (b if master_dtype(b.dtype) == b.dtype else b.detach().to(master_dtype(b.dtype)).clone())
            for n, b in self.state.synced_buffers.items()}
        self._buffer_changed: dict[str, int] = {}  # buffer -> version of its last change
        self._fingerprint = self.state.fingerprint()
        #: a sharded cluster's server: its place, and (the leader) the other servers
        self.cluster = cluster
        self.peers = (ClusterPeers(cluster, secret=self.secret, tls=self.tls)
                      if cluster is not None and cluster.leader and cluster.spec.count > 1 else None)
        #: the leader: its verdict on each gradient, for the other servers (cluster.py)
        self.verdict_stream = VerdictStream(self.peers) if self.peers is not None else None
        #: a server that follows the leader: the leader's verdicts, which its slices wait for
        self.verdicts = (LeaderVerdicts() if cluster is not None and not cluster.leader
                         and cluster.spec.count > 1 and cfg.cluster.follow_leader else None)
        #: server 0's addresses, the only ones a verdict stream is taken from (resolved in
        #: start() when this server has cluster.servers; empty: any)
        self._leader_hosts: frozenset[str] = frozenset()
        self._eval_model = eval_model
        self._sizes = [p.numel() for p in self.params.values()]
        t = cfg.training
        if t.learning_rate <= 0:
            raise ConfigError(
                "training.learning_rate is 0, which means 'the task's default', but no task supplies "
                "one here: pass learning_rate=... (e.g. learning_rate=1e-3)")
        self.base_lr = t.learning_rate
        #: the learning rate's factor by update (warm-up, decay): :meth:`learning_rate`
        self.lr_schedule = t.schedule()
        self.optimizer = make_adam(list(self.params.values()), lr=self.base_lr,
                                    betas=(t.beta1, t.beta2), eps=t.epsilon, weight_decay=t.weight_decay)
        #: the optimizer's step in the fused kernel (one pass: decoding, Adam, publication);
        #: None when the masters are not one flat float32 buffer or the kernels are not built
        self._flat_adam = FlatAdam.create(self.optimizer, self._flat, self.params)
        # Weight deltas to workers: published once per version into a shared log; what this
        # codec drops stays in master - published and goes with the next entry.
        self.codec = downlink_codec(cfg.compression)
        #: the half downlink: answers are the weights rounded to float16 (no deltas)
        self._rounded = downlink_kind(cfg.compression) == "half"
        self.downlink = Downlink(
            self.codec, split=self._split, names=list(self.params), round_replica=self._round_replica,
            replica_bytes=sum(p.numel() * p.element_size() for p in self.state.trainable.values()),
            fused=sum(self._sizes) <= FUSE_MAX_NUMEL, max_drift=cfg.compression.max_drift,
            reset_interval=t.resync_interval, rounded=self._rounded)
        self.raw_bytes_per_step = sum(p.numel() * 4 for p in self.params.values())
        #: full weights go to workers as one FUSED tensor (a float32 model of more than one
        #: parameter): the one buffer every published snapshot is made in (:meth:`_as_replica`),
        #: kept and sent as it is, with no tensor per parameter on either end
        self._fuse_full = (len(self.params) > 1
                           and all(p.dtype == torch.float32 for p in self.state.trainable.values()))
        #: a small model's snapshots are new memory, not pooled nor bounded (common.FUSE_MAX_NUMEL)
        self._small = sum(self._sizes) <= FUSE_MAX_NUMEL
        #: the buffers a larger model's snapshots are written into, each used again once no
        #: answer refers to it (apart from the payloads': the two come and go at other times);
        #: one idle at most (the next snapshot's), so what it keeps beyond the snapshots
        #: answers still hold is one copy of the weights
        self._snapshot_pool = PayloadPool(max_idle_bytes=4 * sum(self._sizes) + PAGE)
        #: freed memory malloc keeps resident after a burst (many workers joining at once, a
        #: coarse downlink track dropped) goes back to the system once it exceeds twice the
        #: model's size (checked every MEMORY_CHECK_INTERVAL_SEC)
        self.freed_memory = FreedMemory(keep_bytes=2 * self.raw_bytes_per_step)
        #: the last gradient header of entries it can check again (plain, lazy top-k): the next
        #: equal one is unpacked without its checks
        self._known_header = KnownHeader()
        #: gradients received and not yet applied, all workers together, are bounded: a worker's
        #: next one is read off the socket once there is room (network.max_held_gradient_mb)
        net = cfg.network
        self.gradient_gate = PayloadGate(int(net.max_held_gradient_mb * 2**20),
                                         timeout=net.admission_timeout_sec)
        #: the outlier screen's reference norm cannot collapse or be ratcheted (roles/screen.py)
        self.screen = NormScreen(t.outlier_norm_factor)
        #: bounded asynchrony: gradients summed until they hold aggregate_samples samples; with
        #: training.robust, one slot per worker combined robustly (docs/robustness.md)
        self.window: GradientWindow | RobustWindow | None = (
            RobustWindow(self.params, t.robust, trim=t.robust_trim) if t.robust != "none"
            else GradientWindow(self.params) if t.aggregate_samples else None)
        self._updated = asyncio.Event()  # set (and replaced) whenever an update is applied
        self._evaluated = asyncio.Event()  # set (and replaced) after each held-out evaluation
        self._window_ids: set[str] = set()  # workers with a gradient in the open window
        #: when the open window got its samples, and when it closes whoever is still missing
        self._window_ready_at: float | None = None
        self._window_deadline: float | None = None
        self._window_timer: asyncio.Task[None] | None = None
        self.num_shards = t.num_shards or max(t.min_workers, 1)
        self.shard_plan = ShardPlanner(self.num_shards)
        self.version = 0
        self.workers: dict[str, WorkerRecord] = {}
        #: worker ids numbered so far (WorkerRecord.member): never reused, records forgotten or not
        self.members_seen = 0
        #: where the coordinator is in its life; changed by :meth:`_enter` alone
        self.lifecycle = CoordinatorState.WAITING
        #: :attr:`stats` of workers whose records are gone: forgotten ones, and (after a resume)
        #: the run before the checkpoint
        self.departed_stats: Counter[str] = Counter({key: 0 for key in _STATS})
        self.staleness_counts: Counter[int] = Counter()  # applied gradients by staleness
        self.held_variance_steps = 0  # sparse gradients applied with Adam's second moment held
        c = cfg.compression
        if c.type == "topk" and t.sparse_variance == "hold" and c.warmup_steps == 0:
            log.info("top-k without warm-up: Adam's second moment has no dense gradients to learn "
                     "from, so it is updated by sparse ones (plain Adam, which moves rarely sent "
                     "weights less far); set compression.warmup_steps (e.g. 200) to hold it")
        self.loss_average = MovingAverage(LOSS_KEEP)
        self.metrics: dict[str, float] = {}
        self.metric_history: deque[tuple[int, dict[str, float]]] = deque(maxlen=1000)
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self.samples_average = MovingAverage(SAMPLES_KEEP)
        self._clip_logged_at = 0.0
        self._apply_pool = ThreadPoolExecutor(1, thread_name_prefix="swarm-apply")
        #: jobs handed to the apply thread and not yet done (the event loop counts them): an
        #: apply runs on the loop only while this is 0, so it never overlaps one on the thread
        self._apply_jobs = 0
        self.apply_time = MovingAverage(APPLY_TIME_KEEP)
        self.applies_inline = self.applies_threaded = 0
        self._eval_pool = ThreadPoolExecutor(1, thread_name_prefix="swarm-eval")
        self._eval_state: ModelState | None = None  # a copy of the model to evaluate on
        self._server: Server | None = None
        #: what this role refused, by reason code (``rejected_gradient``, ``worker_id_taken``...);
        #: ``status()["refusals"]`` adds what the server counted: connections turned away and
        #: messages dropped for a field out of range
        self.refusals = RefusalCounter()
        self._stopped = asyncio.Event()  # set by _enter(STOPPED) alone: what run() waits for
        self._started_at = time.monotonic()
        self._tasks: list[asyncio.Task[Any]] = []
        self.checkpointer: CheckpointHook | None = None  # see attach_checkpointer
        self.run_log: RunRecorder | None = None  # every event is also written here (session sets it)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Training has started (it may be paused) and is not over."""
        return self.lifecycle in (CoordinatorState.RUNNING, CoordinatorState.PAUSED)

    @property
    def paused(self) -> bool:
        """Paused by a ctl (before or after training started)."""
        return self.lifecycle in (CoordinatorState.PAUSED, CoordinatorState.WAITING_PAUSED)

    @property
    def finished(self) -> bool:
        """Shutting down or stopped: no gradient is applied any more."""
        return self.lifecycle in (CoordinatorState.FINISHING, CoordinatorState.STOPPED)

    @property
    def stats(self) -> dict[str, int]:
        """Gradients applied, dropped as stale, duplicates and rejected: the workers' own
        counters summed, with those of :attr:`departed_stats`."""
        total = Counter(self.departed_stats)
        for rec in list(self.workers.values()):  # (the apply thread asks too: checkpoints)
            total.update(rec.counts())
        return {key: total[key] for key in _STATS}

    def _enter(self, state: CoordinatorState, **data: Any) -> None:
        """Move to ``state``: the one place the lifecycle changes. Each move is logged and
        records its event (:data:`_EVENTS`, with ``data``) once.

        Raises:
            StateError: :data:`TRANSITIONS` has no move from the current state to ``state``.
        """
        old = self.lifecycle
        StateError.check_move("coordinator", TRANSITIONS, old, state)
        self.lifecycle = state
        log.debug("coordinator: %s -> %s", old.value, state.value)
        if (event := _EVENTS.get((old, state))) is not None:
            self.record_event(event, **data)
        if state is CoordinatorState.STOPPED:
            self._stopped.set()

    @property
    def loss_ema(self) -> float:
        """The smoothed training loss (NaN before the first applied gradient)."""
        return self.loss_average.get(math.nan)

    def attach_checkpointer(self, checkpointer: CheckpointHook) -> None:
        """Checkpoint through ``checkpointer`` from now on: after applied updates, at
        shutdown and on ``ctl checkpoint``."""
        self.checkpointer = checkpointer

    def add_background_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` alongside the coordinator (a status file, the run log); :meth:`close`
        cancels and awaits it."""
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        return task

    @property
    def port(self) -> int:
        if self._server is None:
            raise SwarmError("the coordinator is not listening yet")
        return self._server.port

    async def start(self) -> None:
        """Bind and start serving (returns once listening)."""
        net = self.config.network
        require_secret(net.host, net.port, self.secret, self.config.security.insecure,
                       "join or send gradients")
        timeouts = Timeouts(handshake=net.handshake_timeout_sec,
                            heartbeat_interval=net.heartbeat_interval_sec,
                            heartbeat_timeout=net.heartbeat_timeout_sec)
        # the fused kernels (built once per machine, ~1 s) before the first worker, not during
        # the first update while that worker waits
        await self.run_on_apply_thread(kernels)
        if self.verdicts is not None and self.cluster is not None and self.cluster.servers:
            self._leader_hosts = await _addresses_of(self.cluster.servers[0])
        self._server = await start_server(
            net.host, net.port, self._handle, secret=self.secret, tls=self.tls, timeouts=timeouts,
            send_queue_size=net.send_queue_size, role_limits=self._role_limits(),
            server_limits=net.server_limits(), socket_buffer_bytes=net.socket_buffer_kb * 1024)
        self._tasks.append(asyncio.create_task(self._eval_loop()))
        self._tasks.append(asyncio.create_task(self._say_waiting_forever()))
        if self.freed_memory.available:
            self._tasks.append(asyncio.create_task(self._release_memory_forever()))
        if self.peers is not None:
            self._tasks.append(asyncio.create_task(self.peers.poll_forever()))
        if self.verdict_stream is not None:
            self._tasks.append(asyncio.create_task(self.verdict_stream.run_forever()))
        self.record_event("listening", address=f"{net.host}:{self.port}")
        log.info("coordinator listening on %s:%d (task %s, min_workers %d)",
                 net.host, self.port, self.task_name or "custom", self.config.training.min_workers)
        limit = self.config.training.max_steps
        if limit and self.version >= limit:  # e.g. resumed from the checkpoint of a finished run
            log.warning("the model is at version %d, already at max_steps=%d: nothing left to "
                        "train, so the run ends now; to train on, raise training.max_steps "
                        "(--max-steps)", self.version, limit)
            self.request_shutdown(f"reached max_steps={limit}")

    #: while training waits for ``min_workers``, a line (and a ``waiting_for_workers`` event)
    #: says so this often
    WAITING_LOG_INTERVAL_SEC = 30.0

    async def _say_waiting_forever(self) -> None:
        """Until training starts, say every :data:`WAITING_LOG_INTERVAL_SEC` that it waits for
        workers; a resumed coordinator (it knows workers from its checkpoint) says so at once."""
        if self.workers:  # (none is connected yet)
            self._say_waiting()
        while True:
            await asyncio.sleep(self.WAITING_LOG_INTERVAL_SEC)
            if self.lifecycle not in (CoordinatorState.WAITING, CoordinatorState.WAITING_PAUSED):
                return
            self._say_waiting()

    #: how often malloc's free memory is compared with its bound (:class:`FreedMemory`)
    MEMORY_CHECK_INTERVAL_SEC = 5.0

    async def _release_memory_forever(self) -> None:
        """Every :data:`MEMORY_CHECK_INTERVAL_SEC`, give freed memory past the bound back to
        the system (off the event loop: a release walks every heap, 4-13 ms measured)."""
        while True:
            await asyncio.sleep(self.MEMORY_CHECK_INTERVAL_SEC)
            released = await asyncio.to_thread(self.freed_memory.check)
            if released:
                log.debug("gave %.0f MB of freed memory back to the system", released / 2**20)

    def _say_waiting(self) -> None:
        """Log and record that training waits for ``min_workers``: how many are connected,
        which workers this run had, and what to do."""
        need = self.config.training.min_workers
        connected = sorted(r.worker_id for r in self._connected())
        had = sorted(w for w in self.workers if w not in connected)
        self.record_event("waiting_for_workers", connected=len(connected), min_workers=need,
                    workers=connected, had=had[:32], version=self.version)
        log.warning(
            "waiting for %d more worker(s) before training %s: %d of min_workers %d connected%s%s. "
            "Any worker counts, not only the ones this run had: start workers (swarmtrain worker "
            "--host <this host> --port %d), or restart this coordinator with a lower --min-workers",
            need - len(connected), f"resumes at version {self.version}" if self.version else "starts",
            len(connected), need, f" ({', '.join(connected)})" if connected else "",
            f"; this run had {', '.join(had[:8])}{' ...' if len(had) > 8 else ''}" if had else "",
            self.port)

    def _role_limits(self) -> dict[str, Limits]:
        """What a frame from each role may carry: a worker's gradient is at most the model's
        size twice over (:func:`payload_limit`); a control client's commands are a few bytes,
        so 64 KiB of header and of payload (docs/security.md)."""
        return {
            "worker": Limits(max_header_bytes=1 << 20,
                             max_payload_bytes=payload_limit([*self.params.values(), *self.buffers.values()]),
                             max_tensors=4 * len(self.params) + len(self.buffers) + 64),
            "ctl": Limits(max_header_bytes=1 << 16, max_payload_bytes=1 << 16, max_tensors=16),
            "leader": Limits(max_header_bytes=1 << 16, max_payload_bytes=1 << 16, max_tensors=16),
        }

    async def run(self) -> None:
        """Serve until stopped (max_steps reached, SHUTDOWN, or :meth:`stop`)."""
        if self._server is None:
            await self.start()
        try:
            await self._stopped.wait()
        finally:
            await self.close()

    def stop(self) -> None:
        """Stop serving at once (workers are not told; see :meth:`request_shutdown`)."""
        if self.lifecycle is not CoordinatorState.STOPPED:
            self._enter(CoordinatorState.STOPPED)

    def request_shutdown(self, reason: str = "shutdown requested") -> None:
        """Shut the cluster down gracefully from synchronous code (e.g. a signal handler):
        checkpoint, tell every worker SHUTDOWN, then stop. Call from the event loop's thread.
        Once it is shutting down (or stopped) this does nothing."""
        if not self.finished:
            self._enter(CoordinatorState.FINISHING, reason=reason)
            self._tasks.append(asyncio.ensure_future(self._finish(reason)))

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._window_timer] if self._window_timer is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
        self._apply_pool.shutdown(wait=True)
        self._eval_pool.shutdown(wait=True)
        self.sync_model()  # nothing applies any more: `model` now holds the final state

    async def shutdown_cluster(self, reason: str) -> None:
        """Checkpoint, tell every worker to stop, and stop serving (returns at once if the
        cluster is already shutting down or stopped)."""
        if not self.finished:
            self._enter(CoordinatorState.FINISHING, reason=reason)
            await self._finish(reason)

    async def _finish(self, reason: str) -> None:
        """(FINISHING) Evaluate, checkpoint, send the final weights and SHUTDOWN, stop."""
        log.info("shutting down the cluster: %s", reason)
        await self._evaluate_now()
        if self.checkpointer is not None:
            await self.checkpoint()
        conns = [r.conn for r in self._connected() if r.conn is not None]
        # the final weights first, so that every Worker.run() returns holding them
        final = await self.run_on_apply_thread(self._final_weights)
        await asyncio.gather(*(c.send(final) for c in conns), return_exceptions=True)
        await asyncio.gather(*(c.send(Shutdown(reason=reason)) for c in conns), return_exceptions=True)
        # Let workers hang up first: closing our end while a worker is still sending would
        # reset its connection and could destroy the unread SHUTDOWN frame.
        waits = [asyncio.ensure_future(c.wait_closed()) for c in conns]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.config.network.heartbeat_timeout_sec)
            for w in pending:
                w.cancel()
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if self.peers is not None:
            # the other servers finish with the leader, once its workers have stopped (told
            # first, a worker would take another server's SHUTDOWN for a server lost); their
            # last status first, for the final summary
            await self.peers.poll_once()
            await self.peers.shut_down_others(reason)
        self.stop()

    # -- connections -----------------------------------------------------------------------

    async def _handle(self, conn: Connection, role: str) -> None:
        if role == "worker":
            await self._serve_worker(conn)
        elif role == "ctl":
            await self._serve_ctl(conn)
        elif role == "leader":
            await self._serve_leader(conn)
        else:
            await conn.close(Error(code="bad_role", message=f"unknown role {role!r}"))

    async def _serve_worker(self, conn: Connection) -> None:
        try:
            msg = await conn.recv(timeout=conn.timeouts.handshake, phase="register")
            if not isinstance(msg, Register):
                raise RemoteProtocolError("unexpected", f"expected REGISTER, got {msg.TYPE.name}")
            rec = self._register(conn, msg)
        except WorkerIdTaken as exc:
            log.warning("refused worker at %s: %s", conn.peer, exc)
            self.refusals.count("worker_id_taken")
            self.record_event("worker_refused", worker=exc.worker_id, address=conn.peer, node=conn.node,
                        reason="worker_id_taken")
            await conn.close(Error(code="worker_id_taken", message=str(exc)))
            return
        except (ModelMismatch, ConfigError) as exc:
            log.warning("refused worker at %s: %s", conn.peer, exc)
            code = "model_mismatch" if isinstance(exc, ModelMismatch) else "config_mismatch"
            self.refusals.count(code)
            await conn.close(Error(code=code, message=str(exc)))
            return
        except SwarmError as exc:
            log.warning("worker at %s failed to register: %s", conn.peer, exc)
            return
        conn.admit_payloads(self.gradient_gate)
        try:
            await self._welcome(rec)
            while True:
                # (no local keeps the message: a gradient's payload is freed once applied,
                # not when the next one arrives)
                await self._on_worker_message(rec, conn, await conn.recv())
        except SwarmError as exc:
            if not self.finished:
                log.info("worker %s left: %s", rec.worker_id, exc)
        finally:
            conn.release_all()
            if rec.conn is conn:
                rec.conn = None
                rec.welcomed = False
                self.record_event("left", worker=rec.worker_id, reason=str(self._leave_reason(conn)))
                if not self.finished:
                    with contextlib.suppress(SwarmError):
                        await self._send_assignments(self.shard_plan.leave(rec.worker_id))

    @staticmethod
    def _leave_reason(conn: Connection) -> str:
        reason = conn.close_reason
        return "unknown" if reason is None else str(reason)

    def _register(self, conn: Connection, msg: Register) -> WorkerRecord:
        _check_identity(msg)
        if self.task_name and msg.task and msg.task != self.task_name:
            raise ConfigError(f"this cluster trains task {self.task_name!r}, the worker runs {msg.task!r}")
        if self.cluster is not None:  # the whole model, then how it is split
            check_fingerprint(self.cluster.model_fingerprint, msg.fingerprint)
            self.cluster.check_register(msg.partition)
        else:
            check_fingerprint(self._fingerprint, msg.fingerprint)
        check_compression_match(self.config.compression, msg.compression)
        if msg.shard_index >= self.num_shards:
            raise ConfigError(f"shard_index {msg.shard_index} is out of range: this cluster has "
                              f"{self.num_shards} shards (0..{self.num_shards - 1}, or -1 for automatic)")
        rec = self.workers.get(msg.worker_id)
        if rec is not None and rec.node and rec.node != conn.node:
            # the id belongs to another node's key: the live worker is not touched
            live = rec.conn is not None and not rec.conn.is_closed
            holder = f"connected from {rec.address}" if live else "not connected now"
            this = f"node {conn.node}" if conn.node else "a client without an identity key"
            raise WorkerIdTaken(msg.worker_id,
                f"worker id {msg.worker_id!r} belongs to node {rec.node} ({holder}), and this is "
                f"{this}: give this worker another --worker-id, or stop the other one (a worker "
                "keeps its node key in its config directory, identity.key)")
        if rec is not None and rec.conn is not None and not rec.conn.is_closed and rec.conn is not conn:
            log.info("worker %s reconnected; closing its old connection", msg.worker_id)
            rec.conn.abort(SwarmError("replaced by a new connection"))
        changed = self.shard_plan.join(msg.worker_id, msg.shard_index if msg.shard_index >= 0 else None)
        shards = changed[msg.worker_id]
        for wid, theirs in changed.items():  # owed to them once this worker is welcomed
            other = self.workers.get(wid)
            if wid != msg.worker_id and other is not None:
                other.shards, other.assign_pending = list(theirs), True
        if rec is None:
            rec = WorkerRecord(msg.worker_id, conn.peer, msg.hardware, msg.batch_size,
                               msg.samples_per_sec)
            self.workers[msg.worker_id] = rec
            self._forget_old_workers()
        rec.conn, rec.address, rec.hardware, rec.welcomed = conn, conn.peer, msg.hardware, False
        rec.node = rec.node or conn.node  # bound to the first verified node that registers it
        if rec.member < 0:
            rec.member, self.members_seen = self.members_seen, self.members_seen + 1
        rec.batch_size, rec.samples_per_sec = msg.batch_size, msg.samples_per_sec
        rec.accumulation_steps = msg.accumulation_steps
        rec.shards = shards
        shard = rec.shard_index
        rec.first_applied_pending = True
        rec.track = 0  # its weights come from the finest track (the next answer may move it)
        rec.holds_version = -1  # (a joining worker holds nothing yet: its welcome says what)
        rec.gaps = AnswerGaps()
        rec.waits_for = None
        rec.joined_at = time.monotonic()
        rec.samples_since_join = 0
        rec.buffers_version = -1
        rec.bad_in_row = 0  # a worker disconnected for its gradients starts afresh
        rec.last_seen = time.monotonic()
        self.record_event("joined", worker=rec.worker_id, address=conn.peer, node=conn.node, shard=shard,
                    profile=msg.hardware.get("profile", "?"))
        log.info("worker %s joined from %s (node %s, profile %s, batch %d x %d, %.0f samples/s, "
                 "shard %d/%d)", rec.worker_id, conn.peer, conn.node or "unverified",
                 msg.hardware.get("profile", "?"), msg.batch_size, msg.accumulation_steps,
                 msg.samples_per_sec, shard, self.num_shards)
        return rec

    def _forget_old_workers(self) -> None:
        """Keep at most :data:`MAX_WORKER_RECORDS` records: forget the workers gone longest
        (a worker coming back after that registers as new), so that many short-lived workers,
        or a stranger registering names in a loop, cannot grow the status without bound."""
        excess = len(self.workers) - MAX_WORKER_RECORDS
        if excess <= 0:
            return
        gone = sorted((r for r in self.workers.values() if r.conn is None or r.conn.is_closed),
                      key=lambda r: r.last_seen)
        for rec in gone[:excess]:
            self.departed_stats.update(rec.counts())  # its counts stay in the totals
            del self.workers[rec.worker_id]

    async def _send_assignments(self, changed: Mapping[str, list[int]]) -> None:
        """Tell workers whose shard set changed (a worker came or went) what to train on."""
        for wid, shards in changed.items():
            rec = self.workers.get(wid)
            if rec is None:
                continue
            rec.shards = list(shards)
            if rec.connected:
                await self._send(rec, Assign(shards=list(shards), num_shards=self.num_shards))
        if changed:
            self.record_event("reassigned", shards={w: list(s) for w, s in changed.items()})

    async def _send_owed_assignments(self) -> None:
        """Send every connected worker the ASSIGN its shard set is owed (registrations that
        overlap each add to what is owed; none is lost)."""
        owed = [r for r in self._connected() if r.assign_pending]
        for r in owed:
            r.assign_pending = False
            await self._send(r, Assign(shards=list(r.shards), num_shards=self.num_shards))
        if owed:
            self.record_event("reassigned", shards={r.worker_id: list(r.shards) for r in owed})

    async def _welcome(self, rec: WorkerRecord) -> None:
        weights = await self.run_on_apply_thread(self._snapshot_for, rec, True)
        await self._send(rec, RegisterAck(
            worker_id=rec.worker_id, shard_index=rec.shard_index, num_shards=self.num_shards,
            shards=list(rec.shards),
            running=self.running, paused=self.paused, version=weights.version,
            last_applied_msg_id=rec.last_msg_id,
            info={"task": self.task_name, "min_workers": self.config.training.min_workers,
                  "aggregate_samples": self.config.training.aggregate_samples,
                  "member": rec.member,
                  **(self.cluster.welcome_info() if self.cluster is not None else {})},
        ))
        await self._send(rec, weights)
        rec.welcomed = True
        await self._send_owed_assignments()
        state = self.lifecycle
        waiting = state in (CoordinatorState.WAITING, CoordinatorState.WAITING_PAUSED)
        if waiting and len(self._connected()) >= self.config.training.min_workers:
            # (paused before the start: it starts paused; the workers were told at the pause)
            self._enter(CoordinatorState.RUNNING if state is CoordinatorState.WAITING
                        else CoordinatorState.PAUSED, version=self.version)
            log.info("%d worker(s) connected: starting training", len(self._connected()))
            await asyncio.gather(*(self._send(r, Start(version=self.version)) for r in self._connected()),
                                 return_exceptions=True)
        elif state in (CoordinatorState.RUNNING, CoordinatorState.PAUSED):
            await self._send(rec, Start(version=self.version))
            if state is CoordinatorState.PAUSED:
                await self._send(rec, Pause())

    async def _on_worker_message(self, rec: WorkerRecord, conn: Connection, msg: Message) -> None:
        rec.last_seen = time.monotonic()
        if isinstance(msg, Gradients):
            if self.finished:
                conn.done_with(msg)
                if self.verdict_stream is not None:  # the other servers do not apply it either
                    self.verdict_stream.publish(rec.worker_id, msg.msg_id, UpdateStatus.FINISHED.value, 0)
                return  # the run is over; SHUTDOWN is on its way to this worker
            arrived = time.monotonic()
            if rec.answered_at and arrived > rec.answered_at:  # answer -> next gradient: its step
                rec.step_time.update(arrived - rec.answered_at)
            version = self.version
            try:
                ruling: Ruling | None = None
                if self.verdict_stream is not None:
                    # the leader judges the gradient here, and every other server does with its
                    # slice what this says (sent before the apply: they wait for it)
                    ruling = self._judge(msg)
                    self.verdict_stream.publish(rec.worker_id, msg.msg_id, ruling.status, ruling.staleness)
                elif self.verdicts is not None:
                    ruling = await self.verdicts.wait(rec.worker_id, msg.msg_id)
                status, reply = await self._run_apply(self._apply_gradient, rec, msg, ruling)
            finally:
                conn.done_with(msg)  # applied (or refused): its room goes to the next gradient
            msg_id = msg.msg_id
            del msg  # and its payload is freed now, not after the answer is sent
            if self.version != version:
                self._after_update()
            elif self.window is not None and status is UpdateStatus.APPLIED:
                if self._window_deadline is not None and self._window_timer is None:
                    self._window_timer = asyncio.create_task(self._close_window_at_deadline())
                await self._hold_for_window(rec)
            if reply is None and rec.waits_for is None and not self.finished:
                reply = await self._run_apply(self._reply, rec, msg_id, status)
            if reply is None and rec.waits_for is not None:
                reply = await self._deferred_answer(rec, msg_id, status)
            if self.finished or reply is None:  # the final weights went out (or are going): a
                return  # delta now would be added on top of them, and the replica would overshoot
            await self._send(rec, reply)
            rec.answered_at = time.monotonic()
            if status is UpdateStatus.REJECTED and rec.bad_in_row >= self.config.training.max_bad_in_row:
                await self._disconnect_bad_sender(rec)
                return
            # (a shutdown, which checkpoints, may have been asked for: max_steps in _after_update)
            if self.checkpointer is not None and status is UpdateStatus.APPLIED and not self.finished:
                await self._maybe_checkpoint()
        elif isinstance(msg, StatusRequest):
            await self._send(rec, Status(status=self.status()))
        elif isinstance(msg, Error):
            # a remote text, shortened: a long one is slow to format and floods the log
            log.warning("worker %s reports: %.300s [%s]", rec.worker_id, msg.message, msg.code)
        else:
            self.refusals.count("unexpected")
            await self._send(rec, Error(code="unexpected", fatal=False,
                                        message=f"a worker may not send {msg.TYPE.name}"))

    async def _send(self, rec: WorkerRecord, msg: Message) -> None:
        if rec.conn is not None and not rec.conn.is_closed:
            await rec.conn.send(msg)

    def _connected(self) -> list[WorkerRecord]:
        # list() first: the apply thread asks too (robust_quorum) while the loop may register
        return [r for r in list(self.workers.values()) if r.connected]

    # -- the apply path (runs on the single apply thread) ---------------------------------

    async def run_on_apply_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the thread that applies gradients, so it sees the weights and the
        optimizer between two updates (a checkpoint snapshot, an evaluation)."""
        self._apply_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._apply_pool, fn, *args)
        finally:
            self._apply_jobs -= 1

    async def _run_apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A gradient's apply or its answer: on the event loop itself while applies are quick
        (:data:`INLINE_APPLY_SEC`) and nothing is running on the apply thread, else there;
        timed either way. The first ones run on the thread (how long they take is not known)."""
        quick = self.apply_time.value is not None and self.apply_time.value < INLINE_APPLY_SEC
        if quick and not self._apply_jobs:
            self.applies_inline += 1
            return self._timed(fn, *args)
        self.applies_threaded += 1
        return await self.run_on_apply_thread(self._timed, fn, *args)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.apply_time.update(time.perf_counter() - started)

    def _replica_weights(self) -> dict[str, torch.Tensor]:
        """The trainable parameters as a worker holds them: the masters in the model's dtype."""
        dtypes = {n: p.dtype for n, p in self.state.trainable.items()}
        return {n: p.detach().to(dtypes[n]).clone() for n, p in self.params.items()}

    def _model_buffers(self, synced_only: bool = False) -> dict[str, torch.Tensor]:
        """The persistent buffers' current values (only the synced ones with ``synced_only``),
        in the model's dtype."""
        return {n: self.buffers.get(n, b).detach().to(b.dtype).clone() for n, b in self.state.buffers.items()
                if not synced_only or n in self.buffers}

    def _state_snapshot(self) -> dict[str, torch.Tensor]:
        """The whole model state now (trainable, frozen, buffers) in the model's dtypes."""
        frozen = {n: p.detach() for n, p in self.state.frozen.items()}  # never change
        return {**self._replica_weights(), **frozen, **self._model_buffers()}

    def _final_weights(self) -> Weights:
        return Weights(version=self.version,
                       tensors={**self._replica_weights(), **self._model_buffers(synced_only=True)})

    def sync_model(self) -> None:
        """Write the master weights and buffers into ``model`` (for half-precision parameters
        and buffers the model's tensors are not the masters). Call on the apply thread."""
        with torch.no_grad():
            for n, p in self.state.trainable.items():
                if p is not self.params[n]:
                    p.copy_(self.params[n])
            for n, b in self.state.synced_buffers.items():
                if b is not self.buffers[n]:
                    b.copy_(self.buffers[n])

    def _snapshot_for(self, rec: WorkerRecord, everything: bool = False) -> Weights:
        """The published weights for ``rec`` (its replica becomes them): the trainable
        parameters (published now, copied once per version whoever asks) and the synced
        buffers' masters, plus frozen parameters and constant buffers with ``everything`` (at
        registration: a worker's frozen backbone becomes the coordinator's).

        While :data:`MAX_HELD_SNAPSHOTS` copies are held, the newest copy after what ``rec``
        holds answers instead of a new one (a joining worker holds nothing: any will do), so
        that a burst of welcomes not yet sent holds no more copies than answers may; a new
        copy is made only when there is none it could take."""
        weights = self._snapshot_or_none(rec, make=self._snapshot_room(), everything=everything)
        if weights is None:
            weights = self._snapshot_or_none(rec, make=True, everything=everything)
        if weights is None:  # (made whenever asked to)
            raise RuntimeError("no snapshot was made")
        return weights

    def _snapshot_or_none(self, rec: WorkerRecord, *, make: bool, everything: bool = False) -> Weights | None:
        """:meth:`_snapshot_for`, but with ``make`` False no new copy of the weights: the
        track's last one if it is newer than what ``rec`` holds, else None."""
        master = self._flat_master()
        self.downlink.publish(master, self.version, rec.track)
        track = rec.track
        found = self.downlink.snapshot(master, lambda views: self._as_replica(views, track), self.version,
                                       track, make=make, newer_than=rec.holds_version)
        if found is None:
            return None
        version, trainable = found
        if everything:
            frozen = {n: p.detach() for n, p in self.state.frozen.items()}  # never change
            rest = {**frozen, **self._model_buffers()}
        else:
            rest = self._model_buffers(synced_only=True)
        rec.buffers_version = self.version
        rec.holds_version = version
        return Weights(version=version, tensors={**trainable, **rest})

    def _as_replica(self, views: list[torch.Tensor], track: int = 0) -> dict[str, torch.Tensor]:
        """Flat-vector views shaped like the parameters -> new tensors in the model's dtypes:
        a float32 model's as one :data:`FUSED` buffer (:meth:`_snapshot_buffers`), which an
        answer sends as it is; else one tensor per parameter, in one pooled buffer (a hundred
        clones would be a hundred allocations below the mmap threshold, whose freed memory the
        heap keeps), half-precision ones rounded as .to() rounds. With the half downlink a
        float32 model's are rounded to float16 (``track``'s drift: what rounding left out); a
        model with half-precision parameters gets its weights in its own dtypes."""
        if self._fuse_full:
            if self._rounded:  # (the half downlink: rounded, unless that is beyond the drift bound)
                half = self._snapshot_buffers(sum(self._sizes), torch.float16)
                if self.downlink.tracks[track].accept_rounding(*self._round_into(views, half)):
                    return {FUSED: half}
            flat = self._snapshot_buffers(sum(self._sizes))
            torch._foreach_copy_(list(_unflatten_dense_tensors(flat, views)), views)
            return {FUSED: flat}
        dtypes = [p.dtype for p in self.state.trainable.values()]
        copies = self._mixed_snapshot_buffers(dtypes)
        for c, v in zip(copies, views):
            c.copy_(v)
        return dict(zip(self.params, copies))

    def _round_into(self, views: list[torch.Tensor], half: torch.Tensor) -> tuple[float, float]:
        """Round the weights ``views`` (float32, in order) to float16 into ``half`` (one vector);
        returns (Σ what rounding left out², Σ weights²), NaN or inf where a weight was NaN or
        beyond float16's range. The master's views: one pass of the kernel (saturating, as the
        step's rounding); otherwise torch's ops."""
        fast = kernels()
        flat = self._flat
        if fast is not None and flat is not None and views and views[0].data_ptr() == flat.data_ptr():
            return fast.round_half(flat, half)
        rounded = list(_unflatten_dense_tensors(half, views))
        torch._foreach_copy_(rounded, views)
        return (global_norm(torch._foreach_sub(views, [r.float() for r in rounded])) ** 2,
                global_norm(views) ** 2)

    def _mixed_snapshot_buffers(self, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Tensors shaped like the parameters in ``dtypes``, each on a 64-byte boundary of one
        buffer of the snapshot pool (a small model's: new memory, the pool's minimum size)."""
        starts, end = [], 0
        for n, d in zip(self._sizes, dtypes):
            end += -end % 64
            starts.append(end)
            end += n * d.itemsize
        flat = pooled_bytes(end, pool=self._snapshot_pool)
        return [flat[at:at + n * d.itemsize].view(d).view(p.shape)
                for at, n, d, p in zip(starts, self._sizes, dtypes, self.params.values())]

    def _snapshot_room(self) -> bool:
        """Whether a new copy of the weights may be made for answers: fewer than
        :data:`MAX_HELD_SNAPSHOTS` are held (a small model's copies are not pooled, nor bounded)."""
        return self._small or self._snapshot_pool.in_use() < MAX_HELD_SNAPSHOTS

    def _snapshot_summary(self) -> dict[str, float]:
        pool = self._snapshot_pool
        kept, idle = pool.kept_bytes(), pool.idle_bytes()
        withheld = sum(t.answers["withheld"] for t in self.downlink.tracks)
        waiting = sum(1 for r in list(self.workers.values()) if r.waits_for is not None)
        return {"held_mb": (kept - idle) / 2**20, "idle_mb": idle / 2**20, "held": pool.in_use(),
                "bound": MAX_HELD_SNAPSHOTS, "withheld": withheld, "waiting": waiting,
                "made": pool.allocated, "reused": pool.reused}

    def _snapshot_buffers(self, total: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One buffer of ``total`` elements for a snapshot of a float32 model, in ``dtype``
        (float32, or float16 for the half downlink; the kernel writes it, or
        :meth:`_as_replica` copies into it). A small model's is new memory; a larger one's
        comes from a pool of its own (:func:`pooled_bytes`), at its own offset in a page
        (:data:`~swarmtrain.roles.ps.flat_adam.COPY_PHASE`, as the moments have theirs): new
        memory of that size can be fresh pages on every update (above glibc's mmap threshold,
        or whenever freed memory went back to the system: a page fault per 4 KiB, 37 ms
        instead of 15 for a 10M-parameter apply)."""
        if self._small:
            return torch.empty(total, dtype=dtype)
        phase = phase_after(self._flat, COPY_PHASE) if self._flat is not None else None
        return pooled_bytes(total * dtype.itemsize, phase=phase, pool=self._snapshot_pool).view(dtype)

    def _round_replica(self, flat: torch.Tensor) -> None:
        """Round the half-precision parameters' part of a flat replica to the model's dtype, as
        the worker's own tensors hold them (so the shadow mirrors the worker bit for bit)."""
        for offset, numel, dtype in self._lowp:
            piece = flat[offset:offset + numel]
            piece.copy_(piece.to(dtype))

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat vector shaped like the parameters, in order."""
        return [t.view(p.shape) for t, p in zip(flat.split(self._sizes), self.params.values())]

    def _flat_master(self) -> torch.Tensor:
        """The master weights flattened in parameter order (a view when storage is flat)."""
        if self._flat is not None:
            return self._flat
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params.values()])

    def _owed_buffers(self, rec: WorkerRecord) -> dict[str, torch.Tensor]:
        """Master values of the buffers that changed since ``rec`` last received them."""
        owed = {n: self.buffers[n] for n, v in self._buffer_changed.items() if v > rec.buffers_version}
        rec.buffers_version = self.version
        return owed

    async def _close_window_at_deadline(self) -> None:
        """Close a window that has its samples but waits for due gradients, at its deadline
        (when they did not come), and wake the answers held for it."""
        try:
            while (deadline := self._window_deadline) is not None and not self.finished:
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))
                version = self.version
                await self.run_on_apply_thread(self._close_window_if_due)
                if self.version != version:
                    self._after_update()
        finally:
            self._window_timer = None

    def _after_update(self) -> None:
        """(event loop) An update was applied: wake the answers held for its window, and stop
        at ``max_steps``."""
        self._updated.set()
        self._updated = asyncio.Event()
        if self.config.training.max_steps and self.version >= self.config.training.max_steps:
            self.request_shutdown(f"reached max_steps={self.config.training.max_steps}")

    async def _hold_for_window(self, rec: WorkerRecord) -> None:
        """Hold the answer to a gradient that went into an open window until the window closes,
        but no longer than ``aggregate_hold`` of this worker's own step: when the others keep
        up, its next gradient is then computed on the new weights (as in one process); when
        they are slower, it goes on with the weights as they are and fills the window itself."""
        if rec.step_sec is None:
            return  # its first gradient: how long it computes is not known yet
        limit = min(self.config.training.aggregate_hold * rec.step_sec, 5.0)
        if limit <= 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                await self._updated.wait()

    def _judge(self, msg: Gradients) -> Ruling:
        """(the leader of a sharded cluster) What becomes of gradient ``msg`` in every group:
        applied with its staleness here, dropped as stale, or not applied (the run is over).
        Duplicates and the screen's refusals each server judges on its own slice."""
        staleness = self.version - msg.version
        limit = self.config.training.max_steps
        if limit and self.version >= limit:
            return Ruling(UpdateStatus.FINISHED.value, 0)
        if staleness < 0 or staleness > self.config.training.max_staleness:
            return Ruling(UpdateStatus.STALE.value, max(0, staleness))
        return Ruling(UpdateStatus.APPLIED.value, staleness)

    def _apply_gradient(self, rec: WorkerRecord, msg: Gradients,
                        ruling: Ruling | None = None) -> tuple[UpdateStatus, Update | None]:
        # Only an applied gradient moves the training state (weights, versions, last_msg_id,
        # the worker's loss); a duplicate, stale or refused one moves its own counter and the
        # traffic counts (gradients received, bytes up) alone. ``ruling``: in a sharded
        # cluster, the leader's verdict on this gradient (_judge), which every server follows.
        rec.gradients += 1
        rec.bytes_up += payload_bytes(msg.tensors)
        staleness = self.version - msg.version
        limit = self.config.training.max_steps
        if limit and self.version >= limit:
            # the run is over (the shutdown is on its way): gradients still queued here are
            # answered, not applied, so a run ends at exactly max_steps updates
            status = UpdateStatus.FINISHED
        elif msg.msg_id <= rec.last_msg_id:
            status = UpdateStatus.DUPLICATE
            rec.duplicates += 1
            self.refusals.count("duplicate_gradient")
        elif staleness < 0 or (ruling.status == UpdateStatus.STALE if ruling is not None
                               else staleness > self.config.training.max_staleness):
            status = UpdateStatus.STALE  # dropped: a resend of it is stale again, never applied
            rec.stale += 1
            self.refusals.count("stale_gradient")
        elif ruling is not None and ruling.status == UpdateStatus.FINISHED:
            status = UpdateStatus.FINISHED
        else:
            if ruling is not None:  # damped as on the leader
                staleness = ruling.staleness
            status = self._apply_checked(rec, msg, staleness)
        if status is UpdateStatus.APPLIED:
            rec.loss = msg.loss
            rec.residual_norm = msg.residual_norm
        if self.window is not None and status is UpdateStatus.APPLIED and self.window.gradients:
            return status, None  # in an open window: answered once it closes (or the hold ends)
        return status, self._reply(rec, msg.msg_id, status)

    def _reply(self, rec: WorkerRecord, msg_id: int, status: UpdateStatus) -> Update | None:
        """The answer to ``rec``'s gradient ``msg_id`` (None: it waits for a copy of the
        weights, ``rec.waits_for``: :meth:`_deferred_answer`)."""
        reply = self._update_for(rec, msg_id, status)
        if reply is None:
            return None
        return self._answered(rec, reply)

    def _answered(self, rec: WorkerRecord, reply: Update) -> Update:
        rec.gaps.answered(full=reply.full)
        rec.holds_version = reply.version
        rec.updates += 1
        rec.bytes_down += payload_bytes(reply.tensor_map())
        return reply

    def _apply_checked(self, rec: WorkerRecord, msg: Gradients, staleness: int) -> UpdateStatus:
        # without a window the fused Adam reads fp16 and top-k gradients as they came
        lazy = self.window is None and self._flat_adam is not None
        try:
            buffer_changes, rest = split_buffers(msg.buffers, msg.tensors, self.buffers)
            grads: dict[str, LazyGradient] = (
                unpack_lazy(msg.codecs, rest, self.params, subset=True, known=self._known_header, whole=True)
                if lazy
                else dict(unpack_compressed(msg.codecs, rest, self.params, subset=True,
                                            known=self._known_header)))
        except RemoteProtocolError as exc:
            return self._reject(rec, msg, str(exc))
        refusal = self._refusal(rec, msg, grads, buffer_changes)
        if refusal:
            return self._reject(rec, msg, refusal)
        if isinstance(self.window, RobustWindow):
            rec.weight = 1.0  # one vote, whatever it claims
            self.window.add(rec.worker_id, _dense(grads), self._damping(staleness), msg.samples,
                            sparse=is_sparse(msg.codecs))
        elif self.window is not None:
            rec.weight = self._sample_weight(msg.samples)
            self.window.add(_dense(grads), msg.samples * self._damping(staleness), msg.samples,
                            sparse=is_sparse(msg.codecs))
        if self.window is not None:
            self._window_ids.add(rec.worker_id)
            if self._window_closes(self.window):
                self._step_window(self.window)
        else:
            rec.weight = self._sample_weight(msg.samples)
            self._adam(grads, self.learning_rate() * self._damping(staleness) * rec.weight,
                       is_sparse(msg.codecs), answer=rec)
        with torch.no_grad():  # in arrival order, as one process updates them batch by batch
            for name, change in buffer_changes.items():
                master = self.buffers[name]
                master.add_(change.to(master.dtype))
                self._buffer_changed[name] = self.version
        rec.last_msg_id = msg.msg_id
        rec.bad_in_row = 0
        if rec.first_applied_pending:
            rec.first_applied_pending = False
            self.record_event("first_applied", worker=rec.worker_id,
                        after_join_sec=time.monotonic() - rec.joined_at)
        rec.steps += 1
        rec.samples += msg.samples
        rec.samples_since_join += msg.samples
        rec.staleness_total += staleness
        self.staleness_counts[staleness] += 1
        self.loss_average.update(msg.loss)
        return UpdateStatus.APPLIED

    def _adam(self, grads: Mapping[str, LazyGradient], lr: float, sparse: bool,
              answer: WorkerRecord | None = None) -> None:
        """One update: an optimizer step on ``grads`` (a parameter without one is not stepped,
        decayed or moved, as torch's optimizers skip ``grad is None``). ``answer``: the worker
        whose answer follows at once; with the fused kernel the publication it is answered
        from is made in the same pass."""
        hold = self.config.training.sparse_variance == "hold"
        if self._flat_adam is not None:
            held = self._fused_step(grads, lr, sparse=sparse, held=sparse and hold
                                    and self._flat_adam.can_hold(grads), answer=answer)
        else:
            for name, p in self.params.items():
                g = grads.get(name)
                p.grad = None if g is None else dense_gradient(g).to(p.dtype)
            held = adam_step(self.optimizer, lr, sparse=sparse, hold=hold)
            for p in self.params.values():
                p.grad = None
            self.version += 1
        if held:
            if not self.held_variance_steps:
                log.info("top-k gradients from now on: Adam's second moment is held at what %d "
                         "dense steps taught it", variance_steps(self.optimizer))
            self.held_variance_steps += 1

    def _fused_step(self, grads: Mapping[str, LazyGradient], lr: float, *, sparse: bool, held: bool,
                    answer: WorkerRecord | None) -> bool:
        """:meth:`_adam` in the fused kernel, publishing the finest downlink track in the same
        pass when ``answer``'s reply publishes it anyway (the worker is on it, or a downlink
        whose answers are the weights, lossless or rounded to float16, will answer it with this
        version's: the step writes that copy as it writes the weights); returns ``held``."""
        fa = self._flat_adam
        if fa is None:
            raise RuntimeError("_fused_step needs the fused Adam")
        fine = self.downlink.fine
        version = self.version + 1
        target = snapshot = None
        if answer is not None and answer.track == 0 and not self._lowp:
            if not fine.whole:
                target = fine.fused_target(fa.flat.numel())
            # (a worker on the finest track stays there while its lag calls for no coarser one)
            elif track_for_lag(version - answer.holds_version) == 0 and self._snapshot_room():
                snapshot = self._snapshot_buffers(fa.flat.numel(),
                                                  torch.float16 if fine.rounded else torch.float32)
        status, resid, norm = fa.step(grads, lr, held=held, publication=target[0] if target else None,
                                      snapshot=snapshot)
        if not held and not sparse:
            fa.count_variance_update(grads)
        self.version = version
        if target is not None:
            fine.finish_fused(fa.flat, version, target[1], status == 0, resid, norm)
        elif snapshot is not None:
            if fine.rounded and not fine.accept_rounding(resid, norm):  # (float32 instead, exactly)
                snapshot = self._snapshot_buffers(fa.flat.numel())
                snapshot.copy_(fa.flat)
            fine.set_snapshot(version, {FUSED: snapshot} if self._fuse_full else dict(zip(
                self.params, _unflatten_dense_tensors(snapshot, list(self.params.values())))))
        return held

    def _refusal(self, rec: WorkerRecord, msg: Gradients, grads: dict[str, LazyGradient],
                 buffer_changes: Mapping[str, torch.Tensor]) -> str:
        """Why a decoded gradient must not touch the weights ("" = it may). Clips in place
        when ``max_grad_norm`` is exceeded and the action is ``clip``, and when the outlier
        screen says the norm is far above what this cluster's gradients look like."""
        if msg.samples <= 0 or not math.isfinite(msg.loss):
            return f"{msg.samples} samples, loss {msg.loss}: a gradient needs samples and a finite loss"
        most = rec.batch_size * rec.accumulation_steps  # 0: not registered since a restore
        if most and msg.samples > most:
            return (f"it claims {msg.samples} samples, but this worker registered batch_size "
                    f"{rec.batch_size} x accumulation_steps {rec.accumulation_steps} = {most} at most "
                    "per gradient")
        if not grads:
            return "the message carries no parameter's gradient"
        dtypes = self._dtype_names
        for name in grads:
            # the model's dtype, or float32 (a float16 model's gradients leave the worker
            # unscaled in float32); decoding gives float32 either way
            sent = entry_spec(msg.codecs, name).get("dtype")
            if sent != "float32" and sent != dtypes[name]:
                return f"{name!r} arrived as {sent}, the model's parameter is {dtypes[name]}"
        for name, change in buffer_changes.items():
            if change.is_floating_point() and not bool(torch.isfinite(change).all()):
                return f"buffer {name!r} changed by NaN or infinite values"
        norm = _gradient_norm(msg, grads)  # one pass: also the screen for NaN/Inf
        if not math.isfinite(norm):
            if not all(bool(torch.isfinite(dense_gradient(g)).all()) for g in grads.values()):
                return "NaN or infinite values"
            return "gradient norm overflows float32 (finite but enormous values)"
        if self.cluster is not None and math.isfinite(msg.total_norm):
            # a slice of a gradient: every server judges (and clips) by the whole gradient's
            # norm, which the worker sends to each; a slice's own norm bounds it from below,
            # so a worker under-stating it gains nothing
            norm = max(norm, msg.total_norm)
        t = self.config.training
        if t.max_grad_norm and norm > t.max_grad_norm:
            if t.grad_norm_action == "reject":
                return f"gradient norm {norm:.3g} > max_grad_norm {t.max_grad_norm:g}"
            dense = _dense(grads)  # (scaled as float32, as without the fused Adam)
            grads.update(dense)
            torch._foreach_mul_(list(dense.values()), t.max_grad_norm / norm)
            norm = t.max_grad_norm
        scale = self.screen.check(rec.worker_id, norm)
        if scale < 1.0:
            dense = _dense(grads)
            grads.update(dense)
            torch._foreach_mul_(list(dense.values()), scale)
            rec.clipped += 1
            now = time.monotonic()
            if now - self._clip_logged_at >= 10.0:  # at most one line per 10 s
                self._clip_logged_at = now
                log.warning("clipped gradient %d from %s: norm %.3g is over %gx the reference %.3g "
                            "(median of the workers' recent norms; outlier_norm_factor); %d clipped "
                            "so far", msg.msg_id, rec.worker_id, norm, t.outlier_norm_factor,
                            self.screen.reference(), self.screen.clipped)
        return ""

    def _reject(self, rec: WorkerRecord, msg: Gradients, why: str) -> UpdateStatus:
        log.warning("refused gradient %d from %s: %s", msg.msg_id, rec.worker_id, why)
        rec.rejected += 1
        rec.bad_in_row += 1
        rec.last_refusal = why
        # last_msg_id stays: a refused gradient changes nothing but the refusal counts (else a
        # hostile msg_id would make the worker's real gradients look like duplicates)
        self.refusals.count("rejected_gradient")
        return UpdateStatus.REJECTED

    async def _disconnect_bad_sender(self, rec: WorkerRecord) -> None:
        why = (f"disconnected: {rec.bad_in_row} gradients in a row were refused (last: "
               f"{rec.last_refusal}); check the worker's model, data and swarmtrain version")
        log.error("worker %s %s", rec.worker_id, why)
        self.record_event("worker_refused", worker=rec.worker_id, reason=why)
        self.refusals.count("too_many_bad_gradients")
        if rec.conn is not None:
            await rec.conn.close(Error(code="too_many_bad_gradients", message=why))

    def learning_rate(self) -> float:
        """The learning rate of the next update (the one that makes version ``version + 1``):
        ``training.learning_rate`` times the schedule's factor at this version."""
        return self.base_lr * self.lr_schedule.factor(self.version)

    def _damping(self, staleness: int) -> float:
        """A gradient ``staleness`` updates behind moves the weights 1/staleness as far."""
        return 1.0 / max(1, staleness) if self.config.training.staleness_damping else 1.0

    def _report_exclusions(self, window: RobustWindow, left: list[Any], back: list[Any]) -> None:
        """Say which workers a robust window left out (their gradients pull against the
        others': docs/robustness.md) or took back; each exclusion is a refusal."""
        for worker in left:
            self.refusals.count("member_excluded")
            self.record_event("member_excluded", worker=str(worker), agreement=window.scores.mean(worker))
            log.warning("worker %s is left out of the robust combination: its gradients pull against the "
                        "others' (mean cosine %.3f over its last rounds); check its data and code, or "
                        "stop it if it is not yours", worker, window.scores.mean(worker))
        for worker in back:
            self.record_event("member_readmitted", worker=str(worker))
            log.info("worker %s agrees with the others again; its gradients count again", worker)

    def robust_quorum(self) -> int:
        """Distinct workers a robust window needs: ``robust_quorum``, or max(3, a majority of
        the connected workers); never more than are connected (at least 1)."""
        connected = len(self._connected())
        q = self.config.training.robust_quorum or max(3, connected // 2 + 1)
        return max(1, min(q, connected))

    def _window_closes(self, window: GradientWindow | RobustWindow) -> bool:
        """Whether the open window steps now: it has its samples (a robust one: from a quorum,
        :meth:`_robust_window_closes`) and no worker's fresh gradient is still due before its
        deadline (:meth:`_any_due`); else the deadline is set for the timer."""
        ready = (self._robust_window_closes(window) if isinstance(window, RobustWindow)
                 else window.samples >= self.config.training.aggregate_samples)
        if not ready:
            return False
        now = time.monotonic()
        if self._window_ready_at is None:
            self._window_ready_at = now
        deadline = self._window_ready_at + self._window_wait_limit()
        if now >= deadline or not self._any_due(deadline):
            return True
        self._window_deadline = deadline
        return False

    def _window_wait_limit(self) -> float:
        """How long a window with its samples waits at most: ``aggregate_wait`` x the median
        step time of the connected workers (0 while none is known)."""
        steps = sorted(r.step_sec for r in self._connected() if r.step_sec)
        if not steps:
            return 0.0
        return self.config.training.aggregate_wait * steps[(len(steps) - 1) // 2]

    def _any_due(self, deadline: float) -> bool:
        """Whether a connected worker not in the open window computes on the weights it will
        step (so its next gradient is fresh in it) and is due before ``deadline`` by its own
        step time; a left-out worker of a robust window is not waited for."""
        out = self.window.scores.excluded() if isinstance(self.window, RobustWindow) else frozenset()
        return any(r.step_sec and r.holds_version == self.version and r.worker_id not in self._window_ids
                   and r.worker_id not in out and r.answered_at + r.step_sec <= deadline
                   for r in self._connected())

    def _step_window(self, window: GradientWindow | RobustWindow) -> None:
        """One Adam step on the open window's combination; the next window opens empty."""
        combined, sparse = window.take()
        self._adam(combined, self.learning_rate(), sparse)
        if isinstance(window, RobustWindow):
            self._report_exclusions(window, *window.last_changes)
        self._window_ids.clear()
        self._window_ready_at = self._window_deadline = None

    def _close_window_if_due(self) -> None:
        """(apply thread) Step the open window if its deadline has passed."""
        if (self._window_deadline is not None and time.monotonic() >= self._window_deadline
                and self.window is not None and self.window.gradients):
            self._step_window(self.window)

    def _robust_window_closes(self, window: RobustWindow) -> bool:
        """A robust window closes once it holds ``aggregate_samples`` samples (no slot counted
        above the median slot) from a quorum of workers, or after ``robust_wait_sec`` with
        the samples but not the quorum (a lone or slow cluster still trains)."""
        t = self.config.training
        if window.counted_samples() < t.aggregate_samples:
            return False
        return (window.members >= self.robust_quorum()
                or time.monotonic() - window.opened_at >= t.robust_wait_sec)

    def _sample_weight(self, samples: int) -> float:
        """Fair aggregation: a gradient's step is weighted by the samples behind it, relative to
        the running mean of samples per gradient, so every sample counts the same whichever
        machine computed it (a Pi's batch of 4 moves the weights 1/16 as far as a batch of 64).
        Clamped to [0.05, 4] so one odd batch cannot dominate."""
        mean = self.samples_average.update(samples)
        return min(4.0, max(0.05, samples / mean)) if mean else 1.0

    def _update_for(self, rec: WorkerRecord, msg_id: int, status: UpdateStatus) -> Update | None:
        """What brings ``rec``'s replica to the published weights: the log's entries after the
        version it holds, as they were encoded once for everyone, or the published weights.

        Drift bound: the published weights (what every worker holds after an update, bit for
        bit) are within ``max_drift`` relative L2 distance of the master weights; a
        publication that would leave them further away sends everyone the full weights.
        """
        master = self._flat_master()
        before = rec.track
        rec.gaps.add(self.version, self.version - rec.holds_version)
        rec.track, chain = self.downlink.choose(master, self.version, rec.track, rec.holds_version, rec.gaps)
        if chain is None:
            dest = rec.track
            reply = (self._weights_of(rec, dest, before, msg_id, status)
                     or self._instead_of_weights(rec, master, msg_id, status))
            if reply is None:
                rec.waits_for = dest  # (answered once a copy may be made: _deferred_answer)
                self.downlink.deferred += 1
                return None
        else:
            reply = self._chain_update(rec, msg_id, status, chain, self.downlink.tracks[rec.track].head)
        return self._settled(rec, before, reply)

    def _weights_of(self, rec: WorkerRecord, dest: int, before: int, msg_id: int,
                    status: UpdateStatus) -> Update | None:
        """The full weights of track ``dest`` for ``rec`` (on ``before`` until now), counted
        as sent; None when no copy of them may go now, and ``rec`` stays on ``before``: a
        worker joins a track only with its weights (its replica is its old track's, and the
        two differ by what each coded)."""
        rec.track = dest
        full = self._full_update(rec, msg_id, status)
        if full is None:
            rec.track = before
            return None
        self.downlink.full_answered(dest, before, sent=True)
        return full

    def _settled(self, rec: WorkerRecord, before: int, reply: Update) -> Update:
        """``reply`` once ``rec``'s track is settled (it was on ``before``): a track that lost
        its last worker lets its memory go; the worker's drift is its track's."""
        if rec.track != before:
            self.downlink.forget_unused({r.track for r in self._connected()})
        rec.drift = self.downlink.tracks[rec.track].drift
        return reply

    def _instead_of_weights(self, rec: WorkerRecord, master: torch.Tensor, msg_id: int,
                            status: UpdateStatus) -> Update | None:
        """The answer to ``rec`` when the full weights were due (on another track, which
        :meth:`Downlink.choose` picked) but no copy of them may be made: the entries of the
        track it is on, when that track's log still reaches the version it holds.
        Such a chain is larger than ``choose`` likes (over half the weights: why it picked the
        weights) but smaller than them, already encoded, and needs no copy. None when no chain
        of newer weights reaches it."""
        track = self.downlink.publish(master, self.version, rec.track)
        chain = track.chain_from(rec.holds_version)
        if not chain:
            return None
        track.count(chain)
        self.downlink.instead_of_weights += 1
        return self._chain_update(rec, msg_id, status, chain, track.head)

    def _chain_update(self, rec: WorkerRecord, msg_id: int, status: UpdateStatus,
                      chain: list[LogEntry], version: int) -> Update:
        """The log's ``chain`` as it was encoded once for everyone (ending at ``version``), and
        the buffers ``rec`` is owed."""
        tensors: dict[str, torch.Tensor] = {}
        for entry in chain:
            tensors.update(entry.tensors)
        buffer_names, buffer_tensors = pack_buffers(self._owed_buffers(rec))
        return Update(msg_id=msg_id, version=version, status=status,
                      deltas=[entry.header() for entry in chain], buffers=buffer_names,
                      tensors={**tensors, **buffer_tensors})

    def _full_update(self, rec: WorkerRecord, msg_id: int, status: UpdateStatus) -> Update | None:
        """The published weights of ``rec.track`` for ``rec``; while
        :data:`MAX_HELD_SNAPSHOTS` copies are held (answers not yet sent refer to them), the
        newest one it does not hold; None when it holds that."""
        w = self._snapshot_or_none(rec, make=self._snapshot_room())
        if w is None:
            return None
        rec.resyncs += 1
        return Update(msg_id=msg_id, version=w.version, status=status, full=True,
                      tensors=w.tensors)

    async def _deferred_answer(self, rec: WorkerRecord, msg_id: int, status: UpdateStatus) -> Update | None:
        """The answer to ``rec``'s gradient ``msg_id`` when the full weights of the track
        ``rec.waits_for`` were due and no copy of them could be made (MAX_HELD_SNAPSHOTS copies
        held by answers still on their way, a link slower than the updates): it waits until
        one may be made, then gets that track's weights as they are then. Until now it was
        told "no change" at once: it computed its next gradient on the weights it held, was
        answered "no change" again while the copies were still held, and so on, each gradient
        staler than the last and applied all the same (bench_shards.py, one server on a 100
        Mbit/s link: 43 % of the answers; a worker with nothing to compute between answers
        went round that loop at the speed of the network). Waiting costs the link nothing (it
        carries the held copies meanwhile) and keeps the worker's next gradient fresh. After
        ``heartbeat_timeout_sec`` (copies held by sends to peers that stopped reading: they are
        dropped by then), or once it left, it is told "no change" after all."""
        give_up = time.monotonic() + self.config.network.heartbeat_timeout_sec
        conn = rec.conn
        while True:
            if rec.conn is not conn:  # it registered again: what waits now is that connection's
                return None
            last = time.monotonic() >= give_up or not rec.connected or self.finished
            # (the pool's count is read here, on the loop: the apply thread is asked only once
            # there is room, not 50 times a second for every waiting worker)
            if last or self._snapshot_room():
                reply = await self._run_apply(self._answer_deferred, rec, msg_id, status, last)
                if reply is not None or last:
                    return reply
            await asyncio.sleep(COPY_WAIT_POLL_SEC)

    def _answer_deferred(self, rec: WorkerRecord, msg_id: int, status: UpdateStatus,
                         last: bool) -> Update | None:
        """(the apply thread) :meth:`_deferred_answer`'s answer once a copy may be made (or
        ``last``: then "no change" if none can), None while it waits."""
        dest = rec.waits_for
        if dest is None or (not last and not self._snapshot_room()):
            return None
        rec.waits_for = None
        before = rec.track
        reply = self._weights_of(rec, dest, before, msg_id, status)
        if reply is None:  # "no change": where it is
            self.downlink.full_answered(dest, before, sent=False)
            reply = self._chain_update(rec, msg_id, status, [], rec.holds_version)
        return self._answered(rec, self._settled(rec, before, reply))

    # -- control, evaluation, status -------------------------------------------------------

    async def _serve_leader(self, conn: Connection) -> None:
        """The leader's verdict stream (a server of a sharded cluster that follows it)."""
        if self.cluster is None or self.cluster.leader or self.cluster.spec.count < 2:
            await conn.close(Error(code="bad_role", message=(
                "only a parameter server other than the leader takes the leader's verdicts; this "
                f"is {'the leader' if self.cluster is not None else 'a lone coordinator'}: check "
                "cluster.servers (--servers) on the leader")))
            return
        # who opened it, in the events: any holder of the cluster secret could
        self.record_event("verdict_stream", address=conn.peer, node=conn.node)
        host = peer_ip(conn.transport) if conn.transport is not None else ""
        if self.verdicts is not None and (why := self.verdicts.admit(conn.node or "", host,
                                                                      self._leader_hosts)):
            log.warning("refused a leader's verdict stream from %s: %s", conn.peer, why)
            self.record_event("verdict_stream_refused", address=conn.peer, node=conn.node, reason=why)
            self.refusals.count("not_the_leader")
            await conn.close(Error(code="not_the_leader", message=why))
            return
        log.info("the leader's verdict stream connected from %s%s%s", conn.peer,
                 f" (node {conn.node})" if conn.node else "",
                 "" if self.verdicts is not None else " (not followed: cluster.follow_leader is false)")
        if self.verdicts is not None:
            self.verdicts.connected()
        try:
            with contextlib.suppress(SwarmError):
                while True:
                    msg = await conn.recv()
                    if isinstance(msg, Verdict):
                        if self.verdicts is not None and not self.verdicts.put(msg):
                            self.refusals.count("bad_verdict")
                            await conn.send(Error(code="bad_verdict", fatal=False, message=(
                                f"a verdict's status is one of {', '.join(sorted(VERDICT_STATUSES))}, "
                                f"not {msg.status!r}: the gradient is judged here")))
                    else:
                        self.refusals.count("unexpected")
                        await conn.send(Error(code="unexpected", fatal=False,
                                              message=f"the leader's stream may not send {msg.TYPE.name}"))
        finally:
            if self.verdicts is not None:
                self.verdicts.disconnected()
            log.info("the leader's verdict stream from %s ended: deciding on gradients here until "
                     "it is back", conn.peer)

    async def _serve_ctl(self, conn: Connection) -> None:
        with contextlib.suppress(SwarmError):
            while True:
                msg = await conn.recv()
                if not isinstance(msg, StatusRequest | Weights):  # (asked every few seconds)
                    # who asked, for the log and the events: the address and the node id its key proved
                    log.info("ctl %s from %s%s", msg.TYPE.name, conn.peer,
                             f" (node {conn.node})" if conn.node else "")
                    self.record_event("ctl", action=msg.TYPE.name.lower(), address=conn.peer, node=conn.node)
                if isinstance(msg, StatusRequest):
                    await conn.send(Status(status=self.status()))
                elif isinstance(msg, Pause | Resume):
                    try:
                        await self.set_paused(isinstance(msg, Pause), source=conn.peer)
                    except StateError as exc:
                        await conn.send(Error(code="finished", fatal=False, message=str(exc)))
                    else:
                        await conn.send(Status(status=self.status()))
                elif isinstance(msg, CheckpointMsg):
                    await conn.send(await self._checkpoint_cluster())
                elif isinstance(msg, Weights):
                    # an empty WEIGHTS asks for the current trainable weights (the leader of a
                    # sharded cluster evaluates on every server's part)
                    version, weights = await self.run_on_apply_thread(
                        lambda: (self.version, self._replica_weights()))
                    await conn.send(Weights(version=version, tensors=weights))
                elif isinstance(msg, Shutdown):
                    await conn.send(Status(status=self.status()))
                    await self.shutdown_cluster(msg.reason or "shutdown requested")
                    return
                else:
                    self.refusals.count("unexpected")
                    await conn.send(Error(code="unexpected", fatal=False,
                                          message=f"ctl may not send {msg.TYPE.name}"))

    async def set_paused(self, paused: bool, *, source: str = "") -> None:
        """Pause (workers stop computing, keep their connection) or resume the cluster;
        ``source`` says who asked (the ctl's address), recorded in the event. Pausing a paused
        cluster changes nothing (the workers are told again).

        Raises:
            StateError: the cluster is shutting down or stopped.
        """
        state = self.lifecycle
        target = (_PAUSE if paused else _RESUME).get(state)
        if target is None and self.finished:
            raise StateError(f"the run is {state.value}: it can no longer be "
                             f"{'paused' if paused else 'resumed'}")
        if target is not None:
            self._enter(target, **({"source": source} if source else {}))
        msg: Message = Pause() if paused else Resume()
        await asyncio.gather(*(self._send(r, msg) for r in self._connected()), return_exceptions=True)

    async def _checkpoint_cluster(self) -> CheckpointMsg:
        """``ctl checkpoint``: this server's checkpoint, and with it (the leader of a sharded
        cluster) every other server's; ok only if all were written, naming any that was not."""
        own = await self.checkpoint()
        if self.peers is None:
            return own
        problems = await self.peers.checkpoint_others()
        if not own.ok:
            problems.insert(0, f"parameter server 0 (this one): {own.message}")
        if not problems:
            return dataclasses.replace(own, message=f"{own.message} (and every other parameter "
                                       "server's)".strip())
        return dataclasses.replace(own, ok=False, message="; ".join(problems))

    async def checkpoint(self) -> CheckpointMsg:
        """Write a checkpoint now (if checkpointing is set up)."""
        if self.checkpointer is None:
            return CheckpointMsg(ok=False, message="checkpointing is not enabled on this coordinator")
        return await self.checkpointer.save_now(self)

    async def _maybe_checkpoint(self) -> None:
        if self.checkpointer is not None:
            await self.checkpointer.maybe_save(self)

    async def _eval_loop(self) -> None:
        interval = self.config.training.eval_interval_sec
        if self.evaluate_fn is None or interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            if self.running:
                await self._evaluate_now()

    async def _evaluate_now(self) -> None:
        evaluate = self.evaluate_fn
        if evaluate is None:
            return
        snap = await self.run_on_apply_thread(lambda: (self._state_snapshot(), self.version))
        weights, version = snap
        if self.peers is not None:
            try:
                weights = {**weights, **await self.peers.pull_weights()}
            except (SwarmError, OSError) as exc:
                log.warning("evaluation skipped: the other parameter servers' weights could not be "
                            "fetched (%s)", exc)
                return
        loop = asyncio.get_running_loop()
        try:
            metrics = await loop.run_in_executor(self._eval_pool, self._evaluate_snapshot, evaluate, weights)
        except Exception as exc:  # noqa: BLE001 - a user's evaluate() may raise anything; keep serving
            log.error("evaluation failed: %s", exc)
            return
        self.metrics = dict(metrics)
        self.metric_history.append((version, self.metrics))
        self._evaluated.set()
        self._evaluated = asyncio.Event()
        log.info("version %d: %s", version, ", ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))

    async def next_evaluation(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the next held-out evaluation to finish; True if
        one did (its metrics are then ``metric_history[-1]``)."""
        try:
            async with asyncio.timeout(timeout):
                await self._evaluated.wait()
        except TimeoutError:
            return False
        return True

    def _evaluate_snapshot(self, evaluate: Evaluate, weights: dict[str, torch.Tensor]) -> Mapping[str, float]:
        if self._eval_state is None:
            self._eval_state = ModelState(self._eval_model if self._eval_model is not None
                                          else copy.deepcopy(self.model))
        self._eval_state.load(weights)
        return evaluate(self._eval_state.model)

    def record_event(self, kind: str, **data: Any) -> None:
        """Record an event: in :attr:`events` (the status shows the recent ones) and the run log."""
        self.events.append({"time": time.time(), "event": kind, **data})
        if self.run_log is not None:
            self.run_log.event(kind, **data)

    def status(self) -> dict[str, Any]:
        """Step, loss, version, metrics and a table of workers (msgpack/JSON-able)."""
        total = sum(r.samples for r in self.workers.values())
        return {
            # when this status was taken (unix seconds, and UTC for people): a status file whose
            # coordinator died says how old it is
            "time": time.time(), "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # "step" is the same number, for the readers every mode's status shares (the
            # swarmtrain_step metric, the demo's progress bar)
            "version": self.version, "step": self.version, "loss": self.loss_ema,
            "learning_rate": self.learning_rate(),
            "metrics": dict(self.metrics), "state": self.lifecycle.name.lower(),
            "running": self.running, "paused": self.paused,
            "finished": self.finished, "task": self.task_name,
            "min_workers": self.config.training.min_workers, "num_shards": self.num_shards,
            "workers_connected": len(self._connected()), "stats": dict(self.stats),
            "held_variance_steps": self.held_variance_steps,
            "uptime_sec": time.monotonic() - self._started_at,
            "raw_bytes_per_step": self.raw_bytes_per_step,
            "workers": [r.summary(total, self.raw_bytes_per_step) for r in self.workers.values()],
            "events": list(self.events)[-20:],
            "staleness_counts": {str(k): n for k, n in sorted(dict(self.staleness_counts).items())},
            # the shared downlink: published version, the log, answers by kind (chain / full)
            "downlink": self.downlink.summary(),
            # a larger model's lossless snapshots (its own pool): MB that answers and the
            # downlink still hold (one per version they carry), MB kept idle for the next
            "snapshots": self._snapshot_summary(),
            # memory malloc holds free, and what was given back to the system after bursts
            "memory": self.freed_memory.summary(),
            # where gradients were applied: on the event loop (quick ones) or the apply thread
            "apply": {"inline": self.applies_inline, "threaded": self.applies_threaded,
                      "mean_ms": 1e3 * (self.apply_time.value or 0.0)},
            # gradients received and not yet applied (bytes), and the workers that waited for room
            "admission": self.gradient_gate.summary(),
            "traffic": self._server.traffic() if self._server is not None else {},
            # everything refused, by reason: connections (handshakes, caps) and messages
            "refusals": merge_refusals([self.refusals, *([self._server.refused] if self._server else [])]),
            # robust windows: who is left out, and each worker's agreement with the combinations
            "robust": (self.window.scores.summary() if isinstance(self.window, RobustWindow) else {}),
            # a sharded cluster: this server's place, and (the leader) one row per server
            "cluster": self._cluster_status(),
        }

    def _cluster_status(self) -> dict[str, Any]:
        if self.cluster is None:
            return {}
        out = self.cluster.summary()
        # the leader's verdicts: sent (the leader), or followed and decided here (the others)
        if self.verdict_stream is not None:
            out["verdicts"] = self.verdict_stream.summary()
        elif self.verdicts is not None:
            out["verdicts"] = self.verdicts.summary()
        if self.peers is not None:
            own = {"version": self.version, "state": self.lifecycle.name.lower(), "loss": self.loss_ema,
                   "workers_connected": len(self._connected()), "stats": dict(self.stats),
                   "shard": str(self.cluster.spec), "verdicts": out.get("verdicts")}
            out["shards"] = self.peers.summary(own)
        return out


def _master_weights(
    trainable: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[tuple[int, int, torch.dtype]]]:
    """The master weights of ``trainable``: (name -> master, the flat buffer they are views
    of or None, and ``(offset, numel, model dtype)`` of every half-precision parameter).

    When every master is float32 (float32, float16 and bfloat16 models) they are views of
    one flat buffer, so the flattened master weights cost nothing to read: a float32 CPU
    parameter is moved into it (the model's tensor *is* its master), a half-precision one
    gets a float32 master there and the model keeps its own copy (see ``sync_model``).
    Otherwise (float64, or parameters on an accelerator) each master is its own tensor and
    :meth:`Coordinator._flat_master` concatenates.
    """
    ps = dict(trainable)
    # offsets in the flattened order, which _flat_master's concatenation keeps too
    offsets = [0]
    for p in ps.values():
        offsets.append(offsets[-1] + p.numel())
    lowp = [(off, p.numel(), p.dtype) for off, p in zip(offsets, ps.values())
            if master_dtype(p.dtype) != p.dtype]
    if all(master_dtype(p.dtype) == torch.float32 and p.device.type == "cpu" for p in ps.values()):
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in ps.values()])
        masters: dict[str, torch.Tensor] = {}
        for (name, p), piece in zip(ps.items(), flat.split([p.numel() for p in ps.values()])):
            if p.dtype == torch.float32:
                p.data = piece.view_as(p)
                masters[name] = p
            else:
                masters[name] = piece.view(p.shape)
        return masters, flat, lowp
    masters = {}
    for name, p in ps.items():
        if p.dtype == master_dtype(p.dtype) and p.device.type == "cpu":
            masters[name] = p
        else:
            masters[name] = p.detach().to("cpu", master_dtype(p.dtype)).clone()
    return masters, None, lowp


#: codecs whose decoded tensor is its ``values`` part put in place, exactly (so both have
#: one norm); the screen reads the smaller wire values instead of the decoded tensor
_VALUES_ARE_THE_GRADIENT = frozenset({"none", "fp16", "topk"})


def _dense(grads: Mapping[str, LazyGradient]) -> dict[str, torch.Tensor]:
    """The gradients decoded to float32 (the ones already are, as they are)."""
    return {n: dense_gradient(g) for n, g in grads.items()}


def _gradient_norm(msg: Gradients, grads: Mapping[str, LazyGradient]) -> float:
    """The L2 norm of a decoded gradient, read from the smallest exact form of each tensor:
    the float16 values on the wire (a top-k gradient's k of them) where decoding only widens
    and places them, the decoded tensor otherwise. The sums of squares the decoder took as
    the payload arrived (:mod:`swarmtrain.wire.measure`) are used where it took them; the
    rest is one pass, in the fused kernels when built."""
    measured = getattr(msg.tensors, "sumsq", None)
    total = 0.0
    sources = []
    fused = msg.codecs.get(FUSED)
    if fused is not None and fused.get("codec") in _VALUES_ARE_THE_GRADIENT:
        grads = {FUSED: msg.tensors[f"{FUSED}/values"]}  # (every parameter, one tensor)
    for name, g in grads.items():
        values = None
        if entry_spec(msg.codecs, name).get("codec") in _VALUES_ARE_THE_GRADIENT:
            key = f"{name}/values"
            if measured is not None and key in measured:
                total += measured[key]
                continue
            values = msg.tensors.get(key)
        sources.append(values if values is not None else dense_gradient(g))
    if not sources:
        return math.sqrt(total)
    fast = kernels()
    if fast is not None and all(t.device.type == "cpu" and t.is_contiguous()
                                and t.dtype in (torch.float32, torch.float16) for t in sources):
        return math.sqrt(total + fast.sumsq_many(sources))
    rest = global_norm(sources)
    return math.sqrt(total + rest * rest)


async def _addresses_of(address: str) -> frozenset[str]:
    """The host of ``address`` (``host:port``) and the IP addresses it resolves to (the host
    alone when it does not resolve)."""
    host, _ = split_address(address)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset({host})
    return frozenset({host, *(str(i[4][0]) for i in infos)})


def _check_identity(msg: Register) -> None:
    """Refuse worker ids and hardware descriptions no real worker sends (they end up in every
    status and log line)."""
    if not _WORKER_ID.fullmatch(msg.worker_id):
        raise ConfigError(f"worker id {msg.worker_id[:40]!r} is not allowed: use 1-64 letters, digits "
                          "and . _ - : @ (set --worker-id)")
    hw = msg.hardware
    if not isinstance(hw, dict) or len(hw) > 64 or not all(
            isinstance(k, str) and len(k) <= 64
            and (isinstance(v, int | float | bool) or v is None or (isinstance(v, str) and len(v) <= 256))
            for k, v in hw.items()):
        raise ConfigError("the worker's hardware description is malformed (at most 64 plain "
                          "entries); is it a swarmtrain worker of the same version?")

