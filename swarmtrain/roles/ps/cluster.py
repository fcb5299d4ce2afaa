"""A sharded parameter-server cluster: where one coordinator process stands in it, and what
the leader (server 0) asks of the other servers.

Server ``i`` of ``S`` (``swarmtrain coordinator --shard i/S``) is an ordinary
:class:`~swarmtrain.roles.ps.coordinator.Coordinator` over the part of the model its
parameter group makes up (:mod:`swarmtrain.roles.ps.partition`): its own master weights,
Adam state, version counter, downlink log, staleness policy, gradient screen and checkpoints.
The leader does the run-level things: it assigns the workers' data shards, gates the start on
``min_workers``, ends the run (``max_steps``, a ctl shutdown) and then shuts the other
servers down, evaluates on the whole model by pulling the other groups' current weights, and
shows every server in its status. The other servers follow: they start training as soon as
a worker joins and finish when the leader tells them (or when they are stopped).

The leader talks to the others as a ``ctl`` client (authenticated with the cluster secret):
STATUS_REQUEST for the status, SHUTDOWN at the end of the run, and an empty WEIGHTS, which a
coordinator answers with its current trainable weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.roles.ps.partition import Partition, ServerSpec, group_module, partition_model
from swarmtrain.transport import Timeouts, connect
from swarmtrain.transport.identity import Identity, node_identity
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import CheckpointMsg, Error, Shutdown, Status, StatusRequest, Weights

__all__ = ["ClusterPlace", "ClusterPeers", "split_address", "shard_of_model"]

log = logging.getLogger("swarmtrain.cluster")

#: how often the leader asks the other servers for their status
STATUS_POLL_SEC = 2.0


@dataclass(frozen=True)
class ClusterPlace:
    """Where one coordinator stands in a sharded cluster.

    Attributes:
        spec: this server's index and the number of servers.
        partition: the parameter groups (every process computes the same).
        servers: ``host:port`` of every server, index = position (may be empty on a server
            that is not the leader: only the leader needs to reach the others).
        model_fingerprint: the whole model's fingerprint (a worker registers with it: each
            server checks the whole model, then the partition's fingerprint).
    """

    spec: ServerSpec
    partition: Partition
    servers: tuple[str, ...]
    model_fingerprint: list[list[Any]]

    @property
    def leader(self) -> bool:
        return self.spec.leader

    def welcome_info(self) -> dict[str, Any]:
        """What a REGISTER_ACK's ``info`` says of the cluster (the worker connects to the rest)."""
        return {"servers": list(self.servers), "partition": self.partition.fingerprint,
                "server": self.spec.index, "server_count": self.spec.count}

    def check_register(self, partition: str) -> None:
        """Refuse a worker whose partition differs from ours; a worker that does not know it
        yet may register with the leader only (which tells it).

        Raises:
            ConfigError: the partition differs, or it is unknown at a server that does not lead.
        """
        if not partition:
            if self.leader:
                return
            raise ConfigError(
                f"this is parameter server {self.spec}, not the leader: a worker registers with "
                "server 0 first (it lists every server); start the worker with --host/--port of "
                "server 0")
        if partition != self.partition.fingerprint:
            raise ConfigError(
                f"parameter partition mismatch: this server ({self.spec}) splits the model into "
                f"{self.spec.count} groups with fingerprint {self.partition.fingerprint}, the worker "
                f"computed {partition}: give every server the same --shard count and cluster.servers "
                "list, and run the same swarmtrain version and model everywhere")

    def summary(self) -> dict[str, Any]:
        return {"shard": str(self.spec), "index": self.spec.index, "count": self.spec.count,
                "leader": self.leader, "servers": list(self.servers),
                "partition": self.partition.fingerprint,
                "group_tensors": len(self.partition.groups[self.spec.index]),
                "group_bytes": self.partition.group_bytes[self.spec.index],
                "imbalance": self.partition.imbalance}


