"""The handshake binds what it authenticates (issue #17): a relay without the secret, sitting
between a real client and a real server (the transport's ``start_server`` with a coordinator,
and a peer's ring listener), can neither rewrite what the client claims (its role, its node
id, the ring announcement), nor splice two sessions, nor reflect a proof. Each attempt is
refused with a coded ERROR (a status byte on the ring) and never reaches the served handler.
The refusal codes in the code and in docs/security.md and docs/protocol.md are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.errors import AuthError
from swarmtrain.roles.peer import links
from swarmtrain.roles.peer.links import MAGIC, REFUSALS, RingBroken, RingListener, dial, recv_exact
from swarmtrain.roles.ps.ctl import ctl_request
from swarmtrain.transport import Connection, auth, connect, start_server
from swarmtrain.transport.endpoints import HANDSHAKE_ERRORS, HANDSHAKE_LIMITS
from swarmtrain.transport.identity import Identity
from swarmtrain.wire import Auth, Challenge, Decoder, Error, Hello, Message, Status, Welcome, encode_bytes
from swarmtrain.wire.handshake import Refusal
from tests.test_coordinator_state import make_coordinator
from tests.test_ps_inprocess import SECRET

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"

Rewrite = Callable[[Message], Message]


async def _until(done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait until ``done()`` (polling: the relay's threads fill its lists), at most ``timeout`` s."""
    async with asyncio.timeout(timeout):
        while not done():
            await asyncio.sleep(0.01)
    assert done(), what


# --- an in-test relay for the framed transport -------------------------------------------


@dataclasses.dataclass
class _Relay:
    """Forwards frames between clients and a server; ``upstream`` / ``downstream`` rewrite a
    message on its way (to the server / to the client). Records every message it saw."""

    target: int
    upstream: Rewrite = staticmethod(lambda m: m)  # type: ignore[assignment]
    downstream: Rewrite = staticmethod(lambda m: m)  # type: ignore[assignment]
    to_server: list[Message] = dataclasses.field(default_factory=list)
    to_client: list[Message] = dataclasses.field(default_factory=list)

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   rewrite: Rewrite, seen: list[Message]) -> None:
        dec = Decoder(HANDSHAKE_LIMITS)
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(1 << 16):
                dec.feed(data)
                while (msg := dec.next_message()) is not None:
                    seen.append(msg)
                    writer.write(encode_bytes(rewrite(msg)))
                await writer.drain()
        writer.close()

    async def serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection(HOST, self.target)
        await asyncio.gather(self.pipe(creader, swriter, self.upstream, self.to_server),
                             self.pipe(sreader, cwriter, self.downstream, self.to_client))


@contextlib.asynccontextmanager
async def relay(relay_: _Relay) -> AsyncIterator[int]:
    tasks: set[asyncio.Task[None]] = set()

    def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.create_task(relay_.serve(r, w)))

    srv = await asyncio.start_server(on_connect, HOST, 0)
    try:
        yield int(srv.sockets[0].getsockname()[1])
    finally:
        srv.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[int, list[str]]]:
    """A real server whose handler records each connection it is given (its role)."""
    reached: list[str] = []

    async def handler(conn: Connection, role: str) -> None:
        reached.append(role)
        with contextlib.suppress(Exception):
            await conn.recv(timeout=5)

    srv = await start_server(HOST, 0, handler, secret=SECRET)
    try:
        yield srv.port, reached
    finally:
        await srv.close()


