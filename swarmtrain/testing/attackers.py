"""Crafted insiders for the robustness tests and benchmark (``docs/robustness.md``): a worker
and a peer strategy that hold the cluster secret, speak the protocol correctly, and alter
what they contribute before it is sent — real TCP, a real coordinator or ring.

Attacks (:data:`ATTACKS`), each on the member's honest gradient ``g`` (or DiLoCo delta):

- ``scaled``: ``100 g``;
- ``sign_flip``: ``-10 g``;
- ``growing``: ``1.3**k g`` on its ``k``-th contribution (no single one far from the last);
- ``huge_samples``: ``-g`` claiming ``2**20`` samples per gradient (the most a worker may
  register as its batch; a peer claims them as its weight): what sample weighting trusts;
- ``ratchet``: ``g`` rescaled to norm ``1e-4 x 30**k``, capped at ``1e18`` (issue #17).

:func:`run_ps` and :func:`run_peers` run a task (digits by default) with :data:`HONEST`
honest members (shards 0..3 of 5) and, optionally, one attacker on shard 4 — in this process,
over loopback — for ``tests/test_robust.py`` and ``benchmarks/bench_robust.py``. A task is
anything with ``build_model()``, ``loss(model, batch)``, ``load_data()`` and
``evaluate(model, data)`` (:class:`~swarmtrain.tasks.DigitsTask`'s names).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

from swarmtrain.config import load_coordinator_config, load_worker_config
from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
from swarmtrain.roles.peer.node import PeerTrainer
from swarmtrain.roles.peer.training import Contribution, DiLoCo, StepAveraging, Strategy
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.tasks import DigitsTask
from swarmtrain.tasks.base import Shard
from swarmtrain.testing.local import free_ports, run_peer_trainers
from swarmtrain.transport.identity import Identity

__all__ = ["ATTACKS", "HONEST", "AttackingWorker", "attack_factor", "attacked_strategy",
           "run_peers", "run_ps"]

HONEST = 4
"""Honest members of the digits runs; with the attacker, 1 of 5 lies."""

ATTACKS = ("scaled", "sign_flip", "growing", "huge_samples", "ratchet")

HUGE_SAMPLES = 1 << 20  # the wire's bound on a registered batch size


def attack_factor(attack: str, k: int, norm: float) -> float:
    """What the ``k``-th contribution (norm ``norm``) is multiplied by under ``attack``."""
    if attack == "scaled":
        return 100.0
    if attack == "sign_flip":
        return -10.0
    if attack == "growing":
        return 1.3 ** min(k, 150)  # 1.3**150 ~ 1e17: stays finite in float32
    if attack == "huge_samples":
        return -1.0
    if attack == "ratchet":
        return min(1e-4 * 30.0**k, 1e18) / max(norm, 1e-30)
    raise ValueError(f"unknown attack {attack!r}; one of {ATTACKS}")


class AttackingWorker(Worker):
    """A :class:`~swarmtrain.roles.ps.worker.Worker` that alters each gradient before sending
    it (``attack`` from :data:`ATTACKS`; the ``none`` codec). Same arguments as a Worker
    plus ``attack``."""

    def __init__(self, *args: Any, attack: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; one of {ATTACKS}")
        self.attack = attack
        self.sent = 0
        if attack == "huge_samples":  # registered as its batch, so the claims pass the cap
            self._largest_batch = HUGE_SAMPLES

    def _compute(self) -> Any:
        out, loss, samples, seconds, residual, changes = super()._compute()
        if not out:
            return out, loss, samples, seconds, residual, changes
        norm = math.sqrt(sum(float(c.parts["values"].double().pow(2).sum()) for c in out.values()))
        factor = attack_factor(self.attack, self.sent, norm)
        self.sent += 1
        out = {n: replace(c, parts={"values": c.parts["values"] * factor}) for n, c in out.items()}
        if self.attack == "huge_samples":
            samples = HUGE_SAMPLES
        return out, loss, samples, seconds, residual, changes


def attacked_strategy(strategy: Strategy, attack: str) -> Strategy:
    """Make ``strategy`` (a peer's :class:`StepAveraging` or :class:`DiLoCo`) contribute
    attacked work: its ``local_work`` is wrapped in place; returns the same object."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; one of {ATTACKS}")
    honest = strategy.local_work
    count = [0]

    def local_work() -> Contribution:
        work = honest()
        factor = attack_factor(attack, count[0], float(work.flat.double().norm()))
        count[0] += 1
        weight = float(HUGE_SAMPLES) if attack == "huge_samples" else work.weight
        return replace(work, flat=work.flat * factor, weight=weight)

    strategy.local_work = local_work  # type: ignore[method-assign]
    return strategy



_TASK = DigitsTask()
_SECRET = b"robust-secret"


