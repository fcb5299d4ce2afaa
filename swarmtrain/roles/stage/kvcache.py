"""Incremental inference for generation: each stage keeps, per session, what it has seen.

A layer that supports it implements :class:`IncrementalLayer`:
``forward_incremental(x_new, state, start) -> (y_new, state)``, where ``x_new`` holds only
the positions ``start .. start + T_new - 1`` and ``state`` is that layer's cache from the
previous call (None on the first, when ``start == 0``). TextLM's embedding, blocks (their
attention keeps the keys and values of every position so far) and head implement it.
:func:`run_incremental` runs a stage's ``nn.Sequential`` this way, recomputing any layer
that lacks the method from its input history. :class:`SessionCaches` holds one stage's
states per generation session, bounded in bytes, evicting least recently used sessions and
expiring idle ones.

Positions are absolute: a session's cache ends at the model's context (TextLM's embedding
refuses positions past it). A sliding window past the context is a new session prefilled
with the window: keys computed at other positions cannot be reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "CacheMismatch",
    "CacheStats",
    "CachedState",
    "IncrementalLayer",
    "SessionCaches",
    "run_incremental",
    "state_nbytes",
    "window_step",
]

DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_IDLE_SECONDS = 300.0


@runtime_checkable
class IncrementalLayer(Protocol):
    """A layer that computes only new positions from a cache of the earlier ones."""

    def forward_incremental(self, x_new: torch.Tensor, state: Any, start: int) -> tuple[torch.Tensor, Any]:
        """Output at positions ``start .. start + T_new - 1`` and the updated state."""
        ...


def run_incremental(
    layers: nn.Sequential, x_new: torch.Tensor, states: list[Any] | None, start: int
) -> tuple[torch.Tensor, list[Any]]:
    """Run a stage's layers on new positions only, without autograd.

    Each child with ``forward_incremental`` gets its own state slot. A child without it is
    recomputed: its slot keeps the child's whole input history, the new input is appended
    along dim 1, the child runs on the whole history and the last ``T_new`` positions of
    its output are kept. That is exact for layers whose output at a position depends only
    on the inputs up to it (causal or position-wise layers, which see the history from
    position 0 just as a full forward would); it is wrong for layers that look ahead
    (bidirectional attention, a non-causal convolution).

    Layers must be in eval mode (TextLM's layers refuse training mode; a recomputed child
    runs in whatever mode it is in).

    Args:
        layers: the stage, any mix of children.
        x_new: the new positions' input, (B, T_new, ...) (token ids for an embedding).
        states: the list this function returned for the previous positions; None on the
            first call.
        start: absolute position of ``x_new[:, 0]``.

    Returns:
        The stage's output at the new positions, and the states to pass next time (a new
        list; the one given is not modified).

    Raises:
        ValueError: ``start`` is negative, not 0 on a first call, or disagrees with the
            states; the states do not match the layers; or a layer refuses (see its
            ``forward_incremental``).
    """
    children = list(layers.children())
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if states is None:
        if start != 0:
            raise ValueError(f"a first call (no states) starts at position 0, got start {start}")
        states = [None] * len(children)
    elif len(states) != len(children):
        raise ValueError(f"{len(states)} states given for a stage of {len(children)} layers")
    new_states: list[Any] = []
    x = x_new
    with torch.no_grad():
        for child, state in zip(children, states, strict=True):
            step = getattr(child, "forward_incremental", None)
            if callable(step):
                x, state = step(x, state, start)
            else:
                x, state = _recompute(child, x, state, start)
            new_states.append(state)
    return x, new_states


def window_step(total: int, cached: int, context: int) -> tuple[int, int]:
    """What a generation step sends: the tokens ``tokens[first:total]`` at position ``start``.

    Within the context the stages compute only the positions they have not cached. Past it
    the model sees the last ``context`` tokens at positions ``0 .. context - 1`` (the sliding
    window), so every cached key is at the wrong position: the step restarts the session
    with the whole window, which costs what an uncached step costs.

    Args:
        total: tokens so far (prompt and generated, > 0).
        cached: positions the stages hold for this session (0 if none).
        context: the model's context.

    Returns:
        ``(start, first)``; ``start == 0`` means a fresh session (drop the old cache).

    Raises:
        ValueError: ``total`` is not positive or ``cached`` is not in ``[0, total)``.
    """
    if total <= 0 or not 0 <= cached < total:
        raise ValueError(f"need 0 <= cached < total, got cached {cached} of {total} tokens")
    if total <= context:
        return cached, cached
    return 0, total - context


def _recompute(
    child: nn.Module, x_new: torch.Tensor, history: torch.Tensor | None, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    seen = 0 if history is None else history.shape[1]
    if seen != start:
        raise ValueError(f"{type(child).__name__}: input history holds {seen} positions, got start {start}")
    if history is None:
        # A copy: x_new may be a slice of a larger output that the history must not pin.
        history = x_new.clone(memory_format=torch.contiguous_format)
    else:
        history = torch.cat((history, x_new), dim=1)
    return child(history)[:, -x_new.shape[1]:], history


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (nested tuples, lists and dict values), each
    storage counted once, so views of one buffer are not counted twice."""
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (item.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return total


class CacheMismatch(ValueError):
    """A cache was stored or asked for at a position other than the session's cached length.

    The server answers it with "cache miss: resend from position 0".
    """


@dataclass(frozen=True)
class CachedState:
    """One session's cache: the stage's states and the positions they cover (the next start)."""

    state: Any
    length: int


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of a :class:`SessionCaches`' counters.

    Attributes:
        hits: ``get`` calls that found the session.
        misses: ``get`` calls that did not (never stored, evicted or expired).
        evictions: sessions dropped to stay within ``max_bytes`` (a state larger than the
            whole bound counts too: it is not kept).
        expired: sessions dropped after ``idle_seconds`` without use.
        bytes: bytes of the tensors held now.
        sessions: sessions held now.
    """

    hits: int
    misses: int
    evictions: int
    expired: int
    bytes: int
    sessions: int


@dataclass
class _Entry:
    cached: CachedState
    nbytes: int
    last_used: float


class SessionCaches:
    """Per-session incremental states of one stage, bounded in bytes, thread-safe.

    Sessions are kept in least-recently-used order; a ``put`` that takes the total over
    ``max_bytes`` evicts whole sessions, least recently used first (never the one being
    stored, unless it alone is larger than the bound: then it is not kept). A session not
    used (``get`` or ``put``) for ``idle_seconds`` expires; expiry is checked on every call.

    Args:
        max_bytes: bound on the bytes of all states held (> 0).
        idle_seconds: a session unused this long is dropped (> 0).
        clock: monotonic seconds; tests pass a fake one.

    Raises:
        ValueError: a bound is not positive.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if not idle_seconds > 0:
            raise ValueError(f"idle_seconds must be > 0, got {idle_seconds}")
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._expired = 0

    def get(self, session: Hashable) -> CachedState | None:
        """The session's cache (and mark it used), or None if it holds none."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            entry = self._entries.get(session)
            if entry is None:
                self._misses += 1
                return None
            self._hits += 1
            entry.last_used = now
            self._entries.move_to_end(session)
            return entry.cached

    def put(self, session: Hashable, state: Any, length: int, *, start: int) -> None:
        """Store the session's states after the positions ``start .. length - 1``.

        Args:
            session: the generation session.
            state: the states covering positions ``0 .. length - 1`` (as
                :func:`run_incremental` returns them).
            length: positions they cover: the next call's ``start``.
            start: the position this step began at. 0 starts the session afresh
                (replacing any cache it had); otherwise it must equal the cached length.

        Raises:
            CacheMismatch (a ValueError): ``start`` is not 0 and the session's cache is
                missing (never stored, evicted, expired) or holds another length.
            ValueError: ``length`` is not greater than ``start``.
        """
        if length <= start or start < 0:
            raise ValueError(f"a step from position {start} must end after it, got length {length}")
        nbytes = state_nbytes(state)
        with self._lock:
            now = self._clock()
            self._expire(now)
            old = self._entries.get(session)
            if start != 0:
                cached = None if old is None else old.cached.length
                if cached != start:
                    held = "no cache" if cached is None else f"a cache of {cached} positions"
                    raise CacheMismatch(
                        f"session {session!r} holds {held}, not {start}: cache miss, resend "
                        "from position 0"
                    )
            if old is not None:
                self._remove(session)
            if nbytes > self.max_bytes:
                self._evictions += 1
                return
            self._entries[session] = _Entry(CachedState(state, length), nbytes, now)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._remove(oldest)
                self._evictions += 1

    def drop(self, session: Hashable) -> None:
        """Forget the session's cache (the generation ended); no error if there is none."""
        with self._lock:
            if session in self._entries:
                self._remove(session)

    def stats(self) -> CacheStats:
        """The counters, after dropping expired sessions."""
        with self._lock:
            self._expire(self._clock())
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                expired=self._expired,
                bytes=self._bytes,
                sessions=len(self._entries),
            )

    def _expire(self, now: float) -> None:
        # LRU order is last-use order, so the idle sessions are at the front.
        while self._entries:
            session, entry = next(iter(self._entries.items()))
            if now - entry.last_used < self.idle_seconds:
                return
            self._remove(session)
            self._expired += 1

    def _remove(self, session: Hashable) -> None:
        self._bytes -= self._entries.pop(session).nbytes
