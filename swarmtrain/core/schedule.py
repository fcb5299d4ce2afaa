"""Learning-rate schedules by update number: a linear warm-up, then constant, cosine or linear
decay to a floor at the run's last update.

The schedule is a pure function of the update (the coordinator's version), so a resumed run
continues it where the checkpoint left off with nothing else saved, and every server of a
sharded cluster follows the same curve. The factors are those of torch's ``LinearLR`` warm-up
followed by ``CosineAnnealingLR`` / ``LinearLR`` decay, stepped once per update
(tests/test_schedule.py compares them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCHEDULES", "LRSchedule"]

#: the schedules by name (``[training] lr_schedule``)
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """``factor(step)`` multiplies the base learning rate of update ``step`` (0-based: the
    update that makes version ``step + 1``).

    - warm-up: updates ``0 .. warmup - 1`` ramp linearly from ``1 / warmup`` to 1;
    - then ``kind``: ``constant`` stays at 1; ``cosine`` and ``linear`` go from 1 at update
      ``warmup`` to ``min_ratio`` at update ``total - 1`` and stay there after it.
    """

    kind: str = "constant"
    total: int = 0
    warmup: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.kind!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.kind != "constant" and self.total <= self.warmup:
            raise ValueError(f"a {self.kind} schedule needs more updates ({self.total}) than its "
                             f"warm-up ({self.warmup})")
        if not 0.0 <= self.min_ratio <= 1.0 or self.warmup < 0:
            raise ValueError("min_ratio must be in [0, 1] and warmup >= 0")

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        span = self.total - 1 - self.warmup
        progress = min(1.0, (step - self.warmup) / span) if span > 0 else 1.0
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape

    @property
    def is_constant(self) -> bool:
        return self.kind == "constant" and self.warmup == 0
