"""The shared downlink (roles/ps/downlink.py): one published copy and a log of compressed
entries by version, from which a replica at any version is brought to the head bit for bit;
bounded memory, the drift bound, and what a long run does to them."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.compression.base import Codec
from swarmtrain.errors import ProtocolError
from swarmtrain.roles.ps.common import FUSED, unpack_compressed
from swarmtrain.roles.ps.downlink import (
    GAP_WINDOW,
    TRACK_INTERVALS,
    AnswerGaps,
    Downlink,
    UpdateLog,
    entry_tensors,
)
from tests.test_ps_inprocess import coordinator, pause_and_settle, worker

SIZES = [600, 400, 24]


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split(SIZES))


def _log(codec: Codec, *, fused: bool = False, max_drift: float = 0.01,
         reset_interval: int = 10**9) -> UpdateLog:
    return UpdateLog(codec, split=_split, names=[f"p{i}" for i in range(len(SIZES))],
                     round_replica=lambda flat: None, replica_bytes=sum(SIZES) * 4, fused=fused,
                     max_drift=max_drift, reset_interval=reset_interval)


class Replica:
    """A worker's copy, moved only by what the log sends, decoded as the worker decodes."""

    def __init__(self, log: UpdateLog, master: torch.Tensor) -> None:
        self.full(log, master)

    def full(self, log: UpdateLog, master: torch.Tensor) -> None:
        self.version, weights = log.snapshot(master, lambda views: {
            f"p{i}": v.clone() for i, v in enumerate(views)}, log.head)
        self.flat = torch.cat([weights[f"p{i}"] for i in range(len(SIZES))])

    def catch_up(self, log: UpdateLog, master: torch.Tensor) -> str:
        chain = log.answer(self.version)
        if chain is None:
            self.full(log, master)
            return "full"
        for entry in chain:
            assert entry.start == self.version
            tensors = {k: t for e in chain for k, t in e.tensors.items()}  # as one UPDATE carries them
            expected = ({FUSED: self.flat} if log.fused
                        else dict(zip((f"p{i}" for i in range(len(SIZES))), _split(self.flat))))
            decoded = unpack_compressed(entry.codecs, entry_tensors(tensors, entry.start), expected)
            if log.fused:
                self.flat += decoded[FUSED].reshape(-1)
            else:
                for piece, d in zip(_split(self.flat), decoded.values()):
                    piece += d.reshape(-1)
            self.version = entry.end
        return "chain" if chain else "current"


def _walk(master: torch.Tensor, gen: torch.Generator, scale: float = 1e-3) -> None:
    master += torch.randn(master.shape, generator=gen) * scale


