"""Ring collectives for peer mode: all-reduce (sum, mean, weighted mean; fp32 / fp16 / int8
on the wire), broadcast and barrier among the members of one epoch.

The all-reduce is the classic chunked ring: the flat buffer is cut into ``world_size``
chunks, ``W - 1`` reduce-scatter steps leave each member owning one fully reduced chunk, and
``W - 1`` all-gather steps hand the owned chunks round. Each chunk is cut further into
segments (``segment_bytes``), and a segment is forwarded as soon as it has landed and been
added, so the links stay busy while the arithmetic runs and no step waits for a whole chunk.

One thread per member drives both links with non-blocking sockets and ``poll``: it sends
what the successor's socket takes (``sendmsg`` of the header and a memoryview of the tensor,
or of the one encoded segment: no copies), receives what has arrived (``recvmsg_into``
straight into the tensor or a preallocated scratch segment), and adds each segment as it
completes (``add_`` on views). With one thread there are no locks, no hand-offs and no GIL
contention, which matters on small machines where the members' processes already fill every
core. A member that sends nothing and takes nothing for ``timeout`` seconds fails the
collective with :class:`RingBroken` naming the phase and its rank; a closed link fails it at once.

The frames' format, their order and the checks on them are sans-IO, in
:mod:`swarmtrain.wire.ring` (the schedules, and :class:`~swarmtrain.wire.ring.FrameReader`,
which lends the buffers each received byte goes to and checks every header); the loop here
(:class:`_Pump`) only moves bytes. A group's lifecycle is one :class:`RingState` with the
transition table :data:`RING_TRANSITIONS`.

The all-reduce keeps no copy of its input and still lets a caller retry with it: with
``keep_input`` the caller's tensor is written only once every member has joined the
collective (the partial sums of the early reduce-scatter steps go to scratch reused by every
call), so a collective that breaks before then leaves every member's input exactly as it
was (:attr:`RingGroup.input_intact`). A member whose input did change takes part in the next
attempt with ``valid=False``, and every member then finds that attempt void.

With TLS the links are ``ssl.SSLSocket`` s, which have no ``sendmsg`` / ``recvmsg_into``: the
same loop sends the header and the payload view with one ``send`` each and receives with
``recv_into``, which returns at most one TLS record (16 KB) per call. Encryption costs a copy
and a pass over every byte on each side; see docs/tls.md for what that does to throughput.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from enum import Enum

import numpy as np
import torch

from swarmtrain.errors import StateError
from swarmtrain.roles.peer.links import RingBroken, RingListener, dial
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire.ring import (
    CODEC_FP32,
    HEADER,
    KIND_ALL_REDUCE,
    KIND_BARRIER,
    WIRES,
    AllReduceSchedule,
    BroadcastSchedule,
    FrameReader,
    Outgoing,
    RingDesync,
    Schedule,
    ScratchBuffers,
    all_finite,
)

__all__ = ["DEFAULT_SEGMENT_BYTES", "RING_TRANSITIONS", "RingBroken", "RingGroup", "RingListener",
           "RingState", "RingStateError"]

DEFAULT_SEGMENT_BYTES = 1 << 20
LOCAL_BUFFER_BYTES = 1 << 20  # socket buffers of a link within this host (the kernel doubles it)
# poll() reports the predecessor's link readable once this much of the frame has landed (or
# all of it, if less is left): one wake-up per frame of the default size instead of one per
# 64 KB skb. Fewer, longer turns matter when the members outnumber the cores: on 2 cores a
# whole frame per wake-up took 3-6 % less time than a quarter of one at 3 and 4 members.
_RCVLOWAT_MAX = 1 << 20


def _shallow_if_local(sock: socket.socket) -> None:
    """Socket buffers of :data:`LOCAL_BUFFER_BYTES` on a link whose two ends are on this host
    (the same address): its bytes never leave the machine, and a receiver that copies them
    out while the sender's copy is still in cache saves a trip to memory. Deep buffers keep
    cross-machine links busy; here they only let the data go cold (with 3 and 4 members on 2
    cores, 1 MB instead of 4 MB made the all-reduce 5-13 % faster). Best effort."""
    try:
        if sock.getsockname()[0] != sock.getpeername()[0]:
            return
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, LOCAL_BUFFER_BYTES)
    except OSError:
        pass


def _consume(bufs: list[memoryview], n: int) -> list[memoryview] | None:
    """Drop the first `n` bytes of the buffer list; None once everything is gone."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs.pop(0)
    if bufs and n:
        bufs[0] = bufs[0][n:]
    return bufs or None


