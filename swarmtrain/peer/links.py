"""Ring links: setting up the TCP connections between ring neighbours.

Every node runs one long-lived :class:`RingListener`. To form a ring for an epoch, each member
dials its successor's listener (:func:`dial`) and claims its predecessor's connection from its
own listener (:meth:`RingListener.claim`). Connections may arrive before the member that
will use them has built its group, so the listener parks authenticated connections until they
are claimed, for a bounded time and in bounded number.

Handshake on a new connection (client = the dialling side; both directions authenticated
with the cluster secret, fresh nonces each, as in :mod:`swarmtrain.transport.auth`)::

    client -> server   MAGIC, client nonce (32)
    server -> client   MAGIC, server nonce (32), server proof (32)
    client -> server   client proof (32), epoch u64, from_rank u32, len u16, ring_id (utf-8)
    server -> client   status u8 (0 = accepted; else why it was refused)

After that the link carries only ring frames (see :mod:`swarmtrain.peer.wireformat`), from
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
from swarmtrain.transport.auth import NONCE_BYTES, client_proof, new_nonce, proofs_equal, server_proof
from swarmtrain.transport.tls import KEYS_HELP, TLSConfig, client_tls_error, server_refusal_reason

__all__ = ["RingBroken", "RingListener", "dial", "tune_socket"]

log = logging.getLogger(__name__)

MAGIC = b"STRING\x00\x01"  # swarmtrain ring link, version 1
_PROOF_BYTES = 32
_ANNOUNCE = struct.Struct("<QIH")  # epoch, from_rank, len(ring_id)
MAX_RING_ID_BYTES = 256

ACCEPTED = 0
_REFUSALS = {
    1: "authentication failed: the listener does not accept our cluster secret",
    2: "stale epoch: the listener has already moved on to a newer epoch of this ring",
    3: "the listener has too many connections waiting to be claimed",
    4: "malformed announcement",
}
_REFUSED_AUTH, _REFUSED_STALE, _REFUSED_BUSY, _REFUSED_BAD = 1, 2, 3, 4

SOCKET_BUFFER_BYTES = 4 << 20
_TLS_HANDSHAKE_RECORD = b"\x16\x03"  # how a TLS client hello starts


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
        return (f"{exc!r}; if {where} has TLS on, this node needs it too: set [security] tls_cert, "
                "tls_key and tls_ca (see docs/tls.md)")
    return (f"{exc!r}; with TLS on, {where} closing the connection before answering most likely "
            f"means it does not accept this node's certificate {tls.cert} (signed by another "
            f"cluster CA?) or has TLS off (its log says why); {KEYS_HELP}")


def _client_handshake(
    sock: socket.socket, secret: bytes | None, rid: bytes, epoch: int, from_rank: int, peer: int, where: str
) -> None:
    tune_socket(sock)
    client_nonce = new_nonce()
    sock.sendall(MAGIC + client_nonce)
    reply = recv_exact(sock, len(MAGIC) + NONCE_BYTES + _PROOF_BYTES)
    if reply[: len(MAGIC)] != MAGIC:
        raise RingBroken("connect", peer, f"{where} is not a swarmtrain ring listener")
    server_nonce = reply[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    if not proofs_equal(reply[-_PROOF_BYTES:], server_proof(secret, client_nonce, server_nonce)):
        raise RingBroken("connect", peer, f"authentication failed: the listener at {where} does not know "
                         "our cluster secret (every member needs the same one)")
    proof = client_proof(secret, client_nonce, server_nonce)
    sock.sendall(proof + _ANNOUNCE.pack(epoch, from_rank, len(rid)) + rid)
    status = recv_exact(sock, 1)[0]
    if status != ACCEPTED:
        raise RingBroken("connect", peer, f"refused by {where}: " + _REFUSALS.get(status, f"status {status}"))


class RingListener:
    """One long-lived TCP listener per node for ring connections of any epoch.

    A background thread accepts connections and authenticates each on its own short-lived
    thread (at most `max_handshakes` at once; more are closed unanswered). Accepted
    connections are parked until a :class:`~swarmtrain.peer.ring.RingGroup` claims them.
    Parked connections of an epoch older than the newest one opened for their ring, and
    those left unclaimed for `park_timeout` seconds, are closed.

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
    Raises:
        ConfigError: the TLS files cannot be loaded.
    """

    def __init__(
        self, host: str, port: int = 0, *, secret: bytes | None, max_parked: int = 64,
        max_handshakes: int = 16, handshake_timeout: float = 5.0, park_timeout: float = 60.0,
        tls: TLSConfig | None = None,
    ) -> None:
        self._secret = secret
        self._tls_context = tls.server_context() if tls is not None else None
        self._max_parked = max_parked
        self._handshake_timeout = handshake_timeout
        self._park_timeout = park_timeout
        self._handshake_slots = threading.BoundedSemaphore(max_handshakes)
        self._cond = threading.Condition()
        # (ring_id, epoch, from_rank) -> (socket, time parked)
        self._parked: dict[tuple[str, int, int], tuple[socket.socket, float]] = {}
        self._newest_epoch: OrderedDict[str, int] = OrderedDict()  # bounded, most recent last
        self._closed = False
        self.refused: dict[str, int] = {"auth": 0, "stale": 0, "busy": 0, "malformed": 0, "tls": 0}
        self._sock = socket.create_server((host, port), backlog=128)
        tune_socket(self._sock)  # accepted sockets inherit the buffer sizes
        self._sock.settimeout(0.5)  # the accept loop wakes to expire parked connections
        host_bound, port_bound = self._sock.getsockname()[:2]
        self.address: tuple[str, int] = (host_bound, port_bound)
        self._thread = threading.Thread(target=self._accept_loop, name=f"ring-listener-{self.address[1]}",
                                        daemon=True)
        self._thread.start()

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
                self._parked.pop(key)[0].close()

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
                if remaining <= 0:
                    raise RingBroken("connect", from_rank,
                                     f"rank {from_rank} did not connect to us within {timeout:g} s")
                self._cond.wait(remaining)
            sock, _ = self._parked.pop(key)
        sock.settimeout(None)
        return sock

    def close(self) -> None:
        """Stop accepting and close every parked connection (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for sock, _ in self._parked.values():
                sock.close()
            self._parked.clear()
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

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._expire_parked()
                continue
            except OSError as exc:
                if self._closed:
                    return
                log.warning("ring listener %s: accept failed: %s", self.address, exc)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            if not self._handshake_slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve_handshake, args=(conn,), daemon=True,
                             name="ring-handshake").start()

    def _expire_parked(self) -> None:
        limit = time.monotonic() - self._park_timeout
        with self._cond:
            for key in [k for k, (_, t) in self._parked.items() if t < limit]:
                self._parked.pop(key)[0].close()

    def _serve_handshake(self, conn: socket.socket) -> None:
        parked = False
        try:
            if self._tls_context is not None:
                conn.settimeout(self._handshake_timeout)
                try:
                    # a failed handshake closes the TLS socket; `conn` is detached by then
                    conn = self._tls_context.wrap_socket(conn, server_side=True)
                except OSError as exc:
                    with self._cond:
                        self.refused["tls"] += 1
                    log.warning("ring listener %s: refused a connection: %s", self.address,
                                server_refusal_reason(exc, self._handshake_timeout))
                    return
            parked = self._handshake(conn)
        except (OSError, ConnectionError, UnicodeDecodeError) as exc:
            log.debug("ring listener %s: handshake failed: %r", self.address, exc)
        finally:
            self._handshake_slots.release()
        if not parked:
            conn.close()

    def _refuse(self, conn: socket.socket, code: int, counter: str) -> bool:
        with self._cond:
            self.refused[counter] += 1
        log.warning("ring listener %s: refused a connection: %s", self.address, _REFUSALS[code])
        try:
            conn.sendall(bytes([code]))
        except OSError:
            pass
        return False

    def _handshake(self, conn: socket.socket) -> bool:
        """Authenticate and park `conn`; True if it was parked (else the caller closes it)."""
        tune_socket(conn)
        conn.settimeout(self._handshake_timeout)
        hello = recv_exact(conn, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            if self._tls_context is None and hello[:2] == _TLS_HANDSHAKE_RECORD:
                with self._cond:
                    self.refused["tls"] += 1
                log.warning("ring listener %s: refused a connection: it speaks TLS and this node has "
                            "TLS off: set [security] tls_cert, tls_key and tls_ca here too, or remove "
                            "them there", self.address)
            return False
        client_nonce = hello[len(MAGIC) :]
        server_nonce = new_nonce()
        conn.sendall(MAGIC + server_nonce + server_proof(self._secret, client_nonce, server_nonce))
        head = recv_exact(conn, _PROOF_BYTES + _ANNOUNCE.size)
        epoch, from_rank, rid_len = _ANNOUNCE.unpack(head[_PROOF_BYTES:])
        if rid_len > MAX_RING_ID_BYTES:
            return self._refuse(conn, _REFUSED_BAD, "malformed")
        ring_id = recv_exact(conn, rid_len).decode()
        if not proofs_equal(head[:_PROOF_BYTES], client_proof(self._secret, client_nonce, server_nonce)):
            return self._refuse(conn, _REFUSED_AUTH, "auth")
        key = (ring_id, epoch, from_rank)
        with self._cond:
            newest = self._newest_epoch.get(ring_id)
            if self._closed:
                return False
            if newest is not None and epoch < newest:
                return self._refuse(conn, _REFUSED_STALE, "stale")
            if len(self._parked) >= self._max_parked and key not in self._parked:
                return self._refuse(conn, _REFUSED_BUSY, "busy")
        conn.sendall(bytes([ACCEPTED]))
        with self._cond:
            newest = self._newest_epoch.get(ring_id)
            if self._closed or (newest is not None and epoch < newest) or (
                len(self._parked) >= self._max_parked and key not in self._parked
            ):
                return False  # things changed meanwhile: the dialler will see EOF
            old = self._parked.pop(key, None)
            if old is not None:
                old[0].close()  # a retry of the same link: the newest attempt wins
            self._parked[key] = (conn, time.monotonic())
            self._cond.notify_all()
        return True
