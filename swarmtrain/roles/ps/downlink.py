"""The coordinator's downlink: one published replica and a shared log of compressed deltas.

Every worker holds the same thing: the *published* weights ``P`` at some version. After an
update the coordinator publishes once — whatever the number of workers — by compressing
``master − P`` with the downlink codec, adding exactly what it decoded to ``P`` and keeping
the compressed entry in a log by version. What the codec dropped stays in ``master − P``
and goes out with the next entry (error feedback on the server side, shared by all). The
answer to a worker whose replica is ``P`` at version ``v`` is the chain of entries after
``v``, encoded once and sent as they are; when that chain would be larger than the weights
themselves (the worker is far behind, or the log no longer reaches back to ``v``), the
published weights go instead.

Memory: ``P`` (one flat copy of the trainable parameters) plus a log bounded by the size
of the weights plus one cached snapshot of the head (let go when the track publishes again:
answers not yet sent hold their own), whatever the number of workers.

Drift bound: after every publication ``‖master − P‖ / ‖master‖ ≤ max_drift``; a publication
that would leave ``P`` further away restarts the published track from the master (every
worker then gets the full weights once), and so does one every ``reset_interval`` answers
of a worker on the track: every ``reset_interval`` publications times the entries in a
typical chain (a worker answered once in four publications is restarted after four times as
many, so that each worker gets the full weights once in ``reset_interval`` of its answers
however many share the track). A lossless downlink keeps no ``P`` at all: the published
weights are the master's, and every answer that changes anything is a snapshot of them (a
float32 delta is as large). Nor does the half downlink (fp16's default): its snapshots are the
master rounded to float16, 2 bytes a parameter whatever a worker's lag, with the drift of that
rounding (below 2^-11 unless a weight is beyond float16's range, when float32 goes instead).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmtrain.compression import LOSSLESS_CODECS, Codec, Compressed, SizeAdaptive
from swarmtrain.compression.kernels import PUB_FP16, PUB_UNIFORM, Kernels, Publication, kernels
from swarmtrain.compression.simple import FP16Codec
from swarmtrain.compression.uniform import UniformCodec
from swarmtrain.core.ema import MovingAverage
from swarmtrain.roles.ps.common import FUSED, global_norm, pack_compressed
from swarmtrain.roles.ps.flat_adam import COPY_PHASE, phase_after
from swarmtrain.wire.pool import PayloadPool, phased_floats, pooled_bytes

__all__ = ["GAP_WINDOW", "TRACK_INTERVALS", "AnswerGaps", "Downlink", "LogEntry", "UpdateLog",
           "coarsest_track", "entry_prefix", "entry_tensors", "relative_drift", "track_for_lag"]

#: how much of the average of a track's chain lengths is kept at each chain answered (about
#: the last twenty answers count)
CHAIN_KEEP = 0.95

#: flat-vector views shaped like the parameters -> new tensors as a worker holds them
ToReplica = Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]


def entry_prefix(start: int) -> str:
    """The payload-name prefix of the log entry that starts at version ``start``."""
    return f"{start}:"


@dataclass(frozen=True)
class LogEntry:
    """The compressed change that takes the published weights from ``start`` to ``end``."""

    start: int
    end: int
    #: name -> codec spec, as :func:`~swarmtrain.roles.ps.common.pack_compressed` makes it
    codecs: dict[str, Any]
    #: payload tensors, named ``entry_prefix(start) + "name/part"``; never modified
    tensors: dict[str, torch.Tensor]
    nbytes: int

    def header(self) -> dict[str, Any]:
        """What the UPDATE's ``deltas`` list carries for this entry."""
        return {"from": self.start, "to": self.end, "codecs": self.codecs}


