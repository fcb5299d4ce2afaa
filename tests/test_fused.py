"""A small model's messages carry their tensors fused (swarmtrain/roles/ps/common.py,
``fuse_gradients``): an uncompressed gradient as one entry, full weights as one tensor. The fused
forms must change nothing but the framing: the coordinator applies a fused gradient exactly
as the per-tensor one, screens it the same (NaN, wrong size), the worker's replica loads
fused weights exactly, and what is not eligible stays per tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import ProtocolError, RemoteProtocolError
from swarmtrain.roles.ps.common import (
    FUSE_MAX_NUMEL,
    FUSED,
    fuse_gradients,
    fused_views,
    pack_compressed,
    whole_entry,
)
from swarmtrain.roles.ps.replica import Replica
from swarmtrain.wire import Decoder, Gradients, Message, Update, UpdateStatus, encode_bytes
from tests.test_coordinator_state import make_coordinator, record
from tests.test_ps_inprocess import TASK

pytestmark = pytest.mark.timeout(60)


def through_the_wire(msg: Message) -> Message:
    """``msg`` encoded and decoded, as a peer receives it."""
    d = Decoder()
    d.feed(encode_bytes(msg))
    out = d.next_message()
    assert out is not None
    return out


def grads_of(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) * 0.01 for n, p in params.items()}


def message(c_params: dict[str, torch.Tensor], g: dict[str, torch.Tensor], *, fuse: bool, msg_id: int,
            version: int) -> Gradients:
    codec = make_codec("none")
    flat = fuse_gradients(g, c_params) if fuse else None
    items = whole_entry(flat) if flat is not None else {n: codec.compress(t) for n, t in g.items()}
    assert (flat is not None) == fuse
    codecs, tensors = pack_compressed(items)
    msg = through_the_wire(Gradients(msg_id=msg_id, version=version, samples=32, loss=1.0,
                                     codecs=codecs, tensors=tensors))
    assert isinstance(msg, Gradients)
    return msg


def test_only_a_whole_float32_gradient_is_fused_up_to_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    whole = {n: torch.ones_like(p) for n, p in params.items()}
    fused = fuse_gradients(whole, params)
    assert fused is not None and fused.shape == (17,) and torch.equal(fused, torch.ones(17))
    entry = whole_entry(fused)
    assert list(entry) == [FUSED] and entry[FUSED].codec == "none" and entry[FUSED].shape == (17,)
    # a parameter without a gradient, another order, another dtype: not fused
    assert fuse_gradients({"a": whole["a"]}, params) is None
    assert fuse_gradients({"b": whole["b"], "a": whole["a"]}, params) is None
    assert fuse_gradients({n: g.to(torch.bfloat16) for n, g in whole.items()}, params) is None
    # a larger model too (the coordinator's per-tensor cost is what fusing saves), up to the
    # size where that cost no longer matters and the worker keeps the second copy's memory
    big = {"a": torch.ones(FUSE_MAX_NUMEL), "b": torch.full((1,), 2.0)}
    flat = fuse_gradients(big, big)
    assert flat is not None and flat.numel() == FUSE_MAX_NUMEL + 1 and float(flat[-1]) == 2.0
    monkeypatch.setattr("swarmtrain.roles.ps.common.FUSE_DENSE_MAX_NUMEL", FUSE_MAX_NUMEL)
    assert fuse_gradients(big, big) is None


def test_a_fused_entry_of_the_wrong_size_is_refused_by_name() -> None:
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    views = fused_views(torch.arange(17.0), params)
    assert views["a"].shape == (3, 4) and torch.equal(views["b"], torch.arange(12.0, 17.0))
    with pytest.raises(RemoteProtocolError, match="does not hold the model's 17 elements"):
        fused_views(torch.arange(16.0), params)


def test_the_coordinator_applies_a_fused_gradient_exactly_as_the_per_tensor_one() -> None:
    a = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0})
    b = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0})
    ra, rb = record(a), record(b)
    for i in range(1, 6):
        g = grads_of(a.params, i)
        fused = message(a.params, g, fuse=True, msg_id=i, version=a.version)
        assert list(fused.codecs) == [FUSED]
        plain = message(b.params, g, fuse=False, msg_id=i, version=b.version)
        assert len(plain.codecs) == len(b.params) > 1
        sa, ua = a._apply_gradient(ra, fused)
        sb, ub = b._apply_gradient(rb, plain)
        assert sa == sb == "applied"
        assert ua is not None and ub is not None
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    assert a.version == b.version == 5


def test_a_fused_gradient_holding_nan_or_of_the_wrong_size_is_rejected_and_nothing_moves() -> None:
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0})
    rec = record(c)
    before = {n: p.detach().clone() for n, p in c.params.items()}
    g = grads_of(c.params, 1)
    g[next(iter(g))][0] = float("nan")
    status, _ = c._apply_gradient(rec, message(c.params, g, fuse=True, msg_id=1, version=0))
    assert status == "rejected"
    codec = make_codec("none")
    short = {FUSED: codec.compress(torch.zeros(sum(p.numel() for p in c.params.values()) - 1))}
    codecs, tensors = pack_compressed(short)
    wrong = through_the_wire(Gradients(msg_id=2, version=0, samples=32, loss=1.0, codecs=codecs,
                                       tensors=tensors))
    assert isinstance(wrong, Gradients)
    status, _ = c._apply_gradient(rec, wrong)
    assert status == "rejected" and c.version == 0
    assert all(torch.equal(before[n], p) for n, p in c.params.items())
    assert c.stats["rejected"] == 2


def test_full_weights_go_fused_and_the_replica_loads_them_exactly() -> None:
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0})
    rec = record(c)
    # the snapshot a registration made (not the kernel's): its buffer is the answer, no copy
    first = c._full_update(rec, 0, "applied")  # type: ignore[arg-type]
    assert first.tensors[FUSED] is c._full_update(rec, 0, "applied").tensors[FUSED]  # type: ignore[arg-type]
    assert torch.equal(first.tensors[FUSED], torch.cat([p.reshape(-1) for p in c.params.values()]))
    c._apply_gradient(rec, message(c.params, grads_of(c.params, 3), fuse=True, msg_id=1, version=0))
    reply = c._full_update(rec, 1, "applied")  # type: ignore[arg-type]
    assert list(reply.tensors) == [FUSED]
    again = c._full_update(rec, 2, "applied")  # type: ignore[arg-type]
    assert again.tensors[FUSED] is reply.tensors[FUSED]  # made once per snapshot
    got = through_the_wire(reply)
    assert isinstance(got, Update) and got.full
    model = TASK.build_model(seed=5)
    replica = Replica(ModelState(model), torch.device("cpu"))
    replica.apply_update(got)
    assert replica.version == c.version
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), c.params[name]), name
    bad = Update(msg_id=3, version=9, status="applied", full=True,  # type: ignore[arg-type]
                 tensors={FUSED: torch.zeros(10)})
    with pytest.raises(ProtocolError, match="fused entry"):
        replica.apply_update(through_the_wire(bad))  # type: ignore[arg-type]
    assert replica.version == c.version  # nothing loaded


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_models_snapshot_is_not_one_fresh_allocation_per_update(threads: int) -> None:
    """A larger model's snapshot is written into a buffer of the coordinator's own pool, used
    again once no answer refers to it. New memory for it on every update is fresh pages: above
    glibc's mmap threshold (32 MB once swarmtrain tunes the allocator) ~9,800 page faults, and
    the 10M-parameter apply (bench_apply.py) took 37 ms instead of 15 (and a tensor per
    parameter, the snapshot until now, faulted 2,000-2,400 times per update on two threads in
    a process without swarmtrain's allocator tuning)."""
    import resource

    from swarmtrain.config import load_coordinator_config
    from swarmtrain.core import hardware
    from swarmtrain.roles.ps.coordinator import Coordinator

    hardware.tune_allocator()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(34)])  # (1 MB tensors)
    assert sum(p.numel() for p in model.parameters()) * 4 > 32 * 2**20
    cfg = load_coordinator_config(overrides={"network.host": "127.0.0.1", "network.port": 0,
                                             "checkpointing.interval": 0, "training.learning_rate": 1e-3})
    c = Coordinator(model, cfg, task_name="big")
    rec = record(c)
    grads = grads_of(c.params, 1)
    msgs = [message(c.params, grads, fuse=False, msg_id=i + 1, version=i) for i in range(12)]
    faults = []
    try:
        for m in msgs:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c._apply_gradient(rec, m)
            c._full_update(rec, c.version, "applied")  # type: ignore[arg-type]
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    finally:
        torch.set_num_threads(old_threads)
    pages = sum(p.numel() for p in c.params.values()) * 4 // 4096
    later = sorted(faults[2:])  # (the first snapshots take new memory either way)
    assert later[len(later) // 2] < pages // 10, (faults, pages)


def _big_coordinator(dtype: torch.dtype = torch.float32, **overrides: Any) -> tuple[Any, Any]:
    from swarmtrain.config import load_coordinator_config
    from swarmtrain.roles.ps.coordinator import Coordinator

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).to(dtype)  # not fused
    assert sum(p.numel() for p in model.parameters()) > FUSE_MAX_NUMEL
    cfg = load_coordinator_config(overrides={"network.host": "127.0.0.1", "network.port": 0,
                                             "checkpointing.interval": 0, "training.learning_rate": 1e-3,
                                             **overrides})
    c = Coordinator(model, cfg, task_name="big")
    assert c._flat_adam is not None and not c._small and c._fuse_full == (dtype == torch.float32)
    return c, record(c)


