"""A worker's replica of what one coordinator holds: the weights it was sent, kept current by
exactly the answers that coordinator sends (full weights, or a chain of its update log).

An unsharded worker has one replica, of the whole model. In a sharded cluster it has one per
parameter server, each over that server's group of the model's tensors (the same tensor
objects as the model's: :func:`swarmtrain.roles.ps.partition.group_module`), each with its
own version, since every server counts its own updates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import ProtocolError
from swarmtrain.roles.ps.common import FUSED, check_fused, fused_views, split_buffers, unpack_compressed
from swarmtrain.roles.ps.downlink import entry_tensors
from swarmtrain.wire import Update

__all__ = ["Replica"]


class Replica:
    """The tensors of ``state`` as one coordinator published them, at :attr:`version`."""

    def __init__(self, state: ModelState, device: torch.device) -> None:
        self.state = state
        self.params: dict[str, torch.Tensor] = state.trainable
        self.buffers = state.synced_buffers
        self.device = device
        self.version = 0
        #: each parameter flattened (a view), to load a :data:`FUSED` tensor in one call; None
        #: when one is not a contiguous float32 CPU tensor (the general path loads those)
        self._flat: list[torch.Tensor] | None = (
            [p.detach().view(-1) for p in self.params.values()]
            if all(p.is_contiguous() and p.dtype == torch.float32 and p.device.type == "cpu"
                   for p in self.params.values()) else None)
        self._sizes = [p.numel() for p in self.params.values()]

    def apply_update(self, item: Update) -> None:
        """Apply an UPDATE: full weights, or the log's chain and the changed buffers."""
        if item.full:
            self.load_full(item.tensors, item.version)
            return
        values, rest = split_buffers(item.buffers, item.tensors, self.buffers)
        self.add_chain(item.deltas, rest, item.version)
        if values:  # (split_buffers checked their shapes)
            self.state.load(values)
        self.version = item.version

    def add_chain(self, chain: list[dict[str, Any]], tensors: Mapping[str, torch.Tensor],
                  version: int) -> None:
        """Add the update log's entries in order. The chain is checked whole before any of it
        is added: each entry must start where the previous one ended, the first where our
        replica is, the last at ``version`` (the coordinator keeps no copy of our replica; a
        gap means its bookkeeping and ours differ, and re-registering mends it)."""
        at = self.version
        steps: list[tuple[int, dict[str, Any]]] = []
        for entry in chain:
            start, end, codecs = (entry.get(k) if isinstance(entry, dict) else None
                                  for k in ("from", "to", "codecs"))
            if not isinstance(start, int) or not isinstance(end, int) or not isinstance(codecs, dict):
                raise ProtocolError("bad_update", "an UPDATE's delta entry is malformed")
            if start != at:
                raise ProtocolError("bad_update", f"an UPDATE's delta starts at version {start}, "
                                    f"and this worker holds version {at}")
            steps.append((start, codecs))
            at = end
        if chain and at != version:
            raise ProtocolError("bad_update", f"an UPDATE's deltas end at version {at}, not at its "
                                f"version {version}")
        for start, codecs in steps:
            self.add_deltas(unpack_compressed(codecs, entry_tensors(tensors, start), self.params))

    def add_deltas(self, deltas: Mapping[str, torch.Tensor]) -> None:
        """Add the coordinator's weight deltas (float32, CPU) to our replica. A float32
        parameter adds them; a half-precision one becomes ``dtype(float32(p) + delta)``, the
        rounding the coordinator's published weights get too (so both stay bit-identical)."""
        same, same_deltas = [], []
        with torch.no_grad():  # the coordinator's published weights moved by exactly this
            for name, p in self.params.items():
                d = deltas[name].to(self.device, non_blocking=True)
                if p.dtype == torch.float32:
                    same.append(p)
                    same_deltas.append(d)
                else:
                    p.copy_(p.to(torch.float32) + d)
            if same:
                torch._foreach_add_(same, same_deltas)

    def _load_fused(self, flat: torch.Tensor, buffers: Mapping[str, torch.Tensor], version: int) -> None:
        """:meth:`load_full` of a :data:`FUSED` tensor of every parameter, in one copy (float16
        ones widened as they are copied)."""
        assert self._flat is not None
        check_fused(flat, sum(self._sizes))
        if buffers:
            try:
                self.state.load(buffers)  # (checked first: nothing is loaded if a buffer is wrong)
            except ValueError as exc:
                raise ProtocolError("shape_mismatch", str(exc)) from None
        with torch.no_grad():
            torch._foreach_copy_(self._flat, torch.split_with_sizes(flat, self._sizes))
        self.version = version

    def load_full(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load full weights: every trainable parameter, and whatever frozen parameters and
        buffers the message carries (all of them at registration)."""
        if FUSED in tensors:  # (a small model's trainable parameters in one tensor)
            flat = tensors[FUSED]
            rest = {k: v for k, v in tensors.items() if k != FUSED}
            if (self._flat is not None and flat.dtype in (torch.float32, torch.float16)
                    and rest.keys() <= self.buffers.keys()):  # (float16: the half downlink's)
                self._load_fused(flat, rest, version)
                return
            tensors = {**fused_views(flat, self.params), **rest}
        missing = set(self.params) - set(tensors)
        if missing:
            raise ProtocolError("shape_mismatch", f"weights lack {sorted(missing)[:3]}")
        try:
            self.state.load(tensors)
        except ValueError as exc:
            raise ProtocolError("shape_mismatch", str(exc)) from None
        self.version = version
