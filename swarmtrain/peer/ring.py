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
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from swarmtrain.peer.links import RingBroken, RingListener, dial
from swarmtrain.peer.wireformat import (
    CODEC_FP32,
    CODEC_RAW,
    HEADER,
    KIND_ALL_REDUCE,
    KIND_BARRIER,
    KIND_BROADCAST,
    WIRES,
    FrameHeader,
    accumulate,
    chunk_bounds,
    decode_into,
    encode_into,
    encoded_nbytes,
    segment_bounds,
)

__all__ = ["DEFAULT_SEGMENT_BYTES", "RingBroken", "RingGroup", "RingListener"]

DEFAULT_SEGMENT_BYTES = 1 << 20
_CHECKED = HEADER.size - 4  # every header field but the trailing scale is known in advance
_SCALE = struct.Struct("<f")
_RCVLOWAT_MAX = int(__import__("os").environ.get("LOWAT", 256 << 10))


class _In(NamedTuple):
    """A frame this member expects: its header (but the scale) and where its payload goes."""

    step: int
    segment: int
    expect: bytes
    payload: memoryview


class _Out(NamedTuple):
    """A frame this member will send once `after` frames have been received and processed."""

    after: int
    step: int
    segment: int


class _Segment:
    """A piece of the buffer that travels as one frame."""

    __slots__ = ("codec", "raw", "values")

    def __init__(self, values: torch.Tensor, raw: memoryview, codec: int) -> None:
        self.values = values
        self.raw = raw
        self.codec = codec


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class _Collective:
    """One collective's plan: the frames to receive and to send, in order, and what to do
    with each. The engine (:meth:`RingGroup._pump`) decides when."""

    def __init__(self, group: RingGroup, kind: int) -> None:
        self.group = group
        self.kind = kind
        self.seq = group._seq

    def phase(self, step: int) -> str:
        raise NotImplementedError

    def incoming(self) -> Iterator[_In]:
        raise NotImplementedError

    def received(self, frame: _In, scale: float) -> None:
        """Called once `frame` has fully landed."""

    def outgoing(self) -> Iterator[_Out]:
        raise NotImplementedError

    def build(self, frame: _Out) -> tuple[bytes, memoryview]:
        """Header and payload of `frame`, called once its dependencies are met."""
        raise NotImplementedError

    def _header(self, codec: int, step: int, segment: int, nbytes: int, scale: float = 0.0) -> bytes:
        return FrameHeader(self.seq, self.kind, codec, step, segment, nbytes, scale).pack()


