"""Opening connections: the authenticated handshake, a server and a client.

Handshake (client C, server S), each step under ``timeouts.handshake``; T is the transcript
(protocol version, HELLO's role, node, software and nonce nc, CHALLENGE's nonce ns and
open_cluster: :class:`~swarmtrain.transport.auth.Transcript`)::

    C → S  HELLO      role, node, software, nc
    S → C  CHALLENGE  ns, open_cluster, server proof = MAC(secret, "server", T)
    C → S  AUTH       client proof = MAC(secret, "client", T)      (after checking S's proof)
    S → C  WELCOME    session, proof = MAC(secret, "welcome", T, session)

So a relay without the secret can change nothing either side says (the role, the node id, a
nonce) and cannot splice two sessions or reflect a proof: the proofs stop matching. Every
refusal of a handshake sends a coded ``ERROR`` (:data:`HANDSHAKE_ERRORS`, or the framing code
of a malformed frame, e.g. ``unsupported_version`` from another release) and closes. The
protocol version is checked by every frame's preamble, and bound into the proofs.

Until the handshake has authenticated the other side, a frame may carry at most
:data:`HANDSHAKE_LIMITS` (a small header, no tensors): a stranger cannot make a node allocate
more than a few kilobytes. A server also caps its connections (in total and per address)
and stops accepting an address whose handshakes keep failing (:class:`ServerLimits`, kept by
:class:`Admission`, which the peers' ring listener uses too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets as _secrets
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from swarmtrain import __version__
from swarmtrain.errors import AuthError, ConfigError, ConnectionLost, ProtocolError, SwarmError, SwarmTimeout
from swarmtrain.transport import auth
from swarmtrain.transport.connection import Connection, FrameProtocol, Timeouts, peer_name
from swarmtrain.transport.tls import (
    PendingTLS,
    TLSConfig,
    client_tls_error,
    closed_in_handshake,
    server_refusal_reason,
)
from swarmtrain.wire import Auth, Challenge, Error, Hello, Limits, Message, Welcome

__all__ = ["HANDSHAKE_ERRORS", "HANDSHAKE_LIMITS", "Admission", "Server", "ServerLimits", "start_server",
           "connect", "is_loopback_host", "require_secret", "peer_ip", "payload_limit"]

log = logging.getLogger("swarmtrain.transport")

Handler = Callable[[Connection, str], Awaitable[None]]

#: what one frame may carry before the other side is authenticated
HANDSHAKE_LIMITS = Limits(max_header_bytes=4096, max_payload_bytes=0, max_tensors=0)


@dataclass(frozen=True)
class ServerLimits:
    """Who may hold connections to a server (against floods and secret guessing).

    Attributes:
        max_connections: open connections at most, handshakes in progress included.
        max_per_address: open connections at most from one IP address.
        max_failed_auth: failed handshakes from one address within ``auth_window_sec``
            after which that address is refused until the window has passed.
        auth_window_sec: the window of ``max_failed_auth``.
    """

    max_connections: int = 256
    max_per_address: int = 32
    max_failed_auth: int = 10
    auth_window_sec: float = 60.0


#: every code a transport handshake refusal sends in its ``ERROR`` (besides the framing codes
#: of :mod:`swarmtrain.wire.frame`, e.g. ``unsupported_version``), and what it means
HANDSHAKE_ERRORS: dict[str, str] = {
    "auth_failed": "the other side's proof is wrong: a different or missing secret, or a relay "
                   "changed the handshake on the way",
    "bad_handshake": "a message out of order during the handshake, or a nonce not 32 bytes long",
    "handshake_timeout": "a handshake step did not arrive in time",
    "too_many_connections": "the server holds its maximum of connections (in total or from this address)",
    "auth_rate_limited": "too many failed handshakes from this address lately",
}


class _Refused(AuthError):
    """A handshake refusal: ``code`` (a key of :data:`HANDSHAKE_ERRORS`) goes in the ``ERROR``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _expect(conn: Connection, kind: type[Message], timeout: float) -> Message:
    msg = await conn.recv(timeout=timeout, phase="handshake")
    if isinstance(msg, Error):
        raise AuthError(f"{conn.peer} refused the handshake: {msg.message} [{msg.code}]")
    if not isinstance(msg, kind):
        raise _Refused("bad_handshake",
                       f"expected {kind.TYPE.name} during the handshake, got {msg.TYPE.name}")
    return msg


