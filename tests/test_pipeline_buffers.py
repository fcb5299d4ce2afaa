"""Pipeline buffers: inbound priority queue, outbound send loop, monitor (pure, no network).

Threads are synchronised with events and joins under timeouts, never with sleeps; wait
times are measured on an injected fake clock. Async scenarios run with ``asyncio.run``
under an overall deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from swarmtrain.errors import SwarmError
from swarmtrain.roles.stage import (
    ActivationBuffer,
    BufferClosed,
    BufferMonitor,
    OutboundBuffer,
    Priority,
    WorkPacket,
)

pytestmark = pytest.mark.timeout(60)

TENSOR = torch.zeros(2)
JOIN = 10.0  # seconds: generous bound for a thread that should finish promptly


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def packet(
    priority: Priority = Priority.TRAINING_FORWARD,
    microbatch_id: int = 0,
    source: str = "node-a",
    direction: str = "forward",
) -> WorkPacket:
    grad = torch.ones(2) if direction == "backward" else None
    return WorkPacket(
        priority=priority,
        session_id="s1",
        microbatch_id=microbatch_id,
        tensor=TENSOR,
        source=source,
        target_layer=3,
        direction=direction,  # type: ignore[arg-type]
        grad=grad,
    )


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
    """Run one scenario on a fresh event loop, under an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def start_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def ids(packets: list[WorkPacket | None]) -> list[int]:
    return [p.microbatch_id for p in packets if p is not None]


# --- WorkPacket ------------------------------------------------------------------------


def test_packet_validation() -> None:
    with pytest.raises(ValueError, match="direction"):
        packet(direction="sideways")
    with pytest.raises(ValueError, match="backward WorkPacket needs grad"):
        WorkPacket(Priority.TRAINING_BACKWARD, "s", 0, TENSOR, "n", 0, "backward")
    with pytest.raises(ValueError, match="forward WorkPacket must not carry grad"):
        WorkPacket(Priority.TRAINING_FORWARD, "s", 0, TENSOR, "n", 0, "forward", grad=TENSOR)
    with pytest.raises(ValueError, match=">= 0"):
        packet(microbatch_id=-1)
    with pytest.raises(ValueError):
        packet(priority=5)  # type: ignore[arg-type]
    coerced = packet(priority=30, direction="backward")  # type: ignore[arg-type]
    assert coerced.priority is Priority.TRAINING_BACKWARD
    assert coerced.enqueued_at is None


# --- ActivationBuffer: ordering, bounds, blocking ----------------------------------------


def test_priority_order_and_fifo_within_a_priority() -> None:
    buf = ActivationBuffer(capacity=10)
    order = [
        (Priority.TRAINING_FORWARD, 0),
        (Priority.GRADIENT_SYNC, 1),
        (Priority.INFERENCE_URGENT, 2),
        (Priority.TRAINING_FORWARD, 3),
        (Priority.INFERENCE_NORMAL, 4),
        (Priority.INFERENCE_URGENT, 5),
        (Priority.TRAINING_BACKWARD, 6),
        (Priority.TRAINING_FORWARD, 7),
    ]
    for prio, mb in order:
        direction = "backward" if prio == Priority.TRAINING_BACKWARD else "forward"
        assert buf.put(packet(prio, mb, direction=direction))
    peeked = buf.peek()
    assert peeked is not None and peeked.microbatch_id == 2
    assert len(buf) == 8  # peek leaves the packet in place
    got = [buf.get(timeout=1) for _ in order]
    assert ids(got) == [2, 5, 4, 0, 3, 7, 6, 1]


