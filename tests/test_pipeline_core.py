"""Pipeline mode, part 2: layers sharded over stage servers, replicas with failover.

Pure pieces first (partition, stage planning, a stage's arithmetic), then stage servers in
this process over real loopback TCP (port 0): replica parameter sync, training a small
TextLM through three stages with two replicas of the middle one (one killed mid-training),
generation while training runs, and refusal of malformed or unauthenticated input.
Nothing waits on wall-clock sleeps: progress is observed through events and counters, and
every async scenario runs under ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from torch import nn

from swarmtrain.errors import AuthError, ConfigError
from swarmtrain.roles.stage import (
    BadInput,
    ComputeConfig,
    LayerCost,
    NodeSpec,
    PipelineTrainer,
    Priority,
    Router,
    RouterConfig,
    StageCompute,
    StageServer,
    StageServerConfig,
    StageUnavailable,
    TrainerConfig,
    UnknownMicrobatch,
    build_stage,
    estimate_layer_costs,
    loss_fn_for,
    plan_stages,
    split_layers,
)
from swarmtrain.tasks import DigitsTask, Shard, TextLMConfig, TextLMTask
from swarmtrain.testing.fuzz_engine import dead_port
from swarmtrain.testing.pipeline import FAST_TIMEOUTS, run_bounded
from swarmtrain.transport import connect
from swarmtrain.wire import (
    PREAMBLE,
    Error,
    Message,
    Register,
    StageBackward,
    StageError,
    StageForward,
    StageGrad,
    StageInfer,
    StageResult,
    Status,
    StatusRequest,
)

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("one_torch_thread")]

SECRET = b"pipeline-core-secret"
TASK = TextLMTask(TextLMConfig(context=32, d_model=32, n_heads=2, n_layers=4))
SEED = 7
FAST = FAST_TIMEOUTS


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return run_bounded(coro, timeout)


@pytest.fixture(scope="module")
def data() -> Any:
    return TASK.load_data()



# --- partition and planning (pure) ---------------------------------------------------------


def test_textlm_stages_reproduce_the_full_model(data: Any) -> None:
    model = TASK.build_model(SEED)
    model.eval()
    inputs, _ = data.train.get_batch(torch.arange(0, 40, 10))
    want = model(inputs)
    layers = split_layers(model)
    assert len(layers) == TASK.config.n_layers + 2
    assert torch.equal(nn.Sequential(*layers)(inputs), want)
    # stages built independently (as replicas on other machines do) compose to the same model
    x = inputs
    for start, stop in [(0, 2), (2, 5), (5, 6)]:
        stage, _ = build_stage(TASK.build_model, SEED, start, stop)
        stage.eval()
        x = stage(x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    # a replica of the middle stage is bit-identical to the first build
    a, _ = build_stage(TASK.build_model, SEED, 2, 5)
    b, _ = build_stage(TASK.build_model, SEED, 2, 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_sequential_models_split_into_their_children() -> None:
    digits = DigitsTask()
    model = digits.build_model(3)
    layers = split_layers(model)
    assert layers == list(model.children())
    x = torch.randn(5, 64)
    front, _ = build_stage(digits.build_model, 3, 0, 2)
    back, loss_fn = build_stage(digits.build_model, 3, 2, len(layers))
    torch.testing.assert_close(back(front(x)), model(x), rtol=0, atol=0)
    assert float(loss_fn(model(x), torch.zeros(5, dtype=torch.long)).detach()) > 0
    with pytest.raises(ConfigError, match="nn.Sequential"):
        split_layers(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="not within"):
        build_stage(digits.build_model, 3, 2, 99)


def test_plan_stages_balances_speed_within_memory() -> None:
    mb = 2**20
    costs = [LayerCost(compute=1.0, memory_bytes=mb)] * 8
    # equal nodes: equal shares
    assert plan_stages(costs, [NodeSpec(f"n{i}", 1.0, 100 * mb) for i in range(4)]) == [
        (0, 2), (2, 4), (4, 6), (6, 8)]
    # a node twice as fast takes twice the layers
    assert plan_stages(costs, [NodeSpec("slow", 1.0, 100 * mb), NodeSpec("fast", 2.0, 100 * mb),
                               NodeSpec("slow2", 1.0, 100 * mb)]) == [(0, 2), (2, 6), (6, 8)]
    # ... unless its memory holds fewer (the slowest stage then takes 3; ties give earlier
    # nodes fewer layers)
    assert plan_stages(costs, [NodeSpec("slow", 1.0, 100 * mb), NodeSpec("fast", 2.0, 3 * mb),
                               NodeSpec("slow2", 1.0, 100 * mb)]) == [(0, 2), (2, 5), (5, 8)]
    with pytest.raises(ConfigError, match=r"does not fit.*8\.0 MiB"):
        plan_stages(costs, [NodeSpec("a", 1.0, 3 * mb), NodeSpec("b", 1.0, 3 * mb)])
    with pytest.raises(ConfigError, match="only 8 layers"):
        plan_stages(costs, [NodeSpec(f"n{i}", 1.0, mb) for i in range(9)])
    with pytest.raises(ConfigError, match="speed"):
        NodeSpec("x", 0.0, mb)
    # real TextLM costs: the embedding is memory but little compute, the blocks dominate
    est = estimate_layer_costs(split_layers(TASK.build_model(SEED)))
    assert est[0].compute < est[1].compute and est[0].memory_bytes > 0
    ranges = plan_stages(est, [NodeSpec(f"n{i}", 1.0, 10 * mb) for i in range(3)])
    assert ranges[0][0] == 0 and ranges[-1][1] == len(est)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_stage_compute_applies_each_backward_once(data: Any) -> None:
    layers, _ = build_stage(TASK.build_model, SEED, 1, 3)
    c = StageCompute(layers, is_first=False, loss_fn=None,
                     config=ComputeConfig(learning_rate=1e-2, accumulate=2, cache_size=2))
    x = torch.randn(2, 8, 32)
    y = c.forward("s", 0, x, None).y
    assert y is not None and y.shape == x.shape
    again = c.forward("s", 0, x, None)
    assert again.cached and again.y is not None and torch.equal(again.y, y)
    before = c.parameters_snapshot()
    g = c.backward("s", 0, torch.ones_like(y))
    assert g.done and not g.cached and g.grad is not None and g.grad.shape == x.shape
    assert c.steps == 0 and c.microbatches == 1  # accumulate=2: no step yet
    dup = c.backward("s", 0, torch.ones_like(y))
    assert dup.cached and dup.grad is not None and torch.equal(dup.grad, g.grad)
    assert c.microbatches == 1 and c.duplicate_backwards == 1
    assert c.forward("s", 0, x, None).done  # a forward of an applied micro-batch says so
    with pytest.raises(UnknownMicrobatch):
        c.backward("s", 1, torch.ones_like(y))
    for mb in (1, 2, 3):  # cache_size=2: the forward of micro-batch 1 is evicted
        c.forward("s", mb, x, None)
    assert c.evictions == 1
    with pytest.raises(UnknownMicrobatch):
        c.backward("s", 1, torch.ones_like(y))
    c.backward("s", 2, torch.ones_like(y))
    assert c.steps == 1 and not all(torch.equal(before[n], p) for n, p in c.parameters_snapshot().items())
    with pytest.raises(BadInput, match="shape"):
        c.backward("s", 3, torch.ones(3))
    with pytest.raises(BadInput, match="NaN"):
        c.backward("s", 3, torch.full_like(y, float("nan")))
    with pytest.raises(BadInput, match="float"):
        c.forward("s", 9, torch.ones(2, 8, 32, dtype=torch.int64), None)


def test_a_backward_after_a_step_differentiates_the_weights_its_forward_used() -> None:
    """Weight stashing: micro-batch 1's forward ran before micro-batch 0's backward stepped
    the optimizer; its backward must give the gradients of the function its forward computed
    (the input gradient sent upstream and the parameter gradient), not those at the new
    weights, and the stashed copy goes once nothing needs it."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    original = copy.deepcopy(layers)
    c = StageCompute(layers, is_first=False, loss_fn=None,
                     config=ComputeConfig(learning_rate=0.1, weight_decay=0.0, grad_clip=0.0))
    x0, x1, g = torch.randn(3, 6), torch.randn(3, 6), torch.randn(3, 6)
    c.forward("s", 0, x0, None)
    c.forward("s", 1, x1, None)  # on version 0, like micro-batch 0
    c.backward("s", 0, g)  # steps: version 1
    assert c.steps == 1 and c.status()["stashed_versions"] == 1
    after_step = [p.detach().clone() for p in layers.parameters()]
    got = c.backward("s", 1, g).grad
    # the reference: micro-batch 1's backward on the weights its forward used
    leaf = x1.clone().requires_grad_(True)
    original(leaf).backward(g)
    assert got is not None and leaf.grad is not None
    assert torch.allclose(got, leaf.grad, atol=1e-6), (got - leaf.grad).abs().max()
    # and on the new weights it would have been something else (the test can tell them apart)
    leaf2 = x1.clone().requires_grad_(True)
    moved = copy.deepcopy(original)
    with torch.no_grad():
        for p, q in zip(moved.parameters(), after_step, strict=True):
            p.copy_(q)
    moved(leaf2).backward(g)
    assert leaf2.grad is not None and not torch.allclose(got, leaf2.grad, atol=1e-4)
    assert c.stashed_backwards == 1 and c.status()["stashed_versions"] == 0
    # the step after micro-batch 1 was taken from the current weights, not the stashed ones
    for p, q in zip(layers.parameters(), after_step, strict=True):
        assert not torch.equal(p, q)


