"""Learning-rate schedules (``[training] lr_schedule``, ``warmup_updates``, ``min_lr_ratio``):
the factors are torch's own schedulers', and the coordinator steps its Adam with them exactly
as one process with ``torch.optim.lr_scheduler`` does, across a checkpoint and resume."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.config import load_coordinator_config
from swarmtrain.core.schedule import LRSchedule
from swarmtrain.errors import ConfigError
from swarmtrain.roles.ps.common import pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.tasks import DigitsTask
from swarmtrain.wire import Gradients
from tests.test_coordinator_state import make_coordinator, record

pytestmark = pytest.mark.timeout(60)

TASK = DigitsTask()
DATA = TASK.load_data()
LR = 3e-3


def torch_schedule(opt: torch.optim.Optimizer, kind: str, total: int, warmup: int,
                   floor: float) -> torch.optim.lr_scheduler.LRScheduler:
    """The same schedule built from torch's schedulers, stepped once per update."""
    sched = torch.optim.lr_scheduler
    decay: sched.LRScheduler
    if kind == "cosine":
        decay = sched.CosineAnnealingLR(opt, T_max=total - 1 - warmup, eta_min=floor * LR)
    elif kind == "linear":
        decay = sched.LinearLR(opt, start_factor=1.0, end_factor=floor, total_iters=total - 1 - warmup)
    else:
        decay = sched.ConstantLR(opt, factor=1.0, total_iters=0)
    if not warmup:
        return decay
    ramp = sched.LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return sched.SequentialLR(opt, [ramp, decay], milestones=[warmup])


@pytest.mark.parametrize(("kind", "warmup", "floor"), [
    ("cosine", 0, 0.0), ("cosine", 10, 0.1), ("linear", 0, 0.0), ("linear", 7, 0.25), ("constant", 12, 0.0)])
def test_the_factors_are_torch_schedulers_stepped_once_per_update(kind: str, warmup: int,
                                                                  floor: float) -> None:
    total = 60
    ours = LRSchedule(kind, total, warmup, floor)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    theirs = torch_schedule(opt, kind, total, warmup, floor)
    for step in range(total):
        assert ours.factor(step) * LR == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-15), step
        opt.step()
        theirs.step()
    assert ours.factor(0) == (1 / warmup if warmup else 1.0)
    end = 1.0 if kind == "constant" else floor
    # past the last update it stays there (torch's cosine would climb back: it is periodic)
    assert all(ours.factor(step) == pytest.approx(end) for step in (total - 1, total, 10 * total))


def _coordinator(tmp_path: Path, kind: str, **over: Any) -> Coordinator:
    return make_coordinator(tmp_path, **{"training.lr_schedule": kind, "training.max_steps": 40,
                                         "training.warmup_updates": 5, "training.min_lr_ratio": 0.1,
                                         "checkpointing.interval": 0, **over})


def _gradient(model: torch.nn.Module, step: int, version: int) -> Gradients:
    gen = torch.Generator().manual_seed(step)
    idx = torch.randint(0, len(DATA.train), (32,), generator=gen)
    model.zero_grad(set_to_none=True)
    TASK.loss(model, DATA.train.get_batch(idx)).backward()
    codec = make_codec("none")
    codecs, tensors = pack_compressed({n: codec.compress(p.grad) for n, p in model.named_parameters()
                                       if p.grad is not None})
    return Gradients(msg_id=step + 1, version=version, samples=32, loss=1.0, codecs=codecs, tensors=tensors)


