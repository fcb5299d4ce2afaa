"""What the pipeline commands do: `swarmtrain stage`, `pipeline`, `generate` and `status`.

Every process of one pipeline builds the same task with the same model shape and seed. A
stage server computes its layer range with :func:`plan_stages` over equal nodes, so all
processes agree on the ranges without talking. The trainer, the generation client and the
status query reach the stages through a route ``"H:P,H:P;H:P;H:P"``: ``;`` separates
stages, ``,`` replicas of one stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmtrain.app.lifecycle import graceful_signals, keep_status_file, write_status_file
from swarmtrain.app.ops.serve import serve_stage
from swarmtrain.app.runlog import RunLog, open_run_log
from swarmtrain.config import LoggingConfig, OpsConfig, PipelineTrainingConfig, StageServingConfig, reused
from swarmtrain.core.devices import resolve_device
from swarmtrain.core.heap import settle_heap
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.roles.stage.checkpointing import StageCheckpointer, StageIdentity, describe_task
from swarmtrain.roles.stage.compute import ComputeConfig, shape_signature
from swarmtrain.roles.stage.discovery import (
    DEFAULT_CLUSTER,
    StageAnnouncement,
    announce_stage,
    check_cluster_name,
    discover_route,
)
from swarmtrain.roles.stage.partition import (
    NodeSpec,
    build_stage,
    estimate_layer_costs,
    loss_fn_for,
    plan_stages,
    split_layers,
)
from swarmtrain.roles.stage.route import Route, check_route, fetch_statuses, parse_host_port, parse_route
from swarmtrain.roles.stage.router import Router, RouterConfig, StageUnavailable
from swarmtrain.roles.stage.stage import StageServer, StageServerConfig
from swarmtrain.roles.stage.trainer import PipelineTrainer, TrainerConfig
from swarmtrain.tasks import Task, TextLMConfig, TextLMTask, load_task
from swarmtrain.transport.endpoints import require_secret
from swarmtrain.transport.tls import TLSConfig

__all__ = [
    "PipelineOptions",
    "checked_router",
    "StageOptions",
    "load_pipeline_task",
    "parse_layer_range",
    "run_generate",
    "run_pipeline",
    "run_stage",
    "run_status",
    "stage_range",
]

log = logging.getLogger("swarmtrain.roles.stage")

# Plenty for any model: equal nodes whose memory never binds, so the plan depends only on
# the layers' compute and every process computes the same ranges.
_UNBOUNDED_MEMORY = 1 << 60


def load_pipeline_task(spec: str, *, context: int | None = None, d_model: int | None = None,
                       n_heads: int | None = None, n_layers: int | None = None) -> Task:
    """The task every process of a pipeline builds; model-size flags shape a ``textlm``.

    Raises:
        ConfigError: model-size flags given for a task other than ``textlm``.
        TaskError: unknown task or an invalid TextLM shape.
    """
    shape = {k: v for k, v in {"context": context, "d_model": d_model, "n_heads": n_heads,
                               "n_layers": n_layers}.items() if v is not None}
    if spec.strip() != "textlm":
        if shape:
            raise ConfigError(f"--context/--d-model/--n-heads/--n-layers shape the textlm task only, "
                              f"not {spec!r}; drop them or use --task textlm")
        return load_task(spec)
    return TextLMTask(TextLMConfig(**shape))


def parse_layer_range(text: str) -> tuple[int, int]:
    """``"A:B"`` → ``(A, B)``, the half-open range of model layers.

    Raises:
        ConfigError: not two integers with ``0 <= A < B``.
    """
    start, sep, stop = text.partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit() or int(start) >= int(stop):
        raise ConfigError(f"--layers {text!r}: give the stage's layers as START:STOP with START < STOP "
                          "(e.g. 0:2 for the embedding and the first block)")
    return int(start), int(stop)


def _already_built(model: nn.Module) -> Callable[[int], nn.Module]:
    """A model factory for :func:`build_stage` that hands over a model built with its seed."""
    return lambda _seed: model


def stage_range(layers: list[nn.Module], stage: int, stages: int) -> tuple[int, int]:
    """The layers of ``stage`` of ``stages`` (out of the model's ``layers``) when every stage
    runs on an equal node.

    Raises:
        ConfigError: the model has fewer layers than stages.
    """
    nodes = [NodeSpec(f"stage{i}", 1.0, _UNBOUNDED_MEMORY) for i in range(stages)]
    return plan_stages(estimate_layer_costs(layers), nodes)[stage]


# -- swarmtrain stage ----------------------------------------------------------------------


@dataclass(frozen=True)
class StageOptions(StageServingConfig):
    """Settings of one `swarmtrain stage` process: the [stage] section
    (:class:`~swarmtrain.config.StageServingConfig`, where every key is described), and
    whether to resume.

    Attributes:
        resume: load the newest valid checkpoint of ``checkpoint_dir`` before serving.
    """

    resume: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resume and self.checkpoint_directory is None:
            raise ConfigError("--resume loads a checkpoint, but --checkpoint-dir none turns them off: "
                              "give the directory to resume from")
        check_cluster_name(self.cluster)
        _ = self.layer_range, self.sync_peers  # refused here, not once the model is built

    @property
    def layer_range(self) -> tuple[int, int] | None:
        """``layers`` parsed, None for the planned range."""
        return parse_layer_range(self.layers) if self.layers else None

    @property
    def sync_peers(self) -> tuple[tuple[str, int], ...]:
        """``sync_with`` parsed: ``(host, port)`` of each replica to average with."""
        return tuple(parse_host_port(a, "--sync-with") for a in self.sync_with)


def _stage_checkpointer(opts: StageOptions) -> StageCheckpointer | None:
    """The stage's checkpointer; None when checkpoints are off."""
    directory = opts.checkpoint_directory
    if directory is None:
        return None
    return StageCheckpointer(directory, every=opts.checkpoint_every, keep=opts.keep_checkpoints)


def _refuse_old_checkpoints(checkpointer: StageCheckpointer | None, opts: StageOptions) -> None:
    """A stage that neither resumed nor copied a replica starts from the seed: it must not
    write its checkpoints among an earlier run's (a later ``--resume`` would pick whichever
    has the higher step), nor start afresh by mistake when the user meant to continue."""
    newest = None if checkpointer is None else checkpointer.newest_step()
    if newest is not None:
        where = checkpointer.directory if checkpointer else ""
        raise ConfigError(f"{where} holds checkpoints of an earlier run of stage {opts.stage} (up to "
                          f"optimizer step {newest}): start with --resume to continue from them, or give "
                          "another --checkpoint-dir (or move them away) to start from the seed")


def run_stage(task: Task, opts: StageOptions, *, secret: bytes | None, insecure: bool,
              tls: TLSConfig | None = None, ops: OpsConfig = OpsConfig()) -> int:
    """Serve one stage until SIGINT or SIGTERM, checkpointing it (see :class:`StageOptions`)
    and, with ``opts.resume``, continuing from its newest valid checkpoint; with
    ``ops.http_port``, serve /metrics and /api/status there too.

    Raises:
        ConfigError: no secret on a reachable address (without ``insecure``), a layer
            range that does not fit the model or the stage's place in the pipeline, a
            ``device`` this machine lacks, or (``resume``) a checkpoint of another stage,
            layer range or model.
        CheckpointError: the checkpoint directory exists but cannot be listed.
    """
    require_secret(opts.host, opts.port, secret, insecure, "send this stage activations or gradients")
    device = resolve_device(opts.device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    model = task.build_model(opts.seed)  # built once: planned, then cut down to this stage
    all_layers = split_layers(model)
    n_layers = len(all_layers)
    layer_range = opts.layer_range or stage_range(all_layers, opts.stage, opts.stages)
    last = opts.stage == opts.stages - 1
    if (layer_range[0] == 0) != (opts.stage == 0) or (layer_range[1] == n_layers) != last:
        raise ConfigError(f"stage {opts.stage} of {opts.stages} cannot hold layers [{layer_range[0]}, "
                          f"{layer_range[1]}) of {n_layers}: only stage 0 starts at layer 0 and only the "
                          "last stage ends at the last layer; fix --layers or drop it")
    layers, loss_fn = build_stage(_already_built(model), opts.seed, *layer_range)
    del model, all_layers  # the stage keeps only its own layers
    server = StageServer(
        layers, stage=opts.stage, layer_range=layer_range, loss_fn=loss_fn if last else None,
        compute=ComputeConfig(learning_rate=opts.learning_rate or task.default_learning_rate,
                              kv_cache_mb=opts.kv_cache_mb),
        config=StageServerConfig(host=opts.host, port=opts.port,
                                 sync_every=opts.sync_every if opts.sync_with else 0,
                                 **opts.limit_values()),
        secret=secret, sync_peers=opts.sync_peers, name=f"stage{opts.stage}", tls=tls, device=device)
    checkpointer = _stage_checkpointer(opts)
    identity = StageIdentity(opts.stage, opts.stages, layer_range, describe_task(task))

    def status(port: int, running: bool) -> dict[str, Any]:
        saved = checkpointer.status() if checkpointer is not None else {"checkpoint": None}
        return {**server.status(), **saved, "address": f"{opts.host}:{port}", "port": port,
                "stages": opts.stages, "cluster": opts.cluster, "pid": os.getpid(), "running": running,
                "time": time.time()}

    async def serve() -> None:
        stop = asyncio.Event()
        graceful_signals(lambda sig: stop.set(), what="checkpointing this stage",
                         loop=asyncio.get_running_loop())
        # Where the state comes from, before the server listens (so it serves nothing before):
        # its checkpoint (--resume), then a live replica that has trained more (--sync-with).
        resumed = opts.resume and checkpointer is not None and await checkpointer.restore(server, identity)
        joined = await server.join() if opts.sync_with else None
        if not resumed and joined is None:
            _refuse_old_checkpoints(checkpointer, opts)
        try:
            await server.start()
        except OSError as exc:
            await server.close()
            raise SwarmError(f"cannot listen on {opts.host}:{opts.port}: {exc.strerror or exc}; is something "
                             "(another stage?) already using that port? Choose another --port") from exc
        port = server.port  # a closed server no longer knows it
        settle_heap()
        if checkpointer is not None:
            checkpointer.attach(server, identity)
        http = await serve_stage(server, ops.http_host, ops.http_port) if ops.http_port else None
        peers = ", ".join(opts.sync_with)
        log.info("stage %d of %d: layers [%d, %d) of %d on %s, listening on %s:%d%s", opts.stage,
                 opts.stages, *layer_range, n_layers, device, opts.host, port,
                 f", averaging with {peers}" if peers else "")
        announcer = announce_stage(StageAnnouncement(
            cluster=opts.cluster, stage=opts.stage, stages=opts.stages, layers=layer_range,
            shape=server.compute.shape, origin=server.compute.origin, steps=server.compute.steps,
            host="", port=port), opts.host) if opts.announce else None
        writer = (asyncio.create_task(keep_status_file(opts.status_file, lambda: status(port, True)))
                  if opts.status_file else None)
        try:
            while not stop.is_set():
                if announcer is not None:
                    announcer.update(server.compute.steps)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await stop.wait()
        finally:
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            if announcer is not None:  # goodbye first: no trainer should find a closing stage
                await announcer.stop()
            if http is not None:
                await http.close()
            if checkpointer is not None and stop.is_set():  # a clean stop: SIGINT or SIGTERM
                await checkpointer.stop()
                await checkpointer.save_now(server)
            await server.close()
            if opts.status_file:
                write_status_file(opts.status_file, status(port, False))
        log.info("stage %d stopped after %d optimizer steps", opts.stage, server.compute.steps)
        if server.at_risk:
            log.warning("stage %d: its last %d optimizer steps are in no checkpoint and no replica",
                        opts.stage, server.at_risk)

    asyncio.run(serve())
    return 0


def _count_layers(task: Task) -> int:
    return len(split_layers(task.build_model(0)))


async def checked_router(task: Task, route: Route, *, secret: bytes | None, tls: TLSConfig | None,
                          config: RouterConfig = RouterConfig()) -> Router:
    """A router over ``route`` once every stage answered and fits this process's model
    (layer ranges, shapes, one weight lineage per stage: :func:`check_route`); the router
    then refuses replicas that do not fit what was checked."""
    layers = split_layers(task.build_model(0))

    def shape_of(layer_range: tuple[int, int]) -> str:
        return shape_signature(nn.Sequential(*layers[layer_range[0]:layer_range[1]]))

    statuses = await fetch_statuses(route, secret=secret, tls=tls)
    identities = check_route(statuses, len(layers), shape_of)
    router = Router(route, secret=secret, tls=tls, config=config)
    for stage, (shape, origin) in enumerate(identities):
        router.expect(stage, shape=shape, origin=origin)
        for replica, status in zip(router.replicas[stage], statuses[stage], strict=True):
            if "error" not in status:
                router.note_status(replica, status)
    return router


def _unavailable(exc: StageUnavailable) -> SwarmError:
    return SwarmError(f"{exc}. Check that `swarmtrain stage` still runs at those addresses "
                      "(see `swarmtrain status --route ...`)")


# -- swarmtrain pipeline -------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineOptions(PipelineTrainingConfig):
    """Settings of the `swarmtrain pipeline` trainer: the [pipeline] section
    (:class:`~swarmtrain.config.PipelineTrainingConfig`, where every key is described), and
    the run log.

    Attributes:
        run_log: the JSONL run log: "auto" = runs/<date-time>/pipeline.jsonl, "" or "none" =
            none, else its path (see :mod:`swarmtrain.app.runlog`).
    """

    run_log: str = reused(LoggingConfig, "run_log")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_cluster_name(self.cluster)
        _ = self.stage_route  # refused here, before the task is built

    @property
    def stage_route(self) -> Route:
        """``route`` parsed: for each stage, the ``(host, port)`` of its replicas; empty = find
        the stages of ``cluster`` by mDNS."""
        return parse_route(self.route) if self.route else []


def _trainer_status(trainer: PipelineTrainer, opts: PipelineOptions, evals: list[tuple[int, float]],
                    state: str, error: str = "") -> dict[str, Any]:
    done = len(trainer.loss_history)
    acked = {str(s): [trainer.acknowledged[(s, mb)] for mb in range(opts.microbatches)]
             for s in range(trainer.router.num_stages)}
    return {
        "state": state, "error": error, "session": trainer.session, "microbatches": opts.microbatches,
        "done": done, "loss_history": trainer.loss_history, "eval_history": evals,
        "acknowledged": acked, "resends": trainer.resends, "router_resends": trainer.router.resends,
        "redone_forwards": trainer.redone_forwards, "replayed": trainer.replayed,
        "lost_steps": trainer.router.lost_steps, "router": trainer.router.stats(), "time": time.time(),
        "schedule": opts.schedule, "samples_per_step": _samples_per_step(opts),
    }


def _samples_per_step(opts: PipelineOptions) -> int:
    return opts.batch_size * (opts.chunks if opts.schedule == "sync" else 1)


def _schedule_line(opts: PipelineOptions) -> str:
    """What the schedule means for the run, in one line (logged at the start)."""
    if opts.schedule == "sync":
        return (f"schedule sync: {opts.chunks} micro-batches of {opts.batch_size} per optimizer step, "
                f"as one process at batch {_samples_per_step(opts)} ({opts.microbatches} micro-batches = "
                f"{-(-opts.microbatches // opts.chunks)} steps)")
    return (f"schedule async: {opts.max_inflight} micro-batches of {opts.batch_size} in flight, every stage "
            "stepping per micro-batch on weights that moved since its forward (stale gradients)")


class _PipelineRun:
    """One `swarmtrain pipeline` run over a checked router: the trainer, its held-out
    evaluations, and what it reports (log lines, the status file, the run log)."""

    def __init__(self, task: Task, router: Router, opts: PipelineOptions) -> None:
        self.opts = opts
        self.data = task.load_data()
        self.loss_fn = loss_fn_for(task.build_model(0))
        self.evals: list[tuple[int, float]] = []  # (micro-batches done, held-out loss)
        self.started = time.monotonic()
        self.every = max(1, opts.microbatches // 20)  # micro-batches between progress lines
        self.trainer = PipelineTrainer(
            router, self.data.train, TrainerConfig(batch_size=opts.batch_size, schedule=opts.schedule,
                                                   chunks=opts.chunks, max_inflight=opts.max_inflight,
                                                   seed=opts.seed, grad_clip=opts.grad_clip),
            context=task.config.context if isinstance(task, TextLMTask) else None,
            on_microbatch=self.progress)
        self.run_log: RunLog | None = open_run_log(opts.run_log, "pipeline.jsonl")  # closed by run()

    @property
    def done(self) -> int:
        return len(self.trainer.loss_history)

    def progress(self, mb: int, loss: float) -> None:
        """After each micro-batch: a log line every ``every``, and the run log's metrics."""
        opts, trainer, done = self.opts, self.trainer, self.done
        elapsed = time.monotonic() - self.started
        if done % self.every == 0 or done == opts.microbatches:
            recent = [v for _, v in trainer.loss_history[-self.every:]]
            log.info("micro-batch %d/%d  loss %.4f  %.1f micro-batches/s  resends %d", done,
                     opts.microbatches, sum(recent) / len(recent), done / elapsed, trainer.resends)
        if self.run_log is not None:
            self.run_log.metrics(role="pipeline", microbatch=done, loss=loss, samples=done * opts.batch_size,
                                 samples_per_sec=done * opts.batch_size / elapsed, resends=trainer.resends)

    async def evaluate(self) -> None:
        """One held-out evaluation, logged and in the run log with the mean training loss
        since the last one."""
        loss = await self.trainer.evaluate(self.data.heldout, self.loss_fn,
                                           max_samples=self.opts.eval_samples)
        done = self.done
        self.evals.append((done, loss))
        if self.run_log is not None:
            start = self.evals[-2][0] if len(self.evals) > 1 else done
            recent = [v for _, v in self.trainer.loss_history[start:]]
            self.run_log.metrics(force=True, role="pipeline", microbatch=done, eval={"loss": loss},
                                 **({"loss": sum(recent) / len(recent)} if recent else {}))
        log.info("held-out loss %.4f after %d micro-batches", loss, done)

    async def train(self) -> None:
        """Evaluate, then train and evaluate in turns of ``eval_every`` micro-batches (whole
        groups of ``chunks`` with the sync schedule) until ``microbatches`` are done."""
        opts = self.opts
        await self.evaluate()
        chunk = opts.eval_every or opts.microbatches
        if opts.schedule == "sync":  # evaluate between whole groups: every step of chunks
            chunk = -(-chunk // opts.chunks) * opts.chunks
        while self.done < opts.microbatches:
            await self.trainer.train(min(chunk, opts.microbatches - self.done))
            await self.evaluate()

    def write_status(self, state: str, error: str = "") -> None:
        opts = self.opts
        if opts.status_file:
            write_status_file(opts.status_file, _trainer_status(self.trainer, opts, self.evals, state, error))

    async def run(self, stages: int) -> None:
        """:meth:`train`, with the status file kept and the run log's start and end events;
        a failure is in both before it is raised."""
        opts = self.opts
        writer = (asyncio.create_task(keep_status_file(
            opts.status_file, lambda: _trainer_status(self.trainer, opts, self.evals, "training")))
            if opts.status_file else None)
        state, error = "failed", ""
        if self.run_log is not None:
            self.run_log.event("started", stages=stages, microbatches=self.opts.microbatches,
                               schedule=self.opts.schedule, samples_per_step=_samples_per_step(self.opts))
        log.info("%s", _schedule_line(self.opts))
        try:
            await self.train()
            state = "finished"
        except asyncio.CancelledError:
            state = "stopped"
            raise
        except StageUnavailable as exc:
            error = str(exc)
            raise _unavailable(exc) from exc
        except SwarmError as exc:
            error = str(exc)
            raise
        finally:
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            self.write_status(state, error)
            if self.run_log is not None:
                self.run_log.event(state, microbatches=self.done, resends=self.trainer.resends,
                                   **({"error": error} if error else {}))
                self.run_log.close()

    def summary(self) -> str:
        """The line a finished run ends with."""
        first = self.evals[0][1] if self.evals else float("nan")
        last = self.evals[-1][1] if self.evals else float("nan")
        t = self.trainer
        return (f"trained {self.done} micro-batches: held-out loss {first:.4f} -> {last:.4f}; resends "
                f"{t.resends} (requests resent {t.router.resends}, forwards redone {t.redone_forwards})")


def _cancel_on_signals(signals: list[signal.Signals]) -> None:
    """SIGINT and SIGTERM cancel the running task (the micro-batches in flight stop; its
    ``finally`` blocks still run), noting the signal in ``signals``."""
    main = asyncio.current_task()
    if main is None:
        raise SwarmError("_cancel_on_signals needs a running task")

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        main.cancel()

    graceful_signals(on_signal, what="stopping the micro-batches in flight",
                     loop=asyncio.get_running_loop())


async def _train_pipeline(task: Task, opts: PipelineOptions, signals: list[signal.Signals], *,
                          secret: bytes | None, tls: TLSConfig | None) -> _PipelineRun:
    """Find and check the stages, then train through them (:meth:`_PipelineRun.run`)."""
    _cancel_on_signals(signals)
    route = opts.stage_route or await discover_route(opts.cluster, opts.discover_timeout, secret=secret,
                                                     tls=tls)
    router = await checked_router(task, route, secret=secret, tls=tls, config=RouterConfig(
        request_timeout=opts.request_timeout, wait_for_replica=opts.stage_wait))
    try:
        run = _PipelineRun(task, router, opts)
        await run.run(len(route))
    finally:
        await router.close()
    return run


def run_pipeline(task: Task, opts: PipelineOptions, *, secret: bytes | None,
                 tls: TLSConfig | None = None) -> int:
    """Train ``opts.microbatches`` micro-batches through the stages of ``opts.route``.

    Returns:
        0, or 128 + the signal's number when SIGINT or SIGTERM stopped it.

    Raises:
        SwarmError: a stage is unreachable or misconfigured, or training failed (the status
            file, if any, then says ``"state": "failed"`` and why).
    """
    signals: list[signal.Signals] = []
    try:
        run = asyncio.run(_train_pipeline(task, opts, signals, secret=secret, tls=tls))
    except asyncio.CancelledError:
        if not signals:
            raise
        log.warning("stopped by %s", signals[0].name)
        return 128 + int(signals[0])
    print(run.summary())
    return 0


# -- swarmtrain generate -------------------------------------------------------------------


def run_generate(task: Task, route: Route, prompt: str, *, tokens: int, temperature: float, seed: int,
                 secret: bytes | None, tls: TLSConfig | None = None, cache: bool = True) -> int:
    """Print ``prompt`` continued by ``tokens`` bytes generated through the stages (with
    ``cache``, the stages keep the session's attention keys and values: see
    :meth:`PipelineTrainer.generate`).

    Raises:
        ConfigError: the task is not a byte-level language model.
        SwarmError: a stage is unreachable or misconfigured.
    """
    if not isinstance(task, TextLMTask):
        raise ConfigError("generate needs a text model: use --task textlm")
    # checked before any network call: a bad argument is refused at once
    if not prompt:
        raise ConfigError("--prompt is empty: give the text the model should continue")
    if tokens < 0:
        raise ConfigError(f"--tokens must be >= 0, got {tokens}")
    if not temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    # the model reads bytes: a prompt the shell passed in another encoding (bytes that are
    # not UTF-8 arrive as surrogate escapes) goes to it byte for byte
    prompt_bytes = os.fsencode(prompt)
    context = task.config.context
    if len(prompt_bytes) > context:
        log.warning("the prompt is %d bytes and the model's context %d: each new byte is predicted "
                    "from the last %d bytes only (a sliding window)", len(prompt_bytes), context, context)

    async def generate() -> bytes:
        router = await checked_router(task, route, secret=secret, tls=tls)
        try:
            trainer = PipelineTrainer(router, task.load_data().heldout, context=context)
            return await trainer.generate(prompt_bytes, tokens, temperature, seed, cache=cache)
        except StageUnavailable as exc:
            raise _unavailable(exc) from exc
        finally:
            await router.close()

    text = asyncio.run(generate())
    print((prompt_bytes + text).decode("utf-8", errors="replace"))
    return 0


def run_status(route: Route, *, secret: bytes | None, as_json: bool, tls: TLSConfig | None = None,
               cluster: str = DEFAULT_CLUSTER, discover_timeout: float = 10.0) -> int:
    """Print every stage replica's status; 1 if some replica did not answer. An empty
    ``route`` is found by mDNS: the stages of ``cluster``, for up to ``discover_timeout`` s.

    Raises:
        SwarmError: (without ``route``) the stages could not all be found.
    """
    from swarmtrain.app.ui import print_pipeline_status

    async def statuses_of_route() -> list[list[dict[str, Any]]]:
        found = route or await discover_route(check_cluster_name(cluster), discover_timeout, secret=secret,
                                              tls=tls)
        return await fetch_statuses(found, secret=secret, tls=tls)

    statuses = asyncio.run(statuses_of_route())
    if as_json:
        print(json.dumps(statuses, default=str, indent=2))
    else:
        print_pipeline_status(statuses)
    down = [s for stage in statuses for s in stage if "error" in s]
    for s in down:
        log.error("stage %d replica %s did not answer: %s. Check that `swarmtrain stage --stage %d` "
                  "runs there and that the port is reachable", s["route_stage"], s["replica"], s["error"],
                  s["route_stage"])
    return 1 if down else 0
