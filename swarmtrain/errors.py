"""The one exception tree of swarmtrain.

Everything swarmtrain raises on purpose derives from :class:`SwarmError`; anything else
escaping is a bug. Protocol errors are split by blame, as in h11: :class:`RemoteProtocolError`
means the other side sent something malformed, :class:`LocalProtocolError` means this
program tried to send something the protocol cannot carry.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "SwarmError",
    "ConfigError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "SwarmTimeout",
    "ConnectionLost",
    "TruncatedFrame",
    "RefusedError",
    "ModelMismatch",
    "CheckpointError",
    "TaskError",
    "StateError",
]


class SwarmError(Exception):
    """Base of every error swarmtrain raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A config key, value or file is wrong; the message names the key and what is allowed."""


class ProtocolError(SwarmError):
    """A frame or message breaks the wire protocol.

    Attributes:
        code: a short stable identifier of what was wrong (``bad_magic``, ``oversize_header``...),
            also sent to the remote side in an ERROR message.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """This program tried to encode something the protocol cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The remote side sent bytes that are not a valid frame or message."""


class AuthError(SwarmError):
    """The cluster-secret handshake failed (wrong or missing secret, or protocol mismatch)."""


class SwarmTimeout(SwarmError, TimeoutError):
    """A named phase (connect, handshake, register, heartbeat, send...) took too long.

    Attributes:
        phase: the name of the phase that timed out.
        seconds: the limit that was exceeded.
    """

    def __init__(self, phase: str, seconds: float, detail: str = "") -> None:
        msg = f"timed out in phase '{phase}' after {seconds:g} s"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.phase = phase
        self.seconds = seconds


class ConnectionLost(SwarmError, ConnectionError):
    """The connection closed or broke while it was needed."""


class RefusedError(SwarmError):
    """The remote side refused us with an ERROR message (code and text from the remote)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.remote_message = message


class ModelMismatch(SwarmError):
    """A worker's model does not match the coordinator's (names, shapes or dtypes differ)."""


class CheckpointError(SwarmError):
    """A checkpoint could not be written, or one on disk is corrupt or incomplete."""


class TaskError(SwarmError):
    """A task could not be found, loaded or built."""


class TruncatedFrame(RemoteProtocolError, ConnectionLost):
    """The connection ended inside a frame (code ``truncated_frame``): a protocol error of the
    sender's, and a lost connection to whoever was waiting on it."""

    def __init__(self, message: str) -> None:
        RemoteProtocolError.__init__(self, "truncated_frame", message)


class StateError(SwarmError):
    """An operation the object's current lifecycle state does not allow (pausing a run that is
    shutting down, a move its state table does not list); the message names the state."""

    @classmethod
    def check_move(cls, who: str, table: Mapping[Any, Collection[Any]], old: Any, new: Any) -> None:
        """Refuse a move of enum states ``old -> new`` that ``table`` (state -> the states it
        may go to) does not list, saying what ``who`` may do from ``old`` instead."""
        if new not in table[old]:
            allowed = ", ".join(repr(s.value) for s in table[old]) or "nothing"
            raise cls(f"the {who} cannot go from {old.value!r} to {new.value!r} "
                      f"(from {old.value!r} it may go to {allowed})")
