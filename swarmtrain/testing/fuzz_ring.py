"""Fuzz a peer's ring listener and a ring group that claims a link from it.

The ring port does not speak the framed transport: its handshake is raw (see
:mod:`swarmtrain.wire.handshake`: MAGIC and a nonce, the listener's nonce and proof, the client's
proof and announcement ``epoch u64, from_rank u32, len u16, ring_id``, a status byte) and
then the link carries ring frames (:mod:`swarmtrain.wire.ring`). Each input is one
connection to the listener under fuzz, ``L``, from its own loopback address, that goes wrong
at one point:

- ``pre``: the opening is hostile: a wrong or truncated MAGIC, a TLS or HTTP client, noise;
- ``hello``: a valid opening, then a truncated proof or silence;
- ``announce``: a wrong, zero, reflected or short proof, or an announcement with an
  oversize or lying ring_id length, a ring_id that is not UTF-8, extreme epochs and ranks,
  garbage after it;
- ``ring``: a member input. A real :class:`~swarmtrain.roles.peer.ring.RingGroup` of two members
  (this node is rank 1 on ``L``; rank 0's listener is the fuzzer's ``F``) waits to claim
  rank 0's link and runs an all-reduce. The fuzzer completes the real handshake as rank 0
  (or announces a wrong epoch or rank) and sends ring frames, valid or mutated: header
  fields (seq, kind, codec, step, segment, a huge payload length, the scale), truncation,
  duplicates, reordering, bit flips, NaN payloads, garbage after or instead of the frames.
  The member must end every such collective within its timeout, with a result or with
  :class:`~swarmtrain.roles.peer.links.RingBroken`; with valid fp32 frames its result must be the
  exact sum.

Health afterwards: no thread raised, no handshake thread is left, both listeners still
accept, and a legitimate 3-member ring on ``L``, ``F`` and a fresh listener completes an
all-reduce whose result is exactly the expected sum.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from swarmtrain.roles.peer.links import RingBroken, RingListener, dial, recv_exact
from swarmtrain.roles.peer.ring import RingGroup
from swarmtrain.testing.fuzz_engine import (
    INPUT_TIMEOUT,
    SECRET,
    FuzzReport,
    NodeFault,
    capture_errors,
    collect_crashes,
    run_inputs,
    source_address,
)
from swarmtrain.wire.handshake import (
    ACCEPTED,
    ANNOUNCE,
    MAGIC,
    MAX_RING_ID_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    RING_VERSION,
    SERVER_HELLO_BYTES,
    proofs_equal,
    ring_client_proof,
    ring_server_proof,
)
from swarmtrain.wire.ring import (
    HEADER,
    KIND_ALL_REDUCE,
    KIND_BROADCAST,
    WIRES,
    chunk_bounds,
    encoded_nbytes,
)

__all__ = ["RingInput", "fuzz_ring", "make_ring_input"]

RING_TIMEOUT = 1.0
"""The member group's timeout (forming the ring, and a collective without progress)."""
LISTENER_HANDSHAKE_TIMEOUT = 1.0
PARK_TIMEOUT = 2.0
_MEMBER_LIMIT = 3 * RING_TIMEOUT + INPUT_TIMEOUT  # a member's collective must end by then
ELEMENTS = 1000
"""The member's tensor: two chunks of 500 float32, one frame each way per step."""

_ANNOUNCE = ANNOUNCE  # epoch, from_rank, len(ring_id): the documented handshake
_PROOF_BYTES = PROOF_BYTES
_SERVER_HELLO = SERVER_HELLO_BYTES

Progress = Callable[[FuzzReport], None] | None


@dataclass(frozen=True)
class RingInput:
    """One connection to the ring listener (everything but the nonces is fixed here).

    Attributes:
        kind: ``<where>:<mutation>``.
        where: ``pre``, ``hello``, ``announce`` or ``ring``.
        hello: the opening bytes (valid: MAGIC and the client nonce).
        tail: ``hello`` inputs: what follows the listener's answer instead of proof and
            announcement; ``pre`` inputs: sent after the opening.
        half_close: whether the fuzzer shuts its sending side after its bytes (else it
            waits for the listener to time out).
        proof: ``ok``, ``random``, ``zero``, ``reflect`` (the listener's own proof back) or
            ``short`` (16 bytes, then the announcement).
        announce: the announcement bytes.
        ring_id / epoch / wire: the member group's (``ring`` inputs).
        frames: sent after an accepted handshake (``ring`` inputs).
        node_values / expected: the member's tensor and, for valid fp32 frames, its exact
            result (else empty).
    """

    kind: str
    where: str
    hello: bytes
    tail: bytes = b""
    half_close: bool = True
    proof: str = "ok"
    announce: bytes = b""
    ring_id: str = ""
    epoch: int = 0
    wire: str = "fp32"
    frames: bytes = b""
    node_values: bytes = b""
    expected: bytes = b""


