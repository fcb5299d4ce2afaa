"""Documentation that is generated from code must match the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_up_to_date() -> None:
    out = subprocess.run([sys.executable, "scripts/config_reference.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert (ROOT / "docs" / "config.md").read_text() == out, (
        "docs/config.md is stale: run `python scripts/config_reference.py > docs/config.md`")


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/setup.sh && .venv/bin/swarmtrain demo" in readme
    test_cmd = ".venv/bin/python -m pytest"
    assert f"./scripts/setup.sh && {test_cmd}" in readme
    assert "./scripts/setup.sh" in ci and test_cmd in ci
