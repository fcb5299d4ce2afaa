"""Gradients a coordinator must refuse (issue 8): NaN, Inf, wrong shapes and dtypes, absurd
norms, oversize payloads. Each is refused and counted against its sender, the master weights
stay bit-for-bit the same, and a sender that keeps sending bad data is disconnected."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from swarmtrain.compression import Compressed
from swarmtrain.roles.ps.common import pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.transport import Connection, connect
from swarmtrain.wire import Error, Gradients, Register, RegisterAck, Update, Weights
from tests.test_ps_inprocess import SECRET, coordinator, worker

pytestmark = pytest.mark.timeout(120)


def _none(t: torch.Tensor, dtype: str = "float32") -> Compressed:
    return Compressed("none", tuple(t.shape), dtype, {"values": t.reshape(-1).contiguous()})


def _grads(c: Coordinator, fill: float = 1e-3) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p, fill) for n, p in c.params.items()}


async def _register(c: Coordinator, worker_id: str) -> Connection:
    conn = await connect("127.0.0.1", c.port, secret=SECRET, role="worker")
    await conn.send(Register(
        worker_id=worker_id, task="digits", fingerprint=c.state.fingerprint(), hardware={},
        batch_size=32, accumulation_steps=1, shard_index=-1,
        compression={"type": "none"}, samples_per_sec=0.0))
    assert isinstance(await conn.recv(timeout=10), RegisterAck)
    assert isinstance(await conn.recv(timeout=10), Weights)
    return conn


async def _send(conn: Connection, msg_id: int, grads: dict[str, Compressed], version: int,
                samples: int = 32, loss: float = 1.0) -> Any:
    codecs, tensors = pack_compressed(grads)
    await conn.send(Gradients(msg_id=msg_id, version=version, samples=samples, loss=loss,
                              codecs=codecs, tensors=tensors))
    while True:
        answer = await conn.recv(timeout=10)
        if isinstance(answer, Update | Error):
            return answer


def _master(c: Coordinator) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in c.params.items()}


def test_bad_gradients_are_refused_counted_and_leave_the_weights_untouched() -> None:
    async def main() -> None:
        c = coordinator(**{"training.min_workers": 1, "training.max_bad_in_row": 100})
        await c.start()
        conn = await _register(c, "mallory")
        try:
            before, version = _master(c), c.version
            good = _grads(c)
            name = next(iter(good))
            bad: dict[str, dict[str, Compressed]] = {
                "nan": {n: _none(g.fill_(float("nan")) if n == name else g) for n, g in _grads(c).items()},
                "inf": {n: _none(g.fill_(float("inf")) if n == name else g) for n, g in _grads(c).items()},
                "shape": {n: _none(torch.zeros(3, 3) if n == name else g) for n, g in good.items()},
                # (a parameter left out is legal: it got no gradient and is not stepped)
                "unknown": {**{n: _none(g) for n, g in good.items()}, "no.such": _none(torch.zeros(3))},
                "dtype": {n: _none(g.double(), "float64") if n == name else _none(g)
                          for n, g in good.items()},
            }
            for i, (kind, grads) in enumerate(bad.items(), start=1):
                answer = await _send(conn, i, grads, c.version)
                assert isinstance(answer, Update) and answer.status == "rejected", (kind, answer)
            no_samples = await _send(conn, 10, {n: _none(g) for n, g in good.items()}, c.version, samples=0)
            nan_loss = await _send(conn, 11, {n: _none(g) for n, g in good.items()}, c.version,
                                   loss=float("nan"))
            assert no_samples.status == nan_loss.status == "rejected"
            assert c.version == version and c.stats["applied"] == 0
            assert all(torch.equal(before[n], p) for n, p in c.params.items())  # bit for bit
            rec = c.workers["mallory"]
            assert rec.rejected == len(bad) + 2 == c.stats["rejected"]
            row = next(w for w in c.status()["workers"] if w["id"] == "mallory")
            assert row["rejected"] == rec.rejected and "finite loss" in row["last_refusal"]
            # and a good one from the same sender still counts
            ok = await _send(conn, 12, {n: _none(g) for n, g in good.items()}, c.version)
            assert ok.status == "applied" and c.version == version + 1 and rec.bad_in_row == 0
        finally:
            await conn.close()
            await c.close()

    asyncio.run(main())


@pytest.mark.parametrize("action", ["clip", "reject"])
def test_an_absolute_norm_limit_clips_or_rejects(action: str) -> None:
    async def main() -> None:
        c = coordinator(**{"training.min_workers": 1, "training.max_grad_norm": 1.0,
                           "training.grad_norm_action": action})
        await c.start()
        conn = await _register(c, "big")
        try:
            before = _master(c)
            answer = await _send(conn, 1, {n: _none(g) for n, g in _grads(c, 10.0).items()}, c.version)
            if action == "reject":
                assert answer.status == "rejected" and "max_grad_norm" in c.workers["big"].last_refusal
                assert all(torch.equal(before[n], p) for n, p in c.params.items())
            else:
                assert answer.status == "applied" and c.version == 1
        finally:
            await conn.close()
            await c.close()

    asyncio.run(main())


def test_an_outlier_norm_is_clipped_once_the_usual_size_is_known() -> None:
    """Clipped, not refused: refusing is what let the old reference collapse over a long run
    (honest large norms never counted) and what disconnected honest workers."""
    async def main() -> None:
        c = coordinator(**{"training.min_workers": 1, "training.outlier_norm_factor": 100.0})
        await c.start()
        conn = await _register(c, "w")
        try:
            for i in range(1, 21):  # the usual size: norm of a 1e-3 fill
                assert (await _send(conn, i, {n: _none(g) for n, g in _grads(c).items()},
                                    c.version)).status == "applied"
            usual = c.screen.reference()
            assert usual > 0
            huge = await _send(conn, 21, {n: _none(g) for n, g in _grads(c, 1.0).items()}, c.version)
            assert huge.status == "applied" and c.workers["w"].clipped == 1 and c.screen.clipped == 1
            assert c.workers["w"].summary(1, 1)["clipped"] == 1
            # one outlier does not move the reference the next gradients are screened against
            assert c.screen.reference() == pytest.approx(usual, rel=0.05)
        finally:
            await conn.close()
            await c.close()

    asyncio.run(main())


def test_a_sender_that_keeps_sending_bad_gradients_is_disconnected_and_others_train_on() -> None:
    async def main() -> None:
        c = coordinator(**{"training.min_workers": 1, "training.max_bad_in_row": 3})
        await c.start()
        good = worker(c.port, **{"training.worker_id": "good"})
        task = asyncio.create_task(good.run_async())
        conn = await _register(c, "mallory")
        try:
            nan = {n: _none(torch.full_like(p, float("nan"))) for n, p in c.params.items()}
            for i in (1, 2):
                assert (await _send(conn, i, nan, c.version)).status == "rejected"
            last = await _send(conn, 3, nan, c.version)
            assert last.status == "rejected"
            final = await conn.recv(timeout=10)
            assert isinstance(final, Error) and final.code == "too_many_bad_gradients"
            assert "3 gradients in a row" in final.message
            await asyncio.wait_for(conn.wait_closed(), 10)
            assert any(e["event"] == "worker_refused" for e in c.status()["events"])
            before = c.version
            for _ in range(200):  # the legitimate worker is not affected
                if c.version > before + 3:
                    break
                await asyncio.sleep(0.05)
            assert c.version > before + 3
        finally:
            good.stop()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
            await conn.close()
            await c.close()

    asyncio.run(main())



def test_a_replayed_gradient_message_is_not_applied_twice() -> None:
    async def main() -> None:
        c = coordinator(**{"training.min_workers": 1})
        await c.start()
        conn = await _register(c, "w")
        try:
            grads = {n: _none(g) for n, g in _grads(c).items()}
            assert (await _send(conn, 7, grads, c.version)).status == "applied"
            after = _master(c)
            for msg_id in (7, 3):  # the same message again, and an older one
                again = await _send(conn, msg_id, grads, c.version)
                assert again.status == "duplicate"
            assert c.version == 1 and all(torch.equal(after[n], p) for n, p in c.params.items())
        finally:
            await conn.close()
            await c.close()

    asyncio.run(main())
