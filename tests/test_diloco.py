"""DiLoCo (swarmtrain/roles/peer/training.py): the outer Nesterov step against its formula, and H by
wall time, where a fast peer does more inner steps than a slow one and counts for more."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
from swarmtrain.roles.peer.node import PeerTrainer
from swarmtrain.roles.peer.training import Contribution, DiLoCo, flatten
from swarmtrain.testing.local import free_ports, run_peer_trainers
from swarmtrain.transport.identity import Identity

pytestmark = pytest.mark.timeout(120)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batches(seed: int, size: int = 8) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return lambda: (torch.randn(size, 4, generator=gen), torch.randn(size, 2, generator=gen))


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_change() -> None:
    """Per DiLoCo (Douillard et al. 2023, Alg. 1) with torch's SGD(nesterov=True) semantics:
    Δ = θ_global − mean(θ_local); b ← μ·b + Δ; θ_global ← θ_global − lr·(Δ + μ·b), lr 0.7, μ 0.9.
    Two rounds, so the momentum carried from the first shows in the second."""
    torch.manual_seed(0)
    strat = DiLoCo(nn.Linear(4, 2), _loss, _batches(1), lr=0.05, weight_decay=0.0, inner_steps=3,
                   outer_lr=0.7, outer_momentum=0.9)
    theta = flatten(strat.global_params).double()
    plain = theta.clone()  # what momentum without Nesterov's look-ahead would give
    buf = torch.zeros_like(theta)
    other = torch.Generator().manual_seed(2)
    for r in range(2):
        work = strat.local_work()
        local = flatten(strat.params).double()
        assert work.steps == 3 and work.samples == 24 and work.weight == 24.0 and work.round == r
        assert torch.allclose(work.flat.double(), theta - local, atol=1e-7)  # the change: global − local
        peer_delta = torch.randn(work.flat.shape, generator=other) * 0.01  # another member's change
        mean = (work.flat * 24 + peer_delta * 40) / 64  # weighted by samples, as the trainer does
        delta = mean.double()
        buf = 0.9 * buf + delta
        theta = theta - 0.7 * (delta + 0.9 * buf)
        plain = plain - 0.7 * buf
        strat.apply(mean)
        assert strat.round == r + 1
        assert torch.allclose(flatten(strat.global_params).double(), theta, rtol=0, atol=1e-6)
        assert torch.allclose(flatten(strat.momentum).double(), buf, rtol=0, atol=1e-6)
        assert torch.equal(flatten(strat.params), flatten(strat.global_params))  # inner starts from it
    assert not torch.allclose(flatten(strat.global_params).double(), plain, atol=1e-4)


class _Recorded(DiLoCo):
    """DiLoCo noting each round's contribution and the mean it was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.contributions: dict[int, Contribution] = {}
        self.means: dict[int, torch.Tensor] = {}

    def local_work(self) -> Contribution:
        work = super().local_work()
        self.contributions[work.round] = work
        return work

    def apply(self, mean: torch.Tensor) -> None:
        self.means[self.round] = mean.clone()
        super().apply(mean)


def test_by_wall_time_a_fast_peer_does_more_inner_steps_and_weighs_more() -> None:
    rounds, speeds = 3, (1.0, 0.1)
    ports = free_ports(2)
    options = [PeerOptions(run="diloco-test", min_peers=2, host="127.0.0.1", port=port, mdns=False,
                           static_peers=tuple(("127.0.0.1", p) for p in ports if p != port),
                           heartbeat_interval_sec=0.3, heartbeat_timeout_sec=3.0, propose_timeout_sec=1.0,
                           ring_timeout_sec=10.0, reform_timeout_sec=15.0) for port in ports]
    backends = [PeerBackend(o, secret=b"diloco-test-secret", identity=Identity.generate()) for o in options]
    trainers = []
    for i, b in enumerate(backends):
        torch.manual_seed(0)
        # a heavier model, so the measured gradient time (what the throttle stretches) dominates a step
        model = nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 2))
        strat = _Recorded(model, _loss, _batches(10 + i, 64), lr=0.01, weight_decay=0.0, inner_seconds=0.4,
                          speed=speeds[i])
        trainers.append(PeerTrainer(b, strat, max_rounds=rounds))
    run_peer_trainers(trainers, timeout=60, wait=20)  # re-raises a trainer's error
    fast, slow = (t.strategy for t in trainers)
    assert isinstance(fast, _Recorded) and isinstance(slow, _Recorded)
    for r in range(rounds):
        f, s = fast.contributions[r], slow.contributions[r]
        assert f.steps > 2 * s.steps >= 2, (r, f.steps, s.steps)  # same wall time, more steps
        assert f.weight == f.samples == 64 * f.steps and s.weight == s.samples == 64 * s.steps
        expected = (f.flat * f.weight + s.flat * s.weight) / (f.weight + s.weight)
        assert torch.allclose(fast.means[r], expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(fast.means[r], slow.means[r])  # the same mean applied everywhere
        unweighted = (f.flat + s.flat) / 2
        assert not torch.allclose(fast.means[r], unweighted, rtol=1e-3, atol=1e-6)
    assert trainers[0].inner_steps > 2 * trainers[1].inner_steps
    assert torch.equal(flatten(fast.global_params), flatten(slow.global_params))