class RingState(Enum):
    """Where a :class:`RingGroup` is in its life.

    - ``IDLE``: links up (or a group of one), no collective running;
    - ``BUSY``: a collective is running;
    - ``ABORTING``: :meth:`RingGroup.close` came during a collective: the links are shut
      down, the collective is failing (or, if it was just finishing, ends anyway);
    - ``BROKEN``: a collective failed: the links are closed, every later call fails;
    - ``CLOSED``: closed by its owner (terminal, like ``BROKEN``).
    """

    IDLE = "idle"
    BUSY = "busy"
    ABORTING = "aborting"
    BROKEN = "broken"
    CLOSED = "closed"


#: every legal move of a ring group's state (anything else is refused with RingStateError)
RING_TRANSITIONS: dict[RingState, frozenset[RingState]] = {
    RingState.IDLE: frozenset({RingState.BUSY, RingState.CLOSED}),
    RingState.BUSY: frozenset({RingState.IDLE, RingState.ABORTING, RingState.BROKEN}),
    RingState.ABORTING: frozenset({RingState.BROKEN, RingState.CLOSED}),
    RingState.BROKEN: frozenset(),
    RingState.CLOSED: frozenset(),
}

_REFUSED_BECAUSE = {
    (RingState.BUSY, RingState.BUSY):
        "another collective is running on this group (calls must be sequential)",
    (RingState.ABORTING, RingState.BUSY): "the group is being closed during a collective",
}


class RingStateError(StateError, RuntimeError):
    """A :class:`RingGroup` was asked for a move its state does not allow (e.g. a second
    collective while one runs: collectives on a group must be sequential)."""

    def __init__(self, current: RingState, target: RingState) -> None:
        why = _REFUSED_BECAUSE.get((current, target), "not a legal transition")
        super().__init__(f"ring group: cannot go from {current.name} to {target.name}: {why}")
        self.current = current
        self.target = target


