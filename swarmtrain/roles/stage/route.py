"""Where a pipeline's stages are: the route ``"H:P,H:P;H:P"`` and what its servers say.

``;`` separates stages, ``,`` replicas of one stage. :func:`fetch_statuses` asks every
replica for its status (STATUS_REQUEST, answered at once, outside the work queue) and
:func:`check_route` tells a user, before any training starts, which address is down or
serves the wrong stage or layers, and what to run there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from swarmtrain.errors import ConfigError, RefusedError, SwarmError
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import Error, Status, StatusRequest

__all__ = ["Route", "check_route", "fetch_statuses", "parse_host_port", "parse_route", "replica_problem",
           "request_status"]

log = logging.getLogger("swarmtrain.roles.stage")

Route = list[list[tuple[str, int]]]


def parse_route(text: str) -> Route:
    """``"H:P,H:P;H:P"`` → ``[[(H, P), (H, P)], [(H, P)]]``.

    Raises:
        ConfigError: an empty stage or a replica that is not ``HOST:PORT``.
    """
    route: Route = []
    for i, stage in enumerate(text.split(";")):
        replicas = [r.strip() for r in stage.split(",") if r.strip()]
        if not replicas:
            raise ConfigError(f"--route {text!r}: stage {i} lists no replica; write HOST:PORT for each "
                              "replica, ',' between replicas of a stage and ';' between stages")
        route.append([parse_host_port(r, "--route") for r in replicas])
    return route


def parse_host_port(text: str, flag: str) -> tuple[str, int]:
    """``"HOST:PORT"`` → ``(HOST, PORT)``; ``flag`` names the option in the error.

    Raises:
        ConfigError: no host, or a port that is not 1-65535.
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag}: {text!r} is not HOST:PORT (e.g. 10.0.0.2:7300)")
    return host.strip("[]"), int(port)


async def fetch_statuses(route: Route, *, secret: bytes | None, timeout: float = 10.0,
                         tls: TLSConfig | None = None) -> list[list[dict[str, Any]]]:
    """Each replica's status, by stage; an unreachable replica gives ``{"error": why}``.

    Every dict also carries ``"replica": "HOST:PORT"`` and the ``"route_stage"`` it was
    listed under.
    """
    timeouts = Timeouts(connect=timeout, handshake=timeout)

    async def ask(stage: int, host: str, port: int) -> dict[str, Any]:
        where = {"replica": f"{host}:{port}", "route_stage": stage}
        try:
            conn = await connect(host, port, secret=secret, tls=tls, role="pipeline", timeouts=timeouts)
            try:
                status = await request_status(conn, timeout)
            finally:
                await conn.close()
        except SwarmError as exc:
            return {**where, "error": str(exc)}
        return {**status, **where}

    answers = await asyncio.gather(*(ask(i, h, p) for i, stage in enumerate(route) for h, p in stage))
    it = iter(answers)
    return [[next(it) for _ in stage] for stage in route]


async def request_status(conn: Connection, timeout: float) -> dict[str, Any]:
    """Ask a stage server on ``conn`` for its status (answered at once, outside its work queue).

    Raises:
        RefusedError: it answered with an ERROR.
        SwarmError: the connection failed, or the answer is not a status (not a stage server).
    """
    await conn.send(StatusRequest(), timeout=timeout)
    reply = await conn.recv(timeout=timeout, phase="stage status")
    if isinstance(reply, Error):
        raise RefusedError(reply.code, reply.message)
    if not isinstance(reply, Status):
        raise SwarmError(f"answered {type(reply).__name__}, not a status: is this a stage server?")
    return reply.status


def replica_problem(status: dict[str, Any], stage: int, *, shape: str, origin: str, most_steps: int) -> str:
    """Why a replica whose status is ``status`` must not serve ``stage`` ("" = it may): it
    serves another stage, holds layers of another shape than ``shape``, weights of another
    lineage than ``origin`` ("" = either not checked), or its seed's weights while its stage
    has trained ``most_steps`` > 0 optimizer steps. The route check and the router both ask."""
    if status.get("stage") != stage:
        return f"it serves stage {status.get('stage')}, not {stage}"
    if shape and status.get("shape", shape) != shape:
        return (f"it holds layers {status.get('layers')} of another shape (signature {status.get('shape')}, "
                f"this model's {shape}): give every process the same --task and model flags (--context, "
                "--d-model, --n-heads, --n-layers)")
    if origin and status.get("origin", origin) != origin:
        return (f"it holds weights of another lineage (origin {status.get('origin')}, its stage's {origin}; "
                f"another --seed?): start it with --sync-with a live replica of stage {stage}, or "
                "--resume from this stage's checkpoints")
    if status.get("started_from") == "seed" and int(status.get("steps", 0)) == 0 and most_steps > 0:
        return (f"it serves its seed's weights while its stage has trained {most_steps} optimizer steps: "
                f"restart it with --sync-with a live replica of stage {stage} (it then copies them), or "
                "--resume from its checkpoints")
    return ""