def named(c: Any, tensors: Any) -> dict[str, torch.Tensor]:
    """An answer's trainable weights by parameter name (a float32 model's travel as one
    :data:`FUSED` tensor: cut into views here)."""
    if FUSED in tensors:
        return fused_views(tensors[FUSED], c.params)
    return {n: tensors[n] for n in c.params}


def test_a_snapshot_an_answer_still_holds_is_never_written_again() -> None:
    """A larger model's snapshots come from the coordinator's pool: the buffer of a version
    an answer still refers to (a send in progress) keeps that version's weights while later
    updates are made, and once nothing refers to it the next snapshot uses it again."""
    c, rec = _big_coordinator()
    msgs = [message(c.params, grads_of(c.params, i), fuse=False, msg_id=i + 1, version=i) for i in range(8)]
    status, held = c._apply_gradient(rec, msgs[0])
    assert status == "applied" and held is not None and held.full
    assert list(held.tensors) == [FUSED]  # (one tensor, no view per parameter)
    kept = {n: t.clone() for n, t in named(c, held.tensors).items()}
    assert all(torch.equal(kept[n], c.params[n]) for n in c.params)
    for m in msgs[1:6]:
        status, reply = c._apply_gradient(rec, m)
        assert status == "applied" and reply is not None
        for n in c.params:  # each answer: its own version's weights
            assert torch.equal(named(c, reply.tensors)[n], c.params[n]), n
        del reply
    for n, t in named(c, held.tensors).items():  # the weights moved; what the held answer sends did not
        assert torch.equal(t, kept[n]) and not torch.equal(t, c.params[n]), n
    size_mb = 4 * sum(p.numel() for p in c.params.values()) / 2**20
    held_mb = c.status()["snapshots"]["held_mb"]  # the held answer's and the downlink's own
    assert 2 * size_mb <= held_mb < 2 * size_mb + 1, (held_mb, size_mb)
    pool = c._snapshot_pool
    made = pool.allocated
    del held, t
    for m in msgs[6:]:
        c._apply_gradient(rec, m)
    assert pool.allocated == made and pool.reused >= 5  # (buffers nobody holds, used again)
    assert c.status()["snapshots"]["held_mb"] < size_mb + 1  # (the downlink's own only)


