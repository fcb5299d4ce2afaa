"""Opening connections: the authenticated handshake, a server and a client.

Handshake (client C, server S), each step under ``timeouts.handshake``; T is the transcript
(protocol version, HELLO's role, node, software and nonce nc, CHALLENGE's nonce ns and
open_cluster: :class:`~swarmtrain.transport.auth.Transcript`)::

    C → S  HELLO      role, node, software, nc
    S → C  CHALLENGE  ns, open_cluster, server proof = MAC(secret, "server", T)
    C → S  AUTH       client proof = MAC(secret, "client", T)      (after checking S's proof)
                      [public_key, signature = Ed25519(key, identity_statement(T))]
    S → C  WELCOME    session, proof = MAC(secret, "welcome", T, session)

A client with a node identity key proves it in AUTH: the server checks that ``node`` is the
peer id of ``public_key`` and that the signature verifies (``bad_identity`` otherwise), and
only then keeps ``node`` as ``conn.node``. A client without a key gets an empty ``conn.node``.

So a relay without the secret can change nothing either side says (the role, the node id, a
nonce) and cannot splice two sessions or reflect a proof: the proofs stop matching. Every
refusal of a handshake sends a coded ``ERROR`` (:data:`HANDSHAKE_ERRORS`, or the framing code
of a malformed frame, e.g. ``unsupported_version`` from another release) and closes. The
protocol version is checked by every frame's preamble, and bound into the proofs.

Until the handshake has authenticated the other side, a frame may carry at most
:data:`HANDSHAKE_LIMITS` (a small header, no tensors): a stranger cannot make a node allocate
more than a few kilobytes. A server also caps its connections (in total and per address)
and stops accepting an address whose handshakes keep failing (:class:`ServerLimits`, kept by
:class:`Admission`, which the peers' ring listener uses too); a few slots past the cap are kept
for ``ctl`` (:attr:`ServerLimits.ctl_slots`). Every connection turned away is counted by
reason (:class:`~swarmtrain.transport.refusals.RefusalCounter`).
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
from swarmtrain.errors import (
    AuthError,
    ConfigError,
    ConnectionLost,
    ProtocolError,
    RemoteProtocolError,
    SwarmError,
    SwarmTimeout,
)
from swarmtrain.transport import auth
from swarmtrain.transport.connection import Connection, FrameProtocol, Timeouts, peer_name
from swarmtrain.transport.identity import Identity, peer_id_of, verify
from swarmtrain.transport.refusals import RefusalCounter
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
        ctl_slots: connections kept beyond ``max_connections`` for a ``ctl`` (an operator's
            ``swarmtrain ctl``), so a full server can still be inspected and stopped. The
            role is known only once the handshake has authenticated it: a connection in one
            of these slots that turns out not to be a ``ctl`` is refused then
            (``too_many_connections``). ``max_per_address`` and ``max_failed_auth`` hold
            for them too, so the addresses filling the server cannot take them as well.
    """

    max_connections: int = 256
    max_per_address: int = 32
    max_failed_auth: int = 10
    auth_window_sec: float = 60.0
    ctl_slots: int = 4


#: every code a transport handshake refusal sends in its ``ERROR`` (besides the framing codes
#: of :mod:`swarmtrain.wire.frame`, e.g. ``unsupported_version``), and what it means
HANDSHAKE_ERRORS: dict[str, str] = {
    "auth_failed": "the other side's proof is wrong: a different or missing secret, or a relay "
                   "changed the handshake on the way",
    "bad_handshake": "a message out of order during the handshake, or a nonce not 32 bytes long",
    "handshake_timeout": "a handshake step did not arrive in time",
    "too_many_connections": "the server holds its maximum of connections (in total or from this address)",
    "auth_rate_limited": "too many failed handshakes from this address lately",
    "bad_identity": "the client's identity proof is wrong: its public key's peer id is not the node "
                    "id it claims, or its signature over the handshake does not verify",
}


class _ServerProtocol(FrameProtocol):
    """A server connection's :class:`FrameProtocol`: :attr:`made` resolves to the transport
    once ``connection_made`` has run, so the task serving it waits for that, not for a
    guessed number of event loop turns."""

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self.made: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.transport is not None and not self.made.done():
            self.made.set_result(self.transport)


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
    conn.node = _verified_node(conn, hello, reply, transcript)
    conn.session = _secrets.token_hex(8)
    await conn.send(Welcome(session=conn.session, proof=auth.welcome_proof(secret, transcript, conn.session)))
    return hello.role


