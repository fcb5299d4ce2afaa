"""A flood of HTTP GETs from its own process (used by bench_http_load.py; no torch import).

    python benchmarks/_http_flood.py PORT PATH THREADS

Reads commands on stdin, one a line: ``on`` starts the flood, ``off`` pauses it, ``quit``
ends it. While on, each thread opens a connection, sends one GET, reads the answer to the
end and starts again. After each ``off`` and at ``quit`` prints one JSON line for the
stretch just flooded: requests answered by status code, transport errors by kind (a reset
is what must never happen), its seconds, and the process's CPU seconds in it.
"""

from __future__ import annotations

import json
import resource
import socket
import sys
import threading
import time
from collections import Counter


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(port: int, path: str, threads: int) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    lock = threading.Lock()
    on = threading.Event()
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            if not on.wait(0.1):
                continue
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    s.sendall(request)
                    chunks = []
                    while chunk := s.recv(65536):
                        chunks.append(chunk)
                answer = b"".join(chunks)
                ok = answer.startswith(b"HTTP/1.1 ")
                with lock:
                    statuses[answer[9:12].decode("ascii", "replace") if ok else "garbled"] += 1
            except OSError as exc:
                with lock:
                    errors[type(exc).__name__] += 1

    workers = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    started, cpu = time.monotonic(), _cpu()
    for line in sys.stdin:
        command = line.strip()
        if command == "on":
            with lock:
                statuses.clear()
                errors.clear()
            started, cpu = time.monotonic(), _cpu()
            on.set()
        elif command in ("off", "quit"):
            on.clear()
            time.sleep(0.05)  # let the requests under way finish
            with lock:
                report = {"seconds": time.monotonic() - started, "statuses": dict(statuses),
                          "errors": dict(errors), "cpu_sec": _cpu() - cpu}
            print(json.dumps(report), flush=True)
            if command == "quit":
                break
    done.set()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