@pytest.fixture(params=["kernels", "torch"])
def coding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each downlink test runs with the fused kernels and with the torch code they replace."""
    if request.param == "torch":
        monkeypatch.setattr("swarmtrain.roles.ps.downlink.kernels", lambda: None)
    return str(request.param)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-tensor"])
@pytest.mark.parametrize("name", ["uniform", "fp16"])
def test_a_replica_at_any_version_is_brought_to_the_published_weights_bit_for_bit(
        name: str, fused: bool, coding: str) -> None:
    codec = make_codec(name, bucket_size=64)
    log = _log(codec, fused=fused)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(sum(SIZES), generator=gen)
    log.publish(master, 0)
    replicas = [Replica(log, master) for _ in range(4)]
    kinds = []
    for version in range(1, 200):
        _walk(master, gen)
        log.publish(master, version)
        # replica i asks every i+1 versions: 0, 1, 2 and 3 versions behind
        for i, r in enumerate(replicas):
            if version % (i + 1) == 0:
                kinds.append(r.catch_up(log, master))
                assert r.version == log.head == version
                assert log.published is not None and torch.equal(r.flat, log.published)
        rel = float((master - log.published).norm() / master.norm())
        assert rel <= 0.01 and math.isclose(log.drift, rel, rel_tol=1e-3, abs_tol=1e-9)
    assert kinds.count("chain") > 100  # the log answered most of them
    if name == "uniform":  # (2 fp16 entries are as large as the weights: never chained)
        assert log.entries_sent > kinds.count("chain")  # chains of more than one entry


def test_a_chain_larger_than_the_weights_or_older_than_the_log_gets_the_weights() -> None:
    codec = make_codec("fp16")  # 2 bytes a parameter: a chain of 2 is as large as the weights
    log = _log(codec)
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(sum(SIZES), generator=gen)
    log.publish(master, 0)
    behind = Replica(log, master)
    near = Replica(log, master)
    for version in range(1, 6):
        _walk(master, gen)
        log.publish(master, version)
        assert log.log_bytes() < log.replica_bytes  # the log never holds what no answer uses
        assert len(log.entries) <= 2
        assert near.catch_up(log, master) == "chain"
    assert behind.catch_up(log, master) == "full"
    assert torch.equal(behind.flat, log.published) and behind.version == 5
    assert log.answer(5) == [] and log.answer(-7) is None  # current; never on the track


def test_a_publication_beyond_the_drift_bound_restarts_the_track(coding: str) -> None:
    # top-k keeps 1 %: Adam-like dense changes leave the published copy further and further
    log = _log(make_codec("topk", topk_ratio=0.01), max_drift=0.002)
    gen = torch.Generator().manual_seed(2)
    master = torch.randn(sum(SIZES), generator=gen)
    log.publish(master, 0)
    r = Replica(log, master)
    kinds = set()
    for version in range(1, 300):
        _walk(master, gen)
        log.publish(master, version)
        assert log.drift <= 0.002
        kinds.add(r.catch_up(log, master))
        assert torch.equal(r.flat, log.published)
    assert log.resets > 1 and kinds == {"chain", "full"}


def test_a_lossless_downlink_keeps_no_copy_and_answers_with_the_master() -> None:
    log = _log(make_codec("none"))
    master = torch.randn(sum(SIZES))
    log.publish(master, 0)
    r = Replica(log, master)
    master += 1.0
    log.publish(master, 1)
    assert log.published is None and r.catch_up(log, master) == "full"
    assert torch.equal(r.flat, master)
    sent = log.snapshot(master, lambda views: {}, 1)[1]  # (the one cached for version 1)
    before = {k: t.clone() for k, t in sent.items()}
    master += 1.0  # the snapshot sent is a copy: the next update does not reach it
    assert all(torch.equal(before[k], t) for k, t in sent.items()) and sent


def test_a_lossless_tracks_copy_is_labelled_with_the_version_it_holds() -> None:
    # a coarse lossless track moved its head without a copy (no worker needed one then); the
    # copy made later is of the master as it is later, and must say so: labelled with the
    # old head, the worker would count its gradients staler than they are
    log = _log(make_codec("none"))
    master = torch.randn(sum(SIZES))
    log.publish(master, 4)
    master += 1.0  # the master of version 5
    version, weights = log.snapshot(master, lambda views: {"w": torch.cat(views).clone()}, 5)
    assert version == 5 == log.head and torch.equal(weights["w"], master)


@pytest.mark.timeout(120)
def test_a_long_run_of_publications_keeps_memory_drift_and_replicas_where_they_were() -> None:
    # Long runs count: nothing the log keeps may grow, and the replicas must still equal the
    # published weights bit for bit after 100,000 entries of a uniform 4-bit downlink (coded
    # by the fused kernels where built; the torch coding is held to the same bits above).
    sizes = [64, 32]
    log = UpdateLog(make_codec("uniform", bucket_size=32), split=lambda f: list(f.split(sizes)),
                    names=["a", "b"], round_replica=lambda flat: None, replica_bytes=96 * 4,
                    fused=True, max_drift=0.01, reset_interval=10**9)
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(96, generator=gen)
    steps = torch.randn(1000, 96, generator=gen) * 1e-3
    log.publish(master, 0)
    replica = master.clone()
    version = 0
    worst_drift, most_entries, most_bytes = 0.0, 0, 0
    for version in range(1, 100_001):
        master += steps[version % 1000]
        log.publish(master, version)
        chain = log.answer(version - 1)
        if chain is None:
            assert log.published is not None
            replica = log.published.clone()
        else:
            for entry in chain:
                replica += unpack_compressed(entry.codecs, entry_tensors(entry.tensors, entry.start),
                                             {FUSED: replica})[FUSED]
        worst_drift = max(worst_drift, log.drift)
        most_entries = max(most_entries, len(log.entries))
        most_bytes = max(most_bytes, log.log_bytes())
    assert torch.equal(replica, log.published)
    assert worst_drift <= 0.01
    assert most_bytes < log.replica_bytes and most_entries <= 96 * 4 // min(e.nbytes for e in log.entries)
    assert log.publications == 100_000 + 1 and log.answers["chain"] > 99_000


@pytest.mark.timeout(120)
def test_workers_share_the_log_and_hold_the_published_weights_exactly() -> None:
    comp = {"compression.type": "topk", "compression.topk_ratio": 0.05, "compression.min_compress_numel": 0}

    async def main() -> None:
        c = coordinator(**{"training.min_workers": 3, "training.resync_interval": 10_000, **comp})
        await c.start()
        ws = [worker(c.port, **{"training.worker_id": f"w{i}", **comp}) for i in range(3)]
        tasks = [asyncio.create_task(w.run_async()) for w in ws]
        try:
            async with asyncio.timeout(60):
                while c.version < 120:
                    await asyncio.sleep(0.05)
            await pause_and_settle(c, ws)
            for w in ws:
                track = c.downlink.tracks[c.workers[w.worker_id].track]
                published = track.published
                assert published is not None
                # what it holds, brought to the head by the log as its next answer would be,
                # is the published copy bit for bit
                held = torch.cat([p.detach().reshape(-1) for p in w.params.values()])
                chain = track.answer(w.version)
                assert chain is not None, (w.version, track.head)
                w._add_chain([e.header() for e in chain],
                             {k: t for e in chain for k, t in e.tensors.items()}, track.head)
                assert torch.equal(torch.cat([p.detach().reshape(-1) for p in w.params.values()]),
                                   published)
                assert chain or torch.equal(held, published)
            st = c.status()["downlink"]
            assert st["answers"]["chain"] > 60 and st["entries_sent"] > st["answers"]["chain"]
            assert all(t["log_bytes"] < c.downlink.fine.replica_bytes for t in st["tracks"])
            # nothing per worker holds a copy of the weights
            assert not any(isinstance(v, torch.Tensor) for r in c.workers.values() for v in vars(r).values())
        finally:
            for w in ws:
                w.stop()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            await c.close()

    asyncio.run(main())


def test_a_worker_refuses_a_chain_that_does_not_start_where_it_is() -> None:
    from tests.test_ps_inprocess import worker as make_worker
    w = make_worker(1, **{"training.worker_id": "gap"})
    w.version = 7
    for chain in ([{"from": 6, "to": 8, "codecs": {}}], [{"from": 7}], ["junk"]):
        with pytest.raises(ProtocolError, match="bad_update|delta"):
            w._add_chain(chain, {}, 8)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="end at version"):
        w._add_chain([{"from": 7, "to": 8, "codecs": {}}], {}, 9)


class TrackedReplica:
    """A worker's copy answered by :class:`Downlink` (the coordinator keeps its track)."""

    def __init__(self) -> None:
        self.track, self.version, self.flat = 0, -1, torch.empty(0)
        self.bytes = 0
        self.full = 0  # answers that were the full weights
        self.gaps = AnswerGaps()  # (as the coordinator's WorkerRecord keeps them)

    def ask(self, dl: Downlink, master: torch.Tensor, version: int) -> list:  # type: ignore[type-arg]
        before = self.track
        # (joining is not an answer: the coordinator's welcome does not go through choose)
        if self.version >= 0:
            self.gaps.add(version, version - self.version)
        self.track, chain = dl.choose(master, version, self.track, self.version, self.gaps)
        self.gaps.answered(full=chain is None)
        if chain is None:
            found = dl.snapshot(master, lambda views: {
                f"p{i}": v.clone() for i, v in enumerate(views)}, version, self.track)
            assert found is not None
            self.version, weights = found
            dl.full_answered(self.track, before, sent=True)
            self.flat = torch.cat([weights[f"p{i}"] for i in range(len(SIZES))])
            self.bytes += sum(SIZES) * 4
            self.full += 1
            return []
        for entry in chain:
            assert entry.start == self.version
            self.flat += unpack_compressed(entry.codecs, entry_tensors(entry.tensors, entry.start),
                                           {FUSED: self.flat})[FUSED]
            self.version = entry.end
            self.bytes += entry.nbytes
        return chain

    def ask_and_check(self, dl: Downlink, master: torch.Tensor, version: int) -> int:
        """:meth:`ask`, then check it holds its track's published weights, bit for bit, at
        most one interval older than ``version``; returns the bytes the answer took."""
        before = self.bytes
        self.ask(dl, master, version)
        track = dl.tracks[self.track]
        assert track.published is not None and torch.equal(self.flat, track.published)
        assert version - self.version < TRACK_INTERVALS[self.track]
        return self.bytes - before


