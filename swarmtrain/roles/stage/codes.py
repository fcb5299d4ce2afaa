"""Why a stage refused a request: the ``code`` of a STAGE_ERROR (docs/protocol.md).

A :class:`StageErrorCode` is a :class:`str`, so it travels as the same bytes as the plain
string it stands for, and a code read off the wire (a plain ``str``) compares equal to it.
"""

from __future__ import annotations

import enum

__all__ = ["RETRYABLE", "SENDERS_FAULT", "StageErrorCode"]


class StageErrorCode(enum.StrEnum):
    """The codes a stage answers a refused request with."""

    OVERLOADED = "overloaded"  #: its buffer is full: ask again, or ask another replica
    CLOSING = "closing"  #: it is shutting down: ask another replica
    BAD_INPUT = "bad_input"  #: the request carried something the stage cannot use
    UNEXPECTED = "unexpected"  #: a message this stage does not serve (or not for this role)
    UNKNOWN_MICROBATCH = "unknown_microbatch"  #: a backward whose forward the stage no longer holds
    CACHE_MISS = "cache_miss"  #: a cached inference step without the cache: send the window again
    INTERNAL = "internal"  #: a bug in the stage (logged there); the connection stays open


#: refusals that say nothing about the request, only about the stage: another replica, or a
#: later try, may take the same request
RETRYABLE = frozenset({StageErrorCode.OVERLOADED, StageErrorCode.CLOSING})
#: refusals a sender earned with what it sent (the others are the stage's doing, and an
#: ``unknown_microbatch`` is a forward the stage evicted); they count toward a disconnect
SENDERS_FAULT = frozenset({StageErrorCode.BAD_INPUT, StageErrorCode.UNEXPECTED})