def test_the_arrays_the_fused_step_streams_through_start_at_different_page_offsets() -> None:
    """The weights, both moments and the snapshot (or published copy) each start at their own
    offset in a 4 KiB page: element i of each then differs in its low 12 address bits, which
    is what keeps the CPU from holding a load back behind an unrelated store (4K aliasing:
    1.2 ms of a 7.9 ms step for 10M parameters). And they are whole cache lines apart."""
    from swarmtrain.wire.pool import PAGE, phased_floats, pooled_floats

    c, rec = _big_coordinator()
    fa = c._flat_adam
    snap = c._snapshot_buffers(fa.flat.numel())
    phases = [t.data_ptr() % PAGE for t in (fa.flat, fa.exp_avg, fa.exp_avg_sq, snap)]
    assert len(set(phases)) == 4 and all(abs(a - b) >= 512 for a in phases for b in phases if a != b)
    assert all((t.data_ptr() - fa.flat.data_ptr()) % 64 == 0 for t in (fa.exp_avg, fa.exp_avg_sq, snap))
    assert torch.equal(fa.exp_avg, torch.zeros_like(fa.exp_avg))
    for phase in (0, 64, 1088, 4032):
        assert phased_floats(1000, phase).data_ptr() % PAGE == phase
        assert pooled_floats(300_000, phase=phase).data_ptr() % PAGE == phase
    assert pooled_floats(300_000).data_ptr() % 64 == 0
    c._apply_gradient(rec, message(c.params, grads_of(c.params, 1), fuse=False, msg_id=1, version=0))
    assert all(torch.equal(c.params[n], t) for n, t in named(c, c.downlink.fine._snapshot[1]).items())


