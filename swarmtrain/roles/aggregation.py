"""Bounded asynchrony: the coordinator's aggregation window (``training.aggregate_samples``).

Applying every gradient the moment it arrives makes each one *stale*: it was computed on
weights that other workers' gradients have moved since. Adam on a small transformer pays
dearly for it: GPT-2 (2 layers) with two workers at staleness 1–5 ended 30 % above one
process at equal samples, and dropping the stale gradients brought it back to one process
(``benchmarks/bench_async.py``). A window sums gradients, weighted by their samples (and by
the staleness damping), until they hold ``aggregate_samples`` samples, and takes one Adam
step on their mean. Every gradient is answered at once — with the weights as they are — so
no worker waits for another; a worker's next gradient is computed on the same weights until
the window closes. So the gradients of one window mostly share their weights, the update is
the one a single process would take with that batch, and a slow worker's late gradient
counts in the next window, damped (K-async SGD, Dutta et al. 2018, with the window sized in
samples so that unequal machines fill it unequally).

Per parameter, the mean is over the gradients that carried it: a parameter unused by one
batch (a skipped branch) is averaged over the batches that used it, and one no gradient of
the window carried is not stepped.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["GradientWindow"]


class GradientWindow:
    """A sample-weighted sum of gradients for the parameters ``params`` (name -> master)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._sums = {n: torch.zeros_like(p) for n, p in params.items()}
        self._weights = dict.fromkeys(params, 0.0)
        self.samples = 0
        self.gradients = 0
        self._sparse = False

    def add(self, grads: Mapping[str, torch.Tensor], weight: float, samples: int, *, sparse: bool) -> None:
        """Add ``weight`` x each of ``grads`` (float32, the masters' shapes); count ``samples``."""
        for name, g in grads.items():
            self._sums[name].add_(g.to(self._sums[name].dtype), alpha=weight)
            self._weights[name] += weight
        self.samples += samples
        self.gradients += 1
        self._sparse = self._sparse or sparse

    def take(self) -> tuple[dict[str, torch.Tensor], bool]:
        """The mean gradient of every parameter some gradient carried, and whether any was
        sparse; the window starts empty again (the returned tensors are fresh)."""
        mean = {n: s / self._weights[n] for n, s in self._sums.items() if self._weights[n] > 0}
        sparse = self._sparse
        for s in self._sums.values():
            s.zero_()
        self._weights = dict.fromkeys(self._weights, 0.0)
        self.samples = self.gradients = 0
        self._sparse = False
        return mean, sparse
