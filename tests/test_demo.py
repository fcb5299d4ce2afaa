"""The README's first command: `swarmtrain demo` trains digits in a local cluster of separate
processes and ends above the demo's target accuracy (else it says so and exits 1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmtrain.app.demo import DEMO_TARGET

pytestmark = pytest.mark.timeout(300)


def _demo(tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {**os.environ, "COLUMNS": "120", "SWARMTRAIN_RUNS_DIR": str(tmp_path / "runs")}
    env.pop("SWARMTRAIN_SECRET", None)
    proc = subprocess.run([sys.executable, "-m", "swarmtrain", "demo", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def _final_accuracy(out: str) -> float:
    found = re.findall(r"held-out accuracy: ([0-9.]+)", out)
    assert found, out
    return float(found[-1])


def test_the_demo_reaches_its_target_and_leaves_a_run_log_and_a_model(tmp_path: Path) -> None:
    code, out = _demo(tmp_path)
    assert code == 0, out
    assert _final_accuracy(out) >= DEMO_TARGET, out
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "coordinator.jsonl").stat().st_size > 0, runs
    assert (runs[0] / "model.safetensors").exists()


def test_a_demo_that_ends_below_the_target_says_so_and_exits_1(tmp_path: Path) -> None:
    code, out = _demo(tmp_path, "--steps", "10")
    assert code == 1, out
    assert _final_accuracy(out) < DEMO_TARGET
    assert "below the demo's target" in out and "--steps 20" in out, out