async def _server_handshake(conn: Connection, secret: bytes | None) -> str:
    """Authenticate a client; returns the role it declared (its node id goes to ``conn.node``).

    Raises:
        AuthError: the handshake failed; a refusal of ours carries a ``code`` for the ``ERROR``.
    """
    t = conn.timeouts.handshake
    hello = await _expect(conn, Hello, t)
    assert isinstance(hello, Hello)
    if len(hello.nonce) != auth.NONCE_BYTES:
        raise _Refused("bad_handshake", f"client nonce must be {auth.NONCE_BYTES} bytes")
    transcript = auth.Transcript(role=hello.role, node=hello.node, software=hello.software,
                                 client_nonce=hello.nonce, server_nonce=auth.new_nonce(),
                                 open_cluster=secret is None)
    await conn.send(Challenge(nonce=transcript.server_nonce, proof=auth.server_proof(secret, transcript),
                              open_cluster=transcript.open_cluster))
    reply = await _expect(conn, Auth, t)
    assert isinstance(reply, Auth)
    if not auth.proofs_equal(reply.proof, auth.client_proof(secret, transcript)):
        raise _Refused("auth_failed", (
            f"authentication failed: the {hello.role} at {conn.peer} does not know this cluster's "
            f"secret (wrong or missing secret), or a relay changed its handshake; {auth.SECRET_HELP}"))
    conn.session = _secrets.token_hex(8)
    conn.node = hello.node
    await conn.send(Welcome(session=conn.session, proof=auth.welcome_proof(secret, transcript, conn.session)))
    return hello.role


async def _client_handshake(conn: Connection, secret: bytes | None, role: str, node: str = "") -> None:
    t = conn.timeouts.handshake
    hello = Hello(role=role, nonce=auth.new_nonce(), software=f"swarmtrain {__version__}", node=node)
    await conn.send(hello)
    ch = await _expect(conn, Challenge, t)
    assert isinstance(ch, Challenge)
    transcript = auth.Transcript(role=role, node=node, software=hello.software, client_nonce=hello.nonce,
                                 server_nonce=ch.nonce, open_cluster=ch.open_cluster)
    if not auth.proofs_equal(ch.proof, auth.server_proof(secret, transcript)):
        if ch.open_cluster:
            why = (f"{conn.peer} runs an open cluster (no secret) but this node has a secret; "
                   "remove the secret here or give the coordinator the same one")
        elif secret is None:
            why = f"{conn.peer} requires a cluster secret and this node has none; {auth.SECRET_HELP}"
        else:
            why = (f"authentication failed: {conn.peer} has a different cluster secret "
                   f"(wrong secret), or a relay changed the handshake; {auth.SECRET_HELP}")
        await conn.close(Error(code="auth_failed", message=why))
        raise AuthError(why)
    await conn.send(Auth(proof=auth.client_proof(secret, transcript)))
    welcome = await _expect(conn, Welcome, t)
    assert isinstance(welcome, Welcome)
    if not auth.proofs_equal(welcome.proof, auth.welcome_proof(secret, transcript, welcome.session)):
        why = f"authentication failed: the WELCOME from {conn.peer} does not prove this session"
        await conn.close(Error(code="auth_failed", message=why))
        raise AuthError(why)
    conn.session = welcome.session


