"""Writing files so that a reader, or a crash, never sees half of one.

Every file swarmtrain writes for someone else to read (status files, exported models, plots,
port files, identity keys, certificates) goes through :func:`write_atomic` or
:func:`create_atomic`: the bytes go to a temporary file in the same directory, are flushed
and (by default) fsynced, and the temporary file is renamed over the target (or, for
:func:`create_atomic`, hard-linked to it, which never replaces an existing file), then the
directory is fsynced so the new name survives a power cut too. A reader sees the old file
or the new one, never a mixture; a failure (a full disk, a read-only directory) leaves the
old file as it was, removes the temporary file and raises :class:`FileWriteError`, which
names the path and says what to do.

Checkpoints (:mod:`swarmtrain.core.checkpoint`) are directories made atomic by renaming a
whole temporary directory; the files inside it are written with :func:`write_new_file` and
the directories synced with :func:`fsync_directory`.

This module sits in the lowest layer (with :mod:`swarmtrain.errors`): the transport writes
identity keys and certificates with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from swarmtrain.errors import SwarmError

__all__ = ["FileWriteError", "create_atomic", "fsync_directory", "write_atomic", "write_new_file"]

_HINT = "free disk space, fix the directory's permissions, or choose another path"

Writer = Callable[[BinaryIO], object]
"""Writes a file's contents to the open binary file it is given (``fig.savefig``, a JSON
dump...): for contents streamed rather than held in memory."""


class FileWriteError(SwarmError, OSError):
    """A file could not be written (disk full, no permission, no such directory).

    It is an :class:`OSError` too, so code that already handled a failed write still does.

    Attributes:
        path: the file that was being written.
    """

    def __init__(self, path: Path, cause: OSError) -> None:
        reason = cause.strerror or str(cause) or type(cause).__name__
        super().__init__(cause.errno, f"cannot write {path}: {reason}; {_HINT}")
        self.path = path

    def __str__(self) -> str:
        return str(self.args[1])


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Writer, *, fsync: bool = True,
                 mode: int | None = None) -> Path:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one.

    Args:
        path: the file to write; its directory must exist. An existing file is replaced.
        data: the contents: bytes, text (written as UTF-8), or a function that writes them to
            the open binary file it is given.
        fsync: also flush the file and its directory to the disk before returning, so the
            new contents survive a crash or power cut. Files rewritten every second whose
            loss costs nothing (status files) pass False: the rename alone already keeps
            readers from seeing a partial file.
        mode: the file's permission bits (e.g. ``0o600`` for a secret), set before any byte
            is written; by default those of a new file under the umask.

    Returns:
        The path written.

    Raises:
        FileWriteError: the file could not be written; ``path`` is unchanged and no
            temporary file is left behind.
    """
    target = Path(path)
    _write_via_temp(target, data, fsync=fsync, mode=mode, exclusive=False)
    return target


def create_atomic(path: str | os.PathLike[str], data: bytes | str | Writer, *, fsync: bool = True,
                  mode: int | None = None) -> bool:
    """Create ``path`` holding ``data`` unless it exists: readers see no file or a whole one.

    The temporary file is hard-linked to ``path`` (a link never replaces a file), so of two
    processes creating the same file at once exactly one wins and the other gets False.

    Args:
        path, data, fsync, mode: as for :func:`write_atomic`.

    Returns:
        True if this call created ``path``; False if it existed already (it is unchanged).

    Raises:
        FileWriteError: the file could not be written (no temporary file is left behind).
    """
    return _write_via_temp(Path(path), data, fsync=fsync, mode=mode, exclusive=True)


def write_new_file(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path``, which must not exist, flushed and (by default) fsynced.

    Not atomic by itself: for files inside a temporary directory that is renamed into place
    afterwards (a checkpoint), where a partial file is never seen under the final name.

    Raises:
        OSError: the file exists (:class:`FileExistsError`) or cannot be written; the caller
            removes its temporary directory.
    """
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (files created, renamed or removed in it) to the disk.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_via_temp(target: Path, data: bytes | str | Writer, *, fsync: bool, mode: int | None,
                    exclusive: bool) -> bool:
    # unique per process and call: two writers of one file never share a temporary file
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    created = True
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o666 if mode is None else mode)
            with os.fdopen(fd, "wb") as f:
                if mode is not None:
                    os.fchmod(f.fileno(), mode)  # exactly these bits, whatever the umask
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, target)
                except FileExistsError:
                    created = False
            else:
                os.replace(tmp, target)
            if fsync and created:
                fsync_directory(target.parent)
        finally:
            # after a replace this name is gone; after a link (or any failure) it is removed
            _remove(tmp)
    except OSError as exc:
        if isinstance(exc, FileWriteError):
            raise
        raise FileWriteError(target, exc) from exc
    return created


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # a directory we can no longer write to: nothing more can be done about it
