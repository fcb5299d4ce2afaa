"""The Python samples of README.md and docs/python-api.md run, exactly as printed (call
signatures are shown in ``text`` blocks, not ``python`` ones: they are not programs).

Every ```python block is extracted and run as a program of its own (a fresh interpreter,
in a temporary directory, with ``examples/`` importable, as the docs say to run them from
there). A block whose first line is ``# NAME.py`` is a module the docs ask you to save: it
is saved under that name, next to every later block of the same file, and run too. The one
premise a sample does not make itself is provided: README's loading sample reads the
``model.safetensors`` a run exports, so a digits model is exported there first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/python-api.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.timeout(120)  # a sample that trains took 23 s on a machine at half speed


def blocks(doc: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every python block of ``doc``."""
    text = (ROOT / doc).read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _module_name(code: str) -> str | None:
    first = code.splitlines()[0].strip() if code.strip() else ""
    m = re.fullmatch(r"#\s*([A-Za-z_]\w*\.py)", first)
    return m.group(1) if m else None


SAMPLES = [pytest.param(doc, line, code, id=f"{doc}:{line}") for doc in DOCS for line, code in blocks(doc)]


def _run(code: str, cwd: Path, timeout: float = 45.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT / "examples")]),
           "SWARMTRAIN_RUNS_DIR": str(cwd / "runs")}
    env.pop("SWARMTRAIN_SECRET", None)  # the samples must not depend on the caller's secret
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_doc_has_samples() -> None:
    assert {doc for doc, *_ in (p.values for p in SAMPLES)} == set(DOCS)


@pytest.mark.parametrize(("doc", "line", "code"), SAMPLES)
def test_sample_runs_as_printed(doc: str, line: int, code: str, tmp_path: Path) -> None:
    for _, earlier in blocks(doc):  # modules the doc asks you to save
        name = _module_name(earlier)
        if name:
            (tmp_path / name).write_text(earlier)
    if "model.safetensors" in code:  # what a coordinator run exports (README: "Using the trained model")
        from swarmtrain.app.export import export_model
        from swarmtrain.tasks import load_task

        export_model(load_task("digits").build_model(5), tmp_path / "model.safetensors", task="digits")
    done = _run(code, tmp_path)
    assert done.returncode == 0, f"{doc}:{line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_spiral_task_reads_the_file_the_jsonl_sample_writes(tmp_path: Path) -> None:
    """python-api.md's task and its data file, together as the CLI would use them."""
    samples = blocks("docs/python-api.md")
    task_code = next(code for _, code in samples if _module_name(code) == "spiral_task.py")
    writer = next(code for _, code in samples if "spiral.jsonl" in code and "make_spiral" in code)
    (tmp_path / "spiral_task.py").write_text(task_code)
    assert _run(writer, tmp_path).returncode == 0
    check = ("from swarmtrain.tasks import load_task\n"
             "task = load_task('spiral_task:make_task')\n"
             "data = task.load_data('spiral.jsonl')\n"
             "model = task.build_model(0)\n"
             "assert (len(data.train), len(data.heldout)) == (4000, 1000)\n"
             "metrics = task.evaluate(model, data)\n"
             "assert set(metrics) >= {'accuracy', 'loss'}, metrics\n")
    done = _run(check, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