def _verified_node(conn: Connection, hello: Hello, reply: Auth, t: auth.Transcript) -> str:
    """The node id the client proved with its key (AUTH's public key and signature), or ""
    for a client that sent no key (its HELLO.node is then an unverified claim, dropped).

    Raises:
        _Refused: ``bad_identity``: a key whose peer id is not HELLO.node, or a signature
            that does not verify.
    """
    if not reply.public_key and not reply.signature:
        return ""
    try:
        keyed = peer_id_of(reply.public_key)
    except ValueError:
        keyed = ""
    if not keyed or keyed != hello.node:
        raise _Refused("bad_identity", (
            f"the {hello.role} at {conn.peer} claims node {hello.node[:40]!r} but its key's peer id "
            f"is {keyed or 'none (not a 32-byte Ed25519 key)'}: a node id is the peer id of its "
            "identity key"))
    if not verify(reply.public_key, auth.identity_statement(t), reply.signature):
        raise _Refused("bad_identity", (
            f"the {hello.role} at {conn.peer} signed the handshake with a signature its key "
            f"(node {hello.node}) does not verify: a forged or damaged identity proof"))
    return hello.node


async def _client_handshake(conn: Connection, secret: bytes | None, role: str, node: str = "",
                            identity: Identity | None = None) -> None:
    if identity is not None:
        node = identity.peer_id
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
    if identity is not None:  # prove the node id with the key: the server then takes it as verified
        await conn.send(Auth(proof=auth.client_proof(secret, transcript), public_key=identity.public_key,
                             signature=identity.sign(auth.identity_statement(transcript))))
    else:
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
    listener (:class:`~swarmtrain.roles.peer.links.RingListener`) share the same bookkeeping.

    Args:
        limits: the caps to enforce.
        refusals: where to count refusals (a role's own counter, shared with its other
            refusals); a new one by default.
    """

    def __init__(self, limits: ServerLimits = ServerLimits(), refusals: RefusalCounter | None = None) -> None:
        self.limits = limits
        #: connections turned away, by reason (``too_many_connections``, ``auth_rate_limited``,
        #: the code of a failed handshake given to :meth:`note_failed_handshake`, or whatever
        #: the owner counts with :meth:`note_refused`)
        self.refused: RefusalCounter = refusals if refusals is not None else RefusalCounter()
        self.failed_handshakes = 0
        self._lock = threading.Lock()
        #: connection slots held per address
        self._open_by_address: Counter[str] = Counter()
        #: slots of the ``ctl`` reserve (:attr:`ServerLimits.ctl_slots`) held per address
        self._ctl_by_address: Counter[str] = Counter()
        #: recent failed handshakes, only of addresses that have some (pruned as they age out)
        self._failures: dict[str, deque[float]] = {}

    def reserve(self, address: str) -> tuple[str, str] | None:
        """Take a connection slot for ``address``; or (code, message) saying why it is refused
        (counted in :attr:`refused`). A taken slot is given back with :meth:`release`."""
        with self._lock:
            refusal = self._refusal(address)
            if refusal is None:
                self._open_by_address[address] += 1
        if refusal is not None:
            self.refused.count(refusal[0])
        return refusal

    def reserve_or_ctl(self, address: str) -> tuple[bool, tuple[str, str] | None]:
        """As :meth:`reserve`, but when only the total cap is reached, take a slot of the
        ``ctl`` reserve instead (:attr:`ServerLimits.ctl_slots`) if one is free.

        Returns:
            ``(ctl_only, refusal)``: ``ctl_only`` says the slot taken is a reserve one (the
            connection must authenticate as ``ctl``); ``refusal`` is (code, message) when no
            slot was taken. Give the slot back with ``release(address, ctl_only=...)``.
        """
        ctl_only = False
        with self._lock:
            refusal = self._refusal(address)
            if refusal is None:
                self._open_by_address[address] += 1
            elif (refusal[0] == "too_many_connections" and self._refusal(address, total=False) is None
                  and self._ctl_by_address.total() < self.limits.ctl_slots):
                self._ctl_by_address[address] += 1
                ctl_only, refusal = True, None
        if refusal is not None:
            self.refused.count(refusal[0])
        return ctl_only, refusal

    def release(self, address: str, *, ctl_only: bool = False) -> None:
        """Give back a slot taken with :meth:`reserve` (or :meth:`reserve_or_ctl`)."""
        with self._lock:
            held = self._ctl_by_address if ctl_only else self._open_by_address
            held[address] -= 1
            if held[address] <= 0:
                del held[address]

    def admit(self, address: str) -> tuple[str, str] | None:
        """(code, message) when a new connection from ``address`` must be refused (takes nothing)."""
        with self._lock:
            return self._refusal(address)

    def note_failed_handshake(self, address: str, reason: str | None = None) -> None:
        """Record a failed handshake of ``address`` (wrong secret, garbage, a refused
        certificate...); given a ``reason`` (the refusal's code), count it in :attr:`refused`."""
        with self._lock:
            self.failed_handshakes += 1
            recent = self._failures.setdefault(address, deque(maxlen=self.limits.max_failed_auth))
            recent.append(time.monotonic())
        if reason is not None:
            self.refused.count(reason)

    def note_refused(self, reason: str) -> None:
        """Count a refusal the owner decided itself (e.g. the ring listener's ``stale``)."""
        self.refused.count(reason)

    def refusals(self) -> dict[str, int]:
        """A snapshot of :attr:`refused` (safe while other threads count)."""
        return self.refused.snapshot()

    def open_connections(self, address: str | None = None) -> int:
        """Slots held now (the ``ctl`` reserve's included), by ``address`` or in total."""
        with self._lock:
            if address is None:
                return self._open_by_address.total() + self._ctl_by_address.total()
            return self._open_by_address[address] + self._ctl_by_address[address]

    def _refusal(self, address: str, *, total: bool = True) -> tuple[str, str] | None:
        lim = self.limits
        if total and self._open_by_address.total() >= lim.max_connections:
            return "too_many_connections", (
                f"the server holds its maximum of {lim.max_connections} connections; try again later")
        if self._open_by_address[address] + self._ctl_by_address[address] >= lim.max_per_address:
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
    def refused(self) -> RefusalCounter:
        """Connections turned away, by reason: over a cap, locked out, or a failed handshake
        by its code (``auth_failed``, ``tls``...); see :meth:`refusals`."""
        return self.admission.refused

    def refusals(self) -> dict[str, int]:
        """:attr:`refused` now, ``{reason: count}``."""
        return self.admission.refusals()

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
    refusals: RefusalCounter | None = None,
    socket_buffer_bytes: int = 0,
) -> Server:
    """Listen on host:port; each authenticated connection runs ``handler(conn, role)``.

    ``socket_buffer_bytes`` (> 0) fixes the kernel's receive and send buffer of every accepted
    connection at that size instead of letting the kernel grow each to its maximum (here
    ``net.ipv4.tcp_rmem`` allows 32 MiB): a server that stops reading connections on purpose
    (the payload gate) would otherwise let each of them fill a buffer that large, and many of
    them together put the whole machine's TCP stack under memory pressure, where every
    connection stalls (seen with 64 workers sending 40 MB gradients: 1.5 GB of socket memory,
    training at a standstill for tens of seconds at a time).

    ``limits`` bound the frames of an authenticated connection, or ``role_limits[role]`` when
    given for its role (a worker's gradient cannot be larger than the model); before the
    handshake every frame is held to :data:`HANDSHAKE_LIMITS`.

    With ``tls``, every connection must first pass a mutual TLS handshake (the client's
    certificate signed by the cluster CA); one that fails is logged, counted in
    ``failed_handshakes`` and closed, and the server goes on serving the others.

    Every connection turned away is counted by reason in ``refusals`` (or the server's own
    counter, :attr:`Server.refused`): ``too_many_connections``, ``auth_rate_limited``, a
    failed handshake by the code of its ``ERROR`` (``handshake_closed`` when the client
    hung up first), ``tls``, and an authenticated connection closed for a malformed frame by
    its framing code. When the total cap is reached, ``server_limits.ctl_slots`` more
    connections may start a handshake, and only a ``ctl`` keeps its slot.

    Raises:
        SwarmError: the address cannot be bound (in use, no such address).
        ConfigError: ``tls`` names files that cannot be loaded.
    """
    acceptor = _Acceptor(handler, secret=secret, timeouts=timeouts, limits=limits,
                         send_queue_size=send_queue_size, role_limits=role_limits or {},
                         server_tls=tls.server_context() if tls is not None else None)
    srv: asyncio.base_events.Server | None = None
    try:
        # bound but not serving: no connection is accepted before the Server admitting it exists
        srv = await acceptor.loop.create_server(acceptor.protocol, host, port, reuse_address=True,
                                                start_serving=False)
        if socket_buffer_bytes > 0:  # accepted connections inherit the listener's buffers
            for sock in srv.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer_bytes)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
        acceptor.state = Server(srv, set(), Admission(server_limits, refusals))
        await srv.start_serving()  # listen(): may still find the port taken meanwhile
    except OSError as exc:
        if srv is not None:
            srv.close()
        raise SwarmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                         "is another coordinator running there? choose another --port") from exc
    return acceptor.state


