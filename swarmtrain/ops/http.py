"""A tiny read-only HTTP/1.1 server on asyncio for metrics and the dashboard.

It answers GET (and HEAD) on a fixed table of paths and nothing else: one request per
connection, no keep-alive, no request bodies. Every limit a remote client could push on is
capped (request line, header block, concurrent connections, time to send the request), so
the port cannot become a weak spot of the node it runs in: a bad request gets 400, an unknown
path 404, and a handler that fails gets 500 while the server goes on serving.

Request parsing (:func:`parse_request_head`) does no I/O, so it is tested without sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from swarmtrain.errors import SwarmError

__all__ = ["BadRequest", "Handler", "HttpLimits", "HttpServer", "Response", "Routes",
           "ThreadedHttpServer", "parse_request_head"]

log = logging.getLogger("swarmtrain.ops")

Response = tuple[int, str, bytes]
"""``(status, content_type, body)`` returned by a route handler."""

Handler = Callable[[], Awaitable[Response]]
"""A route: called with no arguments for each GET of its path (the query string is ignored)."""

Routes = dict[str, Handler]
"""Exact paths (``"/metrics"``) to their handlers."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(frozen=True)
class HttpLimits:
    """What one client may ask of the server.

    Attributes:
        max_request_line: bytes of ``GET /path HTTP/1.1`` at most (longer: 414).
        max_head_bytes: bytes of request line plus headers at most (more: 431).
        read_timeout: seconds a client has to send its whole request head (then 408).
        write_timeout: seconds the answer may take to drain to the client.
        max_connections: connections served at once; more are answered 503 at once.
    """

    max_request_line: int = 2048
    max_head_bytes: int = 16384
    read_timeout: float = 5.0
    write_timeout: float = 10.0
    max_connections: int = 32


class BadRequest(SwarmError):
    """The client sent something that is not a request this server accepts (its fault)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request_head(head: bytes, limits: HttpLimits = HttpLimits()) -> tuple[str, str]:
    """``(method, path)`` of a complete request head (up to and including the blank line).

    The path loses its query string and fragment. Headers are checked for shape only.

    Raises:
        BadRequest: with the status to answer (400, 405, 414 or 431).
    """
    if len(head) > limits.max_head_bytes:
        raise BadRequest(431, f"request head over {limits.max_head_bytes} bytes")
    line, _, rest = head.partition(b"\r\n")
    if len(line) > limits.max_request_line:
        raise BadRequest(414, f"request line over {limits.max_request_line} bytes")
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "request line is not ASCII") from None
    parts = text.split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper():
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(400, f"unsupported protocol {version[:16]!r}")
    if not target.startswith("/") or any(c <= " " or c == "\x7f" for c in target):
        raise BadRequest(400, "request target must be an absolute path")
    for header in rest.split(b"\r\n"):
        if header and (b":" not in header or header[:1] in (b" ", b"\t")):
            raise BadRequest(400, "malformed header line")
    if method not in ("GET", "HEAD"):
        raise BadRequest(405, f"method {method} not allowed (this server is read-only)")
    return method, target.split("?", 1)[0].split("#", 1)[0]


def _render(status: int, content_type: str, body: bytes, *, head_only: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}",
             f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
             "Cache-Control: no-store", "X-Content-Type-Options: nosniff", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("ascii") + (b"" if head_only else body)


class HttpServer:
    """Serves ``routes`` (path -> handler) on the running event loop.

    Args:
        routes: exact paths (``"/metrics"``) to their handlers.
        limits: see :class:`HttpLimits`.
        background: coroutine functions run as tasks from :meth:`start` to :meth:`close`
            (e.g. a sampler keeping the history the dashboard starts from).
    """

    def __init__(self, routes: Mapping[str, Handler], limits: HttpLimits = HttpLimits(),
                 background: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        self.routes = dict(routes)
        self.limits = limits
        self.background = list(background)
        self._background_tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.Server | None = None
        self._active: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port listened on.

        Raises:
            SwarmError: not started.
        """
        if self._server is None or not self._server.sockets:
            raise SwarmError("the HTTP server is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (0 = any free port).

        Raises:
            SwarmError: the address cannot be bound.
        """
        try:
            self._server = await asyncio.start_server(
                self._accept, host, port, limit=self.limits.max_head_bytes, reuse_address=True)
        except OSError as exc:
            raise SwarmError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}; "
                             "choose another --http-port") from exc
        self._background_tasks = [asyncio.ensure_future(fn()) for fn in self.background]
        log.info("serving %s over HTTP on %s:%d", ", ".join(sorted(self.routes)), host, self.port)

    async def close(self) -> None:
        """Stop listening and end the requests being served."""
        if self._server is not None:
            self._server.close()
        tasks = [*self._active, *self._background_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        try:
            if len(self._active) > self.limits.max_connections:
                await self._write(writer, _render(503, "text/plain", b"too many connections\n"))
            else:
                await self._write(writer, await self._answer(reader))
        finally:
            self._active.discard(task)
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(1):
                    await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> bytes:
        try:
            async with asyncio.timeout(self.limits.read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path = parse_request_head(head, self.limits)
        except TimeoutError:
            return self._refuse(408, "request not received in time")
        except asyncio.LimitOverrunError:
            return self._refuse(431, f"request head over {self.limits.max_head_bytes} bytes")
        except asyncio.IncompleteReadError:
            return self._refuse(400, "connection closed before the request head ended")
        except BadRequest as exc:
            return self._refuse(exc.status, str(exc))
        handler = self.routes.get(path)
        if handler is None:
            paths = ", ".join(sorted(self.routes))
            return _render(404, "text/plain", f"no such path; try {paths}\n".encode())
        try:
            status, content_type, body = await handler()
        except Exception:  # a failing page must not take the server down
            log.exception("HTTP handler for %s failed", path)
            return _render(500, "text/plain", b"internal error; see the node's log\n")
        return _render(status, content_type, body, head_only=method == "HEAD")

    def _refuse(self, status: int, why: str) -> bytes:
        return _render(status, "text/plain", (why + "\n").encode())

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(data)
            async with asyncio.timeout(self.limits.write_timeout):
                await writer.drain()


class ThreadedHttpServer:
    """An :class:`HttpServer` on an event loop of its own in a daemon thread, for nodes whose
    loop must not wait on page rendering (a peer's control loop answers heartbeats).

    Args:
        routes: as for :class:`HttpServer`; handlers run on the server's thread.
        limits: see :class:`HttpLimits`.
    """

    def __init__(self, routes: Mapping[str, Handler], limits: HttpLimits = HttpLimits(),
                 background: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        self.http = HttpServer(routes, limits, background)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-http", daemon=True)

    @property
    def port(self) -> int:
        return self.http.port

    def start(self, host: str, port: int, timeout: float = 10.0) -> None:
        """Start the thread and listen (returns once listening).

        Raises:
            SwarmError: the address cannot be bound.
        """
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.http.start(host, port), self._loop).result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving and end the thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(TimeoutError):
            asyncio.run_coroutine_threadsafe(self.http.close(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
