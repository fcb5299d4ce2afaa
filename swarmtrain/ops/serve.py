"""The HTTP routes of each kind of node: ``/metrics``, ``/api/status`` and the dashboard.

A coordinator and a stage serve on their own event loop; a peer serves from a thread of its
own (its training loop is synchronous and its control loop must keep answering heartbeats).
The port is read-only but carries no secret: bind it to a trusted interface (the default
is 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from swarmtrain.ops.http import HttpServer, Response, Routes, ThreadedHttpServer
from swarmtrain.ops.metrics import (
    CONTENT_TYPE,
    CoordinatorCollector,
    PeerCollector,
    StageCollector,
    StatusCollector,
    registry_for,
    render,
)
from swarmtrain.runlog import json_safe

if TYPE_CHECKING:
    from swarmtrain.peer.node import PeerTrainer
    from swarmtrain.pipeline.stage import StageServer
    from swarmtrain.roles.coordinator import Coordinator

__all__ = ["StatusHistory", "dashboard_html", "routes_for", "serve_coordinator", "serve_peer",
           "serve_stage"]

Status = Callable[[], Mapping[str, Any]]


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
    return resources.files("swarmtrain.ops").joinpath("dashboard.html").read_bytes()


def routes_for(kind: str, status: Status, collector: StatusCollector, *,
               history: StatusHistory | None) -> Routes:
    """The routes of a node: ``/metrics``, ``/api/status`` and, given a ``history``, the
    dashboard at ``/`` and the history it starts from at ``/api/history``.

    Args:
        kind: ``"coordinator"``, ``"peer"`` or ``"stage"`` (added to the status as ``node``).
        status: the node's status function.
        collector: the metrics collector reading that status.
        history: the sampled history (None = no dashboard).
    """
    registry = registry_for(collector)

    async def metrics() -> Response:
        return 200, CONTENT_TYPE, render(registry)

    async def api_status() -> Response:
        body = json.dumps(json_safe({**status(), "node": kind, "server_time": time.time()}),
                          allow_nan=False)
        return 200, "application/json", body.encode()

    routes: Routes = {"/metrics": metrics, "/api/status": api_status}
    if history is not None:
        page, points = dashboard_html(), history.points

        async def index() -> Response:
            return 200, "text/html; charset=utf-8", page

        async def api_history() -> Response:
            return 200, "application/json", json.dumps(json_safe(list(points)), allow_nan=False).encode()

        routes["/"] = index
        routes["/api/history"] = api_history
    return routes


async def serve_coordinator(coord: Coordinator, host: str, port: int) -> HttpServer:
    """Serve a coordinator's metrics, status and dashboard on the running loop.

    Raises:
        SwarmError: the address cannot be bound.
    """
    # not coord.status(): that summarises every worker, the events and the traffic each time
    history = StatusHistory(lambda: {"loss": coord.loss_ema, "metrics": coord.metrics,
                                     "samples": sum(r.samples for r in coord.workers.values())})
    server = HttpServer(routes_for("coordinator", coord.status, CoordinatorCollector(coord.status),
                                   history=history), background=[history.run])
    await server.start(host, port)
    return server


async def serve_stage(stage: StageServer, host: str, port: int) -> HttpServer:
    """Serve a pipeline stage's metrics and status on the running loop.

    Raises:
        SwarmError: the address cannot be bound.
    """
    server = HttpServer(routes_for("stage", stage.status, StageCollector(stage.status), history=None))
    await server.start(host, port)
    return server


def serve_peer(trainer: PeerTrainer, host: str, port: int) -> ThreadedHttpServer:
    """Serve a peer's metrics, status and dashboard from a thread of its own.

    Raises:
        SwarmError: the address cannot be bound.
    """
    status = trainer.status
    history = StatusHistory(status)
    server = ThreadedHttpServer(routes_for("peer", status, PeerCollector(status), history=history),
                                background=[history.run])
    server.start(host, port)
    return server
