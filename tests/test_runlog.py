"""Run logs, `swarmtrain plot`, model export and console logging flags.

Pure tests of the log format first, then one real coordinator + worker run (digits, 120
updates, as processes over loopback) whose run log, exported model and console output the
later tests check, and a real single-peer run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarmtrain.app.runlog import RunLog, RunLogError, read_run_log, resolve_run_log_path, safe_file_part
from swarmtrain.core.checkpoint import load_checkpoint
from swarmtrain.tasks import load_task
from swarmtrain.testing.procs import start_coordinator, swarm_cmd, tail, wait_exit

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
SECRET = {"SWARMTRAIN_SECRET": "runlog-test-secret"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the format -------------------------------------------------------------------------


def test_metrics_are_rate_limited_events_always_written_and_nan_is_null(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "run.jsonl"
    run_log = RunLog(path, min_interval=60.0)
    assert run_log.metrics(loss=1.0, nested={"a": float("nan")})
    assert not run_log.metrics(loss=2.0)  # within min_interval: dropped
    assert run_log.metrics(force=True, loss=float("inf"), eval={"accuracy": 0.5})
    run_log.event("joined", worker="w0")
    run_log.event("left", worker="w0")
    run_log.close()
    run_log.event("after_close")  # ignored, not an error
    records = read_run_log(path)
    assert [r["kind"] for r in records] == ["metrics", "metrics", "event", "event"]
    assert records[0]["nested"] == {"a": None} and records[1]["loss"] is None
    assert records[1]["eval"] == {"accuracy": 0.5}
    assert [r["event"] for r in records[2:]] == ["joined", "left"]
    assert all(isinstance(r["time"], float) for r in records)
    # strictly valid JSON on every line (no NaN/Infinity literals)
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_run_log_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    for n in range(2):
        run_log = RunLog(path)
        run_log.event("started", n=n)
        run_log.close()
    assert [r["n"] for r in read_run_log(path)] == [0, 1]


@pytest.mark.parametrize(("content", "message"), [
    (None, "does not exist"),
    ("", "is empty"),
    ("\n\n", "is empty"),
    ('{"time": 1, "kind": "event"}\nnot json\n', "line 2 is not JSON"),
    ('[1, 2]\n', 'line 1 is not an object with "time" and "kind"'),
    ('{"loss": 1}\n', 'line 1 is not an object with "time" and "kind"'),
])
def test_reading_a_bad_run_log_says_what_was_expected(tmp_path: Path, content: str | None,
                                                       message: str) -> None:
    path = tmp_path / "RUN.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RunLogError) as err:
        read_run_log(path)
    assert message in str(err.value) and "JSONL run log" in str(err.value)


def test_a_half_written_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text('{"time": 1, "kind": "metrics", "loss": 2}\n{"time": 2, "kind": "met')
    assert [r["loss"] for r in read_run_log(path)] == [2]


def test_run_log_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_run_log_path("", "coordinator.jsonl") is None
    assert resolve_run_log_path("none", "coordinator.jsonl") is None
    assert resolve_run_log_path("x/y.jsonl", "coordinator.jsonl") == Path("x/y.jsonl")
    monkeypatch.setenv("SWARMTRAIN_RUNS_DIR", str(tmp_path))
    first = resolve_run_log_path("auto", "coordinator.jsonl", now=0.0)
    assert first is not None and first.parent.parent == tmp_path and first.name == "coordinator.jsonl"
    assert re.fullmatch(r"\d{8}-\d{6}", first.parent.name)
    first.parent.mkdir(parents=True)
    first.touch()
    second = resolve_run_log_path("auto", "coordinator.jsonl", now=0.0)
    assert second == first.with_name("coordinator-2.jsonl")
    assert safe_file_part("../w 1") == "_w_1" and safe_file_part("w-1.a") == "w-1.a"


def test_unwritable_run_log_is_a_clear_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = subprocess.run(swarm_cmd("coordinator", "--host", "127.0.0.1", "--port", "0",
                                 "--run-log", str(blocker / "run.jsonl")),
                       env={**os.environ, **SECRET}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "cannot write the run log" in r.stderr and "--run-log none" in r.stderr


# --- a real run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    dir: Path
    coordinator_log: Path
    worker_log: Path
    coordinator_out: Path
    worker_out: Path
    checkpoints: Path


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One coordinator (JSON console logs) and one worker (default console logs) train
    digits for 120 updates with checkpoints every 40; the run log and model go to run/.

    The worker runs at 5 % of its speed, so the run lasts long enough for several evaluations
    0.2 s apart: at 50 %, a clean-clone CI run did its 120 updates in 0.33 s, evaluated only
    twice, and test_every_evaluation_has_its_record_in_the_run_log had fewer than the 3 it
    needs (2026-12-07). Digits steps take 0.5-1.5 ms, so 120 of them at 5 % take 1-3.5 s."""
    tmp = tmp_path_factory.mktemp("real-run")
    run = Run(tmp / "run", tmp / "run" / "coordinator.jsonl", tmp / "run" / "worker.jsonl",
              tmp / "coordinator.log", tmp / "w0.log", tmp / "ck")
    coord, port = start_coordinator(
        tmp, "--task", "digits", "--min-workers", "1", "--max-steps", "120", "--eval-interval", "0.2",
        "--checkpoint-dir", str(run.checkpoints), "--checkpoint-interval", "40",
        "--run-log", str(run.coordinator_log), "--log-json", env=SECRET)
    with open(run.worker_out, "wb") as out:
        worker = subprocess.Popen(
            swarm_cmd("worker", "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
                      "--worker-id", "w0", "--batch-size", "16", "--speed", "0.05",
                      "--run-log", str(run.worker_log)),
            env={**os.environ, **SECRET}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_exit(coord, 180, run.coordinator_out) == 0, tail(run.coordinator_out)
        assert wait_exit(worker, 60, run.worker_out) == 0, tail(run.worker_out)
    finally:
        for p in (coord, worker):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    yield run


def test_coordinator_run_log_has_metrics_and_events(real_run: Run) -> None:
    records = read_run_log(real_run.coordinator_log)
    metrics = [r for r in records if r["kind"] == "metrics"]
    events = [r["event"] for r in records if r["kind"] == "event"]
    for expected in ("listening", "joined", "start", "checkpoint", "shutdown", "exported"):
        assert expected in events, events
    assert events.index("joined") < events.index("shutdown") < events.index("exported")
    assert metrics, records
    last = metrics[-1]
    assert last["role"] == "coordinator" and last["version"] >= 120
    assert last["samples"] > 0 and last["bytes_up"] > 0 and last["bytes_down"] > 0
    assert last["workers"]["w0"]["samples"] == last["samples"]
    assert isinstance(last["loss"], float)
    evals = [r["eval"] for r in metrics if "eval" in r]
    assert evals and 0.0 <= evals[-1]["accuracy"] <= 1.0, evals
    assert any(r["workers"]["w0"]["samples_per_sec"] > 0 for r in metrics if "w0" in r.get("workers", {}))


def test_every_evaluation_has_its_record_in_the_run_log(real_run: Run) -> None:
    # evaluations every 0.2 s: before, the logger looked every 0.25 s and wrote the newest
    # evaluation only, so some never reached the run log
    said = [json.loads(line)["message"] for line in real_run.coordinator_out.read_text().splitlines()
            if line.strip()]
    evaluated = [int(m.group(1)) for m in (re.match(r"version (\d+): accuracy", s) for s in said) if m]
    logged = [r["eval_version"] for r in read_run_log(real_run.coordinator_log) if "eval" in r]
    assert len(evaluated) >= 3, said
    assert logged == evaluated, (logged, evaluated)


def test_worker_run_log_has_its_own_metrics(real_run: Run) -> None:
    records = read_run_log(real_run.worker_log)
    events = [r["event"] for r in records if r["kind"] == "event"]
    assert events[0] == "started" and events[-1] == "finished", events
    last = [r for r in records if r["kind"] == "metrics"][-1]
    assert last["role"] == "worker" and last["worker_id"] == "w0" and last["steps"] > 0


def test_plot_writes_valid_pngs_from_the_real_run_log(real_run: Run, tmp_path: Path) -> None:
    out = tmp_path / "plots"
    r = subprocess.run(swarm_cmd("plot", str(real_run.coordinator_log), "--out", str(out)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    printed = [Path(line) for line in r.stdout.split()]
    names = {p.name for p in printed}
    assert names == {f"coordinator-{c}.png" for c in ("loss", "heldout", "throughput", "bytes")}, names
    for p in printed:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, (p, len(data))


def test_plot_of_a_worker_log_draws_the_charts_that_apply(real_run: Run, tmp_path: Path) -> None:
    r = subprocess.run(swarm_cmd("plot", str(real_run.worker_log), "--out", str(tmp_path)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {Path(p).name for p in r.stdout.split()} == {"worker-throughput.png", "worker-bytes.png"}


def test_plot_charts_a_changing_learning_rate_and_not_a_constant_one(tmp_path: Path) -> None:
    from swarmtrain.app.plotting import plot_run_log
    from swarmtrain.core.schedule import LRSchedule

    for kind in ("cosine", "constant"):
        schedule = LRSchedule(kind, 100, 10 if kind == "cosine" else 0, 0.1)
        path = tmp_path / kind / "coordinator.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps({
            "time": 1000.0 + v, "kind": "metrics", "role": "coordinator", "version": v, "loss": 1.0 / (1 + v),
            "learning_rate": 3e-3 * schedule.factor(v)}) + "\n" for v in range(0, 100, 5)))
        names = {p.name for p in plot_run_log(path)}
        assert ("coordinator-lr.png" in names) == (kind == "cosine"), (kind, names)
        assert "coordinator-loss.png" in names


@pytest.mark.parametrize(("content", "message"), [
    (None, "does not exist"), ("", "is empty"), ("loss,accuracy\n1,2\n", "line 1 is not JSON"),
])
def test_plot_refuses_bad_input_with_exit_2(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "RUN.jsonl"
    if content is not None:
        path.write_text(content)
    r = subprocess.run(swarm_cmd("plot", str(path)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("swarmtrain plot: error: ") and message in r.stderr, r.stderr
    assert "JSONL run log" in r.stderr and not list(tmp_path.glob("*.png"))


def _readme_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using the trained model", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert match, "README's 'Using the trained model' has no python block"
    return match.group(1)


def test_readme_snippet_loads_the_export_with_the_final_weights(real_run: Run, tmp_path: Path) -> None:
    exported = real_run.dir / "model.safetensors"
    final = load_checkpoint(sorted(real_run.checkpoints.glob("ckpt-*"))[-1])
    # the snippet as written in the README, run where it expects model.safetensors
    (tmp_path / "model.safetensors").write_bytes(exported.read_bytes())
    check = (
        "\nimport sys, torch\n"
        "from swarmtrain.core.checkpoint import load_checkpoint\n"
        "ref = load_task('digits').build_model()\n"
        "ck = load_checkpoint(sys.argv[1])\n"
        "ref.load_state_dict({k[len('model/'):]: v for k, v in ck.tensors.items() "
        "if k.startswith('model/')})\n"
        "x = torch.randn(32, next(model.parameters()).shape[1], generator=torch.Generator().manual_seed(0))\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(model(x), ref.eval()(x)), 'outputs differ'\n"
        "print('same outputs')\n")
    r = subprocess.run([sys.executable, "-c", _readme_snippet() + check, str(final.path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "same outputs" in r.stdout, r.stderr
    tensors = load_file(exported)
    params = dict(load_task("digits").build_model().named_parameters())
    assert set(tensors) == set(params)
    for name, t in tensors.items():
        assert torch.equal(t, final.tensors[f"model/{name}"]), name


def test_export_command_writes_the_newest_checkpoints_model(real_run: Run, tmp_path: Path) -> None:
    out = tmp_path / "exported.safetensors"
    r = subprocess.run(swarm_cmd("export", str(real_run.checkpoints), "--out", str(out)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"ckpt-0+12\d \(version 12\d\)", r.stdout), r.stdout
    final = load_file(real_run.dir / "model.safetensors")
    assert {n: torch.equal(t, final[n]) for n, t in load_file(out).items()} == dict.fromkeys(final, True)
    r = subprocess.run(swarm_cmd("export", str(tmp_path / "no-such-dir")), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--checkpoint-dir" in r.stderr, r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run(swarm_cmd("export", str(empty)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no valid checkpoint" in r.stderr, r.stderr


def test_log_json_lines_parse_and_default_logs_are_human_readable(real_run: Run) -> None:
    lines = [line for line in real_run.coordinator_out.read_text().splitlines() if line.strip()]
    assert len(lines) > 3
    parsed = [json.loads(line) for line in lines]  # every line of --log-json output is JSON
    assert all({"time", "level", "logger", "message"} <= set(p) for p in parsed)
    assert any("listening on 127.0.0.1" in p["message"] for p in parsed)
    worker_lines = [line for line in real_run.worker_out.read_text().splitlines() if line.strip()]
    assert worker_lines and not any(line.lstrip().startswith("{") for line in worker_lines)
    assert any("registered as w0" in line for line in worker_lines), worker_lines


@pytest.mark.parametrize("command", ["coordinator", "worker", "peer", "stage", "pipeline"])
def test_every_long_running_command_has_log_level_and_log_json(command: str) -> None:
    r = subprocess.run(swarm_cmd(command, "--help"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--log-level" in r.stdout and "--log-json" in r.stdout
    if command in ("coordinator", "worker", "peer", "pipeline"):
        assert "--run-log" in r.stdout


def test_a_peer_run_writes_a_run_log_that_plots(tmp_path: Path) -> None:
    log_path = tmp_path / "peer.jsonl"
    env = {**os.environ, "SWARMTRAIN_HOME": str(tmp_path / "home")}
    r = subprocess.run(
        swarm_cmd("peer", "--host", "127.0.0.1", "--port", "0", "--insecure", "--task", "digits",
                  "--run", "runlog-test", "--min-peers", "1",
                  "--max-rounds", "4", "--inner-steps", "5", "--eval-every", "2", "--threads", "1",
                  "--batch-size", "16", "--run-log", str(log_path)),
        env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_run_log(log_path)
    rounds = [r["round"] for r in records if r["kind"] == "metrics"]
    assert rounds and rounds[-1] == 4, records
    assert any("eval" in r for r in records if r["kind"] == "metrics"), records
    events = [r["event"] for r in records if r["kind"] == "event"]
    assert events[0] == "started" and events[-1] == "finished", events
    p = subprocess.run(swarm_cmd("plot", str(log_path)), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert {Path(x).name for x in p.stdout.split()} >= {"peer-loss.png", "peer-heldout.png"}


PIPE_MODEL = ("--task", "textlm", "--context", "32", "--d-model", "32", "--n-heads", "2", "--n-layers", "2")


def test_a_pipeline_run_writes_a_run_log_that_plots(tmp_path: Path) -> None:
    env = {**os.environ, **SECRET}
    stages: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            stages.append(subprocess.Popen(
                swarm_cmd("stage", *PIPE_MODEL, "--stage", str(i), "--stages", "2", "--host", "127.0.0.1",
                          "--port", "0", "--threads", "1", "--status-file", str(tmp_path / f"stage{i}.json"),
                          "--checkpoint-dir", str(tmp_path / f"ckpt{i}")),
                env=env, stdout=open(tmp_path / f"stage{i}.log", "ab"), stderr=subprocess.STDOUT,
                start_new_session=True))
        ports = [_wait_for_port(tmp_path / f"stage{i}.json", stages[i], tmp_path / f"stage{i}.log")
                 for i in range(2)]
        log_path = tmp_path / "pipeline.jsonl"
        r = subprocess.run(
            swarm_cmd("pipeline", *PIPE_MODEL, "--route", ";".join(f"127.0.0.1:{p}" for p in ports),
                      "--microbatches", "10", "--batch-size", "4", "--chunks", "5", "--eval-every", "5",
                      "--eval-samples", "8",
                      "--run-log", str(log_path)),
            env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        for p in stages:
            p.kill()
            p.wait(timeout=10)
    records = read_run_log(log_path)
    events = [r["event"] for r in records if r["kind"] == "event"]
    assert events == ["started", "finished"], events
    evals = [r for r in records if r["kind"] == "metrics" and "eval" in r]
    assert [r["microbatch"] for r in evals] == [0, 5, 10], evals
    assert "loss" not in evals[0] and all(isinstance(r["loss"], float) for r in evals[1:]), evals
    p = subprocess.run(swarm_cmd("plot", str(log_path)), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert {Path(x).name for x in p.stdout.split()} >= {"pipeline-loss.png", "pipeline-heldout.png"}


def _wait_for_port(status: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = json.loads(status.read_text())
            if st.get("running"):
                return int(st["port"])
        except (OSError, ValueError):
            pass
        assert proc.poll() is None, f"stage exited {proc.returncode}:\n{tail(log)}"
        time.sleep(0.1)
    raise AssertionError(f"stage not running after {timeout} s:\n{tail(log)}")
