"""The parameter server trains the user's whole model state: buffers, frozen and unused
parameters, half-precision dtypes, and each worker's own data order (issue #15).

Coordinator and workers run in one process over loopback TCP (port 0); each test compares
with what one plain PyTorch process does with the same model."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from swarmtrain.app.export import export_model
from swarmtrain.config import load_coordinator_config, load_worker_config
from swarmtrain.roles.ps.common import FUSED
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.tasks import DigitsTask
from swarmtrain.testing.turns import ComputeTurns
from tests.test_ps_inprocess import _run

TASK = DigitsTask()
DATA = TASK.load_data()
SECRET = b"model-state-secret"


class BNNet(nn.Module):
    """A small residual CNN with BatchNorm on the 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8).to(self.fc.weight.dtype)
        x = F.relu(self.b1(self.c1(x)))
        x = F.max_pool2d(F.relu(self.b2(self.c2(x)) + x), 2)
        return self.fc(x.flatten(1))


class Branchy(nn.Module):
    """A frozen first layer and a branch used only on some batches (as LayerDrop does)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(64, 32)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.frozen(x))
        if x.shape[0] % 2:  # odd batches skip the branch: it gets no gradient then
            h = h + torch.relu(self.branch(h))
        return self.head(h)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def accuracy(model: nn.Module) -> float:
    x, y = DATA.heldout.get_batch(torch.arange(len(DATA.heldout)))
    was = model.training
    model.eval()
    with torch.no_grad():
        out = float((model(x.to(next(model.parameters()).dtype)).argmax(1) == y).float().mean())
    model.train(was)
    return out


def coordinator(model: nn.Module, **over: Any) -> Coordinator:
    cfg = load_coordinator_config(overrides={
        "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
        "training.learning_rate": 3e-3, "training.eval_interval_sec": 60.0, **over})
    return Coordinator(model, cfg, evaluate=lambda m: {"accuracy": accuracy(m)}, secret=SECRET)


def worker(port: int, model: nn.Module, data: Any = None, **over: Any) -> Worker:
    cfg = load_worker_config(overrides={
        "network.coordinator_port": port, "training.batch_size": 32, "network.reconnect_attempts": 0,
        "training.probe_seconds": 0.0, "training.accumulation_steps": 1, **over})
    return Worker(model, loss_fn, DATA.train if data is None else data, cfg, secret=SECRET)


async def _train(coord: Coordinator, workers: list[Worker], timeout: float = 90) -> None:
    await _run(coord, workers, timeout)


def one_process(model: nn.Module, steps: int, lr: float = 3e-3, batch: int = 32, **adam: Any) -> nn.Module:
    """The yardstick: the same model, torch's Adam, the same samples, one process."""
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, **adam)
    for _ in range(steps):
        idx = torch.randint(0, len(DATA.train), (batch,), generator=gen)
        opt.zero_grad()
        loss_fn(model, DATA.train.get_batch(idx)).backward()
        opt.step()
    return model


