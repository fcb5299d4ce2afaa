"""Coordinator and workers in one process over loopback TCP: behaviours that need a live
coordinator but not separate processes."""

from __future__ import annotations

import asyncio
import logging
import platform
import socket
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from swarmtrain.config import load_coordinator_config, load_worker_config
from swarmtrain.core import hardware
from swarmtrain.errors import ConfigError, RefusedError
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.worker import Worker, WorkerState
from swarmtrain.tasks import DigitsTask
from swarmtrain.testing.turns import ComputeTurns
from swarmtrain.transport import auth
from swarmtrain.wire import (
    PREAMBLE,
    Auth,
    Challenge,
    Decoder,
    Error,
    Hello,
    Welcome,
    encode_bytes,
)
from swarmtrain.wire.frame import PROTOCOL_VERSION

TASK = DigitsTask()
DATA = TASK.load_data()
SECRET = b"inproc-secret"


def coordinator(**over: Any) -> Coordinator:
    cfg = load_coordinator_config(overrides={
        "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
        "training.learning_rate": 3e-3, "training.eval_interval_sec": 0.5, **over})
    return Coordinator(TASK.build_model(), cfg, evaluate=lambda m: TASK.evaluate(m, DATA),
                       task_name="digits", secret=SECRET)


def worker(port: int, model: nn.Module | None = None, loss_fn: Callable[[nn.Module, Any], Any] | None = None,
           **over: Any) -> Worker:
    cfg = load_worker_config(overrides={
        "network.coordinator_port": port, "hardware.num_threads": 1, "training.batch_size": 32,
        "network.reconnect_attempts": 0, "training.probe_seconds": 0.2,
        "training.accumulation_steps": 1, **over})
    return Worker(model or TASK.build_model(), loss_fn or TASK.loss, DATA.train, cfg, task_name="digits",
                  secret=SECRET)


async def pause_and_settle(coord: Coordinator, workers: list[Worker], timeout: float = 30.0) -> None:
    """Pause the cluster and return once nothing moves: every worker paused, every gradient
    it sent answered (the coordinator's apply, publication included, is done), every answer
    applied by its worker, and the version the same at two looks 0.2 s apart. Pausing alone
    is not enough: a gradient in flight, or one whose computation started before the pause,
    is still applied afterwards, and its publication rewrites the published weights in place.
    """
    await coord.set_paused(True)

    def quiet() -> bool:
        return all(w.lifecycle is WorkerState.PAUSED and not w._sent_at
                   and sum(w.statuses.values()) == coord.workers[w.worker_id].updates for w in workers)

    async with asyncio.timeout(timeout):
        while True:
            version = coord.version
            if quiet():
                await asyncio.sleep(0.2)
                if quiet() and coord.version == version:
                    return
            await asyncio.sleep(0.05)


async def _run(coord: Coordinator, workers: list[Worker], timeout: float) -> None:
    await coord.start()
    try:
        tasks = [asyncio.create_task(w.run_async()) for w in workers]
        await asyncio.wait_for(coord.run(), timeout)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await coord.close()


def test_slow_worker_does_not_hold_back_the_fast_one() -> None:
    async def main() -> tuple[Worker, Worker, Coordinator]:
        c = coordinator(**{"training.min_workers": 2, "training.max_steps": 150})
        await c.start()
        # The slow worker's step costs ten compute turns to the fast one's one (a virtual
        # clock: a wall-clock throttle's ratio shrinks with the machine's load)
        turns = ComputeTurns(["fast", "slow"], done=lambda: c.version >= 150)
        fast = worker(c.port, loss_fn=turns.loss("fast", 1, TASK.loss),
                      **{"training.worker_id": "fast", "training.probe_seconds": 0.0})
        slow = worker(c.port, loss_fn=turns.loss("slow", 10, TASK.loss),
                      **{"training.worker_id": "slow", "training.probe_seconds": 0.0})
        tasks = [asyncio.create_task(w.run_async()) for w in (fast, slow)]
        await asyncio.wait_for(c.run(), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return fast, slow, c

    fast, slow, c = asyncio.run(main())
    # Synchronous data parallelism would hold both to the same count (ratio 1); the slow
    # worker runs at a tenth of its speed, so anything near 10 shows nobody waits for it.
    assert fast.steps + slow.steps >= 150
    assert fast.steps >= 3 * slow.steps, (fast.steps, slow.steps)
    recs = c.workers
    assert recs["fast"].steps >= 3 * recs["slow"].steps  # and the coordinator applied them


def test_worker_with_a_different_model_is_refused_naming_the_difference() -> None:
    other = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 10))

    async def main() -> None:
        c = coordinator()
        await c.start()
        try:
            with pytest.raises(RefusedError) as info:
                await asyncio.wait_for(worker(c.port, model=other).run_async(), 30)
            assert info.value.code == "model_mismatch"
            assert "parameter #0" in str(info.value) and "'0.weight'" in str(info.value)
            assert "[128, 64]" in str(info.value) and "[100, 64]" in str(info.value)
            assert not c.workers  # never registered
        finally:
            await c.close()

    asyncio.run(main())


