"""`PeerBackend` in one process over loopback (static peer lists, no mDNS): agreeing the first
epoch, collectives, and re-forming after a ring breaks while every member is still alive —
the case that once span forever because the proposer re-committed the spent epoch."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from swarmtrain.peer.backend import PeerBackend, PeerOptions
from swarmtrain.peer.identity import Identity
from swarmtrain.peer.ring import RingBroken

pytestmark = pytest.mark.timeout(120)
SECRET = b"backend-test-secret"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def in_threads(fns: list[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    """Run each function in its own thread; their results (an exception is re-raised)."""
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"a peer is still inside the call after {timeout} s"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def group() -> Iterator[list[PeerBackend]]:
    ports = free_ports(3)
    backends = []
    for port in ports:
        others = tuple(("127.0.0.1", p) for p in ports if p != port)
        opts = PeerOptions(run="backend-test", min_peers=3, host="127.0.0.1", port=port, mdns=False,
                           static_peers=others, heartbeat_interval=0.3, heartbeat_timeout=3.0,
                           propose_timeout=1.0, ring_timeout=10.0, reform_timeout=15.0)
        backends.append(PeerBackend(opts, secret=SECRET, identity=Identity.generate()))
    try:
        for b in backends:
            b.start()
        for b in backends:
            b.wait_for_peers(2, timeout=20)
        in_threads([lambda b=b: b.refresh(timeout=30) for b in backends])
        yield sorted(backends, key=lambda b: b.rank)
    finally:
        for b in backends:
            b.close()


def test_three_peers_agree_an_epoch_and_all_reduce(group: list[PeerBackend]) -> None:
    assert {b.epoch for b in group} == {group[0].epoch} and group[0].world_size == 3
    outs = in_threads([lambda r=r, b=b: b.all_reduce(torch.full((1000,), float(r + 1)), "mean")
                       for r, b in enumerate(group)])
    for out in outs:
        assert torch.allclose(out, torch.full((1000,), 2.0))


@pytest.mark.parametrize("broken_rank", [0, 2])
def test_a_broken_ring_with_everyone_alive_reforms_under_a_new_epoch(
        group: list[PeerBackend], broken_rank: int) -> None:
    before = group[0].epoch
    group[broken_rank]._current_ring().close()  # a link fault on one member; nobody died
    outs = in_threads([lambda r=r, b=b: b.all_reduce(torch.full((4096,), float(r)), "sum", retries=5)
                       for r, b in enumerate(group)])
    for out in outs:
        assert torch.equal(out, torch.full((4096,), 3.0))  # 0 + 1 + 2, counted once each
    epochs = {b.epoch for b in group}
    assert len(epochs) == 1 and epochs.pop() > before  # the spent epoch is never reused
    assert all(b.world_size == 3 for b in group)


def test_a_broken_ring_names_its_epoch(group: list[PeerBackend]) -> None:
    ring = group[1]._current_ring()
    ring.close()
    with pytest.raises(RingBroken) as info:
        group[1].broadcast(torch.zeros(4))
    assert info.value.epoch == ring.epoch  # what recover() is given: the spent epoch, not the newest
