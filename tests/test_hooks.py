"""Public hooks that replace reaches into privates (#19)."""

from __future__ import annotations

import asyncio
import inspect
import socket

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.roles.ps.checkpointing import CoordinatorCheckpointer
from swarmtrain.roles.ps.hooks import CheckpointHook
from swarmtrain.transport import Connection, start_server
from swarmtrain.transport.connection import FrameProtocol
from swarmtrain.wire import Limits


def test_writable_waits_while_flow_control_holds_writes_back() -> None:
    async def main() -> None:
        proto = FrameProtocol(Limits())
        assert proto.can_write
        async with asyncio.timeout(10):
            await proto.writable()  # at once
        proto.pause_writing()
        assert not proto.can_write
        waiter = asyncio.create_task(proto.writable())
        await asyncio.sleep(0)  # let it reach its wait: it must still be waiting after
        assert not waiter.done()
        proto.resume_writing()
        async with asyncio.timeout(10):
            await waiter
        assert proto.can_write

    asyncio.run(main())


def test_losing_the_connection_releases_a_waiting_writer() -> None:
    async def main() -> None:
        proto = FrameProtocol(Limits())
        proto.pause_writing()
        waiter = asyncio.create_task(proto.writable())
        proto.connection_lost(None)
        async with asyncio.timeout(10):
            await waiter

    asyncio.run(main())


def test_the_coordinator_checkpointer_provides_the_checkpoint_hook() -> None:
    # mypy checks the assignment in swarmtrain itself once the coordinator takes a
    # CheckpointHook; this keeps the two method sets from drifting apart meanwhile
    for name in ("maybe_save", "save_now", "restore"):
        hook, impl = getattr(CheckpointHook, name), getattr(CoordinatorCheckpointer, name)
        assert inspect.iscoroutinefunction(hook) == inspect.iscoroutinefunction(impl), name
        assert list(inspect.signature(hook).parameters) == list(inspect.signature(impl).parameters), name


def test_start_server_on_a_taken_port_is_a_swarm_error_naming_it() -> None:
    async def handler(conn: Connection, role: str) -> None:
        raise AssertionError("no connection is expected")

    async def main(port: int) -> None:
        await start_server("127.0.0.1", port, handler, secret=b"s")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SwarmError, match=f"cannot listen on 127.0.0.1:{port}.*choose another --port"):
            asyncio.run(main(port))
