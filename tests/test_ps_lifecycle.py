"""The parameter server's lifecycles and the bugs around them: the coordinator's and the
worker's state tables (every state reachable, illegal transitions refused), one checkpoint
per interval however many saves race for it, cancellation while the worker waits for its
compute thread, and a server that serves a connection only once ``connection_made`` ran."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from swarmtrain.roles.ps.checkpointing import CoordinatorCheckpointer
from swarmtrain.transport import connect
from swarmtrain.wire import Start
from tests.test_coordinator_state import gradient, make_coordinator, record
from tests.test_transport import HOST, echo, serving, timeouts


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
