"""Message types of the swarmtrain protocol as frozen dataclasses.

Each message class has a :class:`MsgType` and plain fields (int, float, str, bool, bytes,
list, dict) that travel in the msgpack header; messages that carry tensors have a
``tensors`` field that travels in the payload. Decoding checks every field's presence and
type, so roles only ever see well-typed messages.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from swarmtrain.errors import RemoteProtocolError

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
    "message_from_fields",
]

TensorMap = Mapping[str, torch.Tensor]


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


@dataclass(frozen=True)
class Message:
    """Base of all messages; ``TYPE`` is the frame's type byte."""

    TYPE: ClassVar[MsgType]

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
    role: str
    nonce: bytes
    software: str = ""
    node: str = ""


@dataclass(frozen=True)
class Challenge(Message):
    """Server → client: the server's nonce and its proof (over the whole transcript) that it
    knows the cluster secret."""

    TYPE = MsgType.CHALLENGE
    nonce: bytes
    proof: bytes
    open_cluster: bool = False


@dataclass(frozen=True)
class Auth(Message):
    """Client → server: the client's proof (over the whole transcript) that it knows the secret."""

    TYPE = MsgType.AUTH
    proof: bytes


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


@dataclass(frozen=True)
class RegisterAck(Message):
    """Coordinator → worker: accepted; the shard to train on and whether training runs."""

    TYPE = MsgType.REGISTER_ACK
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
    msg_id: int
    version: int
    samples: int
    loss: float
    codecs: dict[str, Any]
    residual_norm: float = 0.0
    #: buffers (BatchNorm statistics...) this computation changed: how much each changed
    #: travels as payload tensor ``#i`` for the i-th name
    buffers: list[str] = field(default_factory=list)
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class Update(Message):
    """Coordinator → worker: answer to GRADIENTS ``msg_id`` and the (compressed) weight delta
    that brings the worker's replica from its last known state to ``version``.

    ``status`` is one of ``applied``, ``stale`` (dropped: older than max_staleness),
    ``duplicate`` (already applied before a reconnect) or ``rejected`` (bad values).
    With ``full`` set, ``tensors`` are the complete weights (a resync) and ``codecs`` is empty.
    """

    TYPE = MsgType.UPDATE
    msg_id: int
    version: int
    status: str
    codecs: dict[str, Any]
    full: bool = False
    #: buffers whose master values changed since the worker last got them: each travels as
    #: payload tensor ``#i`` (its value) for the i-th name
    buffers: list[str] = field(default_factory=list)
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class Assign(Message):
    """Coordinator → worker: train on these shards from now on (workers came or went)."""

    TYPE = MsgType.ASSIGN
    shards: list[int]
    num_shards: int


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
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE = MsgType.HEARTBEAT
    time: float
    step: int = 0


@dataclass(frozen=True)
class CheckpointMsg(Message):
    """A request to checkpoint now (empty ``path``), or the answer naming the file written."""

    TYPE = MsgType.CHECKPOINT
    path: str = ""
    step: int = 0
    ok: bool = True
    message: str = ""


@dataclass(frozen=True)
class Error(Message):
    """Either side: what was wrong. ``fatal`` errors are followed by closing the connection."""

    TYPE = MsgType.ERROR
    code: str
    message: str
    fatal: bool = True


@dataclass(frozen=True)
class StatusRequest(Message):
    TYPE = MsgType.STATUS_REQUEST


@dataclass(frozen=True)
class Status(Message):
    """The coordinator's status: step, loss, version, workers (a msgpack-able dict)."""

    TYPE = MsgType.STATUS
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


# --- pipeline mode: stage servers -------------------------------------------------------
# Every request carries ``req``, a per-connection request id the answer repeats, so one
# connection can have many requests in flight and answers may come back in any order.


@dataclass(frozen=True)
class StageForward(Message):
    """Trainer → stage: training forward of micro-batch ``microbatch`` of ``session``.

    Tensors: ``x`` (the stage input), and for the last stage ``targets``.
    """

    TYPE = MsgType.STAGE_FORWARD
    req: int
    session: str
    microbatch: int
    priority: int = 20
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class StageResult(Message):
    """Stage → trainer: answer to STAGE_FORWARD or STAGE_INFER.

    Tensors: ``y`` (the output; the loss as a 0-d tensor from the last stage's training
    forward). With ``done`` set the stage has already applied this micro-batch's backward
    (always so on the last stage) and ``grad``, the gradient of the stage input, comes along
    (absent on stage 0, whose input is not differentiable).
    """

    TYPE = MsgType.STAGE_RESULT
    req: int
    session: str
    microbatch: int
    done: bool = False
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class StageBackward(Message):
    """Trainer → stage: the gradient ``grad`` of the stage output of an earlier forward."""

    TYPE = MsgType.STAGE_BACKWARD
    req: int
    session: str
    microbatch: int
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class StageGrad(Message):
    """Stage → trainer: answer to STAGE_BACKWARD; ``grad`` of the stage input (none for
    stage 0). ``duplicate``: the backward had been applied before and was not applied again."""

    TYPE = MsgType.STAGE_GRAD
    req: int
    session: str
    microbatch: int
    duplicate: bool = False
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class StageInfer(Message):
    """Client → stage: forward of ``x`` without gradients (generation, evaluation)."""

    TYPE = MsgType.STAGE_INFER
    req: int
    session: str
    priority: int = 10
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class StageSync(Message):
    """Replica → replica of the same stage: its parameters (by name) as of optimizer step
    ``step``, for averaging; the answer (``reply`` set) carries the other replica's."""

    TYPE = MsgType.STAGE_SYNC
    req: int
    round: int
    step: int
    reply: bool = False
    tensors: TensorMap = field(default_factory=dict)


@dataclass(frozen=True)
class StageError(Message):
    """Stage → client: request ``req`` failed (``code``, ``message``); the connection stays open."""

    TYPE = MsgType.STAGE_ERROR
    req: int
    code: str
    message: str


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Challenge, Auth, Welcome, Register, RegisterAck, Weights, Gradients, Update, Assign,
        Start, Pause, Resume, Shutdown, Heartbeat, CheckpointMsg, Error, StatusRequest, Status,
        PeerHello, PeerInfoMsg, Propose, Accept, Commit, Reform,
        StageForward, StageResult, StageBackward, StageGrad, StageInfer, StageSync, StageError,
    )
}


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
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


def message_from_fields(
    mtype: MsgType, fields: Mapping[str, Any], tensors: dict[str, torch.Tensor]
) -> Message:
    """Build a message of ``mtype`` from decoded header fields, checking each field.

    Unknown extra fields are ignored (a newer peer may add optional ones).

    Raises:
        RemoteProtocolError: a required field is missing or has the wrong type, or tensors
            arrived on a message type that carries none.
    """
    cls = MESSAGE_CLASSES[mtype]
    hints = _HINTS[cls]
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "tensors":
            kwargs["tensors"] = tensors
            continue
        if f.name not in fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RemoteProtocolError(
                    "missing_field", f"{mtype.name} message lacks required field '{f.name}'"
                )
            continue
        value = fields[f.name]
        if not _type_ok(value, hints[f.name]):
            raise RemoteProtocolError(
                "bad_field",
                f"{mtype.name} field '{f.name}' should be {hints[f.name]}, got {type(value).__name__}",
            )
        if hints[f.name] is float:
            value = float(value)
        kwargs[f.name] = value
    if tensors and "tensors" not in kwargs:
        raise RemoteProtocolError("unexpected_tensors", f"{mtype.name} messages carry no tensors")
    return cls(**kwargs)
