"""Helpers for tests that run swarmtrain as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmtrain.testing.lan import SimulatedLAN

__all__ = ["LanProcesses", "swarm_cmd", "start_coordinator", "wait_exit", "tail", "accuracies_since"]


def swarm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmtrain", *args]


def accuracies_since(run_log: Path, version: int = 0, *, after_event: str | None = None) -> list[float]:
    """The held-out accuracies a coordinator's run log (``--run-log``) records for versions at
    or after ``version``, in order; with ``after_event``, only those recorded after the last
    event of that name (a resumed coordinator appends to the killed one's log:
    ``after_event="resumed_from_checkpoint"`` keeps the resumed run's).

    Tests judge a run on the median of these, not on its last evaluation alone: Adam at
    digits' learning rate has loss spikes in one plain process too (8 seeds, 2,000 steps,
    evaluated every 10 over the second half: medians 0.978-0.983, the lowest single evaluation
    0.891), so a run can end on one.
    """
    from swarmtrain.app.runlog import read_run_log

    records = read_run_log(run_log)
    if after_event is not None:
        records = records[max(i for i, r in enumerate(records) if r.get("event") == after_event):]
    return [r["eval"]["accuracy"] for r in records if "eval" in r and r.get("eval_version", -1) >= version]


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def start_coordinator(
    tmp: Path, *args: str, env: dict[str, str], timeout: float = 60, name: str = "coordinator",
    runner: list[str] | None = None, host: str = "127.0.0.1",
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `swarmtrain coordinator` (output to tmp/NAME.log) and wait for its port."""
    port_file = tmp / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log = open(tmp / f"{name}.log", "ab")
    argv = swarm_cmd("coordinator", "--host", host, "--port", "0", "--port-file", str(port_file), *args)
    proc = subprocess.Popen([*(runner or []), *argv], env={**os.environ, **env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists():
            return proc, int(port_file.read_text())
        if proc.poll() is not None:
            raise AssertionError(f"coordinator exited ({proc.returncode}):\n{tail(tmp / f'{name}.log')}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"coordinator did not start in {timeout} s:\n{tail(tmp / f'{name}.log')}")


def stop_gently(procs: Iterable[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, wait up to ``timeout`` seconds for each, and
    SIGKILL those that are still there."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def wait_exit(proc: subprocess.Popen[bytes], timeout: float, log: Path | None = None) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"process did not exit within {timeout} s:\n{tail(log) if log else ''}") from exc


class LanProcesses:
    """Named swarmtrain processes on the hosts of a :class:`SimulatedLAN`, each with a log
    ``<name>.log`` and a status file ``<name>.json`` (passed as ``--status-file``) in ``tmp``;
    waits poll the status files with a deadline and show every log when they fail."""

    def __init__(self, lan: SimulatedLAN, tmp: Path, env: dict[str, str]) -> None:
        self.lan, self.tmp, self.env = lan, tmp, env
        self.procs: dict[str, subprocess.Popen[Any]] = {}

    def start(self, name: str, host: int, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[Any]:
        argv = swarm_cmd(*args, "--status-file", str(self.status_path(name)))
        self.procs[name] = p = self.lan.hosts[host].run(
            argv, env={**self.env, **(env or {})}, stdout=open(self.tmp / f"{name}.log", "ab"),
            stderr=subprocess.STDOUT)
        return p

    def status_path(self, name: str) -> Path:
        return self.tmp / f"{name}.json"

    def status(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.status_path(name).read_text())
        except (OSError, ValueError):
            return None

    def wait_all(self, names: list[str], pred: Callable[[dict[str, dict[str, Any]]], bool],
                 timeout: float, what: str) -> dict[str, dict[str, Any]]:
        """Poll until every named status exists and ``pred(statuses)`` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sts = {n: self.status(n) for n in names}
            if all(s is not None for s in sts.values()) and pred(sts):  # type: ignore[arg-type]
                return sts  # type: ignore[return-value]
            dead = [n for n in names if self.procs[n].poll() is not None]
            if dead:
                raise AssertionError(f"{dead[0]} exited ({self.procs[dead[0]].returncode}) while waiting "
                                     f"for {what}\n{self.logs()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.logs()}")

    def wait(self, name: str, pred: Callable[[dict[str, Any]], bool], timeout: float,
             what: str) -> dict[str, Any]:
        return self.wait_all([name], lambda sts: pred(sts[name]), timeout, what)[name]

    def join(self, timeout: float) -> None:
        """Wait for every process to exit 0; on a timeout or failure show the logs."""
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout} s\n{self.logs()}") from None
            assert rc == 0, f"{name} exited {rc}\n{self.logs()}"

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {n} ---\n{tail(self.tmp / f'{n}.log', lines)}" for n in self.procs)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs.values():
            p.wait(timeout=10)
