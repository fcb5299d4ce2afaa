"""The insider campaign's cases (see :mod:`swarmtrain.testing.fuzz_insider`): well-framed,
well-typed messages with hostile values, for a coordinator (:func:`coordinator_cases`), a
peer's control port (:func:`peer_cases`) and a pipeline stage (:func:`stage_cases`). A fixed
list covers issue 17's cases (names start with ``!``); a seeded generator adds random
(message, field, hostile value) cases. No I/O here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmtrain.testing.fuzz_engine import dead_port
from swarmtrain.testing.fuzz_inputs import _frame, _split
from swarmtrain.wire import (
    Accept,
    Assign,
    CheckpointMsg,
    Commit,
    Error,
    Gradients,
    Heartbeat,
    Limits,
    Message,
    Pause,
    PeerHello,
    Propose,
    Reform,
    Register,
    RegisterAck,
    Resume,
    Shutdown,
    StageBackward,
    StageForward,
    StageInfer,
    StageSync,
    Start,
    StatusRequest,
    Update,
    Weights,
    encode_bytes,
)

__all__ = [
    "INSIDER_LIMITS", "digits_parameters", "digits_register",
    "HOSTILE_FLOATS", "HOSTILE_INTS", "HOSTILE_STRS", "Case", "Frame", "coordinator_cases", "gf",
    "gradient", "hostile", "peer_cases", "stage_cases",
]

HOSTILE_INTS = [0, -1, 2**31, 2**53, 2**63 - 1, 2**64 - 1]


HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, -1e300, 1e300, 0.0]


HOSTILE_STRS = ["", "x" * 60_000, "\x00", "../../etc/passwd"]


INSIDER_LIMITS = Limits(max_header_bytes=1 << 24, max_payload_bytes=1 << 30, max_tensors=1 << 16)


Frame = bytes | Callable[[int], bytes]
"""A frame, or a function of the role's current version that builds one (gradients)."""


def hostile(msg: Message, **fields: Any) -> bytes:
    """``msg`` as a frame whose header fields are replaced by ``fields``: values the sender's
    own encoder might refuse (out of range, wrong type) still go out, as an insider's would."""
    mtype, head, descs, payload = _split(encode_bytes(msg, INSIDER_LIMITS))
    head.update(fields)
    return _frame(mtype, msgpack.packb({"f": head, "t": descs}, use_bin_type=True), payload)


@dataclass(frozen=True)
class Case:
    """Frames one insider sends on one authenticated connection, as ``role``."""

    name: str  # "<MESSAGE>.<field>=<value>" or a named attack
    role: str
    frames: tuple[Frame, ...]
    answers: int  # replies the role owes (HEARTBEAT and a worker's ERROR get none)
    fixed: bool = False  # one of the cases (else drawn at random)
    session: str = ""  # cases with the same session share one connection ("" = its own)
    as_worker: str = ""  # coordinator: register under this id first
    register_first: bool = True  # coordinator: register first (not for REGISTER cases)


def _pick(rng: random.Random, values: list[Any]) -> Any:
    return values[rng.randrange(len(values))]


def _label(v: Any) -> str:
    if isinstance(v, str) and len(v) > 20:
        return f"str*{len(v)}"
    if isinstance(v, list) and len(v) > 4:
        return f"list*{len(v)}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**20:
        for k in (31, 53, 63, 64):
            if v in (2**k, 2**k - 1):
                return f"2**{k}{'-1' if v == 2**k - 1 else ''}"
    return repr(v)[:24]