@pytest.mark.timeout(120)
def test_batchnorm_model_keeps_its_statistics_and_exports_them(tmp_path: Any) -> None:
    torch.manual_seed(0)
    init = BNNet()
    steps = 240
    plain = one_process(copy.deepcopy(init), steps)
    coord = coordinator(copy.deepcopy(init), **{"training.max_steps": steps, "training.min_workers": 2})
    workers: list[Worker] = []

    async def main() -> None:
        await coord.start()
        # no overlap: staleness stays ~1, so this compares buffers, not asynchrony
        workers.extend(worker(coord.port, copy.deepcopy(init), **{"training.worker_id": f"bn{i}",
                                                                  "training.max_inflight": 0})
                       for i in range(2))
        await _train(coord, workers)

    asyncio.run(main())
    # the running statistics moved on the coordinator, and count every batch of every worker
    # (a gradient may land between reaching max_steps and the shutdown: count what was applied)
    assert coord.version >= steps
    assert int(coord.model.b1.num_batches_tracked) == coord.version == coord.stats["applied"]
    assert not torch.allclose(coord.model.b1.running_var, torch.ones(8))
    # eval-mode accuracy of the coordinator's model (its statistics, not the init's) as one process
    assert accuracy(coord.model) >= accuracy(plain) - 0.03, (accuracy(coord.model), accuracy(plain))
    assert coord.metrics["accuracy"] == pytest.approx(accuracy(coord.model))
    # Worker.run() returned holding the coordinator's final state, buffers included
    for w in workers:
        for (k, a), b in zip(coord.model.state_dict().items(), w.model.state_dict().values()):
            assert torch.equal(a, b), k
    path = export_model(coord.model, tmp_path / "model.safetensors")
    fresh = BNNet()
    fresh.load_state_dict(load_file(str(path)), strict=True)
    assert accuracy(fresh) == accuracy(coord.model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_trains_on_float32_masters(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    init = TASK.build_model().to(dtype)
    before = accuracy(init)
    steps = 150
    coord = coordinator(copy.deepcopy(init), **{"training.max_steps": steps})

    async def main() -> Worker:
        await coord.start()
        # no overlap: each gradient on the weights of the update before, whatever the load (with
        # a gradient in flight on a busy machine the staleness varied, and so did the accuracy:
        # 0.84 once in CI, 0.89-0.94 with two busy loops beside it, 0.91-0.94 quiet). Its
        # sample order is the same every run (it once followed the generated worker id: 0.90 once
        # in CI, bar 0.917).
        w = worker(coord.port, copy.deepcopy(init), **{"training.max_inflight": 0})
        await _train(coord, [w])
        return w

    w = asyncio.run(main())
    assert coord.status()["stats"]["rejected"] == 0
    assert all(p.dtype == torch.float32 for p in coord.params.values())  # masters
    assert all(p.dtype == dtype for p in coord.model.parameters())
    # against one float32 process at as many samples (0.919-0.953 over 20 sample orders)
    plain = accuracy(one_process(copy.deepcopy(init).float(), steps))
    assert accuracy(coord.model) >= max(plain - 0.03, before + 0.3), (accuracy(coord.model), plain)
    # the worker holds exactly the masters rounded to the model's dtype
    for name, p in w.model.named_parameters():
        assert torch.equal(p, coord.params[name].to(dtype)), name


def _worker_overrides(port: int) -> dict[str, Any]:
    return {"network.coordinator_port": port, "training.batch_size": 32, "network.reconnect_attempts": 0,
            "training.probe_seconds": 0.0, "training.accumulation_steps": 1}


@pytest.mark.timeout(120)
def test_frozen_and_unused_parameters_do_not_move_or_travel() -> None:
    torch.manual_seed(0)
    init = Branchy()
    coord = coordinator(copy.deepcopy(init), **{"training.max_steps": 60, "training.weight_decay": 0.1})
    branch_moves: list[bool] = []

    class Recorder(Worker):
        def _compute(self) -> Any:
            out = super()._compute()
            # (a fused entry carries every parameter: only a step where all got a gradient)
            branch_moves.append("branch.weight" in out[0] or FUSED in out[0])
            return out

    # batches of 31 and 32 alternate: the branch gets a gradient on odd ones only
    sizes = iter([31, 32] * 1000)

    class Alternating:
        def __iter__(self) -> Iterator[Any]:
            while True:
                idx = torch.randint(0, len(DATA.train), (next(sizes),))
                yield DATA.train.get_batch(idx)

    async def main() -> Recorder:
        await coord.start()
        cfg = load_worker_config(overrides=_worker_overrides(coord.port))
        w = Recorder(copy.deepcopy(init), loss_fn, Alternating(), cfg, secret=SECRET)
        await _train(coord, [w])
        return w

    w = asyncio.run(main())
    assert torch.equal(coord.model.frozen.weight, init.frozen.weight)  # not stepped, not decayed
    assert "frozen.weight" not in coord.params
    # messages that carried the branch's gradient (the computations are sent in order; one
    # computed when SHUTDOWN came is never sent)
    sent = branch_moves[:w.steps]
    assert len(sent) == w.steps and len(branch_moves) <= w.steps + 1
    with_branch = sum(sent)
    assert 0 < with_branch < w.steps, (with_branch, w.steps)
    # the wire carried only what was computed: never the frozen layer, the branch only when used
    nbytes = {n: p.numel() * 4 for n, p in init.named_parameters()}
    trained = nbytes["branch.weight"] + nbytes["branch.bias"] + nbytes["head.weight"] + nbytes["head.bias"]
    branch = nbytes["branch.weight"] + nbytes["branch.bias"]
    assert w.bytes_up == w.steps * trained - (w.steps - with_branch) * branch


@pytest.mark.timeout(60)
def test_an_unused_parameter_is_not_stepped_as_torch_does() -> None:
    """A parameter with no gradient in a message keeps its value and its Adam moments, exactly
    as torch's Adam skips a parameter whose ``grad`` is None."""
    torch.manual_seed(0)
    init = Branchy()
    coord = coordinator(copy.deepcopy(init))
    ref = copy.deepcopy(init)
    opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=3e-3)
    x, y = DATA.train.get_batch(torch.arange(31))  # odd: the branch is used
    x2, y2 = DATA.train.get_batch(torch.arange(32))  # even: it is not
    from swarmtrain.compression import make_codec
    from swarmtrain.roles.ps.common import pack_compressed
    from swarmtrain.roles.ps.coordinator import WorkerRecord
    from swarmtrain.wire import Gradients

    codec = make_codec("none")
    rec = WorkerRecord("w", "", {}, 32, 0.0, [0])
    for msg_id, (bx, by) in enumerate([(x, y), (x2, y2)], start=1):
        opt.zero_grad(set_to_none=True)
        loss_fn(ref, (bx, by)).backward()
        grads = {n: codec.compress(p.grad) for n, p in ref.named_parameters() if p.grad is not None}
        opt.step()
        codecs, tensors = pack_compressed(grads)
        msg = Gradients(msg_id=msg_id, version=coord.version, samples=32, loss=1.0, codecs=codecs,
                        tensors=tensors)
        assert coord._apply_gradient(rec, msg)[0] == "applied"
    for name, p in ref.named_parameters():
        assert torch.allclose(coord.params.get(name, p), p, atol=1e-7), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ids", [("a", "b"), ("", "")], ids=["given-ids", "generated-ids"])
def test_workers_from_the_same_script_see_different_batches_and_leave_the_host_rng_alone(
        ids: tuple[str, str]) -> None:
    seen: dict[str, list[torch.Tensor]] = {}
    coord = coordinator(TASK.build_model(), **{"training.max_steps": 40, "training.min_workers": 2})

    class Spy(Worker):
        def _next_batch(self) -> Any:
            batch = super()._next_batch()
            seen.setdefault(self.worker_id, []).append(batch[1].clone())
            return batch

    async def main() -> tuple[torch.Tensor, torch.Tensor]:
        await coord.start()
        workers = []
        for wid in ids:
            torch.manual_seed(0)  # what each user script does first
            loader = DataLoader(TensorDataset(*DATA.train.get_batch(torch.arange(len(DATA.train)))),
                                batch_size=32, shuffle=True)
            cfg = load_worker_config(overrides={**_worker_overrides(coord.port), "training.worker_id": wid})
            workers.append(Spy(TASK.build_model(), loss_fn, loader, cfg, secret=SECRET))
        host_state = torch.get_rng_state()
        await _train(coord, workers)
        return host_state, torch.get_rng_state()

    host_before, host_after = asyncio.run(main())
    assert torch.equal(host_before, host_after)  # no draw from the host program's generator
    a, b = seen.values()
    n = min(len(a), len(b))
    assert n >= 10
    same = sum(torch.equal(x, y) for x, y in zip(a[:n], b[:n]))
    assert same == 0, f"{same} of {n} batches were identical"


def _first_batches(kind: str) -> tuple[str, list[torch.Tensor]]:
    """The generated id of one worker and the labels of its first batches, in a run with
    ``training.seed`` 0 and no worker id given: ``kind`` "loader" feeds it a shuffling DataLoader
    (the worker's own stream), "dataset" the task's dataset (the shard the coordinator assigns)."""
    seen: list[torch.Tensor] = []
    coord = coordinator(TASK.build_model(), **{"training.max_steps": 12})

    class Spy(Worker):
        def _next_batch(self) -> Any:
            batch = super()._next_batch()
            seen.append(batch[1].clone())
            return batch

    async def main() -> Worker:
        await coord.start()
        torch.manual_seed(0)
        data: Any = DATA.train
        if kind == "loader":
            data = DataLoader(TensorDataset(*DATA.train.get_batch(torch.arange(len(DATA.train)))),
                              batch_size=32, shuffle=True)
        cfg = load_worker_config(overrides={**_worker_overrides(coord.port), "training.seed": 0})
        w = Spy(TASK.build_model(), loss_fn, data, cfg, secret=SECRET)
        await _train(coord, [w])
        return w

    return asyncio.run(main()).worker_id, seen[:10]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["loader", "dataset"])
