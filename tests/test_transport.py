"""The asyncio transport over real loopback TCP (port 0): handshake and cluster secrets,
refusal of garbage, heartbeats, timeouts per phase and bounded send queues.

Each test is a plain function that runs its scenario with ``asyncio.run`` under an overall
deadline, and every wait inside has its own timeout, so a bug shows as a failure, not a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import torch

from swarmtrain.errors import (
    AuthError,
    ConnectionLost,
    RemoteProtocolError,
    SwarmError,
    SwarmTimeout,
)
from swarmtrain.transport import Connection, Server, Timeouts, auth, connect, start_server
from swarmtrain.transport.connection import FrameProtocol
from swarmtrain.wire import (
    Auth,
    Challenge,
    Decoder,
    Error,
    Heartbeat,
    Hello,
    Limits,
    Message,
    Shutdown,
    Start,
    Weights,
    Welcome,
    encode_bytes,
)
from swarmtrain.wire.frame import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
#: generous limits for everything that is not under test, so a slow machine does not fail
SLOW = Timeouts(connect=10, handshake=10, heartbeat_interval=0.5, heartbeat_timeout=20, send=20)


def timeouts(**tight: float) -> Timeouts:
    """SLOW with the phases under test made short."""
    return dataclasses.replace(SLOW, **tight)


def run(coro: Coroutine[Any, Any, Any], timeout: float = 40) -> Any:
    """Run one test scenario on a fresh event loop, under an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[Connection, str], Awaitable[None]], **kwargs: Any
) -> AsyncIterator[Server]:
    kwargs.setdefault("secret", None)
    kwargs.setdefault("timeouts", SLOW)
    srv = await start_server(HOST, 0, handler, **kwargs)
    try:
        yield srv
    finally:
        await asyncio.wait_for(srv.close(), 15)


async def echo(conn: Connection, role: str) -> None:
    """Send every message back until the peer goes away."""
    while True:
        try:
            msg = await conn.recv(timeout=20)
        except SwarmError:
            return
        await conn.send(msg)


async def idle(conn: Connection, role: str) -> None:
    with contextlib.suppress(SwarmError):
        await conn.recv(timeout=20)


async def eventually(cond: Callable[[], bool], timeout: float = 10, what: str = "") -> None:
    """Wait until ``cond()`` holds (polling), failing after ``timeout`` seconds."""
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        pytest.fail(f"condition not reached within {timeout} s: {what}")


# --- raw peers: a socket speaking the wire protocol by hand ------------------------------


