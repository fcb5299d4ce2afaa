"""Peer mode on a simulated LAN: peers survive a peer killed mid-all-reduce, take in a late
joiner, ignore other runs (finding each other by mDNS, training together and partitions:
``test_peer_partitions.py``)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.partitions import PeerProcesses as Peers

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]


@pytest.fixture
def peers(lan_factory: Callable[..., SimulatedLAN], tmp_path: Path):  # type: ignore[no-untyped-def]
    ps = Peers(lan_factory(5, rate_mbit=None), tmp_path)
    yield ps
    ps.stop_all()


def test_a_peer_killed_mid_allreduce_the_others_reform_and_go_on(peers: Peers) -> None:
    for h in range(4):
        peers.lan.hosts[h].set_rate(4)  # slow links: most of a round is the all-reduce
        peers.start_peer(h, "--min-peers", "4", "--mode", "diloco", "--inner-steps", "2", "--wire", "fp32")
    peers.wait_peers(lambda s: all(x["round"] >= 5 and x["world_size"] == 4 for x in s.values()), 120,
               "4 peers training", [0, 1, 2, 3])
    victim = 2
    peers.procs[str(victim)].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivors = [0, 1, 3]
    sts = peers.wait_peers(lambda s: all(x["world_size"] == 3 for x in s.values()), 60,
                     "the survivors to agree a 3-member epoch", survivors)
    reformed = time.monotonic() - killed
    at = {h: s["round"] for h, s in sts.items()}
    sts = peers.wait_peers(lambda s: all(s[h]["round"] >= at[h] + 3 for h in s), 90,
                     "training to go on with 3 peers", survivors)
    assert reformed < 20, reformed  # heartbeat timeout 2 s + proposal 2 s + ring set-up, with slack
    broken = [e for s in sts.values() for e in s["events"] if e["event"] == "ring_broken"]
    assert broken and all(e["phase"] in ("connect", "reduce_scatter", "all_gather", "broadcast", "barrier")
                          for e in broken), broken
    # the interrupted round is completed exactly once and no round is skipped or applied twice:
    # each survivor's history (entries name the round just completed) counts up by one, except a
    # round another survivor completed just before the ring broke, which this one then loaded;
    # every survivor that completed a round holds the same weights after it
    interrupted, last_broken = min(e["round"] for e in broken), max(e["round"] for e in broken)
    done: list[dict[int, dict[str, Any]]] = []
    for s in sts.values():
        rounds = [h["round"] for h in s["history"]]
        assert rounds == sorted(set(rounds)) and rounds[0] <= interrupted, rounds
        gaps = sorted(set(range(rounds[0], rounds[-1] + 1)) - set(rounds))
        assert gaps in ([], [interrupted + 1]), (gaps, interrupted)
        done.append({h["round"]: h for h in s["history"]})
    completed = set().union(*done)
    assert set(range(min(completed), max(completed) + 1)) == completed  # no round skipped by all
    for r in completed:
        assert len({d[r]["checksum"] for d in done if r in d}) == 1, r
    assert all(h["world_size"] == 3 for d in done for r, h in d.items() if r > last_broken + 1)
    assert sum(1 for d in done for r in d if r > last_broken + 1) >= 3


def test_a_late_joiner_loads_the_current_state_before_contributing(peers: Peers) -> None:
    args = ("--mode", "diloco", "--inner-steps", "5", "--max-rounds", "250")
    for h in range(4):
        peers.lan.hosts[h].set_rate(10)  # about 0.1 s a round, so the joiner arrives mid-run
    for h in range(3):
        peers.start_peer(h, "--min-peers", "3", *args)
    peers.wait_peers(lambda s: all(x["round"] >= 10 for x in s.values()), 120, "3 peers at round 10",
                     [0, 1, 2])
    peers.start_peer(3, *args)
    peers.join(180)
    sts = {h: peers.peer_status(h) for h in range(4)}
    joiner = sts[3]
    assert joiner is not None
    # alone at first (min-peers 1) it trains by itself; the epoch that merges it into the
    # group starts from the group's state, not from its own, also when the group is between
    # two epochs as the joiner proposes (it may then merge with part of the group first)
    epochs = [e for e in joiner["events"] if e["event"] == "epoch"]
    merged = next(e for e in epochs if e["members"] > 1)
    assert merged["round"] >= 10 and merged["donor"] != joiner["peer_id"], epochs
    first = next(e for e in epochs if e["members"] == 4)
    assert first["round"] >= 10, epochs
    # the group's state, and the group's count of the samples behind it: every member loaded
    # the same bytes (digest) at that epoch
    same = [e for s in sts.values() if s for e in s["events"]
            if e["event"] == "epoch" and e["epoch"] == first["epoch"]]
    assert len(same) == 4 and len({e["digest"] for e in same}) == 1, same
    assert first["work"] >= 10 * 3 * 5 * 32  # 10 rounds of 3 peers, 5 inner steps of 32
    ends = {h: (s["round"], s["epoch"], s["checksum"], s.get("history", [])[-3:])
            for h, s in sts.items() if s}
    assert len({s["checksum"] for s in sts.values() if s}) == 1, ends  # all four end identical


def test_peers_of_another_run_are_not_joined(peers: Peers) -> None:
    for h in range(2):
        peers.start_peer(h, "--min-peers", "2", "--mode", "step", "--max-rounds", "100")
    peers.start_peer(2, "--min-peers", "1", "--mode", "step", "--max-rounds", "100", run="other-run")
    peers.join(180)
    sts = {h: peers.peer_status(h) for h in range(3)}
    assert [sts[h]["world_size"] for h in range(3)] == [2, 2, 1], sts  # type: ignore[index]
    assert set(sts[0]["members"]) == set(sts[1]["members"])  # type: ignore[index]
    assert sts[2]["peer_id"] not in sts[0]["members"]  # type: ignore[index]
