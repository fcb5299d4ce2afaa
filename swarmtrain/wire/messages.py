"""Message types of the swarmtrain protocol as frozen dataclasses.

Each message class has a :class:`MsgType` and plain fields (int, float, str, bool, bytes,
list, dict) that travel in the msgpack header; messages that carry tensors have a
``tensors`` field that travels in the payload. Decoding checks every field's presence, type
and range (:class:`Bound`: a class's ``BOUNDS`` declare its fields' ranges, the rest get
:data:`DEFAULT_BOUNDS`), so roles only ever see well-typed messages with sane numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from swarmtrain.errors import RemoteProtocolError

if TYPE_CHECKING:
    import torch

    #: a message's tensors by name
    TensorMap = Mapping[str, torch.Tensor]
else:
    # This module never touches a tensor (payloads are laid out and rebuilt in
    # swarmtrain.wire.tensors), so it does not import torch: clients whose messages carry none
    # (`swarmtrain ctl`) start without it. At run time the hint names no torch type, so that
    # typing.get_type_hints of a message class (decoding checks fields by them) needs no torch.
    TensorMap = Mapping[str, Any]

__all__ = [
    "MsgType",
    "Message",
    "Hello",
    "Challenge",
    "Auth",
    "Welcome",
    "Register",
    "RegisterAck",
    "Weights",
    "Gradients",
    "Update",
    "Assign",
    "Start",
    "Pause",
    "Resume",
    "Shutdown",
    "Heartbeat",
    "CheckpointMsg",
    "Error",
    "StatusRequest",
    "Status",
    "PeerHello",
    "PeerInfoMsg",
    "Propose",
    "Accept",
    "Commit",
    "Reform",
    "StageForward",
    "StageResult",
    "StageBackward",
    "StageGrad",
    "StageInfer",
    "StageSync",
    "StageError",
    "MESSAGE_CLASSES",
    "HANDSHAKE_TYPES",
    "Bound",
    "DEFAULT_BOUNDS",
    "MAX_INT",
    "MAX_TEXT",
    "OutOfRange",
    "bound_of",
    "message_from_fields",
]



class MsgType(enum.IntEnum):
    """The type byte of a frame."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    REGISTER = 10
    REGISTER_ACK = 11
    WEIGHTS = 12
    GRADIENTS = 13
    UPDATE = 14
    ASSIGN = 15
    VERDICT = 16
    START = 20
    PAUSE = 21
    RESUME = 22
    SHUTDOWN = 23
    HEARTBEAT = 24
    CHECKPOINT = 25
    ERROR = 26
    STATUS_REQUEST = 27
    STATUS = 28
    PEER_HELLO = 40
    PEER_INFO = 41
    PROPOSE = 42
    ACCEPT = 43
    COMMIT = 44
    REFORM = 45
    STAGE_FORWARD = 50
    STAGE_RESULT = 51
    STAGE_BACKWARD = 52
    STAGE_GRAD = 53
    STAGE_INFER = 54
    STAGE_SYNC = 55
    STAGE_ERROR = 56
    STAGE_STEP = 57


#: the largest int a field takes unless it declares otherwise: every int a float64 holds
#: exactly (JSON, JavaScript and sums of many of them stay exact and encodable)
MAX_INT = 2**53 - 1


@dataclass(frozen=True)
class Bound:
    """The range a header field's value must be in; checked when a message is decoded.

    Attributes:
        lo: the smallest value of an int or float field (inclusive; None: no lower bound).
        hi: the largest value (inclusive; None: no upper bound).
        max_len: at most this many characters (str), bytes (bytes) or items (list, dict).
        items: the bound of each int or float item of a list field.
        nan_ok: a float field may be NaN (meaning "no value", e.g. a diverged loss); floats
            are otherwise always finite.
    """

    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None
    items: Bound | None = None
    nan_ok: bool = False

    def describe(self) -> str:
        """The bound as docs/protocol.md lists it, e.g. ``0 <= x <= 2^53-1``."""
        parts = []
        if self.lo is not None and self.hi is not None:
            parts.append(f"{_num(self.lo)} <= x <= {_num(self.hi)}")
        elif self.lo is not None:
            parts.append(f"x >= {_num(self.lo)}")
        elif self.hi is not None:
            parts.append(f"x <= {_num(self.hi)}")
        if self.nan_ok:
            parts.append("or NaN")
        if self.max_len is not None:
            parts.append(f"len <= {_num(self.max_len)}")
        if self.items is not None:
            parts.append(f"items {self.items.describe()}")
        return ", ".join(parts)


