"""What one stage trains and keeps: its parameters, their master copies, its buffers.

A :class:`StageWeights` sorts a stage's layers with :class:`~swarmtrain.core.modelstate.ModelState`:

- **trainable** parameters are what the stage's optimizer steps. A float16 or bfloat16
  parameter gets a float32 *master* copy (:func:`~swarmtrain.core.modelstate.master_dtype`), as
  mixed-precision training does: the optimizer and its state work on the master, and after
  each step the layer's half-precision parameter is set from it. Gradients are accumulated
  in float32 for these stages, so small updates are not rounded away.
- **frozen** parameters (``requires_grad`` False) are used by the layers and nothing else:
  not in the optimizer, never decayed, never sent to or moved by a replica.
- **synced buffers** (floating and integer buffers that ``state_dict`` keeps: BatchNorm's
  running statistics and ``num_batches_tracked``) change in the stage's training forwards
  and travel with the parameters in replica syncs.

float16 stages scale their gradients with a :class:`~swarmtrain.core.precision.LossScaler` (the
stage's own: see :meth:`StageWeights.absorb`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from swarmtrain.core.modelstate import ModelState, master_dtype
from swarmtrain.core.precision import LossScaler

__all__ = ["StageWeights", "SyncMismatch"]


class SyncMismatch(ValueError):
    """A replica's tensors do not fit this stage (missing, other shape or kind, not finite)."""


