"""The half downlink (``compression.downlink = "half"``, what ``auto`` picks for an fp16 uplink):
every answer that changes anything is the weights themselves rounded to float16, shared by all
the answers of a version, with no published copy and no log on the coordinator. A worker holds
exactly those rounded weights; a version whose rounding would leave the weights further from the
master than ``max_drift`` (a weight beyond float16's range) goes out in float32 instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmtrain.compression import make_codec
from swarmtrain.config import load_coordinator_config
from swarmtrain.core.modelstate import ModelState
from swarmtrain.roles.ps.common import FUSED, downlink_kind, fused_views, pack_compressed
from swarmtrain.roles.ps.coordinator import Coordinator, WorkerRecord
from swarmtrain.roles.ps.replica import Replica
from swarmtrain.wire import Gradients, Update
from tests.test_coordinator_state import make_coordinator, record
from tests.test_fused import _big_coordinator, _fp16_message, grads_of, through_the_wire
from tests.test_ps_inprocess import TASK

pytestmark = pytest.mark.timeout(60)


def fp16_gradient(c: Coordinator, seed: int, msg_id: int, version: int) -> Gradients:
    """A worker's fp16 gradient: one fused entry, through the wire."""
    return _fp16_message(c.params, grads_of(c.params, seed), fuse=True, msg_id=msg_id, version=version)


def coordinator(size: str) -> tuple[Coordinator, WorkerRecord]:
    """An fp16 coordinator and a registered worker: the digits model (its snapshots are new
    memory) or a larger one (pooled)."""
    if size == "big":
        return _big_coordinator(**{"compression.type": "fp16"})
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0, "compression.type": "fp16"})
    return c, record(c)


def test_auto_picks_half_for_an_fp16_uplink_and_an_explicit_fp16_downlink_stays_deltas() -> None:
    cfg = load_coordinator_config(overrides={"compression.type": "fp16"})
    assert downlink_kind(cfg.compression) == "half"
    for uplink, kind in (("none", "none"), ("topk", "uniform"), ("qsgd", "uniform")):
        other = load_coordinator_config(overrides={"compression.type": uplink})
        assert downlink_kind(other.compression) == kind
    c = make_coordinator(Path("/nonexistent"), **{"checkpointing.interval": 0, "compression.type": "fp16",
                                                   "compression.downlink": "fp16"})
    rec = record(c)
    c._apply_gradient(rec, fp16_gradient(c, 1, 1, 0))
    assert not c.downlink.fine.rounded and c.downlink.fine.published is not None


@pytest.mark.parametrize("size", ["small", "big"])
def test_every_answer_is_the_master_rounded_to_half_and_the_worker_holds_it(size: str) -> None:
    """Small model (the step's snapshot is new memory) and large (pooled): the answer to each
    gradient is one float16 tensor, the master rounded; no published copy or log is kept; the
    drift is what rounding left out; a worker's replica loads exactly the rounded weights."""
    c, rec = coordinator(size)
    replica = Replica(ModelState(TASK.build_model(seed=9) if size == "small" else
                                 torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])),
                      torch.device("cpu"))
    for i in range(1, 5):
        status, reply = c._apply_gradient(rec, fp16_gradient(c, i, i, c.version))
        assert status == "applied" and reply is not None and reply.full and reply.version == c.version
        assert list(reply.tensors) == [FUSED] and reply.tensors[FUSED].dtype == torch.float16
        master = torch.cat([p.reshape(-1) for p in c.params.values()])
        assert torch.equal(reply.tensors[FUSED], master.to(torch.float16))
        got = through_the_wire(reply)
        assert isinstance(got, Update)
        replica.apply_update(got)
        for name, p in replica.params.items():
            assert torch.equal(p.detach(), c.params[name].to(torch.float16).float()), name
    fine = c.downlink.fine
    assert fine.rounded and fine.published is None and not fine.entries
    assert 0.0 < fine.drift < 2.0 ** -11
    assert c.status()["downlink"]["codec"] == "half"


@pytest.mark.parametrize("size", ["small", "big"])
def test_weights_beyond_half_range_go_out_in_float32(size: str) -> None:
    """A weight float16 cannot hold (saturated, the drift far over the bound) sends that
    version's weights in float32, exactly, from the step's snapshot and from a copy made for
    a joining worker alike; the rounded answers resume once the weights fit again."""
    c, rec = coordinator(size)
    first = next(iter(c.params.values()))
    with torch.no_grad():
        first.view(-1)[0] = 1e6
    status, reply = c._apply_gradient(rec, fp16_gradient(c, 1, 1, 0))
    assert status == "applied" and reply is not None and reply.full
    assert reply.tensors[FUSED].dtype == torch.float32
    assert torch.equal(reply.tensors[FUSED], torch.cat([p.reshape(-1) for p in c.params.values()]))
    joiner = WorkerRecord("join", "test", {}, 32, 0.0, [0])
    c.workers["join"] = joiner
    welcome = c._snapshot_for(joiner)
    assert welcome.tensors[FUSED].dtype == torch.float32
    views = fused_views(welcome.tensors[FUSED], c.params)
    assert float(views[next(iter(c.params))].reshape(-1)[0]) == pytest.approx(1e6, rel=1e-3)
    with torch.no_grad():
        first.view(-1)[0] = 0.5
    status, reply = c._apply_gradient(rec, fp16_gradient(c, 2, 2, c.version))
    assert reply is not None and reply.tensors[FUSED].dtype == torch.float16


def test_a_half_precision_model_gets_its_weights_in_its_own_dtype() -> None:
    """A bfloat16 model's workers hold bfloat16 weights: the half downlink sends those (each
    parameter in its dtype, as a lossless downlink does), not a second rounding to float16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    cfg = load_coordinator_config(overrides={"network.host": "127.0.0.1", "network.port": 0,
                                             "checkpointing.interval": 0, "compression.type": "fp16",
                                             "training.learning_rate": 1e-3})
    c = Coordinator(model, cfg, task_name="bf16")
    rec = record(c)
    gen = torch.Generator().manual_seed(1)
    codec = make_codec("fp16")
    items = {n: codec.compress(torch.randn(p.shape, generator=gen) * 0.01) for n, p in c.params.items()}
    codecs, tensors = pack_compressed(items)
    msg = through_the_wire(Gradients(msg_id=1, version=0, samples=32, loss=1.0, codecs=codecs,
                                     tensors=tensors))
    assert isinstance(msg, Gradients)
    status, reply = c._apply_gradient(rec, msg)
    assert status == "applied" and reply is not None and reply.full
    for name, p in c.params.items():
        assert reply.tensors[name].dtype == torch.bfloat16
        assert torch.equal(reply.tensors[name], p.to(torch.bfloat16)), name