class Admission:
    """Who may take a connection slot, under :class:`ServerLimits`: open connections in total
    and per address, and addresses locked out after failed handshakes. Thread-safe (one lock,
    never held while calling out), so the asyncio :class:`Server` and the threads of the ring
    listener (:class:`~swarmtrain.peer.links.RingListener`) share the same bookkeeping.

    Args:
        limits: the caps to enforce.
    """

    def __init__(self, limits: ServerLimits = ServerLimits()) -> None:
        self.limits = limits
        #: connections turned away, by reason (``too_many_connections``, ``auth_rate_limited``,
        #: or whatever the owner counts with :meth:`note_refused`)
        self.refused: Counter[str] = Counter()
        self.failed_handshakes = 0
        self._lock = threading.Lock()
        #: connection slots held per address
        self._open_by_address: Counter[str] = Counter()
        #: recent failed handshakes, only of addresses that have some (pruned as they age out)
        self._failures: dict[str, deque[float]] = {}

    def reserve(self, address: str) -> tuple[str, str] | None:
        """Take a connection slot for ``address``; or (code, message) saying why it is refused
        (counted in :attr:`refused`). A taken slot is given back with :meth:`release`."""
        with self._lock:
            refusal = self._refusal(address)
            if refusal is not None:
                self.refused[refusal[0]] += 1
            else:
                self._open_by_address[address] += 1
            return refusal

    def release(self, address: str) -> None:
        """Give back a slot taken with :meth:`reserve`."""
        with self._lock:
            self._open_by_address[address] -= 1
            if self._open_by_address[address] <= 0:
                del self._open_by_address[address]

    def admit(self, address: str) -> tuple[str, str] | None:
        """(code, message) when a new connection from ``address`` must be refused (takes nothing)."""
        with self._lock:
            return self._refusal(address)

    def note_failed_handshake(self, address: str) -> None:
        """Record a failed handshake of ``address`` (wrong secret, garbage, a refused certificate...)."""
        with self._lock:
            self.failed_handshakes += 1
            recent = self._failures.setdefault(address, deque(maxlen=self.limits.max_failed_auth))
            recent.append(time.monotonic())

    def note_refused(self, reason: str) -> None:
        """Count a refusal the owner decided itself (e.g. the ring listener's ``stale``)."""
        with self._lock:
            self.refused[reason] += 1

    def refusals(self) -> dict[str, int]:
        """A snapshot of :attr:`refused` (safe while other threads count)."""
        with self._lock:
            return dict(self.refused)

    def open_connections(self, address: str | None = None) -> int:
        """Slots held now, by ``address`` or in total."""
        with self._lock:
            return self._open_by_address.total() if address is None else self._open_by_address[address]

    def _refusal(self, address: str) -> tuple[str, str] | None:
        lim = self.limits
        if self._open_by_address.total() >= lim.max_connections:
            return "too_many_connections", (
                f"the server holds its maximum of {lim.max_connections} connections; try again later")
        if self._open_by_address[address] >= lim.max_per_address:
            return "too_many_connections", (
                f"{address} already holds {lim.max_per_address} connections (the most one address "
                "may); close some first")
        recent = self._recent_failures(address)
        if recent and len(recent) >= lim.max_failed_auth:
            wait = recent[0] + lim.auth_window_sec - time.monotonic()
            return "auth_rate_limited", (
                f"{len(recent)} failed handshakes from {address} in {lim.auth_window_sec:.0f} s: "
                f"refused for {max(wait, 0):.0f} s more; check this node's cluster secret")
        return None

    def _recent_failures(self, address: str) -> deque[float] | None:
        """The failures of ``address`` within the window; an address whose failures all aged
        out is forgotten (the record holds only addresses failing now: bounded memory)."""
        recent = self._failures.get(address)
        if recent is None:
            return None
        cutoff = time.monotonic() - self.limits.auth_window_sec
        while recent and recent[0] < cutoff:
            recent.popleft()
        if not recent:
            del self._failures[address]
            return None
        return recent


