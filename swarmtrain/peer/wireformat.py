"""What the ring collectives put on the wire, without any I/O: how a buffer is cut into
chunks and segments, the fixed frame header, the fp32 / fp16 / int8 segment encodings, and
the schedules (which frames a member receives and sends, in which order, each send after
which receive, and what to do with each frame). :mod:`swarmtrain.peer.ring` only moves
the bytes; the schedules are tested by passing frames between members in memory.

Encodings of one segment of ``n`` float32 values (accumulation is always in float32):

- ``fp32``: the raw values, ``4 n`` bytes.
- ``fp16``: half precision, saturating at ±65504 (never inf), ``2 n`` bytes. Rounding error
  per encoding is at most ``2**-11`` relative.
- ``int8``: symmetric linear, ``q = round(x / scale)`` with ``scale = max|x| / 127`` rounded to
  float32 and sent in the frame header, ``n`` bytes. Error per encoding is at most
  ``scale / 2`` per element (the same scheme as :func:`swarmtrain.compression.simple.quantize_int8`).
  A segment holding NaN or inf cannot be scaled; it is sent with a NaN scale, so the whole
  segment decodes to NaN on every member (loud, never silently finite).

Decoding is one fixed float32 operation (fp16 -> fp32 is exact; ``q * scale`` is a single
IEEE multiply), so the owner of a chunk, which replaces its own values by the decoded ones,
and every receiver of the same bytes end with bit-identical values.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "CHECKED_BYTES",
    "CODEC_FP16",
    "CODEC_FP32",
    "CODEC_INT8",
    "CODEC_RAW",
    "HEADER",
    "KIND_ALL_REDUCE",
    "KIND_BARRIER",
    "KIND_BROADCAST",
    "WIRES",
    "AllReduceSchedule",
    "BroadcastSchedule",
    "FrameHeader",
    "Incoming",
    "Outgoing",
    "Schedule",
    "ScratchBuffers",
    "accumulate",
    "chunk_bounds",
    "decode_into",
    "encode_into",
    "encoded_nbytes",
    "segment_bounds",
    "tensor_bytes",
]

WIRES = {"fp32": 0, "fp16": 1, "int8": 2}
CODEC_FP32, CODEC_FP16, CODEC_INT8 = 0, 1, 2
CODEC_RAW = 3  # broadcast: the tensor's bytes, any dtype

KIND_ALL_REDUCE, KIND_BROADCAST, KIND_BARRIER = 1, 2, 3

FP16_MAX = 65504.0

# seq (u32), kind (u8), codec (u8), step (u16), segment (u32), payload bytes (u32), scale (f32)
HEADER = struct.Struct("<IBBHIIf")
CHECKED_BYTES = HEADER.size - 4  # all but the trailing scale is known to the receiver in advance


@dataclass(frozen=True)
class FrameHeader:
    """The fixed header in front of every segment on a ring link.

    ``seq`` is the collective's sequence number on this group (mod 2**32), ``step`` the ring
    step, ``segment`` the index within the step's chunk: the receiver knows all of them in
    advance, so any mismatch is a desync, detected before a single value is added.
    """

    seq: int
    kind: int
    codec: int
    step: int
    segment: int
    nbytes: int
    scale: float = 0.0

    def pack(self) -> bytes:
        return HEADER.pack(
            self.seq & 0xFFFFFFFF, self.kind, self.codec, self.step, self.segment, self.nbytes, self.scale
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> FrameHeader:
        return cls(*HEADER.unpack(data))

    def mismatch(self, expected: FrameHeader) -> str | None:
        """What differs from `expected` (ignoring the scale), or None if it matches."""
        for name in ("seq", "kind", "codec", "step", "segment", "nbytes"):
            got, want = getattr(self, name), getattr(expected, name)
            if name == "seq":
                want &= 0xFFFFFFFF
            if got != want:
                return f"{name} {got} where {want} was expected"
        return None


def chunk_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into `world` contiguous chunks, the first ``n % world`` one longer.

    Chunks may be empty (more members than elements). Returns ``[(start, end), ...]``.
    """
    if world < 1 or n < 0:
        raise ValueError(f"need world >= 1 and n >= 0, got world={world}, n={n}")
    base, extra = divmod(n, world)
    bounds, start = [], 0
    for c in range(world):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def segment_bounds(start: int, end: int, seg_elems: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` into pieces of at most `seg_elems` (none if empty)."""
    if seg_elems < 1:
        raise ValueError(f"seg_elems must be >= 1, got {seg_elems}")
    return [(s, min(s + seg_elems, end)) for s in range(start, end, seg_elems)]


def encoded_nbytes(codec: int, numel: int) -> int:
    """Payload size of a segment of `numel` float32 values in `codec`."""
    return numel * {CODEC_FP32: 4, CODEC_FP16: 2, CODEC_INT8: 1}[codec]


def encode_into(codec: int, src: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> float:
    """Encode float32 `src` into the uint8 buffer `out` (exactly ``encoded_nbytes`` long).

    Args:
        codec: CODEC_FP16 or CODEC_INT8 (fp32 is sent as a view, never encoded).
        src: contiguous float32 values.
        out: uint8 tensor receiving the payload.
        tmp: float32 scratch of at least ``src.numel()`` elements (int8 only).
    Returns:
        The scale to put in the frame header (0.0 for fp16).
    """
    if codec == CODEC_FP16:
        half = out.view(torch.float16)
        half.copy_(src)
        half.clamp_(-FP16_MAX, FP16_MAX)
        return 0.0
    if codec != CODEC_INT8:
        raise ValueError(f"codec {codec} is not an encoding")
    q = out.view(torch.int8)
    if src.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(src)
    amax = max(-float(lo), float(hi))
    if amax == 0.0 or not math.isfinite(amax):
        q.zero_()
        return 0.0 if amax == 0.0 else math.nan
    scale = float(np.float32(amax / 127.0))  # what the header carries, so what decoders use
    work = tmp[: src.numel()]
    torch.div(src, scale, out=work)
    work.round_().clamp_(-127, 127)
    q.copy_(work)
    return scale


def decode_into(codec: int, payload: torch.Tensor, scale: float, dst: torch.Tensor) -> None:
    """Overwrite float32 `dst` with the values of an encoded segment (uint8 `payload`)."""
    if codec == CODEC_FP16:
        dst.copy_(payload.view(torch.float16))
    elif codec == CODEC_INT8:
        torch.mul(payload.view(torch.int8), scale, out=dst)
    else:
        raise ValueError(f"codec {codec} is not an encoding")


def accumulate(codec: int, payload: torch.Tensor, scale: float, dst: torch.Tensor) -> None:
    """``dst += decoded(payload)``, computed in float32 (`payload` is the uint8 frame payload)."""
    if codec == CODEC_FP32:
        dst.add_(payload.view(torch.float32))
    elif codec == CODEC_FP16:
        dst.add_(payload.view(torch.float16))
    elif codec == CODEC_INT8:
        dst.add_(payload.view(torch.int8), alpha=scale)
    else:
        raise ValueError(f"codec {codec} cannot be accumulated")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous `t`: writable, shared with it (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


# --- schedules --------------------------------------------------------------------------


class Incoming(NamedTuple):
    """A frame a member expects: its header but the scale (`expect`) and where its payload goes."""

    step: int
    segment: int
    expect: bytes
    payload: memoryview


class Outgoing(NamedTuple):
    """A frame a member sends once `after` frames have been received and processed."""

    after: int
    step: int
    segment: int


class ScratchBuffers:
    """Per-member buffers reused by every collective: the landing place of a reduce-scatter
    segment, and the encoded segment being sent (with the float32 work space of int8)."""

    def __init__(self, segment_bytes: int) -> None:
        self.received = torch.empty(segment_bytes, dtype=torch.uint8)
        self.received_raw = tensor_bytes(self.received)
        self.encoded = torch.empty(segment_bytes, dtype=torch.uint8)
        self.encoded_raw = tensor_bytes(self.encoded)
        self.work = torch.empty(segment_bytes // 4, dtype=torch.float32)


class _Segment:
    """A piece of the buffer that travels as one frame."""

    __slots__ = ("codec", "raw", "values")

    def __init__(self, values: torch.Tensor, raw: memoryview, codec: int) -> None:
        self.values = values
        self.raw = raw
        self.codec = codec


class Schedule:
    """One collective as seen by one member: the frames it receives (:meth:`incoming`, in
    order; :meth:`received` once each has landed) and sends (:meth:`outgoing`, in order;
    :meth:`build` gives header and payload once the frame's `after` count is reached)."""

    def __init__(self, *, seq: int, kind: int, rank: int, world: int) -> None:
        self.seq, self.kind, self.rank, self.world = seq, kind, rank, world

    def phase(self, step: int) -> str:
        raise NotImplementedError

    def incoming(self) -> Iterator[Incoming]:
        raise NotImplementedError

    def received(self, frame: Incoming, scale: float) -> None:
        """`frame` has fully landed in its payload buffer; `scale` came with its header."""

    def outgoing(self) -> Iterator[Outgoing]:
        raise NotImplementedError

    def build(self, frame: Outgoing) -> tuple[bytes, memoryview]:
        raise NotImplementedError

    def _header(self, codec: int, step: int, segment: int, nbytes: int, scale: float = 0.0) -> bytes:
        return HEADER.pack(self.seq & 0xFFFFFFFF, self.kind, codec, step, segment, nbytes, scale)


class AllReduceSchedule(Schedule):
    """Ring all-reduce of float32 `flat` (plus, for a weighted mean, the 1-element `extra`
    weight, which always travels as exact float32 in a frame of its own).

    At step k (0 <= k < 2(W-1)) a member sends chunk ``rank - k`` and receives chunk
    ``rank - k - 1`` (mod W), segment by segment; sending segment j of step k needs segment j
    of step k-1 received. Steps before W-1 add what they receive (reduce-scatter); from W-1
    on, received values replace the local ones (all-gather), and at step W-1 each member
    sends the chunk it owns: encoded once, its own copy replaced by the decoded values, so
    every member ends with the same bits. Encoded all-gather frames are relayed as received.
    """

    def __init__(
        self, *, seq: int, kind: int, rank: int, world: int, flat: torch.Tensor, extra: torch.Tensor | None,
        codec: int, segment_bytes: int, buffers: ScratchBuffers,
    ) -> None:
        super().__init__(seq=seq, kind=kind, rank=rank, world=world)
        n, base = flat.numel(), tensor_bytes(flat)
        self.chunks: list[list[_Segment]] = []
        for cs, ce in chunk_bounds(n + (extra is not None), world):
            segs = [_Segment(flat[s:e], base[4 * s : 4 * e], codec)
                    for s, e in segment_bounds(cs, min(ce, n), segment_bytes // 4)]
            if extra is not None and cs <= n < ce:
                segs.append(_Segment(extra, tensor_bytes(extra), CODEC_FP32))
            self.chunks.append(segs)
        self.steps = 2 * (world - 1)
        self.first_gather = world - 1
        self.buffers = buffers
        self.relay: dict[tuple[int, int], tuple[torch.Tensor, float]] = {}

    def phase(self, step: int) -> str:
        if self.kind == KIND_BARRIER:
            return "barrier"
        return "reduce_scatter" if step < self.first_gather else "all_gather"

    def _chunk(self, step: int, *, sending: bool) -> list[_Segment]:
        return self.chunks[(self.rank - step - (0 if sending else 1)) % self.world]

    def incoming(self) -> Iterator[Incoming]:
        for k in range(self.steps):
            for j, seg in enumerate(self._chunk(k, sending=False)):
                nb = encoded_nbytes(seg.codec, seg.values.numel())
                expect = self._header(seg.codec, k, j, nb)[:CHECKED_BYTES]
                if k < self.first_gather:
                    yield Incoming(k, j, expect, self.buffers.received_raw[:nb])
                elif seg.codec == CODEC_FP32:
                    yield Incoming(k, j, expect, seg.raw)  # final values land in place
                else:
                    keep = torch.empty(nb, dtype=torch.uint8)  # decoded here, relayed as received
                    self.relay[(k, j)] = (keep, 0.0)
                    yield Incoming(k, j, expect, tensor_bytes(keep))

    def received(self, frame: Incoming, scale: float) -> None:
        seg = self._chunk(frame.step, sending=False)[frame.segment]
        if frame.step < self.first_gather:
            accumulate(seg.codec, self.buffers.received[: len(frame.payload)], scale, seg.values)
        elif seg.codec != CODEC_FP32:
            key = (frame.step, frame.segment)
            keep = self.relay.pop(key)[0]
            decode_into(seg.codec, keep, scale, seg.values)
            if frame.step < self.steps - 1:  # the last step is not relayed
                self.relay[key] = (keep, scale)

    def outgoing(self) -> Iterator[Outgoing]:
        before = 0  # frames received before step k-1
        for k in range(self.steps):
            for j in range(len(self._chunk(k, sending=True))):
                yield Outgoing(before + j + 1 if k else 0, k, j)
            if k:
                before += len(self._chunk(k - 1, sending=False))

    def build(self, frame: Outgoing) -> tuple[bytes, memoryview]:
        k, j = frame.step, frame.segment
        seg = self._chunk(k, sending=True)[j]
        nb = encoded_nbytes(seg.codec, seg.values.numel())
        if seg.codec == CODEC_FP32:
            return self._header(seg.codec, k, j, nb), seg.raw
        if k > self.first_gather:
            keep, scale = self.relay.pop((k - 1, j))
            return self._header(seg.codec, k, j, nb, scale), tensor_bytes(keep)
        encoded = self.buffers.encoded[:nb]
        scale = encode_into(seg.codec, seg.values, encoded, self.buffers.work)
        if k == self.first_gather:  # the owner keeps what every other member will decode
            decode_into(seg.codec, encoded, scale, seg.values)
        return self._header(seg.codec, k, j, nb, scale), self.buffers.encoded_raw[:nb]


class BroadcastSchedule(Schedule):
    """The root's bytes travel root -> root+1 -> ... -> root-1, segment by segment; every
    member but the last relays each segment as soon as it has landed (in place)."""

    def __init__(
        self, *, seq: int, rank: int, world: int, tensor: torch.Tensor, root: int, segment_bytes: int,
    ) -> None:
        super().__init__(seq=seq, kind=KIND_BROADCAST, rank=rank, world=world)
        self.raw = tensor_bytes(tensor)
        self.segments = segment_bounds(0, len(self.raw), segment_bytes)
        self.position = (rank - root) % world  # hops from the root

    def phase(self, step: int) -> str:
        return "broadcast"

    def incoming(self) -> Iterator[Incoming]:
        if self.position > 0:
            for j, (s, e) in enumerate(self.segments):
                yield Incoming(0, j, self._header(CODEC_RAW, 0, j, e - s)[:CHECKED_BYTES], self.raw[s:e])

    def outgoing(self) -> Iterator[Outgoing]:
        if self.position < self.world - 1:
            for j in range(len(self.segments)):
                yield Outgoing(j + 1 if self.position else 0, 0, j)

    def build(self, frame: Outgoing) -> tuple[bytes, memoryview]:
        s, e = self.segments[frame.segment]
        return self._header(CODEC_RAW, 0, frame.segment, e - s), self.raw[s:e]