def test_answer_gaps_remember_the_longest_of_the_last_few_and_forget_it() -> None:
    gaps = AnswerGaps()
    assert gaps.add(10) is None  # the first answer has no gap
    assert gaps.add(10) == 1  # (two answers at one version: a gap of one)
    assert gaps.add(40) == 30
    for version in range(41, 41 + GAP_WINDOW - 1):
        assert gaps.add(version) == 30  # the long gap is still among the last few
    assert gaps.add(41 + GAP_WINDOW - 1) == 1  # and then forgotten


def _downlink(codec: Codec | None = None, reset_interval: int = 10**9) -> Downlink:
    return Downlink(codec or make_codec("uniform", qsgd_bits=4, bucket_size=64), split=_split,
                    names=[f"p{i}" for i in range(len(SIZES))], round_replica=lambda flat: None,
                    replica_bytes=sum(SIZES) * 4, fused=True, max_drift=0.05,
                    reset_interval=reset_interval)


def _advance(dl: Downlink, master: torch.Tensor, gen: torch.Generator, version: int, n: int,
             every_track: bool = False) -> int:
    """``n`` optimizer steps, each published on the finest track (``every_track``: on every
    track in use, as other workers on them would have it); returns the new version."""
    for _ in range(n):
        version += 1
        _walk(master, gen)
        for track in range(len(dl.tracks) if every_track else 1):
            if track == 0 or dl.tracks[track].head >= 0:
                dl.publish(master, version, track)
    return version


