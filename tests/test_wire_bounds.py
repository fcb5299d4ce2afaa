"""Every number a peer sends is bounded at the wire (issue #17, must-have 2): each header
field of each message type has a declared range, a value outside it is refused with the
typed ``out_of_range`` error, the stream goes on after the refused message (outside the
handshake), and docs/protocol.md lists the bounds the code declares."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.errors import RemoteProtocolError
from swarmtrain.wire import Decoder, Gradients, Limits, MsgType, Status, encode_bytes
from swarmtrain.wire.frame import PREAMBLE
from swarmtrain.wire.messages import (
    DEFAULT_BOUNDS,
    HANDSHAKE_TYPES,
    MAX_INT,
    MESSAGE_CLASSES,
    Bound,
    Message,
    OutOfRange,
    bound_of,
)

_DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
#: big enough for a 1 MiB string field and a 2^16-item list
_WIDE = Limits(max_header_bytes=1 << 24, max_payload_bytes=0, max_tensors=0)


def _fields(cls: type[Message]) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, typing.get_origin(hints[f.name]) or hints[f.name])
            for f in dataclasses.fields(cls) if f.name != "tensors"]


def _valid(cls: type[Message]) -> dict[str, Any]:
    """Header fields of a ``cls`` message with every value in range (lowest allowed)."""
    out: dict[str, Any] = {}
    for name, typ in _fields(cls):
        b = bound_of(cls, name)
        if typ is int:
            out[name] = int(max(b.lo, 0)) if b is not None and b.lo is not None else 0
        elif typ is float:
            out[name] = max(float(b.lo), 0.0) if b is not None and b.lo is not None else 0.0
        else:
            out[name] = {str: "", bytes: b"", bool: False, list: [], dict: {}}[typ]
    return out


def _decode(cls: type[Message], fields: dict[str, Any]) -> Message:
    msg = cls(**fields)
    for name, value in fields.items():  # as sent, even where building one would cut a text
        object.__setattr__(msg, name, value)
    dec = Decoder(_WIDE)
    dec.feed(encode_bytes(msg, _WIDE))
    got = dec.next_message()
    if got is None:
        refusal = dec.next_refusal()
        assert refusal is not None, "a message that is neither delivered nor refused"
        raise refusal
    return got


def _past(b: Bound, typ: type) -> list[Any]:
    """Values just outside ``b`` for a field of type ``typ``."""
    if typ in (int, float):
        vals: list[Any] = []
        if b.hi is not None:
            vals.append(int(b.hi) + 1 if typ is int else b.hi * 1.5)
        if b.lo is not None:
            vals.append(int(b.lo) - 1 if typ is int else (b.lo - 1.0 if b.lo == 0 else b.lo * 1.5))
        if typ is float:
            vals += [math.inf, -math.inf] + ([] if b.nan_ok else [math.nan])
        return vals
    assert b.max_len is not None
    n = b.max_len + 1
    if typ is dict:
        return [{str(i): 0 for i in range(n)}]
    return [{str: "x" * n, bytes: b"x" * n, list: [0] * n}[typ]]


_CASES = [(mtype, name, typ) for mtype, cls in MESSAGE_CLASSES.items() for name, typ in _fields(cls)
          if typ is not bool]


def test_every_int_and_float_field_of_every_message_has_a_bound() -> None:
    for mtype, name, typ in _CASES:
        b = bound_of(MESSAGE_CLASSES[mtype], name)
        assert b is not None, (mtype.name, name)
        if typ in (int, float):
            assert b.lo is not None and b.hi is not None, (mtype.name, name)
            assert -MAX_INT <= b.lo and b.hi <= MAX_INT or typ is float, (mtype.name, name)
        else:
            assert b.max_len is not None, (mtype.name, name)


@pytest.mark.parametrize(("mtype", "name", "typ"), _CASES, ids=[f"{m.name}.{n}" for m, n, _ in _CASES])
def test_a_value_past_each_bound_is_refused_with_its_code(mtype: MsgType, name: str, typ: type) -> None:
    cls = MESSAGE_CLASSES[mtype]
    b = bound_of(cls, name)
    assert b is not None
    base = _valid(cls)
    assert isinstance(_decode(cls, base), cls)  # the lowest values are in range
    if typ in (int, float) and b.hi is not None:  # and so is the highest
        top = _decode(cls, {**base, name: typ(b.hi)})
        assert getattr(top, name) == b.hi
    for value in _past(b, typ):
        with pytest.raises(OutOfRange) as info:
            _decode(cls, {**base, name: value})
        err = info.value
        assert err.code == "out_of_range" and isinstance(err, RemoteProtocolError)
        assert err.field == name and err.message_type == mtype
        assert err.bound == b.describe() and err.bound in str(err) and mtype.name in str(err)
        assert len(err.value) <= 40  # shortened: a 1 MiB string is not echoed
        assert err.fatal == (mtype in HANDSHAKE_TYPES)


def test_error_texts_are_cut_where_they_are_built() -> None:
    """What a remote side sends ends up in log lines: an honest node never sends a text the
    wire refuses, however long the exception behind it."""
    from swarmtrain.wire import CheckpointMsg, Error, StageError
    from swarmtrain.wire.messages import MAX_TEXT

    for msg in (Error(code="x", message="m" * 100_000), StageError(req=1, code="x", message="m" * 100_000),
                CheckpointMsg(ok=False, message="m" * 100_000)):
        got = _decode(type(msg), msg.fields())
        assert len(got.fields()["message"]) == MAX_TEXT and got == msg


def test_list_items_are_bounded_where_declared() -> None:
    from swarmtrain.wire import Assign

    with pytest.raises(OutOfRange, match=r"shards\[1\]"):
        _decode(Assign, {"shards": [0, 2**31], "num_shards": 4})
    assert _decode(Assign, {"shards": [0, 3], "num_shards": 4}) == Assign(shards=[0, 3], num_shards=4)


def test_the_issue_values_are_refused() -> None:
    """#17: samples 2^64-1, msg_id 2^64-1 and loss -1e300 all got through."""
    base = dict(msg_id=1, version=0, samples=32, loss=1.0, codecs={})
    for change in ({"samples": 2**64 - 1}, {"msg_id": 2**64 - 1}, {"loss": -1e300}, {"samples": -1},
                   {"version": 2**63}):
        with pytest.raises(OutOfRange):
            _decode(Gradients, {**base, **change})
    # a diverged step's NaN loss goes through: the coordinator refuses it as a gradient
    assert math.isnan(typing.cast(Gradients, _decode(Gradients, {**base, "loss": math.nan})).loss)


