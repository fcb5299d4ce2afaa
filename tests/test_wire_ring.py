"""The peer ring's frame format read without I/O (:class:`swarmtrain.wire.ring.FrameReader`),
tested as :mod:`swarmtrain.wire.frame`'s decoder is: bytes in any split, down to one at a
time, give the same collective; a truncated or corrupted stream raises a
:class:`~swarmtrain.errors.RemoteProtocolError` naming what was wrong, and never anything else.

The streams are real: each member's schedule builds its frames, and the bytes travel to
its successor's reader in chunks of a chosen size."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmtrain.errors import RemoteProtocolError, TruncatedFrame
from swarmtrain.wire.ring import (
    CHECKED_BYTES,
    CODEC_FP16,
    CODEC_FP32,
    CODEC_INT8,
    HEADER,
    KIND_ALL_REDUCE,
    AllReduceSchedule,
    BroadcastSchedule,
    FrameReader,
    RingDesync,
    Schedule,
    ScratchBuffers,
)

pytestmark = pytest.mark.timeout(120)

SEGMENT = 64  # bytes: several frames per chunk even for small arrays


def _inputs(world: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


def _schedules(xs: list[np.ndarray], codec: int, **options: object) -> list[Schedule]:
    return [AllReduceSchedule(seq=3, kind=KIND_ALL_REDUCE, rank=r, world=len(xs), flat=x, codec=codec,
                              segment_bytes=SEGMENT, buffers=ScratchBuffers(SEGMENT), **options)  # type: ignore[arg-type]
            for r, x in enumerate(xs)]


def run_streams(schedules: list[Schedule], chunk: int) -> list[bytes]:
    """Run one collective, member r's frames going to member r+1 as a byte stream that its
    :class:`FrameReader` is fed `chunk` bytes at a time. Returns what each member received."""
    world = len(schedules)
    readers = [FrameReader(s) for s in schedules]
    outs = [s.outgoing() for s in schedules]
    want_out = [next(o, None) for o in outs]
    inbox = [collections.deque[bytes]() for _ in range(world)]
    pending = [bytearray() for _ in range(world)]
    streams = [bytearray() for _ in range(world)]
    while any(r.frame is not None for r in readers) or any(f is not None for f in want_out):
        progress = False
        for r, sched in enumerate(schedules):
            while (frame := want_out[r]) is not None and frame.after <= readers[r].frames:
                header, payload = sched.build(frame)
                data = bytes(header) + bytes(payload)
                inbox[(r + 1) % world].append(data)
                streams[(r + 1) % world] += data
                want_out[r] = next(outs[r], None)
                progress = True
            while inbox[r]:
                pending[r] += inbox[r].popleft()
            if pending[r] and readers[r].frame is not None:
                piece, pending[r] = bytes(pending[r][:chunk]), pending[r][chunk:]
                readers[r].feed(piece)
                progress = True
        assert progress, "deadlock"
    assert not any(pending) and not any(inbox)
    return [bytes(s) for s in streams]


@pytest.mark.parametrize("codec", [CODEC_FP32, CODEC_FP16, CODEC_INT8])
@pytest.mark.parametrize("world,n", [(2, 1), (2, 37), (3, 50), (4, 101)])
def test_byte_at_a_time_gives_the_same_all_reduce_as_whole_frames(codec: int, world: int, n: int) -> None:
    base = _inputs(world, n, seed=world * 100 + n)
    whole = [x.copy() for x in base]
    run_streams(_schedules(whole, codec, mean=True), chunk=1 << 20)
    bytewise = [x.copy() for x in base]
    run_streams(_schedules(bytewise, codec, mean=True), chunk=1)
    for a, b in zip(whole, bytewise, strict=True):
        assert np.array_equal(a, b)  # the same bits
    assert all(np.array_equal(x, whole[0]) for x in whole)  # on every member
    tol = {CODEC_FP32: 1e-6, CODEC_FP16: 1e-2, CODEC_INT8: 0.1}[codec]
    assert np.allclose(whole[0], np.mean(base, axis=0), atol=tol, rtol=0)


def test_byte_at_a_time_broadcast() -> None:
    import torch

    world, root = 3, 1
    tensors = [torch.arange(300, dtype=torch.int16) * (r == root) for r in range(world)]
    schedules: list[Schedule] = [BroadcastSchedule(seq=1, rank=r, world=world, tensor=tensors[r], root=root,
                                                   segment_bytes=SEGMENT) for r in range(world)]
    run_streams(schedules, chunk=1)
    assert all(torch.equal(t, torch.arange(300, dtype=torch.int16)) for t in tensors)


def _recorded(world: int = 2, n: int = 40, codec: int = CODEC_FP32) -> tuple[list[np.ndarray], bytes]:
    """Member 1's inputs and the exact stream member 1 receives in a sound all-reduce."""
    base = _inputs(world, n, seed=5)
    streams = run_streams(_schedules([x.copy() for x in base], codec), chunk=1 << 20)
    return base, streams[1]