def test_a_worker_without_an_id_draws_the_same_batches_in_every_run_of_one_seed(kind: str) -> None:
    # A generated id ("w-" and random hex) seeded the worker's stream and its shards' orders,
    # so no two runs of the same seed drew the same batches. The stream now follows the seed and
    # the worker's number at the coordinator (the order workers first joined in).
    id_1, first = _first_batches(kind)
    id_2, second = _first_batches(kind)
    assert id_1 != id_2  # the ids are still generated, one per run
    assert len(first) == len(second) == 10
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.timeout(60)
def test_workers_sharing_a_shard_walk_it_in_different_orders() -> None:
    a = worker(7100, TASK.build_model(), **{"training.worker_id": "a"})  # never connects
    b = worker(7100, TASK.build_model(), **{"training.worker_id": "b"})
    for w in (a, b):
        w._use_shards([0], 1)
    first = [a._next_batch()[1] for _ in range(5)]
    second = [b._next_batch()[1] for _ in range(5)]
    assert not any(torch.equal(x, y) for x, y in zip(first, second))


@pytest.mark.timeout(60)
def test_concurrent_registrations_lose_no_shard_reassignment() -> None:
    """Three workers register at once on 3 shards: every shard ends up held, each by the
    worker the coordinator says holds it, whatever order the welcomes interleave in."""
    coord = coordinator(TASK.build_model(), **{"training.num_shards": 3, "training.min_workers": 3,
                                               "training.max_steps": 30})
    workers: list[Worker] = []

    async def main() -> None:
        await coord.start()
        workers.extend(worker(coord.port, TASK.build_model(), **{"training.worker_id": f"r{i}"})
                       for i in range(3))
        await _train(coord, workers)

    asyncio.run(main())
    held = sorted(s for w in workers for s in w.shards)
    assert held == [0, 1, 2]
    for w in workers:
        assert w.shards == coord.workers[w.worker_id].shards