def _joined(workers: int, seed: int) -> tuple[Downlink, torch.Generator, torch.Tensor, list[TrackedReplica]]:
    """A downlink published at version 0 and ``workers`` workers that joined there."""
    dl = _downlink()
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(sum(SIZES), generator=gen)
    dl.publish(master, 0)
    replicas = [TrackedReplica() for _ in range(workers)]
    for w in replicas:
        w.ask(dl, master, 0)
    return dl, gen, master, replicas


def _one_worker(seed: int, codec: Codec | None = None,
                ) -> tuple[Downlink, torch.Generator, torch.Tensor, TrackedReplica]:
    """A downlink published at version 0 and one worker that joined there."""
    dl = _downlink(codec)
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(sum(SIZES), generator=gen)
    dl.publish(master, 0)
    w = TrackedReplica()
    w.ask(dl, master, 0)
    return dl, gen, master, w


def test_far_behind_workers_move_to_a_coarser_track_and_get_chains_not_the_weights() -> None:
    # 32 workers asking in turn: each is ~32 versions behind, where the finest track's chain
    # (32 entries of ~1/8 of the weights) is larger than the weights themselves
    dl, gen, master, workers = _joined(32, seed=5)
    version = 0
    late_bytes, late_answers, worst_extra = 0, 0, 0
    for turn in range(40):
        for w in workers:
            version += 1
            _walk(master, gen)
            dl.publish(master, version)
            before = w.bytes
            w.ask(dl, master, version)
            track = dl.tracks[w.track]
            assert track.published is not None and torch.equal(w.flat, track.published)
            assert w.version == track.head
            if turn >= 5:
                late_bytes += w.bytes - before
                late_answers += 1
                worst_extra = max(worst_extra, version - w.version)
    summary = dl.summary()
    # moved off the finest track (interval 4 or 16: at most half the lag of 32; a worker stays
    # on the finer one while its chain there is smaller than the weights)
    assert {w.track for w in workers} <= {1, 2} and any(w.track == 2 for w in workers)
    assert late_bytes / late_answers < 0.4 * sum(SIZES) * 4, summary  # chains, not the weights
    assert worst_extra < 16  # at most one interval older than the finest track
    assert len(summary["tracks"]) <= len(TRACK_INTERVALS)