@dataclass
class Server:
    """A listening server; ``close()`` stops accepting and closes open connections."""

    server: asyncio.base_events.Server
    connections: set[Connection]
    #: connection slots (TLS handshake, secret handshake and serving) and refusals
    admission: Admission = field(default_factory=Admission)
    #: traffic of connections already closed (open ones count on their Connection)
    _closed_traffic: dict[str, Counter[str]] = field(default_factory=dict)

    @property
    def limits(self) -> ServerLimits:
        return self.admission.limits

    @property
    def refused(self) -> Counter[str]:
        """Connections turned away before the handshake, by reason."""
        return self.admission.refused

    @property
    def failed_handshakes(self) -> int:
        return self.admission.failed_handshakes

    def retire(self, conn: Connection) -> None:
        """Stop tracking a closed connection, keeping its traffic in :meth:`traffic`."""
        self.connections.discard(conn)
        for kind, counts in _traffic_of(conn).items():
            self._closed_traffic.setdefault(kind, Counter()).update(counts)

    def traffic(self) -> dict[str, dict[str, int]]:
        """Frames and bytes received and sent since the server started, by message type:
        ``{"messages_in": {...}, "messages_out": {...}, "bytes_in": {...}, "bytes_out": {...}}``."""
        totals = {kind: Counter(self._closed_traffic.get(kind, {})) for kind in _TRAFFIC_KINDS}
        for conn in list(self.connections):
            for kind, counts in _traffic_of(conn).items():
                totals[kind].update(counts)
        return {kind: dict(counts) for kind, counts in totals.items()}

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
    server_limits: ServerLimits = ServerLimits(),
    role_limits: Mapping[str, Limits] | None = None,
    tls: TLSConfig | None = None,
) -> Server:
    """Listen on host:port; each authenticated connection runs ``handler(conn, role)``.

    ``limits`` bound the frames of an authenticated connection, or ``role_limits[role]`` when
    given for its role (a worker's gradient cannot be larger than the model); before the
    handshake every frame is held to :data:`HANDSHAKE_LIMITS`.

    With ``tls``, every connection must first pass a mutual TLS handshake (the client's
    certificate signed by the cluster CA); one that fails is logged, counted in
    ``failed_handshakes`` and closed, and the server goes on serving the others.

    Raises:
        SwarmError: the address cannot be bound (in use, no such address).
        ConfigError: ``tls`` names files that cannot be loaded.
    """
    loop = asyncio.get_running_loop()
    state: Server | None = None

    server_tls = tls.server_context() if tls is not None else None

    def factory() -> asyncio.BaseProtocol:
        proto = FrameProtocol(HANDSHAKE_LIMITS)
        if server_tls is not None:
            return PendingTLS(lambda tcp: loop.create_task(_serve_tls(tcp, proto)))
        loop.create_task(_serve_plain(proto))
        return proto

    async def _in_slot(address: str, who: str, refuse: Callable[[str, str], Awaitable[None]],
                       serve: Callable[[], Awaitable[None]]) -> None:
        """Take a connection slot of ``address`` and ``serve``, giving the slot back after;
        or, over a limit, ``refuse(code, message)``."""
        assert state is not None
        refusal = state.admission.reserve(address)
        if refusal is not None:
            log.warning("refused connection from %s: %s", who, refusal[1])
            await refuse(*refusal)
            return
        try:
            await serve()
        finally:
            state.admission.release(address)

    async def _serve_plain(proto: FrameProtocol) -> None:
        await asyncio.sleep(0)  # let connection_made run
        assert proto.transport is not None
        conn = Connection(proto, timeouts, send_queue_size=send_queue_size, limits=limits)
        address = peer_ip(proto.transport)

        async def refuse(code: str, message: str) -> None:
            await conn.close(Error(code=code, message=message), timeout=1.0)

        await _in_slot(address, conn.peer, refuse, lambda: _serve_one(conn, address))

    async def _serve_tls(tcp: asyncio.Transport, proto: FrameProtocol) -> None:
        address = peer_ip(tcp)

        async def refuse(code: str, message: str) -> None:
            tcp.abort()  # before paying for a TLS handshake; nothing can be said in plain text

        await _in_slot(address, peer_name(tcp), refuse, lambda: _tls_then_serve(tcp, proto, address))

    async def _tls_then_serve(tcp: asyncio.Transport, proto: FrameProtocol, address: str) -> None:
        assert state is not None and server_tls is not None
        transport: asyncio.Transport | None = None
        why = "it closed the connection before the TLS handshake ended"
        try:
            if not tcp.is_closing():
                async with asyncio.timeout(timeouts.handshake + 1.0):
                    transport = await loop.start_tls(tcp, proto, server_tls, server_side=True,
                                                     ssl_handshake_timeout=timeouts.handshake)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            why = server_refusal_reason(exc, timeouts.handshake)
        if transport is None:
            state.admission.note_failed_handshake(address)
            log.warning("refused connection from %s: %s", peer_name(tcp), why)
            tcp.abort()
            return
        proto.connection_made(transport)
        await _serve_one(Connection(proto, timeouts, send_queue_size=send_queue_size, limits=limits), address)

    async def _serve_one(conn: Connection, address: str) -> None:
        """The secret handshake and the handler, on a connection holding a slot."""
        assert state is not None
        state.connections.add(conn)
        try:
            try:
                role = await _server_handshake(conn, secret)
            except (SwarmError, ConnectionError) as exc:
                state.admission.note_failed_handshake(address)
                log.warning("refused connection from %s: %s", conn.peer, exc)
                code = _refusal_code(exc)
                if code is not None:
                    await conn.close(Error(code=code, message=str(exc)))
                return
            conn.set_inbound_limits((role_limits or {}).get(role, limits))
            conn.start_heartbeats()
            await handler(conn, role)
        finally:
            state.retire(conn)
            await conn.close()

    try:
        srv = await loop.create_server(factory, host, port, reuse_address=True)
    except OSError as exc:
        raise SwarmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                         "is another coordinator running there? choose another --port") from exc
    state = Server(srv, set(), Admission(server_limits))
    return state


