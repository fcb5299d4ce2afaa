"""Pipeline mode: a model split into stages that pass activations and gradients along.

This package starts with the stage's buffers, pure and network-free:
:class:`ActivationBuffer` (inbound priority queue of :class:`WorkPacket`),
:class:`OutboundBuffer` (bounded queue drained by an async send loop, with soft/hard
overflow pressure) and :class:`BufferMonitor` (sampled history, warnings, averages).
"""

from swarmtrain.pipeline.buffers import (
    ActivationBuffer,
    BufferClosed,
    BufferMetrics,
    Direction,
    Priority,
    WorkPacket,
)
from swarmtrain.pipeline.monitor import BufferMonitor, BufferSample, BufferSummary
from swarmtrain.pipeline.outbound import OfferResult, OutboundBuffer, OutboundMetrics, PressureLevel

__all__ = [
    "ActivationBuffer",
    "BufferClosed",
    "BufferMetrics",
    "BufferMonitor",
    "BufferSample",
    "BufferSummary",
    "Direction",
    "OfferResult",
    "OutboundBuffer",
    "OutboundMetrics",
    "PressureLevel",
    "Priority",
    "WorkPacket",
]
