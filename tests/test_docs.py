"""Documentation that is generated from code must match the code."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.config import (
    DOC_BEGIN,
    DOC_END,
    CoordinatorConfig,
    PeerConfig,
    PipelineConfig,
    StageConfig,
    WorkerConfig,
    render_config_doc,
)
from swarmtrain.config.schema import _TOML_TYPE_NAMES, _field_specs

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_up_to_date() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    assert render_config_doc(text) == text, (
        "docs/config.md is stale: run `python scripts/config_reference.py`")
    for command in (["scripts/config_reference.py"], ["-m", "swarmtrain.config"]):
        check = subprocess.run([sys.executable, *command, "--check"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, (command, check.stderr)


def test_config_reference_keeps_the_hand_written_parts_and_replaces_the_tables() -> None:
    stale = f"# Intro\nkept\n{DOC_BEGIN}\n| `old_key` | string |\n{DOC_END}\nafter, kept\n"
    fresh = render_config_doc(stale)
    assert fresh.startswith("# Intro\nkept\n") and fresh.endswith(f"{DOC_END}\nafter, kept\n")
    assert "old_key" not in fresh and "## Stage (`swarmtrain stage --config FILE`)" in fresh
    with pytest.raises(ValueError, match="markers"):
        render_config_doc("# no markers\n")


def test_the_generator_fails_a_stale_file_and_rewrites_it(tmp_path: Path) -> None:
    from swarmtrain.config.docs import main

    doc = tmp_path / "config.md"
    doc.write_text(f"# Intro\n{DOC_BEGIN}\n{DOC_END}\n")
    assert main(["--check", str(doc)]) == 1
    assert main([str(doc)]) == 0 and main(["--check", str(doc)]) == 0
    assert doc.read_text() == render_config_doc(doc.read_text())


@pytest.mark.parametrize(("command", "cls"), [("coordinator", CoordinatorConfig), ("worker", WorkerConfig),
                                              ("peer", PeerConfig), ("stage", StageConfig),
                                              ("pipeline", PipelineConfig)])
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
