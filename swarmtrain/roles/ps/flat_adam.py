"""The coordinator's Adam step in one pass over memory: the fused kernel over flat masters.

torch's fused CPU Adam reads and writes the weights and both moments once per step, but the
coordinator's apply also decodes the gradient (a float32 pass of its own for fp16, a
full-size scatter for top-k) and publishes the new weights into the downlink (another pass
over them and the published copy). Here all of it is one pass of ``kernels.c``'s
``st_adam_apply``: the gradient is read as it arrived (float32, float16, or top-k parts
decoded 65536 at a time into a cache-sized buffer), and each block of new weights is
published while it is still in cache.

It steps the state of the coordinator's ``torch.optim.Adam`` itself: ``exp_avg`` and
``exp_avg_sq`` become views of two flat buffers, ``step`` stays the per-parameter tensor
torch keeps, so checkpoints (``adam_state_to_tensors``) and ``--resume`` see an ordinary
Adam, and a state that ``load_state_dict`` replaced is copied back into the flat buffers
before the next step. The arithmetic is torch's fused Adam with decoupled weight decay,
operation for operation (tests/test_kernels.py); the held-variance step for top-k is
``adam.held_variance_step``'s.

Used when the masters are one flat float32 CPU buffer and the kernels are built
(:func:`FlatAdam.create` returns None otherwise, and the coordinator steps torch's Adam).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmtrain.compression.kernels import (
    G_F16,
    G_F32,
    G_NONE,
    G_TOPK,
    PUB_HALF,
    PUB_SNAPSHOT,
    Kernels,
    Publication,
    kernels,
)
from swarmtrain.compression.topk import TopKParts
from swarmtrain.roles.ps.adam import HELD_MAX_RATIO, VARIANCE_STEPS
from swarmtrain.roles.ps.common import FUSED, LazyGradient
from swarmtrain.wire.pool import PAGE, phased_floats

__all__ = ["COPY_PHASE", "FlatAdam", "phase_after"]

#: where the arrays the kernel streams through beside the weights start, in bytes past the
#: weights' own offset in a page (:func:`~swarmtrain.wire.pool.phased_floats`): the two
#: moments, and the copy a publication writes (the lossless snapshot or the published weights)
MOMENT1_PHASE, MOMENT2_PHASE, COPY_PHASE = 1024, 2048, 3072


def phase_after(t: torch.Tensor, delta: int) -> int:
    """The page phase ``delta`` bytes past ``t``'s (for an array streamed beside it)."""
    return (t.data_ptr() + delta) % PAGE

log = logging.getLogger("swarmtrain.coordinator")


