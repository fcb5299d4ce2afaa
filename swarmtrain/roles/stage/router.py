"""Client side of the pipeline: which replica of each stage gets the next request.

A :class:`Router` knows the replicas of every stage by address and keeps one multiplexed
connection to each (requests carry ``req`` ids, answers come back in any order). It picks
the replica with the smallest expected answer time (an EWMA of its measured answer times,
from the request sent to its answer, times the requests it already has in flight;
unmeasured replicas are tried first). A replica left idle while another of its stage is
used is sent the next request once it has been idle for ``remeasure_after`` seconds and 20
of its own answer times, and that answer replaces the old estimate: so an estimate that one
slow answer set (a warm-up, a passing load) is measured again instead of leaving the replica
unused for the rest of the run, and one that is still slow takes about a twentieth of the
time at most. A
replica that times out, drops its connection or says it is overloaded is banned for a time
that doubles with each consecutive failure (``ban_base``, ``2 × ban_base``, … up to
``ban_cap``), and the request is resent to another replica of the same stage.

A backward must reach the replica that did the forward (it holds the activations), so
:meth:`Router.backward` does not fail over: it raises :class:`ReplicaFailed` or
:class:`MicrobatchLost` and the trainer redoes the forward elsewhere.

When every replica of a stage is down, a request waits for one to come back, up to
``wait_for_replica`` seconds (saying so in the log, with what to run), instead of giving up
after a number of attempts. Banned replicas are probed (a status request) every
``probe_interval`` seconds, and a ban is lifted as soon as the replica answers. Every new
connection starts with a status request, and a replica is not used when it does not fit
what the route was checked against (:meth:`Router.expect`: another model shape or weight
lineage) or when it came back with its seed's weights while its stage has trained. A
replica that comes back as a new process (another ``incarnation``) is reported, with the
optimizer steps it lost: those no checkpoint or replica held (``lost_steps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from swarmtrain.core.ema import MovingAverage
from swarmtrain.errors import RefusedError, RemoteProtocolError, SwarmError
from swarmtrain.roles.stage.buffers import Priority
from swarmtrain.roles.stage.codes import RETRYABLE, StageErrorCode
from swarmtrain.roles.stage.route import replica_problem, request_status
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.transport.auth import cluster_secret
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
    StageStep,
)

__all__ = ["CacheMissed", "Expected", "MicrobatchLost", "Replica", "ReplicaFailed", "Router", "RouterConfig",
           "StageUnavailable"]

log = logging.getLogger("swarmtrain.roles.stage")

#: the kind of answer a request takes
_M = TypeVar("_M", bound=Message)

#: seconds between "still waiting for stage I" lines
_WAIT_REPORT_EVERY = 30.0
#: an idle replica is measured again after this many of its answer times (at least), so one
#: that is still slow takes about 1/20 of the time
_REMEASURE_SHARE = 20.0


class ReplicaFailed(SwarmError):
    """A replica did not answer (timeout, connection lost, overloaded); it is now banned."""


class MicrobatchLost(SwarmError):
    """The replica does not hold the forward a backward needs (evicted or never done there)."""


class CacheMissed(SwarmError):
    """A replica does not hold the attention cache a generation step needs: resend the window
    from position 0."""


class StageUnavailable(SwarmError):
    """No replica of a stage answered within the attempts and waiting time allowed."""


@dataclass(frozen=True)
class RouterConfig:
    """How a router waits, bans and retries.

    Attributes:
        request_timeout: seconds to wait for one answer before the replica counts as failed.
        ban_base: seconds of the first ban of a failing replica; doubles per further failure.
        ban_cap: longest ban, in seconds.
        ewma_alpha: weight of the newest answer time in a replica's average (0 < a <= 1);
            0.3 follows a replica that slows down (another job, a thermal throttle) within
            about three answers, while one slow micro-batch does not send traffic away.
        max_attempts: most live replicas tried one after the other for one request before
            it waits for one to come back (a round; rounds go on until ``wait_for_replica``).
        wait_for_replica: most seconds one request waits for a replica of its stage to
            come back when none answers (then :class:`StageUnavailable`).
        probe_interval: seconds between status probes of a banned replica (its ban is
            lifted as soon as one is answered).
        remeasure_after: seconds a live replica may stay idle, while another replica of its
            stage is sent requests, before it is sent the next one to measure its answer
            time again (and at least 20 of its answer times, so a slow replica's share of
            the time stays small).
        timeouts: transport timeouts of the connections to replicas.
    """

    request_timeout: float = 30.0
    ban_base: float = 2.0
    ban_cap: float = 60.0
    ewma_alpha: float = 0.3
    max_attempts: int = 8
    wait_for_replica: float = 300.0
    probe_interval: float = 1.0
    remeasure_after: float = 1.0
    timeouts: Timeouts = Timeouts()

    def __post_init__(self) -> None:
        if (self.wait_for_replica < 0 or not self.probe_interval > 0 or self.max_attempts < 1
                or not self.remeasure_after > 0):
            raise ValueError("RouterConfig: wait_for_replica must be >= 0, probe_interval > 0, "
                             "remeasure_after > 0 and max_attempts >= 1")


@dataclass(frozen=True)
class Expected:
    """What the replicas of one stage must be to be routed to (from the checked route)."""

    shape: str = ""  # the layers' shape signature ("" = not checked)
    origin: str = ""  # the weight lineage ("" = not checked)


@dataclass(eq=False)
class Replica:
    """One server of one stage, and what the router has measured about it."""

    stage: int
    host: str
    port: int
    #: its answer time, smoothed (the router sets the keep from ``RouterConfig.ewma_alpha``)
    answer_time: MovingAverage = field(default_factory=lambda: MovingAverage(0.7))
    inflight: int = 0
    #: when it was last sent a request (the router's clock; -inf: never)
    last_sent: float = -math.inf
    consecutive_failures: int = 0
    banned_until: float = 0.0
    answered: int = 0
    failures: int = 0
    #: what its answers last said: process id, optimizer steps, steps only it holds
    incarnation: str = ""
    steps: int = 0
    at_risk: int = 0
    refused: str = ""  # why it is not routed to ("" = it is)
    restarts: int = 0
    conn: Connection | None = field(default=None, repr=False)
    pending: dict[int, asyncio.Future[Message]] = field(default_factory=dict, repr=False)
    reader: asyncio.Task[None] | None = field(default=None, repr=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"stage{self.stage}@{self.host}:{self.port}"

    @property
    def ewma_seconds(self) -> float | None:
        """Its smoothed answer time in seconds; None until measured."""
        return self.answer_time.value


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

    def __init__(self, stages: Sequence[Sequence[tuple[str, int]]], *, secret: bytes | str | None,
                 config: RouterConfig = RouterConfig(),
                 clock: Callable[[], float] = time.monotonic, tls: TLSConfig | None = None) -> None:
        if not stages or any(not s for s in stages):
            raise ValueError("a router needs at least one stage, and every stage at least one replica")
        self.config = config
        self.secret = cluster_secret(secret)
        self.tls = tls
        self._clock = clock
        keep = 1.0 - self.config.ewma_alpha
        self.replicas = [[Replica(i, h, p, answer_time=MovingAverage(keep)) for h, p in s]
                         for i, s in enumerate(stages)]
        self._ids = itertools.count(1)
        self.resends = 0  # requests sent again to another replica after a failure
        self.bans = 0
        self.bans_lifted = 0  # bans ended early because the replica answered a probe
        self.waits = 0  # times a request waited for a stage with no live replica
        self.expected: list[Expected] = [Expected() for _ in self.replicas]
        #: per stage, optimizer steps lost by replicas that restarted (see the module docstring)
        self.lost_steps = [0] * len(self.replicas)
        #: one entry per replica restart seen: who, when (monotonic), from what, steps lost
        self.restart_log: list[dict[str, Any]] = []
        self._probe_task: asyncio.Task[None] | None = None
        self._lifted: dict[int, asyncio.Event] = {}  # per stage: set when a ban is lifted
        #: stages with no live replica now: (since, last reported), monotonic seconds
        self._outages: dict[int, tuple[float, float]] = {}

    def expect(self, stage: int, *, shape: str = "", origin: str = "") -> None:
        """Route ``stage``'s requests only to replicas with this shape signature and weight
        lineage (checked on every new connection and every probe)."""
        self.expected[stage] = Expected(shape, origin)

    def note_status(self, replica: Replica, status: dict[str, Any]) -> None:
        """Take what a status says about ``replica`` (its incarnation, steps) as its answers'."""
        self._seen(replica, str(status.get("incarnation", "")), int(status.get("steps", 0)),
                   int(status.get("at_risk", 0)), str(status.get("started_from", "")))

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    async def forward(self, stage: int, session: str, microbatch: int, x: torch.Tensor,
                      targets: torch.Tensor | None = None,
                      priority: Priority = Priority.TRAINING_FORWARD, *,
                      step: bool | None = None, prefer: Replica | None = None,
                      group: tuple[int, int] | None = None) -> tuple[Replica, StageResult]:
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
        first, size = group or (-1, 0)

        def build(req: int) -> Message:
            return StageForward(req=req, session=session, microbatch=microbatch, priority=int(priority),
                                tensors=tensors, sync=step is not None, step=bool(step), group=first,
                                group_size=size)

        replica, answer = await self._call_stage(stage, StageResult, build, prefer)
        return replica, answer

    async def backward(self, replica: Replica, session: str, microbatch: int,
                       grad: torch.Tensor, *, step: bool | None = None,
                       group: tuple[int, int] | None = None) -> StageGrad:
        """The backward of a micro-batch, on the replica that did its forward (``step``: the
        trainer's step decision, None: the stage counts).

        Raises:
            ReplicaFailed: the replica did not answer (it is banned now).
            MicrobatchLost: the replica does not hold the forward.
            RefusedError: the replica refused the gradient (bad input).
        """
        first, size = group or (-1, 0)
        answer = await self._request(replica, lambda req: StageBackward(
            req=req, session=session, microbatch=microbatch, tensors={"grad": grad},
            sync=step is not None, step=bool(step), group=first, group_size=size))
        return self._check_answer(replica, answer, StageGrad)

    async def infer(self, stage: int, session: str, x: torch.Tensor,
                    priority: Priority = Priority.INFERENCE_NORMAL) -> torch.Tensor:
        """Forward without gradients on the best replica of ``stage``; its output.

        Raises:
            StageUnavailable: no replica answered.
            RefusedError: the stage refused the request itself (bad input).
        """
        _, answer = await self._call_stage(stage, StageResult, lambda req: StageInfer(
            req=req, session=session, priority=int(priority), tensors={"x": x}))
        return answer.tensors["y"]

    async def step(self, stage: int, session: str, group: tuple[int, int], scale: float, *,
                   prefer: Replica | None = None) -> tuple[Replica, StageStep]:
        """The synchronous step of ``group`` at ``stage``, on ``prefer`` (the replica holding
        the group's gradients) if it is live, else on another (which then says it misses
        the group, and the caller gives it the group again).

        Raises:
            StageUnavailable: no replica answered.
            RefusedError: the stage refused the request itself.
        """
        replica, answer = await self._call_stage(stage, StageStep, lambda req: StageStep(
            req=req, session=session, group=group[0], group_size=group[1], scale=scale), prefer)
        return replica, answer

    async def infer_cached(self, stage: int, session: str, x: torch.Tensor, start: int, *,
                           prefer: Replica | None = None,
                           priority: Priority = Priority.INFERENCE_URGENT) -> tuple[Replica, torch.Tensor]:
        """A cached generation step at ``stage`` (``x``: positions from ``start``), on
        ``prefer`` (the replica holding the session's cache) if it is live.

        Returns:
            The replica that answered (send the session's next steps there) and the output.

        Raises:
            CacheMissed: the replica holds no cache of ``start`` positions for ``session``.
            StageUnavailable: no replica answered.
            RefusedError: the stage refused the request itself (bad input).
        """
        replica, answer = await self._call_stage(stage, StageResult, lambda req: StageInfer(
            req=req, session=session, priority=int(priority), tensors={"x": x}, cache=True, start=start),
            prefer)
        return replica, answer.tensors["y"]

    async def close(self) -> None:
        """Close every connection; pending requests fail."""
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        for replica in itertools.chain.from_iterable(self.replicas):
            self._drop(replica, SwarmError("router closed"))
            if replica.reader is not None:
                await asyncio.gather(replica.reader, return_exceptions=True)
            if replica.conn is not None:
                await replica.conn.close()

    def stats(self) -> dict[str, Any]:
        """Resends, bans, and per replica its answers, failures and answer-time average."""
        now = self._clock()
        return {
            "resends": self.resends, "bans": self.bans, "bans_lifted": self.bans_lifted, "waits": self.waits,
            "lost_steps": list(self.lost_steps), "restarts": list(self.restart_log),
            "replicas": {r.name: {"answered": r.answered, "failures": r.failures,
                                  "ewma_ms": None if r.ewma_seconds is None else r.ewma_seconds * 1e3,
                                  "banned_for": max(0.0, r.banned_until - now), "refused": r.refused,
                                  "incarnation": r.incarnation, "steps": r.steps, "at_risk": r.at_risk,
                                  "restarts": r.restarts}
                         for r in itertools.chain.from_iterable(self.replicas)},
        }

    # -- choosing and calling --------------------------------------------------------------

    def choose(self, stage: int) -> Replica | None:
        """The replica of ``stage`` the next request would go to now (None: all banned), for
        a caller that sends several requests to one replica (a synchronous group)."""
        return self._pick(stage, ())

    def _pick(self, stage: int, tried: Collection[Replica], prefer: Replica | None = None) -> Replica | None:
        now = self._clock()
        live = [r for r in self.replicas[stage] if r.banned_until <= now]
        if prefer is not None and prefer in live and prefer not in tried:
            return prefer
        fresh = [r for r in live if r not in tried] or live
        if not fresh:
            return None
        idle = [r for r in fresh if self._due_for_measuring(r, now)]
        if idle and len(idle) < len(fresh):
            return min(idle, key=lambda r: r.last_sent)
        return min(fresh, key=lambda r: ((r.ewma_seconds or 0.0) * (r.inflight + 1), r.inflight))

    def _due_for_measuring(self, replica: Replica, now: float) -> bool:
        """Whether ``replica``'s answer time is stale at ``now``: measured, nothing in flight,
        and no request sent for ``remeasure_after`` seconds and 20 of its answer times. The
        router sends a stale replica the next request only while another replica of its stage
        is in use, and its answer then replaces the estimate."""
        est = replica.ewma_seconds
        return (est is not None and replica.inflight == 0
                and now - replica.last_sent >= max(self.config.remeasure_after, _REMEASURE_SHARE * est))

    async def _call_stage(self, stage: int, expect: type[_M], build: Callable[[int], Message],
                          prefer: Replica | None = None) -> tuple[Replica, _M]:
        """Send to the best live replica of ``stage``, failing over to the others; when none
        is live, wait (up to ``wait_for_replica``) for a ban to end or be lifted by a probe.
        An answer that is not an ``expect`` (a stage that is not what it claims, or broken)
        fails that replica like a lost connection: banned, and the request goes elsewhere."""
        tried: list[Replica] = []
        last_error = "every replica is banned"
        deadline = self._clock() + self.config.wait_for_replica
        while True:
            replica = None if len(tried) >= self.config.max_attempts else self._pick(stage, tried, prefer)
            if replica is not None and replica in tried:
                replica = None  # every live replica failed this round: wait for one to come back
            if replica is None:
                now = self._clock()
                if now >= deadline:
                    break
                self._report_wait(stage, now, deadline - now, last_error)
                tried.clear()
                await self._wait_for_stage(stage, min(deadline, self._next_ban_end(stage)) - now)
                continue
            if tried:
                self.resends += 1
            tried.append(replica)
            try:
                answer = self._check_answer(replica, await self._request(replica, build), expect)
            except ReplicaFailed as exc:
                last_error = str(exc)
                log.info("%s; resending to another replica", exc)
                continue
            outage = self._outages.pop(stage, None)
            if outage is not None:
                log.warning("stage %d answers again (%s) after %.0f s without a live replica", stage,
                            replica.name, self._clock() - outage[0])
            return replica, answer
        raise StageUnavailable(
            f"no replica of stage {stage} answered within {self.config.wait_for_replica:g} s ("
            + ", ".join(f"{r.name} failed {r.failures}x" + (f", {r.refused}" if r.refused else "")
                        for r in self.replicas[stage])
            + f"); last error: {last_error}"
        )

    def _report_wait(self, stage: int, now: float, left: float, last_error: str) -> None:
        """Say (once per stage and ``_WAIT_REPORT_EVERY`` seconds, whatever the number of
        requests waiting) that ``stage`` has no live replica, and what to do."""
        since, reported = self._outages.get(stage, (now, -math.inf))
        if now - reported < _WAIT_REPORT_EVERY:
            return
        if reported == -math.inf:
            self.waits += 1
        self._outages[stage] = (since, now)
        log.warning("no replica of stage %d answers (%s); waiting up to %.0f s more for one to come back. "
                    "Restart it: `swarmtrain stage --stage %d ... --resume` (its checkpoints), or with "
                    "--sync-with a live replica of stage %d", stage, last_error, left, stage, stage)

    def _next_ban_end(self, stage: int) -> float:
        now = self._clock()
        ends = [r.banned_until for r in self.replicas[stage] if r.banned_until > now]
        return min(ends) if ends else now + self.config.probe_interval

    async def _wait_for_stage(self, stage: int, seconds: float) -> None:
        """Sleep up to ``seconds`` (at least a moment), waking early when a ban of ``stage``
        is lifted."""
        event = self._lifted.setdefault(stage, asyncio.Event())
        event.clear()
        self._start_probing()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.01, min(seconds, self.config.probe_interval))):
                await event.wait()

    async def _request(self, replica: Replica, build: Callable[[int], Message]) -> Message:
        req = next(self._ids)
        loop = asyncio.get_running_loop()
        now = self._clock()
        # an estimate this old is measured again, not blended: the answer replaces it
        stale = self._due_for_measuring(replica, now)
        replica.inflight += 1
        replica.last_sent = now
        try:
            conn = await self._connection(replica)
            fut: asyncio.Future[Message] = loop.create_future()
            replica.pending[req] = fut
            # the answer time starts here: a new connection's handshake and status request
            # are not the replica's answer time (counted, they made its first answer an
            # outlier that kept a replica as fast as the others idle for the whole run)
            started = self._clock()
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
            if answer.code in RETRYABLE:
                raise self._failed(replica, RefusedError(answer.code, answer.message))
            if answer.code == StageErrorCode.UNKNOWN_MICROBATCH:
                raise MicrobatchLost(answer.message)
            if answer.code == StageErrorCode.CACHE_MISS:
                raise CacheMissed(answer.message)
            raise RefusedError(answer.code, answer.message)
        if isinstance(answer, StageResult | StageGrad | StageStep) and answer.incarnation:
            self._seen(replica, answer.incarnation, answer.steps, answer.at_risk, "")
        elapsed = self._clock() - started
        if stale:
            replica.answer_time.reset()
        replica.answer_time.update(elapsed)
        replica.consecutive_failures = 0
        replica.answered += 1
        return answer

    def _check_answer(self, replica: Replica, answer: Message, expect: type[_M]) -> _M:
        """``answer``, if it is an ``expect``. One of the wrong kind (a broken stage, or one that
        is not what it claims) fails the replica like a lost connection: :class:`ReplicaFailed`,
        and it is banned."""
        if not isinstance(answer, expect):
            raise self._failed(replica, RemoteProtocolError(
                "unexpected_reply", f"{replica.name} answered a {type(answer).__name__} to a request "
                f"that takes a {expect.__name__}"))
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
        self._start_probing()
        return ReplicaFailed(f"{replica.name}: {why}")

    async def _connection(self, replica: Replica) -> Connection:
        async with replica.lock:
            if replica.conn is None or replica.conn.is_closed:
                conn = await connect(replica.host, replica.port, secret=self.secret, tls=self.tls,
                                     role="pipeline", timeouts=self.config.timeouts)
                try:
                    status = await request_status(conn, self.config.request_timeout)
                except BaseException:
                    conn.abort(SwarmError("no status"))
                    raise
                why = self._admissible(replica, status)
                if why:
                    await conn.close()
                    raise SwarmError(why)
                replica.conn = conn
                replica.reader = asyncio.create_task(self._read(replica, replica.conn),
                                                     name=f"router-read-{replica.name}")
            return replica.conn

    def _admissible(self, replica: Replica, status: dict[str, Any]) -> str:
        """Why ``replica`` must not be routed to, given its status ("" = it may be): see
        :func:`~swarmtrain.roles.stage.route.replica_problem`, against what the route was
        checked against."""
        want = self.expected[replica.stage]
        trained = max((r.steps for r in self.replicas[replica.stage]), default=0)
        why = replica_problem(status, replica.stage, shape=want.shape, origin=want.origin, most_steps=trained)
        if why:
            if replica.refused != why:
                log.warning("not routing to %s: %s", replica.name, why)
            replica.refused = why
            return why
        if replica.refused:
            log.info("%s fits its stage again: routing to it", replica.name)
        replica.refused = ""
        self.note_status(replica, status)
        return ""

    def _seen(self, replica: Replica, incarnation: str, steps: int, at_risk: int, started_from: str) -> None:
        """What an answer or status says; a new incarnation is a restart: count what it lost."""
        if not incarnation:
            return
        if replica.incarnation and incarnation != replica.incarnation:
            if started_from.startswith("checkpoint"):
                lost = max(0, replica.steps - steps)
            else:  # copied from a replica (or the seed): what only the dead process held
                lost = replica.at_risk
            replica.restarts += 1
            self.lost_steps[replica.stage] += lost
            self.restart_log.append({"replica": replica.name, "time": self._clock(), "lost_steps": lost,
                                     "steps_before": replica.steps, "steps_after": steps,
                                     "started_from": started_from or "?"})
            log.warning("%s restarted (%s): it had %d optimizer steps and comes back at %d; %d step(s) of "
                        "its training no checkpoint or replica held are lost", replica.name,
                        started_from or "state unknown", replica.steps, steps, lost)
        replica.incarnation, replica.steps, replica.at_risk = incarnation, steps, at_risk

    def _start_probing(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to probe from
                self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(),
                                                                          name="router-probe")

    async def _probe_loop(self) -> None:
        """While a replica is banned, ask each banned one for its status every
        ``probe_interval`` seconds, the first time one interval after the ban (a replica that
        has just failed is not asked at once: a liar that answers status probes had its ban
        lifted within milliseconds); lift the ban of one that answers and fits its stage."""
        while True:
            await asyncio.sleep(self.config.probe_interval)
            now = self._clock()
            banned = [r for r in itertools.chain.from_iterable(self.replicas) if r.banned_until > now]
            if not banned:
                return
            await asyncio.gather(*(self._probe(r) for r in banned))

    async def _probe(self, replica: Replica) -> None:
        timeout = min(5.0, self.config.request_timeout)
        try:
            conn = await connect(replica.host, replica.port, secret=self.secret, tls=self.tls,
                                 role="pipeline", timeouts=Timeouts(connect=timeout, handshake=timeout))
        except (SwarmError, OSError):
            return
        try:
            status = await request_status(conn, timeout)
        except (SwarmError, OSError, TimeoutError):
            return
        finally:
            await conn.close()
        if self._admissible(replica, status) or replica.banned_until <= self._clock():
            return
        replica.banned_until = 0.0
        replica.consecutive_failures = 0
        self.bans_lifted += 1
        log.info("%s answers again: its ban is lifted", replica.name)
        event = self._lifted.get(replica.stage)
        if event is not None:
            event.set()

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