def test_gradient_window_counts_a_parameter_a_gradient_left_out_as_zeros() -> None:
    """The window's mean is the gradient of the mean loss over all its samples, as one
    process computes it over one batch: a batch that skipped a branch added zeros for it
    (averaging over the carriers only stepped LayerDrop's blocks with half-sized batches at
    full weight, and its held-out accuracy spread twice as wide as one process's)."""
    from swarmtrain.roles.aggregation import GradientWindow

    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    w = GradientWindow(params)
    w.add({"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([4.0, 4.0])}, 1.0, 8, sparse=False)
    w.add({"a": torch.tensor([3.0, 3.0])}, 3.0, 24, sparse=False)  # "b" unused on this batch
    assert w.samples == 32 and w.gradients == 2
    mean, sparse = w.take()
    assert torch.allclose(mean["a"], torch.tensor([2.5, 2.5]))  # (1*1 + 3*3) / 4
    assert torch.allclose(mean["b"], torch.tensor([1.0, 1.0]))  # (1*4 + 3*0) / 4, not 4
    assert not sparse and w.samples == 0
    assert w.take()[0] == {}  # an empty window steps nothing


@pytest.mark.timeout(120)
def test_bounded_asynchrony_steps_once_per_window_on_fresh_gradients() -> None:
    """aggregate_samples = 32 and two workers of 16: one update per two gradients, and the
    held answers make both gradients of a window computed on the same weights. A window may
    take a third: when one worker is late past the hold, the other is answered, sends again on
    the same weights, and the window then waits for the late one, who is due (by design:
    ``aggregate_wait``). Quiet runs apply 200-201 gradients, 200-202 with two busy loops beside
    them, and 205 came with the whole suite running beside those; a bar of 202 failed there."""
    coord = coordinator(TASK.build_model(), **{"training.max_steps": 100, "training.min_workers": 2,
                                               "training.aggregate_samples": 32})
    workers: list[Worker] = []

    async def main() -> None:
        await coord.start()
        workers.extend(worker(coord.port, TASK.build_model(), **{"training.worker_id": f"g{i}",
                                                                 "training.batch_size": 16})
                       for i in range(2))
        await _train(coord, workers)

    asyncio.run(main())
    st = coord.status()
    assert coord.version == 100
    assert 200 <= st["stats"]["applied"] <= 210  # two gradients of 16 per update of 32
    fresh = st["staleness_counts"].get("0", 0) / st["stats"]["applied"]
    assert fresh >= 0.8, st["staleness_counts"]
    assert all(not w.overlaps() for w in workers)  # a window would always be missed
    assert accuracy(coord.model) > 0.85


def _staleness_by_worker(wait: float, speeds: list[float], aggregate: int, steps: int = 60, *,
                         slots: list[int] | None = None,
                         hold: float = 1.0) -> tuple[Coordinator, list[float]]:
    """Workers of 16 samples at ``speeds`` (a wall-clock throttle), or whose steps cost
    ``slots`` compute turns each (a virtual clock: :class:`ComputeTurns`; it stands still
    while a worker waits, so it cannot model windows that wait for a slow worker), windows of
    ``aggregate`` samples: the coordinator and each worker's mean staleness."""
    coord = coordinator(TASK.build_model(), **{
        "training.max_steps": steps, "training.min_workers": len(speeds),
        "training.aggregate_samples": aggregate, "training.aggregate_wait": wait,
        "training.aggregate_hold": hold})
    workers: list[Worker] = []

    async def main() -> None:
        await coord.start()
        names = [f"s{i}" for i in range(len(speeds))]
        turns = ComputeTurns(names, done=lambda: coord.finished or coord.version >= steps)
        for name, speed, n in zip(names, speeds, slots or [0] * len(names)):
            cfg = load_worker_config(overrides={
                "network.coordinator_port": coord.port, "training.batch_size": 16,
                "network.reconnect_attempts": 0, "training.probe_seconds": 0.0,
                "training.accumulation_steps": 1, "training.worker_id": name, "training.speed": speed})
            workers.append(Worker(TASK.build_model(), turns.loss(name, n, loss_fn) if slots else loss_fn,
                                  DATA.train, cfg, secret=SECRET))
        await _train(coord, workers)

    asyncio.run(main())
    recs = [coord.workers[f"s{i}"] for i in range(len(speeds))]
    return coord, [r.staleness_total / max(1, r.steps) for r in recs]


@pytest.mark.timeout(120)
def test_a_window_waits_for_the_workers_due_on_its_weights_so_none_lands_stale() -> None:
    """Five workers of 16 and windows of 64: four gradients fill a window, and the fifth,
    computed on the same weights and due a moment later, used to land stale in the next
    window (and its worker stayed out of phase: 44 % of the gradients were stale on a tiny
    GPT-2, 1.1x the held-out loss of four workers). Waiting for it keeps every window whole.
    Whether the fifth is due is a race of step times a millisecond long: fresh fractions were
    0.97-0.99 on a quiet box and 0.89-0.96 (20 runs) with two busy loops beside it, and the
    clean-clone CI drew 0.894 against a bar of 0.9 on one run. The bar is on three runs' mean,
    halfway between the bug's 0.56 and the loaded box's worst."""
    fresh, applied, versions = 0, 0, 0
    for _ in range(3):
        coord, _ = _staleness_by_worker(0.5, [1.0] * 5, 64)
        st = coord.status()
        fresh += st["staleness_counts"].get("0", 0)
        applied += st["stats"]["applied"]
        versions += coord.version
    assert fresh / applied >= 0.8, (fresh, applied)
    assert applied >= 4.5 * versions  # mostly windows of all five


@pytest.mark.timeout(120)
def test_a_window_does_not_wait_for_a_slow_worker_unless_told_to() -> None:
    """At the default ``aggregate_wait`` (half a median step) a worker at a fifth of the
    speed is not due, so the fast ones' windows close without it and its gradients land
    damped in later ones; with a wait of 10 steps it is due, and every window waits for it,
    and with an ``aggregate_hold`` of 10 steps the fast ones wait with it, so everyone computes
    on fresh weights. (With the default hold of one step, the fast ones are answered while the
    window waits, compute again on the same weights, and whichever gradient is in flight when
    the window closes lands stale: their staleness then depends on the phase, 0.13-0.57 over
    six runs, and a bar on it failed one run in three.)
    Without the wait the speeds are compute turns, not a wall-clock throttle: under load a
    throttle's sleep does not stretch while the others' computing does, and on a loaded CI
    run the "fifth" came close enough that the slow worker's staleness fell to 0.17 (0.42 on
    a box with two busy loops beside it). With it, turns would stand still while the fast
    ones' answers are held, so there the throttle stays (the wait only grows under load)."""
    _, default = _staleness_by_worker(0.5, [1.0] * 3, 32, slots=[1, 1, 5])
    _, patient = _staleness_by_worker(10.0, [1.0, 1.0, 0.2], 32, hold=10.0)
    assert default[2] >= 0.5, default  # the slow one: about a window behind on average
    assert max(patient) <= 0.2, patient  # everyone (nearly) fresh (0.00-0.07 in four runs)


def test_a_dtype_that_cannot_train_is_refused_naming_the_parameter() -> None:
    from swarmtrain.errors import ConfigError

    model = nn.Linear(2, 2)
    model.register_parameter("phase", nn.Parameter(torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(ConfigError, match="'phase' is torch.complex64"):
        coordinator(model)


@pytest.mark.timeout(120)
def test_checkpoint_resume_and_export_carry_buffers_and_half_precision_masters(tmp_path: Any) -> None:
    """A bf16 BatchNorm model: train, checkpoint, resume into a fresh coordinator; its
    buffers, float32 masters and model come back exactly, and `swarmtrain export` writes a
    file that loads strictly into a fresh model."""
    from swarmtrain.app.export import export_checkpoint
    from swarmtrain.roles.ps.checkpointing import CoordinatorCheckpointer

    torch.manual_seed(0)
    init = BNNet().to(torch.bfloat16)
    coord = coordinator(copy.deepcopy(init), **{"training.max_steps": 60})
    coord.checkpointer = CoordinatorCheckpointer(str(tmp_path / "ck"), interval=0, keep=2)

    async def main() -> None:
        await coord.start()
        await _train(coord, [worker(coord.port, copy.deepcopy(init))])

    asyncio.run(main())  # the shutdown writes a checkpoint
    again = coordinator(BNNet().to(torch.bfloat16))
    again.checkpointer = CoordinatorCheckpointer(str(tmp_path / "ck"), interval=0, keep=2)
    assert again.checkpointer.restore(again)
    assert again.version == coord.version == 60
    for name, master in coord.params.items():
        assert master.dtype == torch.float32 and torch.equal(again.params[name], master), name
    again.sync_model()
    for (k, a), b in zip(coord.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert int(again.model.b1.num_batches_tracked) == 60
    out, _ = export_checkpoint(tmp_path / "ck", tmp_path / "model.safetensors")
    fresh = BNNet().to(torch.bfloat16)
    fresh.load_state_dict(load_file(str(out)), strict=True)
    assert accuracy(fresh) == accuracy(coord.model)