def _num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 2**63:
        n = int(x)
        for k in range(10, 64):
            if abs(n) == 2**k:
                return f"{'-' if n < 0 else ''}2^{k}"
            if abs(n) == 2**k - 1:
                return f"{'-' if n < 0 else ''}2^{k}-1"
        if abs(n) < 10**7:
            return str(n)
    return f"{float(x):g}"


#: the bound of a field whose class declares none, by its type
DEFAULT_BOUNDS: dict[type, Bound] = {
    int: Bound(lo=0, hi=MAX_INT),
    float: Bound(lo=-1e30, hi=1e30),
    str: Bound(max_len=1 << 20),
    bytes: Bound(max_len=1 << 20),
    list: Bound(max_len=1 << 16),
    dict: Bound(max_len=1 << 16),
}


#: characters of an error's text at most (a longer one is cut where it is built): whatever a
#: remote side sends ends up in log lines
MAX_TEXT = 8192


def _cut(text: Any) -> Any:
    if isinstance(text, str) and len(text) > MAX_TEXT:
        return text[:MAX_TEXT - 3] + "..."
    return text


class OutOfRange(RemoteProtocolError):
    """A well-formed message with a field outside its :class:`Bound` (code ``out_of_range``).

    The frame itself was sound, so the stream goes on: the message is dropped unseen by the
    role, and the sender is told. ``fatal`` only for the handshake's messages.

    Attributes:
        message_type, field: which field of which message.
        value: the offending value, shortened for messages.
        bound: the field's bound, as :meth:`Bound.describe` says it.
    """

    def __init__(self, message_type: MsgType, field_name: str, value: Any, bound: Bound, what: str) -> None:
        shown = repr(value)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        super().__init__("out_of_range", f"{message_type.name} field '{field_name}' is out of range: "
                                         f"{what} {shown}, the protocol allows {bound.describe()}")
        self.message_type = message_type
        self.field = field_name
        self.value = shown
        self.bound = bound.describe()
        self.fatal = message_type in HANDSHAKE_TYPES


