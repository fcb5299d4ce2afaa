"""One framed, authenticated TCP connection on asyncio.

Reads go through :class:`FrameProtocol`, an ``asyncio.BufferedProtocol`` that lets the
kernel write straight into the decoder's buffers, so a tensor payload lands in the very
bytearray its tensors are built over (no copy per read). A connection given a
:class:`~swarmtrain.transport.payload_gate.PayloadGate` stops reading before a large payload
until the gate has room for it (the bytes wait in the kernel). Writes go through a bounded
send queue drained by one writer task that honours the transport's flow control, and large
tensors go out in slices: asyncio copies whatever the kernel does not take at once into the
transport's own buffer, so a whole answer written at once would be copied per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from swarmtrain.errors import ConnectionLost, ProtocolError, RemoteProtocolError, SwarmTimeout
from swarmtrain.transport.direct import DirectLink, refusal_reply
from swarmtrain.transport.payload_gate import PayloadGate, Ticket
from swarmtrain.wire import Decoder, Error, Heartbeat, Limits, Message, encode
from swarmtrain.wire.frame import DecoderState

__all__ = ["Timeouts", "Connection", "FrameProtocol"]

log = logging.getLogger("swarmtrain.transport")


@dataclass(frozen=True)
class Timeouts:
    """Named time limits (seconds) for each phase of a connection's life."""

    connect: float = 10.0
    handshake: float = 10.0
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 10.0
    send: float = 60.0


class _Closed:
    pass


_CLOSED = _Closed()
#: frame segments smaller than this are gathered into one write (one system call)
_GATHER_BYTES = 64 * 1024
#: large segments are handed to the transport this much at a time, each once the previous
#: has drained below the transport's low-water mark: at most about this much of an answer is
#: ever copied into the transport's buffer per connection (asyncio copies what the kernel does
#: not take at once), instead of the whole answer (40 MB for a 10M-parameter model in fp32)
_WRITE_SLICE_BYTES = 256 * 1024
#: a message with at most this many bytes of tensors is written at once by ``send`` when
#: nothing is ahead of it (:meth:`Connection._write_now`); larger ones go through the writer,
#: which writes them in slices as the socket drains
_WRITE_NOW_BYTES = _WRITE_SLICE_BYTES


def _gathered(segments: list[bytes | memoryview]) -> Iterator[tuple[Any, bool]]:
    """A frame's segments as the writes to make, each with whether it is a large tensor (a
    byte view of its own memory): smaller segments are gathered into one bytes object, since
    a frame of a small model has a dozen of them and each write is a system call."""
    pending = bytearray()
    for seg in segments:
        if (len(seg) if isinstance(seg, bytes) else seg.nbytes) >= _GATHER_BYTES:
            if pending:
                yield pending, False
                pending = bytearray()
            yield memoryview(seg).cast("B"), True
        else:
            pending += seg
    if pending:
        yield pending, False


