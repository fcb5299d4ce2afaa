"""Payload buffers handed out again once nothing refers to them.

A frame's payload is received straight into one bytearray, and its tensors are views of it
(``torch.frombuffer``). A fresh bytearray of tens of MB is fresh memory from the kernel: every
4 KiB page of it faults the first time the socket writes it. Measured here, receiving a
40 MB gradient (a 10M-parameter model in float32) into a fresh buffer took 36-42 ms, 26-30 ms
of them in the kernel; into a buffer used before, 5 ms. Gradients and answers of one model
have the same few sizes every time, so a buffer can nearly always be used again.

A buffer is used again only when **nothing else refers to it**: every tensor built over it
(and every view of those), memoryview, ctypes or numpy array over it holds a reference to the
bytearray, so a buffer whose reference count shows only the pool's own is not read or written
by anyone. The pool never decides when a message is "done"; the last reference does.

Bounded: buffers nobody uses are kept up to ``max_idle_bytes`` (default: twice the largest
payload taken so far, so a process's idle buffers do not grow with the number of
connections); the oldest beyond that are let go. Payloads under ``min_bytes`` come from the
ordinary allocator (small blocks are reused by it without page faults).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["MIN_BYTES", "PAGE", "PAYLOADS", "PayloadPool", "phase_pad", "phased_floats", "pooled_bytes",
           "pooled_floats"]

#: payloads smaller than this are not pooled
MIN_BYTES = 1 << 20


def _idle_indexes(bufs: list[bytearray]) -> list[int]:
    """The indexes of the buffers in ``bufs`` that nothing but ``bufs`` refers to."""
    return [i for i in range(len(bufs)) if sys.getrefcount(bufs[i]) == _IDLE_REFS]


# what getrefcount says of a buffer only a list refers to, asked as _idle_indexes asks (the
# list's reference and the call's argument): measured, not assumed
_probe = [bytearray(1)]
_IDLE_REFS = sys.getrefcount(_probe[0])
del _probe


class PayloadPool:
    """Bytearrays of exact sizes, reused once only the pool refers to them.

    Args:
        max_idle_bytes: idle buffers kept at most (None: twice the largest payload taken).
        min_bytes: payloads below this size get a plain new bytearray.
    """

    def __init__(self, max_idle_bytes: int | None = None, min_bytes: int = MIN_BYTES) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes
        self._bufs: list[bytearray] = []  # every pooled buffer, least recently taken first
        self._largest = 0
        self._lock = threading.Lock()
        #: payloads served from a buffer used before / from a new one (pooled sizes only)
        self.reused = 0
        self.allocated = 0

    def take(self, n: int) -> bytearray:
        """A bytearray of ``n`` bytes nobody else refers to (its contents are old bytes: the
        caller overwrites every one before it reads any)."""
        if n < self.min_bytes:
            return bytearray(n)
        with self._lock:
            buf = None
            for i in _idle_indexes(self._bufs):
                if len(self._bufs[i]) == n:
                    buf = self._bufs.pop(i)
                    self.reused += 1
                    break
            if buf is None:
                buf = bytearray(n)
                self.allocated += 1
                self._largest = max(self._largest, n)
            self._bufs.append(buf)  # most recently taken last
            self._trim()
            return buf

    def idle_bytes(self) -> int:
        """Bytes of the buffers kept that nobody uses now."""
        with self._lock:
            return sum(len(self._bufs[i]) for i in _idle_indexes(self._bufs))

    def in_use(self) -> int:
        """How many of the buffers kept are referred to from outside the pool now."""
        with self._lock:
            return len(self._bufs) - len(_idle_indexes(self._bufs))

    def kept_bytes(self) -> int:
        """Bytes of every buffer the pool keeps, in use or not."""
        with self._lock:
            return sum(len(b) for b in self._bufs)

    def _trim(self) -> None:
        """Let the oldest idle buffers go until those kept idle fit the bound."""
        bound = 2 * self._largest if self.max_idle_bytes is None else self.max_idle_bytes
        idle = _idle_indexes(self._bufs)
        total = sum(len(self._bufs[i]) for i in idle)
        drop = []
        for i in idle:  # oldest first
            if total <= bound:
                break
            total -= len(self._bufs[i])
            drop.append(i)
        for i in reversed(drop):
            del self._bufs[i]


#: the process's pool, used by every :class:`~swarmtrain.wire.frame.Decoder`
PAYLOADS = PayloadPool()

#: the span of address bits a CPU compares to tell whether a load may depend on an earlier
#: store (x86: the low 12): streams whose addresses agree there slow each other down
PAGE = 4096


def phase_pad(address: int, phase: int | None, align: int = 64) -> int:
    """Bytes to skip from ``address`` to the first address that is ``phase`` modulo
    :data:`PAGE` (``phase`` None: the first multiple of ``align``)."""
    if phase is None:
        return -address % align
    return (phase - address) % PAGE


def pooled_bytes(nbytes: int, *, phase: int | None = None, pool: PayloadPool | None = None) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` (old contents: the caller writes every one) over a buffer
    of ``pool`` (default :data:`PAYLOADS`): memory used before, once nothing refers to it,
    instead of fresh pages. It starts on a 64-byte boundary, or at ``phase`` modulo
    :data:`PAGE` (see :func:`phased_floats`), so slices of it at multiples of 64 bytes can
    be viewed as any dtype. The tensor and every view of it keep the buffer taken."""
    import torch  # (the wire layer does not import torch at import time)

    buf = (pool or PAYLOADS).take(nbytes + PAGE)
    pad = phase_pad(torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr(), phase)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=pad)


def pooled_floats(count: int, *, phase: int | None = None, pool: PayloadPool | None = None) -> torch.Tensor:
    """:func:`pooled_bytes` as a float32 tensor of ``count`` elements."""
    import torch

    return pooled_bytes(4 * count, phase=phase, pool=pool).view(torch.float32)


def phased_floats(count: int, phase: int) -> torch.Tensor:
    """A new zero float32 tensor of ``count`` elements whose address is ``phase`` modulo
    :data:`PAGE`. Arrays a kernel streams through together (weights, the two moments, the
    copy it writes) each get their own phase: big allocations all start at the same offset
    in a page, so element i of each shares its low 12 address bits with element i of the
    others, and the CPU then holds loads back behind unrelated stores ("4K aliasing":
    measured 1.2 ms of a 7.9 ms Adam step over 10M parameters, 3.4 ms with a snapshot
    written beside it)."""
    import torch

    base = torch.zeros(count + PAGE // 4, dtype=torch.float32)
    start = phase_pad(base.data_ptr(), phase) // 4
    return base[start:start + count]
