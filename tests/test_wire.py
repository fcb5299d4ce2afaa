"""The wire layer, tested without a network (as h11 tests HTTP/1.1): every message type
round-trips, any split of the byte stream decodes the same, tensors are rebuilt over the
received buffer without copies, and every kind of malformed frame is refused with its own
error code."""

from __future__ import annotations

import dataclasses
import itertools
import re
import struct
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmtrain import wire
from swarmtrain.errors import (
    ConnectionLost,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TruncatedFrame,
)
from swarmtrain.wire import (
    ALIGN,
    DTYPES,
    MAGIC,
    MESSAGE_CLASSES,
    PREAMBLE,
    PROTOCOL_VERSION,
    Assign,
    Auth,
    Challenge,
    CheckpointMsg,
    Decoder,
    Error,
    Gradients,
    Heartbeat,
    Hello,
    Limits,
    Message,
    MsgType,
    Pause,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    Start,
    Status,
    StatusRequest,
    Update,
    Weights,
    Welcome,
    encode,
    encode_bytes,
)

pytestmark = pytest.mark.timeout(60)


# --- sample messages ---------------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "fc.weight": torch.randn(4, 5, generator=g),
        "fc.bias": torch.randn(5, generator=g, dtype=torch.float64),
        "emb": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "half": torch.randn(9, generator=g).to(torch.float16),
        "steps": torch.tensor([-(2**62), -1, 0, 1, 2**62], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # non-contiguous
        "strided": base[:, ::3],  # non-contiguous, with a storage offset pattern
        "bytes": torch.arange(250, dtype=torch.uint8),
        "i8": torch.tensor([-128, 127, 0], dtype=torch.int8),
        "i16": torch.tensor([[-3, 4]], dtype=torch.int16),
        "i32": torch.tensor([7], dtype=torch.int32),
        "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    }


def _gradient_parts() -> dict[str, torch.Tensor]:
    # the compressed-gradient convention: parts of parameter p travel as "p/<part>"
    return {
        # top-k's layout: fp16 values, uint16 low index bits, int32 counts per index block
        "fc.weight/values": torch.randn(3).to(torch.float16),
        "fc.weight/index_low": torch.tensor([0, 7, 19], dtype=torch.uint16),
        "fc.weight/block_counts": torch.tensor([3], dtype=torch.int32),
        # qsgd's layout: fp32 norms and packed uint8 codes
        "emb.weight/norms": torch.rand(2),
        "emb.weight/codes": torch.randint(0, 256, (9,), dtype=torch.uint8),
        "fc.bias/values": torch.randn(5),
    }


SAMPLES: dict[MsgType, Message] = {
    MsgType.HELLO: Hello(role="worker", nonce=bytes(range(32)), software="swarmtrain 0.1.0"),
    MsgType.CHALLENGE: Challenge(nonce=b"\x00" * 32, proof=b"\xff" * 32, open_cluster=True),
    MsgType.AUTH: Auth(proof=b"\x01\x02" * 16),
    MsgType.WELCOME: Welcome(session="a1b2c3d4", proof=bytes(range(32))),
    MsgType.REGISTER: Register(
        worker_id="pi-4",
        task="digits",
        fingerprint=[["fc.weight", [4, 5], "float32"], ["fc.bias", [5], "float32"]],
        hardware={"profile": "RPI4", "cores": 4, "memory_mb": 3900.5},
        batch_size=8,
        accumulation_steps=2,
        shard_index=-1,
        compression={"type": "topk", "topk_ratio": 0.1},
        samples_per_sec=123.25,
        last_msg_id=41,
    ),
    MsgType.REGISTER_ACK: RegisterAck(
        worker_id="pi-4", shard_index=2, num_shards=4, running=True, paused=False,
        version=17, last_applied_msg_id=40, shards=[2, 6],
        info={"lr": 1e-4, "nested": {"a": [1, 2]}},
    ),
    MsgType.WEIGHTS: Weights(version=17, tensors=_tensors()),
    MsgType.GRADIENTS: Gradients(
        msg_id=42, version=17, samples=64, loss=2.3125,
        codecs={
            "fc.weight": {"codec": "topk", "shape": [4, 5], "dtype": "float32", "meta": {"k": 3},
                          "parts": ["values", "index_low", "block_counts"]},
            "emb.weight": {"codec": "qsgd", "shape": [3, 6], "dtype": "float32",
                           "meta": {"bits": 4, "bucket_size": 16}, "parts": ["norms", "codes"]},
            "fc.bias": {"codec": "none", "shape": [5], "dtype": "float32", "meta": {},
                        "parts": ["values"]},
        },
        tensors=_gradient_parts(),
    ),
    MsgType.UPDATE: Update(
        msg_id=42, version=18, status="applied",
        deltas=[{"from": 17, "to": 18, "codecs": {"fc.bias": {
            "codec": "fp16", "shape": [5], "dtype": "float32", "meta": {}, "parts": ["values"]}}}],
        tensors={"17:fc.bias/values": torch.randn(5).to(torch.float16)},
    ),
    MsgType.ASSIGN: Assign(shards=[0, 3], num_shards=4),
    MsgType.VERDICT: wire.Verdict(worker_id="w-1", msg_id=7, status="stale", staleness=17),
    MsgType.START: Start(version=0),
    MsgType.PAUSE: Pause(),
    MsgType.RESUME: Resume(),
    MsgType.SHUTDOWN: Shutdown(reason="training finished"),
    MsgType.HEARTBEAT: Heartbeat(time=1_700_000_000.123456, step=99),
    MsgType.CHECKPOINT: CheckpointMsg(path="/ckpt/step-100", step=100, ok=True,
                                      message="ünïcødé"),
    MsgType.ERROR: Error(code="auth_failed", message="wrong secret", fatal=True),
    MsgType.STATUS_REQUEST: StatusRequest(),
    MsgType.STATUS: Status(status={"step": 5, "loss": 0.5, "workers": [{"id": "a"}],
                                   "raw": b"\x00"}),
    MsgType.PEER_HELLO: wire.PeerHello(run="lan-run"),
    MsgType.PEER_INFO: wire.PeerInfoMsg(peer_id="ab" * 16, public_key=bytes(range(32)), ring_port=7201,
                                        run="lan-run", profile="RPI4", epoch=3, rounds=40),
    MsgType.PROPOSE: wire.Propose(epoch=4, proposer="ab" * 16, members=["ab" * 16, "cd" * 16],
                                  addresses={"ab" * 16: ["10.0.0.1", 7201]}, public_key=b"k" * 32,
                                  signature=b"s" * 64),
    MsgType.ACCEPT: wire.Accept(epoch=4, peer_id="cd" * 16, ok=False, rounds=7, reason="not ready yet"),
    MsgType.COMMIT: wire.Commit(epoch=4, proposer="ab" * 16, members=["ab" * 16], addresses={},
                                donor="ab" * 16, signature=b"s" * 64),
    MsgType.REFORM: wire.Reform(epoch=4, peer_id="cd" * 16),
    MsgType.STAGE_FORWARD: wire.StageForward(
        req=7, session="s1", microbatch=3, priority=20,
        tensors={"x": torch.randn(2, 4, 8), "targets": torch.randint(0, 256, (2, 4))}),
    MsgType.STAGE_RESULT: wire.StageResult(
        req=7, session="s1", microbatch=3, done=True,
        tensors={"y": torch.tensor(2.5), "grad": torch.randn(2, 4, 8)}),
    MsgType.STAGE_BACKWARD: wire.StageBackward(req=8, session="s1", microbatch=3,
                                               tensors={"grad": torch.randn(2, 4, 8)}),
    MsgType.STAGE_GRAD: wire.StageGrad(req=8, session="s1", microbatch=3, duplicate=True),
    MsgType.STAGE_INFER: wire.StageInfer(req=9, session="gen", priority=0,
                                         tensors={"x": torch.tensor([[1, 2, 3]])}),
    MsgType.STAGE_SYNC: wire.StageSync(req=1, round=2, step=40, reply=False,
                                       tensors={"0.weight": torch.randn(3, 3)}),
    MsgType.STAGE_ERROR: wire.StageError(req=9, code="bad_input", message="x must be float32"),
    MsgType.STAGE_STEP: wire.StageStep(req=4, session="s", group=8, group_size=4, scale=0.25, reply=True,
                                       missing=[9, 10], steps=3, at_risk=1, incarnation="ab12"),
}


def test_samples_cover_every_message_type() -> None:
    assert set(SAMPLES) == set(MESSAGE_CLASSES)
    for mtype, msg in SAMPLES.items():
        assert type(msg) is MESSAGE_CLASSES[mtype]


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (so NaN, -0.0 and bfloat16 compare exactly)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_message(got: Message, want: Message) -> None:
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if f.name == "tensors":
            assert list(g) == list(w), "tensor names or order differ"
            for name in w:
                assert _same_tensor(g[name], w[name]), f"tensor {name!r} differs"
        else:
            assert g == w, f"field {f.name}: {g!r} != {w!r}"
            assert type(g) is type(w), f"field {f.name}: {type(g)} != {type(w)}"


_DEFAULT_LIMITS = Limits()


def _decode_all(data: bytes, limits: Limits = _DEFAULT_LIMITS) -> list[Message]:
    dec = Decoder(limits)
    dec.feed(data)
    out = []
    while (m := dec.next_message()) is not None:
        out.append(m)
    assert not dec.mid_frame
    return out


# --- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("mtype", list(SAMPLES), ids=lambda t: t.name)
def test_round_trip_every_message_type(mtype: MsgType) -> None:
    msg = SAMPLES[mtype]
    data = encode_bytes(msg)
    assert data[5] == int(mtype)
    (got,) = _decode_all(data)
    assert_same_message(got, msg)


def test_round_trip_of_a_full_update() -> None:
    # a resync: complete weights under their plain names, no codecs
    msg = Update(msg_id=0, version=30, status="applied", full=True, tensors=_tensors())
    (got,) = _decode_all(encode_bytes(msg))
    assert_same_message(got, msg)


@pytest.mark.parametrize("mtype", [MsgType.WEIGHTS, MsgType.GRADIENTS, MsgType.HELLO],
                         ids=lambda t: t.name)
def test_fed_one_byte_at_a_time(mtype: MsgType) -> None:
    msg = SAMPLES[mtype]
    data = encode_bytes(msg)
    dec = Decoder()
    for i in range(len(data)):
        assert dec.next_message() is None
        assert dec.mid_frame == (i > 0)
        dec.feed(data[i : i + 1])
    assert not dec.mid_frame
    got = dec.next_message()
    assert got is not None
    assert_same_message(got, msg)
    assert dec.next_message() is None
    assert dec.bytes_received == len(data)


def test_many_frames_in_one_feed() -> None:
    msgs = list(SAMPLES.values()) * 2
    got = _decode_all(b"".join(encode_bytes(m) for m in msgs))
    assert len(got) == len(msgs)
    for g, w in zip(got, msgs, strict=True):
        assert_same_message(g, w)


_STREAM_MSGS = [SAMPLES[MsgType.HELLO], SAMPLES[MsgType.WEIGHTS], SAMPLES[MsgType.PAUSE],
                SAMPLES[MsgType.GRADIENTS], SAMPLES[MsgType.HEARTBEAT]]
_STREAM = b"".join(encode_bytes(m) for m in _STREAM_MSGS)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(_STREAM)), max_size=40))
def test_random_splits_decode_the_same(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(_STREAM)]
    dec = Decoder()
    got: list[Message] = []
    for a, b in itertools.pairwise(bounds):
        dec.feed(memoryview(_STREAM)[a:b])
        while (m := dec.next_message()) is not None:
            got.append(m)
    assert len(got) == len(_STREAM_MSGS)
    for g, w in zip(got, _STREAM_MSGS, strict=True):
        assert_same_message(g, w)


