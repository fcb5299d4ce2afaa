"""The insider fuzz campaign (issue 17, "Tests must show"): a client holding the cluster
secret sends well-formed messages with hostile values to a live coordinator (2 real worker
processes on digits), a live peer group (2 peer processes on digits) and a live pipeline
(2 stage processes and a trainer), while they train. See swarmtrain/testing/fuzz_insider.py
and docs/security.md ("The insider campaign").

Asserted for each: no crash (every process alive, no traceback logged), no hang (every case
answered or closed within CASE_TIMEOUT; a fresh honest request answered after every batch),
STATUS always encodes, every refusal counted (the role's ``refusals`` grew by at least the
cases it refused), and the honest run reaches its target. Each campaign runs once and several
tests read its report, so that one failing check does not hide the others.
``pytest -s`` prints each report; ``SWARMTRAIN_INSIDER_RANDOM=N`` sets the random cases per
target (20); ``python -m swarmtrain.testing.fuzz_insider --long`` is the bigger run.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.testing import fuzz_insider
from swarmtrain.testing.fuzz_insider import (
    CaseResult,
    InsiderReport,
    coordinator_cases,
    counted_refusals,
    hostile,
    peer_cases,
    refusal_counting_pending,
    run_insider,
    stage_cases,
)
from swarmtrain.wire import Decoder, Gradients, Limits, encode_bytes

pytestmark = pytest.mark.timeout(150)

RANDOM = int(os.environ.get("SWARMTRAIN_INSIDER_RANDOM", "20"))  # random cases per target


_REPORTS: dict[str, InsiderReport] = {}


def _campaign(target: str) -> InsiderReport:
    """Each campaign runs once per session; its tests read the same report."""
    if target not in _REPORTS:
        _REPORTS[target] = report = run_insider(target, seed=17, n_random=RANDOM, timeout=120)
        print("\n" + report.summary())
    return _REPORTS[target]


def _assert_survived(report: InsiderReport) -> None:
    assert report.results, report.summary()
    assert not report.crashes, report.summary()
    assert not report.hangs, report.summary()
    assert not report.health, report.summary()


def _assert_refusals_counted(report: InsiderReport) -> None:
    problem = refusal_counting_pending(report)
    assert problem is None, problem + "\n" + report.summary()


def test_a_live_coordinator_survives_the_insider() -> None:
    report = _campaign("coordinator")
    assert report.outcomes["answer:UPDATE:rejected"] > 0, report.summary()  # gradients reached the screen
    _assert_survived(report)


def test_the_coordinators_honest_workers_reach_their_target_despite_the_insider() -> None:
    report = _campaign("coordinator")
    assert not report.honest, report.summary()


def test_every_refusal_of_the_coordinator_is_counted() -> None:
    _assert_refusals_counted(_campaign("coordinator"))


def test_a_live_peer_group_survives_the_insider_and_reaches_090() -> None:
    report = _campaign("peer")
    assert sum(n for k, n in report.outcomes.items() if k.startswith("answer:ACCEPT")) > 0, report.summary()
    _assert_survived(report)
    assert not report.honest, report.summary()


def test_every_refusal_of_the_peers_is_counted() -> None:
    _assert_refusals_counted(_campaign("peer"))


def test_live_stages_survive_the_insider_and_the_trainer_loss_falls() -> None:
    report = _campaign("stage")
    assert report.outcomes["error:bad_input"] > 0, report.summary()
    assert report.outcomes["answer:STAGE_RESULT"] > 0, report.summary()
    _assert_survived(report)
    assert not report.honest, report.summary()


def test_every_refusal_of_the_stages_is_counted() -> None:
    _assert_refusals_counted(_campaign("stage"))


# --- the campaign's own pieces (pure, no processes) ----------------------------------------------


def test_hostile_frames_carry_values_the_encoder_would_refuse() -> None:
    """An insider's frame carries any msgpack value, in range or not, with the tensors intact:
    the role, not the sender, must refuse it (a decoder with bounds yields no GRADIENTS)."""
    from swarmtrain.testing.fuzz_inputs import _split
    from swarmtrain.testing.fuzz_insider import gradient

    msg = gradient({"w": (2, 3)}, 1.0, msg_id=1)
    frame = hostile(msg, samples=2**64 - 1, msg_id=-1)
    _, fields, _, payload = _split(frame)
    assert fields["samples"] == 2**64 - 1 and fields["msg_id"] == -1 and fields["loss"] == 1.0
    assert payload == _split(encode_bytes(msg))[3]
    dec = Decoder(Limits())
    dec.feed(encode_bytes(msg))
    assert isinstance(dec.next_message(), Gradients)  # the same message in range decodes
    try:
        dec.feed(frame)
        got = dec.next_message()
    except SwarmError:  # a decoder that refuses out-of-range fields may raise
        return
    assert got is None or (isinstance(got, Gradients) and got.samples == 2**64 - 1), got


def test_the_case_lists_cover_the_issue_and_are_a_function_of_the_seed() -> None:
    names = [c.name for c in coordinator_cases(random.Random(3), 10, ("w0", "w1"))]
    for needle in (
        "samples=2**64-1",
        "msg_id=2**64-1",
        "ratchet",
        "samples=1e12",
        "a live worker",
        "loss=-1e+300",
        "PAUSE as a worker",
        "SHUTDOWN as a worker",
        "wrong shapes",
        "wrong dtype",
        "unknown codec",
        "duplicate msg_id",
        "HEARTBEAT",
        "ERROR",
    ):
        assert any(needle in n for n in names), needle
    again = [c.name for c in coordinator_cases(random.Random(3), 10, ("w0", "w1"))]
    assert names == again
    peer = [c.name for c in peer_cases(random.Random(3), 5, ["a" * 32], 1)]
    for kind in ("PEER_HELLO", "PROPOSE", "ACCEPT", "COMMIT", "REFORM", "replayed"):
        assert any(kind in n for n in peer), kind
    stage = [c.name for c in stage_cases(random.Random(3), 5, first=True)]
    for kind in (
        "STAGE_FORWARD",
        "STAGE_BACKWARD",
        "STAGE_INFER",
        "STAGE_SYNC",
        "nan",
        "2**64-1",
        "float64",
        "duplicate",
    ):
        assert any(kind in n for n in stage), kind


def test_refusal_counting_fails_without_counters_and_when_they_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert counted_refusals({"refusals": {"out_of_range": 2, "server": {"auth_failed": 3}}}) == 5
    assert counted_refusals({"stats": {}}) is None
    report = InsiderReport("coordinator", 0, results=[CaseResult("x", "coordinator", "error:out_of_range")])
    assert refusal_counting_pending(report) is not None  # a status without counters: a failure
    monkeypatch.setattr(fuzz_insider, "REFUSAL_COUNTERS_REQUIRED", False)  # an old build's target
    assert refusal_counting_pending(report) is None and report.pending
    monkeypatch.setattr(fuzz_insider, "REFUSAL_COUNTERS_REQUIRED", True)
    report.refusals_before, report.refusals_after = 4, 4
    assert "grew by 0" in (refusal_counting_pending(report) or "")
    report.refusals_after = 5
    assert refusal_counting_pending(report) is None


# --- what the campaign found, one minimal case each ----------------------------------------------


def test_a_workers_long_error_message_does_not_stall_the_coordinator(tmp_path: Path) -> None:
    """Found by the campaign: the coordinator logged a worker's ERROR message in full, and the
    console handler's wrapping of a 60 kB word blocked its event loop for seconds (6 kB: 0.6 s,
    20 kB: over 8 s), past the honest workers' heartbeat timeout (they dropped and
    reconnected; ctl timed out)."""
    from swarmtrain.testing.fuzz_insider import SECRET, Case, Insider, status_of
    from swarmtrain.testing.fuzz_insider_cases import digits_register
    from swarmtrain.testing.procs import start_coordinator, tail
    from swarmtrain.wire import Error

    coord, port = start_coordinator(
        tmp_path,
        "--task",
        "digits",
        "--min-workers",
        "1",
        "--checkpoint-interval",
        "0",
        "--run-log",
        "none",
        env={"SWARMTRAIN_SECRET": SECRET},
    )

    def register(wid: str) -> bytes:
        return encode_bytes(digits_register(wid))

    async def main() -> tuple[str, str]:
        insider = Insider(port, register)
        try:  # the ERROR owes no answer: the sentinel STATUS_REQUEST after it must be answered
            error = Error(code="x", message="x" * 60_000, fatal=False)
            result = await insider.send(
                Case("ERROR.message=60 kB", "worker", (encode_bytes(error),), 0), "coordinator"
            )
        finally:
            await insider.close()
        if result.outcome != "ignored":
            return result.outcome, result.detail
        _, problem = await status_of(port, "ctl")
        return result.outcome, problem

    try:
        outcome, problem = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        coord.kill()
        coord.wait(timeout=10)
    assert outcome == "ignored" and not problem, (outcome, problem, tail(tmp_path / "coordinator.log", 5))


def test_a_gradient_refused_as_stale_moves_no_message_id() -> None:
    """Found by the campaign (issue 17 must-have 2, a refused message changes no state): a
    GRADIENTS answered ``stale`` (its version ahead of the coordinator's) advanced the
    sender's ``last_msg_id``, so the next honest gradient was answered ``duplicate``."""
    from swarmtrain.testing.fuzz import _fuzz_coordinator
    from swarmtrain.testing.fuzz_engine import FUZZ_TIMEOUTS
    from swarmtrain.testing.fuzz_engine import SECRET as FUZZ_SECRET
    from swarmtrain.testing.fuzz_insider import gradient
    from swarmtrain.testing.fuzz_insider_cases import digits_register
    from swarmtrain.transport import connect
    from swarmtrain.wire import RegisterAck, Update

    async def main() -> list[str]:
        _, coord, params, fp, comp = _fuzz_coordinator(0)
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        await coord.start()
        try:
            conn = await connect(
                "127.0.0.1", coord.port, secret=FUZZ_SECRET, role="worker", timeouts=FUZZ_TIMEOUTS
            )
            await conn.send(digits_register("insider"))
            while not isinstance(ack := await conn.recv(timeout=10), RegisterAck):
                pass
            statuses = []
            for msg_id, version in ((1000, ack.version + 1000), (5, ack.version)):
                await conn.send(gradient(shapes, 1e-4, msg_id=msg_id, version=version))
                while not isinstance(answer := await conn.recv(timeout=10), Update):
                    pass
                statuses.append(answer.status)
            await conn.close()
            return statuses
        finally:
            await coord.close()

    assert asyncio.run(asyncio.wait_for(main(), 60)) == ["stale", "applied"]
