"""Peer-mode partition drills on a simulated LAN: real `swarmtrain peer` processes, faults made
with the namespaces' links and routes, and what each fault cost, read from the peers' status
files. Used by ``tests/test_peer_partitions.py`` (asserts) and
``benchmarks/bench_partitions.py`` (times).

A drill cuts a set of hosts off (a pulled cable, a two-way split, a flapping link, or a
SIGSTOPped process), mends it, and returns a :class:`Recovery`: when the one group of every
peer formed (the merged epoch's state broadcast, on its slowest member), when every peer had
completed a round in it, which state won (the samples of training behind it, against what
each side could have produced) and whether every member loaded the same bytes (the digest).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmtrain.testing.lan import SimulatedLAN
from swarmtrain.testing.procs import LanProcesses

__all__ = ["PeerProcesses", "Recovery", "PEER_TOML"]

#: a fast failure detector for drills: a silent member is lost after 2 s
PEER_TOML = """
[network]
heartbeat_interval_sec = 0.5
heartbeat_timeout_sec = 2.0
propose_timeout_sec = 2.0
ring_timeout_sec = 30.0
reform_timeout_sec = 30.0
"""


@dataclass
class Recovery:
    """What one fault cost. Times in seconds from the mend (the cut ends, or SIGCONT)."""

    scenario: str
    duration: float
    #: the merged epoch, and when its state broadcast finished on its slowest member
    epoch: int
    to_one_epoch: float
    #: when every peer had completed a round in the merged epoch
    to_first_round: float
    #: samples of training behind the state every member loaded at the merge
    merged_work: int
    #: the most work the training side had reported by the mend; the paused side's at the cut
    majority_work: int
    minority_work_at_cut: int
    digests: set[str] = field(default_factory=set)
    #: rounds the minority completed in a group smaller than the majority during the fault
    minority_rounds_alone: int = 0

    @property
    def majority_state_won(self) -> bool:
        return self.merged_work >= self.majority_work > self.minority_work_at_cut

    def row(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "fault_sec": self.duration, "epoch": self.epoch,
                "to_one_epoch_sec": round(self.to_one_epoch, 2),
                "to_first_round_sec": round(self.to_first_round, 2),
                "merged_work": self.merged_work, "majority_work": self.majority_work,
                "minority_work_at_cut": self.minority_work_at_cut,
                "digests_equal": len(self.digests) == 1,
                "minority_rounds_alone": self.minority_rounds_alone}


class PeerProcesses(LanProcesses):
    """`swarmtrain peer` processes named by host index (``"0"``, ``"1"``, ...), one home
    directory (identity) each, on the hosts of a :class:`SimulatedLAN`."""

    def __init__(self, lan: SimulatedLAN, tmp: Path, secret: str = "peer-lan-secret") -> None:
        super().__init__(lan, tmp, {"SWARMTRAIN_SECRET": secret})
        (tmp / "peer.toml").write_text(PEER_TOML)

    def home(self, host: int) -> Path:
        home = self.tmp / f"home{host}"
        home.mkdir(exist_ok=True)
        return home

    def start_peer(self, host: int, *args: str, run: str = "lan-test",
                   env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        return self.start(str(host), host, "peer", "--config", str(self.tmp / "peer.toml"), "--task",
                          "digits", "--run", run, "--threads", "1", "--batch-size", "32", *args,
                          env={"SWARMTRAIN_HOME": str(self.home(host)), **(env or {})})

    def peer_status(self, host: int) -> dict[str, Any] | None:
        return self.status(str(host))

    def wait_peers(self, pred: Callable[[dict[int, dict[str, Any]]], bool], timeout: float, what: str,
                   hosts: list[int]) -> dict[int, dict[str, Any]]:
        sts = self.wait_all([str(h) for h in hosts], lambda s: pred({int(k): v for k, v in s.items()}),
                            timeout, what)
        return {int(k): v for k, v in sts.items()}

    # -- drills ----------------------------------------------------------------------------

    def wait_one_group(self, hosts: list[int], timeout: float, what: str,
                       after_epoch: int = 0) -> dict[int, dict[str, Any]]:
        """Every host in one epoch (above ``after_epoch``) of all of them, each with a round done in it."""
        n = len(hosts)

        def together(s: dict[int, dict[str, Any]]) -> bool:
            epochs = {x["epoch"] for x in s.values()}
            return (len(epochs) == 1 and min(epochs) > after_epoch
                    and all(x["world_size"] == n and x["history"] and x["history"][-1]["epoch"] == x["epoch"]
                            for x in s.values()))
        return self.wait_peers(together, timeout, what, hosts)

    def lowest(self, hosts: list[int]) -> int:
        """The host whose peer has the lowest id (the first leader)."""
        sts = {h: self.peer_status(h) for h in hosts}
        return min(hosts, key=lambda h: sts[h]["peer_id"])  # type: ignore[index]

    def drill(self, scenario: str, hosts: list[int], minority: list[int], *, duration: float,
              fault: Callable[[], None], mend: Callable[[], None], timeout: float = 120.0) -> Recovery:
        """Run one fault of ``duration`` seconds on a group of ``hosts`` that trains as one,
        ``minority`` being the side expected to pause, and measure the recovery."""
        before = self.wait_one_group(hosts, timeout, f"one group before '{scenario}'")
        epoch0 = max(s["epoch"] for s in before.values())
        minority_work = max(before[h]["work"] for h in minority)
        cut_wall = time.time()
        fault()
        time.sleep(duration)
        majority = [h for h in hosts if h not in minority]
        majority_work = max((self.peer_status(h) or {}).get("work", 0) for h in majority)
        mend_wall = time.time()
        mend()
        after = self.wait_one_group(hosts, timeout, f"one group after '{scenario}'", after_epoch=epoch0)
        # the first epoch after the mend with every host in it
        merged = None
        for e in sorted({e["epoch"] for s in after.values() for e in s["events"]
                         if e["event"] == "epoch" and e["members"] == len(hosts) and e["time"] >= mend_wall}):
            evs = [ev for s in after.values() for ev in s["events"]
                   if ev["event"] == "epoch" and ev["epoch"] == e]
            if len(evs) == len(hosts):
                merged = (e, evs)
                break
        assert merged is not None, f"'{scenario}': no epoch of all {len(hosts)} peers after the mend: " + str(
            {h: [ev for ev in s["events"] if ev["event"] == "epoch"][-3:] for h, s in after.items()})
        e, evs = merged
        first_round = max(next(x["time"] for x in s["history"] if x["epoch"] >= e) for s in after.values())
        alone = sum(1 for h in minority for x in after[h]["history"]
                    if cut_wall + 3 < x["time"] < mend_wall and x["world_size"] < len(majority))
        return Recovery(scenario, duration, e, max(ev["time"] for ev in evs) - mend_wall,
                        first_round - mend_wall, evs[0]["work"], majority_work, minority_work,
                        {ev["digest"] for ev in evs}, alone)

    def stop_process(self, host: int) -> None:
        os.killpg(self.procs[str(host)].pid, signal.SIGSTOP)

    def continue_process(self, host: int) -> None:
        os.killpg(self.procs[str(host)].pid, signal.SIGCONT)

    def flap(self, host: int, times: int, down: float, up: float) -> None:
        """Take ``host``'s link down and up ``times`` times (ends up)."""
        h = self.lan.hosts[host]
        for i in range(times):
            h.cut()
            time.sleep(down)
            h.restore()
            if i < times - 1:
                time.sleep(up)
