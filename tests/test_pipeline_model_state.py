"""Pipeline mode trains a user's ``nn.Sequential`` as one process would (issue #15): stages
own their buffers (BatchNorm statistics, updated once per training forward, used by
inference, averaged by replicas), leave frozen and gradient-less parameters alone, train in
bfloat16 and float16 with float32 master weights, and compute on a chosen device.

Pure stage computes in this process, and stage servers over loopback TCP (port 0) as in
``test_pipeline_core.py``. Only the CPU device is exercised: there is no accelerator here.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.app.cli import build_parser
from swarmtrain.app.pipeline_session import StageOptions, run_stage
from swarmtrain.errors import ConfigError
from swarmtrain.roles.stage import (
    BadInput,
    ComputeConfig,
    PipelineTrainer,
    Priority,
    Router,
    RouterConfig,
    StageCompute,
    StageServer,
    StageServerConfig,
    TrainerConfig,
    loss_fn_for,
)
from swarmtrain.roles.stage.weights import StageWeights
from swarmtrain.tasks import DigitsTask, Shard, TaskData, TensorPairDataset, seeded_module
from swarmtrain.transport import Timeouts

pytestmark = pytest.mark.timeout(60)

SECRET = b"pipeline-model-state-secret"
FAST = Timeouts(connect=5.0, handshake=5.0, heartbeat_interval=1.0, heartbeat_timeout=20.0, send=20.0)
DIGITS = DigitsTask().load_data()


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 40.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(autouse=True)
def _one_thread_per_op() -> Any:
    # Stage threads share two cores; one intra-op thread each also keeps results reproducible.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _digits(dtype: torch.dtype) -> TaskData:
    splits = []
    for split in (DIGITS.train, DIGITS.heldout):
        assert isinstance(split, TensorPairDataset)
        splits.append(TensorPairDataset(split.inputs.to(dtype), split.targets))
    return TaskData(train=splits[0], heldout=splits[1])


def _accuracy(model: nn.Module, data: TaskData) -> float:
    x, y = data.heldout.get_batch(torch.arange(len(data.heldout)))
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def _servers(parts: list[nn.Module], compute: ComputeConfig, **kw: Any) -> list[StageServer]:
    last = len(parts) - 1
    return [StageServer(p, stage=i, layer_range=(i, i + 1), loss_fn=F.cross_entropy if i == last else None,
                        compute=compute, config=StageServerConfig(timeouts=FAST), secret=SECRET,
                        name=f"s{i}", **kw) for i, p in enumerate(parts)]


async def _train(servers: list[StageServer], data: TaskData, steps: int, *, batch_size: int,
                 seed: int, schedule: str = "sync", chunks: int = 1) -> tuple[list[float], Router]:
    """``steps`` optimizer steps of ``batch_size`` samples: with ``sync``, each ``chunks``
    micro-batches of a share of it; with ``async``, ``steps`` micro-batches of ``batch_size``
    with ``chunks`` in flight. Returns every micro-batch's loss."""
    for s in servers:
        await s.start()
    router = Router([[s.address] for s in servers], secret=SECRET,
                    config=RouterConfig(request_timeout=20.0, timeouts=FAST))
    sync = schedule == "sync"
    trainer = PipelineTrainer(router, data.train, TrainerConfig(
        batch_size=batch_size // chunks if sync else batch_size, schedule=schedule, chunks=chunks,
        max_inflight=chunks, seed=seed, grad_clip=0.0))  # as the one-process loop: no clipping
    return await trainer.train(steps * chunks if sync else steps), router


async def _close(router: Router, servers: list[StageServer]) -> None:
    await router.close()
    for s in servers:
        await s.close()


# --- 1. buffers --------------------------------------------------------------------------------


def _bn_stage() -> nn.Sequential:
    return seeded_module(lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                               nn.Linear(8, 4)), 3)


