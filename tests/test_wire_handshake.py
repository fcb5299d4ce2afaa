"""The ring link handshake without I/O (:mod:`swarmtrain.wire.handshake`), tested as the
frame decoder is: any split of the bytes, down to one at a time, gives the same outcome;
truncated or corrupted bytes raise :class:`RingHandshakeError` (a RemoteProtocolError) or
leave the handshake waiting, which its ``end_of_stream`` reports, never anything else; and
each side moves only along its transition table."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmtrain.errors import LocalProtocolError, RemoteProtocolError
from swarmtrain.wire.handshake import (
    _CLIENT_TABLE,
    _SERVER_TABLE,
    ANNOUNCE,
    MAGIC,
    MAX_RING_ID_BYTES,
    OPENING_BYTES,
    SERVER_HELLO_BYTES,
    Announcement,
    ClientHandshake,
    ClientState,
    Refusal,
    RingHandshakeError,
    ServerHandshake,
    ServerState,
    ring_client_proof,
    ring_server_proof,
)

pytestmark = pytest.mark.timeout(120)

SECRET = b"example-secret"
NC, NS = bytes(range(32)), bytes(range(32, 64))


def _pair(secret: bytes | None = SECRET, server_secret: bytes | None = SECRET, ring_id: str = "ring",
          epoch: int = 7, rank: int = 1) -> tuple[ClientHandshake, ServerHandshake]:
    return (ClientHandshake(secret, ring_id=ring_id, epoch=epoch, from_rank=rank, where="L", nonce=NC),
            ServerHandshake(server_secret, nonce=NS))


def _feed(side: ClientHandshake | ServerHandshake, data: bytes, chunk: int) -> None:
    for i in range(0, len(data), chunk):
        side.feed(data[i : i + chunk])


def converse(client: ClientHandshake, server: ServerHandshake, chunk: int) -> list[bytes]:
    """Run both sides to the listener's decision, `chunk` bytes at a time; the bytes each way."""
    sent = []
    while True:
        out = client.data_to_send()
        if out:
            sent.append(out)
            _feed(server, out, chunk)
        back = server.data_to_send()
        if back:
            sent.append(back)
            _feed(client, back, chunk)
        if not out and not back:
            return sent


def test_the_bytes_match_the_documented_layout_and_vectors() -> None:
    client, server = _pair()
    opening, hello, announce = converse(client, server, 1 << 10)
    a = ANNOUNCE.pack(7, 1, 4) + b"ring"
    assert opening == MAGIC + NC
    assert hello == MAGIC + NS + ring_server_proof(SECRET, 2, NC, NS)
    assert ring_server_proof(SECRET, 2, NC, NS).hex() == (
        "fa4ab35f936bd50b363f554937f3a1d4fefded0ff554eb968895b27def6d6f3c")  # docs/protocol.md
    assert announce == ring_client_proof(SECRET, 2, NC, NS, a) + a
    assert server.state is ServerState.ANNOUNCED and server.announced == Announcement("ring", 7, 1)
    assert client.state is ClientState.AWAIT_STATUS and client.need == 1
    status = server.accept()
    assert status == b"\0" and server.state is ServerState.ACCEPTED
    client.feed(status)
    assert client.state is ClientState.ACCEPTED and client.need == 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ring_id=st.text(max_size=40).filter(lambda s: len(s.encode()) <= MAX_RING_ID_BYTES),
       epoch=st.integers(min_value=0, max_value=2**64 - 1),
       rank=st.integers(min_value=0, max_value=2**32 - 1),
       chunk=st.integers(min_value=1, max_value=100), secret=st.one_of(st.none(), st.binary(max_size=16)))
def test_round_trip_in_any_split(ring_id: str, epoch: int, rank: int, chunk: int,
                                 secret: bytes | None) -> None:
    client, server = _pair(secret, secret, ring_id, epoch, rank)
    converse(client, server, chunk)
    assert server.announced == Announcement(ring_id, epoch, rank)
    client.feed(server.accept())
    assert client.state is ClientState.ACCEPTED


def test_bytes_after_the_handshake_are_left_for_the_ring() -> None:
    client, server = _pair()
    opening = client.data_to_send()
    server.feed(opening)
    client.feed(server.data_to_send())
    server.feed(client.data_to_send() + b"ring frames")
    assert server.state is ServerState.ANNOUNCED and server.unused == b"ring frames" and server.need == 0


