"""Peer mode held to the coordinator's limits (issue 8): the ring listener's connection caps
and failed-handshake lockout, the control server's frame limits per role, and NaN/Inf that
never reach any member's weights (a member's own non-finite contribution is sent as zero
with weight zero; a non-finite average is applied nowhere).

Real sockets, threads and rings over loopback; sources 127.0.0.x stand for other hosts."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from swarmtrain.roles.peer import links
from swarmtrain.roles.peer.backend import PeerBackend
from swarmtrain.roles.peer.control import CTL_FRAME_LIMITS, ControlPlane
from swarmtrain.roles.peer.links import RingListener, dial
from swarmtrain.roles.peer.node import PeerTrainer
from swarmtrain.roles.peer.training import Contribution, DiLoCo, StepAveraging, Strategy
from swarmtrain.transport import Timeouts, auth, connect
from swarmtrain.transport.endpoints import ServerLimits
from swarmtrain.transport.tls import generate_cluster_keys
from swarmtrain.wire import (
    PREAMBLE,
    Auth,
    Challenge,
    Error,
    Hello,
    PeerHello,
    PeerInfoMsg,
    Status,
    StatusRequest,
    Welcome,
)
from swarmtrain.wire.frame import PROTOCOL_VERSION
from tests.test_limits import _first_error
from tests.test_peer_backend import in_threads, started_group
from tests.test_ring_tls import node
from tests.test_transport import HOST, RawPeer, eventually, run

pytestmark = pytest.mark.timeout(120)
SECRET = b"hardening-test-secret"


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


# --- the ring listener: caps and lockout ----------------------------------------------------


def _from(source: str, address: tuple[str, int]) -> socket.socket:
    """A TCP connection to `address` whose source is `source` (any 127.x is this host)."""
    sock = socket.create_connection(address, timeout=10, source_address=(source, 0))
    sock.settimeout(10)
    return sock


def _announce(source: str, address: tuple[str, int], *, proof: bytes = bytes(32), ring_id: bytes = b"r",
              length: int | None = None) -> bytes:
    """A ring handshake by hand with a made-up proof; the listener's status byte (b"" if none)."""
    with _from(source, address) as sock:
        sock.sendall(links.MAGIC + auth.new_nonce())
        assert links.recv_exact(sock, len(links.MAGIC) + 64).startswith(links.MAGIC)
        size = len(ring_id) if length is None else length
        sock.sendall(proof + struct.pack("<QIH", 1, 0, size) + (ring_id if length is None else b""))
        return sock.recv(1)


def _turned_away(sock: socket.socket) -> bool:
    """The listener closed `sock` without a word (it says nothing to a refused address)."""
    with sock:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_ring_listener_caps_connections_per_address_and_frees_a_slot_once_claimed() -> None:
    with RingListener(HOST, secret=SECRET, handshake_timeout=30,
                      limits=ServerLimits(max_per_address=2)) as lst:
        hogs = [_from("127.0.0.2", lst.address) for _ in range(2)]  # idle mid-handshake
        wait_for(lambda: lst.admission.open_connections("127.0.0.2") == 2, "two slots held")
        assert _turned_away(_from("127.0.0.2", lst.address))
        assert lst.refused["too_many_connections"] == 1
        # another address is not affected; its parked link holds a slot until it is claimed
        link = dial(lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=10)
        assert lst.admission.open_connections(HOST) == 1
        lst.claim("r", 1, 0, timeout=10).close()
        assert lst.admission.open_connections(HOST) == 0
        link.close()
        for sock in hogs:
            sock.close()
        wait_for(lambda: lst.admission.open_connections() == 0, "every slot given back")
        # the hogs hung up mid-handshake: failures of their address, not of anyone else
        wait_for(lambda: lst.admission.failed_handshakes == 2, "two failed handshakes")
        with _from("127.0.0.2", lst.address) as again:  # the address is below its cap again
            again.sendall(links.MAGIC + auth.new_nonce())
            assert links.recv_exact(again, len(links.MAGIC)).startswith(links.MAGIC)