def test_batchnorm_statistics_move_once_per_training_forward_and_inference_uses_them() -> None:
    torch.manual_seed(0)
    c = StageCompute(_bn_stage(), is_first=False, loss_fn=None, config=ComputeConfig(learning_rate=1e-2))
    ref = copy.deepcopy(c.layers)  # one process: one forward per batch, in train mode
    xs = [torch.randn(6, 4) + i for i in range(3)]
    # two micro-batches in flight, then their backwards (each recomputes its forward)
    for mb in (0, 1):
        c.forward("s", mb, xs[mb], None)
    for mb in (0, 1):
        c.backward("s", mb, torch.randn(6, 4))
    with torch.no_grad():
        ref(xs[0])
        ref(xs[1])
    bn, ref_bn = c.layers[1], ref[1]
    assert isinstance(bn, nn.BatchNorm1d) and isinstance(ref_bn, nn.BatchNorm1d)
    assert int(bn.num_batches_tracked) == 2  # not 4: the recomputations left them alone
    assert bn.running_mean is not None and ref_bn.running_mean is not None
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=0, atol=1e-6)
    assert c.steps == 2 and c.layers.training

    # inference: eval mode on the running statistics and the trained weights, on the twin's
    # own copy of the buffers (never half-updated by a training forward on another thread)
    twin = c._infer_layers
    assert twin is not None and not twin.training
    assert twin[1].running_mean.data_ptr() != bn.running_mean.data_ptr()
    assert twin[0].weight.data_ptr() == c.layers[0].weight.data_ptr()
    probe = torch.randn(5, 4)
    want = copy.deepcopy(c.layers).eval()(probe)
    torch.testing.assert_close(c.infer(probe), want, rtol=0, atol=0)
    with torch.no_grad():  # train mode (batch statistics) would differ
        assert not torch.allclose(want, copy.deepcopy(c.layers)(probe))

    # a third forward moves the statistics again, and inference sees it at once
    c.forward("s", 2, xs[2], None)
    assert int(bn.num_batches_tracked) == 3
    torch.testing.assert_close(c.infer(probe), copy.deepcopy(c.layers).eval()(probe), rtol=0, atol=0)

    # the last stage (loss and backward in one forward) counts each micro-batch once too,
    # and a micro-batch its loss refuses leaves the statistics as they were
    last = StageCompute(_bn_stage(), is_first=False, loss_fn=F.cross_entropy, config=ComputeConfig())
    last.forward("s", 0, xs[0], torch.tensor([0, 1, 2, 3, 0, 1]))
    lbn = last.layers[1]
    assert isinstance(lbn, nn.BatchNorm1d) and int(lbn.num_batches_tracked) == 1
    assert lbn.running_mean is not None
    before = lbn.running_mean.clone()
    with pytest.raises(BadInput, match="targets ignored"):
        last.forward("s", 1, xs[1], torch.full((6,), -100))
    assert int(lbn.num_batches_tracked) == 1 and torch.equal(lbn.running_mean, before)