def test_compression_mismatch_is_reported_at_registration() -> None:
    async def main() -> None:
        c = coordinator()
        await c.start()
        try:
            with pytest.raises(RefusedError, match="compression mismatch"):
                await asyncio.wait_for(worker(c.port, **{"compression.type": "fp16"}).run_async(), 30)
        finally:
            await c.close()

    asyncio.run(main())


def _raw_session(port: int) -> socket.socket:
    """An authenticated raw socket (handshake done by hand), for sending arbitrary bytes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    nc = auth.new_nonce()
    s.sendall(encode_bytes(Hello(role="worker", nonce=nc)))
    ch = _read_msg(s)
    assert isinstance(ch, Challenge)
    s.sendall(encode_bytes(Auth(proof=auth.client_proof(SECRET, auth.Transcript("worker", nc, ch.nonce)))))
    assert isinstance(_read_msg(s), Welcome)
    return s


def _read_msg(s: socket.socket) -> Any:
    d = Decoder()
    while True:
        msg = d.next_message()
        if msg is not None and msg.TYPE.name != "HEARTBEAT":
            return msg
        if msg is None:
            chunk = s.recv(65536)
            if not chunk:
                return None
            d.feed(chunk)


def _frame(mtype: int, header: bytes, payload: bytes = b"", *, magic: bytes = b"SWRM",
           version: int = PROTOCOL_VERSION,
           flags: int = 0, plen: int | None = None) -> bytes:
    return PREAMBLE.pack(magic, version, mtype, flags, len(header),
                         len(payload) if plen is None else plen) + header + payload


def _hdr(fields: dict[str, Any], tensors: list[Any] | None = None) -> bytes:
    return msgpack.packb({"f": fields, "t": tensors or []}, use_bin_type=True)


GRAD = 13
MALFORMED = {
    "bad_magic": _frame(GRAD, _hdr({}), magic=b"XXXX"),
    "unsupported_version": _frame(GRAD, _hdr({}), version=9),
    "unknown_type": _frame(99, _hdr({})),
    "bad_flags": _frame(GRAD, _hdr({}), flags=4),
    "oversize_header": PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION, GRAD, 0, 1 << 30, 0),
    "oversize_payload": PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION, GRAD, 0, 10, 1 << 40),
    "bad_header": _frame(GRAD, b"\xc1\xc1\xc1"),
    "descriptor_out_of_range": _frame(GRAD, _hdr(
        {"msg_id": 1, "version": 0, "samples": 1, "loss": 0.0, "codecs": {}},
        [["x", "float32", [100], 0, 400]]), b"\0" * 64),
    "bad_dtype": _frame(GRAD, _hdr(
        {"msg_id": 1, "version": 0, "samples": 1, "loss": 0.0, "codecs": {}},
        [["x", "complex64", [1], 0, 8]]), b"\0" * 64),
    "missing_field": _frame(GRAD, _hdr({"msg_id": 1})),
}


def test_malformed_frames_get_their_own_error_and_others_keep_training(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="swarmtrain.transport")

    async def main() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        good = worker(c.port, **{"training.worker_id": "good"})
        task = asyncio.create_task(good.run_async())
        try:
            loop = asyncio.get_running_loop()
            for code, frame in MALFORMED.items():
                before = c.version

                def attack(frame: bytes = frame) -> Any:
                    s = _raw_session(c.port)
                    try:
                        s.sendall(frame)
                        return _read_msg(s)
                    finally:
                        s.close()

                reply = await loop.run_in_executor(None, attack)
                assert isinstance(reply, Error), (code, reply)
                assert reply.code == code, (code, reply)
                for _ in range(200):  # the legitimate worker keeps training meanwhile
                    if c.version > before:
                        break
                    await asyncio.sleep(0.05)
                assert c.version > before, f"training stalled after {code}"
            truncated = _frame(GRAD, _hdr({"msg_id": 1}))[:-3]
            s = await loop.run_in_executor(None, _raw_session, c.port)
            s.sendall(truncated)
            s.close()
            before = c.version
            for _ in range(200):
                if c.version > before + 5:
                    break
                await asyncio.sleep(0.05)
            assert c.version > before + 5
            assert c.workers["good"].rejected == 0
            # the cut frame was named as such (its own code), not as a plain disconnect
            assert any("closed mid-frame" in r.getMessage() and "GRADIENTS frame" in r.getMessage()
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
        finally:
            good.stop()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
            await c.close()

    asyncio.run(main())


def test_nan_gradient_is_rejected_and_weights_do_not_change() -> None:
    class NaNLoss:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
            self.calls += 1
            return TASK.loss(model, batch) * float("nan")

    async def main() -> tuple[Coordinator, dict[str, torch.Tensor]]:
        c = coordinator(**{"training.max_steps": 0})
        before = {n: p.detach().clone() for n, p in c.params.items()}
        await c.start()
        w = worker(c.port)
        w.loss_fn = NaNLoss()
        t = asyncio.create_task(w.run_async())
        for _ in range(400):
            if c.stats["rejected"] >= 5:
                break
            await asyncio.sleep(0.05)
        w.stop()
        await asyncio.wait_for(asyncio.gather(t, return_exceptions=True), 30)
        await c.close()
        return c, before

    c, before = asyncio.run(main())
    assert c.stats["rejected"] >= 5 and c.stats["applied"] == 0
    assert all(torch.equal(before[n], p) for n, p in c.params.items())


def test_python_api_keywords_map_to_config_keys() -> None:
    c = Coordinator(TASK.build_model(), port=0, min_workers=3, host="127.0.0.1", secret=SECRET,
                    learning_rate=1e-3)
    assert c.config.network.port == 0 and c.config.training.min_workers == 3
    with pytest.raises(ConfigError, match="prot"):
        Coordinator(TASK.build_model(), prot=1, learning_rate=1e-3)
    with pytest.raises(ConfigError, match="pass learning_rate"):
        Coordinator(TASK.build_model())  # 0 = "the task's default", and there is no task here
    w = Worker(TASK.build_model(), TASK.loss, DATA.train, host="10.0.0.9", port=7200, secret=SECRET)
    assert (w.config.network.coordinator_host, w.config.network.coordinator_port) == ("10.0.0.9", 7200)


@pytest.mark.parametrize("inflight", [0, 1, 3])
def test_gradients_carry_the_version_they_were_computed_on(inflight: int) -> None:
    """One worker: waiting for each answer gives staleness 0. With gradients allowed in
    flight, the worker waits for the first answer (to measure the round trip), then overlaps,
    because a digits step here is far shorter than a round trip: with one in flight every
    later gradient is exactly one update behind; with k in flight, at most k (answers that
    already arrived are applied before sending)."""

    async def main() -> tuple[Coordinator, Worker]:
        c = coordinator(**{"training.max_steps": 60, "training.max_staleness": 16})
        await c.start()
        w = worker(c.port, **{"training.max_inflight": inflight, "training.worker_id": "one"})
        t = asyncio.create_task(w.run_async())
        await asyncio.wait_for(c.run(), 60)
        await asyncio.wait_for(t, 30)
        return c, w

    c, w = asyncio.run(main())
    rec = c.workers["one"]
    if inflight == 0:
        assert rec.staleness_total == 0
        return
    assert w.overlaps(), w.status()
    most = sum(min(i - 1, inflight) for i in range(1, rec.steps))  # the first waited
    if inflight == 1:
        assert rec.staleness_total == most == rec.steps - 2, (rec.staleness_total, most, rec.steps)
    else:
        assert rec.steps - 2 <= rec.staleness_total <= most, (rec.staleness_total, most, rec.steps)


@pytest.mark.parametrize("inline_below", [1.0, 0.0])
def test_quick_applies_run_on_the_event_loop_and_slow_ones_on_the_apply_thread(
        inline_below: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model's apply (well under a millisecond) once always went to the apply thread and
    back, which cost more than the apply; now, once its time is known, it runs on the event loop
    (the thread is kept for slow applies: here "slow" is anything, with the limit at 0). The
    run trains the same either way, and the status says where the applies ran."""
    from swarmtrain.roles.ps import coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "INLINE_APPLY_SEC", inline_below)
    c = coordinator(**{"training.max_steps": 60})

    async def main() -> None:
        await c.start()
        try:
            task = asyncio.create_task(worker(c.port).run_async())
            await asyncio.wait_for(c.run(), 60)
            await asyncio.wait_for(task, 30)
        finally:
            await c.close()

    asyncio.run(main())
    apply = c.status()["apply"]
    assert c.version == 60 and apply["mean_ms"] > 0
    assert apply["inline"] + apply["threaded"] >= 60  # every gradient's apply (and answer) ran
    if inline_below:
        assert apply["threaded"] <= 2 and apply["inline"] >= 55, apply  # the first one is timed
    else:
        assert apply["inline"] == 0, apply