def _values_for(rng: random.Random, v: Any) -> Any:
    """A hostile value of ``v``'s type (so it passes the wire's field type checks)."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return _pick(rng, HOSTILE_INTS + [-(2**63), 10**12])
    if isinstance(v, float):
        return _pick(rng, HOSTILE_FLOATS)
    if isinstance(v, str):
        return _pick(rng, HOSTILE_STRS)
    if isinstance(v, bytes):
        return rng.randbytes(_pick(rng, [0, 1, 31, 33, 100_000]))
    if isinstance(v, list):
        return _pick(rng, [[], [2**64 - 1], ["x"] * 10_000, v * 2])
    if isinstance(v, dict):
        return _pick(rng, [{}, {"x" * 100: [2**64 - 1] * 100}, {str(i): i for i in range(5000)}])
    return None


def gf(msg: Message, **fields: Any) -> Frame:
    """``msg`` (a GRADIENTS) with hostile ``fields``, carrying the role's current version
    unless ``fields`` set one."""
    return lambda version: hostile(msg, **{"version": version, **fields})


def _random_field_cases(
    rng: random.Random, role: str, messages: list[Message], n: int, answers: Callable[[Message], int]
) -> list[Case]:
    """``n`` cases, each one message of ``messages`` with one field made hostile."""
    out = []
    for _ in range(n):
        msg = _pick(rng, messages)
        fields = {k: v for k, v in msg.fields().items() if k not in ("public_key", "signature")}
        if not fields:
            out.append(Case(msg.TYPE.name, role, (encode_bytes(msg),), answers(msg)))
            continue
        name = _pick(rng, sorted(fields))
        value = _values_for(rng, fields[name])
        changes = {name: value}
        if isinstance(msg, StageForward | StageInfer) and name != "session":
            changes["session"] = f"random{len(out)}"  # not a resend of an earlier forward
        frame = gf(msg, **changes) if isinstance(msg, Gradients) else hostile(msg, **changes)
        out.append(Case(f"{msg.TYPE.name}.{name}={_label(value)}", role, (frame,), answers(msg)))
    return out


@functools.cache
def digits_parameters() -> tuple[dict[str, tuple[int, ...]], list[list[Any]], dict[str, Any]]:
    from swarmtrain.config import CompressionConfig, load_coordinator_config
    from swarmtrain.core.modelstate import ModelState
    from swarmtrain.tasks import DigitsTask

    model = DigitsTask().build_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    cfg = load_coordinator_config()
    comp = {k: getattr(cfg.compression, k) for k in CompressionConfig.SHARED_KEYS}
    return shapes, ModelState(model).fingerprint(), comp


def digits_register(worker_id: str = "insider", **over: Any) -> Register:
    """The REGISTER a digits worker with the default compression sends (``over`` replaces
    fields): what an insider needs to be taken in as a worker."""
    _, fp, comp = digits_parameters()
    fields: dict[str, Any] = {
        "worker_id": worker_id, "task": "digits", "fingerprint": fp, "hardware": {"profile": "insider"},
        "batch_size": 32, "accumulation_steps": 1, "shard_index": -1, "compression": comp,
        "samples_per_sec": 100.0,
    }
    return Register(**{**fields, **over})


def gradient(
    shapes: dict[str, tuple[int, ...]], scale: float, *, msg_id: int, samples: int = 32, loss: float = 1.0,
    version: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32, shape_off: int = 0,
    codec: str = "none",
) -> Gradients:
    """An uncompressed (codec ``none``) gradient of norm about ``scale`` per tensor."""
    gen = torch.Generator().manual_seed(seed)
    codecs, tensors = {}, {}
    for name, shape in shapes.items():
        n = math.prod(shape) + shape_off
        t = torch.randn(max(n, 0), generator=gen)
        t = (t / max(float(t.norm()), 1e-12) * scale).to(dtype)
        codecs[name] = {
            "codec": codec, "shape": list(shape), "dtype": "float32", "meta": {}, "parts": ["values"],
        }
        tensors[f"{name}/values"] = t
    return Gradients(
        msg_id=msg_id, version=version, samples=samples, loss=loss, codecs=codecs, tensors=tensors
    )


def coordinator_cases(rng: random.Random, n_random: int, live: tuple[str, str]) -> list[Case]:
    """The issue's cases (fixed, names start with ``!``), then ``n_random`` drawn ones."""
    shapes, _, _ = digits_parameters()

    def reg(**kw: Any) -> Register:
        return digits_register(**{"worker_id": "insider-r", **kw})

    g = functools.partial(gradient, shapes)
    nan_g = dataclasses.replace(
        g(1e-3, msg_id=1),
        tensors={k: torch.full_like(t, math.nan) for k, t in g(1e-3, msg_id=1).tensors.items()},
    )
    fixed: list[Case] = []

    def add(
        name: str, frames: list[Frame], answers: int, role: str = "worker", session: str = "",
        as_worker: str = "",
    ) -> None:
        fixed.append(
            Case(f"!{name}", role, tuple(frames), answers, fixed=True, session=session, as_worker=as_worker)
        )

    # first, while the model is still poor, so that the honest run must learn after them:
    # the ratchet: 40 finite gradients, each 30x the norm of the previous (1e-4 .. ~1e55)
    add(
        "GRADIENTS ratchet 1e-4 x30 ^40", [gf(g(1e-4 * 30.0**i, msg_id=i + 1, seed=i)) for i in range(40)],
        40, session="ratchet",
    )
    # one liar claiming 1e12 samples per gradient, 20 times
    add(
        "GRADIENTS.samples=1e12 x20",
        [gf(g(3e-2, msg_id=i + 1, seed=100 + i, samples=10**12)) for i in range(20)], 20, session="liar",
    )
    # samples = 2**64-1, twice (the issue: STATUS no longer encodes)
    add(
        "GRADIENTS.samples=2**64-1 x2",
        [gf(g(1e-4, msg_id=i + 1, seed=i), samples=2**64 - 1) for i in range(2)], 2,
    )
    for s in (0, -1, 10**12, 2**63 - 1):
        add(f"GRADIENTS.samples={_label(s)}", [gf(g(1e-4, msg_id=1), samples=s)], 1)
    for mid in HOSTILE_INTS:
        add(f"GRADIENTS.msg_id={_label(mid)}(NaN)", [gf(nan_g, msg_id=mid)], 1)
    for v in HOSTILE_INTS + [-(2**63)]:
        add(f"GRADIENTS.version={_label(v)}", [gf(g(1e-4, msg_id=5), version=v)], 1)
    for x in HOSTILE_FLOATS[:5]:
        add(f"GRADIENTS.loss={x!r}", [gf(g(1e-4, msg_id=1), loss=x)], 1)
        add(f"GRADIENTS.residual_norm={x!r}", [gf(g(1e-4, msg_id=1), residual_norm=x)], 1)
    add("GRADIENTS duplicate msg_id", [gf(g(1e-4, msg_id=7)), gf(g(1e-4, msg_id=7))], 2)
    add("GRADIENTS wrong shapes", [gf(g(1e-4, msg_id=1, shape_off=1))], 1)
    add("GRADIENTS wrong dtype float64", [gf(g(1e-4, msg_id=1, dtype=torch.float64))], 1)
    add("GRADIENTS unknown codec", [gf(g(1e-4, msg_id=1, codec="zstd"))], 1)
    add("GRADIENTS no tensors", [gf(g(1e-4, msg_id=1), codecs={})], 1)
    add("GRADIENTS.buffers=huge", [gf(g(1e-4, msg_id=1), buffers=["x"] * 10_000)], 1)
    add("GRADIENTS.codecs=huge", [gf(g(1e-4, msg_id=1), codecs={str(i): {} for i in range(5000)})], 1)
    add("GRADIENTS inf values", [gf(g(math.inf, msg_id=1))], 1)
    add("GRADIENTS norm 1e30", [gf(g(1e30, msg_id=1))], 1)
    for mt in (
        Pause(), Resume(), CheckpointMsg(path="/tmp/x", step=2**63 - 1), Shutdown(reason="insider"),
        Weights(version=2**63 - 1), Start(version=-1), Assign(shards=[2**31], num_shards=0),
        RegisterAck(
            worker_id="x", shard_index=-1, num_shards=0, running=True, paused=True, version=2**64 - 1,
            last_applied_msg_id=2**64 - 1,
        ),
        Update(msg_id=1, version=2**63 - 1, status="applied"), PeerHello(run="x"),
        StageForward(req=1, session="s", microbatch=0, tensors={"x": torch.zeros(1, 2)}),
        Propose(epoch=2**63 - 1, proposer="x", members=[], addresses={}),
    ):
        add(f"{mt.TYPE.name} as a worker", [encode_bytes(mt)], 1)
    add("HEARTBEAT.time=nan step=2**64-1", [hostile(Heartbeat(time=0.0), time=math.nan, step=2**64 - 1)], 0)
    add("ERROR.fatal=True message=huge", [hostile(Error(code="x", message="y"), message="x" * 60_000)], 0)
    registers: list[dict[str, Any]] = [
        {"batch_size": 0}, {"batch_size": 2**63 - 1}, {"accumulation_steps": 2**64 - 1},
        {"shard_index": 2**31}, {"shard_index": -(2**63)}, {"samples_per_sec": math.nan},
        {"samples_per_sec": -1e300}, {"last_msg_id": 2**64 - 1}, {"worker_id": ""},
        {"worker_id": "x" * 60_000}, {"hardware": {str(i): "x" * 50 for i in range(2000)}},
        {"fingerprint": []}, {"compression": {"type": "none"}}, {"task": "textlm"},
    ]
    for kw in registers:
        k, rv = next(iter(kw.items()))
        what = _label(rv) if not isinstance(rv, dict) else f"dict*{len(rv)}"
        fixed.append(
            Case(
                f"!REGISTER.{k}={what}", "worker", (hostile(reg(worker_id=f"insider-reg-{k}"), **kw),), 1,
                fixed=True, register_first=False,
            )
        )
    for k in ("path", "message"):
        for sv in HOSTILE_STRS:
            add(f"CHECKPOINT(ctl).{k}={_label(sv)}", [hostile(CheckpointMsg(), **{k: sv})], 1, role="ctl")
    add("CHECKPOINT(ctl).step=2**64-1", [hostile(CheckpointMsg(), step=2**64 - 1)], 1, role="ctl")
    add("GRADIENTS(ctl)", [gf(g(1e-4, msg_id=1))], 1, role="ctl")
    add("REGISTER(ctl)", [encode_bytes(reg())], 1, role="ctl")
    add("RESUME(ctl) while running", [encode_bytes(Resume())], 1, role="ctl")
    # last: a live worker's id, registered by the insider (kicks it?), then msg_id 2**64-1
    add(
        f"REGISTER.worker_id={live[1]!r} (a live worker) + NaN GRADIENTS msg_id=2**64-1",
        [gf(nan_g, msg_id=2**64 - 1)], 1, as_worker=live[1],
    )
    add(
        f"REGISTER.worker_id={live[0]!r} (a live worker)", [encode_bytes(StatusRequest())], 1,
        as_worker=live[0],
    )

    msgs: list[Message] = [
        g(1e-4, msg_id=rng.randrange(1, 10**6)), nan_g, StatusRequest(), Heartbeat(time=1.0, step=1),
        Error(code="x", message="y", fatal=False), CheckpointMsg(), Shutdown(reason="r"),
    ]
    rand = _random_field_cases(
        rng, "worker", msgs, n_random, lambda m: 0 if isinstance(m, Heartbeat | Error) else 1
    )
    rand += [
        dataclasses.replace(c, register_first=False)
        for c in _random_field_cases(rng, "worker", [reg()], max(1, n_random // 6), lambda m: 1)
    ]
    return fixed + rand


def _sign(identity: Any, msg: Any) -> Any:
    from swarmtrain.roles.peer.membership import signed_bytes

    msg = dataclasses.replace(msg, public_key=identity.public_key)
    return dataclasses.replace(msg, signature=identity.sign(signed_bytes(msg)))


def peer_cases(rng: random.Random, n_random: int, real: list[str], epoch: int) -> list[Case]:
    """Hostile membership messages, signed by the insider's own key, and others."""
    from swarmtrain.transport.identity import Identity

    me = Identity.generate()
    fixed: list[Case] = []

    def add(name: str, msg: Message, **fields: Any) -> None:
        frame = hostile(msg, **fields) if fields else encode_bytes(msg)
        fixed.append(Case(f"!{name}", "peer", (frame,), 1, fixed=True))

    members = [me.peer_id, *real]
    addrs = {m: ["127.0.0.1", dead_port()] for m in members}
    for e in HOSTILE_INTS + [epoch, epoch + 1]:
        add(
            f"PROPOSE.epoch={_label(e)} (signed, naming the group)",
            _sign(me, Propose(epoch=e, proposer=me.peer_id, members=members, addresses=addrs)),
        )
        add(
            f"COMMIT.epoch={_label(e)} (signed)",
            _sign(
                me, Commit(epoch=e, proposer=me.peer_id, members=members, addresses=addrs, donor=me.peer_id)
            ),
        )
        add(f"REFORM.epoch={_label(e)} (signed)", _sign(me, Reform(epoch=e, peer_id=me.peer_id)))
        add(
            f"ACCEPT.epoch={_label(e)} (signed)",
            _sign(me, Accept(epoch=e, peer_id=me.peer_id, ok=True, rounds=0)),
        )
    for w in HOSTILE_INTS:
        add(
            f"PROPOSE.work={_label(w)} (signed)",
            _sign(
                me, Propose(epoch=epoch + 1, proposer=me.peer_id, members=members, addresses=addrs, work=w)
            ),
        )
    for port in (-1, 0, 65536, 2**64 - 1):
        bad = {m: ["127.0.0.1", port] for m in members}
        add(
            f"PROPOSE.addresses.port={_label(port)} (signed)",
            _sign(me, Propose(epoch=epoch + 1, proposer=me.peer_id, members=members, addresses=bad)),
        )
    add(
        "PROPOSE.members=10000 ids (signed)",
        _sign(me, Propose(epoch=epoch + 1, proposer=me.peer_id, members=[me.peer_id] * 10_000, addresses={})),
    )
    add(
        "PROPOSE.members=[] (signed)",
        _sign(me, Propose(epoch=epoch + 1, proposer=me.peer_id, members=[], addresses={})),
    )
    add(
        "PROPOSE.addresses=garbage (signed)",
        _sign(me, Propose(epoch=epoch + 1, proposer=me.peer_id, members=members, addresses={me.peer_id: 7})),
    )
    add(
        "COMMIT.donor=unknown (signed)",
        _sign(
            me, Commit(epoch=epoch + 1, proposer=me.peer_id, members=members, addresses=addrs, donor="x" * 64)
        ),
    )
    for kind in ("leave", "broke", "", "x" * 60_000):
        add(
            f"REFORM.kind={_label(kind)} (signed)",
            _sign(me, Reform(epoch=epoch, peer_id=me.peer_id, kind=kind)),
        )
    if real:
        add("REFORM as a real member (unsigned)", Reform(epoch=epoch, peer_id=real[0], kind="leave"))
        add(
            "PROPOSE as a real member (forged)",
            Propose(
                epoch=2**63 - 1, proposer=real[0], members=real, addresses=addrs, public_key=me.public_key,
                signature=bytes(64),
            ),
        )
    replay = _sign(me, Propose(epoch=epoch + 2, proposer=me.peer_id, members=members, addresses=addrs))
    fixed.append(Case("!PROPOSE replayed x3", "peer", (encode_bytes(replay),) * 3, 3, fixed=True))
    for s in HOSTILE_STRS:
        add(f"PEER_HELLO.run={_label(s)}", PeerHello(run=s))
    add("GRADIENTS to a peer", gradient({"w": (4,)}, 1.0, msg_id=2**64 - 1))
    add(
        "REGISTER to a peer",
        Register(
            worker_id="x", task="digits", fingerprint=[], hardware={}, batch_size=1, accumulation_steps=1,
            shard_index=-1, compression={}, samples_per_sec=1.0,
        ),
    )
    add(
        "STAGE_FORWARD to a peer",
        StageForward(req=2**64 - 1, session="s", microbatch=-1, tensors={"x": torch.full((2, 2), math.nan)}),
    )
    add("SHUTDOWN to a peer", Shutdown(reason="insider"))
    add("STATUS_REQUEST", StatusRequest())
    msgs: list[Message] = [
        _sign(me, Propose(epoch=epoch + 1, proposer=me.peer_id, members=members, addresses=addrs)),
        _sign(
            me,
            Commit(epoch=epoch + 1, proposer=me.peer_id, members=members, addresses=addrs, donor=me.peer_id),
        ),
        _sign(me, Accept(epoch=epoch + 1, peer_id=me.peer_id, ok=True, rounds=1)),
        _sign(me, Reform(epoch=epoch, peer_id=me.peer_id)), PeerHello(run="insider"),
    ]
    rand = _random_field_cases(rng, "peer", msgs, n_random, lambda m: 1)
    # a field changed after signing breaks the signature; re-sign half of them, as an insider would
    return fixed + rand


def stage_cases(rng: random.Random, n_random: int, first: bool) -> list[Case]:
    """Hostile requests for a first stage (token ids) or the last one (activations, targets)."""

    def x(
        b: int = 2, t: int = 8, dtype: torch.dtype | None = None, fill: float | None = None
    ) -> torch.Tensor:
        if first:
            out = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        else:
            out = torch.randn(b, t, 32, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        if fill is not None:
            out = torch.full(out.shape, fill, dtype=torch.long if isinstance(fill, int) else torch.float32)
        return out if dtype is None else out.to(dtype)

    targets = {} if first else {"targets": torch.randint(0, 256, (2, 8))}
    fixed: list[Case] = []

    def add(
        name: str, msgs: list[Message | bytes], role: str = "pipeline", answers: int | None = None
    ) -> None:
        # a session of its own: a stage answers a forward it holds from its cache (a resend)
        own = f"ins{len(fixed)}"
        msgs = [
            dataclasses.replace(m, session=own)
            if isinstance(m, StageForward | StageInfer) and m.session == "ins"
            else m
            for m in msgs
        ]
        frames = tuple(m if isinstance(m, bytes) else encode_bytes(m) for m in msgs)
        fixed.append(Case(f"!{name}", role, frames, len(frames) if answers is None else answers, fixed=True))

    fwd = StageForward(req=1, session="ins", microbatch=0, tensors={"x": x(), **targets})
    for k in ("req", "microbatch", "priority"):
        for v in HOSTILE_INTS + [-(2**63)]:
            add(f"STAGE_FORWARD.{k}={_label(v)}", [hostile(fwd, **{k: v, "session": f"ins{k}{v}"})])
    for sv in HOSTILE_STRS:
        add(f"STAGE_FORWARD.session={_label(sv)}", [hostile(fwd, session=sv, microbatch=len(fixed))])
    for name, t in (
        ("float64", x(dtype=torch.float64)), ("int8", x(dtype=torch.int8)), ("bool", x(dtype=torch.bool)),
        ("3d", x().unsqueeze(0)), ("empty", x(0, 0)), ("t=33 > context", x(1, 33)), ("nan", x(fill=math.nan)),
        ("inf", x(fill=math.inf)), ("-3e38", x(fill=-3e38)), ("ids 2**31", x(fill=2**31)),
        ("ids -1", x(fill=-1)), ("b=4096", x(4096, 1)),
    ):
        add(f"STAGE_FORWARD.x {name}", [dataclasses.replace(fwd, tensors={"x": t, **targets})])
        add(f"STAGE_INFER.x {name}", [StageInfer(req=2, session="ins", tensors={"x": t})])
    if not first:
        for name, t in (
            ("nan", torch.full((2, 8), math.nan)), ("ids 2**40", torch.full((2, 8), 2**40)),
            ("-1", torch.full((2, 8), -1)), ("shape", torch.zeros(3, 8, dtype=torch.long)),
        ):
            add(f"STAGE_FORWARD.targets {name}", [dataclasses.replace(fwd, tensors={"x": x(), "targets": t})])
    # duplicate and replayed ids: the same forward twice, then backwards for it
    add("STAGE_FORWARD duplicate req/microbatch x2", [fwd, fwd])
    grad = torch.randn(2, 8, 32)
    bwd = StageBackward(req=3, session="ins", microbatch=0, tensors={"grad": grad})
    for k in ("req", "microbatch"):
        for v in HOSTILE_INTS:
            add(f"STAGE_BACKWARD.{k}={_label(v)}", [hostile(bwd, **{k: v})])
    for name, t in (
        ("nan", torch.full((2, 8, 32), math.nan)), ("shape", torch.zeros(2, 8, 31)), ("float16", grad.half()),
        ("norm 1e30", grad * 1e30),
    ):
        add(f"STAGE_BACKWARD.grad {name}", [dataclasses.replace(bwd, session="never", tensors={"grad": t})])
    if first:  # a backward for the insider's own forward, finite but huge, then replayed
        own = StageForward(req=10, session="own", microbatch=7, tensors={"x": x()})
        add(
            "STAGE_FORWARD+BACKWARD own, grad norm 1e30, replayed",
            [
                own, StageBackward(req=11, session="own", microbatch=7, tensors={"grad": grad * 1e30}),
                StageBackward(req=12, session="own", microbatch=7, tensors={"grad": grad * 1e30}),
            ],
        )
    params = {"w": torch.zeros(3)}
    add("STAGE_SYNC (as a trainer)", [StageSync(req=4, round=0, step=0, tensors=params)])
    for k in ("round", "step", "req"):
        for v in (2**64 - 1, -1):
            add(
                f"STAGE_SYNC.{k}={_label(v)} (replica)",
                [
                    hostile(
                        StageSync(req=4, round=1, step=1, tensors={"x": torch.full((4,), math.nan)}), **{k: v}
                    )
                ],
                role="stage",
            )
    add("STAGE_SYNC reply=True (replica)", [StageSync(req=5, round=1, step=1, reply=True)], role="stage")
    add("GRADIENTS to a stage", [gradient({"w": (4,)}, 1.0, msg_id=1)])
    add("PROPOSE to a stage", [Propose(epoch=2**64 - 1, proposer="x", members=[], addresses={})])
    add("ERROR to a stage", [Error(code="x", message="y" * 60_000)])
    add("HEARTBEAT.step=2**64-1", [hostile(Heartbeat(time=0.0), step=2**64 - 1, time=math.inf)], answers=0)
    msgs: list[Message] = [
        fwd, StageInfer(req=2, session="ins", tensors={"x": x()}), bwd,
        StageSync(req=4, round=1, step=1, tensors=params),
    ]
    rand = _random_field_cases(rng, "pipeline", msgs, n_random, lambda m: 1)
    return fixed + rand