def test_replicas_average_floating_buffers_take_the_larger_count_and_leave_frozen_alone() -> None:
    def stage() -> nn.Sequential:
        layers = _bn_stage()
        layers[0].requires_grad_(False)  # a frozen first layer
        return layers

    torch.manual_seed(1)

    async def main() -> None:
        b = StageServer(stage(), stage=1, layer_range=(1, 5), loss_fn=None,
                        config=StageServerConfig(timeouts=FAST), secret=SECRET, name="b")
        await b.start()
        a = StageServer(stage(), stage=1, layer_range=(1, 5), loss_fn=None,
                        config=StageServerConfig(timeouts=FAST), secret=SECRET, name="a",
                        sync_peers=[b.address])
        await a.start()
        try:
            # different work on each replica (the servers are idle: drive their computes here)
            for s, n, shift in ((a, 3, 0.0), (b, 5, 2.0)):
                for mb in range(n):
                    s.compute.forward("t", mb, torch.randn(6, 4) + shift, None)
                    s.compute.backward("t", mb, torch.randn(6, 4))
            with torch.no_grad():  # frozen weights that differ: sync must not touch them
                b.compute.layers[0].weight.add_(1.0)
            frozen = {s.name: s.compute.layers[0].weight.clone() for s in (a, b)}
            pa, pb = a.compute.parameters_snapshot(), b.compute.parameters_snapshot()
            assert "0.weight" not in pa and "1.running_mean" in pa and "1.num_batches_tracked" in pa
            assert (int(pa["1.num_batches_tracked"]), int(pb["1.num_batches_tracked"])) == (3, 5)
            assert b.role_limits()["stage"].max_tensors == len(pb) + 8
            assert await a.sync_now() == 1
            qa, qb = a.compute.parameters_snapshot(), b.compute.parameters_snapshot()
            for name in pa:
                torch.testing.assert_close(qa[name], qb[name], rtol=0, atol=1e-6)
                if pa[name].is_floating_point():
                    torch.testing.assert_close(qa[name], (pa[name] + pb[name]) / 2, rtol=0, atol=1e-6)
            assert int(qa["1.num_batches_tracked"]) == 5  # the larger count
            for s in (a, b):
                assert torch.equal(s.compute.layers[0].weight, frozen[s.name])
            # inference on each replica uses the averaged statistics
            probe = torch.randn(3, 4)
            for s in (a, b):
                want = copy.deepcopy(s.compute.layers).eval()(probe)
                torch.testing.assert_close(s.compute.infer(probe), want, rtol=0, atol=0)
        finally:
            await a.close()
            await b.close()

    _run(main())

    # work done during a round is kept on top of the agreed value, for counters too
    w = StageWeights(_bn_stage())
    mine = w.snapshot()
    theirs = {n: t.clone() for n, t in mine.items()}
    theirs["1.num_batches_tracked"].fill_(7)
    theirs["1.running_mean"].add_(2.0)
    assert w.buffers["1.num_batches_tracked"] is not None
    w.buffers["1.num_batches_tracked"].add_(1)  # one batch counted since the snapshot
    w.move_towards(mine, theirs, lock=threading.Lock())
    assert int(w.buffers["1.num_batches_tracked"]) == 8
    torch.testing.assert_close(w.buffers["1.running_mean"], mine["1.running_mean"] + 1.0)


# --- 2. frozen and gradient-less parameters ------------------------------------------------------