@dataclass(frozen=True)
class Message:
    """Base of all messages; ``TYPE`` is the frame's type byte; ``BOUNDS`` the ranges of the
    fields that do not take :data:`DEFAULT_BOUNDS`."""

    TYPE: ClassVar[MsgType]
    BOUNDS: ClassVar[Mapping[str, Bound]] = {}

    def fields(self) -> dict[str, Any]:
        """The header fields (everything but ``tensors``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tensors"}

    def tensor_map(self) -> TensorMap:
        return getattr(self, "tensors", {})


# --- handshake -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    """Client → server: opens the handshake with a fresh nonce and what the client claims to be
    (``role``, and ``node``, its node id if it has one); both proofs cover every field."""

    TYPE = MsgType.HELLO
    BOUNDS = {"role": Bound(max_len=64), "nonce": Bound(max_len=1024), "software": Bound(max_len=256),
              "node": Bound(max_len=128)}
    role: str
    nonce: bytes
    software: str = ""
    node: str = ""


@dataclass(frozen=True)
class Challenge(Message):
    """Server → client: the server's nonce and its proof (over the whole transcript) that it
    knows the cluster secret."""

    TYPE = MsgType.CHALLENGE
    BOUNDS = {"nonce": Bound(max_len=1024), "proof": Bound(max_len=1024)}
    nonce: bytes
    proof: bytes
    open_cluster: bool = False


@dataclass(frozen=True)
class Auth(Message):
    """Client → server: the client's proof (over the whole transcript) that it knows the secret,
    and, from a client with a node identity, its Ed25519 ``public_key`` (whose peer id is
    ``HELLO.node``) and its ``signature`` over the transcript: the server then takes ``node``
    as verified."""

    TYPE = MsgType.AUTH
    BOUNDS = {"proof": Bound(max_len=1024), "public_key": Bound(max_len=64), "signature": Bound(max_len=128)}
    proof: bytes
    public_key: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class Welcome(Message):
    """Server → client: authentication succeeded; ``proof`` binds ``session`` to the transcript."""

    TYPE = MsgType.WELCOME
    session: str
    proof: bytes


# --- parameter server ------------------------------------------------------------------


@dataclass(frozen=True)
class Register(Message):
    """Worker → coordinator: who I am, what model I hold and what I can do."""

    TYPE = MsgType.REGISTER
    BOUNDS = {
        "batch_size": Bound(lo=1, hi=1 << 20), "accumulation_steps": Bound(lo=1, hi=1 << 12),
        "shard_index": Bound(lo=-1, hi=1 << 20), "samples_per_sec": Bound(lo=0.0, hi=1e9),
        "hardware": Bound(max_len=64), "compression": Bound(max_len=64), "partition": Bound(max_len=64)}
    worker_id: str
    task: str
    fingerprint: list[Any]
    hardware: dict[str, Any]
    batch_size: int
    accumulation_steps: int
    shard_index: int
    compression: dict[str, Any]
    samples_per_sec: float
    last_msg_id: int = 0
    #: the fingerprint of the parameter partition the worker computed for a sharded cluster
    #: (roles/ps/partition.py); "" = not known yet (its first REGISTER to the leader, whose
    #: REGISTER_ACK ``info`` says the servers and the partition)
    partition: str = ""


@dataclass(frozen=True)
class RegisterAck(Message):
    """Coordinator → worker: accepted; the shard to train on and whether training runs."""

    TYPE = MsgType.REGISTER_ACK
    BOUNDS = {"shard_index": Bound(lo=-1, hi=1 << 20), "num_shards": Bound(lo=1, hi=1 << 20),
              "shards": Bound(max_len=1 << 16, items=Bound(lo=0, hi=1 << 20))}
    worker_id: str
    shard_index: int
    num_shards: int
    running: bool
    paused: bool
    version: int
    last_applied_msg_id: int
    shards: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Weights(Message):
    """Coordinator → worker: full weights at ``version`` (initial sync and periodic resync)."""

    TYPE = MsgType.WEIGHTS
    version: int
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class Gradients(Message):
    """Worker → coordinator: a (compressed) gradient computed on weights of ``version``.

    ``msg_id`` increases per worker; a coordinator applies each (worker, msg_id) once.
    ``codecs`` maps parameter name → {codec, shape, dtype, meta}; the parts of parameter
    ``p`` travel as tensors named ``p/<part>``. Only parameters that got a gradient are
    carried (a frozen one never, an unused one not on that step).
    """

    TYPE = MsgType.GRADIENTS
    BOUNDS = {
        "samples": Bound(lo=0, hi=1 << 40), "loss": Bound(lo=-1e30, hi=1e30, nan_ok=True),
        "residual_norm": Bound(lo=0.0, hi=1e30, nan_ok=True),
        "total_norm": Bound(lo=0.0, hi=1e30, nan_ok=True)}
    msg_id: int
    version: int
    samples: int
    loss: float
    codecs: dict[str, Any]
    residual_norm: float = 0.0
    #: in a sharded cluster, the L2 norm of the worker's whole gradient, of which this message
    #: carries one server's slice: every server screens and clips by the same norm (0 = unknown)
    total_norm: float = 0.0
    #: buffers (BatchNorm statistics...) this computation changed: how much each changed
    #: travels as payload tensor ``#i`` for the i-th name
    buffers: list[str] = field(default_factory=list)
    tensors: TensorMap = field(default_factory=dict)


class UpdateStatus(enum.StrEnum):
    """What became of the gradient an UPDATE answers; travels as its string value."""

    APPLIED = "applied"
    STALE = "stale"  # dropped: older than max_staleness
    DUPLICATE = "duplicate"  # already applied before a reconnect
    REJECTED = "rejected"  # bad values
    FINISHED = "finished"  # not applied: the run reached max_steps (SHUTDOWN follows)


@dataclass(frozen=True)
class Update(Message):
    """Coordinator → worker: answer to GRADIENTS ``msg_id``, and what brings the worker's
    replica to the published weights of ``version``.

    ``status`` is an :class:`UpdateStatus` value: ``applied``, ``stale`` (dropped: older than
    max_staleness), ``duplicate`` (already applied before a reconnect), ``rejected`` (bad
    values) or ``finished`` (not applied: the run reached ``max_steps``, SHUTDOWN follows). It
    decodes as a plain string, so a worker counts one it does not know.

    ``deltas`` is a chain of entries of the coordinator's update log, oldest first, each
    ``{"from": v0, "to": v1, "codecs": {name: spec}}``: the compressed change from published
    version ``v0`` to ``v1``, its payload tensors named ``"{v0}:{name}/{part}"``. The first
    starts at the version the worker holds, each next one where the previous ended, the last
    ends at ``version``; an empty chain changes nothing. With ``full`` set, ``tensors`` are the
    complete published weights (a resync) and ``deltas`` is empty.
    """

    TYPE = MsgType.UPDATE
    BOUNDS = {"status": Bound(max_len=32), "deltas": Bound(max_len=1 << 16)}
    msg_id: int
    version: int
    status: str
    deltas: list[dict[str, Any]] = field(default_factory=list)
    full: bool = False
    #: buffers whose master values changed since the worker last got them: each travels as
    #: payload tensor ``#i`` (its value) for the i-th name
    buffers: list[str] = field(default_factory=list)
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class Assign(Message):
    """Coordinator → worker: train on these shards from now on (workers came or went)."""

    TYPE = MsgType.ASSIGN
    BOUNDS = {"shards": Bound(max_len=1 << 16, items=Bound(lo=0, hi=1 << 20)),
              "num_shards": Bound(lo=1, hi=1 << 20)}
    shards: list[int]
    num_shards: int


@dataclass(frozen=True)
class Verdict(Message):
    """Leader → the other parameter servers of a sharded cluster: what became of worker
    ``worker_id``'s gradient ``msg_id`` on the leader (an :class:`UpdateStatus` value), and
    its staleness there; a server that follows the leader does the same with its slice."""

    TYPE = MsgType.VERDICT
    BOUNDS = {"worker_id": Bound(max_len=256), "status": Bound(max_len=32)}
    worker_id: str
    msg_id: int
    status: str
    staleness: int


@dataclass(frozen=True)
class Start(Message):
    TYPE = MsgType.START
    version: int


@dataclass(frozen=True)
class Pause(Message):
    TYPE = MsgType.PAUSE


@dataclass(frozen=True)
class Resume(Message):
    TYPE = MsgType.RESUME


@dataclass(frozen=True)
class Shutdown(Message):
    TYPE = MsgType.SHUTDOWN
    BOUNDS = {"reason": Bound(max_len=MAX_TEXT)}
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE = MsgType.HEARTBEAT
    BOUNDS = {"time": Bound(lo=0.0, hi=1e12)}
    time: float
    step: int = 0


@dataclass(frozen=True)
class CheckpointMsg(Message):
    """A request to checkpoint now (empty ``path``), or the answer naming the file written."""

    TYPE = MsgType.CHECKPOINT
    BOUNDS = {"path": Bound(max_len=4096), "message": Bound(max_len=MAX_TEXT)}
    path: str = ""
    step: int = 0
    ok: bool = True
    message: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", _cut(self.message))


@dataclass(frozen=True)
class Error(Message):
    """Either side: what was wrong. ``fatal`` errors are followed by closing the connection.
    A ``message`` longer than :data:`MAX_TEXT` is cut to it when the error is built."""

    TYPE = MsgType.ERROR
    BOUNDS = {"code": Bound(max_len=64), "message": Bound(max_len=MAX_TEXT)}
    code: str
    message: str
    fatal: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", _cut(self.message))


@dataclass(frozen=True)
class StatusRequest(Message):
    TYPE = MsgType.STATUS_REQUEST


@dataclass(frozen=True)
class Status(Message):
    """The coordinator's status: step, loss, version, workers (a msgpack-able dict)."""

    TYPE = MsgType.STATUS
    BOUNDS = {"status": Bound(max_len=256)}
    status: dict[str, Any]


