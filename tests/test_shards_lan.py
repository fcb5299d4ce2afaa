"""A sharded parameter server on a simulated LAN: the two parameter servers and the worker
each on a host of their own (network namespaces). Server 1's host is cut off the LAN and
comes back, then its process is killed and resumes from its own checkpoints; training
pauses while it is gone and finishes the run at the accuracy of a healthy one."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.cluster import COORDINATOR_TOML, SECRET, WORKER_TOML
from swarmtrain.testing.procs import accuracies_since, swarm_cmd, tail
from tests.test_param_shards import _read_version

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

PORT = 7100  # each LAN is its own set of namespaces: a fixed port cannot collide
#: long enough that the cut and the kill both land mid-run (digits on two servers runs at
#: 100-300 updates/s here; the cut comes after update 150, the kill ~100 updates after the
#: link is back: at update 549 in a quiet run, and before the cut the version may lag the file)
MAX_STEPS = 2000


def _wait(pred: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}\n{logs()}"
        time.sleep(0.1)


def test_a_server_cut_off_then_killed_pauses_training_until_it_is_back(
        lan_factory: Callable[..., SimulatedLAN], tmp_path: Path) -> None:
    lan = lan_factory(3)
    leader_host, server_host, worker_host = lan.hosts
    (tmp_path / "coordinator.toml").write_text(COORDINATOR_TOML)
    (tmp_path / "worker.toml").write_text(WORKER_TOML)
    env = {"SWARMTRAIN_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    status, summary = tmp_path / "s0.json", tmp_path / "summary.json"
    d0, d1 = tmp_path / "ck0", tmp_path / "ck1"
    servers = ("--servers", f"{leader_host.address}:{PORT}", "--servers", f"{server_host.address}:{PORT}")
    procs: dict[str, subprocess.Popen[Any]] = {}

    def start(name: str, host: Any, argv: list[str]) -> subprocess.Popen[Any]:
        procs[name] = p = host.run(argv, env=env, stdout=open(tmp_path / f"{name}.log", "ab"),
                                   stderr=subprocess.STDOUT)
        return p

    def logs() -> str:
        return "\n".join(f"--- {n} ---\n{tail(tmp_path / f'{n}.log', 12)}" for n in procs)

    def server_one(name: str, *extra: str) -> subprocess.Popen[Any]:
        return start(name, server_host, swarm_cmd(
            "coordinator", "--config", str(tmp_path / "coordinator.toml"), "--host", server_host.address,
            "--port", str(PORT), "--shard", "1/2", "--checkpoint-dir", str(d1), "--checkpoint-interval", "50",
            *extra))

    try:
        server_one("s1")
        start("s0", leader_host, swarm_cmd(
            "coordinator", "--config", str(tmp_path / "coordinator.toml"), "--host", leader_host.address,
            "--port", str(PORT), "--shard", "0/2", *servers, "--max-steps", str(MAX_STEPS),
            "--eval-interval", "0.5", "--checkpoint-dir", str(d0), "--checkpoint-interval", "200",
            "--status-file", str(status), "--summary-file", str(summary),
            "--run-log", str(tmp_path / "s0.jsonl")))
        start("w0", worker_host, swarm_cmd(
            "worker", "--config", str(tmp_path / "worker.toml"), "--host", leader_host.address,
            "--port", str(PORT), "--worker-id", "w0", "--threads", "1", "--batch-size", "32",
            "--reconnect-delay", "0.2"))
        _wait(lambda: status.exists() and _read_version(status) >= 150, 120, "150 updates", logs)

        # 1. server 1's host is cut off: no error reaches anyone, the connections go silent
        server_host.cut()
        cut_at = _read_version(status)
        time.sleep(4.0)  # (the worker's heartbeat timeout is 3 s)
        stalled = _read_version(status)
        time.sleep(3.0)
        assert _read_version(status) - stalled <= 1, "training went on while server 1 was cut off"
        assert stalled - cut_at < 200, (cut_at, stalled)  # (what was in flight, at most)
        server_host.restore()
        _wait(lambda: _read_version(status) > stalled + 100, 90, "training to go on after the link is back",
              logs)
        assert procs["s0"].poll() is None, "the run ended before the kill: raise MAX_STEPS"

        # 2. server 1's process is killed and resumes from its own checkpoints
        procs["s1"].send_signal(signal.SIGKILL)
        procs["s1"].wait(timeout=10)
        time.sleep(2.0)
        killed = _read_version(status)
        time.sleep(3.0)
        assert _read_version(status) - killed <= 1, "training went on without server 1"
        assert killed < MAX_STEPS
        server_one("s1b", "--resume")
        assert procs["s0"].wait(timeout=180) == 0, logs()
        assert procs["w0"].wait(timeout=60) == 0, logs()
        assert procs["s1b"].wait(timeout=60) == 0, logs()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    final = json.loads(summary.read_text())
    # the accuracy of a healthy run from the kill on (or the second half, if the kill came
    # later), judged on the median, not the last evaluation alone (see accuracies_since)
    late = accuracies_since(tmp_path / "s0.jsonl", min(killed, MAX_STEPS // 2))
    median = statistics.median(late) if late else float("nan")
    print(f"cut at update {cut_at}, stalled at {stalled}; killed at {killed}; finished at "
          f"{final['version']}, held-out accuracy {final['metrics']['accuracy']:.3f} at the end, "
          f"{median:.3f} the median of {len(late)} evaluations since update {killed}")
    assert final["version"] == MAX_STEPS, final["version"]
    assert len(late) >= 3 and median > 0.9, (late, final["metrics"])
    assert "resumed from" in (tmp_path / "s1b.log").read_text()
    said = " ".join((tmp_path / "w0.log").read_text().split())  # (the log wraps lines)
    assert "training waits until it is back" in said and "parameter server 1" in said, said[-3000:]
