"""Choosing codecs by name, composing them by tensor size, and decoding any of them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmtrain.compression.base import Codec, Compressed
from swarmtrain.compression.qsgd import QSGDCodec, decode_qsgd
from swarmtrain.compression.simple import FP16Codec, NoneCodec
from swarmtrain.compression.topk import TopKCodec, decode_topk
from swarmtrain.compression.uniform import UniformCodec, decode_uniform
from swarmtrain.errors import ConfigError, RemoteProtocolError

__all__ = ["CODEC_NAMES", "LOSSLESS_CODECS", "SizeAdaptive", "decompress_any", "make_codec"]

CODEC_NAMES = ("none", "fp16", "topk", "qsgd", "uniform")
"""Codec names accepted by :func:`make_codec` (and the ``[compression] type`` config key)."""

LOSSLESS_CODECS = frozenset({"none"})
"""Codec names whose decoding reproduces a float32 input exactly."""

_DECODERS: dict[str, Callable[[Compressed], torch.Tensor]] = {
    "none": NoneCodec().decompress,
    "fp16": FP16Codec().decompress,
    "topk": decode_topk,
    "qsgd": decode_qsgd,
    "uniform": decode_uniform,
}


def decompress_any(c: Compressed) -> torch.Tensor:
    """Decode any codec's output from ``c.codec`` and ``c.meta`` alone.

    The receiver needs no codec configured like the sender's: top-k's ``k`` and QSGD's
    ``bits`` and ``bucket_size`` travel in ``meta``.

    Returns:
        float32 tensor of shape ``c.shape`` (may be a view of ``c.parts`` for ``none``).

    Raises:
        RemoteProtocolError: unknown codec name or malformed parts/meta.
    """
    decoder = _DECODERS.get(c.codec) if isinstance(c, Compressed) else None
    if decoder is None:
        got = c.codec if isinstance(c, Compressed) else type(c).__name__
        raise RemoteProtocolError(
            "unknown_codec", f"codec must be one of {CODEC_NAMES}, got {got!r}"
        )
    return decoder(c)


class SizeAdaptive(Codec):
    """Route small tensors (biases, norms) to ``small`` and the rest to ``large``.

    The :class:`Compressed` carries the name of the codec that was used, so
    :meth:`decompress` (like :func:`decompress_any`) decodes either.
    """

    name = "size_adaptive"

    def __init__(self, large: Codec, small: Codec | None = None, min_numel: int = 1) -> None:
        """Args:
            large: codec for tensors with ``numel >= min_numel``.
            small: codec for smaller tensors (default: ``none``).
            min_numel: size threshold, >= 0.

        Raises:
            ConfigError: ``min_numel`` is not an int >= 0.
        """
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ConfigError(f"min_compress_numel must be an int >= 0, got {min_numel!r}")
        self.large = large
        self.small = small if small is not None else NoneCodec()
        self.min_numel = min_numel
        self.lossless = self.large.lossless and self.small.lossless

    def __repr__(self) -> str:
        return (
            f"SizeAdaptive(large={self.large!r}, small={self.small!r}, min_numel={self.min_numel})"
        )

    def codec_for(self, numel: int) -> Codec:
        """The codec a tensor of ``numel`` elements goes through."""
        return self.small if numel < self.min_numel else self.large

    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        return self.codec_for(tensor.numel()).compress(tensor, generator=generator)

    def decompress(self, c: Compressed) -> torch.Tensor:
        return decompress_any(c)

    def compress_decoded(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> tuple[Compressed, torch.Tensor]:
        return self.codec_for(tensor.numel()).compress_decoded(tensor, generator=generator)

    def subtract_decoded_(self, target: torch.Tensor, c: Compressed) -> None:
        (self.small if c.codec == self.small.name else self.large).subtract_decoded_(target, c)

    def estimate_wire_bytes(self, numel: int) -> int:
        return self.codec_for(numel).estimate_wire_bytes(numel)


def make_codec(
    name: str,
    *,
    topk_ratio: float = 0.1,
    qsgd_bits: int = 8,
    bucket_size: int = 512,
    min_compress_numel: int = 0,
) -> Codec:
    """Build a codec from config values.

    Args:
        name: one of :data:`CODEC_NAMES`.
        topk_ratio: fraction of elements top-k keeps, in (0, 1].
        qsgd_bits: 2, 4 or 8 (QSGD's bits, and uniform's).
        bucket_size: QSGD (and uniform) bucket size, 1 .. 2**24.
        min_compress_numel: when > 0, tensors with fewer elements are sent uncompressed
            (a :class:`SizeAdaptive` wraps the codec).

    Every parameter is validated whichever codec is chosen, so a bad config value is
    reported even while it is unused.

    Raises:
        ConfigError: unknown name or a parameter out of range (the message names it).
    """
    if not isinstance(name, str) or name not in CODEC_NAMES:
        raise ConfigError(f"compression type must be one of {CODEC_NAMES}, got {name!r}")
    codecs: dict[str, Codec] = {
        "none": NoneCodec(),
        "fp16": FP16Codec(),
        "topk": TopKCodec(topk_ratio),
        "qsgd": QSGDCodec(qsgd_bits, bucket_size),
        "uniform": UniformCodec(qsgd_bits, bucket_size),
    }
    adaptive = SizeAdaptive(codecs[name], min_numel=min_compress_numel)
    return adaptive if min_compress_numel > 0 else codecs[name]
