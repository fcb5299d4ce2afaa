"""An answer that is due the full weights when no copy of them may be made (the coordinator's
MAX_HELD_SNAPSHOTS copies are held by answers still on their way) waits for one, over real
connections; a worker due another track's weights gets its own track's entries instead when
they reach it. Until now both were told "no change" at once: on a link slower than the
updates (bench_shards.py, one server on 100 Mbit/s) 43 % of the answers, each next gradient
computed on weights further behind."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from swarmtrain.config import load_coordinator_config
from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import SwarmTimeout
from swarmtrain.roles.ps.common import FUSE_MAX_NUMEL, FUSED
from swarmtrain.roles.ps.coordinator import MAX_HELD_SNAPSHOTS, Coordinator
from swarmtrain.roles.ps.replica import Replica
from swarmtrain.transport import Timeouts, connect
from swarmtrain.wire import Register, RegisterAck, Start, Update, UpdateStatus, Weights
from tests.test_coordinator_state import record
from tests.test_fused import grads_of, message, named, through_the_wire

pytestmark = pytest.mark.timeout(90)

HOST = "127.0.0.1"
SECRET = b"deferred-answers-test"
TIMEOUTS = Timeouts(connect=10, handshake=10, heartbeat_interval=0.5, heartbeat_timeout=30, send=30)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    assert sum(p.numel() for p in model.parameters()) > FUSE_MAX_NUMEL  # (copies pooled and bounded)
    return model


def _hold_every_copy(c: Coordinator) -> list[bytearray]:
    """Buffers of the snapshot pool taken as answers on a slow link hold them: no copy of the
    weights may be made until they are let go."""
    pool = c._snapshot_pool
    held = [pool.take(4 * sum(c._sizes) + 4096) for _ in range(MAX_HELD_SNAPSHOTS - pool.in_use())]
    assert not c._snapshot_room()
    return held


async def _joined(port: int, fingerprint: Any) -> tuple[Any, Weights]:
    """Worker "w" registered over a real connection, welcomed and started: (the connection, its
    welcome)."""
    conn = await connect(HOST, port, secret=SECRET, role="worker", timeouts=TIMEOUTS)
    await conn.send(Register(worker_id="w", task="", fingerprint=fingerprint, hardware={}, batch_size=32,
                             accumulation_steps=1, shard_index=-1, compression={"type": "none"},
                             samples_per_sec=0.0))
    assert isinstance(await conn.recv(timeout=30), RegisterAck)
    welcome = await conn.recv(timeout=30)
    assert isinstance(welcome, Weights)
    while not isinstance(await conn.recv(timeout=30), Start):
        pass
    return conn, welcome


def test_an_answer_due_the_weights_waits_for_a_copy_over_a_real_connection() -> None:
    """A worker whose answer is the full weights (a lossless downlink) while every copy the
    coordinator may hold is held: its answer does not come at once; once a copy is let go it
    comes, the full weights of the version then, bit for bit the master's. Held past the
    heartbeat timeout (copies held by sends to peers that stopped reading), it is "no change"
    after all, counted withheld, and the worker stays where it was."""
    model = _model()
    state = ModelState(model)
    fingerprint = state.fingerprint()

    async def scenario() -> None:
        cfg = load_coordinator_config(overrides={
            "network.host": HOST, "network.port": 0, "training.learning_rate": 1e-3,
            "training.min_workers": 1, "training.max_staleness": 10_000, "checkpointing.interval": 0,
            "network.heartbeat_interval_sec": 0.5, "network.heartbeat_timeout_sec": 2.0})
        c = Coordinator(model, cfg, secret=SECRET)
        await c.start()
        conn, welcome = await _joined(c.port, fingerprint)
        try:
            g = grads_of(c.params, 1)
            held = _hold_every_copy(c)
            await conn.send(message(c.params, g, fuse=False, msg_id=1, version=welcome.version))
            with pytest.raises(SwarmTimeout):  # (no answer while every copy is held)
                await conn.recv(timeout=0.6)
            assert c.workers["w"].waits_for is not None and c.version == welcome.version + 1
            assert c.status()["snapshots"]["waiting"] == 1 and c.status()["downlink"]["deferred"] == 1
            released = time.monotonic()
            held.clear()
            answer = await conn.recv(timeout=10)
            assert isinstance(answer, Update) and answer.full and answer.status == UpdateStatus.APPLIED
            assert answer.version == c.version and time.monotonic() - released < 5
            assert all(torch.equal(t, c.params[n]) for n, t in named(c, answer.tensors).items())
            assert c.workers["w"].waits_for is None and c.status()["snapshots"]["withheld"] == 0
            assert c.status()["snapshots"]["waiting"] == 0

            held = _hold_every_copy(c)  # and never let go (until the heartbeat timeout)
            asked = time.monotonic()
            await conn.send(message(c.params, g, fuse=False, msg_id=2, version=answer.version))
            late = await conn.recv(timeout=10)
            assert isinstance(late, Update) and not late.full and not late.deltas
            assert late.version == answer.version and time.monotonic() - asked >= 1.9  # "no change"
            assert c.status()["snapshots"]["withheld"] == 1 and c.workers["w"].holds_version == answer.version
            held.clear()
        finally:
            await conn.close()
            c.stop()
            await c.close()

    asyncio.run(asyncio.wait_for(scenario(), 80))


def _uniform_coordinator() -> Any:
    cfg = load_coordinator_config(overrides={
        "network.host": HOST, "network.port": 0, "checkpointing.interval": 0,
        # (steps small beside the weights: the 2-bit entries stay within the drift bound, no restarts)
        "training.learning_rate": 1e-5, "training.max_staleness": 1000, "compression.type": "topk",
        "compression.downlink_bits": 2})
    return Coordinator(_model(), cfg, task_name="big")


def test_a_worker_due_another_tracks_weights_gets_its_own_tracks_entries_when_no_copy_may_be_made() -> None:
    """A worker far enough behind on the finest track that its chain there is over half the
    weights is due the weights of a coarser track (a move). With no copy possible it gets the
    chain of the track it is on instead (smaller than the weights, already encoded, no copy),
    stays on that track, and its replica is that track's published weights bit for bit."""
    c = _uniform_coordinator()
    rec, other = record(c, "rec"), record(c, "other")
    replica = Replica(ModelState(_model()), torch.device("cpu"))
    welcome = c._snapshot_for(rec)
    replica.apply_update(through_the_wire(Update(msg_id=0, version=welcome.version, full=True,
                                                 status=UpdateStatus.APPLIED, tensors=welcome.tensors)))
    for i in range(12):  # rec lags 12 versions: 12 entries of 1/16 of the weights each, over half
        status, _ = c._apply_gradient(other, message(c.params, grads_of(c.params, i), fuse=False,
                                                     msg_id=i + 1, version=other.holds_version))
        assert status == "applied"
    held = _hold_every_copy(c)
    status, reply = c._apply_gradient(rec, message(c.params, grads_of(c.params, 50), fuse=False, msg_id=1,
                                                   version=rec.holds_version))
    assert status == "applied" and reply is not None and not reply.full
    fine = c.downlink.tracks[0]
    assert len(reply.deltas) == c.version == fine.head and rec.track == 0 and rec.waits_for is None
    assert c.downlink.instead_of_weights == 1 and c.downlink.switches == 0
    assert sum(e.nbytes for e in fine.entries) > fine.replica_bytes // 2  # (why the weights were due)
    replica.apply_update(through_the_wire(reply))
    assert replica.version == c.version
    got = torch.cat([p.detach().reshape(-1) for p in replica.params.values()])
    assert fine.published is not None and torch.equal(got, fine.published)
    held.clear()
    status, reply = c._apply_gradient(rec, message(c.params, grads_of(c.params, 51), fuse=False, msg_id=2,
                                                   version=rec.holds_version))
    assert reply is not None and len(reply.deltas) == 1 and rec.track == 0  # (one version since: small)
    assert FUSED not in reply.tensors


