"""The outlier screen for gradient norms: clip what is far above the cluster's usual norm.

The coordinator asks :meth:`NormScreen.check` about every gradient's L2 norm and multiplies
the gradient by the factor it returns. The *reference* norm it compares against is built so
that neither slow, honest convergence nor one lying worker can move it far:

* **Per-worker windows, median of medians.** Each worker keeps its last ``window``
  log-norms; the reference is the median, across workers, of each worker's median. A worker
  that sends more often than the others, or sends wild values, moves only its own median,
  and with three or more workers one median cannot move the median of them. With an even
  count the two middle values are averaged in the log domain (their geometric mean).
* **Clip, never refuse; every norm counts.** A norm over ``factor`` x the reference is
  scaled down to it, and it still enters its window. (An EMA of *accepted* norms ratchets
  down as training converges: honest large norms are refused, never counted, so the mean
  falls until ordinary gradients are refused. Here honest large norms still count.)
* **Bounded steps of the reference.** Where a worker's median enters the reference by
  value (the two middle ones of an even count), it is first clamped to within ``spread =
  max(sqrt(factor), 4)`` of the previous reference. A liar among two workers then drives the
  reference at most to ``honest * spread`` (up) or ``honest / spread`` (down), the fixed
  points of ``r' = (honest + min(liar, r + log spread)) / 2`` in the log domain.
* **A vote is earned, and lapses.** A worker's median enters the reference only once its
  window holds ``votes_after`` norms (8 by default), and a worker not heard from for
  ``32 x max(window, workers)`` norms is forgotten. Before this, every id voted from its
  first norm and was never forgotten, so an insider that registered a fresh worker id for
  each gradient (issue #17: 40 gradients, each far above the last) outvoted the honest
  workers with 40 one-norm "medians" and walked the reference up by ``spread`` per gradient
  — nothing was clipped, and one 1e18 gradient froze Adam (its second moment) for tens of
  thousands of steps.
  One-shot ids now never vote; an id must keep sending to keep its vote, and it still has
  one vote however often it sends. (While no window has earned a vote — a cluster's first
  few norms — all of them vote.)
* **Warm-up.** Until ``warmup`` norms have been seen in total nothing is clipped (there is no
  reference yet; :meth:`NormScreen.reference` is 0.0). The first reference is the plain
  median of medians.

Two departures from the first design (norms entering their window clamped to
``[reference / factor, reference * factor]``), both measured in ``tests/test_screen.py``:

1. The clamp is on the medians where they enter the reference, not on the window entries.
   Clamping entries also clamps the *honest* worker's entries: with two workers and the
   reference held at the clamp edge by a liar, the honest window's floor sits at its own
   median, every upward fluctuation of that median is kept and no downward one, and the
   reference creeps up without bound (2x past its fixed point after 2,000 rounds, still
   rising at 100,000). The honest windows here hold the true norms.
2. ``spread`` is ``sqrt(factor)``, not ``factor``: with ``factor``, a downward liar among two
   workers would put the clip threshold (``factor`` x reference) at the honest median itself,
   clipping half of the honest gradients; with ``sqrt(factor)`` it stays ``sqrt(factor)`` x
   above it. The floor of 4 keeps the reference mobile for small factors.

Bounds (asserted in the tests): with three or more workers and one liar the reference stays
between the honest workers' medians; with two workers and a liar that starts after warm-up,
within ``spread`` of the honest median either way. With two workers of whom one lies from its
very first gradient, no symmetric rule can tell which is honest: the reference then stays
between the two.

Pure bookkeeping, no I/O. Per call: O(window) on the worker's sorted window and O(workers)
to keep the sorted list of medians.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left, insort
from collections import deque
from typing import Any

__all__ = ["MAX_WORKERS", "NormScreen"]

MAX_WORKERS = 1024
"""Workers remembered at most; a new one beyond this evicts the one heard from least recently
(the coordinator bounds its workers below this, so it is a guard, not a policy)."""

_TINY = sys.float_info.min  # a zero gradient is legal; its log must be finite
_STATE_VERSION = 1


def _middle(sorted_values: list[float]) -> float:
    """Median of a non-empty sorted list; the mean of the two middle values for an even count."""
    n = len(sorted_values)
    if n % 2:
        return sorted_values[n // 2]
    return 0.5 * (sorted_values[n // 2 - 1] + sorted_values[n // 2])


def _next_reference(sorted_values: list[float], ref: float, step: float) -> float:
    """The median of a non-empty sorted list as it enters the reference ``ref``: the middle
    value clamped to ``ref +- step``; for an even count, of the two middle values the one
    farther from ``ref`` clamped so, the nearer one as it is, then their mean."""
    n = len(sorted_values)
    if n % 2:
        return min(max(sorted_values[n // 2], ref - step), ref + step)
    near, far = sorted_values[n // 2 - 1], sorted_values[n // 2]
    if abs(near - ref) > abs(far - ref):
        near, far = far, near
    return 0.5 * (near + min(max(far, ref - step), ref + step))


class _Window:
    """One worker's last ``size`` log-norms, in arrival order and sorted."""

    __slots__ = ("order", "sorted", "median", "last")

    def __init__(self, size: int) -> None:
        self.order: deque[float] = deque(maxlen=size)
        self.sorted: list[float] = []
        self.median = 0.0
        self.last = 0  # the screen's norm count when this window was last added to

    def add(self, value: float) -> None:
        if len(self.order) == self.order.maxlen:
            del self.sorted[bisect_left(self.sorted, self.order[0])]  # append drops it
        self.order.append(value)
        insort(self.sorted, value)
        self.median = _middle(self.sorted)


