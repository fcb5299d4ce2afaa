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
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from swarmtrain.roles.peer.links import RingBroken, RingListener, dial
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire.ring import (
    CHECKED_BYTES,
    CODEC_FP32,
    HEADER,
    KIND_ALL_REDUCE,
    KIND_BARRIER,
    WIRES,
    AllReduceSchedule,
    BroadcastSchedule,
    FrameHeader,
    Incoming,
    Outgoing,
    Schedule,
    ScratchBuffers,
    all_finite,
)

__all__ = ["DEFAULT_SEGMENT_BYTES", "RingBroken", "RingGroup", "RingListener"]

DEFAULT_SEGMENT_BYTES = 1 << 20
LOCAL_BUFFER_BYTES = 1 << 20  # socket buffers of a link within this host (the kernel doubles it)
_SCALE = struct.Struct("<f")
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


class RingGroup:
    """A ring of ``len(addresses)`` members for one epoch; this member is `rank`.

    Connects to rank+1's listener and takes rank-1's connection from `listener`. Every member
    must call the same collectives in the same order with same-sized tensors; a mismatch is
    detected (every frame header is checked) and breaks the group. A failed collective breaks
    the group for good: build a new one for a new epoch. With one member, collectives are
    no-ops. One collective at a time; :meth:`close` may come from any thread (it aborts).

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
        self._broken: RingBroken | None = None
        self._closed = False
        self._busy = False
        self._aborted = False
        self._state_lock = threading.Lock()
        self._next, self._prev = (rank + 1) % self.world_size, (rank - 1) % self.world_size
        self._out: socket.socket | None = None
        self._in: socket.socket | None = None
        self._poll = select.poll()
        self._rcvlowat = 1  # the kernel default
        self._send_step = 0  # of the frame being sent (for error messages)
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

    def close(self) -> None:
        """Close the links; the neighbours' collectives then fail at once. Idempotent.

        May be called from another thread to abort a collective in progress: it then fails
        promptly with :class:`RingBroken` ("closed during the collective").
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._aborted = self._busy
            for sock in (self._in, self._out):
                if sock is not None:
                    try:
                        # wakes a poll() on it, tells the neighbour; the plain socket's method,
                        # as SSLSocket.shutdown would drop the TLS state under the pumping thread
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
                    except OSError:
                        pass
            if not self._busy:
                self._release()

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
        if self._broken is not None:
            raise self._broken_here(phase, self._broken.peer,
                                    f"the group broke earlier: {self._broken.detail}")
        if self._closed:
            raise self._broken_here(phase, None, "the group is closed")

    def _run(self, plan: Callable[[int], Schedule], phase: str) -> None:
        with self._state_lock:
            if self._busy:
                raise RuntimeError("another collective is running on this group (calls must be sequential)")
            self._check_usable(phase)
            self._busy = True
        try:
            self._seq += 1
            self._pump(plan(self._seq))
        except RingBroken as exc:
            exc.epoch = self.epoch
            err = exc
            if self._aborted:
                err = self._broken_here(exc.phase, None, "the group was closed during the collective")
            self._broken = err
            self.close()
            if err is exc:
                raise
            raise err from exc
        except BaseException as exc:  # interrupted mid-collective: the ring is out of step
            self._broken = self._broken_here(phase, None, f"interrupted: {exc!r}")
            self.close()
            raise
        finally:
            with self._state_lock:
                self._busy = False
                if self._closed:
                    self._release()

    def _pump(self, op: Schedule) -> None:
        """Move `op`'s frames until all are sent and received; the only blocking call is poll.

        A socket is only tried again after poll says so once a call came back short (its
        buffer is drained or full), which keeps the loop at about two calls per frame. A TLS
        socket is tried until it raises a want-read / want-write error instead: a short TLS
        read only means one record was consumed (the kernel may hold more), and a TLS write
        sends the whole buffer or nothing.
        """
        sock_in, sock_out, poller = self._in, self._out, self._poll
        if sock_in is None or sock_out is None:
            raise RingBroken(op.phase(0), None, "the group has no links")
        in_fd, out_fd = sock_in.fileno(), sock_out.fileno()
        tls_in, tls_out = isinstance(sock_in, ssl.SSLSocket), isinstance(sock_out, ssl.SSLSocket)
        header = self._header_buf
        header_view = memoryview(header)
        hlen = len(header)
        incoming, outgoing = op.incoming(), op.outgoing()
        frame_in: Incoming | None = next(incoming, None)
        frame_out: Outgoing | None = next(outgoing, None)
        got = 0  # bytes of frame_in (header + payload) received so far
        sending: list[memoryview] | None = None  # what is left of the frame being sent
        send_left = 0
        received = 0  # frames fully received and processed
        can_read = can_write = True
        watched: set[int] = set()
        idle_since = time.monotonic()
        while frame_in is not None or frame_out is not None or sending is not None:
            moved = False
            while can_write:  # send what the successor's socket takes
                if sending is None:
                    if frame_out is None or frame_out.after > received:
                        break
                    head, payload = op.build(frame_out)
                    sending, send_left = [memoryview(head), payload], len(head) + len(payload)
                    self._send_step = frame_out.step
                    frame_out = next(outgoing, None)
                try:
                    if tls_out:
                        # after a want-error, the same view again: the record OpenSSL started
                        # must be retried with the same bytes
                        n = sock_out.send(sending[0])
                    else:
                        n = sock_out.sendmsg(sending)
                except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    can_write = False
                    break
                except OSError as exc:
                    raise RingBroken(op.phase(self._send_step), self._next, f"send failed: {exc}") from exc
                self.bytes_sent += n
                moved = True
                send_left -= n
                if send_left:
                    sending = _consume(sending, n)
                    can_write = tls_out  # the socket buffer is full (TLS: the next buffer is due)
                else:
                    sending = None
            while can_read and frame_in is not None:  # receive what has arrived
                want = hlen + len(frame_in.payload) - got
                if got < hlen:
                    bufs = [header_view[got:], frame_in.payload]
                else:
                    bufs = [frame_in.payload[got - hlen :]]
                try:
                    n = sock_in.recv_into(bufs[0]) if tls_in else sock_in.recvmsg_into(bufs)[0]
                except (BlockingIOError, ssl.SSLWantReadError):
                    can_read = False
                    break
                except OSError as exc:
                    raise RingBroken(op.phase(frame_in.step), self._prev, f"receive failed: {exc}") from exc
                if n == 0:
                    raise RingBroken(op.phase(frame_in.step), self._prev,
                                     f"rank {self._prev} closed the connection")
                self.bytes_received += n
                moved = True
                if frame_in.into_caller and got + n > hlen:
                    op.touched = True
                if got < hlen <= got + n and header[:CHECKED_BYTES] != frame_in.expect:
                    raise self._desync(op, frame_in)
                got += n
                if n < want:
                    # plain: the socket buffer is drained; TLS: one record (or the header) is
                    # in, read on until SSLWantReadError (nothing decrypted is left pending then)
                    can_read = tls_in
                    continue
                op.received(frame_in, _SCALE.unpack_from(header, CHECKED_BYTES)[0])
                received += 1
                got = 0
                frame_in = next(incoming, None)
                break  # a send may have been waiting for this frame
            now = time.monotonic()
            if moved:
                idle_since = now
                continue
            remaining = idle_since + self.timeout - now
            if remaining <= 0:
                if sending is not None:
                    raise RingBroken(op.phase(self._send_step), self._next,
                                     f"rank {self._next} took nothing for {self.timeout:g} s")
                step = frame_in.step if frame_in is not None else 0
                raise RingBroken(op.phase(step), self._prev,
                                 f"nothing from rank {self._prev} for {self.timeout:g} s")
            # not with TLS: OpenSSL may already hold part of a record, so the kernel might never
            # hold `lowat` more bytes and poll would sleep until the timeout
            if frame_in is not None and not tls_in:
                lowat = min(hlen + len(frame_in.payload) - got, _RCVLOWAT_MAX)
                if lowat != self._rcvlowat:
                    sock_in.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                    self._rcvlowat = lowat
            # Watch a link only while we wait on it: poll always reports a hang-up, which would
            # spin this loop if, say, the predecessor left once we had all its frames.
            can_send = sending is not None or (frame_out is not None and frame_out.after <= received)
            for fd, mask in ((in_fd, select.POLLIN if frame_in is not None else 0),
                             (out_fd, select.POLLOUT if can_send else 0)):
                if mask:
                    poller.register(fd, mask)
                    watched.add(fd)
                elif fd in watched:
                    poller.unregister(fd)
                    watched.discard(fd)
            for fd, _ in poller.poll(remaining * 1000):
                if fd == in_fd:
                    can_read = True  # data, or a hang-up / error that recv will report
                elif fd == out_fd:
                    can_write = True
        for fd in watched:
            poller.unregister(fd)

    def _desync(self, op: Schedule, frame: Incoming) -> RingBroken:
        got = FrameHeader.unpack(self._header_buf)
        problem = got.mismatch(FrameHeader.unpack(frame.expect + bytes(HEADER.size - CHECKED_BYTES)))
        return RingBroken(op.phase(frame.step), self._prev, f"desynchronised ring: frame has {problem}")


def _check_tensor(tensor: torch.Tensor, *, float_only: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"ring collectives need a CPU tensor, got one on {tensor.device}")
    if float_only and tensor.dtype != torch.float32:
        raise ValueError(f"all_reduce needs a float32 tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("ring collectives work in place on a contiguous tensor; call .contiguous() first")
