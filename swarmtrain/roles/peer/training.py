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

What a round agrees on is the model's whole trained state (:class:`~swarmtrain.core.modelstate.ModelState`):

- **trained parameters** only: frozen ones are never stepped (they travel with the boundary
  state, bit for bit). A contribution carries, per parameter, a flag worth the peer's weight
  if it computed that parameter this round (a gradient, or any inner step on it) and 0 if
  not (LayerDrop, an unused branch). A peer that did not compute a parameter contributes
  zeros for it, so its mean is the gradient of the mean loss over all the round's samples
  (what one process computes over one batch of them); a parameter nobody computed gets
  ``grad = None`` and is not stepped at all (no decay, no momentum), as in one plain process;
- **buffers** (BatchNorm's running statistics, ``num_batches_tracked``, any persistent float
  or integer buffer): each peer sends how its local work changed them, with a flag per buffer
  as for the parameters; every member adds the weighted mean change (rounded for integer
  buffers) to the agreed value. Between rounds a peer's buffers stay at the agreed value;
- **any parameter dtype**: float16 and bfloat16 parameters are stepped through float32
  master copies (the optimizer state is float32 too) and the model gets the masters cast
  back; a float16 model scales its loss (:class:`~swarmtrain.core.precision.LossScaler`) and an
  overflowed gradient is contributed as zeros with weight 0.

The model and its batches live on ``device``; contributions are float32 CPU buffers (the
ring's), and the mean is copied back to the device.
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

from swarmtrain.core import hardware
from swarmtrain.core.devices import batch_to
from swarmtrain.core.modelstate import ModelState, buffer_changes, master_dtype, snapshot_buffers
from swarmtrain.core.precision import LossScaler
from swarmtrain.core.schedule import LRSchedule

__all__ = ["Contribution", "Strategy", "StepAveraging", "DiLoCo", "flatten", "unflatten_into"]

log = logging.getLogger("swarmtrain.roles.peer.training")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
NextBatch = Callable[[], Any]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 CPU buffer holding ``tensors`` back to back."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (the inverse of :func:`flatten`; any device, any
    dtype: the values are cast)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


