"""Signals and status files, the same for every command (swarmtrain.app.lifecycle)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import IO

import pytest

from swarmtrain.app.lifecycle import graceful_signals, keep_status_file, write_status_file
from swarmtrain.fsutil import FileWriteError

# A command that stops cleanly on its first signal: in "slow" mode the clean stop hangs (a
# dead peer), so only a second signal ends it.
_COMMAND = textwrap.dedent("""
    import asyncio, logging, sys, time
    from swarmtrain.app.lifecycle import graceful_signals

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    style, stop_kind = sys.argv[1], sys.argv[2]

    def clean_stop():
        print("stopping", flush=True)
        if stop_kind == "slow":
            time.sleep(60)  # the clean stop hangs
            sys.exit(4)
        print("stopped cleanly", flush=True)

    if style == "sync":
        asked = []
        graceful_signals(asked.append, what="finishing the round")
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while not asked and time.monotonic() < deadline:
            time.sleep(0.01)  # the peer's training loop, checking its stop flag
        if not asked:
            sys.exit(3)
        clean_stop()
    else:
        async def main():
            stop = asyncio.Event()
            with graceful_signals(lambda sig: stop.set(), what="finishing the round",
                                  loop=asyncio.get_running_loop()):
                print("ready", flush=True)
                await asyncio.wait_for(stop.wait(), 60)
                print("stopping", flush=True)
                if stop_kind == "slow":
                    time.sleep(60)  # the clean stop hangs, blocking the event loop itself
                    sys.exit(4)
                print("stopped cleanly", flush=True)
        asyncio.run(main())
""")


def _start(style: str, stop_kind: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _COMMAND, style, stop_kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()

    def pump(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))

    assert proc.stdout is not None
    threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
    return proc, lines


def _expect(lines: queue.Queue[str], wanted: str, proc: subprocess.Popen[str]) -> None:
    try:
        got = lines.get(timeout=60)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"no {wanted!r} line within 60 s")
    assert got == wanted


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        pytest.fail("the command did not exit within 60 s")
    assert proc.stderr is not None
    return proc.returncode, proc.stderr.read()


@pytest.mark.parametrize("style", ["sync", "asyncio"])
def test_one_sigterm_stops_cleanly_and_says_a_second_forces(style: str) -> None:
    proc, lines = _start(style, "quick")
    _expect(lines, "ready", proc)
    proc.send_signal(signal.SIGTERM)
    _expect(lines, "stopping", proc)
    _expect(lines, "stopped cleanly", proc)
    code, err = _finish(proc)
    assert code == 0, err
    assert "received SIGTERM: finishing the round; send it again to stop at once" in err


@pytest.mark.parametrize("style", ["sync", "asyncio"])
def test_a_second_sigterm_ends_a_hanging_clean_stop_at_once(style: str) -> None:
    proc, lines = _start(style, "slow")
    _expect(lines, "ready", proc)
    proc.send_signal(signal.SIGTERM)
    _expect(lines, "stopping", proc)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == -signal.SIGTERM, err  # killed by the signal, as if unhandled
    assert "received SIGTERM again: stopping at once" in err


def test_handlers_are_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with graceful_signals(lambda sig: None):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_once_the_loop_is_closed_the_previous_handler_takes_the_signal() -> None:
    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        loop = asyncio.new_event_loop()
        graceful_signals(lambda sig: pytest.fail("the command is over: nothing to stop"), loop=loop)
        loop.close()
        signal.raise_signal(signal.SIGTERM)
        assert got == [signal.SIGTERM]
        signal.raise_signal(signal.SIGTERM)  # and it stays with it
        assert got == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_reader_never_sees_a_partial_status_file(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    write_status_file(path, {"n": -1, "pad": ""})
    done = threading.Event()
    problems: list[str] = []
    reads = 0

    def read_forever() -> None:
        nonlocal reads
        while not done.is_set():
            text = path.read_text()
            reads += 1
            try:
                json.loads(text)
            except ValueError:
                problems.append(f"{len(text)} bytes: {text[:40]!r}...")

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        for n in range(200):  # alternately large and small, so a torn write would show
            write_status_file(path, {"n": n, "pad": "x" * (200_000 if n % 2 else 10)})
    finally:
        done.set()
        reader.join(timeout=60)
    assert reads > 0 and problems == []
    assert json.loads(path.read_text())["n"] == 199
    assert os.listdir(tmp_path) == ["status.json"]


def test_write_status_file_raises_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(FileWriteError, match="missing"):
        write_status_file(tmp_path / "missing" / "status.json", {})


def test_keep_status_file_rewrites_it_and_survives_failed_writes(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "later"  # missing at first: the writes fail until it exists
    path = directory / "status.json"
    calls = 0

    async def main() -> None:
        nonlocal calls
        written_again = asyncio.Event()

        def snapshot() -> dict[str, int]:
            nonlocal calls
            calls += 1
            if calls == 3:
                directory.mkdir()
            if calls == 5:
                written_again.set()
            return {"calls": calls}

        task = asyncio.create_task(keep_status_file(path, snapshot, interval=0.001))
        async with asyncio.timeout(60):
            await written_again.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="swarmtrain.app"):
        asyncio.run(main())
    assert json.loads(path.read_text())["calls"] in (4, 5)  # cancelled at or after the 5th
    failures = [r for r in caplog.records if "status file" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(failures) == 1 and "cannot write" in failures[0].getMessage()  # once per streak
    assert any(f"status file {path} written again" in r.getMessage() for r in caplog.records)
