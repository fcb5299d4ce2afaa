"""A bound, shared by many connections, on the frame payloads received but not yet processed.

A coordinator serves many workers and applies their gradients one at a time. Without a bound,
every connection reads its whole gradient off the socket and waits for the apply thread with
it, so N workers mean N gradients in memory (N x 40 MB for a 10M-parameter model in fp32).
With a :class:`PayloadGate`, a connection whose next frame would take the bytes held over the
limit stops reading *before* the frame's payload (its header is read: it says how large the
payload is); the payload stays in the kernel's socket buffers and the sender's, and TCP's flow
control slows the sender down. Waiting connections are admitted in the order they asked
(FIFO: none is starved by faster ones); a payload larger than the whole limit is admitted
alone, once nothing else is held, so no frame can wait forever. Frames smaller than
``min_bytes`` (control messages, status requests, heartbeats) pass without asking.

The gate is the event loop's alone (not thread-safe): tickets are asked for by the protocol
as headers are decoded, and released by the application once it is done with the message
(:meth:`~swarmtrain.transport.connection.Connection.done_with`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PayloadGate", "Ticket", "GATE_MIN_BYTES", "AUTO_FRAMES"]

#: frames with a smaller payload are not counted: control messages, status requests and
#: heartbeats must never wait behind gradients (and they are a few bytes each)
GATE_MIN_BYTES = 64 * 1024
#: a gate without a set limit holds this many of the largest payloads it has seen: one being
#: processed while the next is received
AUTO_FRAMES = 2


@dataclass(eq=False)
class Ticket:
    """One frame's payload: admitted (``granted``) or waiting, until released."""

    nbytes: int
    on_grant: Callable[[], None] | None = None
    asked_at: float = field(default_factory=time.monotonic)
    granted: bool = False
    released: bool = False


class PayloadGate:
    """At most ``limit_bytes`` of admitted payloads held at once (one larger payload alone).

    Args:
        limit_bytes: the bound on the payload bytes admitted and not yet released; 0: twice
            (:data:`AUTO_FRAMES`) the largest payload asked for so far, which follows what the
            senders send (a 10M-parameter model's gradient is 40 MB in fp32, 4 MB in top-k).
        min_bytes: payloads below this pass without a ticket (see :data:`GATE_MIN_BYTES`).
        timeout: how long a frame may wait for admission, seconds; the connection gives up
            after that (the gate only reports it, through :meth:`timed_out`).
    """

    def __init__(self, limit_bytes: int, *, min_bytes: int = GATE_MIN_BYTES, timeout: float = 120.0) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be at least 0 (0: automatic), not {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.largest = 0  # the largest payload asked for so far
        self.min_bytes = min_bytes
        self.timeout = timeout
        self._waiting: deque[Ticket] = deque()
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.admitted = 0
        #: frames that had to wait before they were admitted (or gave up)
        self.waited = 0
        self.wait_sec_total = 0.0
        self.max_wait_sec = 0.0
        #: payloads larger than the limit, admitted alone
        self.oversize = 0
        self.timeouts = 0

    def wants_ticket(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` is counted (else it passes at once)."""
        return nbytes >= self.min_bytes

    def request(self, nbytes: int, on_grant: Callable[[], None]) -> Ticket:
        """A ticket for a payload of ``nbytes``: granted now if there is room and no one is
        waiting before it; else queued, and ``on_grant()`` is called once it is granted."""
        ticket = Ticket(nbytes, on_grant)
        self.largest = max(self.largest, nbytes)
        if not self._waiting and self._fits(nbytes):
            self._grant(ticket)
        else:
            self._waiting.append(ticket)
            self.waited += 1
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The payload is processed (or will never be): its bytes, or its place in the queue,
        are given back. Releasing twice does nothing."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.granted:
            self.held_bytes -= ticket.nbytes
        else:
            self._waiting.remove(ticket)
            self._note_wait(ticket)
        self._grant_waiting()

    def timed_out(self, ticket: Ticket) -> None:
        """A waiting ticket's connection gave up: counted, and its place in the queue given up."""
        if not ticket.granted and not ticket.released:
            self.timeouts += 1
        self.release(ticket)

    @property
    def limit(self) -> int:
        """The bound in force: ``limit_bytes``, or :data:`AUTO_FRAMES` x the largest payload."""
        return self.limit_bytes or AUTO_FRAMES * self.largest

    def _fits(self, nbytes: int) -> bool:
        return self.held_bytes + nbytes <= self.limit or self.held_bytes == 0

    def _grant(self, ticket: Ticket) -> None:
        ticket.granted = True
        self.admitted += 1
        self.held_bytes += ticket.nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        if ticket.nbytes > self.limit:
            self.oversize += 1

    def _grant_waiting(self) -> None:
        """Grant queued tickets from the head while they fit (strict FIFO: a large one at the
        head is not overtaken by smaller ones behind it)."""
        while self._waiting and self._fits(self._waiting[0].nbytes):
            ticket = self._waiting.popleft()
            self._grant(ticket)
            self._note_wait(ticket)
            if ticket.on_grant is not None:
                ticket.on_grant()

    def _note_wait(self, ticket: Ticket) -> None:
        waited = time.monotonic() - ticket.asked_at
        self.wait_sec_total += waited
        self.max_wait_sec = max(self.max_wait_sec, waited)

    def summary(self) -> dict[str, Any]:
        """The gate's counters, for a status (bytes and seconds)."""
        return {
            "limit_bytes": self.limit, "automatic": not self.limit_bytes, "held_bytes": self.held_bytes,
            "peak_held_bytes": self.peak_held_bytes, "waiting": len(self._waiting),
            "waiting_bytes": sum(t.nbytes for t in self._waiting), "admitted": self.admitted,
            "waited": self.waited, "mean_wait_sec": self.wait_sec_total / self.waited if self.waited else 0.0,
            "max_wait_sec": self.max_wait_sec, "oversize": self.oversize, "timeouts": self.timeouts,
        }
