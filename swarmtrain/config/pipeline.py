"""Pipeline mode's configs: ``swarmtrain stage`` and ``swarmtrain pipeline``, and the
[model] both give."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarmtrain.config.schema import _opt, _Section, reused, section_values
from swarmtrain.config.sections import (
    ClientSecurityConfig,
    ConsoleLoggingConfig,
    LoggingConfig,
    OpsConfig,
    SecurityConfig,
    ServerLimitsConfig,
)
from swarmtrain.errors import ConfigError

__all__ = ["ModelConfig", "PipelineConfig", "PipelineTrainingConfig", "StageConfig", "StageLimitsConfig",
           "StageServingConfig"]


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
    TRAILING: ClassVar[bool] = True
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
    layers: str = _opt("", 'serve layers START:STOP instead of the planned range ("" = planned)',
                       metavar="START:STOP")
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(7300, "port to listen on (0 = any free port)", ge=0, le=65535)
    sync_with: tuple[str, ...] = _opt(
        (), "HOST:PORT of a replica of the same stage to average parameters with (repeatable; "
        "configure each pair on one side only)", metavar="HOST:PORT")
    sync_every: int = _opt(10, "optimizer steps between averages with sync_with", ge=0)
    learning_rate: float = _opt(0.0, "AdamW learning rate (0 = the task's default)",
                                flag=("--lr", "--learning-rate"), ge=0.0)
    threads: int = _opt(0, "PyTorch threads (0 = all cores)", ge=0)
    kv_cache_mb: float = _opt(256.0, "MiB of generation sessions' attention caches kept at most", gt=0.0)
    device: str = _opt("auto", "where this stage's layers compute: 'auto' (CUDA, else MPS, else CPU), "
                       "'cpu', 'cuda' (or 'cuda:N') or 'mps'", choices=_DEVICES,
                       pattern=("cuda:[0-9]+", "cuda:N"))
    status_file: str = _opt("", 'keep this stage\'s status as JSON here, rewritten every second ("" = none)')
    checkpoint_dir: str = _opt(
        "", 'where this stage\'s checkpoints (weights, optimizer state, step counters) go ("" = '
        'checkpoints/stage{I} in the working directory; none = no checkpoints)', metavar="DIR")
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
        "(restarted with --resume, say) before giving up", metavar="SECONDS", ge=0.0)
    status_file: str = _opt("", 'keep the trainer\'s status (loss history, acknowledgements, resends) '
                            'as JSON here ("" = none)')
    route: str = _opt(
        "", "the stage servers: HOST:PORT of each replica, ',' between replicas of one stage, ';' "
        'between stages, e.g. "10.0.0.2:7300;10.0.0.3:7300,10.0.0.4:7300;10.0.0.5:7300" ("" = the '
        "stages of cluster, found on the LAN by mDNS)")
    cluster: str = reused(StageServingConfig, "cluster")
    discover_timeout: float = _opt(10.0, "without route: look for the stages this long (seconds) at "
                                   "most", metavar="SECONDS", gt=0.0)


@dataclass(frozen=True)
class PipelineConfig:
    """Everything ``swarmtrain pipeline`` is configured with."""

    pipeline: PipelineTrainingConfig = field(default_factory=PipelineTrainingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    security: ClientSecurityConfig = field(default_factory=ClientSecurityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
