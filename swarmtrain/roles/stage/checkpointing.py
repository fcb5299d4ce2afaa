"""Stage checkpoints: a stage server's whole state (:meth:`StageCompute.export_state`: weights,
float32 masters, buffers, AdamW state, step counters), saved atomically through a
:class:`~swarmtrain.core.checkpoint.CheckpointStore` every ``every`` optimizer steps and on a clean
stop, and restored bit-exactly by ``swarmtrain stage --resume``.

A checkpoint's step is the stage's optimizer step. Its metadata names the stage, the number of
stages, the layer range, the task (a description such as ``textlm context=32 d_model=32 ...``)
and the layers' shape signature, so a stage refuses the checkpoint of another stage or model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmtrain.core.checkpoint import CheckpointStore, FailureStreak, list_checkpoints
from swarmtrain.errors import CheckpointError, ConfigError, SwarmError
from swarmtrain.roles.stage.compute import StateMismatch

if TYPE_CHECKING:
    from swarmtrain.roles.stage.stage import StageServer
    from swarmtrain.tasks import Task

__all__ = ["SNAPSHOT_TIMEOUT", "StageCheckpointer", "StageIdentity", "describe_task"]

log = logging.getLogger("swarmtrain.core.checkpoint")

SNAPSHOT_TIMEOUT = 60.0
"""Seconds a snapshot may wait for the compute thread (it is queued behind training work)."""


def describe_task(task: Task) -> str:
    """``"textlm context=32 d_model=32 n_heads=2 n_layers=4 dropout=0.0"``: the task's name and,
    when its ``config`` is a dataclass, every field of it."""
    config = getattr(task, "config", None)
    if config is None or not dataclasses.is_dataclass(config) or isinstance(config, type):
        return task.name
    fields = " ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config))
    return f"{task.name} {fields}"


@dataclasses.dataclass(frozen=True)
class StageIdentity:
    """What a stage is, as written into its checkpoints and checked when one is restored.

    Attributes:
        stage: the stage's index.
        stages: how many stages the pipeline has.
        layers: the model layers ``[start, stop)`` it holds.
        task: the task's description (:func:`describe_task`).
    """

    stage: int
    stages: int
    layers: tuple[int, int]
    task: str


class StageCheckpointer:
    """Saves a :class:`StageServer`'s state every ``every`` optimizer steps and on request, and
    restores the newest valid checkpoint.

    A failed save does not stop training: the first failure of a streak is logged as an ERROR
    with the reason, later ones as a WARNING with the count and the last good checkpoint.

    Args:
        directory: where the checkpoints live (created on the first save).
        every: optimizer steps between saves, counted from the last attempt, written or not
            (0 = only when :meth:`save_now` is called, e.g. on a clean stop).
        keep: how many checkpoints to keep, at least 1.

    Raises:
        ConfigError: ``every`` below 0 or ``keep`` below 1.
    """

    def __init__(self, directory: str | Path, *, every: int, keep: int) -> None:
        if every < 0:
            raise ConfigError(f"checkpoint every must be >= 0 optimizer steps, got {every}")
        self.store = CheckpointStore(directory, keep=keep)
        self.every = every
        self.last_step = -1  # step of the newest checkpoint written or restored (-1: none)
        self.last_path: Path | None = None
        self.last_attempted_step = -1
        self.streak = FailureStreak("stage checkpoint")
        self._saved_at: tuple[int, int] | None = None  # (steps, micro-batches) of the last one
        self._identity: StageIdentity | None = None
        self._lock = asyncio.Lock()
        self._periodic: asyncio.Task[Path | None] | None = None
        self._stopped = False

    @property
    def directory(self) -> Path:
        return self.store.directory

    def attach(self, server: StageServer, identity: StageIdentity) -> None:
        """Save ``server`` every ``every`` optimizer steps from now on (its step listener)."""
        self._identity = identity
        if self.every:
            server.on_step(lambda steps: self._on_step(server, steps))

    async def drain(self) -> None:
        """Wait until the periodic save in flight, if any, is done."""
        if self._periodic is not None:
            await asyncio.gather(self._periodic, return_exceptions=True)

    async def stop(self) -> None:
        """No more periodic saves; wait for one in flight (a clean stop then calls
        :meth:`save_now`)."""
        self._stopped = True
        await self.drain()

    def _on_step(self, server: StageServer, steps: int) -> None:
        # runs on the event loop after each optimizer step: at most one save in flight, and a
        # step during a save starts none (the next interval counts from that save's step)
        if self._stopped or (self._periodic is not None and not self._periodic.done()):
            return
        if steps - max(self.last_step, self.last_attempted_step, 0) >= self.every:
            self._periodic = asyncio.get_running_loop().create_task(self.save_now(server))

    async def save_now(self, server: StageServer) -> Path | None:
        """Snapshot ``server`` on its compute thread and write the checkpoint on a worker
        thread; sets ``server.durable_step`` to the step written.

        Returns:
            The checkpoint's path (the last one's if nothing was trained since it), or None if
            the save failed (logged and counted).

        Raises:
            SwarmError: :meth:`attach` was not called.
        """
        if self._identity is None:
            raise SwarmError("StageCheckpointer.save_now before attach(): the stage is not known")
        identity = self._identity
        async with self._lock:
            done = (server.compute.steps, server.compute.microbatches)
            if done == self._saved_at:  # nothing trained since the last one
                return self.last_path
            try:
                async with asyncio.timeout(SNAPSHOT_TIMEOUT):
                    tensors, meta = await server.export_state()
            except (SwarmError, TimeoutError) as exc:
                reason = str(exc) or f"the compute thread took longer than {SNAPSHOT_TIMEOUT:.0f} s"
                self._report_failure(server.compute.steps, CheckpointError(f"no snapshot: {reason}"))
                return None
            step = int(meta["steps"])
            self.last_attempted_step = step
            meta = {**meta, "stage": identity.stage, "stages": identity.stages,
                    "layers": list(identity.layers), "task": identity.task, "time": time.time()}
            loop = asyncio.get_running_loop()
            try:
                path = await loop.run_in_executor(None, self.store.save, step, tensors, meta)
            except CheckpointError as exc:
                self._report_failure(step, exc)
                return None
            self.streak.succeeded()
            self.last_step, self.last_path = step, path
            self._saved_at = (step, int(meta["microbatches"]))
            server.durable_step = max(server.durable_step, step)
            log.info("stage %d checkpoint at optimizer step %d: %s", identity.stage, step, path)
            return path

    def _report_failure(self, step: int, exc: CheckpointError) -> None:
        retry = f"; next attempt in {self.every} optimizer steps" if self.every else ""
        last_good = f"step {self.last_step} ({self.last_path})" if self.last_path else "none yet"
        self.streak.failed(exc, at=f"step {step}", retry=retry, last_good=last_good)

    def newest_step(self) -> int | None:
        """The highest step among the checkpoints in the directory (valid or not), None if none.

        Raises:
            CheckpointError: the directory exists but cannot be listed.
        """
        found = list_checkpoints(self.directory)
        return int(found[-1].name.removeprefix("ckpt-")) if found else None

    async def restore(self, server: StageServer, expect: StageIdentity) -> bool:
        """Load the newest valid checkpoint into ``server`` (best before ``server.start()``, so
        it serves nothing before: see :meth:`StageServer.import_state`).

        Returns:
            True if a checkpoint was restored, False if the directory holds none (logged).

        Raises:
            ConfigError: the checkpoint is of another stage, layer range or layer shape, or does
                not fit these layers; the message names it, what differs and what to do.
        """
        ckpt = self.store.latest()  # verifies, skips (and logs) corrupt ones
        if ckpt is None:
            log.warning("no checkpoint in %s: stage %d starts from the seed's weights",
                        self.directory, expect.stage)
            return False
        meta, where = ckpt.meta, ckpt.path
        fresh = ("point --checkpoint-dir at this stage's own checkpoints, or start without --resume "
                 "(or with another --checkpoint-dir) to start from the seed")
        if meta.get("stage") != expect.stage:
            raise ConfigError(f"checkpoint {where} is of stage {meta.get('stage')} (layers "
                              f"{_layers(meta.get('layers'))}), this is stage {expect.stage}: {fresh}")
        if list(meta.get("layers") or []) != list(expect.layers):
            raise ConfigError(f"checkpoint {where} holds layers {_layers(meta.get('layers'))} of stage "
                              f"{expect.stage} of {meta.get('stages')}, this stage serves layers "
                              f"{_layers(expect.layers)} of stage {expect.stage} of {expect.stages} (were "
                              f"--stages, --layers or the model flags changed?): start with the flags it "
                              f"was written with, or {fresh}")
        if meta.get("shape") != server.compute.shape:
            raise ConfigError(f"checkpoint {where} holds layers of another shape (written by task "
                              f"{meta.get('task')!r}; this stage runs {expect.task!r}): start with the "
                              f"--task and model flags it was written with, or {fresh}")
        if meta.get("task") != expect.task:
            log.warning("checkpoint %s was written by task %r, this stage runs %r (the layers' shapes "
                        "agree, so it is restored)", where, meta.get("task"), expect.task)
        try:
            await server.import_state(ckpt.tensors, meta, source=f"checkpoint {where}")
        except StateMismatch as exc:
            raise ConfigError(f"checkpoint {where} does not fit stage {expect.stage}'s layers: {exc}; "
                              f"{fresh}") from exc
        self.last_step, self.last_path = ckpt.step, where
        self._saved_at = (server.compute.steps, server.compute.microbatches)
        log.info("resumed stage %d from %s at optimizer step %d", expect.stage, where, ckpt.step)
        return True

    def status(self) -> dict[str, Any]:
        """``{"checkpoint": {...}}`` for the stage's status: directory, every, the last
        checkpoint's step and path (None before the first), failures in all and in a row."""
        return {"checkpoint": {
            "directory": str(self.directory), "every": self.every,
            "last_step": self.last_step if self.last_path is not None else None,
            "last_path": str(self.last_path) if self.last_path is not None else None,
            "failures": self.streak.failures, "failures_in_a_row": self.streak.in_a_row,
        }}


def _layers(value: Any) -> str:
    try:
        start, stop = value
    except (TypeError, ValueError):
        return repr(value)
    return f"[{start}, {stop})"