def test_empty_feed_is_harmless() -> None:
    dec = Decoder()
    dec.feed(b"")
    assert dec.next_message() is None and not dec.mid_frame


def test_unknown_extra_fields_are_ignored() -> None:
    # a newer peer may add optional fields; an older one must still understand the message
    data = _frame(MsgType.START, {"f": {"version": 3, "added_later": [1, 2]}, "t": []})
    (got,) = _decode_all(data)
    assert got == Start(version=3)


def test_optional_fields_take_their_defaults() -> None:
    (got,) = _decode_all(_frame(MsgType.ERROR, {"f": {"code": "x", "message": "y"}, "t": []}))
    assert got == Error(code="x", message="y", fatal=True)


def test_int_is_accepted_for_a_float_field() -> None:
    (got,) = _decode_all(_frame(MsgType.HEARTBEAT, {"f": {"time": 5}, "t": []}))
    assert isinstance(got, Heartbeat) and got.time == 5.0 and type(got.time) is float


# --- layout and zero copy ----------------------------------------------------------------


def _split(data: bytes) -> tuple[tuple[Any, ...], dict[str, Any], bytes]:
    pre = PREAMBLE.unpack_from(data)
    hlen = pre[4]
    header = msgpack.unpackb(data[PREAMBLE.size : PREAMBLE.size + hlen], raw=False)
    return pre, header, data[PREAMBLE.size + hlen :]


