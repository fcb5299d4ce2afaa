"""Opening connections: the authenticated handshake, a server and a client.

Handshake (client C, server S), each step under ``timeouts.handshake``::

    C → S  HELLO      role, client nonce
    S → C  CHALLENGE  server nonce, server proof = HMAC(secret, "server" | nc | ns)
    C → S  AUTH       client proof = HMAC(secret, "client" | ns | nc)    (after checking S's proof)
    S → C  WELCOME    session id

Either side that finds the other's proof wrong sends ERROR ``auth_failed`` saying so and
closes. The protocol version is checked by every frame's preamble.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets as _secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarmtrain import __version__
from swarmtrain.errors import AuthError, ConnectionLost, ProtocolError, SwarmError, SwarmTimeout
from swarmtrain.transport import auth
from swarmtrain.transport.connection import Connection, FrameProtocol, Timeouts
from swarmtrain.wire import Auth, Challenge, Error, Hello, Limits, Message, Welcome

__all__ = ["Server", "start_server", "connect", "is_loopback_host"]

log = logging.getLogger("swarmtrain.transport")

Handler = Callable[[Connection, str], Awaitable[None]]


async def _expect(conn: Connection, kind: type[Message], timeout: float) -> Message:
    msg = await conn.recv(timeout=timeout, phase="handshake")
    if isinstance(msg, Error):
        raise AuthError(msg.message)
    if not isinstance(msg, kind):
        raise AuthError(f"expected {kind.TYPE.name} during the handshake, got {msg.TYPE.name}")
    return msg


async def _server_handshake(conn: Connection, secret: bytes | None) -> str:
    """Authenticate a client; returns the role it declared."""
    t = conn.timeouts.handshake
    hello = await _expect(conn, Hello, t)
    assert isinstance(hello, Hello)
    if len(hello.nonce) != auth.NONCE_BYTES:
        raise AuthError(f"client nonce must be {auth.NONCE_BYTES} bytes")
    ns = auth.new_nonce()
    await conn.send(Challenge(nonce=ns, proof=auth.server_proof(secret, hello.nonce, ns),
                              open_cluster=secret is None))
    reply = await _expect(conn, Auth, t)
    assert isinstance(reply, Auth)
    if not auth.proofs_equal(reply.proof, auth.client_proof(secret, hello.nonce, ns)):
        why = (
            f"authentication failed: the {hello.role} at {conn.peer} does not know this cluster's "
            f"secret (wrong or missing secret); {auth.SECRET_HELP}"
        )
        await conn.close(Error(code="auth_failed", message=why))
        raise AuthError(why)
    conn.session = _secrets.token_hex(8)
    await conn.send(Welcome(session=conn.session))
    return hello.role


async def _client_handshake(conn: Connection, secret: bytes | None, role: str) -> None:
    t = conn.timeouts.handshake
    nc = auth.new_nonce()
    await conn.send(Hello(role=role, nonce=nc, software=f"swarmtrain {__version__}"))
    ch = await _expect(conn, Challenge, t)
    assert isinstance(ch, Challenge)
    if not auth.proofs_equal(ch.proof, auth.server_proof(secret, nc, ch.nonce)):
        if ch.open_cluster:
            why = (f"{conn.peer} runs an open cluster (no secret) but this node has a secret; "
                   "remove the secret here or give the coordinator the same one")
        elif secret is None:
            why = f"{conn.peer} requires a cluster secret and this node has none; {auth.SECRET_HELP}"
        else:
            why = (f"authentication failed: {conn.peer} has a different cluster secret "
                   f"(wrong secret); {auth.SECRET_HELP}")
        await conn.close(Error(code="auth_failed", message=why))
        raise AuthError(why)
    await conn.send(Auth(proof=auth.client_proof(secret, nc, ch.nonce)))
    welcome = await _expect(conn, Welcome, t)
    assert isinstance(welcome, Welcome)
    conn.session = welcome.session


@dataclass
class Server:
    """A listening server; ``close()`` stops accepting and closes open connections."""

    server: asyncio.base_events.Server
    connections: set[Connection]
    failed_handshakes: int = 0

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        await asyncio.gather(*(c.close() for c in list(self.connections)), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self.server.wait_closed()


async def start_server(
    host: str,
    port: int,
    handler: Handler,
    *,
    secret: bytes | None,
    timeouts: Timeouts = Timeouts(),
    limits: Limits = Limits(),
    send_queue_size: int = 64,
) -> Server:
    """Listen on host:port; each authenticated connection runs ``handler(conn, role)``.

    Raises:
        SwarmError: the address cannot be bound (in use, no such address).
    """
    loop = asyncio.get_running_loop()
    state: Server | None = None

    def factory() -> FrameProtocol:
        proto = FrameProtocol(limits)
        loop.create_task(_serve_one(proto))
        return proto

    async def _serve_one(proto: FrameProtocol) -> None:
        await asyncio.sleep(0)  # let connection_made run
        assert state is not None
        conn = Connection(proto, timeouts, send_queue_size=send_queue_size, limits=limits)
        state.connections.add(conn)
        try:
            try:
                role = await _server_handshake(conn, secret)
            except (SwarmError, ConnectionError) as exc:
                state.failed_handshakes += 1
                log.warning("refused connection from %s: %s", conn.peer, exc)
                if isinstance(exc, ProtocolError) or isinstance(exc, SwarmTimeout):
                    await conn.close(Error(code=getattr(exc, "code", "handshake_timeout"),
                                           message=str(exc)))
                return
            conn.start_heartbeats()
            await handler(conn, role)
        finally:
            state.connections.discard(conn)
            await conn.close()

    try:
        srv = await loop.create_server(factory, host, port, reuse_address=True)
    except OSError as exc:
        raise SwarmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                         "is another coordinator running there? choose another --port") from exc
    state = Server(srv, set())
    return state


async def connect(
    host: str,
    port: int,
    *,
    secret: bytes | None,
    role: str,
    timeouts: Timeouts = Timeouts(),
    limits: Limits = Limits(),
    send_queue_size: int = 64,
) -> Connection:
    """Connect and authenticate; heartbeats start once the handshake succeeds.

    Raises:
        SwarmTimeout: connecting or the handshake took too long (phase named).
        ConnectionLost: the address refused or dropped the connection.
        AuthError: the secrets differ (the message says which side lacks what).
    """
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeouts.connect):
            _, proto = await loop.create_connection(lambda: FrameProtocol(limits), host, port)
    except TimeoutError:
        raise SwarmTimeout("connect", timeouts.connect, f"{host}:{port} did not answer") from None
    except OSError as exc:
        raise ConnectionLost(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    conn = Connection(proto, timeouts, send_queue_size=send_queue_size, limits=limits)
    try:
        await _client_handshake(conn, secret, role)
    except BaseException:
        await conn.close()
        raise
    conn.start_heartbeats()
    return conn


def is_loopback_host(host: str) -> bool:
    """True if ``host`` resolves only to loopback addresses (so no one else can reach it)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    import ipaddress

    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)
