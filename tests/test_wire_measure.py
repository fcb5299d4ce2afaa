"""Sums of squares taken while a payload arrives (wire/measure.py) and the payload pool
(wire/pool.py): what the decoder hands over, what the coordinator's screen makes of it, and
that a pooled buffer is never handed out while anything still refers to it."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.compression.kernels import kernels
from swarmtrain.config import load_coordinator_config
from swarmtrain.roles.ps import coordinator as coordinator_module
from swarmtrain.roles.ps.common import pack_compressed, unpack_lazy
from swarmtrain.roles.ps.coordinator import Coordinator, WorkerRecord
from swarmtrain.wire import Decoder, Gradients, Heartbeat, UpdateStatus, encode_bytes
from swarmtrain.wire.measure import WINDOW, MeasuredTensors
from swarmtrain.wire.pool import PAYLOADS, PayloadPool

FAST = kernels()
needs_kernels = pytest.mark.skipif(FAST is None, reason="no C compiler: nothing is measured")


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # one tensor over several windows, one whose end is not a whole block, a tiny one
    # (top-k at 10 % of it still fills more than a window: smaller payloads are not measured)
    return {"w": torch.randn(3 * WINDOW + 5000, generator=gen),
            "b": torch.randn(1027, generator=gen), "s": torch.randn(3, generator=gen)}


def _frame(grads: dict[str, torch.Tensor], codec: str = "none", **fields: object) -> bytes:
    c = make_codec(codec, topk_ratio=0.1, qsgd_bits=4, bucket_size=512, min_compress_numel=0)
    codecs, tensors = pack_compressed({n: c.compress(g) for n, g in grads.items()})
    msg = Gradients(msg_id=int(fields.get("msg_id", 1)), version=0, samples=4, loss=1.0,
                    codecs=codecs, tensors=tensors)
    return encode_bytes(msg)


def _decode(frame: bytes, chunk: int, **kw: object) -> Gradients:
    dec = Decoder(**kw)  # type: ignore[arg-type]
    for i in range(0, len(frame), chunk):
        dec.feed(frame[i:i + chunk])
    msg = dec.next_message()
    assert isinstance(msg, Gradients)
    return msg


def _one_pass(t: torch.Tensor) -> float:
    assert FAST is not None
    lib = FAST._lib
    fn = lib.st_sumsq_f32 if t.dtype == torch.float32 else lib.st_sumsq_f16
    return float(fn(t.data_ptr(), t.numel()))


@needs_kernels
@pytest.mark.parametrize("codec", ["none", "fp16", "topk", "qsgd"])
def test_the_sums_are_one_pass_over_each_tensor_however_the_payload_arrives(codec: str) -> None:
    frame = _frame(_grads(), codec)
    seen: dict[str, float] | None = None
    for chunk in (len(frame), 61, 997, 4096, 65536, WINDOW - 3, WINDOW + 64):
        msg = _decode(frame, chunk)
        sums = msg.tensors.sumsq  # type: ignore[attr-defined]
        floats = {k for k, t in msg.tensors.items() if t.dtype in (torch.float32, torch.float16)}
        assert set(sums) == floats and floats
        for key, value in sums.items():
            t = msg.tensors[key]
            assert value == _one_pass(t)  # bit for bit: blocks are cut where one pass cuts them
            assert value == pytest.approx(float(t.double().square().sum()), rel=1e-5)
        if seen is None:
            seen = dict(sums)
        assert sums == seen


@needs_kernels
def test_nan_and_inf_reach_the_sums() -> None:
    g = _grads()
    g["w"][1_234_567] = float("nan")
    g["b"][3] = float("inf")
    msg = _decode(_frame(g), 65536)
    sums = msg.tensors.sumsq  # type: ignore[attr-defined]
    assert math.isnan(sums["w/values"]) and sums["b/values"] == float("inf")
    assert math.isfinite(sums["s/values"])


@needs_kernels
def test_only_gradients_of_a_window_or_more_are_measured_unless_asked() -> None:
    frame = _frame(_grads())
    assert type(_decode(frame, 65536).tensors) is MeasuredTensors
    assert type(_decode(frame, 65536, measure=()).tensors) is dict
    small = _frame({"w": torch.randn(WINDOW // 8)})  # half a window of float32
    assert type(_decode(small, 4096).tensors) is dict
    hb = Decoder()
    hb.feed(encode_bytes(Heartbeat(time=1.0, step=3)))
    assert type(hb.next_message()) is Heartbeat


@needs_kernels
def test_a_malformed_layout_is_refused_as_before() -> None:
    import msgpack

    from swarmtrain.errors import RemoteProtocolError
    from swarmtrain.wire.frame import MAGIC, PREAMBLE, PROTOCOL_VERSION

    header = msgpack.packb({"f": {"msg_id": 1, "version": 0, "samples": 1, "loss": 1.0,
                                  "codecs": {}}, "t": [["x/values", "float32", [4], 0, 4096]]})
    pre = PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, int(Gradients.TYPE), 0, len(header), 16)
    dec = Decoder()
    with pytest.raises(RemoteProtocolError):
        dec.feed(pre + header + bytes(16))  # a tensor past the payload's end


def _coordinator() -> tuple[Coordinator, WorkerRecord]:
    model = torch.nn.Linear(512, 512)  # 1 MB of float32 gradient: measured on arrival
    cfg = load_coordinator_config(overrides={"training.outlier_norm_factor": 0.0,
                                             "training.learning_rate": 1e-3})
    coord = Coordinator(model, cfg, task_name="measure")
    rec = WorkerRecord("w", "127.0.0.1:0", {}, 4, 0.0, [0])
    coord.workers[rec.worker_id] = rec
    coord._snapshot_for(rec)
    return coord, rec


def test_the_screen_takes_the_measured_sums_where_there_are_some() -> None:
    coord, _rec = _coordinator()
    try:
        grads = {n: torch.zeros_like(p) for n, p in coord.params.items()}
        codecs, tensors = pack_compressed({n: make_codec("none").compress(g) for n, g in grads.items()})
        lazy = unpack_lazy(codecs, tensors, coord.params)
        plain = Gradients(msg_id=1, version=0, samples=4, loss=1.0, codecs=codecs, tensors=tensors)
        assert coordinator_module._gradient_norm(plain, lazy) == 0.0
        # one tensor's sum taken on arrival (here: said to be 9), the other read after
        measured = MeasuredTensors(tensors, {"weight/values": 9.0})
        msg = Gradients(msg_id=1, version=0, samples=4, loss=1.0, codecs=codecs, tensors=measured)
        assert coordinator_module._gradient_norm(msg, lazy) == 3.0
    finally:
        coord._apply_pool.shutdown(wait=True)
        coord._eval_pool.shutdown(wait=True)


@needs_kernels
def test_a_received_gradient_is_judged_by_its_measured_norm_nan_refused() -> None:
    coord, rec = _coordinator()
    try:
        grads = {n: torch.full_like(p, 0.5) for n, p in coord.params.items()}
        msg = _decode(_frame(grads), 4099)
        assert isinstance(msg.tensors, MeasuredTensors)
        exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        lazy = unpack_lazy(msg.codecs, msg.tensors, coord.params)
        assert coordinator_module._gradient_norm(msg, lazy) == pytest.approx(exact, rel=1e-7)
        status, _ = coord._apply_gradient(rec, msg)
        assert status is UpdateStatus.APPLIED
        grads["bias"][1] = float("nan")
        bad = _decode(_frame(grads, msg_id=2), 4099)
        status, _ = coord._apply_gradient(rec, bad)
        assert status is UpdateStatus.REJECTED and "NaN" in rec.last_refusal
    finally:
        coord._apply_pool.shutdown(wait=True)
        coord._eval_pool.shutdown(wait=True)


# ------------------------------------------------------------------------------------ pool


def test_a_pooled_buffer_comes_back_only_when_nothing_refers_to_it() -> None:
    pool = PayloadPool(min_bytes=16)
    a = pool.take(64)
    t = torch.frombuffer(a, dtype=torch.uint8)
    del a
    b = pool.take(64)  # t still views the first: a new one
    assert (pool.allocated, pool.reused) == (2, 0)
    v = t[8:16].view(torch.int16)  # a view of a view keeps it too
    del t
    c = pool.take(64)
    assert (pool.allocated, pool.reused) == (3, 0)
    m = memoryview(c)
    del b, c
    d = pool.take(64)  # the second (b) is free now
    assert (pool.allocated, pool.reused) == (3, 1)
    del v
    e = pool.take(64)  # the first is free now; the third is held by m
    assert (pool.allocated, pool.reused) == (3, 2)
    assert e is not d and len({id(d), id(e), id(m.obj)}) == 3
    assert pool.take(32) is not None and pool.allocated == 4  # another size: a new one


def test_idle_buffers_are_bounded() -> None:
    pool = PayloadPool(min_bytes=16)  # idle bound: twice the largest (2 x 100)
    held = [pool.take(100) for _ in range(6)]
    assert pool.kept_bytes() == 600 and pool.idle_bytes() == 0
    held.clear()
    assert pool.idle_bytes() == 600
    taken = pool.take(100)  # taking trims the idle ones beyond the bound (the oldest go)
    assert pool.idle_bytes() <= 200 and pool.kept_bytes() <= 300 and len(taken) == 100
    small = PayloadPool(max_idle_bytes=0, min_bytes=16)
    x = small.take(50)
    del x
    small.take(50)
    assert small.kept_bytes() == 50  # the one taken; the idle one was let go


def test_a_message_still_held_keeps_its_bytes_while_later_frames_arrive() -> None:
    """The pool's one promise: decoding never writes into a payload a message still holds."""
    gc.collect()
    before = PAYLOADS.reused
    big = {"w": torch.randn(400_000)}
    held = _decode(_frame(big), 65536)
    keep = held.tensors["w/values"].clone()
    for seed in range(1, 4):  # same size, other bytes
        other = _decode(_frame({"w": torch.randn(400_000, generator=torch.Generator().manual_seed(seed))}),
                        65536)
        assert not torch.equal(other.tensors["w/values"], keep)
        assert torch.equal(held.tensors["w/values"], keep)
        del other
    assert PAYLOADS.reused > before  # the later ones did reuse each other's buffer
    del held