@dataclass
class Contribution:
    """One round's local work: ``flat`` (each trained parameter's gradient or change, then each
    synced buffer's change), the weight behind it, and ``flags``: one per parameter, then one
    per buffer, 1 where this peer computed it and 0 where not (None: 1 everywhere)."""

    flat: torch.Tensor
    weight: float
    round: int
    samples: int
    steps: int
    flags: torch.Tensor | None = None


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
    """What a round computes locally and how the averaged result is applied.

    Args:
        model: the user's plain ``nn.Module`` (moved to ``device``).
        loss_fn: ``loss_fn(model, batch)``, a scalar loss.
        next_batch: the next training batch (moved to ``device`` here).
        lr, weight_decay: of the (inner) AdamW, which steps the float32 masters.
        schedule: the learning rate's factor by round (warm-up, decay; default constant): the
            round travels with the agreed state, so every member steps with the same rate.
        speed: fraction of full speed (a throttle, to rehearse a slower machine).
        device: where the model computes (default: where its parameters already are).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, next_batch: NextBatch, *,
                 lr: float, weight_decay: float, speed: float = 1.0,
                 device: torch.device | str | None = None, schedule: LRSchedule | None = None) -> None:
        if device is not None:
            model.to(device)
        first = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu"))
        self.model = model
        self.loss_fn = loss_fn
        self.next_batch = next_batch
        self.state = ModelState(model)
        self.params = list(self.state.trainable.values())
        self.frozen = list(self.state.frozen.values())
        self.buffers = self.state.synced_buffers
        # the optimizer steps these: the parameter itself, or a float32 copy of a half one
        self.masters = [p if master_dtype(p.dtype) == p.dtype
                        else p.detach().to(master_dtype(p.dtype)) for p in self.params]
        self.scaler = LossScaler.for_model(self.params)
        self.round_tensor = torch.zeros(1)  # the round counter travels with the state
        self.throttle = hardware.Throttle(speed)
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.base_lr = lr
        self.schedule = schedule or LRSchedule()
        self.last_loss = float("nan")
        self._shares: torch.Tensor | None = None

    @property
    def speed(self) -> float:
        """Fraction of full speed this trainer runs at (its throttle's)."""
        return self.throttle.speed

    @property
    def round(self) -> int:
        return int(self.round_tensor.item())

    @property
    def learning_rate(self) -> float:
        """The inner optimizer's learning rate in this round: ``lr`` times the schedule's factor."""
        return self.base_lr * self.schedule.factor(self.round)

    def _schedule_inner(self) -> None:
        for group in self.inner.param_groups:
            group["lr"] = self.learning_rate

    @abstractmethod
    def boundary_state(self) -> list[torch.Tensor]:
        """The tensors that define the agreed state at the start of the current round."""

    def after_state_load(self) -> None:
        """Called after the boundary state was overwritten by the donor's: the model gets
        the (cast) masters."""
        self._masters_to_model()

    @abstractmethod
    def local_work(self) -> Contribution: ...

    @property
    def flag_count(self) -> int:
        """Flags in a contribution: one per trained parameter and one per synced buffer."""
        return len(self.params) + len(self.buffers)

    @abstractmethod
    def apply(self, mean: torch.Tensor) -> None:
        """Apply the averaged contribution (the mean of the ``flat`` parts, every member
        having computed every parameter, unless :meth:`apply_average` says otherwise) and
        move to the next round."""

    def apply_average(self, mean: torch.Tensor, shares: torch.Tensor) -> None:
        """Apply the weighted mean of the members' ``flat`` parts, ``shares`` being the mean of
        their flags: for each parameter (then buffer) the share of the total weight behind
        it. A share of 0 means no member computed it: it is left as it is."""
        self._shares = shares
        try:
            self.apply(mean)
        finally:
            self._shares = None

    def discard_local_work(self) -> None:  # noqa: B027 - an optional hook
        """Called when this round's local work came out non-finite and is not contributed:
        forget whatever local state it left behind."""

    def skip_round(self) -> None:
        """Move to the next round applying nothing (its average was refused): the boundary
        state stays exactly as it was."""
        self.after_state_load()
        self.round_tensor += 1

    # -- helpers shared by both strategies ---------------------------------------------------

    def _gradient_step(self) -> tuple[int, list[torch.Tensor | None] | None]:
        """One forward and backward pass: the samples it took and each trained parameter's
        gradient (None where the parameter got none), unscaled for a float16 model — or None
        for all of them if a float16 gradient overflowed (the step is dropped)."""
        cpu = self.throttle.start()
        batch = batch_to(self.next_batch(), self.device)
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(self.model, batch)
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        self.last_loss = float(loss.detach())
        self.throttle.pause(cpu)  # rehearse a slower machine (speed < 1)
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        unscaled = self.scaler.unscale([g for g in grads if g is not None])
        if unscaled is None:
            return _batch_len(batch), None
        found = iter(unscaled)
        return _batch_len(batch), [next(found) if g is not None else None for g in grads]

    def _masters_to_model(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if p is not m:
                    p.copy_(m)

    def _restore_buffers(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, b in self.buffers.items():
                b.copy_(values[name])

    def _contribution(self, per_param: Sequence[torch.Tensor | None], changes: dict[str, torch.Tensor],
                      samples: int, steps: int) -> Contribution:
        """Each parameter's values (zeros where None) and each buffer's change (zeros where
        unchanged), flagged 1 where present. The trainer multiplies values and flags by the
        weight, so after the mean a flag is the share of the weight behind that sum."""
        parts = [v.detach().reshape(-1).to("cpu", torch.float32) if v is not None else torch.zeros(p.numel())
                 for p, v in zip(self.params, per_param)]
        parts += [changes[n].reshape(-1).to(torch.float32) if n in changes else torch.zeros(b.numel())
                  for n, b in self.buffers.items()]
        flags = [0.0 if v is None else 1.0 for v in per_param] + [
            1.0 if n in changes else 0.0 for n in self.buffers]
        return Contribution(torch.cat(parts) if parts else torch.zeros(0), float(samples), self.round,
                            samples, steps, torch.tensor(flags, dtype=torch.float32))

    def _nothing(self, steps: int) -> Contribution:
        """Zeros with weight 0 (every step overflowed): the others' mean is applied here too."""
        size = sum(p.numel() for p in self.params) + sum(b.numel() for b in self.buffers.values())
        return Contribution(torch.zeros(size), 0.0, self.round, 0, steps, torch.zeros(self.flag_count))

    def _unpack(self, mean: torch.Tensor) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
        """Each parameter's mean over all the peers, zeros from those that did not compute it
        (None if none did), and each buffer's mean change over the peers that changed it
        (absent if none did: a buffer a peer's batch did not touch is not a change of 0)."""
        flags = self._shares.tolist() if self._shares is not None else [1.0] * self.flag_count
        values: list[torch.Tensor | None] = []
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            values.append(mean[offset:offset + n].view(p.shape) if flags[i] > 0 else None)
            offset += n
        changes: dict[str, torch.Tensor] = {}
        for j, (name, b) in enumerate(self.buffers.items()):
            n, share = b.numel(), flags[len(self.params) + j]
            if share > 0:
                changes[name] = mean[offset:offset + n].view(b.shape) / share
            offset += n
        return values, changes

    def _apply_buffer_changes(self, changes: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, change in changes.items():
                b = self.buffers[name]
                b.add_((change if b.is_floating_point() else torch.round(change)).to(b.device, b.dtype))

    def _set_grads(self, targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor | None]) -> None:
        for t, v in zip(targets, values):
            t.grad = None if v is None else v.to(t.device, t.dtype)


class StepAveraging(Strategy):
    """Per-step data parallelism: average every gradient, then the same AdamW step everywhere."""

    def boundary_state(self) -> list[torch.Tensor]:
        return [*self.masters, *_adam_state(self.inner, self.masters), *self.frozen,
                *self.state.buffers.values(), self.round_tensor]

    def local_work(self) -> Contribution:
        before = snapshot_buffers(self.buffers)
        samples, grads = self._gradient_step()
        changes = buffer_changes(self.buffers, before)
        self._restore_buffers(before)  # the agreed value until the mean change is applied
        if grads is None:  # float16 overflow: nothing to contribute this round
            return self._nothing(1)
        return self._contribution(grads, changes, samples, 1)

    def apply(self, mean: torch.Tensor) -> None:
        grads, changes = self._unpack(mean)
        self._set_grads(self.masters, grads)
        self._schedule_inner()
        self.inner.step()  # a master with grad None is not stepped at all
        for m in self.masters:
            m.grad = None
        self._masters_to_model()
        self._apply_buffer_changes(changes)
        self.round_tensor += 1


class DiLoCo(Strategy):
    """DiLoCo: H inner AdamW steps locally, then average the change of the weights and take
    an outer Nesterov SGD step on it (outer lr 0.7, momentum 0.9 by default). The buffers
    are averaged at each outer step the same way (their change over the inner loop).

    Args:
        inner_steps: H, inner steps per round (used when ``inner_seconds`` is 0).
        inner_seconds: if > 0, each round's inner loop runs for this long instead, so a fast
            peer does more steps than a slow one instead of waiting for it.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, next_batch: NextBatch, *, lr: float,
                 weight_decay: float, inner_steps: int = 50, inner_seconds: float = 0.0,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, speed: float = 1.0,
                 device: torch.device | str | None = None, schedule: LRSchedule | None = None) -> None:
        super().__init__(model, loss_fn, next_batch, lr=lr, weight_decay=weight_decay, speed=speed,
                         device=device, schedule=schedule)
        self.inner_steps = inner_steps
        self.inner_seconds = inner_seconds
        self.global_params = [m.detach().clone() for m in self.masters]
        self.outer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)  # (torch refuses Nesterov without momentum)
        self.momentum = [torch.zeros_like(p) for p in self.global_params]
        for p, m in zip(self.global_params, self.momentum):
            self.outer.state[p]["momentum_buffer"] = m

    def boundary_state(self) -> list[torch.Tensor]:
        return [*self.global_params, *self.momentum, *self.frozen, *self.state.buffers.values(),
                self.round_tensor]

    def after_state_load(self) -> None:
        with torch.no_grad():
            for m, g in zip(self.masters, self.global_params):
                m.copy_(g)
        self._masters_to_model()

    def discard_local_work(self) -> None:
        """A non-finite change most likely left NaN in AdamW's moments too, which would spoil
        every later round: the inner optimizer starts afresh, from the global weights."""
        self.inner.state.clear()
        self.after_state_load()

    def local_work(self) -> Contribution:
        self.after_state_load()
        self._schedule_inner()  # the inner steps of a round share its rate; the outer lr stays
        before = snapshot_buffers(self.buffers)
        computed = [False] * len(self.params)
        samples = steps = tries = 0
        deadline = time.monotonic() + self.inner_seconds
        while (tries < self.inner_steps) if self.inner_seconds <= 0 else (
                tries == 0 or time.monotonic() < deadline):
            tries += 1
            n, grads = self._gradient_step()
            if grads is None:  # float16 overflow: this inner step is dropped
                continue
            self._set_grads(self.masters, grads)
            self.inner.step()
            for m in self.masters:
                m.grad = None
            self._masters_to_model()
            computed = [c or g is not None for c, g in zip(computed, grads)]
            samples += n
            steps += 1
        changes = buffer_changes(self.buffers, before)
        self._restore_buffers(before)
        with torch.no_grad():
            delta = [g - m if c else None for g, m, c in zip(self.global_params, self.masters, computed)]
        return self._contribution(delta, changes, samples, steps)

    def apply(self, mean: torch.Tensor) -> None:
        delta, changes = self._unpack(mean)
        self._set_grads(self.global_params, delta)
        self.outer.step()  # Nesterov on the averaged change; one nobody changed is not stepped
        for g in self.global_params:
            g.grad = None
        self._apply_buffer_changes(changes)
        self.after_state_load()
        self.round_tensor += 1