def test_preamble_and_alignment_of_the_payload() -> None:
    msg = SAMPLES[MsgType.WEIGHTS]
    data = encode_bytes(msg)
    (magic, version, mtype, flags, hlen, plen), header, payload = _split(data)
    assert (magic, version, mtype, flags) == (MAGIC, PROTOCOL_VERSION, MsgType.WEIGHTS, 0)
    assert len(data) == PREAMBLE.size + hlen + plen
    assert plen == len(payload) and plen % ALIGN == 0
    assert header["f"] == {"version": 17}
    end = 0
    for name, dtype, shape, offset, nbytes in header["t"]:
        t = msg.tensors[name]
        assert offset % ALIGN == 0 and offset >= end
        assert bytes(payload[end:offset]) == bytes(offset - end), "padding must be zeros"
        assert dtype == str(t.dtype).removeprefix("torch.")
        assert shape == list(t.shape) and nbytes == t.numel() * t.element_size()
        end = offset + nbytes
    assert bytes(payload[end:]) == bytes(len(payload) - end)


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def test_encode_does_not_copy_contiguous_tensors() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    segments = encode(Weights(version=1, tensors={"t": t}))
    views = [s for s in segments if isinstance(s, memoryview) and s.nbytes == t.nbytes]
    assert len(views) == 1
    assert _address(views[0]) == t.data_ptr()


