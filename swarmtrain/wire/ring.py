"""What the ring collectives put on the wire, without any I/O: how a buffer is cut into
chunks and segments, the fixed frame header, the fp32 / fp16 / int8 segment encodings, and
the schedules (which frames a member receives and sends, in which order, each send after
which receive, and what to do with each frame). :mod:`swarmtrain.roles.peer.ring` only moves
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

Frames are read by a :class:`FrameReader` per collective: it lends the caller the buffers the
next bytes go to (the header, then the payload's place in the tensor or in scratch: no
copies), checks each header against the schedule's as soon as it is in, and hands each
completed frame to the schedule. ``feed`` takes bytes in any split, for tests and fuzzing.
Every check raises a :class:`~swarmtrain.errors.RemoteProtocolError`: :class:`RingDesync`
(code ``ring_desync``) for a header that differs from the expected one, naming the first
field that differs; ``ring_trailing_bytes`` for bytes past the collective's last frame;
``truncated_frame`` from :meth:`FrameReader.end_of_stream` for a stream that ended inside one.

The header's ``scale`` also carries two flags of an all-reduce (fp32 and fp16 frames leave it
0 otherwise, int8 decodes with its absolute value): its sign bit says that some member's
input was not valid, and NaN in an all-gather frame that the segment holds NaN or Inf (see
:class:`AllReduceSchedule`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from swarmtrain.errors import RemoteProtocolError, TruncatedFrame

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
    "FrameReader",
    "Incoming",
    "Outgoing",
    "RingDesync",
    "Schedule",
    "ScratchBuffers",
    "accumulate",
    "all_finite",
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
_SCALE = struct.Struct("<f")


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
_BLOCK = 65536  # float32 values (256 KB) that several passes can take in turn from the cache


def _torch_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` with dtype conversion by torch, without its thread pool."""
    d, s = torch.from_numpy(dst), torch.from_numpy(src)
    for i in range(0, len(dst), _TORCH_INLINE):
        d[i : i + _TORCH_INLINE].copy_(s[i : i + _TORCH_INLINE])


def _torch_add(dst: np.ndarray, base: np.ndarray, src: np.ndarray) -> None:
    """``dst = base + src`` (float32 + float16) by torch, without its thread pool."""
    d, b, s = torch.from_numpy(dst), torch.from_numpy(base), torch.from_numpy(src)
    for i in range(0, len(dst), _TORCH_INLINE):
        j = i + _TORCH_INLINE
        torch.add(b[i:j], s[i:j], out=d[i:j])


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
        # a NaN scale (non-finite values sent) decodes to NaN, a huge one to inf: both are found
        # by the collective's finiteness check, not here
        with np.errstate(invalid="ignore", over="ignore"):
            np.multiply(payload.view(np.int8), np.float32(scale), out=dst)
    else:
        raise ValueError(f"codec {codec} is not an encoding")


def accumulate(codec: int, payload: np.ndarray, scale: float, dst: np.ndarray, work: np.ndarray,
               base: np.ndarray | None = None) -> None:
    """``dst = base + decoded(payload)`` in float32 (`base` defaults to `dst`: ``dst +=``);
    `payload` is the uint8 frame payload (it may be `dst`'s own bytes, for fp32), `work`
    float32 scratch of at least ``len(dst)`` elements."""
    base = dst if base is None else base
    if codec == CODEC_FP32:
        np.add(base, payload.view(np.float32), out=dst)
    elif codec == CODEC_FP16:
        _torch_add(dst, base, payload.view(np.float16))
    elif codec == CODEC_INT8:
        tmp = work[: len(dst)]
        with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf in stays NaN / inf
            np.multiply(payload.view(np.int8), np.float32(scale), out=tmp)
            np.add(base, tmp, out=dst)
    else:
        raise ValueError(f"codec {codec} cannot be accumulated")


