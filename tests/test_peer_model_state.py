"""Peer mode trains the user's model as one process would (swarmtrain/roles/peer/training.py):
buffers are part of the agreed state, only trained parameters move (and a parameter no peer
computed is not stepped at all), half-precision models train through float32 masters, and
the model lives on ``training.device`` (the CPU here: no accelerator on this machine).

Arithmetic is checked by driving Strategy objects directly and averaging their contributions
the way the trainer does; the rest on real PeerBackend rings over loopback."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
from swarmtrain.roles.peer.node import PeerTrainer
from swarmtrain.roles.peer.training import Contribution, DiLoCo, StepAveraging, Strategy
from swarmtrain.testing.local import free_ports, run_peer_trainers
from swarmtrain.transport.identity import Identity

pytestmark = pytest.mark.timeout(90)


# --- helpers ---------------------------------------------------------------------------------


def _average(works: Sequence[Contribution]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted mean of the contributions and of their flags, as PeerTrainer._reduce."""
    total = sum(w.weight for w in works)
    flat = sum(w.flat * w.weight for w in works) / total
    shares = sum((w.flags if w.flags is not None else torch.ones(0)) * w.weight for w in works) / total
    assert isinstance(flat, torch.Tensor) and isinstance(shares, torch.Tensor)
    return flat, shares


def _one_round(strategies: Sequence[Strategy]) -> list[Contribution]:
    works = [s.local_work() for s in strategies]
    flat, shares = _average(works)
    for s in strategies:
        s.apply_average(flat, shares)
    return works


def _train_on_ring(strategies: list[Strategy], rounds: int, run: str) -> list[PeerTrainer]:
    """``strategies`` trained by as many real peers on loopback for ``rounds`` rounds."""
    ports = free_ports(len(strategies))
    options = [PeerOptions(run=run, min_peers=len(ports), host="127.0.0.1", port=port, mdns=False,
                           static_peers=tuple(("127.0.0.1", p) for p in ports if p != port),
                           heartbeat_interval_sec=0.3, heartbeat_timeout_sec=5.0, propose_timeout_sec=1.0,
                           ring_timeout_sec=20.0, reform_timeout_sec=20.0) for port in ports]
    backends = [PeerBackend(o, secret=b"model-state-test-secret", identity=Identity.generate())
                for o in options]
    trainers = [PeerTrainer(b, s, max_rounds=rounds) for b, s in zip(backends, strategies)]
    run_peer_trainers(trainers, timeout=60, wait=20)  # re-raises a trainer's error
    for t in trainers:
        assert t.strategy.round == rounds
    return trainers


def _state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- a BatchNorm CNN on synthetic images ------------------------------------------------------

_PATTERNS = torch.zeros(3, 1, 8, 8)
_PATTERNS[0, 0, 2, :] = 1.0  # a horizontal bar
_PATTERNS[1, 0, :, 5] = 1.0  # a vertical bar
_PATTERNS[2, 0].fill_diagonal_(1.0)


def _images(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 3, (n,), generator=gen)
    x = 0.5 + 1.5 * _PATTERNS[y] + torch.randn(n, 1, 8, 8, generator=gen) * 1.2
    return x, y