class FrameProtocol(asyncio.BufferedProtocol):
    """Feeds received bytes to a :class:`Decoder` and queues complete messages."""

    def __init__(self, limits: Limits, max_pending: int = 64) -> None:
        self.decoder = Decoder(limits)
        self.transport: asyncio.Transport | None = None
        self.inbox: asyncio.Queue[Message | _Closed] = asyncio.Queue()
        self.max_pending = max_pending
        self.close_reason: BaseException | None = None
        self.closed = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        #: why reading is paused: "inbox" (the application is behind), "admission" (the
        #: payload gate has no room for the frame whose header was just read)
        self._paused_by: set[str] = set()
        self.last_received = time.monotonic()
        self.protocol_error: RemoteProtocolError | None = None
        self.received_by_type: Counter[str] = Counter()
        #: bytes of the frames received, by message type (each frame counted once decoded)
        self.received_bytes_by_type: Counter[str] = Counter()
        self._bytes_counted = 0  # decoder.bytes_received already attributed to a message
        self.peer_step = 0
        #: messages dropped for a field out of range, by code
        self.refused_messages: Counter[str] = Counter()
        #: also told each refused message's code (see :meth:`Connection.count_refusals_with`)
        self.on_refused: Callable[[str], None] | None = None
        self._refusals = 0
        #: bounds the payloads held (see :meth:`Connection.admit_payloads`); None: unbounded
        self.gate: PayloadGate | None = None
        self._frame_ticket: Ticket | None = None  # the frame in progress's, admitted or waiting
        self._admission_timer: asyncio.TimerHandle | None = None
        #: admitted messages the application has not said it is done with, by id (the message
        #: is kept with its ticket, so an id cannot be reused while the ticket is held)
        self.held: dict[int, tuple[Message, Ticket]] = {}
        #: a frame is being written in slices: nothing else may write to the transport now
        self.writing_frame = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self.decoder.get_buffer(sizehint)
        except RemoteProtocolError:
            return memoryview(bytearray(4096))  # already failing; drain into scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = time.monotonic()
        if self.protocol_error is not None:
            return
        try:
            self.decoder.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self.protocol_error = exc
            self._refuse(exc)
            return
        while (msg := self.decoder.next_message()) is not None:
            # get_buffer() hands out at most the rest of one frame: this message is the frame
            # the ticket was asked for, if any
            ticket, self._frame_ticket = self._frame_ticket, None
            self.received_by_type[msg.TYPE.name] += 1
            # get_buffer() hands out at most the rest of one frame, so these bytes are this one's
            self.received_bytes_by_type[msg.TYPE.name] += self.decoder.bytes_received - self._bytes_counted
            self._bytes_counted = self.decoder.bytes_received
            if isinstance(msg, Heartbeat):
                # consumed here, not queued: heartbeats must neither wait for the application
                # to call recv() nor fill the inbox and pause reading (which would stop
                # last_received and get a live peer dropped while the application is busy)
                self.peer_step = msg.step
                self._release(ticket)
                continue
            if ticket is not None:
                self.held[id(msg)] = (msg, ticket)
            self.inbox.put_nowait(msg)
        while (refused := self.decoder.next_refusal()) is not None:
            self._refuse_message(refused)
        if self._frame_ticket is not None and self.decoder.state is not DecoderState.PAYLOAD:
            self._release(self._frame_ticket)  # its frame was dropped (refused)
            self._frame_ticket = None
        if self.inbox.qsize() >= self.max_pending:
            self._pause("inbox")
        self.wait_for_room()

    # -- admission (the payload gate) --------------------------------------------------------

    def wait_for_room(self) -> None:
        """If a frame's header is in and its payload is large, ask the gate for room before
        any payload byte is read; without room, stop reading until the gate grants it."""
        gate, n = self.gate, self.decoder.awaiting_payload
        if gate is None or not n or self._frame_ticket is not None or not gate.wants_ticket(n):
            return
        if self.protocol_error is not None or self.closed.is_set():
            return
        self._frame_ticket = ticket = gate.request(n, self._admitted)
        if not ticket.granted:
            self._pause("admission")
            loop = asyncio.get_running_loop()
            self._admission_timer = loop.call_later(gate.timeout, self._admission_timed_out)

    def _admitted(self) -> None:
        if self._admission_timer is not None:
            self._admission_timer.cancel()
            self._admission_timer = None
        self._resume("admission")

    def _admission_timed_out(self) -> None:
        """The gate had no room for this frame for its whole timeout: give up the connection
        (the peer reconnects and resends; a gradient's msg_id makes the resend idempotent)."""
        self._admission_timer = None
        ticket, self._frame_ticket = self._frame_ticket, None
        gate = self.gate
        if ticket is None or gate is None:
            return
        gate.timed_out(ticket)
        exc = SwarmTimeout("admission", gate.timeout,
                           f"{self._peer()}'s {ticket.nbytes}-byte frame found no room among the "
                           f"{gate.limit} bytes of payloads this node holds")
        log.warning("dropping %s: %s", self._peer(), exc)
        self._mark_closed(exc)
        if self.transport is not None:
            self.transport.abort()

    def _release(self, ticket: Ticket | None) -> None:
        if ticket is not None and self.gate is not None:
            self.gate.release(ticket)

    def done_with(self, msg: Message) -> None:
        """The application is done with ``msg``: its payload's bytes go back to the gate."""
        held = self.held.pop(id(msg), None)
        if held is not None:
            self._release(held[1])

    def release_all(self) -> None:
        """Give back every ticket this connection holds (its handler has ended)."""
        for _, ticket in self.held.values():
            self._release(ticket)
        self.held.clear()
        if self._frame_ticket is not None:
            self._release(self._frame_ticket)
            self._frame_ticket = None
        if self._admission_timer is not None:
            self._admission_timer.cancel()
            self._admission_timer = None

    def _pause(self, reason: str) -> None:
        if not self._paused_by and self.transport is not None:
            self.transport.pause_reading()
        self._paused_by.add(reason)

    def _resume(self, reason: str) -> None:
        if reason not in self._paused_by:
            return
        self._paused_by.discard(reason)
        if not self._paused_by and self.transport is not None and not self.transport.is_closing():
            self.last_received = time.monotonic()  # silence while we did not read is ours
            self.transport.resume_reading()

    def note_refusal(self, exc: RemoteProtocolError) -> None:
        """Count (and log the first few of) the sound frames whose message the decoder
        dropped for a field out of range."""
        self.refused_messages[exc.code] += 1
        if self.on_refused is not None:
            self.on_refused(exc.code)
        self._refusals += 1
        if self._refusals <= 3:  # a flood of them is counted, not logged line by line
            log.warning("refused a message from %s: %s", self._peer(), exc)

    def _refuse_message(self, exc: RemoteProtocolError) -> None:
        """:meth:`note_refusal`, and tell the peer (non-fatal: the stream goes on) while its
        replies do not pile up."""
        self.note_refusal(exc)
        if (self.transport is not None and not self.transport.is_closing() and self.can_write
                and not self.writing_frame and self.transport.get_write_buffer_size() < _GATHER_BYTES):
            with contextlib.suppress(Exception):
                self.transport.write(b"".join(encode(refusal_reply(exc))))

    def _peer(self) -> str:
        return peer_name(self.transport) if self.transport is not None else "?"

    def _refuse(self, exc: RemoteProtocolError) -> None:
        """Tell the peer what was wrong with its frame, then close (the stream can't resync)."""
        log.warning("closing connection: %s", exc)
        if self.transport is not None and not self.transport.is_closing():
            if not self.writing_frame:  # (else the error would land inside that frame)
                with contextlib.suppress(Exception):
                    for seg in encode(Error(code=exc.code, message=str(exc), fatal=True)):
                        self.transport.write(seg)
            self.transport.close()
        self._mark_closed(exc)

    def resume_if_drained(self) -> None:
        if self.inbox.qsize() < self.max_pending // 2:
            self._resume("inbox")

    @property
    def reading_paused(self) -> bool:
        """True while reading is paused: the application has not consumed messages, or the
        payload gate has no room for the next frame (either way the peer is not silent)."""
        return bool(self._paused_by)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        # a frame whose payload we chose not to read yet (no room in the gate): the peer hung
        # up while we held it back, which says nothing bad about its stream
        held_back = self._frame_ticket is not None and not self._frame_ticket.granted
        if self._frame_ticket is not None:  # a frame that will never be complete
            self._release(self._frame_ticket)
            self._frame_ticket = None
        if self._admission_timer is not None:
            self._admission_timer.cancel()
            self._admission_timer = None
        truncated = None
        if self.protocol_error is None and not self.closed.is_set():  # not closed by us
            truncated = self.decoder.end_of_stream()
        if truncated is not None:
            log.log(logging.INFO if held_back else logging.WARNING, "connection closed mid-frame%s: %s",
                    " (its payload waited for room)" if held_back else "", truncated)
            self.protocol_error = truncated
        self._mark_closed(truncated or exc or ConnectionLost("connection closed by peer"))

    def _mark_closed(self, exc: BaseException) -> None:
        if not self.closed.is_set():
            self.close_reason = exc
            self.closed.set()
            self.inbox.put_nowait(_CLOSED)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    @property
    def can_write(self) -> bool:
        """False while the transport's write buffer is over its high-water mark (flow
        control); True again once it drains, or once the connection is lost."""
        return self._can_write.is_set()

    async def writable(self) -> None:
        """Wait until :attr:`can_write` (returns at once if it already is); the caller's
        timeout, if any, bounds the wait."""
        await self._can_write.wait()


