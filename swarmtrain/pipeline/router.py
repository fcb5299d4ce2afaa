"""Client side of the pipeline: which replica of each stage gets the next request.

A :class:`Router` knows the replicas of every stage by address and keeps one multiplexed
connection to each (requests carry ``req`` ids, answers come back in any order). It picks
the replica with the smallest expected answer time (an EWMA of its measured answer times,
times the requests it already has in flight; unmeasured replicas are tried first). A
replica that times out, drops its connection or says it is overloaded is banned for a time
that doubles with each consecutive failure (``ban_base``, ``2 × ban_base``, … up to
``ban_cap``), and the request is resent to another replica of the same stage.

A backward must reach the replica that did the forward (it holds the activations), so
:meth:`Router.backward` does not fail over: it raises :class:`ReplicaFailed` or
:class:`MicrobatchLost` and the trainer redoes the forward elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmtrain.errors import RefusedError, SwarmError
from swarmtrain.pipeline.buffers import Priority
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import (
    Error,
    Message,
    StageBackward,
    StageError,
    StageForward,
    StageGrad,
    StageInfer,
    StageResult,
)

__all__ = ["MicrobatchLost", "Replica", "ReplicaFailed", "Router", "RouterConfig", "StageUnavailable"]

log = logging.getLogger("swarmtrain.pipeline")

_RETRYABLE = {"overloaded", "closing"}


class ReplicaFailed(SwarmError):
    """A replica did not answer (timeout, connection lost, overloaded); it is now banned."""


class MicrobatchLost(SwarmError):
    """The replica does not hold the forward a backward needs (evicted or never done there)."""


class StageUnavailable(SwarmError):
    """No replica of a stage answered within the attempts and waiting time allowed."""


@dataclass(frozen=True)
class RouterConfig:
    """How a router waits, bans and retries.

    Attributes:
        request_timeout: seconds to wait for one answer before the replica counts as failed.
        ban_base: seconds of the first ban of a failing replica; doubles per further failure.
        ban_cap: longest ban, in seconds.
        ewma_alpha: weight of the newest answer time in a replica's average (0 < a <= 1).
        max_attempts: most replicas tried for one request before giving up.
        wait_for_replica: most seconds to wait for a ban to end when every replica of a
            stage is banned.
        timeouts: transport timeouts of the connections to replicas.
    """

    request_timeout: float = 30.0
    ban_base: float = 2.0
    ban_cap: float = 60.0
    ewma_alpha: float = 0.3
    max_attempts: int = 8
    wait_for_replica: float = 60.0
    timeouts: Timeouts = Timeouts()


@dataclass(eq=False)
class Replica:
    """One server of one stage, and what the router has measured about it."""

    stage: int
    host: str
    port: int
    ewma_seconds: float | None = None  # smoothed answer time; None until measured
    inflight: int = 0
    consecutive_failures: int = 0
    banned_until: float = 0.0
    answered: int = 0
    failures: int = 0
    conn: Connection | None = field(default=None, repr=False)
    pending: dict[int, asyncio.Future[Message]] = field(default_factory=dict, repr=False)
    reader: asyncio.Task[None] | None = field(default=None, repr=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"stage{self.stage}@{self.host}:{self.port}"


class Router:
    """Sends stage requests to the best live replica, with bans and failover.

    Args:
        stages: for each stage, in order, the ``(host, port)`` of its replicas.
        secret: the cluster secret.
        config: timeouts, ban lengths, attempts.
        tls: mutual TLS for the connections to stages (None = plain TCP).
        clock: monotonic clock for bans and answer times (injectable for tests).

    Raises:
        ValueError: no stages, or a stage without replicas.
    """

    def __init__(self, stages: Sequence[Sequence[tuple[str, int]]], *, secret: bytes | None,
                 config: RouterConfig = RouterConfig(),
                 clock: Callable[[], float] = time.monotonic, tls: TLSConfig | None = None) -> None:
        if not stages or any(not s for s in stages):
            raise ValueError("a router needs at least one stage, and every stage at least one replica")
        self.config = config
        self.secret = secret
        self.tls = tls
        self._clock = clock
        self.replicas = [[Replica(i, h, p) for h, p in s] for i, s in enumerate(stages)]
        self._ids = itertools.count(1)
        self.resends = 0  # requests sent again to another replica after a failure
        self.bans = 0

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    async def forward(self, stage: int, session: str, microbatch: int, x: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      priority: Priority = Priority.TRAINING_FORWARD, *,
                      step: bool | None = None, prefer: Replica | None = None) -> tuple[Replica, StageResult]:
        """Training forward on the best replica of ``stage`` (``prefer`` if it is live: the
        replica the rest of a synchronous group went to), failing over to others. ``step``:
        the trainer's step decision for the last stage (None: the stage counts).

        Returns:
            The replica that answered (backwards must go to it) and its answer.

        Raises:
            StageUnavailable: no replica answered.
            RefusedError: the stage refused the request itself (bad input).
        """
        tensors = {"x": x} if targets is None else {"x": x, "targets": targets}

        def build(req: int) -> Message:
            return StageForward(req=req, session=session, microbatch=microbatch, priority=int(priority),
                                tensors=tensors, sync=step is not None, step=bool(step))

        replica, answer = await self._call_stage(stage, build, prefer)
        assert isinstance(answer, StageResult)
        return replica, answer

    async def backward(self, replica: Replica, session: str, microbatch: int,
                       grad: torch.Tensor, *, step: bool | None = None) -> StageGrad:
        """The backward of a micro-batch, on the replica that did its forward (``step``: the
        trainer's step decision, None: the stage counts).

        Raises:
            ReplicaFailed: the replica did not answer (it is banned now).
            MicrobatchLost: the replica does not hold the forward.
            RefusedError: the replica refused the gradient (bad input).
        """
        answer = await self._request(replica, lambda req: StageBackward(
            req=req, session=session, microbatch=microbatch, tensors={"grad": grad},
            sync=step is not None, step=bool(step)))
        assert isinstance(answer, StageGrad)
        return answer

    async def infer(self, stage: int, session: str, x: torch.Tensor,
                    priority: Priority = Priority.INFERENCE_NORMAL) -> torch.Tensor:
        """Forward without gradients on the best replica of ``stage``; its output.

        Raises:
            StageUnavailable: no replica answered.
            RefusedError: the stage refused the request itself (bad input).
        """
        _, answer = await self._call_stage(stage, lambda req: StageInfer(
            req=req, session=session, priority=int(priority), tensors={"x": x}))
        assert isinstance(answer, StageResult)
        return answer.tensors["y"]

    async def close(self) -> None:
        """Close every connection; pending requests fail."""
        for replica in itertools.chain.from_iterable(self.replicas):
            self._drop(replica, SwarmError("router closed"))
            if replica.reader is not None:
                await asyncio.gather(replica.reader, return_exceptions=True)
            if replica.conn is not None:
                await replica.conn.close()

    def stats(self) -> dict[str, Any]:
        """Resends, bans, and per replica its answers, failures and answer-time average."""
        return {
            "resends": self.resends, "bans": self.bans,
            "replicas": {r.name: {"answered": r.answered, "failures": r.failures,
                                  "ewma_ms": None if r.ewma_seconds is None else r.ewma_seconds * 1e3}
                         for r in itertools.chain.from_iterable(self.replicas)},
        }

    # -- choosing and calling --------------------------------------------------------------

    def _pick(self, stage: int, tried: Collection[Replica], prefer: Replica | None = None) -> Replica | None:
        now = self._clock()
        live = [r for r in self.replicas[stage] if r.banned_until <= now]
        if prefer is not None and prefer in live and prefer not in tried:
            return prefer
        fresh = [r for r in live if r not in tried] or live
        if not fresh:
            return None
        return min(fresh, key=lambda r: ((r.ewma_seconds or 0.0) * (r.inflight + 1), r.inflight))

    async def _call_stage(self, stage: int, build: Callable[[int], Message],
                          prefer: Replica | None = None) -> tuple[Replica, Message]:
        tried: list[Replica] = []
        last_error = "every replica is banned"
        deadline = self._clock() + self.config.wait_for_replica
        while len(tried) < self.config.max_attempts:
            replica = self._pick(stage, tried, prefer)
            if replica is None:
                wake = min(r.banned_until for r in self.replicas[stage])
                if wake > deadline:
                    break
                await asyncio.sleep(max(0.0, wake - self._clock()))
                continue
            if tried:
                self.resends += 1
            tried.append(replica)
            try:
                return replica, await self._request(replica, build)
            except ReplicaFailed as exc:
                last_error = str(exc)
                log.info("%s; resending to another replica", exc)
        raise StageUnavailable(
            f"no replica of stage {stage} answered after {len(tried)} attempts ("
            + ", ".join(f"{r.name} failed {r.failures}x" for r in self.replicas[stage])
            + f"); last error: {last_error}"
        )

    async def _request(self, replica: Replica, build: Callable[[int], Message]) -> Message:
        req = next(self._ids)
        loop = asyncio.get_running_loop()
        started = self._clock()
        replica.inflight += 1
        try:
            conn = await self._connection(replica)
            fut: asyncio.Future[Message] = loop.create_future()
            replica.pending[req] = fut
            await conn.send(build(req), timeout=self.config.request_timeout)
            async with asyncio.timeout(self.config.request_timeout):
                answer = await fut
        except (TimeoutError, SwarmError, OSError) as exc:
            if isinstance(exc, RefusedError):
                raise
            raise self._failed(replica, exc) from exc
        finally:
            replica.inflight -= 1
            replica.pending.pop(req, None)
        if isinstance(answer, StageError):
            if answer.code in _RETRYABLE:
                raise self._failed(replica, RefusedError(answer.code, answer.message))
            if answer.code == "unknown_microbatch":
                raise MicrobatchLost(answer.message)
            raise RefusedError(answer.code, answer.message)
        elapsed = self._clock() - started
        a = self.config.ewma_alpha
        replica.ewma_seconds = elapsed if replica.ewma_seconds is None else (
            a * elapsed + (1 - a) * replica.ewma_seconds)
        replica.consecutive_failures = 0
        replica.answered += 1
        return answer

    def _failed(self, replica: Replica, exc: BaseException) -> ReplicaFailed:
        why = str(exc) or type(exc).__name__
        replica.failures += 1
        now = self._clock()
        # Requests that were in flight when a replica failed fail together: one incident,
        # one ban. Only a failure after the ban has ended lengthens the next one.
        if replica.banned_until <= now:
            replica.consecutive_failures += 1
            ban = min(self.config.ban_base * 2 ** (replica.consecutive_failures - 1), self.config.ban_cap)
            replica.banned_until = now + ban
            self.bans += 1
            log.warning("banning %s for %.1f s after: %s", replica.name, ban, why)
        self._drop(replica, exc)
        return ReplicaFailed(f"{replica.name}: {why}")

    async def _connection(self, replica: Replica) -> Connection:
        async with replica.lock:
            if replica.conn is None or replica.conn.is_closed:
                replica.conn = await connect(replica.host, replica.port, secret=self.secret, tls=self.tls,
                                             role="pipeline", timeouts=self.config.timeouts)
                replica.reader = asyncio.create_task(self._read(replica, replica.conn),
                                                     name=f"router-read-{replica.name}")
            return replica.conn

    async def _read(self, replica: Replica, conn: Connection) -> None:
        reason: BaseException = SwarmError("connection closed")
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, Error):
                    reason = RefusedError(msg.code, msg.message)
                    if msg.fatal:
                        break
                    continue
                fut = replica.pending.get(getattr(msg, "req", -1))
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except SwarmError as exc:
            reason = exc
        if replica.conn is conn:
            self._drop(replica, reason)

    def _drop(self, replica: Replica, reason: BaseException) -> None:
        conn, replica.conn = replica.conn, None
        if conn is not None:
            conn.abort(reason if isinstance(reason, Exception) else SwarmError(str(reason)))
        for fut in replica.pending.values():
            if not fut.done():
                fut.set_exception(SwarmError(f"{replica.name}: {reason}"))
        replica.pending.clear()
        with contextlib.suppress(RuntimeError):
            if replica.reader is not None and replica.reader is not asyncio.current_task():
                replica.reader.cancel()
