"""Building and running roles from config: what `swarmtrain coordinator` and `swarmtrain worker` do."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from swarmtrain.app.lifecycle import graceful_signals, keep_status_file, write_status_file
from swarmtrain.app.ops.serve import serve_coordinator, serve_peer
from swarmtrain.app.runlog import open_run_log, safe_file_part
from swarmtrain.app.runlogging import (
    CoordinatorSampler,
    export_final_weights,
    log_coordinator_forever,
    log_worker_forever,
    worker_metrics,
)
from swarmtrain.config import CoordinatorConfig, PeerConfig, WorkerConfig, section_values, with_overrides
from swarmtrain.core import hardware
from swarmtrain.core.events import RunRecorder
from swarmtrain.core.heap import settle_heap
from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.fsutil import write_atomic
from swarmtrain.roles.ps.checkpointing import CoordinatorCheckpointer
from swarmtrain.roles.ps.cluster import shard_of_model
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.partition import parse_server_spec
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.tasks import load_task

__all__ = ["CoreShare", "build_coordinator", "build_peer", "build_worker", "peer_summary",
           "run_coordinator", "run_peer", "run_worker"]

if TYPE_CHECKING:
    from swarmtrain.roles.peer.backend import PeerBackend
    from swarmtrain.roles.peer.node import PeerTrainer

log = logging.getLogger("swarmtrain")


def build_coordinator(cfg: CoordinatorConfig, *, resume: bool = False,
                      run_log: RunRecorder | None = None) -> Coordinator:
    """A coordinator for ``cfg.training.task`` with held-out evaluation and checkpoints.

    ``run_log`` is set before a ``resume`` restores the checkpoint, so the run log records
    where the run resumed (``resumed_from_checkpoint``)."""
    task = load_task(cfg.training.task)
    model = task.build_model(seed=cfg.training.seed)
    data = task.load_data(cfg.data.path or None)
    if cfg.training.learning_rate == 0:
        cfg = with_overrides(cfg, {"training.learning_rate": task.default_learning_rate})
    spec = parse_server_spec(cfg.cluster.shard, cfg.cluster.servers)
    if spec.count > 1:
        part, place = shard_of_model(model, spec, cfg.cluster.servers)
        if not spec.leader:
            # the leader gates the start and ends the run; this server serves whoever comes
            cfg = with_overrides(cfg, {"training.min_workers": 1, "training.max_steps": 0})
        log.info("parameter server %s: %d of the model's %d trainable tensors (%.1f MB, partition %s)",
                 spec, len(place.partition.groups[spec.index]),
                 sum(len(g) for g in place.partition.groups),
                 place.partition.group_bytes[spec.index] / 1e6, place.partition.fingerprint)
        # the leader evaluates on a model of its own (its group's tensors become the masters)
        coord = Coordinator(part, cfg, task_name=cfg.training.task, cluster=place,
                            evaluate=(lambda m: task.evaluate(m, data)) if spec.leader else None,
                            eval_model=copy.deepcopy(model) if spec.leader else None)
    else:
        coord = Coordinator(model, cfg, evaluate=lambda m: task.evaluate(m, data),
                            task_name=cfg.training.task)
    coord.run_log = run_log
    ck = cfg.checkpointing
    if ck.interval or resume:
        checkpointer = CoordinatorCheckpointer(ck.directory, interval=ck.interval, keep=ck.keep)
        coord.attach_checkpointer(checkpointer)
        if resume:
            checkpointer.restore(coord)
    return coord


def build_worker(cfg: WorkerConfig) -> Worker:
    import torch

    if cfg.hardware.num_threads == 0:  # auto: as many threads as the machine's profile suggests
        torch.set_num_threads(hardware.recommend(hardware.detect()).num_threads)
    task = load_task(cfg.training.task)
    model = task.build_model(seed=0)
    data = task.load_data(cfg.data.path or None)
    return Worker(model, task.loss, data.train, cfg, task_name=cfg.training.task,
                  sample_bytes=task.sample_bytes_estimate())


def run_coordinator(
    cfg: CoordinatorConfig, *, resume: bool = False, port_file: str | None = None,
    summary_file: str | None = None, status_file: str | None = None,
) -> int:
    async def main() -> dict[str, Any]:
        # the run log opens first: a resume is recorded in it
        run_log = open_run_log(cfg.logging.run_log, "coordinator.jsonl")
        try:
            coord = build_coordinator(cfg, resume=resume, run_log=run_log)
        except BaseException:
            if run_log is not None:
                run_log.close()
            raise
        sampler = CoordinatorSampler(coord)
        await coord.start()
        settle_heap()  # (the model, optimizer, data and kernels built: see swarmtrain.core.heap)
        http = (await serve_coordinator(coord, cfg.ops.http_host, cfg.ops.http_port)
                if cfg.ops.http_port else None)
        if port_file:
            write_atomic(port_file, str(coord.port))
        if status_file:
            coord.add_background_task(keep_status_file(status_file, coord.status))
        if run_log is not None:
            coord.add_background_task(log_coordinator_forever(coord, run_log, sampler))
        graceful_signals(lambda sig: coord.request_shutdown(f"signal {sig.name}"),
                         what="checkpointing and telling the workers to stop",
                         loop=asyncio.get_running_loop())
        try:
            await coord.run()
            if run_log is not None:
                run_log.metrics(force=True, **sampler.sample())
            export_final_weights(coord, cfg.checkpointing.export)
        finally:
            if run_log is not None:
                run_log.close()
            if http is not None:
                await http.close()
        return coord.status()

    status = asyncio.run(main())
    for path in (summary_file, status_file):
        if path:
            write_status_file(path, status)
    return 0


def run_worker(cfg: WorkerConfig) -> int:
    worker = build_worker(cfg)
    run_log = open_run_log(cfg.logging.run_log, f"worker-{safe_file_part(worker.worker_id)}.jsonl")
    settle_heap()

    async def main() -> None:
        graceful_signals(lambda sig: worker.stop(), what="finishing the gradient in flight",
                         loop=asyncio.get_running_loop())
        if run_log is None:
            await worker.run_async(own_loop=True)
            return
        run_log.event("started", worker=worker.worker_id)
        logger = asyncio.create_task(log_worker_forever(worker, run_log))
        try:
            await worker.run_async(own_loop=True)
        finally:
            logger.cancel()
            await asyncio.gather(logger, return_exceptions=True)
            run_log.metrics(force=True, **worker_metrics(worker))
            run_log.event("finished", worker=worker.worker_id, reason=worker.shutdown_reason or "stopped")
            run_log.close()

    asyncio.run(main())
    log.info("worker %s done: %d steps, %d samples (%s)", worker.worker_id, worker.steps,
             worker.samples, worker.shutdown_reason or "stopped")
    return 0


#: ``OMP_NUM_THREADS`` (torch's own thread default) counts as a chosen thread count
_OMP_ENV = "OMP_NUM_THREADS"


def _env_threads(env: Mapping[str, str] = os.environ) -> int:
    """A positive ``OMP_NUM_THREADS``, else 0."""
    text = env.get(_OMP_ENV, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else 0


class CoreShare:
    """The torch threads of a peer sharing its machine with other swarmtrain peers.

    torch's intra-op pool is OpenMP, whose threads spin while they wait for work, so peers
    whose threads together exceed the machine's cores slow each other down many times (4
    processes of 2 threads on 2 cores ran a small MLP's steps 6x slower than with 1 thread
    each; issue #16 saw rounds 24x slower with 4 peers). With the thread count automatic, each
    peer takes ``max(1, cores // peers on this machine)``, following the peers discovery shows
    at an address of this host; with a chosen count (``--threads N``, or ``OMP_NUM_THREADS``)
    it warns once when they would oversubscribe the cores, naming the count to choose.

    :meth:`seen` runs wherever discovery reports changes (the control thread); :meth:`apply`
    runs on the training thread, between steps: under OpenMP ``torch.set_num_threads`` only
    changes the thread that calls it.

    Args:
        cores: the cores this process may run on.
        threads: the torch threads it starts with.
        auto: whether the count is automatic (else it was chosen, and is only warned about).
    """

    def __init__(self, cores: int, threads: int, *, auto: bool) -> None:
        self.cores = max(1, cores)
        self.threads = threads
        self.auto = auto
        self.local_peers = 1
        self.warned = False
        self._wanted = threads

    def seen(self, local_peers: int) -> None:
        """Discovery now shows ``local_peers`` swarmtrain peers on this machine, this one included."""
        self.local_peers = n = max(1, local_peers)
        if self.auto:
            self._wanted = max(1, self.cores // n)
        elif self.threads > 1 and self.threads * n > self.cores and not self.warned:
            self.warned = True
            log.warning(
                "%d swarmtrain peers run on this machine, each with %d torch threads: %d threads on "
                "%d cores. Idle OpenMP threads spin, so every peer's steps slow down many times; "
                "start each peer with --threads %d (or leave --threads at 0 = shared out)",
                n, self.threads, n * self.threads, self.cores, max(1, self.cores // n))

    def apply(self) -> None:
        """Set the thread count :meth:`seen` asked for (call on the training thread)."""
        import torch

        wanted = self._wanted
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            log.info("%d swarmtrain peer(s) on this machine (%d cores): %d torch thread(s) for this "
                     "one (--threads N to choose)", self.local_peers, self.cores, wanted)
            self.threads = wanted


def _local_peer_count(backend: PeerBackend) -> int:
    """Swarmtrain peers discovery shows on this machine, this one included."""
    from swarmtrain.roles.peer.discovery import peers_on_this_host

    return 1 + len(peers_on_this_host(backend.discovery.peers().values()))


def build_peer(cfg: PeerConfig) -> tuple[PeerBackend, PeerTrainer]:
    """A peer for ``cfg.training.task``: backend (not started) and trainer, its model on
    ``training.device``."""
    backend, trainer, _ = _build_peer(cfg)
    return backend, trainer


def _build_peer(cfg: PeerConfig) -> tuple[PeerBackend, PeerTrainer, CoreShare]:
    import copy
    import zlib

    import torch

    from swarmtrain.config import resolve_secret, resolve_tls
    from swarmtrain.core.devices import resolve_device
    from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
    from swarmtrain.roles.peer.discovery import parse_peer_list
    from swarmtrain.roles.peer.node import PeerTrainer
    from swarmtrain.roles.peer.training import DiLoCo, StepAveraging
    from swarmtrain.tasks import Shard
    from swarmtrain.transport.endpoints import require_secret
    from swarmtrain.transport.identity import Identity

    net, t = cfg.network, cfg.training
    secret = resolve_secret(cfg.security)
    require_secret(net.host, net.port, secret, cfg.security.insecure, "join the ring and steer the average")
    info = hardware.detect()
    task = load_task(t.task)
    chosen = cfg.hardware.num_threads or _env_threads()
    plan = hardware.recommend(info, batch_size=t.batch_size, num_threads=chosen,
                              max_memory_mb=cfg.hardware.max_memory_mb,
                              sample_bytes=task.sample_bytes_estimate())
    torch.set_num_threads(plan.num_threads)
    share = CoreShare(info.cores, plan.num_threads, auto=not chosen)
    device = resolve_device(t.device)
    model = task.build_model(seed=t.seed)
    data = task.load_data(cfg.data.path or None)
    identity = Identity.load_or_create()
    # every peer samples the whole data set, in its own order
    shard = Shard(data.train, 0, 1, seed=zlib.crc32(identity.peer_id.encode()))
    lr = t.learning_rate or task.default_learning_rate
    common: dict[str, Any] = {"lr": lr, "weight_decay": t.weight_decay, "speed": t.speed, "device": device,
                              "schedule": t.schedule()}

    def next_batch() -> Any:
        share.apply()  # the training thread, between steps: where a new thread count takes
        return shard.next_batch(plan.batch_size)

    strategy = (DiLoCo(model, task.loss, next_batch, inner_steps=t.inner_steps,
                       inner_seconds=t.inner_seconds, outer_lr=t.outer_lr, outer_momentum=t.outer_momentum,
                       **common)
                if t.mode == "diloco" else
                StepAveraging(model, task.loss, next_batch, **common))
    options = PeerOptions(
        **section_values(net), **section_values(cfg.peer), wire=t.wire, profile=info.profile.value,
        static_peers=tuple(parse_peer_list(cfg.peer.peers)) if cfg.peer.peers else ())
    backend = PeerBackend(options, secret=secret, identity=identity, tls=resolve_tls(cfg.security))

    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        # the tasks evaluate on the CPU, where their held-out data is: a copy goes there
        return task.evaluate(m if device.type == "cpu" else copy.deepcopy(m).cpu(), data)

    trainer = PeerTrainer(backend, strategy, max_rounds=t.max_rounds, evaluate=evaluate,
                          eval_every=t.eval_every, robust=t.robust, robust_trim=t.robust_trim)
    return backend, trainer, share


def run_peer(cfg: PeerConfig, *, status_file: str | None = None) -> int:
    """What ``swarmtrain peer`` does: start, wait for ``peer.min_peers``, train, and log one
    line on how it went (on every rank).

    Raises:
        SwarmError: another process advertises this peer's id (one identity shared), or no
            ``min_peers`` peers came within ``discovery_timeout_sec``.
    """
    backend, trainer, share = _build_peer(cfg)
    trainer.status_file = status_file or ""
    peer_id = backend.identity.peer_id if backend.identity is not None else "peer"
    trainer.run_log = open_run_log(cfg.logging.run_log, f"peer-{safe_file_part(peer_id[:12])}.jsonl")

    graceful_signals(lambda sig: trainer.stop(), what="finishing the round in flight")
    backend.start()
    settle_heap()
    backend.discovery.add_listener(lambda: share.seen(_local_peer_count(backend)))
    http = serve_peer(trainer, cfg.ops.http_host, cfg.ops.http_port) if cfg.ops.http_port else None
    try:
        if cfg.peer.min_peers > 1:
            log.info("waiting for %d other peer(s) of run %r", cfg.peer.min_peers - 1, cfg.peer.run)
            try:
                backend.wait_for_peers(cfg.peer.min_peers - 1, cfg.peer.discovery_timeout_sec)
            except SwarmTimeout as exc:
                _raise_identity_conflict(backend, exc)
                raise
        _raise_identity_conflict(backend)
        share.seen(_local_peer_count(backend))
        share.apply()
        trainer.record_event("started", run=cfg.peer.run, peer=peer_id, mode=cfg.training.mode)
        trainer.run()
    finally:
        summary = peer_summary(trainer, peer_id)  # before close: the last view is still there
        if http is not None:
            http.close()
        if status_file:
            trainer.write_status()
        backend.close()
        if trainer.run_log is not None:
            trainer.run_log.event("finished", round=trainer.strategy.round, metrics=trainer.metrics)
            trainer.run_log.close()
    log.info("%s", summary)
    return 0


def _raise_identity_conflict(backend: PeerBackend, cause: BaseException | None = None) -> None:
    """Raise the discovery's shared-identity finding, if it made one: it says why no peer
    could be found, and what to do."""
    conflict = backend.discovery.conflict
    if conflict is not None:
        path = backend.identity.path if backend.identity is not None else None
        raise SwarmError(conflict + (f"; this peer's identity is {path}" if path else "")) from cause


def peer_summary(trainer: PeerTrainer, peer_id: str) -> str:
    """The line a peer ends with: rounds, group, samples, last loss, and the held-out
    metrics if this peer evaluated them, else which peer does (rank 0 evaluates)."""
    backend, view = trainer.backend, trainer.backend.view
    me = peer_id[:8]
    rounds = trainer.strategy.round
    if view is None or peer_id not in view.members:
        return f"peer {me} done after {rounds} rounds, in no group (no epoch agreed with the others)"
    rank = view.members.index(peer_id)
    loss = trainer.strategy.last_loss
    parts = [f"{trainer.samples} samples trained here",
             f"last loss {loss:.4f}" if math.isfinite(loss) else "no loss yet"]
    if trainer.metrics:
        parts.append("held-out " + ", ".join(f"{k} {v:.4f}" for k, v in trainer.metrics.items()))
    elif rank != 0:
        parts.append(f"held-out metrics are reported by rank 0 (peer {view.members[0][:8]})")
    elif trainer.evaluate is not None:
        parts.append("no held-out evaluation yet")
    return (f"peer {me} done after {rounds} rounds (epoch {backend.epoch}, rank {rank} of "
            f"{view.world_size}): " + "; ".join(parts))
