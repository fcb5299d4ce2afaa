"""Pipeline mode: a model split into stages that pass activations and gradients along.

Pure pieces: :class:`ActivationBuffer` (inbound priority queue of :class:`WorkPacket`),
:class:`OutboundBuffer` (bounded queue drained by an async send loop, with soft/hard
overflow pressure), :class:`BufferMonitor` (sampled history, warnings, averages), the
partition of a model into layers and stages (:func:`split_layers`, :func:`plan_stages`,
:func:`build_stage`) and a stage's arithmetic (:class:`StageCompute`).

Networked pieces: :class:`StageServer` (serves one stage's layers, replicas average their
parameters), :class:`Router` (picks replicas, bans failing ones, fails over) and
:class:`PipelineTrainer` (drives micro-batches through the stages; generation).
"""

from swarmtrain.roles.stage.buffers import (
    ActivationBuffer,
    BufferClosed,
    BufferMetrics,
    Direction,
    Priority,
    WorkPacket,
)
from swarmtrain.roles.stage.compute import (
    BadInput,
    ComputeConfig,
    StageCompute,
    StageOutcome,
    UnknownMicrobatch,
)
from swarmtrain.roles.stage.monitor import BufferMonitor, BufferSample, BufferSummary
from swarmtrain.roles.stage.outbound import OfferResult, OutboundBuffer, OutboundMetrics, PressureLevel
from swarmtrain.roles.stage.partition import (
    LayerCost,
    LossFn,
    NodeSpec,
    build_stage,
    estimate_layer_costs,
    loss_fn_for,
    plan_stages,
    split_layers,
)
from swarmtrain.roles.stage.replicas import ReplicaSync
from swarmtrain.roles.stage.router import (
    MicrobatchLost,
    Replica,
    ReplicaFailed,
    Router,
    RouterConfig,
    StageUnavailable,
)
from swarmtrain.roles.stage.stage import StageServer, StageServerConfig
from swarmtrain.roles.stage.trainer import MicrobatchFailed, PipelineTrainer, TrainerConfig

__all__ = [
    "ActivationBuffer",
    "BadInput",
    "BufferClosed",
    "BufferMetrics",
    "BufferMonitor",
    "BufferSample",
    "BufferSummary",
    "ComputeConfig",
    "Direction",
    "LayerCost",
    "LossFn",
    "MicrobatchFailed",
    "MicrobatchLost",
    "NodeSpec",
    "OfferResult",
    "OutboundBuffer",
    "OutboundMetrics",
    "PipelineTrainer",
    "PressureLevel",
    "Priority",
    "Replica",
    "ReplicaFailed",
    "ReplicaSync",
    "Router",
    "RouterConfig",
    "StageCompute",
    "StageOutcome",
    "StageServer",
    "StageServerConfig",
    "StageUnavailable",
    "TrainerConfig",
    "UnknownMicrobatch",
    "WorkPacket",
    "build_stage",
    "estimate_layer_costs",
    "loss_fn_for",
    "plan_stages",
    "split_layers",
]
