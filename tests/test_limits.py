"""Limits on what strangers can do to a listening node (issue 8): frames before the handshake,
connections in total and per address, failed handshakes per address, replayed handshakes and
messages, and a worker's frames bounded by the model's size."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.transport import auth, connect
from swarmtrain.transport.endpoints import HANDSHAKE_LIMITS, ServerLimits
from swarmtrain.wire import PREAMBLE, Auth, Challenge, Error, Gradients, Hello, Message, Welcome
from swarmtrain.wire.frame import PROTOCOL_VERSION
from tests.test_ps_inprocess import SECRET, coordinator
from tests.test_transport import HOST, RawPeer, echo, eventually, run, serving

pytestmark = pytest.mark.timeout(90)
KEY = b"limits-secret"


async def _from(source: str, port: int) -> RawPeer:
    """A raw peer whose connection comes from ``source`` (any 127.x address is this host)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(HOST, port, local_addr=(source, 0)), 10)
    return RawPeer(reader, writer)


async def _first_error(peer: RawPeer) -> Error:
    got = await peer.read_to_eof(timeout=10)
    errors = [m for m in got if isinstance(m, Error)]
    assert errors, got
    return errors[0]


def test_before_the_handshake_a_frame_may_carry_no_tensors_and_only_a_small_header() -> None:
    async def scenario() -> None:
        async with serving(echo, secret=KEY) as srv:
            # a HELLO announcing a 64 MiB payload: refused from the preamble, nothing allocated
            peer = await RawPeer.open(srv.port)
            peer.send(PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION, int(Hello.TYPE), 0, 10, 64 << 20))
            err = await _first_error(peer)
            assert err.code == "oversize_payload" and str(HANDSHAKE_LIMITS.max_payload_bytes) in err.message
            peer = await RawPeer.open(srv.port)
            peer.send(PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION, int(Hello.TYPE), 0, 1 << 20, 0))
            assert (await _first_error(peer)).code == "oversize_header"
            # an authenticated client may then send big frames
            conn = await connect(HOST, srv.port, secret=KEY, role="worker")
            big = Welcome(session="x" * 100_000, proof=b"")
            await conn.send(big)
            assert await conn.recv(timeout=10) == big
            await conn.close()

    run(scenario())


def test_connection_caps_hold_while_other_addresses_still_get_in() -> None:
    async def scenario() -> None:
        # no ctl reserve here (test_refusal_counters covers it): a full server refuses at once
        limits = ServerLimits(max_connections=6, max_per_address=3, ctl_slots=0)
        async with serving(echo, secret=KEY, server_limits=limits) as srv:
            hogs = [await _from("127.0.0.2", srv.port) for _ in range(3)]  # mid-handshake, idle
            await eventually(lambda: len(srv.connections) == 3, what="three held")
            extra = await _from("127.0.0.2", srv.port)
            err = await _first_error(extra)
            assert err.code == "too_many_connections" and "127.0.0.2" in err.message
            conn = await connect(HOST, srv.port, secret=KEY, role="worker")  # another address
            await conn.send(Hello(role="x", nonce=b"n" * 32))
            assert isinstance(await conn.recv(timeout=10), Hello)
            more = [await _from("127.0.0.3", srv.port) for _ in range(2)]
            await eventually(lambda: len(srv.connections) == 6, what="six held")
            late = await _from("127.0.0.4", srv.port)
            err = await _first_error(late)
            assert err.code == "too_many_connections" and "maximum of 6" in err.message
            assert srv.refused["too_many_connections"] == 2
            for p in [*hogs, *more]:
                p.close()
            await conn.close()

    run(scenario())


async def _wrong_secret_from(source: str, port: int) -> Message:
    peer = await _from(source, port)
    try:
        return await peer.client_handshake(b"not-the-secret")
    finally:
        peer.close()


def test_an_address_whose_handshakes_keep_failing_is_refused_for_a_while() -> None:
    async def scenario() -> None:
        limits = ServerLimits(max_failed_auth=3, auth_window_sec=60)
        async with serving(echo, secret=KEY, server_limits=limits) as srv:
            for _ in range(3):
                answer = await _wrong_secret_from("127.0.0.5", srv.port)
                assert isinstance(answer, Error) and answer.code == "auth_failed"
            await eventually(lambda: srv.failed_handshakes == 3, what="three failures counted")
            # the fourth attempt, even with the right secret, is turned away at once
            peer = await _from("127.0.0.5", srv.port)
            err = await _first_error(peer)
            assert err.code == "auth_rate_limited" and "check this node's cluster secret" in err.message
            # other addresses are not affected
            conn = await connect(HOST, srv.port, secret=KEY, role="worker")
            await conn.close()

    run(scenario())


def test_a_recorded_handshake_cannot_be_replayed() -> None:
    async def scenario() -> None:
        async with serving(echo, secret=KEY) as srv:
            nc = auth.new_nonce()
            first = await RawPeer.open(srv.port)
            first.send(Hello(role="worker", nonce=nc))
            ch = await first.recv()
            assert isinstance(ch, Challenge)
            recorded = Auth(proof=auth.client_proof(KEY, auth.Transcript("worker", nc, ch.nonce)))
            first.send(recorded)
            assert isinstance(await first.recv(), Welcome)
            first.close()
            # an eavesdropper replays the same HELLO and AUTH: the server's nonce is new
            replay = await RawPeer.open(srv.port)
            replay.send(Hello(role="worker", nonce=nc))
            ch2 = await replay.recv()
            assert isinstance(ch2, Challenge) and ch2.nonce != ch.nonce
            replay.send(recorded)
            answer = await replay.recv()
            assert isinstance(answer, Error) and answer.code == "auth_failed"

    run(scenario())


def test_a_worker_frame_larger_than_the_model_allows_is_refused_before_allocation() -> None:
    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        try:
            before = {n: p.detach().clone() for n, p in c.params.items()}
            model_bytes = sum(p.numel() * 4 for p in c.params.values())
            peer = await RawPeer.open(c.port)
            assert isinstance(await peer.client_handshake(SECRET), Welcome)
            peer.send(PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION, int(Gradients.TYPE), 0, 10,
                                    2 * model_bytes + (2 << 20)))
            err = await _first_error(peer)
            assert err.code == "oversize_payload"
            assert c.version == 0 and all(torch.equal(before[n], p) for n, p in c.params.items())
        finally:
            await c.close()

    run(scenario())


def test_the_failed_handshake_record_holds_only_addresses_failing_now() -> None:
    from swarmtrain.transport.endpoints import Admission

    srv = Admission(ServerLimits(max_failed_auth=2, auth_window_sec=0.2))  # a server's bookkeeping
    for i in range(100):  # addresses that connect and never fail leave no trace
        assert srv.admit(f"10.0.{i}.1") is None
    assert not srv._failures
    srv.note_failed_handshake("10.0.0.1")
    srv.note_failed_handshake("10.0.0.1")
    refusal = srv.admit("10.0.0.1")
    assert refusal is not None and refusal[0] == "auth_rate_limited"

    async def aged_out() -> None:
        async with asyncio.timeout(10):
            while srv.admit("10.0.0.1") is not None:
                await asyncio.sleep(0.02)

    asyncio.run(aged_out())
    assert not srv._failures  # forgotten once its failures aged out of the window
