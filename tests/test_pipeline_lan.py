"""Pipeline mode on a simulated LAN: stage 0 on h0, two replicas of stage 1 on h1 and h2
(keeping their parameters together), stage 2 on h3, the trainer on h0. The replica of stage
1 in use is SIGKILLed mid-training; the trainer fails over to the other and finishes with no
micro-batch lost or applied twice at the stages that stayed up. Every wait polls a status
file with a deadline."""

from __future__ import annotations

import functools
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.roles.stage import loss_fn_for
from swarmtrain.tasks import Shard, TextLMConfig, TextLMTask
from swarmtrain.tasks.base import seeded_module
from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.pipeline import one_torch_thread
from swarmtrain.testing.procs import LanProcesses

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

MODEL = ("--task", "textlm", "--context", "32", "--d-model", "32", "--n-heads", "2", "--n-layers", "4")
ENV = {"SWARMTRAIN_SECRET": "pipeline-lan-secret"}
MICROBATCHES = 300
#: the trainers' --chunks and --batch-size: a step takes 4 micro-batches of 16 windows
CHUNKS, BATCH = 4, 16
KILL_AFTER = 80
# Pilot (this test, lr 3e-3, 2-core machine, 15:40-15:45 UTC on 2026-12-03): the trainer's
# held-out loss (64 windows) went from 5.56 (untrained, about ln 256) to 2.848, 2.843, 2.870 and
# 2.851 after 300 micro-batches in four runs, with 1-6 resends each; one process on the same
# samples reaches 2.842 (at 160 micro-batches, the other test's length: 3.208).
HELDOUT_LOSS_BELOW = 3.5


class Procs(LanProcesses):
    """The processes of this test, plus how to start a stage server."""

    def launch_stage(self, name: str, host: int, stage: int, *args: str) -> None:
        """Start a stage server on ``host`` (any free port) without waiting for it (a restarted
        stage's status file is removed first, so a wait is for the new process)."""
        self.status_path(name).unlink(missing_ok=True)
        self.start(name, host, "stage", *MODEL, "--stage", str(stage), "--stages", "3", "--seed", "5",
                   "--host", self.lan.hosts[host].address, "--port", "0", "--threads", "1",
                   "--lr", "3e-3", "--checkpoint-dir", str(self.tmp / f"ckpt-{name}"), *args)

    def port(self, name: str) -> int:
        """The port of a launched stage, once it listens."""
        return int(self.wait(name, lambda s: bool(s.get("running")), 60, f"{name} to listen")["port"])

    def start_stage(self, name: str, host: int, stage: int, *args: str) -> int:
        """:meth:`launch_stage`, then its port once it listens."""
        self.launch_stage(name, host, stage, *args)
        return self.port(name)

    def start_route(self, sync: tuple[str, ...], s2_args: tuple[str, ...] = ()) -> tuple[str, dict[str, int]]:
        """Stage 0 on h0, stage 1 on h1 (s1a, with ``sync`` and ``--sync-with`` s1b) and h2
        (s1b), stage 2 on h3 (with ``s2_args``), started side by side (s1a once s1b's port is
        known); the route, and each stage's port by name."""
        hosts = self.lan.hosts
        self.launch_stage("s0", 0, 0)
        self.launch_stage("s1b", 2, 1)
        self.launch_stage("s2", 3, 2, *s2_args)
        p1b = self.port("s1b")
        self.launch_stage("s1a", 1, 1, "--sync-with", f"{hosts[2].address}:{p1b}", *sync)
        ports = {"s0": self.port("s0"), "s1a": self.port("s1a"), "s1b": p1b, "s2": self.port("s2")}
        route = (f"{hosts[0].address}:{ports['s0']};{hosts[1].address}:{ports['s1a']},"
                 f"{hosts[2].address}:{p1b};{hosts[3].address}:{ports['s2']}")
        return route, ports


