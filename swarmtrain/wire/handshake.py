"""The ring link handshake (peer mode) and the HMAC both handshakes prove the secret with,
without any I/O.

A peer's ring port does not speak frames: a new connection opens with raw bytes, and once
the dialler is accepted the link carries only ring frames (:mod:`swarmtrain.wire.ring`).
Layout (integers little-endian; docs/protocol.md, "The ring link handshake")::

    dialler -> listener   MAGIC (8), dialler nonce nc (32)
    listener -> dialler   MAGIC (8), listener nonce ns (32), proof_RS (32) = MAC("ring server", v, nc, ns)
    dialler -> listener   proof_RC (32) = MAC("ring client", v, nc, ns, A),
                          A = epoch u64, from_rank u32, len u16, ring_id (UTF-8, at most 256 bytes)
    listener -> dialler   status u8: 0 accepted, else a :class:`Refusal`

``v`` is the ring link version, the last byte of :data:`MAGIC`. The dialler's proof binds
its announcement ``A``, so a relay without the secret can neither change the epoch, rank or
ring a dialler claims nor splice two sessions.

Each side is a small state machine with an explicit transition table: :class:`ClientHandshake`
(the dialler) and :class:`ServerHandshake` (the listener). Bytes go in with ``feed`` (any
split), bytes to send come out of ``data_to_send``, and ``need`` says how many more bytes
the current step waits for, so a blocking loop reads exactly that much and never consumes a
ring frame that follows the handshake on the same stream. Anything wrong raises
:class:`RingHandshakeError` (a :class:`~swarmtrain.errors.RemoteProtocolError`), after the
answer to send, if any, has been queued; later calls raise the same error again.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from enum import Enum, IntEnum

from swarmtrain.errors import LocalProtocolError, RemoteProtocolError
from swarmtrain.wire.frame import looks_like_tls

__all__ = [
    "ACCEPTED",
    "ANNOUNCE",
    "DOMAIN",
    "MAGIC",
    "MAX_RING_ID_BYTES",
    "NONCE_BYTES",
    "OPENING_BYTES",
    "PROOF_BYTES",
    "REFUSALS",
    "REFUSAL_CODES",
    "REFUSAL_COUNTERS",
    "RING_VERSION",
    "SERVER_HELLO_BYTES",
    "Announcement",
    "ClientHandshake",
    "ClientState",
    "Refusal",
    "RingHandshakeError",
    "ServerHandshake",
    "ServerState",
    "announcement_bytes",
    "length_prefixed",
    "mac",
    "new_nonce",
    "proofs_equal",
    "ring_client_proof",
    "ring_server_proof",
]

# --- the MAC of both handshakes (the transport's proofs are in swarmtrain.transport.auth) --

NONCE_BYTES = 32
PROOF_BYTES = 32
DOMAIN = b"swarmtrain handshake"
_LEN = struct.Struct("<H")


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def length_prefixed(*fields: bytes) -> bytes:
    """``fields``, each preceded by its length (u16 LE): no two field lists give the same bytes."""
    return b"".join(_LEN.pack(len(f)) + f for f in fields)


def mac(secret: bytes | None, label: bytes, *fields: bytes) -> bytes:
    """HMAC-SHA256 keyed with the secret (empty for an open cluster) over ``DOMAIN``, ``label``
    and ``fields``, each preceded by its length (u16 LE)."""
    return hmac.new(secret or b"", length_prefixed(DOMAIN, label, *fields), hashlib.sha256).digest()


def proofs_equal(a: bytes, b: bytes) -> bool:
    """Compare two proofs in constant time."""
    return hmac.compare_digest(a, b)


def ring_server_proof(secret: bytes | None, version: int, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The ring listener's proof (``version``: the ring link's, the last byte of its magic)."""
    return mac(secret, b"ring server", bytes([version]), client_nonce, server_nonce)


def ring_client_proof(secret: bytes | None, version: int, client_nonce: bytes, server_nonce: bytes,
                      announcement: bytes) -> bytes:
    """The ring dialler's proof, binding its announcement (epoch, rank, ring id) as sent."""
    return mac(secret, b"ring client", bytes([version]), client_nonce, server_nonce, announcement)