def test_a_wrong_secret_is_refused_by_whichever_side_checks_first() -> None:
    client, server = _pair(secret=b"other")
    with pytest.raises(RingHandshakeError, match="the listener at L does not know our cluster") as info:
        converse(client, server, 7)
    assert info.value.code == "auth_failed" and client.state is ClientState.FAILED
    with pytest.raises(RingHandshakeError):  # for good
        client.feed(b"")
    # a dialler that skips its check is refused by the listener, with the code on the wire
    server = ServerHandshake(SECRET, nonce=NS)
    server.feed(MAGIC + NC)
    server.data_to_send()
    a = ANNOUNCE.pack(7, 1, 4) + b"ring"
    with pytest.raises(RingHandshakeError) as info:
        server.feed(ring_client_proof(b"other", 2, NC, NS, a) + a)
    assert info.value.refusal == Refusal.AUTH and info.value.counter == "auth" and info.value.failed
    assert server.data_to_send() == bytes([Refusal.AUTH]) and server.state is ServerState.REFUSED


@pytest.mark.parametrize(("opening", "refusal", "counter"), [
    (MAGIC[:-1] + b"\x01", Refusal.VERSION, "version"),
    (b"GET / HTTP/1.1\r\n", Refusal.OPENING, "malformed")])
def test_a_wrong_opening_is_answered_as_long_as_a_hello(opening: bytes, refusal: Refusal,
                                                        counter: str) -> None:
    server = ServerHandshake(SECRET)
    with pytest.raises(RingHandshakeError) as info:
        server.feed(opening.ljust(OPENING_BYTES, b"\0"))
    assert (info.value.refusal, info.value.counter) == (refusal, counter)
    answer = server.data_to_send()
    assert answer == MAGIC + bytes([refusal]) + bytes(SERVER_HELLO_BYTES - len(MAGIC) - 1)
    client = ClientHandshake(SECRET, ring_id="r", epoch=1, from_rank=0, where="L")
    with pytest.raises(RingHandshakeError):
        client.feed(answer)  # a dialler reads it whole, and does not go on


def test_a_tls_opening_without_tls_here_gets_no_answer_and_with_tls_is_just_wrong() -> None:
    tls_hello = b"\x16\x03\x01" + bytes(OPENING_BYTES - 3)
    server = ServerHandshake(SECRET)
    with pytest.raises(RingHandshakeError, match="speaks TLS and this node has TLS off") as info:
        server.feed(tls_hello)
    assert info.value.code == "tls" and info.value.counter == "tls" and server.data_to_send() == b""
    inside = ServerHandshake(SECRET, tls_on=True)
    with pytest.raises(RingHandshakeError) as info:
        inside.feed(tls_hello)
    assert info.value.refusal == Refusal.OPENING


@pytest.mark.parametrize("rid", [b"x" * (MAX_RING_ID_BYTES + 1), b"\xff\xfe"], ids=["too_long", "not_utf8"])
def test_a_malformed_announcement_is_refused(rid: bytes) -> None:
    server = ServerHandshake(SECRET, nonce=NS)
    server.feed(MAGIC + NC)
    server.data_to_send()
    a = ANNOUNCE.pack(7, 1, len(rid)) + rid
    with pytest.raises(RingHandshakeError) as info:
        server.feed(ring_client_proof(SECRET, 2, NC, NS, a) + a)
    assert info.value.refusal == Refusal.MALFORMED and server.data_to_send() == bytes([Refusal.MALFORMED])


def test_the_listener_refuses_for_its_own_reasons_after_the_announcement() -> None:
    client, server = _pair()
    converse(client, server, 64)
    answer = server.refuse(Refusal.STALE)
    assert answer == bytes([Refusal.STALE]) and server.state is ServerState.REFUSED
    with pytest.raises(RingHandshakeError, match="refused by L: stale epoch") as info:
        client.feed(answer)
    assert info.value.refusal == Refusal.STALE
    unknown = _pair()[0]
    with pytest.raises(RingHandshakeError, match="status 77"):
        converse(unknown, ServerHandshake(SECRET, nonce=NS), 64)
        unknown.feed(b"\x4d")


