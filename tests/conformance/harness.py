"""One harness for every mode: train a :class:`Case` in one plain PyTorch process, through
the parameter server, in peer mode (per-step averaging or DiLoCo) or through the pipeline,
at the same number of training samples, and hand back the trained state to compare.

Every mode returns an :class:`Outcome`: the held-out metrics of a *fresh* model loaded from
the state the mode hands back (the exported file for the parameter server, rank 0's model
in peer mode, the stages' layers put back together for the pipeline), that state itself,
and the samples and seconds it took. :func:`state_problems` lists what is wrong with such a
state: keys missing from ``model.state_dict()``, a strict load failing, frozen parameters
that moved, BatchNorm statistics still at their initial values, tied weights that came apart.

Roles run in this process over real loopback TCP (port 0, or ports bound just before);
every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.tasks import Shard, TaskData, evaluation_mode
from swarmtrain.testing.local import free_ports, run_peer_trainers

__all__ = ["Case", "Outcome", "free_ports", "state_problems", "train_one_process", "train_peer",
           "train_pipeline", "train_ps"]

SECRET = b"conformance-suite-secret"
SEED = 0  # every mode builds its models from this seed
#: how long one distributed training run may take before it counts as hung: a ResNet pipeline
#: run took ~35 s on the clean-clone CI and 98 s on a machine at half that speed with the
#: suite beside it (fused Adam 62-85 steps/s against 145), against the 90 s this was
HANG_GUARD_S = 240.0
Logits = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """A model as a user brings it, with its data and a training budget.

    Attributes:
        name: how tests and tables name it.
        build: ``build(seed) -> model``, a pure function of the seed.
        data: ``data() -> TaskData`` whose splits' ``get_batch`` give ``(inputs, targets)``.
        logits: ``logits(model, inputs)``: (B, classes) for ``classify``, (B, T, vocab) for ``lm``.
        kind: ``classify`` (metric: accuracy, higher is better) or ``lm`` (metric: mean
            next-token loss, lower is better).
        lr: Adam's learning rate, the same in every mode.
        batch_size: samples per update in one process (and per gradient in the parameter
            server; peers take half each, so a round has the same samples).
        steps: updates in one process; every mode trains on ``steps * batch_size`` samples.
        buffers: the model has BatchNorm statistics (checked to have moved).
        repeats: distributed runs the bar averages. A model that draws from torch's global
            generator in training (LayerDrop) gets other draws in each distributed run: its
            members share this process's generator from threads, in arrival order. One run is
            then one sample of a spread as wide as one process's over seeds (LayerDrop: sd
            0.012 vs 0.009 over 8 runs), so its bar is on the mean of ``repeats`` runs. Five
            for LayerDrop: through the parameter server its runs spread with sd 0.012 around
            0.962 (45 runs on a quiet box), and on the loaded CI box a mean of three fell to
            0.934 (0.905, 0.972, 0.925), under the bar of 0.937; the mean of five has 0.77 of
            that spread.
        timing_repeats: parameter-server runs the bar averages (at least ``repeats``). There
            each run's course depends on which worker's gradient lands first, so each run is
            one sample of a spread like one process's over seeds; a case whose held-out metric
            dips for a few steps at a time needs more than one. BERT does: post-LN BERT under
            Adam at near-zero loss has gradient spikes (norms 5-18 against a median of
            0.01-0.03), and one process over six seeds dipped to 0.947, 0.977 and 0.984 at
            checkpoints 10 steps apart in its last 100 steps. 24 parameter-server runs here
            ended at 0.994-1.0 (mean 0.998), and one on the loaded CI box at 0.967, a dip
            under the bar of 0.97 for a single run; a mean of three stays over it with one
            such dip in it.
    """

    name: str
    build: Callable[[int], nn.Module]
    data: Callable[[], TaskData]
    logits: Logits
    kind: Literal["classify", "lm"]
    lr: float
    batch_size: int
    steps: int
    buffers: bool = False
    repeats: int = 1
    timing_repeats: int = 1

    @property
    def ps_repeats(self) -> int:
        """Parameter-server runs the bar averages: ``timing_repeats``, at least ``repeats``."""
        return max(self.repeats, self.timing_repeats)

    @property
    def metric(self) -> str:
        return "accuracy" if self.kind == "classify" else "loss"

    @property
    def higher_is_better(self) -> bool:
        return self.kind == "classify"

    @property
    def samples(self) -> int:
        return self.steps * self.batch_size

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy (computed in float32 whatever the model's dtype)."""
        x, y = batch
        out = self.logits(model, x).float()
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module, data: TaskData, max_samples: int = 512) -> dict[str, float]:
        """Held-out ``{"loss", "accuracy"}`` on the first ``max_samples`` samples, in eval mode."""
        n = min(len(data.heldout), max_samples)
        total, correct, count = 0.0, 0, 0
        with evaluation_mode(model):
            for lo in range(0, n, 128):
                x, y = data.heldout.get_batch(torch.arange(lo, min(n, lo + 128)))
                out = self.logits(model, x).float()
                out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
                total += float(F.cross_entropy(out, y, reduction="sum"))
                correct += int((out.argmax(-1) == y).sum())
                count += y.numel()
        return {"loss": total / count, "accuracy": correct / count}