def test_a_remembered_gradient_header_is_unpacked_as_the_full_checks_unpack_it() -> None:
    """The coordinator remembers the last header of plain entries and unpacks the next one
    with the same header without checking each entry again: the result is the full path's,
    and anything that differs (a header, a tensor's dtype or size under the same header, the
    subset rule) takes the full path, which refuses it as before."""
    from swarmtrain.roles.ps.common import KnownHeader, unpack_compressed, unpack_lazy

    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    codec = make_codec("fp16")
    g = {n: torch.randn(p.shape) for n, p in params.items()}
    codecs, tensors = pack_compressed({n: codec.compress(t) for n, t in g.items()})
    known = KnownHeader()
    first = unpack_lazy(codecs, tensors, params, known=known)
    assert known.plan and known.codecs is codecs
    assert known.unpack(codecs, tensors, params, False, True) is not None  # (the short path)
    again = unpack_lazy(dict(codecs), dict(tensors), params, known=known)
    for n in params:
        assert again[n].dtype == torch.float16 and again[n].shape == params[n].shape
        assert torch.equal(again[n], first[n]) and torch.equal(again[n].float(), g[n].half().float())
    # eager unpacking is a different question: fp16 decodes to float32 through the full path
    eager = unpack_compressed(codecs, tensors, params, known=known)
    assert all(t.dtype == torch.float32 for t in eager.values())
    # the same header over a tensor of another size or dtype: refused by the full path
    for bad in (torch.zeros(11, dtype=torch.float16), torch.zeros(12, dtype=torch.float32)):
        unpack_lazy(codecs, tensors, params, known=known)
        with pytest.raises(RemoteProtocolError):
            unpack_lazy(codecs, {**tensors, "a/values": bad}, params, known=known)
    # a header naming one tensor: fine as a subset, refused as the whole model
    part = {"a": codecs["a"]}
    unpack_lazy(part, {"a/values": tensors["a/values"]}, params, subset=True, known=known)
    with pytest.raises(RemoteProtocolError, match="missing"):
        unpack_lazy(part, {"a/values": tensors["a/values"]}, params, known=known)


