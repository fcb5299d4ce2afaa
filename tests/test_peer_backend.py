"""`PeerBackend` in one process over loopback (static peer lists, no mDNS): agreeing the first
epoch, collectives, re-forming after a ring breaks while every member is still alive (the
case that once span forever because the proposer re-committed the spent epoch), a joiner
taken in by the documented user loop, named timeouts, and signed REFORM requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.roles.peer.backend import NonFiniteResult, PeerBackend, PeerOptions
from swarmtrain.roles.peer.membership import Candidate, Membership
from swarmtrain.roles.peer.ring import RingBroken
from swarmtrain.testing.local import free_ports, in_threads
from swarmtrain.transport.identity import Identity
from swarmtrain.wire import Reform

pytestmark = pytest.mark.timeout(120)
SECRET = b"backend-test-secret"






@contextlib.contextmanager
def started_group(run: str, n: int = 3, *, secret: bytes = SECRET,
                  **options: Any) -> Iterator[list[PeerBackend]]:
    """``n`` started peers on loopback (static peers, no mDNS) that agreed an epoch, by rank;
    ``options`` override :class:`PeerOptions` fields. Closed afterwards."""
    ports = free_ports(n)
    backends = []
    for port in ports:
        others = tuple(("127.0.0.1", p) for p in ports if p != port)
        opts = PeerOptions(**{"run": run, "min_peers": n, "host": "127.0.0.1", "port": port, "mdns": False,
                              "static_peers": others, "heartbeat_interval_sec": 0.3,
                              "heartbeat_timeout_sec": 3.0, "propose_timeout_sec": 1.0,
                              "ring_timeout_sec": 10.0, "reform_timeout_sec": 15.0, **options})
        backends.append(PeerBackend(opts, secret=secret, identity=Identity.generate()))
    try:
        for b in backends:
            b.start()
        for b in backends:
            b.wait_for_peers(n - 1, timeout=20)
        in_threads([lambda b=b: b.refresh(timeout=30) for b in backends])
        yield sorted(backends, key=lambda b: b.rank)
    finally:
        for b in backends:
            b.close()


@pytest.fixture
def group() -> Iterator[list[PeerBackend]]:
    with started_group("backend-test") as backends:
        yield backends


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


def start_peer(port: int, ports: list[int], identity: Identity, **overrides: Any) -> PeerBackend:
    others = tuple(("127.0.0.1", p) for p in ports if p != port)
    opts = PeerOptions(**{**dict(run="backend-test", min_peers=2, host="127.0.0.1", port=port, mdns=False,
                                 static_peers=others, heartbeat_interval_sec=0.3, heartbeat_timeout_sec=3.0,
                                 propose_timeout_sec=1.0, ring_timeout_sec=10.0, reform_timeout_sec=15.0),
                          **overrides})
    backend = PeerBackend(opts, secret=SECRET, identity=identity)
    backend.start()
    return backend


def user_loop(b: PeerBackend, w: torch.Tensor, steps: list[tuple[int, int, torch.Tensor, torch.Tensor]],
              stop_after: int = 0) -> None:
    """The loop docs/peer-mode.md documents: sync_state at the top of each step, one all-reduce.
    The last element of the reduced buffer is a stop vote, so every member stops after the same
    step; the joiner (``stop_after`` > 0) votes once it has done that many steps with 3 members."""
    while b.rounds < 200_000:
        b.sync_state([w])
        start = w.clone()  # the state this step's contribution is computed from
        vote = float(stop_after > 0 and sum(1 for s in steps if s[1] == 3) >= stop_after)
        out = b.all_reduce(torch.cat([torch.ones(8), torch.tensor([vote])]), "sum")
        steps.append((b.rounds - 1, int(out[0]), start, out.clone()))
        w += out[:8]
        if out[8] > 0:
            return


def test_a_joiner_is_taken_in_by_the_user_loop_and_loads_the_state_first() -> None:
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)  # the joiner's is highest
    ports = free_ports(3)
    backends: list[PeerBackend] = []
    try:
        backends += [start_peer(ports[i], ports, ids[i]) for i in range(2)]
        weights = [torch.zeros(8), torch.full((8,), 123.0), torch.full((8,), -1.0)]  # 2nd is overwritten
        steps: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]] = [[], [], []]
        threads = [threading.Thread(target=user_loop, args=(backends[i], weights[i], steps[i]), daemon=True)
                   for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(steps[0]) < 5:  # the two run their loop before the joiner starts
            assert time.monotonic() < deadline and threads[0].is_alive(), "the 2-peer loop does not run"
            time.sleep(0.01)
        joiner = start_peer(ports[2], ports, ids[2])
        backends.append(joiner)
        joiner.wait_for_peers(2, timeout=20)
        in_threads([lambda: user_loop(joiner, weights[2], steps[2], stop_after=5)], timeout=60)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "an old member did not stop with the joiner"
    finally:
        for b in backends:
            b.close()
    assert {b.world_size for b in backends} == {3}
    # before its first contribution, the joiner held exactly what the others held at that step
    first_round, world, start, _ = steps[2][0]
    assert world == 3
    group_state = {r: s for r, _, s, _ in steps[0]}
    assert torch.equal(start, group_state[first_round]) and not torch.equal(start, torch.full((8,), -1.0))
    # every sum counts each member once: 2 until the joiner is in, then 3, never anything else
    for member in steps:
        worlds = [w for _, w, _, _ in member]
        assert set(worlds) <= {2, 3} and worlds == sorted(worlds)
        assert all(torch.equal(out[:8], torch.full((8,), float(w))) for _, w, _, out in member)
    assert all(w == 3 for _, w, _, _ in steps[2])
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])
    assert backends[0].rounds == backends[1].rounds == backends[2].rounds


def test_a_timeout_inside_the_control_loop_keeps_its_phase_and_limit() -> None:
    port, nobody = free_ports(2)  # nobody listens on the second: no other peer, nobody proposes us in
    b = start_peer(port, [port, nobody], Identity.generate(), reform_timeout_sec=1.0)
    try:
        with pytest.raises(SwarmTimeout) as info:
            b.refresh()
        assert info.value.phase == "reform" and info.value.seconds == 1.0
        with pytest.raises(SwarmTimeout) as outer:
            b._call(asyncio.sleep(5), timeout=0.2)
        assert outer.value.phase == "peer control" and outer.value.seconds == 0.2
    finally:
        b.close()


def test_a_forged_reform_is_ignored_and_a_signed_one_reforms(group: list[PeerBackend]) -> None:
    proposer, member, sender = group
    before = proposer.epoch
    to_proposer = Candidate(proposer.membership.me, "127.0.0.1", proposer.port, 0)

    def send(msg: Reform) -> None:
        assert sender._call(sender.control.ask(to_proposer, msg, 5.0), 10) is not None

    send(Reform(epoch=before, peer_id=member.membership.me))  # unsigned
    impostor = Membership(Identity.generate(), ring_address=("127.0.0.1", 1), send=sender.control.ask)
    forged = impostor.reform_request(before)
    send(dataclasses.replace(forged, peer_id=member.membership.me))  # signed by a key not the member's
    assert proposer.forged_reforms == 2
    outs = in_threads([lambda b=b: b.all_reduce(torch.ones(16), "sum", retries=0) for b in group])
    assert all(torch.equal(o, torch.full((16,), 3.0)) for o in outs)  # the ring was left alone
    assert {b.epoch for b in group} == {before}

    send(member.membership.reform_request(before))  # genuine: the proposer aborts its ring
    outs = in_threads([lambda b=b: b.all_reduce(torch.ones(16), "sum") for b in group])
    assert all(torch.equal(o, torch.full((16,), 3.0)) for o in outs)
    assert proposer.forged_reforms == 2 and len({b.epoch for b in group}) == 1 and proposer.epoch > before


def test_check_finite_makes_every_member_refuse_a_non_finite_result(group: list[PeerBackend]) -> None:
    def reduce(b: PeerBackend, value: float, check: bool) -> Any:
        try:
            return b.all_reduce(torch.full((64,), value), "sum", check_finite=check)
        except NonFiniteResult as exc:
            return str(exc)  # (an exception returned would be re-raised by in_threads)

    plain = in_threads([lambda r=r, b=b: reduce(b, float("nan") if r == 1 else 1.0, False)
                        for r, b in enumerate(group)])
    assert all(isinstance(o, torch.Tensor) and bool(torch.isnan(o).all()) for o in plain)  # returned as is
    checked = in_threads([lambda r=r, b=b: reduce(b, float("inf") if r == 2 else 1.0, True)
                          for r, b in enumerate(group)])
    assert all(isinstance(o, str) and "NaN or Inf" in o for o in checked), checked
    outs = in_threads([lambda b=b: reduce(b, 1.0, True) for b in group])  # and the group goes on
    assert all(torch.equal(o, torch.full((64,), 3.0)) for o in outs)


# --- the all-reduce keeps no copy of its input -------------------------------------------


VICTIM = """
import sys, time
from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
from swarmtrain.transport.identity import Identity
port, others = int(sys.argv[1]), [int(p) for p in sys.argv[2].split(",")]
opts = PeerOptions(run="backend-test", min_peers=3, host="127.0.0.1", port=port, mdns=False,
                   static_peers=tuple(("127.0.0.1", p) for p in others), heartbeat_interval_sec=0.3,
                   heartbeat_timeout_sec=3.0, propose_timeout_sec=1.0, ring_timeout_sec=10.0,
                   reform_timeout_sec=15.0)