def test_tensors_are_built_over_the_received_buffer_without_copies() -> None:
    """Receive the payload the way FrameProtocol does (get_buffer/buffer_updated) and check
    every tensor lies inside, and shares memory with, the one buffer the bytes landed in."""
    msg = Weights(version=1, tensors={
        "a": torch.randn(100), "b": torch.arange(30, dtype=torch.int64).reshape(5, 6),
        "c": torch.randn(7).to(torch.bfloat16), "d": torch.tensor(True),
    })
    data = encode_bytes(msg)
    _, _, payload = _split(data)
    dec = Decoder()
    dec.feed(data[: len(data) - len(payload)])
    assert dec.mid_frame and dec.next_message() is None
    target = dec.get_buffer()
    assert target.nbytes == len(payload), "the decoder lends exactly the payload's buffer"
    base = _address(target)
    target[:] = payload
    dec.buffer_updated(len(payload))
    got = dec.next_message()
    assert isinstance(got, Weights)
    assert_same_message(got, msg)
    for name, t in got.tensors.items():
        assert base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + len(payload), name
    # the first tensor starts at offset 0 of the payload, and writing into the buffer is
    # seen through the tensors: they are views of it, not copies
    assert got.tensors["a"].data_ptr() == base
    target[:8] = struct.pack("<ff", 1.5, -2.0)
    assert got.tensors["a"][:2].tolist() == [1.5, -2.0]
    ptrs = sorted(t.data_ptr() for t in got.tensors.values())
    assert all(p - base < len(payload) for p in ptrs)


def test_the_quick_descriptor_checks_build_what_the_full_ones_build() -> None:
    """``rebuild_tensors`` checks each descriptor the cheap way (``_quick_desc``) and gives any
    it does not pass to the full checks (``_parse_desc``), which name the fault or accept it.
    On valid frames of every rank, dtype and size both read a descriptor alike, and a frame
    whose numbers are an int subclass (refused by the cheap checks, accepted by the full
    ones) is rebuilt as the same views of the same bytes (the malformed frames below go
    through the full checks and are refused with their codes)."""
    from swarmtrain.wire.tensors import (
        _dtype_maps,
        _parse_desc,
        _quick_desc,
        layout_tensors,
        rebuild_tensors,
    )

    class Count(int):
        pass

    tensors = {"vec": torch.randn(100), "mat": torch.arange(30, dtype=torch.int64).reshape(5, 6),
               "bf": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(True),
               "empty": torch.empty(0, 3), "half": torch.randn(2, 3, 4).half(),
               "idx": torch.arange(9, dtype=torch.int32)}
    descs, segments, size = layout_tensors(tensors)
    payload = bytearray(size)
    offset = 0
    for seg in segments:
        n = len(seg) if isinstance(seg, bytes) else seg.nbytes
        payload[offset:offset + n] = bytes(seg)
        offset += n
    raw = [[d.name, d.dtype, list(d.shape), d.offset, d.nbytes] for d in descs]
    by_name = _dtype_maps()[0]
    for i, r in enumerate(raw):
        d = _parse_desc(r, i)
        quick = _quick_desc(r, by_name)
        assert quick is not None and quick[:2] == (d.name, by_name[d.dtype]), r
        assert tuple(quick[2]) == d.shape and quick[3:5] == (d.offset, d.nbytes), r
    odd = [[n, dt, [Count(x) for x in shape], Count(off), Count(nb)] for n, dt, shape, off, nb in raw]
    assert all(_quick_desc(r, by_name) is None for r in odd)
    quick_built, full_built = rebuild_tensors(raw, payload, 100), rebuild_tensors(odd, payload, 100)
    assert list(quick_built) == list(full_built) == list(tensors)
    for name, t in quick_built.items():
        assert t.dtype == full_built[name].dtype and t.shape == full_built[name].shape, name
        assert t.numel() == 0 or t.data_ptr() == full_built[name].data_ptr(), name
        assert torch.equal(t, tensors[name]) and torch.equal(full_built[name], tensors[name]), name
    # a descriptor the quick checks pass and the layout refuses: the error that names it
    bad = [*raw[:2], [raw[2][0], raw[2][1], raw[2][2], raw[1][3], raw[2][4]]]  # overlaps "mat"
    with pytest.raises(RemoteProtocolError, match="inside or before the previous") as exc:
        rebuild_tensors(bad, payload, 100)
    assert exc.value.code == "overlapping_tensors"


# --- malformed frames --------------------------------------------------------------------


def _frame(
    mtype: int,
    header: Any,
    payload: bytes = b"",
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    hlen: int | None = None,
    plen: int | None = None,
) -> bytes:
    """A frame built by hand, so every field can be made wrong."""
    hbytes = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    pre = PREAMBLE.pack(
        magic, version, int(mtype), flags,
        len(hbytes) if hlen is None else hlen, len(payload) if plen is None else plen,
    )
    return pre + hbytes + payload


def _weights(descs: list[Any], payload: bytes) -> bytes:
    return _frame(MsgType.WEIGHTS, {"f": {"version": 1}, "t": descs}, payload)


def _refused(data: bytes, code: str, limits: Limits = _DEFAULT_LIMITS) -> RemoteProtocolError:
    dec = Decoder(limits)
    with pytest.raises(RemoteProtocolError) as info:
        dec.feed(data)
    assert info.value.code == code, str(info.value)
    assert dec.next_message() is None
    # the stream cannot be resynchronised: the decoder stays broken
    with pytest.raises(RemoteProtocolError) as again:
        dec.feed(encode_bytes(Pause()))
    assert again.value is info.value
    with pytest.raises(RemoteProtocolError):
        dec.get_buffer()
    return info.value


