"""Fixtures of the conformance suite: one torch thread per computation, as on the 2-core
machine each role of a real cluster would have a core of its own."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_per_op() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _static_peers_probed_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer mode's static discovery probes the listed addresses every 2 s. The first peer
    started probes the others before they listen, so every peer-mode run here waited ~2 s
    for the next round before training (18 runs). What is measured here is the training;
    probing every 0.25 s finds the other peer as soon as it listens."""
    from swarmtrain.roles.peer import discovery

    monkeypatch.setattr(discovery.StaticDiscovery, "__init__",
                        functools.partialmethod(discovery.StaticDiscovery.__init__, interval=0.25))
