"""The parameter server's lifecycles and the bugs around them: the coordinator's and the
worker's state tables (every state reachable, illegal transitions refused), one checkpoint
per interval however many saves race for it, cancellation while the worker waits for its
compute thread, and a server that serves a connection only once ``connection_made`` ran."""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.errors import ConfigError, ConnectionLost, RefusedError, StateError
from swarmtrain.roles.ps import coordinator as coordinator_module
from swarmtrain.roles.ps import worker as worker_module
from swarmtrain.roles.ps.checkpointing import CoordinatorCheckpointer
from swarmtrain.roles.ps.coordinator import Coordinator, CoordinatorState, WorkerRecord
from swarmtrain.roles.ps.ctl import ctl_request
from swarmtrain.roles.ps.shards import ShardPlanner
from swarmtrain.roles.ps.worker import Worker, WorkerState
from swarmtrain.transport import connect
from swarmtrain.wire import Decoder, Start, Update, UpdateStatus, encode_bytes
from tests.test_coordinator_state import gradient, make_coordinator, record
from tests.test_ps_inprocess import SECRET, coordinator, worker
from tests.test_transport import HOST, echo, serving, timeouts

pytestmark = pytest.mark.timeout(180)

TABLES = [(CoordinatorState, coordinator_module.TRANSITIONS, CoordinatorState.WAITING),
          (WorkerState, worker_module.TRANSITIONS, WorkerState.CONNECTING)]


async def eventually(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait (polling) until ``check()`` holds; fail after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"not within {timeout} s: {what}")


# -- the state tables ----------------------------------------------------------------------


@pytest.mark.parametrize(("states", "table", "initial"), TABLES, ids=["coordinator", "worker"])
def test_every_state_is_reachable_and_every_one_can_stop(
        states: type[enum.Enum], table: Mapping[Any, frozenset[Any]], initial: Any) -> None:
    assert set(table) == set(states)  # a move is listed from every state
    reached, todo = {initial}, [initial]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    assert reached == set(states)
    stopped = states["STOPPED"]  # type: ignore[misc]
    assert table[stopped] == frozenset()  # the end
    assert all(stopped in table[s] for s in states if s is not stopped)  # reachable from anywhere


def test_the_coordinator_refuses_every_move_its_table_does_not_list() -> None:
    c = coordinator()
    for old in CoordinatorState:
        for new in CoordinatorState:
            if new in coordinator_module.TRANSITIONS[old]:
                continue
            c.lifecycle = old  # (set by hand to try each move)
            with pytest.raises(StateError, match=f"cannot go from {old.value!r} to {new.value!r}"):
                c._enter(new)
            assert c.lifecycle is old


def test_the_worker_refuses_every_move_its_table_does_not_list() -> None:
    w = worker(1)
    for old in WorkerState:
        for new in WorkerState:
            if new in worker_module.TRANSITIONS[old]:
                continue
            w.lifecycle = old
            with pytest.raises(StateError, match=f"cannot go from {old.value!r} to {new.value!r}"):
                w._enter(new)
            assert w.lifecycle is old


def test_coordinator_pause_resume_and_shutdown_move_through_the_table_once_each() -> None:
    async def main() -> Coordinator:
        c = coordinator()
        assert c.lifecycle is CoordinatorState.WAITING and not c.running and not c.paused
        await c.set_paused(True, source="test")
        await c.set_paused(True, source="test")  # already paused: nothing moves
        assert c.lifecycle is CoordinatorState.WAITING_PAUSED and c.paused and not c.running
        assert c.status()["state"] == "waiting_paused" and c.status()["paused"]
        await c.set_paused(False)
        assert c.lifecycle is CoordinatorState.WAITING
        c.request_shutdown("test over")
        c.request_shutdown("twice")  # once shutting down, nothing more
        assert c.lifecycle is CoordinatorState.FINISHING and c.finished
        with pytest.raises(StateError, match="can no longer be paused"):
            await c.set_paused(True)
        await c.run()  # the shutdown ends in STOPPED, which ends run()
        assert c.lifecycle is CoordinatorState.STOPPED and c.status()["finished"]
        await c.shutdown_cluster("after the end")  # does nothing
        return c

    c = asyncio.run(asyncio.wait_for(main(), 60))
    kinds = [e["event"] for e in c.events if e["event"] in ("paused", "unpaused", "shutdown")]
    assert kinds == ["paused", "unpaused", "shutdown"]
    assert next(e for e in c.events if e["event"] == "shutdown")["reason"] == "test over"


