"""A worker's own random stream for drawing its batches, so that workers started alike differ.

A user's training script typically calls ``torch.manual_seed(0)`` and hands the worker a
shuffling ``DataLoader``. A ``DataLoader`` without a ``generator=`` draws its shuffling seed
(and its worker processes' base seed) from torch's global generator when an epoch starts:
two workers started alike would see the same batches in the same order. :class:`OwnRandomness`
gives each worker a stream of its own, derived from the seed and the worker (its id if one was
given, else its number at the coordinator: see ``Worker``), and swaps it in
only while the worker draws a batch: the host program's generator state is exactly what it was
(it is saved and restored; no draw of the host's is consumed by the data). A ``DataLoader``
with its own ``generator=`` is handled the same way (its state is swapped too), so such
workers also differ without being given different seeds. The forward pass (dropout) draws
from torch's generator as it does in one plain process.

Torch's generator is one per process, so the swaps hold a process-wide lock (several workers
in one process draw their batches one at a time). Not covered: iterables that shuffle with
Python's ``random`` or NumPy, and other threads of the host program drawing from torch's
global generator while a batch is drawn.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from swarmtrain.errors import TaskError

__all__ = ["CycledIterable", "OwnRandomness", "loader_generators", "worker_seed"]

_SWAP = threading.RLock()  # torch's global generator is the process's: one stream at a time


def worker_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed derived from ``seed`` and ``parts`` (e.g. the worker id, a shard index)."""
    text = "/".join(str(p) for p in (seed, *parts)).encode()
    return (zlib.crc32(text) << 31 | zlib.crc32(text[::-1])) & (2**63 - 1)


def loader_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader-like ``data`` shuffles with (its own
    ``generator`` and its sampler's), without duplicates."""
    found: list[torch.Generator] = []
    for owner in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None),
                  getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and g.device.type == "cpu" and all(g is not f for f in found):
            found.append(g)
    return found


class OwnRandomness:
    """Torch's global CPU generator (and the given generators) replaced by a stream of this
    worker's own for the duration of ``with randomness:``.

    Args:
        seed: the stream's seed (see :func:`worker_seed`).
        generators: other generators to give a stream of their own (a DataLoader's).
        cuda: also swap the current CUDA device's generator (dropout on a GPU draws there).
    """

    def __init__(self, seed: int, generators: Iterable[torch.Generator] = (), *, cuda: bool = False) -> None:
        self._generators = list(generators)
        self._cuda = cuda and torch.cuda.is_available()
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Start the stream (and the generators' own streams) afresh from ``seed``."""
        with _SWAP:
            self._state = torch.Generator().manual_seed(seed).get_state()
            self._own = [torch.Generator().manual_seed(worker_seed(seed, "loader", i)).get_state()
                         for i in range(len(self._generators))]
            self._cuda_state: torch.Tensor | None = None

    def __enter__(self) -> OwnRandomness:
        _SWAP.acquire()
        self._outer = torch.get_rng_state()
        torch.set_rng_state(self._state)
        self._outer_gens = [g.get_state() for g in self._generators]
        for g, own in zip(self._generators, self._own):
            g.set_state(own)
        if self._cuda:
            self._outer_cuda = torch.cuda.get_rng_state()
            if self._cuda_state is None:
                torch.cuda.manual_seed(int(self._state[:8].sum()))
            else:
                torch.cuda.set_rng_state(self._cuda_state)
        return self

    def __exit__(self, *exc: object) -> None:
        self._state = torch.get_rng_state()
        torch.set_rng_state(self._outer)
        self._own = [g.get_state() for g in self._generators]
        for g, outer in zip(self._generators, self._outer_gens):
            g.set_state(outer)
        if self._cuda:
            self._cuda_state = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self._outer_cuda)
        _SWAP.release()


class CycledIterable:
    """Batches of an iterable, started again when it ends (every pass in a new order for a
    shuffling DataLoader). Call :meth:`next` inside the worker's :class:`OwnRandomness`."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data
        self._iter: Iterator[Any] | None = None

    def next(self) -> Any:
        if self._iter is None:
            self._iter = iter(self.data)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.data)
            try:
                return next(self._iter)
            except StopIteration:
                raise TaskError("the worker's data yields no batch at all (an empty DataLoader?)") from None
