"""Small helpers for running several nodes inside one process on loopback (tests and
benchmarks): free ports, and functions run side by side in threads."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmtrain.peer.node import PeerTrainer

__all__ = ["free_ports", "in_threads", "run_peer_trainers"]


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


def run_peer_trainers(trainers: Sequence[PeerTrainer], timeout: float = 60, *, wait: float = 30) -> None:
    """Start every trainer's backend, wait until each sees all the others (``wait`` seconds),
    run the trainers side by side in threads (a trainer's error is re-raised here) and close
    every backend, whatever happened."""
    backends = [t.backend for t in trainers]
    try:
        for b in backends:
            b.start()
        for b in backends:
            b.wait_for_peers(len(backends) - 1, timeout=wait)
        in_threads([t.run for t in trainers], timeout, what="a peer's training")
    finally:
        for b in backends:
            b.close()
