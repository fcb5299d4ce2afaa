"""Peer mode through partitions: how long each fault takes to heal, on a simulated LAN.

Four `swarmtrain peer` processes (digits, DiLoCo with 2 inner steps, fp32 wire), one per
host of a :class:`~swarmtrain.testing.SimulatedLAN` (network namespaces: needs root), every
link at 20 Mbit/s, failure detector as in the tests (heartbeat timeout 2 s). The drills run one
after the other on the same four peers, each from one group of all four:

- **non-leader cut 15 s** / **leader cut 15 s**: the host's bridge port down (a pulled cable);
- **2+2 split 20 s**: unicast between the halves lost in both directions (mDNS still heard);
- **link flapping 5x**: a non-leader's port down 3 s, up 1.5 s, five times;
- **SIGSTOP 30 s**: a non-leader process stopped, then continued.

Per drill (times from the mend): *one epoch* = the merged epoch's state broadcast done on its
slowest member; *first round* = every peer has completed a round in it. *Work* = samples of
training behind a state (identical on every member); the state loaded at the merge must carry
at least what the training side had reached by the mend, and more than the cut-off side had
at the cut (which shows the minority's copy did not win). *Alone* = rounds the cut-off side
completed in a smaller group during the fault (0: it paused).

The floor of *one epoch*: the failure detector (2 s heartbeat timeout) does not enter, since
the clock starts at the mend; a probe interval (1 s), a proposal round trip and the ring set
up do, plus the ring's own timeout where a half-open connection has to expire.

Run: ``python benchmarks/bench_partitions.py`` (about 3 minutes).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import tempfile
import time
from pathlib import Path

from _util import machine, md_table, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmtrain.testing import SimulatedLAN, netns_available
from swarmtrain.testing.partitions import PeerProcesses, Recovery

ARGS = ("--min-peers", "4", "--mode", "diloco", "--inner-steps", "2", "--wire", "fp32", "--eval-every", "50")


def shutdowns(peers: PeerProcesses, hosts: list[int], leaver: int) -> dict[str, float]:
    """SIGTERM one peer (its exit, and the others' first round without it), then the rest
    at once (the slowest exit)."""
    rest = [h for h in hosts if h != leaver]
    t0 = time.monotonic()
    peers.procs[str(leaver)].send_signal(signal.SIGTERM)
    peers.procs[str(leaver)].wait(timeout=60)
    one = time.monotonic() - t0
    peers.wait_one_group(rest, 60, "the others without the one that left")
    regroup = time.monotonic() - t0
    t1 = time.monotonic()
    for h in rest:
        peers.procs[str(h)].send_signal(signal.SIGTERM)
    for h in rest:
        peers.procs[str(h)].wait(timeout=60)
    return {"one_exit_sec": one, "others_regroup_sec": regroup, "all_exit_sec": time.monotonic() - t1}


def drills(peers: PeerProcesses) -> tuple[list[Recovery], dict[str, float]]:
    hosts = [0, 1, 2, 3]
    lan = peers.lan
    for h in hosts:
        lan.hosts[h].set_rate(20)
        peers.start_peer(h, *ARGS)
    peers.wait_one_group(hosts, 120, "4 peers training")
    leader = peers.lowest(hosts)
    other = next(h for h in hosts if h != leader)
    low = [leader, next(h for h in hosts if h not in (leader, other))]
    high = [h for h in hosts if h not in low]
    out = [
        peers.drill("non-leader cut 15 s", hosts, [other], duration=15,
                    fault=lan.hosts[other].cut, mend=lan.hosts[other].restore),
        peers.drill("leader cut 15 s", hosts, [leader], duration=15,
                    fault=lan.hosts[leader].cut, mend=lan.hosts[leader].restore),
        peers.drill("2+2 split 20 s", hosts, high, duration=20,
                    fault=lambda: lan.split(low, high), mend=lan.heal),
        peers.drill("link flapping 5x (3 s down, 1.5 s up)", hosts, [other], duration=0,
                    fault=lambda: peers.flap(other, 5, down=3.0, up=1.5), mend=lambda: None),
        peers.drill("SIGSTOP 30 s", hosts, [other], duration=30,
                    fault=lambda: peers.stop_process(other), mend=lambda: peers.continue_process(other)),
    ]
    stops = shutdowns(peers, hosts, other)
    one, regroup, every = stops["one_exit_sec"], stops["others_regroup_sec"], stops["all_exit_sec"]
    print(f"SIGTERM one peer: exits in {one:.2f} s, the other 3 train together after {regroup:.2f} s; "
          f"SIGTERM the other 3: all exit in {every:.2f} s")
    for r in out:
        print(f"{r.scenario:40s} one epoch {r.to_one_epoch:5.2f} s  first round {r.to_first_round:5.2f} s  "
              f"work {r.merged_work} >= {r.majority_work} > {r.minority_work_at_cut}  "
              f"digests equal {len(r.digests) == 1}  alone {r.minority_rounds_alone}", flush=True)
    return out, stops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="accepted for run_all.py; the drills are already as short as the faults they time")
    ap.parse_args()
    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"needs network namespaces: {why}")
    with tempfile.TemporaryDirectory() as tmp, SimulatedLAN(4) as lan:
        peers = PeerProcesses(lan, Path(tmp))
        try:
            results, stops = drills(peers)
        finally:
            peers.stop_all()
    rows = [[r.scenario, f"{r.duration:g} s" if r.duration else "-", f"{r.to_one_epoch:.2f} s",
             f"{r.to_first_round:.2f} s", r.merged_work, r.majority_work, r.minority_work_at_cut,
             "yes" if len(r.digests) == 1 else "NO", r.minority_rounds_alone,
             "PASS" if r.majority_state_won and len(r.digests) == 1 and not r.minority_rounds_alone
             else "FAIL"]
            for r in results]
    md = (
        "## Peer mode through partitions (`benchmarks/bench_partitions.py`)\n\n"
        "4 peers on a simulated LAN (network namespaces, 20 Mbit/s links), digits, DiLoCo (2 inner "
        "steps), heartbeat timeout 2 s; the drills run one after another on the same peers. Times "
        "from the mend: *one epoch* = the merged epoch's state loaded on its slowest member, "
        "*first round* = every peer has completed a round in it. Work = samples of training behind "
        "the state: the merged state's must be >= what the training side had by the mend and > the "
        "cut-off side's at the cut. *Alone* = rounds the cut-off side trained in a smaller group "
        "during the fault (0 = it paused, as the quorum rule says).\n\n"
        + md_table(["fault", "length", "one epoch", "first round", "merged work", "training side",
                    "cut-off side at cut", "digests equal", "alone", "majority state"], rows)
        + "\n\nWorst time to the first round of one group: "
        f"**{max(r.to_first_round for r in results):.2f} s** "
        "(the tests assert < 15 s).\n\n"
        f"SIGTERM: a peer exits in {stops['one_exit_sec']:.2f} s (it says goodbye, so the others "
        "do not wait out a heartbeat timeout: they train as one group again "
        f"{stops['others_regroup_sec']:.2f} s after the signal); the other three, signalled together, "
        f"all exit within {stops['all_exit_sec']:.2f} s.\n")
    data = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "results": [r.row() for r in results], "sigterm": stops}
    j, m = write_results("partitions", data, md)
    print(md)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