def run_ps(robust: str, attack: str | None, *, budget: int = 25_600, lr: float = 3e-3,
           batch: int = 32, aggregate_samples: int = 128, task: Any = None,
           timeout: float = 120.0) -> tuple[dict[str, float], Coordinator]:
    """A coordinator with ``training.robust = robust`` and :data:`HONEST` workers (``batch``),
    plus an :class:`AttackingWorker` if ``attack``, until the honest workers' applied samples
    reach ``budget`` (so attacked and clean runs compare at equal honest samples).

    Returns:
        The held-out metrics of the final weights, and the (closed) coordinator.
    """
    task = task or _TASK
    data = task.load_data()

    async def main() -> Coordinator:
        cfg = load_coordinator_config(overrides={
            "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
            "training.learning_rate": lr, "training.eval_interval_sec": 1000.0,
            "training.min_workers": HONEST + (attack is not None), "training.num_shards": HONEST + 1,
            "training.robust": robust, "training.aggregate_samples": aggregate_samples})
        c = Coordinator(task.build_model(), cfg, task_name="robust", secret=_SECRET)
        await c.start()

        def config(i: int) -> Any:
            return load_worker_config(overrides={
                "network.coordinator_port": c.port, "hardware.num_threads": 1,
                "training.batch_size": batch, "training.accumulation_steps": 1,
                "network.reconnect_attempts": 0, "training.probe_seconds": 0.1,
                "training.worker_id": f"w{i}", "data.shard_index": i})

        workers = [Worker(task.build_model(), task.loss, data.train, config(i), task_name="robust",
                          secret=_SECRET) for i in range(HONEST)]
        if attack is not None:
            workers.append(AttackingWorker(task.build_model(), task.loss, data.train, config(HONEST),
                                           task_name="robust", secret=_SECRET, attack=attack))
        tasks = [asyncio.create_task(w.run_async()) for w in workers]

        async def stop_at_budget() -> None:
            while sum(c.workers[f"w{i}"].samples for i in range(HONEST) if f"w{i}" in c.workers) < budget:
                await asyncio.sleep(0.01)
            c.request_shutdown("honest sample budget reached")

        watch = asyncio.create_task(stop_at_budget())
        try:
            await asyncio.wait_for(c.run(), timeout)
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        finally:
            watch.cancel()
            await c.close()
        return c

    c = asyncio.run(main())
    c.sync_model()
    return dict(task.evaluate(c.model, data)), c


class _Batches:
    """Batches of ``size`` from one shard."""

    def __init__(self, shard: Shard, size: int) -> None:
        self.shard, self.size = shard, size

    def __call__(self) -> Any:
        return self.shard.next_batch(self.size)






def run_peers(robust: str, attack: str | None, *, rounds: int = 100, mode: str = "step",
              lr: float = 3e-3, batch: int = 32, inner_steps: int = 10, task: Any = None,
              timeout: float = 120.0) -> tuple[dict[str, float], list[PeerTrainer]]:
    """:data:`HONEST` peers (``batch``) on a real ring with ``robust``, plus one whose
    contributions are attacked if ``attack``, for ``rounds`` rounds of ``mode`` (``step`` or
    ``diloco`` with ``inner_steps``): same honest samples with or without the attacker.

    Returns:
        Rank 0's held-out metrics at the end, and the trainers (their backends closed).
    """
    task = task or _TASK
    data = task.load_data()
    n = HONEST + (attack is not None)
    ports = free_ports(n)
    options = [PeerOptions(run="robust-digits", min_peers=n, host="127.0.0.1", port=port, mdns=False,
                           static_peers=tuple(("127.0.0.1", p) for p in ports if p != port),
                           heartbeat_interval_sec=0.3, heartbeat_timeout_sec=5.0, propose_timeout_sec=2.0,
                           ring_timeout_sec=20.0, reform_timeout_sec=20.0) for port in ports]
    backends = [PeerBackend(o, secret=_SECRET, identity=Identity.generate()) for o in options]
    trainers = []
    for i, b in enumerate(backends):
        batches = _Batches(Shard(data.train, i, HONEST + 1), batch)
        model = task.build_model()
        strat: Strategy = (StepAveraging(model, task.loss, batches, lr=lr, weight_decay=0.0)
                           if mode == "step" else
                           DiLoCo(model, task.loss, batches, lr=lr, weight_decay=0.0,
                                  inner_steps=inner_steps))
        if i == HONEST and attack is not None:
            attacked_strategy(strat, attack)
        trainers.append(PeerTrainer(b, strat, max_rounds=rounds, robust=robust))
    run_peer_trainers(trainers, timeout)
    return dict(task.evaluate(trainers[0].strategy.model, data)), trainers