def test_ring_listener_locks_out_an_address_after_failed_handshakes() -> None:
    with RingListener(HOST, secret=SECRET, limits=ServerLimits(max_failed_auth=3)) as lst:
        assert _announce("127.0.0.3", lst.address, length=links.MAX_RING_ID_BYTES + 1) == bytes([4])
        for _ in range(2):
            assert _announce("127.0.0.3", lst.address) == bytes([1])  # authentication failed
        assert (lst.refused["malformed"], lst.refused["auth"]) == (1, 2)
        # locked out: even a correct attempt from there is closed before any answer
        assert _turned_away(_from("127.0.0.3", lst.address))
        assert lst.refused["auth_rate_limited"] == 1
        # while a member that knows the secret still gets in from its own address
        link = dial(lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=10)
        lst.claim("r", 1, 0, timeout=10).close()
        link.close()
        assert lst.admission.failed_handshakes == 3


def test_ring_listener_counts_failed_tls_handshakes_against_the_address(tmp_path: Path) -> None:
    keys = generate_cluster_keys(tmp_path, ["a", "b"])
    limits = ServerLimits(max_failed_auth=2)
    with RingListener(HOST, secret=SECRET, tls=node(keys, "a"), limits=limits) as lst:
        for _ in range(2):  # a plain client: its first bytes are no TLS client hello
            with _from("127.0.0.4", lst.address) as sock:
                sock.sendall(links.MAGIC + auth.new_nonce())
                assert _turned_away(sock)
        wait_for(lambda: lst.refused["tls"] == 2, "two TLS failures counted")
        assert _turned_away(_from("127.0.0.4", lst.address))
        wait_for(lambda: lst.refused["auth_rate_limited"] == 1, "the address locked out")
        dial(lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=10,
             tls=node(keys, "b")).close()


# --- the control server: frame limits per role ----------------------------------------------


def _control_plane(limits: ServerLimits = ServerLimits()) -> ControlPlane:
    info = PeerInfoMsg(peer_id="p" * 64, public_key=b"k" * 32, ring_port=1, run="r", profile="test",
                       epoch=0, rounds=0)
    return ControlPlane(run="r", secret=SECRET, timeouts=Timeouts(handshake=10, heartbeat_timeout=20),
                        info=lambda: info, status=lambda: {"epoch": 0}, on_member_lost=lambda pid: None,
                        server_limits=limits)


async def _raw_client(port: int, role: str) -> RawPeer:
    """An authenticated connection whose frames the test writes byte by byte."""
    peer = await RawPeer.open(port)
    nc = auth.new_nonce()
    peer.send(Hello(role=role, nonce=nc))
    ch = await peer.recv()
    assert isinstance(ch, Challenge)
    peer.send(Auth(proof=auth.client_proof(SECRET, auth.Transcript(role, nc, ch.nonce))))
    assert isinstance(await peer.recv(), Welcome)
    return peer


def test_control_frames_over_the_role_limit_close_only_that_connection() -> None:
    async def scenario() -> None:
        limits = ServerLimits(max_connections=40, max_per_address=20, max_failed_auth=5)
        plane = _control_plane(limits)
        port = await plane.start(HOST, 0)
        try:
            assert plane.server is not None and plane.server.limits == limits
            good = await connect(HOST, port, secret=SECRET, role="peer")
            # a peer frame announcing a tensor payload: peers send none, refused from the preamble
            peer = await _raw_client(port, "peer")
            peer.send(PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION, int(PeerHello.TYPE), 0, 10, 1 << 20))
            assert (await _first_error(peer)).code == "oversize_payload"
            # a command from ctl is small: a 100 KB one is refused, a peer may send that much
            ctl = await connect(HOST, port, secret=SECRET, role="ctl")
            await ctl.send(StatusRequest())
            assert isinstance(await ctl.recv(timeout=10), Status)
            await ctl.send(PeerHello(run="x" * (100 << 10)))
            refusal = await ctl.recv(timeout=10)
            assert isinstance(refusal, Error) and refusal.code == "oversize_header"
            assert str(CTL_FRAME_LIMITS.max_header_bytes) in refusal.message
            await asyncio.wait_for(ctl.wait_closed(), 10)
            await good.send(PeerHello(run="x" * (100 << 10)))
            answer = await good.recv(timeout=10)
            assert isinstance(answer, Error) and answer.code == "other_run"  # served, not refused
            await good.send(PeerHello(run="r"))
            assert isinstance(await good.recv(timeout=10), PeerInfoMsg)
            await eventually(lambda: plane.server is not None and len(plane.server.connections) == 1,
                             what="only the refused connections closed")
            await good.close()
        finally:
            await plane.close()

    run(scenario())