_F32 = struct.pack("<4f", 1, 2, 3, 4) + bytes(48)


MALFORMED: dict[str, tuple[bytes, str]] = {
    "bad magic": (_frame(MsgType.PAUSE, {"f": {}, "t": []}, magic=b"HTTP"), "bad_magic"),
    "http request": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_magic"),
    "unknown version": (_frame(MsgType.PAUSE, {"f": {}, "t": []}, version=3),
                        "unsupported_version"),
    "version zero": (_frame(MsgType.PAUSE, {"f": {}, "t": []}, version=0), "unsupported_version"),
    "unknown type": (_frame(99, {"f": {}, "t": []}), "unknown_type"),
    "type zero": (_frame(0, {"f": {}, "t": []}), "unknown_type"),
    "reserved flags": (_frame(MsgType.PAUSE, {"f": {}, "t": []}, flags=0x8000), "bad_flags"),
    "empty header": (_frame(MsgType.PAUSE, b""), "bad_header"),
    "header not msgpack": (_frame(MsgType.PAUSE, b"\xc1\xc1\xc1"), "bad_header"),
    "header truncated msgpack": (_frame(MsgType.PAUSE, b"\x82\xa1f"), "bad_header"),
    "header with trailing bytes": (
        _frame(MsgType.PAUSE, msgpack.packb({"f": {}, "t": []}) + b"\x00"), "bad_header"),
    "header is a list": (_frame(MsgType.PAUSE, [1, 2, 3]), "bad_header"),
    "header lacks f": (_frame(MsgType.PAUSE, {"t": []}), "bad_header"),
    "header lacks t": (_frame(MsgType.PAUSE, {"f": {}}), "bad_header"),
    "fields not a map": (_frame(MsgType.PAUSE, {"f": [], "t": []}), "bad_header"),
    "tensors not a list": (_frame(MsgType.PAUSE, {"f": {}, "t": {}}), "bad_header"),
    "non-string map key": (_frame(MsgType.PAUSE, {"f": {1: 2}, "t": []}), "bad_header"),
    "descriptor outside the payload": (
        _weights([["a", "float32", [4], 64, 16]], bytes(64)), "descriptor_out_of_range"),
    "descriptor past the end": (
        _weights([["a", "float32", [20], 0, 80]], bytes(64)), "descriptor_out_of_range"),
    "overlapping descriptors": (
        _weights([["a", "float32", [4], 0, 16], ["b", "float32", [2], 8, 8]], _F32),
        "overlapping_tensors"),
    "descriptors out of order": (
        _weights([["a", "float32", [2], 32, 8], ["b", "float32", [2], 0, 8]], _F32),
        "overlapping_tensors"),
    "bad dtype name": (_weights([["a", "complex64", [2], 0, 16]], _F32), "bad_dtype"),
    "dtype not a string": (_weights([["a", 5, [4], 0, 16]], _F32), "bad_dtype"),
    "nbytes not matching shape": (_weights([["a", "float32", [4], 0, 12]], _F32), "bad_descriptor"),
    "misaligned offset": (_weights([["a", "float32", [2], 2, 8]], _F32), "misaligned"),
    "duplicate tensor name": (
        _weights([["a", "float32", [2], 0, 8], ["a", "float32", [2], 8, 8]], _F32),
        "duplicate_tensor"),
    "descriptor not a list": (_weights([{"name": "a"}], _F32), "bad_descriptor"),
    "descriptor too short": (_weights([["a", "float32", [4], 0]], _F32), "bad_descriptor"),
    "empty tensor name": (_weights([["", "float32", [4], 0, 16]], _F32), "bad_descriptor"),
    "negative dimension": (_weights([["a", "float32", [-4], 0, 16]], _F32), "bad_descriptor"),
    "boolean dimension": (_weights([["a", "float32", [True], 0, 4]], _F32), "bad_descriptor"),
    "shape not a list": (_weights([["a", "float32", 4, 0, 16]], _F32), "bad_descriptor"),
    "too many dimensions": (_weights([["a", "float32", [1] * 17, 0, 4]], _F32), "bad_descriptor"),
    "negative offset": (_weights([["a", "float32", [4], -16, 16]], _F32), "bad_descriptor"),
    "missing required field": (_frame(MsgType.START, {"f": {}, "t": []}), "missing_field"),
    "missing tensor-message field": (
        _frame(MsgType.WEIGHTS, {"f": {}, "t": [["a", "float32", [4], 0, 16]]}, _F32),
        "missing_field"),
    "wrong field type": (_frame(MsgType.START, {"f": {"version": "7"}, "t": []}), "bad_field"),
    "bool for an int field": (
        _frame(MsgType.START, {"f": {"version": True}, "t": []}), "bad_field"),
    "str for a float field": (
        _frame(MsgType.HEARTBEAT, {"f": {"time": "now"}, "t": []}), "bad_field"),
    "str for bytes": (_frame(MsgType.AUTH, {"f": {"proof": "abc"}, "t": []}), "bad_field"),
    "list for a dict": (_frame(MsgType.STATUS, {"f": {"status": [1]}, "t": []}), "bad_field"),
    "huge dimension on an empty tensor": (
        _weights([["a", "float32", [0, 2**64 - 1], 0, 0]], b""), "bad_descriptor"),
    "tensors on a message that carries none": (
        _frame(MsgType.START, {"f": {"version": 1}, "t": [["a", "float32", [4], 0, 16]]}, _F32),
        "unexpected_tensors"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frame_is_refused_with_its_code(case: str) -> None:
    data, code = MALFORMED[case]
    _refused(data, code)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frame_after_a_good_one(case: str) -> None:
    """Good frames before the bad one are still delivered; then the decoder breaks."""
    data, code = MALFORMED[case]
    dec = Decoder()
    with pytest.raises(RemoteProtocolError) as info:
        dec.feed(encode_bytes(Start(version=1)) + data)
    assert info.value.code == code
    assert dec.next_message() == Start(version=1)
    assert dec.next_message() is None


def test_error_messages_name_what_was_wrong() -> None:
    assert "HTTP" in str(_refused(MALFORMED["bad magic"][0], "bad_magic"))
    assert "version 3" in str(_refused(MALFORMED["unknown version"][0], "unsupported_version"))
    assert "version" in str(_refused(MALFORMED["missing required field"][0], "missing_field"))
    assert "complex64" in str(_refused(MALFORMED["bad dtype name"][0], "bad_dtype"))


def test_too_many_tensors() -> None:
    descs = [[f"t{i}", "float32", [1], 64 * i, 4] for i in range(3)]
    data = _weights(descs, bytes(192))
    _refused(data, "too_many_tensors", Limits(max_tensors=2))
    (got,) = _decode_all(data, Limits(max_tensors=3))
    assert list(got.tensors) == ["t0", "t1", "t2"]


def test_oversize_header_is_refused_at_the_preamble() -> None:
    limits = Limits(max_header_bytes=64)
    ok = _frame(MsgType.SHUTDOWN, {"f": {"reason": "x" * 20}, "t": []})
    _decode_all(ok, limits)
    # a header length of 4 GiB: refused from the 20 preamble bytes alone, nothing allocated
    pre = PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, MsgType.SHUTDOWN, 0, 2**32 - 1, 0)
    _refused(pre, "oversize_header", limits)
    big = _frame(MsgType.SHUTDOWN, {"f": {"reason": "x" * 100}, "t": []})
    _refused(big[: PREAMBLE.size], "oversize_header", limits)


def test_oversize_payload_is_refused_at_the_preamble() -> None:
    limits = Limits(max_payload_bytes=128)
    _decode_all(_weights([["a", "float32", [32], 0, 128]], bytes(128)), limits)
    # 2**60 bytes would be an allocation failure if the decoder tried; it must not try
    pre = PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, MsgType.WEIGHTS, 0, 10, 2**60)
    _refused(pre, "oversize_payload", limits)
    _refused(_weights([["a", "float32", [48], 0, 192]], bytes(192))[: PREAMBLE.size],
             "oversize_payload", limits)