# --- stage servers over loopback ---------------------------------------------------------


def _server(start: int, stop: int, stage: int, *, last: bool = False, seed: int = SEED,
            sync_peers: list[tuple[str, int]] | None = None, name: str = "", lr: float = 3e-3,
            sync_every: int = 0, secret: bytes = SECRET, **config: Any) -> StageServer:
    layers, loss_fn = build_stage(TASK.build_model, seed, start, stop)
    return StageServer(layers, stage=stage, layer_range=(start, stop), loss_fn=loss_fn if last else None,
                       compute=ComputeConfig(learning_rate=lr),
                       config=StageServerConfig(timeouts=FAST, sync_every=sync_every, **config),
                       secret=secret, sync_peers=sync_peers or [], name=name)


def test_the_synchronous_schedule_trains_three_stages_as_one_process_at_the_groups_batch(data: Any) -> None:
    """The default schedule: 12 steps of 4 chunks of 8 through three stages give the weights
    one process gets from 12 AdamW steps of 32 on the same samples, the whole model's
    gradient norm clipped to 0.5 (up to float summation order), and each stage stepped once
    per group. The asynchronous schedule at 4 in flight,
    on the same samples, does not (so the comparison can tell them apart)."""
    steps, chunks, micro, lr, clip = 12, 4, 8, 3e-3, 0.5
    norms: list[float] = []  # the whole model's gradient norm at each synchronous step
    ranges = [(0, 2), (2, 4), (4, 6)]

    def servers() -> list[StageServer]:
        out = []
        for i, (a, b) in enumerate(ranges):
            layers, loss_fn = build_stage(TASK.build_model, SEED, a, b)
            out.append(StageServer(layers, stage=i, layer_range=(a, b), loss_fn=loss_fn if i == 2 else None,
                                   compute=ComputeConfig(learning_rate=lr, weight_decay=0.0, grad_clip=0.0),
                                   config=StageServerConfig(timeouts=FAST), secret=SECRET, name=f"q{i}"))
        return out

    def pipeline(schedule: str) -> tuple[list[torch.Tensor], list[int]]:
        stages = servers()

        async def main() -> None:
            for srv in stages:
                await srv.start()
            router = Router([[srv.address] for srv in stages], secret=SECRET,
                            config=RouterConfig(timeouts=FAST))
            try:
                trainer = PipelineTrainer(router, data.train, TrainerConfig(
                    batch_size=micro, schedule=schedule, chunks=chunks, max_inflight=chunks, seed=1,
                    grad_clip=clip))
                assert len(await trainer.train(steps * chunks)) == steps * chunks
                norms.extend(trainer.grad_norms)
            finally:
                await router.close()
                for srv in stages:
                    await srv.close()

        _run(main())
        params = [p.detach().clone() for srv in stages for p in srv.compute.layers.parameters()]
        return params, [srv.compute.steps for srv in stages]

    model = TASK.build_model(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    shard = Shard(data.train, 0, 1, seed=1)
    loss_fn = loss_fn_for(model)
    for _ in range(steps):
        x, y = shard.next_batch(micro * chunks)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # the whole model's norm
        opt.step()
    alone = [p.detach() for layer in split_layers(model) for p in layer.parameters()]

    synced, sync_steps = pipeline("sync")
    assert sync_steps == [steps] * 3
    assert len(norms) == steps and sum(n > clip for n in norms) >= steps // 2, norms  # it clipped
    gap = max(float((a - b).abs().max()) for a, b in zip(synced, alone, strict=True))
    assert gap < 1e-4, gap  # float sums in another order, through 12 Adam steps: 3e-5 here
    stale, async_steps = pipeline("async")
    assert async_steps == [steps * chunks] * 3
    stale_gap = max(float((a - b).abs().max()) for a, b in zip(stale, alone, strict=True))
    assert stale_gap > 30 * max(gap, 1e-6), (stale_gap, gap)


def test_replica_sync_averages_two_replicas_to_identical_weights() -> None:
    async def main() -> None:
        b = _server(2, 4, 1, seed=11, name="b")
        await b.start()
        a = _server(2, 4, 1, seed=SEED, name="a", sync_peers=[b.address])
        await a.start()
        try:
            pa, pb = a.compute.parameters_snapshot(), b.compute.parameters_snapshot()
            assert any(not torch.equal(pa[n], pb[n]) for n in pa)
            assert await a.sync_now() == 1
            qa, qb = a.compute.parameters_snapshot(), b.compute.parameters_snapshot()
            for n in pa:
                torch.testing.assert_close(qa[n], qb[n], rtol=0, atol=1e-7)
                torch.testing.assert_close(qa[n], (pa[n] + pb[n]) / 2, rtol=0, atol=1e-7)
            assert (a.replicas.rounds, b.sync_served, a.replicas.failures) == (1, 1, 0)
            await b.kill()
            assert await a.sync_now() == 0 and a.replicas.failures == 1  # a dead peer: counted, no hang
        finally:
            await a.close()
            await b.close()

    _run(main())


def test_a_replica_answering_the_wrong_kind_of_message_is_banned_and_the_request_goes_elsewhere() -> None:
    """A stage that answers a forward with a STAGE_GRAD (broken, or not what it claims) fails
    like a lost connection: banned, the forward resent to the other replica; alone, the stage
    is unavailable. (The router used to assert the answer's type: an AssertionError out of
    the trainer, and nothing at all under ``python -O``.)"""
    async def main() -> None:
        liar, honest = _server(0, 2, 0, name="liar"), _server(0, 2, 0, name="honest")
        liar._run = lambda job: StageGrad(  # type: ignore[method-assign]
            req=job.req, session=job.session_id, microbatch=job.microbatch_id, tensors={})
        for s in (liar, honest):
            await s.start()
        # (the ban must last the test: the liar answers status probes, so a probe lifts it
        # a second after it began, and the default 2 s ban ends by itself; either happened
        # before the check on a loaded CI run)
        cfg = RouterConfig(wait_for_replica=0.0, timeouts=FAST, probe_interval=600.0, ban_base=600.0,
                           ban_cap=600.0)
        router = Router([[liar.address, honest.address]], secret=SECRET, config=cfg)
        lone = Router([[liar.address]], secret=SECRET, config=cfg)
        try:
            x = torch.randint(0, 256, (2, 8))
            for mb in range(4):
                replica, answer = await router.forward(0, "s", mb, x)
                assert replica.port == honest.port and isinstance(answer, StageResult)
            bad = next(r for r in router.replicas[0] if r.port == liar.port)
            await asyncio.sleep(1.0)  # a probe at once (as the router did) would have lifted it
            assert bad.failures >= 1 and bad.banned_until > 0 and router.bans_lifted == 0
            with pytest.raises(StageUnavailable, match="answered a StageGrad to a request"):
                await lone.forward(0, "s", 9, x)
        finally:
            await router.close()
            await lone.close()
            for s in (liar, honest):
                await s.close()

    _run(main())


def test_router_bans_a_dead_replica_for_growing_times_and_fails_over() -> None:
    now = [1000.0]

    async def main() -> None:
        live = _server(0, 2, 0, name="live")
        await live.start()
        dead = ("127.0.0.1", dead_port())
        cfg = RouterConfig(request_timeout=5.0, ban_base=2.0, ban_cap=5.0, wait_for_replica=0.0,
                           timeouts=FAST)
        router = Router([[dead, live.address]], secret=SECRET, config=cfg, clock=lambda: now[0])
        lone = Router([[dead]], secret=SECRET, config=cfg, clock=lambda: now[0])
        try:
            x = torch.randint(0, 256, (2, 8))
            for mb in range(3):
                replica, _ = await router.forward(0, "s", mb, x)
                assert replica.port == live.port
            assert router.replicas[0][0].failures == 1 and router.resends == 1
            bans = []
            for _ in range(3):
                with pytest.raises(StageUnavailable, match="stage 0"):
                    await lone.infer(0, "s", x)
                bans.append(lone.replicas[0][0].banned_until - now[0])
                now[0] += 10.0  # past the ban
            assert bans == [2.0, 4.0, 5.0]  # doubling, capped
        finally:
            await router.close()
            await lone.close()
            await live.close()

    _run(main())


def test_a_replicas_answer_time_leaves_out_the_handshake_of_its_connection() -> None:
    """The router measures a replica's answer time from the request, not from the start of
    the connection it opens first. Counting the handshake and status request made the first
    answer of each replica an outlier, and a replica as fast as the others could stay idle for
    the rest of the run (the LAN failover test's replica s1a had 1 group in 75 on a CI run)."""
    async def main() -> None:
        server = _server(0, 2, 0, name="slow-status")
        status = server.status

        def slow_status() -> dict[str, Any]:
            time.sleep(0.3)  # the new connection's status request, answered late
            return status()

        server.status = slow_status  # type: ignore[method-assign]
        await server.start()
        router = Router([[server.address]], secret=SECRET, config=RouterConfig(timeouts=FAST))
        try:
            replica, _ = await router.forward(0, "s", 0, torch.randint(0, 256, (2, 8)))
            assert replica.ewma_seconds is not None and replica.ewma_seconds < 0.25, replica.ewma_seconds
        finally:
            await router.close()
            await server.close()

    _run(main())


def test_a_replica_left_idle_after_one_slow_answer_is_measured_again() -> None:
    """A replica whose one answer was slow (a warm-up, a passing load) is sent a request again
    once it has been idle for ``remeasure_after`` while the other replica works, and takes its
    share back once it answers as fast; before, the router never tried it again."""
    async def main() -> None:
        a, b = _server(0, 2, 0, name="a"), _server(0, 2, 0, name="b")
        run_a = a._run
        slow = [True]

        def slow_once(job: Any) -> Message | None:
            if slow[0]:
                slow[0] = False
                time.sleep(0.05)  # idle for 20 x 0.05 s = 1 s before it is measured again
            return run_a(job)

        a._run = slow_once  # type: ignore[method-assign]
        for s in (a, b):
            await s.start()
        router = Router([[a.address, b.address]], secret=SECRET,
                        config=RouterConfig(timeouts=FAST, remeasure_after=0.3))
        try:
            x = torch.randint(0, 256, (2, 8))
            counts: Counter[int] = Counter()
            end = time.monotonic() + 10.0
            mb = 0
            while counts[a.port] < 3 and time.monotonic() < end:
                replica, _ = await router.forward(0, "s", mb, x)
                counts[replica.port] += 1
                mb += 1
            ra = next(r for r in router.replicas[0] if r.port == a.port)
            # its first answer took 0.05 s; measured again, its estimate is an ordinary answer's
            assert counts[a.port] >= 3 and ra.ewma_seconds is not None and ra.ewma_seconds < 0.02, (
                counts, ra.ewma_seconds)
            assert counts[b.port] >= 3, counts
        finally:
            await router.close()
            for s in (a, b):
                await s.close()

    _run(main())


def test_router_config_refuses_a_remeasure_interval_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="remeasure_after > 0"):
        RouterConfig(remeasure_after=0.0)


