"""Refusals counted by reason: what an operator reads on ``/metrics`` and in ``ctl status``.

Every server (:func:`~swarmtrain.transport.endpoints.start_server`) keeps one, in its
``Admission``: the connections it turns away (a failed handshake by its ``ERROR`` code,
``too_many_connections``, ``auth_rate_limited``, ``tls``, a malformed frame by its framing
code) and the messages of its connections dropped for a field out of range
(``out_of_range``). Each role keeps one more for what it refuses itself
(``Coordinator.refusals``: a rejected gradient, ``worker_id_taken``...; ``StageServer.refusals``,
``PeerBackend.refusals``), and its status adds the two.

A reason is a short code (``[a-z][a-z0-9_]*``, at most :data:`MAX_REASON_CHARS`), the same
codes the ``ERROR`` messages carry. The counter keeps at most :data:`MAX_REASONS` distinct
reasons; anything else (a malformed code, one past the cap) is counted as ``other``, so the
status and the metrics stay bounded whatever a remote side makes us count.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["MAX_REASONS", "MAX_REASON_CHARS", "OTHER", "RefusalCounter", "merge_refusals"]

#: distinct reasons one counter keeps (then new ones fold into :data:`OTHER`)
MAX_REASONS = 64
#: characters of a reason at most
MAX_REASON_CHARS = 40
#: where malformed reasons and those past :data:`MAX_REASONS` are counted
OTHER = "other"

_CODE = re.compile(rf"[a-z][a-z0-9_]{{0,{MAX_REASON_CHARS - 1}}}")


class RefusalCounter:
    """Refusals by reason; thread-safe (the compute and ring threads count too), bounded.

    Args:
        max_reasons: distinct reasons kept; past them a new reason is counted as ``other``.
    """

    def __init__(self, max_reasons: int = MAX_REASONS) -> None:
        self.max_reasons = max_reasons
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, reason: str, n: int = 1) -> None:
        """Count ``n`` refusals for ``reason`` (a code such as ``auth_failed``)."""
        key = reason if isinstance(reason, str) and _CODE.fullmatch(reason) else OTHER
        with self._lock:
            if key not in self._counts and key != OTHER:
                kept = len(self._counts) - (OTHER in self._counts)
                if kept >= self.max_reasons - 1:  # one place is kept for OTHER itself
                    key = OTHER
            self._counts[key] += n

    def __getitem__(self, reason: str) -> int:
        with self._lock:
            return self._counts.get(reason, 0)

    def get(self, reason: str, default: int = 0) -> int:
        with self._lock:
            return self._counts.get(reason, default)

    def snapshot(self) -> dict[str, int]:
        """``{reason: count}`` now (a copy, safe to encode while other threads count)."""
        with self._lock:
            return dict(self._counts)

    def items(self) -> list[tuple[str, int]]:
        """``(reason, count)`` pairs now."""
        return list(self.snapshot().items())

    def total(self) -> int:
        """Refusals counted, all reasons."""
        with self._lock:
            return sum(self._counts.values())

    def __repr__(self) -> str:
        return f"RefusalCounter({self.snapshot()!r})"


def merge_refusals(parts: Iterable[Mapping[str, int] | RefusalCounter]) -> dict[str, int]:
    """The sum of several counters (or their snapshots), sorted by reason."""
    total: Counter[str] = Counter()
    for part in parts:
        total.update(part.snapshot() if isinstance(part, RefusalCounter) else dict(part))
    return dict(sorted(total.items()))
