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
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from swarmtrain.testing.fuzz import FuzzReport, fuzz_coordinator, fuzz_peer, fuzz_stage
from swarmtrain.testing.fuzz_engine import (
    FUZZ_TIMEOUTS,
    SECRET,
    capture_errors,
    collect_crashes,
    send_input,
)
from swarmtrain.testing.fuzz_inputs import FuzzInput
from swarmtrain.wire import (
    Assign,
    Heartbeat,
    Message,
    Propose,
    Register,
    RegisterAck,
    StageSync,
    Start,
    Weights,
    encode_bytes,
)

pytestmark = pytest.mark.timeout(90)

INPUTS = 400  # per target; about 60-70 inputs/s on a 2-core machine


def _campaign(fuzz: Callable[..., Awaitable[FuzzReport]], seed: int) -> FuzzReport:
    report = asyncio.run(asyncio.wait_for(fuzz(INPUTS, seed=seed), 80))
    print("\n" + report.summary())
    assert report.total == INPUTS
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


# --- bugs the fuzzer found (regression tests) --------------------------------------


async def _drained(connections: set[Any], timeout: float = 10.0) -> None:
    """Wait until a server holds no connection: every connection task has ended (so an
    exception escaping one has been raised and logged)."""
    async with asyncio.timeout(timeout):
        while connections:
            await asyncio.sleep(0.01)


def _coordinator() -> Any:
    from swarmtrain.config import load_coordinator_config
    from swarmtrain.roles.coordinator import Coordinator
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
    from swarmtrain.roles.common import fingerprint

    async def main() -> tuple[str, list[str]]:
        c = _coordinator()
        fp = fingerprint(c.params.items())
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
    from swarmtrain.roles.common import fingerprint
    from swarmtrain.transport import connect
    from swarmtrain.wire import Status, StatusRequest

    async def main() -> tuple[str, Message]:
        c = _coordinator()
        fp = fingerprint(c.params.items())
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
    from swarmtrain.peer.backend import PeerBackend, PeerOptions
    from swarmtrain.peer.identity import Identity

    async def main() -> tuple[str, list[str]]:
        opts = PeerOptions(run="fuzz", min_peers=1, host="127.0.0.1", port=0, mdns=False,
                           static_peers=(("127.0.0.1", 9),), profile="fuzz",
                           propose_timeout=FUZZ_TIMEOUTS.handshake)
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
                         [("pipeline", "error:unexpected"), ("stage", "error:bad_input")])
def test_a_stage_sync_with_nan_parameters_is_refused(role: str, expected: str) -> None:
    """Found by the fuzzer: a STAGE_SYNC with the stage's own parameter names and shapes
    but NaN values, from any authenticated client, was applied: every parameter became NaN.
    Now only replicas (role ``stage``) may sync, and non-finite values are refused."""
    from swarmtrain.pipeline import StageServer, StageServerConfig, build_stage
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
    assert outcome == expected, outcome