def test_repeated_requests_over_the_wire_are_answered_from_caches_never_applied_twice() -> None:
    async def main() -> None:
        s = _server(2, 4, 1, name="mid")
        await s.start()
        conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
        try:
            x = torch.randn(2, 8, 32)

            async def ask(msg: Any) -> Any:
                await conn.send(msg)
                return await conn.recv(timeout=10)

            first = await ask(StageForward(req=1, session="s", microbatch=0, tensors={"x": x}))
            again = await ask(StageForward(req=2, session="s", microbatch=0, tensors={"x": x}))
            assert isinstance(first, StageResult) and isinstance(again, StageResult) and again.req == 2
            assert torch.equal(first.tensors["y"], again.tensors["y"]) and not again.done
            grad = torch.ones(2, 8, 32)
            g1 = await ask(StageBackward(req=3, session="s", microbatch=0, tensors={"grad": grad}))
            g2 = await ask(StageBackward(req=4, session="s", microbatch=0, tensors={"grad": grad}))
            assert isinstance(g1, StageGrad) and isinstance(g2, StageGrad)
            assert not g1.duplicate and g2.duplicate
            assert torch.equal(g1.tensors["grad"], g2.tensors["grad"])
            redo = await ask(StageForward(req=5, session="s", microbatch=0, tensors={"x": x}))
            assert isinstance(redo, StageResult) and redo.done
            assert torch.equal(redo.tensors["grad"], g1.tensors["grad"])
            status = await ask(StatusRequest())
            assert isinstance(status, Status)
            st = status.status
            counts = (st["forwards"], st["microbatches"], st["steps"], st["duplicate_backwards"])
            assert counts == (1, 1, 1, 1)
            assert st["layers"] == [2, 4] and st["inbound"]["capacity"] == 100
        finally:
            await conn.close()
            await s.close()

    _run(main())