class RingGroup:
    """A ring of ``len(addresses)`` members for one epoch; this member is `rank`.

    Connects to rank+1's listener and takes rank-1's connection from `listener`. Every member
    must call the same collectives in the same order with same-sized tensors; a mismatch is
    detected (every frame header is checked) and breaks the group. A failed collective breaks
    the group for good: build a new one for a new epoch. With one member, collectives are
    no-ops. One collective at a time; :meth:`close` may come from any thread (it aborts).
    :attr:`state` is a :class:`RingState`, moved only along :data:`RING_TRANSITIONS`.

    Args:
        listener: this node's ring listener (its address is ``addresses[rank]``).
        rank: this member's position in `addresses`.
        addresses: every member's ring listener address, identical on every member.
        ring_id: names the ring (e.g. the run); connections of other rings are not taken.
        epoch: membership epoch; connections for older epochs are refused.
        secret: the cluster secret (None: open cluster).
        tls: mutual TLS for the link to our successor (None: plain TCP); the link from our
            predecessor is TLS if `listener` has TLS.
        timeout: seconds forming the ring may take, and that a collective may go without
            any progress on its links before it fails.
        segment_bytes: largest pipelined frame (float32 bytes; a multiple of 4). Chunks are
            cut into about 8 segments, no smaller than 64 KB (or this), no larger than this.
    Raises:
        ValueError: bad arguments.
        RingBroken: phase ``connect``: a neighbour was unreachable, refused us or failed
            authentication (or a certificate) within `timeout`.
        ConfigError: the TLS files cannot be loaded.
    """

    def __init__(
        self, listener: RingListener, rank: int, addresses: list[tuple[str, int]], *,
        ring_id: str, epoch: int, secret: bytes | None, timeout: float = 10.0,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES, tls: TLSConfig | None = None,
    ) -> None:
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank must be in 0..{len(addresses) - 1}, got {rank}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        if not 4 <= segment_bytes <= 1 << 30 or segment_bytes % 4:
            raise ValueError(f"segment_bytes must be a multiple of 4 in 4..2**30, got {segment_bytes}")
        self.rank, self.world_size, self.epoch = rank, len(addresses), epoch
        self.timeout = timeout
        self.bytes_sent = self.bytes_received = 0
        #: after an all-reduce that raised: its tensor still holds exactly its input
        self.input_intact = True
        #: after an all-reduce: some member passed ``valid=False`` (the same on every member)
        self.result_void = False
        #: after an all-reduce with ``check_finite``: no NaN or Inf in the result (likewise)
        self.result_finite: bool | None = None
        self._segment_bytes = segment_bytes
        self._seq = 0
        self._state = RingState.IDLE
        self._broken: RingBroken | None = None  # why the group broke (state BROKEN)
        self._state_lock = threading.Lock()
        self._next, self._prev = (rank + 1) % self.world_size, (rank - 1) % self.world_size
        self._out: socket.socket | None = None
        self._in: socket.socket | None = None
        self._poll = select.poll()
        self._rcvlowat = 1  # the kernel default
        if self.world_size == 1:
            return
        self._header_buf = bytearray(HEADER.size)
        self._buffers = ScratchBuffers(segment_bytes)
        listener.open_epoch(ring_id, epoch)
        deadline = time.monotonic() + timeout
        try:
            self._out = dial(addresses[self._next], secret=secret, ring_id=ring_id, epoch=epoch,
                             from_rank=rank, peer=self._next, timeout=timeout, tls=tls)
        except RingBroken as exc:
            exc.epoch = epoch
            raise
        try:
            self._in = listener.claim(ring_id, epoch, self._prev, max(deadline - time.monotonic(), 0.001))
        except BaseException as exc:
            self._out.close()
            if isinstance(exc, RingBroken):
                exc.epoch = epoch
            raise
        self._out.setblocking(False)
        self._in.setblocking(False)
        for sock in (self._out, self._in):
            _shallow_if_local(sock)

    # --- collectives --------------------------------------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, weight: float | None = None, wire: str = "fp32",
        check_finite: bool = False, valid: bool = True, keep_input: bool = False,
    ) -> torch.Tensor:
        """Reduce `tensor` over all members, in place, and return it.

        Args:
            tensor: contiguous float32 CPU tensor, the same shape on every member.
            op: ``sum`` or ``mean``.
            weight: this member's weight (e.g. samples contributed); every member passes one,
                with ``op="mean"``; the result is ``sum(w_i * x_i) / sum(w_i)``. Weights travel
                exactly (float32) whatever the wire format.
            wire: ``fp32``, ``fp16`` or ``int8``: encoding of the values on the wire (sums are
                always accumulated in float32). Every member ends with bit-identical values.
            check_finite: find out whether the result holds NaN or Inf (:attr:`result_finite`,
                the same on every member), at the cost of one read of each owned chunk while
                it is in cache. Every member passes the same, as for `op`.
            valid: False if `tensor` no longer holds this member's input (an earlier attempt
                changed it): the member still takes part, so the others do not wait, and every
                member's :attr:`result_void` says the result must not be used.
            keep_input: write `tensor` only once every member has joined the collective (see
                :class:`~swarmtrain.wire.ring.AllReduceSchedule`): if the group breaks
                before, :attr:`input_intact` is True on every member that passed it, and a
                retry can use `tensor` as it is. Costs scratch of (W-2)/W of the tensor (kept
                for the next call) and its writes.
        Raises:
            ValueError / TypeError: bad arguments (raised before anything is sent); ValueError
                after the collective if the weights sum to zero (identically on every member).
            RingBroken: a neighbour died, timed out or desynchronised; the group is then
                unusable, and `tensor` holds its input if :attr:`input_intact`, else it is
                undefined.
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {sorted(WIRES)}, got {wire!r}")
        if weight is not None and op != "mean":
            raise ValueError("a weight makes a weighted mean: pass op='mean' with it")
        if weight is not None and not 0 <= weight < float("inf"):
            raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        _check_tensor(tensor, float_only=True)
        self.input_intact, self.result_void, self.result_finite = True, not valid, None
        flat = tensor.detach().reshape(-1).numpy()  # a view: the collective works in place
        if self.world_size == 1:
            self._check_usable("reduce_scatter")
            if weight == 0.0:
                raise ValueError("the weights of all members sum to 0: no weighted mean")
            if check_finite:
                self.result_finite = all_finite(flat)
            return tensor
        made: list[AllReduceSchedule] = []

        def plan(seq: int) -> Schedule:
            made.append(AllReduceSchedule(
                seq=seq, kind=KIND_ALL_REDUCE, rank=self.rank, world=self.world_size, flat=flat,
                codec=WIRES[wire], segment_bytes=self._segment_bytes, buffers=self._buffers, weight=weight,
                mean=op == "mean", check_finite=check_finite, valid=valid, keep_input=keep_input))
            return made[0]

        try:
            self._run(plan, "reduce_scatter")
        except BaseException:
            self.input_intact = not (made and made[0].touched)
            raise
        done = made[0]
        self.result_void = done.void
        if check_finite:
            self.result_finite = done.finite
        if done.weight_total == 0.0:
            raise ValueError("the weights of all members sum to 0: no weighted mean")
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Copy `root`'s `tensor` into every member's `tensor`, in place, and return it.

        Any dtype: the bytes travel along the ring from the root, pipelined by segment.

        Raises:
            ValueError: bad root or tensor. RingBroken: as for :meth:`all_reduce`.
        """
        if not 0 <= root < self.world_size:
            raise ValueError(f"root must be in 0..{self.world_size - 1}, got {root}")
        _check_tensor(tensor, float_only=False)
        if self.world_size == 1:
            self._check_usable("broadcast")
            return tensor
        self._run(lambda seq: BroadcastSchedule(seq=seq, rank=self.rank, world=self.world_size, tensor=tensor,
                                                root=root, segment_bytes=self._segment_bytes), "broadcast")
        return tensor

    def barrier(self) -> None:
        """Return once every member has entered the barrier.

        Raises:
            RingBroken: phase ``barrier``.
        """
        if self.world_size == 1:
            self._check_usable("barrier")
            return
        token = np.zeros(self.world_size, dtype=np.float32)  # an element per chunk: frames on every link
        self._run(lambda seq: AllReduceSchedule(
            seq=seq, kind=KIND_BARRIER, rank=self.rank, world=self.world_size, flat=token, codec=CODEC_FP32,
            segment_bytes=self._segment_bytes, buffers=self._buffers), "barrier")

    @property
    def state(self) -> RingState:
        """Where the group is in its life (see :class:`RingState`)."""
        return self._state

    def _move(self, to: RingState) -> None:
        """The one way the state changes (under ``_state_lock``).

        Raises:
            RingStateError: `to` is not reachable from the current state.
        """
        if to not in RING_TRANSITIONS[self._state]:
            raise RingStateError(self._state, to)
        self._state = to

    def close(self) -> None:
        """Close the links; the neighbours' collectives then fail at once. Idempotent.

        May be called from another thread to abort a collective in progress: it then fails
        promptly with :class:`RingBroken` ("closed during the collective").
        """
        with self._state_lock:
            if self._state is RingState.IDLE:
                self._move(RingState.CLOSED)
                self._shut_links()
                self._release()
            elif self._state is RingState.BUSY:
                self._move(RingState.ABORTING)  # the collective's thread releases the links
                self._shut_links()

    def _shut_links(self) -> None:
        for sock in (self._in, self._out):
            if sock is not None:
                try:
                    # wakes a poll() on it, tells the neighbour; the plain socket's method,
                    # as SSLSocket.shutdown would drop the TLS state under the pumping thread
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

    def _release(self) -> None:
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close()

    def __enter__(self) -> RingGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the engine ---------------------------------------------------------------------

    def _broken_here(self, phase: str, peer: int | None, detail: str) -> RingBroken:
        """A :class:`RingBroken` of this group, stamped with its epoch."""
        err = RingBroken(phase, peer, detail)
        err.epoch = self.epoch
        return err

    def _check_usable(self, phase: str) -> None:
        if self._state is RingState.BROKEN:
            broken = self._broken  # set with the move to BROKEN
            raise self._broken_here(phase, broken.peer if broken else None,
                                    f"the group broke earlier: {broken.detail if broken else '?'}")
        if self._state is RingState.CLOSED:
            raise self._broken_here(phase, None, "the group is closed")

    def _begin(self, phase: str) -> None:
        with self._state_lock:
            self._check_usable(phase)
            self._move(RingState.BUSY)

    def _end(self, failure: RingBroken | None) -> None:
        """The collective is over: back to IDLE, or BROKEN with `failure`, or CLOSED if it
        was aborted but finished anyway; the links are closed unless the group is IDLE."""
        with self._state_lock:
            if failure is not None:
                self._broken = failure
                self._move(RingState.BROKEN)
                self._shut_links()
            elif self._state is RingState.ABORTING:
                self._move(RingState.CLOSED)
            else:
                self._move(RingState.IDLE)
                return
            self._release()

    def _run(self, plan: Callable[[int], Schedule], phase: str) -> None:
        self._begin(phase)
        failure: RingBroken | None = None
        try:
            self._seq += 1
            self._pump(plan(self._seq))
        except RingBroken as exc:
            exc.epoch = self.epoch
            failure = exc
            if self._state is RingState.ABORTING:
                failure = self._broken_here(exc.phase, None, "the group was closed during the collective")
            if failure is exc:
                raise
            raise failure from exc
        except BaseException as exc:  # interrupted mid-collective: the ring is out of step
            failure = self._broken_here(phase, None, f"interrupted: {exc!r}")
            raise
        finally:
            self._end(failure)

    def _pump(self, op: Schedule) -> None:
        """Move `op`'s frames until all are sent and received (see :class:`_Pump`)."""
        _Pump(self, op).run()