def test_the_stream_goes_on_after_a_refused_message() -> None:
    bad = Gradients(msg_id=2**64 - 1, version=0, samples=1, loss=1.0, codecs={})
    good = Gradients(msg_id=7, version=0, samples=1, loss=1.0, codecs={})
    dec = Decoder()
    data = encode_bytes(bad) + encode_bytes(good)
    for i in range(len(data)):  # one byte at a time: every boundary
        dec.feed(data[i:i + 1])
    assert dec.next_message() == good and dec.next_message() is None
    refusal = dec.next_refusal()
    assert refusal is not None and refusal.field == "msg_id" and dec.next_refusal() is None
    assert not dec.mid_frame


def test_a_handshake_message_out_of_range_breaks_the_stream() -> None:
    from swarmtrain.wire import Hello

    dec = Decoder()
    with pytest.raises(OutOfRange):
        dec.feed(encode_bytes(Hello(role="x" * 65, nonce=b"n" * 32)))
    with pytest.raises(OutOfRange):  # the decoder stays broken, as after any malformed frame
        dec.feed(PREAMBLE.pack(b"SWRM", 2, 1, 0, 1, 0))


def test_a_status_always_encodes() -> None:
    """#17: after two gradients of 2^64-1 samples no STATUS could be encoded. Sums are now
    bounded by the field bounds; a STATUS would still carry an impossible counter as a float."""
    status = {"stats": {"samples": 2 * (2**64 - 1), "neg": -(2**70)}, "workers": [{"samples": 2**65}]}
    dec = Decoder()
    dec.feed(encode_bytes(Status(status=status)))
    got = dec.next_message()
    assert isinstance(got, Status)
    assert got.status["stats"]["samples"] == float(2 * (2**64 - 1))
    assert got.status["workers"][0]["samples"] == float(2**65)


# --- docs/protocol.md lists the bounds -----------------------------------------------------


def _doc_section() -> str:
    text = _DOC.read_text()
    start = text.index("## Bounds on field values")
    return text[start:text.index("\n## ", start + 1)]


def test_protocol_doc_lists_every_declared_bound_and_the_defaults() -> None:
    section = _doc_section()
    declared = set(re.findall(r"^\| `([A-Z_]+)` \| `(\w+)` \| (.+?) \|$", section, re.M))
    want = {(mtype.name, name, b.describe()) for mtype, cls in MESSAGE_CLASSES.items()
            for name, b in cls.BOUNDS.items()}
    assert declared == want, "docs/protocol.md: the declared bounds table is stale"
    defaults = set(re.findall(r"^\| `(\w+)` \| ([^|`]+?) \|$", section, re.M))
    assert defaults == {(typ.__name__, b.describe()) for typ, b in DEFAULT_BOUNDS.items()}
    proto = _DOC.read_text()
    errors = proto[proto.index("## Error codes"):]
    assert "| `out_of_range`" in errors