def shard_of_model(model: nn.Module, spec: ServerSpec,
                   servers: tuple[str, ...]) -> tuple[nn.Module, ClusterPlace]:
    """Server ``spec``'s part of ``model`` (its group; with the frozen parameters and buffers on
    the leader) and its place in the cluster.

    Raises:
        ConfigError: the leader of a cluster of several servers has no ``cluster.servers``.
    """
    if spec.count > 1 and spec.leader and len(servers) != spec.count:
        raise ConfigError(
            f"parameter server {spec} leads a cluster of {spec.count}: set cluster.servers "
            "(--servers HOST:PORT, once per server, server 0 first) so that it can tell the "
            "workers where the others are")
    partition = partition_model(model, spec.count)
    fingerprint = ModelState(model).fingerprint()
    part = group_module(model, partition.groups[spec.index], with_rest=spec.leader)
    return part, ClusterPlace(spec, partition, servers, fingerprint)


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``.

    Raises:
        ConfigError: no port, or a port out of range.
    """
    host, sep, port = address.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 < number < 65536:
        raise ConfigError(f"parameter server address {address!r}: expected HOST:PORT, e.g. 10.0.0.2:7101")
    return host.strip("[]"), number


class ClusterPeers:
    """The leader's view of the other servers: their status (polled), their weights (pulled
    for an evaluation) and the end of the run (each is told to shut down)."""

    def __init__(self, place: ClusterPlace, *, secret: bytes | None, tls: TLSConfig | None,
                 timeout: float = 10.0) -> None:
        self.place = place
        self.secret, self.tls, self.timeout = secret, tls, timeout
        self._identity: Identity | None = None
        #: the last status of each other server (index -> summary), or why it was not reached
        self.statuses: dict[int, dict[str, Any]] = {}

    @property
    def others(self) -> list[tuple[int, str]]:
        return [(i, a) for i, a in enumerate(self.place.servers) if i != self.place.spec.index]

    async def _request(self, address: str, msg: Any) -> Any:
        if self._identity is None:
            self._identity = node_identity("the other servers record the leader by its address only")
        host, port = split_address(address)
        conn = await connect(host, port, secret=self.secret, tls=self.tls, role="ctl",
                             identity=self._identity,
                             timeouts=Timeouts(connect=self.timeout, handshake=self.timeout))
        try:
            await conn.send(msg)
            reply = await conn.recv(timeout=self.timeout, phase="cluster request")
        finally:
            await conn.close()
        if isinstance(reply, Error):
            raise SwarmError(f"parameter server at {address} answered {reply.code}: {reply.message}")
        return reply

    async def poll_forever(self) -> None:
        """Keep :attr:`statuses` current (every :data:`STATUS_POLL_SEC`)."""
        while True:
            await self.poll_once()
            await asyncio.sleep(STATUS_POLL_SEC)

    async def poll_once(self) -> None:
        """Ask every other server for its status now."""
        await asyncio.gather(*(self._poll(i, a) for i, a in self.others))

    async def _poll(self, index: int, address: str) -> None:
        try:
            reply = await self._request(address, StatusRequest())
        except (SwarmError, OSError) as exc:
            self.statuses[index] = {"index": index, "address": address, "reachable": False,
                                    "error": str(exc)[:300], "time": time.time()}
            return
        status = reply.status if isinstance(reply, Status) else {}
        self.statuses[index] = {
            "index": index, "address": address, "reachable": True, "time": time.time(),
            **{k: status.get(k) for k in ("version", "state", "loss", "workers_connected", "stats")},
            "shard": (status.get("cluster") or {}).get("shard", ""),
        }

    async def pull_weights(self) -> dict[str, torch.Tensor]:
        """Every other server's current trainable weights, merged (for the leader's evaluation).

        Raises:
            SwarmError: a server could not be reached, or answered without weights.
        """
        replies = await asyncio.gather(*(self._request(a, Weights(version=0)) for _, a in self.others))
        merged: dict[str, torch.Tensor] = {}
        for (index, address), reply in zip(self.others, replies):
            if not isinstance(reply, Weights):
                raise SwarmError(f"parameter server {index} at {address} sent no weights")
            merged.update(reply.tensors)
        return merged

    async def ask_others(self, msg: Any) -> list[tuple[int, str, Any]]:
        """Send ``msg`` to every other server at once: (index, address, its answer, or the
        SwarmError / OSError that stood in its way) for each."""
        async def one(address: str) -> Any:
            try:
                return await self._request(address, msg)
            except (SwarmError, OSError) as exc:
                return exc

        replies = await asyncio.gather(*(one(a) for _, a in self.others))
        return [(i, a, r) for (i, a), r in zip(self.others, replies)]

    async def checkpoint_others(self) -> list[str]:
        """Ask every other server to checkpoint now; what went wrong, one line per server
        that could not (empty: all wrote theirs)."""
        problems = []
        for index, address, reply in await self.ask_others(CheckpointMsg()):
            if not isinstance(reply, CheckpointMsg) or not reply.ok:
                why = reply.message if isinstance(reply, CheckpointMsg) else str(reply)
                problems.append(f"parameter server {index} at {address}: {why}")
        return problems

    async def shut_down_others(self, reason: str) -> None:
        """Tell every other server to finish (checkpoint, final weights, stop); one that cannot
        be reached is named in the log (stop it yourself: it has checkpointed as it went)."""
        for index, address, reply in await self.ask_others(Shutdown(reason=f"the leader finished: {reason}")):
            if isinstance(reply, SwarmError | OSError):
                log.warning("could not tell parameter server %d at %s to shut down (%s); stop it "
                            "with `swarmtrain ctl shutdown --host/--port` of that server",
                            index, address, reply)

    def summary(self, own: Mapping[str, Any]) -> list[dict[str, Any]]:
        """One row per server, this one (``own``) first among them in index order."""
        rows = dict(self.statuses)
        rows[self.place.spec.index] = {"index": self.place.spec.index, "reachable": True,
                                       "address": (self.place.servers[self.place.spec.index]
                                                   if self.place.servers else ""), **own}
        return [rows[i] for i in sorted(rows)]
