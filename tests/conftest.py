"""Shared fixtures. Each block is self-contained; append new fixtures below."""

from __future__ import annotations

import fcntl
import os
import tempfile
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


# --- run logs (swarmtrain/app/runlog.py) -----------------------------------------------------


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run started by a test (in-process or as a child process) writes its default
    ("auto") run log and exported model under a temporary directory, not ./runs."""
    monkeypatch.setenv("SWARMTRAIN_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))


# --- running side by side (pytest-xdist) -------------------------------------------------
#
# The suite runs on three xdist workers (pyproject.toml). A test whose assertion depends on
# having the machine's cores to itself (a ratio of speeds) is marked ``serial``: it waits until
# the other workers' current tests end, and they start nothing new until it is done. Two
# locks: a gate (a serial test holds it exclusively, so no new test slips in while it waits)
# and the run lock (shared by ordinary tests, exclusive for a serial one). Taken outside
# pytest-timeout's timer, so waiting for a long serial test does not count against a test's
# own timeout.


def _lock_dir() -> str | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run is None else os.path.join(tempfile.gettempdir(), f"swarmtrain-tests-{run}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    where = _lock_dir()
    if where is None:  # not under xdist: nothing runs beside us
        yield
        return
    os.makedirs(where, exist_ok=True)
    serial = item.get_closest_marker("serial") is not None
    with open(os.path.join(where, "gate"), "a") as gate, open(os.path.join(where, "run"), "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        fcntl.flock(run, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            if serial:
                fcntl.flock(gate, fcntl.LOCK_UN)


# --- order: the longest files first (pytest-xdist) -----------------------------------------
#
# Each xdist worker takes a whole file at a time (--dist loadfile), the next once it is almost
# done with the last. xdist's own order (files with the most tests first) started the long
# LAN and peer files last: one clean-clone run was 673 s for 1,664 s of tests on 3 workers
# (555 s if shared evenly), the last worker running test_peer_partitions alone at the end.
# Started longest first, the short files fill in around them (pyproject.toml turns xdist's
# reordering off). Seconds per file, from `pytest --durations=0` on that run.
LONGEST_FILES = (
    # (the conformance suite was one file of 303 s; one file per mode now, each computing the
    # one-process references it needs)
    "tests/conformance/test_conformance_peer.py",  # ~135
    "tests/conformance/test_conformance_pipeline.py",  # ~130
    "tests/conformance/test_conformance.py",  # ~95
    "tests/test_peer_partitions.py",  # 99
    "tests/test_peer_lan.py",  # 85
    "tests/test_lan_recovery.py",  # 78
    "tests/test_pipeline_cli.py",  # 66
    "tests/test_demo.py",  # 66
    "tests/test_robust.py",  # 65
    "tests/test_runlog.py",  # 55
    "tests/test_fuzz_insider.py",  # 49
    "tests/test_param_shards.py",  # 46
    "tests/test_ps_processes.py",  # 45
    "tests/test_scale_load.py",  # 49 on a box at half speed (2026-12-07)
    "tests/test_fuzz_live.py",  # 43
    "tests/test_pipeline_discovery.py",  # 39
    "tests/test_pipeline_lan.py",  # 37
    "tests/test_pipeline_checkpoint.py",  # 36
    "tests/test_shards_lan.py",  # 36
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # (stable)


# --- pipeline tests: one PyTorch thread per operation -----------------------------------


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    from swarmtrain.testing.pipeline import one_torch_thread as single

    with single():
        yield
