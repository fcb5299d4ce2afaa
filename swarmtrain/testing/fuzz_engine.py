"""The engine of the live-node fuzzer: sending inputs, watching the node, the campaign loop
(:mod:`swarmtrain.testing.fuzz_inputs` makes the inputs, :mod:`swarmtrain.testing.fuzz` has
the targets).

Each target (a coordinator, a pipeline stage server, a peer's control server) runs in this
process on 127.0.0.1, port 0, with short transport timeouts. Every input is one fresh TCP
connection that sends bytes at one of three points: at once (``connect``), after a valid
HELLO instead of AUTH (``hello``), or after a full authentication with the cluster secret
(``auth``, optionally behind valid ``prelude`` frames such as a REGISTER), from its own
loopback source address. The fuzzer then waits for the node to answer or close.

Failures: a *crash* is an exception escaping a node task (asyncio logs it), any ERROR record
with a traceback, a message the node cannot encode, a stage ``internal`` error, or a frame
from the node that does not decode (other ERROR records, decisions a node logs loudly, are
counted apart); a *hang* is an input the node neither answers nor
closes within ``INPUT_TIMEOUT`` after which it also fails a legitimate request. After the
campaign the node must still serve a legitimate client and its weights must be intact.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from swarmtrain.errors import ProtocolError
from swarmtrain.testing.fuzz_inputs import FuzzInput, Prelude, Seeds, make_input
from swarmtrain.transport import Timeouts, auth
from swarmtrain.wire import (
    Auth,
    Challenge,
    Decoder,
    Error,
    Heartbeat,
    Hello,
    Limits,
    Message,
    StageError,
    Update,
    Welcome,
    encode_bytes,
)

__all__ = ["FUZZ_TIMEOUTS", "INPUT_TIMEOUT", "SECRET", "FuzzReport", "NodeFault", "send_input",
           "run_campaign", "run_inputs", "source_address", "capture_errors", "collect_crashes", "dead_port"]

FUZZ_TIMEOUTS = Timeouts(connect=5.0, handshake=1.0, heartbeat_interval=0.2, heartbeat_timeout=2.0, send=5.0)
"""Transport timeouts of the fuzzed nodes: a silent connection is closed within ~2 s."""
INPUT_TIMEOUT = 4.0
"""Seconds an input may go unanswered; above every node timeout of :data:`FUZZ_TIMEOUTS`."""
SECRET = b"fuzz-cluster-secret"
_READ_LIMITS = Limits(max_payload_bytes=1 << 28)


@dataclass
class FuzzReport:
    """What a campaign against one target did and found."""

    target: str
    seed: int
    inputs: Counter[str] = field(default_factory=Counter)  # by phase (and message type)
    # closed / error:<code> / answer:<TYPE> / no_answer
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    health: list[str] = field(default_factory=list)  # failed health checks (empty = healthy)
    logged_errors: Counter[str] = field(default_factory=Counter)  # ERROR records that are no crash
    mutations: Counter[str] = field(default_factory=Counter)  # inputs by mutation
    notes: list[str] = field(default_factory=list)  # what else the target counted
    elapsed: float = 0.0

    @property
    def total(self) -> int:
        """Inputs sent."""
        return sum(self.inputs.values())

    @property
    def ok(self) -> bool:
        """No crash, no hang, and the node passed its health check."""
        return not (self.crashes or self.hangs or self.health)

    def summary(self) -> str:
        """A human-readable report."""
        rate = self.total / self.elapsed if self.elapsed else 0.0
        lines = [f"[{self.target}] seed {self.seed}: {self.total} inputs in {self.elapsed:.1f} s "
                 f"({rate:.1f}/s); crashes {len(self.crashes)}, hangs {len(self.hangs)}, "
                 f"health {'ok' if not self.health else 'FAILED'}",
                 "  inputs:   " + ", ".join(f"{k} {v}" for k, v in sorted(self.inputs.items())),
                 "  mutations: " + ", ".join(f"{k} {v}" for k, v in self.mutations.most_common()),
                 "  outcomes: " + ", ".join(f"{k} {v}" for k, v in self.outcomes.most_common(12))]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  logged {n}x at ERROR (not a crash): {m}" for m, n in self.logged_errors.items()]
        lines += [f"  CRASH  {c}" for c in self.crashes[:20]]
        lines += [f"  HANG   {h}" for h in self.hangs[:20]]
        lines += [f"  HEALTH {h}" for h in self.health]
        return "\n".join(lines)


# --- driving one connection -----------------------------------------------------------------


class NodeFault(Exception):
    """The node misbehaved on a legitimate step (handshake) or sent an undecodable frame."""


async def _next_msg(reader: asyncio.StreamReader, dec: Decoder, skip: tuple[type[Message], ...],
                    deadline: float) -> Message | None:
    """The next message not in ``skip`` (None: the node closed); TimeoutError at ``deadline``."""
    while True:
        try:
            while (msg := dec.next_message()) is not None:
                if not isinstance(msg, skip):
                    return msg
        except ProtocolError as exc:
            raise NodeFault(f"the node sent an undecodable frame: {exc}") from None
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            try:
                chunk = await reader.read(65536)
            except (ConnectionError, OSError):
                return None
        if not chunk:
            return None
        try:
            dec.feed(chunk)
        except ProtocolError as exc:
            raise NodeFault(f"the node sent an undecodable frame: {exc}") from None


def source_address(index: int) -> str:
    """The loopback address input ``index`` connects from (never 127.0.0.1, which the health
    checks use): every input has its own, so the per-address limits of a server (failed
    handshakes, connections) never turn the campaign into a test of those limits."""
    return f"127.{1 + (index >> 16) % 254}.{(index >> 8) & 255}.{index & 255}"


async def send_input(port: int, inp: FuzzInput, skip: tuple[type[Message], ...],
                     timeout: float = INPUT_TIMEOUT, source: str = "127.0.0.1") -> str:
    """Send one input to 127.0.0.1:port from ``source``; the node's reaction (closed /
    error:<code> / answer:<TYPE>[:<detail>] / no_answer).

    Raises:
        NodeFault: the node failed a legitimate handshake step or sent garbage.
    """
    deadline = time.monotonic() + timeout
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    dec = Decoder(_READ_LIMITS)
    try:
        if inp.phase != "connect":
            nc = auth.new_nonce()
            writer.write(encode_bytes(Hello(role=inp.role, nonce=nc)))
            ch = await _next_msg(reader, dec, (Heartbeat,), deadline)
            if not isinstance(ch, Challenge):
                raise NodeFault(f"expected CHALLENGE, got {ch}")
            if inp.phase == "auth":
                transcript = auth.Transcript(role=inp.role, node="", software="", client_nonce=nc,
                                             server_nonce=ch.nonce, open_cluster=ch.open_cluster)
                writer.write(encode_bytes(Auth(proof=auth.client_proof(SECRET, transcript))))
                if not isinstance(welcome := await _next_msg(reader, dec, (Heartbeat,), deadline), Welcome):
                    raise NodeFault(f"expected WELCOME, got {welcome}")
        writer.write(inp.prelude + inp.data)
        try:
            msg = await _next_msg(reader, dec, skip, deadline)
        except TimeoutError:
            return "no_answer"
        if msg is None:
            return "closed"
        if isinstance(msg, Error | StageError):
            return f"error:{msg.code}"
        detail = f":{msg.status}" if isinstance(msg, Update) else ""
        return f"answer:{msg.TYPE.name}{detail}"
    except TimeoutError:
        raise NodeFault("the node did not complete a legitimate handshake step in time") from None
    finally:
        writer.close()
        try:
            async with asyncio.timeout(1.0):
                await writer.wait_closed()
        except (TimeoutError, ConnectionError, OSError):
            pass


# --- the campaign ---------------------------------------------------------------------------


_INTERNAL_TEMPLATES = {"cannot send to %s: %s"}  # the node built a message it cannot encode


class _ErrorLog(logging.Handler):
    """Collects ERROR records of the node's loggers (an escaped task exception lands here)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.internal: list[str] = []
        self.operational: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        """An exception (with its traceback) or anything asyncio reports is an internal error;
        other ERROR records are decisions the node logs loudly (e.g. dropping a bad sender)."""
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None or record.name == "asyncio" or record.msg in _INTERNAL_TEMPLATES:
            what = ""
            if exc is not None:
                tb = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
                at = "".join(f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in tb)
                what = f" [{type(exc).__name__}: {exc}{at}]"
            self.internal.append(f"{record.name}: {record.getMessage().splitlines()[0][:300]}{what}")
        else:
            self.operational[f"{record.name}: {record.msg}"] += 1