def test_truncated_frame_yields_nothing_and_reports_mid_frame() -> None:
    data = encode_bytes(SAMPLES[MsgType.WEIGHTS])
    for cut in (1, PREAMBLE.size - 1, PREAMBLE.size, PREAMBLE.size + 5, len(data) - 1):
        dec = Decoder()
        dec.feed(data[:cut])
        assert dec.mid_frame, cut
        assert dec.next_message() is None, cut
        dec.feed(data[cut:])
        assert not dec.mid_frame
        assert dec.next_message() is not None


def test_a_stream_ending_inside_a_frame_is_a_truncated_frame_error() -> None:
    data = encode_bytes(SAMPLES[MsgType.WEIGHTS])
    whole = Decoder()
    whole.feed(data)
    assert whole.end_of_stream() is None  # ended between frames: nothing wrong
    for cut, part in ((3, "preamble"), (PREAMBLE.size + 2, "header"), (len(data) - 1, "payload")):
        dec = Decoder()
        dec.feed(data[:cut])
        err = dec.end_of_stream()
        assert isinstance(err, TruncatedFrame) and isinstance(err, ConnectionLost), cut
        assert err.code == "truncated_frame"
        assert part in str(err), (part, str(err))
        with pytest.raises(TruncatedFrame):  # the decoder stays broken, as after any error
            dec.feed(b"x")


def test_error_codes_are_distinct_per_kind() -> None:
    # sanity check of the table above: the structural classes each have their own code
    codes = {code for _, code in MALFORMED.values()}
    assert codes >= {
        "bad_magic", "unsupported_version", "unknown_type", "bad_flags", "bad_header",
        "descriptor_out_of_range", "overlapping_tensors", "bad_dtype", "bad_descriptor",
        "misaligned", "duplicate_tensor", "missing_field", "bad_field", "unexpected_tensors",
    }