@dataclass
class Outcome:
    """What one training run handed back.

    Attributes:
        mode: ``one-process``, ``ps``, ``peer-step``, ``peer-diloco`` or ``pipeline``.
        metrics: held-out metrics of a fresh model loaded (non-strictly) from ``state``.
        state: the trained state the mode hands back, by ``state_dict`` key.
        samples: training samples consumed (all machines together).
        seconds: wall time of the training, start-up included.
        replicas: other copies the mode holds (workers' or other peers' ``state_dict``).
        models: the models those copies live in (the workers'), for checks on the modules.
        load_error: why ``state`` did not load into a fresh model with ``strict=True`` ("" if it did).
        extra: mode-specific figures (updates, rounds, ...).
    """

    mode: str
    metrics: dict[str, float]
    state: dict[str, torch.Tensor]
    samples: int
    seconds: float
    replicas: list[dict[str, torch.Tensor]] = field(default_factory=list)
    models: list[nn.Module] = field(default_factory=list)
    load_error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.nan


def _finish(case: Case, data: TaskData, mode: str, state: Mapping[str, torch.Tensor], samples: int,
            seconds: float, **kw: Any) -> Outcome:
    fresh = case.build(SEED + 1)  # other initial values: whatever loads must overwrite them
    state = {k: v.detach().clone() for k, v in state.items()}
    try:
        fresh.load_state_dict(state, strict=True)
        load_error = ""
    except (RuntimeError, KeyError, ValueError) as exc:
        load_error = str(exc).splitlines()[0][:300]
        fresh.load_state_dict(state, strict=False)
    return Outcome(mode, case.evaluate(fresh, data), state, samples, seconds, load_error=load_error, **kw)


# --- (a) one plain PyTorch process ----------------------------------------------------------


def train_one_process(case: Case, data: TaskData | None = None, *, chunks: int = 1) -> Outcome:
    """The reference: ``torch.optim.Adam``, ``case.steps`` updates of ``case.batch_size``. With
    ``chunks``, each update accumulates the mean of ``chunks`` micro-batches' gradients, drawn
    one after the other (what the synchronous pipeline schedule computes: BatchNorm then
    normalises each micro-batch on its own)."""
    data = data or case.data()
    model = case.build(SEED)
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=case.lr)
    shard = Shard(data.train, 0, 1, seed=SEED)
    torch.manual_seed(SEED)  # dropout and LayerDrop draw from the global generator
    micro = case.batch_size // chunks
    if micro * chunks != case.batch_size:
        raise ValueError(f"{case.name}: batch {case.batch_size} does not split into {chunks} micro-batches")
    started = time.monotonic()
    for _ in range(case.steps):
        opt.zero_grad(set_to_none=True)
        if chunks == 1:
            case.loss(model, shard.next_batch(case.batch_size)).backward()
        else:
            for _ in range(chunks):
                (case.loss(model, shard.next_batch(micro)) / chunks).backward()
        opt.step()
    seconds = time.monotonic() - started
    mode = "one-process" if chunks == 1 else f"one-process, {chunks} micro-batches"
    return _finish(case, data, mode, model.state_dict(), case.samples, seconds)


