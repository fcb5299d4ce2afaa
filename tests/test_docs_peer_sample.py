"""The "From your own training loop" program of docs/peer-mode.md, exactly as printed, run as
two real processes on loopback (static peers and ports through the environment variables the
program reads): both finish the same number of rounds and end with the same weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_peer_backend import free_ports

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "peer-mode.md"


def sample_program() -> str:
    """The first ```python block under "## From your own training loop"."""
    text = DOC.read_text()
    section = text[text.index("## From your own training loop"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None, "no python block under 'From your own training loop'"
    return m.group(1)


def test_the_sample_is_complete() -> None:
    code = sample_program()
    compile(code, "peer-mode.md", "exec")
    assert "..." not in code and 'b"..."' not in code  # no placeholders left to fill in
    assert "barrier()" in code and "close()" in code and "backend.rounds" in code


def test_the_sample_trains_two_processes_to_the_same_weights(tmp_path: Path) -> None:
    script = tmp_path / "sample.py"
    script.write_text(sample_program())
    rounds = 30
    ports = free_ports(2)
    procs = []
    for i, port in enumerate(ports):
        home = tmp_path / f"home{i}"
        home.mkdir()
        env = {**os.environ, "SWARMTRAIN_HOME": str(home), "SWARM_SECRET": "docs-sample-test-secret",
               "SWARM_HOST": "127.0.0.1", "SWARM_PORT": str(port), "SWARM_ROUNDS": str(rounds),
               "SWARM_PEERS": ",".join(f"127.0.0.1:{p}" for p in ports if p != port),
               "SWARM_MIN_PEERS": "2", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1.0)  # the second starts later: the first waits for it
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    results = []
    for code, out, err in outputs:
        assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
        m = re.search(r"round (\d+): loss (\S+), weights checksum (\S+)", out)
        assert m is not None, out
        results.append((int(m.group(1)), float(m.group(2)), m.group(3)))
    assert [r[0] for r in results] == [rounds, rounds]
    assert results[0][2] == results[1][2]  # bit-identical weights (the repr of the same float)
    assert all(r[1] < 1.0 for r in results), results  # it learned: the loss starts near 4
