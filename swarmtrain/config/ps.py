"""The parameter server's configs: ``swarmtrain coordinator`` and ``swarmtrain worker``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarmtrain.config.schema import _opt, _Section
from swarmtrain.config.sections import (
    CheckpointingConfig,
    CompressionConfig,
    DataConfig,
    HardwareConfig,
    LoggingConfig,
    LRScheduleConfig,
    OpsConfig,
    SecurityConfig,
    ServerLimitsConfig,
)

if TYPE_CHECKING:
    from swarmtrain.transport.endpoints import ServerLimits

__all__ = ["CoordinatorClusterConfig", "CoordinatorConfig", "CoordinatorDataConfig",
           "CoordinatorNetworkConfig",
           "CoordinatorTrainingConfig", "WorkerConfig", "WorkerDataConfig", "WorkerNetworkConfig",
           "WorkerTrainingConfig"]


@dataclass(frozen=True)
class CoordinatorNetworkConfig(ServerLimitsConfig):
    """[network] of the coordinator: where it listens and its connection timing."""

    SECTION = "network"
    LESS_THAN = (("heartbeat_interval_sec", "heartbeat_timeout_sec"),)
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(7100, "TCP port to listen on (0 = any free port)", ge=0, le=65535)
    heartbeat_interval_sec: float = _opt(2.0, "seconds between heartbeats", gt=0.0)
    heartbeat_timeout_sec: float = _opt(10.0, "silence after which a peer is dead", gt=0.0)
    handshake_timeout_sec: float = _opt(10.0, "limit on the connection handshake", gt=0.0)
    send_queue_size: int = _opt(64, "messages queued per connection before backpressure", ge=1)
    max_held_gradient_mb: float = _opt(
        0.0, "gradient bytes received and not yet applied, all workers together, in MiB (0 = "
        "twice the largest gradient received so far: one applied while the next is received). A worker "
        "whose next gradient does not fit waits, in arrival order, before its bytes are read (they "
        "stay in the network buffers); one gradient larger than this is taken alone. The "
        "coordinator's memory then does not grow with the number of workers", ge=0.0)
    admission_timeout_sec: float = _opt(
        20.0, "how long a worker's gradient may wait for room under max_held_gradient_mb before "
        "its connection is dropped (the worker reconnects and sends it again); keep it below the "
        "workers' answer timeout, 3 x their heartbeat_timeout_sec", gt=0.0)
    socket_buffer_kb: int = _opt(
        512, "kernel receive and send buffer of each worker connection, KiB (0 = the system's "
        "automatic sizing, which grows each buffer up to net.ipv4.tcp_rmem's maximum). Workers "
        "waiting under max_held_gradient_mb leave their gradients in these buffers, so many "
        "workers with automatic sizing can fill the machine's TCP memory, and every connection "
        "stalls; 512 KiB keeps a 1 Gbit/s LAN link full (raise it for long round trips: a "
        "connection carries at most this much per round trip)", ge=0)
    ctl_slots: int = _opt(
        4, "connections beyond max_connections kept for `swarmtrain ctl` (any other role is "
        "refused there once authenticated)", ge=0)

    def server_limits(self) -> ServerLimits:
        """:meth:`ServerLimitsConfig.server_limits` with the ``ctl`` reserve."""
        return dataclasses.replace(super().server_limits(), ctl_slots=self.ctl_slots)


@dataclass(frozen=True)
class CoordinatorTrainingConfig(LRScheduleConfig):
    """[training] of the coordinator: task, Adam, staleness, and the run's length."""

    SECTION = "training"
    task: str = _opt("digits", "'digits', 'textlm' or 'package.module:factory'")
    learning_rate: float = _opt(0.0, "Adam learning rate (0 = the task's default)",
                                flag=("--lr", "--learning-rate"), ge=0.0)
    beta1: float = _opt(0.9, "Adam first-moment decay", ge=0.0, lt=1.0)
    beta2: float = _opt(0.999, "Adam second-moment decay", ge=0.0, lt=1.0)
    epsilon: float = _opt(1e-8, "Adam denominator epsilon", gt=0.0)
    weight_decay: float = _opt(
        0.0, "decoupled weight decay (AdamW's rule: each step multiplies the weights by "
        "1 - lr * weight_decay)", ge=0.0)
    min_workers: int = _opt(1, "workers needed before training starts", ge=1)
    max_staleness: int = _opt(16, "gradients staler than this are dropped", ge=0)
    staleness_damping: bool = _opt(True, "scale the learning rate down with staleness")
    aggregate_samples: int = _opt(
        0, "bounded asynchrony: sum gradients (sample-weighted) until they hold this many samples, "
        "then take one Adam step, answering every gradient at once so no worker waits (0 = one "
        "step per gradient). Set it to the batch one process would train with and give workers "
        "smaller batches: gradients of one window are computed on the same weights, so the run "
        "follows one process at equal samples instead of paying for staleness", ge=0)
    aggregate_hold: float = _opt(
        1.0, "with aggregate_samples: hold the answer to a gradient until its window closes, for at "
        "most this many of that worker's own step times (0 = answer at once): workers that keep up "
        "compute on the new weights, a fast one waits at most about one of its steps", ge=0.0, le=10.0)
    aggregate_wait: float = _opt(
        0.5, "with aggregate_samples: once a window has its samples, keep it open for at most this "
        "many median worker step times for the workers computing on the same weights whose "
        "gradients are due by then, so that every worker that keeps up is in it and none lands "
        "stale in the next (5 workers of 16 samples with aggregate_samples = 64 left one "
        "gradient in two stale; 0 = close at once)", ge=0.0, le=10.0)
    sparse_variance: str = _opt(
        "hold", "Adam's second moment on a top-k (sparse) gradient: 'hold' keeps what dense "
        "gradients (the warm-up) taught it, so that error feedback feeds a linear update and "
        "sparse steps move weights as far as dense ones would; 'update' = plain Adam",
        choices=("hold", "update"))
    max_steps: int = _opt(0, "stop after this many updates (0 = run until stopped)", ge=0)
    eval_interval_sec: float = _opt(5.0, "seconds between held-out evaluations", flag="--eval-interval",
                                    gt=0.0)
    num_shards: int = _opt(0, "data shards (0 = max(min_workers, 1))", ge=0)
    resync_interval: int = _opt(
        50, "a worker's answers between restarts of its downlink track from the master (each "
        "worker then gets the full weights once): publications, times the entries of the track's "
        "typical chain, so as rare per answer however many workers share the track", ge=1)
    seed: int = _opt(0, "seed of the model initialisation", ge=0)
    max_grad_norm: float = _opt(
        0.0, "gradients with a larger L2 norm are clipped or rejected (grad_norm_action); 0 = no "
        "absolute limit", ge=0.0)
    grad_norm_action: str = _opt("clip", "what max_grad_norm does", choices=("clip", "reject"))
    outlier_norm_factor: float = _opt(
        1000.0, "clip a gradient whose norm is over this many times the reference norm (the "
        "median of the workers' median recent norms, checked after 20 gradients; no single "
        "worker can drag it far, and honest large norms still count, so it cannot collapse over "
        "a long run); 0 = off", ge=0.0)
    robust: str = _opt(
        "none", "how the gradients of one step are combined so that no single worker steers the "
        "model (docs/robustness.md): 'none' = sample-weighted mean; 'clip', 'trimmed_mean' or "
        "'median' = a window with one slot (one vote) per worker, closed once robust_quorum "
        "workers are in, then the slots' mean after clipping each to the median slot norm, their "
        "coordinate-wise trimmed mean, or their coordinate-wise median",
        choices=("none", "clip", "trimmed_mean", "median"))
    robust_trim: float = _opt(
        0.2, "with robust = 'trimmed_mean': fraction of the slots cut at each end of every "
        "coordinate (at least one from 3 slots on)", ge=0.0, lt=0.5)
    robust_quorum: int = _opt(
        0, "with a robust mode: distinct workers a window needs before it closes (0 = max(3, a "
        "majority of the connected workers), never more than are connected)", ge=0)
    robust_wait_sec: float = _opt(
        2.0, "with a robust mode: a window that has its samples but not its quorum closes anyway "
        "after this long, so training goes on when workers are few or slow (such a window is "
        "only as robust as the workers in it)", gt=0.0)
    max_bad_in_row: int = _opt(
        5, "disconnect a worker whose gradients were refused this many times in a row", ge=1)