def test_capacity_bound_and_argument_checks() -> None:
    buf = ActivationBuffer(capacity=3)
    assert [buf.put_nowait(packet(microbatch_id=i)) for i in range(4)] == [True, True, True, False]
    assert len(buf) == 3 and buf.capacity == 3
    with pytest.raises(ValueError, match="capacity"):
        ActivationBuffer(capacity=0)
    with pytest.raises(ValueError, match="timeout"):
        buf.put(packet(), timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        buf.get(timeout=-0.5)


def test_put_times_out_when_full() -> None:
    buf = ActivationBuffer(capacity=1)
    assert buf.put(packet(microbatch_id=0))
    assert buf.put(packet(microbatch_id=1), timeout=0.05) is False
    assert len(buf) == 1
    assert buf.metrics().rejected == 1


def test_blocked_put_proceeds_when_a_consumer_gets() -> None:
    buf = ActivationBuffer(capacity=1)
    assert buf.put(packet(microbatch_id=0))
    result: list[bool] = []
    producer = start_thread(lambda: result.append(buf.put(packet(microbatch_id=1), timeout=JOIN)))
    producer.join(0.05)
    assert producer.is_alive() and result == []  # waiting for space
    first = buf.get(timeout=1)
    producer.join(JOIN)
    assert not producer.is_alive()
    assert result == [True]
    assert first is not None and first.microbatch_id == 0
    assert ids([buf.get_nowait()]) == [1]


def test_get_times_out_on_empty() -> None:
    buf = ActivationBuffer()
    assert buf.get(timeout=0.05) is None
    assert buf.get_nowait() is None
    assert buf.peek() is None
    assert buf.metrics().packets_out == 0


def test_nonblocking_put_and_get() -> None:
    buf = ActivationBuffer(capacity=2)
    assert buf.put_nowait(packet(Priority.GRADIENT_SYNC, 0))
    assert buf.put_nowait(packet(Priority.INFERENCE_NORMAL, 1))
    assert buf.put_nowait(packet(Priority.INFERENCE_URGENT, 2)) is False
    assert ids([buf.get_nowait(), buf.get_nowait(), buf.get_nowait()]) == [1, 0]
    m = buf.metrics()
    assert (m.packets_in, m.packets_out, m.rejected, m.dropped) == (2, 2, 1, 0)


def test_clear_counts_dropped_and_frees_space_for_a_waiting_producer() -> None:
    buf = ActivationBuffer(capacity=3)
    for i in range(3):
        buf.put(packet(Priority.INFERENCE_NORMAL, i))
    result: list[bool] = []
    producer = start_thread(lambda: result.append(buf.put(packet(microbatch_id=9), timeout=JOIN)))
    producer.join(0.05)
    assert producer.is_alive()
    assert buf.clear() == 3
    producer.join(JOIN)
    assert result == [True]
    m = buf.metrics()
    assert m.dropped == 3 and m.size == 1 and m.packets_in == 4 and m.packets_out == 0
    assert m.count_by_priority["INFERENCE_NORMAL"] == 0
    assert m.count_by_priority["TRAINING_FORWARD"] == 1


def test_close_wakes_waiters_and_drains() -> None:
    empty = ActivationBuffer(capacity=1)
    full = ActivationBuffer(capacity=1)
    full.put(packet(microbatch_id=0))
    got: list[WorkPacket | None] = []
    errors: list[BaseException] = []

    def blocked_put() -> None:
        try:
            full.put(packet(microbatch_id=1))  # no timeout: only close() can end this
        except BufferClosed as exc:
            errors.append(exc)

    consumer = start_thread(lambda: got.append(empty.get()))
    producer = start_thread(blocked_put)
    consumer.join(0.05)
    producer.join(0.05)
    assert consumer.is_alive() and producer.is_alive()
    empty.close()
    full.close()
    consumer.join(JOIN)
    producer.join(JOIN)
    assert not consumer.is_alive() and not producer.is_alive()
    assert got == [None]
    assert len(errors) == 1 and isinstance(errors[0], SwarmError)
    assert full.closed
    with pytest.raises(BufferClosed, match="closed"):
        full.put_nowait(packet())
    # What was queued before close is still handed out, then None without waiting.
    assert ids([full.get()]) == [0]
    assert full.get() is None
    full.close()  # closing twice is harmless


def test_many_producers_one_consumer_no_loss_no_duplicates() -> None:
    producers, per_producer = 8, 500
    priorities = [Priority.INFERENCE_NORMAL, Priority.TRAINING_FORWARD, Priority.GRADIENT_SYNC]
    buf = ActivationBuffer()  # capacity 100: producers keep running into the bound
    barrier = threading.Barrier(producers + 1, timeout=JOIN)
    failures: list[str] = []

    def produce(source: str) -> None:
        barrier.wait()
        for i in range(per_producer):
            if not buf.put(packet(priorities[i % 3], i, source=source), timeout=JOIN):
                failures.append(f"{source} put {i} timed out")

    threads = [start_thread(functools.partial(produce, f"p{k}")) for k in range(producers)]
    barrier.wait()
    got: list[WorkPacket] = []
    while len(got) < producers * per_producer:
        p = buf.get(timeout=JOIN)
        assert p is not None, f"consumer starved after {len(got)} packets"
        got.append(p)
    for t in threads:
        t.join(JOIN)
        assert not t.is_alive()
    assert failures == []
    assert buf.get_nowait() is None
    keys = [(p.source, p.microbatch_id) for p in got]
    assert len(set(keys)) == len(keys) == producers * per_producer
    for k in range(producers):
        for prio in priorities:
            seq = [p.microbatch_id for p in got if p.source == f"p{k}" and p.priority == prio]
            assert seq == sorted(seq) and len(seq) in (166, 167)
    m = buf.metrics()
    assert (m.packets_in, m.packets_out, m.size, m.dropped, m.rejected) == (4000, 4000, 0, 0, 0)


# --- ActivationBuffer: metrics against a hand-counted scenario ---------------------------


def test_metrics_hand_counted() -> None:
    clock = FakeClock()
    buf = ActivationBuffer(capacity=10, clock=clock)
    m = buf.metrics()
    assert (m.capacity, m.size, m.fill, m.starved, m.backpressured) == (10, 0, 0.0, True, False)
    assert (m.packets_in, m.packets_out, m.dropped, m.rejected, m.avg_wait_ms) == (0, 0, 0, 0, 0.0)
    assert m.count_by_priority == {p.name: 0 for p in Priority}

    forward = packet(Priority.TRAINING_FORWARD, 1)
    buf.put(forward)  # t=0
    clock.now = 1.0
    buf.put(packet(Priority.INFERENCE_URGENT, 2))
    clock.now = 2.0
    buf.put(packet(Priority.GRADIENT_SYNC, 3))
    m = buf.metrics()
    assert (m.size, m.fill, m.starved, m.backpressured, m.packets_in) == (3, 0.3, False, False, 3)
    assert m.count_by_priority == {
        "INFERENCE_URGENT": 1,
        "INFERENCE_NORMAL": 0,
        "TRAINING_FORWARD": 1,
        "TRAINING_BACKWARD": 0,
        "GRADIENT_SYNC": 1,
    }

    clock.now = 5.0
    urgent = buf.get()  # waited 5 - 1 = 4 s
    clock.now = 6.0
    first = buf.get_nowait()  # waited 6 - 0 = 6 s
    assert urgent is not None and urgent.microbatch_id == 2 and urgent.enqueued_at == 1.0
    assert first is not None and first.microbatch_id == 1 and first.enqueued_at == 0.0
    assert forward.enqueued_at is None  # the caller's packet is not modified
    m = buf.metrics()
    assert (m.size, m.packets_out, m.avg_wait_ms) == (1, 2, 5000.0)
    assert (m.fill, m.starved) == (0.1, False)  # exactly 10 % is not starved

    for i in range(8):
        assert buf.put_nowait(packet(Priority.TRAINING_FORWARD, 10 + i))
    m = buf.metrics()
    assert (m.size, m.fill, m.backpressured) == (9, 0.9, True)  # exactly 90 % is backpressured
    assert m.count_by_priority["TRAINING_FORWARD"] == 8 and m.count_by_priority["GRADIENT_SYNC"] == 1
    assert buf.put_nowait(packet(microbatch_id=20))
    assert buf.put_nowait(packet(microbatch_id=21)) is False
    assert buf.put(packet(microbatch_id=22), timeout=0) is False
    assert buf.clear() == 10

    m = buf.metrics()
    assert (m.size, m.fill, m.starved, m.backpressured) == (0, 0.0, True, False)
    assert (m.packets_in, m.packets_out, m.dropped, m.rejected) == (12, 2, 10, 2)
    assert m.avg_wait_ms == 5000.0  # cleared packets do not count towards the wait
    assert m.count_by_priority == {p.name: 0 for p in Priority}


#: one operation on a buffer: put (a packet of this priority), get, peek or clear
_OPS = hs.one_of(hs.sampled_from(list(Priority)).map(lambda p: ("put", p)),
                 hs.sampled_from([("get", None), ("peek", None), ("clear", None)]))


@settings(max_examples=300, deadline=None)
@given(capacity=hs.integers(1, 8), ops=hs.lists(_OPS, max_size=60))
def test_counts_by_priority_are_what_is_queued_after_any_puts_and_gets(
        capacity: int, ops: list[tuple[str, Priority | None]]) -> None:
    """Against a plain model (one list per priority): every get returns the oldest packet of
    the most urgent priority queued, and the size, the counts by priority and the counters
    are what the model holds after every operation."""
    buf = ActivationBuffer(capacity=capacity, clock=FakeClock())
    model: dict[Priority, list[int]] = {p: [] for p in Priority}
    n_in = n_out = dropped = rejected = 0
    for i, (op, priority) in enumerate(ops):
        queued = sum(map(len, model.values()))
        urgent = next((model[p] for p in sorted(Priority) if model[p]), None)
        if op == "put":
            assert priority is not None
            accepted = buf.put_nowait(packet(priority, i))
            assert accepted == (queued < capacity)
            if accepted:
                model[priority].append(i)
                n_in += 1
            else:
                rejected += 1
        elif op == "get":
            got = buf.get_nowait()
            assert (got.microbatch_id if got else None) == (urgent.pop(0) if urgent else None)
            n_out += got is not None
        elif op == "peek":
            seen = buf.peek()
            assert (seen.microbatch_id if seen else None) == (urgent[0] if urgent else None)
        else:
            assert buf.clear() == queued
            dropped += queued
            model = {p: [] for p in Priority}
        m = buf.metrics()
        assert m.count_by_priority == {p.name: len(model[p]) for p in Priority}
        assert m.size == len(buf) == sum(map(len, model.values()))
        assert (m.packets_in, m.packets_out, m.dropped, m.rejected) == (n_in, n_out, dropped, rejected)


# --- OutboundBuffer -----------------------------------------------------------------------


class Router:
    """Records sends; can block on an event and fail given packets a number of times."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.attempts: dict[int, int] = {}
        self.fail_times: dict[int, int] = {}
        self.gate: asyncio.Event | None = None

    async def send(self, p: WorkPacket) -> None:
        self.attempts[p.microbatch_id] = self.attempts.get(p.microbatch_id, 0) + 1
        if self.gate is not None:
            await self.gate.wait()
        if self.attempts[p.microbatch_id] <= self.fail_times.get(p.microbatch_id, 0):
            raise ConnectionError(f"replica down for {p.microbatch_id}")
        self.sent.append(p.microbatch_id)


def test_outbound_sends_in_order_from_any_thread() -> None:
    async def scenario() -> None:
        router = Router()
        out = OutboundBuffer(router.send, capacity=50)
        assert out.offer(packet(microbatch_id=0)) == "ok"  # before start: sent once started
        await out.start()
        with pytest.raises(RuntimeError, match="already started"):
            await out.start()
        await asyncio.to_thread(lambda: [out.offer(packet(microbatch_id=i)) for i in range(1, 21)])
        for i in range(21, 30):
            out.offer(packet(microbatch_id=i))
        assert await out.flush(timeout=10)
        assert router.sent == list(range(30))
        m = out.metrics()
        assert (m.sent, m.failed, m.retries, m.refused, m.size, m.fill) == (30, 0, 0, 0, 0, 0.0)
        assert (m.capacity, m.pressure) == (50, "ok")
        assert await out.close() == []

    run(scenario())


def test_outbound_retries_then_succeeds() -> None:
    async def scenario() -> None:
        router = Router()
        router.fail_times = {1: 2}
        out = OutboundBuffer(router.send, max_retries=3, retry_delay=0.001)
        await out.start()
        for i in range(3):
            out.offer(packet(microbatch_id=i))
        assert await out.flush(timeout=10)
        assert router.sent == [0, 1, 2]
        assert router.attempts == {0: 1, 1: 3, 2: 1}
        m = out.metrics()
        assert (m.sent, m.retries, m.failed) == (3, 2, 0)
        await out.close()

    run(scenario())


def test_outbound_gives_up_after_max_retries_and_hands_packet_back() -> None:
    async def scenario() -> None:
        router = Router()
        router.fail_times = {1: 100}
        failed: list[WorkPacket] = []
        out = OutboundBuffer(router.send, max_retries=3, retry_delay=0.001, on_failed=failed.append)
        await out.start()
        offered = [packet(microbatch_id=i) for i in range(3)]
        for p in offered:
            out.offer(p)
        assert await out.flush(timeout=10)
        assert router.sent == [0, 2]
        assert router.attempts[1] == 4  # the first attempt and 3 retries
        assert failed == [offered[1]]
        m = out.metrics()
        assert (m.sent, m.retries, m.failed, m.size) == (2, 3, 1, 0)
        await out.close()

    run(scenario())


def test_outbound_failure_without_callback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        router = Router()
        router.fail_times = {0: 100}
        out = OutboundBuffer(router.send, max_retries=0)
        await out.start()
        out.offer(packet(microbatch_id=0))
        assert await out.flush(timeout=10)
        assert out.metrics().failed == 1
        await out.close()

    with caplog.at_level(logging.ERROR, logger="swarmtrain.roles.stage"):
        run(scenario())
    assert any("gave up sending s1/0" in r.getMessage() for r in caplog.records)


def test_outbound_pressure_levels_and_refusal_when_full() -> None:
    async def scenario() -> None:
        router = Router()
        router.gate = asyncio.Event()
        out = OutboundBuffer(router.send, capacity=100)
        await out.start()
        results = [out.offer(packet(microbatch_id=i)) for i in range(100)]
        assert results[:89] == ["ok"] * 89
        assert results[89:98] == ["soft_overflow"] * 9  # 90..98 packets held
        assert results[98:] == ["hard_overflow"] * 2  # 99 and 100 packets held
        assert out.pressure() == "hard_overflow"
        assert out.offer(packet(microbatch_id=100)) == "refused"
        m = out.metrics()
        assert (m.size, m.fill, m.pressure, m.refused, m.sent) == (100, 1.0, "hard_overflow", 1, 0)
        router.gate.set()
        assert await out.flush(timeout=10)
        assert router.sent == list(range(100))
        assert out.pressure() == "ok"
        await out.close()

    run(scenario())


def test_outbound_flush_true_and_false() -> None:
    async def scenario() -> None:
        router = Router()
        router.gate = asyncio.Event()
        out = OutboundBuffer(router.send)
        assert await out.flush(timeout=0)  # empty: done at once
        await out.start()
        out.offer(packet(microbatch_id=0))
        assert await out.flush(timeout=0.05) is False
        assert len(out) == 1
        router.gate.set()
        assert await out.flush(timeout=10) is True
        with pytest.raises(ValueError, match="timeout"):
            await out.flush(timeout=-1)
        await out.close()

    run(scenario())


def test_outbound_close_hands_back_unsent_packets() -> None:
    async def scenario() -> None:
        router = Router()
        router.gate = asyncio.Event()
        out = OutboundBuffer(router.send)
        await out.start()
        for i in range(3):
            out.offer(packet(microbatch_id=i))
        leftovers = await out.close()
        assert ids(list(leftovers)) == [0, 1, 2]  # 0 was cut off mid-send
        assert len(out) == 0 and router.sent == []
        with pytest.raises(BufferClosed):
            out.offer(packet())
        with pytest.raises(BufferClosed):
            await out.start()
        assert await out.close() == []

    run(scenario())


def test_outbound_argument_checks() -> None:
    async def send(p: WorkPacket) -> None:
        return None

    for kwargs in ({"capacity": 0}, {"max_retries": -1}, {"retry_delay": -0.1}):
        with pytest.raises(ValueError):
            OutboundBuffer(send, **kwargs)


# --- BufferMonitor --------------------------------------------------------------------------


def test_monitor_history_is_bounded() -> None:
    clock = FakeClock()
    inbound = ActivationBuffer(capacity=10)
    monitor = BufferMonitor({"in": inbound}, interval=1.0, history_seconds=3.0, clock=clock)
    assert monitor.max_samples == 3
    assert BufferMonitor({"in": inbound}).max_samples == 720  # an hour at 5 s
    for t in range(5):
        clock.now = float(t)
        inbound.put_nowait(packet(microbatch_id=t))
        monitor.sample()
    history = monitor.history("in")
    assert [s.at for s in history] == [2.0, 3.0, 4.0]
    assert [s.size for s in history] == [3, 4, 5]
    with pytest.raises(KeyError, match="nope"):
        monitor.history("nope")


def test_monitor_warns_once_per_transition(caplog: pytest.LogCaptureFixture) -> None:
    inbound = ActivationBuffer(capacity=10)
    outbound = OutboundBuffer(Router().send, capacity=10)  # never started: it only fills
    monitor = BufferMonitor({"in": inbound, "out": outbound}, clock=FakeClock())

    def warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "swarmtrain.roles.stage"
        ]

    with caplog.at_level(logging.INFO, logger="swarmtrain.roles.stage"):
        monitor.sample()
        monitor.sample()
        assert warnings() == ["buffer 'in' is starved: 0/10 packets (0%)"]  # empty outbound is fine
        for i in range(9):
            inbound.put_nowait(packet(microbatch_id=i))
            outbound.offer(packet(microbatch_id=i))
        monitor.sample()
        monitor.sample()
        assert warnings()[1:] == [
            "buffer 'in' is overflowing: 9/10 packets (90%)",
            "buffer 'out' is overflowing: 9/10 packets (90%)",
        ]
        assert any("'in' is no longer starved" in r.getMessage() for r in caplog.records)
        inbound.clear()
        monitor.sample()
        monitor.sample()
        assert warnings()[3:] == ["buffer 'in' is starved: 0/10 packets (0%)"]
    assert any("'in' is no longer overflowing" in r.getMessage() for r in caplog.records)


def test_monitor_summary() -> None:
    inbound = ActivationBuffer(capacity=10)
    outbound = OutboundBuffer(Router().send, capacity=10)
    monitor = BufferMonitor({"in": inbound, "out": outbound}, clock=FakeClock())
    empty = monitor.summary()["in"]
    assert (empty.samples, empty.mean_fill, empty.max_size) == (0, 0.0, 0)
    mb = iter(range(100))
    for in_size, out_size in [(0, 0), (5, 0), (9, 9), (10, 9)]:
        while len(inbound) < in_size:
            inbound.put_nowait(packet(microbatch_id=next(mb)))
        while len(outbound) < out_size:
            outbound.offer(packet(microbatch_id=next(mb)))
        monitor.sample()
    s = monitor.summary()
    assert s["in"].samples == 4
    assert s["in"].mean_fill == pytest.approx((0 + 0.5 + 0.9 + 1.0) / 4)
    assert (s["in"].starved_fraction, s["in"].backpressured_fraction, s["in"].max_size) == (0.25, 0.5, 10)
    assert s["out"].mean_fill == pytest.approx(0.45)
    assert (s["out"].starved_fraction, s["out"].backpressured_fraction, s["out"].max_size) == (0.0, 0.5, 9)


def test_monitor_thread_samples_until_stopped() -> None:
    calls = 0
    three_samples = threading.Event()

    def clock() -> float:
        nonlocal calls
        calls += 1
        if calls >= 3:
            three_samples.set()
        return float(calls)

    monitor = BufferMonitor({"in": ActivationBuffer()}, interval=0.01, clock=clock)
    monitor.stop()  # not running: harmless
    monitor.start()
    with pytest.raises(RuntimeError, match="already running"):
        monitor.start()
    assert three_samples.wait(JOIN)
    monitor.stop(timeout=JOIN)
    taken = len(monitor.history("in"))
    assert taken >= 3
    assert monitor.summary()["in"].samples == taken
    with pytest.raises(ValueError, match="interval"):
        BufferMonitor({"in": ActivationBuffer()}, interval=0)
    with pytest.raises(ValueError, match="history_seconds"):
        BufferMonitor({"in": ActivationBuffer()}, interval=10, history_seconds=5)
    with pytest.raises(ValueError, match="at least one"):
        BufferMonitor({})
