"""Documentation that is generated from code must match the code."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.config import _TOML_TYPE_NAMES, CoordinatorConfig, PeerConfig, WorkerConfig, _field_specs

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_up_to_date() -> None:
    out = subprocess.run([sys.executable, "scripts/config_reference.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert (ROOT / "docs" / "config.md").read_text() == out, (
        "docs/config.md is stale: run `python scripts/config_reference.py > docs/config.md`")


@pytest.mark.parametrize(("command", "cls"), [("coordinator", CoordinatorConfig), ("worker", WorkerConfig),
                                              ("peer", PeerConfig)])
def test_config_reference_documents_every_key_of_every_role(command: str, cls: Any) -> None:
    """Every section and key of each role's config, with its type and default, under the
    role's heading (so a role left out of the generator is caught, not only a stale file)."""
    text = (ROOT / "docs" / "config.md").read_text()
    heading = f"(`swarmtrain {command} --config FILE`)"
    assert heading in text, f"docs/config.md has no section for swarmtrain {command}"
    role = text.split(heading, 1)[1].split("\n## ", 1)[0]
    for f in dataclasses.fields(cls):
        section = f.default_factory()
        assert f"### [{f.name}]" in role, f"{command}: [{f.name}] missing"
        table = role.split(f"### [{f.name}]", 1)[1].split("\n### ", 1)[0]
        for key, (typ, _meta) in _field_specs(type(section)).items():
            row = f"| `{key}` | {_TOML_TYPE_NAMES[typ]} | `{getattr(section, key)!r}` |"
            assert row in table, f"{command}: [{f.name}] {key} missing or wrong: {row}"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/setup.sh && .venv/bin/swarmtrain demo" in readme
    test_cmd = ".venv/bin/python -m pytest"
    assert f"./scripts/setup.sh && {test_cmd}" in readme
    assert "./scripts/setup.sh" in ci and test_cmd in ci
