"""The sections more than one mode reads: security, compression, logging, checkpoints,
hardware, the ops port, and the limits every server holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from swarmtrain.config.schema import _opt, _Section
from swarmtrain.core.schedule import SCHEDULES, LRSchedule
from swarmtrain.errors import ConfigError

if TYPE_CHECKING:
    from swarmtrain.transport.endpoints import ServerLimits

__all__ = ["CheckpointingConfig", "ClientSecurityConfig", "CompressionConfig", "ConsoleLoggingConfig",
           "HardwareConfig", "LRScheduleConfig", "LoggingConfig", "OpsConfig", "SecurityConfig",
           "ServerLimitsConfig"]


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
        "auto", "coordinator only: what answers carry to workers. A codec for weight deltas "
        "(none, fp16, topk, qsgd, uniform: error-compensated by the published copy), or half: the "
        "weights themselves rounded to float16 (no published copy or log; as mixed precision "
        "rounds the weights it computes with). auto = half when the uplink is fp16, uniform "
        "(deterministic) when it is topk or qsgd (Adam's updates are dense), none otherwise",
        choices=("auto", *_UPLINK_CODECS, "uniform", "half"))
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
        'run log, else the file\'s path', metavar="PATH")


@dataclass(frozen=True)
class CheckpointingConfig(_Section):
    """[checkpointing]: periodic atomic checkpoints of weights and optimizer state."""

    SECTION = "checkpointing"
    interval: int = _opt(1000, "updates between checkpoints (0 = off)", flag="--checkpoint-interval",
                         ge=0)
    directory: str = _opt("checkpoints", "where checkpoints are written", flag="--checkpoint-dir",
                          metavar="DIR")
    keep: int = _opt(3, "newest checkpoints kept on disk", flag="--keep-checkpoints", ge=1)
    export: str = _opt(
        "auto", 'where the final weights go (safetensors) when the run ends: "auto" = '
        'model.safetensors next to the run log (none without one), "" or "none" = no export, '
        'else the file\'s path', metavar="PATH")


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
class DataConfig(_Section):
    """[data]: the data set every mode reads (each mode's section says what else it takes)."""

    SECTION = "data"
    path: str = _opt("", 'JSONL file replacing the task\'s built-in data ("" = built-in)', flag="--data")


@dataclass(frozen=True)
class ServerLimitsConfig(_Section):
    """Who may hold connections to a server of this process (against floods and secret
    guessing): the keys every mode's server reads, in its ``[network]`` (``[stage]`` for a
    stage). A peer's control server and its ring listener each hold these limits."""

    SECTION = "network"
    TRAILING: ClassVar[bool] = True  # listed after the keys of the section that reuses these
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


@dataclass(frozen=True)
class LRScheduleConfig(_Section):
    """The learning-rate schedule keys of a ``[training]`` that steps an optimizer (the
    coordinator's, counted in updates up to ``max_steps``; a peer's, in rounds up to
    ``max_rounds``): :class:`~swarmtrain.core.schedule.LRSchedule`."""

    SECTION = "training"
    TRAILING: ClassVar[bool] = True
    #: the key holding the run's length, which a decaying schedule ends at
    RUN_LENGTH: ClassVar[str] = "max_steps"
    lr_schedule: str = _opt(
        "constant", "learning rate over the run, after the warm-up: 'constant', or 'cosine' / "
        "'linear' decay to min_lr_ratio x learning_rate at the run's last update (max_steps of a "
        "coordinator, max_rounds of a peer: it must be set); a function of the update number, so "
        "a resumed run continues it", choices=SCHEDULES)
    warmup_updates: int = _opt(
        0, "updates (a peer's rounds) over which the learning rate ramps linearly from "
        "learning_rate / warmup_updates up to learning_rate (0 = no warm-up)", ge=0)
    min_lr_ratio: float = _opt(
        0.0, "with a cosine or linear lr_schedule: the learning rate at the last update, as a "
        "fraction of learning_rate", ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        length = getattr(self, self.RUN_LENGTH)
        if self.lr_schedule != "constant" and length <= self.warmup_updates:
            raise ConfigError(
                f"training.lr_schedule = {self.lr_schedule!r} decays the learning rate until "
                f"training.{self.RUN_LENGTH}, which is {length}"
                + (" (run until stopped)" if not length else
                   f", not more than training.warmup_updates ({self.warmup_updates})")
                + f": set {self.RUN_LENGTH} to the run's length, or lr_schedule = 'constant'")

    def schedule(self) -> LRSchedule:
        """The learning-rate factor by update that these keys describe."""
        return LRSchedule(self.lr_schedule, getattr(self, self.RUN_LENGTH), self.warmup_updates,
                          self.min_lr_ratio)