# --- (b) parameter server -------------------------------------------------------------------


def train_ps(case: Case, data: TaskData | None = None, *, workers: int = 2, timeout: float = HANG_GUARD_S,
             window: bool = True, coordinator_overrides: dict[str, Any] | None = None) -> Outcome:
    """A ``Coordinator`` and ``workers`` ``Worker``\\ s in one event loop over loopback TCP;
    ``case.steps`` updates of ``case.batch_size`` samples each are applied. With ``window``
    (bounded asynchrony, the documented setting for quality: ``aggregate_samples`` = the batch)
    each worker computes ``batch / workers`` samples per gradient and the coordinator steps
    once per ``batch`` samples; without it every gradient of ``batch`` samples is an update.
    The state is the file ``swarmtrain.app.export.export_model`` writes from the coordinator's model.
    ``coordinator_overrides``: more config keys for the coordinator alone (e.g. its downlink)."""
    from safetensors.torch import load_file

    from swarmtrain import Coordinator, Worker
    from swarmtrain.app.export import export_model

    data = data or case.data()
    worker_batch = max(1, case.batch_size // workers) if window else case.batch_size
    coord = Coordinator(case.build(SEED), host="127.0.0.1", port=0, learning_rate=case.lr,
                        max_steps=case.steps, min_workers=workers, eval_interval_sec=3600.0,
                        aggregate_samples=case.batch_size if window else 0,
                        secret=SECRET, **{"checkpointing.interval": 0,  # type: ignore[arg-type]
                                          **(coordinator_overrides or {})})
    ws: list[Worker] = []

    async def main() -> None:
        await coord.start()
        try:
            # each worker starts from other weights: the coordinator's must reach it
            ws.extend(Worker(case.build(SEED + 10 + i), case.loss, data.train, host="127.0.0.1",
                             port=coord.port, batch_size=worker_batch, accumulation_steps=1,
                             num_threads=1, probe_seconds=0.0, reconnect_attempts=0, worker_id=f"w{i}",
                             secret=SECRET) for i in range(workers))
            tasks = [asyncio.create_task(w.run_async()) for w in ws]
            await asyncio.wait_for(coord.run(), timeout)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            await coord.close()

    started = time.monotonic()
    asyncio.run(main())
    seconds = time.monotonic() - started
    with tempfile.TemporaryDirectory() as tmp:
        path = export_model(coord.model, Path(tmp) / "model.safetensors", task=case.name,
                            version=coord.version)
        state = load_file(path)
    applied = coord.stats["applied"]
    return _finish(case, data, "ps", state, applied * worker_batch, seconds,
                   replicas=[w.model.state_dict() for w in ws],
                   models=[w.model for w in ws],
                   extra={"updates": coord.version, "applied": applied, "workers": workers,
                          "downlink": coord.downlink.summary()})


# --- (c) peer mode --------------------------------------------------------------------------




def train_peer(case: Case, data: TaskData | None = None, *, mode: Literal["step", "diloco"] = "step",
               peers: int = 2, inner_steps: int = 10, outer_lr: float = 0.7, outer_momentum: float = 0.9,
               timeout: float = HANG_GUARD_S) -> Outcome:
    """``peers`` ``PeerBackend``\\ s on loopback (static peers, no mDNS), each with a
    ``PeerTrainer``. Every peer draws ``batch_size / peers`` samples per step from its own
    shard, so a step of all peers together has the samples of one update in one process:

    - ``step``: ``case.steps`` rounds, each one averaged gradient and one Adam step;
    - ``diloco``: ``case.steps / inner_steps`` rounds of ``inner_steps`` inner Adam steps.

    The state is rank 0's ``model.state_dict()``; the other peers' are ``replicas``."""
    from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
    from swarmtrain.roles.peer.node import PeerTrainer
    from swarmtrain.roles.peer.training import DiLoCo, StepAveraging
    from swarmtrain.transport.identity import Identity

    data = data or case.data()
    if case.batch_size % peers:
        raise ValueError(f"batch size {case.batch_size} does not split over {peers} peers")
    per_peer = case.batch_size // peers
    rounds = case.steps if mode == "step" else max(1, case.steps // inner_steps)
    ports = free_ports(peers)
    backends = [PeerBackend(PeerOptions(
        run=f"conformance-{case.name}", min_peers=peers, host="127.0.0.1", port=port, mdns=False,
        static_peers=tuple(("127.0.0.1", p) for p in ports if p != port), heartbeat_interval_sec=0.3,
        heartbeat_timeout_sec=5.0, propose_timeout_sec=1.0, ring_timeout_sec=30.0, reform_timeout_sec=30.0),
        secret=SECRET, identity=Identity.generate()) for port in ports]
    trainers = []
    for i, backend in enumerate(backends):
        model = case.build(SEED)
        shard = Shard(data.train, i, peers, seed=SEED)
        next_batch = lambda shard=shard: shard.next_batch(per_peer)  # noqa: E731
        if mode == "step":
            strategy: Any = StepAveraging(model, case.loss, next_batch, lr=case.lr, weight_decay=0.0)
        else:
            strategy = DiLoCo(model, case.loss, next_batch, lr=case.lr, weight_decay=0.0,
                              inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum)
        trainers.append(PeerTrainer(backend, strategy, max_rounds=rounds))
    started = time.monotonic()
    run_peer_trainers(trainers, timeout)
    seconds = time.monotonic() - started
    by_rank = sorted(zip(backends, trainers), key=lambda bt: bt[0].rank)
    states = [t.strategy.model.state_dict() for _, t in by_rank]
    samples = sum(t.samples for t in trainers)
    return _finish(case, data, f"peer-{mode}", states[0], samples, seconds, replicas=states[1:],
                   extra={"rounds": rounds, "peers": peers,
                          "inner_steps": inner_steps if mode == "diloco" else 1})


# --- (d) pipeline ---------------------------------------------------------------------------


def train_pipeline(case: Case, data: TaskData | None = None, *, stages: int = 2, chunks: int = 2,
                   timeout: float = HANG_GUARD_S) -> Outcome:
    """Stage servers over loopback for an ``nn.Sequential`` model cut into ``stages``
    contiguous ranges of its children (planned by ``plan_stages``), AdamW without weight
    decay or clipping at each stage (Adam, as in one process), ``case.steps`` optimizer steps
    of ``case.batch_size`` samples, each ``chunks`` micro-batches of a share of it in flight
    at once (the synchronous schedule, the default). The state is every stage's
    ``state_dict`` with its keys renamed back to the whole model's."""
    from swarmtrain.roles.stage import (
        ComputeConfig,
        NodeSpec,
        PipelineTrainer,
        Router,
        RouterConfig,
        StageServer,
        StageServerConfig,
        TrainerConfig,
        build_stage,
        estimate_layer_costs,
        plan_stages,
        split_layers,
    )
    from swarmtrain.transport import Timeouts

    data = data or case.data()
    micro = case.batch_size // chunks
    if micro * chunks != case.batch_size:
        raise ValueError(f"{case.name}: batch {case.batch_size} does not split into {chunks} micro-batches")
    layers = split_layers(case.build(SEED))
    ranges = plan_stages(estimate_layer_costs(layers), [NodeSpec(f"n{i}", 1.0, 2**30) for i in range(stages)])
    fast = Timeouts(connect=5.0, handshake=5.0, heartbeat_interval=1.0, heartbeat_timeout=20.0, send=20.0)
    servers = []
    for i, (start, stop) in enumerate(ranges):
        stage_layers, loss_fn = build_stage(case.build, SEED, start, stop)
        servers.append(StageServer(
            stage_layers, stage=i, layer_range=(start, stop), loss_fn=loss_fn if i == stages - 1 else None,
            compute=ComputeConfig(learning_rate=case.lr, weight_decay=0.0, grad_clip=0.0),
            config=StageServerConfig(timeouts=fast), secret=SECRET, name=f"s{i}"))

    async def main() -> int:
        for s in servers:
            await s.start()
        router = Router([[s.address] for s in servers], secret=SECRET,
                        config=RouterConfig(request_timeout=30.0, timeouts=fast))
        try:
            trainer = PipelineTrainer(router, data.train, TrainerConfig(
                batch_size=micro, schedule="sync", chunks=chunks, seed=SEED, grad_clip=0.0))
            losses = await asyncio.wait_for(trainer.train(case.steps * chunks), timeout)
            return len(losses)
        finally:
            await router.close()
            for s in servers:
                await s.close()

    started = time.monotonic()
    done = asyncio.run(main())
    seconds = time.monotonic() - started
    state: dict[str, torch.Tensor] = {}
    for (start, _), s in zip(ranges, servers):
        for key, value in s.compute.layers.state_dict().items():
            index, _, rest = key.partition(".")
            state[f"{start + int(index)}.{rest}"] = value
    return _finish(case, data, "pipeline", state, done * micro, seconds,
                   extra={"stages": [list(r) for r in ranges], "microbatches": done})


# --- state checks ---------------------------------------------------------------------------


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """``state_dict`` keys that name one shared tensor (tied weights), in groups of 2+."""
    by_ptr: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if t.numel():
            by_ptr.setdefault(t.data_ptr(), []).append(key)
    return [keys for keys in by_ptr.values() if len(keys) > 1]


def state_problems(case: Case, out: Outcome) -> list[str]:
    """What is wrong with a trained state, as sentences (empty: nothing).

    - every key of ``model.state_dict()`` is there, and it loads with ``strict=True``;
    - frozen parameters are bit-identical to their initial values;
    - with ``case.buffers``: every BatchNorm running mean and variance has left its initial
      value (zeros, ones) and ``num_batches_tracked`` counted the training batches;
    - tied weights hold equal values;
    - every replica (workers, other peers) holds the same keys and values: peers end every
      round identical, and a worker holds the coordinator's final state when its run returns.
    """
    init = case.build(SEED)
    want = init.state_dict()
    problems = []
    missing = sorted(set(want) - set(out.state))
    if missing:
        problems.append(f"{len(missing)} state_dict key(s) missing, e.g. {missing[:3]}")
    if out.load_error:
        problems.append(f"strict load into a fresh model failed: {out.load_error}")
    for name, p in init.named_parameters():
        moved = name in out.state and not torch.equal(out.state[name].to(p.dtype), p.detach())
        if not p.requires_grad and moved:
            problems.append(f"frozen parameter {name!r} moved")
    if case.buffers:
        for mod_name, mod in init.named_modules():
            if not isinstance(mod, nn.modules.batchnorm._BatchNorm):
                continue
            for buf in ("running_mean", "running_var"):
                key = f"{mod_name}.{buf}"
                if key in out.state and torch.equal(out.state[key], want[key]):
                    problems.append(f"BatchNorm buffer {key!r} is still its initial value")
            key = f"{mod_name}.num_batches_tracked"
            if key in out.state and int(out.state[key]) <= 0:
                problems.append(f"{key!r} is {int(out.state[key])}: no batch was counted")
    for group in _tied_groups(init):
        present = [k for k in group if k in out.state]
        if any(not torch.equal(out.state[present[0]], out.state[k]) for k in present[1:]):
            problems.append(f"tied weights {present} hold different values")
    for i, replica in enumerate(out.replicas):
        if set(replica) != set(want):
            problems.append(f"replica {i} has other state_dict keys than the model")
            continue
        differ = [k for k in want if k in out.state
                  and not torch.equal(replica[k].detach().to(out.state[k].dtype), out.state[k])]
        if differ:
            problems.append(f"replica {i} differs from the handed-back state at {len(differ)} key(s), "
                            f"e.g. {differ[:3]}")
    return problems