def test_a_wait_ends_unanswered_when_its_worker_registers_again_on_another_connection() -> None:
    """The worker's answer waits for a copy; it registers again on a new connection (its old
    one is closed) and its next gradient waits too. The old wait must end without answering:
    answers go to the worker's connection as it is now, and the old wait, giving up first
    (every copy stays held), would take the new wait's place and answer "no change" to the
    old gradient on the new connection, leaving the new gradient unanswered for good."""
    model = _model()
    fingerprint = ModelState(model).fingerprint()

    async def scenario() -> None:
        cfg = load_coordinator_config(overrides={
            "network.host": HOST, "network.port": 0, "training.learning_rate": 1e-3,
            "training.min_workers": 1, "training.max_staleness": 10_000, "checkpointing.interval": 0,
            "network.heartbeat_interval_sec": 0.5, "network.heartbeat_timeout_sec": 2.0})
        c = Coordinator(model, cfg, secret=SECRET)
        await c.start()
        old, welcome = await _joined(c.port, fingerprint)
        new = None
        held: list[bytearray] = []
        try:
            g = grads_of(c.params, 1)
            held = _hold_every_copy(c)
            await old.send(message(c.params, g, fuse=False, msg_id=1, version=welcome.version))
            with pytest.raises(SwarmTimeout):
                await old.recv(timeout=0.5)  # (it waits)
            new, again = await _joined(c.port, fingerprint)  # (the coordinator closes the old connection)
            held += _hold_every_copy(c)  # (the welcome made a copy of its own)
            asked = time.monotonic()
            await new.send(message(c.params, g, fuse=False, msg_id=7, version=again.version))
            answer = await new.recv(timeout=10)
            assert isinstance(answer, Update) and answer.msg_id == 7, answer.msg_id
            assert not answer.full and time.monotonic() - asked >= 1.9  # its own wait's "no change"
            assert c.workers["w"].holds_version == again.version == answer.version
            assert c.status()["snapshots"]["withheld"] == 1 and c.workers["w"].waits_for is None
        finally:
            held.clear()
            for conn in (old, new):
                if conn is not None:
                    await conn.close()
            c.stop()
            await c.close()

    asyncio.run(asyncio.wait_for(scenario(), 80))
