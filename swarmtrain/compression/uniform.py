"""Uniform: bucketed deterministic quantization to a few signed levels, scaled by each
bucket's largest magnitude — the codec for error-compensated streams.

The flattened tensor is cut into buckets of ``bucket_size`` elements (the last may be
shorter). For a bucket whose largest magnitude is ``M`` and ``s = 2**(bits-1) - 1`` levels
a side, element ``x`` becomes ``round(x * s / M)`` in ``[-s, s]`` and decodes to
``level * M / s``: the error is at most ``M / (2 s)`` per element, and the bucket's largest
element is exact.

Unlike QSGD (:mod:`.qsgd`) the rounding is to nearest, so the result is biased but its
error is small and bounded — about ``sqrt(bucket_size) / 2`` times smaller than QSGD's at
the same bits, whose levels are spaced by the bucket's L2 norm. That is the right trade
wherever the error is fed back: the coordinator's weight deltas (its published copy
carries the rounding error into the next delta, so it never accumulates) and gradients
sent through :class:`~swarmtrain.compression.ErrorFeedback`.

Each element is stored as the offset code ``level + s`` in ``[0, 2s]``, packed
``8 // bits`` per byte (see :mod:`.bitpack`); each bucket adds one float32 scale ``M``.
"""

from __future__ import annotations

import torch

from swarmtrain.compression.base import (
    Compressed,
    dtype_name,
    flat_float32,
)
from swarmtrain.compression.bitpack import pack_bits
from swarmtrain.compression.qsgd import (
    BucketedLevelCodec,
    _levels,
    _per_bucket,
    _scale_per_bucket_,
    decode_bucketed_levels,
)
from swarmtrain.errors import LocalProtocolError

__all__ = ["UniformCodec", "decode_uniform"]


def _max_magnitude(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return x.abs().amax() if dim is None else x.abs().amax(dim=dim)


class UniformCodec(BucketedLevelCodec):
    """Deterministic ``bits``-bit quantization with one max-magnitude scale per bucket.

    Args:
        bits: 2 (levels -1..1), 4 (-7..7) or 8 (-127..127).
        bucket_size: elements per bucket (one float32 scale each).

    Raises:
        ConfigError: ``bits`` not in (2, 4, 8) or ``bucket_size`` out of range.
    """

    name = "uniform"
    SCALE_PART = "scales"
    BITS_KEY = "uniform bits"

    def __init__(self, bits: int = 4, bucket_size: int = 512) -> None:
        super().__init__(bits, bucket_size)

    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        return self.compress_decoded(tensor)[0]

    def compress_decoded(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> tuple[Compressed, torch.Tensor]:
        flat = flat_float32(tensor)
        size = self.bucket_size
        s = _levels(self.bits)
        scales = _per_bucket(flat, size, _max_magnitude)
        if scales.numel() and not bool(torch.isfinite(scales).all()):
            raise LocalProtocolError(
                "non_finite", "uniform: a bucket holds NaN or inf; fix the tensor before sending it"
            )
        # Zero buckets get factor 0: every level there is 0.
        factor = torch.where(scales > 0, s / scales, torch.zeros_like(scales))
        level = flat.clone()
        _scale_per_bucket_(level, factor, size)
        level.round_().clamp_(-s, s)
        codes = (level + s).to(torch.uint8)
        parts = {"scales": scales, "codes": pack_bits(codes, self.bits)}
        meta: dict[str, int | float | str] = {"bits": self.bits, "bucket_size": size}
        _scale_per_bucket_(level, scales / s, size)  # what decode_uniform computes, bit for bit
        c = Compressed(self.name, tuple(tensor.shape), dtype_name(tensor), parts, meta)
        return c, level.view(tensor.shape)



def decode_uniform(c: Compressed) -> torch.Tensor:
    """Decode a ``uniform`` :class:`Compressed` from its parts and meta alone (the same layout
    as QSGD's, with ``scales`` in place of ``norms``).

    Raises:
        RemoteProtocolError: bad meta, wrong part sizes or dtypes, a scale that is negative
            or not finite, or a code above ``2s``.
    """
    return decode_bucketed_levels(c, UniformCodec.name, "scales")