b = PeerBackend(opts, secret=sys.argv[3].encode(), identity=Identity.generate())
b.start()
b.wait_for_peers(2, timeout=20)
b.refresh(timeout=30)
print("joined", b.world_size, flush=True)
time.sleep(600)  # never enters the all-reduce: it is killed while the others wait in it
"""


def test_a_member_killed_while_the_others_wait_in_the_all_reduce_they_retry_with_their_inputs() -> None:
    ports = free_ports(3)
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(ports[2]), f"{ports[0]},{ports[1]}",
                               SECRET.decode()], stdout=subprocess.PIPE, text=True)
    survivors: list[PeerBackend] = []
    try:
        survivors += [start_peer(p, ports, Identity.generate(), min_peers=3) for p in ports[:2]]
        for b in survivors:
            b.wait_for_peers(2, timeout=20)
        in_threads([lambda b=b: b.refresh(timeout=30) for b in survivors])
        assert victim.stdout is not None and victim.stdout.readline().split() == ["joined", "3"]
        inputs = [torch.randint(-1000, 1000, (100_003,)).float() for _ in survivors]
        tensors = [x.clone() for x in inputs]
        killer = threading.Timer(1.0, victim.kill)  # the survivors are inside the all-reduce by then
        killer.start()
        outs = in_threads([lambda b=b, t=t: b.all_reduce(t, "sum") for b, t in zip(survivors, tensors)])
        killer.join()
        for out, t in zip(outs, tensors):
            assert out is t and torch.equal(t, inputs[0] + inputs[1])  # exactly the survivors' inputs
        assert [b.world_size for b in survivors] == [2, 2]
    finally:
        victim.kill()
        victim.wait(10)
        for b in survivors:
            b.close()


def break_once_changed(b: PeerBackend) -> None:
    """The current ring of ``b`` breaks right after its collective first writes the tensor
    (every member has joined by then, so the others may have changed theirs too)."""
    ring = b._current_ring()
    pump = ring._pump

    def pump_until_changed(op: Any) -> None:
        received = op.received

        def then_break(frame: Any, scale: float) -> None:
            received(frame, scale)
            if op.touched:
                raise RingBroken("reduce_scatter", None, "injected once the tensor changed")

        op.received = then_break
        pump(op)

    ring._pump = pump_until_changed  # type: ignore[method-assign]


def test_a_ring_broken_after_a_tensor_changed_voids_the_retry_on_every_member(
        group: list[PeerBackend]) -> None:
    break_once_changed(group[1])
    before = [b.rounds for b in group]

    def reduce(b: PeerBackend) -> Any:
        try:
            return b.all_reduce(torch.ones(4096), "sum")
        except RingBroken as exc:
            return exc.phase  # (an exception returned would be re-raised by in_threads)

    assert in_threads([lambda b=b: reduce(b) for b in group]) == ["retry"] * 3  # alike, nobody waits
    assert [b.rounds for b in group] == before
    outs = in_threads([lambda b=b: b.all_reduce(torch.ones(4096), "sum") for b in group])  # and it goes on
    assert all(torch.equal(o, torch.full((4096,), 3.0)) for o in outs)


def resident_peak_above(run: Callable[[], Any]) -> int:
    """Bytes the process's resident set rose above its size before ``run`` at its peak."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident size
    rss = status("VmRSS:")
    run()
    return status("VmHWM:") - rss


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_all_reduce_copies_nothing_for_its_retry(group: list[PeerBackend]) -> None:
    n = 12_000_000  # 48 MB each: more than glibc ever reuses without mapping it afresh
    tensors = [torch.full((n,), float(r)) for r in range(3)]
    in_threads([lambda b=b, t=t: b.all_reduce(t, "sum") for b, t in zip(group, tensors)])  # scratch set up
    calls: list[Callable[[PeerBackend, torch.Tensor], Any]] = [
        lambda b, t: b.all_reduce(t, "mean"),  # the default retries, weighted or not
        lambda b, t: b.all_reduce(t, "mean", weight=2.0),
        lambda b, t: b.all_reduce(t, "sum", retries=0, boundary=False, check_finite=True),  # the trainer's
    ]
    for call in calls:
        extra = resident_peak_above(lambda call=call: in_threads(
            [lambda b=b, t=t: call(b, t) for b, t in zip(group, tensors)]))
        assert extra < n, f"{extra / 1e6:.0f} MB resident above the start (bound: a quarter tensor)"
    assert all(torch.equal(t, torch.full((n,), 9.0)) for t in tensors)  # 3 (sum), 3, 3, 3 x 3


