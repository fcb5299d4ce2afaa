"""The one atomic file writer (swarmtrain.fsutil): a reader or a failure never sees half a file."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import BinaryIO

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.fsutil import FileWriteError, create_atomic, fsync_directory, write_atomic, write_new_file


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_writes_bytes_text_and_streamed_contents(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a.bin", b"\x00\x01")
    write_atomic(tmp_path / "b.txt", "héllo")

    def stream(f: BinaryIO) -> None:
        for i in range(3):
            f.write(f"line {i}\n".encode())

    assert write_atomic(tmp_path / "c.txt", stream) == tmp_path / "c.txt"
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "c.txt").read_text() == "line 0\nline 1\nline 2\n"
    assert _names(tmp_path) == ["a.bin", "b.txt", "c.txt"]  # no temporary file left


def test_replaces_an_existing_file_and_sets_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_text("old")
    old_umask = os.umask(0o077)
    try:
        write_atomic(target, "new", mode=0o640, fsync=False)
    finally:
        os.umask(old_umask)
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # exactly, whatever the umask


def test_a_writer_failing_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "status.json"
    target.write_text('{"old": true}')

    def half_then_full_disk(f: BinaryIO) -> None:
        f.write(b'{"new": ')
        f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(FileWriteError) as caught:
        write_atomic(target, half_then_full_disk)
    assert target.read_text() == '{"old": true}'
    assert _names(tmp_path) == ["status.json"]
    err = caught.value
    assert isinstance(err, SwarmError) and isinstance(err, OSError)  # old `except OSError` still works
    assert err.errno == errno.ENOSPC and err.path == target
    assert str(target) in str(err) and "free disk space" in str(err)


def test_a_writer_raising_something_else_propagates_it_and_cleans_up(tmp_path: Path) -> None:
    def not_serialisable(f: BinaryIO) -> None:
        f.write(b"partial")
        raise TypeError("not JSON serialisable")

    with pytest.raises(TypeError, match="not JSON"):
        write_atomic(tmp_path / "x.json", not_serialisable)
    assert _names(tmp_path) == []


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(FileWriteError, match="fix the directory's permissions"):
        write_atomic(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert _names(tmp_path) == ["model.safetensors"]


def test_a_missing_directory_is_a_typed_error_naming_the_path(tmp_path: Path) -> None:
    target = tmp_path / "nowhere" / "status.json"
    with pytest.raises(FileWriteError, match=str(target)) as caught:
        write_atomic(target, "{}")
    assert caught.value.errno == errno.ENOENT


def test_create_atomic_never_replaces_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "identity.key"
    assert create_atomic(target, b"first", mode=0o600) is True
    assert create_atomic(target, b"second", mode=0o600) is False
    assert target.read_bytes() == b"first"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _names(tmp_path) == ["identity.key"]


def test_create_atomic_from_many_threads_has_exactly_one_winner(tmp_path: Path) -> None:
    target = tmp_path / "key"
    results: list[bool] = []
    barrier = threading.Barrier(8, timeout=30)

    def race(i: int) -> None:
        barrier.wait()
        results.append(create_atomic(target, f"writer {i}".encode(), fsync=False))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == [False] * 7 + [True]
    assert target.read_bytes().startswith(b"writer ")
    assert _names(tmp_path) == ["key"]


def test_write_new_file_refuses_an_existing_file(tmp_path: Path) -> None:
    write_new_file(tmp_path / "meta.json", b"{}")
    fsync_directory(tmp_path)
    with pytest.raises(FileExistsError):
        write_new_file(tmp_path / "meta.json", b"{}")
    assert (tmp_path / "meta.json").read_bytes() == b"{}"


_FULL_DISK = textwrap.dedent("""
    import json, os, subprocess, sys
    from pathlib import Path
    from swarmtrain.fsutil import FileWriteError, write_atomic

    mnt = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    target = mnt / "status.json"
    write_atomic(target, json.dumps({"old": True}))
    try:
        write_atomic(target, json.dumps({"new": "x" * 1_000_000}))
        outcome = "written"
    except FileWriteError as exc:
        outcome = f"{exc.errno} {exc}"
    print(json.dumps({"outcome": outcome, "content": target.read_text(), "names": sorted(os.listdir(mnt))}))
""")


def test_a_really_full_disk_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    """A 64 KiB tmpfs, mounted in a private mount namespace (root), fills up mid-write."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", _FULL_DISK,
                        str(mnt)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, f"cannot run in a private mount namespace (needs root): {r.stderr}"
    seen = json.loads(r.stdout)
    assert seen["outcome"].startswith(f"{errno.ENOSPC} ")
    assert "status.json" in seen["outcome"] and "free disk space" in seen["outcome"]
    assert json.loads(seen["content"]) == {"old": True}
    assert seen["names"] == ["status.json"]
