"""A stage server's hardening (issue 8, as on the coordinator): per-role frame limits, counted
refusals with a disconnect of the repeat offender, non-finite inputs refused, and the
`swarmtrain stage` limit flags. Real stage servers on loopback (port 0), real clients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import swarmtrain.roles.stage.stage as stage_module
from swarmtrain.app.cli import build_parser, config_overrides
from swarmtrain.config import load_stage_config
from swarmtrain.errors import ConnectionLost
from swarmtrain.roles.stage import (
    BadInput,
    ComputeConfig,
    StageCompute,
    StageServer,
    StageServerConfig,
)
from swarmtrain.testing.fuzz_engine import SECRET as FUZZ_SECRET
from swarmtrain.testing.fuzz_engine import send_input
from swarmtrain.testing.fuzz_inputs import FuzzInput
from swarmtrain.transport import Connection, connect
from swarmtrain.wire import (
    PREAMBLE,
    Error,
    Heartbeat,
    Message,
    StageBackward,
    StageError,
    StageForward,
    StageGrad,
    StageInfer,
    StageResult,
    StageSync,
    encode_bytes,
)
from swarmtrain.wire.frame import PROTOCOL_VERSION
from tests.test_pipeline_core import FAST, SECRET, _raw_exchange, _run, _server
from tests.test_transport import eventually

pytestmark = pytest.mark.timeout(90)

TOKENS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
HIDDEN = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))  # a middle stage's input


async def _ask(conn: Connection, msg: Message) -> Message:
    await conn.send(msg)
    return await conn.recv(timeout=10)


def _same_parameters(before: dict[str, torch.Tensor], server: StageServer) -> bool:
    after = server.compute.parameters_snapshot()
    return all(torch.equal(before[n], t) for n, t in after.items())


def test_an_oversize_pipeline_frame_closes_only_that_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        s = _server(0, 2, 0)
        await s.start()
        try:
            good = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            # 257 MiB announced in the preamble: refused before anything is allocated
            answer = await _raw_exchange(s.port, PREAMBLE.pack(b"SWRM", PROTOCOL_VERSION,
                                                               int(StageForward.TYPE), 0, 10, 257 << 20))
            assert isinstance(answer, Error) and answer.code == "oversize_payload", answer
            assert str(256 << 20) in answer.message
            await eventually(lambda: "--max-request-mb, now 256" in caplog.text, what="the stage's hint")
            # five tensors: a request carries at most an activation and targets
            five = StageForward(req=1, session="x", microbatch=0,
                                tensors={k: TOKENS for k in ("x", "targets", "a", "b", "c")})
            answer = await _raw_exchange(s.port, encode_bytes(five))
            assert isinstance(answer, Error) and answer.code == "too_many_tensors", answer
            res = await _ask(good, StageForward(req=2, session="ok", microbatch=0, tensors={"x": TOKENS}))
            assert isinstance(res, StageResult) and res.tensors["y"].shape == (2, 8, 32)
            await good.close()
        finally:
            await s.close()

    _run(main())


def test_a_smaller_max_request_mb_is_the_pipeline_limit() -> None:
    async def main() -> None:
        s = _server(0, 2, 0, max_request_mb=0.5)
        await s.start()
        try:
            assert s.role_limits()["pipeline"].max_payload_bytes == 1 << 19
            conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            big = torch.zeros(1, 1 << 17, dtype=torch.long)  # 1 MiB of token ids
            answer = await _ask(conn, StageInfer(req=1, session="x", tensors={"x": big}))
            assert isinstance(answer, Error) and answer.code == "oversize_payload", answer
            await conn.close()
        finally:
            await s.close()

    _run(main())


def test_an_oversize_stage_sync_closes_only_that_connection_and_replicas_still_sync() -> None:
    async def main() -> None:
        s = _server(2, 4, 1, name="b")
        await s.start()
        a = _server(2, 4, 1, name="a", sync_peers=[s.address])
        await a.start()
        try:
            params = s.compute.parameters_snapshot()
            param_bytes = sum(t.numel() * t.element_size() for t in params.values())
            limits = s.role_limits()["stage"]
            assert limits.max_payload_bytes == 2 * param_bytes + (1 << 20)
            assert limits.max_tensors == len(params) + 8
            too_big = {**params, "extra": torch.zeros((2 * param_bytes + (2 << 20)) // 4)}
            too_many = {**params, **{f"extra{i}": torch.zeros(1) for i in range(9)}}
            for tensors, code in ((too_big, "oversize_payload"), (too_many, "too_many_tensors")):
                rogue = await connect("127.0.0.1", s.port, secret=SECRET, role="stage", timeouts=FAST)
                answer = await _ask(rogue, StageSync(req=1, round=0, step=0, tensors=tensors))
                assert isinstance(answer, Error) and answer.code == code, answer
                with pytest.raises(ConnectionLost):
                    await rogue.recv(timeout=10)
            assert _same_parameters(params, s)
            # a real replica's sync (every parameter, its real names) fits the limits
            assert await a.sync_now() == 1 and s.sync_served == 1
        finally:
            await a.close()
            await s.close()

    _run(main())


def test_a_sender_refused_five_times_in_a_row_is_disconnected_while_others_are_served() -> None:
    async def main() -> None:
        s = _server(2, 4, 1)
        await s.start()
        try:
            before = s.compute.parameters_snapshot()
            bad = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            good = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            nan = torch.full_like(HIDDEN, math.nan)
            refusals = [  # from the event loop, the training thread and the inference thread
                (StageForward(req=1, session="b", microbatch=0, tensors={"y": HIDDEN}), "bad_input"),
                (StageForward(req=2, session="b", microbatch=1, tensors={"x": nan}), "bad_input"),
                (StageSync(req=3, round=0, step=0, tensors={"w": HIDDEN}), "unexpected"),
                (StageInfer(req=4, session="b", tensors={"x": HIDDEN * math.inf}), "bad_input"),
            ]
            for i, (msg, code) in enumerate(refusals):
                answer = await _ask(bad, msg)
                assert isinstance(answer, StageError) and answer.code == code, answer
                res = await _ask(good, StageForward(req=i, session="g", microbatch=i, tensors={"x": HIDDEN}))
                assert isinstance(res, StageResult), res
            # the fifth, refused on the training thread: answered, then the connection closed
            answer = await _ask(bad, StageForward(req=5, session="b", microbatch=2,
                                                  tensors={"x": HIDDEN.long()}))
            assert isinstance(answer, StageError) and answer.code == "bad_input", answer
            closing = await bad.recv(timeout=10)
            assert isinstance(closing, Error) and closing.code == "too_many_bad", closing
            assert "5 requests in a row" in closing.message and "float tensor" in closing.message
            with pytest.raises(ConnectionLost):
                await bad.recv(timeout=10)
            y = await _ask(good, StageInfer(req=9, session="g", tensors={"x": HIDDEN}))
            assert isinstance(y, StageResult) and bool(torch.isfinite(y.tensors["y"]).all())
            assert _same_parameters(before, s)
            st = s.status()
            assert (st["bad_input"], st["sender_disconnects"], st["steps"]) == (5, 1, 0)
            record = st["senders"]["127.0.0.1"]
            assert (record["refused"], record["disconnected"]) == (5, 1)
            assert record["last_refusal"].startswith("bad_input: ")
            assert "float tensor" in record["last_refusal"]
            await good.close()
        finally:
            await s.close()

    _run(main())


def test_an_answered_request_starts_the_count_again_and_stage_faults_never_count() -> None:
    async def main() -> None:
        s = _server(2, 4, 1, max_bad_in_row=3)
        await s.start()
        try:
            conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            refused = StageForward(req=1, session="b", microbatch=0, tensors={"y": HIDDEN})
            for _ in range(2):
                for _ in range(2):
                    answer = await _ask(conn, refused)
                    assert isinstance(answer, StageError) and answer.code == "bad_input", answer
                ok = await _ask(conn, StageInfer(req=2, session="g", tensors={"x": HIDDEN}))
                assert isinstance(ok, StageResult), ok
            # not the sender's doing: a backward of a forward this stage never held (or evicted)
            for i in range(4):
                lost = await _ask(conn, StageBackward(req=3, session="b", microbatch=i,
                                                      tensors={"grad": HIDDEN}))
                assert isinstance(lost, StageError) and lost.code == "unknown_microbatch", lost
            server_side = next(iter(s._senders))
            for _ in range(4):
                assert not s._count_answer(server_side, StageError(req=0, code="overloaded", message="full"))
            st = s.status()
            assert (st["bad_input"], st["sender_disconnects"]) == (4, 0)
            assert st["senders"]["127.0.0.1"]["disconnected"] == 0
            res = await _ask(conn, StageForward(req=4, session="g", microbatch=0, tensors={"x": HIDDEN}))
            assert isinstance(res, StageResult), res  # still connected and served
            await conn.close()
        finally:
            await s.close()

    _run(main())


def test_nan_and_infinite_inputs_are_refused_before_they_reach_the_weights() -> None:
    async def main() -> None:
        s = _server(2, 4, 1)
        await s.start()
        try:
            before = s.compute.parameters_snapshot()
            conn = await connect("127.0.0.1", s.port, secret=SECRET, role="pipeline", timeouts=FAST)
            res = await _ask(conn, StageForward(req=1, session="t", microbatch=0, tensors={"x": HIDDEN}))
            assert isinstance(res, StageResult)
            grad = torch.ones_like(res.tensors["y"])
            for msg in (StageForward(req=2, session="t", microbatch=1, tensors={"x": HIDDEN * math.nan}),
                        StageInfer(req=3, session="t", tensors={"x": -HIDDEN * math.inf}),
                        StageBackward(req=4, session="t", microbatch=0, tensors={"grad": grad * math.nan})):
                answer = await _ask(conn, msg)
                assert isinstance(answer, StageError) and answer.code == "bad_input", answer
                assert "NaN or infinite" in answer.message
            assert _same_parameters(before, s)
            applied = await _ask(conn, StageBackward(req=5, session="t", microbatch=0,
                                                     tensors={"grad": grad}))
            assert isinstance(applied, StageGrad) and s.compute.steps == 1  # the real backward still applies
            await conn.close()
        finally:
            await s.close()

    _run(main())

    # the last stage's float targets (a regression loss) too
    compute = StageCompute(nn.Linear(3, 1), is_first=False, loss_fn=nn.functional.mse_loss,
                           config=ComputeConfig())
    weights = compute.parameters_snapshot()
    with pytest.raises(BadInput, match="targets hold NaN"):
        compute.forward("r", 0, torch.ones(4, 3), torch.full((4, 1), math.nan))
    assert all(torch.equal(weights[n], t) for n, t in compute.parameters_snapshot().items())

    # and a micro-batch whose every target is ignored (cross-entropy's -100): its loss is NaN
    classify = StageCompute(nn.Linear(3, 5), is_first=False, loss_fn=nn.functional.cross_entropy,
                            config=ComputeConfig())
    weights = classify.parameters_snapshot()
    with pytest.raises(BadInput, match="targets ignored"):
        classify.forward("r", 0, torch.ones(4, 3), torch.full((4,), -100))
    assert classify.steps == 0
    assert all(torch.equal(weights[n], t) for n, t in classify.parameters_snapshot().items())


def test_the_sender_record_keeps_the_newest_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_module, "_MAX_SENDER_RECORDS", 3)
    refused = FuzzInput("record", "auth", encode_bytes(StageForward(req=1, session="x", microbatch=0,
                                                                    tensors={"y": TOKENS})), "pipeline")

    async def main() -> None:
        s = _server(0, 2, 0, secret=FUZZ_SECRET)
        await s.start()
        try:
            for last in (2, 3, 4, 5, 3):
                outcome = await send_input(s.port, refused, (Heartbeat,), source=f"127.0.0.{last}")
                assert outcome == "error:bad_input", outcome
            await eventually(lambda: not s._senders, what="the connections to be gone")
            senders = s.status()["senders"]
            assert list(senders) == ["127.0.0.4", "127.0.0.5", "127.0.0.3"]  # .2 forgotten, .3 renewed
            assert senders["127.0.0.3"]["refused"] == 2 and s.bad_input == 5
        finally:
            await s.close()

    _run(main())


def test_stage_limit_flags_parse_and_set_the_server_config() -> None:
    base = ["stage", "--stage", "0", "--stages", "2"]
    args = build_parser().parse_args([*base, "--max-request-mb", "512", "--max-connections", "64",
                                      "--max-connections-per-address", "4", "--max-failed-auth", "3",
                                      "--max-bad-in-row", "2"])
    config = StageServerConfig(**load_stage_config(None, config_overrides(args)).stage.limit_values())
    assert (config.max_request_mb, config.max_connections, config.max_connections_per_address,
            config.max_failed_auth, config.max_bad_in_row) == (512.0, 64, 4, 3, 2)
    defaults = load_stage_config(None, config_overrides(build_parser().parse_args(base))).stage
    assert StageServerConfig(**defaults.limit_values()) == StageServerConfig()  # the config's defaults hold
    for flag in ("--max-bad-in-row", "--max-request-mb", "--max-connections"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, flag, "0"])
    with pytest.raises(ValueError, match="max_bad_in_row"):
        StageServerConfig(max_bad_in_row=0)
