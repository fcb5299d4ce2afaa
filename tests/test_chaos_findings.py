"""What a chaos run on a simulated LAN found (issue #19): a resumed coordinator waiting in
silence, a resume missing from the run log, a status file without a clock, an unlabelled
`ctl status`, a frozen worker blaming the coordinator, runs ending past max_steps."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from swarmtrain.app.ops.serve import serve_coordinator
from swarmtrain.app.runlog import read_run_log
from swarmtrain.app.session import run_coordinator
from swarmtrain.app.ui import print_status
from swarmtrain.config import load_coordinator_config
from swarmtrain.errors import SwarmError
from swarmtrain.roles.ps.coordinator import WorkerRecord
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.testing.procs import start_coordinator, swarm_cmd, tail, wait_exit
from tests.test_coordinator_state import make_coordinator
from tests.test_dashboard import run_chromium
from tests.test_ps_inprocess import coordinator, worker

# --- max_steps ---------------------------------------------------------------------------


def test_a_run_stops_applying_at_exactly_max_steps_with_many_workers() -> None:
    # six small-batch workers send gradients faster than the shutdown goes out: before, the
    # ones already queued on the apply thread were applied too (version 21 or 22 of 20).
    # max_staleness is the run's length, so no gradient can be dropped as stale: on a busy box
    # one worker starved for 17 updates had its gradient dropped (a CI failure), which is
    # the staleness bound at work, not the stop this test is about
    c = coordinator(**{"training.min_workers": 6, "training.max_steps": 20, "training.max_staleness": 20})
    ws: list[Worker] = []

    async def main() -> None:
        await c.start()
        ws.extend(worker(c.port, **{"training.worker_id": f"w{i}", "training.batch_size": 4,
                                    "training.probe_seconds": 0.0}) for i in range(6))
        tasks = [asyncio.create_task(w.run_async()) for w in ws]
        await asyncio.wait_for(c.run(), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(main())
    assert c.version == 20, c.version
    assert c.stats["applied"] == 20
    assert sum(r.steps for r in c.workers.values()) == 20
    # what came after the last update was answered 'finished', not applied
    answered = [w.statuses for w in ws]
    assert all(set(s) <= {"applied", "finished"} for s in answered), answered


# --- the resume in the run log -------------------------------------------------------------


def _checkpoint_at(directory: Path, version: int, workers: tuple[str, ...] = ()) -> Path:
    """A coordinator checkpoint at ``version`` in ``directory`` (as a killed run leaves) of a
    run that had ``workers``."""
    c = make_coordinator(directory, **{"checkpointing.interval": 0})
    c.version = version
    for wid in workers:
        c.workers[wid] = WorkerRecord(wid, "", {}, 0, 0.0)
    reply = asyncio.run(c.checkpointer.save_now(c))
    assert reply.ok, reply
    return Path(reply.path)


def test_a_resume_is_in_the_run_log_under_its_own_name(tmp_path: Path) -> None:
    # before, the run log opened after restore(): a resumed run's log did not say so
    path = _checkpoint_at(tmp_path / "ckpt", 30)
    log_path = tmp_path / "coordinator.jsonl"
    cfg = load_coordinator_config(overrides={
        "network.host": "127.0.0.1", "network.port": 0, "training.task": "digits",
        "training.max_steps": 30,  # the checkpoint's run is over: it ends at once
        "checkpointing.directory": str(tmp_path / "ckpt"), "logging.run_log": str(log_path)})
    assert run_coordinator(cfg, resume=True) == 0
    events = [r for r in read_run_log(log_path) if r["kind"] == "event"]
    resumed = [e for e in events if e["event"] == "resumed_from_checkpoint"]
    assert len(resumed) == 1, events
    assert resumed[0]["step"] == resumed[0]["version"] == 30 and resumed[0]["path"] == str(path)
    assert [e["event"] for e in events].index("resumed_from_checkpoint") < \
        [e["event"] for e in events].index("listening")


def test_unpausing_is_not_called_resumed() -> None:
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0})

    async def main() -> None:
        await c.set_paused(True, source="ctl")
        await c.set_paused(False, source="ctl")

    asyncio.run(main())
    assert [e["event"] for e in c.events][-2:] == ["paused", "unpaused"]
    assert c.events[-1]["source"] == "ctl"


# --- a resumed coordinator waiting for workers ---------------------------------------------


def test_a_resumed_coordinator_says_it_waits_for_workers_and_what_to_do(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # before, it waited for min_workers in silence: nothing said why nothing trained
    _checkpoint_at(tmp_path, 30, workers=("gone",))
    c = make_coordinator(tmp_path, **{"checkpointing.interval": 0, "training.min_workers": 2})
    assert c.checkpointer.restore(c) and c.version == 30
    c.WAITING_LOG_INTERVAL_SEC = 0.05

    async def waits() -> list[dict[str, Any]]:
        await c.start()
        try:
            async with asyncio.timeout(30):
                while len(found := [e for e in c.events if e["event"] == "waiting_for_workers"]) < 2:
                    await asyncio.sleep(0.01)
            return found
        finally:
            c.stop()
            await c.close()

    with caplog.at_level(logging.WARNING, logger="swarmtrain.coordinator"):
        found = asyncio.run(waits())
    assert found[0]["connected"] == 0 and found[0]["min_workers"] == 2 and found[0]["had"] == ["gone"]
    assert found[0]["version"] == 30
    lines = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(lines) >= 2  # at once (it was resumed), then every interval
    assert "2 more worker(s)" in lines[0] and "resumes at version 30" in lines[0]
    assert "this run had gone" in lines[0] and "--min-workers" in lines[0]
    assert "Any worker counts" in lines[0]


# --- what a worker says when the link goes -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_worker_that_never_connected_says_it_could_not_reach_the_coordinator(
        caplog: pytest.LogCaptureFixture) -> None:
    # before: "lost the coordinator", for a coordinator it never had
    port = _free_port()  # nothing listens there
    w = worker(port, **{"network.reconnect_attempts": 2, "network.reconnect_delay_sec": 0.01,
                        "training.probe_seconds": 0.0})
    with caplog.at_level(logging.WARNING, logger="swarmtrain.worker"), \
            pytest.raises(SwarmError, match="gave up reaching"):
        asyncio.run(asyncio.wait_for(w.run_async(), 60))
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"could not reach the coordinator at 127.0.0.1:{port}" in m and "is it running?" in m
               and "--host/--port" in m for m in lines), lines
    assert not any("lost the coordinator" in m for m in lines), lines


def test_a_frozen_worker_says_it_was_frozen_not_that_the_coordinator_went_silent(
        caplog: pytest.LogCaptureFixture) -> None:
    # The coordinator runs on its own thread and event loop; the worker's loop is then blocked
    # for three heartbeat timeouts, as SIGSTOP freezes a process (its compute thread aside).
    # Before, the worker woke up blaming the coordinator ("lost the coordinator ... silent").
    fast = {"network.heartbeat_interval_sec": 0.2, "network.heartbeat_timeout_sec": 1.0}
    c = coordinator(**{"training.min_workers": 1, **fast})
    ready = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def serve() -> None:
        async def main() -> None:
            await c.start()
            loops.append(asyncio.get_running_loop())
            ready.set()
            await c.run()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    # (through the loop: with the socket lent to the compute thread, that thread would train
    # on through a blocked loop, which is then rightly not a frozen process)
    w = worker(c.port, **{**fast, "network.reconnect_attempts": 5, "network.reconnect_delay_sec": 0.05,
                          "training.probe_seconds": 0.0, "training.batch_size": 8,
                          "network.direct_io": False})

    def said_frozen() -> bool:
        return any("was paused or frozen" in r.getMessage() for r in caplog.records)

    async def main() -> None:
        task = asyncio.create_task(w.run_async())
        try:
            async with asyncio.timeout(60):
                while w.steps < 3:
                    await asyncio.sleep(0.01)
            time.sleep(3.0)  # the freeze itself (not a synchronisation): nothing here runs
            async with asyncio.timeout(60):
                while not said_frozen():
                    await asyncio.sleep(0.01)
        finally:
            w.stop()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)

    try:
        with caplog.at_level(logging.WARNING, logger="swarmtrain.worker"):
            asyncio.run(main())
    finally:
        loops[0].call_soon_threadsafe(c.stop)
        thread.join(30)
    lines = [r.getMessage() for r in caplog.records if r.name == "swarmtrain.worker"]
    frozen = [m for m in lines if "was paused or frozen" in m]
    assert frozen and "heartbeat timeout of 1 s" in frozen[0] and "reconnecting" in frozen[0], lines
    assert not any("lost the coordinator" in m for m in lines), lines


# --- the status file's clock and what `ctl status` shows -------------------------------------


def _render(status: dict[str, Any], now: float | None = None) -> str:
    console = Console(width=200, force_terminal=False, color_system=None)
    with console.capture() as captured:
        print_status(status, console, **({} if now is None else {"now": now}))
    return captured.get()


def _status_with_workers() -> dict[str, Any]:
    """The status of a coordinator that had two workers: 'here' connected, 'gone' gone."""
    c = coordinator()
    for wid in ("here", "gone"):
        rec = WorkerRecord(wid, "10.0.0.2:4000", {"profile": "PI"}, 32, 5432.0, shards=[1], steps=9,
                           samples=288)
        c.workers[wid] = rec
    c.workers["here"].conn = FakeConn()  # type: ignore[assignment]
    c.workers["here"].welcomed = True
    c.loss_average.update(0.08)
    c.metrics = {"accuracy": 0.95, "loss": 0.15}
    return c.status()


class FakeConn:
    is_closed = False


def test_the_status_says_when_it_was_written_and_a_stale_one_says_so(tmp_path: Path) -> None:
    # before, the status had no wall-clock time: a dead coordinator's file read 'running'
    before = time.time()
    status = _status_with_workers()
    assert before <= status["time"] <= time.time()
    assert status["updated"].endswith("Z") and status["updated"][:4].isdigit()
    status.update(running=True, time=status["time"] - 60)
    text = _render(status, now=status["time"] + 60)
    assert "stale (last written 60 s ago; is the coordinator still running?)" in text, text
    assert "stale (" not in _render(status)  # a status asked of the coordinator itself is live
    assert "stale (" not in _render({**status, "finished": True}, now=status["time"] + 60)

    path = tmp_path / "status.json"
    path.write_text(json.dumps(status))
    old = subprocess.run(swarm_cmd("ctl", "status", "--status-file", str(path)),
                         capture_output=True, text=True, timeout=120)
    assert old.returncode == 1 and "is the coordinator still running?" in old.stdout, old
    # fresh: written "later" than the command reads it, so that the command's own start-up (slow
    # on a loaded machine) cannot make it look stale
    path.write_text(json.dumps({**status, "time": time.time() + 600}))
    fresh = subprocess.run(swarm_cmd("ctl", "status", "--status-file", str(path)),
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0 and "stale (" not in fresh.stdout, fresh


def test_ctl_status_labels_both_losses() -> None:
    # before: "loss 0.0800  accuracy 0.9500  loss 0.1500", two losses with one name
    first = _render(_status_with_workers()).splitlines()[0]
    assert "loss (EMA of workers' training loss) 0.0800" in first, first
    assert "held-out accuracy 0.9500" in first and "held-out loss 0.1500" in first, first


def test_a_gone_worker_shows_its_steps_but_no_speed_and_no_shards() -> None:
    # before: a gone worker kept the start-up probe's speed and its old shards
    status = _status_with_workers()
    rows = {w["id"]: w for w in status["workers"]}
    assert rows["gone"]["samples_per_sec"] == 0.0 and rows["gone"]["shards"] == []
    assert rows["here"]["samples_per_sec"] == 5432.0 and rows["here"]["shards"] == [1]
    text = _render(status)
    lines = [line for line in text.splitlines() if line.startswith(("here", "gone"))]
    assert [line.split()[0] for line in lines] == ["here", "gone"]  # connected ones first
    gone = lines[1]
    assert "5432" not in gone and "(gone)" in gone and " 9 " in gone, gone
    assert "5432" in lines[0]


def test_per_worker_steps_carry_on_across_a_resume(tmp_path: Path) -> None:
    # before: a resumed coordinator's workers started again from 0 steps
    c = make_coordinator(tmp_path, **{"checkpointing.interval": 0})
    c.version = 40
    c.workers["w"] = WorkerRecord("w", "", {}, 32, 0.0, steps=40, samples=1280, staleness_total=12)
    assert c.stats["applied"] == 40
    assert asyncio.run(c.checkpointer.save_now(c)).ok
    resumed = make_coordinator(tmp_path, **{"checkpointing.interval": 0})
    assert resumed.checkpointer.restore(resumed)
    rec = resumed.workers["w"]
    assert (rec.steps, rec.samples, rec.staleness_total) == (40, 1280, 12)
    assert resumed.status()["workers"][0]["avg_staleness"] == pytest.approx(12 / 40)
    # its restored steps count once in the totals: as the record's, no longer also as departed
    assert resumed.stats["applied"] == 40


def test_the_dashboard_says_stale_for_a_status_taken_long_before_it_was_served() -> None:
    c = coordinator()
    live = c.status
    c.status = lambda: {**live(), "running": True, "time": time.time() - 60}  # type: ignore[method-assign]

    async def main() -> str:
        await c.start()
        http = await serve_coordinator(c, "127.0.0.1", 0, max_age=0)
        try:
            return await run_chromium(f"http://127.0.0.1:{http.port}/", "--dump-dom", budget_ms=3000)
        finally:
            await http.close()
            c.stop()
            await c.close()

    dom = asyncio.run(main())
    assert re.search(r'<span id="state" class="stale">stale</span>', dom), dom[:3000]


def test_a_worker_process_woken_from_sigstop_says_it_was_frozen(tmp_path: Path) -> None:
    # the chaos run's case itself: a real worker process stopped and continued
    (tmp_path / "fast.toml").write_text(
        "[network]\nheartbeat_interval_sec = 0.2\nheartbeat_timeout_sec = 1.0\n")
    config = ("--config", str(tmp_path / "fast.toml"))
    env = {"SWARMTRAIN_SECRET": "chaos-test-secret"}
    status_path = tmp_path / "status.json"
    coord, port = start_coordinator(tmp_path, "--task", "digits", "--min-workers", "1",
                                    "--checkpoint-interval", "0", "--status-file", str(status_path),
                                    *config, env=env)
    log_path = tmp_path / "w.log"
    w = subprocess.Popen(
        swarm_cmd("worker", "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
                  "--worker-id", "frozen", "--batch-size", "32", "--reconnect-attempts", "5",
                  "--reconnect-delay", "0.1", *config),
        env={**os.environ, **env}, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
        start_new_session=True)

    def worker_row() -> dict[str, Any]:  # from the coordinator's status file (every second)
        rows = json.loads(status_path.read_text())["workers"] if status_path.exists() else []
        return rows[0] if rows else {}

    def wait(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{tail(log_path)}"
            time.sleep(0.1)

    try:
        wait("training", lambda: worker_row().get("steps", 0) >= 3)
        os.kill(w.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait("drop of the stopped worker", lambda: worker_row().get("connected") is False)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - stopped)))  # the freeze itself: 3 s at least
        os.kill(w.pid, signal.SIGCONT)
        wait("'frozen' line", lambda: "was paused or frozen" in log_path.read_text(errors="replace"))
        wait("reconnection", lambda: worker_row().get("connected") is True)
        text = log_path.read_text(errors="replace")
        assert "lost the coordinator" not in text, text
        stop = subprocess.run(swarm_cmd("ctl", "shutdown", "--port", str(port)), env={**os.environ, **env},
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert wait_exit(coord, 60, tmp_path / "coordinator.log") == 0
        assert wait_exit(w, 60, log_path) == 0
    finally:
        for p in (w, coord):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(timeout=10)
