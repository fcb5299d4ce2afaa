"""A parameter-server cluster on a simulated LAN: the coordinator on host 0 (with a sharded
coordinator, parameter server i on host i), workers on the others, each a real process; the
coordinator's status is read from its --status-file."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.procs import swarm_cmd, tail

SECRET = "lan-test-secret"
PORT = 7100  # each LAN is its own set of namespaces, so a fixed port cannot collide

COORDINATOR_TOML = """
[network]
heartbeat_interval_sec = 0.5
heartbeat_timeout_sec = 3.0
handshake_timeout_sec = 5.0
"""
WORKER_TOML = """
[network]
heartbeat_interval_sec = 0.5
heartbeat_timeout_sec = 3.0
handshake_timeout_sec = 5.0
connect_timeout_sec = 2.0
reconnect_attempts = 40
reconnect_delay_sec = 0.5
"""


class LanCluster:
    def __init__(self, lan: SimulatedLAN, tmp: Path) -> None:
        self.lan, self.tmp = lan, tmp
        self.status_file = tmp / "status.json"
        (tmp / "coordinator.toml").write_text(COORDINATOR_TOML)
        (tmp / "worker.toml").write_text(WORKER_TOML)
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.env = {"SWARMTRAIN_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}

    @property
    def coordinator_address(self) -> str:
        return self.lan.hosts[0].address

    def start_coordinator(self, *args: str, resume: bool = False, wait: bool = True) -> subprocess.Popen[Any]:
        """Start the coordinator on host 0; with ``wait``, return once it wrote a status (else at
        once: the workers reconnect until it listens, and a later :meth:`wait_for` fails if it
        exits first)."""
        self.status_file.unlink(missing_ok=True)
        argv = swarm_cmd("coordinator", "--config", str(self.tmp / "coordinator.toml"),
                         "--host", self.coordinator_address, "--port", str(PORT),
                         "--status-file", str(self.status_file), *args, *(["--resume"] if resume else []))
        self.procs["coordinator"] = p = self.lan.hosts[0].run(
            argv, env=self.env, stdout=open(self.tmp / "coordinator.log", "ab"), stderr=subprocess.STDOUT)
        if wait:
            self.wait_for(lambda s: True, 60, "the coordinator to start")
        return p

    def server_status_file(self, index: int) -> Path:
        """Where parameter server ``index`` (not the leader) writes its status."""
        return self.tmp / f"server{index}.json"

    def start_server(self, index: int, count: int, *args: str) -> subprocess.Popen[Any]:
        """Start parameter server ``index`` of ``count`` (not the leader: ``index`` >= 1) on host
        ``index``, with the coordinator's config, writing :meth:`server_status_file`; returns at
        once (it listens once that file exists). The leader is :meth:`start_coordinator` with
        :meth:`leader_args`."""
        host = self.lan.hosts[index]
        argv = swarm_cmd("coordinator", "--config", str(self.tmp / "coordinator.toml"),
                         "--host", host.address, "--port", str(PORT), "--shard", f"{index}/{count}",
                         "--status-file", str(self.server_status_file(index)), *args)
        self.procs[f"server{index}"] = p = host.run(
            argv, env=self.env, stdout=open(self.tmp / f"server{index}.log", "ab"), stderr=subprocess.STDOUT)
        return p

    def leader_args(self, count: int) -> tuple[str, ...]:
        """The leader's arguments in a cluster of ``count`` parameter servers on hosts 0..count-1
        (none for one server)."""
        if count < 2:
            return ()
        servers = [f"{self.lan.hosts[i].address}:{PORT}" for i in range(count)]
        return ("--shard", f"0/{count}", *(a for addr in servers for a in ("--servers", addr)))

    def start_worker(self, host: int, name: str, *args: str) -> subprocess.Popen[Any]:
        argv = swarm_cmd("worker", "--config", str(self.tmp / "worker.toml"),
                         "--host", self.coordinator_address, "--port", str(PORT),
                         "--worker-id", name, "--threads", "1", "--batch-size", "32", *args)
        self.procs[name] = p = self.lan.hosts[host].run(
            argv, env=self.env, stdout=open(self.tmp / f"{name}.log", "ab"), stderr=subprocess.STDOUT)
        return p

    def status(self) -> dict[str, Any] | None:
        try:
            status: dict[str, Any] = json.loads(self.status_file.read_text())
            return status
        except (OSError, ValueError):
            return None

    def worker(self, status: dict[str, Any], name: str) -> dict[str, Any]:
        return next((w for w in status["workers"] if w["id"] == name), {"connected": False, "steps": 0})

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st is not None and pred(st):
                return st
            coord = self.procs.get("coordinator")
            if coord is not None and coord.poll() is not None and not self.status_file.exists():
                raise AssertionError(f"coordinator exited:\n{tail(self.tmp / 'coordinator.log')}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last status: "
                             f"{json.dumps(self.status(), default=str)[:1500]}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{tail(self.tmp / f'{n}.log', 15)}" for n in self.procs)

    def events(self, status: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        return [e for e in status.get("events", []) if e.get("event") == kind]

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
