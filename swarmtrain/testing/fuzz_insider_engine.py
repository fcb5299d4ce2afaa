"""The insider campaign's engine (see :mod:`swarmtrain.testing.fuzz_insider`): sending a
:class:`~swarmtrain.testing.fuzz_insider_cases.Case` on an authenticated connection and
recording what the role answered, the health probes, the role's refusal counters, and the
real processes the campaign runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.testing.fuzz_insider_cases import INSIDER_LIMITS, Case
from swarmtrain.testing.procs import swarm_cmd, tail
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.wire import (
    Accept,
    Assign,
    Error,
    Message,
    Pause,
    RegisterAck,
    Resume,
    Shutdown,
    StageError,
    Start,
    Status,
    StatusRequest,
    Update,
    Weights,
    encode_bytes,
)

__all__ = [
    "Processes", "processes", "run_cases", "tracebacks_in",
    "BATCH", "CASE_TIMEOUT", "SECRET", "CaseResult", "Insider", "InsiderReport", "ask",
    "counted_refusals", "record_refusals", "refusal_reasons", "status_of",
]

SECRET = "insider-campaign-secret"


CASE_TIMEOUT = 8.0
"""Seconds a case (and its sentinel STATUS_REQUEST) may go unanswered before it is a hang."""


BATCH = 10
"""Cases between two health probes (a fresh honest request; the processes alive)."""


_CLIENT_TIMEOUTS = Timeouts(
    connect=5.0, handshake=CASE_TIMEOUT, heartbeat_interval=1.0, heartbeat_timeout=30.0, send=CASE_TIMEOUT
)


@dataclass
class CaseResult:
    case: str
    target: str
    outcome: str  # error:<code> / answer:<TYPE>[:<status>] / ignored / closed / hang
    detail: str = ""
    refusals: int = -1  # refused replies (and refused registrations); -1: 1 if ``refused``

    def __post_init__(self) -> None:
        if self.refusals < 0:
            self.refusals = int(self.refused)

    @property
    def refused(self) -> bool:
        return (
            self.outcome.startswith("error:")
            or self.outcome == "closed"
            or self.outcome in ("answer:UPDATE:rejected", "answer:UPDATE:duplicate", "answer:UPDATE:stale")
        )


@dataclass
class InsiderReport:
    """What a campaign did and found; ``ok`` when nothing went wrong."""

    target: str
    seed: int
    results: list[CaseResult] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    health: list[str] = field(default_factory=list)  # a probe failed, status unencodable, a bad exit
    honest: list[str] = field(default_factory=list)  # the honest members' run missed its target
    pending: list[str] = field(default_factory=list)  # checks waiting for other fixes
    notes: list[str] = field(default_factory=list)
    refusals_before: int | None = None
    refusals_after: int | None = None
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.health or self.honest)

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(r.outcome for r in self.results)

    @property
    def refused(self) -> int:
        """Refused messages: every refused reply of every case (a lockstep case, say 40
        gradients, may earn many), a connection closed without a coded refusal counting one."""
        return sum(r.refusals for r in self.results)

    def summary(self) -> str:
        lines = [
            f"[insider {self.target}] seed {self.seed}: {len(self.results)} cases in {self.elapsed:.1f} s; "
            f"crashes {len(self.crashes)}, hangs {len(self.hangs)}, refused {self.refused}, "
            f"health {'ok' if not self.health else 'FAILED'}",
            "  outcomes: " + ", ".join(f"{k} {v}" for k, v in self.outcomes.most_common(14)),
        ]
        lines += [
            f"  fixed case {r.case} -> {r.outcome} {r.detail[:160]}"
            for r in self.results
            if r.case.startswith("!")
        ]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  PENDING {p}" for p in self.pending]
        lines += [f"  CRASH  {c}" for c in self.crashes[:20]]
        lines += [f"  HANG   {h}" for h in self.hangs[:20]]
        lines += [f"  HEALTH {h}" for h in self.health]
        lines += [f"  HONEST {h}" for h in self.honest]
        return "\n".join(lines)


def counted_refusals(status: dict[str, Any] | None) -> int | None:
    """The sum of a role's per-reason refusal counters (``refusals``, any nesting), or None if
    its status has none yet."""
    if not isinstance(status, dict) or "refusals" not in status:
        return None

    def total(v: Any) -> int:
        if isinstance(v, bool):
            return 0
        if isinstance(v, int):
            return v
        if isinstance(v, dict):
            return sum(total(x) for x in v.values())
        return 0

    return total(status["refusals"])


def refusal_reasons(status: dict[str, Any] | None) -> Counter[str]:
    """A role's ``refusals`` flattened to ``reason`` (or ``part.reason``) -> count."""
    out: Counter[str] = Counter()

    def walk(v: Any, prefix: str) -> None:
        if isinstance(v, int) and not isinstance(v, bool):
            out[prefix] += v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{prefix}.{k}" if prefix else str(k))

    if isinstance(status, dict):
        walk(status.get("refusals"), "")
    return out