def test_a_remembered_top_k_header_checks_each_payloads_counts_and_indices() -> None:
    """Top-k entries read lazily are remembered too: the next gradient with the same header
    gives the same parts as the full path, and a payload whose counts do not add up or whose
    index is out of range under that header is refused as before, naming why."""
    from swarmtrain.compression.topk import TopKParts
    from swarmtrain.roles.ps.common import KnownHeader, unpack_lazy

    params = {"a": torch.zeros(300, 7), "b": torch.zeros(70_000), "c": torch.zeros(5)}
    codecs, tensors = pack_compressed({n: make_codec("topk", topk_ratio=0.1).compress(torch.randn(p.shape))
                                       for n, p in params.items()})
    known = KnownHeader()
    first = unpack_lazy(codecs, tensors, params, known=known)
    assert known.plan and all(isinstance(g, TopKParts) for g in first.values())
    assert known.unpack(codecs, tensors, params, False, True) is not None  # (the short path)
    again = unpack_lazy(dict(codecs), dict(tensors), params, known=known)
    for n in params:
        assert torch.equal(again[n].decode(), first[n].decode()) and again[n].shape == tuple(params[n].shape)
    counts = tensors["b/block_counts"].clone()
    counts[0] += 1
    counts[1] -= 1
    assert int(counts.sum()) == int(tensors["b/block_counts"].sum())  # (sums to k: not caught that way)
    counts[1] = -1
    with pytest.raises(RemoteProtocolError, match="block counts"):
        unpack_lazy(codecs, {**tensors, "b/block_counts": counts}, params, known=known)
    low = tensors["b/index_low"].clone()
    low[-1] = 70_000 - 65_536  # the last block holds 70,000 - 65,536 elements: one past its end
    with pytest.raises(RemoteProtocolError, match="index out of range"):
        unpack_lazy(codecs, {**tensors, "b/index_low": low}, params, known=known)
    assert unpack_lazy(codecs, tensors, params, known=known).keys() == params.keys()  # (still fine)


def test_copies_of_the_weights_held_by_unsent_answers_are_bounded_whatever_the_workers() -> None:
    """Eight workers each with an answer not yet sent (slow links): a lossless downlink's
    answers are copies of the weights, one per version, so once the coordinator held one per
    worker. At most MAX_HELD_SNAPSHOTS are held: past it an answer shares the newest copy, or,
    to a worker that holds that one, waits until a copy may be made (it was told "no change"
    at once until now); each answer is exactly its version's weights, and a replica takes a
    shared copy as any other. Once the answers go out, the waiting ones get the weights of
    the version then; one that waited past its bound is told "no change" after all."""
    from swarmtrain.roles.ps.coordinator import MAX_HELD_SNAPSHOTS

    c, first = _big_coordinator(**{"training.max_staleness": 1000})
    recs = [first] + [record(c, f"w{i}") for i in range(1, 8)]
    assert MAX_HELD_SNAPSHOTS < len(recs)  # (the answers held outnumber it)
    weights = {c.version: {n: p.clone() for n, p in c.params.items()}}
    held: list[Update] = []
    kinds = {"new": 0, "shared": 0, "waits": 0}
    waiting: dict[str, int] = {}  # worker -> the msg_id its answer waits on
    pool = c._snapshot_pool
    for i in range(24):
        rec = recs[i % len(recs)]
        if rec.worker_id in waiting:  # (its answer has not come: it sends nothing meanwhile)
            continue
        before = rec.holds_version
        status, reply = c._apply_gradient(rec, message(c.params, grads_of(c.params, i), fuse=False,
                                                       msg_id=i + 1, version=before))
        assert status == "applied"
        weights[c.version] = {n: p.clone() for n, p in c.params.items()}
        assert pool.in_use() <= MAX_HELD_SNAPSHOTS, i
        if reply is None:
            assert rec.waits_for is not None and rec.holds_version == before
            waiting[rec.worker_id] = i + 1
            kinds["waits"] += 1
            continue
        assert reply.full and before < reply.version == rec.holds_version
        assert all(torch.equal(named(c, reply.tensors)[n], weights[reply.version][n]) for n in c.params)
        kinds["new" if reply.version == c.version else "shared"] += 1
        held.append(reply)
    assert kinds["new"] >= MAX_HELD_SNAPSHOTS - 1 and kinds["shared"] and kinds["waits"] >= 2, kinds
    snap = c.status()["snapshots"]
    size_mb = 4 * sum(p.numel() for p in c.params.values()) / 2**20
    assert snap["held"] == MAX_HELD_SNAPSHOTS and snap["held_mb"] < MAX_HELD_SNAPSHOTS * size_mb + 1
    answers = c.status()["downlink"]["answers"]  # (counted as what went, not as what was due)
    assert answers["withheld"] == 0 and answers["full"] == kinds["new"] + kinds["shared"]
    replica = Replica(ModelState(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])),
                      torch.device("cpu"))
    for reply in held:  # a shared copy loads as any other
        got = through_the_wire(reply)
        assert isinstance(got, Update)
        replica.apply_update(got)
    (late_id, late_msg), *others = waiting.items()
    late = c.workers[late_id]
    at = late.holds_version
    assert c._answer_deferred(late, late_msg, UpdateStatus.APPLIED, False) is None  # (still no room)
    unchanged = c._answer_deferred(late, late_msg, UpdateStatus.APPLIED, True)  # past its bound
    assert unchanged is not None and not unchanged.full and not unchanged.deltas
    assert unchanged.version == at == late.holds_version and late.waits_for is None
    assert c.status()["snapshots"]["withheld"] == 1
    held.clear()
    del reply, got
    for wid, msg_id in others:  # the copies went: the waiting answers come, this version's weights
        reply = c._answer_deferred(c.workers[wid], msg_id, UpdateStatus.APPLIED, False)
        assert reply is not None and reply.full and reply.version == c.version == c.workers[wid].holds_version
        assert all(torch.equal(named(c, reply.tensors)[n], c.params[n]) for n in c.params)
        assert pool.in_use() <= MAX_HELD_SNAPSHOTS