# --- the ring link's messages ---------------------------------------------------------------

RING_VERSION = 2
MAGIC = b"STRING\x00" + bytes([RING_VERSION])  # swarmtrain ring link, and its version
OPENING_BYTES = len(MAGIC) + NONCE_BYTES
SERVER_HELLO_BYTES = len(MAGIC) + NONCE_BYTES + PROOF_BYTES
ANNOUNCE = struct.Struct("<QIH")  # epoch, from_rank, len(ring_id)
MAX_RING_ID_BYTES = 256
ACCEPTED = 0


class Refusal(IntEnum):
    """The status byte a listener refuses a dialler with (0 is :data:`ACCEPTED`)."""

    AUTH = 1
    STALE = 2
    BUSY = 3
    MALFORMED = 4
    VERSION = 5
    OPENING = 6


#: every status byte a ring listener refuses a handshake with, and what it means
REFUSALS = {
    Refusal.AUTH: "authentication failed: the listener does not accept our cluster secret (a "
                  "different secret, or a relay changed the handshake)",
    Refusal.STALE: "stale epoch: the listener has already moved on to a newer epoch of this ring",
    Refusal.BUSY: "the listener has too many connections waiting to be claimed",
    Refusal.MALFORMED: "malformed announcement",
    Refusal.VERSION: "unsupported version: the listener speaks another ring link version (run the "
                     "same swarmtrain release on every machine)",
    Refusal.OPENING: "not a ring link opening: the listener did not find its MAGIC",
}

#: the listener's refusal counter (``RingListener.refused``) of each refusal
REFUSAL_COUNTERS = {Refusal.AUTH: "auth", Refusal.STALE: "stale", Refusal.BUSY: "busy",
                    Refusal.MALFORMED: "malformed", Refusal.VERSION: "version", Refusal.OPENING: "malformed"}

#: the code of the RingHandshakeError a listener raises with each refusal of its own checks
#: (stale and busy are the listener's decisions: :meth:`ServerHandshake.refuse`)
REFUSAL_CODES = {Refusal.AUTH: "auth_failed", Refusal.MALFORMED: "malformed_announcement",
                 Refusal.VERSION: "unsupported_version", Refusal.OPENING: "bad_magic"}

TLS_OFF_HERE = ("it speaks TLS and this node has TLS off: set [security] tls_cert, tls_key and tls_ca "
                "here too, or remove them there")


class RingHandshakeError(RemoteProtocolError):
    """The other side of a ring link handshake sent something this side refuses.

    Attributes:
        code: ``bad_magic``, ``unsupported_version``, ``auth_failed``, ``malformed_announcement``,
            ``tls`` (a TLS client on a listener with TLS off), ``refused`` (the listener said
            no), ``truncated`` (the stream ended mid-handshake); docs/protocol.md lists them.
        refusal: the status byte of the refusal (sent by a listener; received by a dialler,
            as an int, which may be a code this release does not know); None if there is none.
        failed: the listener counts it as a failed handshake of the dialler's address.
    """

    def __init__(self, code: str, message: str, *, refusal: int | None = None, failed: bool = True) -> None:
        super().__init__(code, message)
        self.refusal = refusal
        self.failed = failed

    @property
    def counter(self) -> str:
        """The listener's refusal counter this error counts under."""
        if self.refusal in REFUSAL_COUNTERS:
            return REFUSAL_COUNTERS[Refusal(self.refusal)]
        return self.code


@dataclass(frozen=True)
class Announcement:
    """Who a dialler says it is: the ring, the epoch it dials for and its rank."""

    ring_id: str
    epoch: int
    from_rank: int


def announcement_bytes(ring_id: str, epoch: int, from_rank: int) -> bytes:
    """``A`` as sent. Raises ValueError if the ring id is over :data:`MAX_RING_ID_BYTES`, or the
    epoch or rank does not fit its field."""
    rid = ring_id.encode()
    if len(rid) > MAX_RING_ID_BYTES:
        raise ValueError(f"ring_id is longer than {MAX_RING_ID_BYTES} bytes")
    if not (0 <= epoch < 1 << 64 and 0 <= from_rank < 1 << 32):
        raise ValueError(f"epoch must be in 0..2**64-1 and from_rank in 0..2**32-1, got {epoch}, {from_rank}")
    return ANNOUNCE.pack(epoch, from_rank, len(rid)) + rid


