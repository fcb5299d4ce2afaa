"""The codec interface: what a compressed tensor looks like and how a codec is called.

A :class:`Compressed` is what travels: a few named, contiguous 1-D CPU tensors (``parts``)
that the wire layer sends back to back without copying, plus a few msgpack-able scalars
(``meta``). Everything a receiver needs to decode is in the :class:`Compressed` itself, so
decoding never depends on how the receiving codec instance was configured.

Decoders treat a :class:`Compressed` as untrusted network input: every check that could
otherwise end in an ``IndexError`` or a torch ``RuntimeError`` is made first and raises
:class:`~swarmtrain.errors.RemoteProtocolError`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarmtrain.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["FLOAT_DTYPES", "FP16_MAX", "Codec", "Compressed"]

FP16_MAX = 65504.0
"""Largest finite float16; fp16 encodings clamp to ±this so no finite value becomes inf."""

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
"""Original dtypes a codec accepts, by the name carried in :attr:`Compressed.dtype`."""
_ACCEPTED_DTYPES = frozenset(FLOAT_DTYPES.values())

# Bounds a shape from the network before anything is allocated from it (2**48 float32
# elements is a petabyte: no real tensor, but every product stays far from int64 overflow).
_MAX_DIM = 2**48
_MAX_NUMEL = 2**48
_MAX_NDIM = 32


@dataclass(frozen=True)
class Compressed:
    """One compressed tensor, ready for the wire.

    Attributes:
        codec: name of the codec that produced it ("none", "fp16", "topk", "qsgd").
        shape: shape of the original tensor.
        dtype: name of the original dtype ("float32", ...); decoding always gives float32.
        parts: named contiguous 1-D CPU tensors to send, e.g. ``{"values": f16, ...}``.
        meta: small scalars the decoder needs (``k``, ``bits``, ``bucket_size``...).
    """

    codec: str
    shape: tuple[int, ...]
    dtype: str
    parts: dict[str, torch.Tensor]
    meta: dict[str, int | float | str] = field(default_factory=dict)

    def wire_bytes(self) -> int:
        """Total bytes of all parts (the payload this tensor adds to a frame)."""
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)


class Codec(ABC):
    """A way to turn a float tensor into a :class:`Compressed` and back.

    Attributes:
        name: the codec name written into :attr:`Compressed.codec`.
        lossless: True when ``decompress(compress(x))`` equals ``x`` exactly (float32 input),
            so error feedback has nothing to keep.
    """

    name: str = ""
    lossless: bool = False

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        """Compress a floating-point tensor.

        Args:
            tensor: any shape (including ``()`` and empty), any float dtype, not requiring grad
                (it is detached). Its values are never modified.
            generator: source of randomness for stochastic codecs (ignored by the others).

        Returns:
            The parts and meta to send. Parts may share memory with ``tensor``.

        Raises:
            LocalProtocolError: the tensor is not floating point.
        """

    @abstractmethod
    def decompress(self, c: Compressed) -> torch.Tensor:
        """Decode into a float32 CPU tensor of shape ``c.shape``.

        The result may share memory with ``c.parts`` (the ``none`` codec returns a view);
        clone it if the parts' buffer will be reused.

        Raises:
            RemoteProtocolError: the parts or meta are malformed or inconsistent.
        """

    @abstractmethod
    def estimate_wire_bytes(self, numel: int) -> int:
        """Exact :meth:`Compressed.wire_bytes` for a tensor of ``numel`` elements."""

    def compress_decoded(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> tuple[Compressed, torch.Tensor]:
        """``compress`` plus what the receiver will decode from it (float32, ``tensor``'s shape),
        for a sender that tracks the receiver's copy; codecs may override it to skip the decode."""
        c = self.compress(tensor, generator=generator)
        return c, self.decompress(c)

    def subtract_decoded_(self, target: torch.Tensor, c: Compressed) -> None:
        """``target -= decompress(c)`` in place, for error feedback on a :class:`Compressed`
        this codec made. ``target``: contiguous float32 with ``c``'s number of elements.
        Codecs may override it to touch only what ``c`` carries."""
        target.view(-1).sub_(self.decompress(c).reshape(-1))


def require_float(tensor: torch.Tensor) -> None:
    """Raise :class:`LocalProtocolError` unless ``tensor`` has one of :data:`FLOAT_DTYPES`."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _ACCEPTED_DTYPES:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise LocalProtocolError(
            "unsupported_dtype", f"codecs compress tensors of {sorted(FLOAT_DTYPES)}, got {got}"
        )


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Detached contiguous 1-D float32 CPU view of ``tensor`` (copies only when it must).

    Raises:
        LocalProtocolError: the tensor is not floating point.
    """
    require_float(tensor)
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        flat = flat.to(device="cpu", dtype=torch.float32)
    return flat.contiguous()


def dtype_name(tensor: torch.Tensor) -> str:
    """Name of a float dtype as carried in :attr:`Compressed.dtype` ("float32", ...)."""
    return str(tensor.dtype).removeprefix("torch.")


def to_fp16_clamped(values: torch.Tensor) -> torch.Tensor:
    """Cast to float16, saturating at ±65504 instead of overflowing to inf; NaN stays NaN."""
    return values.to(torch.float16).clamp_(-FP16_MAX, FP16_MAX)


def check_header(c: Compressed, codec: str) -> int:
    """Validate the fields every codec shares; return the element count.

    Raises:
        RemoteProtocolError: wrong codec name, bad shape or dtype, or non-dict parts/meta.
    """
    if not isinstance(c, Compressed):
        raise RemoteProtocolError("bad_compressed", f"expected Compressed, got {type(c).__name__}")
    if c.codec != codec:
        raise RemoteProtocolError("codec_mismatch", f"expected codec {codec!r}, got {c.codec!r}")
    if (
        not isinstance(c.shape, tuple)
        or len(c.shape) > _MAX_NDIM
        or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in c.shape)
    ):
        raise RemoteProtocolError("bad_shape", f"shape must be a tuple of ints >= 0: {c.shape!r}")
    if math.prod(d for d in c.shape if d) > _MAX_NUMEL:
        raise RemoteProtocolError("bad_shape", f"shape {c.shape!r} is too large")
    if not isinstance(c.dtype, str) or c.dtype not in FLOAT_DTYPES:
        raise RemoteProtocolError(
            "bad_dtype", f"dtype must be one of {sorted(FLOAT_DTYPES)}, got {c.dtype!r}"
        )
    if not isinstance(c.parts, Mapping) or not isinstance(c.meta, Mapping):
        raise RemoteProtocolError("bad_compressed", "parts and meta must be dicts")
    return c.numel


