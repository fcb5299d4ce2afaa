"""Adam under top-k: the coordinator holds the second moment for sparse gradients.

Plain Adam moves a weight that error feedback sends once in T steps (as one late sum) about
sqrt(T) times less far than dense training; after the dense warm-up the coordinator holds the
second moment for top-k gradients so the update is linear in the gradient. These tests pin
the rule down: dense steps are plain Adam and counted, sparse ones follow the held formula
(with its cap and its zero-variance guard), nothing changes before a dense step or with
``sparse_variance = "update"``, and a checkpoint keeps the count.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from swarmtrain.app.ops.metrics import CoordinatorCollector
from swarmtrain.compression import make_codec
from swarmtrain.roles.ps.adam import (
    HELD_MAX_RATIO,
    VARIANCE_STEPS,
    adam_step,
    held_variance_step,
    is_sparse,
    make_adam,
)
from swarmtrain.roles.ps.common import pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.wire import Gradients
from tests.test_coordinator_state import make_coordinator, record

BETAS, EPS, LR = (0.9, 0.999), 1e-8, 1e-2


def _adam(p: torch.Tensor, weight_decay: float = 0.0) -> torch.optim.Adam:
    return make_adam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)


def _dense_steps(opt: torch.optim.Adam, p: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g in grads:
        p.grad = g.clone()
        assert not adam_step(opt, LR, sparse=False, hold=True)


def test_a_held_step_follows_the_formula_and_leaves_the_second_moment_alone() -> None:
    torch.manual_seed(0)
    p = torch.randn(50, requires_grad=True)
    opt = _adam(p)
    _dense_steps(opt, p, [torch.randn(50) for _ in range(3)])
    state = opt.state[p]
    assert state[VARIANCE_STEPS] == 3.0
    m0, v0, w0 = state["exp_avg"].clone(), state["exp_avg_sq"].clone(), p.detach().clone()
    g = torch.zeros(50)
    g[[3, 17, 40]] = torch.tensor([0.5, -2.0, 0.01])  # what top-k lets through
    p.grad = g
    assert held_variance_step(opt, LR)
    assert torch.equal(state["exp_avg_sq"], v0)  # held, bit for bit
    m = BETAS[0] * m0 + (1 - BETAS[0]) * g
    torch.testing.assert_close(state["exp_avg"], m)
    assert float(state["step"]) == 4.0
    ratio = (m / (1 - BETAS[0] ** 4)) / ((v0 / (1 - BETAS[1] ** 3)).sqrt() + EPS)
    expected = w0 - LR * ratio.clamp(-HELD_MAX_RATIO, HELD_MAX_RATIO)
    torch.testing.assert_close(p.detach(), expected)
    # the weights top-k left out still move by their momentum, as in a dense step
    assert not torch.equal(p.detach()[0], w0[0])


def test_a_late_sum_moves_a_weight_as_far_as_its_parts_would_have() -> None:
    """The reason for holding: T steps' gradient arriving as one sum (error feedback) moves the
    weight as far as T dense steps do; plain Adam, once the sums dominate its second moment,
    moves it ~sqrt(T) times less."""
    T, periods, g = 20, 100, 0.01

    def travel(hold: bool, late: bool) -> float:
        p = torch.zeros(1, requires_grad=True)
        opt = _adam(p)
        _dense_steps(opt, p, [torch.full((1,), g)] * 50)  # the warm-up teaches v ~ g^2
        start = float(p.detach())
        for t in range(T * periods + 100):  # then long enough for the momentum to die out
            busy = t < T * periods
            value = (T * g if t % T == T - 1 else 0.0) if late else g
            p.grad = torch.full((1,), value if busy else 0.0)
            assert adam_step(opt, LR, sparse=True, hold=hold) == hold
        return start - float(p.detach())

    dense, held_late, plain_late = travel(True, False), travel(True, True), travel(False, True)
    assert held_late == pytest.approx(dense, rel=0.05)
    assert plain_late < dense / 2  # what the rule fixes (sqrt(20) ~ 4.5 at steady state)


def test_no_weight_moves_more_than_the_cap_in_one_step() -> None:
    p = torch.zeros(4, requires_grad=True)
    opt = _adam(p)
    _dense_steps(opt, p, [torch.full((4,), 1e-6)])  # tiny while dense...
    before = p.detach().clone()
    p.grad = torch.tensor([1.0, -1.0, 0.0, 1e-6])  # ...then large
    assert held_variance_step(opt, LR)
    moved = (p.detach() - before).abs()
    assert float(moved.max()) == pytest.approx(LR * HELD_MAX_RATIO)
    assert float(moved[3]) < LR * HELD_MAX_RATIO


def test_a_weight_with_no_variance_yet_takes_its_gradients_square() -> None:
    p = torch.zeros(2, requires_grad=True)
    opt = _adam(p)
    _dense_steps(opt, p, [torch.tensor([1.0, 0.0])])  # the second weight never saw a gradient
    p.grad = torch.tensor([0.0, 0.5])
    assert held_variance_step(opt, LR)
    v = opt.state[p]["exp_avg_sq"]
    bias = 1 - BETAS[1]
    assert float(v[1]) == pytest.approx(0.25 * bias)  # bias-corrected: v_hat = 0.25
    # step: m_hat / sqrt(v_hat) = (0.1 * 0.5 / (1 - 0.9^2)) / 0.5, well under the cap
    assert float(p.detach()[1]) == pytest.approx(-LR * (0.05 / 0.19) / 0.5, rel=1e-4)


def test_nothing_is_held_before_a_dense_step() -> None:
    p = torch.zeros(3, requires_grad=True)
    opt = _adam(p)
    p.grad = torch.ones(3)
    assert not held_variance_step(opt, LR)
    assert not opt.state[p] and float(p.detach().abs().max()) == 0.0


def _gradient(c: Coordinator, msg_id: int, codec_name: str) -> Gradients:
    codec = make_codec(codec_name, topk_ratio=0.01, min_compress_numel=256)
    torch.manual_seed(msg_id)
    grads = {n: torch.randn_like(p) * 0.01 for n, p in c.params.items()}
    codecs, tensors = pack_compressed({n: codec.compress(t) for n, t in grads.items()})
    return Gradients(msg_id=msg_id, version=c.version, samples=32, loss=1.0, codecs=codecs,
                     tensors=tensors)


def _topk_gradient(c: Coordinator, msg_id: int) -> Gradients:
    return _gradient(c, msg_id, "topk")


def _fp16_gradient(c: Coordinator, msg_id: int) -> Gradients:
    """What a worker sends in the dense part of the warm-up."""
    g = _gradient(c, msg_id, "fp16")
    assert not is_sparse(g.codecs)
    return g


@pytest.mark.parametrize("setting", ["hold", "update"])
def test_the_coordinator_holds_only_for_sparse_gradients_after_dense_ones(setting: str) -> None:
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0,
                                                  "training.sparse_variance": setting})
    plain = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0,
                                                      "training.sparse_variance": "update"})
    rec, rec_plain = record(c), record(plain)
    # a top-k gradient before any dense one: plain Adam, not counted as teaching the variance
    for coord, r in ((c, rec), (plain, rec_plain)):
        assert is_sparse(_topk_gradient(coord, 1).codecs)
        assert coord._apply_gradient(r, _topk_gradient(coord, 1))[0] == "applied"
    assert all(torch.equal(c.params[n], plain.params[n]) for n in c.params)
    first = c.optimizer.state[next(iter(c.params.values()))]
    assert VARIANCE_STEPS not in first and c.held_variance_steps == 0
    for i in (2, 3):  # two dense gradients: plain Adam, counted
        for coord, r in ((c, rec), (plain, rec_plain)):
            assert coord._apply_gradient(r, _fp16_gradient(coord, i))[0] == "applied"
    assert first[VARIANCE_STEPS] == 2.0
    assert all(torch.equal(c.params[n], plain.params[n]) for n in c.params)
    v_before = {n: c.optimizer.state[p]["exp_avg_sq"].clone() for n, p in c.params.items()}
    for coord, r in ((c, rec), (plain, rec_plain)):
        assert coord._apply_gradient(r, _topk_gradient(coord, 4))[0] == "applied"
    held = all(torch.equal(c.optimizer.state[p]["exp_avg_sq"], v_before[n])
               for n, p in c.params.items())
    same_as_plain = all(torch.equal(c.params[n], plain.params[n]) for n in c.params)
    if setting == "hold":
        assert held and not same_as_plain and c.held_variance_steps == 1
        assert c.status()["held_variance_steps"] == 1
        held_series = [m for m in CoordinatorCollector(c.status).collect()
                       if m.name == "swarmtrain_held_variance_steps"]
        assert [s.value for s in held_series[0].samples] == [1.0]
    else:
        assert not held and same_as_plain and c.held_variance_steps == 0
    assert first[VARIANCE_STEPS] == 2.0  # sparse steps never count


def test_a_checkpoint_keeps_the_count_and_resumes_holding(tmp_path: Path) -> None:
    a = make_coordinator(tmp_path)
    rec = record(a)
    for i in range(1, 4):
        a._apply_gradient(rec, _fp16_gradient(a, i))
    a._apply_gradient(rec, _topk_gradient(a, 4))
    assert asyncio.run(a.checkpoint()).ok
    b = make_coordinator(tmp_path)
    assert b.checkpointer.restore(b)
    pb = next(iter(b.params.values()))
    assert b.optimizer.state[pb][VARIANCE_STEPS] == 3.0
    rec_b = b.workers["w"]
    b._snapshot_for(rec_b)
    for i in (5, 6):  # and the next sparse steps are the same on both, bit for bit
        a._apply_gradient(rec, _topk_gradient(a, i))
        b._apply_gradient(rec_b, _topk_gradient(b, i))
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
    assert b.held_variance_steps == 2


def test_weight_decay_is_decoupled_on_dense_steps() -> None:
    """``training.weight_decay`` is AdamW's: a zero gradient shrinks every weight by exactly
    lr * wd (L2 folded into the gradient would move it by ~lr instead, Adam's first step)."""
    wd = 0.1
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0,
                                                  "training.weight_decay": wd})
    rec = record(c)
    before = {n: p.detach().clone() for n, p in c.params.items()}
    g = _fp16_gradient(c, 1)
    g = Gradients(msg_id=1, version=c.version, samples=32, loss=1.0, codecs=g.codecs,
                  tensors={n: torch.zeros_like(t) for n, t in g.tensors.items()})
    assert c._apply_gradient(rec, g)[0] == "applied"
    for n, p in c.params.items():  # staleness 0, one worker: lr undamped, weight 1
        torch.testing.assert_close(p.detach(), before[n] * (1 - c.base_lr * wd))


def test_weight_decay_is_decoupled_on_held_steps() -> None:
    wd = 0.1
    p = torch.ones(4, requires_grad=True)
    opt = _adam(p, weight_decay=wd)
    _dense_steps(opt, p, [torch.zeros(4)])  # zero gradient: only the decay moves p
    torch.testing.assert_close(p.detach(), torch.full((4,), 1 - LR * wd))
    p.grad = torch.zeros(4)
    assert held_variance_step(opt, LR)
    torch.testing.assert_close(p.detach(), torch.full((4,), (1 - LR * wd) ** 2))
