"""Lending a connection's socket to a thread (swarmtrain/transport/direct.py), over real
loopback TCP: what was received before goes to the link in order, what the link leaves goes
back to the inbox in order, what is queued meanwhile is sent after; heartbeats and silence
are handled while the loop stands aside; a peer that closes or sends garbage, or a local
abort, ends the thread's wait; and a worker whose steps are quick trains on the lent socket,
pauses and resumes there, and ends holding the coordinator's weights."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.errors import ConnectionLost, RemoteProtocolError, SwarmError, SwarmTimeout
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.worker import Worker, WorkerState
from swarmtrain.transport import Connection, connect
from swarmtrain.transport.direct import DirectLink
from swarmtrain.transport.payload_gate import PayloadGate
from swarmtrain.transport.tls import ClusterKeys, generate_cluster_keys
from swarmtrain.wire import Decoder, Error, Heartbeat, Message, Start, Weights, encode_bytes
from swarmtrain.wire.frame import PROTOCOL_VERSION
from tests.test_ps_inprocess import coordinator, worker
from tests.test_tls import node
from tests.test_transport import HOST, RawPeer, eventually, raw_server, run, serving, timeouts

pytestmark = pytest.mark.timeout(90)


async def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own, as the worker's compute thread drives a link."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def lent(conn: Connection) -> DirectLink:
    link = await conn.start_direct()
    assert link is not None, "a plain TCP connection with no payload gate is lent"
    return link


@contextlib.asynccontextmanager
async def pair(**tight: float) -> Any:
    """(client connection, the server's side of it), over loopback."""
    accepted: asyncio.Queue[Connection] = asyncio.Queue()

    async def handler(conn: Connection, role: str) -> None:
        accepted.put_nowait(conn)
        with contextlib.suppress(SwarmError):
            await conn.wait_closed()

    t = timeouts(**tight)
    async with serving(handler, timeouts=t) as srv:
        conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=t)
        try:
            yield conn, await asyncio.wait_for(accepted.get(), 10)
        finally:
            await conn.close()


def versions(msgs: list[Message]) -> list[int]:
    return [m.version for m in msgs if isinstance(m, Start)]


def test_messages_keep_their_order_across_the_lending_both_ways() -> None:
    async def scenario() -> None:
        async with pair() as (conn, server):
            for v in (1, 2):
                await server.send(Start(version=v))
            await eventually(lambda: conn._proto.inbox.qsize() == 2, what="1 and 2 received")
            link = await lent(conn)
            assert conn.direct is link
            for v in (3, 4, 5):
                await server.send(Start(version=v))
            await conn.send(Start(version=100))  # queued while lent: goes out after the link's
            payload = torch.randn(50_000)  # a payload larger than the link's receive buffer

            def drive() -> list[int]:
                got = [link.recv(10), link.recv(10), link.recv(10)]
                fourth = link.recv(10)  # taken and handed back, as the worker does
                assert fourth is not None
                link.pending.appendleft(fourth)
                link.send(Start(version=99))
                link.send(Weights(version=7, tensors={"w": payload}))
                return versions([m for m in got if m is not None])

            assert await in_thread(drive) == [1, 2, 3]
            conn.end_direct(link)
            assert conn.direct is None
            assert versions([await conn.recv(timeout=10), await conn.recv(timeout=10)]) == [4, 5]
            got = [await server.recv(timeout=10) for _ in range(3)]
            assert versions(got[:1]) == [99] and versions(got[2:]) == [100]
            assert isinstance(got[1], Weights) and torch.equal(got[1].tensors["w"], payload)
            await conn.send(Start(version=101))  # the loop writes again
            assert versions([await server.recv(timeout=10)]) == [101]
            assert conn.sent_by_type["START"] >= 3 and conn.sent_by_type["WEIGHTS"] == 1
            assert conn.received_by_type["START"] == 5

    run(scenario())


def test_a_lent_link_sends_heartbeats_and_gives_up_on_a_silent_peer() -> None:
    frames: list[Message] = []

    async def silent(peer: RawPeer) -> None:
        await peer.server_handshake(None)
        decoder = Decoder()
        with contextlib.suppress(ConnectionError):
            while data := await peer.reader.read(1 << 16):
                decoder.feed(data)
                while (m := decoder.next_message()) is not None:
                    frames.append(m)

    async def scenario() -> None:
        async with raw_server(silent) as port:
            t = timeouts(heartbeat_interval=0.1, heartbeat_timeout=1.5)
            conn = await connect(HOST, port, secret=None, role="worker", timeouts=t)
            try:
                link = await lent(conn)
                frames.clear()
                with pytest.raises(SwarmTimeout) as info:
                    await in_thread(lambda: link.recv(30))
                assert info.value.phase == "heartbeat"
                conn.end_direct(link)
                assert conn.is_closed
                with pytest.raises(SwarmTimeout):
                    await conn.recv(timeout=5)
            finally:
                await conn.close()
        beats = [m for m in frames if isinstance(m, Heartbeat)]
        assert len(beats) >= 5, f"the link kept the connection alive: {len(beats)} heartbeats in 1.5 s"

    run(scenario())


def test_a_peer_that_closes_ends_the_wait_and_the_connection() -> None:
    async def scenario() -> None:
        async with pair() as (conn, server):
            link = await lent(conn)
            wait = asyncio.ensure_future(in_thread(lambda: link.recv(30)))
            await asyncio.sleep(0.2)
            await server.close()
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(wait, 20)
            conn.end_direct(link)
            assert conn.is_closed
            with pytest.raises(ConnectionLost):
                await conn.recv(timeout=5)

    run(scenario())


