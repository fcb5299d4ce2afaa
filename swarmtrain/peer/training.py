"""Training in peer mode: per-step data-parallel averaging, and DiLoCo.

One *round* ends with one all-reduce. A round's local work (one gradient, or H inner steps)
becomes a *contribution*: a flat float32 buffer, a weight (the samples behind it) and the
round number it belongs to. The loop per round is:

1. do the local work unless a contribution is already pending (kept across failures);
2. at the boundary, apply a new epoch if there is one: rebuild the ring, then every member
   loads the donor's *boundary state* (broadcast) — the weights (and optimizer state) as
   they were at the start of the round. A member whose pending contribution belongs to
   another round drops it and contributes zero with weight zero (a joiner, say);
3. all-reduce the weighted mean; on a broken ring, agree a new epoch and go back to 2
   keeping the contribution;
4. apply the mean (an optimizer step, or DiLoCo's outer Nesterov step); next round.

So every member ends every round with bit-identical weights, a joiner loads the current
state before it contributes, and a failed round is redone rather than lost.

NaN and Inf never reach the weights: a member whose own contribution is not finite sends
zeros with weight zero instead (the others' mean is applied everywhere), and a mean that
is not finite anyway (a member that skipped that check) is applied nowhere: every member
holds the same reduced bits, so all of them skip that round alike (:meth:`Strategy.skip_round`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmtrain import hardware

__all__ = ["Contribution", "Strategy", "StepAveraging", "DiLoCo", "flatten", "unflatten_into"]

log = logging.getLogger("swarmtrain.peer.training")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
NextBatch = Callable[[], Any]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 buffer holding ``tensors`` back to back."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (the inverse of :func:`flatten`)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


@dataclass
class Contribution:
    flat: torch.Tensor
    weight: float
    round: int
    samples: int
    steps: int


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 1


def _adam_state(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Create Adam's state eagerly (so its shape is known before the first step) and list it."""
    out = []
    for p in params:
        st = opt.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out += [st["step"], st["exp_avg"], st["exp_avg_sq"]]
    return out


class Strategy(ABC):
    """What a round computes locally and how the averaged result is applied."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, next_batch: NextBatch, *,
                 lr: float, weight_decay: float, speed: float = 1.0) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.next_batch = next_batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.round_tensor = torch.zeros(1)  # the round counter travels with the state
        self.throttle = hardware.Throttle(speed)
        self.inner = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.last_loss = float("nan")

    @property
    def speed(self) -> float:
        """Fraction of full speed this trainer runs at (its throttle's)."""
        return self.throttle.speed

    @property
    def round(self) -> int:
        return int(self.round_tensor.item())

    @abstractmethod
    def boundary_state(self) -> list[torch.Tensor]:
        """The tensors that define the agreed state at the start of the current round."""

    def after_state_load(self) -> None:  # noqa: B027 - an optional hook
        """Called after the boundary state was overwritten by the donor's."""

    @abstractmethod
    def local_work(self) -> Contribution: ...

    @abstractmethod
    def apply(self, mean: torch.Tensor) -> None:
        """Apply the averaged contribution and move to the next round."""

    def discard_local_work(self) -> None:  # noqa: B027 - an optional hook
        """Called when this round's local work came out non-finite and is not contributed:
        forget whatever local state it left behind."""

    def skip_round(self) -> None:
        """Move to the next round applying nothing (its average was refused): the boundary
        state stays exactly as it was."""
        self.after_state_load()
        self.round_tensor += 1

    def _gradient_step(self) -> int:
        cpu = self.throttle.start()
        batch = self.next_batch()
        loss = self.loss_fn(self.model, batch)
        self.inner.zero_grad(set_to_none=True)
        loss.backward()
        self.last_loss = float(loss.detach())
        self.throttle.pause(cpu)  # rehearse a slower machine (speed < 1)
        return _batch_len(batch)


class StepAveraging(Strategy):
    """Per-step data parallelism: average every gradient, then the same AdamW step everywhere."""

    def boundary_state(self) -> list[torch.Tensor]:
        return [*self.params, *_adam_state(self.inner, self.params), self.round_tensor]

    def local_work(self) -> Contribution:
        samples = self._gradient_step()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return Contribution(flatten(grads), float(samples), self.round, samples, 1)

    def apply(self, mean: torch.Tensor) -> None:
        for p in self.params:
            p.grad = torch.empty_like(p)
        unflatten_into(mean, [p.grad for p in self.params])  # type: ignore[misc]
        self.inner.step()
        self.round_tensor += 1


class DiLoCo(Strategy):
    """DiLoCo: H inner AdamW steps locally, then average the change of the weights and take
    an outer Nesterov SGD step on it (outer lr 0.7, momentum 0.9 by default).

    Args:
        inner_steps: H, inner steps per round (used when ``inner_seconds`` is 0).
        inner_seconds: if > 0, each round's inner loop runs for this long instead, so a fast
            peer does more steps than a slow one instead of waiting for it.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, next_batch: NextBatch, *, lr: float,
                 weight_decay: float, inner_steps: int = 50, inner_seconds: float = 0.0,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, speed: float = 1.0) -> None:
        super().__init__(model, loss_fn, next_batch, lr=lr, weight_decay=weight_decay, speed=speed)
        self.inner_steps = inner_steps
        self.inner_seconds = inner_seconds
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=True)
        self.momentum = [torch.zeros_like(p) for p in self.global_params]
        for p, m in zip(self.global_params, self.momentum):
            self.outer.state[p]["momentum_buffer"] = m

    def boundary_state(self) -> list[torch.Tensor]:
        return [*self.global_params, *self.momentum, self.round_tensor]

    def after_state_load(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)

    def discard_local_work(self) -> None:
        """A non-finite change most likely left NaN in AdamW's moments too, which would spoil
        every later round: the inner optimizer starts afresh, from the global weights."""
        self.inner.state.clear()
        self.after_state_load()

    def local_work(self) -> Contribution:
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
        samples = steps = 0
        deadline = time.monotonic() + self.inner_seconds
        while (steps < self.inner_steps) if self.inner_seconds <= 0 else (
                steps == 0 or time.monotonic() < deadline):
            samples += self._gradient_step()
            self.inner.step()
            steps += 1
        with torch.no_grad():
            delta = [g - p for g, p in zip(self.global_params, self.params)]
        return Contribution(flatten(delta), float(samples), self.round, samples, steps)

    def apply(self, mean: torch.Tensor) -> None:
        for g in self.global_params:
            g.grad = torch.empty_like(g)
        unflatten_into(mean, [g.grad for g in self.global_params])  # type: ignore[misc]
        self.outer.step()  # Nesterov: the outer gradient is the averaged change of the weights
        for g in self.global_params:
            g.grad = None
        self.after_state_load()
        self.round_tensor += 1
