"""Building and running roles from config: what `swarmtrain coordinator` and `swarmtrain worker` do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from swarmtrain.config import CoordinatorConfig, WorkerConfig, with_overrides
from swarmtrain.roles.checkpointing import CoordinatorCheckpointer
from swarmtrain.roles.coordinator import Coordinator
from swarmtrain.roles.worker import Worker
from swarmtrain.tasks import load_task

__all__ = ["build_coordinator", "build_worker", "run_coordinator", "run_worker", "write_atomic"]

log = logging.getLogger("swarmtrain")


def build_coordinator(cfg: CoordinatorConfig, *, resume: bool = False) -> Coordinator:
    """A coordinator for ``cfg.training.task`` with held-out evaluation and checkpoints."""
    task = load_task(cfg.training.task)
    model = task.build_model(seed=cfg.training.seed)
    data = task.load_data(cfg.data.path or None)
    if cfg.training.learning_rate == 0:
        cfg = with_overrides(cfg, {"training.learning_rate": task.default_learning_rate})
    coord = Coordinator(model, cfg, evaluate=lambda m: task.evaluate(m, data),
                        task_name=cfg.training.task)
    ck = cfg.checkpointing
    if ck.interval or resume:
        coord.checkpointer = CoordinatorCheckpointer(ck.directory, interval=ck.interval, keep=ck.keep)
        if resume:
            coord.checkpointer.restore(coord)
    return coord


def build_worker(cfg: WorkerConfig) -> Worker:
    import torch

    from swarmtrain import hardware

    if cfg.hardware.num_threads == 0:  # auto: as many threads as the machine's profile suggests
        torch.set_num_threads(hardware.recommend(hardware.detect()).num_threads)
    task = load_task(cfg.training.task)
    model = task.build_model(seed=0)
    data = task.load_data(cfg.data.path or None)
    return Worker(model, task.loss, data.train, cfg, task_name=cfg.training.task,
                  sample_bytes=task.sample_bytes_estimate())


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


async def _write_status_forever(coord: Coordinator, path: str, interval: float = 1.0) -> None:
    while True:
        write_atomic(path, json.dumps(coord.status(), default=str))
        await asyncio.sleep(interval)


def run_coordinator(
    cfg: CoordinatorConfig, *, resume: bool = False, port_file: str | None = None,
    summary_file: str | None = None, status_file: str | None = None,
) -> int:
    async def main() -> dict[str, Any]:
        coord = build_coordinator(cfg, resume=resume)
        await coord.start()
        if port_file:
            write_atomic(port_file, str(coord.port))
        if status_file:
            coord._tasks.append(asyncio.create_task(_write_status_forever(coord, status_file)))
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            coord.request_shutdown(f"signal {sig.name}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, on_signal, sig)
        await coord.run()
        return coord.status()

    status = asyncio.run(main())
    for path in (summary_file, status_file):
        if path:
            write_atomic(path, json.dumps(status, default=str))
    return 0


def run_worker(cfg: WorkerConfig) -> int:
    worker = build_worker(cfg)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, worker.stop)
        await worker.run_async()

    asyncio.run(main())
    log.info("worker %s done: %d steps, %d samples (%s)", worker.worker_id, worker.steps,
             worker.samples, worker.shutdown_reason or "stopped")
    return 0
