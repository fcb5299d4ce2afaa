"""How every command stops on a signal and keeps its status file.

Signals: the first SIGINT or SIGTERM asks the command to stop cleanly (finish or abandon the
step in flight, write the last checkpoint and status) and logs that a second one forces it;
the second ends the process at once, killed by that signal as if nothing had handled it (so
``kill`` twice, or Ctrl-C twice, always works, even when the clean stop hangs on a dead
peer). :func:`graceful_signals` installs this the same way for asyncio commands
and for synchronous ones (the peer), and works even while the clean stop blocks the loop.

Status files: :func:`write_status_file` replaces the file with a JSON snapshot atomically
(:func:`~swarmtrain.fsutil.write_atomic`), so ``ctl status`` or a script reading it never
sees half of one; :func:`keep_status_file` does that every ``interval`` seconds until it is
cancelled, logging (not raising) a failed write, so a full disk does not stop training.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from swarmtrain.fsutil import FileWriteError, write_atomic

__all__ = ["SIGNALS", "GracefulSignals", "graceful_signals", "keep_status_file", "write_status_file"]

log = logging.getLogger("swarmtrain.app")

#: the signals that stop a command
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulSignals:
    """SIGINT/SIGTERM handlers: the first signal calls ``on_stop``, the second kills.

    Made by :func:`graceful_signals`; :meth:`restore` (or leaving its ``with`` block) puts
    the previous handlers back.

    The handlers are ``signal.signal`` ones even for an asyncio command (``on_stop`` is then
    handed to the loop with ``call_soon_threadsafe``, which wakes it): a handler the loop
    runs (``loop.add_signal_handler``) would not run while the clean stop blocks the loop,
    and the second signal must work exactly then.

    Attributes:
        received: the signals received so far, in order.
    """

    def __init__(self, on_stop: Callable[[signal.Signals], object], what: str,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self._on_stop = on_stop
        self._what = what
        self._loop = loop
        self._previous: dict[signal.Signals, Any] = {}
        self.received: list[signal.Signals] = []

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # only the main thread receives signals (and may install handlers): a command
            # run from another thread (a test, an embedding program) is stopped by its caller
            log.debug("not installing signal handlers outside the main thread")
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._loop is not None and self._loop.is_closed():
            # the command's loop is over: as if these handlers were gone (as the loop's own
            # are when it closes), the previous handler takes the signal
            self.restore()
            signal.raise_signal(sig)
            return
        self.received.append(sig)
        if len(self.received) == 1:
            log.warning("received %s: %s; send it again to stop at once", sig.name, self._what)
            if self._loop is not None:  # asyncio state is only touched from the loop itself
                self._loop.call_soon_threadsafe(self._on_stop, sig)
            else:
                self._on_stop(sig)
            return
        log.warning("received %s again: stopping at once", sig.name)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    def restore(self) -> None:
        """Put back the handlers that were there before (idempotent)."""
        for sig, previous in self._previous.items():
            # None: a handler installed from outside Python, which cannot be put back
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def __enter__(self) -> GracefulSignals:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore()


def graceful_signals(on_stop: Callable[[signal.Signals], object], *, what: str = "stopping cleanly",
                     loop: asyncio.AbstractEventLoop | None = None) -> GracefulSignals:
    """Install SIGINT/SIGTERM handling: the first signal logs and calls ``on_stop(signal)``,
    a second one ends the process at once (killed by that signal).

    Args:
        on_stop: starts the clean stop; it must return quickly (set an event, cancel a task,
            ask the role to shut down). With ``loop`` it runs in the event loop; without,
            in the main thread between two Python instructions (so only set flags there).
            It is called at most once.
        what: what the clean stop does, for the log line (``"finishing the step in flight"``).
        loop: the running event loop of an asyncio command; None for a synchronous one.

    Returns:
        The installed handlers; ``restore()`` them when the command is done. Outside the
        main thread nothing is installed (signals only reach the main thread).
    """
    handlers = GracefulSignals(on_stop, what, loop)
    handlers._install()
    return handlers


def write_status_file(path: str | os.PathLike[str], status: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``status`` as JSON, atomically (values JSON lacks become strings).

    Not fsynced: a status file is rewritten every second and a lost one costs nothing, while
    the rename alone keeps readers from ever seeing a partial file.

    Raises:
        FileWriteError: the file cannot be written (it is unchanged).
    """
    write_atomic(path, json.dumps(status, default=str), fsync=False)


async def keep_status_file(path: str | os.PathLike[str], snapshot: Callable[[], Mapping[str, Any]],
                           *, interval: float = 1.0) -> None:
    """Write ``snapshot()`` to ``path`` now and every ``interval`` seconds, until cancelled.

    A failed write is logged (once when a streak of failures starts, once when the file is
    written again) and retried at the next interval; it never ends the loop.
    """
    target = Path(path)
    failing = False
    while True:
        try:
            write_status_file(target, snapshot())
        except FileWriteError as exc:
            if not failing:
                log.warning("status file: %s; retrying every %g s", exc, interval)
            failing = True
        else:
            if failing:
                log.info("status file %s written again", target)
            failing = False
        await asyncio.sleep(interval)