def check_route(statuses: list[list[dict[str, Any]]], n_layers: int,
                shape_of: Callable[[tuple[int, int]], str] | None = None) -> list[tuple[str, str]]:
    """Raise unless every stage has a live replica that serves the stage its place says,
    the live stages' layer ranges join up to cover the model's ``n_layers`` layers, and
    (with ``shape_of``, the shape signature this process's model gives a layer range) each
    replica's layers have the shape this model's have; and unless the live replicas of each
    stage share one weight lineage (``origin``), none of them serving its seed's weights
    while another has trained.

    Returns:
        For each stage, the ``(shape, origin)`` its replicas have (for :meth:`Router.expect`).

    Raises:
        SwarmError: the message names the address and what to start or fix there.
    """
    n = len(statuses)
    ranges: list[tuple[int, int]] = []
    identities: list[tuple[str, str]] = []
    for i, replicas in enumerate(statuses):
        live = [s for s in replicas if "error" not in s]
        for s in replicas:
            if "error" in s:
                log.warning("stage %d replica %s is unreachable (%s); going on without it for now",
                            i, s["replica"], s["error"])
        if not live:
            raise SwarmError(
                f"no replica of stage {i} answered: "
                + "; ".join(f"{s['replica']}: {s['error']}" for s in replicas)
                + f". Check that `swarmtrain stage --stage {i} --stages {n}` runs at that address and "
                "port, that the port is reachable from here, and that both sides use the same secret")
        for s in live:
            if s.get("stage") != i:
                raise SwarmError(
                    f"{s['replica']} serves stage {s.get('stage')}, but the route lists it as stage {i} of "
                    f"{n}: fix --route or restart it with --stage {i} --stages {n}")
        found = {tuple(s["layers"]) for s in live}
        if len(found) > 1:
            raise SwarmError(f"the replicas of stage {i} hold different layers ({sorted(found)}): "
                             "start them with the same --stages and model flags")
        ranges.append(found.pop())
        identities.append(_check_replicas(i, live, shape_of(ranges[-1]) if shape_of else ""))
    if ranges[-1][1] != n_layers:
        raise SwarmError(f"the last stage of the route ends at layer {ranges[-1][1]}, but the model here has "
                         f"{n_layers} layers: give every process the same --task and model flags, and list "
                         f"every stage in --route (it lists {n})")
    for i in range(1, n):
        if ranges[i][0] != ranges[i - 1][1]:
            raise SwarmError(f"stage {i - 1} ends at layer {ranges[i - 1][1]} but stage {i} starts at "
                             f"{ranges[i][0]}: start every stage with the same --stages, --task and "
                             "model flags")
    return identities


def _check_replicas(stage: int, live: list[dict[str, Any]], shape: str) -> tuple[str, str]:
    """The live replicas of ``stage`` share one lineage and each fits (:func:`replica_problem`);
    their identity."""
    origins = {s.get("origin", "") for s in live}
    if len(origins) > 1:
        raise SwarmError(
            f"the replicas of stage {stage} hold weights of different lineages ("
            + ", ".join(f"{s['replica']}: origin {s.get('origin')}, {s.get('steps', 0)} steps" for s in live)
            + "): they were built with different --seed values or never copied each other's weights. "
            "Restart the newer one with --sync-with the other (it then copies its weights), or give "
            "every stage the same --seed")
    most = max(int(s.get("steps", 0)) for s in live)
    for s in live:
        why = replica_problem(s, stage, shape=shape, origin="", most_steps=most)
        if why:
            raise SwarmError(f"{s['replica']} cannot serve stage {stage}: {why}; or leave it out of --route")
    return shape, str(origins.pop())
