"""The payload gate (transport/payload_gate.py): one bound, shared by many connections, on
the frame payloads received and not yet processed; and the sliced writes that keep a
connection's send buffer small.

The gate alone first (pure: FIFO order, a payload larger than the bound admitted alone, a
waiting place given up), then over real loopback TCP: many senders against one slow consumer
(the bound holds, nothing deadlocks, every message arrives in order), small messages passing
while the gate is full, an oversize frame, the admission timeout; then a real coordinator
receiving real gradients from many connections at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from torch import nn

from swarmtrain.config import CompressionConfig, load_coordinator_config
from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import SwarmError
from swarmtrain.roles.ps.common import codec_for_step, pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.transport import Connection, Timeouts, connect, start_server
from swarmtrain.transport.payload_gate import GATE_MIN_BYTES, PayloadGate
from swarmtrain.wire import (
    Decoder,
    Gradients,
    MsgType,
    Register,
    RegisterAck,
    Shutdown,
    Start,
    StatusRequest,
    Update,
    Weights,
    encode_bytes,
)

pytestmark = pytest.mark.timeout(90)

HOST = "127.0.0.1"
SLOW = Timeouts(connect=10, handshake=10, heartbeat_interval=0.5, heartbeat_timeout=30, send=30)
SECRET = b"payload-gate-test"
FRAME = 1 << 20  # the payload of one test frame: 256 Ki float32 values


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def frame(i: int, numel: int = FRAME // 4) -> Weights:
    return Weights(version=i, tensors={"w": torch.full((numel,), float(i))})


# --- the gate alone --------------------------------------------------------------------------


def test_gate_admits_in_arrival_order_and_never_over_its_bound() -> None:
    gate = PayloadGate(3 * FRAME)
    granted: list[int] = []
    tickets = [gate.request(FRAME, lambda i=i: granted.append(i)) for i in range(6)]
    assert [t.granted for t in tickets] == [True] * 3 + [False] * 3
    assert gate.held_bytes == 3 * FRAME and gate.waited == 3
    gate.release(tickets[1])
    assert granted == [3] and gate.held_bytes == 3 * FRAME
    # a small one asking now waits behind the queue (no overtaking), even if it would fit later
    late = gate.request(FRAME // 2, lambda: granted.append(99))
    gate.release(tickets[0])
    gate.release(tickets[2])
    assert granted == [3, 4, 5] and not late.granted
    for t in tickets[3:]:
        gate.release(t)
    assert granted == [3, 4, 5, 99] and gate.peak_held_bytes == 3 * FRAME
    gate.release(late)
    assert gate.held_bytes == 0 and gate.summary()["waiting"] == 0


def test_a_payload_larger_than_the_bound_is_admitted_alone() -> None:
    gate = PayloadGate(FRAME)
    small = gate.request(FRAME // 2, lambda: None)
    big = gate.request(4 * FRAME, lambda: None)
    assert small.granted and not big.granted  # something is held: it waits
    gate.release(small)
    assert big.granted and gate.held_bytes == 4 * FRAME and gate.oversize == 1
    after = gate.request(FRAME // 4, lambda: None)
    assert not after.granted  # nothing else while the big one is held
    gate.release(big)
    assert after.granted


def test_an_automatic_gate_holds_two_of_the_largest_payloads_seen() -> None:
    gate = PayloadGate(0)
    first = gate.request(FRAME, lambda: None)
    second = gate.request(FRAME, lambda: None)
    third = gate.request(FRAME, lambda: None)
    assert first.granted and second.granted and not third.granted
    assert gate.summary()["limit_bytes"] == 2 * FRAME and gate.summary()["automatic"]
    gate.release(first)
    assert third.granted and gate.peak_held_bytes == 2 * FRAME and gate.oversize == 0


def test_a_waiting_ticket_that_gives_up_leaves_the_queue() -> None:
    gate = PayloadGate(FRAME)
    first = gate.request(FRAME, lambda: None)
    gone = gate.request(FRAME, lambda: pytest.fail("granted after it gave up"))
    third = gate.request(FRAME, lambda: None)
    gate.timed_out(gone)
    gate.release(first)
    assert third.granted and gate.timeouts == 1 and gate.summary()["waiting"] == 0


def test_the_decoder_says_how_large_a_payload_is_before_it_takes_any_of_it() -> None:
    data = encode_bytes(frame(7))
    dec = Decoder()
    header_end = len(data) - FRAME
    dec.feed(data[:header_end])
    assert dec.awaiting_payload == FRAME and dec.frame_type is MsgType.WEIGHTS
    assert dec.awaiting_payload == FRAME  # asking twice changes nothing
    dec.feed(data[header_end:header_end + 1])  # the first payload byte: the buffer now exists
    assert dec.awaiting_payload == 0 and dec.next_message() is None
    dec.feed(data[header_end + 1:])
    msg = dec.next_message()
    assert isinstance(msg, Weights) and float(msg.tensors["w"][-1]) == 7.0


# --- over real connections -------------------------------------------------------------------


@dataclasses.dataclass
class SlowConsumer:
    """A server handler that processes one message at a time, across all connections (like
    the coordinator's single apply thread), checking the gate's bound as it goes."""

    gate: PayloadGate
    delay: float = 0.01
    received: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    peak_seen: int = 0

    async def handle(self, conn: Connection, role: str) -> None:
        conn.admit_payloads(self.gate)
        try:
            while True:
                msg = await conn.recv(timeout=30)
                self.peak_seen = max(self.peak_seen, self.gate.held_bytes)
                if isinstance(msg, Shutdown):
                    await conn.send(Shutdown(reason="bye"))
                    continue
                assert isinstance(msg, Weights)
                async with self.lock:
                    await asyncio.sleep(self.delay)
                self.received.setdefault(int(msg.tensors["w"][0]) // 1000, []).append(msg.version)
                conn.done_with(msg)
        except SwarmError:
            return
        finally:
            conn.release_all()


async def _send_frames(port: int, sender: int, count: int, numel: int = FRAME // 4) -> None:
    conn = await connect(HOST, port, secret=None, role="worker", timeouts=SLOW)
    try:
        for i in range(count):
            msg = frame(sender * 1000 + i, numel)
            await conn.send(dataclasses.replace(msg, version=i))
        await conn.send(Shutdown(reason="done"))
        reply = await conn.recv(timeout=30)  # every frame before it was read
        assert isinstance(reply, Shutdown)
    finally:
        await conn.close()


def test_many_senders_one_slow_consumer_the_bound_holds_and_all_arrive_in_order() -> None:
    async def scenario() -> None:
        gate = PayloadGate(3 * FRAME, timeout=30)
        consumer = SlowConsumer(gate)
        srv = await start_server(HOST, 0, consumer.handle, secret=None, timeouts=SLOW)
        try:
            await asyncio.gather(*(_send_frames(srv.port, s, 6) for s in range(12)))
        finally:
            await srv.close()
        assert sorted(consumer.received) == list(range(12))
        assert all(v == list(range(6)) for v in consumer.received.values())
        summary = gate.summary()
        # the payload of the frame in progress is counted from its header on: never more
        # than the bound held at once, though 12 frames were in flight at the start
        assert summary["peak_held_bytes"] <= 3 * FRAME
        assert consumer.peak_seen <= 3 * FRAME
        assert summary["waited"] > 0  # the bound did bite
        assert summary["admitted"] == 12 * 6 and summary["held_bytes"] == 0
        assert summary["waiting"] == 0 and summary["timeouts"] == 0

    run(scenario())


def test_small_messages_pass_while_the_gate_is_full_and_a_frame_over_the_bound_passes_alone() -> None:
    async def scenario() -> None:
        gate = PayloadGate(2 * FRAME, timeout=30)
        held: list[tuple[Connection, Weights]] = []
        statuses: list[str] = []

        async def handle(conn: Connection, role: str) -> None:
            conn.admit_payloads(gate)
            try:
                while True:
                    msg = await conn.recv(timeout=30)
                    if isinstance(msg, Weights):
                        held.append((conn, msg))  # kept: not done with it until told
                    elif isinstance(msg, StatusRequest):
                        statuses.append(role)
                        await conn.send(Shutdown(reason="status"))
            except SwarmError:
                return
            finally:
                conn.release_all()

        srv = await start_server(HOST, 0, handle, secret=None, timeouts=SLOW)
        clients: list[Connection] = []
        try:
            filler = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            clients.append(filler)
            await filler.send(frame(1))
            await filler.send(frame(2))
            async with asyncio.timeout(20):
                while len(held) < 2:
                    await asyncio.sleep(0.01)
            assert gate.held_bytes == 2 * FRAME
            big = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            clients.append(big)
            await big.send(frame(3, numel=FRAME))  # 4 x the frame: twice the bound
            async with asyncio.timeout(20):
                while gate.summary()["waiting"] < 1:
                    await asyncio.sleep(0.01)
            # the gate is full and someone waits: a small request on another connection passes
            ctl = await connect(HOST, srv.port, secret=None, role="ctl", timeouts=SLOW)
            clients.append(ctl)
            await ctl.send(StatusRequest())
            assert isinstance(await ctl.recv(timeout=20), Shutdown)
            assert statuses == ["ctl"] and len(held) == 2
            for conn, msg in held[:2]:
                conn.done_with(msg)
            async with asyncio.timeout(20):
                while len(held) < 3:
                    await asyncio.sleep(0.01)
            assert gate.oversize == 1 and gate.held_bytes == 4 * FRAME  # alone, over the bound
            held[2][0].done_with(held[2][1])
            assert gate.held_bytes == 0
        finally:
            for c in clients:
                await c.close()
            await srv.close()

    run(scenario())


def test_a_frame_that_waits_past_the_timeout_drops_its_connection() -> None:
    async def scenario() -> None:
        gate = PayloadGate(FRAME, timeout=0.5)
        held: list[Weights] = []
        ended: list[str] = []

        async def handle(conn: Connection, role: str) -> None:
            conn.admit_payloads(gate)
            try:
                while True:
                    msg = await conn.recv(timeout=30)
                    assert isinstance(msg, Weights)
                    held.append(msg)  # never done with: the gate stays full
            except SwarmError as exc:
                ended.append(type(exc).__name__)
            finally:
                conn.release_all()

        srv = await start_server(HOST, 0, handle, secret=None, timeouts=SLOW)
        try:
            first = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            await first.send(frame(1))
            async with asyncio.timeout(20):
                while not held:
                    await asyncio.sleep(0.01)
            second = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            await second.send(frame(2))
            async with asyncio.timeout(20):
                await second.wait_closed()  # dropped by the server
            assert gate.timeouts == 1 and ended == ["SwarmTimeout"] and len(held) == 1
            await first.close()
            await second.close()
        finally:
            await srv.close()
        assert gate.held_bytes == 0 and gate.summary()["waiting"] == 0

    run(scenario())


def test_a_large_frame_to_a_reader_that_does_not_read_is_not_copied_into_the_send_buffer() -> None:
    """asyncio copies what the kernel does not take into the transport's buffer: a whole
    32 MB frame written at once to a stalled reader sat there (one copy per connection);
    written in slices, at most about a slice does."""
    async def scenario() -> None:
        ready: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()

        async def handle(conn: Connection, role: str) -> None:
            ready.set_result(conn)
            with contextlib.suppress(SwarmError):
                await conn.wait_closed()

        srv = await start_server(HOST, 0, handle, secret=None, timeouts=SLOW)
        try:
            client = await connect(HOST, srv.port, secret=None, role="worker", timeouts=SLOW)
            client.transport.pause_reading()  # the reader stalls: the kernel buffers fill up
            server_side = await asyncio.wait_for(ready, 10)
            await server_side.send(frame(1, numel=8 << 20))  # 32 MB
            most = 0
            for _ in range(100):
                await asyncio.sleep(0.01)
                most = max(most, server_side.transport.get_write_buffer_size())
            assert most <= 1 << 20, most  # a slice (256 KiB) and the high-water mark
            client.transport.resume_reading()
            msg = await client.recv(timeout=30)
            assert isinstance(msg, Weights) and msg.tensors["w"].numel() == 8 << 20
            assert float(msg.tensors["w"][-1]) == 1.0
            await client.close()
        finally:
            await srv.close()

    run(scenario())


# --- a coordinator ---------------------------------------------------------------------------


class Wide(nn.Module):
    """A model whose gradient (160 KiB) is over the gate's minimum, so that it is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(200, 200)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_coordinator_holds_at_most_its_bound_of_gradients_from_many_workers() -> None:
    torch.manual_seed(0)
    model = Wide()
    state = ModelState(model)
    model(torch.randn(4, 200)).square().mean().backward()
    comp = CompressionConfig(type="none")
    codec = codec_for_step(comp, step=0)
    codecs, tensors = pack_compressed({n: codec.compress(p.grad.detach())
                                       for n, p in state.trainable.items() if p.grad is not None})
    grad_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert grad_bytes >= GATE_MIN_BYTES
    fingerprint = state.fingerprint()
    model.zero_grad()
    bound_mb = 2.5 * grad_bytes / 2**20  # room for two gradients and a half
    workers, per_worker = 12, 4

    async def one_worker(port: int, i: int) -> list[str]:
        conn = await connect(HOST, port, secret=SECRET, role="worker", timeouts=SLOW)
        try:
            await conn.send(Register(
                worker_id=f"w{i}", task="", fingerprint=fingerprint, hardware={}, batch_size=4,
                accumulation_steps=1, shard_index=-1,
                compression={k: getattr(comp, k) for k in comp.SHARED_KEYS}, samples_per_sec=0.0))
            assert isinstance(await conn.recv(timeout=30), RegisterAck)
            weights = await conn.recv(timeout=30)
            assert isinstance(weights, Weights)
            version = weights.version
            while not isinstance(await conn.recv(timeout=30), Start):
                pass
            # every gradient sent at once: all of them are in flight together
            for k in range(per_worker):
                await conn.send(Gradients(msg_id=k + 1, version=version, samples=4, loss=1.0,
                                          codecs=codecs, tensors=tensors))
            statuses = []
            while len(statuses) < per_worker:
                msg = await conn.recv(timeout=60)
                if isinstance(msg, Update):
                    statuses.append(str(msg.status))
            return statuses
        finally:
            await conn.close()

    async def scenario() -> dict[str, Any]:
        cfg = load_coordinator_config(overrides={
            "network.host": HOST, "network.port": 0, "training.learning_rate": 1e-3,
            "training.min_workers": workers, "training.max_staleness": 10_000,
            "checkpointing.interval": 0, "network.max_held_gradient_mb": bound_mb})
        coord = Coordinator(model, cfg, secret=SECRET)
        await coord.start()
        try:
            answers = await asyncio.gather(*(one_worker(coord.port, i) for i in range(workers)))
            assert all(s == ["applied"] * per_worker for s in answers), answers
            return coord.status()
        finally:
            coord.stop()
            await coord.close()

    status = run(scenario(), timeout=80)
    adm = status["admission"]
    assert status["stats"]["applied"] == workers * per_worker
    assert adm["limit_bytes"] == int(bound_mb * 2**20)
    # the bound holds (a frame is counted from its header on, so not even one over it)
    assert 2 * grad_bytes <= adm["peak_held_bytes"] <= adm["limit_bytes"]
    assert adm["waited"] > 0 and adm["held_bytes"] == 0 and adm["timeouts"] == 0
