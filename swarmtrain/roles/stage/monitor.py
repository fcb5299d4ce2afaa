"""Periodic sampling of pipeline buffers: history, warnings and averages.

A :class:`BufferMonitor` reads the metrics of named inbound and outbound buffers every few
seconds, keeps a bounded history (an hour by default), logs a warning when a buffer
becomes starved or starts overflowing (once per change, not once per sample), and
summarises the history as averages.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from swarmtrain.errors import SwarmTimeout
from swarmtrain.roles.stage.buffers import ActivationBuffer
from swarmtrain.roles.stage.outbound import OutboundBuffer, PressureLevel

__all__ = ["BufferMonitor", "BufferSample", "BufferSummary"]

log = logging.getLogger("swarmtrain.roles.stage")


@dataclass(frozen=True)
class BufferSample:
    """One reading of one buffer.

    Attributes:
        at: clock reading when sampled (seconds).
        size: packets held.
        capacity: most packets the buffer holds.
        fill: ``size / capacity``.
        starved: an inbound buffer below 10 % fill (always False for an outbound buffer,
            where empty is the healthy state).
        backpressured: an inbound buffer at 90 % fill or above, or an outbound buffer in
            soft or hard overflow.
    """

    at: float
    size: int
    capacity: int
    fill: float
    starved: bool
    backpressured: bool


@dataclass(frozen=True)
class BufferSummary:
    """Averages over a buffer's sample history.

    Attributes:
        samples: how many samples the history holds.
        mean_fill: mean of the sampled fills (0.0 without samples).
        starved_fraction: fraction of samples that were starved.
        backpressured_fraction: fraction of samples that were backpressured.
        max_size: largest sampled size.
    """

    samples: int
    mean_fill: float
    starved_fraction: float
    backpressured_fraction: float
    max_size: int


class BufferMonitor:
    """Samples named buffers in a daemon thread, or on explicit :meth:`sample` calls.

    Args:
        buffers: the buffers to watch, by name.
        interval: seconds between samples of the thread started by :meth:`start` (> 0).
        history_seconds: how far back the history reaches; it keeps
            ``ceil(history_seconds / interval)`` samples per buffer (>= ``interval``).
        clock: clock in seconds used to stamp samples (injectable for tests).

    Raises:
        ValueError: no buffers, or ``interval`` / ``history_seconds`` out of range.
    """

    def __init__(
        self,
        buffers: Mapping[str, ActivationBuffer | OutboundBuffer],
        interval: float = 5.0,
        history_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not buffers:
            raise ValueError("BufferMonitor needs at least one buffer to watch")
        if interval <= 0:
            raise ValueError(f"BufferMonitor interval must be > 0 seconds, got {interval}")
        if history_seconds < interval:
            raise ValueError(
                f"BufferMonitor history_seconds must be >= interval ({interval}), got {history_seconds}"
            )
        self._buffers = dict(buffers)
        self._interval = interval
        self._clock = clock
        self._max_samples = math.ceil(history_seconds / interval)
        self._lock = threading.Lock()
        self._history: dict[str, deque[BufferSample]] = {
            name: deque(maxlen=self._max_samples) for name in self._buffers
        }
        # Last alert state per buffer, so a warning is logged only when the state changes.
        #: (buffer, "starved" | "overflowing") -> whether the last sample was in that state
        self._was: dict[tuple[str, str], bool] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def max_samples(self) -> int:
        """How many samples the history keeps per buffer."""
        return self._max_samples

    def sample(self) -> dict[str, BufferSample]:
        """Read every buffer once, append to the history and log state changes.

        Returns:
            The new sample of each buffer, by name.
        """
        now = self._clock()
        taken = {name: _sample_of(buffer, now) for name, buffer in self._buffers.items()}
        with self._lock:
            for name, s in taken.items():
                self._history[name].append(s)
                self._note_change(name, s)
        return taken

    def history(self, name: str) -> list[BufferSample]:
        """The samples kept for buffer ``name``, oldest first.

        Raises:
            KeyError: no buffer of that name is watched.
        """
        with self._lock:
            if name not in self._history:
                raise KeyError(f"no buffer named {name!r} is monitored; known: {sorted(self._history)}")
            return list(self._history[name])

    def summary(self) -> dict[str, BufferSummary]:
        """Averages over each buffer's history, by name."""
        with self._lock:
            return {name: _summarise(h) for name, h in self._history.items()}

    def start(self) -> None:
        """Sample now and then every ``interval`` seconds in a daemon thread.

        Raises:
            RuntimeError: the monitor is already running.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("BufferMonitor is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="buffer-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the sampling thread and wait for it; harmless when not running.

        Raises:
            SwarmTimeout: the thread did not end within ``timeout`` seconds.
        """
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            raise SwarmTimeout("buffer monitor stop", timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # keep monitoring; the traceback is logged
                log.exception("buffer monitor: sampling failed")
            if self._stop.wait(self._interval):
                return

    def _note_change(self, name: str, s: BufferSample) -> None:
        """Log each transition into (warning) and out of (info) starvation and overflow."""
        for state, now in (("starved", s.starved), ("overflowing", s.backpressured)):
            if now == self._was.get((name, state), False):
                continue
            self._was[name, state] = now
            if now:
                log.warning("buffer %r is %s: %d/%d packets (%.0f%%)", name, state, s.size, s.capacity,
                            100 * s.fill)
            else:
                log.info("buffer %r is no longer %s: %d/%d packets", name, state, s.size, s.capacity)


def _sample_of(buffer: ActivationBuffer | OutboundBuffer, now: float) -> BufferSample:
    if isinstance(buffer, ActivationBuffer):
        m = buffer.metrics()
        starved, backpressured = m.starved, m.backpressured
        size, capacity, fill = m.size, m.capacity, m.fill
    else:
        o = buffer.metrics()
        starved, backpressured = False, o.pressure is not PressureLevel.OK
        size, capacity, fill = o.size, o.capacity, o.fill
    return BufferSample(
        at=now, size=size, capacity=capacity, fill=fill, starved=starved, backpressured=backpressured
    )


def _summarise(history: deque[BufferSample]) -> BufferSummary:
    n = len(history)
    if n == 0:
        return BufferSummary(
            samples=0, mean_fill=0.0, starved_fraction=0.0, backpressured_fraction=0.0, max_size=0
        )
    return BufferSummary(
        samples=n,
        mean_fill=sum(s.fill for s in history) / n,
        starved_fraction=sum(s.starved for s in history) / n,
        backpressured_fraction=sum(s.backpressured for s in history) / n,
        max_size=max(s.size for s in history),
    )
