"""bench_scale.py's machinery (benchmarks/_scale_load.py) on a tiny model: a coordinator process
and a process of two light workers; the coordinator really applies their gradients.

Guards the benchmark from rotting when the protocol, the coordinator or the config change."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarmtrain.roles.ps.ctl import ctl_request
from swarmtrain.testing.procs import tail, wait_exit

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "_scale_load.py"
SECRET = "scale-load-test-secret"
ENV = {**os.environ, "SWARMTRAIN_SECRET": SECRET, "OMP_NUM_THREADS": "1"}


def _start(tmp: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = open(tmp / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, str(SCRIPT), *args, "--model", "tiny"], env=ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _status(port: int) -> dict[str, Any]:
    reply = asyncio.run(ctl_request("127.0.0.1", port, "status", secret=SECRET.encode(), timeout=30))
    status: dict[str, Any] = reply.fields()["status"]
    return status


def test_two_light_workers_have_their_gradients_applied(tmp_path: Path) -> None:
    port_file = tmp_path / "coordinator.port"
    coord = _start(tmp_path, "coordinator", "coordinator", "--port-file", str(port_file),
                   "--min-workers", "2", "--connections", "2", "--compression", "topk")
    workers: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert coord.poll() is None, tail(tmp_path / "coordinator.log")
            assert time.monotonic() < deadline, "the coordinator did not start in 60 s"
            time.sleep(0.05)
        port = int(port_file.read_text())
        out = tmp_path / "workers.json"
        workers = _start(tmp_path, "workers", "workers", "--port", str(port), "--count", "2",
                         "--prefix", "lw-", "--rate", "20", "--out", str(out), "--compression", "topk")
        deadline = time.monotonic() + 90
        while True:  # both workers have gradients applied (counts from the coordinator)
            assert workers.poll() is None, tail(tmp_path / "workers.log")
            status = _status(port)
            steps = {w["id"]: w["steps"] for w in status["workers"]}
            if len(steps) == 2 and min(steps.values()) >= 10:
                break
            assert time.monotonic() < deadline, (status["stats"], steps)
            time.sleep(0.2)
        assert set(steps) == {"lw-000", "lw-001"}
        assert status["stats"]["rejected"] == 0 and status["stats"]["duplicates"] == 0, status["stats"]
        assert status["version"] == status["stats"]["applied"] >= 20
        asyncio.run(ctl_request("127.0.0.1", port, "shutdown", secret=SECRET.encode(), timeout=30))
        assert wait_exit(workers, 60, tmp_path / "workers.log") == 0, tail(tmp_path / "workers.log")
        assert wait_exit(coord, 60, tmp_path / "coordinator.log") == 0, tail(tmp_path / "coordinator.log")
    finally:
        for p in (workers, coord):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    report = json.loads(out.read_text())
    assert report["wire_bytes"] > 0
    for wid, w in report["workers"].items():
        assert w["error"] == "" and w["shutdown"], (wid, w["error"])
        # every answer read, each to the gradient sent, all applied, on a newer version each time
        assert len(w["answers"]) >= steps[wid], (wid, len(w["answers"]), steps[wid])
        assert {a[2] for a in w["answers"]} == {"applied"}, wid
        versions = [a[4] for a in w["answers"]]
        assert versions == sorted(set(versions)), wid
        assert all(a[1] >= a[0] for a in w["answers"]), wid  # answered after sent