class UpdateLog:
    """The published replica, the log of entries that built it, and its snapshots.

    Args:
        codec: the downlink codec.
        split: flat vector -> views shaped like the parameters, in order.
        names: the parameter names, in order.
        round_replica: rounds the half-precision parameters' part of a flat replica in place,
            as a worker's own tensors hold them.
        replica_bytes: bytes of the trainable weights as a worker holds them (a snapshot).
        fused: one :data:`FUSED` entry for the whole flat vector (small models) instead of one
            per parameter.
        max_drift: the drift bound (relative L2).
        reset_interval: a worker's answers after which the track restarts from the master
            (publications, times the mean entries of the chains it answers with).
        rounded: the ``half`` downlink: no published copy and no log, as with a lossless
            codec; every answer is the weights, rounded to float16 (the coordinator's
            snapshots, :meth:`set_snapshot`).

    All methods but :meth:`answer` and :meth:`snapshot`'s reads run on the apply thread.
    """

    def __init__(self, codec: Codec, *, split: Callable[[torch.Tensor], list[torch.Tensor]],
                 names: Sequence[str], round_replica: Callable[[torch.Tensor], None],
                 replica_bytes: int, fused: bool, max_drift: float, reset_interval: int,
                 rounded: bool = False) -> None:
        self.codec = codec
        self.lossless = codec.lossless
        self.rounded = rounded
        #: answers are the weights themselves (lossless, or rounded): no published copy, no log
        self.whole = self.lossless or rounded
        self._split = split
        self._names = list(names)
        self._round = round_replica
        self.replica_bytes = replica_bytes
        self.fused = fused
        self.max_drift = max_drift
        self.reset_interval = reset_interval
        #: the published weights (flat, the masters' dtype); None until the first publication
        #: and always for a lossless codec (then the master is what is published)
        self.published: torch.Tensor | None = None
        self.head = -1  # the version of the published weights
        self.entries: deque[LogEntry] = deque()
        self._log_bytes = 0
        self.drift = 0.0
        self.resets = 0  # track restarts (drift bound, interval, first publication)
        self.publications = 0
        self._since_reset = 0
        #: the entries in the chains it answered with, averaged: how many publications pass
        #: between two answers of one worker (restarts come that many times more rarely)
        self.chain_entries = MovingAverage(CHAIN_KEEP)
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        #: the buffers of the entries the optimizer step writes (:meth:`fused_target`, fp16 or
        #: uniform): each publication's entry is the same size, so a trimmed entry's memory, once
        #: no answer holds it, takes the next one (a new 5 MB block each time left the allocator
        #: holding freed blocks in the resident set)
        self._entry_pool = PayloadPool(min_bytes=0)
        #: answers by kind: "current" (nothing to send), "chain" (entries), "full" (weights),
        #: "withheld" (the weights were due, but no copy of them could be made: "no change")
        self.answers = {"current": 0, "chain": 0, "full": 0, "withheld": 0}
        self.entries_sent = 0  # entries in all the chains answered

    # -- the apply thread -------------------------------------------------------------------

    def publish(self, master: torch.Tensor, version: int) -> None:
        """Bring the published weights to ``version``, whose master weights are ``master``
        (flat): one compressed entry for everything since the last publication."""
        if version == self.head:
            return
        if self.whole:
            self.head = version
            return
        if self.published is None or self._restart_due():
            self._reset(master, version)
            return
        published = self.published
        fast = kernels() if _kernel_ready(master, published) else None
        if self.fused or fast is not None:
            # one FUSED entry: the kernels make no temporaries, and one call beats one per tensor
            names, masters, pubs = [FUSED], [master], [published]
        else:
            # per tensor: every temporary stays small enough for the allocator to reuse
            names, masters, pubs = self._names, self._split(master), self._split(published)
        if fast is not None:
            done = _publish_fused(fast, self.codec, names, masters, pubs)
            if done is None:  # NaN or inf in the change (the copy moved part way): restart
                self._reset(master, version)
                return
            items, drift = done
            if drift > self.max_drift:
                self._reset(master, version)  # (overwrites the copy the kernels moved)
                return
        else:
            deltas = torch._foreach_sub(masters, pubs)
            pairs = [self.codec.compress_decoded(d) for d in deltas]
            items = {n: item for n, (item, _) in zip(names, pairs)}
            sent = [decoded for _, decoded in pairs]
            drift = 0.0
            if any(item.codec not in LOSSLESS_CODECS for item in items.values()):
                # (a lossless `sent` may be its delta itself: subtract out of place)
                drift = global_norm(torch._foreach_sub(deltas, sent)) / max(global_norm(masters), 1e-30)
                if drift > self.max_drift:
                    self._reset(master, version)
                    return
            torch._foreach_add_(pubs, sent)  # exactly what every worker will add
        self._round(published)
        self._append(items, drift, version)

    def fused_target(self, numel: int) -> tuple[Publication, Compressed] | None:
        """Where the next publication goes when the optimizer step writes it (the fused
        kernel: each block of new weights coded while in cache), and the entry's item it
        fills; None when it cannot be fused (lossless: see :meth:`set_snapshot`; a restart
        is due; a codec without a kernel). Finish with :meth:`finish_fused`."""
        published = self.published
        if (self.whole or published is None or self._restart_due()
                or published.numel() != numel or not _kernel_ready(published, published)):
            return None
        chosen = self.codec.codec_for(numel) if isinstance(self.codec, SizeAdaptive) else self.codec
        if isinstance(chosen, FP16Codec):
            out = pooled_bytes(2 * numel, pool=self._entry_pool).view(torch.float16)
            return (Publication(PUB_FP16, published.data_ptr(), out.data_ptr()),
                    Compressed(chosen.name, (numel,), "float32", {"values": out}))
        if isinstance(chosen, UniformCodec) and chosen.bucket_size % (8 // chosen.bits) == 0:
            size, bits = chosen.bucket_size, chosen.bits
            ncodes, nscales = (numel * bits + 7) // 8, -(-numel // size)
            at = ncodes + -ncodes % 64  # (the scales on a 64-byte boundary)
            buf = pooled_bytes(at + 4 * nscales, pool=self._entry_pool)
            codes, scales = buf[:ncodes], buf[at:].view(torch.float32)
            return (Publication(PUB_UNIFORM, published.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                size, bits),
                    Compressed(chosen.name, (numel,), "float32", {"scales": scales, "codes": codes},
                               {"bits": bits, "bucket_size": size}))
        return None

    def finish_fused(self, master: torch.Tensor, version: int, item: Compressed, ok: bool,
                     resid: float, norm: float) -> None:
        """Record the publication the optimizer step made into :meth:`fused_target`'s
        buffers (``ok`` False: it met NaN/inf) as :meth:`publish` records its own."""
        drift = relative_drift(resid, norm) if ok else math.inf
        if not drift <= self.max_drift:  # (past the bound, or NaN/inf)
            self._reset(master, version)  # (overwrites the copy the kernel moved)
            return
        if self.published is not None:  # (fused_target saw it)
            self._round(self.published)
        self._append({FUSED: item}, drift, version)

    def set_snapshot(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """(lossless or rounded) The weights of ``version`` as a worker holds them, written by
        the optimizer step itself: the snapshot every answer of that version shares."""
        if not self.whole:
            raise ValueError("set_snapshot is for a downlink whose answers are the weights (lossless "
                             "or half): the master is what is published")
        self.head = version
        self._snapshot = (version, tensors)

    def accept_rounding(self, resid: float, norm: float) -> bool:
        """(rounded) Whether a copy of the weights rounded to float16 may answer, from the
        rounding's sums (Σ what it left out², Σ weights²): its drift within ``max_drift``
        (then the track's drift), else no (NaN, or a weight beyond float16's range): the
        weights go in float32, exactly (drift 0)."""
        drift = relative_drift(resid, norm)
        ok = drift <= self.max_drift
        self.drift = drift if ok else 0.0
        return ok

    def _append(self, items: dict[str, Compressed], drift: float, version: int) -> None:
        codecs, tensors = pack_compressed(items)
        prefix = entry_prefix(self.head)
        entry = LogEntry(self.head, version, codecs, {prefix + k: t for k, t in tensors.items()},
                         sum(t.numel() * t.element_size() for t in tensors.values()))
        self.entries.append(entry)
        self._log_bytes += entry.nbytes
        self._trim()
        self._snapshot = None  # (of the version before: see _reset)
        self.head = version
        self.drift = drift
        self.publications += 1
        self._since_reset += 1

    def _restart_due(self) -> bool:
        """Is the next publication a restart (``reset_interval`` answers of a worker since the
        last, counted in publications: see the module docstring)?"""
        per_answer = max(1.0, self.chain_entries.value or 1.0)
        return self._since_reset + 1 >= self.reset_interval * per_answer

    def _reset(self, master: torch.Tensor, version: int) -> None:
        """Restart the track: the published weights become the master's (rounded as workers
        hold them); no entry reaches across, so every worker behind gets the full weights."""
        if self.published is not None and self.published.shape == master.shape:
            self.published.copy_(master)  # reuse: a fresh big buffer costs page faults
        elif master.dtype == torch.float32 and master.dim() == 1:
            # the fused step streams through it beside the master: at a page offset of its own
            self.published = phased_floats(master.numel(), phase_after(master, COPY_PHASE))
            self.published.copy_(master.detach())
        else:
            self.published = master.detach().clone()
        self._round(self.published)
        self.entries.clear()
        self._log_bytes = 0
        # The copy of the weights made for the version before is let go: a worker that needs the
        # full weights later gets this version's, copied then. Kept, it held a copy per track in
        # use for nobody (64 workers on three tracks: 115 MB, all in answers sent long before).
        # Answers not yet sent hold their own reference to it.
        self._snapshot = None
        self.head = version
        self.drift = 0.0
        self.resets += 1
        self.publications += 1
        self._since_reset = 0

    def forget(self) -> None:
        """Drop the track's published weights, log and snapshot (no worker is on it): it starts
        afresh from the master at its next publication. A worker only ever joins a track with
        its full weights, so nothing it holds refers to what is dropped."""
        self.published = None
        self.entries.clear()
        self._log_bytes = 0
        self._snapshot = None
        self._entry_pool = PayloadPool(min_bytes=0)  # (its idle buffers go with it)
        self.head = -1
        self.drift = 0.0
        self._since_reset = 0
        self.chain_entries = MovingAverage(CHAIN_KEEP)

    def _trim(self) -> None:
        """Forget the oldest entries no answer would use: a chain through the oldest carries
        all the log's bytes, and once they are as many as the weights' it is never sent."""
        while self.entries and self._log_bytes >= self.replica_bytes:
            self._log_bytes -= self.entries.popleft().nbytes

    def snapshot(self, master: torch.Tensor, to_replica: ToReplica, version: int, *,
                 make: bool = True, newer_than: int = -1) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(the published version, the published weights as a worker holds them), copied once
        per version and shared by every answer that sends them; publish first. ``master`` is
        the master of ``version``: a lossless track whose head has no copy yet copies the
        master now, which makes this version its head (the copy is of it).

        ``make`` False (the caller holds as many copies as it may): no new copy; the last one
        made answers instead if it is of a version after ``newer_than`` (what the worker
        holds), else None. (A lossy track keeps its copy only until it publishes again, see
        :meth:`_append`; a lossless or rounded one until the step sets the next.)"""
        cached = self._snapshot
        if cached is not None and cached[0] == self.head:
            return cached
        if not make:
            return cached if cached is not None and cached[0] > newer_than else None
        if self.whole or self.published is None:
            self.head = version
            source = master
        else:
            source = self.published
        self._snapshot = (self.head, to_replica(self._split(source)))
        return self._snapshot

    # -- any thread --------------------------------------------------------------------------

    def answer(self, holds: int) -> list[LogEntry] | None:
        """:meth:`chain_from` ``holds``, counted as an answer this track gave."""
        chain = self.chain_from(holds)
        self.count(chain)
        return chain

    def count(self, chain: list[LogEntry] | None) -> None:
        """Count an answer this track gave (for the status)."""
        kind = "full" if chain is None else "chain" if chain else "current"
        self.answers[kind] += 1
        self.entries_sent += len(chain or ())
        if chain:
            self.chain_entries.update(len(chain))

    def chain_from(self, holds: int) -> list[LogEntry] | None:
        """The entries that take a replica at version ``holds`` to the head, oldest first:
        ``[]`` when it is there, None when the full weights are the answer (no chain from
        ``holds``, or one larger than the weights)."""
        if holds == self.head:
            return []
        chain: list[LogEntry] = []
        size = 0
        for entry in reversed(self.entries):
            chain.append(entry)
            size += entry.nbytes
            if size >= self.replica_bytes or entry.start < holds:
                return None
            if entry.start == holds:
                chain.reverse()
                return chain
        return None

    def log_bytes(self) -> int:
        """Bytes the log's entries hold."""
        return self._log_bytes

    def summary(self) -> dict[str, Any]:
        """For the status: where the published weights are, what the log holds, what went out."""
        return {"version": self.head, "entries": len(self.entries), "log_bytes": self._log_bytes,
                "drift": self.drift, "resets": self.resets, "publications": self.publications,
                "codec": "half" if self.rounded else getattr(self.codec, "name", "?"),
                "answers": dict(self.answers),
                "entries_sent": self.entries_sent}


def relative_drift(resid: float, norm: float) -> float:
    """The relative L2 distance ``sqrt(resid) / sqrt(norm)`` from the two sums of squares a
    publication kernel gives (what was left out, the weights); NaN or inf when either is."""
    return math.sqrt(resid) / max(math.sqrt(norm), 1e-30)


def _kernel_ready(master: torch.Tensor, published: torch.Tensor) -> bool:
    return (master.dtype == published.dtype == torch.float32 and master.device.type == "cpu"
            and master.is_contiguous() and published.is_contiguous())


def _publish_fused(fast: Kernels, codec: Codec, names: Sequence[str], masters: Sequence[torch.Tensor],
                   pubs: Sequence[torch.Tensor]) -> tuple[dict[str, Compressed], float] | None:
    """:meth:`UpdateLog.publish`'s coding step in one pass per tensor with the fused kernels
    (fp16 and uniform; other codecs, and tensors a size-adaptive codec sends raw, take the
    codec's own code): the items to send and the drift, or None if the change held NaN/inf.
    The published copy moves by what the items decode to, bit for bit as the codec's
    ``compress_decoded`` would have it."""
    items: dict[str, Compressed] = {}
    resid = norm = 0.0
    for name, m, pub in zip(names, masters, pubs):
        chosen = codec.codec_for(m.numel()) if isinstance(codec, SizeAdaptive) else codec
        flat_m, flat_p = m.reshape(-1), pub.view(-1)
        shape = tuple(m.shape)
        if isinstance(chosen, FP16Codec):
            out = torch.empty(m.numel(), dtype=torch.float16)
            r, n = fast.publish_fp16(flat_m, flat_p, out)
            items[name] = Compressed(chosen.name, shape, "float32", {"values": out})
        elif isinstance(chosen, UniformCodec) and chosen.bucket_size % (8 // chosen.bits) == 0:
            size, bits = chosen.bucket_size, chosen.bits
            codes = torch.empty((m.numel() * bits + 7) // 8, dtype=torch.uint8)
            scales = torch.empty(-(-m.numel() // size), dtype=torch.float32)
            sums = fast.publish_uniform(flat_m, flat_p, codes, scales, size, bits)
            if sums is None:
                return None
            r, n = sums
            items[name] = Compressed(chosen.name, shape, "float32", {"scales": scales, "codes": codes},
                                     {"bits": bits, "bucket_size": size})
        else:
            delta = m - pub
            item, sent = chosen.compress_decoded(delta)
            if not bool(torch.isfinite(sent).all()):
                return None
            r = 0.0 if item.codec in LOSSLESS_CODECS else float((delta - sent).square().sum())
            n = float(m.square().sum())
            pub.add_(sent)
            items[name] = item
        resid += r
        norm += n
    if not (math.isfinite(resid) and math.isfinite(norm)):
        return None
    return items, relative_drift(resid, norm)


def entry_tensors(tensors: Mapping[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
    """The payload tensors of the entry that starts at ``start``, with its prefix removed."""
    prefix = entry_prefix(start)
    n = len(prefix)
    return {k[n:]: t for k, t in tensors.items() if k.startswith(prefix)}


#: answers over which the spacing of a worker's answers is remembered (:class:`AnswerGaps`).
#: Staying on a coarse track and joining one others are on take the same bound (its interval
#: at most the longest gap): with four remembered, 64 workers with one gradient in flight,
#: answered give or take 20 places out of order, fell off the interval-64 track and were
#: taken back on at one answer in nine, the full weights each time; with eight, one in seventy
GAP_WINDOW = 8


#: full answers over which what they add to a worker's lag is remembered (:attr:`AnswerGaps.full_extra`)
EXTRA_WINDOW = 4


class AnswerGaps:
    """How many versions passed between a worker's answers, over its last
    :data:`GAP_WINDOW`, for :meth:`Downlink.choose`: how often it is answered. Its lag
    (versions behind what it holds) does not say that on a coarse track, where the track's
    own age adds to it: a worker kept there by its lag would keep itself there. With several
    gradients in flight the gaps alternate short and long, and which track answers it must
    not follow that alternation; once it really is answered more often (the others left),
    the long gaps are forgotten within :data:`GAP_WINDOW` answers.

    The gap after an answer that was the full weights (a welcome is one) measures how long
    the weights took on the way too, which on a slow link is many times a chain's time.
    What they added is measured as :attr:`full_extra`, that gap less the one after the next
    answer (a chain, in the same minutes), and the gaps after full answers are remembered
    less it: a worker whose weights took long is not taken for one answered seldom (it
    joined coarser tracks on that, with the weights again). The gap after its welcome is
    not remembered (joining is not an answer)."""

    __slots__ = ("_gaps", "_last", "_full", "_after_full", "_extras")

    def __init__(self) -> None:
        self._gaps: deque[int] = deque(maxlen=GAP_WINDOW)
        self._last = -1
        self._full = True  # (its welcome was the weights)
        self._after_full: int | None = None  # the gap after them, until the next is known
        self._extras: deque[int] = deque(maxlen=EXTRA_WINDOW)

    def add(self, version: int, lag: int | None = None) -> int | None:
        """An answer at ``version`` to a gradient computed ``lag`` versions behind (None: the
        gap since its last answer); returns the longest remembered gap (None: no gap yet)."""
        known = self._last >= 0
        if known or (self._full and lag is not None):
            gap = max(1, version - self._last if lag is None or not self._full else lag)
            if self._full:
                self._after_full = gap
                gap = max(1, gap - self.full_extra)
            elif self._after_full is not None:
                self._extras.append(max(0, self._after_full - gap))
                self._after_full = None
            if known:
                self._gaps.append(gap)
        self._last = version
        self._full = False
        return self.longest

    def answered(self, *, full: bool) -> None:
        """Its answer went: the full weights or not."""
        self._full = full

    @property
    def full_extra(self) -> int:
        """The most versions one of its last :data:`EXTRA_WINDOW` full answers made it lag
        more than a chain did next (0: none measured): what a move to another track, which
        is the full weights, would cost it again. The most, not the last: when a track
        restarts every worker on it gets the weights at once, and the gap after the next
        answer is slowed by the others' weights too, so that one such measure reads far
        less than a move would then cost (workers moved down on it, and up again)."""
        return max(self._extras, default=0)

    @property
    def longest(self) -> int | None:
        """The longest remembered gap (None: no gap yet)."""
        return max(self._gaps) if self._gaps else None

    @property
    def mean(self) -> float | None:
        """The mean of the remembered gaps: how often it is answered lately (None: no gap yet)."""
        return sum(self._gaps) / len(self._gaps) if self._gaps else None


#: the published tracks: publication every 1, 4, 16 and 64 versions (a coarse one is made
#: only once a worker lags enough to need it)
TRACK_INTERVALS = (1, 4, 16, 64)


def coarsest_track(versions: int) -> int:
    """The coarsest track whose interval is at most ``versions`` (the finest when none is)."""
    return max(i for i, g in enumerate(TRACK_INTERVALS) if g <= max(1, versions))


def track_for_lag(lag: int) -> int:
    """The track a worker ``lag`` versions behind should be on: the coarsest whose interval
    is at most half its lag (:meth:`Downlink.choose`, before its hysteresis)."""
    return coarsest_track(max(1, lag) // 2)


class Downlink:
    """Published tracks at several intervals, and which one answers a worker.

    A worker that asks every few versions is answered from the finest track, one entry per
    version. One that lags far (many workers: each asks about once per ``workers`` versions)
    would need a chain larger than the weights there; it is moved once, with the full
    weights, to the track whose interval is at most half its lag, where every entry covers
    that many versions in the bytes of one. Its replica is then up to one interval older
    than the finest track's: no more than half of what it lags anyway when it moves there,
    and less than the versions that passed between two of its last few answers while it
    stays (it moves back down once they are all shorter than the interval, see
    :meth:`choose`); one that may stay on a coarser track other workers are on goes there
    (:meth:`_track_to_join`), so that workers alike share one. Each track is an
    :class:`UpdateLog`; each is O(parameters), none grows with the workers; a worker
    costs one small int (its track) and its last few answers' spacing
    (:class:`AnswerGaps`). A track no connected worker is on is dropped
    (:meth:`forget_unused`): as more workers lag more they move to coarser tracks, and the
    finer ones they left would otherwise keep their copies of the weights for nobody.

    With a lossless codec every answer that changes anything is the track's weights (a
    float32 delta is as large); a coarse track then shares one copy of the weights among all
    the answers of its interval instead of copying them every version.

    Args: as :class:`UpdateLog`'s (every track gets them).
    """

    def __init__(self, codec: Codec, **kwargs: Any) -> None:
        intervals = TRACK_INTERVALS
        self.tracks = [UpdateLog(codec, **kwargs) for _ in intervals]
        self.intervals = intervals
        self.switches = 0  # workers moved to another track
        self.forgotten = 0  # tracks dropped once no worker was on them
        #: answers with a chain of the worker's own track because the weights it was due
        #: could not be copied (the coordinator's MAX_HELD_SNAPSHOTS: see _instead_of_weights)
        self.instead_of_weights = 0
        #: answers that waited for a copy of the weights (the coordinator's _deferred_answer)
        self.deferred = 0
        self._last_entry = 0  # (_entry_bytes)

    @property
    def fine(self) -> UpdateLog:
        """The finest track (a publication every version)."""
        return self.tracks[0]

    def publish(self, master: torch.Tensor, version: int, track: int = 0) -> UpdateLog:
        """Publish ``track`` at ``version`` once its interval has passed (the finest: whenever
        the version moved), so that the workers a coarse track answers meanwhile share its
        weights; returns the track."""
        t = self.tracks[track]
        if t.head < 0 or version - t.head >= self.intervals[track]:
            t.publish(master, version)
        return t

    def choose(self, master: torch.Tensor, version: int, track: int, holds: int,
               gaps: AnswerGaps | None = None) -> tuple[int, list[LogEntry] | None]:
        """(the track that answers a worker on ``track`` holding its version ``holds``, the
        entries that bring it to that track's head — None: that track's full weights, whose
        answer the caller counts with :meth:`full_answered` once it knows whether they went).
        Publishes only the track that answers (no track is published for nobody).

        The track a worker should be on is the coarsest whose interval is at most half its
        lag. On it, it gets a chain (or the weights, when no chain is smaller). On a finer one
        it stays while the chain there is at most half the weights, and moves up otherwise. On
        a coarser one it stays while at least that track's interval passed between two of its
        last few answers (:attr:`AnswerGaps.longest`; without one, its lag), and moves down
        only once all were shorter. A move costs the full weights, and a worker whose lag
        hovers about twice an interval, or whose gradients in flight are answered alternately
        soon and late, would otherwise move up and down again and again (four workers with two
        gradients in flight each did, at one answer in four, measured by
        ``benchmarks/bench_scale.py``); staying adds at most ``interval - 1`` versions, fewer
        than it lately waited between answers.

        Nor does it move down to a track where it would come back from the move, which is the
        full weights, with a chain over half the weights: its usual gap plus what its full
        answers added to its lag (:attr:`AnswerGaps.full_extra`, the most of its last four)
        calls for a track no finer than its own (:meth:`_full_destination`), and it stays. On
        a link the weights take seconds to cross, that extra is many times its usual gap: a
        worker answered often while others waited for their weights moved down, came back
        tens of versions behind and moved up, each time with the weights, over and over
        (``scripts/sim_link.py``: 3.6 moves and 8.2 full answers per 100 answers, the whole
        run long).

        A worker that gets the full weights anyway goes where its next answers will be small
        (:meth:`_full_destination`): when a chain on the track its lag calls for would be about
        the weights' size (an fp16 entry is half of them, so two entries are as large), it goes
        to the coarsest track whose interval is at most its lag, where one or two entries
        cover it, under the same bound as staying; the lag it is taken to come back with is its
        usual one plus the extra.

        A worker answered on average at least a coarser track's interval apart over its last
        few answers (:attr:`AnswerGaps.mean`; without one, the longest), which is then sure to
        be allowed to stay there, and finds other workers there goes there at once with the
        full weights (:meth:`_track_to_join`): workers alike in speed share one track."""
        lag = max(1, version - holds)
        wanted = track_for_lag(lag)
        recent = gaps.longest if gaps is not None else None
        spacing = lag if recent is None else recent
        typical = min(lag, spacing) + (gaps.full_extra if gaps is not None else 0)
        if track > wanted and (self.intervals[track] <= spacing
                               or self._full_destination(wanted, typical) >= track):
            wanted = track  # (hysteresis: see above)
        # (a track to join is past `wanted`, so never the worker's own: see _track_to_join)
        mean = gaps.mean if gaps is not None else None
        dest = self._track_to_join(wanted, spacing if mean is None else mean)
        if dest is None:
            if track <= wanted:
                current = self.publish(master, version, track)
                chain = current.chain_from(holds)
                small = chain is not None and (track == wanted or sum(e.nbytes for e in chain)
                                               <= current.replica_bytes // 2)
                if chain is not None and small:
                    current.count(chain)
                    return track, chain
            dest = self._full_destination(wanted, typical)
        self.publish(master, version, dest)
        return dest, None  # (counted once answered: full_answered)

    def _track_to_join(self, wanted: int, spacing: float) -> int | None:
        """The coarsest track past ``wanted`` that other workers are on (it is published: the
        coordinator drops a track no connected worker is on at the next move, so one whose
        last worker left meanwhile still counts) and whose interval is at most ``spacing``,
        how many versions apart the worker's answers come on average, or None; never for
        a downlink whose answers are the weights (a track of it holds no copy of its own).
        Never the worker's own track either: :meth:`choose` raises ``wanted`` to it when it
        may stay there, and a coarser own track it may not stay on fails the same bound here.

        Each lossy track holds its own published copy and log (two copies of the weights).
        Workers alike in speed lag alike, and a worker that may stay on a coarse track (see
        :meth:`choose`) but was never sent there kept the finer one in use beside it:
        ``bench_scale.py``'s 64 workers with top-k sat on the interval-16 and interval-64
        tracks about half and half (150–180 MB more than one track), their answers 3–4
        entries on the finer one. A worker that may be where others are goes there, once,
        with the full weights: one track for workers alike, one or two entries an answer.

        Joining takes the mean of the recent gaps, staying the longest: a band between them.
        With one bound for both, a worker answered about every 36 versions whose gaps reached
        64 now and then (four gradients in flight among 64 workers) joined the interval-64
        track at each such gap and fell back 8 answers later, each time with the full weights:
        at one of its answers in twenty, the whole run long (``test_downlink.py``, 100,000
        answers: 290–350 full answers every 10,000, now 20–40)."""
        if self.tracks[0].whole:
            return None
        return max((t for t in range(wanted + 1, len(self.tracks))
                    if self.tracks[t].head >= 0 and self.intervals[t] <= spacing), default=None)

    def _full_destination(self, wanted: int, typical: int) -> int:
        """The track whose weights answer a worker that :meth:`choose` sends the full weights,
        ``typical`` versions behind (its lag, or the spacing of its answers if less):
        ``wanted``, unless the chains it would get there (about ``typical / interval`` entries
        of the size the tracks' entries have) would be over half the weights, as
        :meth:`choose` counts a chain small; then the coarsest whose interval is at most
        ``typical``. (A lossless track has no entries: its answers are the weights whatever
        the track.)"""
        entry = self._entry_bytes()
        half = self.tracks[wanted].replica_bytes // 2
        if not entry or math.ceil(typical / self.intervals[wanted]) * entry <= half:
            return wanted
        return max(wanted, coarsest_track(typical))

    def _entry_bytes(self) -> int:
        """The size of the tracks' latest entry, or of the last there was: a track restarted
        (the drift bound, its resync interval) has none until it publishes again, and a
        worker answered meanwhile is to be placed as before, not as if entries cost nothing
        (which moved every worker on the track down at once, and up again once they came
        back from the weights). 0: none yet (a lossless downlink has none)."""
        latest = max((t.entries[-1].nbytes for t in self.tracks if t.entries), default=0)
        if latest:
            self._last_entry = latest
        return self._last_entry

    def full_answered(self, track: int, moved_from: int, *, sent: bool) -> None:
        """Count the answer with ``track``'s weights that :meth:`choose` called for, to a
        worker that was on ``moved_from``: ``sent``, or withheld (no copy of the weights could
        be made: the worker stays where it was)."""
        self.tracks[track].answers["full" if sent else "withheld"] += 1
        if sent and track != moved_from:
            self.switches += 1

    def snapshot(self, master: torch.Tensor, to_replica: ToReplica, version: int, track: int = 0, *,
                 make: bool = True, newer_than: int = -1) -> tuple[int, dict[str, torch.Tensor]] | None:
        """:meth:`UpdateLog.snapshot` of ``track``."""
        return self.tracks[track].snapshot(master, to_replica, version, make=make, newer_than=newer_than)

    def forget_unused(self, in_use: set[int]) -> int:
        """Drop the state of every track not in ``in_use`` (the tracks the connected workers
        are on): each holds up to three copies of the weights (published, log, snapshot), and
        as more workers lag more the coarse ones are taken up while the finer ones empty. A
        joining worker starts on the finest track, which then starts afresh from the master.
        Returns how many were dropped."""
        dropped = 0
        for i, track in enumerate(self.tracks):
            if i not in in_use and track.head >= 0:
                track.forget()
                dropped += 1
        self.forgotten += dropped
        return dropped

    def summary(self) -> dict[str, Any]:
        """The finest track's summary, plus every track's and the switches."""
        fine = self.fine.summary()
        used = [dict(t.summary(), interval=g) for g, t in zip(self.intervals, self.tracks) if t.head >= 0]
        answers = {k: sum(t.answers[k] for t in self.tracks) for k in fine["answers"]}
        # (the version published last on any track: the finest one is dropped while no worker is on it)
        return {**fine, "version": max(t.head for t in self.tracks), "answers": answers,
                "entries_sent": sum(t.entries_sent for t in self.tracks),
                "log_bytes": sum(t.log_bytes() for t in self.tracks), "tracks": used,
                "switches": self.switches, "forgotten": self.forgotten,
                "instead_of_weights": self.instead_of_weights, "deferred": self.deferred}
