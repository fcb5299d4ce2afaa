"""Fuzz inputs for live nodes, without I/O: valid frames made hostile, deterministically.

Input ``i`` of campaign seed ``s`` is drawn from ``random.Random(f"{s}:{i}")`` alone
(:func:`make_input`), so any one input can be regenerated and replayed. Mutations are
structure-aware (fields replaced anywhere inside their nesting, tensor descriptors, a
random header) or byte-level (bit flips, truncation, length lies, splices, garbage).
"""

from __future__ import annotations

import itertools
import math
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmtrain.errors import ProtocolError
from swarmtrain.wire import PREAMBLE, Auth, Decoder, Hello, Limits, Message, encode_bytes
from swarmtrain.wire.frame import PROTOCOL_VERSION

__all__ = ["FuzzInput", "Mutator", "Seeds", "Prelude", "delivers", "make_input", "nan_tensor"]

_EXTREME_INTS = [0, -1, 1, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
_DTYPE_NAMES = ["float32", "float16", "bfloat16", "float64", "int8", "uint8", "uint16", "int16",
                "int32", "int64", "bool", "complex64", "float8_e4m3fn", "", "FLOAT32", "float32\x00"]


@dataclass(frozen=True)
class FuzzInput:
    """One input: ``data`` written at ``phase`` (connect / hello / auth) as ``role``."""

    kind: str
    phase: str
    data: bytes
    role: str = ""
    prelude: bytes = b""




def _frame(mtype: int, header: bytes, payload: bytes = b"", *, magic: bytes = b"SWRM",
           version: int = PROTOCOL_VERSION,
           flags: int = 0, hlen: int | None = None, plen: int | None = None) -> bytes:
    return PREAMBLE.pack(magic, version, mtype, flags, len(header) if hlen is None else hlen,
                         len(payload) if plen is None else plen) + header + payload


def _split(frame: bytes) -> tuple[int, dict[str, Any], list[Any], bytes]:
    """A valid frame's type, fields, descriptors and payload."""
    _, _, mtype, _, hlen, _ = PREAMBLE.unpack_from(frame)
    head = msgpack.unpackb(frame[PREAMBLE.size:PREAMBLE.size + hlen], raw=False)
    return mtype, dict(head["f"]), [list(d) for d in head["t"]], frame[PREAMBLE.size + hlen:]


Path = tuple[Any, ...]


def _paths(v: Any, path: Path = ()) -> Iterator[Path]:
    """Every position inside a nested value (list indices and dict keys), ``()`` first."""
    yield path
    if isinstance(v, list):
        for i, e in enumerate(v):
            yield from _paths(e, path + (i,))
    elif isinstance(v, dict):
        for k, e in v.items():
            yield from _paths(e, path + (k,))


def _at(v: Any, path: Path) -> Any:
    for key in path:
        v = v[key]
    return v


def _replace(v: Any, path: Path, new: Any) -> Any:
    """A copy of ``v`` with the node at ``path`` replaced (containers on the way are copied)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(v, list):
        return v[:head] + [_replace(v[head], rest, new)] + v[head + 1:]
    return {**v, head: _replace(v[head], rest, new)}


class Mutator:
    """Turns valid messages into hostile frames, deterministically from ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def value(self, depth: int = 0) -> Any:
        """A random msgpack value: extreme ints, odd floats, long strings, nested containers."""
        r = self.rng
        choice = r.randrange(10 if depth < 2 else 7)
        if choice == 0:
            return r.choice(_EXTREME_INTS)
        if choice == 1:
            return r.choice([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, r.random()])
        if choice == 2:
            return r.choice(["", "x" * r.choice([1, 600, 70000]), "\u0000\ud7ff\U0001f600", "worker"])
        if choice == 3:
            return r.randbytes(r.choice([0, 1, 31, 32, 33, 1000]))
        if choice in (4, 5):
            return r.choice([True, False, None])
        if choice == 6:
            return r.randrange(-1000, 1000)
        if choice == 7:
            return [self.value(depth + 1) for _ in range(r.randrange(5))]
        return {str(self.value(depth + 1))[:40]: self.value(depth + 1) for _ in range(r.randrange(4))}

    def same_type(self, v: Any) -> Any:
        """A hostile value of ``v``'s type: it passes the wire's field type checks and so
        reaches the role's own code."""
        r = self.rng
        if isinstance(v, bool):
            return not v
        if isinstance(v, int):
            return r.choice(_EXTREME_INTS + [v + 1, v - 1, -v])
        if isinstance(v, float):
            return r.choice([math.nan, math.inf, -math.inf, -0.0, 1e308, v * 1e30])
        if isinstance(v, str):
            return r.choice(["", "x" * 600, v + "\x00", v[::-1], "\u202e\U0001f600", v * 50])
        if isinstance(v, bytes):
            return r.randbytes(r.choice([0, 1, 31, 32, 33, 64, 1000]))
        if isinstance(v, list):
            return r.choice([[], v + [self.value()], v[:-1], v * 3])
        if isinstance(v, dict):
            return r.choice([{}, {**v, str(self.value())[:20]: self.value()}])
        return self.value()

    def poke(self, v: Any) -> Any:
        """``v`` with one node of its nesting, chosen uniformly (``v`` itself included),
        replaced by :meth:`same_type` or :meth:`value`."""
        path = self.rng.choice(list(itertools.islice(_paths(v), 500)))
        new = _at(v, path)
        return _replace(v, path, self.same_type(new) if self.rng.random() < 0.5 else self.value())

    def bytes_level(self, frame: bytes) -> tuple[str, bytes]:
        """Bit flips, truncation, length lies, duplication, garbage before or after."""
        r, b = self.rng, bytearray(frame)
        op = r.randrange(6)
        if op == 0:
            for _ in range(r.randint(1, 8)):
                i = r.randrange(len(b))
                b[i] ^= 1 << r.randrange(8)
            return "bitflip", bytes(b)
        if op == 1:
            return "truncate", bytes(b[:r.randrange(len(b))])
        if op == 2:
            off, fmt = r.choice([(8, "<I"), (12, "<Q")])
            lie = r.choice([0, 1, len(b), len(b) * 2, 2**32 - 1 if fmt == "<I" else 2**64 - 1,
                            r.randrange(1 << 20)])
            struct.pack_into(fmt, b, off, lie)
            return "length_lie", bytes(b)
        if op == 3:
            i = r.randrange(len(b))
            return "splice", bytes(b[:i] + b[r.randrange(len(b)):])
        if op == 4:
            pre = r.choice([b"SWR", b"GET / HTTP/1.1\r\n\r\n", b"SSH-2.0-x\r\n",
                            r.randbytes(r.randrange(64))])
            return "garbage_prefix", pre + bytes(b)
        return "preamble", PREAMBLE.pack(r.choice([b"SWRM", b"SWRN", b"\0\0\0\0"]), r.choice([0, 1, 2, 255]),
                                         r.randrange(256), r.choice([0, 0, 1, 0x8000]),
                                         *struct.unpack_from("<IQ", b, 8)) + bytes(b[PREAMBLE.size:])

    def structure_level(self, frame: bytes) -> tuple[str, bytes]:
        """Mutate fields or tensor descriptors and rebuild a frame with honest lengths."""
        r = self.rng
        mtype, fields, descs, payload = _split(frame)
        # weights: most mutations keep the frame well-formed so that they reach the roles
        ops = ["field", "drop_field", "descriptor", "random_header", "type_swap"]
        kind = r.choices(ops, [8, 2, 5, 2, 2])[0]
        op = ops.index(kind)
        if op == 0 and fields:
            name = r.choice(sorted(fields))
            fields[name] = self.poke(fields[name])
        elif op == 1 and fields:
            del fields[r.choice(sorted(fields))]
        elif op == 2 and descs:
            d = r.choice(descs)
            i = r.randrange(6)
            if i == 5:
                descs.append(list(d))  # duplicate name
            else:
                d[i] = {0: lambda: r.choice(["", "x" * 600, 7, d[0] + "/x"]),
                        1: lambda: r.choice(_DTYPE_NAMES),
                        2: lambda: r.choice([[-1], [2**63], [1] * 17, [10**6, 10**6], "shape", [0]]),
                        3: lambda: r.choice([-1, 1, 3, len(payload), len(payload) + 64, 2**63]),
                        4: lambda: r.choice([0, -4, d[4] + 1, d[4] * 2, 2**64 - 1])}[i]()
        elif op == 3:
            fields = {str(self.value())[:20]: self.value() for _ in range(r.randrange(6))}
        else:
            mtype = r.randrange(256)
        head = msgpack.packb({"f": fields, "t": descs}, use_bin_type=True)
        return kind, _frame(mtype, head, payload)

    def mutate(self, msg: Message) -> tuple[str, bytes]:
        """One mutation of ``msg``: structure-aware or byte-level, sometimes both."""
        frame = encode_bytes(msg)
        op = self.rng.randrange(4)
        if op == 0:
            return self.bytes_level(frame)
        kind, out = self.structure_level(frame)
        if op == 3:
            kind2, out = self.bytes_level(out)
            kind = f"{kind}+{kind2}"
        return kind, out

    def noise(self) -> tuple[str, bytes]:
        """Random bytes, or a frame of a random type with a random msgpack header."""
        r = self.rng
        if r.random() < 0.5:
            return "random_bytes", r.randbytes(r.randrange(1, 300))
        head = msgpack.packb({"f": {str(k): self.value() for k in range(r.randrange(4))},
                              "t": [] if r.random() < 0.7 else [self.value()]}, use_bin_type=True)
        return "random_frame", _frame(r.randrange(256), head, r.randbytes(r.choice([0, 64])))


Seeds = Callable[[random.Random], list[Message]]
"""The valid messages a target's inputs are mutated from (may draw on the rng)."""
Prelude = Callable[[random.Random], bytes]
"""Valid frames sent after authentication and before the input (e.g. a REGISTER)."""


def make_input(seed: int, index: int, role: str, seeds: Seeds, prelude: Prelude | None = None,
               forbid: tuple[type[Message], ...] = ()) -> FuzzInput:
    """Input ``index`` of campaign ``seed``: a function of those two numbers alone.

    An input after authentication that would deliver a well-formed message of a ``forbid``
    type (an operator's legitimate SHUTDOWN, say) is drawn again from the next sub-seed.
    """
    for attempt in itertools.count():
        inp = _draw_input(random.Random(f"{seed}:{index}" + (f":{attempt}" if attempt else "")),
                          role, seeds, prelude)
        if not (forbid and inp.phase == "auth" and delivers(inp.prelude + inp.data, forbid)):
            return inp
    raise AssertionError("unreachable")


def delivers(data: bytes, types: tuple[type[Message], ...]) -> bool:
    """Whether a node decoding ``data`` (leniently: any frame a stricter node decodes, this
    decodes too) gets a message of one of ``types`` before the stream goes bad."""
    dec = Decoder(Limits(max_header_bytes=1 << 30, max_payload_bytes=1 << 30, max_tensors=1 << 20))
    try:
        dec.feed(data)
        while (msg := dec.next_message()) is not None:
            if isinstance(msg, types):
                return True
    except ProtocolError:
        pass
    return False


def _draw_input(rng: random.Random, role: str, seeds: Seeds, prelude: Prelude | None) -> FuzzInput:
    m = Mutator(rng)
    where = rng.random()
    if where < 0.2:  # before authentication: garbage or a mutated HELLO / AUTH
        kind, data = m.noise() if rng.random() < 0.4 else m.mutate(Hello(role=role, nonce=rng.randbytes(32)))
        return FuzzInput(f"pre:{kind.split('+')[0]}", "connect", data)
    if where < 0.3:
        kind, data = m.noise() if rng.random() < 0.3 else m.mutate(Auth(proof=rng.randbytes(32)))
        return FuzzInput(f"hello:{kind.split('+')[0]}", "hello", data, role=role)
    pre = prelude(rng) if prelude is not None and rng.random() < 0.7 else b""
    if rng.random() < 0.1:
        kind, data = m.noise()
    else:
        msg = rng.choice(seeds(rng))
        kind, data = m.mutate(msg) if rng.random() < 0.85 else ("valid", encode_bytes(msg))
        kind = f"{msg.TYPE.name.lower()}:{kind.split('+')[0]}"
    return FuzzInput(f"post:{kind}", "auth", data, role=role, prelude=pre)


def nan_tensor(rng: random.Random, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random tensor with one NaN or infinite element."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))).to(dtype)
    flat = t.view(-1)
    if flat.numel():
        flat[rng.randrange(flat.numel())] = rng.choice([math.nan, math.inf, -math.inf])
    return t