class RawPeer:
    """A plain asyncio stream plus a Decoder: a peer that does exactly what the test says."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = Decoder()

    @classmethod
    async def open(cls, port: int) -> RawPeer:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10)
        return cls(reader, writer)

    def send(self, msg: Message | bytes) -> None:
        self.writer.write(msg if isinstance(msg, bytes) else encode_bytes(msg))

    async def recv(self, timeout: float = 10) -> Message:
        """The next message, skipping heartbeats; raises ConnectionLost at EOF."""
        async def read() -> Message:
            while True:
                msg = self.decoder.next_message()
                if msg is not None and not isinstance(msg, Heartbeat):
                    return msg
                if msg is None:
                    data = await self.reader.read(1 << 16)
                    if not data:
                        raise ConnectionLost("raw peer saw EOF")
                    self.decoder.feed(data)

        return await asyncio.wait_for(read(), timeout)

    async def read_to_eof(self, timeout: float = 10) -> list[Message]:
        """Every message until the other side closes."""
        out: list[Message] = []
        with contextlib.suppress(ConnectionLost, ConnectionResetError):
            while True:
                out.append(await self.recv(timeout))
        return out

    async def client_handshake(
        self, secret: bytes | None, proof_secret: bytes | None = None
    ) -> Message:
        """HELLO, CHALLENGE, AUTH (with a proof made from ``proof_secret``), then the reply."""
        nc = auth.new_nonce()
        self.send(Hello(role="worker", nonce=nc))
        ch = await self.recv()
        assert isinstance(ch, Challenge)
        key = secret if proof_secret is None else proof_secret
        self.send(Auth(proof=auth.client_proof(key, auth.Transcript("worker", nc, ch.nonce,
                                                                    open_cluster=ch.open_cluster))))
        return await self.recv()

    async def server_handshake(self, secret: bytes | None) -> None:
        hello = await self.recv()
        assert isinstance(hello, Hello)
        t = auth.Transcript(hello.role, hello.nonce, auth.new_nonce(), node=hello.node,
                            software=hello.software, open_cluster=secret is None)
        self.send(Challenge(nonce=t.server_nonce, proof=auth.server_proof(secret, t),
                            open_cluster=t.open_cluster))
        reply = await self.recv()
        assert isinstance(reply, Auth)
        assert auth.proofs_equal(reply.proof, auth.client_proof(secret, t))
        self.send(Welcome(session="raw", proof=auth.welcome_proof(secret, t, "raw")))

    def close(self) -> None:
        self.writer.close()


@contextlib.asynccontextmanager
async def raw_server(serve: Callable[[RawPeer], Awaitable[None]]) -> AsyncIterator[int]:
    """A listening socket whose connections are driven by ``serve`` (a hand-made peer)."""
    tasks: list[asyncio.Task[None]] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.append(asyncio.create_task(serve(RawPeer(reader, writer))))

    srv = await asyncio.start_server(on_connect, HOST, 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# --- authentication primitives ------------------------------------------------------------


def _documented_mac(key: bytes, label: bytes, *fields: bytes) -> bytes:
    """The MAC exactly as docs/protocol.md writes it, independently of transport/auth.py."""
    data = b"".join(struct.pack("<H", len(f)) + f for f in (b"swarmtrain handshake", label, *fields))
    return hmac.new(key, data, hashlib.sha256).digest()


def test_hmac_proofs_match_the_documented_construction_and_vectors() -> None:
    """docs/protocol.md gives the MAC inputs and these vectors; keep them true."""
    nc, ns, key = bytes(range(32)), bytes(range(32, 64)), b"example-secret"
    t = auth.Transcript("worker", nc, ns, node="w1", software="swarmtrain test")
    fields = (b"\x02", b"worker", b"w1", b"swarmtrain test", nc, ns, b"\x00")
    server, client = auth.server_proof(key, t), auth.client_proof(key, t)
    welcome = auth.welcome_proof(key, t, "0123456789abcdef")
    assert server == _documented_mac(key, b"server", *fields)
    assert client == _documented_mac(key, b"client", *fields)
    assert welcome == _documented_mac(key, b"welcome", *fields, b"0123456789abcdef")
    assert server.hex() == "54923ee3b53ec50573d8c3ba007fb667741a548c1d22c1ae2bf9da3bb9ea3905"
    assert client.hex() == "497c9ee1ae2eef02e05c0e8688fd2a3af947be3386d20cf9550aa1d108fea229"
    assert welcome.hex() == "8130037c91c2de415dcfbe722a0e8e5b956f20fbe85836e3161fac6426bdacbe"
    open_t = dataclasses.replace(t, open_cluster=True)
    assert auth.server_proof(None, open_t).hex() == (
        "05a63eea490642fe4efbced6a760cc683b017d0263e2c697cd511199a947afc0")
    announcement = struct.pack("<QIH", 7, 1, 4) + b"ring"
    ring_s = auth.ring_server_proof(key, 2, nc, ns)
    ring_c = auth.ring_client_proof(key, 2, nc, ns, announcement)
    assert ring_s == _documented_mac(key, b"ring server", b"\x02", nc, ns)
    assert ring_c == _documented_mac(key, b"ring client", b"\x02", nc, ns, announcement)
    assert ring_s.hex() == "fa4ab35f936bd50b363f554937f3a1d4fefded0ff554eb968895b27def6d6f3c"
    assert ring_c.hex() == "b4087e9ca8270e2a9c241ed3108a16bfc70292dfd6b11f949a0f3d29731f199a"
    # every claimed field changes the proof
    for change in ({"role": "ctl"}, {"node": "w2"}, {"software": "x"}, {"open_cluster": True},
                   {"version": 1}, {"client_nonce": ns}, {"server_nonce": nc}):
        assert auth.server_proof(key, dataclasses.replace(t, **change)) != server  # type: ignore[arg-type]
    assert server != client and auth.server_proof(b"other", t) != server
    assert len(auth.new_nonce()) == auth.NONCE_BYTES == 32
    assert auth.new_nonce() != auth.new_nonce()


# --- data --------------------------------------------------------------------------------


def test_large_tensor_message_echoes_bit_exactly() -> None:
    g = torch.Generator().manual_seed(1)
    sent = Weights(version=7, tensors={
        "big": torch.randn(4 * 1024 * 1024, generator=g),  # 16 MiB
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
    })
    roles: list[str] = []

    async def handler(conn: Connection, role: str) -> None:
        roles.append(role)
        await echo(conn, role)

    async def scenario() -> None:
        async with serving(handler, secret=b"s3cret") as srv:
            conn = await connect(HOST, srv.port, secret=b"s3cret", role="worker", timeouts=SLOW)
            try:
                assert conn.session
                await conn.send(sent)
                got = await conn.recv(timeout=30)
            finally:
                await conn.close()
        assert roles == ["worker"]
        assert isinstance(got, Weights) and got.version == 7
        assert list(got.tensors) == list(sent.tensors)
        for name, t in sent.tensors.items():
            assert _same(got.tensors[name], t), name
        assert srv.failed_handshakes == 0

    run(scenario())


@pytest.mark.parametrize("size", [0, 256 * 1024])
def test_accepted_connections_have_the_socket_buffers_asked_for(size: int) -> None:
    """A server that holds connections unread (the payload gate) bounds the kernel memory each
    may fill: with ``socket_buffer_bytes`` every accepted connection's buffers are fixed at
    that size (Linux books twice what is asked), and a 16 MiB message still goes through
    bit for bit; with 0 the kernel sizes them itself."""
    import socket as socketlib

    seen: list[tuple[int, int]] = []

    async def handler(conn: Connection, role: str) -> None:
        sock = conn.transport.get_extra_info("socket")
        seen.append((sock.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_RCVBUF),
                     sock.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_SNDBUF)))
        await echo(conn, role)

    big = Weights(version=1, tensors={"w": torch.randn(4 * 1024 * 1024)})

    async def scenario() -> None:
        async with serving(handler, socket_buffer_bytes=size) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            try:
                await conn.send(big)
                got = await conn.recv(timeout=30)
            finally:
                await conn.close()
        assert isinstance(got, Weights) and torch.equal(got.tensors["w"], big.tensors["w"])

    run(scenario())
    (rcv, snd), = seen
    if size:
        assert (rcv, snd) == (2 * size, 2 * size)
    else:  # the kernel's own sizing (tcp_rmem / tcp_wmem defaults), not what a test asked
        assert rcv != 2 * 256 * 1024 and snd != 2 * 256 * 1024


def test_messages_arrive_in_order() -> None:
    async def scenario() -> None:
        async with serving(echo) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            try:
                for i in range(50):
                    await conn.send(Start(version=i))
                got = [await conn.recv(timeout=10) for _ in range(50)]
            finally:
                await conn.close()
        assert got == [Start(version=i) for i in range(50)]

    run(scenario())


def test_a_small_message_is_written_by_send_itself_and_mixed_sizes_keep_their_order() -> None:
    """send() hands a small message to the transport itself when nothing is ahead of it (no
    turn of the event loop for the writer task: a quick worker's every answer), and queues it
    behind anything that is: mixed with large messages, which go through the writer in
    slices, every message arrives in the order sent."""
    async def scenario() -> None:
        async with serving(echo) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            try:
                await eventually(lambda: conn._outbox.empty() and not conn.transport.get_write_buffer_size())
                before = conn.bytes_sent
                await conn.send(Start(version=1000))
                assert conn.bytes_sent > before  # on its way before send returned
                big = torch.arange(200_000, dtype=torch.float32)  # 800 KB: through the writer
                sent: list[Message] = []
                for i in range(24):
                    msg: Message = (Weights(version=i, tensors={"w": big + i}) if i % 3 == 0
                                    else Start(version=i))
                    await conn.send(msg)
                    sent.append(msg)
                got = [await conn.recv(timeout=10) for _ in range(25)]
            finally:
                await conn.close()
        assert got[0] == Start(version=1000)
        for a, b in zip(got[1:], sent, strict=True):
            assert type(a) is type(b) and a.version == b.version  # type: ignore[attr-defined]
            if isinstance(b, Weights):
                assert isinstance(a, Weights) and torch.equal(a.tensors["w"], b.tensors["w"])

    run(scenario())


# --- cluster secrets ---------------------------------------------------------------------


def test_wrong_secret_is_refused_on_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serving(idle, secret=b"alpha") as srv:
            with pytest.raises(AuthError, match="wrong secret"):
                await connect(HOST, srv.port, secret=b"beta", role="worker", timeouts=SLOW)
            await eventually(lambda: srv.failed_handshakes == 1, what="server counts the failure")
            assert not srv.connections

    with caplog.at_level(logging.WARNING, logger="swarmtrain.transport"):
        run(scenario())
    refusals = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert len(refusals) == 1 and "wrong secret" in refusals[0]


def test_client_without_the_secret_is_told_by_the_server_it_does_not_know_it() -> None:
    """A client that sends a bad proof (skipping its own check of the server) is refused by
    the server, with an ERROR that says why."""
    async def scenario() -> None:
        async with serving(idle, secret=b"alpha") as srv:
            peer = await RawPeer.open(srv.port)
            reply = await peer.client_handshake(b"alpha", proof_secret=b"beta")
            assert isinstance(reply, Error)
            assert reply.code == "auth_failed" and reply.fatal
            assert "does not know" in reply.message and "secret" in reply.message
            assert await peer.read_to_eof() == []
            peer.close()
            await eventually(lambda: srv.failed_handshakes == 1, what="server counts the failure")

    run(scenario())


def test_missing_client_secret_is_refused() -> None:
    async def scenario() -> None:
        async with serving(idle, secret=b"alpha") as srv:
            with pytest.raises(AuthError, match="requires a cluster secret") as info:
                await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            assert "SWARMTRAIN_SECRET" in str(info.value)  # says how to fix it
            await eventually(lambda: srv.failed_handshakes == 1, what="server counts the failure")

    run(scenario())


def test_client_with_a_secret_is_refused_by_an_open_cluster() -> None:
    async def scenario() -> None:
        async with serving(idle, secret=None) as srv:
            with pytest.raises(AuthError, match="open cluster"):
                await connect(HOST, srv.port, secret=b"alpha", role="worker", timeouts=SLOW)
            await eventually(lambda: srv.failed_handshakes == 1, what="server counts the failure")

    run(scenario())


def test_open_cluster_works() -> None:
    async def scenario() -> None:
        async with serving(echo, secret=None) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="peer", timeouts=SLOW)
            try:
                await conn.send(Shutdown(reason="bye"))
                assert await conn.recv(timeout=10) == Shutdown(reason="bye")
            finally:
                await conn.close()
            assert srv.failed_handshakes == 0

    run(scenario())


def test_failed_handshakes_are_counted_and_do_not_stop_the_server() -> None:
    async def scenario() -> None:
        async with serving(echo, secret=b"alpha") as srv:
            for _ in range(3):
                with pytest.raises(AuthError):
                    await connect(HOST, srv.port, secret=b"beta", role="worker", timeouts=SLOW)
            await eventually(lambda: srv.failed_handshakes == 3, what="three failures counted")
            conn = await connect(HOST, srv.port, secret=b"alpha", role="worker", timeouts=SLOW)
            try:
                await conn.send(Start(version=1))
                assert await conn.recv(timeout=10) == Start(version=1)
            finally:
                await conn.close()
            assert srv.failed_handshakes == 3

    run(scenario())


# --- garbage and stalls --------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: swarm\r\n\r\n",  # longer than a preamble: bytes left unread
    b"\x00" * 20,                               # exactly one preamble
], ids=["http", "zeros"])
def test_garbage_gets_an_error_frame_and_the_server_keeps_serving(garbage: bytes) -> None:
    async def scenario() -> None:
        async with serving(echo, secret=b"alpha") as srv:
            peer = await RawPeer.open(srv.port)
            peer.send(garbage)
            got = await peer.read_to_eof()
            peer.close()
            assert len(got) == 1 and isinstance(got[0], Error), got
            assert got[0].code == "bad_magic" and got[0].fatal
            await eventually(lambda: srv.failed_handshakes == 1, what="server counts the failure")
            conn = await connect(HOST, srv.port, secret=b"alpha", role="worker", timeouts=SLOW)
            try:
                await conn.send(Start(version=3))
                assert await conn.recv(timeout=10) == Start(version=3)
            finally:
                await conn.close()

    run(scenario())


def test_garbage_after_the_handshake_closes_the_connection_with_an_error() -> None:
    seen: asyncio.Queue[BaseException] = asyncio.Queue()

    async def handler(conn: Connection, role: str) -> None:
        try:
            await conn.recv(timeout=20)
        except SwarmError as exc:
            seen.put_nowait(exc)

    async def scenario() -> None:
        async with serving(handler) as srv:
            peer = await RawPeer.open(srv.port)
            assert isinstance(await peer.client_handshake(None), Welcome)
            peer.send(b"SWRM" + bytes([PROTOCOL_VERSION, 0xEE]) + bytes(14))  # unknown message type
            got = await peer.read_to_eof()
            peer.close()
            errors = [(m.code, m.fatal) for m in got if isinstance(m, Error)]
            assert errors == [("unknown_type", True)]
            exc = await asyncio.wait_for(seen.get(), 10)
            assert isinstance(exc, RemoteProtocolError) and exc.code == "unknown_type"

    run(scenario())


@pytest.mark.parametrize("stall", ["nothing", "half_a_preamble", "hello_only"])
def test_client_that_never_completes_the_handshake_is_closed(stall: str) -> None:
    quick = timeouts(handshake=0.3)

    async def scenario() -> None:
        async with serving(idle, secret=b"alpha", timeouts=quick) as srv:
            peer = await RawPeer.open(srv.port)
            if stall == "half_a_preamble":
                peer.send(b"SWRM" + bytes([PROTOCOL_VERSION]))
            elif stall == "hello_only":
                peer.send(Hello(role="worker", nonce=auth.new_nonce()))
            got = await peer.read_to_eof(timeout=10)
            peer.close()
            errors = [m for m in got if isinstance(m, Error)]
            assert [e.code for e in errors] == ["handshake_timeout"], got
            assert "handshake" in errors[0].message
            await eventually(lambda: srv.failed_handshakes == 1, what="server counts the failure")
            assert not srv.connections

    run(scenario())


def test_connect_to_a_server_that_never_answers_times_out_in_the_handshake() -> None:
    async def mute(peer: RawPeer) -> None:
        await asyncio.sleep(30)

    async def scenario() -> None:
        async with raw_server(mute) as port:
            quick = timeouts(handshake=0.3)
            with pytest.raises(SwarmTimeout) as info:
                await connect(HOST, port, secret=None, role="worker", timeouts=quick)
            assert info.value.phase == "handshake"

    run(scenario())


def test_connect_to_something_that_is_not_swarmtrain_is_a_protocol_error() -> None:
    async def ssh(peer: RawPeer) -> None:
        peer.send(b"SSH-2.0-OpenSSH_9.6 Debian-1\r\n")
        await asyncio.sleep(30)

    async def scenario() -> None:
        async with raw_server(ssh) as port:
            with pytest.raises(RemoteProtocolError, match="not a swarmtrain peer") as info:
                await connect(HOST, port, secret=None, role="worker", timeouts=SLOW)
            assert info.value.code == "bad_magic"

    run(scenario())


def test_connect_to_a_closed_port_is_connection_lost() -> None:
    async def scenario() -> None:
        srv = await asyncio.start_server(lambda r, w: None, HOST, 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await asyncio.wait_for(srv.wait_closed(), 10)
        with pytest.raises(ConnectionLost, match="cannot connect"):
            await connect(HOST, port, secret=None, role="worker", timeouts=SLOW)

    run(scenario())


# --- heartbeats ----------------------------------------------------------------------------

BEATING = timeouts(heartbeat_interval=0.05, heartbeat_timeout=0.5)


def test_silent_client_is_dropped_after_the_heartbeat_timeout() -> None:
    seen: asyncio.Queue[BaseException] = asyncio.Queue()

    async def handler(conn: Connection, role: str) -> None:
        try:
            await conn.recv(timeout=20)
        except SwarmError as exc:
            seen.put_nowait(exc)

    async def scenario() -> None:
        async with serving(handler, timeouts=BEATING) as srv:
            peer = await RawPeer.open(srv.port)
            assert isinstance(await peer.client_handshake(None), Welcome)
            # from here the raw peer neither sends nor answers heartbeats
            exc = await asyncio.wait_for(seen.get(), 15)
            peer.writer.transport.abort()
            assert isinstance(exc, SwarmTimeout) and exc.phase == "heartbeat", exc
            assert exc.seconds == BEATING.heartbeat_timeout
            await eventually(lambda: not srv.connections, what="server forgets the connection")

    run(scenario())


def test_client_drops_a_server_that_goes_silent() -> None:
    async def silent_after_handshake(peer: RawPeer) -> None:
        await peer.server_handshake(None)
        await asyncio.sleep(30)

    async def scenario() -> None:
        async with raw_server(silent_after_handshake) as port:
            conn = await connect(HOST, port, secret=None, role="worker", timeouts=BEATING)
            try:
                with pytest.raises(SwarmTimeout) as info:
                    await conn.recv(timeout=15)
                assert info.value.phase == "heartbeat"
                assert conn.is_closed
                with pytest.raises(SwarmTimeout):  # every later call sees the same reason
                    await conn.send(Start(version=1))
            finally:
                await conn.close()

    run(scenario())


def test_heartbeats_keep_an_idle_connection_alive() -> None:
    alive = timeouts(heartbeat_interval=0.05, heartbeat_timeout=1.5)

    async def scenario() -> None:
        async with serving(echo, timeouts=alive) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=alive)
            try:
                await asyncio.sleep(3 * alive.heartbeat_timeout)
                assert not conn.is_closed
                await conn.send(Start(version=5))
                assert await conn.recv(timeout=10) == Start(version=5)
            finally:
                await conn.close()

    run(scenario())


def test_heartbeats_are_not_returned_by_recv() -> None:
    async def handler(conn: Connection, role: str) -> None:
        await eventually(lambda: conn.sent_by_type["HEARTBEAT"] >= 5, what="heartbeats sent")
        await conn.send(Start(version=11))
        await idle(conn, role)

    async def scenario() -> None:
        async with serving(handler, timeouts=BEATING) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=BEATING)
            try:
                got = await conn.recv(timeout=10)
                assert got == Start(version=11)
                assert conn.received_by_type["HEARTBEAT"] >= 5
                assert conn.received_by_type["START"] == 1
            finally:
                await conn.close()

    run(scenario())


# --- backpressure ----------------------------------------------------------------------------


class _Deaf(asyncio.Protocol):
    """Accepts a connection and never reads from it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self.transport = transport


def test_send_queue_is_bounded_when_the_peer_does_not_read() -> None:
    tensor = torch.zeros(1 << 20)  # 4 MiB per message, one tensor shared by all of them
    msg = Weights(version=0, tensors={"w": tensor})
    msg_bytes = len(encode_bytes(msg))
    attempts = 64  # 256 MiB if nothing pushed back

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        deaf: list[_Deaf] = []

        def make() -> _Deaf:
            deaf.append(_Deaf())
            return deaf[-1]

        srv = await loop.create_server(make, HOST, 0)
        port = srv.sockets[0].getsockname()[1]
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: FrameProtocol(Limits()), HOST, port), 10)
        conn = Connection(proto, timeouts(send=0.3), send_queue_size=2)
        sent = 0
        try:
            with pytest.raises(SwarmTimeout) as info:
                for _ in range(attempts):
                    await conn.send(msg)
                    sent += 1
            assert info.value.phase == "send"
            assert sent < attempts, sent
            # what sits in user space: the full queue, plus at most one message the writer
            # handed to the transport past its high-water mark
            assert conn._outbox.full()
            assert conn.transport.get_write_buffer_size() <= msg_bytes + (1 << 16)
            with pytest.raises(SwarmTimeout):
                await conn.send(msg, timeout=0.05)
        finally:
            conn.abort(ConnectionLost("test over"))
            for d in deaf:
                d.transport.abort()
            srv.close()

    run(scenario())


