"""Pipeline mode from the command line, on loopback: `swarmtrain stage` ×3, then `pipeline`,
`generate` and `status` against them, and the errors a user meets first (no secret on a
reachable address, a stage that is not running). Every wait polls with a deadline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.app.pipeline_session import parse_layer_range
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.roles.stage.route import check_route, parse_route
from swarmtrain.testing.procs import stop_gently, swarm_cmd, tail

pytestmark = pytest.mark.timeout(300)  # (78 s at half speed)

MODEL = ("--task", "textlm", "--context", "32", "--d-model", "32", "--n-heads", "2", "--n-layers", "4")
ENV = {"SWARMTRAIN_SECRET": "pipeline-cli-secret"}


def test_routes_and_layer_ranges_parse_or_say_what_is_wrong() -> None:
    assert parse_route("a:1,b:2; c:3") == [[("a", 1), ("b", 2)], [("c", 3)]]
    assert parse_layer_range("2:5") == (2, 5)
    for bad in ("a:1;", "a", "a:x", "a:0", ":7"):
        with pytest.raises(ConfigError, match="--route"):
            parse_route(bad)
    for bad in ("3:3", "4:2", "x:2", "2"):
        with pytest.raises(ConfigError, match="START:STOP"):
            parse_layer_range(bad)


def test_route_checks_name_the_address_and_what_to_run_there() -> None:
    def st(replica: str, stage: int, layers: tuple[int, int]) -> dict[str, Any]:
        return {"replica": replica, "stage": stage, "layers": list(layers)}

    down = {"replica": "h1:9", "error": "connection refused"}
    check_route([[st("h0:1", 0, (0, 3))], [down, st("h2:1", 1, (3, 6))]], 6)  # one replica is enough
    with pytest.raises(SwarmError, match=r"h1:9: connection refused.*swarmtrain stage --stage 1 --stages 2"):
        check_route([[st("h0:1", 0, (0, 3))], [down]], 6)
    with pytest.raises(SwarmError, match="h2:1 serves stage 0, but the route lists it as stage 1"):
        check_route([[st("h0:1", 0, (0, 3))], [st("h2:1", 0, (0, 3))]], 6)
    with pytest.raises(SwarmError, match="stage 0 ends at layer 3 but stage 1 starts at 4"):
        check_route([[st("h0:1", 0, (0, 3))], [st("h2:1", 1, (4, 6))]], 6)
    with pytest.raises(SwarmError, match="has 8 layers"):
        check_route([[st("h0:1", 0, (0, 3))], [st("h2:1", 1, (3, 6))]], 8)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _run(*args: str, timeout: float = 90,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(swarm_cmd(*args), env={**os.environ, **(env if env is not None else ENV)},
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"`swarmtrain {args[0]}` did not finish in {timeout} s: {exc.stderr!r}") from exc


@pytest.fixture
def stages(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    """Three stage servers on loopback, any free ports; yields (process, status file)."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for i in range(3):
        status = tmp_path / f"stage{i}.json"
        log = open(tmp_path / f"stage{i}.log", "ab")
        argv = swarm_cmd("stage", *MODEL, "--stage", str(i), "--stages", "3", "--seed", "3",
                         "--host", "127.0.0.1", "--port", "0", "--threads", "1", "--lr", "3e-3",
                         "--status-file", str(status), "--checkpoint-dir", str(tmp_path / f"ckpt{i}"))
        procs.append((subprocess.Popen(argv, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), status))
    try:
        deadline = time.monotonic() + 60
        while not all((_read_json(s) or {}).get("running") for _, s in procs):
            for i, (p, _) in enumerate(procs):
                log = tail(tmp_path / f"stage{i}.log")
                assert p.poll() is None, f"stage {i} exited {p.returncode}:\n{log}"
            assert time.monotonic() < deadline, "stages did not start in 60 s:\n" + "\n".join(
                tail(tmp_path / f"stage{i}.log") for i in range(3))
            time.sleep(0.1)
        yield procs
    finally:
        stop_gently((p for p, _ in procs), timeout=20)