class FlatAdam:
    """Steps ``optimizer`` (one param group over ``params``, views of ``flat`` in order) with
    the fused kernel. Make it with :meth:`create`."""

    def __init__(self, optimizer: torch.optim.Optimizer, flat: torch.Tensor,
                 params: Mapping[str, torch.Tensor], fast: Kernels) -> None:
        self.optimizer = optimizer
        self.flat = flat
        self.names = list(params)
        self.params = list(params.values())
        self._fast = fast
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.exp_avg = phased_floats(flat.numel(), phase_after(flat, MOMENT1_PHASE))
        self.exp_avg_sq = phased_floats(flat.numel(), phase_after(flat, MOMENT2_PHASE))
        self._m_views = [t.view(p.shape) for t, p in zip(self.exp_avg.split(self.sizes), self.params)]
        self._v_views = [t.view(p.shape) for t, p in zip(self.exp_avg_sq.split(self.sizes), self.params)]
        #: every parameter's step count (its state's "step" is a 0-dim view of it): one add
        #: and one read per step instead of one per tensor
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)
        self._steps_np = self.steps.numpy()  # (the same memory: numpy's add costs a torch op's tenth)
        self._step_views = [self.steps[i] for i in range(len(self.params))]
        #: every parameter's state, in order, once all have one and while that state dict is bound
        self._all_states: list[dict[str, Any]] | None = None
        self._no_snapshot = [0] * len(self.params)
        #: the state dict last bound and its size (held, so that no new dict can take its id)
        self._bound: tuple[Any, int] | None = None

    @classmethod
    def create(cls, optimizer: torch.optim.Optimizer, flat: torch.Tensor | None,
               params: Mapping[str, torch.Tensor]) -> FlatAdam | None:
        """A FlatAdam when the kernels are built and the layout and settings are ones it
        computes exactly as torch does (else None, said once in the log)."""
        why = _unsupported(optimizer, flat, params)
        fast = kernels() if not why else None
        if why:
            log.info("Adam runs in torch, not the fused kernel: %s", why)
        if fast is None or flat is None:
            return None
        return cls(optimizer, flat, params, fast)

    def _bind(self) -> None:
        """Make the optimizer's state views of the flat buffers (copied in where they are
        not: after ``load_state_dict``, which makes a new state dict, or on the first step).
        Only this class steps the optimizer once it exists, so a state dict it bound and
        that has not changed size is still bound."""
        state = self.optimizer.state
        if self._bound is not None and self._bound[0] is state and self._bound[1] == len(state):
            return
        self._all_states = None  # (the dicts of the state bound before)
        for p, m, v, t in zip(self.params, self._m_views, self._v_views, self._step_views):
            s = state.get(p)
            if not s:
                continue
            with torch.no_grad():
                if s.get("exp_avg") is not m:
                    m.copy_(s["exp_avg"])
                    s["exp_avg"] = m
                if s.get("exp_avg_sq") is not v:
                    v.copy_(s["exp_avg_sq"])
                    s["exp_avg_sq"] = v
                if s.get("step") is not t:
                    t.copy_(s["step"])
                    s["step"] = t
        self._bound = (state, len(state))

    def _states(self, stepped: Sequence[int]) -> list[dict[str, Any]]:
        """The state of every stepped parameter, made as torch's fused Adam makes it on a
        parameter's first step (a float32 step tensor, zero moments)."""
        state = self.optimizer.state
        cached = self._all_states  # (valid while _bind keeps the state it bound)
        if cached is not None and len(stepped) == len(cached):
            return cached
        out = []
        for i in stepped:
            p = self.params[i]
            s = state.get(p)
            if not s:
                s = state[p] = {"step": self._step_views[i].zero_(),
                                "exp_avg": self._m_views[i].zero_(),
                                "exp_avg_sq": self._v_views[i].zero_()}
            out.append(s)
        self._bound = (state, len(state))  # (what was added is bound)
        self._all_states = out if len(out) == len(self.params) else None
        return out

    def can_hold(self, grads: Mapping[str, LazyGradient]) -> bool:
        """Would :func:`adam.held_variance_step` hold the second moment for these gradients
        (every parameter they step has had dense steps)?"""
        state = self.optimizer.state
        return bool(grads) and all((state.get(p) or {}).get(VARIANCE_STEPS)
                                   for n, p in zip(self.names, self.params) if n in grads)

    @torch.no_grad()
    def step(self, grads: Mapping[str, LazyGradient], lr: float, *, held: bool,
             publication: Publication | None = None,
             snapshot: torch.Tensor | None = None) -> tuple[int, float, float]:
        """One step on ``grads`` (name -> gradient; a parameter without one is not stepped,
        as torch skips ``grad is None``; or :data:`FUSED` -> every parameter's gradient in one
        vector, in order) at ``lr``: plain Adam, or with ``held`` the
        held-variance step (the caller checked :meth:`can_hold`). With ``publication`` the
        new weights are published as they are written; with ``snapshot`` (a vector of as many
        elements as the weights) they are also copied there: float32 exactly, float16 rounded
        (saturating at ±65504, the publication's sums then those of what rounding left out).

        Returns: the kernel's (status, Σ residual², Σ master²) (status 2: the publication met
        NaN/inf, the caller restarts its published track).

        Raises:
            RuntimeError: a top-k index out of range reached the kernel (they are checked
                when unpacked; the weights are then part stepped).
        """
        if snapshot is not None:
            if (publication is not None or snapshot.dtype not in (torch.float32, torch.float16)
                    or not snapshot.is_contiguous() or snapshot.numel() != self.flat.numel()):
                raise ValueError("FlatAdam.step: a snapshot (a float32 or float16 vector the weights' "
                                 "size) or a publication")
            publication = Publication(PUB_SNAPSHOT if snapshot.dtype == torch.float32 else PUB_HALF)
        self._bind()
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        wd = float(group["weight_decay"])
        keep: list[Any] = []  # contiguous copies made here live until the kernel is done
        rows: list[int] = []
        stepped: list[int] = []
        f32, f16 = torch.float32, torch.float16
        snaps = ([snapshot.data_ptr() + snapshot.element_size() * off for off in self.offsets[:-1]]
                 if snapshot is not None else self._no_snapshot)
        whole = grads.get(FUSED) if len(grads) == 1 else None
        if whole is not None:  # every parameter's gradient in one tensor, in order
            g = self._whole_gradient(whole)
            keep.append(g)
            kind, base, size = G_F16 if g.dtype is f16 else G_F32, g.data_ptr(), g.element_size()
            for off, n, snap in zip(self.offsets, self.sizes, snaps):
                rows += (off, n, kind, base + size * off, 0, 0, snap)
            stepped = list(range(len(self.params)))
        else:
            for i, (name, off, n, snap) in enumerate(zip(self.names, self.offsets, self.sizes, snaps)):
                one = grads.get(name)
                if one is None:
                    rows += (off, n, G_NONE, 0, 0, 0, snap)
                    continue
                stepped.append(i)
                if isinstance(one, TopKParts):
                    parts = [t.contiguous() for t in (one.values, one.index_low, one.block_counts)]
                    keep.append(parts)
                    rows += (off, n, G_TOPK, *(t.data_ptr() for t in parts), snap)
                    continue
                g, dtype = one, one.dtype
                if dtype is not f32 and dtype is not f16:
                    g, dtype = g.to(f32), f32
                if not g.is_contiguous():
                    g = g.contiguous()
                keep.append(g)
                rows += (off, n, G_F16 if dtype is f16 else G_F32, g.data_ptr(), 0, 0, snap)
        states = self._states(stepped)
        if len(stepped) == len(self.params):
            self._steps_np += 1.0
        elif stepped:
            self._steps_np[stepped] += 1.0
        counts = self._steps_np.tolist()
        if not held and len(stepped) == len(counts) and counts.count(counts[0]) == len(counts):
            # (every parameter stepped as often, as when every gradient carries them all: the
            # same scalars for each, computed once)
            t = counts[0]
            scalars = [lr / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t), 0.0] * len(counts)
        else:
            scalars = [0.0, 1.0, 1.0] * len(self.params)
            for i, s in zip(stepped, states):
                t = counts[i]
                if held:
                    vb = 1.0 - beta2 ** float(s[VARIANCE_STEPS])
                    scalars[3 * i:3 * i + 3] = [1.0 / (1.0 - beta1 ** t), vb, 1.0 / math.sqrt(vb)]
                else:
                    scalars[3 * i:3 * i + 3] = [lr / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t), 0.0]
        hyper = [1.0 if wd else 0.0, 1.0 - lr * wd, 1.0 - beta1, beta2, 1.0 - beta2,
                 float(group["eps"]), -lr, HELD_MAX_RATIO]
        status, resid, norm = self._fast.adam_apply(
            rows, scalars, self.flat, self.exp_avg, self.exp_avg_sq, hyper, held=held,
            publication=publication)
        if status == 1:
            raise RuntimeError("a top-k index out of range reached the fused Adam kernel (unpack "
                               "checks them): this is a bug in swarmtrain, please report it")
        return status, resid, norm

    def _whole_gradient(self, g: LazyGradient) -> torch.Tensor:
        """A :data:`FUSED` gradient as the kernel reads it: a contiguous float32 or float16
        vector of every parameter's elements (unpacking checked its size; checked again)."""
        if not isinstance(g, torch.Tensor) or g.dim() != 1 or g.numel() != self.flat.numel():
            raise ValueError(f"a fused gradient holds all {self.flat.numel()} elements in one vector")
        if g.dtype is not torch.float32 and g.dtype is not torch.float16:
            g = g.to(torch.float32)
        return g if g.is_contiguous() else g.contiguous()

    def count_variance_update(self, grads: Mapping[str, LazyGradient]) -> None:
        """:func:`adam.count_variance_update` for a step on ``grads`` (:data:`FUSED`: all)."""
        state = self.optimizer.state
        every = FUSED in grads
        for name, p in zip(self.names, self.params):
            s = state.get(p)
            if s and (every or name in grads):
                s[VARIANCE_STEPS] = float(s.get(VARIANCE_STEPS, 0.0)) + 1.0