def _cnn() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights everywhere
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(6 * 16, 3))


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _accuracy(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    was = model.training
    model.eval()
    with torch.no_grad():
        right = (model(data[0]).argmax(1) == data[1]).float().mean()
    model.train(was)
    return float(right)


def test_batchnorm_buffers_are_averaged_like_one_process_with_averaged_batch_statistics() -> None:
    """Pure arithmetic: running_mean ← (1−m)·b + m·Σwᵢμᵢ/Σwᵢ with wᵢ the samples, and the
    integer counter the rounded mean; a peer's buffers stay at the agreed value until then."""
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    batches = [_images(gens[0], 8), _images(gens[1], 24)]  # unequal weights: 8 and 24 samples
    peers = [StepAveraging(_cnn(), _ce, lambda b=b: b, lr=1e-2, weight_decay=0.0) for b in batches]
    bn = [p.model[1] for p in peers]
    start = _state_of(peers[0].model)
    with torch.no_grad():  # each peer's batch statistics of the BatchNorm input
        feats = [_cnn()[0](b[0]) for b in batches]
    works = [p.local_work() for p in peers]
    for p in peers:  # local work leaves the buffers as agreed (the change is in the contribution)
        assert torch.equal(p.model[1].running_mean, start["1.running_mean"])
        assert int(p.model[1].num_batches_tracked) == 0
    assert [w.weight for w in works] == [8.0, 24.0]
    flat, shares = _average(works)
    for p in peers:
        p.apply_average(flat, shares)
    mu = [f.mean(dim=(0, 2, 3)) for f in feats]
    var = [f.var(dim=(0, 2, 3), unbiased=True) for f in feats]
    m = bn[0].momentum
    assert m is not None
    want_mean = (1 - m) * start["1.running_mean"] + m * (8 * mu[0] + 24 * mu[1]) / 32
    want_var = (1 - m) * start["1.running_var"] + m * (8 * var[0] + 24 * var[1]) / 32
    for b in bn:
        assert torch.allclose(b.running_mean, want_mean, atol=1e-6)
        assert torch.allclose(b.running_var, want_var, atol=1e-5)
        assert int(b.num_batches_tracked) == 1 and b.num_batches_tracked.dtype == torch.int64
    assert torch.equal(bn[0].running_var, bn[1].running_var)
    # both boundary states carry every buffer (what a joiner loads from the donor)
    for strat in (peers[0], DiLoCo(_cnn(), _ce, lambda: batches[0], lr=1e-2, weight_decay=0.0)):
        ids = {id(t) for t in strat.boundary_state()}
        assert all(id(b) in ids for b in strat.model[1].buffers())


def test_two_peers_train_a_batchnorm_cnn_like_one_process() -> None:
    """2 peers × 16 samples a round vs one process × the same 32 samples: equal buffers on
    both peers (the second peer started with other buffers: the donor's were loaded), close to
    the one process's, and held-out accuracy alike."""
    rounds, size = 50, 16
    heldout = _images(torch.Generator().manual_seed(99), 600)

    def stream(seed: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        return lambda: _images(gen, size)

    peers: list[Strategy] = [StepAveraging(_cnn(), _ce, stream(s), lr=1e-2, weight_decay=1e-4)
                             for s in (11, 12)]
    with torch.no_grad():  # one peer's buffers start elsewhere: only a sync makes them agree
        peers[1].model[1].running_var.fill_(7.0)
        peers[1].model[1].num_batches_tracked.fill_(1000)
    before = _accuracy(_cnn(), heldout)
    trainers = _train_on_ring(peers, rounds, "bn-cnn")
    # one process on the union of the two peers' batches, round for round
    streams = [stream(11), stream(12)]

    def union() -> tuple[torch.Tensor, torch.Tensor]:
        parts = [s() for s in streams]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    alone = StepAveraging(_cnn(), _ce, union, lr=1e-2, weight_decay=1e-4)
    donor = trainers[0].strategy.model if int(peers[0].model[1].num_batches_tracked) == rounds else None
    if donor is None:  # peer 1 was the donor: the one process starts from its buffers too
        with torch.no_grad():
            alone.model[1].running_var.fill_(7.0)
            alone.model[1].num_batches_tracked.fill_(1000)
    for _ in range(rounds):
        _one_round([alone])
    states = [_state_of(t.strategy.model) for t in trainers]
    ref = _state_of(alone.model)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(states[0][name], states[1][name]), name
    assert int(states[0]["1.num_batches_tracked"]) == int(ref["1.num_batches_tracked"])
    assert int(states[0]["1.num_batches_tracked"]) in (rounds, rounds + 1000)
    # the weights themselves differ a little (BatchNorm normalises 16-sample batches there, 32
    # here), so do their statistics: each run's running statistics track its own model's
    # statistics on held-out data, and the two runs' are close
    for model, state in ((trainers[0].strategy.model, states[0]), (alone.model, ref)):
        with torch.no_grad():
            feats = model[0](heldout[0])
        assert torch.allclose(state["1.running_mean"], feats.mean(dim=(0, 2, 3)), atol=0.1)
        assert torch.allclose(state["1.running_var"], feats.var(dim=(0, 2, 3)), rtol=0.1)
    assert torch.allclose(states[0]["1.running_mean"], ref["1.running_mean"], atol=0.15)
    assert torch.allclose(states[0]["1.running_var"], ref["1.running_var"], rtol=0.05)
    acc_peers = [_accuracy(t.strategy.model, heldout) for t in trainers]
    acc_alone = _accuracy(alone.model, heldout)
    assert acc_peers[0] == acc_peers[1]
    assert acc_peers[0] > max(0.8, before + 0.3), (before, acc_peers, acc_alone)
    assert abs(acc_peers[0] - acc_alone) < 0.05, (acc_peers, acc_alone)
    print(f"held-out accuracy: before {before:.3f}, 2 peers {acc_peers[0]:.3f}, one process {acc_alone:.3f}")


# --- parameters nobody (or only some) computed; frozen ones ------------------------------------


class _Branchy(nn.Module):
    """A frozen embedding, a body always used, a branch used only when the batch says so, and
    a branch nobody uses (an unused LayerDrop layer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8).requires_grad_(False)
        self.body = nn.Linear(8, 2)
        self.branch = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.body(h) + self.branch(h) if use_branch else self.body(h)


def _branchy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, use = batch
    return ((model(x, use) - y) ** 2).mean()


def _branchy_batch(seed: int, n: int, use: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen), use


def _record_grads(strat: Strategy) -> list[list[torch.Tensor | None]]:
    """The gradients each AdamW step is given (recorded by a step pre-hook)."""
    seen: list[list[torch.Tensor | None]] = []

    def note(*_: Any) -> None:
        seen.append([m.grad.clone() if m.grad is not None else None for m in strat.masters])

    strat.inner.register_step_pre_hook(note)
    return seen


def test_a_parameter_a_peer_did_not_compute_counts_as_zeros_and_one_nobody_did_is_not_stepped() -> None:
    batches = [_branchy_batch(1, 8, True), _branchy_batch(2, 24, False)]
    peers = [StepAveraging(_Branchy(), _branchy_loss, lambda b=b: b, lr=0.05, weight_decay=0.1)
             for b in batches]
    seen = [_record_grads(p) for p in peers]
    start = _state_of(peers[0].model)
    # each peer's own gradients, computed independently
    own = []
    for b in batches:
        model = _Branchy()
        _branchy_loss(model, b).backward()
        own.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    _one_round(peers)
    names = list(peers[0].state.trainable)
    for s in seen:
        got = dict(zip(names, s[0]))
        # the body: the weighted mean over both; the branch: peer 0's gradient weighted by its
        # 8 of the round's 32 samples (peer 1 computed none there), as one process over all 32
        assert got["body.weight"] is not None and got["branch.weight"] is not None
        both = (8 * own[0]["body.weight"] + 24 * own[1]["body.weight"]) / 32
        assert torch.allclose(got["body.weight"], both, atol=1e-7)
        assert torch.allclose(got["branch.weight"], 8 * own[0]["branch.weight"] / 32, atol=1e-7)
        assert got["unused.weight"] is None and got["unused.bias"] is None  # nobody computed it
    for p in peers:
        now = _state_of(p.model)
        # not stepped: no decay (weight_decay 0.1 would have moved it), no Adam state either
        assert torch.equal(now["unused.weight"], start["unused.weight"])
        assert torch.equal(now["unused.bias"], start["unused.bias"])
        assert "exp_avg" not in p.inner.state[p.model.unused.weight]  # AdamW never saw it
        assert float(p.inner.state[p.model.branch.weight]["step"]) == 1.0
        assert not torch.equal(now["branch.weight"], start["branch.weight"])
        assert torch.equal(now["embed.weight"], start["embed.weight"])  # frozen
        assert all(t is not p.model.embed.weight for t in p.masters)  # never on the wire


def test_on_a_ring_frozen_and_unused_parameters_stay_bit_identical() -> None:
    rounds = 8
    peers: list[Strategy] = [
        StepAveraging(_Branchy(), _branchy_loss, lambda r=r: _branchy_batch(10 + r, 16, r == 0), lr=0.05,
                      weight_decay=0.1) for r in range(2)]
    start = _state_of(peers[0].model)
    trainers = _train_on_ring(peers, rounds, "branchy")
    states = [_state_of(t.strategy.model) for t in trainers]
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name  # every member alike
    for name in ("embed.weight", "embed.bias", "unused.weight", "unused.bias"):
        assert torch.equal(states[0][name], start[name]), name
    for t in trainers:
        assert float(t.strategy.inner.state[t.strategy.model.unused.weight]["step"]) == 0.0
        assert float(t.strategy.inner.state[t.strategy.model.branch.weight]["step"]) == rounds
    assert not torch.equal(states[0]["branch.weight"], start["branch.weight"])


# --- half precision --------------------------------------------------------------------------


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)


_TARGET = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


Batches = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _regression(dtype: torch.dtype, seed: int, n: int = 32) -> Batches:
    gen = torch.Generator().manual_seed(seed)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 4, generator=gen)
        return x.to(dtype), (x @ _TARGET).to(dtype)

    return batch


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y).float() ** 2).mean()


def test_a_bfloat16_model_trains_on_two_peers_through_float32_masters() -> None:
    rounds = 40
    peers: list[Strategy] = [StepAveraging(_mlp(torch.bfloat16), _mse, _regression(torch.bfloat16, s),
                                           lr=0.02, weight_decay=0.0) for s in (1, 2)]
    losses: list[list[float]] = [[], []]
    for i, s in enumerate(peers):
        step = s.local_work

        def noting(step: Callable[[], Contribution] = step, i: int = i) -> Contribution:
            work = step()
            losses[i].append(peers[i].last_loss)
            return work

        s.local_work = noting  # type: ignore[method-assign]
    start = [p.detach().clone() for p in peers[0].params]
    trainers = _train_on_ring(peers, rounds, "bf16")
    for t in trainers:
        s = t.strategy
        assert all(p.dtype == torch.bfloat16 for p in s.params)
        assert all(m.dtype == torch.float32 and m is not p for m, p in zip(s.masters, s.params))
        for p, m in zip(s.params, s.masters):
            assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the cast masters
        state = s.boundary_state()
        assert all(t.dtype == torch.float32 for t in state[:4 * len(s.masters)])  # masters, Adam
    for m0, m1 in zip(trainers[0].strategy.masters, trainers[1].strategy.masters):
        assert torch.equal(m0, m1)
    assert any(not torch.equal(a, b) for a, b in zip(start, trainers[0].strategy.params))
    first, last = sum(losses[0][:5]) / 5, sum(losses[0][-5:]) / 5
    assert last < 0.3 * first, (first, last)


def test_a_float16_model_scales_its_loss_and_an_overflowed_step_weighs_nothing() -> None:
    strat = StepAveraging(_mlp(torch.float16), _mse, _regression(torch.float16, 3), lr=0.02, weight_decay=0.0)
    assert strat.scaler.enabled
    strat.scaler.scale = 2.0**40  # certain to overflow float16
    work = strat.local_work()
    assert work.weight == 0.0 and work.samples == 0 and not work.flat.any()
    assert work.flags is not None and not work.flags.any()
    assert strat.scaler.scale == 2.0**39 and strat.scaler.overflows == 1
    strat.scaler.scale = 8.0
    masters = [m.detach().clone() for m in strat.masters]
    work = strat.local_work()
    assert work.weight == 32.0 and work.flat.dtype == torch.float32 and bool(torch.isfinite(work.flat).all())
    strat.apply_average(work.flat, work.flags if work.flags is not None else torch.ones(0))
    assert all(m.dtype == torch.float32 for m in strat.masters)
    assert any(not torch.equal(a, b) for a, b in zip(masters, strat.masters))
    for p, m in zip(strat.params, strat.masters):
        assert p.dtype == torch.float16 and torch.equal(p, m.to(torch.float16))


# --- DiLoCo ------------------------------------------------------------------------------------


def test_diloco_averages_the_buffers_at_each_outer_step() -> None:
    inner = 3
    data = [[_images(torch.Generator().manual_seed(50 + r * 10 + k), n) for k in range(inner)]
            for r, n in enumerate((8, 24))]

    def feed(batches: list[Any]) -> Callable[[], Any]:
        it: Iterator[Any] = iter(batches)
        return lambda: next(it)

    peers = [DiLoCo(_cnn(), _ce, feed(d), lr=1e-2, weight_decay=0.0, inner_steps=inner) for d in data]
    start = _state_of(peers[0].model)
    # what each peer's inner loop does to the buffers, replayed on a plain copy
    changes = []
    for d in data:
        model = copy.deepcopy(_cnn())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for b in d:
            opt.zero_grad()
            _ce(model, b).backward()
            opt.step()
        changes.append(model[1].running_mean - start["1.running_mean"])
    works = [p.local_work() for p in peers]
    for p in peers:  # the inner loop left them as agreed
        assert torch.equal(p.model[1].running_mean, start["1.running_mean"])
    assert [w.weight for w in works] == [24.0, 72.0]
    flat, shares = _average(works)
    for p in peers:
        p.apply_average(flat, shares)
    want = start["1.running_mean"] + (24 * changes[0] + 72 * changes[1]) / 96
    for p in peers:
        assert torch.allclose(p.model[1].running_mean, want, atol=1e-6)
        assert int(p.model[1].num_batches_tracked) == inner
    assert torch.equal(peers[0].model[1].running_var, peers[1].model[1].running_var)


def test_diloco_on_a_ring_ends_with_equal_buffers() -> None:
    rounds, inner = 3, 4
    peers: list[Strategy] = []
    for seed in (21, 22):
        gen = torch.Generator().manual_seed(seed)
        peers.append(DiLoCo(_cnn(), _ce, lambda g=gen: _images(g, 16), lr=1e-2, weight_decay=0.0,
                            inner_steps=inner))
    start = _state_of(peers[0].model)
    trainers = _train_on_ring(peers, rounds, "diloco-bn")
    states = [_state_of(t.strategy.model) for t in trainers]
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    assert int(states[0]["1.num_batches_tracked"]) == rounds * inner
    assert not torch.equal(states[0]["1.running_mean"], start["1.running_mean"])


def test_the_strategy_runs_on_the_named_device() -> None:
    """The CPU path of ``training.device`` (the only one this machine has): model and batches
    there, the contribution a float32 CPU buffer."""
    strat = StepAveraging(_mlp(torch.float32), _mse, _regression(torch.float32, 4), lr=0.02, weight_decay=0.0,
                          device="cpu")
    assert strat.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in strat.model.parameters())
    work = strat.local_work()
    assert work.flat.device.type == "cpu" and work.flat.dtype == torch.float32
    assert work.flat.numel() == sum(p.numel() for p in strat.params)


def test_peer_device_flag_reaches_the_strategy(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``swarmtrain peer --device cpu``: the flag sets ``training.device`` and build_peer puts
    the strategy (model and batches) there. Only the CPU exists on this machine."""
    from swarmtrain.app.cli import build_parser, config_overrides
    from swarmtrain.app.session import build_peer
    from swarmtrain.config import load_peer_config

    monkeypatch.setenv("SWARMTRAIN_HOME", str(tmp_path))
    args = build_parser().parse_args(["peer", "--task", "digits", "--device", "cpu", "--host", "127.0.0.1",
                                      "--port", "0", "--mode", "step"])
    cfg = load_peer_config(None, config_overrides(args))
    assert cfg.training.device == "cpu"
    _, trainer = build_peer(cfg)
    assert trainer.strategy.device == torch.device("cpu")
    assert trainer.strategy.local_work().flat.device.type == "cpu"
