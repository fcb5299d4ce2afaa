"""Run log lines of the parameter-server roles: what the coordinator and a worker write to
their :class:`~swarmtrain.app.runlog.RunLog` every second (events come from ``Coordinator._event``)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmtrain.app.runlog import RunLog, is_disabled

if TYPE_CHECKING:
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.roles.ps.worker import Worker

__all__ = ["CoordinatorSampler", "export_final_weights", "log_coordinator_forever", "log_worker_forever",
           "resolve_export_path", "worker_metrics"]

log = logging.getLogger("swarmtrain")


class CoordinatorSampler:
    """Builds the coordinator's metrics lines; rates are over the time since the last line.

    A line holds the version, the loss (running mean of the workers' reported losses), total
    samples and samples/s, bytes up (gradients) and down (updates) in total, and per worker
    the same; ``eval`` (the held-out metrics) and ``eval_version`` appear on the first line
    after each evaluation.
    """

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self._last_time = time.monotonic()
        self._last_samples: dict[str, int] = {}
        self._last_eval: object = None  # the newest metric_history entry already logged

    def sample(self) -> dict[str, Any]:
        """The next metrics line's values."""
        coord = self.coord
        now = time.monotonic()
        dt = max(now - self._last_time, 1e-9)
        self._last_time = now
        workers: dict[str, dict[str, Any]] = {}
        for wid, rec in list(coord.workers.items()):
            rate = (rec.samples - self._last_samples.get(wid, 0)) / dt
            self._last_samples[wid] = rec.samples
            workers[wid] = {
                "connected": rec.connected, "steps": rec.steps, "samples": rec.samples,
                "samples_per_sec": rate, "bytes_up": rec.bytes_up, "bytes_down": rec.bytes_down,
                "loss": rec.loss,
            }
        line: dict[str, Any] = {
            "role": "coordinator", "version": coord.version, "loss": coord.loss_ema,
            "learning_rate": coord.learning_rate(),
            "samples": sum(w["samples"] for w in workers.values()),
            "samples_per_sec": sum(w["samples_per_sec"] for w in workers.values()),
            "bytes_up": sum(w["bytes_up"] for w in workers.values()),
            "bytes_down": sum(w["bytes_down"] for w in workers.values()),
            "workers_connected": sum(1 for w in workers.values() if w["connected"]),
            "workers": workers,
        }
        if self._new_eval():
            version, metrics = self._last_eval = self.coord.metric_history[-1]
            line["eval"], line["eval_version"] = dict(metrics), version
        return line

    def _new_eval(self) -> bool:
        history = self.coord.metric_history
        return bool(history) and history[-1] is not self._last_eval

    def due(self, interval: float) -> bool:
        """An evaluation finished, or ``interval`` seconds passed, since the last line."""
        return (self._new_eval() or time.monotonic() - self._last_time >= interval)


async def log_coordinator_forever(coord: Coordinator, run_log: RunLog, sampler: CoordinatorSampler,
                                  interval: float = 1.0) -> None:
    """Write a metrics line every ``interval`` seconds, and one after each evaluation (woken by
    it, so evaluations more frequent than the interval each get their line)."""
    while True:
        await coord.next_evaluation(min(interval, 0.25))
        if sampler.due(interval):
            run_log.metrics(force=True, **sampler.sample())


def worker_metrics(worker: Worker) -> dict[str, Any]:
    """A worker's metrics line: its own steps, samples/s, loss and bytes."""
    st = worker.status()
    keep = ("worker_id", "version", "steps", "samples", "samples_per_sec", "batch_size",
            "round_trip_ms")
    return {"role": "worker", **{k: st[k] for k in keep if k in st},
            "bytes_up": worker.bytes_up, "bytes_down": worker.bytes_down}


async def log_worker_forever(worker: Worker, run_log: RunLog, interval: float = 1.0) -> None:
    """Write the worker's metrics line every ``interval`` seconds."""
    while True:
        await asyncio.sleep(interval)
        run_log.metrics(**worker_metrics(worker))


def resolve_export_path(setting: str, run_log: RunLog | None) -> Path | None:
    """Where the final weights go for the ``[checkpointing] export`` setting: ``"auto"`` =
    ``model.safetensors`` next to the run log (None without one), ``""``/``"none"`` = None,
    else the path given."""
    if is_disabled(setting):
        return None
    if setting == "auto":
        return run_log.path.parent / "model.safetensors" if run_log is not None else None
    return Path(setting)


def export_final_weights(coord: Coordinator, setting: str) -> Path | None:
    """Write the coordinator's weights where ``setting`` says (see :func:`resolve_export_path`),
    note it in the run log, and return the path (None if no export).

    Raises:
        CheckpointError: if the file cannot be written.
    """
    from swarmtrain.app.export import export_model
    from swarmtrain.roles.ps.checkpointing import param_shard_of

    run_log = coord.run_log if isinstance(coord.run_log, RunLog) else None
    path = resolve_export_path(setting, run_log)
    if path is None:
        return None
    # (a parameter server of a sharded cluster writes its slice, marked as such: `swarmtrain
    # export` puts the servers' slices back together)
    export_model(coord.model, path, task=coord.task_name, version=coord.version,
                 shard=param_shard_of(coord))
    coord.record_event("exported", path=str(path), version=coord.version)
    log.info("final weights (version %d) written to %s", coord.version, path)
    return path
