"""Shared fixtures. Each block is self-contained; append new fixtures below."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from swarmtrain.testing import LanError, SimulatedLAN, netns_available

# --- simulated LAN (network namespaces, needs root) -------------------------------------


def require_netns() -> None:
    """Skip the calling test if network namespaces are unavailable.

    With SWARMTRAIN_REQUIRE_NETNS=1 (set by .ci/run) the test fails instead, so CI cannot
    pass by silently skipping every multi-host test.
    """
    ok, reason = netns_available()
    if ok:
        return
    if os.environ.get("SWARMTRAIN_REQUIRE_NETNS") == "1":
        pytest.fail(f"SWARMTRAIN_REQUIRE_NETNS=1 but the simulated LAN is unavailable: {reason}")
    pytest.skip(f"simulated LAN unavailable: {reason}")


@pytest.fixture
def lan_factory() -> Iterator[Callable[..., SimulatedLAN]]:
    """A callable ``make(n_hosts, rate_mbit=None)``; every LAN it made is closed at teardown."""
    require_netns()
    made: list[SimulatedLAN] = []

    def make(n_hosts: int, rate_mbit: float | None = None) -> SimulatedLAN:
        lan = SimulatedLAN(n_hosts, rate_mbit=rate_mbit)
        made.append(lan)
        return lan

    yield make
    errors = []
    for lan in made:
        try:
            lan.close()
        except LanError as exc:
            errors.append(str(exc))
    if errors:
        pytest.fail("simulated LAN cleanup failed: " + "; ".join(errors))


# --- run logs (swarmtrain/runlog.py) -----------------------------------------------------


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run started by a test (in-process or as a child process) writes its default
    ("auto") run log and exported model under a temporary directory, not ./runs."""
    monkeypatch.setenv("SWARMTRAIN_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))