class _RawClient:
    """A client that knows the secret and proves its own transcript, but does not check the
    server's proof: it stands for whatever a relay could get a real client to send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.dec = reader, writer, Decoder(HANDSHAKE_LIMITS)

    @classmethod
    async def open(cls, port: int) -> _RawClient:
        return cls(*await asyncio.open_connection(HOST, port))

    def send(self, msg: Message) -> None:
        self.writer.write(encode_bytes(msg))

    async def recv(self) -> Message | None:
        while (msg := self.dec.next_message()) is None:
            data = await asyncio.wait_for(self.reader.read(1 << 16), 10)
            if not data:
                return None
            self.dec.feed(data)
        return msg

    async def hello(self, role: str = "worker", node: str = "") -> tuple[Hello, Challenge]:
        hello = Hello(role=role, nonce=auth.new_nonce(), software="raw", node=node)
        self.send(hello)
        ch = await self.recv()
        assert isinstance(ch, Challenge)
        return hello, ch

    def auth(self, hello: Hello, ch: Challenge, **fields: Any) -> None:
        """AUTH with the right proof for this transcript, and ``fields`` (values, or callables
        of the transcript: e.g. a forged identity signature)."""
        t = auth.Transcript(hello.role, hello.nonce, ch.nonce, node=hello.node, software=hello.software,
                            open_cluster=ch.open_cluster)
        extra = {k: (v(t) if callable(v) else v) for k, v in fields.items()}
        self.send(Auth(proof=auth.client_proof(SECRET, t), **extra))

    def close(self) -> None:
        self.writer.close()


def _hello_rewrite(**change: str) -> Rewrite:
    return lambda m: dataclasses.replace(m, **change) if isinstance(m, Hello) else m


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 40))  # type: ignore[arg-type]


# --- the transport handshake -------------------------------------------------------------


@pytest.mark.parametrize("change", [{"role": "ctl"}, {"node": "coordinator"}, {"software": "x"}],
                         ids=["role", "node", "software"])
def test_a_relay_rewriting_hello_is_refused_by_the_real_client(change: dict[str, str]) -> None:
    async def scenario() -> None:
        async with served() as (port, reached):
            r = _Relay(port, upstream=_hello_rewrite(**change))
            async with relay(r) as rport:
                with pytest.raises(AuthError, match="relay changed the handshake"):
                    await connect(HOST, rport, secret=SECRET, role="worker", node="w1")
                # the client's ERROR is on its way through the relay to the server
                await _until(lambda: any(isinstance(m, Error) for m in r.to_server), "the client's ERROR")
        errors = [m for m in r.to_server if isinstance(m, Error)]
        assert [e.code for e in errors] == ["auth_failed"]  # the client said why, with a code
        assert not any(isinstance(m, Welcome) for m in r.to_client)
        assert reached == []

    run(scenario())


@pytest.mark.parametrize("change", [{"role": "ctl"}, {"node": "coordinator"}], ids=["role", "node"])
def test_a_relay_rewriting_hello_is_refused_by_the_server(change: dict[str, str]) -> None:
    """Even a client that answers any CHALLENGE cannot be turned into something else."""
    async def scenario() -> None:
        async with served() as (port, reached):
            async with relay(_Relay(port, upstream=_hello_rewrite(**change))) as rport:
                client = await _RawClient.open(rport)
                hello, ch = await client.hello(node="w1")
                client.auth(hello, ch)
                err = await client.recv()
                client.close()
        assert isinstance(err, Error) and err.code == "auth_failed" and "relay" in err.message
        assert reached == []

    run(scenario())


def test_the_issue_attack_a_relay_cannot_pause_a_coordinator(tmp_path: Path) -> None:
    """#17: a worker dials a relay, which rewrites its HELLO to ``ctl`` and would send PAUSE."""
    async def scenario() -> None:
        c = make_coordinator(tmp_path, **{"checkpointing.interval": 0})
        await c.start()
        try:
            async with relay(_Relay(c.port, upstream=_hello_rewrite(role="ctl"))) as rport:
                client = await _RawClient.open(rport)
                hello, ch = await client.hello(role="worker")
                client.auth(hello, ch)
                err = await client.recv()
                client.close()
                with pytest.raises(AuthError):
                    await connect(HOST, rport, secret=SECRET, role="worker")
            assert isinstance(err, Error) and err.code == "auth_failed"
            assert not c.paused and not any(e["event"] in ("paused", "ctl") for e in c.events)
        finally:
            await c.close()

    run(scenario())


