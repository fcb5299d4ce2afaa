"""Training survives workers and the coordinator going away — on a simulated LAN with the
coordinator and each worker on its own host (network namespace)."""

from __future__ import annotations

import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.cluster import LanCluster
from swarmtrain.testing.procs import accuracies_since

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(lan_factory: Callable[..., SimulatedLAN], tmp_path: Path):  # type: ignore[no-untyped-def]
    c = LanCluster(lan_factory(3), tmp_path)
    yield c
    c.stop_all()


#: the workers' first delay between reconnects (doubling to 8x): short, so a worker that lost
#: the coordinator is back soon after it listens again, not up to 4 s later
RECONNECT = ("--reconnect-delay", "0.2")


def _steps(c: LanCluster, name: str) -> Callable[[dict], int]:  # type: ignore[type-arg]
    return lambda st: int(c.worker(st, name)["steps"])


def test_worker_killed_others_carry_on_and_it_rejoins(cluster: LanCluster) -> None:
    c = cluster
    c.start_coordinator("--min-workers", "2", "--checkpoint-interval", "0", wait=False)
    c.start_worker(1, "w1", *RECONNECT)
    c.start_worker(2, "w2", *RECONNECT)
    st = c.wait_for(lambda s: s["version"] > 60, 90, "training to get going")
    c.procs["w1"].send_signal(signal.SIGKILL)
    st = c.wait_for(lambda s: not c.worker(s, "w1")["connected"], 30, "the coordinator to notice w1 died")
    w2_then = _steps(c, "w2")(st)
    assert c.worker(st, "w2")["shards"] == [0, 1]  # w2 took over w1's shard
    st = c.wait_for(lambda s: _steps(c, "w2")(s) > w2_then + 30, 60, "w2 to keep training alone")
    w1_before = _steps(c, "w1")(st)
    c.start_worker(1, "w1", *RECONNECT)
    st = c.wait_for(lambda s: c.worker(s, "w1")["connected"] and _steps(c, "w1")(s) > w1_before + 20,
                    90, "w1 to rejoin and train on")
    assert sorted(c.worker(st, w)["shards"][0] for w in ("w1", "w2")) == [0, 1]  # split again
    assert c.events(st, "first_applied")
    # the new w1 process continued the message ids: none of its gradients was taken for a resend
    assert st["stats"]["duplicates"] == 0


def test_worker_link_cut_for_10s_comes_back_by_itself(cluster: LanCluster) -> None:
    c = cluster
    c.start_coordinator("--min-workers", "2", "--checkpoint-interval", "0", wait=False)
    c.start_worker(1, "w1", *RECONNECT)
    c.start_worker(2, "w2", *RECONNECT)
    c.wait_for(lambda s: s["version"] > 60, 90, "training to get going")
    c.lan.hosts[1].cut()
    cut_at = time.monotonic()
    st = c.wait_for(lambda s: not c.worker(s, "w1")["connected"], 20, "the coordinator to drop w1")
    # the cut left the TCP connection open: the coordinator found w1 silent (its heartbeat
    # timeout), it did not wait for TCP to give up
    left = [e for e in c.events(st, "left") if e.get("worker") == "w1"]
    assert left and "went silent" in left[-1]["reason"], left
    w2_then = _steps(c, "w2")(st)
    time.sleep(max(0.0, 10 - (time.monotonic() - cut_at)))
    st = c.status()
    assert st is not None and _steps(c, "w2")(st) > w2_then  # w2 trained through the outage
    w1_before = _steps(c, "w1")(st)
    c.lan.hosts[1].restore()
    c.wait_for(lambda s: c.worker(s, "w1")["connected"] and _steps(c, "w1")(s) > w1_before + 10, 90,
               "w1 to come back by itself after the link returns")
    assert c.procs["w1"].poll() is None  # the same process, never restarted


def test_coordinator_killed_and_resumed_workers_carry_on_to_target(cluster: LanCluster) -> None:
    c = cluster
    # long enough that the kill lands mid-run: digits runs at several hundred updates/s here
    # and the status file is written once a second (a 700-update run once ended in between);
    # the kill comes after update 200 (at 250-600 in four runs here)
    max_steps = 2000
    args = ("--min-workers", "2", "--checkpoint-interval", "50", "--max-steps", str(max_steps),
            "--checkpoint-dir", str(c.tmp / "ckpt"), "--eval-interval", "0.25",
            "--run-log", str(c.tmp / "coordinator.jsonl"))
    c.start_coordinator(*args, wait=False)
    w1, w2 = c.start_worker(1, "w1", *RECONNECT), c.start_worker(2, "w2", *RECONNECT)
    st = c.wait_for(lambda s: s["version"] >= 200 and c.events(s, "checkpoint"), 120, "200 updates")
    assert c.procs["coordinator"].poll() is None, "the run ended before the kill: raise max_steps"
    c.procs["coordinator"].send_signal(signal.SIGKILL)
    c.procs["coordinator"].wait(timeout=10)
    last = c.status()  # the last status written before the kill (at most 1 s old)
    assert last is not None
    c.start_coordinator(*args, resume=True, wait=False)
    st = c.wait_for(lambda s: bool(c.events(s, "resumed_from_checkpoint")), 30, "the coordinator to resume")
    resumed = c.events(st, "resumed_from_checkpoint")[0]["step"]
    # checkpoints are taken once 50 updates have passed since the last (a few more may land
    # while one is written), so at most about one interval of work is lost
    assert resumed >= last["version"] - 60, (resumed, last["version"])
    assert resumed < max_steps, resumed  # the workers have work left to carry on with
    assert c.procs["coordinator"].wait(timeout=180) == 0
    final = c.status()
    assert final is not None and final["finished"]
    after = accuracies_since(c.tmp / "coordinator.jsonl", after_event="resumed_from_checkpoint")
    print(f"killed at update {last['version']} of {max_steps}, resumed from {resumed}; held-out accuracy "
          f"{final['metrics']['accuracy']:.3f} at the end, {statistics.median(after):.3f} the median of "
          f"{len(after)} evaluations after the resume")
    # Judged on the evaluations since the resume, not the last alone: Adam at digits' rate has
    # loss spikes in one plain process too (8 seeds, batch 32, 2,000 steps, evaluated every 10
    # steps over the second half: medians 0.978-0.983, the lowest single evaluation 0.891), and
    # a run once ended on one (0.900, loss 0.35, where this run's evaluations sit at 0.95-0.99).
    assert len(after) >= 3 and statistics.median(after) > 0.94, after
    for name, proc in (("w1", w1), ("w2", w2)):  # the very same worker processes finished the run
        assert proc.wait(timeout=60) == 0, c.logs()
        assert c.worker(final, name)["steps"] > 0