# ------------------------------------------------------------------- unpacking, short path


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_the_short_unpacking_path_gives_what_the_general_one_gives(codec: str) -> None:
    from swarmtrain.roles.ps import common

    model = {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    grads = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    c = make_codec(codec)
    codecs, tensors = pack_compressed({n: c.compress(g) for n, g in grads.items()})
    short = unpack_lazy(codecs, tensors, model)
    for name, spec in codecs.items():
        assert common._plain_values(name, spec, tensors, model, lazy=True) is not None
    # the general path, entry by entry (what _unpack did for every entry before)
    general = {}
    for n, s in codecs.items():
        entry = common.Compressed(codec=s["codec"], shape=tuple(s["shape"]), dtype=s["dtype"],
                                  parts={"values": tensors[f"{n}/values"]}, meta=s["meta"])
        general[n] = common._fp16_values(entry) if codec == "fp16" else common.decompress_any(entry)
    for name in grads:
        assert short[name].dtype == general[name].dtype and torch.equal(short[name], general[name])
        assert short[name].data_ptr() == tensors[f"{name}/values"].data_ptr()  # a view, no copy


@pytest.mark.parametrize("spoil", ["float_dims", "meta", "dtype", "length", "parts"])
def test_what_the_short_path_does_not_take_is_refused_by_the_general_one(spoil: str) -> None:
    from swarmtrain.errors import RemoteProtocolError

    model = {"w": torch.zeros(6, 4)}
    codecs, tensors = pack_compressed({"w": make_codec("none").compress(torch.randn(6, 4))})
    spec = codecs["w"]
    if spoil == "float_dims":
        spec["shape"] = [6.0, 4.0]
    elif spoil == "meta":
        spec["meta"] = {"k": 1}
    elif spoil == "dtype":
        tensors["w/values"] = tensors["w/values"].to(torch.float64)
    elif spoil == "length":
        tensors["w/values"] = tensors["w/values"][:-1]
    else:
        spec["parts"] = ["values", "extra"]
    with pytest.raises(RemoteProtocolError):
        unpack_lazy(codecs, tensors, model)
