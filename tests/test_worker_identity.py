"""Insiders against a live coordinator (issue #17, must-haves 2 and 3): a refused message
changes no state, claims are checked against what the worker registered, and a worker id
belongs to the node key that first registered it. Real coordinator, real workers, real TCP
(in one process)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.compression import Compressed
from swarmtrain.errors import AuthError
from swarmtrain.roles.ps.checkpointing import CoordinatorCheckpointer
from swarmtrain.roles.ps.common import pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.ctl import ctl_request
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.transport import Connection, auth, connect, start_server
from swarmtrain.transport.identity import Identity
from swarmtrain.wire import (
    Error,
    Gradients,
    Heartbeat,
    Message,
    Register,
    RegisterAck,
    Status,
    StatusRequest,
    Update,
    Weights,
    Welcome,
)
from swarmtrain.wire.messages import MAX_INT
from tests.test_handshake_binding import _RawClient
from tests.test_ps_inprocess import SECRET, coordinator, worker

pytestmark = pytest.mark.timeout(120)
HOST = "127.0.0.1"


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 90))  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)
    assert check(), what


def _register_msg(c: Coordinator, worker_id: str, **over: Any) -> Register:
    fields: dict[str, Any] = dict(
        worker_id=worker_id, task="digits", fingerprint=c.state.fingerprint(), hardware={},
        batch_size=32, accumulation_steps=1, shard_index=-1, compression={"type": "none"},
        samples_per_sec=0.0)
    return Register(**{**fields, **over})


async def _join(c: Coordinator, worker_id: str, identity: Identity | None,
                **over: Any) -> tuple[Connection, Message]:
    """A hand-built worker: connect (with ``identity``'s key, if any) and register; returns the
    connection and the answer (REGISTER_ACK, after which WEIGHTS has been read, or ERROR)."""
    conn = await connect(HOST, c.port, secret=SECRET, role="worker", identity=identity)
    await conn.send(_register_msg(c, worker_id, **over))
    answer = await conn.recv(timeout=10)
    while isinstance(answer, Update):  # the answer to a gradient of the connection replaced
        answer = await conn.recv(timeout=10)
    if isinstance(answer, RegisterAck):
        assert isinstance(await conn.recv(timeout=10), Weights)
    return conn, answer


def _grads(c: Coordinator) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return pack_compressed({n: Compressed("none", tuple(p.shape), "float32",
                                          {"values": torch.full_like(p, 1e-3).reshape(-1)})
                            for n, p in c.params.items()})


async def _answer(conn: Connection) -> Message:
    while True:
        msg = await conn.recv(timeout=10)
        if isinstance(msg, Update | Error):
            return msg


def _state(c: Coordinator, worker_id: str) -> tuple[Any, ...]:
    """Everything a refused message must leave as it was."""
    rec = c.workers[worker_id]
    return (c.version, dict(c.stats), rec.last_msg_id, rec.steps, rec.samples, rec.rejected,
            rec.loss if not math.isnan(rec.loss) else "nan", rec.batch_size, rec.accumulation_steps,
            rec.node, [p.detach().clone() for p in c.params.values()])


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:-1] == b[:-1] and all(torch.equal(x, y) for x, y in zip(a[-1], b[-1]))


def _real_worker(port: int, worker_id: str) -> Worker:
    return worker(port, **{"training.worker_id": worker_id, "network.reconnect_attempts": 5,
                           "network.reconnect_delay_sec": 0.2, "training.probe_seconds": 0.0})


# --- claims and bounds ---------------------------------------------------------------------


def test_out_of_range_fields_and_overclaimed_samples_are_refused_and_change_no_state() -> None:
    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        try:
            conn, ack = await _join(c, "w", Identity.generate(), batch_size=32, accumulation_steps=2)
            assert isinstance(ack, RegisterAck)
            codecs, tensors = _grads(c)

            def gradient(**over: Any) -> Gradients:
                fields: dict[str, Any] = dict(msg_id=1, version=c.version, samples=64, loss=1.0,
                                              codecs=codecs, tensors=tensors)
                return Gradients(**{**fields, **over})

            # every field bound at the wire: an ERROR out_of_range that is not fatal, nothing moves
            wire_cases: list[Message] = [
                gradient(samples=2**64 - 1), gradient(msg_id=2**64 - 1), gradient(loss=-1e300),
                gradient(loss=math.inf), gradient(version=MAX_INT + 1), gradient(residual_norm=-1.0),
                gradient(samples=-5), _register_msg(c, "w", batch_size=2**40),
                _register_msg(c, "w", accumulation_steps=0), _register_msg(c, "w", samples_per_sec=1e300),
                _register_msg(c, "w", shard_index=-2), Heartbeat(time=-1.0),
            ]
            for n, msg in enumerate(wire_cases, 1):
                before = _state(c, "w")
                await conn.send(msg)
                err = await _answer(conn)
                assert isinstance(err, Error) and err.code == "out_of_range" and not err.fatal, (msg, err)
                assert msg.TYPE.name in err.message and "allows" in err.message
                assert _same(_state(c, "w"), before), msg
                assert c.status()["refusals"]["out_of_range"] == n
            # a claim over what the worker registered (32 x 2): a rejected gradient, counted
            before = _state(c, "w")
            for samples in (10**12, 65):
                await conn.send(gradient(samples=samples, msg_id=5))
                ans = await _answer(conn)
                assert isinstance(ans, Update) and ans.status == "rejected" and ans.msg_id == 5
            rec = c.workers["w"]
            assert "registered batch_size 32 x accumulation_steps 2 = 64" in rec.last_refusal
            assert rec.rejected == 2 and c.stats["rejected"] == 2 and rec.last_msg_id == 0
            assert c.refusals["rejected_gradient"] == 2
            assert c.version == before[0] and all(torch.equal(a, b) for a, b in
                                                  zip(before[-1], c.params.values()))
            # the connection went on all along: a gradient within the claim is applied
            await conn.send(gradient(samples=64, msg_id=5))
            ans = await _answer(conn)
            assert isinstance(ans, Update) and ans.status == "applied" and c.version == before[0] + 1
            assert rec.last_msg_id == 5 and rec.samples == 64
            # and the status (what the issue's huge sample counts broke) encodes and reaches ctl
            reply = await ctl_request(HOST, c.port, "status", secret=SECRET, timeout=10)
            assert isinstance(reply, Status)
            assert reply.status["refusals"] == {"out_of_range": len(wire_cases), "rejected_gradient": 2}
            await conn.send(StatusRequest())
            await conn.close()
        finally:
            await c.close()

    run(scenario())


def test_the_issue_lockout_sequence_no_longer_locks_a_worker_out() -> None:
    """#17: a gradient under a live worker's id with a huge ``msg_id`` was refused (it was NaN)
    but still advanced ``last_msg_id``; the real worker, told that id on its next
    registration, could not send another gradient and gave up. Now: the stranger's REGISTER of
    the live id is refused; even a connection from the worker's own node (a duplicate of it)
    gets a huge ``msg_id`` refused at the wire, and a refused gradient leaves ``last_msg_id``
    alone, so the real worker comes back and trains on."""
    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        real = _real_worker(c.port, "victim")
        task = asyncio.create_task(real.run_async())
        try:
            await eventually(lambda: real.steps >= 3, "the real worker trains")
            # the sequence from the issue, by a secret holder without the worker's key
            conn, answer = await _join(c, "victim", None)
            assert isinstance(answer, Error) and answer.code == "worker_id_taken"
            await conn.close()
            # the same sequence from a duplicate holding the real worker's key
            conn, ack = await _join(c, "victim", real.identity)
            assert isinstance(ack, RegisterAck)
            codecs, tensors = _grads(c)
            nan = {"loss": math.nan, "codecs": codecs, "tensors": tensors, "samples": 32}
            await conn.send(Gradients(msg_id=2**64 - 1, version=c.version, **nan))
            err = await _answer(conn)
            assert isinstance(err, Error) and err.code == "out_of_range"
            last = c.workers["victim"].last_msg_id
            await conn.send(Gradients(msg_id=MAX_INT, version=c.version, **nan))
            ans = await _answer(conn)
            assert isinstance(ans, Update) and ans.status == "rejected"
            assert c.workers["victim"].last_msg_id == last < 2**32  # a refusal moves no id
            await conn.close()
            # the real worker registers again and goes on training
            steps = real.steps
            await eventually(lambda: real.steps >= steps + 3, "the real worker trains on")
            assert real.msg_id < 2**32 and c.workers["victim"].connected
        finally:
            real.stop()
            await asyncio.gather(task, return_exceptions=True)
            await c.close()

    run(scenario())


def test_a_worker_whose_loader_batches_exceed_its_batch_size_registers_them() -> None:
    """A DataLoader's batches (48 here) may be larger than the worker's batch_size (32): the
    worker registers again with the batches it computes instead of having its gradients
    refused for claiming more samples than it registered."""
    from tests.test_ps_inprocess import DATA, TASK

    batches = [DATA.train.get_batch(torch.arange(i, i + 48)) for i in range(0, 480, 48)]

    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        w = Worker(TASK.build_model(), TASK.loss, batches, _real_worker(c.port, "loader").config,
                   task_name="digits", secret=SECRET)
        task = asyncio.create_task(w.run_async())
        try:
            await eventually(lambda: c.workers.get("loader") is not None
                             and c.workers["loader"].steps >= 3, "the worker trains")
            rec = c.workers["loader"]
            assert rec.batch_size == 48 and rec.samples == 48 * rec.steps
            assert rec.rejected == 0 and c.stats["rejected"] == 0
        finally:
            w.stop()
            await asyncio.gather(task, return_exceptions=True)
            await c.close()

    run(scenario())


# --- worker ids belong to a node --------------------------------------------------------------


def test_another_node_cannot_take_a_live_worker_id_but_its_own_node_can() -> None:
    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        real = _real_worker(c.port, "w1")
        task = asyncio.create_task(real.run_async())
        try:
            await eventually(lambda: c.workers.get("w1") is not None and c.workers["w1"].steps >= 3,
                             "the real worker trains")
            rec = c.workers["w1"]
            assert rec.node == real.identity.peer_id  # bound to the verified node
            held = rec.conn
            for intruder in (Identity.generate(), None):  # another key, and no key at all
                conn, answer = await _join(c, "w1", intruder)
                assert isinstance(answer, Error) and answer.code == "worker_id_taken"
                assert real.identity.peer_id in answer.message and "--worker-id" in answer.message
                await conn.close()
            assert c.refusals["worker_id_taken"] == 2 == c.status()["refusals"]["worker_id_taken"]
            # the live worker was not kicked, and its updates go on
            steps = rec.steps
            await eventually(lambda: rec.steps >= steps + 5, "the real worker keeps training")
            assert rec.conn is held and not held.is_closed
            # the worker's own node (a worker that lost its link comes back) is let in
            conn, ack = await _join(c, "w1", real.identity)
            assert isinstance(ack, RegisterAck)
            await eventually(lambda: held.is_closed, "its old connection is replaced")
            await conn.close()
            steps = rec.steps
            await eventually(lambda: rec.steps >= steps + 3, "the real worker came back")
        finally:
            real.stop()
            await asyncio.gather(task, return_exceptions=True)
            await c.close()

    run(scenario())


def test_worker_id_bindings_survive_a_checkpoint(tmp_path: Path) -> None:
    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        me = Identity.generate()
        try:
            conn, ack = await _join(c, "w1", me)
            assert isinstance(ack, RegisterAck)
            await conn.close()
            ckpt = CoordinatorCheckpointer(str(tmp_path), interval=0, keep=2)
            assert (await ckpt.save_now(c)).ok
        finally:
            await c.close()
        again = coordinator(**{"training.min_workers": 1})
        assert CoordinatorCheckpointer(str(tmp_path), interval=0, keep=2).restore(again)
        assert again.workers["w1"].node == me.peer_id
        await again.start()
        try:
            conn, answer = await _join(again, "w1", Identity.generate())
            assert isinstance(answer, Error) and answer.code == "worker_id_taken"
            await conn.close()
            conn, ack = await _join(again, "w1", me)
            assert isinstance(ack, RegisterAck)
            await conn.close()
        finally:
            await again.close()

    run(scenario())


# --- the identity proof in the handshake ------------------------------------------------------


async def _handshake(port: int, node: str, **auth_fields: Any) -> Message | None:
    """HELLO claiming ``node``, then AUTH with a correct secret proof and ``auth_fields`` (a
    forger's: values, or callables of the transcript); the server's answer."""
    raw = await _RawClient.open(port)
    try:
        hello, ch = await raw.hello("worker", node)
        raw.auth(hello, ch, **auth_fields)
        return await raw.recv()
    finally:
        raw.close()


def test_a_forged_or_mismatched_identity_is_refused_with_a_code() -> None:
    me, other = Identity.generate(), Identity.generate()

    def sign(ident: Identity) -> Callable[[auth.Transcript], bytes]:
        return lambda t: ident.sign(auth.identity_statement(t))

    def sign_other_session(t: auth.Transcript) -> bytes:  # a signature from another handshake
        return me.sign(auth.identity_statement(auth.Transcript("worker", auth.new_nonce(), t.server_nonce,
                                                               node=t.node, software=t.software)))

    async def scenario() -> None:
        nodes: list[str] = []

        async def handler(conn: Connection, role: str) -> None:
            nodes.append(conn.node)

        srv = await start_server(HOST, 0, handler, secret=SECRET)
        try:
            forged = {
                "another key's": dict(public_key=other.public_key, signature=sign(other)),
                "a signature by another key": dict(public_key=me.public_key, signature=sign(other)),
                "a garbage signature": dict(public_key=me.public_key, signature=b"\0" * 64),
                "another session's signature": dict(public_key=me.public_key, signature=sign_other_session),
                "a key of the wrong size": dict(public_key=me.public_key[:31], signature=sign(me)),
                "a signature without a key": dict(signature=sign(me)),
            }
            for why, fields in forged.items():
                answer = await _handshake(srv.port, me.peer_id, **fields)
                assert isinstance(answer, Error) and answer.code == "bad_identity", (why, answer)
            assert nodes == []
            answer = await _handshake(srv.port, me.peer_id, public_key=me.public_key, signature=sign(me))
            assert isinstance(answer, Welcome)
            # a client without a key still gets in, but its claimed node is not kept
            conn = await connect(HOST, srv.port, secret=SECRET, role="worker", node=me.peer_id)
            await conn.close()
            conn = await connect(HOST, srv.port, secret=SECRET, role="worker", identity=me)
            await conn.close()
            await eventually(lambda: len(nodes) == 3, "three sessions reached the handler")
            assert nodes == [me.peer_id, "", me.peer_id]
        finally:
            await srv.close()

    run(scenario())


def test_a_relay_cannot_swap_in_its_own_key() -> None:
    """A relay (without the secret) replacing HELLO.node by its own key's id breaks the MAC;
    keeping the node and swapping AUTH's key and signature breaks the identity proof."""
    me, relay_key = Identity.generate(), Identity.generate()

    async def scenario() -> None:
        async def handler(conn: Connection, role: str) -> None:
            pass

        srv = await start_server(HOST, 0, handler, secret=SECRET)
        try:
            answer = await _handshake(srv.port, me.peer_id, public_key=relay_key.public_key,
                                      signature=lambda t: relay_key.sign(auth.identity_statement(t)))
            assert isinstance(answer, Error) and answer.code == "bad_identity"
            with pytest.raises(AuthError):
                await connect(HOST, srv.port, secret=b"not the secret", role="worker", identity=me)
        finally:
            await srv.close()

    run(scenario())


def test_worker_numbers_are_given_in_join_order_kept_across_a_checkpoint_and_never_reused(
        tmp_path: Path) -> None:
    # A worker without an id of its own derives its random streams from its number: two workers
    # with one number would draw the same batches.
    async def scenario() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        me = Identity.generate()
        try:
            numbers: dict[str, list[int]] = {}
            for wid in ("w1", "w2", "w1"):  # (w1 again: the same number)
                conn, ack = await _join(c, wid, me)
                assert isinstance(ack, RegisterAck)
                numbers.setdefault(wid, []).append(ack.info["member"])
                await conn.close()
            assert numbers == {"w1": [0, 0], "w2": [1]}
            assert (await CoordinatorCheckpointer(str(tmp_path), interval=0, keep=2).save_now(c)).ok
        finally:
            await c.close()
        again = coordinator(**{"training.min_workers": 1})
        assert CoordinatorCheckpointer(str(tmp_path), interval=0, keep=2).restore(again)
        await again.start()
        try:
            for wid, number in (("w3", 2), ("w1", 0)):
                conn, ack = await _join(again, wid, me)
                assert isinstance(ack, RegisterAck) and ack.info["member"] == number, (wid, ack)
                await conn.close()
        finally:
            await again.close()

    run(scenario())