def test_a_worker_whose_lag_shrinks_comes_back_to_the_finest_track() -> None:
    dl, gen, master, w = _one_worker(6)
    version = 0
    for _ in range(5):  # it asks every 40 versions: moved to a coarse track
        version = _advance(dl, master, gen, version, 40)
        w.ask(dl, master, version)
    assert w.track > 0
    for _ in range(GAP_WINDOW + 1):  # now every version (the others left): once its long gaps are
        version = _advance(dl, master, gen, version, 1)  # forgotten, back to one entry per version
        w.ask(dl, master, version)
    assert w.track == 0 and w.version == version
    assert torch.equal(w.flat, dl.fine.published)


@pytest.mark.parametrize("lags", [(9, 7), (13, 2)], ids=["hovering", "two-in-flight"])
def test_a_worker_whose_lag_hovers_about_a_tracks_threshold_does_not_move_back_and_forth(
        lags: tuple[int, int]) -> None:
    # lags in turn: 9 (or 13) call for the interval-4 track (at most half the lag), 7 (or 2)
    # for the finest; 13 and 2 are a worker with two gradients in flight, answered soon and
    # late in turn. Every move is the full weights; without hysteresis the worker moved at
    # every answer (bench_scale's four workers did so at one answer in four)
    dl, gen, master, w = _one_worker(8)
    version = 0
    late_bytes, settled = 0, 0
    for turn in range(20):
        if turn == 4:
            settled = dl.switches
        version = _advance(dl, master, gen, version, lags[turn % 2])
        got = w.ask_and_check(dl, master, version)
        assert TRACK_INTERVALS[w.track] <= 4
        if turn >= 4:
            late_bytes += got
    summary = dl.summary()
    # it moved up (and, while its gaps settled, perhaps once back), then stayed
    assert w.track == 1 and summary["switches"] <= 3 and summary["switches"] == settled, summary
    assert late_bytes / 16 < 0.4 * sum(SIZES) * 4  # chains of 1-3 entries, not the weights
    for _ in range(10):  # lagging less than the interval from now on: back to the finest track
        version = _advance(dl, master, gen, version, 1)
        w.ask(dl, master, version)
    assert w.track == 0 and w.version == version


@pytest.mark.parametrize("jitter", [3, 40])
def test_workers_alike_in_speed_end_on_one_track_with_one_or_two_entries_an_answer(jitter: int) -> None:
    # bench_scale.py's light workers: 64 alike, two gradients in flight each, applied in the
    # order they arrive (each new one queued behind the others, give or take ``jitter``
    # places). They lag about 64 versions between answers: the interval-16 track's rule, and
    # the interval-64 one's once there. Before, they sat on both about half and half for good
    # (two published copies and two logs: 150-180 MB more than one track on a 38 MB model),
    # answers 2-4 entries on the finer one; now each moves once to where the others are
    rnd = random.Random(jitter)
    dl, gen, master, workers = _joined(64, seed=12)
    queue = [i for i in range(64) for _ in range(2)]
    rnd.shuffle(queue)
    version, late_bytes, late_full, late_answers, switches = 0, 0, 0, 0, 0
    for step in range(30 * 128):
        i = queue.pop(0)
        version += 1
        _walk(master, gen)
        w = workers[i]
        before, full_before = w.bytes, w.full
        w.ask_and_check(dl, master, version)
        dl.forget_unused({x.track for x in workers})  # (as the coordinator does at every move)
        queue.insert(len(queue) - rnd.randint(0, jitter), i)
        if step == 10 * 128:
            switches = dl.switches
        if step > 10 * 128:
            late_answers += 1
            late_bytes += w.bytes - before
            late_full += w.full - full_before
    summary = dl.summary()
    assert len({w.track for w in workers}) == 1 and len(summary["tracks"]) == 1, summary
    # one or two entries (a seventh of the weights each) an answer, hardly ever the weights
    assert late_bytes / late_answers < 0.2 * sum(SIZES) * 4, (late_bytes / late_answers, summary)
    assert late_full / late_answers < 0.02 and dl.switches - switches < 64, summary