@dataclass(frozen=True)
class CoordinatorClusterConfig(_Section):
    """[cluster] of the coordinator: the parameter servers of a sharded cluster (parameter
    shards: each server holds one group of the model's tensors; not the data shards of
    ``training.num_shards``)."""

    SECTION = "cluster"
    shard: str = _opt(
        "", 'which parameter server this is, "i/S": server i of S, each holding the master weights '
        "and Adam state of one group of the model's tensors (server 0 leads: data shards, the run's "
        'length, evaluation, the cluster status); "" = the only server', metavar="i/S")
    servers: tuple[str, ...] = _opt(
        (), "HOST:PORT of every parameter server, server 0 first (the index is the position); the "
        "leader needs it and tells the workers, so a worker is started with the leader's address "
        "only", metavar="HOST:PORT")
    follow_leader: bool = _opt(
        True, "a server other than the leader drops or applies each worker's slice as the leader "
        "did the same gradient, damped by the leader's staleness, so that every group steps on the "
        "same gradients (the leader sends its verdicts as it makes them; a server waits for each "
        "one, and decides on its own while the leader is unreachable); false = each server judges "
        "staleness on its own, and their drops compound (bench_shards: 14 percent of slices dropped on "
        "each of 4 servers lost 44 percent of the rounds)")