# --- closing and timeouts --------------------------------------------------------------------


def test_recv_after_the_peer_closes_raises_connection_lost() -> None:
    async def hang_up(conn: Connection, role: str) -> None:
        await conn.close()

    async def scenario() -> None:
        async with serving(hang_up) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            try:
                with pytest.raises(ConnectionLost):
                    await conn.recv(timeout=10)
                with pytest.raises(ConnectionLost):  # and again: the close is sticky
                    await conn.recv(timeout=10)
                with pytest.raises(ConnectionLost):
                    await conn.send(Start(version=1))
                assert conn.is_closed
            finally:
                await conn.close()

    run(scenario())


def test_pending_messages_are_delivered_before_the_close() -> None:
    async def say_bye(conn: Connection, role: str) -> None:
        await conn.send(Start(version=1))
        await conn.close(Error(code="shutting_down", message="bye", fatal=True))

    async def scenario() -> None:
        async with serving(say_bye) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            try:
                assert await conn.recv(timeout=10) == Start(version=1)
                assert await conn.recv(timeout=10) == Error(code="shutting_down", message="bye")
                with pytest.raises(ConnectionLost):
                    await conn.recv(timeout=10)
            finally:
                await conn.close()

    run(scenario())


def test_recv_timeout_names_the_phase_and_leaves_the_connection_usable() -> None:
    async def scenario() -> None:
        async with serving(echo) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            try:
                with pytest.raises(SwarmTimeout) as info:
                    await conn.recv(timeout=0.1, phase="register")
                assert info.value.phase == "register" and info.value.seconds == 0.1
                assert "register" in str(info.value)
                assert isinstance(info.value, TimeoutError)
                await conn.send(Start(version=2))
                assert await conn.recv(timeout=10) == Start(version=2)
            finally:
                await conn.close()

    run(scenario())


