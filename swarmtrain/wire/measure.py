"""Sums of squares of a payload's float tensors, taken while the payload arrives.

A coordinator reads every gradient once to screen it (the L2 norm finds NaN and inf and feeds
the outlier screen) before Adam may touch a weight. Read after the frame is complete, that
pass streams the whole gradient from main memory again: 40 MB for a 10M-parameter float32
gradient, 2-5 ms on the apply thread here. Read while the bytes arrive, a few hundred KiB
after the socket copied them into the payload buffer, the same pass reads from cache, on the
receiving (event loop) thread, while the apply thread steps the previous gradient.

The decoder (:mod:`swarmtrain.wire.frame`) makes a :class:`PayloadMeasure` from the header of
a frame whose type asks for one (GRADIENTS by default), calls :meth:`PayloadMeasure.advance`
as bytes are received, and hands the sums over with the message's tensors
(:class:`MeasuredTensors`). The sums are this node's own arithmetic over the bytes it holds,
the same bytes the tensors are views of; nothing the sender claims about them is used.

Needs swarmtrain's C kernels (:mod:`swarmtrain.compression.kernels`), which register their sum
here once they are built (:func:`use_kernel`: the wire layer imports nothing above it); until
then, or without them, no frame is measured and a coordinator computes the norm itself, after
the frame, as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from swarmtrain.wire.tensors import ALIGN

if TYPE_CHECKING:  # (torch is imported where tensors are built, not by importing the wire)
    import torch

    _TensorDict = dict[str, torch.Tensor]
else:
    _TensorDict = dict

__all__ = ["WINDOW", "MeasuredTensors", "PayloadMeasure", "use_kernel"]

#: bytes received between two measuring calls, at most (but the last of a payload): small
#: enough that they are still in the core's cache when measured, large enough that the calls
#: cost nothing next to the copy
WINDOW = 1 << 19
_SIZES = {"float32": 4, "float16": 2}

#: ``Kernels.sumsq_ranges`` once the C kernels are built (None: nothing is measured)
_sumsq_ranges: Callable[..., None] | None = None


def use_kernel(sumsq_ranges: Callable[..., None] | None) -> None:
    """Measure payloads with ``sumsq_ranges`` (the loaded kernels' method; None: stop)."""
    global _sumsq_ranges
    _sumsq_ranges = sumsq_ranges


class MeasuredTensors(_TensorDict):
    """A message's tensors (name -> tensor, as a plain dict) and ``sumsq``: name -> the sum
    of squares of that float32 / float16 tensor's elements (in double; NaN or inf when it
    holds them), computed as its bytes arrived. Other tensors have no entry."""

    __slots__ = ("sumsq",)

    def __init__(self, tensors: dict[str, torch.Tensor], sumsq: dict[str, float]) -> None:
        super().__init__(tensors)
        self.sumsq = sumsq


class PayloadMeasure:
    """The running sums of squares over one payload's float tensors."""

    __slots__ = ("_sum", "_names", "_ranges", "_out", "_done", "_view", "_addr")
    # _ranges: 4 int64 per float tensor (start, end, element size, bytes summed so far)

    def __init__(self, sumsq_ranges: Callable[..., None], names: list[str], flat: list[int]) -> None:
        self._sum = sumsq_ranges
        self._names = names
        self._ranges = (ctypes.c_int64 * len(flat))(*flat)
        self._out = (ctypes.c_double * len(names))()
        self._done = 0  # payload bytes measured so far
        self._view: Any = None  # keeps the buffer's address valid while it is measured
        self._addr = 0

    @classmethod
    def plan(cls, descs: Sequence[Any], payload_len: int) -> PayloadMeasure | None:
        """A measure for a payload of ``payload_len`` bytes laid out by ``descs`` (the
        header's ``[name, dtype, shape, offset, nbytes]`` entries, not yet checked), or None:
        no float tensor, no kernels, or an entry the decoder will refuse anyway."""
        names: list[str] = []
        flat: list[int] = []
        for d in descs:
            if not (isinstance(d, list) and len(d) == 5):
                return None
            name, dtype, _shape, offset, nbytes = d
            size = _SIZES.get(dtype) if isinstance(dtype, str) else None
            if size is None:
                continue
            if not (isinstance(name, str) and type(offset) is int and type(nbytes) is int
                    and 0 <= offset and offset % ALIGN == 0 and 0 <= nbytes
                    and nbytes % size == 0 and offset + nbytes <= payload_len):
                return None
            names.append(name)
            flat += (offset, offset + nbytes, size, offset)
        fn = _sumsq_ranges
        return cls(fn, names, flat) if names and fn is not None else None

    def advance(self, buf: bytearray, filled: int) -> None:
        """``buf`` (the payload buffer) holds its first ``filled`` bytes: measure what arrived
        since the last call once a window's worth has, or the payload is complete (the sums
        do not depend on how the payload was cut as it arrived)."""
        complete = filled == len(buf)
        if not complete and filled - self._done < WINDOW:
            return
        if self._view is None:
            self._view = (ctypes.c_char * len(buf)).from_buffer(buf)
            self._addr = ctypes.addressof(self._view)
        self._sum(self._addr, self._ranges, len(self._names), filled, self._out)
        self._done = filled
        if complete:
            self._view = None  # (the bytearray may be resized or freed again)

    def sums(self) -> dict[str, float]:
        """name -> sum of squares; valid once :meth:`advance` saw the payload complete."""
        return dict(zip(self._names, self._out))