class _Acceptor:
    """What :func:`start_server` does with each accepted TCP connection: take a slot of its
    address (or refuse it), the TLS handshake if any, the secret handshake, then the handler."""

    def __init__(self, handler: Handler, *, secret: bytes | None, timeouts: Timeouts, limits: Limits,
                 send_queue_size: int, role_limits: Mapping[str, Limits],
                 server_tls: ssl.SSLContext | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.handler = handler
        self.secret = auth.cluster_secret(secret)
        self.timeouts = timeouts
        self.limits = limits
        self.send_queue_size = send_queue_size
        self.role_limits = role_limits
        self.server_tls = server_tls
        #: set by start_server before the first connection is accepted
        self.state: Server | None = None

    def protocol(self) -> asyncio.BaseProtocol:
        """The protocol factory of ``loop.create_server``."""
        proto = _ServerProtocol(HANDSHAKE_LIMITS)
        if self.server_tls is not None:
            return PendingTLS(lambda tcp: self.loop.create_task(self._serve_tls(tcp, proto)))
        self.loop.create_task(self._serve_plain(proto))
        return proto

    def _server(self) -> Server:
        assert self.state is not None  # start_server sets it before it starts serving
        return self.state

    def _connection(self, proto: FrameProtocol) -> Connection:
        return Connection(proto, self.timeouts, send_queue_size=self.send_queue_size, limits=self.limits)

    async def _in_slot(self, address: str, who: str, refuse: Callable[[str, str], Awaitable[None]],
                       serve: Callable[[bool], Awaitable[None]]) -> None:
        """Take a connection slot of ``address`` and ``serve(ctl_only)``, giving the slot back
        after; or, over a limit, ``refuse(code, message)``."""
        admission = self._server().admission
        ctl_only, refusal = admission.reserve_or_ctl(address)
        if refusal is not None:
            log.warning("refused connection from %s: %s", who, refusal[1])
            await refuse(*refusal)
            return
        try:
            await serve(ctl_only)
        finally:
            admission.release(address, ctl_only=ctl_only)

    async def _serve_plain(self, proto: _ServerProtocol) -> None:
        # asyncio calls connection_made when it chooses (after this task may have started)
        try:
            async with asyncio.timeout(self.timeouts.handshake):
                transport = await proto.made
        except TimeoutError:  # the accepted socket never became a transport
            log.warning("an accepted connection was never set up; dropped")
            return
        conn = self._connection(proto)
        address = peer_ip(transport)

        async def refuse(code: str, message: str) -> None:
            await conn.close(Error(code=code, message=message), timeout=1.0)

        await self._in_slot(address, conn.peer, refuse,
                            lambda ctl_only: self._serve_one(conn, address, ctl_only))

    async def _serve_tls(self, tcp: asyncio.Transport, proto: FrameProtocol) -> None:
        address = peer_ip(tcp)

        async def refuse(code: str, message: str) -> None:
            tcp.abort()  # before paying for a TLS handshake; nothing can be said in plain text

        await self._in_slot(address, peer_name(tcp), refuse,
                            lambda ctl_only: self._tls_then_serve(tcp, proto, address, ctl_only))

    async def _tls_then_serve(self, tcp: asyncio.Transport, proto: FrameProtocol, address: str,
                              ctl_only: bool) -> None:
        assert self.server_tls is not None
        transport: asyncio.Transport | None = None
        why = "it closed the connection before the TLS handshake ended"
        handshake = self.timeouts.handshake
        try:
            if not tcp.is_closing():
                async with asyncio.timeout(handshake + 1.0):
                    transport = await self.loop.start_tls(tcp, proto, self.server_tls, server_side=True,
                                                          ssl_handshake_timeout=handshake)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            why = server_refusal_reason(exc, handshake)
        if transport is None:
            self._server().admission.note_failed_handshake(address, "tls")
            log.warning("refused connection from %s: %s", peer_name(tcp), why)
            tcp.abort()
            return
        proto.connection_made(transport)
        await self._serve_one(self._connection(proto), address, ctl_only)

    async def _serve_one(self, conn: Connection, address: str, ctl_only: bool = False) -> None:
        """The secret handshake and the handler, on a connection holding a slot (of the
        ``ctl`` reserve when ``ctl_only``: any other role is refused once authenticated)."""
        state = self._server()
        state.connections.add(conn)
        served = False
        try:
            role = await self._authenticate(conn, address, ctl_only)
            if role is None:
                return
            conn.set_inbound_limits(self.role_limits.get(role, self.limits))
            conn.count_refusals_with(state.admission.note_refused)  # messages out of range, every role
            conn.start_heartbeats()
            served = True
            await self.handler(conn, role)
        finally:
            state.retire(conn)
            await conn.close()
            reason = conn.close_reason
            if served and isinstance(reason, RemoteProtocolError) and not isinstance(reason, ConnectionLost):
                state.admission.note_refused(reason.code)  # a malformed frame of a connection served

    async def _authenticate(self, conn: Connection, address: str, ctl_only: bool) -> str | None:
        """The secret handshake: the client's role, or None if it was refused (and told why)."""
        state = self._server()
        try:
            role = await _server_handshake(conn, self.secret)
        except (SwarmError, ConnectionError) as exc:
            code = _refusal_code(exc)
            state.admission.note_failed_handshake(address, code or "handshake_closed")
            log.warning("refused connection from %s: %s", conn.peer, exc)
            if code is not None:
                await conn.close(Error(code=code, message=str(exc)))
            return None
        if ctl_only and role != "ctl":
            state.admission.note_refused("too_many_connections")
            why = (f"the server holds its maximum of {state.limits.max_connections} connections "
                   f"(its last {state.limits.ctl_slots} are kept for ctl); try again later")
            log.warning("refused %s connection from %s: %s", role, conn.peer, why)
            await conn.close(Error(code="too_many_connections", message=why))
            return None
        return role


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
    identity: Identity | None = None,
) -> Connection:
    """Connect and authenticate; heartbeats start once the handshake succeeds.

    With ``tls``, a mutual TLS handshake comes first: the server's certificate must be
    signed by the cluster CA ``tls.ca``, and we present ``tls.cert``. The secret handshake
    then runs inside TLS.

    Args:
        role: what this client is to the server (``worker``, ``ctl``, ``peer``, ``stage``,
            ``pipeline``); the handshake's proofs cover it, so no relay can change it.
        node: the node id this client claims, if any (covered by the proofs too). Without
            ``identity`` the claim is unverified and the server does not keep it.
        identity: this node's key: ``node`` becomes its peer id and AUTH carries the public
            key and a signature over the transcript, so the server keeps ``conn.node`` as a
            verified id (a coordinator binds worker ids to it).

    Raises:
        SwarmTimeout: connecting or the handshake took too long (phase named).
        ConnectionLost: the address refused or dropped the connection, or one side has TLS
            on and the other off (the message says which).
        AuthError: the secrets differ (the message says which side lacks what), or a
            certificate is refused (the server's is not signed by our CA, or ours not by
            the CA the server trusts).
        ConfigError: ``tls`` names files that cannot be loaded.
    """
    secret = auth.cluster_secret(secret)
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
        await _client_handshake(conn, secret, role, node, identity)
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