@pytest.mark.timeout(240)
def test_tracks_stay_where_they_were_over_100000_answers_to_workers_that_leave_return_and_change_speed(
) -> None:
    # Long runs count: the rules that move a worker between tracks (its lag, its recent answer
    # gaps, joining where others are, forgetting tracks nobody is on) over 100,000 answers: 64
    # workers with 1, 2 or 4 gradients in flight, applied in the order they arrive give or take
    # 20 places; every 10,000 updates (one period) the same things happen: 8 leave, 8 come back
    # (joining as a restarted worker does), 8 change speed. Every answer is checked (the
    # track's published weights bit for bit, less than one interval behind), and the periods
    # must look alike: what a period costs (full answers, moves, bytes) may not creep up.
    rnd = random.Random(20)
    dl, gen, master, workers = _joined(64, seed=20)
    speeds = [rnd.choice((1, 2, 2, 4)) for _ in workers]
    queue = [i for i in range(64) for _ in range(speeds[i])]
    rnd.shuffle(queue)
    away: list[int] = []
    period, periods = 10_000, 10
    per: list[dict[str, float]] = []
    weights = sum(SIZES) * 4
    version = 0
    for _ in range(periods):
        full, sent, switches, most_tracks, most_log = 0, 0, dl.switches, 0, 0
        for step in range(period):
            if step == period // 2:  # leave, come back, change speed
                for i in away:
                    workers[i] = TrackedReplica()
                    workers[i].ask(dl, master, version)  # (joining: the full weights)
                    queue += [i] * speeds[i]
                here = [i for i in range(64) if i not in away]
                away = rnd.sample(here, 8)
                queue = [i for i in queue if i not in away]
                for i in rnd.sample([i for i in here if i not in away], 8):
                    speeds[i] = rnd.choice((1, 2, 4))
                    queue = [j for j in queue if j != i] + [i] * speeds[i]
            i = queue.pop(0)
            version += 1
            _walk(master, gen)
            w = workers[i]
            full_before = w.full
            sent += w.ask_and_check(dl, master, version)
            full += w.full - full_before
            dl.forget_unused({workers[j].track for j in range(64) if j not in away})
            queue.insert(len(queue) - rnd.randint(0, min(20, len(queue))), i)
            if step % 100 == 0:
                summary = dl.summary()
                most_tracks = max(most_tracks, len(summary["tracks"]))
                most_log = max(most_log, summary["log_bytes"])
        per.append({"full": full, "bytes": sent / period / weights, "moves": dl.switches - switches,
                    "tracks": most_tracks, "log": most_log / weights})
    table = "\n".join(str({k: round(v, 3) for k, v in r.items()}) for r in per)
    # the full weights at under 1 % of the answers after the first period (8 of them are the
    # joins); before, workers moved back and forth between two tracks: 2.9-3.5 %
    assert all(r["full"] < 0.01 * period for r in per[1:]), table
    # nothing creeps up: the last periods cost what the second did (the joins of a period, 8
    # workers once each, are full answers and moves of their own)
    for key, slack in (("full", 16), ("moves", 16), ("bytes", 0.02), ("log", 0.5)):
        assert max(r[key] for r in per[-3:]) <= 1.5 * per[1][key] + slack, (key, table)
    assert version == periods * period