def test_a_ctl_pause_of_a_finishing_run_is_answered_with_a_non_fatal_error() -> None:
    async def main() -> None:
        c = coordinator()
        await c.start()
        try:
            c._enter(CoordinatorState.FINISHING)  # (the rest of a shutdown is not run here)
            with pytest.raises(RefusedError, match="can no longer be paused") as refused:
                await ctl_request(HOST, c.port, "pause", secret=SECRET, timeout=20)
            assert refused.value.code == "finished" and c.lifecycle is CoordinatorState.FINISHING
        finally:
            await c.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_cluster_paused_before_the_start_starts_paused_and_trains_once_resumed() -> None:
    """Coordinator and worker go WAITING_PAUSED -> PAUSED -> RUNNING/TRAINING -> STOPPED."""
    async def main() -> tuple[Coordinator, Worker]:
        c = coordinator(**{"training.max_steps": 20})
        await c.start()
        run = asyncio.create_task(c.run())
        await c.set_paused(True)
        w = worker(c.port, **{"training.worker_id": "w", "training.probe_seconds": 0})
        wt = asyncio.create_task(w.run_async())
        try:
            await eventually(lambda: c.lifecycle is CoordinatorState.PAUSED, "the start, paused")
            assert any(e["event"] == "start" for e in c.events) and c.running and c.paused
            await eventually(lambda: w.lifecycle is WorkerState.PAUSED, "the worker to be paused")
            assert c.version == 0 and w.steps == 0  # nothing computed while paused
            await c.set_paused(False)
            assert c.lifecycle is CoordinatorState.RUNNING
            await eventually(lambda: w.lifecycle is not WorkerState.PAUSED, "the worker to resume")
            async with asyncio.timeout(120):
                await run  # max_steps: FINISHING, then STOPPED
                await wt
        finally:
            w.stop()
            await asyncio.gather(wt, return_exceptions=True)
            await c.close()
        return c, w

    c, w = asyncio.run(main())
    assert c.lifecycle is CoordinatorState.STOPPED and c.version >= 20
    assert w.lifecycle is WorkerState.STOPPED and w.shutdown_reason and w.steps >= 20


# -- the worker waits for its compute thread, and is still cancellable ---------------------


def test_a_worker_cancelled_while_it_waits_for_its_compute_thread_is_cancelled() -> None:
    """A gradient computed ahead (overlap) must finish before the session resets; a cancel
    that arrives meanwhile must end the worker, not be swallowed (it used to be, and the
    worker went on to reconnect)."""
    w = worker(1, **{"training.max_inflight": 1})
    w._claim_cap = 1 << 20
    w.round_trip_time.value = w.compute_time.value = 1.0  # a slow link: the next gradient is computed ahead
    codec = make_codec("none")
    grads = {n: codec.compress(torch.zeros_like(p)) for n, p in w.params.items()}
    calls, ahead, release = [], threading.Event(), threading.Event()

    def compute() -> Any:
        calls.append(1)
        if len(calls) > 1:  # the one computed ahead: busy until the test says so
            ahead.set()
            release.wait(30)
        return grads, 1.0, 32, 0.01, 0.0, {}

    w._compute = compute  # type: ignore[method-assign]

    class BrokenLink:
        def __init__(self) -> None:
            self.sent = asyncio.Event()

        async def send(self, msg: Any) -> None:
            self.sent.set()
            raise ConnectionLost("the link broke while sending")

    async def main() -> None:
        w._enter(WorkerState.TRAINING)
        conn = BrokenLink()
        train = asyncio.create_task(w._train(conn))  # type: ignore[arg-type]
        await asyncio.wait_for(conn.sent.wait(), 30)  # the send failed: it waits for the thread
        assert await asyncio.get_running_loop().run_in_executor(None, ahead.wait, 30)
        train.cancel()
        done, _ = await asyncio.wait([train], timeout=0.5)
        assert not done  # still waiting for the computation...
        release.set()
        with pytest.raises(asyncio.CancelledError):  # ...then cancelled, not ConnectionLost
            await asyncio.wait_for(train, 30)

    try:
        asyncio.run(main())
    finally:
        release.set()
        w._pool.shutdown(wait=True)


# -- values derived, not kept twice --------------------------------------------------------