class _AllReduce(_Collective):
    def __init__(
        self, group: RingGroup, kind: int, flat: torch.Tensor, extra: torch.Tensor | None, codec: int,
    ) -> None:
        super().__init__(group, kind)
        w, n = group.world_size, flat.numel()
        seg_elems = group._segment_bytes // 4
        base = _bytes_of(flat)
        self.chunks: list[list[_Segment]] = []
        for cs, ce in chunk_bounds(n + (extra is not None), w):
            segs = [_Segment(flat[s:e], base[4 * s : 4 * e], codec)
                    for s, e in segment_bounds(cs, min(ce, n), seg_elems)]
            if extra is not None and cs <= n < ce:
                segs.append(_Segment(extra, _bytes_of(extra), CODEC_FP32))  # a weight travels exactly
            self.chunks.append(segs)
        self.steps = 2 * (w - 1)
        self.first_gather = w - 1
        self.scratch = group._scratch
        self.scratch_raw = memoryview(self.scratch.numpy())
        self.relay: dict[tuple[int, int], tuple[torch.Tensor, float]] = {}

    def phase(self, step: int) -> str:
        if self.kind == KIND_BARRIER:
            return "barrier"
        return "reduce_scatter" if step < self.first_gather else "all_gather"

    def _chunk(self, step: int, sending: bool) -> list[_Segment]:
        # At step k a member sends chunk rank-k and receives chunk rank-k-1 (mod W).
        return self.chunks[(self.group.rank - step - (0 if sending else 1)) % self.group.world_size]

    def incoming(self) -> Iterator[_In]:
        for k in range(self.steps):
            for j, seg in enumerate(self._chunk(k, sending=False)):
                nb = encoded_nbytes(seg.codec, seg.values.numel())
                expect = self._header(seg.codec, k, j, nb)[:_CHECKED]
                if k < self.first_gather:
                    yield _In(k, j, expect, self.scratch_raw[:nb])
                elif seg.codec == CODEC_FP32:
                    yield _In(k, j, expect, seg.raw)  # final values land in place
                else:
                    keep = torch.empty(nb, dtype=torch.uint8)  # decoded here, relayed as received
                    self.relay[(k, j)] = (keep, 0.0)
                    yield _In(k, j, expect, memoryview(keep.numpy()))

    def received(self, frame: _In, scale: float) -> None:
        seg = self._chunk(frame.step, sending=False)[frame.segment]
        if frame.step < self.first_gather:
            accumulate(seg.codec, self.scratch[: len(frame.payload)], scale, seg.values)
        elif seg.codec != CODEC_FP32:
            key = (frame.step, frame.segment)
            keep = self.relay[key][0]
            decode_into(seg.codec, keep, scale, seg.values)
            if frame.step == self.steps - 1:
                del self.relay[key]  # the last step is not relayed
            else:
                self.relay[key] = (keep, scale)

    def outgoing(self) -> Iterator[_Out]:
        before = 0  # frames received before step k-1: sending (k, j) needs (k-1, j) received
        for k in range(self.steps):
            for j in range(len(self._chunk(k, sending=True))):
                yield _Out(before + j + 1 if k else 0, k, j)
            if k:
                before += len(self._chunk(k - 1, sending=False))

    def build(self, frame: _Out) -> tuple[bytes, memoryview]:
        k, j = frame.step, frame.segment
        seg = self._chunk(k, sending=True)[j]
        nb = encoded_nbytes(seg.codec, seg.values.numel())
        group = self.group
        if seg.codec == CODEC_FP32:
            return self._header(seg.codec, k, j, nb), seg.raw
        if k < self.first_gather:
            scale = encode_into(seg.codec, seg.values, group._encoded[:nb], group._encode_tmp)
        elif k == self.first_gather:
            # This member owns the chunk: encode it once and keep what the others will
            # decode, so that every member ends with the same bits.
            scale = encode_into(seg.codec, seg.values, group._encoded[:nb], group._encode_tmp)
            decode_into(seg.codec, group._encoded[:nb], scale, seg.values)
        else:
            keep, scale = self.relay.pop((k - 1, j))
            return self._header(seg.codec, k, j, nb, scale), memoryview(keep.numpy())
        return self._header(seg.codec, k, j, nb, scale), group._encoded_raw[:nb]


