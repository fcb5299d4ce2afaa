"""Peer mode (per-step averaging and DiLoCo) against one process: the bar of
``test_conformance.py``."""

from __future__ import annotations

import pytest

from .bar import CASES, check, timed
from .harness import train_peer

pytestmark = pytest.mark.timeout(300)  # (above HANG_GUARD_S, the harness's own guard on a run)


@pytest.mark.parametrize("name", timed(list(CASES)))
def test_peer_mode_per_step_averaging(name: str) -> None:
    check(CASES[name], lambda case: train_peer(case, mode="step"))


@pytest.mark.parametrize("name", timed(list(CASES)))
def test_peer_mode_diloco(name: str) -> None:
    """DiLoCo's outer step as plain averaging (outer SGD lr 1, no momentum): at 25-60 rounds of
    10 inner steps the default Nesterov outer step (lr 0.7, momentum 0.9, tuned for hundreds of
    inner steps over thousands of rounds) overshoots: BERT stayed at chance with it."""
    check(CASES[name], lambda case: train_peer(case, mode="diloco", inner_steps=10, outer_lr=1.0,
                                               outer_momentum=0.0))
