"""The one exponential moving average: smoothed timings, rates and losses.

Each use names its own ``keep`` (the weight of the old average) next to it, with why that
much smoothing: ``keep = 0.8`` follows a change within a handful of samples, ``0.95``
averages over about twenty.
"""

from __future__ import annotations

import math

from swarmtrain.errors import ConfigError

__all__ = ["MovingAverage"]


class MovingAverage:
    """An exponential moving average: each sample moves it ``1 - keep`` of the way there.

    It has no value until its first sample, which it then takes as it is (no bias toward a
    made-up starting value). A non-finite sample (NaN, infinity) is ignored: one bad
    measurement must not poison the average for good.

    Args:
        keep: the weight of the old average, in ``[0, 1)``: 0 keeps only the newest sample,
            0.9 averages over roughly the last ten.
        value: a starting value (a restored checkpoint's), or None for none yet.

    Raises:
        ConfigError: ``keep`` outside ``[0, 1)``.
    """

    __slots__ = ("keep", "value")

    def __init__(self, keep: float, value: float | None = None) -> None:
        if not 0.0 <= keep < 1.0:
            raise ConfigError(f"a moving average's keep must be in [0, 1), got {keep!r}")
        self.keep = keep
        #: the average, or None before the first sample
        self.value: float | None = value

    def __repr__(self) -> str:
        return f"MovingAverage(keep={self.keep!r}, value={self.value!r})"

    def update(self, sample: float) -> float | None:
        """Fold ``sample`` in; returns the new average (None only if still without one)."""
        if math.isfinite(sample):
            self.value = sample if self.value is None else self.keep * self.value + (1 - self.keep) * sample
        return self.value

    def get(self, default: float) -> float:
        """The average, or ``default`` before the first sample (``math.nan``, ``0.0``...)."""
        return default if self.value is None else self.value

    def reset(self) -> None:
        """Forget every sample: the next one is taken as it is."""
        self.value = None
