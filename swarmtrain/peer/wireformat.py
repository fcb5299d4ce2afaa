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
    "segment_size",
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


MIN_SEGMENT_BYTES = 64 << 10
SEGMENTS_PER_CHUNK = 8


def segment_size(nbytes: int, max_bytes: int, align: int = 1) -> int:
    """Segment size for pipelining a chunk of `nbytes`: about an eighth of it, so a step
    overlaps with the next after an eighth of its data (what a hop adds to the latency),
    but at least 64 KB, where per-frame costs stay small, and at most `max_bytes`;
    a multiple of `align`."""
    size = min(max_bytes, max(MIN_SEGMENT_BYTES, -(-nbytes // SEGMENTS_PER_CHUNK)))
    return max(align, size - size % align)


def segment_bounds(start: int, end: int, seg_elems: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` into pieces of at most `seg_elems` (none if empty)."""
    if seg_elems < 1:
        raise ValueError(f"seg_elems must be >= 1, got {seg_elems}")
    return [(s, min(s + seg_elems, end)) for s in range(start, end, seg_elems)]


def encoded_nbytes(codec: int, numel: int) -> int:
    """Payload size of a segment of `numel` float32 values in `codec`."""
    return numel * {CODEC_FP32: 4, CODEC_FP16: 2, CODEC_INT8: 1}[codec]


# The kernels below run on one segment at a time and must not use torch's thread pool: the
# members of a ring are separate processes sharing the cores, and an OpenMP parallel region
# waits for all its threads (and leaves them spinning), which on busy cores costs up to
# milliseconds per call. numpy's kernels are single-threaded; torch is used only for float16
# conversions (vectorised, unlike numpy's), on slices short enough that it runs them inline.
_TORCH_INLINE = 32768  # at::internal::GRAIN_SIZE: shorter element-wise ops skip the pool


def _torch_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` with dtype conversion by torch, without its thread pool."""
    d, s = torch.from_numpy(dst), torch.from_numpy(src)
    for i in range(0, len(dst), _TORCH_INLINE):
        d[i : i + _TORCH_INLINE].copy_(s[i : i + _TORCH_INLINE])


def _torch_add(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst += src`` (float32 += float16) by torch, without its thread pool."""
    d, s = torch.from_numpy(dst), torch.from_numpy(src)
    for i in range(0, len(dst), _TORCH_INLINE):
        d[i : i + _TORCH_INLINE].add_(s[i : i + _TORCH_INLINE])


def encode_into(codec: int, src: np.ndarray, out: np.ndarray, work: np.ndarray) -> float:
    """Encode float32 `src` into the uint8 buffer `out` (exactly ``encoded_nbytes`` long).

    Args:
        codec: CODEC_FP16 or CODEC_INT8 (fp32 is sent as it is, never encoded).
        src: float32 values.
        out: uint8 array receiving the payload.
        work: float32 scratch of at least ``len(src)`` elements.
    Returns:
        The scale to put in the frame header (0.0 for fp16).
    """
    n = len(src)
    tmp = work[:n]
    if codec == CODEC_FP16:
        np.clip(src, -FP16_MAX, FP16_MAX, out=tmp)  # saturate instead of overflowing to inf
        _torch_copy(out.view(np.float16), tmp)
        return 0.0
    if codec != CODEC_INT8:
        raise ValueError(f"codec {codec} is not an encoding")
    q = out.view(np.int8)
    amax = max(-float(src.min()), float(src.max())) if n else 0.0
    if amax == 0.0 or not math.isfinite(amax):
        q.fill(0)
        return 0.0 if amax == 0.0 else math.nan
    scale = np.float32(amax / 127.0)  # what the header carries, so what decoders use
    np.divide(src, scale, out=tmp)
    np.rint(tmp, out=tmp)
    np.clip(tmp, -127, 127, out=tmp)
    np.copyto(q, tmp, casting="unsafe")
    return float(scale)


def decode_into(codec: int, payload: np.ndarray, scale: float, dst: np.ndarray) -> None:
    """Overwrite float32 `dst` with the values of an encoded segment (uint8 `payload`)."""
    if codec == CODEC_FP16:
        _torch_copy(dst, payload.view(np.float16))
    elif codec == CODEC_INT8:
        with np.errstate(invalid="ignore"):  # a NaN scale (non-finite values sent) decodes to NaN
            np.multiply(payload.view(np.int8), np.float32(scale), out=dst)
    else:
        raise ValueError(f"codec {codec} is not an encoding")


def accumulate(codec: int, payload: np.ndarray, scale: float, dst: np.ndarray, work: np.ndarray) -> None:
    """``dst += decoded(payload)`` in float32; `payload` is the uint8 frame payload, `work`
    float32 scratch of at least ``len(dst)`` elements."""
    if codec == CODEC_FP32:
        np.add(dst, payload.view(np.float32), out=dst)
    elif codec == CODEC_FP16:
        _torch_add(dst, payload.view(np.float16))
    elif codec == CODEC_INT8:
        tmp = work[: len(dst)]
        with np.errstate(invalid="ignore"):  # NaN in (a NaN scale, or inf - inf) stays NaN
            np.multiply(payload.view(np.int8), np.float32(scale), out=tmp)
            np.add(dst, tmp, out=dst)
    else:
        raise ValueError(f"codec {codec} cannot be accumulated")


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous `t` as a uint8 array: writable, shared with it (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


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
        self.received = np.empty(segment_bytes, dtype=np.uint8)
        self.encoded = np.empty(segment_bytes, dtype=np.uint8)
        self.work = np.empty(segment_bytes // 4, dtype=np.float32)


class _Segment:
    """A piece of the buffer that travels as one frame: float32 `values`, their bytes `raw`."""

    __slots__ = ("codec", "raw", "values")

    def __init__(self, values: np.ndarray, codec: int) -> None:
        self.values = values
        self.raw = values.data.cast("B")
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
    """Ring all-reduce of the float32 array `flat`, in place (plus, for a weighted mean, the
    1-element `extra` weight, which always travels as exact float32 in a frame of its own).

    At step k (0 <= k < 2(W-1)) a member sends chunk ``rank - k`` and receives chunk
    ``rank - k - 1`` (mod W), segment by segment; sending segment j of step k needs segment j
    of step k-1 received. Steps before W-1 add what they receive (reduce-scatter); from W-1
    on, received values replace the local ones (all-gather), and at step W-1 each member
    sends the chunk it owns: encoded once, its own copy replaced by the decoded values, so
    every member ends with the same bits. Encoded all-gather frames are relayed as received.
    """

    def __init__(
        self, *, seq: int, kind: int, rank: int, world: int, flat: np.ndarray, extra: np.ndarray | None,
        codec: int, segment_bytes: int, buffers: ScratchBuffers,
    ) -> None:
        super().__init__(seq=seq, kind=kind, rank=rank, world=world)
        n = len(flat)
        bounds = chunk_bounds(n + (extra is not None), world)
        seg_elems = segment_size(4 * (bounds[0][1] - bounds[0][0]), segment_bytes, 4) // 4
        self.chunks: list[list[_Segment]] = []
        for cs, ce in bounds:
            segs = [_Segment(flat[s:e], codec) for s, e in segment_bounds(cs, min(ce, n), seg_elems)]
            if extra is not None and cs <= n < ce:
                segs.append(_Segment(extra, CODEC_FP32))
            self.chunks.append(segs)
        self.steps = 2 * (world - 1)
        self.first_gather = world - 1
        self.buffers = buffers
        self.relay: dict[tuple[int, int], tuple[np.ndarray, float]] = {}

    def phase(self, step: int) -> str:
        if self.kind == KIND_BARRIER:
            return "barrier"
        return "reduce_scatter" if step < self.first_gather else "all_gather"

    def _chunk(self, step: int, *, sending: bool) -> list[_Segment]:
        return self.chunks[(self.rank - step - (0 if sending else 1)) % self.world]

    def incoming(self) -> Iterator[Incoming]:
        for k in range(self.steps):
            for j, seg in enumerate(self._chunk(k, sending=False)):
                nb = encoded_nbytes(seg.codec, len(seg.values))
                expect = self._header(seg.codec, k, j, nb)[:CHECKED_BYTES]
                if k < self.first_gather:
                    yield Incoming(k, j, expect, self.buffers.received[:nb].data)
                elif seg.codec == CODEC_FP32:
                    yield Incoming(k, j, expect, seg.raw)  # final values land in place
                else:
                    keep = np.empty(nb, dtype=np.uint8)  # decoded here, relayed as received
                    self.relay[(k, j)] = (keep, 0.0)
                    yield Incoming(k, j, expect, keep.data)

    def received(self, frame: Incoming, scale: float) -> None:
        seg = self._chunk(frame.step, sending=False)[frame.segment]
        if frame.step < self.first_gather:
            payload = self.buffers.received[: len(frame.payload)]
            accumulate(seg.codec, payload, scale, seg.values, self.buffers.work)
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
        nb = encoded_nbytes(seg.codec, len(seg.values))
        if seg.codec == CODEC_FP32:
            return self._header(seg.codec, k, j, nb), seg.raw
        if k > self.first_gather:
            keep, scale = self.relay.pop((k - 1, j))
            return self._header(seg.codec, k, j, nb, scale), keep.data
        encoded = self.buffers.encoded[:nb]
        scale = encode_into(seg.codec, seg.values, encoded, self.buffers.work)
        if k == self.first_gather:  # the owner keeps what every other member will decode
            decode_into(seg.codec, encoded, scale, seg.values)
        return self._header(seg.codec, k, j, nb, scale), encoded.data


class BroadcastSchedule(Schedule):
    """The root's bytes travel root -> root+1 -> ... -> root-1, segment by segment; every
    member but the last relays each segment as soon as it has landed (in place)."""

    def __init__(
        self, *, seq: int, rank: int, world: int, tensor: torch.Tensor, root: int, segment_bytes: int,
    ) -> None:
        super().__init__(seq=seq, kind=KIND_BROADCAST, rank=rank, world=world)
        self.raw = tensor_bytes(tensor).data
        self.segments = segment_bounds(0, len(self.raw), segment_size(len(self.raw), segment_bytes))
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