class _Broadcast(_Collective):
    def __init__(self, group: RingGroup, tensor: torch.Tensor, root: int) -> None:
        super().__init__(group, KIND_BROADCAST)
        self.raw = _bytes_of(tensor)
        self.segments = segment_bounds(0, len(self.raw), group._segment_bytes)
        self.position = (group.rank - root) % group.world_size  # hops from the root

    def phase(self, step: int) -> str:
        return "broadcast"

    def incoming(self) -> Iterator[_In]:
        if self.position > 0:
            for j, (s, e) in enumerate(self.segments):
                yield _In(0, j, self._header(CODEC_RAW, 0, j, e - s)[:_CHECKED], self.raw[s:e])

    def outgoing(self) -> Iterator[_Out]:
        if self.position < self.group.world_size - 1:
            for j in range(len(self.segments)):
                yield _Out(j + 1 if self.position else 0, 0, j)

    def build(self, frame: _Out) -> tuple[bytes, memoryview]:
        s, e = self.segments[frame.segment]
        return self._header(CODEC_RAW, 0, frame.segment, e - s), self.raw[s:e]


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
    no-ops. Not thread-safe: one collective at a time.

    Args:
        listener: this node's ring listener (its address is ``addresses[rank]``).
        rank: this member's position in `addresses`.
        addresses: every member's ring listener address, identical on every member.
        ring_id: names the ring (e.g. the run); connections of other rings are not taken.
        epoch: membership epoch; connections for older epochs are refused.
        secret: the cluster secret (None: open cluster).
        timeout: seconds forming the ring may take, and that a collective may go without
            any progress on its links before it fails.
        segment_bytes: size of the pipelined frames (float32 bytes; a multiple of 4).
    Raises:
        ValueError: bad arguments.
        RingBroken: phase ``connect``: a neighbour was unreachable, refused us or failed
            authentication within `timeout`.
    """

    def __init__(
        self, listener: RingListener, rank: int, addresses: list[tuple[str, int]], *,
        ring_id: str, epoch: int, secret: bytes | None, timeout: float = 10.0,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank must be in 0..{len(addresses) - 1}, got {rank}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        if segment_bytes < 4 or segment_bytes % 4:
            raise ValueError(f"segment_bytes must be a positive multiple of 4, got {segment_bytes}")
        self.rank, self.world_size, self.epoch = rank, len(addresses), epoch
        self.timeout = timeout
        self.bytes_sent = self.bytes_received = 0
        self._segment_bytes = segment_bytes
        self._seq = 0
        self._broken: RingBroken | None = None
        self._closed = False
        self._busy = False
        self._aborted = False
        self._state_lock = threading.Lock()
        self._header_buf = bytearray(HEADER.size)
        self._scratch = torch.empty(segment_bytes, dtype=torch.uint8)
        self._encoded = torch.empty(segment_bytes, dtype=torch.uint8)
        self._encoded_raw = memoryview(self._encoded.numpy())
        self._encode_tmp = torch.empty(segment_bytes // 4, dtype=torch.float32)
        self._next, self._prev = (rank + 1) % self.world_size, (rank - 1) % self.world_size
        self._out: socket.socket | None = None
        self._in: socket.socket | None = None
        if self.world_size == 1:
            return
        listener.open_epoch(ring_id, epoch)
        deadline = time.monotonic() + timeout
        self._out = dial(addresses[self._next], secret=secret, ring_id=ring_id, epoch=epoch,
                         from_rank=rank, peer=self._next, timeout=timeout)
        try:
            self._in = listener.claim(ring_id, epoch, self._prev, max(deadline - time.monotonic(), 0.001))
        except BaseException:
            self._out.close()
            raise
        self._out.setblocking(False)
        self._in.setblocking(False)
        self._poll = select.poll()
        self._rcvlowat = 1
        self._send_step = 0

    # --- collectives --------------------------------------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, weight: float | None = None, wire: str = "fp32",
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
        Raises:
            ValueError / TypeError: bad arguments (raised before anything is sent); ValueError
                after the collective if the weights sum to zero (identically on every member).
            RingBroken: a neighbour died, timed out or desynchronised. `tensor` is then
                undefined and the group unusable.
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
        flat = tensor.detach().view(-1)
        if self.world_size == 1:
            self._check_usable("reduce_scatter")
            return tensor
        extra = None
        if weight is not None:
            flat.mul_(weight)
            extra = torch.tensor([weight], dtype=torch.float32)
        self._run(lambda: _AllReduce(self, KIND_ALL_REDUCE, flat, extra, WIRES[wire]), "reduce_scatter")
        if extra is not None:
            if float(extra[0]) == 0.0:
                raise ValueError("the weights of all members sum to 0: no weighted mean")
            flat.div_(extra)
        elif op == "mean":
            flat.div_(self.world_size)
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
        self._run(lambda: _Broadcast(self, tensor, root), "broadcast")
        return tensor

    def barrier(self) -> None:
        """Return once every member has entered the barrier.

        Raises:
            RingBroken: phase ``barrier``.
        """
        if self.world_size == 1:
            self._check_usable("barrier")
            return
        token = torch.zeros(self.world_size)  # one element per chunk: every link carries frames
        self._run(lambda: _AllReduce(self, KIND_BARRIER, token, None, CODEC_FP32), "barrier")

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
                        sock.shutdown(socket.SHUT_RDWR)  # wakes a poll() on it, tells the neighbour
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

    def _check_usable(self, phase: str) -> None:
        if self._broken is not None:
            raise RingBroken(phase, self._broken.peer, f"the group broke earlier: {self._broken.detail}")
        if self._closed:
            raise RingBroken(phase, None, "the group is closed")

    def _run(self, make_op: Callable[[], _Collective], phase: str) -> None:
        with self._state_lock:
            if self._busy:
                raise RuntimeError("another collective is running on this group (calls must be sequential)")
            self._check_usable(phase)
            self._busy = True
        try:
            self._seq += 1
            self._pump(make_op())
        except RingBroken as exc:
            err = RingBroken(exc.phase, None, "the group was closed during the collective") if self._aborted else exc
            self._broken = err
            self.close()
            if err is exc:
                raise
            raise err from exc
        except BaseException as exc:  # interrupted mid-collective: the ring is out of step
            self._broken = RingBroken(phase, None, f"interrupted: {exc!r}")
            self.close()
            raise
        finally:
            with self._state_lock:
                self._busy = False
                if self._closed:
                    self._release()

    def _pump(self, op: _Collective) -> None:
        """Move `op`'s frames until all are sent and received; the only blocking call is poll.

        A socket is only tried again after poll says so once a call came back short (its
        buffer is drained or full), which keeps the loop at about two calls per frame.
        """
        sock_in, sock_out, poller = self._in, self._out, self._poll
        if sock_in is None or sock_out is None:
            raise RingBroken(op.phase(0), None, "the group has no links")
        in_fd, out_fd = sock_in.fileno(), sock_out.fileno()
        header = self._header_buf
        header_view = memoryview(header)
        hlen = len(header)
        incoming, outgoing = op.incoming(), op.outgoing()
        frame_in: _In | None = next(incoming, None)
        frame_out: _Out | None = next(outgoing, None)
        got = 0  # bytes of frame_in (header + payload) received so far
        sending: list[memoryview] | None = None  # what is left of the frame being sent
        send_left = 0
        received = 0  # frames fully received and processed
        can_read = can_write = True
        watching_out = False
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
                    n = sock_out.sendmsg(sending)
                except BlockingIOError:
                    can_write = False
                    break
                except OSError as exc:
                    raise RingBroken(op.phase(self._send_step), self._next, f"send failed: {exc}") from exc
                self.bytes_sent += n
                moved = True
                send_left -= n
                if send_left:
                    sending = _consume(sending, n)
                    can_write = False  # the socket buffer is full
                else:
                    sending = None
            while can_read and frame_in is not None:  # receive what has arrived
                want = hlen + len(frame_in.payload) - got
                bufs = [header_view[got:], frame_in.payload] if got < hlen else [frame_in.payload[got - hlen :]]
                try:
                    n = sock_in.recvmsg_into(bufs)[0]
                except BlockingIOError:
                    can_read = False
                    break
                except OSError as exc:
                    raise RingBroken(op.phase(frame_in.step), self._prev, f"receive failed: {exc}") from exc
                if n == 0:
                    raise RingBroken(op.phase(frame_in.step), self._prev,
                                     f"rank {self._prev} closed the connection")
                self.bytes_received += n
                moved = True
                if got < hlen <= got + n and header[:_CHECKED] != frame_in.expect:
                    raise self._desync(op, frame_in)
                got += n
                if n < want:
                    can_read = False  # the socket buffer is drained
                    continue
                op.received(frame_in, _SCALE.unpack_from(header, _CHECKED)[0])
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
            if frame_in is not None:
                # Wake for a large piece of the frame, not for every 64 KB that lands.
                lowat = min(hlen + len(frame_in.payload) - got, _RCVLOWAT_MAX)
                if lowat != self._rcvlowat:
                    sock_in.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                    self._rcvlowat = lowat
            # Watch the successor only while there is something for it: a hang-up is always
            # reported by poll, and would spin the loop once it has all our frames.
            want_out = sending is not None or (frame_out is not None and frame_out.after <= received)
            if want_out:
                poller.register(out_fd, select.POLLOUT)
            elif watching_out:
                poller.unregister(out_fd)
            watching_out = want_out
            poller.register(in_fd, select.POLLIN if frame_in is not None else 0)
            for fd, _ in poller.poll(remaining * 1000):
                if fd == in_fd:
                    can_read = True  # data, or a hang-up / error that recv will report
                elif fd == out_fd:
                    can_write = True
        if watching_out:
            poller.unregister(out_fd)

    def _desync(self, op: _Collective, frame: _In) -> RingBroken:
        got = FrameHeader.unpack(self._header_buf)
        problem = got.mismatch(FrameHeader.unpack(frame.expect + bytes(HEADER.size - _CHECKED)))
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