def test_stats_are_the_records_counters_and_keep_those_of_forgotten_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0})
    recs = [record(c, f"w{i}") for i in range(3)]
    for i, rec in enumerate(recs):
        rec.steps, rec.stale, rec.duplicates, rec.rejected = 10 * (i + 1), i, 1, 2
    assert c.stats == {"applied": 60, "stale": 3, "duplicates": 3, "rejected": 6}
    monkeypatch.setattr(coordinator_module, "MAX_WORKER_RECORDS", 1)
    c._forget_old_workers()  # none is connected: two are forgotten, their counts are not
    assert len(c.workers) == 1
    assert c.stats == {"applied": 60, "stale": 3, "duplicates": 3, "rejected": 6}
    assert c.status()["stats"] == c.stats


def test_a_records_shard_index_is_its_first_shard() -> None:
    rec = WorkerRecord("w", "", {}, 32, 0.0, [3, 5])
    assert rec.shard_index == 3
    rec.shards = [1]
    assert rec.shard_index == 1 and rec.summary(0, 1)["shard"] == 1
    assert WorkerRecord("gone", "", {}, 0, 0.0).shard_index == -1  # (restored, holds none)


def test_update_status_travels_as_the_same_bytes_as_its_string() -> None:
    for status in UpdateStatus:
        fields: dict[str, Any] = dict(msg_id=3, version=4)
        wire = encode_bytes(Update(status=status, **fields))
        assert wire == encode_bytes(Update(status=status.value, **fields))
        d = Decoder()
        d.feed(wire)
        got = d.next_message()
        assert isinstance(got, Update) and got.status == status and UpdateStatus(got.status) is status


def test_saves_racing_at_one_interval_boundary_write_one_checkpoint(tmp_path: Path) -> None:
    """Every applied gradient asks for a checkpoint; those asked for while one is being written
    must not each write another a few updates later (``keep`` would then hold near-duplicates)."""
    c = make_coordinator(tmp_path, **{"checkpointing.interval": 5})
    assert isinstance(c.checkpointer, CoordinatorCheckpointer)
    rec = record(c)
    store = c.checkpointer.store
    real_save = store.save
    writing, go_on = threading.Event(), threading.Event()

    def slow_save(*args: Any) -> Any:  # the first write is held until the test lets it go
        writing.set()
        go_on.wait(10)
        return real_save(*args)

    store.save = slow_save  # type: ignore[method-assign]

    async def main() -> None:
        for i in range(1, 6):
            assert c._apply_gradient(rec, gradient(c, i))[0] == "applied"
        assert c.version == 5  # an interval boundary: eight saves are asked for at once
        savers = [asyncio.create_task(c._maybe_checkpoint()) for _ in range(8)]
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, writing.wait, 10)  # version 5 is being written
        assert c._apply_gradient(rec, gradient(c, 6))[0] == "applied"  # training goes on
        go_on.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*savers)

    asyncio.run(main())
    written = [e["step"] for e in c.events if e["event"] == "checkpoint"]
    assert written == [5], written
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000000000005"]


class _LateConnectionMade(asyncio.BufferedProtocol):
    """Passes everything to ``inner`` but calls its ``connection_made`` a few event loop turns
    late: asyncio promises to call it, not when (another event loop may well be later)."""

    def __init__(self, inner: asyncio.BufferedProtocol) -> None:
        self.inner = inner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()

        def later(turns: int) -> None:
            if turns:
                loop.call_soon(later, turns - 1)
            else:
                self.inner.connection_made(transport)

        later(5)

    def get_buffer(self, sizehint: int) -> Any:
        return self.inner.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.inner.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def test_the_server_serves_a_connection_once_connection_made_ran_however_late() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        real_create_server = loop.create_server

        async def create_server(factory: Any, *args: Any, **kwargs: Any) -> Any:
            return await real_create_server(lambda: _LateConnectionMade(factory()), *args, **kwargs)

        loop.create_server = create_server  # type: ignore[method-assign]
        async with serving(echo) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker",
                                 timeouts=timeouts(handshake=5))
            try:
                await conn.send(Start(version=7))
                assert await conn.recv(timeout=10) == Start(version=7)
            finally:
                await conn.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_shard_planner_preconditions_are_typed_errors_that_survive_python_o() -> None:
    with pytest.raises(ConfigError, match="num_shards must be >= 1"):
        ShardPlanner(0)
    with pytest.raises(ConfigError, match=r"shard 7 is out of range: there are 3 shards \(0..2\)"):
        ShardPlanner(3).join("x", pinned=7)
