"""The HTTP routes of each kind of node: ``/metrics``, ``/api/status`` and the dashboard.

A coordinator and a stage serve on their own event loop; a peer serves from a thread of its
own (its training loop is synchronous and its control loop must keep answering heartbeats).
The port is read-only but carries no secret: bind it to a trusted interface (the default
is 127.0.0.1).

``/api/status`` and ``/metrics`` serve a snapshot of the node's status at most
:data:`STATUS_MAX_AGE` seconds old (:class:`CachedStatus`), and each page is rendered once
per snapshot: however many requests arrive, the node builds its status and the pages at most
a few times a second, and its training does not slow down.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from swarmtrain.app.ops.http import HttpServer, Response, Routes, ThreadedHttpServer
from swarmtrain.app.ops.metrics import (
    CONTENT_TYPE,
    CoordinatorCollector,
    HttpCollector,
    PeerCollector,
    StageCollector,
    StatusCollector,
    registry_for,
    render,
)
from swarmtrain.app.runlog import json_safe

if TYPE_CHECKING:
    from swarmtrain.roles.peer.node import PeerTrainer
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.roles.stage.stage import StageServer

__all__ = ["STATUS_MAX_AGE", "CachedStatus", "StatusHistory", "dashboard_html", "routes_for",
           "serve_coordinator", "serve_peer", "serve_stage"]

Status = Callable[[], Mapping[str, Any]]

STATUS_MAX_AGE = 0.5
"""Seconds a status snapshot served over HTTP may be old."""


class CachedStatus:
    """A node's ``status()``, built at most once every ``max_age`` seconds.

    Called from one thread (the HTTP server's loop); the snapshot it returns is shared, so
    callers must not change it.

    Args:
        status: the node's status function.
        max_age: seconds a snapshot is served before the next call builds a new one.
    """

    def __init__(self, status: Status, max_age: float = STATUS_MAX_AGE) -> None:
        self.status = status
        self.max_age = max_age
        #: snapshots built so far (how often ``status`` has run)
        self.builds = 0
        self._value: Mapping[str, Any] | None = None
        self._at = 0.0

    def __call__(self) -> Mapping[str, Any]:
        now = time.monotonic()
        if self._value is None or now - self._at >= self.max_age:
            self._value = self.status()
            self._at = now
            self.builds += 1
        return self._value


class _PerSnapshot:
    """``build(snapshot)``, computed once per snapshot of a :class:`CachedStatus`."""

    def __init__(self, status: CachedStatus, build: Callable[[Mapping[str, Any]], bytes]) -> None:
        self.status, self.build = status, build
        self._snapshot: Mapping[str, Any] | None = None
        self._body = b""

    def __call__(self) -> bytes:
        snapshot = self.status()
        if snapshot is not self._snapshot:
            self._snapshot, self._body = snapshot, self.build(snapshot)
        return self._body


class StatusHistory:
    """Loss, held-out metrics and samples trained, sampled every ``interval`` seconds and
    kept for the last ``size`` samples, so a dashboard opened mid-run starts with the run's
    recent past.

    Args:
        progress: returns ``{"loss": ..., "metrics": {...}, "samples": ...}`` now (cheap:
            it runs every second, on the coordinator's event loop for a coordinator).
        interval: seconds between samples.
        size: samples kept (the oldest are dropped).
    """

    def __init__(self, progress: Status, interval: float = 1.0, size: int = 900) -> None:
        self.progress = progress
        self.interval = interval
        self.points: deque[dict[str, Any]] = deque(maxlen=size)

    def sample(self) -> None:
        """Record the node's state now."""
        now = self.progress()
        self.points.append({"time": time.time(), "loss": now.get("loss"),
                            "metrics": dict(now.get("metrics") or {}), "samples": now.get("samples")})

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval)


def dashboard_html() -> bytes:
    """The dashboard page (one self-contained file shipped with the package)."""
    return resources.files("swarmtrain.app.ops").joinpath("dashboard.html").read_bytes()


def routes_for(kind: str, status: Status, collector: Callable[[Status], StatusCollector], *,
               history: StatusHistory | None, max_age: float = STATUS_MAX_AGE,
               answered: Counter[int] | None = None) -> Routes:
    """The routes of a node: ``/metrics``, ``/api/status`` and, given a ``history``, the
    dashboard at ``/`` and the history it starts from at ``/api/history``.

    ``/metrics`` and ``/api/status`` read one :class:`CachedStatus` of ``status`` (at most
    ``max_age`` seconds old), and each renders its page once per snapshot; ``/api/history``
    is rendered at most once every ``max_age`` seconds too.

    Args:
        kind: ``"coordinator"``, ``"peer"`` or ``"stage"`` (added to the status as ``node``).
        status: the node's status function.
        collector: the metrics collector class (or factory) to read the cached status with.
        history: the sampled history (None = no dashboard).
        max_age: seconds a status snapshot may be served (0: build one for every request).
        answered: the HTTP server's answers by status code, for ``/metrics``
            (``swarmtrain_http_responses_total``; None = not shown).
    """
    cached = CachedStatus(status, max_age)
    registry = registry_for(collector(cached), *([HttpCollector(answered)] if answered is not None else []))
    metrics_body = _PerSnapshot(cached, lambda _: render(registry))
    status_body = _PerSnapshot(cached, lambda st: json.dumps(
        json_safe({**st, "node": kind, "server_time": time.time()}), allow_nan=False).encode())

    async def metrics() -> Response:
        return 200, CONTENT_TYPE, metrics_body()

    async def api_status() -> Response:
        return 200, "application/json", status_body()

    routes: Routes = {"/metrics": metrics, "/api/status": api_status}
    if history is not None:
        page, points = dashboard_html(), history.points
        history_body = _PerSnapshot(CachedStatus(lambda: {"points": list(points)}, max_age),
                                    lambda h: json.dumps(json_safe(h["points"]), allow_nan=False).encode())

        async def index() -> Response:
            return 200, "text/html; charset=utf-8", page

        async def api_history() -> Response:
            return 200, "application/json", history_body()

        routes["/"] = index
        routes["/api/history"] = api_history
    return routes


async def serve_coordinator(coord: Coordinator, host: str, port: int, *,
                            max_age: float = STATUS_MAX_AGE) -> HttpServer:
    """Serve a coordinator's metrics, status and dashboard on the running loop.

    Args:
        max_age: seconds a status snapshot may be served (see :class:`CachedStatus`).

    Raises:
        SwarmError: the address cannot be bound.
    """
    # not coord.status(): that summarises every worker, the events and the traffic each time
    history = StatusHistory(lambda: {"loss": coord.loss_ema, "metrics": coord.metrics,
                                     "samples": sum(r.samples for r in coord.workers.values())})
    answered: Counter[int] = Counter()
    server = HttpServer(routes_for("coordinator", coord.status, CoordinatorCollector, history=history,
                                   max_age=max_age, answered=answered),
                        background=[history.run], answered=answered)
    await server.start(host, port)
    return server


async def serve_stage(stage: StageServer, host: str, port: int) -> HttpServer:
    """Serve a pipeline stage's metrics and status on the running loop.

    Raises:
        SwarmError: the address cannot be bound.
    """
    answered: Counter[int] = Counter()
    server = HttpServer(routes_for("stage", stage.status, StageCollector, history=None, answered=answered),
                        answered=answered)
    await server.start(host, port)
    return server


def serve_peer(trainer: PeerTrainer, host: str, port: int) -> ThreadedHttpServer:
    """Serve a peer's metrics, status and dashboard from a thread of its own.

    Raises:
        SwarmError: the address cannot be bound.
    """
    status = trainer.status
    history = StatusHistory(status)
    answered: Counter[int] = Counter()
    server = ThreadedHttpServer(routes_for("peer", status, PeerCollector, history=history, answered=answered),
                                background=[history.run], answered=answered)
    server.start(host, port)
    return server
