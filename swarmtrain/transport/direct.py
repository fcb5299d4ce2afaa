"""Blocking I/O on an established connection, from one thread, while asyncio stands aside.

A worker whose steps take a millisecond pays more for asyncio than for its messages: a frame
sent goes through a queue, a writer task and the transport; one received through the
protocol, the inbox and a reader task; and each hand-over between the event loop and the
compute thread costs a wake-up and the interpreter lock. :meth:`Connection.start_direct
<swarmtrain.transport.connection.Connection.start_direct>` lends the connection's socket to
one thread instead: that thread computes, sends with one ``sendmsg`` per frame (the tensors'
memory, not a copy) and receives with ``recv_into``, decoding on the same :class:`Decoder`
the protocol uses, so the stream carries on where asyncio left it and asyncio takes it
back where the thread stops (:meth:`Connection.end_direct
<swarmtrain.transport.connection.Connection.end_direct>`).

While the link is lent, the event loop neither reads nor writes the socket: reading is
paused and the connection's writer holds what is queued. The link keeps the connection's
rules itself: it consumes heartbeats, sends one when it has sent nothing for a heartbeat
interval, and gives up on a peer silent for the heartbeat timeout. What it decodes and the
caller does not take stays queued on the link, in order, for the connection's inbox.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmtrain.errors import ConnectionLost, RemoteProtocolError, SwarmTimeout
from swarmtrain.wire import Error, Heartbeat, Message, encode

if TYPE_CHECKING:
    from swarmtrain.transport.connection import FrameProtocol, Timeouts

__all__ = ["DirectLink", "SCRATCH_BYTES", "refusal_reply"]

#: bytes read per ``recv`` into the link's own buffer (then fed to the decoder): a small frame
#: arrives in one system call instead of one each for its preamble, header and payload; a
#: payload larger than this is received straight into the decoder's buffer instead
SCRATCH_BYTES = 256 * 1024
#: the longest one wait for the socket lasts, so that a heartbeat is sent on time
_SLICE_SEC = 0.5


def refusal_reply(exc: RemoteProtocolError) -> Error:
    """What the peer is told of its message dropped for a field out of range (the stream goes on)."""
    return Error(code=exc.code, message=str(exc), fatal=False)


class DirectLink:
    """The connection's socket, driven with blocking calls by the one thread that holds it.

    Made by :meth:`Connection.start_direct`; not thread-safe: one thread uses it, except for
    :meth:`interrupt`, which any thread may call.
    """

    def __init__(self, sock: socket.socket, proto: FrameProtocol, timeouts: Timeouts, peer: str,
                 *, pending: deque[Message], count_sent: Callable[[str, int], None]) -> None:
        self._sock = sock
        self._proto = proto
        self._decoder = proto.decoder
        self.timeouts = timeouts
        self.peer = peer
        #: decoded messages the caller has not taken yet, oldest first (end_direct queues them)
        self.pending = pending
        #: why the link failed, if it did (end_direct closes the connection with it)
        self.error: BaseException | None = None
        self._count_sent = count_sent  # the connection's counters, as its writer keeps them
        self._scratch = bytearray(SCRATCH_BYTES)
        self._last_sent = time.monotonic()
        self._interrupted = False

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        """Send ``msg`` now: one ``sendmsg`` of its segments (more if the kernel takes part).

        Raises:
            ConnectionLost: the connection failed or was interrupted.
            SwarmTimeout: the peer took nothing for ``timeouts.send`` seconds.
            LocalProtocolError: ``msg`` cannot be encoded.
        """
        self._check()
        self._count_sent(msg.TYPE.name, self._send_all([memoryview(s).cast("B") for s in encode(msg)]))
        self._last_sent = time.monotonic()

    def _send_all(self, views: list[memoryview]) -> int:
        total = sum(v.nbytes for v in views)
        left = total
        deadline = time.monotonic() + self.timeouts.send
        while left:
            self._sock.settimeout(max(0.001, min(_SLICE_SEC, deadline - time.monotonic())))
            try:
                n = self._sock.sendmsg(views[:512])  # (IOV_MAX is 1024 on Linux)
            except TimeoutError:
                self._check()
                if time.monotonic() >= deadline:
                    raise self._fail(SwarmTimeout("send", self.timeouts.send,
                                                  f"{self.peer} took none of our frame")) from None
                continue
            except OSError as exc:
                raise self._fail(ConnectionLost(f"connection to {self.peer} failed: {exc}")) from exc
            left -= n
            while n:  # drop what was sent
                if n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0
        return total

    # -- receiving -------------------------------------------------------------------------

    def recv(self, timeout: float) -> Message | None:
        """The next message (heartbeats are consumed here), waiting at most ``timeout``
        seconds (0: only what has arrived); None if none came. Meanwhile a heartbeat goes out
        whenever nothing was sent for a heartbeat interval.

        Raises:
            ConnectionLost: the peer closed the connection, or it failed or was interrupted.
            SwarmTimeout: the peer was silent for ``timeouts.heartbeat_timeout``.
            RemoteProtocolError: the peer sent a malformed frame.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.pending:
                return self.pending.popleft()
            self._check()
            now = time.monotonic()
            if now - self._last_sent >= self.timeouts.heartbeat_interval:
                self.send(Heartbeat(time=time.time(), step=0))
            silent = now - self._proto.last_received
            if silent > self.timeouts.heartbeat_timeout:
                raise self._fail(SwarmTimeout("heartbeat", self.timeouts.heartbeat_timeout,
                                              f"{self.peer} went silent"))
            wait = min(deadline - now, _SLICE_SEC,
                       self._last_sent + self.timeouts.heartbeat_interval - now,
                       self.timeouts.heartbeat_timeout - silent)
            got = self._read(max(0.0, wait))
            if not got and time.monotonic() >= deadline:
                return self.pending.popleft() if self.pending else None

    def _read(self, wait: float) -> bool:
        """One receive (waiting up to ``wait`` seconds for bytes); True if bytes came."""
        decoder = self._decoder
        try:
            target = decoder.get_buffer()
        except RemoteProtocolError as exc:
            raise self._fail(exc) from None
        into = target if target.nbytes >= SCRATCH_BYTES else memoryview(self._scratch)
        self._sock.settimeout(wait if wait > 0 else 0.0)
        try:
            n = self._sock.recv_into(into)
        except (TimeoutError, BlockingIOError):
            return False
        except OSError as exc:
            raise self._fail(ConnectionLost(f"connection to {self.peer} failed: {exc}")) from exc
        if n == 0:
            self._check()
            truncated = decoder.end_of_stream()
            raise self._fail(truncated or ConnectionLost(f"{self.peer} closed the connection"))
        self._proto.last_received = time.monotonic()
        try:
            if into is target:
                decoder.buffer_updated(n)
            else:
                decoder.feed(into[:n])
        except RemoteProtocolError as exc:
            raise self._fail(exc) from None
        self._collect()
        return True

    def _collect(self) -> None:
        proto, decoder = self._proto, self._decoder
        while (msg := decoder.next_message()) is not None:
            name = msg.TYPE.name
            proto.received_by_type[name] += 1
            proto.received_bytes_by_type[name] += decoder.bytes_received - proto._bytes_counted
            proto._bytes_counted = decoder.bytes_received
            if isinstance(msg, Heartbeat):
                proto.peer_step = msg.step
                continue
            self.pending.append(msg)
        while (refused := decoder.next_refusal()) is not None:
            # counted as the loop counts them, and answered here (the loop does not write now)
            proto.note_refusal(refused)
            self.send(refusal_reply(refused))

    # -- ending ----------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Make the thread's next or current wait fail with ConnectionLost (any thread: the
        connection is being closed)."""
        self._interrupted = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        if self._interrupted:
            raise self._fail(ConnectionLost(f"connection to {self.peer} closed locally"))

    def _fail(self, exc: BaseException) -> BaseException:
        if self.error is None:
            self.error = exc
        return exc

    def close(self) -> None:
        """Let go of the socket (the connection's own stays open)."""
        with contextlib.suppress(OSError):
            self._sock.close()
