"""Dense codecs (``none``, ``fp16``) and the linear int8 format used by collectives."""

from __future__ import annotations

import torch

from swarmtrain.compression.base import (
    Codec,
    Compressed,
    check_header,
    check_meta_keys,
    check_parts,
    dtype_name,
    flat_float32,
    require_float,
    to_fp16_clamped,
)

__all__ = ["FP16Codec", "NoneCodec", "dequantize_int8", "quantize_int8"]


class NoneCodec(Codec):
    """Exact: sends the float32 values. Wire: ``values`` float32[numel]."""

    name = "none"
    lossless = True

    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        # A contiguous float32 input is sent as a view of itself: no copy.
        values = flat_float32(tensor)
        return Compressed(self.name, tuple(tensor.shape), dtype_name(tensor), {"values": values})

    def decompress(self, c: Compressed) -> torch.Tensor:
        numel = check_header(c, self.name)
        check_meta_keys(c, set())
        check_parts(c, {"values": (torch.float32, numel)})
        return c.parts["values"].contiguous().view(c.shape)

    def estimate_wire_bytes(self, numel: int) -> int:
        return 4 * numel


class FP16Codec(Codec):
    """Half precision, saturating at ±65504 (never inf). Wire: ``values`` float16[numel]."""

    name = "fp16"

    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        require_float(tensor)
        values = to_fp16_clamped(tensor.detach().reshape(-1).cpu()).contiguous()
        return Compressed(self.name, tuple(tensor.shape), dtype_name(tensor), {"values": values})

    def decompress(self, c: Compressed) -> torch.Tensor:
        numel = check_header(c, self.name)
        check_meta_keys(c, set())
        check_parts(c, {"values": (torch.float16, numel)})
        return c.parts["values"].to(torch.float32).view(c.shape)

    def estimate_wire_bytes(self, numel: int) -> int:
        return 2 * numel


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Symmetric linear int8 quantization of one chunk, for compressed collectives.

    ``q = round(x / scale)`` with ``scale = max|x| / 127``, so ``q`` is in [-127, 127] and
    ``|dequantize_int8(q, scale) - x| <= scale / 2`` elementwise. Rounding is to nearest
    (deterministic), so every peer reconstructs the same values.

    Args:
        x: float tensor (any shape); NaN/inf are the caller's to reject beforehand.

    Returns:
        ``(q, scale)``: int8 tensor of x's shape and the float scale (0.0 for an all-zero
        or empty chunk).
    """
    xf = x.detach().to(torch.float32)
    amax = float(xf.abs().max()) if xf.numel() else 0.0
    if amax == 0.0:
        return torch.zeros(x.shape, dtype=torch.int8), 0.0
    scale = amax / 127.0
    q = (xf / scale).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 values of an int8 chunk made by :func:`quantize_int8`."""
    return q.to(torch.float32).mul_(scale)