@dataclass(frozen=True)
class CoordinatorDataConfig(DataConfig):
    """[data] of the coordinator."""



@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything ``swarmtrain coordinator`` is configured with."""

    network: CoordinatorNetworkConfig = field(default_factory=CoordinatorNetworkConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    training: CoordinatorTrainingConfig = field(default_factory=CoordinatorTrainingConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    data: CoordinatorDataConfig = field(default_factory=CoordinatorDataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    cluster: CoordinatorClusterConfig = field(default_factory=CoordinatorClusterConfig)


# ---------------------------------------------------------------- worker sections


@dataclass(frozen=True)
class WorkerNetworkConfig(_Section):
    """[network] of the worker: where the coordinator is, reconnects and timing."""

    SECTION = "network"
    LESS_THAN = (("heartbeat_interval_sec", "heartbeat_timeout_sec"),)
    coordinator_host: str = _opt("127.0.0.1", "the coordinator's address", flag="--host")
    coordinator_port: int = _opt(7100, "the coordinator's TCP port", flag="--port", ge=1, le=65535)
    reconnect_attempts: int = _opt(10, "reconnects tried before giving up", ge=0)
    reconnect_delay_sec: float = _opt(5.0, "first delay between reconnects (backs off)",
                                      flag="--reconnect-delay", ge=0.0)
    heartbeat_interval_sec: float = _opt(2.0, "seconds between heartbeats", gt=0.0)
    heartbeat_timeout_sec: float = _opt(10.0, "silence after which the link is dead", gt=0.0)
    handshake_timeout_sec: float = _opt(10.0, "limit on the connection handshake", gt=0.0)
    connect_timeout_sec: float = _opt(10.0, "limit on opening the TCP connection", gt=0.0)
    direct_io: bool = _opt(
        True, "quick steps of a small model (under 10 ms of compute, gradients up to 4 MiB) send "
        "and receive on the compute thread with blocking socket calls instead of through the "
        "event loop: one system call per message and no hand-over between threads; a plain TCP "
        "connection only (TLS goes through the loop)")


@dataclass(frozen=True)
class WorkerTrainingConfig(_Section):
    """[training] of the worker: task, batch shape, identity and throttle."""

    SECTION = "training"
    task: str = _opt("digits", "must match the coordinator's task")
    batch_size: int = _opt(0, "samples per step (0 = from the hardware profile)", ge=0)
    accumulation_steps: int = _opt(
        0, "micro-batches per gradient sent (0 = auto: 1, or enough for message_compute_ms)", ge=0)
    message_compute_ms: float = _opt(
        0.0, "with accumulation_steps = 0: accumulate until one gradient message carries this "
        "much compute (ms); 0 = off. Raises samples/s when messages cost more than steps (tiny "
        "models, slow links), but each update then has a bigger batch: check time to accuracy",
        ge=0.0, le=10_000.0)
    worker_id: str = _opt("", 'stable worker name ("" = generated; its batches then follow the seed and the '
                          'order workers first joined the coordinator in)')
    speed: float = _opt(
        1.0, "fraction of full speed (throttle to rehearse a slow machine)", gt=0.0, le=1.0
    )
    max_inflight: int = _opt(
        1, "gradients in flight while the next is computed (0 = wait for each answer)", ge=0, le=8
    )
    seed: int = _opt(0, "seed of the worker's batch sampling (with its worker_id, or its join number)", ge=0)
    probe_seconds: float = _opt(
        1.0, "seconds of the real task timed at start-up (reported speed); 0 = no probe", ge=0.0)
    device: str = _opt("auto", "where to compute: 'auto' (CUDA, else MPS, else CPU), 'cpu', "
                       "'cuda' or 'mps'", choices=("auto", "cpu", "cuda", "mps"))


@dataclass(frozen=True)
class WorkerDataConfig(DataConfig):
    """[data] of the worker."""

    shard_index: int = _opt(-1, "shard to train on (-1 = assigned by the coordinator)", flag="--shard",
                            ge=-1)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything ``swarmtrain worker`` is configured with."""

    network: WorkerNetworkConfig = field(default_factory=WorkerNetworkConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    training: WorkerTrainingConfig = field(default_factory=WorkerTrainingConfig)
    data: WorkerDataConfig = field(default_factory=WorkerDataConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
