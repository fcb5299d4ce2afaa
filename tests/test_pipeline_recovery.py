"""Pipeline mode keeps what it learned when stages and replicas die and come back.

- A synchronous step whose micro-batches are not all on the stage (a restarted stage, a
  replica that took some of them and died) is put off and completed by giving the stage
  the missing ones again: the result equals an uninterrupted run.
- A group's micro-batches go to one replica of each stage.
- The only replica of a stage killed mid-step and restarted from its last state: the run
  goes on, and ends where an uninterrupted run ends.
- A replica that joins copies a live one's whole state before serving; replicas of another
  seed or shape are refused into a route; a replica that comes back with its seed's
  weights is not routed to; a ban is lifted as soon as the replica answers again.

Real stage servers on loopback, real TCP; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from swarmtrain.app.pipeline_session import checked_router
from swarmtrain.errors import SwarmError
from swarmtrain.roles.stage import (
    ComputeConfig,
    PipelineTrainer,
    Router,
    RouterConfig,
    StageServer,
    StageServerConfig,
    TrainerConfig,
    build_stage,
)
from swarmtrain.roles.stage.compute import StageCompute, StateMismatch
from swarmtrain.roles.stage.replicas import sync_fractions
from swarmtrain.roles.stage.router import StageUnavailable
from swarmtrain.tasks import TextLMConfig, TextLMTask
from swarmtrain.testing.pipeline import FAST_TIMEOUTS, run_bounded

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SECRET = b"pipeline-recovery-secret"
TASK = TextLMTask(TextLMConfig(context=16, d_model=16, n_heads=2, n_layers=2))
SEED = 3
FAST = FAST_TIMEOUTS
RANGES = [(0, 2), (2, 3), (3, 4)]  # embedding + block 0 | block 1 | head


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 90.0) -> Any:
    return run_bounded(coro, timeout)


@pytest.fixture(scope="module")
def data() -> Any:
    return TASK.load_data()



def _compute(stage: int = 1, seed: int = SEED) -> StageCompute:
    layers, loss_fn = build_stage(TASK.build_model, seed, *RANGES[stage])
    return StageCompute(layers, is_first=stage == 0, loss_fn=loss_fn if stage == 2 else None,
                        config=ComputeConfig(learning_rate=3e-3))


def _server(stage: int, *, seed: int = SEED, port: int = 0, name: str = "", task: TextLMTask = TASK,
            sync_peers: list[tuple[str, int]] | None = None) -> StageServer:
    layers, loss_fn = build_stage(task.build_model, seed, *RANGES[stage])
    return StageServer(layers, stage=stage, layer_range=RANGES[stage],
                       loss_fn=loss_fn if stage == 2 else None,
                       compute=ComputeConfig(learning_rate=3e-3, grad_clip=0.0),
                       config=StageServerConfig(port=port, timeouts=FAST), secret=SECRET,
                       name=name or f"s{stage}", sync_peers=sync_peers or [])


# --- the step of a group, at one stage ------------------------------------------------------


def test_a_step_missing_some_of_its_group_is_put_off_until_they_are_given_again() -> None:
    """A middle stage restarted in the middle of a group (its state as of the last step: the
    gradients summed since are gone) does not step on the half it has: it names the missing
    micro-batches, and once they are given again the step equals the uninterrupted one."""
    torch.manual_seed(0)
    xs = [torch.randn(2, 16, 16) for _ in range(8)]
    gs = [torch.randn(2, 16, 16) for _ in range(8)]
    ref, live = _compute(), _compute()
    for c in (ref, live):  # one whole group first, so the restart is after a step
        for mb in range(4):
            c.forward("s", mb, xs[mb], None)
            c.backward("s", mb, gs[mb], step=mb == 3, group=(0, 4))
        assert c.step_group("s", (0, 4)) == () and c.steps == 1
    for mb in range(4, 8):
        ref.forward("s", mb, xs[mb], None)
        out = ref.backward("s", mb, gs[mb], step=mb == 7, group=(4, 4))
        assert out.missing == () and (out.grad_sq is not None) == (mb == 7)
    assert ref.step_group("s", (4, 4)) == ()
    for mb in (4, 5):
        live.forward("s", mb, xs[mb], None)
        live.backward("s", mb, gs[mb], step=False, group=(4, 4))
    saved = live.export_state()
    restarted = _compute()
    restarted.import_state(*saved)
    for mb in (6, 7):
        restarted.forward("s", mb, xs[mb], None)
    assert restarted.backward("s", 6, gs[6], step=False, group=(4, 4)).missing == ()
    put_off = restarted.backward("s", 7, gs[7], step=True, group=(4, 4))
    assert put_off.missing == (4, 5) and put_off.grad_sq is None  # no norm of half a group
    assert restarted.step_group("s", (4, 4)) == (4, 5) and restarted.steps == 1  # nor a step
    # the group's last request again (its answer was lost, say) still says so
    assert restarted.backward("s", 7, gs[7], step=True, group=(4, 4)).missing == (4, 5)
    for mb in (4, 5):
        restarted.forward("s", mb, xs[mb], None)
    assert restarted.backward("s", 4, gs[4], step=False, group=(4, 4)).missing == ()
    whole = restarted.backward("s", 5, gs[5], step=True, group=(4, 4))
    assert whole.missing == () and whole.grad_sq is not None and whole.grad_sq > 0
    assert restarted.step_group("s", (4, 4)) == ()
    assert restarted.steps == ref.steps == 2
    for (n, a), b in zip(ref.weights.synced().items(), restarted.weights.synced().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)  # the sums in another order
    # a step repeated after the step: nothing again, nothing missing
    assert restarted.step_group("s", (4, 4)) == () and restarted.steps == 2


def test_sums_of_a_group_whose_step_was_taken_elsewhere_are_dropped() -> None:
    """A replica that applied part of a group before the group moved to another replica
    must not carry those gradients into its next step."""
    torch.manual_seed(1)
    xs = [torch.randn(2, 16, 16) for _ in range(5)]
    gs = [torch.randn(2, 16, 16) for _ in range(5)]
    stray, clean = _compute(), _compute()
    stray.forward("s", 0, xs[0], None)
    stray.backward("s", 0, gs[0], step=False, group=(0, 4))  # the rest of 0-3 went elsewhere
    for c in (stray, clean):
        for mb in range(1, 5):
            c.forward("s", mb + 3, xs[mb], None)
            c.backward("s", mb + 3, gs[mb], step=mb == 4, group=(4, 4))
        assert c.step_group("s", (4, 4)) == ()
    assert stray.dropped_microbatches == 1 and stray.steps == clean.steps == 1
    assert stray.fingerprint() == clean.fingerprint()


# --- through the trainer ---------------------------------------------------------------------


def test_a_groups_microbatches_go_to_one_replica_of_each_stage(data: Any) -> None:
    """With two replicas of the middle stage, every group is applied on one of them: a group
    split over both would step each on part of its samples."""
    async def main() -> PipelineTrainer:
        servers = [_server(0), _server(1, name="s1a"), _server(1, name="s1b"), _server(2)]
        for srv in servers:
            await srv.start()
        route = [[servers[0].address], [servers[1].address, servers[2].address], [servers[3].address]]
        router = Router(route, secret=SECRET, config=RouterConfig(timeouts=FAST))
        try:
            trainer = PipelineTrainer(router, data.train, TrainerConfig(batch_size=4, chunks=4, seed=2))
            await trainer.train(48)
            assert [servers[1].compute.steps + servers[2].compute.steps] == [12]
            assert servers[1].compute.incomplete_steps + servers[2].compute.incomplete_steps == 0
            return trainer
        finally:
            await router.close()
            for srv in servers:
                await srv.close()

    trainer = _run(main())
    for first in range(0, 48, 4):
        assert len({trainer.acknowledged_by[(1, mb)] for mb in range(first, first + 4)}) == 1, first
    assert trainer.replayed == 0


def test_the_only_replica_of_a_stage_killed_mid_step_and_restarted_the_run_ends_as_if_it_had_not(
        data: Any) -> None:
    """Stage 2 (no replica) keeps its state after every step (as `--checkpoint-every 1`
    does), is killed in the middle of a group and restarted from it on the same port. The
    trainer waits for it, gives it the group's micro-batches it lost, and the run ends with
    the weights of an uninterrupted run (up to the order of float sums)."""
    groups, chunks = 8, 4

    async def run(kill_at: int | None) -> tuple[list[str], list[torch.Tensor], PipelineTrainer]:
        servers = [_server(i) for i in range(3)]
        for srv in servers:
            await srv.start()
        saved: list[Any] = []
        saves: list[asyncio.Future[None]] = []
        restarts: list[asyncio.Future[None]] = []

        def keep(_steps: int) -> None:
            async def save(srv: StageServer) -> None:
                saved.append(await srv.export_state())
            saves.append(asyncio.ensure_future(save(servers[2])))

        servers[2].on_step(keep)
        router = Router([[s.address] for s in servers], secret=SECRET,
                        config=RouterConfig(timeouts=FAST, ban_base=1.0, probe_interval=0.2,
                                            wait_for_replica=60.0, request_timeout=20.0))

        async def restart() -> None:
            old = servers[2]
            port = old.port
            await old.kill()
            await asyncio.gather(*saves, return_exceptions=True)  # the last state kept before the kill
            new = _server(2, port=port, name="s2-restarted")
            await new.import_state(*saved[-1], source="checkpoint (test)")
            await new.start()
            servers[2] = new

        class Trainer(PipelineTrainer):
            def _acknowledge(self, stage: int, mb: int, replica: Any) -> None:
                super()._acknowledge(stage, mb, replica)
                if (stage, mb) == (2, kill_at) and not restarts:  # its sums now hold part of a group
                    restarts.append(asyncio.ensure_future(restart()))

        trainer = Trainer(router, data.train, TrainerConfig(batch_size=4, chunks=chunks, seed=4))
        try:
            await trainer.train(groups * chunks)
            await asyncio.gather(*restarts)
            params = [p.detach().clone() for s in servers for p in s.compute.layers.parameters()]
            return [s.compute.fingerprint() for s in servers], params, trainer
        finally:
            await router.close()
            for srv in servers:
                await srv.close()

    _, whole, _ = _run(run(None))
    _, resumed, trainer = _run(run(kill_at=3 * chunks + 1))  # once it applied two of group 3
    log = trainer.router.restart_log
    assert len(log) == 1 and log[0]["lost_steps"] == 0, log
    assert trainer.replayed >= 2  # micro-batches 12 and 13 given to it again
    assert trainer.acknowledged[(2, 3 * chunks)] >= 1
    assert sorted(mb for mb, _ in trainer.loss_history) == list(range(groups * chunks))
    gap = max(float((a - b).abs().max()) for a, b in zip(whole, resumed, strict=True))
    assert gap < 1e-5, gap


# --- joining, refusing, bans ----------------------------------------------------------------


def test_a_replica_that_joins_copies_the_whole_state_of_a_live_one_before_serving() -> None:
    torch.manual_seed(2)
    x, g = torch.randn(2, 16, 16), torch.randn(2, 16, 16)

    async def main() -> None:
        live = _server(1, name="live")
        await live.start()
        try:
            for mb in range(3):
                live.compute.forward("s", mb, x, None)
                live.compute.backward("s", mb, g * (mb + 1), step=True)
            joiner = _server(1, seed=SEED + 1, name="joiner", sync_peers=[live.address])
            assert joiner.compute.fingerprint() != live.compute.fingerprint()
            assert await joiner.join() is not None
            st = joiner.status()
            assert st["fingerprint"] == live.compute.fingerprint() and st["steps"] == 3
            assert st["origin"] == live.compute.origin and st["started_from"].startswith("replica")
            assert live.status()["joins_served"] == 1
            # the optimizer state came along: one more identical step keeps them identical
            for c in (live.compute, joiner.compute):
                c.forward("s", 9, x, None)
                c.backward("s", 9, g, step=True)
            assert joiner.compute.fingerprint() == live.compute.fingerprint()
            # a replica of another model shape cannot join it
            wide = TextLMTask(TextLMConfig(context=16, d_model=32, n_heads=2, n_layers=2))
            other = _server(1, task=wide, name="wide", sync_peers=[live.address])
            with pytest.raises(StateMismatch, match="another"):
                await other.join()
            await other.close()
            await joiner.close()
        finally:
            await live.close()

    _run(main())


def test_the_route_refuses_replicas_of_another_seed_or_shape() -> None:
    async def main() -> None:
        wide = TextLMTask(TextLMConfig(context=16, d_model=32, n_heads=2, n_layers=2))
        servers = [_server(0), _server(1, name="a"), _server(1, seed=SEED + 1, name="b"), _server(2),
                   _server(1, task=wide, name="wide")]
        for srv in servers:
            await srv.start()
        s0, a, b, s2, w = (srv.address for srv in servers)
        try:
            with pytest.raises(SwarmError, match="different lineages"):
                await checked_router(TASK, [[s0], [a, b], [s2]], secret=SECRET, tls=None)
            with pytest.raises(SwarmError, match="another shape"):
                await checked_router(TASK, [[s0], [w], [s2]], secret=SECRET, tls=None)
            router = await checked_router(TASK, [[s0], [a], [s2]], secret=SECRET, tls=None)
            await router.close()
        finally:
            for srv in servers:
                await srv.close()

    _run(main())


def test_a_ban_is_lifted_as_soon_as_the_replica_answers_and_seed_weights_are_not_served(data: Any) -> None:
    """A killed stage is banned for long (30 s); restarted from its state it is used again
    as soon as a probe reaches it, well before the ban would end. Restarted with its seed's
    weights after the stage had trained, it is not routed to, and the request says why."""
    async def main() -> None:
        servers = [_server(i) for i in range(3)]
        for srv in servers:
            await srv.start()
        cfg = RouterConfig(timeouts=FAST, ban_base=30.0, ban_cap=30.0, probe_interval=0.2,
                           wait_for_replica=20.0)
        route = [[s.address] for s in servers]
        router = await checked_router(TASK, route, secret=SECRET, tls=None, config=cfg)
        trainer = PipelineTrainer(router, data.train, TrainerConfig(batch_size=4, chunks=2, seed=5))
        try:
            await trainer.train(4)
            port = servers[2].port
            saved = await servers[2].export_state()
            await servers[2].kill()
            impatient = Router(route, secret=SECRET, config=RouterConfig(timeouts=FAST, wait_for_replica=0.5,
                                                                         probe_interval=0.1))
            with pytest.raises(StageUnavailable, match="within 0.5 s"):  # waits, then gives up
                await impatient.infer(2, "g", torch.randn(1, 16, 16))
            await impatient.close()
            back = _server(2, port=port, name="back")
            await back.import_state(*saved, source="checkpoint (test)")

            async def later() -> None:
                await asyncio.sleep(1.0)
                await back.start()

            starting = asyncio.ensure_future(later())
            await trainer.train(2)  # stage 2's first request fails (banned 30 s), then waits
            await starting
            replica = router.replicas[2][0]
            assert router.bans_lifted >= 1 and replica.banned_until <= time.monotonic()
            assert router.stats()["replicas"][replica.name]["restarts"] == 1
            await back.kill()
            fresh = _server(2, port=port, name="fresh")  # the seed's weights, nothing trained
            await fresh.start()
            router.config = RouterConfig(timeouts=FAST, ban_base=0.5, probe_interval=0.2,
                                         wait_for_replica=2.0)
            with pytest.raises(StageUnavailable, match="seed's weights"):
                await router.infer(2, "g", torch.randn(1, 16, 16))
            await fresh.close()
        finally:
            await router.close()
            for srv in servers[:2]:
                await srv.close()

    _run(main())


def test_a_standby_replica_takes_the_trained_ones_weights_instead_of_averaging_them_away() -> None:
    """Under the synchronous schedule one replica of a stage trains and the other stands by.
    A sync round must give the standby the trained weights (and step count), not move both
    halfway back towards the standby's stale ones; two replicas that both trained average."""
    torch.manual_seed(4)
    x, g = torch.randn(2, 16, 16), torch.randn(2, 16, 16)

    async def main() -> None:
        standby = _server(1, name="standby")
        await standby.start()
        active = _server(1, name="active", sync_peers=[standby.address])
        await active.start()
        try:
            for mb in range(3):
                active.compute.forward("s", mb, x, None)
                active.compute.backward("s", mb, g * (mb + 1), step=True)
            trained = active.compute.fingerprint()
            assert await active.sync_now() == 1
            assert active.compute.fingerprint() == trained == standby.compute.fingerprint()
            assert standby.compute.steps == active.compute.steps == 3
            # now both train (the asynchronous schedule spreads work): they average
            for c in (active.compute, standby.compute):
                c.forward("s", 7, x, None)
                c.backward("s", 7, g if c is active.compute else -g, step=True)
            a, b = active.compute.parameters_snapshot(), standby.compute.parameters_snapshot()
            assert await active.sync_now() == 1
            after = active.compute.parameters_snapshot()
            other = standby.compute.parameters_snapshot()
            for n in a:  # (each at the mean, up to its rounding: not bit for bit)
                torch.testing.assert_close(after[n], (a[n] + b[n]) / 2, rtol=0, atol=1e-7)
                torch.testing.assert_close(other[n], after[n], rtol=0, atol=1e-7)
        finally:
            await active.close()
            await standby.close()

    _run(main())


def test_sync_fractions() -> None:
    assert sync_fractions(0, 3) == (1.0, 0.0) and sync_fractions(3, 0) == (0.0, 1.0)
    assert sync_fractions(2, 3) == sync_fractions(0, 0) == sync_fractions(5, None) == (0.5, 0.5)