def test_welcomes_to_a_burst_of_joining_workers_hold_no_more_copies_than_answers_may() -> None:
    """Workers joining while training runs each get the full weights (the welcome); a welcome
    not yet sent (a slow link) holds its copy. They took a new copy each, outside the bound on
    copies that answers keep to (bench_scale: RSS after 64 joins 974 MB against 737 at 4, HWM
    1,088 MB); past MAX_HELD_SNAPSHOTS a welcome now shares the newest copy. A joining worker
    holds nothing, so any version's weights will do: each welcome is exactly its version's."""
    from swarmtrain.roles.ps.coordinator import MAX_HELD_SNAPSHOTS, WorkerRecord

    c, trainer = _big_coordinator(**{"training.max_staleness": 1000})
    weights = {c.version: {n: p.clone() for n, p in c.params.items()}}
    welcomes = []
    pool = c._snapshot_pool
    for i in range(3 * MAX_HELD_SNAPSHOTS):
        status, _ = c._apply_gradient(trainer, message(c.params, grads_of(c.params, i), fuse=False,
                                                       msg_id=i + 1, version=trainer.holds_version))
        assert status == "applied"
        weights[c.version] = {n: p.clone() for n, p in c.params.items()}
        joiner = WorkerRecord(f"join{i}", "test", {}, 32, 0.0, [0])  # (as record() makes one)
        c.workers[joiner.worker_id] = joiner
        welcomes.append(c._snapshot_for(joiner, everything=True))  # (as _welcome takes them)
        assert pool.in_use() <= MAX_HELD_SNAPSHOTS, i
    assert len({w.version for w in welcomes}) >= MAX_HELD_SNAPSHOTS - 1  # (new copies while room)
    for w in welcomes:
        assert all(torch.equal(named(c, w.tensors)[n], weights[w.version][n]) for n in c.params)
        assert c.workers[f"join{welcomes.index(w)}"].holds_version == w.version


def test_a_worker_waiting_for_another_tracks_weights_stays_on_the_track_its_replica_is_from() -> None:
    """A worker far behind is moved to a coarser track with that track's full weights (its
    published copy differs from the finest track's by what each coded). When no copy may be
    made (MAX_HELD_SNAPSHOTS held) and no chain of its own track reaches it, its answer waits,
    and meanwhile it stays on the track its replica is from: a chain of the other track's
    entries would be added to weights they were not coded against. Once a copy may be made it
    moves, with the weights of that track as they are then."""
    from swarmtrain.roles.ps.coordinator import MAX_HELD_SNAPSHOTS

    c, rec = _big_coordinator(**{"training.max_staleness": 1000, "compression.downlink": "fp16"})
    other = record(c, "other")
    for i in range(40):  # rec now lags 40 versions: its answer comes from the 16-version track
        c._apply_gradient(other, message(c.params, grads_of(c.params, i), fuse=False, msg_id=i + 1,
                                         version=other.holds_version))
    pool = c._snapshot_pool
    held = [pool.take(4 * sum(c._sizes)) for _ in range(MAX_HELD_SNAPSHOTS - pool.in_use())]
    assert pool.in_use() == MAX_HELD_SNAPSHOTS
    status, reply = c._apply_gradient(rec, message(c.params, grads_of(c.params, 50), fuse=False,
                                                   msg_id=1, version=rec.holds_version))
    assert status == "applied" and reply is None and rec.waits_for == 2
    assert rec.track == 0 and rec.holds_version == 0  # still where its replica is from
    assert c.downlink.switches == 0 and c.downlink.instead_of_weights == 0  # (no chain reaches it)
    coarse = c.downlink.tracks[2]  # (published for the answer that waits)
    assert coarse.head == c.version and coarse.published is not None
    head, at_head = coarse.head, coarse.published.clone()
    assert c._answer_deferred(rec, 1, UpdateStatus.APPLIED, False) is None and rec.track == 0
    held.clear()
    reply = c._answer_deferred(rec, 1, UpdateStatus.APPLIED, False)
    assert reply is not None and reply.full and rec.track == 2  # moved, with that track's weights
    assert c.downlink.switches == 1 and c.status()["downlink"]["answers"]["full"] == 1
    assert reply.version == head == rec.holds_version and rec.waits_for is None
    assert torch.equal(reply.tensors[FUSED], at_head)


