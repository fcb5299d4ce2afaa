"""Bounded asynchrony: the coordinator's aggregation window (``training.aggregate_samples``).

Applying every gradient the moment it arrives makes each one *stale*: it was computed on
weights that other workers' gradients have moved since. Adam on a small transformer pays
dearly for it: GPT-2 (2 layers) with two workers at staleness 1–5 ended 30 % above one
process at equal samples, and dropping the stale gradients brought it back to one process
(``benchmarks/bench_async.py``). A window sums gradients, weighted by their samples (and by
the staleness damping), until they hold ``aggregate_samples`` samples, and takes one Adam
step on their mean. Every gradient is answered at once — with the weights as they are — so
no worker waits for another; a worker's next gradient is computed on the same weights until
the window closes. So the gradients of one window mostly share their weights, the update is
the one a single process would take with that batch, and a slow worker's late gradient
counts in the next window, damped (K-async SGD, Dutta et al. 2018, with the window sized in
samples so that unequal machines fill it unequally).

A parameter some gradient of the window did not carry (a branch that batch skipped:
LayerDrop, an unused expert) counts as a zero gradient from that batch: the window's mean is
the gradient of the mean loss over all its samples, as one process computes it over one
batch of them (and as DDP's all-reduce does). Averaging over only the batches that used it
stepped such a branch with half-sized batches at full weight: LayerDrop's held-out accuracy
then spread twice as wide as one process's (sd 0.018 vs 0.009 over 8 runs, some 0.03 below).
A parameter no gradient of the window carried is not stepped at all (torch's optimizers skip
``grad is None``).

**Robust windows** (``training.robust``, :class:`RobustWindow`): the plain window trusts
every gradient's claimed samples and its values, so one member can steer the step. A robust
window keeps one *slot per worker* — a worker's several gradients in one window average into
its slot (staleness-damped, not sample-weighted), so a fast or lying worker has one vote — and
combines the slots with :func:`robust_combine` (coordinate-wise median, coordinate-wise
trimmed mean, or the mean after clipping every slot's norm to the median slot norm of *this*
window: a reference recomputed from the current slots, so no history can be ratcheted). Top-k
gradients arrive densified (zeros where nothing was sent) and enter their slot so; the median
of mostly-zero coordinates is zero, which is why ``docs/robustness.md`` advises the clip mode
with top-k. See ``docs/robustness.md`` for what each mode costs and does not stop.

**Members that pull against the others are left out** (:class:`MemberScores`). A robust
combination bounds what one member can do per step, but a member sending honest-sized
vectors in a bad direction (a sign-flipped gradient) still biases each coordinate's median
or trimmed mean by a fraction of the honest spread, every step, and that bias wins as the
honest gradients shrink near the optimum. So every combination also scores each member: the
cosine of its slot with the sum of the *other* members' slots, each first scaled down as
``clip`` scales it, to the lower median slot norm (so a liar among the others weighs no more
than an honest member, and no member is compared with itself: a member's own share of the
combination would make even a liar look agreeable). An honest member's cosine is positive on
average, and about zero when the gradients are all noise (near an optimum); a member whose
mean cosine over its last rounds is *significantly* below a small margin under zero (``mean
+ z * stderr < -margin``) takes no part in the next combinations, until its mean cosine is
back at zero or above (it is still scored; the gap between the two tests keeps a liar near
the margin from flapping in and out). The margin is what keeps an honest member of a pure-
noise phase from ever being left out by chance over a long run (``tests/test_robust.py``:
100,000 combinations); the price is that a liar whose mean cosine with the others stays
above ``-margin`` goes uncaught. The score is a plain function of the current
slots, never of a reference the member could move over time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Hashable, Mapping, Sequence

import torch

__all__ = ["ROBUST_MODES", "GradientWindow", "MemberScores", "RobustWindow", "capped_total", "robust_combine",
           "trim_count"]

ROBUST_MODES = ("none", "clip", "trimmed_mean", "median")
"""Values of ``training.robust``: how the members' gradients of one step are combined."""