def test_garbage_from_the_peer_is_refused_with_an_error_frame() -> None:
    told: list[Message] = []

    async def garbage(peer: RawPeer) -> None:
        await peer.server_handshake(None)
        await asyncio.sleep(0.3)  # (the client lends its socket meanwhile)
        peer.send(b"SWRM" + bytes([PROTOCOL_VERSION, 0xEE]) + bytes(14))  # an unknown type
        told.extend(await peer.read_to_eof())

    async def scenario() -> None:
        async with raw_server(garbage) as port:
            conn = await connect(HOST, port, secret=None, role="worker", timeouts=timeouts())
            try:
                link = await lent(conn)
                with pytest.raises(RemoteProtocolError) as info:
                    await in_thread(lambda: link.recv(20))
                assert info.value.code == "unknown_type"
                conn.end_direct(link)
                assert conn.is_closed
                await eventually(lambda: any(isinstance(m, Error) for m in told), what="the error frame")
            finally:
                await conn.close()
        assert [(m.code, m.fatal) for m in told if isinstance(m, Error)] == [("unknown_type", True)]

    run(scenario())


def test_a_message_out_of_range_is_counted_and_answered_while_lent() -> None:
    told: list[Message] = []

    async def out_of_range(peer: RawPeer) -> None:
        await peer.server_handshake(None)
        await asyncio.sleep(0.3)  # (the client lends its socket meanwhile)
        peer.send(encode_bytes(Start(version=-1)))  # a sound frame, a field out of range
        peer.send(Start(version=3))
        with contextlib.suppress(TimeoutError):
            told.append(await peer.recv(timeout=10))

    async def scenario() -> None:
        async with raw_server(out_of_range) as port:
            conn = await connect(HOST, port, secret=None, role="worker", timeouts=timeouts())
            try:
                link = await lent(conn)
                got = await in_thread(lambda: link.recv(20))
                assert got == Start(version=3)  # the stream went on past the refused message
                assert sum(conn._proto.refused_messages.values()) == 1
                await eventually(lambda: bool(told), what="the peer told of its refused message")
                conn.end_direct(link)
                assert not conn.is_closed
            finally:
                await conn.close()
        assert isinstance(told[0], Error) and not told[0].fatal and "out of range" in told[0].message

    run(scenario())


def test_an_abort_on_the_loop_wakes_the_thread_at_once() -> None:
    async def scenario() -> None:
        async with pair() as (conn, _):
            link = await lent(conn)
            started = time.monotonic()
            # without the wake-up, recv would wait its 20 s and return None (nothing came)
            wait = asyncio.ensure_future(in_thread(lambda: link.recv(20)))
            await asyncio.sleep(0.2)
            conn.abort(SwarmError("stopped by the test"))
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(wait, 30)
            assert time.monotonic() - started < 15
            conn.end_direct(link)
            assert conn.is_closed

    run(scenario())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ClusterKeys:
    return generate_cluster_keys(tmp_path_factory.mktemp("keys"), ["server", "client"])


def test_only_a_plain_connection_without_a_payload_gate_is_lent(cluster: ClusterKeys) -> None:
    async def scenario() -> None:
        async with pair() as (conn, _):
            conn.admit_payloads(PayloadGate(1 << 20, timeout=5))
            assert await conn.start_direct() is None
        tls_client = node(cluster, "client")

        async def handler(c: Connection, role: str) -> None:
            with contextlib.suppress(SwarmError):
                await c.wait_closed()

        async with serving(handler, tls=node(cluster, "server")) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=timeouts(),
                                 tls=tls_client)
            try:
                assert await conn.start_direct() is None  # (TLS lives in asyncio's transport)
                await conn.send(Start(version=1))  # and the connection is as it was
            finally:
                await conn.close()

    run(scenario())


# -- the worker ------------------------------------------------------------------------------


def test_a_quick_worker_trains_on_the_lent_socket_pauses_resumes_and_ends_current(tmp_path: Path) -> None:
    async def main() -> tuple[Coordinator, Worker, list[int]]:
        c = coordinator(**{"training.max_steps": 100_000})
        await c.start()
        run_task = asyncio.create_task(c.run())
        w = worker(c.port, **{"training.worker_id": "quick", "training.max_inflight": 1})
        wt = asyncio.create_task(w.run_async())
        try:
            await eventually(lambda: w.direct_bursts >= 1 and w.steps >= 100, timeout=60,
                             what="steps on the lent socket")
            await c.set_paused(True)
            await eventually(lambda: w.lifecycle is WorkerState.PAUSED, timeout=30,
                             what="the worker to pause")
            await asyncio.sleep(0.3)
            paused_at = [w.steps, c.version]
            await asyncio.sleep(0.5)
            assert [w.steps, c.version] == paused_at, "nothing is computed or applied while paused"
            await c.set_paused(False)
            await eventually(lambda: w.direct_bursts >= 2 and w.steps >= paused_at[0] + 100, timeout=60,
                             what="training again on the lent socket")
            c.request_shutdown("test over")
            async with asyncio.timeout(60):
                await run_task
                await wt
        finally:
            w.stop()
            await asyncio.gather(wt, return_exceptions=True)
            await c.close()
        return c, w, paused_at

    c, w, _ = asyncio.run(main())
    assert w.lifecycle is WorkerState.STOPPED and w.shutdown_reason
    assert w.statuses.get("applied", 0) >= 200
    # the worker's replica is exactly the coordinator's final weights (the answers taken on the
    # lent socket and the final WEIGHTS went through the same replica)
    assert w.version == c.version
    for name, p in c.params.items():
        assert torch.equal(w.params[name].detach(), p.detach()), name
