"""Helpers for tests that run swarmtrain as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["swarm_cmd", "start_coordinator", "wait_exit", "tail"]


def swarm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmtrain", *args]


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


def wait_exit(proc: subprocess.Popen[bytes], timeout: float, log: Path | None = None) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"process did not exit within {timeout} s:\n{tail(log) if log else ''}") from exc