# --- local errors ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.float8_e4m3fn])
def test_encoding_an_unsupported_dtype_is_a_local_error(dtype: torch.dtype) -> None:
    t = torch.zeros(3, dtype=dtype)
    with pytest.raises(LocalProtocolError) as info:
        encode(Weights(version=1, tensors={"w": t}))
    assert info.value.code == "bad_dtype"
    assert not isinstance(info.value, RemoteProtocolError)


@pytest.mark.parametrize("msg", [
    Status(status={"obj": object()}),
    Status(status={"s": {1, 2}}),
    Heartbeat(time=0.0, step=2**70),  # (a STATUS carries such a counter as a float: test_wire_bounds)
    Shutdown(reason=torch.tensor(1)),  # type: ignore[arg-type]
], ids=["object", "set", "huge-int", "tensor-in-header"])
def test_encoding_an_unencodable_field_is_a_local_error(msg: Message) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode(msg)
    assert info.value.code == "unencodable"


def test_local_limits_are_checked_when_encoding() -> None:
    tensors = {f"t{i}": torch.zeros(1) for i in range(3)}
    with pytest.raises(LocalProtocolError, match="tensors") as info:
        encode(Weights(version=1, tensors=tensors), Limits(max_tensors=2))
    assert info.value.code == "too_many_tensors"
    with pytest.raises(LocalProtocolError) as info:
        encode(Weights(version=1, tensors={"w": torch.zeros(64)}), Limits(max_payload_bytes=128))
    assert info.value.code == "oversize_payload"
    with pytest.raises(LocalProtocolError) as info:
        encode(Shutdown(reason="x" * 200), Limits(max_header_bytes=100))
    assert info.value.code == "oversize_header"