async def connect(
    host: str,
    port: int,
    *,
    secret: bytes | None,
    role: str,
    node: str = "",
    timeouts: Timeouts = Timeouts(),
    limits: Limits = Limits(),
    send_queue_size: int = 64,
    tls: TLSConfig | None = None,
) -> Connection:
    """Connect and authenticate; heartbeats start once the handshake succeeds.

    With ``tls``, a mutual TLS handshake comes first: the server's certificate must be
    signed by the cluster CA ``tls.ca``, and we present ``tls.cert``. The secret handshake
    then runs inside TLS.

    Args:
        role: what this client is to the server (``worker``, ``ctl``, ``peer``, ``stage``,
            ``pipeline``); the handshake's proofs cover it, so no relay can change it.
        node: the node id this client claims, if any (covered by the proofs too; the server
            keeps it as ``conn.node`` and logs it with what this connection does).

    Raises:
        SwarmTimeout: connecting or the handshake took too long (phase named).
        ConnectionLost: the address refused or dropped the connection, or one side has TLS
            on and the other off (the message says which).
        AuthError: the secrets differ (the message says which side lacks what), or a
            certificate is refused (the server's is not signed by our CA, or ours not by
            the CA the server trusts).
        ConfigError: ``tls`` names files that cannot be loaded.
    """
    loop = asyncio.get_running_loop()
    where = f"{host}:{port}"
    client_tls = tls.client_context() if tls is not None else None
    limit = timeouts.connect + (timeouts.handshake if tls is not None else 0.0)
    try:
        async with asyncio.timeout(limit):
            _, proto = await loop.create_connection(
                lambda: FrameProtocol(HANDSHAKE_LIMITS), host, port, ssl=client_tls,
                ssl_handshake_timeout=timeouts.handshake if tls is not None else None)
    except TimeoutError:
        raise SwarmTimeout("connect", limit, f"{where} did not answer") from None
    except ssl.SSLError as exc:
        assert tls is not None
        raise client_tls_error(where, exc, tls) from exc
    except OSError as exc:
        raise ConnectionLost(f"cannot connect to {where}: {exc.strerror or exc}") from exc
    conn = Connection(proto, timeouts, send_queue_size=send_queue_size, limits=limits)
    try:
        await _client_handshake(conn, secret, role, node)
    except _Refused as exc:  # the server broke the handshake's order: say so, as it would
        await conn.close(Error(code=exc.code, message=str(exc)))
        raise
    except ConnectionLost as exc:
        await conn.close()
        err = closed_in_handshake(where, exc, tls, answered=bool(conn.received_by_type))
        if err is exc:
            raise
        raise err from exc
    except BaseException:
        await conn.close()
        raise
    conn.set_inbound_limits(limits)
    conn.start_heartbeats()
    return conn


def _refusal_code(exc: BaseException) -> str | None:
    """The ``ERROR`` code that refuses a failed server handshake; None when there is no one
    left to tell (the client hung up or refused us itself)."""
    if isinstance(exc, _Refused | ProtocolError):
        return exc.code
    if isinstance(exc, SwarmTimeout):
        return "handshake_timeout"
    return None


_TRAFFIC_KINDS = ("messages_in", "messages_out", "bytes_in", "bytes_out")


def _traffic_of(conn: Connection) -> dict[str, Counter[str]]:
    return {"messages_in": conn.received_by_type, "messages_out": conn.sent_by_type,
            "bytes_in": conn.received_bytes_by_type, "bytes_out": conn.sent_bytes_by_type}


def peer_ip(transport: asyncio.BaseTransport) -> str:
    """The other side's IP address (what per-address limits count)."""
    peername = transport.get_extra_info("peername")
    return str(peername[0]) if isinstance(peername, tuple) and peername else "?"


def require_secret(host: str, port: int, secret: bytes | None, insecure: bool, what: str) -> None:
    """Refuse to listen beyond loopback without a cluster secret, unless ``insecure`` says an
    open cluster is meant.

    Args:
        what: what strangers could then do, for the message ("join or send gradients").

    Raises:
        ConfigError: no secret, not ``insecure``, and ``host`` is reachable from elsewhere.
    """
    if secret is None and not insecure and not is_loopback_host(host):
        raise ConfigError(
            f"refusing to listen on {host}:{port} without a cluster secret: anyone on the network "
            f"could {what}. Set SWARMTRAIN_SECRET or --secret-file (create one with `swarmtrain "
            "secret --out FILE`), or pass --insecure for an open cluster")


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


def payload_limit(params: Iterable[torch.Tensor]) -> int:
    """The most payload a frame carrying these parameters (or their gradients) may hold: twice
    their bytes (every codec sends less than the plain tensors) plus 1 MiB of slack."""
    return 2 * sum(p.numel() * p.element_size() for p in params) + (1 << 20)
