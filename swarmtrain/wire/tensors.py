"""Tensor descriptors and the raw payload layout.

A frame's payload is the raw bytes of its tensors back to back, each starting at an offset
that is a multiple of :data:`ALIGN` (zero padding between). The header lists one descriptor per
tensor: ``[name, dtype, shape, offset, nbytes]``. A receiver rebuilds every tensor with
``torch.frombuffer`` over the one buffer the payload was received into: no per-tensor copies.

torch is imported by the functions that handle tensors, not with this module: a client whose
messages carry none (``swarmtrain ctl``) starts without it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmtrain.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "DTYPES", "TensorDesc", "layout_tensors", "tensor_bytes", "rebuild_tensors"]

#: every tensor starts at a multiple of this many bytes in the payload
ALIGN = 64


class _WireDtypes(Mapping[str, "torch.dtype"]):
    """The dtype names allowed on the wire, each the name of its torch dtype (``"float32"`` ->
    ``torch.float32``). Names are checked without torch; torch is imported when a dtype is
    looked up."""

    _NAMES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8",
              "uint16",  # top-k index_low parts
              "int16", "int32", "int64", "bool")

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in self._NAMES:
            raise KeyError(name)
        return _dtype_maps()[0][name]

    def __contains__(self, name: object) -> bool:
        return name in self._NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(self._NAMES)

    def __len__(self) -> int:
        return len(self._NAMES)


#: dtype names allowed on the wire, and their torch dtypes
DTYPES: Mapping[str, torch.dtype] = _WireDtypes()


@functools.cache
def _dtype_maps() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """(wire name -> torch dtype, torch dtype -> wire name); imports torch."""
    import torch

    by_name = {n: getattr(torch, n) for n in _WireDtypes._NAMES}
    return by_name, {dtype: n for n, dtype in by_name.items()}


def _wire_name(dtype: torch.dtype) -> str | None:
    """The wire name of ``dtype`` (None: the wire cannot carry it)."""
    return _dtype_maps()[1].get(dtype)


_MAX_NAME = 512
_MAX_DIMS = 16
# torch sizes are int64: a larger dim (possible on an empty tensor) would break torch.empty
_MAX_DIM = 2**63


@dataclass(frozen=True)
class TensorDesc:
    """Where one tensor lies in a payload and how to read it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