@pytest.mark.parametrize("inline_below", [1.0, 0.0])
def test_a_worker_on_its_own_loop_computes_quick_steps_on_it(
        inline_below: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker.run() (the CLI's way: an event loop of its own) computes quick steps (here: all,
    with the limit at 1 s, as three actors in one process share one interpreter lock; or none,
    at 0) on that loop instead of handing each to the compute thread; run_async() in the
    caller's loop never does (it must not block what else runs there). Both train. (This is
    the path through the loop, ``direct_io`` off: with it on, quick steps train on the socket
    lent to the compute thread instead, tests/test_direct.py.)"""
    import threading

    from swarmtrain.roles.ps import worker as worker_module

    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SEC", inline_below)
    c = coordinator(**{"training.max_steps": 80})
    own: list[Worker] = []

    async def main() -> Worker:
        await c.start()
        try:
            loop_path = {"training.max_inflight": 1, "network.direct_io": False}
            own.append(worker(c.port, **{"training.worker_id": "own", **loop_path}))
            thread = threading.Thread(target=own[0].run, daemon=True)
            thread.start()
            embedded = worker(c.port, **{"training.worker_id": "embedded", **loop_path})
            task = asyncio.create_task(embedded.run_async())
            await asyncio.wait_for(c.run(), 60)
            await asyncio.wait_for(task, 30)
            await asyncio.wait_for(asyncio.to_thread(thread.join, 30), 35)
            assert not thread.is_alive()
            return embedded
        finally:
            await c.close()

    embedded = asyncio.run(main())
    assert embedded.inline_computes == 0 and embedded.steps > 0 and own[0].steps > 0
    if inline_below:  # all but the first (timed on the thread)
        assert own[0].inline_computes >= own[0].steps - 2, (own[0].inline_computes, own[0].steps)
    else:
        assert own[0].inline_computes == 0


def test_each_step_starts_from_no_gradient_and_a_models_own_zero_grad_is_called() -> None:
    """A step's gradient is its batch's alone (the worker clears the parameters' gradients
    without walking the module tree), and a model that defines its own ``zero_grad`` gets it
    called every step."""

    class Counting(nn.Sequential):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            type(self).calls += 1
            super().zero_grad(set_to_none)

    stale, fresh = worker(1, **{"training.worker_id": "same"}), worker(1, **{"training.worker_id": "same"})
    for w in (stale, fresh):
        w._use_shards([0], 1)
    for p in stale.params.values():
        p.grad = torch.full_like(p, 1e6)  # left over from somewhere: must not be added to
    # the same weights, the same seed, the same first batch
    got, want = (w._compute()[0]["*"].parts["values"] for w in (stale, fresh))
    assert torch.equal(got, want) and float(got.abs().max()) < 1e3
    own = worker(1, model=Counting(*TASK.build_model()))
    own._use_shards([0], 1)
    own._compute()
    own._compute()
    assert Counting.calls == 2


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_coordinator_gives_memory_freed_by_a_burst_back_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the wiring of FreedMemory (tests/test_hardware.py): a running coordinator releases what
    # a burst left resident within its check interval, and its status counts it
    monkeypatch.setattr(Coordinator, "MEMORY_CHECK_INTERVAL_SEC", 0.2)
    hardware.tune_allocator()  # (as every swarmtrain command does: 8 MB buffers in malloc's heap)

    # memory freed before the coordinator exists (as earlier tests leave it in this process,
    # which made this test fail on the clean-clone CI: malloc held 626 MB free, resident)
    earlier = [torch.ones(2 << 20) for _ in range(70)]
    pin = torch.ones(2 << 20)  # (the 560 MB below it stay in malloc's heap, one free chunk)
    del earlier

    async def main() -> dict[str, Any]:
        c = coordinator()
        await c.start()
        try:
            await asyncio.sleep(0.5)
            assert c.status()["memory"]["releases"] == 0  # (nothing to give back yet)
            burst = [torch.ones(2 << 20) for _ in range(60)]  # 60 buffers of 8 MB
            del burst[::2]  # 240 MB freed between buffers still in use
            deadline = time.monotonic() + 20
            while c.status()["memory"]["releases"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            del burst
            return c.status()["memory"]
        finally:
            await c.close()

    memory = asyncio.run(main())
    del pin
    assert memory["releases"] >= 1 and memory["released_mb"] > 200, memory
    assert memory["allocator_free_mb"] is not None
