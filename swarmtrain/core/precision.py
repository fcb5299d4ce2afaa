"""Dynamic loss scaling for float16 models, as mixed-precision training does it.

float16 gradients underflow to zero below about 6e-8 and overflow above 65504. The loss is
multiplied by a scale before ``backward()`` so small gradients survive; the gradients are
divided by it again (in float32) before they leave the machine. A computation whose
gradients overflowed is dropped and the scale halved; after ``growth_interval`` clean
computations in a row the scale doubles. bfloat16 and float32 models need none of this
(bfloat16 has float32's range): :meth:`LossScaler.for_model` gives a scaler that does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """Loss scale of one machine's computations.

    Args:
        enabled: False for models without float16 parameters (the scale stays 1).
        init_scale: the first scale (2**16, as torch's GradScaler).
        growth_interval: clean computations in a row before the scale doubles.
    """

    def __init__(self, enabled: bool, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean = 0
        self.overflows = 0

    @classmethod
    def for_model(cls, params: Iterable[torch.Tensor]) -> LossScaler:
        """A scaler that scales only if some trainable parameter is float16."""
        return cls(any(p.dtype == torch.float16 for p in params))

    def unscale(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The gradients divided by the scale, as float32 — or None if any is not finite:
        the computation overflowed, the scale is halved, drop it (at scale 1 the non-finite
        gradients are returned: the model itself diverged, and the receiver refuses them)."""
        if not self.enabled:
            return grads
        wide = [g.float() for g in grads]
        if wide and not math.isfinite(float(torch.stack(torch._foreach_norm(wide)).sum())):
            if self.scale <= 1.0:  # not the scale's doing: the values themselves are not finite
                return wide
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean = 0
            self.overflows += 1
            return None
        torch._foreach_div_(wide, self.scale)
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale = min(self.scale * 2.0, 2.0**24)
            self.clean = 0
        return wide