def _fresh_reader(base: list[np.ndarray], codec: int = CODEC_FP32) -> tuple[FrameReader, np.ndarray]:
    flat = base[1].copy()
    sched = AllReduceSchedule(seq=3, kind=KIND_ALL_REDUCE, rank=1, world=len(base), flat=flat, codec=codec,
                              segment_bytes=SEGMENT, buffers=ScratchBuffers(SEGMENT))
    return FrameReader(sched), flat


def _header_offsets(stream: bytes, base: list[np.ndarray], codec: int) -> list[int]:
    """Where each frame of `stream` starts."""
    reader, _ = _fresh_reader(base, codec)
    starts, pos = [], 0
    while reader.frame is not None:
        starts.append(pos)
        size = reader.remaining
        reader.feed(stream[pos : pos + size])
        pos += size
    assert pos == len(stream)
    return starts


def test_a_replayed_stream_gives_the_result_the_member_had() -> None:
    base, stream = _recorded()
    reader, flat = _fresh_reader(base)
    assert reader.feed(stream) == reader.frames > 0 and reader.frame is None
    assert reader.end_of_stream() is None
    assert np.allclose(flat, base[0] + base[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("field", "offset", "value"), [
    ("seq", 0, 0xFF), ("kind", 4, 9), ("codec", 5, 2), ("step", 6, 7), ("segment", 8, 5),
    ("nbytes", 12, 0x7F)])
def test_a_wrong_header_field_is_a_desync_naming_the_field(field: str, offset: int, value: int) -> None:
    base, stream = _recorded()
    bad = bytearray(stream)
    bad[offset] = value
    reader, flat = _fresh_reader(base)
    before = flat.copy()
    with pytest.raises(RingDesync, match=f"desynchronised ring: frame has {field} ") as info:
        reader.feed(bad)
    assert info.value.code == "ring_desync" and info.value.step == 0
    assert np.array_equal(flat, before)  # refused before a value was added
    with pytest.raises(RingDesync):  # and for good
        reader.feed(b"")
        reader.buffers()


def test_bytes_past_the_last_frame_are_refused() -> None:
    base, stream = _recorded()
    reader, _ = _fresh_reader(base)
    with pytest.raises(RemoteProtocolError, match="after the collective's last frame") as info:
        reader.feed(stream + b"\0")
    assert info.value.code == "ring_trailing_bytes"


def test_a_stream_ending_inside_a_frame_is_a_truncated_frame() -> None:
    base, stream = _recorded()
    reader, _ = _fresh_reader(base)
    reader.feed(stream[: HEADER.size + 3])
    err = reader.end_of_stream()
    assert isinstance(err, TruncatedFrame) and err.code == "truncated_frame"
    assert f"after {HEADER.size + 3} of the" in str(err) and "ring frame 0/0" in str(err)


_BASE, _STREAM = _recorded(world=3, n=61, codec=CODEC_INT8)
_HEADER_OF = {s + k: s for s in _header_offsets(_STREAM, _BASE, CODEC_INT8) for k in range(CHECKED_BYTES)}
_CHECKED = set(_HEADER_OF)  # the stream's header bytes that the receiver knows in advance


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(_STREAM)), max_size=30))
def test_any_split_gives_the_same_result(cuts: list[int]) -> None:
    whole, want = _fresh_reader(_BASE, CODEC_INT8)
    whole.feed(_STREAM)
    reader, got = _fresh_reader(_BASE, CODEC_INT8)
    bounds = [0, *sorted(cuts), len(_STREAM)]
    for a, b in zip(bounds, bounds[1:]):
        reader.feed(_STREAM[a:b])
    assert reader.frame is None and np.array_equal(got, want)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(min_value=0, max_value=len(_STREAM)),
       flips=st.dictionaries(st.integers(min_value=0, max_value=len(_STREAM) - 1),
                             st.integers(min_value=1, max_value=255), max_size=4),
       tail=st.binary(max_size=8), chunk=st.integers(min_value=1, max_value=200))
def test_truncated_or_corrupted_streams_raise_protocol_errors_only(
        cut: int, flips: dict[int, int], tail: bytes, chunk: int) -> None:
    data = bytearray(_STREAM)
    for pos, xor in flips.items():
        data[pos] ^= xor
    data = data[:cut] + tail
    reader, _ = _fresh_reader(_BASE, CODEC_INT8)
    error: RemoteProtocolError | None = None
    try:
        for i in range(0, len(data), chunk):
            reader.feed(data[i : i + chunk])
    except RemoteProtocolError as exc:
        error = exc
    else:
        error = reader.end_of_stream()
    total = len(data)
    # a header is checked once it is all in: a changed byte of one, before the cut, is found
    complete = {p for p in _CHECKED if _HEADER_OF[p] + HEADER.size <= total}
    tail_in_a_header = any(cut <= p < total for p in _CHECKED)  # the tail may read as a bad header
    allowed: tuple[type, ...] = (RingDesync,) if tail_in_a_header else ()
    if any(pos in complete and pos < cut for pos in flips):
        assert isinstance(error, RingDesync), error
    elif total < len(_STREAM):
        assert isinstance(error, TruncatedFrame | RingDesync), error
    elif total == len(_STREAM):
        assert error is None or isinstance(error, allowed), error  # payload and scale bytes are values
    else:
        trailing = error is not None and error.code == "ring_trailing_bytes"
        assert trailing or isinstance(error, allowed), error