def _announce(epoch: int, rank: int, rid: bytes, declared: int | None = None) -> bytes:
    return _ANNOUNCE.pack(epoch, rank, len(rid) if declared is None else declared) + rid


def _frames(rng: random.Random, wire: str, node: np.ndarray) -> tuple[list[bytearray], np.ndarray | None]:
    """The two valid frames rank 0 sends rank 1 in a 2-member all-reduce of ``ELEMENTS``
    values (step 0: chunk 0 to add; step 1: reduced chunk 1), and for fp32 the member's
    exact result."""
    (s0, e0), (s1, e1) = chunk_bounds(ELEMENTS, 2)
    codec = WIRES[wire]
    out, values = [], []
    for step, (s, e) in enumerate(((s0, e0), (s1, e1))):
        n = e - s
        if wire == "fp32":
            v = np.array([rng.randrange(-1000, 1000) for _ in range(n)], dtype=np.float32)
            payload, scale = v.tobytes(), 0.0
        elif wire == "fp16":
            v = np.array([rng.uniform(-100, 100) for _ in range(n)], dtype=np.float16)
            payload, scale = v.tobytes(), 0.0
        else:
            v = np.array([rng.randrange(-127, 128) for _ in range(n)], dtype=np.int8)
            payload, scale = v.tobytes(), rng.uniform(1e-3, 1.0)
        values.append(v)
        header = HEADER.pack(1, KIND_ALL_REDUCE, codec, step, 0, encoded_nbytes(codec, n), scale)
        out.append(bytearray(header + payload))
    if wire != "fp32":
        return out, None
    expected = np.concatenate([node[s0:e0] + values[0], values[1]]).astype(np.float32)
    return out, expected


