"""Outbound buffer of a pipeline stage: a bounded queue drained by an async send loop.

The compute loop hands finished work to :meth:`OutboundBuffer.offer`, which never blocks,
and goes on computing. A send loop on the asyncio event loop passes the packets, one at a
time and in order, to the router's ``send`` coroutine, retrying failures with a doubling
delay. When the queue nears its bound the offer reports the pressure so the stage can hold
results back and keep computing locally instead of stalling (DiLoCo-style).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarmtrain.errors import SwarmTimeout
from swarmtrain.roles.stage.buffers import BufferClosed, WorkPacket

__all__ = ["OfferResult", "OutboundBuffer", "OutboundMetrics", "PressureLevel"]

log = logging.getLogger("swarmtrain.roles.stage")

class PressureLevel(enum.StrEnum):
    """How full an :class:`OutboundBuffer` is (a ``str``: statuses carry it as its value)."""

    OK = "ok"
    SOFT_OVERFLOW = "soft_overflow"  #: fill >= 90 %: hold further results back
    HARD_OVERFLOW = "hard_overflow"  #: fill >= 99 %: the buffer is (nearly) full


class OfferResult(enum.StrEnum):
    """What :meth:`OutboundBuffer.offer` did: queued at a :class:`PressureLevel`, or refused."""

    OK = "ok"
    SOFT_OVERFLOW = "soft_overflow"
    HARD_OVERFLOW = "hard_overflow"
    REFUSED = "refused"  #: the buffer was full: the caller keeps the packet


#: the offer's answer for each pressure level it queued at
_QUEUED_AT = {level: OfferResult(level.value) for level in PressureLevel}


@dataclass(frozen=True)
class OutboundMetrics:
    """A snapshot of an :class:`OutboundBuffer`.

    Attributes:
        capacity: most packets held at once (queued plus the one being sent).
        size: packets held now, including the one being sent.
        fill: ``size / capacity``.
        pressure: ``"ok"``, ``"soft_overflow"`` (fill >= 90 %) or ``"hard_overflow"``
            (fill >= 99 %).
        sent: packets the router accepted.
        failed: packets given up on after ``max_retries`` retries (handed to ``on_failed``).
        retries: send attempts after a first failure, over all packets.
        refused: offers refused because the buffer was full (the caller kept the packet).
    """

    capacity: int
    size: int
    fill: float
    pressure: PressureLevel
    sent: int
    failed: int
    retries: int
    refused: int


class OutboundBuffer:
    """Bounded queue of outbound :class:`WorkPacket` with an async send loop.

    Threading: :meth:`offer`, :meth:`pressure`, :meth:`metrics` and ``len()`` may be called
    from any thread; the queue is a deque under a :class:`threading.Lock`, and an offer
    wakes the send loop with ``loop.call_soon_threadsafe(event.set)``. :meth:`start`,
    :meth:`flush` and :meth:`close` are coroutines for the loop that runs the send loop.

    A packet stays in the buffer (and counts towards its size) until the router has
    accepted it or it has failed for good, so the fill is what is really still unsent.

    Overflow policy: a packet offered while the buffer is full is refused, counted as
    ``refused``, and stays with the caller (``offer`` returns ``"refused"``); the buffer never
    drops a packet. A packet whose send still fails after ``max_retries`` retries is counted
    as ``failed`` and handed to ``on_failed`` (e.g. for the router to send it elsewhere), or
    logged as an error when there is no callback. Packets go out strictly in order, so a
    failing packet delays the ones behind it by its retry delays.

    Args:
        send: the router's coroutine that delivers one packet; raising any exception means
            the attempt failed.
        capacity: most packets held at once (>= 1).
        max_retries: attempts after the first before giving up on a packet (>= 0).
        retry_delay: seconds before the first retry, doubling for each further one (>= 0).
        on_failed: called on the event loop with each packet given up on.

    Raises:
        ValueError: a numeric argument is out of range.
    """

    def __init__(
        self,
        send: Callable[[WorkPacket], Awaitable[None]],
        capacity: int = 50,
        max_retries: int = 3,
        retry_delay: float = 0.05,
        on_failed: Callable[[WorkPacket], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"OutboundBuffer capacity must be >= 1, got {capacity}")
        if max_retries < 0:
            raise ValueError(f"OutboundBuffer max_retries must be >= 0, got {max_retries}")
        if retry_delay < 0:
            raise ValueError(f"OutboundBuffer retry_delay must be >= 0 seconds, got {retry_delay}")
        self._send = send
        self._capacity = capacity
        self._max_retries = max_retries
        self._retry_delay = retry_delay
        self._on_failed = on_failed
        self._lock = threading.Lock()
        self._queue: deque[WorkPacket] = deque()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()  # a packet may be waiting: set on the loop only
        self._progress = asyncio.Event()  # a packet left the buffer: set on the loop only
        self._sent = 0
        self._failed = 0
        self._retries = 0
        self._refused = 0

    @property
    def capacity(self) -> int:
        """Most packets held at once."""
        return self._capacity

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def offer(self, packet: WorkPacket) -> OfferResult:
        """Queue ``packet`` for sending without waiting; callable from any thread.

        Returns:
            The pressure level after queueing (``"ok"``, ``"soft_overflow"``: hold further
            results back and keep computing locally, ``"hard_overflow"``: the buffer is
            (nearly) full), or ``"refused"`` if the buffer was full: the packet was not
            taken and the caller keeps it.

        Raises:
            BufferClosed: the buffer is closed.
        """
        with self._lock:
            if self._closed:
                raise BufferClosed("cannot offer to a closed OutboundBuffer")
            if len(self._queue) >= self._capacity:
                self._refused += 1
                return OfferResult.REFUSED
            self._queue.append(packet)
            level = _QUEUED_AT[_pressure(len(self._queue), self._capacity)]
            loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wakeup.set)
            except RuntimeError:
                # The loop is closed. After close() that is expected: the packet was queued
                # before close() took the leftovers, so it is among them.
                if not self._closed:
                    raise
        return level

    def pressure(self) -> PressureLevel:
        """Current pressure level: ``"ok"``, ``"soft_overflow"`` or ``"hard_overflow"``."""
        with self._lock:
            return _pressure(len(self._queue), self._capacity)

    def metrics(self) -> OutboundMetrics:
        """A consistent snapshot of size, pressure and counters."""
        with self._lock:
            size = len(self._queue)
            return OutboundMetrics(
                capacity=self._capacity,
                size=size,
                fill=size / self._capacity,
                pressure=_pressure(size, self._capacity),
                sent=self._sent,
                failed=self._failed,
                retries=self._retries,
                refused=self._refused,
            )

    async def start(self) -> None:
        """Start the send loop on the running event loop; packets offered earlier go first.

        Raises:
            BufferClosed: the buffer is closed.
            RuntimeError: the send loop was already started.
        """
        with self._lock:
            if self._closed:
                raise BufferClosed("cannot start a closed OutboundBuffer")
            if self._task is not None:
                raise RuntimeError("OutboundBuffer send loop already started")
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._send_loop(), name="outbound-send-loop")
        self._wakeup.set()

    async def flush(self, timeout: float) -> bool:
        """Wait until every packet has been sent or given up on.

        Args:
            timeout: most seconds to wait.

        Returns:
            True if the buffer was empty within ``timeout``, else False.

        Raises:
            ValueError: ``timeout`` is negative.
        """
        if timeout < 0:
            raise ValueError(f"flush timeout must be >= 0 seconds, got {timeout}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._progress.clear()
            if len(self) == 0:
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    await self._progress.wait()
            except TimeoutError:
                return len(self) == 0

    async def close(self, timeout: float = 5.0) -> list[WorkPacket]:
        """Refuse further offers, stop the send loop and hand back what was not sent.

        Call :meth:`flush` first to send what is queued. A send cut off by closing stays
        among the returned packets although the router may have delivered it.

        Args:
            timeout: most seconds to wait for the send loop to stop.

        Returns:
            The packets still held, oldest first (empty when closed already).

        Raises:
            SwarmTimeout: the send loop did not stop within ``timeout`` (the router's
                ``send`` ignores cancellation).
        """
        with self._lock:
            self._closed = True
            task = self._task
        if task is not None and not task.done():
            task.cancel()
            _, pending = await asyncio.wait({task}, timeout=timeout)
            if pending:
                raise SwarmTimeout("outbound close", timeout, "the send loop ignores cancellation")
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("outbound send loop had crashed", exc_info=task.exception())
        with self._lock:
            leftovers = list(self._queue)
            self._queue.clear()
        self._progress.set()
        return leftovers

    async def _send_loop(self) -> None:
        while True:
            # Clear before looking so an offer landing after the look still wakes us.
            self._wakeup.clear()
            with self._lock:
                packet = self._queue[0] if self._queue else None
            if packet is None:
                await self._wakeup.wait()
                continue
            await self._deliver(packet)
            with self._lock:
                self._queue.popleft()
            self._progress.set()

    async def _deliver(self, packet: WorkPacket) -> None:
        delay = self._retry_delay
        for attempt in range(self._max_retries + 1):
            if attempt:
                with self._lock:
                    self._retries += 1
                await asyncio.sleep(delay)
                delay *= 2
            try:
                await self._send(packet)
            except Exception as exc:  # noqa: BLE001 - the router reports any failure by raising
                log.debug(
                    "send of %s/%d failed (attempt %d of %d): %r",
                    packet.session_id,
                    packet.microbatch_id,
                    attempt + 1,
                    self._max_retries + 1,
                    exc,
                )
                continue
            with self._lock:
                self._sent += 1
            return
        with self._lock:
            self._failed += 1
        if self._on_failed is None:
            log.error(
                "gave up sending %s/%d to layer %d after %d attempts and no on_failed callback "
                "is set: the packet is lost",
                packet.session_id,
                packet.microbatch_id,
                packet.target_layer,
                self._max_retries + 1,
            )
            return
        log.warning(
            "gave up sending %s/%d after %d attempts; handing it to on_failed",
            packet.session_id,
            packet.microbatch_id,
            self._max_retries + 1,
        )
        try:
            self._on_failed(packet)
        except Exception:  # a callback bug must not stop the send loop
            log.exception("on_failed callback raised for %s/%d", packet.session_id, packet.microbatch_id)


def _pressure(size: int, capacity: int) -> PressureLevel:
    # Integer comparisons keep the 90 % / 99 % thresholds exact for every capacity.
    if size * 100 >= capacity * 99:
        return PressureLevel.HARD_OVERFLOW
    if size * 10 >= capacity * 9:
        return PressureLevel.SOFT_OVERFLOW
    return PressureLevel.OK
