"""Ring links: setting up the TCP connections between ring neighbours.

Every node runs one long-lived :class:`RingListener`. To form a ring for an epoch, each member
dials its successor's listener (:func:`dial`) and claims its predecessor's connection from its
own listener (:meth:`RingListener.claim`). Connections may arrive before the member that
will use them has built its group, so the listener parks authenticated connections until they
are claimed, for a bounded time and in bounded number.

Handshake on a new connection (client = the dialling side; both directions authenticated
with the cluster secret over the transcript, fresh nonces each, as in
:mod:`swarmtrain.transport.auth`)::

    client -> server   MAGIC, client nonce nc (32)
    server -> client   MAGIC, server nonce ns (32), server proof (32) = MAC("ring server", v, nc, ns)
    client -> server   client proof (32) = MAC("ring client", v, nc, ns, A), announcement A =
                       epoch u64, from_rank u32, len u16, ring_id (utf-8)
    server -> client   status u8 (0 = accepted; else why it was refused: :data:`REFUSALS`)

``v`` is the ring link version (the last byte of MAGIC). The client's proof binds its
announcement, so a relay without the secret can neither change the epoch, rank or ring a
dialler claims nor splice two sessions. An opening with another version (or no MAGIC) is
answered MAGIC and a status byte, padded to the length of a server hello, and closed: a
dialler of another release reads a clear refusal instead of timing out. Only an opening that
looks like TLS (this listener has TLS off) is closed without a word: nothing can be said to it
in plain text.

After that the link carries only ring frames (see :mod:`swarmtrain.wire.ring`), from
the client to the server; the reverse direction is unused.

With TLS on (a :class:`~swarmtrain.transport.tls.TLSConfig` on both sides), each connection
first runs a mutual TLS handshake against the cluster CA, and the handshake above, then the
frames, run inside TLS.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict

from swarmtrain.errors import SwarmError
from swarmtrain.transport.auth import (
    NONCE_BYTES,
    new_nonce,
    proofs_equal,
    ring_client_proof,
    ring_server_proof,
)
from swarmtrain.transport.endpoints import Admission, ServerLimits
from swarmtrain.transport.refusals import RefusalCounter
from swarmtrain.transport.tls import (
    KEYS_HELP,
    TLS_NEEDED_HERE,
    TLSConfig,
    client_tls_error,
    server_refusal_reason,
)
from swarmtrain.wire.frame import looks_like_tls

__all__ = ["REFUSALS", "RingBroken", "RingListener", "dial", "tune_socket"]

log = logging.getLogger(__name__)

RING_VERSION = 2
MAGIC = b"STRING\x00" + bytes([RING_VERSION])  # swarmtrain ring link, and its version
_PROOF_BYTES = 32
_SERVER_HELLO_BYTES = len(MAGIC) + NONCE_BYTES + _PROOF_BYTES
_ANNOUNCE = struct.Struct("<QIH")  # epoch, from_rank, len(ring_id)
MAX_RING_ID_BYTES = 256

ACCEPTED = 0
#: every status byte a ring listener refuses a handshake with, and what it means
REFUSALS = {
    1: "authentication failed: the listener does not accept our cluster secret (a different "
       "secret, or a relay changed the handshake)",
    2: "stale epoch: the listener has already moved on to a newer epoch of this ring",
    3: "the listener has too many connections waiting to be claimed",
    4: "malformed announcement",
    5: "unsupported version: the listener speaks another ring link version (run the same "
       "swarmtrain release on every machine)",
    6: "not a ring link opening: the listener did not find its MAGIC",
}
_REFUSED_AUTH, _REFUSED_STALE, _REFUSED_BUSY, _REFUSED_BAD = 1, 2, 3, 4
_REFUSED_VERSION, _REFUSED_OPENING = 5, 6

SOCKET_BUFFER_BYTES = 4 << 20


class RingBroken(SwarmError):
    """A collective (or forming the ring) failed: a neighbour died, timed out, refused us, or
    sent garbage. The group is unusable afterwards; build a new one (a new epoch).

    Attributes:
        phase: ``connect``, ``reduce_scatter``, ``all_gather``, ``broadcast`` or ``barrier``.
        peer: the rank of the neighbour involved, if known.
        detail: what happened.
        epoch: the epoch of the ring that broke (set by the :class:`RingGroup` raising it).
    """

    epoch: int | None = None

    def __init__(self, phase: str, peer: int | None, detail: str) -> None:
        where = f" (neighbour rank {peer})" if peer is not None else ""
        super().__init__(f"ring broken in phase '{phase}'{where}: {detail}")
        self.phase = phase
        self.peer = peer
        self.detail = detail


def tune_socket(sock: socket.socket) -> None:
    """Low latency and deep buffers for bulk ring traffic (best effort: limits may clamp them)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly `n` bytes (the small handshake messages); EOF raises ConnectionError."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def dial(
    address: tuple[str, int], *, secret: bytes | None, ring_id: str, epoch: int, from_rank: int,
    peer: int, timeout: float, tls: TLSConfig | None = None,
) -> socket.socket:
    """Connect to `peer`'s ring listener at `address`, authenticate both ways and announce
    (`ring_id`, `epoch`, `from_rank`).

    Transient failures (refused, unreachable, dropped before the listener answered: the
    peer may still be starting, or its listener momentarily full) are retried until `timeout`.

    Args:
        tls: mutual TLS (None: plain TCP): the TLS handshake runs first, the secret one inside it.
    Returns:
        The connected, authenticated socket (blocking, tuned; an ``ssl.SSLSocket`` with TLS).
    Raises:
        RingBroken: phase ``connect``: unreachable within `timeout`, authentication failed,
            refused (stale epoch, busy, malformed), or a certificate was refused either way.
        ConfigError: the TLS files cannot be loaded.
    """
    rid = ring_id.encode()
    if len(rid) > MAX_RING_ID_BYTES:
        raise ValueError(f"ring_id is longer than {MAX_RING_ID_BYTES} bytes")
    where = f"{address[0]}:{address[1]}"
    context = tls.client_context() if tls is not None else None
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.001))
        except OSError as exc:
            last = repr(exc)
        else:
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                if context is not None:
                    # a failed handshake closes the TLS socket; `sock` is detached by then
                    sock = context.wrap_socket(sock, server_hostname=None)
                _client_handshake(sock, secret, rid, epoch, from_rank, peer, where)
                sock.settimeout(None)
                return sock
            except RingBroken:
                sock.close()
                raise
            except ssl.SSLError as exc:
                sock.close()
                if tls is not None and not isinstance(exc, ssl.SSLEOFError):
                    # a certificate refused either way, or no TLS there: retrying cannot help
                    raise RingBroken("connect", peer, str(client_tls_error(where, exc, tls))) from exc
                last = _dropped(where, exc, tls)
            except OSError as exc:
                sock.close()
                last = _dropped(where, exc, tls)
        if time.monotonic() + delay >= deadline:
            raise RingBroken("connect", peer, f"cannot reach {where} within {timeout:g} s: {last}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _dropped(where: str, exc: OSError, tls: TLSConfig | None) -> str:
    """Why a connection may have failed after it was made (the listener may just have been
    busy, so the dial is retried; this is the reason given if it never works)."""
    if not isinstance(exc, ConnectionError | ssl.SSLEOFError):
        return repr(exc)
    if tls is None:
        return f"{exc!r}; if {where} has TLS on, {TLS_NEEDED_HERE}"
    return (f"{exc!r}; with TLS on, {where} closing the connection before answering most likely "
            f"means it does not accept this node's certificate {tls.cert} (signed by another "
            f"cluster CA?) or has TLS off (its log says why); {KEYS_HELP}")


def _client_handshake(
    sock: socket.socket, secret: bytes | None, rid: bytes, epoch: int, from_rank: int, peer: int, where: str
) -> None:
    tune_socket(sock)
    client_nonce = new_nonce()
    sock.sendall(MAGIC + client_nonce)
    reply = recv_exact(sock, _SERVER_HELLO_BYTES)
    if reply[: len(MAGIC) - 1] == MAGIC[:-1] and reply[len(MAGIC) - 1] != RING_VERSION:
        raise RingBroken("connect", peer, f"{where} speaks ring link version {reply[len(MAGIC) - 1]}, "
                         f"this node {RING_VERSION}: run the same swarmtrain release on every machine")
    if reply[: len(MAGIC)] != MAGIC:
        raise RingBroken("connect", peer, f"{where} is not a swarmtrain ring listener")
    server_nonce = reply[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    theirs = reply[-_PROOF_BYTES:]
    if not proofs_equal(theirs, ring_server_proof(secret, RING_VERSION, client_nonce, server_nonce)):
        raise RingBroken("connect", peer, f"authentication failed: the listener at {where} does not know "
                         "our cluster secret (every member needs the same one), or a relay changed the "
                         "handshake")
    announcement = _ANNOUNCE.pack(epoch, from_rank, len(rid)) + rid
    proof = ring_client_proof(secret, RING_VERSION, client_nonce, server_nonce, announcement)
    sock.sendall(proof + announcement)
    status = recv_exact(sock, 1)[0]
    if status != ACCEPTED:
        raise RingBroken("connect", peer, f"refused by {where}: " + REFUSALS.get(status, f"status {status}"))


class _Deadline:
    """Shuts a socket down when its handshake outlives `seconds` in all: per-call socket
    timeouts alone would let a client that drips a byte at a time hold a handshake slot
    forever, without knowing the secret."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._lock = threading.Lock()
        self._sock = sock
        self._stopped = False
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def follow(self, sock: socket.socket) -> None:
        """Watch `sock` instead (the TLS socket that replaced the plain one)."""
        with self._lock:
            self._sock = sock

    def stop(self) -> bool:
        """Stop the clock; False if it had run out already (and shut the socket down)."""
        with self._lock:
            self._stopped = True
            self._timer.cancel()
            return not self.expired

    def _expire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.expired = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the handshake thread's recv
            except OSError:
                pass


class RingListener:
    """One long-lived TCP listener per node for ring connections of any epoch.

    A background thread accepts connections and authenticates each on its own short-lived
    thread (at most `max_handshakes` at once; more are closed unanswered). Accepted
    connections are parked until a :class:`~swarmtrain.roles.peer.ring.RingGroup` claims them.
    Parked connections of an epoch older than the newest one opened for their ring, and
    those left unclaimed for `park_timeout` seconds, are closed.

    Like a control server, the listener holds `limits` (:class:`ServerLimits`, kept by its
    :attr:`admission`): a connection counts against them from its accept until it is claimed
    or closed, and one over the total or per-address cap, or from an address with
    ``max_failed_auth`` failed handshakes (a wrong secret proof, a malformed announcement, a
    failed TLS handshake, garbage or a handshake cut short) within ``auth_window_sec``, is
    closed unanswered. Every refusal is counted in :attr:`refused` by reason.

    Args:
        host: address to bind (``0.0.0.0`` for every interface).
        port: port to bind; 0 picks a free one (see :attr:`address`).
        secret: the cluster secret (None: an open cluster, authenticates nothing).
        tls: mutual TLS (None: plain TCP): each connection must first complete a TLS handshake
            with a certificate of the cluster CA (else it is logged, counted in
            ``refused["tls"]`` and closed), and then the secret handshake inside TLS.
        max_parked: connections that may wait to be claimed; more are refused ("busy").
        handshake_timeout: seconds a connecting side gets to complete each handshake.
        park_timeout: seconds an unclaimed connection is kept.
        limits: connections at most, in total and per address, and the failed-handshake lockout.
    Raises:
        ConfigError: the TLS files cannot be loaded.
    """

    def __init__(
        self, host: str, port: int = 0, *, secret: bytes | None, max_parked: int = 64,
        max_handshakes: int = 16, handshake_timeout: float = 5.0, park_timeout: float = 60.0,
        tls: TLSConfig | None = None, limits: ServerLimits = ServerLimits(),
    ) -> None:
        self._secret = secret
        self.admission = Admission(limits)
        self._tls_context = tls.server_context() if tls is not None else None
        self._max_parked = max_parked
        self._handshake_timeout = handshake_timeout
        self._park_timeout = park_timeout
        self._handshake_slots = threading.BoundedSemaphore(max_handshakes)
        self._cond = threading.Condition()
        # (ring_id, epoch, from_rank) -> (socket, time parked, the address holding its slot)
        self._parked: dict[tuple[str, int, int], tuple[socket.socket, float, str]] = {}
        self._newest_epoch: OrderedDict[str, int] = OrderedDict()  # bounded, most recent last
        self._closed = False
        self._sock = socket.create_server((host, port), backlog=128)
        tune_socket(self._sock)  # accepted sockets inherit the buffer sizes
        self._sock.settimeout(0.5)  # the accept loop wakes to expire parked connections
        host_bound, port_bound = self._sock.getsockname()[:2]
        self.address: tuple[str, int] = (host_bound, port_bound)
        self._thread = threading.Thread(target=self._accept_loop, name=f"ring-listener-{self.address[1]}",
                                        daemon=True)
        self._thread.start()

    @property
    def refused(self) -> RefusalCounter:
        """Connections turned away, by reason: ``auth``, ``malformed``, ``tls`` (failed
        handshakes), ``stale``, ``busy`` (authenticated, not parked), ``too_many_connections``
        ``auth_rate_limited`` (see :class:`ServerLimits`) and ``too_many_handshakes`` (closed at
        once, unanswered)."""
        return self.admission.refused

    # --- the group side -----------------------------------------------------------------

    def open_epoch(self, ring_id: str, epoch: int) -> None:
        """Declare `epoch` current for `ring_id`: close parked connections of older epochs and
        refuse new ones for them.

        Raises:
            RingBroken: phase ``connect``: a newer epoch of this ring was opened already.
        """
        with self._cond:
            newest = self._newest_epoch.get(ring_id)
            if newest is not None and epoch < newest:
                raise RingBroken("connect", None, f"epoch {epoch} of ring {ring_id!r} is older than "
                                 f"epoch {newest}, already opened on this node")
            self._newest_epoch[ring_id] = epoch
            self._newest_epoch.move_to_end(ring_id)
            while len(self._newest_epoch) > self._max_parked:
                self._newest_epoch.popitem(last=False)
            for key in [k for k in self._parked if k[0] == ring_id and k[1] < epoch]:
                self._unpark(key).close()

    def supersede(self, ring_id: str, epoch: int) -> None:
        """A newer `epoch` of `ring_id` is agreed (from any thread): a ring of an older epoch
        still waiting in :meth:`claim` gives up at once instead of waiting out its timeout for a
        member that has moved on, and older connections are refused from now on."""
        with self._cond:
            if epoch > self._newest_epoch.get(ring_id, 0):
                self._newest_epoch[ring_id] = epoch
                for key in [k for k in self._parked if k[0] == ring_id and k[1] < epoch]:
                    self._unpark(key).close()
            self._cond.notify_all()

    def claim(self, ring_id: str, epoch: int, from_rank: int, timeout: float) -> socket.socket:
        """Take the connection `from_rank` opened to us for (`ring_id`, `epoch`), waiting for it.

        Raises:
            RingBroken: phase ``connect``: it did not arrive within `timeout`, or the listener closed.
        """
        self.open_epoch(ring_id, epoch)
        key = (ring_id, epoch, from_rank)
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._parked:
                remaining = deadline - time.monotonic()
                if self._closed:
                    raise RingBroken("connect", from_rank, "the ring listener was closed")
                newest = self._newest_epoch.get(ring_id, epoch)
                if newest > epoch:
                    raise RingBroken("connect", from_rank, f"epoch {epoch} was superseded by epoch {newest}")
                if remaining <= 0:
                    raise RingBroken("connect", from_rank,
                                     f"rank {from_rank} did not connect to us within {timeout:g} s")
                self._cond.wait(remaining)
            sock = self._unpark(key)
        sock.settimeout(None)
        return sock

    def close(self) -> None:
        """Stop accepting and close every parked connection (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for key in list(self._parked):
                self._unpark(key).close()
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2.0)

    def __enter__(self) -> RingListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the accepting side -------------------------------------------------------------

    def _unpark(self, key: tuple[str, int, int]) -> socket.socket:
        """Take a parked connection out (under ``_cond``), giving back its slot."""
        sock, _, address = self._parked.pop(key)
        self.admission.release(address)
        return sock

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                self._expire_parked()
                continue
            except OSError as exc:
                if self._closed:
                    return
                log.warning("ring listener %s: accept failed: %s", self.address, exc)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            refusal = self.admission.reserve(address)
            if refusal is not None:
                log.warning("ring listener %s: refused a connection from %s: %s", self.address, address,
                            refusal[1])
                conn.close()
                continue
            if not self._handshake_slots.acquire(blocking=False):
                self.admission.release(address)
                self.admission.note_refused("too_many_handshakes")
                conn.close()
                continue
            threading.Thread(target=self._serve_handshake, args=(conn, address), daemon=True,
                             name="ring-handshake").start()

    def _expire_parked(self) -> None:
        limit = time.monotonic() - self._park_timeout
        with self._cond:
            for key in [k for k, (_, t, _) in self._parked.items() if t < limit]:
                self._unpark(key).close()

    def _serve_handshake(self, conn: socket.socket, address: str) -> None:
        """Authenticate and park `conn`, which holds a slot of `address` (given back unless parked)."""
        parked = False
        deadline = _Deadline(conn, self._handshake_timeout)
        try:
            if self._tls_context is not None:
                conn.settimeout(self._handshake_timeout)
                try:
                    # a failed handshake closes the TLS socket; `conn` is detached by then
                    conn = self._tls_context.wrap_socket(conn, server_side=True)
                    deadline.follow(conn)
                except OSError as exc:
                    self.admission.note_refused("tls")
                    self.admission.note_failed_handshake(address)
                    log.warning("ring listener %s: refused a connection from %s: %s", self.address, address,
                                server_refusal_reason(exc, self._handshake_timeout))
                    return
            parked = self._handshake(conn, address, deadline)
        except (OSError, ConnectionError) as exc:  # cut short, timed out: a failed handshake too
            self.admission.note_failed_handshake(address)
            log.debug("ring listener %s: handshake with %s failed%s: %r", self.address, address,
                      " (past the handshake timeout)" if deadline.expired else "", exc)
        finally:
            deadline.stop()
            self._handshake_slots.release()
            if not parked:
                self.admission.release(address)
        if not parked:
            conn.close()

    def _refuse(self, conn: socket.socket, code: int, counter: str, address: str, *, failed: bool,
                opening: bool = False) -> bool:
        """Count, log and answer a refusal; `failed`: it counts as a failed handshake of `address`."""
        self.admission.note_refused(counter)
        if failed:
            self.admission.note_failed_handshake(address)
        log.warning("ring listener %s: refused a connection from %s: %s", self.address, address,
                    REFUSALS[code])
        try:
            # an opening is answered as long as a server hello, so that any dialler reads it whole
            conn.sendall(MAGIC + bytes([code]).ljust(_SERVER_HELLO_BYTES - len(MAGIC), b"\0")
                         if opening else bytes([code]))
        except OSError:
            pass
        return False

    def _handshake(self, conn: socket.socket, address: str, deadline: _Deadline) -> bool:
        """Authenticate and park `conn`; True if it was parked (else the caller closes it)."""
        tune_socket(conn)
        conn.settimeout(self._handshake_timeout)
        hello = recv_exact(conn, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            if self._tls_context is None and looks_like_tls(hello):
                self.admission.note_failed_handshake(address)
                self.admission.note_refused("tls")
                log.warning("ring listener %s: refused a connection: it speaks TLS and this node has "
                            "TLS off: set [security] tls_cert, tls_key and tls_ca here too, or remove "
                            "them there", self.address)
                return False
            if hello[: len(MAGIC) - 1] == MAGIC[:-1]:
                return self._refuse(conn, _REFUSED_VERSION, "version", address, failed=True, opening=True)
            return self._refuse(conn, _REFUSED_OPENING, "malformed", address, failed=True, opening=True)
        client_nonce = hello[len(MAGIC) :]
        server_nonce = new_nonce()
        conn.sendall(MAGIC + server_nonce + ring_server_proof(self._secret, RING_VERSION, client_nonce,
                                                              server_nonce))
        head = recv_exact(conn, _PROOF_BYTES + _ANNOUNCE.size)
        epoch, from_rank, rid_len = _ANNOUNCE.unpack(head[_PROOF_BYTES:])
        if rid_len > MAX_RING_ID_BYTES:
            return self._refuse(conn, _REFUSED_BAD, "malformed", address, failed=True)
        rid = recv_exact(conn, rid_len)
        announcement = head[_PROOF_BYTES:] + rid
        if not proofs_equal(head[:_PROOF_BYTES], ring_client_proof(self._secret, RING_VERSION, client_nonce,
                                                                   server_nonce, announcement)):
            return self._refuse(conn, _REFUSED_AUTH, "auth", address, failed=True)
        try:
            ring_id = rid.decode()
        except UnicodeDecodeError:
            return self._refuse(conn, _REFUSED_BAD, "malformed", address, failed=True)
        key = (ring_id, epoch, from_rank)
        with self._cond:
            newest = self._newest_epoch.get(ring_id)
            if self._closed:
                return False
            if newest is not None and epoch < newest:
                return self._refuse(conn, _REFUSED_STALE, "stale", address, failed=False)
            if len(self._parked) >= self._max_parked and key not in self._parked:
                return self._refuse(conn, _REFUSED_BUSY, "busy", address, failed=False)
        if not deadline.stop():
            return False  # it took longer than the handshake timeout: the socket is shut already
        conn.sendall(bytes([ACCEPTED]))
        with self._cond:
            newest = self._newest_epoch.get(ring_id)
            if self._closed or (newest is not None and epoch < newest) or (
                len(self._parked) >= self._max_parked and key not in self._parked
            ):
                return False  # things changed meanwhile: the dialler will see EOF
            if key in self._parked:
                self._unpark(key).close()  # a retry of the same link: the newest attempt wins
            self._parked[key] = (conn, time.monotonic(), address)
            self._cond.notify_all()
        return True