def test_illegal_moves_are_refused_and_every_state_is_reachable() -> None:
    server = ServerHandshake(SECRET)
    with pytest.raises(LocalProtocolError, match="no transition from AWAIT_OPENING to ACCEPTED"):
        server.accept()  # before the dialler has said anything
    with pytest.raises(LocalProtocolError, match="not been authenticated"):
        _ = server.announced
    client, server = _pair()
    converse(client, server, 64)
    server.accept()
    with pytest.raises(LocalProtocolError, match="from ACCEPTED to REFUSED"):
        server.refuse(Refusal.BUSY)  # one answer only
    assert set(_SERVER_TABLE) == set(ServerState) and set(_CLIENT_TABLE) == set(ClientState)
    seen_server, seen_client = set(), set()
    for stop in ("accept", "refuse", "opening", "announce", "proof"):
        client, server = _pair(server_secret=b"other" if stop == "proof" else SECRET)
        seen_server.add(server.state)
        seen_client.add(client.state)
        opening = client.data_to_send()
        try:
            server.feed(b"nope" + opening[4:] if stop == "opening" else opening)
            seen_server.add(server.state)
            client.feed(server.data_to_send())
            seen_client.add(client.state)
            announce = client.data_to_send()
            server.feed(announce[:32] + ANNOUNCE.pack(7, 1, 999) if stop == "announce" else announce[:46])
            seen_server.add(server.state)
            server.feed(announce[46:])
            seen_server.add(server.state)
            client.feed(server.accept() if stop == "accept" else server.refuse(Refusal.BUSY))
        except RingHandshakeError:
            pass
        seen_server.add(server.state)
        seen_client.add(client.state)
    assert seen_server == set(ServerState) and seen_client == set(ClientState)


_CLIENT, _SERVER = _pair()
_SENT = converse(_CLIENT, _SERVER, 1 << 10)
_TO_SERVER, _TO_CLIENT = _SENT[0] + _SENT[2], _SENT[1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk=st.integers(min_value=1, max_value=50))
def test_corrupted_or_truncated_dialler_bytes_never_get_a_dialler_announced(data: st.DataObject,
                                                                             chunk: int) -> None:
    stream = bytearray(_TO_SERVER)
    flips = data.draw(st.dictionaries(st.integers(0, len(stream) - 1), st.integers(1, 255), max_size=3))
    for pos, xor in flips.items():
        stream[pos] ^= xor
    cut = data.draw(st.integers(0, len(stream)))
    server = ServerHandshake(SECRET, nonce=NS)
    error: RemoteProtocolError | None = None
    try:
        _feed(server, bytes(stream[:cut]), chunk)
    except RingHandshakeError as exc:
        error = exc
    else:
        error = server.end_of_stream()
    if not flips and cut == len(stream):
        assert error is None and server.announced == Announcement("ring", 7, 1)
    else:  # every byte the dialler sends is covered by the magic check or its proof
        assert isinstance(error, RingHandshakeError), error
        assert server.state is ServerState.REFUSED


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk=st.integers(min_value=1, max_value=50))
def test_corrupted_or_truncated_listener_bytes_never_get_a_listener_trusted(data: st.DataObject,
                                                                            chunk: int) -> None:
    stream = bytearray(_TO_CLIENT)
    flips = data.draw(st.dictionaries(st.integers(0, len(stream) - 1), st.integers(1, 255), max_size=3))
    for pos, xor in flips.items():
        stream[pos] ^= xor
    cut = data.draw(st.integers(0, len(stream)))
    client = ClientHandshake(SECRET, ring_id="ring", epoch=7, from_rank=1, where="L", nonce=NC)
    client.data_to_send()
    intact = not flips and cut == len(stream)
    error: RemoteProtocolError | None = None
    try:
        _feed(client, bytes(stream[:cut]), chunk)
    except RingHandshakeError as exc:
        error = exc
    else:
        # the intact stream leaves the client waiting for the listener's status byte: ending
        # the stream there would (rightly) be an error too, so only the others are ended
        error = None if intact else client.end_of_stream()
    if intact:
        assert error is None and client.state is ClientState.AWAIT_STATUS
    else:
        assert isinstance(error, RingHandshakeError), error
        assert client.state is ClientState.FAILED and client.data_to_send() == b""


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(max_size=200), chunk=st.integers(min_value=1, max_value=64))
def test_garbage_only_ever_raises_handshake_errors(garbage: bytes, chunk: int) -> None:
    client = ClientHandshake(SECRET, ring_id="r", epoch=0, from_rank=0, where="L")
    for side in (ServerHandshake(SECRET), client):
        try:
            _feed(side, garbage, chunk)
            side.end_of_stream()
        except RingHandshakeError:
            pass
        assert side.state not in (ServerState.ANNOUNCED, ClientState.AWAIT_STATUS, ClientState.ACCEPTED)
