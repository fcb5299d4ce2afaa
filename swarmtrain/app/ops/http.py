"""A tiny read-only HTTP/1.1 server on asyncio for metrics and the dashboard.

It answers GET (and HEAD) on a fixed table of paths and nothing else: one request per
connection, no keep-alive, no request bodies. Every limit a remote client could push on is
capped (request line, header block, concurrent connections, time to send the request,
requests accepted per second), so the port cannot become a weak spot of the node it runs
in: a bad request gets 400, a too long request line 414, a too big head 431, an unknown path
404, a connection past the cap 503, and a handler that fails gets 500 while the server goes
on serving.

Every client gets a whole answer, never a reset. A reset is what the kernel sends when a
socket is closed with bytes it has not read, and it may destroy the answer on its way; so
after answering, the server half-closes (FIN), reads and discards what the client still
sends (up to :attr:`HttpLimits.max_discard_bytes`, for :attr:`HttpLimits.linger_sec`) and
closes once the client has. Accepting is paced (:attr:`HttpLimits.max_requests_per_sec`,
with a burst of ``max_connections``): under a flood, connections wait in the listen backlog
instead of taking the node's event loop from its real work.

Request parsing (:func:`parse_request_head`) does no I/O, so it is tested without sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from swarmtrain.errors import SwarmError

__all__ = ["BadRequest", "Handler", "HttpLimits", "HttpServer", "Response", "Routes",
           "ThreadedHttpServer", "parse_request_head"]

log = logging.getLogger("swarmtrain.app.ops")

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
        max_requests_per_sec: connections accepted per second at most, after a burst of
            ``max_connections`` (more wait in the listen backlog: a flood of requests costs
            the node a bounded share of its event loop).
        backlog: connections the kernel queues for accepting.
        linger_sec: after answering, how long the server waits for the client to close,
            discarding what it still sends (so that closing does not reset the answer).
        max_discard_bytes: bytes discarded at most after answering (then the connection is
            closed, and a client still sending may see a reset).
    """

    max_request_line: int = 2048
    max_head_bytes: int = 16384
    read_timeout: float = 5.0
    write_timeout: float = 10.0
    max_connections: int = 32
    max_requests_per_sec: float = 100.0
    backlog: int = 1024
    linger_sec: float = 2.0
    max_discard_bytes: int = 4 << 20


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
        answered: where to count the answers sent by status code (e.g. one that the node's
            ``/metrics`` reads); a new one by default.
    """

    def __init__(self, routes: Mapping[str, Handler], limits: HttpLimits = HttpLimits(),
                 background: Sequence[Callable[[], Awaitable[None]]] = (),
                 answered: Counter[int] | None = None) -> None:
        self.routes = dict(routes)
        self.limits = limits
        self.background = list(background)
        #: answers sent, by status code (``503``: busy, ``414``, ``431``, ``408``...)
        self.answered: Counter[int] = answered if answered is not None else Counter()
        self._background_tasks: list[asyncio.Task[None]] = []
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        #: connections reading their request or running its handler (what max_connections caps)
        self._serving: set[_HttpConnection] = set()
        #: every open connection, lingering ones too
        self._open: set[_HttpConnection] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port listened on.

        Raises:
            SwarmError: not started.
        """
        if self._sock is None:
            raise SwarmError("the HTTP server is not listening")
        return int(self._sock.getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (0 = any free port).

        Raises:
            SwarmError: the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_PASSIVE)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(self.limits.backlog)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            raise SwarmError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}; "
                             "choose another --http-port") from exc
        self._sock = sock
        self._accepting = loop.create_task(self._accept_loop(sock))
        self._background_tasks = [asyncio.ensure_future(fn()) for fn in self.background]
        log.info("serving %s over HTTP on %s:%d", ", ".join(sorted(self.routes)), host, self.port)

    async def close(self) -> None:
        """Stop listening and end the requests being served."""
        tasks = [*self._handlers, *self._background_tasks, *([self._accepting] if self._accepting else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        for conn in list(self._open):
            conn.abort()

    async def _accept_loop(self, sock: socket.socket) -> None:
        """Accept connections, at most ``max_requests_per_sec`` after a burst (a token bucket)."""
        loop = asyncio.get_running_loop()
        rate, burst = self.limits.max_requests_per_sec, float(max(self.limits.max_connections, 1))
        tokens, last = burst, loop.time()
        while True:
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as exc:  # e.g. out of file descriptors: wait rather than spin
                log.warning("HTTP server: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            try:
                await loop.connect_accepted_socket(lambda: _HttpConnection(self), client)
            except OSError:
                client.close()
            now = loop.time()
            tokens = min(burst, tokens + (now - last) * rate) - 1.0
            last = now
            if tokens < 0:
                await asyncio.sleep(-tokens / rate)

    def _dispatch(self, conn: _HttpConnection, head: bytes) -> None:
        """Answer a complete request head: at once, or from a handler task."""
        try:
            method, path = parse_request_head(head, self.limits)
        except BadRequest as exc:
            conn.answer(exc.status, _refusal(exc.status, str(exc)))
            return
        handler = self.routes.get(path)
        if handler is None:
            paths = ", ".join(sorted(self.routes))
            conn.answer(404, _render(404, "text/plain", f"no such path; try {paths}\n".encode()))
            return
        task = asyncio.get_running_loop().create_task(self._run(conn, handler, path, method == "HEAD"))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _run(self, conn: _HttpConnection, handler: Handler, path: str, head_only: bool) -> None:
        try:
            status, content_type, body = await handler()
        except Exception:  # a failing page must not take the server down
            log.exception("HTTP handler for %s failed", path)
            conn.answer(500, _render(500, "text/plain", b"internal error; see the node's log\n"))
            return
        conn.answer(status, _render(status, content_type, body, head_only=head_only))


def _refusal(status: int, why: str) -> bytes:
    return _render(status, "text/plain", (why + "\n").encode())


class _HttpConnection(asyncio.Protocol):
    """One connection: read the request head (bounded), answer once, then linger: half-close,
    discard what the client still sends, and close when it has (or the linger time is up)."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._state = "head"  # then "answering" (a handler runs), then "lingering"
        self._discarded = 0
        self._eof = False  # the client has closed its side
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0

    # -- asyncio callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server._open.add(self)
        if len(self.server._serving) >= self.limits.max_connections:
            self.answer(503, _refusal(503, "too many connections; try again in a moment"))
            return
        self.server._serving.add(self)
        self._timer = asyncio.get_running_loop().call_later(self.limits.read_timeout, self._read_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._state != "head":
            self._discard(len(data))
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > self.limits.max_head_bytes:
                self._refuse_oversize()
            return
        head, rest = bytes(self._head[:end + 4]), len(self._head) - end - 4
        self._head = bytearray()
        self._state = "answering"
        self._discard(rest)  # a body (refused anyway: GET and HEAD only)
        self.server._dispatch(self, head)

    def eof_received(self) -> bool:
        self._eof = True
        if self._state == "head":
            self.answer(400, _refusal(400, "connection closed before the request head ended"))
        elif self._state == "lingering":
            self._close_if_sent()
        return True  # keep our side open until the answer is written

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.server._serving.discard(self)
        self.server._open.discard(self)

    # -- answering and closing -------------------------------------------------------------

    def answer(self, status: int, data: bytes) -> None:
        """Send the whole answer, half-close, and linger (once; later calls do nothing)."""
        if self._state == "lingering" or self.transport is None or self.transport.is_closing():
            return
        self._state = "lingering"
        self._head = bytearray()
        self.server._serving.discard(self)
        self.server.answered[status] += 1
        self._cancel_timer()
        self.transport.write(data)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # FIN after the answer: the client reads it to the end
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + self.limits.write_timeout
        self._timer = loop.call_later(self.limits.linger_sec, self._linger_over)
        if self._eof:
            self._close_if_sent()

    def abort(self) -> None:
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    def _refuse_oversize(self) -> None:
        line_end = self._head.find(b"\r\n", 0, self.limits.max_request_line + 2)
        if line_end < 0:
            self.answer(414, _refusal(414, f"request line over {self.limits.max_request_line} bytes"))
        else:
            self.answer(431, _refusal(431, f"request head over {self.limits.max_head_bytes} bytes"))

    def _read_timed_out(self) -> None:
        self._timer = None
        self.answer(408, _refusal(408, "request not received in time"))

    def _discard(self, n: int) -> None:
        self._discarded += n
        if self._discarded > self.limits.max_discard_bytes:
            self._finish()

    def _linger_over(self) -> None:
        """The client has not closed in time: close if the answer is out, else wait for it up
        to ``write_timeout``, then give up on the client."""
        self._timer = None
        if self.transport is None:
            return
        loop = asyncio.get_running_loop()
        if self.transport.get_write_buffer_size() and loop.time() < self._deadline:
            self._timer = loop.call_later(min(0.5, self._deadline - loop.time()), self._linger_over)
            return
        self._finish()

    def _close_if_sent(self) -> None:
        """The client has closed its side: close ours once the answer is out (else the linger
        timer does, or gives up on the client)."""
        if self.transport is not None and not self.transport.get_write_buffer_size():
            self._finish()

    def _finish(self) -> None:
        self._cancel_timer()
        if self.transport is None or self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # a client that reads nothing does not keep a connection
        else:
            self.transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ThreadedHttpServer:
    """An :class:`HttpServer` on an event loop of its own in a daemon thread, for nodes whose
    loop must not wait on page rendering (a peer's control loop answers heartbeats).

    Args:
        routes: as for :class:`HttpServer`; handlers run on the server's thread.
        limits: see :class:`HttpLimits`.
    """

    def __init__(self, routes: Mapping[str, Handler], limits: HttpLimits = HttpLimits(),
                 background: Sequence[Callable[[], Awaitable[None]]] = (),
                 answered: Counter[int] | None = None) -> None:
        self.http = HttpServer(routes, limits, background, answered)
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
