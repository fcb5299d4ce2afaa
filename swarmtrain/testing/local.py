"""Small helpers for running several nodes inside one process on loopback (tests and
benchmarks): free ports, and functions run side by side in threads."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["free_ports", "in_threads"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports of 127.0.0.1 free a moment ago (all bound at once, so none comes
    back twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def in_threads(fns: Sequence[Callable[[], Any]], timeout: float = 60, what: str = "a peer") -> list[Any]:
    """Run each function in its own thread and return their results; the first exception
    one raised is re-raised here.

    Raises:
        TimeoutError: a function was still running after ``timeout`` seconds (``what`` names
            it in the message).
    """
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{what} was still running after {timeout} s")
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
