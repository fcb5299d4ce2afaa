"""Sans-IO wire protocol: frames, messages and tensor payloads. No sockets here."""

from swarmtrain.wire.frame import (
    MAGIC,
    PREAMBLE,
    PROTOCOL_VERSION,
    Decoder,
    Limits,
    encode,
    encode_bytes,
)
from swarmtrain.wire.messages import *  # noqa: F403
from swarmtrain.wire.messages import __all__ as _messages_all
from swarmtrain.wire.tensors import ALIGN, DTYPES, TensorDesc

__all__ = [
    "MAGIC", "PREAMBLE", "PROTOCOL_VERSION", "Decoder", "Limits", "encode", "encode_bytes",
    "ALIGN", "DTYPES", "TensorDesc", *_messages_all,
]