class StageWeights:
    """Trainable parameters (with float32 masters for half-precision ones), frozen
    parameters and synced buffers of one stage's layers (see the module docstring).

    Args:
        layers: the stage's layers, already on their device.

    Raises:
        ConfigError: a trainable parameter has a dtype that cannot be trained (integer,
            complex); the message names it.
    """

    def __init__(self, layers: nn.Module) -> None:
        state = ModelState(layers)
        self.trainable = state.trainable
        self.frozen = state.frozen
        self.buffers = state.synced_buffers
        with torch.no_grad():
            self.masters = {name: p.detach().to(master_dtype(p.dtype)).clone()
                            for name, p in self.trainable.items() if master_dtype(p.dtype) != p.dtype}
        self.scaler = LossScaler.for_model(self.trainable.values())
        # Move gradients out of the layers after every backward (to unscale them and to sum
        # them in float32); fp32 stages let autograd sum them in place, as one process does.
        self._collect = bool(self.masters) or self.scaler.enabled
        self._sums: dict[str, torch.Tensor] = {}

    def optimized(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps: each trainable parameter's master, or itself."""
        return [self.masters.get(name, p) for name, p in self.trainable.items()]

    def absorb(self, extra: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Take the gradients a backward left in the layers into the step's sums.

        With a loss scale (float16 stages), the gradients and ``extra`` (the input gradient
        for upstream) are divided by it in float32; None means they overflowed: nothing was
        taken, the scale has been halved, and the caller redoes the backward with it.

        Returns:
            ``extra`` (unscaled, float32, when there is a loss scale), or None.
        """
        if not self._collect:
            return extra
        names = [n for n, p in self.trainable.items() if p.grad is not None]
        grads = [self.trainable[n].grad for n in names]
        unscaled = self.scaler.unscale([g for g in grads if g is not None] + extra)
        for p in self.trainable.values():
            p.grad = None  # a parameter with no gradient in any backward stays without one
        if unscaled is None:
            return None
        with torch.no_grad():
            for name, g in zip(names, unscaled, strict=False):
                wide = g.to(master_dtype(g.dtype))
                total = self._sums.get(name)
                self._sums[name] = wide.clone() if total is None else total.add_(wide)
        return unscaled[len(names):]

    def grad_sq(self, microbatches: int) -> float:
        """The squared 2-norm of the mean gradient so far (the sums over ``microbatches``), in
        float64: a stage's share of the whole model's norm, which the trainer clips."""
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            grads = self._sums.values() if self._collect else (
                p.grad for p in self.trainable.values() if p.grad is not None)
            for g in grads:
                total += (g.detach().double() / microbatches).pow(2).sum().cpu()
        return float(total)

    def step(self, optimizer: torch.optim.Optimizer | None, microbatches: int, grad_clip: float,
             lock: threading.Lock, scale: float = 1.0) -> None:
        """Average the summed gradients over ``microbatches``, multiply them by ``scale`` (the
        trainer's clipping of the whole model's norm), clip their norm to ``grad_clip`` (0 = no
        clipping), step ``optimizer``, copy masters into the layers.
        Parameters that got no gradient keep ``grad`` None, so the optimizer skips them (no
        step, no decay, no moment update), as torch optimizers do in one process. No
        optimizer (a stage without trainable parameters): nothing to do."""
        if optimizer is None:
            return
        targets = self.optimized()
        with torch.no_grad():
            if self._collect:
                for name, total in self._sums.items():
                    self.masters.get(name, self.trainable[name]).grad = total.div_(microbatches)
                self._sums.clear()
            else:
                for p in targets:
                    if p.grad is not None:
                        p.grad.div_(microbatches)
        if scale != 1.0:
            with torch.no_grad():
                for p in targets:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        if grad_clip > 0:
            nn.utils.clip_grad_norm_(targets, grad_clip)
        with lock:
            optimizer.step()
            self._publish_masters()
        optimizer.zero_grad(set_to_none=True)

    def discard_sums(self) -> None:
        """Drop the gradients summed since the last step (they belong to weights replaced)."""
        self._sums.clear()
        for p in [*self.trainable.values(), *self.masters.values()]:
            p.grad = None

    def synced(self) -> dict[str, torch.Tensor]:
        """The live tensors a replica sync exchanges, by name: each trainable parameter's
        master (or itself) and each synced buffer. Frozen parameters are not among them."""
        return {**{n: self.masters.get(n, p) for n, p in self.trainable.items()}, **self.buffers}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of :meth:`synced`."""
        return {n: t.detach().to("cpu", copy=True) for n, t in self.synced().items()}

    def check_sync(self, theirs: Mapping[str, torch.Tensor]) -> None:
        """Refuse a replica's tensors that would not fit.

        Raises:
            SyncMismatch: a tensor is missing, of another shape, floating where it should be
                integer (or the other way), or holds NaN or infinite values.
        """
        for name, own in self.synced().items():
            other = theirs.get(name)
            what = "buffer" if name in self.buffers else "parameter"
            if (other is None or other.shape != own.shape
                    or other.is_floating_point() != own.is_floating_point() or other.dtype == torch.bool):
                raise SyncMismatch(f"replica sync: {what} {name!r} missing or of another shape/dtype")
            if other.is_floating_point() and not bool(torch.isfinite(other).all()):
                raise SyncMismatch(f"replica sync: {what} {name!r} holds NaN or infinite values")

    def move_towards(self, mine: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor],
                     lock: threading.Lock, fraction: float = 0.5) -> None:
        """Move ``fraction`` of the way (0.5: halfway; 1: all the way) to the other replica,
        keeping the work done since ``mine`` was taken.

        Floating tensors (parameters' masters, running statistics) get ``(theirs - mine) x
        fraction``; with fraction 1 integer buffers take theirs too.
        Integer buffers (``num_batches_tracked``) go to the larger of the two counts, plus
        what they counted since: a counter never goes back, two replicas that did not train
        during the round agree on it, and a fresh replica that joins does not halve the
        count of an experienced one (the rounded mean would do both of the latter).

        Raises:
            SyncMismatch: see :meth:`check_sync` (nothing is then changed).
        """
        self.check_sync(theirs)
        with lock, torch.no_grad():
            for name, own in self.synced().items():
                a = mine[name].to(own.device)
                b = theirs[name].to(own.device)
                if own.is_floating_point() and fraction == 1.0:  # theirs exactly, plus work since
                    own.copy_(b.to(own.dtype) + (own - a.to(own.dtype)))
                elif own.is_floating_point():
                    own.add_((b.to(own.dtype) - a.to(own.dtype)) * fraction)
                elif fraction == 1.0:  # take theirs (plus what this one counted since)
                    own.add_((b.to(a.dtype) - a).to(own.dtype))
                else:
                    own.add_((torch.maximum(a, b.to(a.dtype)) - a).to(own.dtype))
            self._publish_masters()

    @contextlib.contextmanager
    def buffers_kept(self, *, only_on_error: bool = False) -> Iterator[None]:
        """Run a block, then put the synced buffers back as they were before it: a
        recomputation of a forward must not change them again (its first run did). With
        ``only_on_error``, only when the block raises (a forward that was refused)."""
        if not self.buffers:
            yield
            return
        saved = {n: b.detach().clone() for n, b in self.buffers.items()}
        failed = True
        try:
            yield
            failed = False
        finally:
            if failed or not only_on_error:
                with torch.no_grad():
                    for n, b in self.buffers.items():
                        b.copy_(saved[n])

    def _publish_masters(self) -> None:
        with torch.no_grad():
            for name, master in self.masters.items():
                self.trainable[name].copy_(master)