# --- non-finite contributions -----------------------------------------------------------------


@pytest.fixture
def trio() -> Iterator[list[PeerBackend]]:
    """Three started peers on loopback that agreed an epoch, with their own connection limits."""
    with started_group("hardening", secret=SECRET, heartbeat_timeout_sec=5.0, ring_timeout_sec=20.0,
                       reform_timeout_sec=20.0, max_connections=100, max_connections_per_address=50,
                       max_failed_auth=7) as backends:
        yield backends


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batch(rank: int, poisoned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
    return (torch.full_like(x, float("nan")) if poisoned else x), y


def _strategy(mode: str, batch: tuple[torch.Tensor, torch.Tensor]) -> Strategy:
    torch.manual_seed(0)  # the same initial weights on every member
    model = nn.Linear(4, 2)
    if mode == "step":
        return StepAveraging(model, _loss, lambda: batch, lr=0.05, weight_decay=0.0)
    return DiLoCo(model, _loss, lambda: batch, lr=0.05, weight_decay=0.0, inner_steps=3)


class _Unscreened(PeerTrainer):
    """A member that sends whatever its local work gives (a bug, or a malicious secret holder)."""

    def _screen(self, work: Contribution) -> Contribution:
        return work


def _train(trainers: list[PeerTrainer]) -> None:
    in_threads([t.run for t in trainers], timeout=90)


def test_connection_limits_reach_the_control_server_and_the_ring_listener(trio: list[PeerBackend]) -> None:
    for b in trio:
        for limits in (b.control.server.limits if b.control.server else None, b.listener.admission.limits):
            assert limits == ServerLimits(max_connections=100, max_per_address=50, max_failed_auth=7)
        st = b.status()
        assert st["ring_refused"] == {} and st["control_refused"] == {}
        assert st["ring_failed_handshakes"] == 0


@pytest.mark.parametrize("mode", ["step", "diloco"])
def test_a_member_with_a_nan_contribution_sends_zero_weight(trio: list[PeerBackend], mode: str) -> None:
    rounds, sick = 3, 1
    trainers = [PeerTrainer(b, _strategy(mode, _batch(r, r == sick)), max_rounds=rounds)
                for r, b in enumerate(trio)]
    _train(trainers)
    weights = [torch.cat([p.detach().reshape(-1) for p in t.strategy.params]) for t in trainers]
    for t, w in zip(trainers, weights):
        assert t.strategy.round == rounds and t.rounds_refused == 0
        assert bool(torch.isfinite(w).all()) and torch.equal(w, weights[0])  # bit-identical
    status = trainers[sick].status()
    assert status["nonfinite_local"] == rounds and status["samples"] == 0
    assert [t.nonfinite_local for t in trainers] == [0, rounds, 0]
    if mode == "step":  # the healthy members' mean, applied by everyone
        ref = _strategy("step", _batch(0, False))
        healthy = [_batch(r, False) for r in (0, 2)]
        for _ in range(rounds):
            grads = []
            for batch in healthy:
                ref.inner.zero_grad()
                _loss(ref.model, batch).backward()
                grads.append([p.grad.clone() for p in ref.params if p.grad is not None])
            for p, g0, g2 in zip(ref.params, *grads):
                p.grad = (g0 + g2) / 2
            ref.inner.step()
        expected = torch.cat([p.detach().reshape(-1) for p in ref.params])
        assert torch.allclose(weights[0], expected, atol=1e-6)


def test_a_poisoned_average_is_applied_by_no_member(trio: list[PeerBackend]) -> None:
    rounds, sick = 2, 2
    trainers = [(_Unscreened if r == sick else PeerTrainer)(b, _strategy("step", _batch(r, r == sick)),
                                                             max_rounds=rounds)
                for r, b in enumerate(trio)]
    before = [[x.detach().clone() for x in t.strategy.boundary_state()[:-1]] for t in trainers]
    _train(trainers)
    for t, state in zip(trainers, before):
        # weights and AdamW state bit for bit as they were; the rounds moved on, refused
        after = t.strategy.boundary_state()[:-1]
        assert all(torch.equal(a, b) for a, b in zip(after, state))
        assert t.strategy.round == rounds and t.rounds_refused == rounds
        assert t.status()["rounds_refused"] == rounds and t.samples == 0
        assert [e["round"] for e in t.events if e["event"] == "round_refused"] == list(range(rounds))
