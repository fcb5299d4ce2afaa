"""The ops HTTP port under load (issue 17, must-have 5): past its connection cap every client
gets a whole 503, never a reset; an oversized request line gets its 414 whole; and however
many requests arrive, the node's status is built once per snapshot."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from swarmtrain.app.ops import HttpLimits, HttpServer
from swarmtrain.app.ops.http import Response
from swarmtrain.app.ops.metrics import CoordinatorCollector
from swarmtrain.app.ops.serve import routes_for

pytestmark = pytest.mark.timeout(120)


def _exchange(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    """Send ``data`` (without half-closing, as browsers and curl do) and read the whole answer;
    a reset raises ConnectionResetError."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def _whole(answer: bytes) -> tuple[int, bytes]:
    """(status, body) of a complete HTTP answer (its body as long as Content-Length says)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    assert sep, f"no complete head: {answer[:200]!r}"
    lines = head.decode("ascii").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    assert len(body) == length, (len(body), length, lines[0])
    return int(lines[0].split(" ")[1]), body


def _serve(routes: dict[str, Any], limits: HttpLimits, job: Any, answered: Counter[int] | None = None) -> Any:
    """Run ``job(port)`` in a thread while ``routes`` are served on this thread's loop."""
    async def main() -> Any:
        server = HttpServer(routes, limits, answered=answered)
        await server.start("127.0.0.1", 0)
        try:
            loop = asyncio.get_running_loop()
            return await asyncio.wait_for(loop.run_in_executor(None, job, server.port), 90)
        finally:
            await server.close()

    return asyncio.run(main())


def test_clients_past_the_cap_get_a_whole_503_and_none_a_reset() -> None:
    release = threading.Event()

    async def slow() -> Response:  # holds its connection until many more have arrived
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return 200, "text/plain", b"slow but fine\n" * 100

    clients = 96

    def job(port: int) -> list[bytes | BaseException]:
        def one(_: int) -> bytes | BaseException:
            try:
                return _exchange(port, b"GET /slow HTTP/1.1\r\nHost: x\r\nUser-Agent: t\r\n\r\n")
            except OSError as exc:
                return exc

        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(one, i) for i in range(clients)]
            threading.Timer(2.0, release.set).start()
            return [f.result(60) for f in futures]

    answered: Counter[int] = Counter()
    answers = _serve({"/slow": slow}, HttpLimits(max_connections=4, max_requests_per_sec=1000), job, answered)
    failures = [a for a in answers if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    statuses = [_whole(a)[0] for a in answers if isinstance(a, bytes)]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 4, sorted(set(statuses))
    assert statuses.count(503) >= clients - 4 * 4  # the cap held (a few may be served after release)
    assert answered == Counter(statuses)  # what /metrics shows as swarmtrain_http_responses_total


def test_oversized_request_lines_and_heads_get_their_status_whole() -> None:
    async def ok() -> Response:
        return 200, "text/plain", b"fine\n"

    def job(port: int) -> dict[str, tuple[int, bytes]]:
        return {name: _whole(_exchange(port, data)) for name, data in [
            ("line_1mib", b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("line_3kib", b"GET /" + b"a" * 3072 + b" HTTP/1.1\r\n\r\n"),
            ("head_20kib", b"GET /ok HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20480 + b"\r\n\r\n"),
            ("ok", b"GET /ok HTTP/1.1\r\n\r\n"),
        ]}

    got = _serve({"/ok": ok}, HttpLimits(), job)
    assert got["line_1mib"][0] == 414 and b"request line" in got["line_1mib"][1]
    assert got["line_3kib"][0] == 414
    assert got["head_20kib"][0] == 431
    assert got["ok"] == (200, b"fine\n")


def test_a_flood_of_requests_builds_the_status_once_per_snapshot() -> None:
    built = [0]

    def status() -> dict[str, Any]:
        built[0] += 1
        return {"version": built[0], "loss": 0.5, "refusals": {"auth_failed": 3}, "workers": []}

    routes = routes_for("coordinator", status, CoordinatorCollector, history=None, max_age=3600)

    def job(port: int) -> list[tuple[int, bytes]]:
        with ThreadPoolExecutor(8) as pool:
            paths = ["/api/status", "/metrics"] * 50
            return list(pool.map(lambda p: _whole(_exchange(port, f"GET {p} HTTP/1.1\r\n\r\n".encode())),
                                 paths))

    answers = _serve(routes, HttpLimits(max_connections=64, max_requests_per_sec=1000), job)
    assert all(code == 200 for code, _ in answers)
    assert built[0] == 1  # 100 requests, one snapshot
    statuses = [json.loads(body) for code, body in answers if body.startswith(b"{")]
    assert len(statuses) == 50 and all(st["version"] == 1 for st in statuses)
    assert any(b'swarmtrain_refusals_total{reason="auth_failed"} 3.0' in body for _, body in answers)