def test_a_half_precision_models_copies_come_from_the_pool_and_are_bounded_too() -> None:
    """A bfloat16 model's copies of the weights (its masters are float32; a worker holds them
    rounded to bfloat16) are made in the snapshot pool like a float32 model's, rounded as
    ``.to()`` rounds, so the bound on held copies covers them: until now each was a clone per
    tensor, outside the pool and outside the bound."""
    from swarmtrain.roles.ps.coordinator import MAX_HELD_SNAPSHOTS

    c, first = _big_coordinator(torch.bfloat16, **{"training.max_staleness": 1000})
    recs = [first] + [record(c, f"w{i}") for i in range(1, 8)]
    pool = c._snapshot_pool
    assert pool.in_use() == 1  # the registrations' copy, shared
    held = []
    for i in range(16):
        rec = recs[i % len(recs)]
        if rec.waits_for is not None:  # (its answer waits for a copy: it sends nothing meanwhile)
            continue
        status, reply = c._apply_gradient(rec, message(c.params, grads_of(c.params, i), fuse=False,
                                                       msg_id=i + 1, version=rec.holds_version))
        assert status == "applied"
        assert pool.in_use() <= MAX_HELD_SNAPSHOTS, i
        if reply is None:
            continue
        if reply.full and reply.version == c.version:  # a copy made now: this version's, rounded
            for name, p in c.params.items():
                t = reply.tensors[name]
                assert t.dtype == torch.bfloat16 and torch.equal(t, p.to(torch.bfloat16)), name
        held.append(reply)
    assert c.status()["snapshots"]["held"] == MAX_HELD_SNAPSHOTS


def _fp16_message(params: dict[str, torch.Tensor], g: dict[str, torch.Tensor], *, fuse: bool, msg_id: int,
                  version: int) -> Gradients:
    codec = make_codec("fp16")
    flat = fuse_gradients(g, params) if fuse else None
    items = ({FUSED: codec.compress(flat)} if flat is not None
             else {n: codec.compress(t) for n, t in g.items()})
    codecs, tensors = pack_compressed(items)
    msg = through_the_wire(Gradients(msg_id=msg_id, version=version, samples=32, loss=1.0,
                                     codecs=codecs, tensors=tensors))
    assert isinstance(msg, Gradients)
    return msg


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_large_models_fused_gradient_steps_the_fused_adam_exactly_as_the_per_tensor_one(codec: str) -> None:
    """Dense gradients travel as one entry whatever the model's size; the coordinator's fused
    Adam reads that vector in one piece (no view per parameter) and moves every weight and
    moment exactly as it does for one entry per tensor, the fp16 values read as they came."""
    a, ra = _big_coordinator(**{"compression.type": codec})
    b, rb = _big_coordinator(**{"compression.type": codec})
    make = message if codec == "none" else _fp16_message
    for i in range(1, 5):
        g = grads_of(a.params, i)
        fused = make(a.params, g, fuse=True, msg_id=i, version=a.version)
        plain = make(b.params, g, fuse=False, msg_id=i, version=b.version)
        assert list(fused.codecs) == [FUSED] and len(plain.codecs) == len(b.params)
        assert a._apply_gradient(ra, fused)[0] == b._apply_gradient(rb, plain)[0] == "applied"
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
        sa, sb = a.optimizer.state[a.params[name]], b.optimizer.state[b.params[name]]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    assert a.version == b.version == 4