class _Gate(nn.Module):
    """A layer that records each call (batch size, grad mode, train mode) and holds the
    training-mode calls until the test opens it, so the stage's training buffer fills
    meanwhile. The stage's eval-mode copy for inference shares the record and the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.calls: list[tuple[int, bool, bool]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> _Gate:
        twin = _Gate()
        twin.entered, twin.opened, twin.calls = self.entered, self.opened, self.calls
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.shape[0], torch.is_grad_enabled(), self.training))
        if self.training:
            self.entered.set()
            if not self.opened.wait(20):
                raise RuntimeError("the test never opened the gate")
        return x


def _gated_server(gate: nn.Module, **config: Any) -> StageServer:
    return StageServer(nn.Sequential(gate, nn.Linear(4, 4)), stage=1, layer_range=(0, 2), loss_fn=None,
                       config=StageServerConfig(timeouts=FAST, **config), secret=SECRET, name="gated")


def test_inference_does_not_wait_for_training_work_in_progress_or_queued() -> None:
    async def main() -> None:
        gate = _Gate()
        s = _gated_server(gate)
        await s.start()
        conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
        try:
            # micro-batch 1 occupies the training thread; 2..4 queue up behind it
            await conn.send(StageForward(req=1, session="t", microbatch=1, tensors={"x": torch.randn(1, 4)}))
            assert await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, 10)
            for mb in range(2, 5):
                await conn.send(StageForward(req=mb, session="t", microbatch=mb,
                                             tensors={"x": torch.randn(mb, 4)}))
            await conn.send(StageInfer(req=9, session="gen", priority=int(Priority.INFERENCE_URGENT),
                                       tensors={"x": torch.randn(9, 4)}))
            # answered while the gate still holds the training thread
            first = await conn.recv(timeout=10)
            assert isinstance(first, StageResult) and first.req == 9 and first.tensors["y"].shape == (9, 4)
            await conn.send(StatusRequest())
            status = await conn.recv(timeout=10)
            assert isinstance(status, Status)
            st = status.status
            assert st["inbound"]["count_by_priority"]["TRAINING_FORWARD"] == 3  # still waiting
            assert st["infer_inbound"]["packets_out"] == 1 and st["inferences"] == 1
            gate.opened.set()
            order = [(await conn.recv(timeout=10)).req for _ in range(4)]
            assert order == [1, 2, 3, 4], order
            # training forwards and inference both run without autograd (the backward
            # recomputes); inference in eval mode, on its copy: training stayed in train mode
            assert gate.calls == [(1, False, True), (9, False, False), (2, False, True),
                                  (3, False, True), (4, False, True)]
        finally:
            gate.opened.set()
            await conn.close()
            await s.close()

    _run(main())


class _Uncopyable(_Gate):
    def __deepcopy__(self, memo: dict[int, Any]) -> _Gate:
        raise TypeError("cannot copy a gate")


def test_layers_that_cannot_be_copied_still_serve_inference_after_training_work() -> None:
    async def main() -> None:
        gate = _Uncopyable()
        s = _gated_server(gate)
        await s.start()
        conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
        try:
            await conn.send(StageForward(req=1, session="t", microbatch=1, tensors={"x": torch.randn(1, 4)}))
            assert await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, 10)
            await conn.send(StageInfer(req=9, session="gen", priority=int(Priority.INFERENCE_URGENT),
                                       tensors={"x": torch.randn(9, 4)}))
            gate.opened.set()
            order = [(await conn.recv(timeout=10)).req for _ in range(2)]
            assert order == [1, 9], order  # no copy: inference waited for the training forward
            assert gate.calls == [(1, False, True), (9, False, False)]
            assert gate.training  # borrowed in eval mode, handed back in train mode
        finally:
            gate.opened.set()
            await conn.close()
            await s.close()

    _run(main())


def test_the_training_thread_runs_at_a_lower_os_priority_than_inference() -> None:
    # per-thread nice values, as Linux has them (the platform this project runs on)
    async def main() -> None:
        s = _gated_server(nn.Identity(), training_nice=7)
        await s.start()
        try:
            assert s._thread is not None and s._infer_thread is not None
            base = os.getpriority(os.PRIO_PROCESS, 0)
            deadline = time.monotonic() + 10
            while os.getpriority(os.PRIO_PROCESS, s._thread.native_id or 0) == base:
                assert time.monotonic() < deadline, "the training thread kept its priority"
                await asyncio.sleep(0.01)
            assert os.getpriority(os.PRIO_PROCESS, s._thread.native_id or 0) == min(19, base + 7)
            assert os.getpriority(os.PRIO_PROCESS, s._infer_thread.native_id or 0) == base
        finally:
            await s.close()

    _run(main())


def test_inference_on_the_twin_matches_the_trained_weights_while_training_runs(data: Any) -> None:
    torch.manual_seed(SEED)
    layers = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    c = StageCompute(layers, is_first=False, loss_fn=None, config=ComputeConfig(learning_rate=1e-2))
    x = torch.randn(4, 8)
    stop = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for mb in range(200):
                c.forward("s", mb, torch.randn(2, 8), None)
                c.backward("s", mb, torch.randn(2, 8))
            stop.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            stop.set()

    t = threading.Thread(target=train)
    t.start()
    outs = []
    while not stop.is_set():
        outs.append(c.infer(x))
    t.join(30)
    assert not errors and not t.is_alive() and c.steps == 200
    assert layers.training  # inference never switched the training module to eval mode
    assert all(bool(torch.isfinite(o).all()) for o in outs) and len(outs) > 1
    layers.eval()
    with torch.no_grad():
        expected = layers(x)
    assert torch.equal(c.infer(x), expected)  # dropout off, and the twin sees the new weights


async def _raw_exchange(port: int, frame: bytes) -> Any:
    """Authenticate with a real client, then write ``frame`` raw and read the answer."""
    conn = await connect("127.0.0.1", port, secret=SECRET, role="pipeline", timeouts=FAST)
    try:
        conn.transport.write(frame)
        return await conn.recv(timeout=10)
    except Exception as exc:  # noqa: BLE001 - the close reason is what the test looks at
        return exc
    finally:
        await conn.close()


def test_malformed_and_unauthenticated_input_is_refused_and_others_keep_being_served() -> None:
    async def main() -> None:
        # eight refusals on one connection: above the disconnect bound (tested on its own in
        # test_stage_hardening.py), so that every kind of refusal is seen here
        s = _server(0, 2, 0, name="s0", max_bad_in_row=20)
        await s.start()
        router = Router([[s.address]], secret=SECRET, config=RouterConfig(timeouts=FAST))
        try:
            with pytest.raises(AuthError, match="secret"):
                await connect("127.0.0.1", s.port, secret=b"wrong", role="pipeline", timeouts=FAST)
            c = await connect("127.0.0.1", s.port, secret=SECRET, role="worker", timeouts=FAST)
            answer = await c.recv(timeout=10)
            assert isinstance(answer, Error) and answer.code == "bad_role"
            assert "serves roles" in answer.message
            await c.close()
            conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            tokens = torch.randint(0, 256, (2, 8))
            bad = {
                "float tokens": StageForward(req=1, session="x", microbatch=0,
                                             tensors={"x": torch.randn(2, 8)}),
                "no x": StageForward(req=2, session="x", microbatch=0, tensors={"y": tokens}),
                "token out of range": StageForward(req=3, session="x", microbatch=0,
                                                   tensors={"x": tokens + 1000}),
                "too long": StageInfer(req=4, session="x",
                                       tensors={"x": torch.zeros(1, 99, dtype=torch.long)}),
                "priority": StageInfer(req=5, session="x", priority=30, tensors={"x": tokens}),
                "negative id": StageForward(req=6, session="x", microbatch=-1, tensors={"x": tokens}),
            }
            for why, msg in bad.items():
                await conn.send(msg)
                answer = await conn.recv(timeout=10)
                assert isinstance(answer, StageError) and answer.code == "bad_input", (why, answer)
                assert answer.req == msg.req and "s0" in answer.message
            await conn.send(StageBackward(req=7, session="x", microbatch=5, tensors={"grad": torch.ones(1)}))
            answer = await conn.recv(timeout=10)
            assert isinstance(answer, StageError) and answer.code == "unknown_microbatch"
            await conn.send(Register(worker_id="w", task="t", fingerprint=[], hardware={}, batch_size=1,
                                     accumulation_steps=1, shard_index=0, compression={},
                                     samples_per_sec=1.0))
            answer = await conn.recv(timeout=10)
            assert isinstance(answer, StageError) and answer.code == "unexpected"
            await conn.close()
            bad_magic = PREAMBLE.pack(b"XXXX", 1, 50, 0, 1, 0) + b"\x80"
            answer = await _raw_exchange(s.port, bad_magic)
            assert isinstance(answer, Error) and answer.code == "bad_magic", answer
            # through all of that the server kept serving a well-behaved client
            replica, res = await router.forward(0, "ok", 0, tokens)
            assert not res.done and res.tensors["y"].shape == (2, 8, 32)
            y = await router.infer(0, "ok", tokens, Priority.INFERENCE_URGENT)
            assert y.shape == (2, 8, 32)
            st = s.status()
            assert (st["forwards"], st["inferences"], st["microbatches"]) == (1, 1, 0)
            assert st["failed_handshakes"] >= 1
        finally:
            await router.close()
            await s.close()

    _run(main())


# --- training through three stages, one middle replica killed --------------------------------

# Pilot (run before fixing the numbers below; this config, seed 7, batch 16, lr 3e-3,
# s1a killed after ~60 micro-batches, this 2-core machine, 21:40-21:50 UTC): the pipeline's
# own held-out eval (64 windows) went from 5.54 (untrained, about ln 256) to 3.17, 3.19,
# 3.23 and 3.30 after 360 micro-batches in four runs of this test (3.26-3.42 after 240; the
# asynchronous schedule, which replica trains what, varies from run to run). About 9 s.
MICROBATCHES = 360
KILL_AFTER = 60
HELDOUT_LOSS_BELOW = 3.5


def test_three_stages_train_with_a_middle_replica_killed_and_generation_meanwhile(data: Any) -> None:
    ranges = plan_stages(estimate_layer_costs(split_layers(TASK.build_model(SEED))),
                         [NodeSpec(f"n{i}", 1.0, 2**30) for i in range(3)])

    async def main() -> dict[str, Any]:
        first = _server(*ranges[0], 0, name="s0")
        mid_b = _server(*ranges[1], 1, name="s1b")
        last = _server(*ranges[2], 2, last=True, name="s2")
        for srv in (first, mid_b, last):
            await srv.start()
        # after every step: a synchronous step is a group of 4 micro-batches, and s1a serves
        # only some of the groups before it is killed (every 3 steps made no sync in a CI run)
        mid_a = _server(*ranges[1], 1, name="s1a", sync_peers=[mid_b.address], sync_every=1)
        await mid_a.start()
        router = Router([[first.address], [mid_a.address, mid_b.address], [last.address]],
                        secret=SECRET, config=RouterConfig(request_timeout=20.0, timeouts=FAST))
        killed = asyncio.Event()
        victim: list[StageServer] = []

        def kill_a_replica_holding_work(mb: int, loss: float) -> None:
            # Kill synchronously the replica of stage 1 that holds a forward whose backward is
            # still to come (a synchronous group uses one replica: the other stands by), so
            # that micro-batch must be redone on the other (or, should that moment never
            # come, a little later anyway: the asserts below then say what was missed).
            done = len(trainer.loss_history)
            busy = [r for r in (mid_a, mid_b) if r.status()["pending_forwards"] > 0]
            if not killed.is_set() and (done >= KILL_AFTER and busy or done >= 2 * KILL_AFTER):
                victim.append(busy[0] if busy else mid_a)
                victim[0].abort()
                killed.set()

        trainer = PipelineTrainer(router, data.train, TrainerConfig(batch_size=16, chunks=4, seed=1),
                                  context=TASK.config.context, on_microbatch=kill_a_replica_holding_work)
        loss_fn = loss_fn_for(TASK.build_model(SEED))
        try:
            untrained = await trainer.evaluate(data.heldout, loss_fn, max_samples=64)
            training = asyncio.create_task(trainer.train(MICROBATCHES))
            await asyncio.wait_for(killed.wait(), 40)
            generated = await trainer.generate(b"def ", 12)
            generated_while_training = not training.done()
            losses = await training
            trained = await trainer.evaluate(data.heldout, loss_fn, max_samples=64)
            return {
                "losses": losses, "untrained": untrained, "trained": trained, "generated": generated,
                "while_training": generated_while_training, "trainer": trainer, "router": router.stats(),
                "servers": {s.name: s for s in (first, mid_a, mid_b, last)},
                # the killed replica is "s1a" below, the one that stayed up "s1b"
                "killed": victim[0].name, "b_port": (mid_b if victim[0] is mid_a else mid_a).port,
                "syncs": mid_a.replicas.rounds, "sync_served": mid_b.sync_served,
            }
        finally:
            await router.close()
            for srv in (first, mid_a, mid_b, last):
                await srv.close()

    out = _run(main(), timeout=80)
    trainer, servers = out["trainer"], out["servers"]
    print(f"held-out loss {out['untrained']:.3f} -> {out['trained']:.3f}; first/last 20 train "
          f"{sum(out['losses'][:20]) / 20:.3f}/{sum(out['losses'][-20:]) / 20:.3f}; "
          f"resends {trainer.router.resends} + redone forwards {trainer.redone_forwards}; "
          f"syncs {out['syncs']}/{out['sync_served']}; router {out['router']}; "
          f"generated {out['generated']!r}")
    # no micro-batch lost: every one has a loss and was acknowledged exactly once per stage
    assert len(out["losses"]) == MICROBATCHES
    assert all(trainer.acknowledged[(s, mb)] == 1 for s in range(3) for mb in range(MICROBATCHES))
    assert set(trainer.acknowledged) == {(s, mb) for s in range(3) for mb in range(MICROBATCHES)}
    # ... and applied exactly once on every stage that survived
    for name in ("s0", "s2"):
        applied = Counter(mb for _, mb in servers[name].compute.applied_log)
        assert applied == Counter(range(MICROBATCHES)), name
        assert servers[name].compute.duplicate_backwards == 0
    gone, kept = ("s1a", "s1b") if out["killed"] == "s1a" else ("s1b", "s1a")
    on_a = Counter(mb for _, mb in servers[gone].compute.applied_log)
    on_b = Counter(mb for _, mb in servers[kept].compute.applied_log)
    assert max(on_a.values()) == 1 and max(on_b.values()) == 1  # never twice on one replica
    b_name = f"stage1@127.0.0.1:{out['b_port']}"
    acked_by_b = {mb for (s, mb), who in trainer.acknowledged_by.items() if s == 1 and who == b_name}
    acked_by_a = {mb for (s, mb), who in trainer.acknowledged_by.items() if s == 1 and who != b_name}
    # (a group split over both by the kill: s1b was given the part s1a had applied, for its step)
    replayed_on_b = {mb for (s, mb), who in trainer.replayed_by.items() if s == 1 and who == b_name}
    assert set(on_b) == acked_by_b | replayed_on_b and acked_by_a <= set(on_a)
    assert set(on_a) | set(on_b) == set(range(MICROBATCHES))
    # only a micro-batch s1a applied but could not acknowledge before dying was redone on
    # s1b: at most the micro-batches in flight (one synchronous group)
    assert len(set(on_a) & set(on_b)) <= trainer.config.chunks
    # the failover really happened, and the survivors carried the rest of the run
    assert trainer.redone_forwards + trainer.router.resends >= 1
    assert all(mb in acked_by_b for mb in range(max(on_a) + 1, MICROBATCHES))
    assert out["syncs"] >= 1 and out["sync_served"] >= 1
    # generation was served while training ran, and training learned
    assert len(out["generated"]) == 12 and out["while_training"]
    assert out["untrained"] > 5.0
    assert out["trained"] < HELDOUT_LOSS_BELOW, out["trained"]


def test_a_recomputed_forward_draws_what_its_forward_drew_while_another_stage_draws() -> None:
    """Stages that share a process (threads) share its random generator. A training forward's
    state is captured for the recompute its backward runs, so the recompute drops the same
    layers (LayerDrop) and the same dropout masks; another stage drawing between the capture
    and the forward, or during the replay, made them differ (the conformance suite's LayerDrop
    pipeline ended at 0.93 against one process's 0.97 on a loaded run, 0.953 mean over 15
    quiet ones; 0.963 with this, one process's draws 0.964)."""
    from swarmtrain.roles.stage.placement import RngState

    cpu = torch.device("cpu")
    stop = threading.Event()

    def other_stage() -> None:
        while not stop.is_set():
            with RngState.drawing(cpu):
                torch.rand(8)
                time.sleep(0)  # (its layers run: the interpreter lock changes hands)

    thread = threading.Thread(target=other_stage, daemon=True)
    thread.start()
    differ = 0
    try:
        for _ in range(300):
            with RngState.drawing(cpu) as state:
                time.sleep(0)
                drawn = torch.rand(16)
            with state.replayed():
                time.sleep(0)
                again = torch.rand(16)
            differ += not torch.equal(drawn, again)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert differ == 0, f"{differ} of 300 recomputes drew other numbers than their forward"