@pytest.mark.parametrize("name", ["", "x" * 513])
def test_encoding_a_tensor_name_the_peer_would_refuse_is_a_local_error(name: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode(Weights(version=1, tensors={name: torch.zeros(1)}))
    assert info.value.code == "bad_tensor"


def test_encoding_a_non_tensor_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode(Weights(version=1, tensors={"w": [1.0, 2.0]}))  # type: ignore[dict-item]
    assert info.value.code == "bad_tensor"


# --- fuzzing -----------------------------------------------------------------------------

_FUZZ_LIMITS = Limits(max_header_bytes=4096, max_payload_bytes=1 << 16, max_tensors=64)
_VALID_FRAMES = [encode_bytes(m) for m in SAMPLES.values() if len(encode_bytes(m)) < 4096]


@st.composite
def _mutated_frame(draw: st.DrawFn) -> bytes:
    """A valid frame with a few bytes overwritten, inserted or cut: reaches deep states."""
    data = bytearray(draw(st.sampled_from(_VALID_FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["set", "insert", "delete"]))
        byte = draw(st.integers(0, 255))
        if op == "set" and pos < len(data):
            data[pos] = byte
        elif op == "insert":
            data.insert(pos, byte)
        elif pos < len(data):
            del data[pos]
    return bytes(data)


@st.composite
def _random_header_frame(draw: st.DrawFn) -> bytes:
    """A valid preamble followed by arbitrary header and payload bytes."""
    header = draw(st.binary(min_size=1, max_size=300))
    payload = draw(st.binary(max_size=300))
    mtype = draw(st.sampled_from(list(MsgType)))
    return _frame(mtype, header, payload)


@st.composite
def _random_header_object(draw: st.DrawFn) -> bytes:
    """A valid preamble and msgpack header holding arbitrary (msgpack-able) values."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                     st.floats(), st.text(max_size=8), st.binary(max_size=8))
    value = st.recursive(
        leaf,
        lambda c: st.one_of(st.lists(c, max_size=5),
                            st.dictionaries(st.text(max_size=6), c, max_size=4)),
        max_leaves=20,
    )
    descs = st.lists(st.one_of(value, st.tuples(
        st.text(max_size=4), st.sampled_from(["float32", "int64", "bool", "bfloat16", "x"]),
        st.lists(st.integers(-1, 2**64 - 1), max_size=3),
        st.integers(-1, 2**64 - 1), st.integers(-1, 2**64 - 1)).map(list)), max_size=4)
    header = {"f": draw(st.dictionaries(st.text(max_size=10), value, max_size=5)), "t": draw(descs)}
    mtype = draw(st.sampled_from(list(MsgType)))
    return _frame(mtype, header, draw(st.binary(max_size=256)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(st.binary(max_size=200), _mutated_frame(), _random_header_frame(),
                      _random_header_object()),
       chunk=st.integers(1, 64))
def test_any_bytes_give_messages_or_a_remote_protocol_error(data: bytes, chunk: int) -> None:
    dec = Decoder(_FUZZ_LIMITS)
    try:
        for i in range(0, len(data), chunk):
            dec.feed(data[i : i + chunk])
    except RemoteProtocolError as exc:
        assert exc.code and isinstance(exc.code, str)
        with pytest.raises(RemoteProtocolError):
            dec.feed(b"\x00")
    while (msg := dec.next_message()) is not None:
        assert type(msg) in MESSAGE_CLASSES.values()


def test_protocol_errors_are_split_by_blame() -> None:
    assert issubclass(LocalProtocolError, ProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


# --- docs/protocol.md stays true -----------------------------------------------------------


def test_the_worked_example_in_the_protocol_doc() -> None:
    data = encode_bytes(Weights(version=1, tensors={"w": torch.tensor([1.0, -2.0])}))
    expected = bytes.fromhex(
        "5357524d 02 0c 0000 1f000000 4000000000000000"  # preamble
        "82 a166 81 a776657273696f6e 01"  # {"f": {"version": 1},
        "a174 91 95 a177 a7666c6f61743332 9102 00 08"  # "t": [["w", "float32", [2], 0, 8]]}
        "0000803f 000000c0" + "00" * 56  # 1.0, -2.0, padding
    )
    assert data == expected
    beat = bytes.fromhex(
        "5357524d 02 18 0000 1b000000 0000000000000000"
        "82 a166 82 a474696d65 cb3fe0000000000000 a473746570 03 a174 90"
    )
    assert encode_bytes(Heartbeat(time=0.5, step=3)) == beat
    weights, heartbeat = _decode_all(expected + beat)
    assert isinstance(weights, Weights) and weights.version == 1
    assert weights.tensors["w"].tolist() == [1.0, -2.0]
    assert heartbeat == Heartbeat(time=0.5, step=3)


def test_constants_match_the_protocol_doc() -> None:
    assert {t.name: int(t) for t in MsgType} == {
        "HELLO": 1, "CHALLENGE": 2, "AUTH": 3, "WELCOME": 4,
        "REGISTER": 10, "REGISTER_ACK": 11, "WEIGHTS": 12, "GRADIENTS": 13, "UPDATE": 14,
        "ASSIGN": 15, "VERDICT": 16,
        "START": 20, "PAUSE": 21, "RESUME": 22, "SHUTDOWN": 23, "HEARTBEAT": 24,
        "CHECKPOINT": 25, "ERROR": 26, "STATUS_REQUEST": 27, "STATUS": 28,
        "PEER_HELLO": 40, "PEER_INFO": 41, "PROPOSE": 42, "ACCEPT": 43, "COMMIT": 44, "REFORM": 45,
        "STAGE_FORWARD": 50, "STAGE_RESULT": 51, "STAGE_BACKWARD": 52, "STAGE_GRAD": 53,
        "STAGE_INFER": 54, "STAGE_SYNC": 55, "STAGE_ERROR": 56, "STAGE_STEP": 57,
    }
    assert PREAMBLE.format == "<4sBBHIQ" and PREAMBLE.size == 20
    assert MAGIC == b"SWRM" and PROTOCOL_VERSION == 2 and ALIGN == 64
    assert Limits() == Limits(max_header_bytes=1 << 20, max_payload_bytes=1 << 30,
                              max_tensors=16384)
    itemsizes = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
    assert itemsizes == {
        "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "bool": 1,
        "int8": 1, "uint8": 1, "uint16": 2, "int16": 2, "int32": 4, "int64": 8,
    }


_DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([A-Z_]+)`\s*\|[^|]*\|(.*)\|\s*$", re.MULTILINE)
_FIELD = re.compile(r"`(\w+): (\w+)( = [^`]+)?`")


def test_protocol_doc_lists_every_message_type_with_its_fields() -> None:
    """Each message row of docs/protocol.md gives the type byte and every header field with
    its type and whether it has a default, in the order of the dataclass."""
    rows = {name: (int(num), fields) for num, name, fields in _ROW.findall(_DOC.read_text())}
    assert set(rows) == {t.name for t in MsgType}, "docs/protocol.md message tables are stale"
    for mtype, cls in MESSAGE_CLASSES.items():
        num, cell = rows[mtype.name]
        assert num == int(mtype), mtype.name
        hints = typing.get_type_hints(cls)
        want = [
            (f.name, getattr(typing.get_origin(hints[f.name]) or hints[f.name], "__name__", "?"),
             f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
            for f in dataclasses.fields(cls) if f.name != "tensors"
        ]
        got = [(name, typ, bool(default)) for name, typ, default in _FIELD.findall(cell)]
        assert got == want, f"docs/protocol.md row for {mtype.name} is stale"
        carries = any(f.name == "tensors" for f in dataclasses.fields(cls))
        assert ("**tensors**" in cell) == carries, mtype.name


_WITHOUT_TORCH = """
import sys
import {module}
from swarmtrain.wire import Decoder, Heartbeat, StatusRequest, encode_bytes

decoder = Decoder()
decoder.feed(encode_bytes(Heartbeat(time=1.5, step=3)) + encode_bytes(StatusRequest()))
assert decoder.next_message() == Heartbeat(time=1.5, step=3)
assert decoder.next_message() == StatusRequest()
print("torch" in sys.modules)
"""


@pytest.mark.parametrize("module", ["swarmtrain.wire.messages", "swarmtrain.wire", "swarmtrain.roles.ps.ctl"])
def test_messages_without_tensors_need_no_torch(module: str) -> None:
    """The wire layer imports torch only to lay out or rebuild tensors: a client whose messages
    carry none (``swarmtrain ctl``) starts without it (importing torch takes seconds)."""
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH.format(module=module)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} imported torch"
