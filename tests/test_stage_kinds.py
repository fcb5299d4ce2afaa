"""The pipeline stage's enums (pure, no network): the refusal codes and the outbound pressure
levels travel as exactly the bytes of the plain strings they replaced, and come back equal to
their members; a stage job names its kind, and only the stage's own jobs carry a future."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json

import pytest
import torch

from swarmtrain.roles.stage import OfferResult, OutboundBuffer, PressureLevel, Priority
from swarmtrain.roles.stage.codes import RETRYABLE, SENDERS_FAULT, StageErrorCode
from swarmtrain.roles.stage.stage import _INTERNAL_KINDS, JobKind, _Job
from swarmtrain.wire import StageError, Status
from swarmtrain.wire.frame import Decoder, encode_bytes

pytestmark = pytest.mark.timeout(60)

#: the codes as the stage sent them before they were an enum (what clients already read)
_CODES_ON_THE_WIRE = ("overloaded", "closing", "bad_input", "unexpected", "unknown_microbatch",
                      "cache_miss", "internal")


def _decode_byte_by_byte(data: bytes) -> object:
    dec = Decoder()
    for i in range(len(data)):
        dec.feed(data[i:i + 1])
    msg = dec.next_message()
    assert msg is not None and dec.next_message() is None
    return msg


def test_every_stage_error_code_travels_as_its_plain_string_and_comes_back_as_itself() -> None:
    assert sorted(c.value for c in StageErrorCode) == sorted(_CODES_ON_THE_WIRE)
    for code in StageErrorCode:
        frame = encode_bytes(StageError(req=7, code=code, message="why"))
        assert frame == encode_bytes(StageError(req=7, code=code.value, message="why"))
        msg = _decode_byte_by_byte(frame)
        assert isinstance(msg, StageError) and type(msg.code) is str
        assert msg.code == code and StageErrorCode(msg.code) is code
    # the sets the router and the stage decide with hold the strings a decoded answer carries
    assert {"overloaded", "closing"} == RETRYABLE and "bad_input" in SENDERS_FAULT
    assert "internal" not in SENDERS_FAULT and "unknown_microbatch" not in SENDERS_FAULT


def test_outbound_pressure_in_a_status_is_the_plain_string_in_json_and_on_the_wire() -> None:
    out = OutboundBuffer(lambda packet: None, capacity=10)  # type: ignore[arg-type, return-value]
    metrics = dataclasses.asdict(out.metrics())
    assert metrics["pressure"] is PressureLevel.OK
    plain = {**metrics, "pressure": "ok"}
    assert json.dumps(metrics) == json.dumps(plain)
    frame = encode_bytes(Status(status={"outbound": metrics}))
    assert frame == encode_bytes(Status(status={"outbound": plain}))
    back = _decode_byte_by_byte(frame)
    assert isinstance(back, Status) and PressureLevel(back.status["outbound"]["pressure"]) is PressureLevel.OK
    # every pressure level is also an offer's answer, by the same value
    assert {p.value for p in PressureLevel} | {"refused"} == {r.value for r in OfferResult}


def _job(kind: JobKind, result: concurrent.futures.Future[object] | None = None) -> _Job:
    return _Job(Priority.GRADIENT_SYNC, "sync", 0, torch.zeros(()), "me", 0, "forward", kind=kind,
                result=result)


def test_a_stage_job_names_its_kind_and_only_the_stages_own_jobs_carry_a_future() -> None:
    with pytest.raises(TypeError, match="kind"):
        _Job(Priority.GRADIENT_SYNC, "sync", 0, torch.zeros(()), "me", 0, "forward")  # type: ignore[call-arg]
    for kind in JobKind:
        if kind in _INTERNAL_KINDS:
            assert _job(kind, concurrent.futures.Future()).kind is kind
            with pytest.raises(TypeError, match="result future: give it one"):
                _job(kind)
        else:
            assert _job(kind).kind is kind
            with pytest.raises(TypeError, match="takes no result future"):
                _job(kind, concurrent.futures.Future())
    # the replica rounds name their jobs by value
    assert JobKind("snapshot") is JobKind.SNAPSHOT and JobKind("sync_apply") is JobKind.SYNC_APPLY
    with pytest.raises(ValueError, match="snapshots"):
        JobKind("snapshots")
