"""Frames: encoding messages to bytes and an incremental, sans-IO decoder.

Frame layout (all integers little-endian)::

    offset size field
    0      4    magic          b"SWRM"
    4      1    version        PROTOCOL_VERSION
    5      1    type           MsgType
    6      2    flags          0 (reserved; any set bit is refused)
    8      4    header_length  bytes of msgpack header that follow
    12     8    payload_length bytes of raw tensor payload after the header
    20     H    header         msgpack map {"f": {fields}, "t": [[name, dtype, shape, offset, nbytes], ...]}
    20+H   P    payload        tensor bytes, each at a multiple of 64

The decoder can be fed bytes in any split (``feed``), or lend its own buffers to the
caller for zero-copy receives (``get_buffer``/``buffer_updated``, the shape of
``asyncio.BufferedProtocol``): the payload is received straight into the bytearray the
tensors are then built over.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from swarmtrain.errors import LocalProtocolError, RemoteProtocolError, TruncatedFrame
from swarmtrain.wire.measure import WINDOW as MEASURE_FROM
from swarmtrain.wire.measure import MeasuredTensors, PayloadMeasure
from swarmtrain.wire.messages import Message, MsgType, OutOfRange, message_from_fields
from swarmtrain.wire.pool import PAYLOADS
from swarmtrain.wire.tensors import layout_tensors, rebuild_tensors

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "PREAMBLE",
    "Limits",
    "encode",
    "encode_bytes",
    "DECODER_TRANSITIONS",
    "Decoder",
    "DecoderState",
    "looks_like_tls",
]

MAGIC = b"SWRM"
PROTOCOL_VERSION = 2
PREAMBLE = struct.Struct("<4sBBHIQ")


@dataclass(frozen=True)
class Limits:
    """Caps on what one frame may carry; a frame over any cap is refused before allocation."""

    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 1 << 30
    max_tensors: int = 16384


DEFAULT_LIMITS = Limits()


def _informational(obj: Any) -> Any:
    """``obj`` with every int msgpack cannot carry turned into a float (for STATUS only)."""
    if isinstance(obj, dict):
        return {k: _informational(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_informational(v) for v in obj]
    if isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
        return float(obj)
    return obj


def _pack_header(msg: Message, descs: list[Any]) -> bytes:
    try:
        return msgpack.packb({"f": msg.fields(), "t": descs}, use_bin_type=True)
    except OverflowError:
        if msg.TYPE != MsgType.STATUS:
            raise LocalProtocolError("unencodable",
                                     f"{msg.TYPE.name} has an int msgpack cannot carry") from None
        # a status is informational: a counter past 2^64 goes as a float rather than not at all
        return msgpack.packb({"f": _informational(msg.fields()), "t": descs}, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(
            "unencodable", f"{msg.TYPE.name} has a field msgpack cannot carry: {exc}"
        ) from exc


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS) -> list[bytes | memoryview]:
    """Encode ``msg`` as a list of buffers to write back to back (tensor memory is not copied).

    Raises:
        LocalProtocolError: the message cannot be carried (bad dtype, over a limit...).
    """
    descs, segments, payload_len = layout_tensors(msg.tensor_map())
    if len(descs) > limits.max_tensors:
        raise LocalProtocolError("too_many_tensors", f"{len(descs)} tensors > {limits.max_tensors}")
    header = _pack_header(msg, [d.to_wire() for d in descs])
    if len(header) > limits.max_header_bytes:
        raise LocalProtocolError(
            "oversize_header", f"header of {len(header)} bytes > limit {limits.max_header_bytes}"
        )
    if payload_len > limits.max_payload_bytes:
        raise LocalProtocolError(
            "oversize_payload", f"payload of {payload_len} bytes > limit {limits.max_payload_bytes}"
        )
    pre = PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, int(msg.TYPE), 0, len(header), payload_len)
    return [pre + header, *segments]


def encode_bytes(msg: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Encode ``msg`` into one bytes object (convenient for tests and small messages)."""
    return b"".join(encode(msg, limits))


class DecoderState(Enum):
    """What a :class:`Decoder` is waiting for: the preamble of a frame, its header, its
    payload; or nothing ever again (``BROKEN``: the stream cannot be resynchronised)."""

    PREAMBLE = "preamble"
    HEADER = "header"
    PAYLOAD = "payload"
    BROKEN = "broken"


#: every legal move of a decoder (a frame with an empty payload passes through PAYLOAD too)
DECODER_TRANSITIONS: dict[DecoderState, frozenset[DecoderState]] = {
    DecoderState.PREAMBLE: frozenset({DecoderState.HEADER, DecoderState.BROKEN}),
    DecoderState.HEADER: frozenset({DecoderState.PAYLOAD, DecoderState.BROKEN}),
    DecoderState.PAYLOAD: frozenset({DecoderState.PREAMBLE, DecoderState.BROKEN}),
    DecoderState.BROKEN: frozenset(),
}


