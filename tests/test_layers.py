"""The package's layers (docs/architecture.md): a module imports only from its own layer or
the ones below it, and the three modes' roles do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "swarmtrain"

# lowest first; a module may import from its own rank or a lower one
LAYERS: list[tuple[str, ...]] = [
    ("swarmtrain.errors", "swarmtrain.fsutil"),
    ("swarmtrain.wire",),
    ("swarmtrain.transport",),
    ("swarmtrain.compression",),
    ("swarmtrain.core", "swarmtrain.tasks", "swarmtrain.config"),
    ("swarmtrain.roles",),
    ("swarmtrain.app",),
    ("swarmtrain.testing",),
]
# the modes' roles: none imports another's (shared pieces live in swarmtrain.roles itself)
MODES = ("swarmtrain.roles.ps", "swarmtrain.roles.peer", "swarmtrain.roles.stage")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rank(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None  # the package root (lazy facade, __version__) and __main__


def _mode(module: str) -> str | None:
    return next((m for m in MODES if module == m or module.startswith(m + ".")), None)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every swarmtrain module the file imports, anywhere in it (TYPE_CHECKING blocks and
    function bodies included), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("swarmtrain")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("swarmtrain"):
            # "from swarmtrain.x import y" may name a module y: count the deeper name when it is one
            for alias in node.names:
                deeper = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / deeper.replace(".", "/")).with_suffix(".py").exists() \
                    or (PACKAGE.parent / deeper.replace(".", "/")).is_dir()
                found.append((node.lineno, deeper if is_module else node.module))
    return sorted(set(found))


def _violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        my_rank, my_mode = _rank(me), _mode(me)
        if my_rank is None:
            continue
        for line, target in _imports(path):
            rank = _rank(target)
            if rank is None:  # the package root: only its light __version__ / lazy names
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} ({me}) imports {target}"
            if rank > my_rank:
                problems.append(f"{where}: upward, from layer {LAYERS[my_rank][0]} to {LAYERS[rank][0]}")
            mode = _mode(target)
            if my_mode and mode and mode != my_mode:
                problems.append(f"{where}: sideways between the roles of two modes")
    return problems


def test_no_module_imports_from_a_layer_above_it_or_another_modes_roles() -> None:
    problems = _violations()
    assert not problems, "\n".join(problems)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a wire module importing a role must be reported (the check is not vacuous)
    fake = tmp_path / "swarmtrain"
    (fake / "wire").mkdir(parents=True)
    (fake / "roles" / "ps").mkdir(parents=True)
    (fake / "roles" / "ps" / "coordinator.py").write_text("")
    (fake / "roles" / "peer").mkdir(parents=True)
    (fake / "wire" / "bad.py").write_text("from swarmtrain.roles.ps import coordinator\n")
    (fake / "roles" / "peer" / "x.py").write_text("import swarmtrain.roles.ps.coordinator\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake, raising=False)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    problems = _violations()
    assert any("wire/bad.py:1" in p and "upward" in p for p in problems), problems
    assert any("roles/peer/x.py:1" in p and "sideways" in p for p in problems), problems
