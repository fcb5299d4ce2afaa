"""The one moving average (swarmtrain.core.ema)."""

from __future__ import annotations

import math

import pytest

from swarmtrain.core.ema import MovingAverage
from swarmtrain.errors import ConfigError


def test_the_first_sample_is_taken_as_it_is_then_each_moves_it_part_of_the_way() -> None:
    avg = MovingAverage(0.8)
    assert avg.value is None and avg.get(math.nan) != avg.get(math.nan)  # NaN before any sample
    assert avg.get(0.0) == 0.0
    assert avg.update(10.0) == 10.0
    assert avg.update(20.0) == pytest.approx(12.0)  # 0.8 * 10 + 0.2 * 20
    assert avg.value == pytest.approx(12.0)


def test_old_samples_fade_geometrically() -> None:
    avg = MovingAverage(0.5, value=0.0)
    for _ in range(3):
        avg.update(8.0)
    assert avg.value == pytest.approx(7.0)  # 8 * (1 - 0.5 ** 3)


def test_a_non_finite_sample_is_ignored() -> None:
    avg = MovingAverage(0.95)
    assert avg.update(math.nan) is None
    avg.update(2.0)
    assert avg.update(math.inf) == 2.0
    assert avg.update(math.nan) == 2.0


def test_keep_zero_follows_the_newest_sample_and_reset_forgets() -> None:
    avg = MovingAverage(0.0, value=5.0)
    assert avg.update(1.0) == 1.0
    avg.reset()
    assert avg.value is None
    assert avg.update(9.0) == 9.0


@pytest.mark.parametrize("keep", [-0.1, 1.0, 1.5, math.nan])
def test_keep_outside_zero_one_is_a_config_error(keep: float) -> None:
    with pytest.raises(ConfigError, match="keep must be in"):
        MovingAverage(keep)