class NormScreen:
    """Clips gradients whose norm is over ``factor`` x a robust reference of recent norms.

    Args:
        factor: clip above this many times the reference; 0 disables the screen.
        window: log-norms kept per worker.
        warmup: norms seen in total before anything is clipped.
        votes_after: norms a worker's window must hold before its median votes (at most
            ``window``).

    Raises:
        ValueError: ``factor`` negative or not finite, ``window`` < 1, ``warmup`` < 0 or
            ``votes_after`` < 1.
    """

    def __init__(self, factor: float, *, window: int = 32, warmup: int = 20,
                 votes_after: int = 8) -> None:
        if not math.isfinite(factor) or factor < 0:
            raise ValueError(f"factor must be a finite number >= 0 (0 = off), got {factor!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup!r}")
        if votes_after < 1:
            raise ValueError(f"votes_after must be >= 1, got {votes_after!r}")
        self.factor = float(factor)
        self.window = int(window)
        self.warmup = int(warmup)
        self.votes_after = min(int(votes_after), self.window)
        #: how far (as a ratio) one update may move a middle median from the reference
        self.spread = max(math.sqrt(self.factor), 4.0)
        self._log_factor = math.log(self.factor) if self.factor > 0 else 0.0
        self._log_spread = math.log(self.spread)
        #: gradients clipped so far
        self.clipped = 0
        self._seen = 0  # norms recorded in total
        self._ref: float | None = None  # log of the reference, None while warming up
        self._workers: dict[str, _Window] = {}  # insertion order = least recently heard first
        self._medians: list[float] = []  # the medians of the windows that vote, sorted
        self._young: list[float] = []  # the medians of those that do not vote yet, sorted

    def reference(self) -> float:
        """The current reference norm; 0.0 while warming up (or when disabled)."""
        return 0.0 if self._ref is None else math.exp(self._ref)

    def check(self, worker: str, norm: float) -> float:
        """Record ``norm`` for ``worker``; return the factor to multiply this gradient by.

        Args:
            worker: who sent the gradient.
            norm: its L2 norm, finite and >= 0 (0 counts as the smallest positive float).

        Returns:
            1.0 to keep the gradient as it is; a value < 1.0 scales it to ``factor`` x the
            reference. Always 1.0 when ``factor`` is 0 or before ``warmup`` norms were seen.

        Raises:
            ValueError: ``norm`` negative, NaN or infinite (the caller screens those first).
        """
        if not math.isfinite(norm) or norm < 0:
            raise ValueError(f"norm must be finite and >= 0, got {norm!r}")
        if self.factor == 0:
            return 1.0
        value = math.log(max(norm, _TINY))
        scale = 1.0
        if self._ref is not None and value > self._ref + self._log_factor:
            scale = min(1.0, math.exp(self._ref + self._log_factor - value))
            self.clipped += 1
        self._seen += 1
        self._record(worker, value)
        self._expire()
        voters = self._medians or sorted(self._medians + self._young)
        if self._ref is not None:
            self._ref = _next_reference(voters, self._ref, self._log_spread)
        elif self._seen >= self.warmup:
            self._ref = _middle(voters)
        return scale

    def forget(self, worker: str) -> None:
        """Drop ``worker``'s records (it left for good); unknown workers are ignored. The
        reference keeps its value until the next :meth:`check`."""
        win = self._workers.pop(worker, None)
        if win is not None:
            self._unlist(win)

    def _votes(self, win: _Window) -> bool:
        return len(win.order) >= self.votes_after

    def _unlist(self, win: _Window) -> None:
        medians = self._medians if self._votes(win) else self._young
        del medians[bisect_left(medians, win.median)]

    def _record(self, worker: str, value: float) -> None:
        win = self._workers.pop(worker, None)  # re-inserted last: most recently heard
        if win is None:
            if len(self._workers) >= MAX_WORKERS:
                self.forget(next(iter(self._workers)))
            win = _Window(self.window)
        else:
            self._unlist(win)
        win.add(value)
        win.last = self._seen
        self._workers[worker] = win
        insort(self._medians if self._votes(win) else self._young, win.median)

    def _expire(self) -> None:
        """Forget the workers not heard from for ``32 x max(window, workers)`` norms (the
        least recently heard come first, so this is O(1) per call, amortised)."""
        limit = 32 * max(self.window, len(self._workers))
        while self._workers:
            oldest = next(iter(self._workers))
            if self._seen - self._workers[oldest].last <= limit:
                return
            self.forget(oldest)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the windows (log-norms, oldest first), reference and counters."""
        return {"version": _STATE_VERSION, "seen": self._seen, "clipped": self.clipped,
                "reference_log": self._ref,
                "workers": {w: list(win.order) for w, win in self._workers.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Windows are cut to this screen's ``window`` (the
        newest kept); ``factor``, ``window`` and ``warmup`` stay as configured.

        Raises:
            ValueError: ``d`` is not a state this class wrote (nothing is changed then).
        """
        try:
            if d.get("version") != _STATE_VERSION:
                raise ValueError(f"unknown version {d.get('version')!r}")
            seen, clipped = int(d["seen"]), int(d["clipped"])
            ref = None if d["reference_log"] is None else float(d["reference_log"])
            workers: dict[str, _Window] = {}
            for w, values in list(d["workers"].items())[-MAX_WORKERS:]:
                win = _Window(self.window)
                for v in [float(v) for v in values][-self.window:]:
                    if not math.isfinite(v):
                        raise ValueError(f"log-norm {v!r} of worker {w!r} is not finite")
                    win.add(v)
                if win.order:
                    win.last = seen
                    workers[str(w)] = win
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a NormScreen state: {exc}") from exc
        if seen < 0 or clipped < 0 or (ref is not None and not math.isfinite(ref)):
            raise ValueError(f"not a NormScreen state: seen {seen}, clipped {clipped}, "
                             f"reference_log {ref}")
        self._seen, self.clipped, self._ref, self._workers = seen, clipped, ref, workers
        self._medians = sorted(win.median for win in workers.values() if self._votes(win))
        self._young = sorted(win.median for win in workers.values() if not self._votes(win))