def test_a_busy_application_that_does_not_call_recv_keeps_its_connection() -> None:
    """Heartbeats must not depend on the application reading: a worker in a long compute
    step (no recv for many heartbeat intervals) is alive, and so is its peer."""
    fast = timeouts(heartbeat_interval=0.01, heartbeat_timeout=0.5)
    go = asyncio.Event()

    async def handler(conn: Connection, role: str) -> None:
        await asyncio.wait_for(go.wait(), 20)
        await conn.send(Start(version=4))
        await idle(conn, role)

    async def scenario() -> None:
        async with serving(handler, timeouts=fast) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=fast)
            try:
                # far more heartbeats than the inbox holds arrive while nobody calls recv
                await asyncio.sleep(4 * fast.heartbeat_timeout)
                go.set()
                assert await conn.recv(timeout=10) == Start(version=4)
                assert conn.received_by_type["HEARTBEAT"] > 64
            finally:
                await conn.close()

    run(scenario())


def test_a_backlog_of_unread_messages_does_not_get_a_live_peer_dropped() -> None:
    """When the application falls behind, reading pauses (the inbox is bounded); the
    peer's bytes then wait in the kernel, which is not the peer going silent."""
    fast = timeouts(heartbeat_interval=0.01, heartbeat_timeout=0.5)
    count = 300  # several times the inbox bound

    async def handler(conn: Connection, role: str) -> None:
        for i in range(count):
            await conn.send(Start(version=i))
        await idle(conn, role)

    async def scenario() -> None:
        async with serving(handler, timeouts=fast) as srv:
            conn = await connect(HOST, srv.port, secret=None, role="worker", timeouts=fast)
            try:
                await eventually(lambda: conn._proto.reading_paused, what="reading paused")
                await asyncio.sleep(4 * fast.heartbeat_timeout)
                got = [await conn.recv(timeout=10) for _ in range(count)]
                assert got == [Start(version=i) for i in range(count)]
                assert not conn.is_closed
            finally:
                await conn.close()

    run(scenario())