class _Branchy(nn.Module):
    """A branch used only on even batch sizes (as LayerDrop skips layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x) if x.shape[0] % 2 == 0 else x


def _frozen_model() -> nn.Sequential:
    def build() -> nn.Sequential:
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), _Branchy(), nn.Linear(8, 3))
        m[0].requires_grad_(False)
        return m

    return seeded_module(build, 5)


def test_frozen_parameters_are_never_optimized_and_gradless_ones_are_not_stepped() -> None:
    cfg = ComputeConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip=0.0)
    c = StageCompute(_frozen_model(), is_first=True, loss_fn=F.cross_entropy, config=cfg)
    ref = _frozen_model()  # one process: AdamW over the trainable parameters, grads set to None
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    optimized = {id(p) for g in c.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in c.layers.named_parameters() if not n.startswith("0.")}
    frozen0 = c.layers[0].weight.clone()
    gen = torch.Generator().manual_seed(0)
    branch = c.layers[2].branch.weight
    for mb, size in enumerate((4, 3, 3, 4, 5)):
        x, y = torch.randn(size, 4, generator=gen), torch.randint(0, 3, (size,), generator=gen)
        before = branch.clone()
        c.forward("s", mb, x, y)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        if size % 2:  # no gradient for the branch: not stepped, not decayed
            assert torch.equal(branch, before)
        else:
            assert not torch.equal(branch, before)
        assert all(p.grad is None for p in c.layers.parameters())  # nothing zero-filled, nothing kept
    assert torch.equal(c.layers[0].weight, frozen0)
    assert c.optimizer is not None and c.optimizer.state[branch]["step"] == 2  # the even batches only
    for (name, p), q in zip(c.layers.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)

    # a first stage whose every parameter is frozen: no optimizer, and its backward is a no-op
    still = StageCompute(_frozen_model()[:2], is_first=True, loss_fn=None, config=cfg)
    assert still.optimizer is None and not still.parameters_snapshot()
    y = still.forward("s", 0, torch.randn(3, 4), None).y
    assert y is not None
    done = still.backward("s", 0, torch.ones_like(y))
    assert done.done and done.grad is None and still.steps == 1


# --- 3. half precision ------------------------------------------------------------------------------


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    return seeded_module(lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), 1).to(dtype)


def test_bfloat16_stages_train_with_float32_masters_and_bfloat16_on_the_wire() -> None:
    data = _digits(torch.bfloat16)
    model = _mlp(torch.bfloat16)
    servers = _servers([model[:2], model[2:]], ComputeConfig(learning_rate=3e-3))

    async def main() -> tuple[list[float], dict[str, torch.Tensor]]:
        losses, router = await _train(servers, data, 80, batch_size=32, chunks=2, seed=0)
        try:
            x, y = data.train.get_batch(torch.arange(8))
            _, first = await router.forward(0, "probe", 0, x)
            _, last = await router.forward(1, "probe", 0, first.tensors["y"], y)
            hidden = await router.infer(0, "probe", x, Priority.INFERENCE_NORMAL)
            return losses, {"y0": first.tensors["y"], "grad1": last.tensors["grad"], "infer": hidden}
        finally:
            await _close(router, servers)

    losses, wire = _run(main())
    assert wire["y0"].dtype == wire["grad1"].dtype == wire["infer"].dtype == torch.bfloat16
    for s in servers:
        c = s.compute
        assert all(p.dtype == torch.bfloat16 for p in c.layers.parameters())
        assert all(m.dtype == torch.float32 for m in c.weights.masters.values())
        assert all(st["exp_avg"].dtype == torch.float32 for st in c.optimizer.state.values())
        for name, p in c.weights.trainable.items():  # the layers hold the rounded masters
            assert torch.equal(p, c.weights.masters[name].to(torch.bfloat16))
    accuracy = _accuracy(nn.Sequential(*servers[0].compute.layers, *servers[1].compute.layers), data)
    print(f"bf16 pipeline: loss {sum(losses[:10]) / 10:.3f} -> {sum(losses[-10:]) / 10:.3f}, "
          f"held-out accuracy {accuracy:.3f}")
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert accuracy >= 0.85


def test_a_float16_stage_scales_its_gradients_so_small_ones_survive_and_big_ones_retry() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 64)

    def step_with(grad_out: torch.Tensor) -> tuple[StageCompute, torch.Tensor, torch.Tensor]:
        c = StageCompute(_mlp(torch.float16)[:1], is_first=False, loss_fn=None,
                         config=ComputeConfig(learning_rate=1e-3, grad_clip=0.0))
        before = c.weights.masters["0.weight"].clone()
        c.forward("s", 0, x.half(), None)
        out = c.backward("s", 0, grad_out)
        assert out.grad is not None
        return c, out.grad, c.weights.masters["0.weight"] - before

    ref = _mlp(torch.float32)[:1]
    tiny = (torch.randn(16, 64) * 5e-9).clamp(-2.5e-8, 2.5e-8)  # float16 rounds all to 0 (< 3e-8)
    assert not bool(tiny.half().any())
    xf = x.half().float().requires_grad_(True)
    ref(xf).backward(tiny)
    assert ref[0].weight.grad is not None and xf.grad is not None
    c, in_grad, moved = step_with(tiny)
    assert in_grad.dtype == torch.float32  # sent upstream unscaled, in float32
    assert float(xf.grad.abs().mean()) > 1e-9 and bool(in_grad.all())  # survived, where fp16 has 0
    assert float((in_grad - xf.grad).norm() / xf.grad.norm()) < 1e-2  # float16 rounding only
    # the weights moved (AdamW's first step: about lr against the gradient's sign)
    agree = (moved.sign() == -ref[0].weight.grad.sign())[ref[0].weight.grad.abs() > 1e-10]
    assert float(agree.float().mean()) > 0.99
    assert c.status()["overflows"] == 0 and c.status()["loss_scale"] == 2.0**16

    big = torch.randn(16, 64) * 1e3  # times 2**16 overflows float16 (65504): redone at smaller scales
    xf.grad = None
    ref(xf).backward(big)
    c, in_grad, _ = step_with(big)
    assert c.status()["overflows"] >= 1 and c.status()["loss_scale"] < 2.0**16
    assert c.microbatches == 1 and c.steps == 1  # retried, not dropped
    assert float((in_grad - xf.grad).norm() / xf.grad.norm()) < 1e-2  # float16 rounding only


def test_float16_stages_train_digits_through_the_pipeline() -> None:
    data = _digits(torch.float16)
    model = _mlp(torch.float16)
    servers = _servers([model[:2], model[2:]], ComputeConfig(learning_rate=3e-3))

    async def main() -> list[float]:
        losses, router = await _train(servers, data, 80, batch_size=32, chunks=2, seed=0)
        await _close(router, servers)
        return losses

    losses = _run(main())
    accuracy = _accuracy(nn.Sequential(*servers[0].compute.layers, *servers[1].compute.layers), data)
    scales = [s.compute.status()["loss_scale"] for s in servers]
    print(f"fp16 pipeline: loss {sum(losses[:10]) / 10:.3f} -> {sum(losses[-10:]) / 10:.3f}, "
          f"held-out accuracy {accuracy:.3f}, loss scales {scales}")
    assert all(p.dtype == torch.float16 for s in servers for p in s.compute.layers.parameters())
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert accuracy >= 0.85


# --- 4. device ---------------------------------------------------------------------------------


def test_the_stage_device_option_reaches_the_layers() -> None:
    args = build_parser().parse_args(["stage", "--stage", "0", "--stages", "2", "--device", "cpu"])
    assert args.device == "cpu"
    assert build_parser().parse_args(["stage", "--stage", "0", "--stages", "2"]).device == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage", "--stage", "0", "--stages", "2", "--device", "tpu"])
    with pytest.raises(ConfigError, match="--device"):
        StageOptions(stage=0, stages=2, device="tpu")
    if not torch.cuda.is_available():  # a device this machine lacks is refused before serving
        with pytest.raises(ConfigError, match="CUDA"):
            run_stage(DigitsTask(), StageOptions(stage=0, stages=2, host="127.0.0.1", device="cuda"),
                      secret=SECRET, insecure=False)
    # the CPU path (the only one this machine has): layers, inputs and answers on the CPU
    c = StageCompute(_bn_stage(), is_first=False, loss_fn=None, config=ComputeConfig(), device="cpu")
    assert c.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in c.layers.parameters())
    out = c.forward("s", 0, torch.randn(4, 4), None)
    assert out.y is not None and out.y.device.type == "cpu"


# --- 5. conformance: a BatchNorm CNN in two stages vs one process ----------------------------------

CNN_SEED = 11
LR = 3e-3
BATCH = 32
STEPS = 120  # 3,840 samples: about 2.7 passes over the 1,438 training digits
CUT = 4  # stage 0: unflatten, conv, BN, ReLU; stage 1: conv, BN, ReLU, pool, flatten, linear
# Bounds. The synchronous schedule with one chunk computes what one process computes (the
# same batches, weights and AdamW), so only floating-point rounding could differ: measured
# identical on this 2-core machine (accuracy 0.9721 both, buffer and parameter gaps 0). With two
# chunks the gradients are the same up to summation order, but BatchNorm normalizes each
# micro-batch of 16 by its own statistics instead of the batch of 32's, so the runs part a
# little. With the asynchronous schedule at four in flight, stage 0 steps between a
# micro-batch's forward and its backward (asynchronous-pipeline staleness), so the runs part
# (the schedule varies from run to run): in four runs accuracy 0.9721-0.9805 vs 0.9721,
# largest buffer gap 0.06-0.11 absolute, 0.13-0.20 relative (||pipeline - one process|| /
# ||one process|| of the worst buffer; the weights themselves differ by as much).
BOUNDS = {"sync1": (0.01, 1e-5), "sync2": (0.02, 0.5), "async4": (0.03, 0.5)}


def _cnn(seed: int) -> nn.Sequential:
    return seeded_module(lambda: nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 10)), seed)


def _one_process(seed: int) -> nn.Sequential:
    model = _cnn(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    shard = Shard(DIGITS.train, 0, 1, seed=seed)
    for _ in range(STEPS):
        x, y = shard.next_batch(BATCH)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.parametrize("schedule", ["sync1", "sync2", "async4"])
def test_a_batchnorm_cnn_trains_through_two_stages_as_in_one_process(schedule: str) -> None:
    alone = _one_process(CNN_SEED)
    model = _cnn(CNN_SEED)
    servers = _servers([model[:CUT], model[CUT:]],
                       ComputeConfig(learning_rate=LR, weight_decay=0.0, grad_clip=0.0))

    async def main() -> tuple[list[float], torch.Tensor, float]:
        losses, router = await _train(servers, DIGITS, STEPS, batch_size=BATCH, seed=CNN_SEED,
                                      schedule=schedule[:-1], chunks=int(schedule[-1]))
        try:
            x, _ = DIGITS.heldout.get_batch(torch.arange(len(DIGITS.heldout)))
            for stage in range(2):  # inference through the stages: eval mode, running statistics
                x = await router.infer(stage, "eval", x, Priority.INFERENCE_NORMAL)
            trainer = PipelineTrainer(router, DIGITS.train)
            heldout_loss = await trainer.evaluate(DIGITS.heldout, loss_fn_for(model), max_samples=359)
            return losses, x, heldout_loss
        finally:
            await _close(router, servers)

    losses, served_logits, heldout_loss = _run(main())
    joined = nn.Sequential(*servers[0].compute.layers, *servers[1].compute.layers)
    acc_pipeline, acc_alone = _accuracy(joined, DIGITS), _accuracy(alone, DIGITS)
    served_acc = float((served_logits.argmax(-1) == DIGITS.heldout.get_batch(
        torch.arange(len(DIGITS.heldout)))[1]).float().mean())
    mine, ref = joined.state_dict(), alone.state_dict()
    buffer_gap = max(float((mine[k] - ref[k]).abs().max()) for k in ref if "running" in k)
    relative_gap = max(float((mine[k] - ref[k]).norm() / ref[k].norm()) for k in ref if "running" in k)
    param_gap = max(float((p - q).detach().abs().max())
                    for p, q in zip(joined.parameters(), alone.parameters(), strict=True))
    print(f"{schedule}: one process: held-out accuracy {acc_alone:.4f}; "
          f"pipeline {acc_pipeline:.4f} "
          f"(served through the stages {served_acc:.4f}, held-out loss {heldout_loss:.4f}); "
          f"largest BN buffer gap {buffer_gap:.2e} ({relative_gap:.2e} relative), parameter gap "
          f"{param_gap:.2e}; "
          f"train loss {sum(losses[:10]) / 10:.3f} -> {sum(losses[-10:]) / 10:.3f}")
    assert len(losses) == STEPS * (int(schedule[-1]) if schedule.startswith("sync") else 1)
    assert acc_alone >= 0.9  # the reference itself learned
    accuracy_slack, buffer_bound = BOUNDS[schedule]
    assert acc_pipeline >= acc_alone - accuracy_slack
    assert relative_gap <= buffer_bound
    assert served_acc == acc_pipeline  # inference over the wire uses the trained buffers
    for k in ref:
        if k.endswith("num_batches_tracked"):
            # one count per BatchNorm forward: per micro-batch in the pipeline
            assert int(mine[k]) == len(losses) and int(ref[k]) == STEPS, k
        elif "running" in k:
            assert not torch.equal(ref[k], _cnn(CNN_SEED).state_dict()[k]), k  # they did move
