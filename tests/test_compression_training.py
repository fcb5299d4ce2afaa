"""Compression in the parameter server: uplink and downlink, warm-up, drift bound, metrics,
wire bytes against each codec's declared size, and accuracy with heavy compression."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from swarmtrain.compression import CODEC_NAMES, make_codec
from swarmtrain.config import CompressionConfig
from swarmtrain.errors import RefusedError
from swarmtrain.roles.ps.common import codec_for_step, pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.wire import ALIGN, PREAMBLE, Gradients, encode, encode_bytes
from tests.test_ps_inprocess import TASK, coordinator, pause_and_settle, worker


def _train(codec: dict[str, Any], steps: int, workers: int = 2,
           lr: float = 3e-3) -> tuple[Coordinator, list[Any]]:
    comp = {f"compression.{k}": v for k, v in codec.items()}

    async def main() -> tuple[Coordinator, list[Any]]:
        c = coordinator(**{"training.min_workers": workers, "training.max_steps": steps,
                           "training.learning_rate": lr, **comp})
        await c.start()
        ws = [worker(c.port, **{"training.worker_id": f"w{i}", **comp}) for i in range(workers)]
        tasks = [asyncio.create_task(w.run_async()) for w in ws]
        await asyncio.wait_for(c.run(), 150)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return c, ws

    return asyncio.run(main())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("codec", [
    {"type": "topk", "topk_ratio": 0.01, "warmup_steps": 100, "min_compress_numel": 0},
    {"type": "qsgd", "qsgd_bits": 4, "min_compress_numel": 0},
], ids=["topk-1%", "qsgd-4bit"])
def test_digits_reaches_095_with_heavy_compression(codec: dict[str, Any]) -> None:
    c, workers = _train(codec, steps=3000)  # async top-k 1 % needs the margin (0.94 at 2000 seen)
    reached = max([m["accuracy"] for _, m in c.metric_history] + [c.metrics["accuracy"]])
    assert reached >= 0.95, list(c.metric_history)[-5:]  # held-out accuracy reached 0.95
    st = c.status()
    for row in st["workers"]:
        assert row["up_ratio"] > (15 if codec["type"] == "topk" else 5), row  # really compressed
        assert row["down_ratio"] > 1.5, row  # the downlink too (resyncs included)
    if codec["type"] == "topk":
        assert all(w["residual_norm"] > 0 for w in st["workers"])  # error feedback at work


def test_worker_weights_stay_within_the_drift_bound() -> None:
    # A top-k downlink lags far behind (Adam's updates are dense), so the bound must act.
    comp = {"compression.type": "topk", "compression.topk_ratio": 0.01, "compression.min_compress_numel": 0,
            "compression.max_drift": 0.002, "compression.downlink": "topk"}

    async def main() -> None:
        c = coordinator(**{"training.resync_interval": 10_000, **comp})
        await c.start()
        w = worker(c.port, **{"training.worker_id": "d", **comp})
        t = asyncio.create_task(w.run_async())
        try:
            for _ in range(400):
                if c.version > 150:
                    break
                await asyncio.sleep(0.05)
            await pause_and_settle(c, [w])
            rec = c.workers["d"]
            assert c.downlink.fine.resets >= 2  # the bound restarted the track (after the first)
            assert rec.resyncs >= 1  # and the worker got the full weights
            # the worker holds exactly what the coordinator sent
            assert torch.equal(torch.cat([p.detach().reshape(-1) for p in w.params.values()]),
                               c.downlink.fine.published)
            num = math.sqrt(sum(float((c.params[n] - w.params[n]).detach().norm()) ** 2 for n in c.params))
            den = math.sqrt(sum(float(p.detach().norm()) ** 2 for p in c.params.values()))
            assert num / den <= 0.002 + 1e-9
            assert 0 <= rec.drift <= 0.002 + 1e-9
        finally:
            w.stop()
            await asyncio.wait_for(asyncio.gather(t, return_exceptions=True), 30)
            await c.close()

    asyncio.run(main())


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_bytes_on_the_wire_are_the_declared_size_plus_framing(name: str) -> None:
    model = TASK.build_model()
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    codec = make_codec(name, topk_ratio=0.05, qsgd_bits=4)
    items = {n: codec.compress(g) for n, g in grads.items()}
    declared = sum(codec.estimate_wire_bytes(g.numel()) for g in grads.values())
    assert sum(c.wire_bytes() for c in items.values()) == declared
    codecs, tensors = pack_compressed(items)
    msg = Gradients(msg_id=1, version=0, samples=32, loss=0.5, codecs=codecs, tensors=tensors)
    frame = encode_bytes(msg)
    header = len(encode(msg)[0]) - PREAMBLE.size
    framing = len(frame) - declared
    assert framing == PREAMBLE.size + header + sum(-t.nbytes % ALIGN for t in tensors.values())
    assert framing <= PREAMBLE.size + 160 * len(grads) + ALIGN * len(tensors)  # small, per tensor


def test_auto_downlink_is_dense_uniform_for_topk_and_qsgd_and_the_uplink_codec_otherwise() -> None:
    from swarmtrain.roles.ps.common import downlink_codec

    x = torch.randn(100_000)
    top = downlink_codec(CompressionConfig(type="topk", topk_ratio=0.01, min_compress_numel=0))
    assert top.compress(x).codec == "uniform" and top.compress(x).meta["bits"] == 4
    q8 = downlink_codec(CompressionConfig(type="qsgd", qsgd_bits=8, min_compress_numel=0))
    assert q8.compress(x).codec == "uniform" and q8.compress(x).meta["bits"] == 4
    two = downlink_codec(CompressionConfig(type="topk", downlink_bits=2, min_compress_numel=0))
    assert two.compress(x).meta["bits"] == 2
    explicit = downlink_codec(CompressionConfig(type="topk", downlink="qsgd", qsgd_bits=4,
                                                min_compress_numel=0))
    assert explicit.compress(x).codec == "qsgd" and explicit.compress(x).meta["bits"] == 4
    assert downlink_codec(CompressionConfig(type="fp16")).compress(x).codec == "fp16"
    forced = downlink_codec(CompressionConfig(type="topk", downlink="fp16", min_compress_numel=0))
    assert forced.compress(x).codec == "fp16"


def test_topk_warmup_ramps_density_from_dense_to_target() -> None:
    c = CompressionConfig(type="topk", topk_ratio=0.01, warmup_steps=100, min_compress_numel=0)
    x = torch.randn(10_000)
    sizes = [codec_for_step(c, s).compress(x).wire_bytes() for s in (0, 25, 50, 75, 100, 500)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 10 * sizes[-1]
    assert codec_for_step(c, 0).compress(x).codec == "fp16"  # dense at step 0, cheaper as fp16
    assert codec_for_step(c, 14).compress(x).codec == "fp16"  # density 0.525: still fp16
    assert codec_for_step(c, 16).compress(x).meta["k"] == 4787  # density 0.479: top-k from here
    assert codec_for_step(c, 100).compress(x).meta["k"] == 100  # the target after warm-up


def test_a_compression_key_mismatch_is_reported_at_registration() -> None:
    async def main() -> None:
        c = coordinator(**{"compression.type": "topk", "compression.topk_ratio": 0.01})
        await c.start()
        try:
            w = worker(c.port, **{"compression.type": "topk", "compression.topk_ratio": 0.1})
            with pytest.raises(RefusedError, match="topk_ratio = 0.01 here, 0.1 on the worker"):
                await asyncio.wait_for(w.run_async(), 30)
        finally:
            await c.close()

    asyncio.run(main())


def test_a_fused_delta_splits_into_the_models_tensors_and_malformed_ones_are_refused() -> None:
    from swarmtrain.compression import UniformCodec
    from swarmtrain.errors import RemoteProtocolError
    from swarmtrain.roles.ps.common import FUSED, unpack_compressed

    expected = {"a.weight": torch.zeros(3, 4), "a.bias": torch.zeros(4), "b": torch.zeros(2, 2, 2)}
    flat = torch.arange(24, dtype=torch.float32)
    codecs, tensors = pack_compressed({FUSED: make_codec("none").compress(flat)})
    out = unpack_compressed(codecs, tensors, expected)
    assert list(out) == list(expected) and all(out[n].shape == t.shape for n, t in expected.items())
    assert torch.equal(out["a.bias"], torch.arange(12, 16, dtype=torch.float32))
    u_codecs, u_tensors = pack_compressed({FUSED: UniformCodec(8).compress(flat)})
    assert torch.allclose(unpack_compressed(u_codecs, u_tensors, expected)["b"].reshape(-1),
                          flat[16:], atol=23 / 127 / 2 + 1e-6)
    short = dict(expected, b=torch.zeros(3))  # 23 elements expected, 24 sent
    bad = [
        (codecs, tensors, short),  # a model of another size
        (codecs, {}, expected),  # the part is missing
        (codecs, {**tensors, "extra/values": torch.zeros(1)}, expected),  # an unnamed tensor
        ({FUSED: {**codecs[FUSED], "codec": "zstd"}}, tensors, expected),  # an unknown codec
    ]
    for c, t, e in bad:
        with pytest.raises(RemoteProtocolError):
            unpack_compressed(c, t, e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-tensor"])
def test_with_a_lossless_downlink_the_worker_holds_the_master_weights_exactly(
        fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fused:  # the path big models take
        monkeypatch.setattr("swarmtrain.roles.ps.coordinator.FUSE_MAX_NUMEL", 0)

    async def main() -> None:
        c = coordinator(**{"training.resync_interval": 10_000})
        await c.start()
        w = worker(c.port, **{"training.worker_id": "x", "training.max_inflight": 0})
        t = asyncio.create_task(w.run_async())
        try:
            for _ in range(400):
                if c.version >= 30:
                    break
                await asyncio.sleep(0.05)
            await pause_and_settle(c, [w])
            # a float32 delta is as large as the weights: every answer is the master itself, and
            # no published copy is kept
            assert c.version >= 30 and c.downlink.fine.published is None and not c.downlink.fine.entries
            for n, p in c.params.items():
                assert torch.equal(p, w.params[n]), n
        finally:
            await c.close()
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)

    asyncio.run(main())
