"""Error feedback: what a lossy codec drops this step is added to the next step's gradient.

With top-k, coordinates that are never large enough to be sent still accumulate in the
residual until they are, so over many steps every coordinate's mass reaches the
coordinator (the sum of what was sent plus the final residual equals the sum of the
gradients). This lives on the worker; the coordinator only decodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from swarmtrain.compression.base import Codec, Compressed, dtype_name, require_float
from swarmtrain.compression.codecs import LOSSLESS_CODECS

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Keeps a residual per named tensor.

    ``compress(name, grad)`` sends ``codec.compress(grad + residual)`` and keeps
    ``residual := (grad + residual) - decompress(sent)``. For top-k the residual is then the
    dropped elements plus the fp16 rounding error of the kept ones.

    Args:
        codec: the codec to send with; may be replaced between steps through the ``codec``
            attribute (e.g. to follow :func:`~swarmtrain.compression.topk_warmup_ratio`).
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(
        self, name: str, grad: torch.Tensor, generator: torch.Generator | None = None
    ) -> Compressed:
        """Compress ``grad`` plus the residual kept under ``name``; update the residual.

        ``grad`` is never modified.

        Raises:
            ValueError: ``grad`` has a different shape than earlier tensors of this name.
            LocalProtocolError: ``grad`` is not floating point.
        """
        require_float(grad)
        residual = self._residuals.get(name)
        if residual is None:
            target = grad.detach()
        elif residual.shape != grad.shape:
            raise ValueError(
                f"error feedback for {name!r}: shape {tuple(grad.shape)} differs from "
                f"the residual's {tuple(residual.shape)}"
            )
        else:
            target = grad.detach().to(torch.float32) + residual
        sent = self.codec.compress(target, generator=generator)
        if sent.dtype != dtype_name(grad):  # target was promoted to float32 by the residual
            sent = dataclasses.replace(sent, dtype=dtype_name(grad))
        if sent.codec in LOSSLESS_CODECS:
            self._residuals.pop(name, None)
            return sent
        if residual is None or _shares_memory(sent, target):
            # never write into the caller's gradient or into parts that view it
            target = target.to(torch.float32).clone(memory_format=torch.contiguous_format)
        self.codec.subtract_decoded_(target, sent)
        self._residuals[name] = target
        return sent

    def residual_norm(self) -> float:
        """L2 norm over all residuals together."""
        return math.sqrt(
            sum(
                float(torch.linalg.vector_norm(r, dtype=torch.float64)) ** 2
                for r in self._residuals.values()
            )
        )

    def reset(self) -> None:
        """Forget every residual (e.g. after a full weight resync)."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the residuals by name (for checkpoints)."""
        return {name: r.clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all residuals with float32 copies of ``state``.

        Raises:
            ValueError: a value is not a floating-point tensor.
        """
        loaded: dict[str, torch.Tensor] = {}
        for name, r in state.items():
            if not isinstance(r, torch.Tensor) or not r.is_floating_point():
                raise ValueError(f"error feedback state {name!r} must be a float tensor")
            loaded[name] = r.detach().to(device="cpu", dtype=torch.float32, copy=True)
        self._residuals = loaded


def _shares_memory(c: Compressed, tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage().data_ptr()
    return any(p.untyped_storage().data_ptr() == storage for p in c.parts.values())