# --- peer mode: membership (signed with the sender's Ed25519 identity) -------------------


@dataclass(frozen=True)
class PeerHello(Message):
    """Peer → peer: who are you? (answered with PEER_INFO)."""

    TYPE = MsgType.PEER_HELLO
    run: str


@dataclass(frozen=True)
class PeerInfoMsg(Message):
    """A peer's identity and addresses; ``peer_id`` must be the hash of ``public_key``."""

    TYPE = MsgType.PEER_INFO
    BOUNDS = {"ring_port": Bound(lo=0, hi=65535)}
    peer_id: str
    public_key: bytes
    ring_port: int
    run: str
    profile: str
    epoch: int
    rounds: int


@dataclass(frozen=True)
class Propose(Message):
    """Proposer → member: the next epoch's members (peer ids in ring order) and ring addresses."""

    TYPE = MsgType.PROPOSE
    BOUNDS = {"members": Bound(max_len=4096), "group": Bound(lo=0, hi=1 << 16)}
    epoch: int
    proposer: str
    members: list[str]
    addresses: dict[str, Any]
    #: the training behind the proposer's state (samples) and the size of its working group
    #: (0 if its ring is not working): a member of a healthy group led by another peer accepts
    #: only a proposer of a larger working group, or of one as large whose state carries more
    work: int = 0
    group: int = 0
    public_key: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class Accept(Message):
    """Member → proposer: accept (or refuse, with ``ok`` false and a reason) a proposal."""

    TYPE = MsgType.ACCEPT
    BOUNDS = {"group": Bound(lo=0, hi=1 << 16)}
    epoch: int
    peer_id: str
    ok: bool
    rounds: int
    reason: str = ""
    #: the training behind this member's state (samples) and its working group's size (0 if
    #: its ring is not working): they rank the donor
    work: int = 0
    group: int = 0
    #: the views this member's quorum must respect: ``[epoch, [members...]]`` of the view it
    #: has installed and of the last view it completed a collective in (empty: a newcomer)
    anchors: list[Any] = field(default_factory=list)
    #: on a refusal: a machine-readable reason (``follows``, ``stale_epoch``, ``promised``,
    #: ``not_ready``, ``not_member``, ``bad_signature``)
    code: str = ""
    #: on a refusal with code ``follows``: the leader this member follows, and the highest
    #: epoch it has seen (a proposer asks again above it)
    leader: str = ""
    seen: int = 0
    public_key: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class Commit(Message):
    """Proposer → member: the epoch is agreed with exactly these members; ``donor`` sends its
    state to all before the first round."""

    TYPE = MsgType.COMMIT
    BOUNDS = {"members": Bound(max_len=4096)}
    epoch: int
    proposer: str
    members: list[str]
    addresses: dict[str, Any]
    donor: str
    public_key: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class Reform(Message):
    """Member → proposer: my ring of ``epoch`` broke; abort yours and agree a new epoch.
    Signed like PROPOSE, by ``peer_id``'s key: an unsigned or forged one is ignored."""

    TYPE = MsgType.REFORM
    epoch: int
    peer_id: str
    #: ``broke`` (my ring of ``epoch`` broke), ``join`` (I am back and not in your view:
    #: include me at your next boundary) or ``leave`` (I am shutting down: do not wait for me)
    kind: str = "broke"
    public_key: bytes = b""
    signature: bytes = b""