def all_finite(values: np.ndarray) -> bool:
    """No NaN and no Inf in float32 `values`. A finite sum says so in one read (NaN and Inf
    never add up to a finite number); only a sum that is not finite, which a finite array
    can reach by overflowing, is looked at again, with max and min (they propagate NaN)."""
    return (len(values) == 0 or math.isfinite(np.einsum("i->", values))
            or (math.isfinite(values.max()) and math.isfinite(values.min())))


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous `t` as a uint8 array: writable, shared with it (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


# --- schedules --------------------------------------------------------------------------


class Incoming(NamedTuple):
    """A frame a member expects: its header but the scale (`expect`) and where its payload
    goes; `into_caller`: that is the caller's own array (whoever receives bytes of it sets
    the schedule's ``touched``)."""

    step: int
    segment: int
    expect: bytes
    payload: memoryview
    into_caller: bool = False


class Outgoing(NamedTuple):
    """A frame a member sends once `after` frames have been received and processed."""

    after: int
    step: int
    segment: int


class ScratchBuffers:
    """Per-member buffers reused by every collective: the landing place of a reduce-scatter
    segment, the encoded (or weighted) segment being sent, float32 work space, and two
    areas sized by the collective, allocated by the first that needs them and grown only
    when a larger one does: the partial sums of the reduce-scatter steps before the last,
    and the encoded all-gather segments kept until they are relayed."""

    def __init__(self, segment_bytes: int) -> None:
        self.received = np.empty(segment_bytes, dtype=np.uint8)
        self.encoded = np.empty(segment_bytes, dtype=np.uint8)
        self.work = np.empty(segment_bytes // 4, dtype=np.float32)
        self.scaled = np.empty(segment_bytes // 4, dtype=np.float32)
        self._partial = np.empty(0, dtype=np.float32)
        self._kept = np.empty(0, dtype=np.uint8)

    def partial(self, elems: int) -> np.ndarray:
        """At least `elems` float32 values of scratch (not zeroed)."""
        if len(self._partial) < elems:
            self._partial = np.empty(elems, dtype=np.float32)
        return self._partial

    def kept(self, nbytes: int) -> np.ndarray:
        """At least `nbytes` bytes of scratch (not zeroed)."""
        if len(self._kept) < nbytes:
            self._kept = np.empty(nbytes, dtype=np.uint8)
        return self._kept


class _Segment:
    """A piece of the buffer that travels as one frame: float32 `values`, their bytes `raw`.
    `caller`: part of the caller's array (else a weight slot of the schedule's own);
    `offset` / `enc_offset`: where it starts in its chunk's values / encoded bytes."""

    __slots__ = ("caller", "codec", "enc_offset", "offset", "raw", "values")

    def __init__(self, values: np.ndarray, codec: int, *, caller: bool, offset: int = 0,
                 enc_offset: int = 0) -> None:
        self.values = values
        self.raw = values.data.cast("B")
        self.codec = codec
        self.caller = caller
        self.offset = offset
        self.enc_offset = enc_offset


class Schedule:
    """One collective as seen by one member: the frames it receives (:meth:`incoming`, in
    order; :meth:`received` once each has landed) and sends (:meth:`outgoing`, in order;
    :meth:`build` gives header and payload once the frame's `after` count is reached).
    :attr:`touched`: the caller's array may no longer hold what it held before."""

    def __init__(self, *, seq: int, kind: int, rank: int, world: int) -> None:
        self.seq, self.kind, self.rank, self.world = seq, kind, rank, world
        self.touched = False

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
    """Ring all-reduce of the float32 array `flat`, in place.

    At step k (0 <= k < 2(W-1)) a member sends chunk ``rank - k`` and receives chunk
    ``rank - k - 1`` (mod W), segment by segment; sending segment j of step k needs segment j
    of step k-1 received. Steps before W-1 add what they receive (reduce-scatter); from W-1
    on, received values replace the local ones (all-gather). Each segment of the chunk a
    member owns is finished as soon as its last addend is in, while still in cache: divided
    (a mean) and checked (``check_finite``; encoded formats check the decoded values when
    sending). At step W-1 the owner sends it, and, encoded, replaces its own copy by the
    decoded values, so every member ends with the same bits. Encoded all-gather frames are
    relayed as received.

    **With `keep_input`, `flat` is written from the last reduce-scatter step on (W-2), not
    before.** The partial sums of the steps before go to scratch (``ScratchBuffers.partial``;
    fp32 frames land there and are summed in place) and are sent from there; a `weight` is
    always applied as values are read, never to `flat`. A frame of step W-2 reaches a member
    only after every other member has sent its step-0 frames: its predecessor sends it once
    it has step W-3 from its own predecessor, and so on back to step 0. So a collective that
    breaks before every member has joined it leaves every member's `flat` exactly as it was
    (:attr:`touched` False everywhere), and it can be retried with the same arrays: no copy
    is kept. Once every member has joined, a member's `flat` may change at any time
    (:attr:`touched`). The scratch costs writes of (W-2)/W of the array that would otherwise
    stay in cache; without `keep_input` the reduce-scatter sums in place and `flat` changes
    from the first frame received.

    Flags travel in the frame header's ``scale`` (unused by fp32 and fp16 frames; int8
    decodes with its absolute value), so the frames are the same with or without them:

    - *void*: a member whose `flat` no longer holds its input (``valid=False``) sets the
      sign bit of every frame it sends, and so does every member from the first such frame
      it receives. Each chunk's reduce-scatter passes through every member and its
      all-gather reaches every member, so :attr:`void` ends the same everywhere (for an
      array of at least one element; an empty one cannot have been changed).
    - *not finite*: with ``check_finite``, the owner of each chunk checks each segment once
      finished and sends NaN as its scale if it holds NaN or Inf (int8: the scale is NaN
      then anyway). :attr:`finite` ends the same everywhere.

    A weighted mean puts a 1-element fp32 segment first in every chunk, the member's
    weight (exact float32), summed with the chunk, so its owner knows the sum of the
    weights before the values and divides by it before the all-gather.
    """

    def __init__(
        self, *, seq: int, kind: int, rank: int, world: int, flat: np.ndarray, codec: int,
        segment_bytes: int, buffers: ScratchBuffers, weight: float | None = None, mean: bool = False,
        check_finite: bool = False, valid: bool = True, keep_input: bool = False,
    ) -> None:
        super().__init__(seq=seq, kind=kind, rank=rank, world=world)
        bounds = chunk_bounds(len(flat), world)
        self.chunk_elems = bounds[0][1] - bounds[0][0]  # the first chunk is a longest
        seg_elems = segment_size(4 * self.chunk_elems, segment_bytes, 4) // 4
        self.weights = None if weight is None else np.full(world, weight, dtype=np.float32)
        self.chunks: list[list[_Segment]] = []
        self.enc_max = 0  # encoded bytes of the longest chunk
        for c, (cs, ce) in enumerate(bounds):
            segs = [] if self.weights is None else [
                _Segment(self.weights[c : c + 1], CODEC_FP32, caller=False)]
            enc = 0
            for s, e in segment_bounds(cs, ce, seg_elems):
                segs.append(_Segment(flat[s:e], codec, caller=True, offset=s - cs, enc_offset=enc))
                enc += encoded_nbytes(codec, e - s)
            self.enc_max = max(self.enc_max, enc)
            self.chunks.append(segs)
        self.steps = 2 * (world - 1)
        self.first_gather = world - 1
        self.buffers = buffers
        self.weight = None if weight is None else np.float32(weight)
        self.mean = mean
        self.check_finite = check_finite
        # keep_input: reduce-scatter steps 0 .. W-3 each sum one chunk into an area of their own
        self.scratch_steps = max(world - 2, 0) if keep_input else 0
        self.partial = buffers.partial(self.scratch_steps * self.chunk_elems)
        self.kept = buffers.kept((world - 1) * self.enc_max if codec != CODEC_FP32 else 0)
        self.relay: dict[tuple[int, int], float] = {}  # scale of each all-gather frame to pass on
        self.bad: set[int] = set()  # offsets of the owned fp32 segments that hold NaN or Inf
        self.void = not valid  #: some member's input was not valid (the same on every member)
        self.finite = True  #: with check_finite: the result holds no NaN or Inf (likewise)

    def phase(self, step: int) -> str:
        if self.kind == KIND_BARRIER:
            return "barrier"
        return "reduce_scatter" if step < self.first_gather else "all_gather"

    @property
    def weight_total(self) -> float | None:
        """The sum of the members' weights (a weighted mean, after the collective)."""
        return None if self.weights is None else float(self.weights[(self.rank + 1) % self.world])

    def _chunk(self, step: int, *, sending: bool) -> list[_Segment]:
        return self.chunks[(self.rank - step - (0 if sending else 1)) % self.world]

    def _partial(self, step: int, seg: _Segment) -> np.ndarray:
        start = step * self.chunk_elems + seg.offset
        return self.partial[start : start + len(seg.values)]

    def _kept(self, step: int, seg: _Segment, nbytes: int) -> np.ndarray:
        start = (step - self.first_gather) * self.enc_max + seg.enc_offset
        return self.kept[start : start + nbytes]

    def incoming(self) -> Iterator[Incoming]:
        for k in range(self.steps):
            for j, seg in enumerate(self._chunk(k, sending=False)):
                nb = encoded_nbytes(seg.codec, len(seg.values))
                expect = self._header(seg.codec, k, j, nb)[:CHECKED_BYTES]
                if k < self.first_gather:
                    if seg.caller and k < self.scratch_steps and seg.codec == CODEC_FP32:
                        payload = self._partial(k, seg).view(np.uint8)  # summed where it lands
                    else:
                        payload = self.buffers.received[:nb]
                elif seg.codec == CODEC_FP32:
                    payload = seg.values.view(np.uint8)  # final values land in place
                else:
                    payload = self._kept(k, seg, nb)  # decoded here, relayed as received
                yield Incoming(k, j, expect, payload.data,
                               into_caller=seg.caller and k >= self.first_gather and seg.codec == CODEC_FP32)

    def received(self, frame: Incoming, scale: float) -> None:
        k = frame.step
        seg = self._chunk(k, sending=False)[frame.segment]
        if math.copysign(1.0, scale) < 0:
            self.void = True
        scale = abs(scale)
        payload = np.frombuffer(frame.payload, dtype=np.uint8)
        if k < self.first_gather:
            base = seg.values
            if seg.caller and self.weight is not None:
                base = self.buffers.scaled[: len(base)]
                np.multiply(seg.values, self.weight, out=base)
            if seg.caller and k < self.scratch_steps:
                dst = self._partial(k, seg)
            else:
                dst = seg.values
                self.touched |= seg.caller
            if k == self.first_gather - 1 and seg.caller:
                self._finish_owned(seg, payload, scale, base)
            else:
                accumulate(seg.codec, payload, scale, dst, self.buffers.work, base)
            return
        if seg.caller and math.isnan(scale):
            self.finite = False
        if seg.codec != CODEC_FP32:
            decode_into(seg.codec, payload, scale, seg.values)
            self.touched |= seg.caller
        if k < self.steps - 1:  # the last step is not relayed
            self.relay[(k, frame.segment)] = scale

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
        if k > self.first_gather:  # relayed as received at step k-1
            scale = self.relay.pop((k - 1, j))
            payload = seg.raw if seg.codec == CODEC_FP32 else self._kept(k - 1, seg, nb).data
        else:
            payload, scale = self._finish(k, seg, nb) if seg.caller else (seg.raw, 0.0)
        if self.void:
            scale = math.copysign(scale, -1.0)
        return self._header(seg.codec, k, j, nb, scale), payload

    def _finish(self, k: int, seg: _Segment, nb: int) -> tuple[memoryview, float]:
        """Payload and scale of a segment of the caller's array sent at step k <= W-1."""
        if k == 0:  # this member's own values, weighted if a weight is given
            src = seg.values
            if self.weight is not None:
                # fp32 is sent from the encoded buffer, which stays untouched until it is sent
                out = (self.buffers.encoded[:nb].view(np.float32) if seg.codec == CODEC_FP32
                       else self.buffers.scaled[: len(src)])
                src = np.multiply(src, self.weight, out=out)
        elif k < self.first_gather:  # the partial sum received at step k-1
            src = self._partial(k - 1, seg) if k - 1 < self.scratch_steps else seg.values
        else:  # the chunk this member owns, finished (_finish_owned)
            src = seg.values
        scale = 0.0
        if seg.codec == CODEC_FP32:
            payload = src.view(np.uint8).data
            if k == self.first_gather and seg.offset in self.bad:
                scale = math.nan
        else:
            encoded = self.buffers.encoded[:nb]
            scale = encode_into(seg.codec, src, encoded, self.buffers.work)
            if k == self.first_gather:  # the owner keeps what every other member will decode
                decode_into(seg.codec, encoded, scale, seg.values)
                if self.check_finite and not all_finite(seg.values):
                    self.finite, scale = False, math.nan
            payload = encoded.data
        return payload, scale

    def _finish_owned(self, seg: _Segment, payload: np.ndarray, scale: float, base: np.ndarray) -> None:
        """The last addend of a segment of the chunk this member owns: add it, divide (a mean)
        and check (fp32), a block at a time, so that each pass reads what the one before
        left in cache (a whole segment does not stay there)."""
        divisor = self.weight_total if self.weights is not None else self.world if self.mean else None
        check = self.check_finite and seg.codec == CODEC_FP32
        width = encoded_nbytes(seg.codec, 1)
        for i in range(0, len(seg.values), _BLOCK):
            dst = seg.values[i : i + _BLOCK]
            accumulate(seg.codec, payload[i * width : (i + len(dst)) * width], scale, dst, self.buffers.work,
                       base[i : i + _BLOCK])
            if divisor:  # (a weight sum of 0 is refused after the collective)
                np.divide(dst, np.float32(divisor), out=dst)
            if check and not all_finite(dst):
                self.finite = False
                self.bad.add(seg.offset)


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


# --- reading a link ---------------------------------------------------------------------


class RingDesync(RemoteProtocolError):
    """A frame's header is not the one the schedule expects next (code ``ring_desync``): the
    members are not running the same collective in step, or the bytes are not ring frames.

    Attributes:
        step: the ring step of the frame that was expected.
        problem: the first field that differs, e.g. ``seq 3 where 2 was expected``.
    """

    def __init__(self, step: int, problem: str) -> None:
        super().__init__("ring_desync", f"desynchronised ring: frame has {problem}")
        self.step = step
        self.problem = problem


class FrameReader:
    """The receiving end of one collective's link, without I/O: the frames of `schedule`
    (its :meth:`~Schedule.incoming`), in order, each a :data:`HEADER` and its payload.

    Zero-copy use (the ring's loop): :meth:`buffers` gives the views the next bytes go to
    (what is left of the header, then of the payload), :meth:`updated` records how many were
    written. The header is checked as soon as it is complete, before a payload byte is used;
    a complete frame goes to ``schedule.received``. After an error every call raises it again.

    Args:
        schedule: the collective as this member sees it.
        header: where headers land (reused across collectives; default: a new buffer).
    """

    def __init__(self, schedule: Schedule, header: bytearray | None = None) -> None:
        self.schedule = schedule
        self._incoming = schedule.incoming()
        #: the frame being received (None once every frame is in)
        self.frame: Incoming | None = next(self._incoming, None)
        self._header = header if header is not None else bytearray(HEADER.size)
        self._header_view = memoryview(self._header)
        self._got = 0  # bytes of `frame` (header + payload) received so far
        self._error: RemoteProtocolError | None = None
        #: frames fully received and handed to the schedule
        self.frames = 0

    @property
    def remaining(self) -> int:
        """Bytes left of the current frame (0 once every frame is in)."""
        frame = self.frame
        return 0 if frame is None else HEADER.size + len(frame.payload) - self._got

    def buffers(self) -> list[memoryview]:
        """Writable views of the current frame's missing bytes, in order (none once done)."""
        if self._error is not None:
            raise self._error
        frame, got, hlen = self.frame, self._got, HEADER.size
        if frame is None:
            return []
        if got < hlen:
            return [self._header_view[got:], frame.payload]
        return [frame.payload[got - hlen :]]

    def updated(self, n: int) -> bool:
        """Record that the first `n` bytes of :meth:`buffers` were written; True if that
        completed a frame (then handed to the schedule).

        Raises:
            RingDesync: the header just completed is not the expected one.
        """
        if self._error is not None:
            raise self._error
        frame, got, hlen = self.frame, self._got, HEADER.size
        if frame is None:
            raise self._fail(RemoteProtocolError("ring_trailing_bytes", f"{n} bytes after the "
                                                 f"collective's last frame ({self.frames} frames)"))
        if frame.into_caller and got + n > hlen:
            self.schedule.touched = True
        if got < hlen <= got + n and self._header[:CHECKED_BYTES] != frame.expect:
            raise self._fail(self._desync(frame))
        got += n
        if got < hlen + len(frame.payload):
            self._got = got
            return False
        self.schedule.received(frame, _SCALE.unpack_from(self._header, CHECKED_BYTES)[0])
        self.frames += 1
        self._got = 0
        self.frame = next(self._incoming, None)
        return True

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """Take bytes of the stream in any split (copied into :meth:`buffers`); the number of
        frames they completed. Raises RemoteProtocolError (RingDesync, ``ring_trailing_bytes``)."""
        view = memoryview(data).cast("B")
        done = 0
        while view.nbytes:
            bufs = self.buffers()
            if not bufs:
                self.updated(view.nbytes)  # raises: past the last frame
            n = min(len(bufs[0]), view.nbytes)
            bufs[0][:n] = view[:n]
            view = view[n:]
            done += self.updated(n)
        return done

    def end_of_stream(self) -> TruncatedFrame | None:
        """The stream has ended: the ``truncated_frame`` error if frames were still expected
        (saying how far into which one), else None."""
        if self._error is not None or self.frame is None:
            return None
        frame = self.frame
        err = TruncatedFrame(f"the stream ended after {self._got} of the {HEADER.size + len(frame.payload)} "
                             f"bytes of ring frame {frame.step}/{frame.segment} "
                             f"({self.frames} complete frames before it)")
        self._fail(err)
        return err

    def _fail(self, exc: RemoteProtocolError) -> RemoteProtocolError:
        self._error = exc
        return exc

    def _desync(self, frame: Incoming) -> RingDesync:
        got = FrameHeader.unpack(self._header)
        problem = got.mismatch(FrameHeader.unpack(frame.expect + bytes(HEADER.size - CHECKED_BYTES)))
        return RingDesync(frame.step, problem or "a header that differs from the expected one")
