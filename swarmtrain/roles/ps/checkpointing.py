"""Coordinator checkpoints: master weights, Adam state and bookkeeping, saved atomically
every ``interval`` updates, on SHUTDOWN and on a CHECKPOINT command, restored bit-exactly."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from swarmtrain.config import to_dict
from swarmtrain.core.checkpoint import (
    MODEL_PREFIX,
    CheckpointStore,
    FailureStreak,
    adam_state_from_tensors,
    adam_state_to_tensors,
)
from swarmtrain.errors import CheckpointError
from swarmtrain.wire import CheckpointMsg

MASTER_PREFIX = "master/"
"""Checkpoint tensors holding the float32 masters of half-precision parameters and buffers."""

#: the per-worker counters a checkpoint keeps (``WorkerRecord`` fields)
_WORKER_COUNTS = ("steps", "samples", "staleness_total")

if TYPE_CHECKING:
    from swarmtrain.roles.ps.coordinator import Coordinator

__all__ = ["CoordinatorCheckpointer"]

log = logging.getLogger("swarmtrain.core.checkpoint")


class CoordinatorCheckpointer:
    """Saves and restores a :class:`Coordinator`'s state through a :class:`CheckpointStore`."""

    def __init__(self, directory: str, *, interval: int, keep: int) -> None:
        self.store = CheckpointStore(directory, keep=keep)
        self.interval = interval
        self.last_saved_version = -1
        # The next interval counts from the newest attempt, written or not, so a directory that
        # cannot be written costs one snapshot and write attempt per interval, not per update.
        self.last_attempted_version = -1
        self.streak = FailureStreak("checkpoint")
        self._lock = asyncio.Lock()

    @property
    def failures(self) -> int:
        return self.streak.failures

    @property
    def failures_in_a_row(self) -> int:
        return self.streak.in_a_row

    async def maybe_save(self, coord: Coordinator) -> None:
        """Save if ``interval`` updates have been applied since the last attempt.

        The interval is checked under the lock the save holds: calls made while a save is
        under way (one per applied gradient) see that save's version once it is taken, so
        they write nothing until the next interval, not one checkpoint each."""
        if not self.interval:
            return
        async with self._lock:
            since = max(self.last_saved_version, self.last_attempted_version, 0)
            if coord.version - since >= self.interval:
                await self._save(coord)

    async def save_now(self, coord: Coordinator) -> CheckpointMsg:
        """Snapshot on the apply thread (consistent), write on another thread."""
        async with self._lock:
            return await self._save(coord)

    async def _save(self, coord: Coordinator) -> CheckpointMsg:
        """(holding the lock) Snapshot and write one checkpoint."""
        if coord.version == self.last_saved_version:
            return CheckpointMsg(ok=True, step=coord.version, message="already saved")
        tensors, meta = await coord.run_on_apply_thread(self._snapshot, coord)
        version = meta["version"]
        self.last_attempted_version = version
        loop = asyncio.get_running_loop()
        try:
            path = await loop.run_in_executor(None, self.store.save, version, tensors, meta)
        except CheckpointError as exc:
            self._report_failure(coord, version, exc)
            return CheckpointMsg(ok=False, step=version, message=str(exc))
        self.streak.succeeded()
        self.last_saved_version = version
        coord.record_event("checkpoint", step=version, path=str(path))
        log.info("checkpoint at version %d: %s", version, path)
        return CheckpointMsg(ok=True, step=version, path=str(path))

    def _report_failure(self, coord: Coordinator, version: int, exc: CheckpointError) -> None:
        retry = f"; next attempt in {self.interval} updates" if self.interval else ""
        last_good = f"version {self.last_saved_version}" if self.last_saved_version >= 0 else "none yet"
        n = self.streak.failed(exc, at=f"version {version}", retry=retry, last_good=last_good)
        coord.record_event("checkpoint_failed", step=version, failures_in_a_row=n, error=str(exc))

    @staticmethod
    def _snapshot(coord: Coordinator) -> tuple[dict[str, Any], dict[str, Any]]:
        """Runs on the apply thread. ``model/`` holds the model's whole ``state_dict`` (buffers,
        frozen and tied parameters under every name, in the model's dtypes: what
        ``swarmtrain export`` writes); ``master/`` the float32 masters of half-precision
        parameters and buffers, so a resumed run continues bit-exactly."""
        names = list(coord.params)
        coord.sync_model()
        tensors = {f"{MODEL_PREFIX}{n}": t.clone() for n, t in coord.state.state_dict().items()}
        for n, master in {**coord.params, **coord.buffers}.items():
            own = coord.state.trainable.get(n, coord.state.synced_buffers.get(n))
            if own is not master:
                tensors[f"{MASTER_PREFIX}{n}"] = master.detach().clone()
        adam_tensors, adam_meta = adam_state_to_tensors(coord.optimizer, names)
        tensors.update({k: v.clone() for k, v in adam_tensors.items()})
        meta = {
            "version": coord.version, "task": coord.task_name, "config": to_dict(coord.config),
            "adam": adam_meta, "stats": dict(coord.stats),
            "loss_ema": coord.loss_average.value,
            "samples_ema": coord.samples_average.get(0.0),
            "workers": {w: r.last_msg_id for w, r in coord.workers.items()},
            # each worker's applied steps, samples and their staleness, so its counts go on
            # after a resume (absent from checkpoints before it)
            "worker_counts": {w: {k: getattr(r, k) for k in _WORKER_COUNTS}
                              for w, r in coord.workers.items()},
            # which node's key owns each worker id (absent from checkpoints before it)
            "worker_nodes": {w: r.node for w, r in coord.workers.items() if r.node},
            # each worker id's number, and how many were given (absent from checkpoints before
            # them: the ids restored get numbers again as they register)
            "worker_members": {w: r.member for w, r in coord.workers.items() if r.member >= 0},
            "members_seen": coord.members_seen,
            "screen": coord.screen.state_dict(),
            # which parameter server's group this is (absent: the only server)
            "param_shard": param_shard_of(coord),
        }
        return tensors, meta

    def restore(self, coord: Coordinator) -> bool:
        """Load the newest valid checkpoint into ``coord``; False if there is none."""
        ckpt = self.store.latest()
        for path, why in self.store.last_skipped:
            log.warning("skipped checkpoint %s: %s", path, why)
        if ckpt is None:
            log.warning("no valid checkpoint in %s: starting from scratch", self.store.directory)
            return False
        meta = ckpt.meta
        _check_param_shard(ckpt.path, meta.get("param_shard"), param_shard_of(coord))
        import torch

        with torch.no_grad():
            own = coord.state.full_state()
            for n, p in own.items():
                key = f"{MODEL_PREFIX}{n}"
                if key not in ckpt.tensors:
                    if n in coord.state.trainable:
                        raise CheckpointError(f"checkpoint {ckpt.path} does not fit this model: it "
                                              f"lacks {n!r}")
                    log.warning("checkpoint %s has no %r (saved before buffers were kept?): keeping "
                                "the model's own", ckpt.path, n)
                    continue
                if ckpt.tensors[key].shape != p.shape:
                    raise CheckpointError(f"checkpoint {ckpt.path} does not fit this model ({n!r} is "
                                          f"{list(ckpt.tensors[key].shape)}, the model's {list(p.shape)})")
                p.copy_(ckpt.tensors[key])
            for n, master in {**coord.params, **coord.buffers}.items():
                if master is not own.get(n):  # a float32 master of a half-precision tensor
                    saved = ckpt.tensors.get(f"{MASTER_PREFIX}{n}", ckpt.tensors.get(f"{MODEL_PREFIX}{n}"))
                    if saved is not None:
                        master.copy_(saved)
        adam_state_from_tensors(coord.optimizer, list(coord.params), ckpt.tensors, meta["adam"])
        coord.version = int(meta["version"])
        # the restored records start counting afresh: what they counted before is departed
        coord.departed_stats.update({k: int(n) for k, n in meta.get("stats", {}).items()})
        coord.loss_average.value = None if meta.get("loss_ema") is None else float(meta["loss_ema"])
        coord.samples_average.value = float(meta.get("samples_ema", 0.0)) or None  # 0: none yet
        if isinstance(meta.get("screen"), dict):
            coord.screen.load_state_dict(meta["screen"])
        from swarmtrain.roles.ps.coordinator import WorkerRecord

        for wid, last in meta.get("workers", {}).items():
            coord.workers[wid] = WorkerRecord(wid, "", {}, 0, 0.0, last_msg_id=int(last))
        for wid, counts in meta.get("worker_counts", {}).items():
            if wid in coord.workers and isinstance(counts, dict):
                for k in _WORKER_COUNTS:
                    setattr(coord.workers[wid], k, int(counts.get(k, 0)))
                # its applied steps are counted by its record again, no longer as departed
                applied = coord.departed_stats.get("applied", 0) - coord.workers[wid].steps
                coord.departed_stats["applied"] = max(0, applied)
        for wid, node in meta.get("worker_nodes", {}).items():
            if wid in coord.workers:
                coord.workers[wid].node = str(node)
        numbers = {wid: int(num) for wid, num in meta.get("worker_members", {}).items()
                   if wid in coord.workers and int(num) >= 0}
        for wid, num in numbers.items():
            coord.workers[wid].member = num
        coord.members_seen = max([int(meta.get("members_seen", 0)), *(num + 1 for num in numbers.values())])
        self.last_saved_version = coord.version
        coord.record_event("resumed_from_checkpoint", step=coord.version, version=coord.version,
                     path=str(ckpt.path))
        log.info("resumed from %s at version %d", ckpt.path, coord.version)
        return True


def param_shard_of(coord: Coordinator) -> dict[str, Any] | None:
    """The parameter server a checkpoint belongs to: index, count and partition fingerprint
    (None for a coordinator that is the only server)."""
    place = coord.cluster
    if place is None or place.spec.count == 1:
        return None
    return {"index": place.spec.index, "count": place.spec.count,
            "partition": place.partition.fingerprint}


def _check_param_shard(path: Any, saved: Any, mine: dict[str, Any] | None) -> None:
    """Refuse a checkpoint written by another parameter server (or by an unsharded
    coordinator for a server, or the other way round): its tensors are another group's.

    Raises:
        CheckpointError: naming both and what to do.
    """
    def name(p: Any) -> str:
        if not isinstance(p, dict):
            return "an unsharded coordinator (the only server)"
        return f"parameter server {p.get('index')}/{p.get('count')} (partition {p.get('partition')})"

    if (saved or None) != mine:
        raise CheckpointError(
            f"checkpoint {path} was written by {name(saved)}, and this is {name(mine)}: each server "
            "resumes from its own checkpoints; give it its own --checkpoint-dir (the one it wrote "
            "before) with the same --shard i/S, or start without --resume")