def test_the_fused_adam_is_given_a_fused_gradient_whole_and_a_short_one_is_refused() -> None:
    from swarmtrain.roles.ps.common import unpack_lazy

    c, rec = _big_coordinator(**{"compression.type": "fp16"})
    g = grads_of(c.params, 1)
    msg = _fp16_message(c.params, g, fuse=True, msg_id=1, version=0)
    got = unpack_lazy(msg.codecs, msg.tensors, c.params, subset=True, whole=True)
    assert list(got) == [FUSED]
    values = got[FUSED]
    assert isinstance(values, torch.Tensor) and values.dtype == torch.float16 and values.dim() == 1
    assert values.data_ptr() == msg.tensors[f"{FUSED}/values"].data_ptr()  # as it came, not copied
    # without whole (a window, torch's Adam): one float32 view per parameter, as before
    views = unpack_lazy(msg.codecs, msg.tensors, c.params, subset=True)
    assert list(views) == list(c.params) and all(v.dtype == torch.float32 for v in views.values())
    before = {n: p.detach().clone() for n, p in c.params.items()}
    codec = make_codec("fp16")
    total = sum(p.numel() for p in c.params.values())
    codecs, tensors = pack_compressed({FUSED: codec.compress(torch.zeros(total - 8))})
    short = through_the_wire(Gradients(msg_id=2, version=0, samples=32, loss=1.0, codecs=codecs,
                                       tensors=tensors))
    assert isinstance(short, Gradients)
    assert c._apply_gradient(rec, short)[0] == "rejected" and c.version == 0
    assert all(torch.equal(before[n], p) for n, p in c.params.items())


@pytest.mark.parametrize("codec", ["none", "fp16", "topk"])
def test_a_worker_sends_a_dense_gradient_as_one_entry_and_a_topk_one_per_tensor(codec: str) -> None:
    from tests.test_ps_inprocess import worker

    w = worker(1, **{"compression.type": codec})
    w._use_shards([0], 1)
    items = w._compute()[0]
    if codec == "topk":
        assert list(items) == list(w.params)
        return
    assert list(items) == [FUSED] and items[FUSED].codec == codec
    assert items[FUSED].shape == (sum(p.numel() for p in w.params.values()),)
    if codec == "fp16":  # what the float16 rounding dropped is kept for the next gradient
        assert w.feedback is not None and w.feedback.residual_norm() > 0.0


@pytest.mark.parametrize("codec", ["fp16", "topk"])
def test_a_remembered_header_is_used_again_by_a_coordinator_asking_for_whole_gradients(codec: str) -> None:
    """The coordinator unpacks with ``whole`` (its fused Adam takes a fused gradient in one
    piece): the header it remembered must be the one it asks again with, for one fused entry
    and for per-tensor top-k entries alike (else every gradient takes the full checks)."""
    from swarmtrain.roles.ps.common import KnownHeader, unpack_lazy

    c, _ = _big_coordinator(**{"compression.type": codec})
    g = grads_of(c.params, 1)
    if codec == "fp16":
        msg = _fp16_message(c.params, g, fuse=True, msg_id=1, version=0)
    else:
        items = {n: make_codec("topk", topk_ratio=0.1).compress(t) for n, t in g.items()}
        codecs, tensors = pack_compressed(items)
        got = through_the_wire(Gradients(msg_id=1, version=0, samples=32, loss=1.0, codecs=codecs,
                                         tensors=tensors))
        assert isinstance(got, Gradients)
        msg = got
    known = KnownHeader()
    first = unpack_lazy(msg.codecs, msg.tensors, c.params, subset=True, known=known, whole=True)
    again = known.unpack(msg.codecs, msg.tensors, c.params, True, True, True)
    assert again is not None and list(again) == list(first)
    assert known.unpack(msg.codecs, msg.tensors, c.params, True, True, False) is None  # (views wanted)
