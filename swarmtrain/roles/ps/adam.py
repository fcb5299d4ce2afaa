"""The coordinator's Adam, and what it does with top-k (sparse) gradients.

Dense gradients step plain Adam (decoupled weight decay, the fused CPU kernel) and count how
often they taught the second moment. Top-k gradients, once that count is above zero, step
with the second moment held (:func:`held_variance_step`), so that error feedback's late sums
move the weights as far as their parts would have; ``training.sparse_variance = "update"``
turns that off. :func:`adam_step` is the one entry point of the torch path; where the master
weights are one flat buffer and the C kernels are built, the coordinator steps the same
optimizer state with :mod:`swarmtrain.roles.ps.flat_adam` instead (same arithmetic, one pass),
for which these functions are the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch

__all__ = ["HELD_MAX_RATIO", "VARIANCE_STEPS", "adam_step", "count_variance_update",
           "held_variance_step", "is_sparse", "make_adam", "variance_steps"]


def make_adam(params: list[torch.Tensor], **kwargs: Any) -> torch.optim.Adam:
    """Adam with decoupled weight decay (AdamW's rule, which ``training.weight_decay``
    promises) and the fused CPU kernel where torch has it (about 3x the foreach one here)."""
    try:
        return torch.optim.Adam(params, fused=True, decoupled_weight_decay=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, foreach=True, decoupled_weight_decay=True, **kwargs)


def is_sparse(codecs: Mapping[str, Any]) -> bool:
    """Does a gradient message carry top-k entries (anything but every element)?"""
    for spec in codecs.values():
        if spec.get("codec") == "topk":
            meta, shape = spec.get("meta", {}), spec.get("shape", [])
            if meta.get("k", 0) < math.prod(shape):
                return True
    return False


#: per-parameter Adam state: how many steps updated the second moment (dense gradients only)
VARIANCE_STEPS = "variance_steps"

#: with the second moment held, no weight moves more than this many learning rates in one
#: step (plain Adam's bound is (1 - beta1) / sqrt(1 - beta2), about 3.2)
HELD_MAX_RATIO = 10.0


def count_variance_update(optimizer: torch.optim.Optimizer) -> None:
    """Note one more step that taught the second moment of every parameter that had a
    gradient in it (one without was not stepped)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and p.grad is not None:
                state[VARIANCE_STEPS] = float(state.get(VARIANCE_STEPS, 0.0)) + 1.0


def variance_steps(optimizer: torch.optim.Optimizer) -> int:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return int(state.get(VARIANCE_STEPS, 0))


@torch.no_grad()
def held_variance_step(optimizer: torch.optim.Optimizer, lr: float) -> bool:
    """One Adam step whose second moment is held: the first moment and the weights move,
    the second moment keeps what dense gradients taught it (bias-corrected by their count).

    Why: with top-k and error feedback, a weight receives nothing for many steps and then
    the sum of what it missed. Plain Adam divides that sum by the root of its own square
    (which the sum's arrival just inflated), so it moves a weight updated once in T steps
    about sqrt(T) times less far than dense gradients would; with the second moment held
    the update is linear in the gradient and the delayed sum moves the weight as far as
    its parts would have (the observation behind 1-bit Adam, Tang et al. 2021).

    Two guards keep it as stable as plain Adam: no weight moves more than
    :data:`HELD_MAX_RATIO` learning rates in one step (a weight whose gradients were tiny
    while dense would otherwise jump), and a weight whose second moment is still 0 takes
    this gradient's square instead of dividing by epsilon.
    Returns False (nothing done) while no dense step has taught the second moment yet.
    """
    group = optimizer.param_groups[0]
    params = [p for p in group["params"] if p.grad is not None]
    states: list[dict[str, Any]] = [optimizer.state.get(p) or {} for p in params]
    if not params or not all(s.get(VARIANCE_STEPS) for s in states):
        return False
    beta1, beta2 = group["betas"]
    grads = [cast(torch.Tensor, p.grad) for p in params]
    if group["weight_decay"]:  # decoupled, as in the dense steps
        torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
    exp_avg = [s["exp_avg"] for s in states]
    exp_avg_sq = [s["exp_avg_sq"] for s in states]
    for s in states:
        s["step"] += 1
    # per parameter: one that went without gradients on some steps has taken fewer of them
    variance_bias = [1.0 - beta2 ** float(s[VARIANCE_STEPS]) for s in states]
    torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
    for v, g, vb in zip(exp_avg_sq, grads, variance_bias):
        # a weight whose gradient was always zero while dense: take this one's square (its
        # bias-corrected estimate) rather than divide by epsilon
        torch.where(v == 0, g * g * vb, v, out=v)
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_mul_(denom, [1.0 / math.sqrt(vb) for vb in variance_bias])
    torch._foreach_add_(denom, group["eps"])
    ratio = torch._foreach_div(exp_avg, denom)
    torch._foreach_mul_(ratio, [1.0 / (1.0 - beta1 ** float(s["step"])) for s in states])
    torch._foreach_clamp_min_(ratio, -HELD_MAX_RATIO)
    torch._foreach_clamp_max_(ratio, HELD_MAX_RATIO)
    torch._foreach_add_(params, ratio, alpha=-lr)
    return True


def adam_step(optimizer: torch.optim.Optimizer, lr: float, *, sparse: bool, hold: bool) -> bool:
    """One optimizer step at ``lr`` on the gradients in ``p.grad``; True if it held the second
    moment (``sparse`` and ``hold``, after a dense step), False for plain Adam (which counts as
    teaching the second moment when the gradient is dense)."""
    if sparse and hold and held_variance_step(optimizer, lr):
        return True
    optimizer.param_groups[0]["lr"] = lr
    optimizer.step()
    if not sparse:
        count_variance_update(optimizer)
    return False