def record_refusals(
    report: InsiderReport, before: list[dict[str, Any] | None], after: list[dict[str, Any] | None]
) -> None:
    """Set the report's refusal totals from the statuses of the role's processes before and
    after the campaign (left None unless every status has ``refusals``), and note what was
    counted by reason against what the campaign saw refused."""
    totals = [counted_refusals(st) for st in before + after]
    if any(t is None for t in totals):
        return
    n = len(before)
    report.refusals_before = sum(t for t in totals[:n] if t is not None)
    report.refusals_after = sum(t for t in totals[n:] if t is not None)
    grew: Counter[str] = Counter()
    for b, a in zip(before, after):
        grew.update(refusal_reasons(a))
        grew.subtract(refusal_reasons(b))
    seen: Counter[str] = Counter()
    for r in report.results:
        seen[r.outcome] += r.refusals
    report.notes.append(
        "refusals counted: "
        + ", ".join(f"{k} +{v}" for k, v in sorted(grew.items()) if v)
        + "; refused messages seen: "
        + ", ".join(f"{k} {v}" for k, v in seen.most_common() if v)
    )


_UNORDERED = ("pipeline", "stage")  # a stage answers STATUS at once, work once computed


_SKIP: tuple[type[Message], ...] = (Weights, Start, Assign, Pause, Resume, RegisterAck)


def _outcome(msg: Message) -> str:
    if isinstance(msg, Error | StageError):
        return f"error:{msg.code}"
    if isinstance(msg, Update):
        return f"answer:UPDATE:{msg.status}"
    if isinstance(msg, Status) and "installed" in msg.status:  # a peer's answer to COMMIT
        return f"answer:STATUS:installed={msg.status['installed']}"
    if isinstance(msg, Accept):
        return f"answer:ACCEPT:{'ok' if msg.ok else msg.code or 'refused'}"
    return f"answer:{msg.TYPE.name}"


