"""Peer mode through partitions, on a simulated LAN of 4 peers: whichever peer is cut off (the
leader or not), a 2|2 split, a flapping link and a SIGSTOPped process all end in one group
of every peer, with the state of the side that kept training loaded bit for bit everywhere;
a stranger with another secret and the lowest id changes nothing."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.partitions import PeerProcesses, Recovery
from swarmtrain.transport.identity import Identity

pytestmark = [pytest.mark.netns]

ARGS = ("--min-peers", "4", "--mode", "diloco", "--inner-steps", "2", "--wire", "fp32", "--eval-every", "50")


@pytest.fixture
def peers(lan_factory: Callable[..., SimulatedLAN], tmp_path: Path):  # type: ignore[no-untyped-def]
    ps = PeerProcesses(lan_factory(5, rate_mbit=None), tmp_path)
    yield ps
    ps.stop_all()


def _check(r: Recovery, bound: float) -> None:
    print(r)  # the figures, shown with a failure
    assert len(r.digests) == 1, r  # every member loaded the same bytes
    assert r.majority_state_won, r  # and they were the training side's
    assert r.minority_rounds_alone == 0, r  # the cut-off side did not train a copy of its own
    assert r.to_first_round < bound, r  # one group again, training, within the stated bound


# Runs beside other tests (not `serial`): with the conformance file and two busy loops beside it,
# the worst time to one group training again was 4.9 s against the bound of 15 s (quiet: 4.5 s).
@pytest.mark.timeout(420)
def test_every_partition_heals_into_one_group_with_the_training_sides_state(peers: PeerProcesses) -> None:
    hosts = [0, 1, 2, 3]
    for h in hosts:
        peers.lan.hosts[h].set_rate(20)  # rounds of ~0.1 s: history covers the whole drill
        peers.start_peer(h, *ARGS)
    peers.wait_one_group(hosts, 120, "4 peers training")
    lan = peers.lan
    leader = peers.lowest(hosts)
    other = next(h for h in hosts if h != leader)

    # Each fault lasts 4-6x the 2 s heartbeat timeout (so the group re-forms without the
    # missing peers and the probes back off); benchmarks/bench_partitions.py runs the long ones.
    r = peers.drill("non-leader cut 8 s", hosts, [other], duration=8,
                    fault=lan.hosts[other].cut, mend=lan.hosts[other].restore)
    _check(r, 15)
    r = peers.drill("leader cut 8 s", hosts, [leader], duration=8,
                    fault=lan.hosts[leader].cut, mend=lan.hosts[leader].restore)
    _check(r, 15)
    # 2|2: exactly one half goes on, the one holding the lowest id of the group
    low = [leader, next(h for h in hosts if h not in (leader, other))]
    high = [h for h in hosts if h not in low]
    r = peers.drill("2+2 split 10 s", hosts, high, duration=10,
                    fault=lambda: lan.split(low, high), mend=lan.heal)
    _check(r, 15)
    r = peers.drill("link flapping 3x", hosts, [other], duration=0,
                    fault=lambda: peers.flap(other, 3, down=3.0, up=1.5), mend=lambda: None)
    assert len(r.digests) == 1 and r.merged_work >= r.majority_work, r
    assert r.to_first_round < 15, r
    r = peers.drill("SIGSTOP 12 s", hosts, [other], duration=12,
                    fault=lambda: peers.stop_process(other), mend=lambda: peers.continue_process(other))
    _check(r, 15)
    # and the weights are the same on all four after every round since
    sts = {h: peers.peer_status(h) for h in hosts}
    last = min(s["history"][-1]["round"] for s in sts.values() if s)
    sums = {s["history"][i]["checksum"] for s in sts.values() if s
            for i in range(len(s["history"])) if s["history"][i]["round"] == last}
    assert len(sums) == 1, sums
    # found by mDNS alone (no addresses, ranks or world size given), they learnt all along
    acc = max(s["metrics"].get("accuracy", 0.0) for s in sts.values() if s)
    assert acc > 0.9, acc
    # a peer stopped with SIGTERM says goodbye: the others regroup without waiting out its
    # heartbeats and without a warning (a leave is routine)
    peers.procs[str(other)].send_signal(signal.SIGTERM)
    assert peers.procs[str(other)].wait(timeout=20) == 0
    rest = [h for h in hosts if h != other]
    peers.wait_one_group(rest, 30, "the others without the peer that left")
    for h in rest:
        log = (peers.tmp / f"{h}.log").read_text()
        after = log[log.rindex("is leaving"):]
        assert "WARNING" not in after, after


@pytest.mark.timeout(240)
def test_a_stranger_with_another_secret_and_the_lowest_id_changes_nothing(peers: PeerProcesses) -> None:
    # identities made here, so the stranger's is the lowest of all
    pids = {h: Identity.load_or_create(peers.home(h)).peer_id for h in range(4)}
    stranger = min(pids, key=lambda h: pids[h])
    real = [h for h in range(4) if h != stranger]
    peers.start_peer(stranger, "--min-peers", "1", "--mode", "step",
                     env={"SWARMTRAIN_SECRET": "not-the-secret"})
    for h in real:
        peers.start_peer(h, "--min-peers", "3", "--mode", "step", "--max-rounds", "150")
    for h in real:
        peers.procs[str(h)].wait(timeout=150)
    sts = {h: peers.peer_status(h) for h in real}
    for h in real:
        assert peers.procs[str(h)].returncode == 0, peers.logs()
        s = sts[h]
        assert s is not None and s["round"] == 150 and s["world_size"] == 3, s
        assert s["epoch"] == 1, s  # formed once, never disturbed
        assert s["members"] == sorted(pids[x] for x in real)
        assert any(s["unauthenticated"].values()), s  # it was seen, and ignored for failing the handshake
    assert len({sts[h]["checksum"] for h in real}) == 1  # type: ignore[index]
    # the stranger is told why, once per peer that refused it
    log = (peers.tmp / f"{stranger}.log").read_text()
    assert 1 <= log.count("failed authentication") <= 3, log[-3000:]
