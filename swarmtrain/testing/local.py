"""Small helpers for running several nodes inside one process on loopback (tests and
benchmarks): free ports, and functions run side by side in threads."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmtrain.roles.peer.node import PeerTrainer

__all__ = ["free_ports", "in_threads", "run_peer_trainers"]


#: where :func:`free_ports` hands ports out: below the kernel's ephemeral range (32768-60999
#: by default: where every process's port-0 listeners and outgoing connections land). A port
#: picked there and bound a moment later can be taken in between by any connection (a parallel
#: test run lost a peer's port so); below it only this helper allocates.
PORT_RANGE = (20000, 32768)
_SLICE = 1000
_cursor: list[int] = []  # [slice start, next offset in it]
_port_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return PORT_RANGE[1]


def _my_slice() -> list[int]:
    """This process's slice of the range, one per pytest-xdist worker (``gw3``: the fourth;
    else by pid), and a starting offset in it from the pid (so a child process starts elsewhere)."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low())
    slices = max(1, (high - low) // _SLICE)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else os.getpid()
    return [low + (index % slices) * _SLICE, (os.getpid() * 7919) % _SLICE]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports of 127.0.0.1 that were free a moment ago and that no other caller
    of this function gets soon: taken in turn from this process's slice of :data:`PORT_RANGE`
    (outside the ephemeral range, so no port-0 listener or outgoing connection takes one
    before its user binds it), each checked by binding it.

    Raises:
        OSError: the slice has not ``n`` free ports.
    """
    out: list[int] = []
    with _port_lock:
        if not _cursor:
            _cursor.extend(_my_slice())
        start = _cursor[0]
        for _ in range(_SLICE):
            if len(out) == n:
                break
            port = start + _cursor[1]
            _cursor[1] = (_cursor[1] + 1) % _SLICE
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            out.append(port)
    if len(out) < n:
        raise OSError(f"no {n} free ports of 127.0.0.1 in {start}-{start + _SLICE - 1}")
    return out


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