@contextmanager
def capture_errors() -> Iterator[_ErrorLog]:
    """Collect ERROR records of the ``swarmtrain`` and ``asyncio`` loggers while inside."""
    handler = _ErrorLog()
    loggers = [logging.getLogger("swarmtrain"), logging.getLogger("asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.getEffectiveLevel() > logging.ERROR:  # a quiet root must not hide crashes
            lg.setLevel(logging.ERROR)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


class _HasKind(Protocol):
    @property
    def kind(self) -> str: ...


InputT = TypeVar("InputT", bound=_HasKind)


STARVED_STALL = 0.5
"""Seconds the event loop must have been held up, with the process off the CPU for most of
them, for a failed legitimate request to be taken for the box's doing (see :class:`_Stalls`)."""


class _Stalls:
    """Watches the event loop the fuzzer and an in-process node share: how long it was held
    up, and whether the process had the CPU meanwhile. The nodes' handshake bound is 1 s
    (:data:`FUZZ_TIMEOUTS`), and a box running other tests can take the CPU from the whole
    process for that long; the legitimate client then answers its challenge late and the
    node rightly refuses it. A stall with the CPU is the node's (or the fuzzer's) own work
    blocking the loop; one without it is the box."""

    TICK = 0.05
    #: a stall in which the process had the CPU less than this share of the time was the box's
    #: (a process blocked by work still gets a third of a core when three share two)
    OFF_CPU = 0.25

    def __init__(self) -> None:
        self.starved = 0.0  # the longest stall since reset without the CPU (s)
        self.busy = 0.0  # ... and with it
        self._since = (time.monotonic(), time.process_time())  # the tick under way

    def reset(self) -> None:
        self.starved = self.busy = 0.0

    def settle(self) -> None:
        """Count the tick under way (a stall that just ended, before the watch woke)."""
        wall, cpu = self._since
        lag = time.monotonic() - wall - self.TICK
        if lag > self.TICK:
            if time.process_time() - cpu < self.OFF_CPU * lag:
                self.starved = max(self.starved, lag)
            else:
                self.busy = max(self.busy, lag)

    async def watch(self) -> None:
        while True:
            self._since = (time.monotonic(), time.process_time())
            await asyncio.sleep(self.TICK)
            self.settle()


async def _checked(live: Callable[[], Awaitable[str | None]], stalls: _Stalls,
                   report: FuzzReport) -> str | None:
    """``live()``, asked once more (and noted) if it failed while the box held the whole
    process off the CPU (a node that does not serve fails the second request too); a
    failure says how long the loop stalled."""
    stalls.reset()
    problem = await live()
    stalls.settle()
    if problem is not None and stalls.starved >= STARVED_STALL:
        report.notes.append(f"a legitimate request failed while the process was off the CPU for "
                            f"{stalls.starved:.1f} s and was asked again ({problem})")
        stalls.reset()
        problem = await live()
        stalls.settle()
    if problem is None:
        return None
    return (f"{problem} (the event loop stalled up to {stalls.busy:.2f} s busy, "
            f"{stalls.starved:.2f} s off the CPU)")


async def run_inputs(report: FuzzReport, make: Callable[[int], InputT],
                     send: Callable[[InputT, int], Awaitable[str]],
                     live: Callable[[], Awaitable[str | None]], *, count: int, seconds: float,
                     concurrency: int, progress: Callable[[FuzzReport], None] | None = None) -> None:
    """Run ``count`` inputs (or until ``seconds`` pass), ``concurrency`` at a time.

    ``make(i)`` builds input ``i`` (its ``kind`` is ``<where>:<mutation>``), ``send(input, i)``
    delivers it and returns the node's reaction; ``live()`` is a legitimate request (None if
    it was served), run after a suspicious reaction and every 50 inputs.
    """
    start = time.monotonic()
    next_index = 0

    async def one_worker() -> None:
        nonlocal next_index
        while next_index < count and time.monotonic() - start < seconds:
            i, next_index = next_index, next_index + 1
            inp = make(i)
            where, mutation = inp.kind.rsplit(":", 1)
            report.inputs[where] += 1
            report.mutations[mutation] += 1
            try:
                outcome = await send(inp, i)
            except NodeFault as exc:
                outcome = "node_fault"
                report.crashes.append(f"input {i} ({inp.kind}): {exc}")
            except (ConnectionError, OSError) as exc:
                outcome = "refused"
                report.crashes.append(f"input {i} ({inp.kind}): cannot connect: {exc}")
            report.outcomes[outcome] += 1
            if outcome == "error:internal":
                report.crashes.append(f"input {i} ({inp.kind}): the node answered 'internal'")
            if outcome in ("no_answer", "node_fault", "refused") or i % 50 == 49:
                problem = await _checked(live, stalls, report)
                if problem is not None:
                    report.hangs.append(f"input {i} ({inp.kind}, {outcome}): {problem}")
            if progress is not None and i % 100 == 99:
                progress(report)

    stalls = _Stalls()
    watch = asyncio.create_task(stalls.watch())
    try:
        await asyncio.gather(*(one_worker() for _ in range(concurrency)))
    finally:
        watch.cancel()
    report.elapsed = time.monotonic() - start


async def run_campaign(report: FuzzReport, port: int, role: str, seeds: Seeds,
                       skip: tuple[type[Message], ...], live: Callable[[], Awaitable[str | None]], *,
                       count: int, seconds: float, concurrency: int, prelude: Prelude | None = None,
                       progress: Callable[[FuzzReport], None] | None = None,
                       forbid: tuple[type[Message], ...] = ()) -> None:
    """Run ``count`` transport-level inputs (or until ``seconds`` pass), ``concurrency``
    connections at a time, each from its own :func:`source_address`. Inputs that would
    deliver a well-formed message of a ``forbid`` type are replaced (see :func:`make_input`)."""
    await run_inputs(report, lambda i: make_input(report.seed, i, role, seeds, prelude, forbid),
                     lambda inp, i: send_input(port, inp, skip, source=source_address(i)), live,
                     count=count, seconds=seconds, concurrency=concurrency, progress=progress)


def collect_crashes(report: FuzzReport, errors: _ErrorLog) -> None:
    """Add the ERROR records logged so far to ``report.crashes``."""
    gc.collect()  # an unretrieved task exception is logged when its task is collected
    report.crashes += errors.internal
    report.logged_errors.update(errors.operational)


def dead_port() -> int:
    """A local port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
