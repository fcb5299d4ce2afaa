"""The configuration of every mode: one tree of frozen dataclasses.

Each TOML section is a frozen dataclass; each field carries its help text, its allowed values
and its command-line flag in the field metadata (:func:`_opt`), and one generic checker
validates every field of every section (also when a section is built directly in Python).
The CLI flags (``swarmtrain.app.cli``), the Python keyword overrides
(:func:`overrides_from_kwargs`) and docs/config.md (:func:`render_config_doc`) are all
generated from that metadata. Precedence: defaults < file < ``SWARMTRAIN_<SECTION>__<KEY>``
environment variables < overrides (CLI flags, as dotted keys: ``{"network.port": 7200}``).

The modes and their sections (:data:`MODES`):

- ``coordinator`` (:class:`CoordinatorConfig`) and ``worker`` (:class:`WorkerConfig`): the
  parameter server;
- ``peer`` (:class:`PeerConfig`): peer mode;
- ``stage`` (:class:`StageConfig`) and ``pipeline`` (:class:`PipelineConfig`): pipeline mode.

Servers of every mode share one limits section (:class:`ServerLimitsConfig`, whose keys sit
in the mode's ``[network]`` or ``[stage]``) and one builder of the transport's
``ServerLimits`` from it (:meth:`ServerLimitsConfig.server_limits`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from swarmtrain.errors import ConfigError

if TYPE_CHECKING:
    from swarmtrain.transport.endpoints import ServerLimits
    from swarmtrain.transport.tls import TLSConfig

__all__ = [
    "MODES",
    "SECRET_ENV_VAR",
    "CheckpointingConfig",
    "ClientSecurityConfig",
    "CompressionConfig",
    "ConsoleLoggingConfig",
    "CoordinatorConfig",
    "CoordinatorDataConfig",
    "CoordinatorNetworkConfig",
    "CoordinatorTrainingConfig",
    "FieldInfo",
    "HardwareConfig",
    "LoggingConfig",
    "ModelConfig",
    "OpsConfig",
    "PeerConfig",
    "PeerDataConfig",
    "PeerDiscoveryConfig",
    "PeerNetworkConfig",
    "PeerTrainingConfig",
    "PipelineConfig",
    "PipelineTrainingConfig",
    "SecurityConfig",
    "ServerLimitsConfig",
    "StageConfig",
    "StageLimitsConfig",
    "StageServingConfig",
    "WorkerConfig",
    "WorkerDataConfig",
    "WorkerNetworkConfig",
    "WorkerTrainingConfig",
    "apply_kwargs",
    "field_infos",
    "load_config",
    "load_coordinator_config",
    "load_peer_config",
    "load_pipeline_config",
    "load_stage_config",
    "load_worker_config",
    "overrides_from_kwargs",
    "render_config_doc",
    "resolve_secret",
    "resolve_tls",
    "reused",
    "section_values",
    "to_dict",
    "with_overrides",
]

SECRET_ENV_VAR = "SWARMTRAIN_SECRET"
_REDACTED = "<redacted>"
_TOML_TYPE_NAMES: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string",
                                    tuple[str, ...]: "array of strings"}


def _opt(default: Any, help: str, *, flag: str | tuple[str, ...] = "", cli: bool = True,
         required: bool = False, **checks: Any) -> Any:
    """A config field with its help text, its command-line flag and its checks.

    Args:
        default: the value when no file, variable or flag sets it.
        help: what the key means (the flag's help and the docs' row).
        flag: the flag's name(s), the first one shown; default ``--key-with-dashes``. A
            boolean whose default is True gets ``--no-...`` (setting it False).
        cli: False keeps the key off the command line (``security.secret``: other users of
            the machine would see it in the process list).
        required: a file, a variable or the flag must set it (its default serves only
            sections built in Python).
        **checks: ``ge``, ``gt``, ``le``, ``lt`` (bounds) or ``choices``.
    """
    names = (flag,) if isinstance(flag, str) and flag else tuple(flag)
    return field(default=default, metadata={"help": help, "flags": names, "cli": cli,
                                            "required": required, **checks})


def reused(section: type, name: str) -> Any:
    """The field ``name`` of ``section`` again (same default, help and checks), for a class
    derived from config sections that needs one more key of another section."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


