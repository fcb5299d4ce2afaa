"""Inbound activation buffer of a pipeline stage: a bounded priority queue of work packets.

The compute loop of a stage must never wait on the network, so every packet that arrives
(activations going forward, gradients going backward, inference requests, gradient sync)
lands here first and the compute loop takes the most urgent one. Lower :class:`Priority`
goes first; within one priority packets leave in the order they were put (one FIFO queue
per priority). The buffer is bounded; a full buffer makes producers wait or refuses
them, and never discards an accepted packet except through :meth:`ActivationBuffer.clear`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from swarmtrain.errors import SwarmError

__all__ = [
    "ActivationBuffer",
    "BufferClosed",
    "BufferMetrics",
    "Direction",
    "Priority",
    "WorkPacket",
]

Direction = Literal["forward", "backward"]
_DIRECTIONS: tuple[str, ...] = ("forward", "backward")

# Fill thresholds as integer ratios (numerator, denominator) so that the comparisons are
# exact for every capacity: starved below 10 %, backpressured at 90 % and above.
_STARVED = (1, 10)
_BACKPRESSURED = (9, 10)


class Priority(enum.IntEnum):
    """Urgency of a work packet; lower values are taken first."""

    INFERENCE_URGENT = 0
    INFERENCE_NORMAL = 10
    TRAINING_FORWARD = 20
    TRAINING_BACKWARD = 30
    GRADIENT_SYNC = 40


class BufferClosed(SwarmError):
    """A packet was put into (or offered to) a buffer that has been closed."""


@dataclass(frozen=True, eq=False)
class WorkPacket:
    """One unit of work travelling between pipeline stages.

    Packets compare by identity (they hold tensors, which have no plain equality).

    Args:
        priority: how urgent the work is; a plain int is converted to :class:`Priority`.
        session_id: the training or inference session the packet belongs to.
        microbatch_id: index of the micro-batch within the session (>= 0).
        tensor: the activations (forward) or the tensor the backward pass runs on.
        source: node id of the sender.
        target_layer: index of the first layer that must process the packet (>= 0).
        direction: ``"forward"`` or ``"backward"``.
        grad: the gradient flowing backward; required for ``"backward"``, must be ``None``
            for ``"forward"``.
        enqueued_at: clock reading when an :class:`ActivationBuffer` accepted the packet;
            ``None`` until then. The buffer sets it on the copy it hands out.

    Raises:
        ValueError: ``direction`` is not ``"forward"``/``"backward"``, ``grad`` does not
            match the direction, ``priority`` is not a :class:`Priority` value, or an id
            is negative.
    """

    priority: Priority
    session_id: str
    microbatch_id: int
    tensor: torch.Tensor
    source: str
    target_layer: int
    direction: Direction
    grad: torch.Tensor | None = None
    enqueued_at: float | None = None

    def __post_init__(self) -> None:
        if self.direction not in _DIRECTIONS:
            raise ValueError(f"WorkPacket direction must be one of {_DIRECTIONS}, got {self.direction!r}")
        if self.direction == "backward" and self.grad is None:
            raise ValueError("a backward WorkPacket needs grad (the gradient flowing back)")
        if self.direction == "forward" and self.grad is not None:
            raise ValueError("a forward WorkPacket must not carry grad")
        if self.microbatch_id < 0 or self.target_layer < 0:
            raise ValueError(
                f"WorkPacket microbatch_id and target_layer must be >= 0, got "
                f"{self.microbatch_id} and {self.target_layer}"
            )
        # Priority(...) raises ValueError naming the bad value.
        object.__setattr__(self, "priority", Priority(self.priority))


@dataclass(frozen=True)
class BufferMetrics:
    """A snapshot of an :class:`ActivationBuffer`.

    Attributes:
        capacity: most packets the buffer holds.
        size: packets queued now.
        fill: ``size / capacity``.
        starved: fill below 10 % (the compute loop is about to run dry).
        backpressured: fill at 90 % or above (producers are about to wait or be refused).
        packets_in: packets accepted since creation.
        packets_out: packets handed out by ``get``/``get_nowait``.
        dropped: accepted packets discarded by :meth:`ActivationBuffer.clear`.
        rejected: puts refused because the buffer stayed full (``put_nowait`` on a full
            buffer, or ``put`` timing out); the caller still holds those packets.
        avg_wait_ms: mean time from put to get over the packets handed out, in ms
            (0.0 before the first one).
        count_by_priority: packets queued now, by :class:`Priority` name (every name present).
    """

    capacity: int
    size: int
    fill: float
    starved: bool
    backpressured: bool
    packets_in: int
    packets_out: int
    dropped: int
    rejected: int
    avg_wait_ms: float
    count_by_priority: dict[str, int]


class ActivationBuffer:
    """Bounded, thread-safe priority queue of inbound :class:`WorkPacket`.

    Any number of producer and consumer threads may use it. One lock guards one FIFO queue per
    priority (what is queued, by priority, is their lengths); two conditions on that lock wake
    producers (space freed) and consumers (packet added).

    Args:
        capacity: most packets held at once (>= 1).
        clock: monotonic clock in seconds used only to stamp packets and measure their wait
            (injectable for tests); blocking timeouts always use real time.

    Raises:
        ValueError: ``capacity`` is below 1.
    """

    def __init__(self, capacity: int = 100, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"ActivationBuffer capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        # one FIFO queue per priority, most urgent first: a get takes from the first that is
        # not empty, and the counts by priority are their lengths
        self._queues: dict[Priority, deque[WorkPacket]] = {p: deque() for p in sorted(Priority)}
        self._closed = False
        self._packets_in = 0
        self._packets_out = 0
        self._dropped = 0
        self._rejected = 0
        self._total_wait = 0.0

    @property
    def capacity(self) -> int:
        """Most packets held at once."""
        return self._capacity

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        with self._lock:
            return self._closed

    def __len__(self) -> int:
        with self._lock:
            return self._queued()

    def put(self, packet: WorkPacket, timeout: float | None = None) -> bool:
        """Add ``packet``, waiting for space while the buffer is full.

        Args:
            packet: the work to queue; the buffer keeps a copy stamped with ``enqueued_at``.
            timeout: most seconds to wait for space; ``None`` waits until space frees up
                or the buffer is closed.

        Returns:
            True if the packet was queued; False if the buffer was still full after
            ``timeout`` (counted as ``rejected``; the caller keeps the packet).

        Raises:
            BufferClosed: the buffer is closed, or was closed while waiting.
            ValueError: ``timeout`` is negative.
        """
        deadline = _deadline(timeout)
        with self._lock:
            while True:
                if self._closed:
                    raise BufferClosed("cannot put into a closed ActivationBuffer")
                if self._queued() < self._capacity:
                    self._push(packet)
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._rejected += 1
                    return False
                self._not_full.wait(remaining)

    def put_nowait(self, packet: WorkPacket) -> bool:
        """Add ``packet`` if there is space, without waiting.

        Returns:
            True if queued; False if the buffer is full (counted as ``rejected``).

        Raises:
            BufferClosed: the buffer is closed.
        """
        return self.put(packet, timeout=0.0)

    def get(self, timeout: float | None = None) -> WorkPacket | None:
        """Take the most urgent packet, waiting while the buffer is empty.

        After :meth:`close`, packets still queued are handed out; then ``None``.

        Args:
            timeout: most seconds to wait for a packet; ``None`` waits until one arrives
                or the buffer is closed.

        Returns:
            The packet (with ``enqueued_at`` set), or None on timeout or once a closed
            buffer is empty.

        Raises:
            ValueError: ``timeout`` is negative.
        """
        deadline = _deadline(timeout)
        with self._lock:
            while not self._queued():
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._not_empty.wait(remaining)
            return self._pop()

    def get_nowait(self) -> WorkPacket | None:
        """Take the most urgent packet, or return None at once if there is none."""
        return self.get(timeout=0.0)

    def peek(self) -> WorkPacket | None:
        """The packet :meth:`get` would return next, left in the buffer; None if empty."""
        with self._lock:
            return next((q[0] for q in self._queues.values() if q), None)

    def clear(self) -> int:
        """Discard every queued packet (counted as ``dropped``) and wake waiting producers.

        Returns:
            How many packets were discarded.
        """
        with self._lock:
            removed = self._queued()
            for q in self._queues.values():
                q.clear()
            self._dropped += removed
            self._not_full.notify_all()
            return removed

    def close(self) -> None:
        """Refuse further puts and wake every waiter.

        Waiting producers raise :class:`BufferClosed`; consumers drain what is left and then
        get None. Closing twice is harmless.
        """
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()

    def metrics(self) -> BufferMetrics:
        """A consistent snapshot of size, fill state and counters."""
        with self._lock:
            size = self._queued()
            out = self._packets_out
            return BufferMetrics(
                capacity=self._capacity,
                size=size,
                fill=size / self._capacity,
                starved=size * _STARVED[1] < self._capacity * _STARVED[0],
                backpressured=size * _BACKPRESSURED[1] >= self._capacity * _BACKPRESSURED[0],
                packets_in=self._packets_in,
                packets_out=out,
                dropped=self._dropped,
                rejected=self._rejected,
                avg_wait_ms=self._total_wait / out * 1000.0 if out else 0.0,
                count_by_priority={p.name: len(q) for p, q in self._queues.items()},
            )

    # The helpers below run with self._lock held.

    def _queued(self) -> int:
        """Packets queued now: every accepted one that was neither handed out nor cleared (the
        counters are kept anyway, and reading them is cheaper than summing the queues' lengths
        on every put and get)."""
        return self._packets_in - self._packets_out - self._dropped

    def _push(self, packet: WorkPacket) -> None:
        self._queues[packet.priority].append(replace(packet, enqueued_at=self._clock()))
        self._packets_in += 1
        self._not_empty.notify()

    def _pop(self) -> WorkPacket:
        """The head of the most urgent queue that is not empty (the caller saw one)."""
        for queue in self._queues.values():
            if queue:
                packet = queue.popleft()
                break
        else:
            raise AssertionError("_pop on an empty ActivationBuffer")
        self._packets_out += 1
        assert packet.enqueued_at is not None  # stamped by _push
        self._total_wait += self._clock() - packet.enqueued_at
        self._not_full.notify()
        return packet


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return time.monotonic() + timeout