#: a stage answers a negative micro-batch id itself (``bad_input``, naming the request)
_MICROBATCH = Bound(lo=-MAX_INT, hi=MAX_INT)
_GROUP_START = Bound(lo=-1, hi=MAX_INT)
#: micro-batches one synchronous step may name (and an answer may list as missing)
MAX_GROUP = 4096
_GROUP_SIZE = Bound(lo=0, hi=MAX_GROUP)
_STAGE_ANSWER_BOUNDS = {"missing": Bound(max_len=MAX_GROUP, items=_MICROBATCH),
                        "steps": Bound(lo=0, hi=MAX_INT), "at_risk": Bound(lo=0, hi=MAX_INT),
                        "incarnation": Bound(max_len=64)}
#: the squared norm of a stage's gradient (-1 = not reported; a stage caps it at 1e30)
MAX_GRAD_SQ = 1e30
_GRAD_SQ = Bound(lo=-1.0, hi=MAX_GRAD_SQ)


# --- pipeline mode: stage servers -------------------------------------------------------
# Every request carries ``req``, a per-connection request id the answer repeats, so one
# connection can have many requests in flight and answers may come back in any order.


@dataclass(frozen=True)
class StageForward(Message):
    """Trainer → stage: training forward of micro-batch ``microbatch`` of ``session``.

    Tensors: ``x`` (the stage input), and for the last stage ``targets``.

    ``sync``: the trainer decides when this stage steps (the synchronous schedule): the last
    stage, which applies the backward within the forward, takes its optimizer step after this
    micro-batch if ``step`` is set and only then. Without ``sync`` it steps every
    ``accumulate`` micro-batches of its own counting. With ``sync``, ``group`` and
    ``group_size`` name the micro-batches of the step this one belongs to (``group`` …
    ``group + group_size - 1`` of ``session``): the stage drops gradient sums of another
    group when it gets the first of a new one, and at the ``step`` a stage missing some of
    them does not step and lists them in its answer's ``missing``.
    """

    TYPE = MsgType.STAGE_FORWARD
    BOUNDS = {"priority": Bound(lo=0, hi=255), "microbatch": _MICROBATCH, "group": _GROUP_START,
              "group_size": _GROUP_SIZE}
    req: int
    session: str
    microbatch: int
    priority: int = 20
    tensors: TensorMap = field(default_factory=dict)
    sync: bool = False
    step: bool = False
    group: int = -1
    group_size: int = 0


