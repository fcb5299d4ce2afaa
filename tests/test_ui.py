"""What `swarmtrain ctl status` shows: the workers table stays readable at 80 to 140 columns
(id, address, profile, steps and last seen never cut), rendered from a live coordinator's
status and through the real command against a coordinator process."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from swarmtrain.app.ui import print_status
from swarmtrain.testing.procs import start_coordinator, swarm_cmd, tail, wait_exit
from tests.test_ps_inprocess import coordinator, worker

IDS = ("pi-kitchen-1", "pi-kitchen-2", "pi-kitchen-3")
LAN_ADDRESSES = ("192.168.1.23:51234", "192.168.1.24:40001", "10.0.0.7:33333")


@pytest.fixture(scope="module")
def live_status() -> dict[str, Any]:
    """The status of an in-process coordinator with three workers that have all trained."""

    async def main() -> dict[str, Any]:
        c = coordinator(**{"training.min_workers": 3})
        await c.start()
        named: list[dict[str, Any]] = [{"training.worker_id": wid} for wid in IDS]
        workers = [worker(c.port, **over) for over in named]
        tasks = [asyncio.create_task(w.run_async()) for w in workers]
        try:
            async with asyncio.timeout(60):
                while not all(w.steps >= 3 for w in workers):
                    await asyncio.sleep(0.05)
            return c.status()
        finally:
            for w in workers:
                w.stop()
            async with asyncio.timeout(30):
                await asyncio.gather(*tasks, return_exceptions=True)
            await c.close()

    return asyncio.run(main())


def render(status: dict[str, Any], width: int) -> str:
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as captured:
        print_status(status, console)
    return captured.get()


def row_of(text: str, worker_id: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(worker_id)]
    assert len(lines) == 1, f"no single row for {worker_id!r}:\n{text}"
    return lines[0]


@pytest.mark.parametrize("width", [80, 100, 140])
def test_live_status_shows_every_worker_whole(live_status: dict[str, Any], width: int) -> None:
    rows = {w["id"]: w for w in live_status["workers"]}
    assert set(rows) == set(IDS)
    text = render(live_status, width)
    assert max(len(line) for line in text.splitlines()) <= width
    for wid in IDS:
        line = row_of(text, wid)  # the whole id, on one row, so no two workers look alike
        w = rows[wid]
        assert w["address"].startswith("127.0.0.1:") and w["address"] in line
        assert w["profile"] in line and re.search(rf"\b{w['steps']}\b", line), line
        assert re.search(r"\d+\.\d s ago", line), line
    assert "…" not in text


@pytest.mark.parametrize("width", [80, 140])
def test_lan_addresses_and_a_gone_worker_fit_and_narrow_tables_drop_the_minor_columns(
        live_status: dict[str, Any], width: int) -> None:
    status = copy.deepcopy(live_status)
    by_id = {w["id"]: w for w in status["workers"]}
    for wid, address in zip(IDS, LAN_ADDRESSES):
        by_id[wid]["address"] = address
    by_id[IDS[2]].update(connected=False, last_seen_sec=125.4, profile="WORKSTATION")
    text = render(status, width)
    for w in status["workers"]:
        line = row_of(text, w["id"])
        assert w["address"] in line and w["profile"] in line and str(w["steps"]) in line
    assert "125 s ago (gone)" in row_of(text, IDS[2])
    header = next(line for line in text.splitlines() if line.startswith("id "))
    if width == 80:  # the minor columns go, and the caption says which and where to find them
        assert "probe" not in header and "not shown at this width" in text and "--json" in text
    else:
        assert {"shards", "batch", "share", "samples/s"} <= set(header.split())


def test_too_narrow_for_a_table_gives_each_worker_its_own_lines(live_status: dict[str, Any]) -> None:
    text = render(live_status, 50)
    for w in live_status["workers"]:
        assert f"{w['id']}  {w['address']}" in text
        assert f"{w['profile']}  steps {w['steps']}" in text
    assert "…" not in text


def test_ctl_status_command_against_a_coordinator_process(tmp_path: Path) -> None:
    env = {"SWARMTRAIN_SECRET": "ui-test-secret"}
    coord, port = start_coordinator(tmp_path, "--task", "digits", "--min-workers", "1",
                                    "--checkpoint-interval", "0", env=env)
    log = open(tmp_path / "w.log", "ab")
    w = subprocess.Popen(
        swarm_cmd("worker", "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
                  "--worker-id", "pi-kitchen-1", "--batch-size", "32", "--reconnect-attempts", "0"),
        env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ctl_env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | env

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(swarm_cmd("ctl", "--port", str(port), *args), env=ctl_env,
                              capture_output=True, text=True, timeout=60)

    try:
        deadline = time.monotonic() + 60
        while True:  # until the worker has trained a few steps
            raw = ctl("status", "--json")
            assert raw.returncode == 0, raw.stderr
            rows = json.loads(raw.stdout)["status"]["workers"]
            if rows and rows[0]["steps"] >= 3:
                break
            assert time.monotonic() < deadline, f"no training: {rows}\n{tail(tmp_path / 'w.log')}"
        out = ctl("status")
        assert out.returncode == 0, out.stderr
        line = row_of(out.stdout, "pi-kitchen-1")
        # A pipe gets the full width: every column, nothing cut.
        assert f"127.0.0.1:{rows[0]['address'].rsplit(':', 1)[1]}" in line and rows[0]["profile"] in line
        assert "not shown" not in out.stdout and "…" not in out.stdout
        header = next(h for h in out.stdout.splitlines() if h.startswith("id "))
        # id, address, profile, shards, batch, then steps: one word each on both lines
        assert header.split()[5] == "steps", header
        assert int(line.split()[5]) >= rows[0]["steps"], (header, line)
        assert re.search(r"\d+\.\d s ago", line), line
        assert re.search(r"step \d+ .*loss", out.stdout), out.stdout
        stop = ctl("shutdown")
        assert stop.returncode == 0, stop.stderr
        assert wait_exit(coord, 60, tmp_path / "coordinator.log") == 0
        assert wait_exit(w, 60, tmp_path / "w.log") == 0
    finally:
        for p in (w, coord):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