@pytest.mark.parametrize("restarts", [False, True], ids=["steady", "restarted-tracks"])
def test_a_worker_whose_full_weights_take_long_to_arrive_is_not_moved_down_to_be_moved_up_again(
        restarts: bool) -> None:
    # one server's 100 Mbit/s link (scripts/sim_link.py): a chain arrives within 2 versions,
    # the full weights 40 versions later. On a coarse track the worker is answered every 2
    # versions, so its gaps called for the finest track; it moved down (the full weights),
    # came back 42 versions behind, where a chain of the finest track is larger than the
    # weights, and moved up again (the weights again): every ~10 answers, the whole run long.
    # Now the 40 its full answers add are measured (AnswerGaps.full_extra) and it stays. With
    # the tracks restarted every 30 publications (the drift bound, the resync interval), each
    # restart sends it its track's weights; before its track published again there was no
    # entry to size a chain by, and it moved down then
    slow = 40
    dl = _downlink(reset_interval=30 if restarts else 10**9)
    gen = torch.Generator().manual_seed(14)
    master = torch.randn(sum(SIZES), generator=gen)
    dl.publish(master, 0)
    w = TrackedReplica()
    w.ask(dl, master, 0)  # (its welcome: the full weights)
    version, got_full, settled = 0, True, (0, 0)
    for answer in range(300):
        if answer == 50:
            settled = (dl.switches, w.full)
        for _ in range(2 + (slow if got_full else 0)):
            version += 1
            _walk(master, gen)
            dl.publish(master, version, w.track)  # (as other workers on its track have it)
        full = w.full
        w.ask_and_check(dl, master, version)
        dl.forget_unused({w.track})  # (as the coordinator does: no other track is in use)
        got_full = w.full > full
    summary = dl.summary()
    assert w.gaps.full_extra >= slow - 2 and w.track == 2, summary
    assert dl.switches == settled[0], summary  # no move once settled (before: 50 in 250 answers)
    # the full weights only when its track restarts (every 30 publications: 16 versions each)
    assert w.full - settled[1] <= (version // (30 * 16) + 1 if restarts else 0), (w.full, summary)


def test_a_worker_sent_the_weights_anyway_goes_where_one_entry_covers_its_lag() -> None:
    # an fp16 entry is half the weights: a worker 20 versions behind would get 5 entries on
    # the interval-4 track (at most half its lag; published every 4 versions, as with other
    # workers on it), more than the weights, so the full weights at every answer; on the
    # interval-16 track one entry covers its lag, or two (as large as the weights: then the
    # weights) when two of its publications fell within it
    dl, gen, master, w = _one_worker(9, make_codec("fp16"))
    weights = sum(SIZES) * 4
    version, late_bytes, late_full = 0, 0, 0
    for turn in range(12):
        version = _advance(dl, master, gen, version, 20, every_track=True)
        full_before = w.full
        got = w.ask_and_check(dl, master, version)
        assert TRACK_INTERVALS[w.track] <= 20  # (so it is less than 20 versions older)
        if turn >= 3:
            late_bytes += got
            late_full += w.full - full_before
    assert w.track == 2, dl.summary()
    # (before: the weights at all 9 answers; here one entry at 5 of them)
    assert late_full <= 5 and late_bytes <= 9 * weights * 0.8, (late_full, late_bytes, dl.summary())


def test_a_track_no_worker_is_on_is_forgotten_and_starts_afresh_when_needed() -> None:
    # a worker lagging 40 versions moves to a coarse track; once its lag shrinks it comes back
    # to the finest, and the coarse track (three copies of the weights at most) is dropped;
    # lagging again, the finest is dropped in turn
    dl, gen, master, w = _one_worker(7)
    version = 0

    def lag(n: int) -> None:
        nonlocal version
        version = _advance(dl, master, gen, version, n)
        w.ask(dl, master, version)

    for _ in range(5):
        lag(40)
    coarse = w.track
    assert coarse > 0 and dl.tracks[coarse].published is not None
    assert dl.forget_unused({coarse}) == 1  # its worker is on it: kept; the finest is not
    assert dl.fine.head == -1 and dl.tracks[coarse].published is not None
    for _ in range(GAP_WINDOW + 1):  # (until its long gaps are forgotten)
        lag(1)
    assert w.track == 0
    assert dl.forget_unused({0}) >= 1
    dropped = dl.tracks[coarse]
    assert dropped.published is None and not dropped.entries and dropped.head == -1
    intervals = [t["interval"] for t in dl.summary()["tracks"]]
    assert dl.summary()["forgotten"] >= 1 and TRACK_INTERVALS[coarse] not in intervals
    assert torch.equal(w.flat, dl.fine.published)  # its own track is kept
    for _ in range(3):  # lagging again: the coarse track starts afresh from the master
        lag(40)
    assert w.track > 0 and torch.equal(w.flat, dl.tracks[w.track].published)
    # now no one is on the finest track: it goes too, and a joiner gets it afresh
    assert dl.forget_unused({w.track}) == 1 and dl.fine.head == -1
    assert dl.summary()["version"] == dl.tracks[w.track].head
    dl.publish(master, version)  # a joiner's welcome (Coordinator._snapshot_for, track 0)
    held, weights = dl.snapshot(master, lambda views: {f"p{i}": v.clone() for i, v in enumerate(views)},
                                version)
    assert held == version and torch.equal(torch.cat([weights[f"p{i}"] for i in range(len(SIZES))]), master)


@pytest.mark.parametrize("workers", [1, 8])
def test_each_worker_gets_the_full_weights_once_in_resync_interval_answers_however_many_share_it(
        workers: int) -> None:
    # the periodic restart of a track sends each worker on it the full weights once. Counted
    # in publications, eight workers answered in turn (lag 8: the interval-4 track, chains of
    # two entries) were restarted every 5 of their answers, not 10, and bench_scale's 64 (on
    # the interval-16 track, chains of four) at one answer in twelve: a tenth of the answers
    # 38 MB instead of 5, arriving all at once. Now the restarts are as rare per answer as a
    # lone worker's, and still happen
    interval = 10
    dl = _downlink(reset_interval=interval)
    gen = torch.Generator().manual_seed(11)
    master = torch.randn(sum(SIZES), generator=gen)
    dl.publish(master, 0)
    replicas = [TrackedReplica() for _ in range(workers)]
    for w in replicas:
        w.ask(dl, master, 0)
    version = 0
    for turn in range(90):
        if turn == 10:  # (settled on its track)
            settled = sum(w.full for w in replicas)
        for w in replicas:
            version += 1
            _walk(master, gen)
            w.ask_and_check(dl, master, version)
    answers, full = 80 * workers, sum(w.full for w in replicas) - settled
    assert {w.track for w in replicas} == {0 if workers == 1 else 1}
    assert 0.7 / interval <= full / answers <= 1.3 / interval, (full, answers, dl.summary())


@pytest.mark.parametrize("how", ["publication", "restart"])
def test_a_lossy_tracks_copy_of_the_weights_is_let_go_once_it_publishes_again(how: str) -> None:
    # A copy made for one full answer stayed in the track for nobody until the next full
    # answer on that track: 64 workers on three tracks held 115 MB of them (bench_scale.py,
    # top-k), with no full answer in the window. Now only answers not yet sent hold it.
    import weakref

    log = _log(make_codec("uniform", qsgd_bits=4, bucket_size=64), fused=True,
               reset_interval=1 if how == "restart" else 10**9)
    gen = torch.Generator().manual_seed(11)
    master = torch.randn(sum(SIZES), generator=gen)
    log.publish(master, 0)
    version, weights = log.snapshot(master, lambda views: {"w": torch.cat(views)}, 0)
    assert version == 0 and torch.equal(weights["w"], log.published)
    again = log.snapshot(master, lambda views: {"w": torch.cat(views)}, 0)
    assert again is not None and again[1] is weights  # one copy per version, shared
    held = weakref.ref(weights["w"])
    del weights, again
    assert held() is not None  # (the track still has it at its version)
    _walk(master, gen)
    resets = log.resets
    log.publish(master, 1)
    assert (log.resets > resets) == (how == "restart")
    assert held() is None
    version, weights = log.snapshot(master, lambda views: {"w": torch.cat(views)}, 1)
    assert version == 1 and torch.equal(weights["w"], log.published)  # made anew when asked


@pytest.mark.parametrize("codec", ["uniform", "fp16"])
def test_the_entries_the_step_writes_reuse_the_memory_of_entries_no_longer_held(codec: str) -> None:
    # Each publication's entry is the same size; a new block each time left freed 5 MB blocks
    # in the allocator (bench_scale.py, top-k, 64 workers). Entries now come from the track's
    # pool: once trimmed from the log and held by no answer, an entry's memory takes the next.
    log = _log(make_codec(codec, qsgd_bits=4, bucket_size=64), fused=True)
    gen = torch.Generator().manual_seed(12)
    master = torch.randn(sum(SIZES), generator=gen)
    log.publish(master, 0)
    held = []
    for version in range(1, 61):
        target = log.fused_target(master.numel())
        assert target is not None
        _, item = target
        for t in item.parts.values():
            t.zero_()  # (what the step writes: all codes 0, all scales 0, a change of nothing)
        log.finish_fused(master, version, item, True, 0.0, float(master.square().sum()))
        if version == 30:
            held = list(log.entries)  # an answer still being sent holds these
    live = len(log.entries)
    assert 1 <= live < 60 and log.head == 60  # (trimmed to the weights' size)
    pool = log._entry_pool
    # every entry still referred to (the log's, the held answer's) has its own buffer, and
    # nothing else was made but the two idle ones the pool keeps at most
    assert pool.allocated <= live + len(held) + 2, (pool.allocated, live, len(held))
    assert pool.reused >= 60 - pool.allocated
    assert all(e.tensors for e in held)  # (the held answer's entries are intact)
