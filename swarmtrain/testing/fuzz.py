"""Fuzz live swarmtrain nodes over real sockets: a coordinator (as a worker and as the
operator's ctl), pipeline stages (first, middle, last; as a trainer and as a replica), a
peer's control port, and (in :mod:`swarmtrain.testing.fuzz_ring`) a peer's ring listener.

Each ``fuzz_*`` function starts its node in this process on 127.0.0.1 (port 0, the short
timeouts of :data:`FUZZ_TIMEOUTS`), sends ``count`` inputs (or as many as ``seconds``
allow) from :func:`~swarmtrain.testing.fuzz_inputs.make_input`, then checks the node's
health, and returns a :class:`FuzzReport`. See ``docs/fuzzing.md``.

What is deliberately not generated, because a well-formed one legitimately changes the
node: a finite gradient with samples > 0 (it is applied), a STAGE_SYNC carrying finite
values for every parameter of the stage (it moves the weights halfway), a backward for a
forward the fuzzer made, a correctly signed membership proposal naming the node, and a
well-formed PAUSE or SHUTDOWN of the coordinator's ``ctl`` role (an operator may pause or
stop the cluster; inputs that would deliver one are drawn again). A STAGE_SYNC of the
stage's own parameters carries non-finite values in every other element of every tensor
(or a wrong shape, an integer dtype, a missing parameter), so no mutation of a few bytes
can make it valid. Every gradient the fuzzer builds is invalid three ways at once (no
samples, NaN loss, a NaN or infinite value), so no single mutation can make it valid. On
the last stage a forward with valid targets legitimately steps the optimizer; there the
health check asks for finite weights instead of unchanged ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from swarmtrain.errors import SwarmError
from swarmtrain.testing.fuzz_engine import (
    FUZZ_TIMEOUTS,
    SECRET,
    FuzzReport,
    capture_errors,
    collect_crashes,
    dead_port,
    run_campaign,
)
from swarmtrain.testing.fuzz_inputs import nan_tensor
from swarmtrain.testing.fuzz_ring import fuzz_ring
from swarmtrain.transport import connect
from swarmtrain.wire import (
    Accept,
    Assign,
    CheckpointMsg,
    Commit,
    Error,
    Gradients,
    Heartbeat,
    Hello,
    Message,
    Pause,
    PeerHello,
    PeerInfoMsg,
    Propose,
    Reform,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    StageBackward,
    StageForward,
    StageInfer,
    StageResult,
    StageSync,
    Start,
    Status,
    StatusRequest,
    Weights,
    encode_bytes,
)

__all__ = ["FuzzReport", "fuzz_coordinator", "fuzz_ctl", "fuzz_stage", "fuzz_peer", "fuzz_ring",
           "FUZZ_TIMEOUTS", "TARGETS"]

Progress = Callable[[FuzzReport], None] | None

_CHECK_TIMEOUT = 5.0


async def _ask(port: int, role: str, msg: Message) -> Message:
    """Send ``msg`` as a legitimate client of ``role``; the first answer."""
    conn = await connect("127.0.0.1", port, secret=SECRET, role=role, timeouts=FUZZ_TIMEOUTS)
    try:
        await conn.send(msg, timeout=_CHECK_TIMEOUT)
        return await conn.recv(timeout=_CHECK_TIMEOUT, phase="health check")
    finally:
        await conn.close()


async def _live(port: int, role: str, msg: Message, expect: type[Message]) -> str | None:
    """None if the node answers ``msg`` with an ``expect``, else what went wrong."""
    try:
        async with asyncio.timeout(3 * _CHECK_TIMEOUT):
            answer = await _ask(port, role, msg)
    except (SwarmError, OSError, TimeoutError) as exc:
        return f"a legitimate {msg.TYPE.name} failed: {type(exc).__name__}: {exc}"
    return None if isinstance(answer, expect) else f"{msg.TYPE.name} was answered with {answer}"


# --- coordinator ------------------------------------------------------------------------------


def _bad_gradient(rng: random.Random, params: dict[str, torch.Tensor]) -> Gradients:
    """A gradient in one of the codecs' formats that must never be applied."""
    codec = rng.choice(["none", "fp16", "topk", "qsgd", "fused"])
    codecs, tensors = {}, {}
    items = ([("*", torch.zeros(sum(p.numel() for p in params.values())))] if codec == "fused"
             else list(params.items()))
    for name, p in items:
        n = p.numel()
        spec = {"codec": "none" if codec == "fused" else codec, "shape": list(p.shape),
                "dtype": "float32", "meta": {}}
        if codec in ("none", "fused"):
            parts = {"values": nan_tensor(rng, (n,))}
        elif codec == "fp16":
            parts = {"values": nan_tensor(rng, (n,), torch.float16)}
        elif codec == "topk":
            k = max(1, n // 10)
            spec["meta"] = {"k": k}
            parts = {"values": nan_tensor(rng, (k,), torch.float16),
                     "index_low": torch.randint(0, min(n, 65536), (k,), dtype=torch.int32).to(torch.uint16),
                     "block_counts": torch.tensor([k] + [0] * ((n - 1) // 65536), dtype=torch.int32)}
        else:
            spec["meta"] = {"bits": 8, "bucket_size": 128}
            parts = {"norms": nan_tensor(rng, (-(-n // 128),)),
                     "codes": torch.randint(0, 255, (n,), dtype=torch.uint8)}
        spec["parts"] = list(parts)
        codecs[name] = spec
        tensors.update({f"{name}/{k}": t for k, t in parts.items()})
    return Gradients(msg_id=rng.choice([1, 2, rng.randrange(1, 10**6), 2**63 - 1]), version=0,
                     samples=rng.choice([0, -1, -(2**63)]), loss=math.nan, codecs=codecs, tensors=tensors)


def _fuzz_coordinator(seed: int) -> tuple[Any, Any, dict[str, torch.Tensor], Any, dict[str, Any]]:
    """An in-process digits coordinator on loopback with the fuzz timeouts and secret:
    ``(task, coordinator, its parameters, model fingerprint, compression keys)``."""
    from swarmtrain.config import CompressionConfig, load_coordinator_config
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.tasks import DigitsTask

    task = DigitsTask()
    torch.manual_seed(seed)
    cfg = load_coordinator_config(overrides={
        "network.handshake_timeout_sec": FUZZ_TIMEOUTS.handshake,
        "network.heartbeat_interval_sec": FUZZ_TIMEOUTS.heartbeat_interval,
        "network.heartbeat_timeout_sec": FUZZ_TIMEOUTS.heartbeat_timeout,
        "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
        "training.learning_rate": 3e-3, "training.eval_interval_sec": 3600.0, "training.min_workers": 1})
    coord = Coordinator(task.build_model(), cfg, task_name="digits", secret=SECRET)
    params = {n: p.detach() for n, p in coord.params.items()}
    comp = {k: getattr(cfg.compression, k) for k in CompressionConfig.SHARED_KEYS}
    return task, coord, params, coord.state.fingerprint(), comp


async def fuzz_coordinator(count: int = 300, *, seconds: float = math.inf, seed: int = 0,
                           concurrency: int = 16, progress: Progress = None) -> FuzzReport:
    """Fuzz an in-process coordinator (digits task) as role ``worker``.

    Health: master weights bit-for-bit and version unchanged, nothing applied, a ctl
    STATUS_REQUEST answered, then a legitimate worker registers and trains 3 steps.
    """
    from swarmtrain.config import load_worker_config
    from swarmtrain.roles.ps.worker import Worker

    task, coord, params, fp, comp = _fuzz_coordinator(seed)

    def register(rng: random.Random) -> Register:
        return Register(worker_id=f"fuzz-{rng.randrange(10**6)}", task="digits", fingerprint=fp,
                        hardware={"profile": "fuzz"}, batch_size=32, accumulation_steps=1,
                        shard_index=-1, compression=comp, samples_per_sec=100.0)

    def seeds(rng: random.Random) -> list[Message]:
        return [_bad_gradient(rng, params), _bad_gradient(rng, params), register(rng), StatusRequest(),
                Heartbeat(time=0.0), Shutdown(reason="fuzz"), Hello(role="worker", nonce=b"x" * 32),
                Error(code="fuzz", message="x", fatal=rng.random() < 0.5)]

    report = FuzzReport("coordinator", seed)
    with capture_errors() as errors:
        await coord.start()
        try:
            before, version = coord._flat_master().clone(), coord.version
            skip = (Heartbeat, RegisterAck, Weights, Start, Assign, Pause, Resume)
            await run_campaign(report, coord.port, "worker", seeds, skip,
                               lambda: _live(coord.port, "ctl", StatusRequest(), Status),
                               count=count, seconds=seconds, concurrency=concurrency,
                               prelude=lambda rng: encode_bytes(register(rng)), progress=progress)
            if not torch.equal(coord._flat_master(), before):
                report.health.append("the master weights changed")
            if coord.version != version or coord.stats["applied"]:
                report.health.append(f"version moved {version} -> {coord.version}, stats {coord.stats}")
            if (problem := await _live(coord.port, "ctl", StatusRequest(), Status)) is not None:
                report.health.append(problem)
            wcfg = load_worker_config(overrides={
                "network.coordinator_port": coord.port, "hardware.num_threads": 1, "training.batch_size": 32,
                "network.reconnect_attempts": 0, "training.probe_seconds": 0.2,
                "training.accumulation_steps": 1, "training.worker_id": "legit"})
            legit = asyncio.create_task(Worker(task.build_model(), task.loss, task.load_data().train, wcfg,
                                               task_name="digits", secret=SECRET).run_async())
            deadline = time.monotonic() + 60
            while coord.version < version + 3 and time.monotonic() < deadline and not legit.done():
                await asyncio.sleep(0.05)
            if coord.version < version + 3:
                report.health.append(f"a legitimate worker did not train 3 steps (version {coord.version})")
            elif torch.equal(coord._flat_master(), before):
                report.health.append("training steps left the weights unchanged")
            await asyncio.wait_for(coord.shutdown_cluster("fuzz health check done"), 30)
            await asyncio.wait_for(legit, 30)
        except (SwarmError, OSError, TimeoutError) as exc:
            report.health.append(f"health check failed: {type(exc).__name__}: {exc}")
        finally:
            collect_crashes(report, errors)
            await coord.close()
    return report


async def fuzz_ctl(count: int = 300, *, seconds: float = math.inf, seed: int = 0, concurrency: int = 16,
                   progress: Progress = None) -> FuzzReport:
    """Fuzz an in-process coordinator (digits task) as role ``ctl`` (the operator's tool).

    A well-formed PAUSE or SHUTDOWN from an authenticated ctl is legitimate (it pauses or
    stops the cluster), so no input delivers one: an input that would is drawn again.
    Mutated ones, and every other message, are sent. Health: not paused, not shutting
    down, master weights bit-for-bit and version unchanged; then a legitimate ctl is
    served: STATUS_REQUEST, PAUSE (the coordinator pauses), RESUME (it resumes), CHECKPOINT
    (answered; checkpointing is off here) and SHUTDOWN (it shuts the cluster down).
    """
    task, coord, params, fp, comp = _fuzz_coordinator(seed)

    def seeds(rng: random.Random) -> list[Message]:
        reason = rng.choice(["", "fuzz", "x" * 600])
        return [StatusRequest(), StatusRequest(), Resume(), Resume(), CheckpointMsg(),
                CheckpointMsg(path=rng.choice(["", "/etc/passwd", "../../x", "\x00"]),
                              step=rng.randrange(-5, 5), ok=rng.random() < 0.5, message="fuzz"),
                Pause(), Shutdown(reason=reason),  # only ever sent mutated (forbidden as they are)
                Status(status={"version": rng.randrange(10)}), Heartbeat(time=0.0),
                Register(worker_id="ctl", task="digits", fingerprint=fp, hardware={}, batch_size=1,
                         accumulation_steps=1, shard_index=-1, compression=comp, samples_per_sec=1.0),
                _bad_gradient(rng, params), Error(code="fuzz", message="x", fatal=rng.random() < 0.5)]

    async def ctl(msg: Message) -> Message:
        async with asyncio.timeout(3 * _CHECK_TIMEOUT):
            return await _ask(coord.port, "ctl", msg)

    report = FuzzReport("ctl", seed)
    with capture_errors() as errors:
        await coord.start()
        try:
            before, version = coord._flat_master().clone(), coord.version
            await run_campaign(report, coord.port, "ctl", seeds, (Heartbeat,),
                               lambda: _live(coord.port, "ctl", StatusRequest(), Status),
                               count=count, seconds=seconds, concurrency=concurrency, progress=progress,
                               forbid=(Pause, Shutdown))
            if coord.paused or coord.finished:
                report.health.append(f"the cluster was paused ({coord.paused}) or shut down "
                                     f"({coord.finished}) by inputs that carried no valid PAUSE/SHUTDOWN")
            if not torch.equal(coord._flat_master(), before) or coord.version != version:
                report.health.append(f"the master weights or version changed ({version} -> {coord.version})")
            for msg, expect, paused in ((StatusRequest(), Status, False), (Pause(), Status, True),
                                        (Resume(), Status, False), (CheckpointMsg(), CheckpointMsg, False)):
                answer = await ctl(msg)
                if not isinstance(answer, expect) or coord.paused != paused:
                    report.health.append(f"a legitimate {msg.TYPE.name} was answered with {answer} "
                                         f"(paused: {coord.paused})")
            if not isinstance(answer := await ctl(Shutdown(reason="fuzz health check")), Status):
                report.health.append(f"a legitimate SHUTDOWN was answered with {answer}")
            deadline = time.monotonic() + 30
            while not coord.finished and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not coord.finished:
                report.health.append("a legitimate SHUTDOWN did not shut the cluster down")
        except (SwarmError, OSError, TimeoutError) as exc:
            report.health.append(f"health check failed: {type(exc).__name__}: {exc}")
        finally:
            collect_crashes(report, errors)
            await coord.close()
    return report


# --- stage -------------------------------------------------------------------------------------


_STAGE_POSITIONS = {"first": (0, (0, 2)), "middle": (1, (2, 4)), "last": (2, (4, 6))}
_STAGE_NAMES = {("first", "pipeline"): "stage", ("middle", "pipeline"): "stage-mid",
                ("last", "pipeline"): "stage-last", ("middle", "stage"): "stage-replica"}


def _bad_syncs(rng: random.Random, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, torch.Tensor]]:
    """Replica syncs that must all be refused: the stage's own names with too many
    non-finite values for a few bit flips to repair, a wrong shape or an integer dtype (and
    non-finite values too), a missing parameter, unknown names, a huge tensor, nothing."""
    def nonfinite(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        t.view(-1)[::2] = rng.choice([math.nan, math.inf, -math.inf])  # >= 16 per tensor here
        return t

    names = sorted(shapes)
    odd, dropped = rng.choice(names), rng.choice(names)
    own = {n: nonfinite(s) for n, s in shapes.items()}
    return [own,
            {**own, odd: nonfinite(tuple(d + 1 for d in shapes[odd]))},
            {**own, odd: torch.zeros(shapes[odd], dtype=rng.choice([torch.int32, torch.int64, torch.bool]))},
            {n: torch.randn(s) for n, s in shapes.items() if n != dropped},
            {**own, "fuzz.extra": torch.randn(rng.choice(list(shapes.values())))},
            {f"fuzz.{i}": nan_tensor(rng, rng.choice(list(shapes.values())))
             for i in range(rng.randrange(3))},
            {"fuzz.huge": torch.zeros(rng.choice([1 << 16, 1 << 20]))},
            {}]


def _hostile_targets(rng: random.Random, b: int, t: int) -> torch.Tensor:
    """Targets for the last stage: valid byte ids, or ids the loss must refuse or ignore."""
    choice = rng.randrange(8)
    if choice < 3:
        return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    if choice == 3:  # every position ignored (cross_entropy's ignore_index): a mean over nothing
        return torch.full((b, t), -100, dtype=torch.int64)
    if choice == 4:
        return torch.full((b, t), rng.choice([-1, 256, 2**31 - 1, -(2**63)]), dtype=torch.int64)
    if choice == 5:
        return torch.zeros((b, t + rng.choice([-1, 1])), dtype=torch.int64)
    if choice == 6:
        return nan_tensor(rng, (b, t))
    return torch.zeros(rng.choice([(0,), (b,), (b, t, 256)]), dtype=rng.choice([torch.int64, torch.uint8]))


async def fuzz_stage(count: int = 300, *, seconds: float = math.inf, seed: int = 0, concurrency: int = 16,
                     position: str = "first", role: str = "pipeline",
                     progress: Progress = None) -> FuzzReport:
    """Fuzz an in-process stage server of a 6-layer text model: stage 0 (token ids, layers
    0-1) if ``position`` is ``first``, a middle stage (float activations, layers 2-3), or the
    ``last`` stage (layers 4-5, which computes the loss from targets and steps its optimizer),
    as role ``pipeline`` (trainers) or ``stage`` (replicas: syncs must be refused).

    Health: no replica sync was applied; every parameter is finite; unless training is
    legitimate here (the last stage as ``pipeline``: a forward with valid targets steps the
    optimizer), the parameters are bit-for-bit unchanged, no optimizer step was taken and a
    legitimate STAGE_INFER returns exactly the output it returned before the campaign; a
    legitimate forward is answered (on the last stage: with a finite loss).

    Raises:
        ValueError: an unknown ``position``/``role`` pair.
    """
    from swarmtrain.roles.stage import ComputeConfig, StageServer, StageServerConfig, build_stage
    from swarmtrain.tasks import TextLMConfig, TextLMTask

    if (position, role) not in _STAGE_NAMES:
        raise ValueError(f"no stage target for position {position!r} and role {role!r}; "
                         f"choose one of {sorted(_STAGE_NAMES)}")
    task = TextLMTask(TextLMConfig(context=32, d_model=32, n_heads=2, n_layers=4))
    index, (start, stop) = _STAGE_POSITIONS[position]
    first, last = position == "first", position == "last"
    layers, loss_fn = build_stage(task.build_model, seed, start, stop)
    server = StageServer(layers, stage=index, layer_range=(start, stop), loss_fn=loss_fn if last else None,
                         compute=ComputeConfig(learning_rate=1e-2),
                         config=StageServerConfig(timeouts=FUZZ_TIMEOUTS), secret=SECRET, name="fuzz-stage")
    shapes = {n: tuple(t.shape) for n, t in server.compute.parameters_snapshot().items()}
    training = last and role == "pipeline"  # valid forwards with targets legitimately step

    def x(rng: random.Random, b: int | None = None, t: int | None = None) -> torch.Tensor:
        b, t = b or rng.randint(1, 4), t or rng.randint(1, 32)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        if first:
            return torch.randint(0, 256, (b, t), generator=gen)
        return torch.randn((b, t, 32), generator=gen)

    def forward(rng: random.Random, req: int) -> StageForward:
        b, t = rng.randint(1, 4), rng.randint(1, 32)
        tensors = {"x": x(rng, b, t)}
        if last:
            tensors["targets"] = _hostile_targets(rng, b, t)
        return StageForward(req=req, session=f"F{req}", microbatch=rng.randrange(100),
                            priority=rng.choice([0, 10, 20]), tensors=tensors,
                            sync=rng.random() < 0.5, step=rng.random() < 0.5)

    def seeds(rng: random.Random) -> list[Message]:
        req = rng.randrange(2**31)
        common: list[Message] = [
            forward(rng, req),
            StageInfer(req=req, session="fz", priority=rng.choice([0, 10]), tensors={"x": x(rng)}),
            StageBackward(req=req, session=f"zz{req}", microbatch=rng.randrange(100),
                          tensors={"grad": nan_tensor(rng, (2, 8, 32))}, sync=rng.random() < 0.5,
                          step=rng.random() < 0.5),
            StatusRequest(), Heartbeat(time=0.0), Shutdown(reason="fuzz")]
        syncs = _bad_syncs(rng, shapes)
        if role == "stage":  # replica syncs are what this role is for: most inputs are syncs
            return common[:3] + [StageSync(req=req, round=rng.randrange(10), step=rng.randrange(10),
                                           reply=rng.random() < 0.2, tensors=s) for s in syncs]
        return common + [StageSync(req=req, round=rng.randrange(10), step=0, reply=rng.random() < 0.3,
                                   tensors=rng.choice(syncs))]

    ref_x = x(random.Random(seed), 2, 16)
    ref_targets = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    report = FuzzReport(_STAGE_NAMES[(position, role)], seed)
    with capture_errors() as errors:
        await server.start()
        try:
            ref = await _ask(server.port, "pipeline", StageInfer(req=1, session="ref", tensors={"x": ref_x}))
            if not isinstance(ref, StageResult):
                raise SwarmError(f"the reference inference failed: {ref}")
            before = server.compute.parameters_snapshot()
            infer = StageInfer(req=2, session="health", tensors={"x": ref_x})
            await run_campaign(report, server.port, role, seeds, (Heartbeat,),
                               lambda: _live(server.port, "pipeline", infer, StageResult),
                               count=count, seconds=seconds, concurrency=concurrency, progress=progress)
            after = server.compute.parameters_snapshot()
            report.notes.append(f"optimizer steps {server.compute.steps}, syncs applied {server.sync_served}")
            if server.sync_served:
                report.health.append(f"{server.sync_served} replica sync(s) the fuzzer made invalid "
                                     "were applied")
            if not all(bool(torch.isfinite(t).all()) for t in after.values()):
                bad = sorted(n for n, t in after.items() if not bool(torch.isfinite(t).all()))
                report.health.append(f"parameters became non-finite: {bad[:5]} "
                                     f"(optimizer steps: {server.compute.steps})")
            elif not training and (any(not torch.equal(before[n], after[n]) for n in before)
                                   or server.compute.steps):
                report.health.append(f"the parameters changed (optimizer steps: {server.compute.steps})")
            again = await _ask(server.port, "pipeline", infer)
            if report.health or training:
                pass  # with other weights the reference output cannot come back
            elif not (isinstance(again, StageResult) and torch.equal(again.tensors["y"], ref.tensors["y"])):
                report.health.append(f"inference no longer gives the reference output: {again}")
            tensors = {"x": ref_x, "targets": ref_targets} if last else {"x": ref_x}
            fwd = await _ask(server.port, "pipeline", StageForward(req=3, session="health", microbatch=0,
                                                                   tensors=tensors))
            if not isinstance(fwd, StageResult):
                report.health.append(f"a legitimate forward failed: {fwd}")
            elif last and not (fwd.tensors["y"].numel() == 1 and math.isfinite(float(fwd.tensors["y"]))):
                report.health.append(f"a legitimate forward gave the loss {fwd.tensors['y']}")
            elif not last and fwd.tensors["y"].shape != ref.tensors["y"].shape:
                report.health.append(f"a legitimate forward gave an output of shape {fwd.tensors['y'].shape}")
        except (SwarmError, OSError, TimeoutError) as exc:
            report.health.append(f"health check failed: {type(exc).__name__}: {exc}")
        finally:
            collect_crashes(report, errors)
            await server.close()
    return report


# --- peer --------------------------------------------------------------------------------------


async def fuzz_peer(count: int = 300, *, seconds: float = math.inf, seed: int = 0, concurrency: int = 16,
                    progress: Progress = None) -> FuzzReport:
    """Fuzz a :class:`~swarmtrain.roles.peer.backend.PeerBackend`'s control server as role ``peer``.

    Health: the control port answers a legitimate PEER_HELLO with this peer's PEER_INFO and a
    STATUS_REQUEST, and the membership epoch did not move.
    """
    from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
    from swarmtrain.roles.peer.membership import signed_bytes
    from swarmtrain.transport.identity import Identity

    opts = PeerOptions(run="fuzz", min_peers=1, host="127.0.0.1", port=0, mdns=False,
                       static_peers=(("127.0.0.1", dead_port()),), profile="fuzz",
                       heartbeat_interval_sec=FUZZ_TIMEOUTS.heartbeat_interval,
                       heartbeat_timeout_sec=FUZZ_TIMEOUTS.heartbeat_timeout,
                       propose_timeout_sec=FUZZ_TIMEOUTS.handshake)
    backend = PeerBackend(opts, secret=SECRET, identity=Identity.generate())
    fuzzer = Identity.generate()

    def signed(msg: Propose | Commit | Accept) -> Message:
        msg = dataclasses.replace(msg, public_key=fuzzer.public_key)
        return dataclasses.replace(msg, signature=fuzzer.sign(signed_bytes(msg)))

    def seeds(rng: random.Random) -> list[Message]:
        members = [rng.randbytes(16).hex() for _ in range(rng.randrange(4))] + [fuzzer.peer_id]
        addresses = {m: ["127.0.0.1", rng.randrange(65536)] for m in members}
        epoch = rng.choice([1, 2, rng.randrange(10**6), 2**63 - 1])
        return [PeerHello(run="fuzz"), PeerHello(run="other"), StatusRequest(), Heartbeat(time=0.0),
                signed(Propose(epoch=epoch, proposer=fuzzer.peer_id, members=members, addresses=addresses)),
                signed(Commit(epoch=epoch, proposer=fuzzer.peer_id, members=members, addresses=addresses,
                              donor=members[0])),
                signed(Accept(epoch=epoch, peer_id=fuzzer.peer_id, ok=True, rounds=0)),
                Propose(epoch=epoch, proposer=members[0], members=members, addresses=addresses,
                        public_key=rng.randbytes(32), signature=rng.randbytes(64)),
                Reform(epoch=epoch, peer_id=members[0])]

    report = FuzzReport("peer", seed)
    loop = asyncio.get_running_loop()
    with capture_errors() as errors:
        await loop.run_in_executor(None, backend.start)
        try:
            port, epoch = backend.port, backend.epoch
            hello = PeerHello(run="fuzz")
            await run_campaign(report, port, "peer", seeds, (Heartbeat,),
                               lambda: _live(port, "peer", hello, PeerInfoMsg),
                               count=count, seconds=seconds, concurrency=concurrency, progress=progress)
            info = await _ask(port, "peer", hello)
            if not (isinstance(info, PeerInfoMsg) and backend.identity is not None
                    and info.peer_id == backend.identity.peer_id):
                report.health.append(f"PEER_HELLO was answered with {info}")
            if (problem := await _live(port, "peer", StatusRequest(), Status)) is not None:
                report.health.append(problem)
            if backend.epoch != epoch:
                report.health.append(f"the membership epoch moved {epoch} -> {backend.epoch}")
        except (SwarmError, OSError, TimeoutError) as exc:
            report.health.append(f"health check failed: {type(exc).__name__}: {exc}")
        finally:
            collect_crashes(report, errors)
            await loop.run_in_executor(None, backend.close)
    return report


TARGETS: dict[str, Callable[..., Awaitable[FuzzReport]]] = {
    "coordinator": fuzz_coordinator,
    "ctl": fuzz_ctl,
    "stage": fuzz_stage,
    "stage-mid": functools.partial(fuzz_stage, position="middle"),
    "stage-last": functools.partial(fuzz_stage, position="last"),
    "stage-replica": functools.partial(fuzz_stage, position="middle", role="stage"),
    "peer": fuzz_peer,
    "ring": fuzz_ring,
}
"""Every fuzz target by name: ``await TARGETS[name](count, seconds=..., seed=..., progress=...)``."""