def test_a_ctl_action_is_logged_and_recorded_with_its_source(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With the address and the node id the ctl proved with this machine's key."""
    monkeypatch.setenv("SWARMTRAIN_HOME", str(tmp_path / "home"))
    node = Identity.load_or_create().peer_id

    async def scenario() -> None:
        c = make_coordinator(tmp_path, **{"checkpointing.interval": 0})
        await c.start()
        try:
            with caplog.at_level("INFO", logger="swarmtrain"):
                reply = await ctl_request(HOST, c.port, "pause", secret=SECRET, timeout=10)
            assert isinstance(reply, Status) and c.paused
        finally:
            await c.close()
        paused = [e for e in c.events if e["event"] == "paused"]
        ctl = [e for e in c.events if e["event"] == "ctl"]
        assert len(paused) == 1 and paused[0]["source"].startswith("127.0.0.1:")
        assert ctl == [{"time": ctl[0]["time"], "event": "ctl", "action": "pause",
                        "address": paused[0]["source"], "node": node}]
        assert f"ctl PAUSE from {paused[0]['source']} (node {node})" in caplog.text

    run(scenario())


def test_two_sessions_spliced_by_swapping_their_challenges_are_refused() -> None:
    """The relay hands each of two concurrent clients the other's CHALLENGE."""
    async def scenario() -> None:
        async with served() as (port, reached):
            a, b = await _RawClient.open(port), await _RawClient.open(port)
            hello_a, ch_a = await a.hello()
            hello_b, ch_b = await b.hello()
            # real clients refuse the swapped challenge: its proof names the other session
            for hello, ch in ((hello_a, ch_b), (hello_b, ch_a)):
                t = auth.Transcript(hello.role, hello.nonce, ch.nonce, software=hello.software)
                assert not auth.proofs_equal(ch.proof, auth.server_proof(SECRET, t))
            # and a proof made for the swapped challenge is refused by each session
            a.auth(hello_a, ch_b)
            b.auth(hello_b, ch_a)
            got = [await a.recv(), await b.recv()]
            a.close()
            b.close()
        assert all(isinstance(m, Error) and m.code == "auth_failed" for m in got), got
        assert reached == []

    run(scenario())


def test_a_real_client_refuses_a_challenge_spliced_from_another_session() -> None:
    async def scenario() -> None:
        async with served() as (port, reached):
            other = await _RawClient.open(port)
            _, foreign = await other.hello()
            r = _Relay(port, downstream=lambda m: foreign if isinstance(m, Challenge) else m)
            async with relay(r) as rport:
                with pytest.raises(AuthError):
                    await connect(HOST, rport, secret=SECRET, role="worker")
            other.close()
        assert [m.code for m in r.to_server if isinstance(m, Error)] == ["auth_failed"]
        assert reached == []

    run(scenario())


def test_the_servers_own_proof_reflected_back_is_refused() -> None:
    async def scenario() -> None:
        async with served() as (port, reached):
            attacker = await _RawClient.open(port)
            _, ch = await attacker.hello(role="ctl")
            attacker.send(Auth(proof=ch.proof))
            err = await attacker.recv()
            attacker.close()
        assert isinstance(err, Error) and err.code == "auth_failed"
        assert reached == []

    run(scenario())


def test_a_relay_rewriting_the_session_in_welcome_is_refused_by_the_client() -> None:
    async def scenario() -> None:
        async with served() as (port, _):
            r = _Relay(port, downstream=lambda m: dataclasses.replace(m, session="f" * 16)
                       if isinstance(m, Welcome) else m)
            async with relay(r) as rport:
                with pytest.raises(AuthError, match="WELCOME"):
                    await connect(HOST, rport, secret=SECRET, role="worker")

    run(scenario())


def test_a_genuine_session_through_a_plain_relay_still_works() -> None:
    async def scenario() -> None:
        async with served() as (port, reached):
            async with relay(_Relay(port)) as rport:
                conn = await connect(HOST, rport, secret=SECRET, role="worker", node="w1")
                await _until(lambda: reached == ["worker"], "the server's handler")
                await conn.close()
        assert reached == ["worker"]

    run(scenario())


def test_an_open_cluster_still_binds_the_role() -> None:
    """No secret: explicitly insecure, but one code path (the empty key), role included."""
    async def scenario() -> None:
        reached: list[str] = []

        async def handler(conn: Connection, role: str) -> None:
            reached.append(role)

        srv = await start_server(HOST, 0, handler, secret=None)
        try:
            conn = await connect(HOST, srv.port, secret=None, role="worker")
            await conn.close()
            async with relay(_Relay(srv.port, upstream=_hello_rewrite(role="ctl"))) as rport:
                with pytest.raises(AuthError):
                    await connect(HOST, rport, secret=None, role="worker")
        finally:
            await srv.close()
        assert reached == ["worker"]

    run(scenario())


@pytest.mark.parametrize("case", ["bad_nonce", "out_of_order"])
def test_a_malformed_handshake_is_refused_with_a_code(case: str) -> None:
    async def scenario() -> None:
        async with served() as (port, reached):
            client = await _RawClient.open(port)
            client.send(Hello(role="worker", nonce=b"short") if case == "bad_nonce"
                        else Auth(proof=bytes(32)))
            err = await client.recv()
            client.close()
        assert isinstance(err, Error) and err.code == "bad_handshake"
        assert reached == []

    run(scenario())


def test_an_old_release_is_refused_with_unsupported_version() -> None:
    async def scenario() -> None:
        async with served() as (port, reached):
            client = await _RawClient.open(port)
            old = bytearray(encode_bytes(Hello(role="worker", nonce=auth.new_nonce())))
            old[4] = 1  # the version byte of the preamble
            client.writer.write(bytes(old))
            err = await client.recv()
            client.close()
        assert isinstance(err, Error) and err.code == "unsupported_version"
        assert "protocol version 1" in err.message and reached == []

    run(scenario())


# --- the ring listener's handshake -------------------------------------------------------


_SERVER_HELLO = len(MAGIC) + auth.NONCE_BYTES + 32
_ANNOUNCE = struct.Struct("<QIH")


class _RingRelay:
    """A byte relay in front of a ring listener: ``rewrite(direction, chunk_index, data)``
    may change each handshake message (the diallers send theirs whole)."""

    def __init__(self, target: tuple[str, int], rewrite: Callable[[str, int, bytes], bytes]) -> None:
        self.target, self.rewrite = target, rewrite
        self.sock = socket.create_server((HOST, 0))
        self.address = self.sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.sock.accept()
                server = socket.create_connection(self.target, timeout=10)
                client.settimeout(10)
                for src, dst, way in ((client, server, "up"), (server, client, "down")):
                    threading.Thread(target=self._pipe, args=(src, dst, way), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        with contextlib.suppress(OSError):
            if way == "up":  # the opening, then the proof and announcement, each read whole
                dst.sendall(self.rewrite(way, 0, recv_exact(src, len(MAGIC) + auth.NONCE_BYTES)))
                head = recv_exact(src, 32 + _ANNOUNCE.size)
                data = head + recv_exact(src, _ANNOUNCE.unpack_from(head, 32)[2])
                dst.sendall(self.rewrite(way, 1, data))
            else:
                dst.sendall(self.rewrite(way, 0, recv_exact(src, _SERVER_HELLO)))
            while data := src.recv(1 << 16):
                dst.sendall(self.rewrite(way, 2, data))
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def ring_relay(listener: RingListener, rewrite: Callable[[str, int, bytes], bytes]) -> Iterator[_RingRelay]:
    r = _RingRelay(listener.address, rewrite)
    try:
        yield r
    finally:
        r.close()


def _dial(address: tuple[str, int], epoch: int = 3, rank: int = 0) -> socket.socket:
    return dial(address, secret=SECRET, ring_id="r", epoch=epoch, from_rank=rank, peer=1, timeout=5)


def _nothing_parked(listener: RingListener, epoch: int = 3, rank: int = 0) -> bool:
    with pytest.raises(RingBroken):
        listener.claim("r", epoch, rank, timeout=0.3)
    return True


@pytest.mark.parametrize("field", ["epoch", "rank", "ring_id"])
def test_a_relay_rewriting_the_ring_announcement_is_refused(field: str) -> None:
    def rewrite(way: str, i: int, data: bytes) -> bytes:
        if way == "up" and i == 1:  # the client's proof and announcement
            proof, rid = data[:32], data[32 + _ANNOUNCE.size:]
            epoch, rank, _ = _ANNOUNCE.unpack_from(data, 32)
            epoch += field == "epoch"
            rank += field == "rank"
            rid = b"s" if field == "ring_id" else rid
            return proof + _ANNOUNCE.pack(epoch, rank, len(rid)) + rid
        return data

    with RingListener(HOST, 0, secret=SECRET) as listener, ring_relay(listener, rewrite) as r:
        with pytest.raises(RingBroken, match="authentication failed"):
            _dial(r.address)
        assert listener.refused["auth"] == 1
        assert _nothing_parked(listener, 4 if field == "epoch" else 3, 1 if field == "rank" else 0)
        assert _nothing_parked(listener)


def test_a_ring_link_through_a_plain_relay_still_works() -> None:
    with RingListener(HOST, 0, secret=SECRET) as listener, ring_relay(listener, lambda w, i, d: d) as r:
        sock = _dial(r.address)
        got = listener.claim("r", 3, 0, timeout=5)
        sock.close()
        got.close()


def test_two_ring_dials_spliced_by_swapping_the_listener_hellos_are_refused() -> None:
    """Two concurrent diallers; the relay hands each the other's listener nonce and proof."""
    hellos: dict[int, bytes] = {}
    barrier = threading.Barrier(2, timeout=10)
    lock = threading.Lock()

    def rewrite(way: str, i: int, data: bytes) -> bytes:
        if way == "down" and i == 0:
            with lock:
                me = len(hellos)
                hellos[me] = data
            barrier.wait()
            return hellos[1 - me]
        return data

    with RingListener(HOST, 0, secret=SECRET) as listener, ring_relay(listener, rewrite) as r:
        outcomes: list[BaseException | None] = []

        def go(rank: int) -> None:
            try:
                _dial(r.address, rank=rank).close()
                outcomes.append(None)
            except RingBroken as exc:
                outcomes.append(exc)

        threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert len(outcomes) == 2 and all(isinstance(e, RingBroken) and "authentication failed" in str(e)
                                          for e in outcomes), outcomes
        assert _nothing_parked(listener, rank=0) and _nothing_parked(listener, rank=1)


def _ring_open(listener: RingListener) -> tuple[socket.socket, bytes, bytes, bytes]:
    sock = socket.create_connection(listener.address, timeout=10)
    nc = auth.new_nonce()
    sock.sendall(MAGIC + nc)
    reply = recv_exact(sock, _SERVER_HELLO)
    return sock, nc, reply[len(MAGIC):len(MAGIC) + 32], reply[-32:]


def test_ring_proofs_made_for_another_session_or_reflected_are_refused() -> None:
    announcement = _ANNOUNCE.pack(3, 0, 1) + b"r"
    with RingListener(HOST, 0, secret=SECRET) as listener:
        a, nc_a, ns_a, _ = _ring_open(listener)
        b, nc_b, ns_b, their_b = _ring_open(listener)
        # session a gets a proof made for (nc_a, ns_b): spliced
        a.sendall(auth.ring_client_proof(SECRET, links.RING_VERSION, nc_a, ns_b, announcement) + announcement)
        # session b gets its listener's own proof back: reflected
        b.sendall(their_b + announcement)
        assert recv_exact(a, 1)[0] == recv_exact(b, 1)[0] == 1
        a.close()
        b.close()
        assert listener.refused["auth"] == 2 and _nothing_parked(listener)


@pytest.mark.parametrize("opening, code", [(MAGIC[:-1] + b"\x01", 5), (b"GET / HTTP/1.1\r\n", 6)],
                         ids=["old_release", "not_a_ring_link"])
def test_a_bad_ring_opening_is_refused_with_a_code(opening: bytes, code: int) -> None:
    with RingListener(HOST, 0, secret=SECRET) as listener:
        sock = socket.create_connection(listener.address, timeout=10)
        sock.sendall(opening.ljust(len(MAGIC) + auth.NONCE_BYTES, b"\0"))
        reply = recv_exact(sock, _SERVER_HELLO)  # as long as a listener's hello: old diallers read it whole
        sock.close()
    assert reply == MAGIC + bytes([code]) + bytes(_SERVER_HELLO - len(MAGIC) - 1)


def test_a_dialler_meeting_another_ring_version_says_so() -> None:
    srv = socket.create_server((HOST, 0))

    def answer() -> None:
        conn, _ = srv.accept()
        recv_exact(conn, len(MAGIC) + auth.NONCE_BYTES)
        conn.sendall(MAGIC[:-1] + b"\x03" + bytes(_SERVER_HELLO - len(MAGIC)))
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(RingBroken, match="ring link version 3"):
        _dial(srv.getsockname()[:2])
    srv.close()


# --- the refusal codes: code and docs agree ----------------------------------------------


def _section(doc: str, heading: str, until: str = "\n#") -> str:
    """The part of docs/``doc`` from ``heading`` to the next ``until``."""
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(heading)
    end = text.find(until, start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _codes_sent_in_source() -> set[str]:
    """Every code the server side of the handshake refuses with, read from endpoints.py."""
    src = (ROOT / "swarmtrain" / "transport" / "endpoints.py").read_text()
    return set(re.findall(r'_Refused\(\s*"(\w+)"', src)) | set(re.findall(r'return "(\w+)", \(', src)) | set(
        re.findall(r'code="(\w+)"', src))


def test_every_handshake_refusal_code_is_documented_in_both_docs() -> None:
    transport = set(HANDSHAKE_ERRORS)
    assert _codes_sent_in_source() | {"handshake_timeout"} == transport
    ring = set(REFUSALS)
    assert {int(code) for code in Refusal} == ring  # every code the ring handshake can refuse with
    sec = _section("security.md", "**Handshake refusals.**", until="\n**")
    assert set(re.findall(r"^\| `(\w+)` ", sec, re.M)) == transport, "docs/security.md: transport codes"
    assert {int(n) for n in re.findall(r"^\| (\d+) \|", sec, re.M)} == ring, "docs/security.md: ring codes"
    proto = (ROOT / "docs" / "protocol.md").read_text()
    table = _section("protocol.md", "Codes sent in `ERROR` by the transport and roles")
    assert transport <= set(re.findall(r"^\| `(\w+)`", table, re.M)), "docs/protocol.md: transport codes"
    ring_doc = _section("protocol.md", "### The ring link handshake")
    assert {int(n) for n in re.findall(r"^\| (\d+) \|", ring_doc, re.M)} == ring, \
        "docs/protocol.md: ring codes"
    assert "auth_failed" in proto


# --- what a secret may be ---------------------------------------------------------------------


def test_a_str_secret_is_its_utf8_bytes_and_a_bad_one_is_refused_when_the_node_is_made() -> None:
    """``Coordinator(secret="...")`` (what people type) once passed the constructor and then
    crashed every handshake inside the server (hmac wants bytes): the worker saw only "closed
    by peer". A str is now its UTF-8 bytes, so it meets the same secret given as bytes; an
    empty secret or a non-secret is a ConfigError from the constructor, before anything listens."""
    from swarmtrain import Coordinator
    from swarmtrain.errors import ConfigError
    from swarmtrain.tasks import load_task

    model = load_task("digits").build_model()
    text = "our-lab-secret-ünïcode"
    coord = Coordinator(model, host=HOST, port=0, secret=text, learning_rate=1e-3,
                        **{"checkpointing.interval": 0})
    assert coord.secret == text.encode("utf-8")

    async def main() -> Message:
        await coord.start()
        try:
            return await ctl_request(HOST, coord.port, "status", secret=text.encode("utf-8"), timeout=10)
        finally:
            await coord.close()

    assert isinstance(asyncio.run(asyncio.wait_for(main(), 30)), Status)
    for bad, said in ((b"", "empty"), ("", "empty"), (12345, "bytes or str")):
        with pytest.raises(ConfigError, match=said):
            Coordinator(model, host=HOST, port=0, secret=bad, learning_rate=1e-3)  # type: ignore[arg-type]
    assert auth.cluster_secret(bytearray(b"k")) == b"k" and auth.cluster_secret(None) is None