def test_stage_pipeline_generate_and_status_commands_work_together(
        stages: list[tuple[subprocess.Popen[bytes], Path]], tmp_path: Path) -> None:
    ports = [(_read_json(s) or {})["port"] for _, s in stages]
    route = ";".join(f"127.0.0.1:{p}" for p in ports)
    status_file = tmp_path / "trainer.json"

    out = _run("pipeline", *MODEL, "--route", route, "--microbatches", "12",
               "--batch-size", "8", "--chunks", "3", "--eval-every", "6", "--eval-samples", "16",
               "--status-file", str(status_file))
    assert out.returncode == 0, out.stderr
    assert "trained 12 micro-batches" in out.stdout, out.stdout
    trainer = _read_json(status_file)
    assert trainer is not None and trainer["state"] == "finished", trainer
    assert trainer["schedule"] == "sync" and trainer["samples_per_step"] == 24  # 3 chunks of 8
    said = " ".join((out.stdout + out.stderr).split())  # log lines wrap at the terminal's width
    assert "schedule sync: 3 micro-batches of 8 per optimizer step, as one process at batch 24" in said, said
    assert [mb for mb, _ in sorted(trainer["loss_history"])] == list(range(12))
    assert all(c == [1] * 12 for c in trainer["acknowledged"].values()), trainer["acknowledged"]
    assert [n for n, _ in trainer["eval_history"]] == [0, 6, 12]

    gen = _run("generate", *MODEL, "--route", route, "--prompt", "def ", "--tokens", "10")
    assert gen.returncode == 0, gen.stderr
    printed = gen.stdout.removesuffix("\n")  # the prompt, then 10 generated bytes as text
    assert printed.startswith("def ") and len(printed) > len("def "), gen.stdout
    # bytes that are not UTF-8 (the shell passes them as they are) go to the byte-level model
    # as they are; it crashed with UnicodeEncodeError ("surrogates not allowed") before
    raw = _run("generate", *MODEL, "--route", route, "--prompt", os.fsdecode(b"\xff\xfedef "),
               "--tokens", "4")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout.startswith("\ufffd\ufffddef ") and "Traceback" not in raw.stderr, (raw.stdout,
                                                                                          raw.stderr)
    # a prompt longer than the context: said, then a sliding window
    long = _run("generate", *MODEL, "--route", route, "--prompt", "x" * 100, "--tokens", "2")
    assert long.returncode == 0, long.stderr
    assert "sliding window" in " ".join((long.stdout + long.stderr).split()), long.stderr

    table = _run("status", "--route", route)
    assert table.returncode == 0, table.stderr
    assert "pipeline stages" in table.stdout, table.stdout
    assert all(f"127.0.0.1:{p}" in table.stdout for p in ports), table.stdout
    raw = _run("status", "--route", route, "--json")
    assert raw.returncode == 0, raw.stderr
    sts = json.loads(raw.stdout)
    assert [[s["stage"] for s in replicas] for replicas in sts] == [[0], [1], [2]]
    assert [s[0]["microbatches"] for s in sts] == [12, 12, 12]  # each applied every backward once
    assert sts[0][0]["layers"][0] == 0 and sts[2][0]["layers"][1] == 6  # embedding, 4 blocks, head

    for p, s in stages:  # SIGTERM stops a stage cleanly and its status file says so
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        assert (_read_json(s) or {}).get("running") is False


def test_generate_checks_its_arguments_before_any_network_call() -> None:
    """An empty prompt, negative tokens or temperature are refused at once, naming the flag,
    with nothing listening at the route (they were refused only after every stage had been
    asked for its status: 3.8 s on a LAN, and a route error first when a stage was down)."""
    from swarmtrain.testing.fuzz_engine import dead_port

    route = f"127.0.0.1:{dead_port()}"
    for flags, says in ((["--prompt", ""], "--prompt is empty"),
                        (["--prompt", "a", "--tokens", "-1"], "--tokens must be >= 0"),
                        (["--prompt", "a", "--temperature", "-0.5"], "--temperature must be >= 0")):
        out = _run("generate", *MODEL, "--route", route, *flags)
        said = " ".join(out.stderr.split())
        assert out.returncode == 2 and says in said, (flags, out.stderr)
        assert route not in said and "Traceback" not in said, (flags, out.stderr)


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    no_secret = {k: v for k, v in os.environ.items() if k != "SWARMTRAIN_SECRET"}
    out = _run("stage", *MODEL, "--stage", "0", "--stages", "2", "--host", "0.0.0.0",
               "--port", "0", env=no_secret)
    assert out.returncode == 2 and "refusing to listen on 0.0.0.0" in out.stderr, out.stderr
    assert "--secret-file" in out.stderr and "--insecure" in out.stderr

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    out = _run("pipeline", *MODEL, "--route", f"127.0.0.1:{dead}", "--microbatches", "1")
    assert out.returncode == 2, out.stderr
    assert f"127.0.0.1:{dead}" in out.stderr, out.stderr
    assert "swarmtrain stage --stage 0 --stages 1" in out.stderr, out.stderr

    out = _run("pipeline", "--route", "127.0.0.1:1;;127.0.0.1:2")
    assert out.returncode == 2 and "stage 1 lists no replica" in out.stderr, out.stderr