async def _exchange(conn: Connection, case: Case, version: list[int]) -> tuple[str, str, int]:
    """Send ``case`` then a sentinel STATUS_REQUEST; (outcome, detail, refused replies). The outcome is the
    first refusal among the replies, else the first reply (``ignored`` if none), ``closed``
    if the connection closed, or ``hang`` if the replies (and the sentinel's STATUS) did not
    come within :data:`CASE_TIMEOUT`. When every frame owes a reply, each is sent once the
    previous one is answered (so that a gradient carries the version the last UPDATE said)."""
    lockstep = case.answers == len(case.frames) and case.answers > 1
    skip = _SKIP if case.register_first else tuple(t for t in _SKIP if t is not RegisterAck)
    replies: list[str] = []
    detail = ""

    async def read(owed: int, sentinel: bool) -> str | None:
        """Read ``owed`` replies (and, with ``sentinel``, until a STATUS came last)."""
        nonlocal detail
        got, deadline = 0, time.monotonic() + CASE_TIMEOUT
        statuses = 0
        while True:
            try:
                msg = await conn.recv(timeout=max(0.01, deadline - time.monotonic()))
            except SwarmTimeout as exc:
                detail = detail or f"{len(replies)} of {case.answers} replies: {exc}"
                return "hang"
            except SwarmError as exc:
                detail = detail or str(exc.__cause__ or exc)[:300]
                return "closed"
            if isinstance(msg, Update | RegisterAck | Weights | Start):
                version[0] = max(version[0], getattr(msg, "version", 0))
            if isinstance(msg, skip) or (isinstance(msg, Shutdown) and case.role == "worker"):
                continue
            got += 1
            statuses += isinstance(msg, Status)
            replies.append(_outcome(msg))
            if not detail and isinstance(msg, Error | StageError):
                detail = msg.message[:300]
            if got >= owed + sentinel and (
                not sentinel or (statuses and (case.role in _UNORDERED or isinstance(msg, Status)))
            ):
                if sentinel:  # the sentinel's STATUS is no reply to the case
                    replies.remove("answer:STATUS")
                break
        return None

    end: str | None = None
    for frame in case.frames:
        conn.transport.write(frame(version[0]) if callable(frame) else frame)
        if lockstep and (end := await read(1, False)) is not None:
            break
    if end is None:
        conn.transport.write(encode_bytes(StatusRequest()))
        end = await read(0 if lockstep else case.answers, True)
    refused = [
        r for r in replies if r.startswith("error:") or r.endswith((":rejected", ":duplicate", ":stale"))
    ]
    if len(set(replies)) > 1:  # the tally first: the detail may be cut short
        tally = ", ".join(f"{k} x{v}" for k, v in Counter(replies).most_common())
        detail = f"({tally}) {detail}".strip()
    if refused:
        return refused[0], detail, len(refused)
    if end is not None:
        return end, detail, int(end == "closed")
    return (replies[0] if replies else "ignored"), detail, 0


class Insider:
    """Authenticated connections of one insider to one role, reused while they stay open."""

    def __init__(self, port: int, register: Callable[[str], bytes] | None = None) -> None:
        self.port = port
        self.register = register
        self._conns: dict[tuple[str, str, str], Connection] = {}
        self._ids = 0
        self.version = [0]  # the role's version as its last REGISTER_ACK / UPDATE said

    async def _conn(self, case: Case) -> tuple[Connection, str]:
        key = (case.role, case.session, case.as_worker)
        conn = self._conns.get(key) if case.session else None
        if conn is not None and not conn.is_closed:
            return conn, ""
        conn = await connect(
            "127.0.0.1", self.port, secret=SECRET.encode(), role=case.role, node=f"insider-{case.role}",
            timeouts=_CLIENT_TIMEOUTS, limits=INSIDER_LIMITS,
        )
        note = ""
        if case.role == "worker" and self.register is not None and case.register_first:
            self._ids += 1
            wid = case.as_worker or f"insider-{self._ids}"
            conn.transport.write(self.register(wid))
            while True:  # the coordinator answers REGISTER_ACK (or refuses)
                msg = await conn.recv(timeout=CASE_TIMEOUT)
                if isinstance(msg, RegisterAck):
                    self.version[0] = max(self.version[0], msg.version)
                    break
                if isinstance(msg, Error):
                    note = f"registering {wid!r} was refused: {msg.code}"
                    break
        if case.session:
            self._conns[key] = conn
        return conn, note

    async def send(self, case: Case, target: str) -> CaseResult:
        try:
            async with asyncio.timeout(3 * CASE_TIMEOUT):
                conn, note = await self._conn(case)
                try:
                    outcome, detail, refusals = await _exchange(conn, case, self.version)
                finally:
                    if not case.session:
                        await conn.close()
        except (SwarmError, OSError, TimeoutError) as exc:
            return CaseResult(
                case.name, target, "hang" if isinstance(exc, TimeoutError) else "closed",
                f"{type(exc).__name__}: {exc}"[:300],
            )
        if note:  # the registration before the case was refused (and the connection closed)
            refusals = 1 + (refusals if outcome != "closed" else 0)
        return CaseResult(case.name, target, outcome, " ".join(x for x in (note, detail) if x), refusals)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._conns.values()), return_exceptions=True)