@dataclass(frozen=True)
class StageResult(Message):
    """Stage → trainer: answer to STAGE_FORWARD or STAGE_INFER.

    Tensors: ``y`` (the output; the loss as a 0-d tensor from the last stage's training
    forward). With ``done`` set the stage has already applied this micro-batch's backward
    (always so on the last stage) and ``grad``, the gradient of the stage input, comes along
    (absent on stage 0, whose input is not differentiable).

    Every training answer (this and STAGE_GRAD) also says ``missing`` (a step request's
    micro-batches the stage does not hold: it did not step; resend them, the last with the
    step), ``steps`` (its optimizer steps now), ``at_risk`` (of those, how many no
    checkpoint and no replica holds yet) and ``incarnation`` (an id drawn when the process
    started: a new one means the stage restarted and lost what it held in memory).
    """

    TYPE = MsgType.STAGE_RESULT
    BOUNDS = {"microbatch": _MICROBATCH, "grad_sq": _GRAD_SQ, **_STAGE_ANSWER_BOUNDS}
    req: int
    session: str
    microbatch: int
    done: bool = False
    tensors: TensorMap = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    steps: int = 0
    at_risk: int = 0
    incarnation: str = ""
    grad_sq: float = -1.0


@dataclass(frozen=True)
class StageBackward(Message):
    """Trainer → stage: the gradient ``grad`` of the stage output of an earlier forward.
    ``sync``, ``step``, ``group`` and ``group_size`` as in STAGE_FORWARD: with ``sync`` the
    stage steps after applying this backward if ``step`` is set (and it holds the whole
    group), and only then."""

    TYPE = MsgType.STAGE_BACKWARD
    BOUNDS = {"microbatch": _MICROBATCH, "group": _GROUP_START, "group_size": _GROUP_SIZE}
    req: int
    session: str
    microbatch: int
    tensors: TensorMap = field(default_factory=dict)
    sync: bool = False
    step: bool = False
    group: int = -1
    group_size: int = 0