class _Machine:
    """What both sides share: an input buffer, queued output, and a state moved only along
    the side's transition table (``_TABLE``)."""

    _TABLE: dict[Enum, frozenset[Enum]]
    _FAILED: Enum

    def __init__(self, state: Enum, need: int) -> None:
        self.state = state
        self._need = need
        self._in = bytearray()
        self._out = bytearray()
        self._error: RingHandshakeError | None = None

    @property
    def need(self) -> int:
        """Bytes the current step still waits for (0: it waits for none; see ``state``)."""
        return max(self._need - len(self._in), 0) if self._error is None and self._need else 0

    def data_to_send(self) -> bytes:
        """The bytes queued for the other side since the last call (maybe none)."""
        out, self._out = bytes(self._out), bytearray()
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes from the other side (any split). Bytes past the handshake are kept in
        :attr:`unused`. Raises RingHandshakeError (again on every later call, once raised)."""
        if self._error is not None:
            raise self._error
        self._in += data
        while self._need and len(self._in) >= self._need:
            message = bytes(self._in[: self._need])
            del self._in[: self._need]
            try:
                self._step(message)
            except RingHandshakeError as exc:
                self._move(self._FAILED)
                self._error = exc
                raise

    @property
    def unused(self) -> bytes:
        """Bytes fed past the end of the handshake (the start of the ring stream)."""
        return bytes(self._in) if not self._need else b""

    def end_of_stream(self) -> RingHandshakeError | None:
        """The stream has ended: the ``truncated`` error if the handshake was still waiting
        for bytes (saying for which step and how many it had), else None."""
        if self._error is not None or not self._need:
            return None
        err = RingHandshakeError("truncated", f"the stream ended in state {self.state.name}, after "
                                 f"{len(self._in)} of the {self._need} bytes it waits for")
        self._move(self._FAILED)
        self._error = err
        return err

    def _move(self, to: Enum) -> None:
        if to not in self._TABLE[self.state]:
            raise LocalProtocolError("illegal_transition", f"{type(self).__name__}: no transition from "
                                     f"{self.state.name} to {to.name}")
        self.state = to

    def _step(self, message: bytes) -> None:
        raise NotImplementedError


class ClientState(Enum):
    """The dialler's states: opening sent, waiting for the listener's hello; proof and
    announcement sent, waiting for the status byte; accepted; failed (terminal)."""

    AWAIT_HELLO = "await_hello"
    AWAIT_STATUS = "await_status"
    ACCEPTED = "accepted"
    FAILED = "failed"


_CLIENT_TABLE: dict[Enum, frozenset[Enum]] = {
    ClientState.AWAIT_HELLO: frozenset({ClientState.AWAIT_STATUS, ClientState.FAILED}),
    ClientState.AWAIT_STATUS: frozenset({ClientState.ACCEPTED, ClientState.FAILED}),
    ClientState.ACCEPTED: frozenset(),
    ClientState.FAILED: frozenset(),
}


class ClientHandshake(_Machine):
    """The dialler's side. The opening is queued at once (:meth:`data_to_send`).

    Checks, in order, on the listener's hello: the magic's version byte (another version:
    ``unsupported_version``), the magic (``bad_magic``), the listener's proof
    (``auth_failed``); then the status byte (not 0: ``refused``, with :attr:`refusal`).

    Args:
        secret: the cluster secret (None: an open cluster).
        ring_id, epoch, from_rank: the announcement (ValueError if they do not fit).
        where: how messages name the listener (its ``host:port``).
        nonce: this side's nonce (default: fresh random bytes; tests give their own).
    """

    _TABLE = _CLIENT_TABLE
    _FAILED = ClientState.FAILED

    def __init__(self, secret: bytes | None, *, ring_id: str, epoch: int, from_rank: int,
                 where: str, nonce: bytes | None = None) -> None:
        super().__init__(ClientState.AWAIT_HELLO, SERVER_HELLO_BYTES)
        self._secret = secret
        self._announcement = announcement_bytes(ring_id, epoch, from_rank)
        self._where = where
        self._nonce = new_nonce() if nonce is None else nonce
        if len(self._nonce) != NONCE_BYTES:
            raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(self._nonce)}")
        self._server_nonce = b""
        self._out += MAGIC + self._nonce

    def _step(self, message: bytes) -> None:
        if self.state is ClientState.AWAIT_HELLO:
            self._hello(message)
        else:
            self._status(message[0])

    def _hello(self, reply: bytes) -> None:
        where = self._where
        if reply[: len(MAGIC) - 1] == MAGIC[:-1] and reply[len(MAGIC) - 1] != RING_VERSION:
            raise RingHandshakeError(
                "unsupported_version", f"{where} speaks ring link version {reply[len(MAGIC) - 1]}, "
                f"this node {RING_VERSION}: run the same swarmtrain release on every machine")
        if reply[: len(MAGIC)] != MAGIC:
            raise RingHandshakeError("bad_magic", f"{where} is not a swarmtrain ring listener")
        self._server_nonce = reply[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        theirs = reply[-PROOF_BYTES:]
        if not proofs_equal(theirs, ring_server_proof(self._secret, RING_VERSION, self._nonce,
                                                      self._server_nonce)):
            raise RingHandshakeError(
                "auth_failed", f"authentication failed: the listener at {where} does not know our "
                "cluster secret (every member needs the same one), or a relay changed the handshake")
        self._out += ring_client_proof(self._secret, RING_VERSION, self._nonce, self._server_nonce,
                                       self._announcement) + self._announcement
        self._need = 1
        self._move(ClientState.AWAIT_STATUS)

    def _status(self, status: int) -> None:
        if status != ACCEPTED:
            why = REFUSALS[Refusal(status)] if status in REFUSALS else f"status {status}"
            raise RingHandshakeError("refused", f"refused by {self._where}: {why}", refusal=status)
        self._need = 0
        self._move(ClientState.ACCEPTED)


class ServerState(Enum):
    """The listener's states: waiting for the opening, for the proof and announcement head,
    for the ring id; announced (the listener decides: :meth:`ServerHandshake.accept` or
    :meth:`ServerHandshake.refuse`); accepted; refused or failed (terminal)."""

    AWAIT_OPENING = "await_opening"
    AWAIT_ANNOUNCEMENT = "await_announcement"
    AWAIT_RING_ID = "await_ring_id"
    ANNOUNCED = "announced"
    ACCEPTED = "accepted"
    REFUSED = "refused"


_SERVER_TABLE: dict[Enum, frozenset[Enum]] = {
    ServerState.AWAIT_OPENING: frozenset({ServerState.AWAIT_ANNOUNCEMENT, ServerState.REFUSED}),
    ServerState.AWAIT_ANNOUNCEMENT: frozenset({ServerState.AWAIT_RING_ID, ServerState.REFUSED}),
    ServerState.AWAIT_RING_ID: frozenset({ServerState.ANNOUNCED, ServerState.REFUSED}),
    ServerState.ANNOUNCED: frozenset({ServerState.ACCEPTED, ServerState.REFUSED}),
    ServerState.ACCEPTED: frozenset(),
    ServerState.REFUSED: frozenset(),
}


class ServerHandshake(_Machine):
    """The listener's side.

    Checks, in order: the opening's magic (a TLS client while this listener has TLS off:
    ``tls``, no answer; the right magic but another version: :attr:`Refusal.VERSION`; no
    magic: :attr:`Refusal.OPENING`; both answered ``MAGIC``, the code and zeros up to
    :data:`SERVER_HELLO_BYTES`, so a dialler of any release reads the answer whole); the
    announced ring id length (over :data:`MAX_RING_ID_BYTES`: :attr:`Refusal.MALFORMED`); the
    dialler's proof (:attr:`Refusal.AUTH`); the ring id's UTF-8 (:attr:`Refusal.MALFORMED`).
    Every such refusal counts as a failed handshake. Then :attr:`announcement` is known, and
    the listener answers with :meth:`accept` or :meth:`refuse` (stale epoch, busy).

    Args:
        secret: the cluster secret (None: an open cluster).
        tls_on: the connection runs inside TLS (then a TLS opening is just a wrong opening).
        nonce: this side's nonce (default: fresh random bytes).
    """

    _TABLE = _SERVER_TABLE
    _FAILED = ServerState.REFUSED

    def __init__(self, secret: bytes | None, *, tls_on: bool = False, nonce: bytes | None = None) -> None:
        super().__init__(ServerState.AWAIT_OPENING, OPENING_BYTES)
        self._secret = secret
        self._tls_on = tls_on
        self._nonce = new_nonce() if nonce is None else nonce
        self._client_nonce = b""
        self._head = b""
        #: who the dialler says it is (once in state ANNOUNCED)
        self.announcement: Announcement | None = None

    def _step(self, message: bytes) -> None:
        if self.state is ServerState.AWAIT_OPENING:
            self._opening(message)
        elif self.state is ServerState.AWAIT_ANNOUNCEMENT:
            self._announce_head(message)
        else:
            self._ring_id(message)

    def _refused(self, code: Refusal, *, opening: bool = False) -> RingHandshakeError:
        """Queue the answer refusing the dialler with `code`; the error to raise."""
        # an opening is answered as long as a server hello, so that any dialler reads it whole
        self._out += (MAGIC + bytes([code]).ljust(SERVER_HELLO_BYTES - len(MAGIC), b"\0")
                      if opening else bytes([code]))
        return RingHandshakeError(REFUSAL_CODES[code], REFUSALS[code], refusal=code)

    def _opening(self, hello: bytes) -> None:
        if hello[: len(MAGIC)] != MAGIC:
            if not self._tls_on and looks_like_tls(hello):
                raise RingHandshakeError("tls", TLS_OFF_HERE)
            if hello[: len(MAGIC) - 1] == MAGIC[:-1]:
                raise self._refused(Refusal.VERSION, opening=True)
            raise self._refused(Refusal.OPENING, opening=True)
        self._client_nonce = hello[len(MAGIC) :]
        self._out += MAGIC + self._nonce + ring_server_proof(self._secret, RING_VERSION, self._client_nonce,
                                                             self._nonce)
        self._need = PROOF_BYTES + ANNOUNCE.size
        self._move(ServerState.AWAIT_ANNOUNCEMENT)

    def _announce_head(self, head: bytes) -> None:
        rid_len = ANNOUNCE.unpack_from(head, PROOF_BYTES)[2]
        if rid_len > MAX_RING_ID_BYTES:
            raise self._refused(Refusal.MALFORMED)
        self._head = head
        self._need = rid_len
        self._move(ServerState.AWAIT_RING_ID)
        if rid_len == 0:
            self._ring_id(b"")

    def _ring_id(self, rid: bytes) -> None:
        proof, announced = self._head[:PROOF_BYTES], self._head[PROOF_BYTES:] + rid
        if not proofs_equal(proof, ring_client_proof(self._secret, RING_VERSION, self._client_nonce,
                                                     self._nonce, announced)):
            raise self._refused(Refusal.AUTH)
        try:
            ring_id = rid.decode()
        except UnicodeDecodeError:
            raise self._refused(Refusal.MALFORMED) from None
        epoch, from_rank, _ = ANNOUNCE.unpack_from(self._head, PROOF_BYTES)
        self.announcement = Announcement(ring_id, epoch, from_rank)
        self._need = 0
        self._move(ServerState.ANNOUNCED)

    @property
    def announced(self) -> Announcement:
        """:attr:`announcement`, once the dialler is authenticated (state ANNOUNCED or later).

        Raises:
            LocalProtocolError: ``not_announced``: the handshake has not got that far.
        """
        if self.announcement is None:
            raise LocalProtocolError("not_announced", f"the dialler has not been authenticated yet "
                                     f"(state {self.state.name})")
        return self.announcement

    def accept(self) -> bytes:
        """Accept the announced dialler: the status byte to send."""
        self._move(ServerState.ACCEPTED)
        return bytes([ACCEPTED])

    def refuse(self, code: Refusal) -> bytes:
        """Refuse the announced dialler (the listener's own reasons: stale epoch, busy): the
        status byte to send."""
        self._move(ServerState.REFUSED)
        return bytes([code])