class Connection:
    """An established connection: ``send``/``recv`` messages, heartbeats, clean close.

    Heartbeats are handled here: they refresh the peer's last-seen time and are never
    returned by :meth:`recv`. A peer silent for ``timeouts.heartbeat_timeout`` is dropped.
    """

    def __init__(
        self,
        protocol: FrameProtocol,
        timeouts: Timeouts,
        *,
        send_queue_size: int = 64,
        limits: Limits | None = None,
    ) -> None:
        if protocol.transport is None:
            raise ConnectionLost("transport not connected")
        self._proto = protocol
        self.transport = protocol.transport
        self.timeouts = timeouts
        self.limits = limits or protocol.decoder.limits
        self.peer = peer_name(self.transport)
        self._outbox: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=send_queue_size)
        self._tasks: list[asyncio.Task[Any]] = [asyncio.create_task(self._writer())]
        self.bytes_sent = 0
        self.sent_by_type: Counter[str] = Counter()
        self.sent_bytes_by_type: Counter[str] = Counter()
        self.received_by_type = protocol.received_by_type  # counted as frames are decoded
        self.received_bytes_by_type = protocol.received_bytes_by_type
        self.session = ""
        #: the other side's node id, verified: the peer id of the identity key it proved in
        #: the handshake (AUTH's signature); empty if it proved none
        self.node = ""
        #: set while no thread holds the socket (:meth:`start_direct`): the writer waits on it
        self._undirected = asyncio.Event()
        self._undirected.set()
        self._direct: DirectLink | None = None
        self._writing = False  # the writer is handing a frame to the transport

    # -- sending ---------------------------------------------------------------------------

    async def send(self, msg: Message, timeout: float | None = None) -> None:
        """Queue ``msg`` for sending; waits while the send queue is full.

        Raises:
            ConnectionLost: the connection is closed.
            SwarmTimeout: the queue stayed full for ``timeout`` (default ``timeouts.send``).
        """
        self._check_open()
        if self._write_now(msg):
            return
        limit = self.timeouts.send if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await self._outbox.put(msg)
        except TimeoutError:
            raise SwarmTimeout("send", limit, f"send queue to {self.peer} stayed full") from None

    def _write_now(self, msg: Message) -> bool:
        """Hand a small ``msg`` (up to :data:`_WRITE_NOW_BYTES` of tensors) to the transport
        here and now when nothing is ahead of it: nothing queued, nothing being written or
        buffered, no thread holding the socket, the transport under its high-water mark. That
        is one write where the writer task costs a turn of the event loop per message (an
        answer to each of a quick worker's gradients). True if it was written (or could not
        be encoded: the connection is then aborted, as the writer does)."""
        if (not self._outbox.empty() or self._writing or not self._undirected.is_set()
                or not self._proto.can_write or self.transport.is_closing()
                or self.transport.get_write_buffer_size()
                or sum(t.nbytes for t in msg.tensor_map().values()) > _WRITE_NOW_BYTES):
            return False
        try:
            segments = encode(msg, self.limits)
        except ProtocolError as exc:
            log.error("cannot send to %s: %s", self.peer, exc)
            self.abort(exc)
            return True
        size = 0
        for chunk, _ in _gathered(segments):  # (what the socket does not take, the transport copies)
            self.transport.write(chunk)
            size += chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
        self._count_sent(msg.TYPE.name, size)
        return True

    async def _writer(self) -> None:
        try:
            while True:
                msg = await self._outbox.get()
                if msg is None or self.transport.is_closing():
                    return
                await self._undirected.wait()  # (a thread holds the socket: after it)
                await self._proto.writable()
                if self.transport.is_closing():
                    return
                self._writing = True
                try:
                    size = await self._write_frame(encode(msg, self.limits))
                finally:
                    self._writing = False
                self._count_sent(msg.TYPE.name, size)
        except ProtocolError as exc:
            log.error("cannot send to %s: %s", self.peer, exc)
            self.abort(exc)

    def _count_sent(self, kind: str, size: int) -> None:
        self.bytes_sent += size
        self.sent_by_type[kind] += 1
        self.sent_bytes_by_type[kind] += size

    async def _write_frame(self, segments: list[bytes | memoryview]) -> int:
        """Hand a frame's segments to the transport; returns its size. Small segments (the
        preamble, the header, small tensors) are gathered into one write (:func:`_gathered`).
        Large tensors are written from their own memory in slices of :data:`_WRITE_SLICE_BYTES`,
        each once the transport has room (so what asyncio copies into its buffer stays that small)."""
        size = 0
        for chunk, large in _gathered(segments):
            if large:
                await self._write_sliced(chunk)
                size += chunk.nbytes
            else:
                self.transport.write(chunk)
                size += len(chunk)
        return size

    async def _write_sliced(self, view: memoryview) -> None:
        self._proto.writing_frame = True
        try:
            for start in range(0, view.nbytes, _WRITE_SLICE_BYTES):
                await self._proto.writable()  # returns at once while the transport has room
                if self.transport.is_closing():
                    return
                self.transport.write(view[start:start + _WRITE_SLICE_BYTES])
        finally:
            self._proto.writing_frame = False

    # -- receiving -------------------------------------------------------------------------

    async def recv(self, timeout: float | None = None, phase: str = "recv") -> Message:
        """The next message from the peer (heartbeats never arrive here: the protocol
        consumes them as they are decoded).

        Raises:
            ConnectionLost: the connection closed (the reason is chained).
            RemoteProtocolError: the peer sent a malformed frame (the connection is closed).
            SwarmTimeout: nothing arrived within ``timeout`` (named ``phase``).
        """
        try:
            async with asyncio.timeout(timeout):
                item = await self._proto.inbox.get()
        except TimeoutError:
            raise SwarmTimeout(phase, timeout or 0.0, f"waiting for {self.peer}") from None
        self._proto.resume_if_drained()
        if isinstance(item, _Closed):
            self._proto.inbox.put_nowait(item)  # every later recv sees the close too
            raise self._closed_error()
        return item

    def _closed_error(self) -> Exception:
        reason = self._proto.close_reason
        if isinstance(reason, (RemoteProtocolError, SwarmTimeout)):
            return reason
        err = ConnectionLost(f"connection to {self.peer} closed" + (f": {reason}" if reason else ""))
        err.__cause__ = reason
        return err

    def _check_open(self) -> None:
        if self._proto.closed.is_set() or self.transport.is_closing():
            raise self._closed_error()

    # -- lending the socket to a thread (transport/direct.py) -------------------------------

    async def start_direct(self, timeout: float = 5.0) -> DirectLink | None:
        """Lend the socket to one thread: a :class:`~swarmtrain.transport.direct.DirectLink`
        to send and receive on with blocking calls, until :meth:`end_direct`. The messages
        already received and not yet taken by :meth:`recv` move to the link first, in order.

        Only a plain TCP connection is lent (TLS state lives in asyncio's transport), one with
        no payload gate, open and sound, once what is queued for sending has gone out (at most
        ``timeout`` seconds); None otherwise, and nothing changed.
        """
        proto = self._proto
        if (self._direct is not None or proto.gate is not None or proto.protocol_error is not None
                or self.transport.get_extra_info("sslcontext") is not None):
            return None
        raw = self.transport.get_extra_info("socket")
        if raw is None:
            return None
        deadline = time.monotonic() + timeout
        while not (self._outbox.empty() and not self._writing
                   and self.transport.get_write_buffer_size() == 0):
            if self.is_closed or time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.001)
        if self.is_closed or self.transport.is_closing():
            return None
        try:
            sock = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
        except OSError:
            return None
        # (open, so the inbox holds messages only: the close marker comes with closing)
        pending: deque[Message] = deque(cast(Message, proto.inbox.get_nowait())
                                        for _ in range(proto.inbox.qsize()))
        self._undirected.clear()
        proto._pause("direct")
        self._direct = DirectLink(sock, proto, self.timeouts, self.peer, pending=pending,
                                  count_sent=self._count_sent)
        return self._direct

    def end_direct(self, link: DirectLink) -> None:
        """Take the socket back from ``link`` (on the event loop, once its thread is done with
        it): what the link decoded and nobody took goes to the inbox, in order; a link that
        failed closes the connection with its error; otherwise reading and writing resume."""
        if link is not self._direct:
            return
        self._direct = None
        link.close()
        proto = self._proto
        for msg in link.pending:
            proto.inbox.put_nowait(msg)
        link.pending.clear()
        error = link.error
        if isinstance(error, RemoteProtocolError):
            proto.protocol_error = error
            proto._refuse(error)
        elif error is not None:
            self.abort(error)
        self._undirected.set()
        if not self.is_closed:
            proto._resume("direct")

    @property
    def direct(self) -> DirectLink | None:
        """The link the socket is lent to, if it is (:meth:`start_direct`)."""
        return self._direct

    # -- liveness --------------------------------------------------------------------------

    def start_heartbeats(self, step_fn: Any = None) -> None:
        """Send a heartbeat every interval and drop the peer after ``heartbeat_timeout`` silence."""
        self._tasks.append(asyncio.create_task(self._heartbeat(step_fn)))

    async def _heartbeat(self, step_fn: Any) -> None:
        interval, limit = self.timeouts.heartbeat_interval, self.timeouts.heartbeat_timeout
        while not self._proto.closed.is_set():
            # while reading is paused (the application is behind), the peer's bytes wait in
            # the kernel: that silence says nothing about the peer
            paused = self._proto.reading_paused
            silent = 0.0 if paused else time.monotonic() - self._proto.last_received
            if silent > limit:
                log.warning("no word from %s for %.1f s: dropping it", self.peer, silent)
                self.abort(SwarmTimeout("heartbeat", limit, f"{self.peer} went silent"))
                return
            if self._outbox.qsize() < self._outbox.maxsize:
                self._outbox.put_nowait(Heartbeat(time=time.time(), step=step_fn() if step_fn else 0))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(interval, limit / 2)):
                    await self._proto.closed.wait()

    @property
    def last_received(self) -> float:
        """time.monotonic() of the last bytes received from the peer."""
        return self._proto.last_received

    @property
    def peer_step(self) -> int:
        """The training step the peer reported in its last heartbeat."""
        return self._proto.peer_step

    @property
    def close_reason(self) -> BaseException | None:
        """Why the connection closed (None while open)."""
        return self._proto.close_reason

    def count_refusals_with(self, count: Callable[[str], None]) -> None:
        """Call ``count(code)`` for each message of the peer refused from now on, and for those
        refused so far (a role counts them with its others, e.g. ``RefusalCounter.count``)."""
        for code, n in self._proto.refused_messages.items():
            for _ in range(n):
                count(code)
        self._proto.on_refused = count

    def admit_payloads(self, gate: PayloadGate) -> None:
        """Bound the payloads received from now on by ``gate`` (shared with other connections):
        a large frame is read only once the gate has room for it. The application then calls
        :meth:`done_with` for every message it received once it is done with it (or
        :meth:`release_all` when it stops serving the connection), or the gate fills up."""
        self._proto.gate = gate
        self._proto.wait_for_room()

    def done_with(self, msg: Message) -> None:
        """Done with ``msg`` (a received message): its payload's room goes back to the gate
        (no-op for a message the gate did not count)."""
        self._proto.done_with(msg)

    def release_all(self) -> None:
        """Give back the gate's room for every message of this connection still held, and
        for a frame waiting or in progress (call when the connection's handler ends)."""
        self._proto.release_all()

    def set_inbound_limits(self, limits: Limits) -> None:
        """Bound the frames received from now on (raised once the handshake has succeeded)."""
        self._proto.decoder.limits = limits

    @property
    def is_closed(self) -> bool:
        return self._proto.closed.is_set()

    async def wait_closed(self) -> None:
        await self._proto.closed.wait()

    # -- closing ---------------------------------------------------------------------------

    async def close(self, error: Error | None = None, timeout: float = 5.0) -> None:
        """Send ``error`` (if given) and what is queued, then close."""
        if not self.is_closed:
            with contextlib.suppress(Exception):
                if error is not None:
                    self._outbox.put_nowait(error)
                self._outbox.put_nowait(None)
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._tasks[0])
        self.transport.close()
        self._proto._mark_closed(ConnectionLost("closed locally"))
        await self._cancel_tasks()

    def abort(self, reason: BaseException) -> None:
        """Close now, discarding anything unsent (a thread holding the socket is woken)."""
        if self._direct is not None:
            self._direct.interrupt()
        self._proto._mark_closed(reason)
        self.transport.abort()
        for t in self._tasks:
            if t is not asyncio.current_task() and not t.done():
                t.cancel()
                # the loop holds tasks weakly: a dropped connection's cancelled tasks must
                # live until they have run their cancellation, or they are destroyed pending
                _CANCELLED.add(t)
                t.add_done_callback(_CANCELLED.discard)

    async def _cancel_tasks(self) -> None:
        me = asyncio.current_task()
        others = [t for t in self._tasks if t is not me]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)


#: tasks of aborted connections, kept until they finish (see :meth:`Connection.abort`)
_CANCELLED: set[asyncio.Task[Any]] = set()


def peer_name(transport: asyncio.BaseTransport) -> str:
    """``host:port`` of the other side, for messages."""
    addr = transport.get_extra_info("peername")
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
