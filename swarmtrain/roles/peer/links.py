"""Ring links: setting up the TCP connections between ring neighbours.

Every node runs one long-lived :class:`RingListener`. To form a ring for an epoch, each member
dials its successor's listener (:func:`dial`) and claims its predecessor's connection from its
own listener (:meth:`RingListener.claim`). Connections may arrive before the member that
will use them has built its group, so the listener parks authenticated connections until they
are claimed, for a bounded time and in bounded number.

The handshake on a new connection (both directions authenticated with the cluster secret
over the transcript, fresh nonces each) is :mod:`swarmtrain.wire.handshake`: its message
layout, what is checked and in which order, as two sans-IO state machines. This module only
drives them over blocking sockets (:func:`run_handshake`): it reads exactly the bytes the
current step waits for, so no ring frame behind the handshake is consumed, and sends what
they queue. docs/protocol.md, "The ring link handshake", has the bytes.

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
import threading
import time
from collections import OrderedDict

from swarmtrain.errors import SwarmError
from swarmtrain.transport.endpoints import Admission, ServerLimits
from swarmtrain.transport.refusals import RefusalCounter
from swarmtrain.transport.tls import (
    KEYS_HELP,
    TLS_NEEDED_HERE,
    TLSConfig,
    client_tls_error,
    server_refusal_reason,
)
from swarmtrain.wire.handshake import (
    ACCEPTED,
    MAGIC,
    MAX_RING_ID_BYTES,
    REFUSAL_COUNTERS,
    REFUSALS,
    RING_VERSION,
    ClientHandshake,
    Refusal,
    RingHandshakeError,
    ServerHandshake,
    announcement_bytes,
)

__all__ = ["ACCEPTED", "MAGIC", "MAX_RING_ID_BYTES", "REFUSALS", "RING_VERSION", "RingBroken", "RingListener",
           "dial", "recv_exact", "run_handshake", "tune_socket"]

log = logging.getLogger(__name__)

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


def run_handshake(sock: socket.socket, hs: ClientHandshake | ServerHandshake) -> None:
    """Drive `hs` over blocking `sock` until it waits for no more bytes: send what it queued,
    read exactly what its step waits for. Raises what ``hs.feed`` raises (the answer it queued
    with it, if any, is left to the caller to send) and OSError / ConnectionError."""
    while True:
        out = hs.data_to_send()
        if out:
            sock.sendall(out)
        if not hs.need:
            return
        hs.feed(recv_exact(sock, hs.need))


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
    announcement_bytes(ring_id, epoch, from_rank)  # ValueError before any connection
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
                tune_socket(sock)
                try:
                    run_handshake(sock, ClientHandshake(secret, ring_id=ring_id, epoch=epoch,
                                                        from_rank=from_rank, where=where))
                except RingHandshakeError as exc:
                    raise RingBroken("connect", peer, str(exc)) from None
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

    def _refuse(self, conn: socket.socket, hs: ServerHandshake, code: Refusal, address: str) -> bool:
        """Refuse the announced dialler for a reason of the listener's own (not a failed handshake)."""
        self.admission.note_refused(REFUSAL_COUNTERS[code])
        log.warning("ring listener %s: refused a connection from %s: %s", self.address, address,
                    REFUSALS[code])
        try:
            conn.sendall(hs.refuse(code))
        except OSError:
            pass
        return False

    def _handshake(self, conn: socket.socket, address: str, deadline: _Deadline) -> bool:
        """Authenticate and park `conn`; True if it was parked (else the caller closes it)."""
        tune_socket(conn)
        conn.settimeout(self._handshake_timeout)
        hs = ServerHandshake(self._secret, tls_on=self._tls_context is not None)
        try:
            run_handshake(conn, hs)
        except RingHandshakeError as exc:
            self.admission.note_refused(exc.counter)
            if exc.failed:
                self.admission.note_failed_handshake(address)
            log.warning("ring listener %s: refused a connection from %s: %s", self.address, address, exc)
            try:
                conn.sendall(hs.data_to_send())  # counted first: a dialler that reads it sees the count
            except OSError:
                pass
            return False
        ann = hs.announced
        key = (ann.ring_id, ann.epoch, ann.from_rank)
        with self._cond:
            newest = self._newest_epoch.get(ann.ring_id)
            if self._closed:
                return False
            if newest is not None and ann.epoch < newest:
                return self._refuse(conn, hs, Refusal.STALE, address)
            if len(self._parked) >= self._max_parked and key not in self._parked:
                return self._refuse(conn, hs, Refusal.BUSY, address)
        if not deadline.stop():
            return False  # it took longer than the handshake timeout: the socket is shut already
        conn.sendall(hs.accept())
        with self._cond:
            newest = self._newest_epoch.get(ann.ring_id)
            if self._closed or (newest is not None and ann.epoch < newest) or (
                len(self._parked) >= self._max_parked and key not in self._parked
            ):
                return False  # things changed meanwhile: the dialler will see EOF
            if key in self._parked:
                self._unpark(key).close()  # a retry of the same link: the newest attempt wins
            self._parked[key] = (conn, time.monotonic(), address)
            self._cond.notify_all()
        return True