def looks_like_tls(prefix: bytes) -> bool:
    """True if a stream starting with ``prefix`` is TLS (a handshake or alert record), i.e.
    the other side has TLS on and this one has it off."""
    return prefix[:2] in (b"\x16\x03", b"\x15\x03")


class Decoder:
    """Incremental frame decoder; no I/O.

    After a :class:`RemoteProtocolError` the stream cannot be resynchronised: the decoder
    stays broken and every later call raises the same error. The exception is a sound frame
    whose message has a field out of range (:class:`OutOfRange`, outside the handshake): it
    is dropped, kept for :meth:`next_refusal`, and decoding goes on.

    Frames of the types in ``measure`` (GRADIENTS by default) with a payload of at least
    :data:`~swarmtrain.wire.measure.WINDOW` bytes have the sums of squares of their float
    tensors taken while the payload arrives, in cache
    (:mod:`swarmtrain.wire.measure`): their message's ``tensors`` is then a
    :class:`~swarmtrain.wire.measure.MeasuredTensors` holding them.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS,
                 measure: Collection[MsgType] = (MsgType.GRADIENTS,)) -> None:
        self.limits = limits
        self._measure_types = frozenset(measure)
        self._measure: PayloadMeasure | None = None
        self._ready: deque[Message] = deque()
        #: well-framed messages dropped for a field out of range (the stream went on)
        self.refused: deque[OutOfRange] = deque(maxlen=256)
        self._error: RemoteProtocolError | None = None
        self._state = DecoderState.PREAMBLE
        self._buf = bytearray(PREAMBLE.size)
        self._filled = 0
        self._mtype = MsgType.HEARTBEAT
        self._header_len = 0
        self._payload_len = 0
        self._fields: dict[str, Any] = {}
        self._descs: list[Any] = []
        #: the payload buffer of the frame in progress exists (it is made on demand, by the
        #: first :meth:`get_buffer` after the header: a receiver may first wait for room)
        self._payload_made = True
        self.bytes_received = 0

    @property
    def state(self) -> DecoderState:
        """What the decoder waits for (see :class:`DecoderState`)."""
        return self._state

    def _move(self, to: DecoderState) -> None:
        """The one way the state changes.

        Raises:
            LocalProtocolError: ``illegal_transition``: `to` is not reachable from here (a bug).
        """
        if to not in DECODER_TRANSITIONS[self._state]:
            raise LocalProtocolError("illegal_transition",
                                     f"decoder: no transition from {self._state.name} to {to.name}")
        self._state = to

    def _start(self, state: DecoderState, buf: bytearray) -> None:
        self._move(state)
        self._buf = buf
        self._filled = 0

    def _fail(self, exc: RemoteProtocolError) -> RemoteProtocolError:
        self._error = exc
        self._move(DecoderState.BROKEN)
        return exc

    # -- the two ways of getting bytes in --------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes received from the peer (any split). Raises RemoteProtocolError."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            target = self.get_buffer()
            n = min(target.nbytes, view.nbytes)
            target[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable view of exactly the bytes the decoder needs next (the payload's buffer
        is allocated here, the first time it is asked for)."""
        if self._error is not None:
            raise self._error
        if not self._payload_made:
            self._buf = PAYLOADS.take(self._payload_len)  # (a large one used before, if idle)
            self._payload_made = True
        return memoryview(self._buf)[self._filled :]

    @property
    def awaiting_payload(self) -> int:
        """Payload bytes of the frame in progress whose buffer is not allocated yet: its header
        is decoded and no payload byte is taken (0 otherwise). A receiver that bounds what it
        holds can wait here, before any of those bytes are read, for room to take them."""
        return 0 if self._payload_made else self._payload_len

    @property
    def frame_type(self) -> MsgType:
        """The message type of the frame in progress (once its preamble is decoded)."""
        return self._mtype

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the last buffer from :meth:`get_buffer`."""
        if self._error is not None:
            raise self._error
        self._filled += nbytes
        self.bytes_received += nbytes
        if self._measure is not None and self._state is DecoderState.PAYLOAD:
            self._measure.advance(self._buf, self._filled)
        while self._filled == len(self._buf) and self._error is None and self._payload_made:
            self._advance()

    # -- state machine ----------------------------------------------------------------------

    def _advance(self) -> None:
        if self._state is DecoderState.PREAMBLE:
            self._parse_preamble()
        elif self._state is DecoderState.HEADER:
            self._parse_header()
        else:
            self._finish()

    def _parse_preamble(self) -> None:
        magic, version, mtype, flags, hlen, plen = PREAMBLE.unpack(self._buf)
        if magic != MAGIC:
            if looks_like_tls(bytes(magic)):
                raise self._fail(RemoteProtocolError(
                    "bad_magic", "the peer speaks TLS but this node has TLS off: set [security] "
                    "tls_cert, tls_key and tls_ca here too (see docs/tls.md)"))
            raise self._fail(RemoteProtocolError(
                "bad_magic", f"frame starts with {bytes(magic)!r}, not {MAGIC!r}: not a swarmtrain peer?"
            ))
        if version != PROTOCOL_VERSION:
            raise self._fail(RemoteProtocolError(
                "unsupported_version",
                f"peer speaks protocol version {version}, this node speaks {PROTOCOL_VERSION}: "
                "run the same swarmtrain release on every machine",
            ))
        try:
            self._mtype = MsgType(mtype)
        except ValueError:
            raise self._fail(RemoteProtocolError("unknown_type", f"unknown message type {mtype}")) from None
        if flags:
            raise self._fail(RemoteProtocolError("bad_flags", f"reserved flags set: {flags:#x}"))
        if hlen > self.limits.max_header_bytes:
            raise self._fail(RemoteProtocolError(
                "oversize_header", f"header of {hlen} bytes > limit {self.limits.max_header_bytes}"
            ))
        if plen > self.limits.max_payload_bytes:
            raise self._fail(RemoteProtocolError(
                "oversize_payload", f"payload of {plen} bytes > limit {self.limits.max_payload_bytes}"
            ))
        if hlen == 0:
            raise self._fail(RemoteProtocolError("bad_header", "frame has an empty header"))
        self._header_len, self._payload_len = hlen, plen
        self._start(DecoderState.HEADER, bytearray(hlen))

    def _parse_header(self) -> None:
        try:
            obj = msgpack.unpackb(
                self._buf, raw=False, strict_map_key=True, use_list=True
            )
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
            err = RemoteProtocolError("bad_header", f"header is not valid msgpack: {exc}")
            raise self._fail(err) from None
        if not (isinstance(obj, dict) and isinstance(obj.get("f"), dict) and isinstance(obj.get("t"), list)):
            raise self._fail(RemoteProtocolError(
                "bad_header", "header must be a map with 'f' (fields map) and 't' (tensor list)"
            ))
        if len(obj["t"]) > self.limits.max_tensors:
            raise self._fail(RemoteProtocolError(
                "too_many_tensors", f"frame carries {len(obj['t'])} tensors; limit {self.limits.max_tensors}"
            ))
        self._fields, self._descs = obj["f"], obj["t"]
        # (a payload under a window is in cache anyway when the coordinator reads it: the
        # plan would cost more than it saves)
        self._measure = (PayloadMeasure.plan(self._descs, self._payload_len)
                         if self._payload_len >= MEASURE_FROM and self._mtype in self._measure_types
                         else None)
        self._start(DecoderState.PAYLOAD, bytearray())
        if self._payload_len == 0:
            self._finish()
        else:
            self._payload_made = False  # allocated by the next get_buffer()

    def _finish(self) -> None:
        payload = self._buf
        measure, self._measure = self._measure, None
        try:
            tensors = rebuild_tensors(self._descs, payload, self.limits.max_tensors)
            if measure is not None:
                tensors = MeasuredTensors(tensors, measure.sums())
            msg = message_from_fields(self._mtype, self._fields, tensors)
        except OutOfRange as exc:
            if exc.fatal:
                raise self._fail(exc) from None
            # a sound frame with a value out of range: dropped, the stream goes on
            self.refused.append(exc)
            self._start(DecoderState.PREAMBLE, bytearray(PREAMBLE.size))
            return
        except RemoteProtocolError as exc:
            raise self._fail(exc) from None
        except (TypeError, ValueError) as exc:
            raise self._fail(RemoteProtocolError("bad_message", f"{self._mtype.name}: {exc}")) from None
        self._ready.append(msg)
        self._start(DecoderState.PREAMBLE, bytearray(PREAMBLE.size))

    # -- output ----------------------------------------------------------------------------

    def next_message(self) -> Message | None:
        """The next complete message, or None if more bytes are needed."""
        return self._ready.popleft() if self._ready else None

    def next_refusal(self) -> OutOfRange | None:
        """The next message dropped for a field out of range (:class:`OutOfRange`), if any."""
        return self.refused.popleft() if self.refused else None

    @property
    def mid_frame(self) -> bool:
        """True if some bytes of an unfinished frame have been received."""
        return self._state is not DecoderState.PREAMBLE or self._filled > 0

    def end_of_stream(self) -> TruncatedFrame | None:
        """The stream has ended: the ``truncated_frame`` error if it ended inside a frame
        (saying how far in), else None. Messages already complete stay available."""
        if self._error is not None or not self.mid_frame:
            return None
        if self._state is DecoderState.PREAMBLE:
            where = f"{self._filled} of the {PREAMBLE.size} preamble bytes"
        elif self._state is DecoderState.HEADER:
            where = f"{self._filled} of the {self._header_len} header bytes of a {self._mtype.name} frame"
        else:
            where = f"{self._filled} of the {self._payload_len} payload bytes of a {self._mtype.name} frame"
        err = TruncatedFrame(f"the stream ended inside a frame, after {where}")
        self._fail(err)
        return err