def check_parts(c: Compressed, expected: Mapping[str, tuple[torch.dtype, int]]) -> None:
    """Check that ``c.parts`` holds exactly the expected names, dtypes and lengths.

    Args:
        expected: part name -> (dtype, number of elements).

    Raises:
        RemoteProtocolError: a part is missing, extra, not a 1-D CPU tensor, or of the
            wrong dtype or length.
    """
    if set(c.parts) != set(expected):
        raise RemoteProtocolError(
            "bad_parts",
            f"{c.codec}: expected parts {sorted(expected)}, got {sorted(map(str, c.parts))}",
        )
    for name, (dtype, length) in expected.items():
        part = c.parts[name]
        if not isinstance(part, torch.Tensor) or part.dim() != 1 or part.device.type != "cpu":
            raise RemoteProtocolError("bad_part", f"{c.codec}: part {name!r} is not a 1-D tensor")
        if part.dtype != dtype:
            raise RemoteProtocolError(
                "bad_part_dtype",
                f"{c.codec}: part {name!r} must be {dtype}, got {part.dtype}",
            )
        if part.numel() != length:
            raise RemoteProtocolError(
                "bad_part_size",
                f"{c.codec}: part {name!r} has {part.numel()} elements, expected {length}",
            )


def meta_int(c: Compressed, key: str, low: int, high: int) -> int:
    """Read integer ``c.meta[key]`` and check ``low <= value <= high``.

    Raises:
        RemoteProtocolError: missing, not an int, or out of range.
    """
    value = c.meta.get(key)
    if type(value) is not int or not low <= value <= high:
        raise RemoteProtocolError(
            "bad_meta", f"{c.codec}: meta {key!r} must be an int in [{low}, {high}], got {value!r}"
        )
    return value


def check_meta_keys(c: Compressed, keys: set[str]) -> None:
    """Reject meta with missing or unknown keys (a sender speaking another layout).

    Raises:
        RemoteProtocolError: the key set differs from ``keys``.
    """
    if set(c.meta) != keys:
        raise RemoteProtocolError(
            "bad_meta",
            f"{c.codec}: expected meta keys {sorted(keys)}, got {sorted(map(repr, c.meta))}",
        )