class _Section:
    """Base of every section: validates each field against its type and metadata."""

    SECTION: ClassVar[str]
    # (a, b) pairs of fields where a must be strictly less than b
    LESS_THAN: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _check_value(type(self), f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        for a, b in self.LESS_THAN:
            if not getattr(self, a) < getattr(self, b):
                raise ConfigError(
                    f"{self.SECTION}.{a} ({getattr(self, a)}) must be less than "
                    f"{self.SECTION}.{b} ({getattr(self, b)})"
                )


_SPECS: dict[type, dict[str, tuple[Any, Mapping[str, Any]]]] = {}


def _field_specs(cls: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """Field name -> (type, metadata) of a section class, resolved once per class."""
    if cls not in _SPECS:
        hints = typing.get_type_hints(cls)
        _SPECS[cls] = {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(cls)}
    return _SPECS[cls]


def _type_name(t: Any) -> str:
    return _TOML_TYPE_NAMES.get(t, getattr(t, "__name__", str(t)))


def _check_type(expected: Any, value: Any) -> tuple[Any, bool]:
    """``(value, ok)``: ints widened for float fields, lists of strings made tuples."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), True
    if expected == tuple[str, ...]:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        return (tuple(value) if ok else value), ok
    origin = typing.get_origin(expected) or expected
    if not isinstance(origin, type):  # e.g. an Optional of a role's own class: not checked here
        return value, True
    return value, isinstance(value, origin) and not (isinstance(value, bool) and origin is not bool)


def _check_value(cls: type, name: str, value: Any) -> Any:
    """Return ``value`` (ints widened to float for float fields) or raise ConfigError."""
    expected, meta = _field_specs(cls)[name]
    key = f"{cls.SECTION}.{name}"  # type: ignore[attr-defined]
    value, ok = _check_type(expected, value)
    if not ok:
        raise ConfigError(
            f"{key}: expected {_type_name(expected)}, got {value!r} ({_type_name(type(value))})"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(
            f"{key} = {value!r} is not allowed; allowed values: {allowed}{_flag_hint(name, meta)}")
    lower = [(meta[op], sym) for op, sym in (("ge", "<="), ("gt", "<")) if op in meta]
    upper = [(meta[op], sym) for op, sym in (("le", "<="), ("lt", "<")) if op in meta]
    in_range = all(value >= b if s == "<=" else value > b for b, s in lower) and all(
        value <= b if s == "<=" else value < b for b, s in upper
    )
    if not in_range:
        text = " ".join([*(f"{b} {s}" for b, s in lower), name, *(f"{s} {b}" for b, s in upper)])
        raise ConfigError(f"{key} = {value!r} is out of range; allowed: {text}{_flag_hint(name, meta)}")
    return value


def _flag_hint(name: str, meta: Mapping[str, Any]) -> str:
    """`` (--flag)``: the flag that sets a config key, for its error messages; "" for a key
    with no flag and for the plain fields of the roles' own classes."""
    if "help" not in meta or not meta.get("cli", True):
        return ""
    flags = meta.get("flags") or ("--" + name.replace("_", "-"),)
    return f" ({flags[0]})"


def section_values(section: Any) -> dict[str, Any]:
    """The fields of a section (or of a class derived from sections) by name, unconverted
    (``dataclasses.asdict`` would turn tuples into lists): ``Derived(**section_values(s))``."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


# ---------------------------------------------------------------- sections shared by the modes


@dataclass(frozen=True)
class ClientSecurityConfig(_Section):
    """[security] of a process that only connects: the cluster secret, and optional TLS."""

    SECTION = "security"
    secret: str = _opt("", "cluster secret; takes precedence over secret_file and the env var",
                       cli=False)
    secret_file: str = _opt("", "file holding the cluster secret (whitespace stripped; or set "
                            "SWARMTRAIN_SECRET)")
    tls_cert: str = _opt("", 'this node\'s certificate (PEM) from `swarmtrain keys` ("" = TLS off)')
    tls_key: str = _opt("", 'this node\'s private key (PEM) from `swarmtrain keys` ("" = TLS off)')
    tls_ca: str = _opt("", 'the cluster CA certificate, ca.pem from `swarmtrain keys` ("" = TLS off)')

    TLS_KEYS: ClassVar[tuple[str, ...]] = ("tls_cert", "tls_key", "tls_ca")

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [k for k in self.TLS_KEYS if getattr(self, k)]
        if given and len(given) < len(self.TLS_KEYS):
            missing = [f"security.{k}" for k in self.TLS_KEYS if k not in given]
            raise ConfigError(
                f"{', '.join(f'security.{k}' for k in given)} set but {', '.join(missing)} not: "
                "TLS needs all three (this node's certificate, its key and the cluster CA), or "
                "none for TLS off; make them with `swarmtrain keys --out DIR`")


@dataclass(frozen=True)
class SecurityConfig(ClientSecurityConfig):
    """[security] of a process that listens: the cluster secret, optional TLS, and whether it
    may run with no secret."""

    insecure: bool = _opt(False, "allow running without any secret: anyone who can reach the port "
                          "can join (trusted networks only)")


#: the codecs a gradient may travel in (swarmtrain.compression's, but for the downlink's uniform)
_UPLINK_CODECS = ("none", "fp16", "topk", "qsgd")


@dataclass(frozen=True)
class CompressionConfig(_Section):
    """[compression]: how gradients (and weight deltas) are compressed on the wire."""

    SECTION = "compression"
    type: str = _opt("none", "gradient codec", flag="--compression", choices=_UPLINK_CODECS)
    topk_ratio: float = _opt(0.1, "fraction of entries topk keeps", gt=0.0, le=1.0)
    qsgd_bits: int = _opt(8, "bits per QSGD level index", choices=(2, 4, 8))
    bucket_size: int = _opt(512, "elements per QSGD bucket (one norm each)", ge=1)
    warmup_steps: int = _opt(
        0, "topk density ramps from 1 (dense) down to topk_ratio over this many steps", ge=0)
    min_compress_numel: int = _opt(256, "tensors smaller than this go uncompressed", ge=0)
    max_drift: float = _opt(
        0.01, "coordinator only: largest relative L2 distance a worker's weights may have from the "
        "master after an update; beyond it the full weights are sent", gt=0.0)
    downlink: str = _opt(
        "auto", "coordinator only: codec for weight deltas sent to workers; auto = the uplink's, "
        "except uniform (deterministic, error-compensated by the worker's shadow) when the uplink "
        "is topk or qsgd (Adam's updates are dense)",
        choices=("auto", *_UPLINK_CODECS, "uniform"))
    downlink_bits: int = _opt(
        4, "coordinator only: bits per element of a uniform downlink", choices=(2, 4, 8))

    #: keys both sides must agree on (max_drift is the coordinator's alone)
    SHARED_KEYS: ClassVar[tuple[str, ...]] = (
        "type", "topk_ratio", "qsgd_bits", "bucket_size", "warmup_steps", "min_compress_numel")


@dataclass(frozen=True)
class ConsoleLoggingConfig(_Section):
    """[logging] of a process without a run log: console verbosity."""

    SECTION = "logging"
    level: str = _opt("info", "log level", flag="--log-level",
                      choices=("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class LoggingConfig(ConsoleLoggingConfig):
    """[logging]: console verbosity and the optional JSONL run log."""

    run_log: str = _opt(
        "auto", 'JSONL log of the run\'s metrics and events, for `swarmtrain plot`: "auto" = '
        'runs/<date-time>/<role>.jsonl (under $SWARMTRAIN_RUNS_DIR if set), "" or "none" = no '
        'run log, else the file\'s path')


@dataclass(frozen=True)
class CheckpointingConfig(_Section):
    """[checkpointing]: periodic atomic checkpoints of weights and optimizer state."""

    SECTION = "checkpointing"
    interval: int = _opt(1000, "updates between checkpoints (0 = off)", flag="--checkpoint-interval",
                         ge=0)
    directory: str = _opt("checkpoints", "where checkpoints are written", flag="--checkpoint-dir")
    keep: int = _opt(3, "newest checkpoints kept on disk", flag="--keep-checkpoints", ge=1)
    export: str = _opt(
        "auto", 'where the final weights go (safetensors) when the run ends: "auto" = '
        'model.safetensors next to the run log (none without one), "" or "none" = no export, '
        'else the file\'s path')


@dataclass(frozen=True)
class HardwareConfig(_Section):
    """[hardware]: limits on what the worker uses of its machine."""

    SECTION = "hardware"
    num_threads: int = _opt(0, "torch threads (0 = auto: a worker's from its hardware profile, a "
                            "peer's the cores shared out among the swarmtrain peers on this machine)",
                            flag="--threads", ge=0)
    max_memory_mb: int = _opt(0, "memory budget for training in MB (0 = auto)", ge=0)


@dataclass(frozen=True)
class OpsConfig(_Section):
    """[ops]: the read-only HTTP port serving Prometheus metrics and the live dashboard."""

    SECTION = "ops"
    http_port: int = _opt(0, "serve Prometheus /metrics, /api/status (JSON) and, but for a stage, a "
                          "live dashboard at / on this port (read-only, no secret; 0 = off)", ge=0, le=65535)
    http_host: str = _opt(
        "127.0.0.1", "address the HTTP port listens on; it has no secret, so keep it on a trusted interface")


@dataclass(frozen=True)
class ServerLimitsConfig(_Section):
    """Who may hold connections to a server of this process (against floods and secret
    guessing): the keys every mode's server reads, in its ``[network]`` (``[stage]`` for a
    stage). A peer's control server and its ring listener each hold these limits."""

    SECTION = "network"
    max_connections: int = _opt(256, "open connections at most, handshakes included", ge=1)
    max_connections_per_address: int = _opt(32, "open connections at most from one IP address", ge=1)
    max_failed_auth: int = _opt(
        10, "failed handshakes from one address within a minute before it is refused for a minute",
        ge=1)

    def server_limits(self) -> ServerLimits:
        """These limits as the transport's :class:`~swarmtrain.transport.endpoints.ServerLimits`
        (the one place the two are mapped)."""
        from swarmtrain.transport.endpoints import ServerLimits

        return ServerLimits(max_connections=self.max_connections,
                            max_per_address=self.max_connections_per_address,
                            max_failed_auth=self.max_failed_auth)


# ---------------------------------------------------------------- coordinator sections


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
    ctl_slots: int = _opt(
        4, "connections beyond max_connections kept for `swarmtrain ctl` (any other role is "
        "refused there once authenticated)", ge=0)

    def server_limits(self) -> ServerLimits:
        """:meth:`ServerLimitsConfig.server_limits` with the ``ctl`` reserve."""
        return dataclasses.replace(super().server_limits(), ctl_slots=self.ctl_slots)


@dataclass(frozen=True)
class CoordinatorTrainingConfig(_Section):
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
    resync_interval: int = _opt(50, "updates between full weight resyncs to a worker", ge=1)
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
class CoordinatorDataConfig(_Section):
    """[data] of the coordinator."""

    SECTION = "data"
    path: str = _opt("", 'JSONL file replacing the task\'s built-in data ("" = built-in)', flag="--data")


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
    worker_id: str = _opt("", 'stable worker name ("" = generated)')
    speed: float = _opt(
        1.0, "fraction of full speed (throttle to rehearse a slow machine)", gt=0.0, le=1.0
    )
    max_inflight: int = _opt(
        1, "gradients in flight while the next is computed (0 = wait for each answer)", ge=0, le=8
    )
    seed: int = _opt(0, "seed of the worker's batch sampling", ge=0)
    probe_seconds: float = _opt(
        1.0, "seconds of the real task timed at start-up (reported speed); 0 = no probe", ge=0.0)
    device: str = _opt("auto", "where to compute: 'auto' (CUDA, else MPS, else CPU), 'cpu', "
                       "'cuda' or 'mps'", choices=("auto", "cpu", "cuda", "mps"))


@dataclass(frozen=True)
class WorkerDataConfig(_Section):
    """[data] of the worker."""

    SECTION = "data"
    path: str = _opt("", 'JSONL file replacing the task\'s built-in data ("" = built-in)', flag="--data")
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


# ---------------------------------------------------------------- peer


@dataclass(frozen=True)
class PeerNetworkConfig(ServerLimitsConfig):
    """[network] of a peer: where it listens, the time limits of each phase, and what its control
    server and its ring listener admit."""

    SECTION = "network"
    LESS_THAN = (("heartbeat_interval_sec", "heartbeat_timeout_sec"),)
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(7200, "control port (membership, status); 0 = any free port", ge=0, le=65535)
    ring_port: int = _opt(0, "port of the all-reduce ring listener (0 = any free port)", ge=0, le=65535)
    advertise_host: str = _opt("", 'address others reach this peer at ("" = found automatically)')
    heartbeat_interval_sec: float = _opt(0.5, "seconds between heartbeats to each member", gt=0.0)
    heartbeat_timeout_sec: float = _opt(5.0, "a member silent this long is dead", gt=0.0)
    propose_timeout_sec: float = _opt(3.0, "how long a proposer waits for each answer", gt=0.0)
    ring_timeout_sec: float = _opt(
        120.0, "longest wait for a ring neighbour's data (slow peers arrive late)", gt=0.0)
    reform_timeout_sec: float = _opt(60.0, "longest wait for a new epoch after a failure", gt=0.0)


@dataclass(frozen=True)
class PeerDiscoveryConfig(_Section):
    """[peer]: which run to join and how to find its other peers."""

    SECTION = "peer"
    run: str = _opt("default", "run name: only peers with the same name are joined")
    min_peers: int = _opt(1, "peers (including this one) to wait for before the first round", ge=1)
    discovery_timeout_sec: float = _opt(300.0, "longest wait for min_peers", gt=0.0)
    peers: str = _opt("", 'static list "host:port,host:port" for networks without multicast')
    quorum: str = _opt("majority", "majority: a peer cut off from most of its group pauses instead of "
                       "training a copy that diverges; none: every group trains, the larger "
                       "working group's state wins the merge", choices=("majority", "none"))
    probe_interval_sec: float = _opt(1.0, "how often a known peer outside the group is asked "
                                     "whether it is back (backing off to 4x while it is not)", gt=0.0)


@dataclass(frozen=True)
class PeerTrainingConfig(_Section):
    """[training] of a peer: per-step averaging or DiLoCo."""

    SECTION = "training"
    task: str = _opt("textlm", "'digits', 'textlm' or 'package.module:factory'")
    mode: str = _opt("diloco", "'diloco' (H local steps, then average) or 'step' (every step)",
                     choices=("diloco", "step"))
    learning_rate: float = _opt(0.0, "inner AdamW learning rate (0 = the task's default)",
                                flag=("--lr", "--learning-rate"), ge=0.0)
    weight_decay: float = _opt(0.0, "inner AdamW weight decay", ge=0.0)
    batch_size: int = _opt(0, "samples per step (0 = from the hardware profile)", ge=0)
    inner_steps: int = _opt(50, "DiLoCo: inner steps per round (H)", ge=1)
    inner_seconds: float = _opt(
        0.0, "DiLoCo: if > 0, each round's inner loop runs this long instead of inner_steps", ge=0.0)
    outer_lr: float = _opt(0.7, "DiLoCo outer Nesterov learning rate", gt=0.0)
    outer_momentum: float = _opt(0.9, "DiLoCo outer Nesterov momentum", ge=0.0, lt=1.0)
    wire: str = _opt("fp32", "all-reduce wire format: peer mode's compression",
                     choices=("fp32", "fp16", "int8"))
    robust: str = _opt(
        "none", "how the members' contributions of a round are combined so that no single peer "
        "steers the model (docs/robustness.md): 'none' = weighted mean by all-reduce; 'clip', "
        "'trimmed_mean' or 'median' = every contribution is gathered (fp32, world_size x the "
        "all-reduce's bytes) and every member computes the same robust combination, one vote "
        "per member", choices=("none", "clip", "trimmed_mean", "median"))
    robust_trim: float = _opt(
        0.2, "with robust = 'trimmed_mean': fraction of the members cut at each end of every "
        "coordinate (at least one from 3 members on)", ge=0.0, lt=0.5)
    max_rounds: int = _opt(0, "stop after this many rounds (0 = run until stopped)", ge=0)
    eval_every: int = _opt(10, "rounds between held-out evaluations (by rank 0)", ge=1)
    speed: float = _opt(1.0, "fraction of full speed (throttle to rehearse a slow machine)",
                        gt=0.0, le=1.0)
    seed: int = _opt(0, "seed of the model initialisation (the same on every peer)", ge=0)
    device: str = _opt("auto", "where to compute: 'auto' (CUDA, else MPS, else CPU), 'cpu', "
                       "'cuda' or 'mps'", choices=("auto", "cpu", "cuda", "mps"))


@dataclass(frozen=True)
class PeerDataConfig(_Section):
    """[data] of a peer (every peer samples the whole data set, in its own order: no shards)."""

    SECTION = "data"
    path: str = _opt("", 'JSONL file replacing the task\'s built-in data ("" = built-in)', flag="--data")


@dataclass(frozen=True)
class PeerConfig:
    """Everything ``swarmtrain peer`` is configured with."""

    network: PeerNetworkConfig = field(default_factory=PeerNetworkConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    peer: PeerDiscoveryConfig = field(default_factory=PeerDiscoveryConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    training: PeerTrainingConfig = field(default_factory=PeerTrainingConfig)
    data: PeerDataConfig = field(default_factory=PeerDataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)


# ---------------------------------------------------------------- pipeline mode

#: where a process may compute (``swarmtrain.core.devices`` resolves them)
_DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass(frozen=True)
class ModelConfig(_Section):
    """[model] of pipeline mode: the task and the model's shape, the same on every stage and
    trainer of one pipeline."""

    SECTION = "model"
    task: str = _opt("textlm", "textlm, or package.module:factory")
    context: int = _opt(0, "textlm: tokens the model sees at once (0 = the task's default, 128)", ge=0)
    d_model: int = _opt(0, "textlm: width of the residual stream (0 = the task's default, 128)", ge=0)
    n_heads: int = _opt(0, "textlm: attention heads (0 = the task's default, 4)", ge=0)
    n_layers: int = _opt(0, "textlm: transformer blocks (0 = the task's default, 4)", ge=0)

    def shape(self) -> dict[str, int]:
        """The shape keys that are set (not 0), by name."""
        return {k: v for k, v in section_values(self).items() if k != "task" and v}


@dataclass(frozen=True)
class StageLimitsConfig(ServerLimitsConfig):
    """What a stage server admits (against floods and misbehaving clients): the shared server
    limits, and what one request may carry."""

    SECTION = "stage"
    max_request_mb: float = _opt(
        256.0, "MiB one request of a trainer or generation client may carry; a micro-batch x "
        "context x width x 4 bytes over it closes the connection", gt=0.0)
    max_bad_in_row: int = _opt(
        5, "close a connection whose requests were refused this many times in a row for what they "
        "carried", ge=1)

    def limit_values(self) -> dict[str, Any]:
        """These limits by name (for a class derived from this one)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(StageLimitsConfig)}


@dataclass(frozen=True)
class StageServingConfig(StageLimitsConfig):
    """[stage]: which stage `swarmtrain stage` serves, where, and how it trains, checkpoints
    and announces itself. Every stage computes its layer range from ``stage`` and ``stages``
    alone, so every stage and replica of one pipeline gives the same [model] and ``seed``."""

    stage: int = _opt(0, "index of the stage served (0 = the first)", required=True, ge=0)
    stages: int = _opt(1, "number of stages in the pipeline", required=True, ge=1)
    seed: int = _opt(0, "model initialisation seed (the same on every stage)", ge=0)
    layers: str = _opt("", 'serve layers START:STOP instead of the planned range ("" = planned)')
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(7300, "port to listen on (0 = any free port)", ge=0, le=65535)
    sync_with: tuple[str, ...] = _opt(
        (), "HOST:PORT of a replica of the same stage to average parameters with (repeatable; "
        "configure each pair on one side only)")
    sync_every: int = _opt(10, "optimizer steps between averages with sync_with", ge=0)
    learning_rate: float = _opt(0.0, "AdamW learning rate (0 = the task's default)",
                                flag=("--lr", "--learning-rate"), ge=0.0)
    threads: int = _opt(0, "PyTorch threads (0 = all cores)", ge=0)
    kv_cache_mb: float = _opt(256.0, "MiB of generation sessions' attention caches kept at most", gt=0.0)
    device: str = _opt("auto", "where this stage's layers compute: 'auto' (CUDA, else MPS, else CPU), "
                       "'cpu', 'cuda' or 'mps'", choices=_DEVICES)
    status_file: str = _opt("", 'keep this stage\'s status as JSON here, rewritten every second ("" = none)')
    checkpoint_dir: str = _opt(
        "", 'where this stage\'s checkpoints (weights, optimizer state, step counters) go ("" = '
        'checkpoints/stage{I} in the working directory; none = no checkpoints)')
    checkpoint_every: int = _opt(10, "optimizer steps between checkpoints (0 = only on SIGINT/SIGTERM)",
                                 ge=0)
    keep_checkpoints: int = _opt(3, "newest checkpoints kept on disk", ge=1)
    cluster: str = _opt("swarmtrain", "the pipeline's name, announced by its stages on the LAN (mDNS); "
                        "the same on every stage and trainer of one pipeline")
    announce: bool = _opt(True, "announce this stage on the LAN by mDNS (without it, trainers need "
                          "--route)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage >= self.stages:
            raise ConfigError(f"--stage {self.stage} --stages {self.stages}: need 0 <= stage < stages")
        if self.checkpoint_dir and not self.checkpoint_dir.strip():
            raise ConfigError("--checkpoint-dir is blank: give a directory, or none to turn checkpoints off")

    @property
    def checkpoint_directory(self) -> str | None:
        """Where this stage's checkpoints go, None when they are turned off."""
        if self.checkpoint_dir.strip().lower() == "none":
            return None
        return self.checkpoint_dir or os.path.join("checkpoints", f"stage{self.stage}")


@dataclass(frozen=True)
class StageConfig:
    """Everything ``swarmtrain stage`` is configured with."""

    stage: StageServingConfig = field(default_factory=StageServingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    logging: ConsoleLoggingConfig = field(default_factory=ConsoleLoggingConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)


@dataclass(frozen=True)
class PipelineTrainingConfig(_Section):
    """[pipeline]: what `swarmtrain pipeline` trains through the stages, and how."""

    SECTION = "pipeline"
    microbatches: int = _opt(200, "micro-batches to train", ge=1)
    batch_size: int = _opt(16, "samples per micro-batch", ge=1)
    schedule: str = _opt(
        "sync", "sync: one optimizer step per `chunks` micro-batches, all in flight at once and "
        "flushed, so the run is one process's at a batch of chunks x batch_size; async: "
        "max_inflight micro-batches in flight, every stage stepping per micro-batch on weights "
        "that moved since its forward", choices=("sync", "async"))
    chunks: int = _opt(8, "with schedule sync: micro-batches per optimizer step", ge=1)
    max_inflight: int = _opt(4, "with schedule async: micro-batches in the pipeline at once", ge=1)
    grad_clip: float = _opt(
        1.0, "with schedule sync: clip the whole model's gradient norm to this before each step, as "
        "one process does (0 = no clipping); with async each stage clips its own part", ge=0.0)
    eval_every: int = _opt(
        50, "micro-batches between held-out evaluations (0 = only at start and end; with schedule "
        "sync rounded up to whole groups of chunks)", ge=0)
    eval_samples: int = _opt(64, "held-out windows per evaluation", ge=1)
    seed: int = _opt(0, "seed of the order training samples are drawn in", ge=0)
    request_timeout: float = _opt(30.0, "seconds a stage may take to answer before its replica is "
                                  "banned", gt=0.0)
    stage_wait: float = _opt(
        300.0, "when no replica of a stage answers, wait this long (seconds) for one to come back "
        "(restarted with --resume, say) before giving up", ge=0.0)
    status_file: str = _opt("", 'keep the trainer\'s status (loss history, acknowledgements, resends) '
                            'as JSON here ("" = none)')
    route: str = _opt(
        "", "the stage servers: HOST:PORT of each replica, ',' between replicas of one stage, ';' "
        'between stages, e.g. "10.0.0.2:7300;10.0.0.3:7300,10.0.0.4:7300;10.0.0.5:7300" ("" = the '
        "stages of cluster, found on the LAN by mDNS)")
    cluster: str = reused(StageServingConfig, "cluster")
    discover_timeout: float = _opt(10.0, "without route: look for the stages this long (seconds) at "
                                   "most", gt=0.0)


@dataclass(frozen=True)
class PipelineConfig:
    """Everything ``swarmtrain pipeline`` is configured with."""

    pipeline: PipelineTrainingConfig = field(default_factory=PipelineTrainingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    security: ClientSecurityConfig = field(default_factory=ClientSecurityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


#: every mode's whole config, by the command that reads it
MODES: dict[str, type] = {"coordinator": CoordinatorConfig, "worker": WorkerConfig, "peer": PeerConfig,
                          "stage": StageConfig, "pipeline": PipelineConfig}


# ---------------------------------------------------------------- loading

AnyConfig = CoordinatorConfig | WorkerConfig | PeerConfig | StageConfig | PipelineConfig
C = TypeVar("C", bound=AnyConfig)
_Layers = dict[str, dict[str, tuple[Any, str]]]  # section -> key -> (value, where it came from)


def load_coordinator_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> CoordinatorConfig:
    """Load a coordinator config: defaults, then the TOML file, then ``overrides``.

    Args:
        path: TOML file, or None for defaults only.
        overrides: dotted keys (``"network.port"``) to values; None values are ignored.
            String values for non-string keys are parsed (``"7200"``, ``"true"``).

    Raises:
        ConfigError: the file is missing or malformed, or a section, key, type or value is
            not allowed; the message names the file or override and the key.
    """
    return _load(CoordinatorConfig, path, overrides)


def load_worker_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> WorkerConfig:
    """Load a worker config; as :func:`load_coordinator_config`."""
    return _load(WorkerConfig, path, overrides)


def load_peer_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PeerConfig:
    """Load a peer config; as :func:`load_coordinator_config`."""
    return _load(PeerConfig, path, overrides)


def load_stage_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> StageConfig:
    """Load a stage config; as :func:`load_coordinator_config`. ``stage.stage`` and
    ``stage.stages`` must be set (by the file, a variable or an override)."""
    return _load(StageConfig, path, overrides)


def load_pipeline_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PipelineConfig:
    """Load a pipeline trainer's config; as :func:`load_coordinator_config`."""
    return _load(PipelineConfig, path, overrides)


def load_config(
    cls: type[C], path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> C:
    """Load the config of class ``cls`` (a value of :data:`MODES`); as
    :func:`load_coordinator_config`."""
    return _load(cls, path, overrides)


def with_overrides(cfg: C, overrides: Mapping[str, Any]) -> C:
    """A copy of ``cfg`` with dotted-key ``overrides`` applied and validated."""
    layers: _Layers = {}
    for section, values in to_dict(cfg, redact_secrets=False).items():
        layers[section] = {k: (v, "config") for k, v in values.items()}
    _apply_overrides(type(cfg), layers, overrides)
    return _build(type(cfg), layers)


def overrides_from_kwargs(cfg: AnyConfig, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Turn Python keyword arguments into dotted overrides for ``cfg``'s type.

    A plain name is a key or the name of a key's flag (``--`` dropped, ``-`` as ``_``) in
    one of the sections: ``min_workers=2`` is ``training.min_workers``, and a worker's
    ``host="10.0.0.2"`` (its flag ``--host``) is ``network.coordinator_host``. A dotted name
    (``**{"network.port": 7200}``) passes through unchanged.

    Raises:
        ConfigError: a plain name matches no key, or keys in several sections.
    """
    names = _keyword_names(type(cfg))
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if "." in name:
            out[name] = value
            continue
        owners = sorted(names.get(name, ()))
        if not owners:
            known = [i.key for i in field_infos(type(cfg))]
            raise ConfigError(
                f"keyword argument {name!r} is not a config key{_did_you_mean(name, names)}; "
                f"allowed: {', '.join(known)}"
            )
        if len(owners) > 1:
            raise ConfigError(
                f"keyword argument {name!r} is a key of several sections; give one of "
                f"{', '.join(owners)} as a dotted key"
            )
        out[owners[0]] = value
    return out


def _keyword_names(cls: type) -> dict[str, set[str]]:
    """Keyword name -> the dotted keys it names: each key's own name, and its flags' names
    (not a ``--no-...`` flag's: ``no_announce=True`` would read as the opposite)."""
    names: dict[str, set[str]] = {}
    for info in field_infos(cls):
        negated = info.type is bool and info.default is True
        flags = () if negated or not info.cli else info.flags
        for name in (info.key, *(f[2:].replace("-", "_") for f in flags)):
            names.setdefault(name, set()).add(info.dotted)
    return names


def apply_kwargs(cfg: C, kwargs: Mapping[str, Any]) -> C:
    """``cfg`` with Python keyword overrides applied (:func:`overrides_from_kwargs`): what the
    ``**overrides`` of ``Coordinator(...)`` and ``Worker(...)`` do."""
    return with_overrides(cfg, overrides_from_kwargs(cfg, kwargs)) if kwargs else cfg


def to_dict(cfg: AnyConfig, *, redact_secrets: bool = True) -> dict[str, dict[str, Any]]:
    """``cfg`` as a nested plain dict ``{section: {key: value}}``, e.g. for checkpoints.

    Args:
        redact_secrets: replace a non-empty ``security.secret`` with a placeholder, so the
            dict can be written to checkpoints, logs and status pages.
    """
    out = {name: {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
           for name, section in dataclasses.asdict(cfg).items()}  # a list key as TOML's array
    if redact_secrets and out["security"]["secret"]:
        out["security"]["secret"] = _REDACTED
    return out


def resolve_secret(sec: ClientSecurityConfig, env: Mapping[str, str] = os.environ) -> bytes | None:
    """The cluster secret: ``secret``, else ``secret_file``'s content, else $SWARMTRAIN_SECRET.

    Returns:
        The secret as bytes, or None when none of the three is set.

    Raises:
        ConfigError: ``secret_file`` is set but cannot be read or is empty.
    """
    if sec.secret:
        return sec.secret.encode("utf-8")
    if sec.secret_file:
        try:
            with open(sec.secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ConfigError(
                f"security.secret_file: cannot read {sec.secret_file!r}: {e.strerror or e}"
            ) from e
        if not secret:
            raise ConfigError(f"security.secret_file: {sec.secret_file!r} is empty")
        return secret
    from_env = env.get(SECRET_ENV_VAR, "")
    return from_env.encode("utf-8") if from_env else None


def resolve_tls(sec: ClientSecurityConfig) -> TLSConfig | None:
    """The TLS files of ``sec``, or None when TLS is off (``tls_cert``, ``tls_key``, ``tls_ca`` empty).

    Raises:
        ConfigError: a file named by ``tls_cert``, ``tls_key`` or ``tls_ca`` does not exist.
    """
    from swarmtrain.transport.tls import KEYS_HELP, TLSConfig

    if not sec.tls_cert:
        return None
    for key in SecurityConfig.TLS_KEYS:
        path = getattr(sec, key)
        if not os.path.isfile(path):
            raise ConfigError(f"security.{key}: {path!r} is not a file; {KEYS_HELP}")
    return TLSConfig(cert=Path(sec.tls_cert), key=Path(sec.tls_key), ca=Path(sec.tls_ca))


def _sections(cls: type) -> dict[str, type[_Section]]:
    """Section name -> section class of a whole config class (e.g. :class:`PeerConfig`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _load(
    cls: type[C], path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None
) -> C:
    layers: _Layers = {name: {} for name in _sections(cls)}
    if path is not None:
        _apply_file(cls, layers, os.fspath(path))
    _apply_env(cls, layers, os.environ)
    _apply_overrides(cls, layers, overrides or {})
    _check_required(cls, layers)
    return _build(cls, layers)


def _check_required(cls: type, layers: _Layers) -> None:
    """Refuse a load that leaves a required key (``stage.stage``) at its Python default."""
    missing = [i for i in field_infos(cls) if i.required and i.key not in layers[i.section]]
    if missing:
        raise ConfigError(
            f"{', '.join(i.dotted for i in missing)} must be set: give "
            f"{' and '.join(i.flags[0] for i in missing)} (or set them in the config file's "
            f"[{missing[0].section}] section)")


#: ``SWARMTRAIN_<SECTION>__<KEY>=value`` sets ``[section] key`` (over the file, under flags)
ENV_PREFIX = "SWARMTRAIN_"


def _apply_env(cls: type, layers: _Layers, env: Mapping[str, str]) -> None:
    """Config keys from environment variables (containers): ``SWARMTRAIN_TRAINING__BATCH_SIZE=4``
    is ``[training] batch_size = 4``. Only names with a double underscore are config keys
    (``SWARMTRAIN_SECRET`` and the like are not); an unknown one is an error naming it."""
    sections = _sections(cls)
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        section, _, key = var[len(ENV_PREFIX):].lower().partition("__")
        where = f"environment variable {var}"
        if section not in sections:
            raise ConfigError(f"{where}: no config section {section!r}; sections are "
                              f"{', '.join(sections)} (SWARMTRAIN_<SECTION>__<KEY>)")
        _set_key(sections, layers, section, key, value, where)


def _apply_file(cls: type, layers: _Layers, path: str) -> None:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path!r} not found") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    sections = _sections(cls)
    for name, table in doc.items():
        if name not in sections:
            raise ConfigError(
                f"{path}: unknown section [{name}]{_did_you_mean(name, sections)}; "
                f"allowed sections: {', '.join(sections)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{name}] must be a table (a section), got {table!r}")
        for key, value in table.items():
            _check_key(sections[name], name, key, path)
            layers[name][key] = (value, path)


def _apply_overrides(cls: type, layers: _Layers, overrides: Mapping[str, Any]) -> None:
    sections = _sections(cls)
    for dotted, value in overrides.items():
        if value is None:
            continue
        name, _, key = dotted.partition(".")
        where = f"override {dotted!r}"
        if name not in sections or not key:
            raise ConfigError(
                f"{where}: expected 'section.key' with section one of: {', '.join(sections)}"
            )
        _set_key(sections, layers, name, key, value, where)


def _set_key(sections: dict[str, type[_Section]], layers: _Layers, section: str, key: str, value: Any,
             where: str) -> None:
    """Check that ``section.key`` exists, parse a string ``value`` for its type, and layer it
    (named ``where`` in any later error)."""
    _check_key(sections[section], section, key, where)
    expected = _field_specs(sections[section])[key][0]
    layers[section][key] = (_parse_string(value, expected), where)


def _parse_string(value: Any, expected: Any) -> Any:
    """CLI strings for non-string keys: "7200" -> 7200, "true" -> True, "a,b" -> ("a", "b")
    for a list; else unchanged."""
    if not isinstance(value, str) or expected is str:
        return value
    if expected == tuple[str, ...]:
        return tuple(part.strip() for part in value.split(",") if part.strip())
    text = value.strip().lower()
    if expected is bool:
        return {"true": True, "false": False}.get(text, value)
    try:
        return expected(text)
    except ValueError:
        return value


def _check_key(section_cls: type[_Section], name: str, key: str, where: str) -> None:
    allowed = list(_field_specs(section_cls))
    if key not in allowed:
        raise ConfigError(
            f"{where}: unknown key '{name}.{key}'{_did_you_mean(key, allowed)}; "
            f"allowed keys in [{name}]: {', '.join(allowed)}"
        )


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build(cls: type[C], layers: _Layers) -> C:
    sections = _sections(cls)
    built: dict[str, Any] = {}
    for name, section_cls in sections.items():
        values = layers.get(name, {})
        kwargs = {}
        for key, (value, where) in values.items():
            try:
                kwargs[key] = _check_value(section_cls, key, value)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        try:
            built[name] = section_cls(**kwargs)
        except ConfigError as e:
            origins = sorted({where for _, where in values.values()})
            raise ConfigError(f"{', '.join(origins) or 'defaults'}: {e}") from None
    return cls(**built)


# ---------------------------------------------------------------- the metadata, for the CLI and the docs


@dataclass(frozen=True)
class FieldInfo:
    """One key of a mode's config, as the CLI and the docs see it.

    Attributes:
        section: the TOML section (``network``).
        key: the key in it (``port``).
        section_cls: the section's class (checks a value with :meth:`check`).
        type: ``bool``, ``int``, ``float``, ``str`` or ``tuple[str, ...]``.
        default: the value when nothing sets it.
        help: what it means.
        flags: its command-line flag names (the first is the main one); a boolean that
            defaults to True has one ``--no-...`` flag that sets it False.
        cli: whether it has a flag at all.
        required: whether a load must set it.
        choices: the allowed values, or None.
    """

    section: str
    key: str
    section_cls: type
    type: Any
    default: Any
    help: str
    flags: tuple[str, ...]
    cli: bool
    required: bool
    choices: tuple[Any, ...] | None

    @property
    def dotted(self) -> str:
        """``section.key``, the override's name."""
        return f"{self.section}.{self.key}"

    @property
    def allowed(self) -> str:
        """The allowed values in words (``">= 0 and <= 65535"``, ``"'fp32', 'fp16'"``), or ""."""
        meta = _field_specs(self.section_cls)[self.key][1]
        if self.choices is not None:
            return ", ".join(repr(c) for c in self.choices)
        words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        return " and ".join(f"{words[op]} {meta[op]}" for op in ("ge", "gt", "le", "lt") if op in meta)

    def check(self, value: Any) -> Any:
        """``value`` checked (and converted) as this key's, or ConfigError."""
        return _check_value(self.section_cls, self.key, value)


def field_infos(cls: type, sections: typing.Iterable[str] | None = None) -> Iterator[FieldInfo]:
    """Every key of the config class ``cls`` (a value of :data:`MODES`), section by section,
    or of the ``sections`` named only."""
    for name, section_cls in _sections(cls).items():
        if sections is not None and name not in sections:
            continue
        for key, (typ, meta) in _field_specs(section_cls).items():
            default = next(f.default for f in dataclasses.fields(section_cls)  # type: ignore[arg-type]
                           if f.name == key)
            flags = meta.get("flags") or (f"--{key.replace('_', '-')}",)
            if typ is bool and default is True:
                flags = tuple(f"--no-{f[2:]}" for f in flags)
            choices = meta.get("choices")
            yield FieldInfo(name, key, section_cls, typ, default, meta.get("help", ""), flags,
                            meta.get("cli", True), meta.get("required", False),
                            tuple(choices) if choices is not None else None)


#: where docs/config.md's generated part starts and ends
DOC_BEGIN = "<!-- generated by swarmtrain.config.render_config_doc: edit swarmtrain/config.py, not this -->"
DOC_END = "<!-- end of the generated part -->"

_DOC_TITLES = {"coordinator": "Coordinator", "worker": "Worker", "peer": "Peer", "stage": "Stage",
               "pipeline": "Pipeline trainer"}


def config_reference() -> str:
    """The per-mode key tables of docs/config.md (its generated part)."""
    lines = []
    for mode, cls in MODES.items():
        lines += [f"## {_DOC_TITLES[mode]} (`swarmtrain {mode} --config FILE`)", ""]
        for section in _sections(cls):
            lines += [f"### [{section}]", "", "| key | type | default | allowed | flag | meaning |",
                      "|---|---|---|---|---|---|"]
            for i in field_infos(cls, [section]):
                flag = ", ".join(f"`{f}`" for f in i.flags) if i.cli else "(file or variable only)"
                lines.append(f"| `{i.key}` | {_type_name(i.type)} | `{i.default!r}` | {i.allowed} | {flag} "
                             f"| {i.help}{' (required)' if i.required else ''} |")
            lines.append("")
    return "\n".join(lines)


def render_config_doc(text: str) -> str:
    """``text`` (docs/config.md) with the part between :data:`DOC_BEGIN` and :data:`DOC_END`
    replaced by :func:`config_reference`; the human-written rest is kept.

    Raises:
        ConfigError: ``text`` lacks the two markers.
    """
    if DOC_BEGIN not in text or DOC_END not in text:
        raise ConfigError(f"docs/config.md lacks the markers {DOC_BEGIN!r} and {DOC_END!r} around its "
                          "generated part; put them back (on lines of their own)")
    head, rest = text.split(DOC_BEGIN, 1)
    tail = rest.split(DOC_END, 1)[1]
    return f"{head}{DOC_BEGIN}\n\n{config_reference()}\n{DOC_END}{tail}"
