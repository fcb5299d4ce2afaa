"""Pure pieces of the ring collectives: how a buffer is cut into chunks and segments, the
fixed frame header of a ring link, and the fp32 / fp16 / int8 segment encodings.

No sockets here; everything is tested without a network.

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
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CODEC_FP16",
    "CODEC_FP32",
    "CODEC_INT8",
    "CODEC_RAW",
    "HEADER",
    "KIND_ALL_REDUCE",
    "KIND_BARRIER",
    "KIND_BROADCAST",
    "WIRES",
    "FrameHeader",
    "accumulate",
    "chunk_bounds",
    "decode_into",
    "encode_into",
    "encoded_nbytes",
    "segment_bounds",
]

WIRES = {"fp32": 0, "fp16": 1, "int8": 2}
CODEC_FP32, CODEC_FP16, CODEC_INT8 = 0, 1, 2
CODEC_RAW = 3  # broadcast: the tensor's bytes, any dtype

KIND_ALL_REDUCE, KIND_BROADCAST, KIND_BARRIER = 1, 2, 3

FP16_MAX = 65504.0

# seq (u32), kind (u8), codec (u8), step (u16), segment (u32), payload bytes (u32), scale (f32)
HEADER = struct.Struct("<IBBHIIf")


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