class GradientWindow:
    """A sample-weighted sum of gradients for the parameters ``params`` (name -> master)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._sums = {n: torch.zeros_like(p) for n, p in params.items()}
        self._carried: set[str] = set()  # names some gradient of the open window carried
        self._total = 0.0  # every added gradient's weight, whichever names it carried
        self.samples = 0
        self.gradients = 0
        self._sparse = False

    def add(self, grads: Mapping[str, torch.Tensor], weight: float, samples: int, *, sparse: bool) -> None:
        """Add ``weight`` x each of ``grads`` (float32, the masters' shapes); count ``samples``."""
        for name, g in grads.items():
            self._sums[name].add_(g.to(self._sums[name].dtype), alpha=weight)
            if weight > 0:
                self._carried.add(name)
        self._total += weight
        self.samples += samples
        self.gradients += 1
        self._sparse = self._sparse or sparse

    def take(self) -> tuple[dict[str, torch.Tensor], bool]:
        """The mean gradient of every parameter some gradient carried (over all the window's
        gradients: one that did not carry it counts as zeros), and whether any was sparse;
        the window starts empty again (the returned tensors are fresh)."""
        mean = {n: s / self._total for n, s in self._sums.items() if n in self._carried}
        sparse = self._sparse
        for s in self._sums.values():
            s.zero_()
        self._carried = set()
        self._total = 0.0
        self.samples = self.gradients = 0
        self._sparse = False
        return mean, sparse


def capped_total(claims: Sequence[float]) -> int:
    """The members' claimed samples summed with none counted above the lower median claim:
    one member claiming huge counts adds no more than a typical member (and a liar of two
    cannot raise the cap)."""
    if not claims:
        return 0
    cap = sorted(claims)[(len(claims) - 1) // 2]
    return max(0, round(sum(min(c, cap) for c in claims)))


def trim_count(members: int, trim: float) -> int:
    """Values dropped at each end of a coordinate by the trimmed mean of ``members`` values:
    ``floor(trim x members)``, at least 1 from 3 members on (with ``trim`` > 0), and never so
    many that nothing is left."""
    if trim <= 0 or members < 3:
        return 0
    return min(max(1, math.floor(trim * members)), (members - 1) // 2)


def _middle(sorted_values: torch.Tensor) -> torch.Tensor:
    """The median along dim 0 of values sorted along dim 0 (the mean of the two middle ones
    for an even count: torch.median would return the lower one, which is biased)."""
    k = sorted_values.shape[0]
    if k % 2:
        return sorted_values[k // 2].clone()
    return (sorted_values[k // 2 - 1] + sorted_values[k // 2]) / 2


def robust_combine(members: Sequence[Mapping[str, torch.Tensor]], mode: str, *,
                   trim: float = 0.2) -> dict[str, torch.Tensor]:
    """Combine the members' gradients (name -> float32 tensor; a member may lack a name)
    with one vote each. Deterministic: the same inputs give the same bits.

    Args:
        members: one mapping per member, in a fixed order.
        mode: ``clip`` (mean after scaling every member whose global L2 norm is over the
            lower median of the members' norms down to it), ``trimmed_mean`` (per coordinate, drop
            :func:`trim_count` values at each end, average the rest) or ``median`` (per
            coordinate). A member that lacks a name some other member carries counts as zeros
            for it (it computed no gradient there: a skipped branch).
        trim: the trimmed mean's fraction cut at each end.

    Returns:
        The combined gradient of every name some member carried.

    Raises:
        ValueError: ``mode`` is not one of these three (``none`` is the plain window's).
    """
    if mode not in ROBUST_MODES[1:]:
        raise ValueError(f"robust mode must be one of {ROBUST_MODES[1:]}, got {mode!r}")
    names = list(dict.fromkeys(n for m in members for n in m))
    scales = _clip_scales(_norms(members)) if mode == "clip" else [1.0] * len(members)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        carriers = [(i, m[name]) for i, m in enumerate(members) if name in m]
        if mode == "clip":
            total = torch.zeros_like(carriers[0][1])
            for i, g in carriers:
                total.add_(g, alpha=scales[i])
            out[name] = total / len(members)
            continue
        values = [g for _, g in carriers]
        if len(carriers) < len(members):  # the others skipped it: zeros from them
            values += [torch.zeros_like(values[0])] * (len(members) - len(carriers))
        stacked = torch.stack(values).sort(dim=0).values
        if mode == "median":
            out[name] = _middle(stacked)
        else:
            t = trim_count(len(members), trim)
            out[name] = stacked[t:len(members) - t].mean(dim=0)
    return out


def _norms(members: Sequence[Mapping[str, torch.Tensor]]) -> list[float]:
    """Each member's global L2 norm (over all its names; inf if it overflows float32)."""
    return [math.sqrt(sum(float(torch.dot(g.reshape(-1), g.reshape(-1))) for g in m.values()))
            for m in members]


def _clip_scales(norms: Sequence[float]) -> list[float]:
    """The factor that brings each norm down to the lower median of ``norms`` (1 for those at
    or below it): of two members, the smaller norm, so one liar of two cannot raise the
    reference (the mean of the two middle ones would put it at half the liar's)."""
    if not norms:
        return []
    ref = sorted(norms)[(len(norms) - 1) // 2]
    return [ref / n if n > ref else 1.0 for n in norms]


def _agreements(members: Sequence[Mapping[str, torch.Tensor]]) -> list[float]:
    """For each member, the cosine of its gradient with the sum of the others' gradients,
    each scaled down as ``clip`` scales it (:func:`_clip_scales`). 0.0 for a member alone,
    or where a norm is zero or not finite.

    One pass over the data per member and name, no copies: with S the sum of the scaled
    gradients, d_i = g_i . S and q_i = |g_i|^2, the others' sum is S - s_i g_i, so
    g_i . others = d_i - s_i q_i and |others|^2 = |S|^2 - 2 s_i d_i + s_i^2 q_i.
    Deterministic: the same members in the same order give the same bits.
    """
    k = len(members)
    norms = _norms(members)
    if k < 2 or not all(math.isfinite(n) for n in norms):
        return [0.0] * k
    scales = _clip_scales(norms)
    dots, total_sq = [0.0] * k, 0.0
    for name in dict.fromkeys(n for m in members for n in m):
        carriers = [(i, m[name].reshape(-1)) for i, m in enumerate(members) if name in m]
        total = torch.zeros_like(carriers[0][1])
        for i, g in carriers:
            total.add_(g, alpha=scales[i])
        total_sq += float(torch.dot(total, total))
        for i, g in carriers:
            dots[i] += float(torch.dot(g, total))
    out = []
    for d, s, n in zip(dots, scales, norms):
        others_sq = total_sq - 2 * s * d + s * s * n * n
        mine = d - s * n * n
        out.append(mine / (n * math.sqrt(others_sq)) if n > 0 and others_sq > 0 else 0.0)
    return out


class MemberScores:
    """Each member's agreement with the robust combinations, and who is left out of them.

    Args:
        rounds: cosines kept per member (its last ``rounds`` combinations).
        min_rounds: a member is never left out before it has this many.
        z: how many standard errors below ``-margin`` its mean cosine must be to be left out
            (from 8 cosines on; with fewer, more: see :data:`SMALL_SAMPLE_FACTOR`).
        margin: how far below zero the mean cosine must be at least.

    Deterministic (the same operations in a fixed order), so peers that score the same rows decide
    the same. Members not seen for ``4 x rounds`` combinations are forgotten.
    """

    #: with n < 8 cosines the standard error is itself uncertain: the threshold is ``z`` times
    #: this factor, Student's t quantile with n - 1 degrees of freedom at the one-sided level
    #: that 4 standard errors have at n = 8 (0.26 %), over 4. So a member is left out from 4
    #: combinations on when the evidence is that strong (a sign flipper: about -0.5 +- 0.1),
    #: while an honest member is no likelier to be left out at 4 than it was at 8 (it used to
    #: wait 8, half of a 15-round DiLoCo run).
    SMALL_SAMPLE_FACTOR = {4: 7.36 / 4, 5: 5.54 / 4, 6: 4.73 / 4, 7: 4.28 / 4}

    def __init__(self, *, rounds: int = 64, min_rounds: int = 4, z: float = 4.0,
                 margin: float = 0.05) -> None:
        if (rounds < 2 or not 4 <= min_rounds <= rounds or not (math.isfinite(z) and z > 0)
                or not 0 <= margin < 1):
            raise ValueError(f"need 4 <= min_rounds <= rounds, z > 0 and 0 <= margin < 1; got "
                             f"rounds={rounds}, min_rounds={min_rounds}, z={z}, margin={margin}")
        self.rounds, self.min_rounds, self.z, self.margin = rounds, min_rounds, z, margin
        self._cosines: dict[Hashable, deque[float]] = {}
        self._seen: dict[Hashable, int] = {}
        self._excluded: set[Hashable] = set()
        self.combinations = 0
        #: times a member was left out (each start of an exclusion counts once)
        self.exclusions = 0

    def excluded(self) -> frozenset[Hashable]:
        """The members left out of the next combination."""
        return frozenset(self._excluded)

    def voting(self, keys: Sequence[Hashable]) -> list[int]:
        """Which of a combination's members (by index) vote in it: all but the ones left out,
        unless that would leave no more than half of them (a majority always decides)."""
        kept = [i for i, k in enumerate(keys) if k not in self._excluded]
        return kept if 2 * len(kept) > len(keys) else list(range(len(keys)))

    def mean(self, member: Hashable) -> float:
        """The member's mean cosine over its kept rounds (NaN if it has none)."""
        values = self._cosines.get(member)
        return math.fsum(values) / len(values) if values else math.nan

    def update(self, members: Sequence[tuple[Hashable, Mapping[str, torch.Tensor]]]
               ) -> tuple[list[Hashable], list[Hashable]]:
        """Score every member of one combination against the others; returns who is newly
        left out and who is taken back (both in ``members``' order)."""
        self.combinations += 1
        left: list[Hashable] = []
        back: list[Hashable] = []
        for (key, _), agreement in zip(members, _agreements([g for _, g in members])):
            kept = self._cosines.setdefault(key, deque(maxlen=self.rounds))
            kept.append(agreement)
            self._seen[key] = self.combinations
            if key not in self._excluded:
                if self._pulls_against(kept):
                    self._excluded.add(key)
                    self.exclusions += 1
                    left.append(key)
            elif math.fsum(kept) >= 0.0:  # back once it agrees on average again (hysteresis:
                self._excluded.discard(key)  # a liar near the margin does not flap in and out)
                back.append(key)
        for key in [k for k, at in self._seen.items() if self.combinations - at > 4 * self.rounds]:
            self._cosines.pop(key, None)
            self._seen.pop(key, None)
            self._excluded.discard(key)
        return left, back

    def _pulls_against(self, kept: deque[float]) -> bool:
        n = len(kept)
        if n < self.min_rounds:
            return False
        mean = math.fsum(kept) / n
        var = math.fsum((c - mean) ** 2 for c in kept) / (n - 1)
        z = self.z * self.SMALL_SAMPLE_FACTOR.get(n, 1.0)
        return mean + z * math.sqrt(var / n) < -self.margin

    def summary(self) -> dict[str, object]:
        """For status: the members left out and every member's mean cosine (rounded)."""
        return {"excluded": sorted(map(str, self._excluded)), "exclusions": self.exclusions,
                "agreement": {str(k): round(self.mean(k), 4) for k in self._cosines}}


class _Slot:
    """One worker's gradients of the window: a damping-weighted sum per parameter, in buffers
    kept from window to window (a fresh model-sized buffer per worker and window costs page
    faults: as much as the combination itself at 1M parameters)."""

    __slots__ = ("buffers", "weights", "samples")

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        #: the weight summed into each parameter's buffer in this window (absent: unused)
        self.weights: dict[str, float] = {}
        self.samples = 0

    def add(self, name: str, g: torch.Tensor, weight: float) -> None:
        if name in self.weights:
            self.buffers[name].add_(g, alpha=weight)
            self.weights[name] += weight
            return
        buf = self.buffers.get(name)
        if buf is None:
            self.buffers[name] = g * weight
        else:
            torch.mul(g, weight, out=buf)
        self.weights[name] = weight

    def mean(self) -> dict[str, torch.Tensor]:
        """The mean per parameter, in place: valid until the slot is used again."""
        return {n: self.buffers[n].div_(w) for n, w in self.weights.items() if w > 0}

    def reset(self) -> None:
        self.weights = {}
        self.samples = 0


class RobustWindow:
    """A window of one slot per worker, combined robustly when it closes (``training.robust``).

    Args:
        params: the master parameters (name -> tensor): names and dtypes of the slots.
        mode: ``clip``, ``trimmed_mean`` or ``median`` (see :func:`robust_combine`).
        trim: the trimmed mean's fraction cut at each end.

    Memory: one model-sized float32 buffer per worker with a gradient in a window, kept for
    the next windows (at most as many as the most workers one window has held).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], mode: str, *, trim: float = 0.2) -> None:
        if mode not in ROBUST_MODES[1:]:
            raise ValueError(f"robust mode must be one of {ROBUST_MODES[1:]}, got {mode!r}")
        self.mode = mode
        self.trim = trim
        self._dtypes = {n: p.dtype for n, p in params.items()}
        self._slots: dict[str, _Slot] = {}
        self._free: list[_Slot] = []  # slots of earlier windows, their buffers reused
        #: gradients in the open window (a :class:`GradientWindow` has the same attribute)
        self.gradients = 0
        self._sparse = False
        self.opened_at = 0.0  # time.monotonic() of the open window's first gradient
        #: who agrees with the combinations; members pulling against them are left out
        self.scores = MemberScores()
        #: (newly left out, taken back) by the last :meth:`take`
        self.last_changes: tuple[list[Hashable], list[Hashable]] = ([], [])

    @property
    def members(self) -> int:
        """Distinct workers with a gradient in the open window, not counting those left out
        (a window closes on voting members: a liar's slot must not take an honest one's
        place in it)."""
        out = self.scores.excluded()
        return sum(1 for w in self._slots if w not in out)

    def counted_samples(self) -> int:
        """The open window's samples with no slot counted above the median slot's (a worker
        claiming huge sample counts cannot close windows alone), left-out workers' not
        counted."""
        out = self.scores.excluded()
        return capped_total([s.samples for w, s in self._slots.items() if w not in out])

    def add(self, worker: str, grads: Mapping[str, torch.Tensor], weight: float, samples: int,
            *, sparse: bool) -> None:
        """Add ``weight`` x each of ``grads`` into ``worker``'s slot; count ``samples``."""
        if not self._slots:
            self.opened_at = time.monotonic()
        slot = self._slots.get(worker)
        if slot is None:
            slot = self._slots[worker] = self._free.pop() if self._free else _Slot()
        for name, g in grads.items():
            slot.add(name, g.to(self._dtypes[name]), weight)
        slot.samples += samples
        self.gradients += 1
        self._sparse = self._sparse or sparse

    def take(self) -> tuple[dict[str, torch.Tensor], bool]:
        """The robust combination of the slots (in the order the workers first sent) and
        whether any gradient was sparse; the window starts empty again."""
        means = [(worker, s.mean()) for worker, s in self._slots.items()]
        voting = [means[i][1] for i in self.scores.voting([w for w, _ in means])]
        combined = robust_combine(voting, self.mode, trim=self.trim)
        self.last_changes = self.scores.update(means)
        sparse = self._sparse  # the combination is fresh tensors: the slots may be reused now
        for slot in self._slots.values():
            slot.reset()
            self._free.append(slot)
        self._slots = {}
        self.gradients = 0
        self._sparse = False
        return combined, sparse