def _unsupported(optimizer: torch.optim.Optimizer, flat: torch.Tensor | None,
                 params: Mapping[str, torch.Tensor]) -> str:
    """Why the fused kernel cannot step this optimizer exactly ("" = it can)."""
    if flat is None or flat.dtype != torch.float32 or flat.device.type != "cpu" or not flat.is_contiguous():
        return "the master weights are not one flat float32 CPU buffer"
    if not isinstance(optimizer, torch.optim.Adam) or len(optimizer.param_groups) != 1:
        return "the optimizer is not one torch Adam param group"
    group = optimizer.param_groups[0]
    if group.get("amsgrad") or group.get("maximize") or not group.get("decoupled_weight_decay"):
        return "amsgrad, maximize or coupled weight decay are set"
    beta1, _ = group["betas"]
    if not 0.5 < beta1 < 1.0 or isinstance(group["lr"], torch.Tensor):
        return "beta1 <= 0.5 or a tensor learning rate (torch computes those differently)"
    ps = list(params.values())
    if len(group["params"]) != len(ps) or any(a is not b for a, b in zip(group["params"], ps)):
        return "the optimizer's parameters are not the masters in order"
    offset = 0
    base = flat.data_ptr()
    for p in ps:
        if p.dtype != torch.float32 or not p.is_contiguous() or p.data_ptr() != base + 4 * offset:
            return "the masters are not views of the flat buffer in order"
        offset += p.numel()
    if offset != flat.numel():
        return "the masters do not cover the flat buffer"
    return ""
