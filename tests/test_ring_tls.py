"""The peer ring's links over mutual TLS (swarmtrain.roles.peer.links / ring with ``tls=``): rings of
threads on 127.0.0.1 computing exact results, refusals of certificates from another CA and of
plain members, aborts, and three `PeerBackend`s with TLS on.

Certificates are made by the code under test in a temporary directory; every port is 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
from swarmtrain.roles.peer.links import RingListener, dial
from swarmtrain.roles.peer.ring import RingBroken, RingGroup
from swarmtrain.transport.identity import Identity
from swarmtrain.transport.tls import ClusterKeys, TLSConfig, generate_cluster_keys
from tests.test_peer_backend import free_ports, in_threads
from tests.test_ring import close_midway, run_ring

pytestmark = pytest.mark.timeout(90)

SECRET = b"ring-tls-test-secret"
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ClusterKeys:
    return generate_cluster_keys(tmp_path_factory.mktemp("keys"), ["a", "b", "c"])


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> ClusterKeys:
    """Another cluster: another CA, so none of its certificates are ours."""
    return generate_cluster_keys(tmp_path_factory.mktemp("other"), ["x"])


def node(keys: ClusterKeys, name: str, ca: Path | None = None) -> TLSConfig:
    cert, key = keys.nodes[name]
    return TLSConfig(cert=cert, key=key, ca=ca or keys.ca)


def members(cluster: ClusterKeys, world: int) -> list[TLSConfig | None]:
    return [node(cluster, "abc"[r % 3]) for r in range(world)]


def integers(world: int, numel: int) -> list[torch.Tensor]:
    """Integer-valued floats: sums in any order are exact, so results can be compared exactly."""
    gen = torch.Generator().manual_seed(numel)
    return [torch.randint(-1000, 1000, (numel,), generator=gen).float() for _ in range(world)]


# --- collectives over TLS -----------------------------------------------------------------


def test_all_reduce_broadcast_and_barrier_over_tls_are_exact(cluster: ClusterKeys) -> None:
    world, big = 3, 1_500_001  # not divisible by 3; ~40 segments of 64 KB per chunk
    xs, ones = integers(world, big), integers(world, 1)
    exact, exact_one = sum(xs), sum(ones)

    def body(group: RingGroup, rank: int) -> dict[str, Any]:
        summed = group.all_reduce(xs[rank].clone())
        mean = group.all_reduce(xs[rank].clone(), "mean")
        one = group.all_reduce(ones[rank].clone())
        text = torch.arange(100_003, dtype=torch.int64)
        if rank != 1:
            text.zero_()
        group.broadcast(text, root=1)
        group.barrier()
        return {"sum": summed, "mean": mean, "one": one, "bcast": text, "sent": group.bytes_sent}

    for res in run_ring(world, body, tls=members(cluster, world), segment_bytes=64 << 10):
        assert torch.equal(res["sum"], exact)
        assert torch.equal(res["mean"], exact / world)  # float32 division, as the ring does it
        assert torch.equal(res["one"], exact_one)
        assert torch.equal(res["bcast"], torch.arange(100_003, dtype=torch.int64))
        assert res["sent"] > 2 * 2 * (world - 1) / world * big * 4 * 0.99  # the payload did travel


def test_links_are_really_tls(cluster: ClusterKeys) -> None:
    with RingListener(HOST, secret=SECRET, tls=node(cluster, "a")) as lst:
        sock = dial(lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=5,
                    tls=node(cluster, "b"))
        parked = lst.claim("r", 1, 0, timeout=5)
        try:
            for s in (sock, parked):
                assert s.version() in ("TLSv1.2", "TLSv1.3")  # type: ignore[attr-defined]
                assert s.getpeercert() is not None  # type: ignore[attr-defined]
        finally:
            sock.close()
            parked.close()


# --- refusals -----------------------------------------------------------------------------


def test_member_from_another_ca_cannot_join_and_the_listener_serves_on(
        cluster: ClusterKeys, stranger: ClusterKeys) -> None:
    good, bad = node(cluster, "a"), node(stranger, "x")
    timeout = 3.0
    listeners = [RingListener(HOST, secret=SECRET, tls=t) for t in (good, bad)]
    addresses = [lst.address for lst in listeners]
    try:
        def member(rank: int) -> float:
            start = time.monotonic()
            with pytest.raises(RingBroken) as info:
                RingGroup(listeners[rank], rank, addresses, ring_id="ca", epoch=1, secret=SECRET,
                          timeout=timeout, tls=(good, bad)[rank])
            assert info.value.phase == "connect" and info.value.peer == 1 - rank
            assert "certificate" in str(info.value) and "not trust" in str(info.value)
            return time.monotonic() - start

        for seconds in in_threads([lambda r=r: member(r) for r in range(2)]):
            assert seconds < timeout
        # a certificate of another CA that trusts our CA: our listener refuses the certificate
        with pytest.raises(RingBroken, match="does not accept this node's TLS certificate") as info:
            dial(addresses[0], secret=SECRET, ring_id="ca", epoch=2, from_rank=1, peer=0, timeout=timeout,
                 tls=node(stranger, "x", ca=cluster.ca))
        assert info.value.phase == "connect"
        assert listeners[0].refused["tls"] >= 1
        # and a good member still gets in
        sock = dial(addresses[0], secret=SECRET, ring_id="ca", epoch=2, from_rank=1, peer=0, timeout=timeout,
                    tls=node(cluster, "b"))
        sock.close()
    finally:
        for lst in listeners:
            lst.close()


def test_plain_member_and_tls_listener_refuse_each_other(cluster: ClusterKeys) -> None:
    timeout = 2.0
    with RingListener(HOST, secret=SECRET, tls=node(cluster, "a")) as tls_lst, \
            RingListener(HOST, secret=SECRET) as plain_lst:
        start = time.monotonic()
        with pytest.raises(RingBroken, match="has TLS on, this node needs it too") as info:
            dial(tls_lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=timeout)
        assert info.value.phase == "connect"
        with pytest.raises(RingBroken, match="TLS") as info:
            dial(plain_lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=timeout,
                 tls=node(cluster, "b"))
        assert info.value.phase == "connect"
        assert time.monotonic() - start < 2 * timeout + 2
        assert tls_lst.refused["tls"] >= 1 and plain_lst.refused["tls"] >= 1
        # neither parked anything; both still serve their own kind
        dial(tls_lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0, timeout=timeout,
             tls=node(cluster, "b")).close()
        dial(plain_lst.address, secret=SECRET, ring_id="r", epoch=1, from_rank=0, peer=0,
             timeout=timeout).close()


def test_wrong_secret_inside_tls_is_still_refused(cluster: ClusterKeys) -> None:
    with RingListener(HOST, secret=SECRET, tls=node(cluster, "a")) as lst:
        with pytest.raises(RingBroken, match="authentication"):
            dial(lst.address, secret=b"not the secret", ring_id="r", epoch=1, from_rank=0, peer=0, timeout=3,
                 tls=node(cluster, "b"))


# --- failures during a collective ---------------------------------------------------------


def test_close_from_another_thread_aborts_a_tls_collective_in_progress(cluster: ClusterKeys) -> None:
    assert run_ring(2, close_midway, timeout=30.0, tls=members(cluster, 2))[0] < 5.0


def test_member_closing_mid_transfer_fails_the_others_fast(cluster: ClusterKeys) -> None:
    timeout = 5.0
    xs = integers(3, 4_000_000)

    def body(group: RingGroup, rank: int) -> Any:
        if rank == 2:
            time.sleep(0.05)  # the others are inside their all_reduce, sending to / waiting on us
            group.close()
            return None
        start = time.monotonic()
        with pytest.raises(RingBroken) as info:
            group.all_reduce(xs[rank])
        assert info.value.phase in ("reduce_scatter", "all_gather")
        return time.monotonic() - start

    for seconds in run_ring(3, body, tls=members(cluster, 3), timeout=timeout, segment_bytes=256 << 10)[:2]:
        assert seconds < 3 * timeout


# --- PeerBackend ------------------------------------------------------------------------------


@pytest.fixture
def backends(cluster: ClusterKeys) -> Iterator[list[PeerBackend]]:
    ports = free_ports(3)
    group = []
    for port, name in zip(ports, "abc"):
        others = tuple((HOST, p) for p in ports if p != port)
        opts = PeerOptions(run="ring-tls-test", min_peers=3, host=HOST, port=port, mdns=False,
                           static_peers=others, heartbeat_interval_sec=0.3, heartbeat_timeout_sec=3.0,
                           propose_timeout_sec=1.0, ring_timeout_sec=10.0, reform_timeout_sec=15.0)
        group.append(PeerBackend(opts, secret=SECRET, identity=Identity.generate(), tls=node(cluster, name)))
    try:
        for b in group:
            b.start()
        for b in group:
            b.wait_for_peers(2, timeout=20)
        in_threads([lambda b=b: b.refresh(timeout=30) for b in group])
        yield sorted(group, key=lambda b: b.rank)
    finally:
        for b in group:
            b.close()


def test_three_tls_backends_agree_an_epoch_and_all_reduce(backends: list[PeerBackend]) -> None:
    assert {b.epoch for b in backends} == {backends[0].epoch} and backends[0].world_size == 3
    ring = backends[0]._current_ring()
    assert ring._out is not None and ring._out.version() is not None  # type: ignore[attr-defined]
    outs = in_threads([lambda r=r, b=b: b.all_reduce(torch.full((300_001,), float(r + 1)), "mean")
                       for r, b in enumerate(backends)])
    for out in outs:
        assert torch.equal(out, torch.full((300_001,), 2.0))