def _mutate_frames(rng: random.Random, frames: list[bytearray]) -> tuple[str, bytes]:
    """A mutation of the valid frame sequence (the name, the bytes to send)."""
    op = rng.choices(["valid", "header", "nonfinite", "truncate", "garbage_after", "garbage",
                      "duplicate", "reorder", "bitflip", "silence"], [3, 8, 2, 2, 2, 1, 1, 1, 2, 1])[0]
    if op == "header":
        f = rng.choice(frames)
        field = rng.randrange(7)
        fields = list(HEADER.unpack_from(f))
        fields[field] = {0: lambda: rng.choice([0, 2, 2**32 - 1]),
                         1: lambda: rng.choice([0, KIND_BROADCAST, 3, 255]),
                         2: lambda: rng.choice([c for c in range(5) if c != fields[2]] + [255]),
                         3: lambda: rng.choice([fields[3] ^ 1, 2, 65535]),
                         4: lambda: rng.choice([1, 2**32 - 1]),
                         5: lambda: rng.choice([0, fields[5] + 4, max(0, fields[5] - 4), 2**32 - 1, 1 << 30]),
                         6: lambda: rng.choice([math.nan, math.inf, -math.inf, -0.0, 3.4e38])}[field]()
        HEADER.pack_into(f, 0, *fields)
        name = ["seq", "kind", "codec", "step", "segment", "nbytes", "scale"][field]
        return f"header_{name}", b"".join(frames)
    data = b"".join(frames)
    if op == "nonfinite":
        for f in frames:  # every float32 (or fp16 pair) of the payload NaN / inf: still well-formed
            word = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f"])
            f[HEADER.size:] = word * ((len(f) - HEADER.size) // 4)
        return op, b"".join(frames)
    if op == "truncate":
        return op, data[:rng.randrange(len(data))]
    if op == "garbage_after":
        return op, data + rng.randbytes(rng.choice([1, HEADER.size, 4096]))
    if op == "garbage":
        return op, rng.randbytes(rng.choice([1, HEADER.size - 1, HEADER.size, 3000]))
    if op == "duplicate":
        return op, bytes(frames[0] + frames[0] + frames[1])
    if op == "reorder":
        return op, bytes(frames[1] + frames[0])
    if op == "bitflip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(HEADER.size if rng.random() < 0.5 else len(b))
            b[i] ^= 1 << rng.randrange(8)
        return op, bytes(b)
    if op == "silence":
        return op, b""
    return op, data


def make_ring_input(seed: int, index: int) -> RingInput:
    """Input ``index`` of campaign ``seed``: a function of those two numbers alone."""
    rng = random.Random(f"ring:{seed}:{index}")
    hello = MAGIC + rng.randbytes(NONCE_BYTES)
    where = rng.choices(["pre", "hello", "announce", "ring"], [15, 10, 30, 45])[0]
    if where == "pre":
        op = rng.choice(["magic", "version", "truncated", "tls", "http", "noise", "empty"])
        flip = rng.randrange(len(MAGIC))
        data = {"magic": lambda: bytes(b ^ 0x20 if i == flip else b for i, b in enumerate(hello)),
                "version": lambda: MAGIC[:-1] + bytes([rng.choice([0, RING_VERSION - 1, 255])])
                + hello[len(MAGIC):],
                "truncated": lambda: hello[:rng.randrange(len(hello))],
                "tls": lambda: b"\x16\x03\x01\x02\x00" + rng.randbytes(rng.randrange(35, 300)),
                "http": lambda: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 20,
                "noise": lambda: rng.randbytes(rng.randrange(1, 200)),
                "empty": lambda: b""}[op]()
        return RingInput(f"pre:{op}", "pre", data, half_close=rng.random() < 0.8)
    if where == "hello":
        op = rng.choice(["short_proof", "silence", "short_announce"])
        tail = {"short_proof": lambda: rng.randbytes(rng.randrange(1, _PROOF_BYTES)),
                "silence": lambda: b"",
                "short_announce": lambda: rng.randbytes(_PROOF_BYTES + rng.randrange(_ANNOUNCE.size))}[op]()
        return RingInput(f"hello:{op}", "hello", hello, tail=tail, half_close=rng.random() < 0.7)
    # member inputs mostly authenticate: a refused link only times the member out
    proof = rng.choices(["ok", "random", "zero", "reflect", "short"], [5, 2, 1, 1, 1] if where == "announce"
                        else [30, 2, 1, 1, 1])[0]
    if where == "announce":
        op = rng.choice(["oversize_rid", "rid_len_lie", "not_utf8", "extreme", "max_rid", "garbage_after",
                         "empty_rid"])
        rid = rng.choice([b"fuzz", b"x" * 40, "\u202e\U0001f600".encode()])
        epoch, rank = rng.choice([0, 1, 2**63, 2**64 - 1]), rng.choice([0, 1, 2**32 - 1])
        announce = {
            "oversize_rid": lambda: _announce(epoch, rank, b"y" * rng.choice([MAX_RING_ID_BYTES + 1, 4000])),
            "rid_len_lie": lambda: _announce(epoch, rank, rid, rng.choice([len(rid) + 10, 65535, 200])),
            "not_utf8": lambda: _announce(epoch, rank, rng.choice([b"\xff\xfe", b"ab\xc3", b"\xed\xa0\x80"])),
            "extreme": lambda: _announce(epoch, rank, rid),
            "max_rid": lambda: _announce(epoch, rank, b"m" * MAX_RING_ID_BYTES),
            "garbage_after": lambda: _announce(epoch, rank, rid) + rng.randbytes(rng.randrange(1, 100)),
            "empty_rid": lambda: _announce(epoch, rank, b"")}[op]()
        return RingInput(f"announce:{op}" if proof == "ok" else f"announce:proof_{proof}", "announce", hello,
                         proof=proof, announce=announce, half_close=rng.random() < 0.8)
    ring_id, epoch = f"fz.{seed}.{index}", rng.choice([1, 7, 2**40])
    wire = rng.choice(list(WIRES))
    node = np.array([rng.randrange(-1000, 1000) for _ in range(ELEMENTS)], dtype=np.float32)
    frames, expected = _frames(rng, wire, node)
    if rng.random() < 0.12:  # the link is announced wrongly: the member must not take it
        op = rng.choice(["epoch_older", "epoch_newer", "rank"])
        e, r = {"epoch_older": (epoch - 1, 0), "epoch_newer": (epoch + 1, 0), "rank": (0, 0)}[op]
        if op == "rank":
            e, r = epoch, rng.choice([1, 2, 2**32 - 1])
        announce, proof, valid = _announce(e, r, ring_id.encode()), "ok", False
        data = b"".join(frames)
    else:
        announce = _announce(epoch, 0, ring_id.encode())
        op, data = _mutate_frames(rng, frames)
        valid = op == "valid" and proof == "ok"
        if proof != "ok":
            op = f"proof_{proof}"
    return RingInput(f"ring:{op}", "ring", hello, proof=proof, announce=announce, ring_id=ring_id,
                     epoch=epoch, wire=wire, frames=data, node_values=node.tobytes(),
                     expected=expected.tobytes() if valid and expected is not None else b"")


# --- driving one input -----------------------------------------------------------------------


#: what :func:`_reaction` says when the listener accepted (parked) the connection
_PARKED = f"status:{ACCEPTED}"


def _reaction(sock: socket.socket) -> str:
    """How the listener reacts to what was sent: closed / status:<n> / answer / no_answer."""
    try:
        got = sock.recv(1)
    except TimeoutError:
        return "no_answer"
    except ConnectionError:
        return "closed"
    if not got:
        return "closed"
    return f"status:{got[0]}"


def _announced(announce: bytes) -> bytes:
    """The announcement as the listener reads it (up to its declared ring_id length), which the
    client's proof covers; what follows is not part of it."""
    return announce[:_ANNOUNCE.size + _ANNOUNCE.unpack_from(announce)[2]]


def _proof(mode: str, client_nonce: bytes, server_nonce: bytes, theirs: bytes, announce: bytes) -> bytes:
    ok = ring_client_proof(SECRET, RING_VERSION, client_nonce, server_nonce, announce)
    return {"ok": ok, "random": bytes(b ^ 0x5A for b in ok), "zero": bytes(_PROOF_BYTES),
            "reflect": theirs, "short": ok[:16]}[mode]


class _Member:
    """This node's side of a ``ring`` input: rank 1 of a 2-member group on ``listener``,
    on its own thread, running one all-reduce."""

    def __init__(self, inp: RingInput, listener: RingListener, helper: RingListener) -> None:
        self.inp = inp
        self.outcome = ""
        self.result: np.ndarray | None = None
        self.crash = ""
        self._addresses = [helper.address, listener.address]
        self._listener = listener
        self.thread = threading.Thread(target=self._run, name="fuzz-ring-member", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        inp = self.inp
        try:
            with RingGroup(self._listener, 1, self._addresses, ring_id=inp.ring_id, epoch=inp.epoch,
                           secret=SECRET, timeout=RING_TIMEOUT) as group:
                t = torch.from_numpy(np.frombuffer(inp.node_values, dtype=np.float32).copy())
                group.all_reduce(t, wire=inp.wire)
                self.result = t.numpy()
                self.outcome = "reduced"
        except RingBroken as exc:
            self.outcome = f"broken:{exc.phase}"
        except BaseException as exc:  # noqa: BLE001 - anything but RingBroken escaping is a bug
            self.outcome = "crash"
            self.crash = "".join(traceback.format_exception(exc)[-3:]).strip()


class _RingTarget:
    """The listeners under fuzz and the blocking client side of every input."""

    def __init__(self) -> None:
        # L is fuzzed; F is rank 0's listener in member inputs (only ever dialled properly)
        self.listener = RingListener("127.0.0.1", 0, secret=SECRET, max_parked=256,
                                     handshake_timeout=LISTENER_HANDSHAKE_TIMEOUT, park_timeout=PARK_TIMEOUT)
        self.helper = RingListener("127.0.0.1", 0, secret=SECRET, max_parked=256,
                                   handshake_timeout=LISTENER_HANDSHAKE_TIMEOUT, park_timeout=PARK_TIMEOUT)
        self._probes = itertools.count()

    def close(self) -> None:
        self.listener.close()
        self.helper.close()

    def send(self, inp: RingInput, index: int) -> str:
        """Run one input against the listener from its own source address; the reaction.

        Raises:
            NodeFault: the listener failed a legitimate handshake step, or the member's
                collective crashed, hung or summed wrongly.
        """
        member = _Member(inp, self.listener, self.helper) if inp.where == "ring" else None
        sock = socket.create_connection(self.listener.address, timeout=INPUT_TIMEOUT,
                                        source_address=(source_address(index), 0))
        try:
            outcome = self._drive(sock, inp)
        finally:
            sock.close()
        if member is None:
            return outcome
        member.thread.join(_MEMBER_LIMIT)
        self._claim(self.helper, inp.ring_id, inp.epoch, 1)  # the member's outgoing link
        if member.thread.is_alive():
            raise NodeFault(f"the member's all-reduce did not end within {_MEMBER_LIMIT:g} s "
                            f"(its timeout is {RING_TIMEOUT:g} s)")
        if member.outcome == "crash":
            raise NodeFault(f"the member's all-reduce raised: {member.crash}")
        if inp.expected and member.outcome == "reduced":
            want = np.frombuffer(inp.expected, dtype=np.float32)
            if member.result is None or not np.array_equal(member.result, want):
                raise NodeFault("valid fp32 frames gave a wrong all-reduce result")
        elif inp.expected:
            raise NodeFault(f"valid frames did not complete the all-reduce: {member.outcome}")
        return f"{outcome}/{member.outcome}"

    def _drive(self, sock: socket.socket, inp: RingInput) -> str:
        sock.sendall(inp.hello)
        if inp.where == "pre":
            return self._finish(sock, inp.tail, inp.half_close)
        try:
            reply: bytes | None = recv_exact(sock, _SERVER_HELLO)
        except ConnectionError:
            reply = None
        except TimeoutError:
            raise NodeFault("the listener did not answer a valid opening in time") from None
        if reply is None or reply[:len(MAGIC)] != MAGIC:
            raise NodeFault(f"the listener answered a valid opening with {reply!r}")
        client_nonce, server_nonce = inp.hello[len(MAGIC):], reply[len(MAGIC):len(MAGIC) + NONCE_BYTES]
        theirs = reply[-_PROOF_BYTES:]
        if not proofs_equal(theirs, ring_server_proof(SECRET, RING_VERSION, client_nonce, server_nonce)):
            raise NodeFault("the listener's proof does not match the cluster secret")
        if inp.where == "hello":
            return self._finish(sock, inp.tail, inp.half_close)
        proof = _proof(inp.proof, client_nonce, server_nonce, theirs, _announced(inp.announce))
        sock.sendall(proof + inp.announce)
        if inp.where == "announce":
            outcome = self._finish(sock, b"", inp.half_close)
            if outcome == _PARKED:  # parked: take it back, so that junk does not pile up
                epoch, rank, n = _ANNOUNCE.unpack_from(inp.announce)
                rid = inp.announce[_ANNOUNCE.size:_ANNOUNCE.size + n].decode()
                self._claim(self.listener, rid, epoch, rank)
            return outcome
        status = _reaction(sock)
        if status != _PARKED:
            return status
        try:
            sock.sendall(inp.frames)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return f"{_PARKED}/reset"
        if not inp.announce.endswith(inp.ring_id.encode()) or _ANNOUNCE.unpack_from(inp.announce)[:2] != (
                inp.epoch, 0):
            epoch, rank, _ = _ANNOUNCE.unpack_from(inp.announce)
            self._claim(self.listener, inp.ring_id, epoch, rank)  # announced wrongly: junk
        return status

    def _finish(self, sock: socket.socket, tail: bytes, half_close: bool) -> str:
        try:
            sock.sendall(tail)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            return "reset"
        return _reaction(sock)

    @staticmethod
    def _claim(listener: RingListener, ring_id: str, epoch: int, rank: int) -> None:
        """Take a connection parked for (ring_id, epoch, rank), if any, and close it."""
        try:
            listener.claim(ring_id, epoch, rank, 0.2).close()
        except RingBroken:
            pass

    def probe(self) -> str | None:
        """None if a legitimate link to the listener is accepted and can be claimed."""
        ring_id = f"probe.{next(self._probes)}"
        try:
            out = dial(self.listener.address, secret=SECRET, ring_id=ring_id, epoch=0, from_rank=0, peer=0,
                       timeout=5.0)
        except RingBroken as exc:
            return f"a legitimate link was not accepted: {exc}"
        try:
            self.listener.claim(ring_id, 0, 0, 5.0).close()
        except RingBroken as exc:
            return f"a legitimate link was accepted but cannot be claimed: {exc}"
        finally:
            out.close()
        return None


def _ring_all_reduce(listeners: list[RingListener], seed: int) -> str | None:
    """A legitimate ring over ``listeners`` sums exactly; None if it did, else what failed."""
    n = 100_003  # several segments per chunk, uneven chunks
    values = [np.arange(n, dtype=np.float32) * (r + 1) - seed % 7 for r in range(len(listeners))]
    expected = np.sum(values, axis=0, dtype=np.float32)
    results: dict[int, np.ndarray | str] = {}
    addresses = [lst.address for lst in listeners]

    def member(rank: int) -> None:
        try:
            with RingGroup(listeners[rank], rank, addresses, ring_id="health", epoch=1, secret=SECRET,
                           timeout=10.0) as group:
                t = torch.from_numpy(values[rank].copy())
                group.all_reduce(t)
                results[rank] = t.numpy()
        except BaseException as exc:  # noqa: BLE001 - reported as the health check's failure
            results[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=member, args=(r,), name=f"fuzz-ring-health-{r}", daemon=True)
               for r in range(len(listeners))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30.0)
    if any(th.is_alive() for th in threads):
        return "a legitimate all-reduce did not end within 30 s"
    for rank in range(len(listeners)):
        got = results.get(rank)
        if not isinstance(got, np.ndarray):
            return f"rank {rank} of a legitimate all-reduce failed: {got}"
        if not np.array_equal(got, expected):
            return f"rank {rank} of a legitimate all-reduce got a wrong sum"
    return None


@contextmanager
def _thread_crashes() -> Iterator[list[str]]:
    """Collect exceptions that escape any thread while inside."""
    crashes: list[str] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        crashes.append(f"thread {name}: {args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    try:
        yield crashes
    finally:
        threading.excepthook = previous


def _wait_threads_gone(prefix: str, timeout: float) -> int:
    """Poll until no thread named ``prefix...`` is alive; how many still are at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = sum(1 for t in threading.enumerate() if t.name.startswith(prefix))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


async def fuzz_ring(count: int = 300, *, seconds: float = math.inf, seed: int = 0, concurrency: int = 16,
                    progress: Progress = None) -> FuzzReport:
    """Fuzz a :class:`~swarmtrain.roles.peer.links.RingListener` and the member groups claiming its
    links (see the module docstring).

    Health: no exception escaped a thread, no handshake or member thread is left after the
    campaign, and a legitimate 3-member ring on the fuzzed listener, the fuzzer's helper
    listener and a fresh one completes a fp32 all-reduce with exactly the expected sum.
    """
    report = FuzzReport("ring", seed)
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="fuzz-ring-client")
    with capture_errors() as errors, _thread_crashes() as thread_crashes:
        target = _RingTarget()
        try:
            async def live() -> str | None:
                return await loop.run_in_executor(pool, target.probe)

            await run_inputs(report, lambda i: make_ring_input(seed, i),
                             lambda inp, i: loop.run_in_executor(pool, target.send, inp, i), live,
                             count=count, seconds=seconds, concurrency=concurrency, progress=progress)
            for prefix, limit in (("ring-handshake", 3 * LISTENER_HANDSHAKE_TIMEOUT + 5),
                                  ("fuzz-ring-member", 3 * RING_TIMEOUT + 5)):
                if left := await loop.run_in_executor(pool, _wait_threads_gone, prefix, limit):
                    report.health.append(f"{left} '{prefix}' thread(s) still alive {limit:g} s "
                                         "after the campaign")
            for lst in (target.listener, target.helper):
                name = f"ring-listener-{lst.address[1]}"
                if not any(t.name == name and t.is_alive() for t in threading.enumerate()):
                    report.health.append(f"the accept thread of the ring listener {lst.address} is gone")
            if (problem := await loop.run_in_executor(pool, target.probe)) is not None:
                report.health.append(problem)
            with RingListener("127.0.0.1", 0, secret=SECRET) as fresh:
                trio = [target.listener, target.helper, fresh]
                if (problem := await loop.run_in_executor(pool, _ring_all_reduce, trio, seed)) is not None:
                    report.health.append(problem)
            report.notes.append("the listener refused: " + ", ".join(
                f"{k} {v}" for k, v in target.listener.refused.items()))
        finally:
            target.close()
            pool.shutdown(wait=True)
            collect_crashes(report, errors)
            report.crashes += thread_crashes
    return report