@dataclass(frozen=True)
class StageGrad(Message):
    """Stage → trainer: answer to STAGE_BACKWARD; ``grad`` of the stage input (none for
    stage 0). ``duplicate``: the backward had been applied before and was not applied again.
    ``missing``, ``steps``, ``at_risk``, ``incarnation``: as in STAGE_RESULT."""

    TYPE = MsgType.STAGE_GRAD
    BOUNDS = {"microbatch": _MICROBATCH, "grad_sq": _GRAD_SQ, **_STAGE_ANSWER_BOUNDS}
    req: int
    session: str
    microbatch: int
    duplicate: bool = False
    tensors: TensorMap = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    steps: int = 0
    at_risk: int = 0
    incarnation: str = ""
    grad_sq: float = -1.0


@dataclass(frozen=True)
class StageInfer(Message):
    """Client → stage: forward of ``x`` without gradients (generation, evaluation).

    ``cache``: the stage keeps, for ``session``, what it computed (the attention keys and
    values of each position), and ``x`` holds only the positions from ``start`` on: the
    answer's ``y`` has those positions only. ``start`` 0 begins the session's cache afresh;
    any other ``start`` must be the length the stage holds for the session, else the answer
    is STAGE_ERROR ``cache_miss`` (evicted, expired, the weights changed since, or another
    replica): resend the whole window from position 0.
    """

    TYPE = MsgType.STAGE_INFER
    BOUNDS = {"priority": Bound(lo=0, hi=255), "start": Bound(lo=0, hi=MAX_INT)}
    req: int
    session: str
    priority: int = 10
    tensors: TensorMap = field(default_factory=dict)
    cache: bool = False
    start: int = 0


@dataclass(frozen=True)
class StageSync(Message):
    """Replica → replica of the same stage: its parameters (by name) as of optimizer step
    ``step``, for averaging; the answer (``reply`` set) carries the other replica's.

    ``join``: a replica starting up asks (no tensors) for the whole state of a live one; the
    answer carries it (``model/``, ``master/`` and ``adam/`` tensors, and in ``meta`` the
    optimizer steps, lineage, shape signature, fingerprint and optimizer settings), and the
    live replica does not move."""

    TYPE = MsgType.STAGE_SYNC
    BOUNDS = {"meta": Bound(max_len=64)}
    req: int
    round: int
    step: int
    reply: bool = False
    tensors: TensorMap = field(default_factory=dict)
    join: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageStep(Message):
    """Trainer → stage: take the synchronous step of the micro-batches ``group`` …
    ``group + group_size - 1`` of ``session``, their mean gradient multiplied by ``scale``
    (the trainer's clipping of the whole model's gradient norm; 1 = none); and the answer
    (``reply`` set), saying the stage's ``steps`` after it, or the ``missing`` micro-batches
    it does not hold (it did not step), its ``at_risk`` and ``incarnation`` as in
    STAGE_RESULT. A step request for a group already stepped steps nothing again."""

    TYPE = MsgType.STAGE_STEP
    BOUNDS = {"group": _GROUP_START, "group_size": _GROUP_SIZE, "scale": Bound(lo=0.0, hi=1.0),
              **_STAGE_ANSWER_BOUNDS}
    req: int
    session: str
    group: int
    group_size: int
    scale: float = 1.0
    reply: bool = False
    missing: list[int] = field(default_factory=list)
    steps: int = 0
    at_risk: int = 0
    incarnation: str = ""


@dataclass(frozen=True)
class StageError(Message):
    """Stage → client: request ``req`` failed (``code``, ``message``); the connection stays open."""

    TYPE = MsgType.STAGE_ERROR
    BOUNDS = {"code": Bound(max_len=64), "message": Bound(max_len=MAX_TEXT)}
    req: int
    code: str
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", _cut(self.message))


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Challenge, Auth, Welcome, Register, RegisterAck, Weights, Gradients, Update, Assign, Verdict,
        Start, Pause, Resume, Shutdown, Heartbeat, CheckpointMsg, Error, StatusRequest, Status,
        PeerHello, PeerInfoMsg, Propose, Accept, Commit, Reform,
        StageForward, StageResult, StageBackward, StageGrad, StageInfer, StageSync, StageError,
        StageStep,
    )
}


