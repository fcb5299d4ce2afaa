"""Fixtures of the conformance suite: one torch thread per computation, as on the 2-core
machine each role of a real cluster would have a core of its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_per_op() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
