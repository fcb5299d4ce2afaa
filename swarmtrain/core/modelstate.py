"""What a model's trained state is: trainable parameters, frozen parameters and buffers.

Every mode trains more than ``model.parameters()``. A :class:`ModelState` sorts a plain
``nn.Module`` into the three kinds of tensor its ``state_dict`` holds:

- **trainable** parameters (``requires_grad``): gradients travel for these, the optimizer
  steps them; a tied parameter (GPT-2's ``lm_head.weight`` is ``wte.weight``) counts once,
  under the name ``named_parameters()`` gives it;
- **frozen** parameters: part of the model, sent once with the full weights, never stepped,
  never decayed, never on the gradient wire;
- **buffers** that ``state_dict`` keeps (BatchNorm's running statistics and
  ``num_batches_tracked``, any persistent ``register_buffer``). Floating and integer buffers
  are *synced*: each machine reports how its computation changed them and the changes are
  combined (:func:`buffer_changes`); buffers of other dtypes (bool masks) are constants.
  Non-persistent buffers are constants the model rebuilds itself and are left alone.

It also fixes what the coordinator keeps for each parameter dtype (:func:`master_dtype`:
fp32 master weights for fp16 and bf16 models, as mixed-precision training does) and which
dtypes cannot be trained at all (refused with :class:`~swarmtrain.errors.ConfigError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from swarmtrain.errors import ConfigError

__all__ = [
    "BUFFER",
    "FROZEN",
    "TRAINABLE",
    "ModelState",
    "buffer_changes",
    "is_synced_buffer",
    "master_dtype",
    "snapshot_buffers",
]

TRAINABLE = "param"
FROZEN = "frozen"
BUFFER = "buffer"

_TRAINABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master copy (and optimizer state) of a parameter of ``dtype``:
    float32 for the half-precision types, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def is_synced_buffer(t: torch.Tensor) -> bool:
    """Is a buffer combined across machines (floating or integer), or a constant?"""
    return (t.is_floating_point() or (not t.is_complex() and t.dtype != torch.bool)) and t.numel() > 0


class ModelState:
    """The named tensors that make up ``model``'s trained state (see the module docstring).

    Args:
        model: any ``nn.Module``.

    Raises:
        ConfigError: a trainable parameter has a dtype that cannot be trained here (integer,
            complex); the message names the parameter and what to do.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.trainable: dict[str, torch.Tensor] = {}
        self.frozen: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                if p.dtype not in _TRAINABLE_DTYPES:
                    raise ConfigError(
                        f"parameter {name!r} is {p.dtype}: swarmtrain trains float32, float16, "
                        "bfloat16 and float64 parameters; freeze it (requires_grad_(False)) or "
                        "convert it")
                self.trainable[name] = p
            else:
                self.frozen[name] = p
        persistent = set(model.state_dict(keep_vars=True))
        self.buffers: dict[str, torch.Tensor] = {
            n: b for n, b in model.named_buffers() if n in persistent}
        self.synced_buffers: dict[str, torch.Tensor] = {
            n: b for n, b in self.buffers.items() if is_synced_buffer(b)}

    @property
    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, trainable and frozen, in ``named_parameters()`` order."""
        return dict(self.model.named_parameters())

    def fingerprint(self) -> list[list[Any]]:
        """``[[name, dtype, shape, kind], ...]``: what two ends must agree on to train together."""
        out: list[list[Any]] = []
        for name, p in self.model.named_parameters():
            kind = TRAINABLE if name in self.trainable else FROZEN
            out.append([name, _dtype_name(p.dtype), list(p.shape), kind])
        for name, b in self.buffers.items():
            out.append([name, _dtype_name(b.dtype), list(b.shape), BUFFER])
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer by its canonical name (tied ones once)."""
        return {**self.parameters, **self.buffers}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` detached, tied weights under each of their names, so that it
        loads with ``load_state_dict(strict=True)`` into a fresh model."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load(self, tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> None:
        """Copy ``tensors[name]`` into the model's tensor of that name (casting to its dtype),
        for every name in ``names`` (default: every name in ``tensors`` the model has).

        Raises:
            KeyError: a name in ``names`` is missing from ``tensors``.
            ValueError: a tensor's shape differs from the model's (nothing is copied then).
        """
        own = self.full_state()
        chosen = list(names) if names is not None else [n for n in tensors if n in own]
        for name in chosen:
            if tuple(tensors[name].shape) != tuple(own[name].shape):
                raise ValueError(f"{name!r} arrived as {list(tensors[name].shape)}, the model's is "
                                 f"{list(own[name].shape)}")
        with torch.no_grad():
            for name in chosen:
                own[name].copy_(tensors[name])


def snapshot_buffers(buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``buffers`` to diff against after a computation (:func:`buffer_changes`)."""
    return {n: b.detach().clone() for n, b in buffers.items()}


def buffer_changes(buffers: Mapping[str, torch.Tensor],
                   before: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """How a computation changed each buffer: ``after - before`` (float32 for floating
    buffers, float64 for float64 ones, int64 for integer ones, on the CPU), for the buffers
    that changed at all.

    Why changes and not values: a running statistic is an exponential average, and adding
    each machine's change to the master copy in arrival order is what one process does with
    the same batches one after another (exactly so when the machine was current; a
    ``num_batches_tracked`` counter adds up to the batches seen everywhere).
    """
    out: dict[str, torch.Tensor] = {}
    for name, b in buffers.items():
        old = before[name]
        if torch.equal(b, old):
            continue
        wide = (torch.int64 if not b.is_floating_point()
                else torch.float64 if b.dtype == torch.float64 else torch.float32)
        out[name] = (b.detach().to("cpu", wide) - old.to("cpu", wide)).contiguous()
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
