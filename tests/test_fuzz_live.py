"""The bounded fuzz campaign against live nodes over real sockets (issue 8, part 4), and the
minimal reproductions of the bugs it found.

Each campaign test starts one node in-process, sends a fixed number of mutated and random
frames (fixed seed: input ``i`` is a function of the seed and ``i`` alone), and asserts zero
crashes, zero hangs and a healthy node afterwards (weights intact, a legitimate client
still served). ``pytest -s`` prints each report. The long campaign is
``python scripts/fuzz.py``; see docs/fuzzing.md.

Below the campaigns: one regression test for each bug the fuzzer found (all fixed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from swarmtrain.testing.fuzz import TARGETS, FuzzReport, fuzz_coordinator, fuzz_ctl, fuzz_peer, fuzz_stage
from swarmtrain.testing.fuzz_engine import (
    FUZZ_TIMEOUTS,
    SECRET,
    capture_errors,
    collect_crashes,
    send_input,
)
from swarmtrain.testing.fuzz_inputs import FuzzInput, delivers, make_input
from swarmtrain.testing.fuzz_ring import fuzz_ring, make_ring_input
from swarmtrain.wire import (
    Assign,
    Heartbeat,
    Message,
    Pause,
    Propose,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    StageSync,
    Start,
    StatusRequest,
    Weights,
    encode_bytes,
)

pytestmark = pytest.mark.timeout(90)

INPUTS = 400  # per target; about 60-90 inputs/s on a 2-core machine
SMALL = 250  # for the targets added later, to keep this file near 60 s


def _campaign(fuzz: Callable[..., Awaitable[FuzzReport]], seed: int, inputs: int = INPUTS) -> FuzzReport:
    report = asyncio.run(asyncio.wait_for(fuzz(inputs, seed=seed), 80))
    print("\n" + report.summary())
    assert report.total == inputs
    assert not report.crashes, report.summary()
    assert not report.hangs, report.summary()
    assert not report.health, report.summary()
    return report


def test_fuzz_campaign_against_a_live_coordinator() -> None:
    report = _campaign(fuzz_coordinator, seed=8401)
    assert report.outcomes["answer:UPDATE:rejected"] > 0  # some gradients got past the framing


def test_fuzz_campaign_against_a_live_stage_server() -> None:
    report = _campaign(fuzz_stage, seed=8402)
    assert report.outcomes["answer:STAGE_RESULT"] > 0


def test_fuzz_campaign_against_a_live_peer_control_server() -> None:
    report = _campaign(fuzz_peer, seed=8403)
    assert report.outcomes["answer:PEER_INFO"] > 0


def test_fuzz_campaign_against_the_coordinator_ctl_role() -> None:
    report = _campaign(fuzz_ctl, seed=8404, inputs=SMALL)
    assert report.outcomes["answer:STATUS"] > 0  # mutated ctl requests got through
    assert report.outcomes["answer:CHECKPOINT"] > 0


def test_fuzz_campaign_against_the_last_stage() -> None:
    report = _campaign(TARGETS["stage-last"], seed=8405, inputs=SMALL)
    assert report.outcomes["answer:STAGE_RESULT"] > 0  # forwards with targets computed a loss
    assert report.outcomes["error:bad_input"] > 0  # hostile targets were refused


def test_fuzz_campaign_against_a_stage_as_a_replica() -> None:
    report = _campaign(TARGETS["stage-replica"], seed=8406, inputs=SMALL)
    assert report.inputs["post:stage_sync"] > SMALL // 3
    assert report.outcomes["error:bad_input"] > 0  # syncs got past the framing and were refused


def test_fuzz_campaign_against_a_live_ring_listener() -> None:
    report = _campaign(fuzz_ring, seed=8407)
    assert report.outcomes["status:0/reduced"] > 0  # member collectives completed (valid frames)
    assert report.outcomes["status:0/broken:reduce_scatter"] > 0  # and broke cleanly on bad ones
    assert report.outcomes["status:4"] > 0  # malformed announcements were refused


def test_ctl_inputs_never_deliver_a_valid_pause_or_shutdown() -> None:
    """The ctl campaign must not stop the cluster legitimately: inputs that would deliver a
    well-formed PAUSE or SHUTDOWN are drawn again (and the others stay as they were)."""
    def seeds(rng: Any) -> list[Message]:
        return [Pause(), Shutdown(reason="x"), Resume(), StatusRequest()]

    forbidden = (Pause, Shutdown)
    redrawn = 0
    for i in range(600):
        inp = make_input(5, i, "ctl", seeds, forbid=forbidden)
        assert not (inp.phase == "auth" and delivers(inp.data, forbidden)), (i, inp.kind)
        redrawn += inp != make_input(5, i, "ctl", seeds)
    assert redrawn > 0  # the filter had something to do


def test_ring_inputs_are_a_function_of_seed_and_index() -> None:
    assert make_ring_input(3, 17) == make_ring_input(3, 17)
    kinds = {make_ring_input(3, i).where for i in range(200)}
    assert kinds == {"pre", "hello", "announce", "ring"}


# --- bugs the fuzzer found (regression tests) --------------------------------------


async def _drained(connections: set[Any], timeout: float = 10.0) -> None:
    """Wait until a server holds no connection: every connection task has ended (so an
    exception escaping one has been raised and logged)."""
    async with asyncio.timeout(timeout):
        while connections:
            await asyncio.sleep(0.01)


def _coordinator() -> Any:
    from swarmtrain.config import load_coordinator_config
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.tasks import DigitsTask

    cfg = load_coordinator_config(overrides={
        "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
        "training.learning_rate": 3e-3, "network.handshake_timeout_sec": 1.0})
    return Coordinator(DigitsTask().build_model(), cfg, task_name="digits", secret=SECRET)


def test_a_register_with_a_malformed_fingerprint_is_refused_as_a_model_mismatch() -> None:
    """Found by the fuzzer: a REGISTER whose fingerprint has a shape that is not a list (here
    the int 5) made ``check_fingerprint`` raise TypeError, which escaped the connection task
    (no ERROR frame, "Task exception was never retrieved")."""
    from swarmtrain.config import CompressionConfig

    async def main() -> tuple[str, list[str]]:
        c = _coordinator()
        fp = c.state.fingerprint()
        comp = {k: getattr(c.config.compression, k) for k in CompressionConfig.SHARED_KEYS}
        reg = Register(worker_id="w", task="digits", fingerprint=[[fp[0][0], fp[0][1], 5], *fp[1:]],
                       hardware={}, batch_size=1, accumulation_steps=1, shard_index=-1,
                       compression=comp, samples_per_sec=1.0)
        skip: tuple[type[Message], ...] = (Heartbeat, RegisterAck, Weights, Start, Assign)
        report = FuzzReport("repro", 0)
        with capture_errors() as errors:
            await c.start()
            try:
                inp = FuzzInput("repro", "auth", encode_bytes(reg), "worker")
                outcome = await send_input(c.port, inp, skip)
                assert c._server is not None
                await _drained(c._server.connections)  # the connection's task is over
            finally:
                collect_crashes(report, errors)
                await c.close()
        return outcome, report.crashes

    outcome, crashes = asyncio.run(asyncio.wait_for(main(), 60))
    assert not crashes, crashes
    assert outcome == "error:model_mismatch", outcome


def test_a_registration_cannot_make_the_coordinator_status_unsendable() -> None:
    """Found by the fuzzer: the coordinator kept a record of every worker id that ever
    registered and echoes ids, hardware and events in STATUS; past the 1 MiB header limit
    STATUS could no longer be encoded and every STATUS_REQUEST got its connection reset.
    One REGISTER with a 600 kB ``worker_id`` was enough (the campaign got there with ~3000
    ids). Now ids and hardware descriptions are bounded and old records are forgotten."""
    from swarmtrain.config import CompressionConfig
    from swarmtrain.transport import connect
    from swarmtrain.wire import Status, StatusRequest

    async def main() -> tuple[str, Message]:
        c = _coordinator()
        fp = c.state.fingerprint()
        comp = {k: getattr(c.config.compression, k) for k in CompressionConfig.SHARED_KEYS}
        reg = Register(worker_id="w" * 600_000, task="digits", fingerprint=fp, hardware={}, batch_size=1,
                       accumulation_steps=1, shard_index=-1, compression=comp, samples_per_sec=1.0)
        await c.start()
        try:
            refused = await send_input(c.port, FuzzInput("repro", "auth", encode_bytes(reg), "worker"),
                                       (Heartbeat, RegisterAck, Weights, Start, Assign), timeout=1.0)
            conn = await connect("127.0.0.1", c.port, secret=SECRET, role="ctl", timeouts=FUZZ_TIMEOUTS)
            try:
                await conn.send(StatusRequest())
                try:
                    return refused, await conn.recv(timeout=5)
                except ConnectionError as exc:
                    raise AssertionError(f"STATUS_REQUEST failed: {exc}") from exc
            finally:
                await conn.close()
        finally:
            await c.close()

    refused, answer = asyncio.run(asyncio.wait_for(main(), 60))
    assert refused == "error:config_mismatch", refused  # the 600 kB id is refused at registration
    assert isinstance(answer, Status), answer


def test_a_proposal_with_a_short_public_key_is_answered_as_a_bad_signature() -> None:
    """Found by the fuzzer: a PROPOSE (or COMMIT) whose ``public_key`` was not 32 bytes made
    ``check_signature`` raise ValueError, which escaped the control server's connection task
    (no answer, connection dropped)."""
    from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
    from swarmtrain.transport.identity import Identity

    async def main() -> tuple[str, list[str]]:
        opts = PeerOptions(run="fuzz", min_peers=1, host="127.0.0.1", port=0, mdns=False,
                           static_peers=(("127.0.0.1", 9),), profile="fuzz",
                           propose_timeout_sec=FUZZ_TIMEOUTS.handshake)
        backend = PeerBackend(opts, secret=SECRET, identity=Identity.generate())
        msg = Propose(epoch=1, proposer="a" * 32, members=["a" * 32], addresses={}, public_key=b"x",
                      signature=b"s" * 64)
        report = FuzzReport("repro", 0)
        loop = asyncio.get_running_loop()
        with capture_errors() as errors:
            await loop.run_in_executor(None, backend.start)
            try:
                inp = FuzzInput("repro", "auth", encode_bytes(msg), "peer")
                outcome = await send_input(backend.port, inp, (Heartbeat,))
                assert backend.control.server is not None
                await _drained(backend.control.server.connections)  # the connection's task is over
            finally:
                collect_crashes(report, errors)
                await loop.run_in_executor(None, backend.close)
        return outcome, report.crashes

    outcome, crashes = asyncio.run(asyncio.wait_for(main(), 60))
    assert not crashes, crashes
    assert outcome == "answer:ACCEPT", outcome


@pytest.mark.parametrize(("role", "expected"),
                         [("pipeline", {"error:unexpected", "error:too_many_tensors"}),
                          ("stage", {"error:bad_input"})])
def test_a_stage_sync_with_nan_parameters_is_refused(role: str, expected: set[str]) -> None:
    """Found by the fuzzer: a STAGE_SYNC with the stage's own parameter names and shapes
    but NaN values, from any authenticated client, was applied: every parameter became NaN.
    Now only replicas (role ``stage``) may sync, and non-finite values are refused (a
    ``pipeline`` client's frame limits may refuse so many tensors even before that)."""
    from swarmtrain.roles.stage import StageServer, StageServerConfig, build_stage
    from swarmtrain.tasks import TextLMConfig, TextLMTask

    async def main() -> tuple[str, bool]:
        task = TextLMTask(TextLMConfig(context=32, d_model=32, n_heads=2, n_layers=4))
        layers, _ = build_stage(task.build_model, 0, 0, 2)
        server = StageServer(layers, stage=0, layer_range=(0, 2), loss_fn=None,
                             config=StageServerConfig(timeouts=FUZZ_TIMEOUTS), secret=SECRET)
        await server.start()
        try:
            before = server.compute.parameters_snapshot()
            sync = StageSync(req=1, round=0, step=0,
                             tensors={n: torch.full_like(t, math.nan) for n, t in before.items()})
            inp = FuzzInput("repro", "auth", encode_bytes(sync), role)
            outcome = await send_input(server.port, inp, (Heartbeat,))
            after = server.compute.parameters_snapshot()
            same = all(torch.equal(before[n], t) for n, t in after.items())
        finally:
            await server.close()
        return outcome, same

    outcome, same = asyncio.run(asyncio.wait_for(main(), 60))
    assert same, f"the refused sync changed the stage's parameters (its answer: {outcome})"
    assert outcome in expected, outcome  # a pipeline client may be stopped by its frame limits


def test_a_ring_handshake_dripped_byte_by_byte_is_cut_at_the_handshake_timeout() -> None:
    """Found while fuzzing the ring port (NOT FIXED: this test fails until it is): the
    listener's ``handshake_timeout`` bounds each ``recv`` of the handshake, not the handshake.
    A client sending one byte every 0.6 timeouts keeps a handshake thread (one of
    ``max_handshakes``) for as long as it likes, without knowing the secret; that many such
    clients make the listener close every new connection unanswered."""
    import select
    import socket
    import time

    from swarmtrain.roles.peer.links import MAGIC, RingListener

    timeout = 0.5
    with RingListener("127.0.0.1", 0, secret=SECRET, handshake_timeout=timeout) as listener:
        opening = MAGIC + bytes(32)
        with socket.create_connection(listener.address, timeout=5.0) as sock:
            start = time.monotonic()
            closed_after = None
            for i in range(len(opening) - 1):  # never complete the opening
                sock.sendall(opening[i:i + 1])
                readable, _, _ = select.select([sock], [], [], 0.6 * timeout)  # the drip's pace
                if readable and not sock.recv(1):
                    closed_after = time.monotonic() - start
                    break
                if time.monotonic() - start > 8 * timeout:
                    break
    assert closed_after is not None and closed_after < 3 * timeout, (
        f"a dripped handshake was still open after {time.monotonic() - start:.1f} s "
        f"(handshake_timeout {timeout} s)")


@pytest.mark.parametrize("how", ["off-cpu-once", "off-cpu-always"])
def test_a_failed_legitimate_request_is_asked_again_only_when_the_box_held_the_process(how: str) -> None:
    """Failed once in CI (3 test processes on 2 cores): a legitimate STATUS_REQUEST after input
    389 was refused with ``handshake_timeout``, the node's 1 s bound, and counted as a hang;
    alone it passed. A request that fails while the process was off the CPU is asked again
    (a node that does not serve fails that too); one that fails while the loop was busy is
    not (that case is not run here: whether a process blocked by work keeps the CPU depends on
    what else the box runs). ``time.sleep`` in the loop holds it up off the CPU, as the box does."""
    from swarmtrain.testing.fuzz_engine import _checked, _Stalls

    calls = []

    async def live() -> str | None:
        calls.append(time.monotonic())
        if how == "off-cpu-always" or len(calls) == 1:
            time.sleep(0.8)  # the loop held up, the process off the CPU
            return "handshake_timeout"
        return None

    async def main() -> tuple[str | None, FuzzReport]:
        stalls, report = _Stalls(), FuzzReport("repro", 0)
        watch = asyncio.create_task(stalls.watch())
        await asyncio.sleep(0.2)  # the watch is on
        try:
            return await _checked(live, stalls, report), report
        finally:
            watch.cancel()

    problem, report = asyncio.run(asyncio.wait_for(main(), 30))
    if how == "off-cpu-once":
        assert problem is None and len(calls) == 2 and len(report.notes) == 1, (problem, report.notes)
        assert "off the CPU" in report.notes[0]
    else:
        assert len(calls) == 2 and problem is not None and "off the CPU" in problem, problem