class _Pump:
    """One collective's frames moving over a group's two links; the only blocking call is poll.

    Each turn sends what the successor's socket takes (:meth:`send`), receives what has
    arrived (:meth:`receive`), and, if neither moved a byte, fails a collective stalled for
    the group's timeout (:meth:`stalled`) or waits for a link (:meth:`wait`).

    A socket is only tried again after poll says so once a call came back short (its buffer
    is drained or full), which keeps the loop at about two calls per frame. A TLS socket is
    tried until it raises a want-read / want-write error instead: a short TLS read only means
    one record was consumed (the kernel may hold more), and a TLS write sends the whole buffer
    or nothing.
    """

    def __init__(self, group: RingGroup, op: Schedule) -> None:
        sock_in, sock_out = group._in, group._out
        if sock_in is None or sock_out is None:
            raise RingBroken(op.phase(0), None, "the group has no links")
        self.group, self.op = group, op
        self.sock_in, self.sock_out = sock_in, sock_out
        self.in_fd, self.out_fd = sock_in.fileno(), sock_out.fileno()
        self.tls_in, self.tls_out = isinstance(sock_in, ssl.SSLSocket), isinstance(sock_out, ssl.SSLSocket)
        self.reader = FrameReader(op, group._header_buf)
        self.outgoing = op.outgoing()
        self.frame_out: Outgoing | None = next(self.outgoing, None)
        self.sending: list[memoryview] | None = None  # what is left of the frame being sent
        self.send_left = 0
        self.send_step = 0  # of the frame being sent (for error messages)
        self.can_read = self.can_write = True
        self.watched: set[int] = set()

    def run(self) -> None:
        idle_since = time.monotonic()
        timeout = self.group.timeout
        try:
            while self.reader.frame is not None or self.frame_out is not None or self.sending is not None:
                moved = self.send()
                moved = self.receive() or moved
                now = time.monotonic()
                if moved:
                    idle_since = now
                    continue
                remaining = idle_since + timeout - now
                if remaining <= 0:
                    raise self.stalled()
                self.wait(remaining)
        finally:
            for fd in self.watched:
                self.group._poll.unregister(fd)

    def _send_due(self) -> bool:
        """A frame is being sent, or the next one may be (its receive is in)."""
        return self.sending is not None or (
            self.frame_out is not None and self.frame_out.after <= self.reader.frames)

    def send(self) -> bool:
        """Send while the successor's socket takes bytes; True if any went."""
        moved = False
        while self.can_write:
            if self.sending is None:
                frame = self.frame_out
                if frame is None or frame.after > self.reader.frames:
                    break
                head, payload = self.op.build(frame)
                self.sending, self.send_left = [memoryview(head), payload], len(head) + len(payload)
                self.send_step = frame.step
                self.frame_out = next(self.outgoing, None)
            try:
                if self.tls_out:
                    # after a want-error, the same view again: the record OpenSSL started
                    # must be retried with the same bytes
                    n = self.sock_out.send(self.sending[0])
                else:
                    n = self.sock_out.sendmsg(self.sending)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                self.can_write = False
                break
            except OSError as exc:
                raise RingBroken(self.op.phase(self.send_step), self.group._next,
                                 f"send failed: {exc}") from exc
            self.group.bytes_sent += n
            moved = True
            self.send_left -= n
            if self.send_left:
                self.sending = _consume(self.sending, n)
                self.can_write = self.tls_out  # the socket buffer is full (TLS: the next buffer is due)
            else:
                self.sending = None
        return moved

    def receive(self) -> bool:
        """Receive what has arrived, up to the end of a frame (a send may wait for it); True
        if any bytes came."""
        reader, op, prev = self.reader, self.op, self.group._prev
        moved = False
        while self.can_read and reader.frame is not None:
            want, step = reader.remaining, reader.frame.step
            bufs = reader.buffers()
            try:
                n = self.sock_in.recv_into(bufs[0]) if self.tls_in else self.sock_in.recvmsg_into(bufs)[0]
            except (BlockingIOError, ssl.SSLWantReadError):
                self.can_read = False
                break
            except OSError as exc:
                raise RingBroken(op.phase(step), prev, f"receive failed: {exc}") from exc
            if n == 0:
                raise RingBroken(op.phase(step), prev, f"rank {prev} closed the connection")
            self.group.bytes_received += n
            moved = True
            try:
                reader.updated(n)
            except RingDesync as exc:
                raise RingBroken(op.phase(exc.step), prev, str(exc)) from None
            if n < want:
                # plain: the socket buffer is drained; TLS: one record (or the header) is
                # in, read on until SSLWantReadError (nothing decrypted is left pending then)
                self.can_read = self.tls_in
                continue
            break  # a frame is complete: a send may have been waiting for it
        return moved

    def stalled(self) -> RingBroken:
        """Nothing moved for the group's timeout: blame the link we were waiting on."""
        group = self.group
        if self.sending is not None:
            return RingBroken(self.op.phase(self.send_step), group._next,
                              f"rank {group._next} took nothing for {group.timeout:g} s")
        step = self.reader.frame.step if self.reader.frame is not None else 0
        return RingBroken(self.op.phase(step), group._prev,
                          f"nothing from rank {group._prev} for {group.timeout:g} s")

    def wait(self, remaining: float) -> None:
        """Poll the links we are waiting on, for at most `remaining` seconds."""
        group, frame_in = self.group, self.reader.frame
        # not with TLS: OpenSSL may already hold part of a record, so the kernel might never
        # hold `lowat` more bytes and poll would sleep until the timeout
        if frame_in is not None and not self.tls_in:
            lowat = min(self.reader.remaining, _RCVLOWAT_MAX)
            if lowat != group._rcvlowat:
                self.sock_in.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                group._rcvlowat = lowat
        # Watch a link only while we wait on it: poll always reports a hang-up, which would
        # spin this loop if, say, the predecessor left once we had all its frames.
        poller, watched = group._poll, self.watched
        for fd, mask in ((self.in_fd, select.POLLIN if frame_in is not None else 0),
                         (self.out_fd, select.POLLOUT if self._send_due() else 0)):
            if mask:
                poller.register(fd, mask)
                watched.add(fd)
            elif fd in watched:
                poller.unregister(fd)
                watched.discard(fd)
        for fd, _ in poller.poll(remaining * 1000):
            if fd == self.in_fd:
                self.can_read = True  # data, or a hang-up / error that recv will report
            elif fd == self.out_fd:
                self.can_write = True


def _check_tensor(tensor: torch.Tensor, *, float_only: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"ring collectives need a CPU tensor, got one on {tensor.device}")
    if float_only and tensor.dtype != torch.float32:
        raise ValueError(f"all_reduce needs a float32 tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("ring collectives work in place on a contiguous tensor; call .contiguous() first")