async def ask(port: int, role: str, msg: Message, timeout: float = CASE_TIMEOUT) -> Message:
    """A fresh honest request (what the health probes send); its first answer."""
    async with asyncio.timeout(timeout):
        conn = await connect("127.0.0.1", port, secret=SECRET.encode(), role=role, timeouts=_CLIENT_TIMEOUTS)
        try:
            await conn.send(msg)
            while True:
                answer = await conn.recv(timeout=timeout)
                if not isinstance(answer, _SKIP):
                    return answer
        finally:
            await conn.close()


async def status_of(port: int, role: str) -> tuple[dict[str, Any] | None, str]:
    """A role's STATUS over a fresh connection: (status, "") or (None, what went wrong)."""
    try:
        answer = await ask(port, role, StatusRequest())
    except (SwarmError, OSError, TimeoutError) as exc:
        return None, f"STATUS_REQUEST failed: {type(exc).__name__}: {exc}"
    if not isinstance(answer, Status):
        return None, f"STATUS_REQUEST was answered with {answer}"
    return answer.status, ""


class Processes:
    """Named real processes with logs in ``tmp``; all killed on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.finishing: set[str] = set()
        self.env = {**os.environ, "SWARMTRAIN_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = p = subprocess.Popen(
            swarm_cmd(*args), env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return p

    def dead(self) -> list[str]:
        """Processes that exited (but those in ``finishing`` that exited 0: a trainer's run ends)."""
        return [
            f"{n} exited with {p.returncode}: {tail(self.tmp / f'{n}.log', 8)}"
            for n, p in self.procs.items()
            if p.poll() is not None and not (n in self.finishing and p.returncode == 0)
        ]

    def json(self, name: str) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = json.loads((self.tmp / name).read_text())
            return out
        except (OSError, ValueError):
            return None

    async def wait_for(self, what: str, pred: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (got := pred()) is not None and got is not False:
                return got
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{what} not within {timeout:g} s")

    def logs(self, lines: int = 12) -> str:
        return "\n".join(f"--- {n} ---\n{tail(self.tmp / f'{n}.log', lines)}" for n in self.procs)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


@contextmanager
def processes(tmp: Path | None) -> Iterator[Processes]:
    with tempfile.TemporaryDirectory(prefix="insider-") as scratch:
        procs = Processes(tmp or Path(scratch))
        try:
            yield procs
        finally:
            procs.stop()


async def run_cases(
    procs: Processes, report: InsiderReport, insider: Insider, cases: list[Case], probe: Callable[[], Any]
) -> None:
    """Send every case in order; probe the role after every :data:`BATCH` and after a hang."""
    for i, case in enumerate(cases):
        res = await insider.send(case, report.target)
        report.results.append(res)
        if res.outcome == "hang":
            report.hangs.append(f"{case.name}: {res.detail}")
        if res.outcome == "hang" or i % BATCH == BATCH - 1 or i == len(cases) - 1:
            if dead := procs.dead():
                report.crashes += [f"after {case.name}: {d}" for d in dead]
                return
            _, problem = await probe()
            if problem:
                report.health.append(f"after {case.name} ({res.outcome}): a fresh honest request: {problem}")


def tracebacks_in(procs: Processes) -> list[str]:
    """A traceback in any process's log is a crash (a bug escaped some handler)."""
    out = []
    for name in procs.procs:
        text = (
            (procs.tmp / f"{name}.log").read_text(errors="replace")
            if (procs.tmp / f"{name}.log").exists()
            else ""
        )
        if "Traceback (most recent call last)" in text:
            i = text.index("Traceback (most recent call last)")
            out.append(f"{name} logged a traceback: {text[max(0, i - 300) : i + 1500]}")
    return out