#: the handshake's messages: a field out of range there ends the connection (nothing to go on with)
HANDSHAKE_TYPES = frozenset({MsgType.HELLO, MsgType.CHALLENGE, MsgType.AUTH, MsgType.WELCOME})


def _origin_ok(value: Any, origin: Any) -> bool:
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (str, bytes, bool, list, dict):
        return isinstance(value, origin)
    return True


_HINTS: dict[type[Message], dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in MESSAGE_CLASSES.values()
}


def bound_of(cls: type[Message], name: str) -> Bound | None:
    """The bound of field ``name`` of ``cls``: declared in ``cls.BOUNDS``, else the default of
    its type (None for a bool)."""
    if name in cls.BOUNDS:
        return cls.BOUNDS[name]
    hint = _HINTS[cls][name]
    return DEFAULT_BOUNDS.get(typing.get_origin(hint) or hint)


@dataclasses.dataclass(frozen=True)
class _Field:
    """What :func:`message_from_fields` checks of one field, worked out once per class."""

    name: str
    hint: Any
    origin: Any  # the hint's type as _origin_ok takes it
    required: bool
    bound: Bound | None


_FIELDS: dict[type[Message], tuple[_Field, ...]] = {
    cls: tuple(
        _Field(f.name, _HINTS[cls][f.name], typing.get_origin(_HINTS[cls][f.name]) or _HINTS[cls][f.name],
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
               bound_of(cls, f.name))
        for f in dataclasses.fields(cls) if f.name != "tensors")
    for cls in MESSAGE_CLASSES.values()
}
_CARRIES_TENSORS = {cls: any(f.name == "tensors" for f in dataclasses.fields(cls))
                    for cls in MESSAGE_CLASSES.values()}


def _check_number(mtype: MsgType, name: str, value: int | float, bound: Bound) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value) and bound.nan_ok:
            return
        raise OutOfRange(mtype, name, value, bound, "not a finite number:")
    if (bound.lo is not None and value < bound.lo) or (bound.hi is not None and value > bound.hi):
        raise OutOfRange(mtype, name, value, bound, "value")


def _check_bound(mtype: MsgType, name: str, value: Any, bound: Bound) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        _check_number(mtype, name, value, bound)
        return
    if bound.max_len is not None and isinstance(value, str | bytes | list | dict) \
            and len(value) > bound.max_len:
        raise OutOfRange(mtype, name, f"<{len(value)} long>", bound, "length")
    if bound.items is not None and isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, int | float) and not isinstance(item, bool):
                _check_number(mtype, f"{name}[{i}]", item, bound.items)


def message_from_fields(
    mtype: MsgType, fields: Mapping[str, Any], tensors: dict[str, torch.Tensor]
) -> Message:
    """Build a message of ``mtype`` from decoded header fields, checking each field.

    Unknown extra fields are ignored (a newer peer may add optional ones).

    Raises:
        OutOfRange: a field is outside its :class:`Bound` (the frame was sound).
        RemoteProtocolError: a required field is missing or has the wrong type, or tensors
            arrived on a message type that carries none.
    """
    cls = MESSAGE_CLASSES[mtype]
    kwargs: dict[str, Any] = {}
    for f in _FIELDS[cls]:
        if f.name not in fields:
            if f.required:
                raise RemoteProtocolError(
                    "missing_field", f"{mtype.name} message lacks required field '{f.name}'"
                )
            continue
        value = fields[f.name]
        if not _origin_ok(value, f.origin):
            raise RemoteProtocolError(
                "bad_field",
                f"{mtype.name} field '{f.name}' should be {f.hint}, got {type(value).__name__}",
            )
        if f.hint is float:
            value = float(value)
        if f.bound is not None:
            _check_bound(mtype, f.name, value, f.bound)
        kwargs[f.name] = value
    if _CARRIES_TENSORS[cls]:
        kwargs["tensors"] = tensors
    elif tensors:
        raise RemoteProtocolError("unexpected_tensors", f"{mtype.name} messages carry no tensors")
    return cls(**kwargs)
