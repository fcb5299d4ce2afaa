"""The examples as real processes: the plain script, and its swarmtrain version on loopback."""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from swarmtrain.testing.procs import tail, wait_exit

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "SWARMTRAIN_SECRET": "examples-test-secret"}


def _accuracy(text: str, label: str) -> float:
    """The number printed as ``<label>held-out accuracy 0.xxx``."""
    found = re.findall(rf"^{label}held-out accuracy ([0-9.]+)", text, flags=re.MULTILINE)
    assert found, f"no line {label!r}held-out accuracy in:\n{text[-2000:]}"
    return float(found[-1])


def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / name), *args]


def test_plain_script_trains_and_reports_heldout_accuracy() -> None:
    r = subprocess.run(_script("plain_train.py", "--epochs", "5"), cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _accuracy(r.stdout, "") > 0.9


def test_swarm_example_coordinator_and_worker_train_over_loopback(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    coord_log, worker_log = tmp_path / "coordinator.log", tmp_path / "worker.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(coord_log, "wb") as out:
            coord = subprocess.Popen(
                _script("swarm_coordinator.py", "--host", "127.0.0.1", "--port", "0",
                        "--port-file", str(port_file), "--min-workers", "1", "--max-steps", "400"),
                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(coord)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert coord.poll() is None, f"coordinator exited ({coord.returncode}):\n{tail(coord_log)}"
            assert time.monotonic() < deadline, f"coordinator not listening after 30 s:\n{tail(coord_log)}"
            time.sleep(0.05)
        with open(worker_log, "wb") as out:
            worker = subprocess.Popen(
                _script("swarm_worker.py", "--host", "127.0.0.1", "--port", port_file.read_text(),
                        "--seed", "1"),
                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(worker)
        assert wait_exit(coord, 60, coord_log) == 0, tail(coord_log)
        assert wait_exit(worker, 30, worker_log) == 0, tail(worker_log)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    coord_out, worker_out = coord_log.read_text(), worker_log.read_text()
    assert "Traceback" not in coord_out + worker_out, coord_out + worker_out
    updates = re.findall(r"after (\d+) updates", coord_out)
    assert updates and int(updates[-1]) >= 400, coord_out  # it stopped at max_steps, not earlier
    untrained = _accuracy(coord_out, "untrained ")
    final = _accuracy(coord_out, "final ")
    assert final > untrained + 0.3 and final > 0.85, (untrained, final)
    # the worker's replica ends at the master weights, so it measures (about) the same
    assert abs(_accuracy(worker_out, "") - final) < 0.05, (worker_out, final)


def test_worker_script_differs_from_plain_script_by_a_few_marked_lines() -> None:
    plain = (EXAMPLES / "plain_train.py").read_text().splitlines()
    worker_text = (EXAMPLES / "swarm_worker.py").read_text()
    worker = worker_text.splitlines()
    docstring_end = ast.parse(worker_text).body[0].end_lineno or 0  # the module docstring
    changed = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=plain, b=worker, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        changed += (i2 - i1) + (j2 - j1)
        for j in range(max(j1, docstring_end), j2):
            line = worker[j]
            marked = "# swarmtrain:" in line or (j > 0 and worker[j - 1].lstrip().startswith("# swarmtrain:"))
            assert marked or not line.strip(), f"swarm_worker.py:{j + 1} changed without a mark: {line!r}"
    assert 0 < changed <= 16, f"{changed} lines differ"
    # docs/python-api.md shows the diff; it must be the real one
    docs = (ROOT / "docs" / "python-api.md").read_text()
    diff = difflib.unified_diff(plain, worker, lineterm="", n=0)
    for line in list(diff)[2:]:
        if line[:1] in "+-":
            assert line in docs, f"docs/python-api.md lacks the diff line {line!r}"
