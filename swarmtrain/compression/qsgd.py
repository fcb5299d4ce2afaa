"""QSGD: bucketed stochastic quantization to a few signed levels (unbiased).

The idea is from Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding" (NeurIPS 2017); this is our own implementation of it.

The flattened tensor is cut into buckets of ``bucket_size`` elements (the last may be
shorter). For a bucket with L2 norm ``N`` and ``s = 2**(bits-1) - 1`` magnitude levels,
element ``x`` becomes the level ``l = floor(|x| / N * s + u)`` with ``u ~ U[0, 1)``, so
``E[l] = |x| / N * s`` and the decoded ``sign(x) * N * l / s`` is unbiased. Its variance
is at most ``min(n / s**2, sqrt(n) / s) * N**2`` per bucket of ``n`` elements (Lemma 3.1).

Each element is stored as the offset code ``sign(x) * l + s`` in ``[0, 2s]``, which fits in
``bits`` bits; codes are packed 8 // bits per byte (see :mod:`.bitpack`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmtrain.compression.base import (
    Codec,
    Compressed,
    check_header,
    check_meta_keys,
    check_parts,
    dtype_name,
    flat_float32,
    meta_int,
)
from swarmtrain.compression.bitpack import PACK_BITS, pack_bits, packed_nbytes, unpack_bits
from swarmtrain.errors import ConfigError, LocalProtocolError, RemoteProtocolError

__all__ = ["MAX_BUCKET_SIZE", "QSGD_BITS", "BucketedLevelCodec", "QSGDCodec", "decode_bucketed_levels"]

QSGD_BITS = PACK_BITS
"""Allowed bits per element: 2 (levels -1..1), 4 (-7..7), 8 (-127..127)."""

MAX_BUCKET_SIZE = 1 << 24
"""Largest bucket a decoder accepts (bounds the work one meta value can ask for)."""


def _levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _num_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def _scale_per_bucket_(values: torch.Tensor, scale: torch.Tensor, bucket_size: int) -> None:
    """``values[i] *= scale[i // bucket_size]`` in place, without materializing the repeat."""
    full = values.numel() // bucket_size
    if full:
        values[: full * bucket_size].view(full, bucket_size).mul_(scale[:full, None])
    if values.numel() > full * bucket_size:
        values[full * bucket_size :].mul_(scale[full])


def _per_bucket(flat: torch.Tensor, size: int, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``reduce`` (e.g. an L2 norm, a max magnitude) of each bucket of ``size`` elements of
    ``flat``: float32, one value per bucket. ``reduce(x, dim=1)`` over the full buckets at
    once, ``reduce(x)`` over the shorter last one."""
    numel = flat.numel()
    full = numel // size
    out = torch.empty(_num_buckets(numel, size), dtype=torch.float32)
    if full:
        out[:full] = reduce(flat[: full * size].view(full, size), dim=1)
    if numel > full * size:
        out[full] = reduce(flat[full * size :])
    return out


class BucketedLevelCodec(Codec):
    """What QSGD and the uniform codec share: ``bits``-bit level codes packed on the wire,
    one float32 scale per bucket of ``bucket_size`` elements, one decoder
    (:func:`decode_bucketed_levels`, the scale part named :attr:`SCALE_PART`).

    Raises:
        ConfigError: ``bits`` not in (2, 4, 8) or ``bucket_size`` out of 1 .. 2**24.
    """

    SCALE_PART = ""
    BITS_KEY = "bits"  # the config key named in errors

    def __init__(self, bits: int = 8, bucket_size: int = 512) -> None:
        if isinstance(bits, bool) or bits not in QSGD_BITS:
            raise ConfigError(f"{self.BITS_KEY} must be one of {QSGD_BITS}, got {bits!r}")
        if (
            isinstance(bucket_size, bool)
            or not isinstance(bucket_size, int)
            or not 1 <= bucket_size <= MAX_BUCKET_SIZE
        ):
            raise ConfigError(
                f"bucket_size must be an int in [1, {MAX_BUCKET_SIZE}], got {bucket_size!r}"
            )
        self.bits = bits
        self.bucket_size = bucket_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.bits}, bucket_size={self.bucket_size})"

    def decompress(self, c: Compressed) -> torch.Tensor:
        return decode_bucketed_levels(c, self.name, self.SCALE_PART)

    def estimate_wire_bytes(self, numel: int) -> int:
        return 4 * _num_buckets(numel, self.bucket_size) + packed_nbytes(numel, self.bits)


class QSGDCodec(BucketedLevelCodec):
    """Stochastic ``bits``-bit quantization with one float32 L2 norm per bucket.

    Wire (n = numel, B = ceil(n / bucket_size))::

        norms   float32[B]                      L2 norm of each bucket
        codes   uint8[ceil(n * bits / 8)]       packed offset codes sign*level + s
        meta    {"bits": bits, "bucket_size": bucket_size}
    """

    name = "qsgd"
    SCALE_PART = "norms"
    BITS_KEY = "qsgd_bits"

    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        flat = flat_float32(tensor)
        numel = flat.numel()
        size = self.bucket_size
        s = _levels(self.bits)
        norms = _per_bucket(flat, size, torch.linalg.vector_norm)
        if norms.numel() and not bool(torch.isfinite(norms).all()):
            raise LocalProtocolError(
                "non_finite", "qsgd: a bucket norm is not finite (NaN/inf in the tensor)"
            )
        # Zero-norm buckets get scale 0, so every level there is floor(0 + u) = 0.
        scale = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        level = torch.rand(numel, generator=generator)
        magnitude = flat.abs()
        _scale_per_bucket_(magnitude, scale, size)
        # floor(|x| s / N + u); the clamp only guards |x| / N rounding just above 1.
        level.add_(magnitude).floor_().clamp_(max=s)
        del magnitude
        codes = level.copysign_(flat).add_(s).to(torch.uint8)
        parts = {"norms": norms, "codes": pack_bits(codes, self.bits)}
        meta: dict[str, int | float | str] = {"bits": self.bits, "bucket_size": size}
        return Compressed(self.name, tuple(tensor.shape), dtype_name(tensor), parts, meta)



def decode_qsgd(c: Compressed) -> torch.Tensor:
    """Decode a ``qsgd`` :class:`Compressed` from its parts and meta alone.

    Raises:
        RemoteProtocolError: bad meta, wrong part sizes or dtypes, a norm that is negative
            or not finite, or a code above ``2s``.
    """
    return decode_bucketed_levels(c, QSGDCodec.name, "norms")


def decode_bucketed_levels(c: Compressed, codec: str, scale_part: str) -> torch.Tensor:
    """The decoder shared by the bucketed level codecs (``qsgd``, ``uniform``): offset codes
    ``level + s`` packed in ``bits`` bits, and one float32 scale per bucket under
    ``scale_part``; element ``= level * scale / s``.

    Raises:
        RemoteProtocolError: bad meta, wrong part sizes or dtypes, a scale that is negative
            or not finite, or a code above ``2s``.
    """
    numel = check_header(c, codec)
    check_meta_keys(c, {"bits", "bucket_size"})
    bits = meta_int(c, "bits", 2, 8)
    if bits not in QSGD_BITS:
        raise RemoteProtocolError("bad_meta", f"{codec}: bits must be one of {QSGD_BITS}, got {bits}")
    size = meta_int(c, "bucket_size", 1, MAX_BUCKET_SIZE)
    check_parts(
        c,
        {
            scale_part: (torch.float32, _num_buckets(numel, size)),
            "codes": (torch.uint8, packed_nbytes(numel, bits)),
        },
    )
    scales = c.parts[scale_part]
    if scales.numel() and not bool(torch.isfinite(scales).all() and (scales >= 0).all()):
        raise RemoteProtocolError(f"bad_{codec}_{scale_part.removesuffix('s')}",
                                  f"{codec}: bucket {scale_part} must be finite and >= 0")
    s = _levels(bits)
    codes = unpack_bits(c.parts["codes"].contiguous(), bits, numel)
    if numel and int(codes.max()) > 2 * s:
        raise RemoteProtocolError(f"bad_{codec}_code", f"{codec}: codes must be <= {2 * s}")
    values = codes.to(torch.float32).sub_(s)
    _scale_per_bucket_(values, scales / s, size)
    return values.view(c.shape)