def test_the_byte_totals_are_the_rings_counters_over_every_collective_and_epoch(
        group: list[PeerBackend]) -> None:
    """bytes_sent/bytes_received are the rings' own counters, summed over the rings let go of:
    what one member sends another receives, a broadcast counts at once (not at the next
    all-reduce), a new epoch and close() lose nothing."""
    def totals() -> list[tuple[int, int]]:
        return [(b.bytes_sent, b.bytes_received) for b in group]

    n = 30_000
    in_threads([lambda b=b: b.all_reduce(torch.ones(n), "sum") for b in group])
    after_reduce = totals()
    # a ring all-reduce sends 2 (W-1)/W of the tensor from every member (fp32), plus headers
    assert all(sent >= 2 * 2 * n * 4 // 3 for sent, _ in after_reduce)
    assert sum(s for s, _ in after_reduce) == sum(r for _, r in after_reduce)
    assert [(b.status()["bytes_sent"], b.status()["bytes_received"]) for b in group] == after_reduce

    in_threads([lambda b=b: b.broadcast(torch.ones(n), root=0) for b in group])
    after_broadcast = totals()
    assert after_broadcast[0][0] > after_reduce[0][0]  # the root sent the tensor
    assert all(r > r0 for (_, r), (_, r0) in zip(after_broadcast[1:], after_reduce[1:], strict=True))

    epoch = group[0].epoch
    group[0].membership.healthy = False  # a broken ring with everyone alive: a new epoch
    in_threads([lambda b=b: b.recover(epoch) for b in group])
    assert {b.epoch for b in group} == {group[0].epoch} and group[0].epoch > epoch
    assert totals() == after_broadcast  # the rings let go of keep their bytes
    in_threads([lambda b=b: b.all_reduce(torch.ones(n), "sum") for b in group])
    again = totals()
    assert all(s > s0 for (s, _), (s0, _) in zip(again, after_broadcast, strict=True))
    assert sum(s for s, _ in again) == sum(r for _, r in again)

    group[2].close()
    assert group[2].bytes_sent == again[2][0] and group[2].bytes_received == again[2][1]


@pytest.mark.parametrize("interval", [0.5, 2.0])
def test_a_silent_peer_is_probed_backing_off_to_four_probe_intervals(
        interval: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer outside the group that does not answer is asked again after the probe interval,
    doubling per failure up to 4x the interval (as [peer] probe_interval_sec documents),
    whatever the interval: not a fixed number of seconds."""
    port, nobody = free_ports(2)
    backend = start_peer(port, [port, nobody], Identity.generate(), probe_interval_sec=interval)
    try:
        async def unreachable(host: str, port: int, timeout: float = 3.0) -> SwarmError:
            return SwarmError(f"cannot reach {host}:{port}")

        monkeypatch.setattr(backend.control, "probe_detail", unreachable)
        silent = Candidate("f" * 64, "127.0.0.1", nobody, nobody)
        waits = []
        for _ in range(6):
            backend._call(backend._probe_one(silent.peer_id, silent), 10)
            waits.append(backend._probe_next[silent.peer_id] - time.monotonic())
    finally:
        backend.close()
    want = [interval * k for k in (1, 2, 4, 4, 4, 4)]
    assert all(w - 1.0 < got <= w for got, w in zip(waits, want, strict=True)), (waits, want)
