"""Stage checkpoints (swarmtrain/roles/stage/checkpointing.py): real files, real stage servers on
loopback (port 0) driven by a real trainer, and `swarmtrain stage --resume` as processes.

A stage restored from its checkpoint continues bit-identically (a fresh one does not);
periodic saves land on the interval and honour ``keep``; a directory that cannot be written
costs one ERROR, then WARNINGs, and training goes on; a checkpoint of another stage or model
is refused saying what differs. Every wait has a deadline; nothing sleeps to synchronise."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.app.pipeline_session import StageOptions
from swarmtrain.errors import ConfigError
from swarmtrain.roles.stage import (
    ComputeConfig,
    PipelineTrainer,
    Router,
    RouterConfig,
    StageServer,
    StageServerConfig,
    TrainerConfig,
    build_stage,
)
from swarmtrain.roles.stage.checkpointing import StageCheckpointer, StageIdentity, describe_task
from swarmtrain.tasks import TextLMConfig, TextLMTask
from swarmtrain.testing.pipeline import FAST_TIMEOUTS, run_bounded
from swarmtrain.testing.procs import stop_gently, swarm_cmd, tail

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]  # (64 s at half speed)

SECRET = b"pipeline-checkpoint-secret"
TASK = TextLMTask(TextLMConfig(context=16, d_model=16, n_heads=2, n_layers=2))  # 4 layers
RANGES = [(0, 2), (2, 4)]
SEED = 11
FAST = FAST_TIMEOUTS


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return run_bounded(coro, timeout)


@pytest.fixture(scope="module")
def data() -> Any:
    return TASK.load_data()



def _stage(i: int, *, task: TextLMTask = TASK, ranges: list[tuple[int, int]] = RANGES) -> StageServer:
    layers, loss_fn = build_stage(task.build_model, SEED, *ranges[i])
    last = i == len(ranges) - 1
    return StageServer(layers, stage=i, layer_range=ranges[i], loss_fn=loss_fn if last else None,
                       compute=ComputeConfig(learning_rate=3e-3), config=StageServerConfig(timeouts=FAST),
                       secret=SECRET, name=f"s{i}")


def _identity(server: StageServer, task: TextLMTask = TASK, stages: int = 2) -> StageIdentity:
    return StageIdentity(server.stage, stages, server.layer_range, describe_task(task))


class _Pipeline:
    """Started stage servers and a trainer through them (sync schedule, one step per
    ``chunks`` micro-batches of 4; the sample order is fixed by ``seed``)."""

    def __init__(self, servers: list[StageServer]) -> None:
        self.servers = servers
        self.router: Router | None = None

    async def __aenter__(self) -> _Pipeline:
        for s in self.servers:
            await s.start()
        self.router = Router([[s.address] for s in self.servers], secret=SECRET,
                             config=RouterConfig(timeouts=FAST))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.router is not None
        await self.router.close()
        for s in self.servers:
            await s.close()

    def trainer(self, data: Any, *, seed: int, chunks: int = 1) -> PipelineTrainer:
        assert self.router is not None
        return PipelineTrainer(self.router, data.train, TrainerConfig(batch_size=4, chunks=chunks, seed=seed))


def test_a_restored_stage_continues_bit_identically_and_a_fresh_one_does_not(
        data: Any, tmp_path: Path) -> None:
    async def main() -> None:
        original = _Pipeline([_stage(0), _stage(1)])
        restored = _Pipeline([_stage(0), _stage(1)])
        fresh = _Pipeline([_stage(0), _stage(1)])
        async with original, restored, fresh:
            await original.trainer(data, seed=1, chunks=2).train(6)  # 3 optimizer steps
            for s in original.servers:
                ck = StageCheckpointer(tmp_path / f"stage{s.stage}", every=0, keep=2)
                ck.attach(s, _identity(s))
                path = await ck.save_now(s)
                assert path is not None and path.name == "ckpt-000000000003", path
                assert s.durable_step == 3 and s.at_risk == 0
            for s in restored.servers:
                ck = StageCheckpointer(tmp_path / f"stage{s.stage}", every=0, keep=2)
                assert await ck.restore(s, _identity(s))
                assert s.compute.steps == 3 and s.durable_step == 3
                assert ck.status()["checkpoint"]["last_step"] == 3
            assert [s.compute.fingerprint() for s in restored.servers] == [
                s.compute.fingerprint() for s in original.servers]
            for p in (original, restored, fresh):  # the same further micro-batches
                await p.trainer(data, seed=2, chunks=2).train(4)
        assert [s.compute.steps for s in restored.servers] == [5, 5]
        after = [s.compute.fingerprint() for s in original.servers]
        assert [s.compute.fingerprint() for s in restored.servers] == after
        # the control: the same further training from the seed's weights ends elsewhere, so
        # the equality above says the restore carried the weights and the AdamW state
        assert all(a != b for a, b in zip([s.compute.fingerprint() for s in fresh.servers], after,
                                          strict=True))

    _run(main())


def test_periodic_checkpoints_land_every_n_steps_and_keep_is_honoured(data: Any, tmp_path: Path) -> None:
    async def main() -> list[int | None]:
        seen = []
        async with _Pipeline([_stage(0), _stage(1)]) as p:
            last = p.servers[1]
            ck = StageCheckpointer(tmp_path / "ck", every=2, keep=2)
            ck.attach(last, _identity(last))
            trainer = p.trainer(data, seed=1)
            for _ in range(6):  # one optimizer step each; the save it starts is awaited
                await trainer.train(1)
                await ck.drain()
                seen.append(ck.status()["checkpoint"]["last_step"])
            assert last.durable_step == 6 and last.at_risk == 0
            assert await ck.save_now(last) == ck.last_path  # nothing trained since: no new save
        return seen

    assert _run(main()) == [None, 2, 2, 4, 4, 6]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-000000000004", "ckpt-000000000006"]
    meta = json.loads((tmp_path / "ck" / "ckpt-000000000006" / "meta.json").read_text())["meta"]
    assert (meta["stage"], meta["stages"], meta["layers"], meta["steps"]) == (1, 2, [2, 4], 6)
    assert meta["task"] == "textlm context=16 d_model=16 n_heads=2 n_layers=2 dropout=0.0"


def test_an_unwritable_directory_costs_one_error_then_warnings_and_training_goes_on(
        data: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # mkdir under a regular file fails, even for root

    async def main() -> dict[str, Any]:
        async with _Pipeline([_stage(0), _stage(1)]) as p:
            last = p.servers[1]
            ck = StageCheckpointer(blocker / "ck", every=1, keep=2)
            ck.attach(last, _identity(last))
            trainer = p.trainer(data, seed=1)
            for _ in range(3):
                await trainer.train(1)
                await ck.drain()
            assert await ck.save_now(last) is None  # as on a clean stop
            assert last.compute.steps == 3 and last.at_risk == 3
            return ck.status()["checkpoint"]

    with caplog.at_level(logging.INFO, logger="swarmtrain.core.checkpoint"):
        status = _run(main())
    assert status["failures"] == status["failures_in_a_row"] == 4, status
    assert status["last_step"] is None and status["last_path"] is None
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "swarmtrain.core.checkpoint"]
    errors = [m for lvl, m in said if lvl == logging.ERROR]
    warnings = [m for lvl, m in said if lvl == logging.WARNING]
    assert len(errors) == 1 and "failed, training goes on" in errors[0] and "a-file" in errors[0], said
    assert len(warnings) == 3 and all("still failing" in m and "none yet" in m for m in warnings), said
    assert "4 attempts in a row" in warnings[-1], warnings


def test_a_checkpoint_of_another_stage_layer_range_or_width_is_refused_saying_what_differs(
        tmp_path: Path) -> None:
    ranges3 = [(0, 2), (2, 3), (3, 4)]
    wide = TextLMTask(TextLMConfig(context=16, d_model=24, n_heads=2, n_layers=2))

    async def main() -> None:
        one = _stage(1, ranges=ranges3)  # block 2 of 3 stages
        other = _stage(2, ranges=ranges3)
        moved = _stage(1)  # stage 1 of 2: layers [2, 4)
        wider = _stage(1, task=wide, ranges=ranges3)
        try:
            for s in (one, other, moved, wider):
                await s.start()
            ck = StageCheckpointer(tmp_path / "one", every=0, keep=1)
            ck.attach(one, _identity(one, stages=3))
            assert await ck.save_now(one) is not None  # an untrained stage's state, step 0
            reader = StageCheckpointer(tmp_path / "one", every=0, keep=1)
            with pytest.raises(ConfigError, match=r"ckpt-000000000000 is of stage 1 \(layers \[2, 3\)\), "
                                                  r"this is stage 2.*--checkpoint-dir"):
                await reader.restore(other, _identity(other, stages=3))
            with pytest.raises(ConfigError, match=r"holds layers \[2, 3\) of stage 1 of 3, this stage "
                                                  r"serves layers \[2, 4\) of stage 1 of 2"):
                await reader.restore(moved, _identity(moved))
            with pytest.raises(ConfigError, match=r"another shape .*d_model=16.*d_model=24.*model flags"):
                await reader.restore(wider, _identity(wider, task=wide, stages=3))
            assert other.compute.steps == moved.compute.steps == wider.compute.steps == 0
            empty = StageCheckpointer(tmp_path / "nothing", every=0, keep=1)
            assert not await empty.restore(other, _identity(other, stages=3))
        finally:
            for s in (one, other, moved, wider):
                await s.close()

    _run(main())


def test_stage_options_check_the_checkpoint_flags() -> None:
    assert StageOptions(stage=2, stages=3).checkpoint_directory == os.path.join("checkpoints", "stage2")
    assert StageOptions(stage=0, stages=1, checkpoint_dir="none").checkpoint_directory is None
    for bad, says in (({"checkpoint_every": -1}, r"allowed: 0 <= checkpoint_every \(--checkpoint-every\)"),
                      ({"keep_checkpoints": 0}, r"allowed: 1 <= keep_checkpoints \(--keep-checkpoints\)"),
                      ({"checkpoint_dir": " "}, "--checkpoint-dir is blank"),
                      ({"checkpoint_dir": "none", "resume": True}, "--resume loads a checkpoint")):
        with pytest.raises(ConfigError, match=says):
            StageOptions(stage=0, stages=1, **bad)


# --- `swarmtrain stage` as processes -------------------------------------------------------

MODEL = ("--task", "textlm", "--context", "16", "--d-model", "16", "--n-heads", "2", "--n-layers", "2")
ENV = {"SWARMTRAIN_SECRET": "pipeline-checkpoint-cli-secret"}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _start_stages(tmp: Path, tag: str, *extra: tuple[str, ...]) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """Both stages, any free ports, their checkpoints in tmp/ck{i}; waits until they serve."""
    procs = []
    for i in range(2):
        status = tmp / f"{tag}{i}.json"
        argv = swarm_cmd("stage", *MODEL, "--stage", str(i), "--stages", "2", "--seed", "3", "--host",
                         "127.0.0.1", "--port", "0", "--threads", "1", "--status-file", str(status),
                         "--checkpoint-dir", str(tmp / f"ck{i}"), *extra[i])
        log = open(tmp / f"{tag}{i}.log", "ab")
        procs.append((subprocess.Popen(argv, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), status))
    deadline = time.monotonic() + 60
    while not all((_read_json(s) or {}).get("running") for _, s in procs):
        for i, (p, _) in enumerate(procs):
            assert p.poll() is None, f"stage {i} exited {p.returncode}:\n{tail(tmp / f'{tag}{i}.log')}"
        assert time.monotonic() < deadline, "stages did not start in 60 s"
        time.sleep(0.1)  # polling the status files, each check with the deadline above
    return procs


def _stop(procs: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    stop_gently(p for p, _ in procs)


def test_sigterm_writes_a_final_checkpoint_and_resume_continues_from_it(tmp_path: Path) -> None:
    # stage 0 saves only when stopped (every 100 steps), stage 1 after every step
    procs = _start_stages(tmp_path, "first", ("--checkpoint-every", "100"), ("--checkpoint-every", "1"))
    try:
        route = ";".join(f"127.0.0.1:{(_read_json(s) or {})['port']}" for _, s in procs)
        out = subprocess.run(swarm_cmd("pipeline", *MODEL, "--route", route, "--microbatches", "6",
                                       "--batch-size", "4", "--chunks", "2", "--eval-every", "0",
                                       "--eval-samples", "4"),
                             env={**os.environ, **ENV}, capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=30) == 0
    finally:
        _stop(procs)
    before = [_read_json(s) or {} for _, s in procs]
    assert [b["steps"] for b in before] == [3, 3] and not any(b["running"] for b in before), before
    assert [b["checkpoint"]["last_step"] for b in before] == [3, 3], before
    assert [b["checkpoint"]["failures"] for b in before] == [0, 0], before
    for i in range(2):
        assert (tmp_path / f"ck{i}" / "ckpt-000000000003").is_dir(), list((tmp_path / f"ck{i}").iterdir())
    assert "checkpoint at optimizer step 3" in tail(tmp_path / "first0.log", 200)

    # without --resume a stage refuses to start from the seed over an earlier run's checkpoints
    # (it would write its own among them), says how to continue, and leaves them alone
    again = subprocess.run(swarm_cmd("stage", *MODEL, "--stage", "0", "--stages", "2", "--seed", "3",
                                     "--host", "127.0.0.1", "--port", "0", "--checkpoint-dir",
                                     str(tmp_path / "ck0")),
                           env={**os.environ, **ENV}, capture_output=True, text=True, timeout=60)
    said = " ".join(again.stderr.split())
    assert again.returncode != 0 and "Traceback" not in said, said
    assert "earlier run of stage 0 (up to optimizer step 3): start with --resume" in said, said
    assert sorted(p.name for p in (tmp_path / "ck0").iterdir()) == ["ckpt-000000000003"]

    resumed = _start_stages(tmp_path, "resumed", ("--resume",), ("--resume",))
    try:
        after = [_read_json(s) or {} for _, s in resumed]
        assert [a["steps"] for a in after] == [3, 3], after
        assert [a["microbatches"] for a in after] == [b["microbatches"] for b in before]
        assert [a["checkpoint"]["last_step"] for a in after] == [3, 3], after
    finally:
        _stop(resumed)
    said = "".join(tail(tmp_path / "resumed1.log", 200).split())  # lines wrap, paths too
    path = tmp_path / "ck1" / "ckpt-000000000003"
    assert f"resumedstage1from{path}atoptimizerstep3" in said, said