def test_the_coordinator_follows_one_process_with_torchs_scheduler_through_a_resume(tmp_path: Path) -> None:
    """40 updates of the digits model, cosine after a 5-update warm-up to 0.1 x: the
    coordinator's weights are one process's (torch Adam + SequentialLR) at every update,
    also after a checkpoint at update 20 and a resume in a new coordinator; and with the
    schedule left at 'constant' they are not (the comparison can fail)."""
    coord = _coordinator(tmp_path, "cosine")
    flat = _coordinator(tmp_path / "flat", "constant")
    ref = TASK.build_model()
    ref.load_state_dict({n: p.detach().clone() for n, p in coord.params.items()})
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    sched = torch_schedule(opt, "cosine", 40, 5, 0.1)
    rec, rec_flat = record(coord), record(flat)
    for step in range(40):
        if step == 20:
            assert asyncio.run(coord.checkpoint()).ok
            coord = _coordinator(tmp_path, "cosine")
            assert coord.checkpointer is not None and coord.checkpointer.restore(coord)
            rec = coord.workers["w"]
            coord._snapshot_for(rec)
            assert coord.version == 20
        assert coord.learning_rate() == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9)
        msg = _gradient(ref, step, coord.version)
        assert coord._apply_gradient(rec, msg)[0] == "applied"
        assert flat._apply_gradient(rec_flat, _gradient(ref, step, flat.version))[0] == "applied"
        opt.step()
        sched.step()
        for name, p in ref.named_parameters():
            assert torch.allclose(coord.params[name], p, atol=1e-6), (step, name)
    gap = max(float((flat.params[n].detach() - p.detach()).abs().max()) for n, p in ref.named_parameters())
    assert gap > 1e-3, gap
    assert coord.status()["learning_rate"] == pytest.approx(0.1 * LR)


def test_a_decaying_schedule_without_a_run_length_is_refused_saying_what_to_set() -> None:
    with pytest.raises(ConfigError,
                       match="max_steps, which is 0 .run until stopped.*lr_schedule = 'constant'"):
        load_coordinator_config(overrides={"training.lr_schedule": "cosine"})
    with pytest.raises(ConfigError, match="not more than training.warmup_updates"):
        load_coordinator_config(overrides={"training.lr_schedule": "linear", "training.max_steps": 10,
                                           "training.warmup_updates": 10})
    # a warm-up alone needs no run length
    cfg = load_coordinator_config(overrides={"training.warmup_updates": 10})
    assert cfg.training.schedule().factor(4) == 0.5 and cfg.training.schedule().factor(10 ** 6) == 1.0


def test_a_peer_steps_its_adamw_with_the_schedule_by_round_as_one_process() -> None:
    """Peer mode: the round counter travels with the agreed state and sets the inner AdamW's
    rate; one member alone follows torch's AdamW + SequentialLR, and DiLoCo's inner steps of
    a round share that round's rate."""
    from swarmtrain.config import load_peer_config
    from swarmtrain.roles.peer.training import DiLoCo, StepAveraging
    from tests.test_peer_model_state import _average

    cfg = load_peer_config(overrides={"training.lr_schedule": "linear", "training.max_rounds": 30,
                                      "training.warmup_updates": 4, "training.min_lr_ratio": 0.2})
    schedule = cfg.training.schedule()
    gen = torch.Generator().manual_seed(3)
    batches = [DATA.train.get_batch(torch.randint(0, len(DATA.train), (32,), generator=gen))
               for _ in range(30)]
    it = iter(batches)
    peer = StepAveraging(TASK.build_model(), TASK.loss, lambda: next(it), lr=LR, weight_decay=0.01,
                         schedule=schedule)
    ref = TASK.build_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    sched = torch_schedule(opt, "linear", 30, 4, 0.2)
    for batch in batches:
        assert peer.learning_rate == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9)
        peer.apply_average(*_average([peer.local_work()]))
        opt.zero_grad()
        TASK.loss(ref, batch).backward()
        opt.step()
        sched.step()
    assert peer.round == 30
    for (name, p), q in zip(peer.model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name

    diloco = DiLoCo(TASK.build_model(), TASK.loss, lambda: batches[0], lr=LR, weight_decay=0.0,
                    inner_steps=2, schedule=schedule)
    for r in range(6):
        diloco.apply_average(*_average([diloco.local_work()]))
        assert diloco.inner.param_groups[0]["lr"] == pytest.approx(LR * schedule.factor(r)), r
    with pytest.raises(ConfigError, match="training.max_rounds, which is 0"):
        load_peer_config(overrides={"training.lr_schedule": "cosine"})