@pytest.fixture
def procs(lan_factory: Callable[..., SimulatedLAN], tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(lan_factory(4), tmp_path, ENV)
    yield ps
    ps.stop_all()


def test_a_stage_replica_killed_mid_training_the_trainer_fails_over_and_finishes(procs: Procs) -> None:
    # s1a averages with s1b every 2 of its steps (a step is a group of 4 micro-batches); the
    # router's share of groups for each replica varies from run to run
    route, _ = procs.start_route(("--sync-every", "2"))
    trainer = procs.start("trainer", 0, "pipeline", *MODEL, "--route", route, "--microbatches",
                          str(MICROBATCHES), "--batch-size", str(BATCH), "--chunks", str(CHUNKS),
                          "--eval-every", "100", "--seed", "1", "--request-timeout", "20")
    procs.wait("trainer", lambda s: s["done"] >= KILL_AFTER, 120, f"{KILL_AFTER} micro-batches")
    # s1a asks s1b to average every 2 of its own steps: the kill waits for the first averaging,
    # which the end of the test checks happened (the router measures an idle replica again, so
    # s1a is not left without groups after one slow answer; failing fast if the trainer ends)
    procs.wait_all(["s1b", "trainer"], lambda sts: sts["s1b"]["sync_served"] >= 1, 120,
                   "s1a and s1b to average once")
    gone = kill_the_replica_in_use(procs, ("s1a", "s1b"))
    kept = "s1b" if gone == "s1a" else "s1a"
    try:
        rc = trainer.wait(timeout=150)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the trainer did not finish in 150 s\n{procs.logs()}") from None
    assert rc == 0, f"trainer exited {rc}\n{procs.logs()}"

    st = procs.status("trainer")
    assert st is not None and st["state"] == "finished", st
    print(f"held-out loss {st['eval_history']}; resends {st['resends']} (router {st['router_resends']}, "
          f"redone forwards {st['redone_forwards']}); router {st['router']}")
    # every micro-batch trained, and acknowledged exactly once by the stages that stayed up
    assert sorted(mb for mb, _ in st["loss_history"]) == list(range(MICROBATCHES))
    for stage in ("0", "2"):
        assert st["acknowledged"][stage] == [1] * MICROBATCHES, stage
    assert st["acknowledged"]["1"] == [1] * MICROBATCHES  # on h1 or h2, never both
    assert st["resends"] > 0  # the kill was noticed and work went elsewhere
    evals = st["eval_history"]
    assert evals[0][1] > 5.0 and evals[-1][0] == MICROBATCHES
    assert evals[-1][1] < HELDOUT_LOSS_BELOW, evals
    # the yardstick: one process on the same samples at the same batch per step. The run
    # differs by the averaging of stage 1's two replicas (each steps on its own groups) and
    # the kills; within 3 %
    alone = yardstick(st)
    print(f"held-out loss {evals[-1][1]:.4f} through the LAN pipeline, {alone:.4f} in one process")
    assert evals[-1][1] <= alone * 1.03, (evals[-1][1], alone)
    # the surviving stages saw each micro-batch's backward once; h2 served h1's averaging
    for name in ("s0", "s2"):
        s = procs.wait(name, lambda s: s["microbatches"] >= MICROBATCHES, 10, f"{name}'s status")
        assert s["microbatches"] == MICROBATCHES and s["duplicate_backwards"] == 0, s
    survivor = procs.wait(kept, lambda s: True, 10, f"{kept}'s status")
    assert survivor["sync_served"] + survivor["sync_rounds"] >= 1  # the pair averaged before the kill


RESTART_MICROBATCHES = 160
EVAL_EVERY = 32


def kill_the_replica_in_use(procs: Procs, replicas: tuple[str, ...], timeout: float = 60) -> str:
    """SIGKILL the replica (of ``replicas``) that holds the trainer's current group, so the
    trainer must resend or redo work to fail over; its name.

    A group's micro-batches go to one replica of a stage, chosen as the group starts, so which
    one is in use changes from group to group. The trainer is paused (SIGSTOP) while the
    replicas are asked: with nothing new arriving, a status written half a second into the
    pause shows the group where it is (forwards held for their backwards, or gradients not yet
    stepped). Between groups (neither holds any) the trainer goes on and they are asked again.
    """
    trainer = procs.procs["trainer"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trainer.send_signal(signal.SIGSTOP)
        try:
            settled = time.time() + 0.5  # requests already sent are answered by then

            def written_since(sts: dict[str, dict[str, Any]], t: float = settled) -> bool:
                return all(s["time"] > t for s in sts.values())

            sts = procs.wait_all(list(replicas), written_since, 10, "the replicas' status during the pause")
            in_use = [n for n, s in sts.items() if s["pending_forwards"] or s["accumulated"]]
            if len(in_use) == 1:
                procs.procs[in_use[0]].send_signal(signal.SIGKILL)
                procs.procs[in_use[0]].wait(timeout=10)
                return in_use[0]
            assert not in_use, f"two replicas of one stage hold a group: {sts}"
        finally:
            trainer.send_signal(signal.SIGCONT)
        time.sleep(0.3)
    raise AssertionError(f"no replica of {replicas} held a group in {timeout} s\n{procs.logs()}")


@functools.cache
def _one_process_heldout_losses() -> dict[int, float]:
    """:func:`one_process_heldout_loss` at the lengths of this module's runs, from one run."""
    with one_torch_thread():
        task = TextLMTask(TextLMConfig(context=32, d_model=32, n_heads=2, n_layers=4))
        data = task.load_data()
        model = seeded_module(lambda: task.build_model(5), 5)  # as every stage builds it
        loss_fn = loss_fn_for(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        shard = Shard(data.train, 0, 1, seed=1)
        starts = torch.linspace(0, len(data.heldout) - 1, 64).round().long()
        heldout = data.heldout.get_batch(starts)
        losses: dict[int, float] = {}
        for step in range(1, max(MICROBATCHES, RESTART_MICROBATCHES) // CHUNKS + 1):
            model.train()
            x, y = shard.next_batch(BATCH * CHUNKS)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step * CHUNKS in (MICROBATCHES, RESTART_MICROBATCHES):
                model.eval()
                with torch.no_grad():
                    losses[step * CHUNKS] = float(loss_fn(model(heldout[0]), heldout[1]))
        return losses


def yardstick(st: dict[str, Any]) -> float:
    """The one-process held-out loss at the samples of a finished trainer's last evaluation
    (``st``, its status): as many micro-batches as that evaluation came after, and as many
    samples per step."""
    assert st["schedule"] == "sync" and st["samples_per_step"] == BATCH * CHUNKS, st
    at = st["eval_history"][-1][0]
    assert at == st["microbatches"] == len(st["loss_history"]), (at, st["microbatches"])
    return one_process_heldout_loss(at)


def one_process_heldout_loss(microbatches: int) -> float:
    """The model of MODEL (seed 5) trained in one plain process on the trainer's samples (its
    --seed 1 order) for ``microbatches`` micro-batches, at the pipeline's samples per step,
    AdamW lr 3e-3 without decay, the gradient norm clipped to 1.0; its loss on the trainer's
    64 held-out windows. One run serves both tests (computed once, with one torch thread)."""
    return _one_process_heldout_losses()[microbatches]


def test_a_killed_stage_resumes_a_killed_replica_rejoins_and_the_run_goes_on(procs: Procs) -> None:
    """The only replica of stage 2 (checkpointing after every step) is SIGKILLed mid-run and
    restarted with --resume on the same port: the trainer waits for it, the run goes on and
    held-out loss after the restart is no worse than before the kill. A replica of stage 1
    is SIGKILLed and restarted with --sync-with its peer: it copies the peer's weights (equal
    fingerprints) before it serves. A replica built with another seed is refused into the
    route before any training."""
    hosts = procs.lan.hosts
    # another seed's replica of stage 1 (started beside the route's stages)
    procs.launch_stage("s1x", 1, 1, "--seed", "6")
    s2_args = ("--checkpoint-every", "1")
    route, ports = procs.start_route(("--sync-every", "1"), s2_args)
    p1a, p1b, p2 = ports["s1a"], ports["s1b"], ports["s2"]
    sync = ("--sync-with", f"{hosts[2].address}:{p1b}", "--sync-every", "1")
    other = procs.port("s1x")

    # another seed's replica of stage 1: refused before any training, saying why
    refused = procs.start("refused", 0, "pipeline", *MODEL, "--microbatches", "4", "--route",
                          route.replace(f"{hosts[2].address}:{p1b}", f"{hosts[1].address}:{other}"))
    assert refused.wait(timeout=60) != 0
    said = " ".join((procs.tmp / "refused.log").read_text().split())
    assert "different lineages" in said and "Traceback" not in said, said
    procs.procs["s1x"].send_signal(signal.SIGTERM)

    trainer = procs.start("trainer", 0, "pipeline", *MODEL, "--route", route, "--microbatches",
                          str(RESTART_MICROBATCHES), "--batch-size", str(BATCH), "--chunks", str(CHUNKS),
                          "--eval-every", str(EVAL_EVERY), "--seed", "1", "--request-timeout", "20",
                          "--stage-wait", "120")
    st = procs.wait("trainer", lambda s: s["done"] >= 70, 120, "70 micro-batches")
    before_kill = st["eval_history"][-1]
    steps_before = procs.status("s2")["steps"]  # type: ignore[index]
    procs.procs["s2"].send_signal(signal.SIGKILL)
    procs.procs["s2"].wait(timeout=10)
    procs.start_stage("s2", 3, 2, *s2_args, "--resume", "--port", str(p2))
    resumed = procs.wait("s2", lambda s: s.get("running") and s["started_from"].startswith("checkpoint"),
                         60, "stage 2 to resume")
    assert resumed["steps"] >= steps_before - 1  # the newest checkpoint: at most the step in progress

    procs.wait("trainer", lambda s: s["done"] >= 112, 120, "112 micro-batches")
    procs.procs["s1a"].send_signal(signal.SIGKILL)
    procs.procs["s1a"].wait(timeout=10)
    procs.start_stage("s1a", 1, 1, *sync, "--port", str(p1a))
    joined = procs.wait("s1a", lambda s: bool(s.get("running")), 60, "s1a to rejoin")
    assert joined["started_from"] == f"replica {hosts[2].address}:{p1b}", joined["started_from"]
    # (s1a asked at its first start too, when neither had trained: it kept its own then)
    served = procs.wait("s1b", lambda s: s.get("joins_served", 0) >= 2, 10, "s1b's status")
    # the state it serves from is the one its peer had when it copied it
    assert joined["joined"]["fingerprint"] == served["last_join_served"]["fingerprint"], (joined, served)
    assert joined["joined"]["steps"] == served["last_join_served"]["steps"] > 0

    try:
        rc = trainer.wait(timeout=180)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the trainer did not finish in 180 s\n{procs.logs()}") from None
    assert rc == 0, f"trainer exited {rc}\n{procs.logs()}"
    st = procs.status("trainer")
    assert st is not None and st["state"] == "finished", st
    evals = st["eval_history"]
    print(f"held-out loss {evals}; before the kill {before_kill}; lost steps {st['lost_steps']}; "
          f"replayed {st['replayed']}; restarts {st['router']['restarts']}")
    assert sorted(mb for mb, _ in st["loss_history"]) == list(range(RESTART_MICROBATCHES))
    after_kill = [loss for mb, loss in evals if mb > before_kill[0]]
    # no worse than before the kill (within the noise of 64 held-out windows: ~0.05 here)
    assert after_kill and after_kill[0] <= before_kill[1] + 0.05, (before_kill, evals)
    assert evals[-1][1] < HELDOUT_LOSS_BELOW, evals
    # the yardstick: one process on the same samples at the same batch per step. The run
    # differs by the averaging of stage 1's two replicas (each steps on its own groups) and
    # the kills; within 3 %
    alone = yardstick(st)
    print(f"held-out loss {evals[-1][1]:.4f} through the LAN pipeline, {alone:.4f} in one process")
    assert evals[-1][1] <= alone * 1.03, (evals[-1][1], alone)
    restarts = st["router"]["restarts"]
    assert {r["replica"].split("@")[0] for r in restarts} >= {"stage2"}, restarts
    stage2 = [r for r in restarts if r["replica"].startswith("stage2")]
    assert stage2[0]["lost_steps"] <= 1 and st["lost_steps"][2] == stage2[0]["lost_steps"], st["lost_steps"]