#: zero bytes that pad a tensor to the next multiple of ALIGN
_PADDING = bytes(ALIGN)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, as a memoryview sharing its memory."""
    import torch

    arr: Any = (t if t.dim() == 1 else t.reshape(-1)).view(torch.uint8).numpy()
    return memoryview(arr)


def layout_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[TensorDesc], list[memoryview | bytes], int]:
    """Plan a payload for ``tensors``.

    Returns:
        (descriptors, segments, payload_length): the segments written back to back are
        the payload (tensor bytes and zero padding), without copying tensor memory.

    Raises:
        LocalProtocolError: a tensor has a dtype the wire cannot carry, or is not on the CPU.
    """
    descs: list[TensorDesc] = []
    segments: list[memoryview | bytes] = []
    offset = 0
    if not tensors:
        return descs, segments, offset
    import torch

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise LocalProtocolError("bad_tensor", f"tensor {name!r} is a {type(t).__name__}")
        wire_dtype = _wire_name(t.dtype)
        if wire_dtype is None:
            raise LocalProtocolError(
                "bad_dtype", f"tensor {name!r} has dtype {t.dtype}; the wire carries {sorted(DTYPES)}"
            )
        if not t.is_cpu:
            raise LocalProtocolError("bad_device", f"tensor {name!r} is on {t.device}; move it to cpu")
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME or t.dim() > _MAX_DIMS:
            # the same rules _parse_desc applies on the receiving side
            raise LocalProtocolError(
                "bad_tensor", f"tensor name must be 1..{_MAX_NAME} characters and rank at most "
                f"{_MAX_DIMS}: {str(name)[:40]!r} of rank {t.dim()}"
            )
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        descs.append(TensorDesc(name, wire_dtype, tuple(t.shape), offset, nbytes))
        if nbytes:
            segments.append(tensor_bytes(t))
        end = offset + nbytes
        pad = _aligned(end) - end
        if pad:
            segments.append(_PADDING[:pad])
        offset = end + pad
    return descs, segments, offset



def _parse_desc(raw: Any, index: int) -> TensorDesc:
    if not (isinstance(raw, list) and len(raw) == 5):
        raise RemoteProtocolError("bad_descriptor", f"tensor descriptor #{index} is not a 5-item list")
    name, dtype, shape, offset, nbytes = raw
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
        raise RemoteProtocolError("bad_descriptor", f"tensor descriptor #{index} has a bad name")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise RemoteProtocolError(
            "bad_dtype", f"tensor {name!r} has dtype {dtype!r}; allowed: {', '.join(sorted(DTYPES))}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _MAX_DIM for d in shape
        )
    ):
        raise RemoteProtocolError("bad_descriptor", f"tensor {name!r} has a bad shape {shape!r}")
    for what, v in (("offset", offset), ("nbytes", nbytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise RemoteProtocolError("bad_descriptor", f"tensor {name!r} has a bad {what} {v!r}")
    return TensorDesc(name, dtype, tuple(shape), offset, nbytes)


def rebuild_tensors(
    raw_descs: Sequence[Any], payload: bytearray, max_tensors: int
) -> dict[str, torch.Tensor]:
    """Rebuild tensors from descriptors over ``payload`` without copying.

    Every descriptor is checked, the cheap way first (:func:`_quick_desc`; no reshape of a
    one-dimensional tensor): a frame of a few hundred tensors (a top-k gradient; an answer
    that chains several log entries has over a thousand) cost about 5 µs per tensor in the
    checks and views, more than receiving its bytes. A descriptor the cheap checks do not
    pass is judged by :func:`_parse_desc`, which says what is wrong.

    Raises:
        RemoteProtocolError: a descriptor is malformed, names a dtype we do not carry, does not
            match its byte count, overlaps another, or points outside the payload.
    """
    if len(raw_descs) > max_tensors:
        raise RemoteProtocolError(
            "too_many_tensors", f"frame carries {len(raw_descs)} tensors; the limit is {max_tensors}"
        )
    out: dict[str, torch.Tensor] = {}
    if not raw_descs:
        return out
    import torch

    by_name = _dtype_maps()[0]
    end_prev = 0
    for i, raw in enumerate(raw_descs):
        desc = _quick_desc(raw, by_name)
        if desc is None:  # the full checks say what is wrong (or accept it after all)
            d = _parse_desc(raw, i)
            desc = (d.name, by_name[d.dtype], d.shape, d.offset, d.nbytes, math.prod(d.shape))
        name, dt, shape, offset, nbytes, numel = desc
        itemsize = dt.itemsize
        if numel * itemsize != nbytes:
            raise RemoteProtocolError(
                "bad_descriptor",
                f"tensor {name!r}: shape {list(shape)} of {raw[1]} needs {numel * itemsize} "
                f"bytes, descriptor says {nbytes}",
            )
        if offset + nbytes > len(payload):
            raise RemoteProtocolError(
                "descriptor_out_of_range",
                f"tensor {name!r} claims bytes [{offset}, {offset + nbytes}) of a "
                f"{len(payload)}-byte payload",
            )
        if offset < end_prev:
            raise RemoteProtocolError(
                "overlapping_tensors",
                f"tensor {name!r} starts at byte {offset}, inside or before the previous "
                f"tensor (which ends at {end_prev}); tensors must follow each other in "
                "payload order",
            )
        if offset % itemsize:
            raise RemoteProtocolError("misaligned", f"tensor {name!r} offset {offset} is misaligned")
        if name in out:
            raise RemoteProtocolError("duplicate_tensor", f"tensor {name!r} appears twice")
        end_prev = offset + nbytes
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            t = torch.frombuffer(payload, dtype=dt, count=numel, offset=offset)
            out[name] = t if len(shape) == 1 else t.view(shape)
    return out


def _quick_desc(raw: Any, by_name: dict[str, torch.dtype]) -> tuple[Any, ...] | None:
    """(name, torch dtype, shape, offset, nbytes, numel) of a descriptor that passes
    :func:`_parse_desc`'s checks the cheap way (exact types, a one-dimensional shape without a
    generator); None for any other, which :func:`_parse_desc` then judges."""
    if type(raw) is not list or len(raw) != 5:
        return None
    name, dtype, shape, offset, nbytes = raw
    dt = by_name.get(dtype) if type(dtype) is str else None
    if (dt is None or type(name) is not str or not name or len(name) > _MAX_NAME or type(shape) is not list
            or type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0):
        return None
    if len(shape) == 1:
        numel = shape[0]
        if type(numel) is not int or not 0 <= numel < _MAX_DIM:
            return None
    elif len(shape) <= _MAX_DIMS and all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        numel = math.prod(shape)
    else:
        return None
    return name, dt, shape, offset, nbytes, numel
