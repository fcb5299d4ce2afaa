"""A small model's messages carry their tensors fused (swarmtrain/roles/ps/common.py,
``fuse_gradients``): an uncompressed gradient as one entry, full weights as one tensor. The fused
forms must change nothing but the framing: the coordinator applies a fused gradient exactly
as the per-tensor one, screens it the same (NaN, wrong size), the worker's replica loads
fused weights exactly, and what is not eligible stays per tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import ProtocolError, RemoteProtocolError
from swarmtrain.roles.ps.common import FUSE_MAX_NUMEL, FUSED, fuse_gradients, fused_views, pack_compressed
from swarmtrain.roles.ps.replica import Replica
from swarmtrain.wire import Decoder, Gradients, Message, Update, encode_bytes
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
    items = fuse_gradients(g, c_params) if fuse else {n: codec.compress(t) for n, t in g.items()}
    assert items is not None
    codecs, tensors = pack_compressed(items)
    msg = through_the_wire(Gradients(msg_id=msg_id, version=version, samples=32, loss=1.0,
                                     codecs=codecs, tensors=tensors))
    assert isinstance(msg, Gradients)
    return msg


def test_only_a_whole_small_float32_gradient_is_fused() -> None:
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    whole = {n: torch.ones_like(p) for n, p in params.items()}
    fused = fuse_gradients(whole, params)
    assert fused is not None and list(fused) == [FUSED] and fused[FUSED].shape == (17,)
    assert fused[FUSED].codec == "none" and torch.equal(fused[FUSED].parts["values"], torch.ones(17))
    # a parameter without a gradient, another order, another dtype, too many elements: not fused
    assert fuse_gradients({"a": whole["a"]}, params) is None
    assert fuse_gradients({"b": whole["b"], "a": whole["a"]}, params) is None
    assert fuse_gradients({n: g.to(torch.bfloat16) for n, g in whole.items()}, params) is None
    big = {"a": torch.zeros(FUSE_MAX_NUMEL), "b": torch.zeros(1)}
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


def test_a_large_models_snapshot_is_not_one_fresh_allocation_per_update() -> None:
    """Only a small model's snapshot is one buffer. A model above glibc's mmap threshold (32 MB
    once swarmtrain tunes the allocator) would get fresh pages for it on every update: ~9,800
    page faults, and the 10M-parameter apply (bench_apply.py) took 37 ms instead of 15. Its
    snapshot stays a tensor per parameter, which the allocator reuses."""
    import resource

    from swarmtrain.config import load_coordinator_config
    from swarmtrain.core import hardware
    from swarmtrain.roles.ps.coordinator import Coordinator

    hardware.tune_allocator()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(34)])  # (1 MB tensors)
    assert sum(p.numel() for p in model.parameters()) * 4 > 32 * 2**20
    cfg = load_coordinator_config(overrides={"network.host": "127.0.0.1", "network.port": 0,
                                             "checkpointing.interval": 0, "training.learning_rate": 1e-3})
    c = Coordinator(model, cfg, task_name="big")
    rec = record(c)
    grads = grads_of(c.params, 1)
    msgs = [message(c.params, grads, fuse=False, msg_id=i + 1, version=i) for i in range(12)]
    faults = []
    for m in msgs:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c._apply_gradient(rec, m)
        c._full_update(rec, c.version, "applied")  # type: ignore[arg-type]
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    pages = sum(p.numel() for p in c.params.values()) * 4 // 4096
    later = sorted(faults[2:])  # (the first snapshots take new memory either way)
    assert later[len(later) // 2] < pages // 10, (faults, pages)
