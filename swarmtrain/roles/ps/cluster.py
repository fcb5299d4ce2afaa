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

And it decides for the cluster what becomes of each gradient. A worker sends every server its
slice of one gradient; were each server to judge staleness on its own (its version less the
version of its group the worker holds), the servers would drop different slices, as their
versions and the slices' arrival differ a little: with four servers each dropping 14 % of
slices, 44 % of the rounds lost a slice somewhere (bench_shards, 34.3), and the groups
stepped on different gradients. So the leader sends each of its verdicts, (worker, msg_id,
status, staleness), to every other server over one connection of role ``leader``
(:class:`VerdictStream`), and a server that follows (``cluster.follow_leader``, the default)
waits for the verdict on a slice before it applies it, then drops it or applies it damped by
the leader's staleness (:class:`LeaderVerdicts`). While no verdict stream is connected (the
leader is down), or when a verdict is later than :data:`VERDICT_WAIT_SEC`, a server decides
on its own, and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import ConfigError, RefusedError, SwarmError
from swarmtrain.roles.ps.partition import Partition, ServerSpec, group_module, partition_model
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.transport.identity import Identity, node_identity
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import (
    CheckpointMsg,
    Error,
    Shutdown,
    Status,
    StatusRequest,
    UpdateStatus,
    Verdict,
    Weights,
)

__all__ = ["VERDICT_STATUSES", "ClusterPlace", "ClusterPeers", "LeaderVerdicts", "VerdictStream",
           "split_address", "shard_of_model"]

log = logging.getLogger("swarmtrain.cluster")

#: how often the leader asks the other servers for their status
STATUS_POLL_SEC = 2.0
#: how long a server that follows the leader waits for its verdict on a slice before it
#: decides on its own (the leader's slice came later than its own, or never: the worker's
#: link to the leader broke)
VERDICT_WAIT_SEC = 10.0
#: verdicts a server keeps for one worker's slices that have not come yet, and workers it
#: keeps them for (the oldest go first)
VERDICTS_KEPT = 256
VERDICT_WORKERS_KEPT = 4096
#: verdicts the leader queues for one server before it drops them (that server decides those)
VERDICT_QUEUE = 8192
#: how long the leader waits before it connects again to a server its verdict stream lost,
#: and to one that refused it (it takes another node's: docs/security.md)
VERDICT_RECONNECT_SEC = 1.0
VERDICT_REFUSED_RETRY_SEC = 30.0


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

    async def connect(self, address: str, role: str = "ctl") -> Connection:
        """An authenticated connection to the server at ``address``, as ``role``."""
        if self._identity is None:
            self._identity = node_identity("the other servers record the leader by its address only")
        host, port = split_address(address)
        return await connect(host, port, secret=self.secret, tls=self.tls, role=role,
                             identity=self._identity,
                             timeouts=Timeouts(connect=self.timeout, handshake=self.timeout))

    async def _request(self, address: str, msg: Any) -> Any:
        conn = await self.connect(address)
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
            "verdicts": (status.get("cluster") or {}).get("verdicts"),
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


class VerdictStream:
    """(the leader) Its verdict on every worker's gradient, sent to each other server as it
    is made, over one connection per server (role ``leader``), connected again when lost.

    A verdict is queued only for a server whose stream is up: one that is not decides on its
    own until the stream is back, so nothing older than the connection is ever sent.
    """

    def __init__(self, peers: ClusterPeers) -> None:
        self.peers = peers
        self._queues: dict[int, asyncio.Queue[Verdict | None]] = {}  # index -> while connected
        self.sent = 0
        #: verdicts not sent: a full queue (that server is far behind) or a stream that broke
        self.dropped = 0
        self.reconnects = 0

    def publish(self, worker_id: str, msg_id: int, status: str, staleness: int) -> None:
        """Queue the verdict on ``worker_id``'s gradient ``msg_id`` for every connected server."""
        verdict = Verdict(worker_id=worker_id, msg_id=msg_id, status=status, staleness=staleness)
        for queue in self._queues.values():
            try:
                queue.put_nowait(verdict)
            except asyncio.QueueFull:
                self.dropped += 1

    async def run_forever(self) -> None:
        await asyncio.gather(*(self._serve(i, a) for i, a in self.peers.others))

    async def _serve(self, index: int, address: str) -> None:
        delay = 0.0
        while True:
            await asyncio.sleep(delay)
            delay = VERDICT_RECONNECT_SEC
            try:
                conn = await self.peers.connect(address, role="leader")
            except (SwarmError, OSError) as exc:
                log.debug("verdict stream to parameter server %d at %s: %s", index, address, exc)
                continue
            queue: asyncio.Queue[Verdict | None] = asyncio.Queue(VERDICT_QUEUE)
            self._queues[index] = queue
            watch = asyncio.create_task(self._watch(conn, index, address, queue))
            try:
                while (verdict := await queue.get()) is not None:
                    await conn.send(verdict)
                    self.sent += 1
                why = "it closed the stream"
            except (SwarmError, OSError) as exc:
                why = str(exc)
            finally:
                self._queues.pop(index, None)
                self.dropped += queue.qsize()
                watch.cancel()
                await conn.close()
            self.reconnects += 1
            if watch.done() and not watch.cancelled() and watch.result():
                delay = VERDICT_REFUSED_RETRY_SEC  # refused: it will not change its mind soon
            else:
                log.info("verdict stream to parameter server %d at %s lost (%s): it decides on its "
                         "own until the stream is back", index, address, why)

    @staticmethod
    async def _watch(conn: Connection, index: int, address: str,
                     queue: asyncio.Queue[Verdict | None]) -> bool:
        """A server sends nothing on the stream but its refusal: say it, and end the stream
        (True: refused)."""
        refused = False
        try:
            msg = await conn.recv()
            why = msg.message if isinstance(msg, Error) else f"unexpected {msg.TYPE.name}"
            refused = isinstance(msg, Error)
        except RefusedError as exc:
            why, refused = exc.remote_message, True
        except (SwarmError, OSError) as exc:
            why = f"closed ({exc})"
        if refused:
            log.warning("parameter server %d at %s refused the leader's verdicts: %s (it decides on "
                        "its own; asked again in %.0f s)", index, address, why, VERDICT_REFUSED_RETRY_SEC)
        with contextlib.suppress(asyncio.QueueFull):  # (full: the sender meets the closed stream)
            queue.put_nowait(None)
        return refused

    def summary(self) -> dict[str, Any]:
        return {"streams": len(self._queues), "sent": self.sent, "dropped": self.dropped,
                "reconnects": self.reconnects}


#: the statuses a verdict has (Coordinator._judge); one with another is refused, and the
#: server judges that gradient itself
VERDICT_STATUSES = frozenset({UpdateStatus.APPLIED.value, UpdateStatus.STALE.value,
                              UpdateStatus.FINISHED.value})
_FINISHED = UpdateStatus.FINISHED.value


@dataclass(frozen=True)
class Ruling:
    """The leader's verdict on one gradient, as a server that follows it reads it."""

    status: str
    staleness: int


class LeaderVerdicts:
    """(a server other than the leader) The leader's verdicts, by (worker, msg_id): a slice
    waits here for the verdict on its gradient (:meth:`wait`).

    Whoever holds the cluster secret can open a ``leader`` stream (every worker does), so a
    server takes verdicts from one node only (:meth:`admit`): the first stream's proven node
    id is kept for the life of the process (a leader restarted on its machine has the same
    key), and with ``cluster.servers`` set here, only from server 0's host. Once a verdict
    says the run is over, every gradient after it is over too, so no stream can drop the
    others' gradients as "finished" and keep its own.

    (A check of each verdict against this server's own count of the slice's staleness was
    tried and dropped: each server moves a worker between downlink tracks on its own, so the
    version a worker holds of each group, and with it each server's count, differ by up to a
    coarse track's interval; with four servers it refused 73 honest verdicts of 1,532, with
    two 716 of 1,300, and the servers drifted apart again.)
    """

    def __init__(self, wait_sec: float = VERDICT_WAIT_SEC) -> None:
        self.wait_sec = wait_sec
        self._kept: dict[str, dict[int, Ruling]] = {}  # worker -> msg_id -> verdict
        self._waiting: dict[tuple[str, int], asyncio.Future[Ruling | None]] = {}
        #: verdict streams connected now (the leader's; two while a reconnect overlaps)
        self.streams = 0
        self.followed = 0
        #: slices decided here: no stream connected (``alone``) or no verdict in time (``late``)
        self.alone = 0
        self.late = 0
        self.wait_total = 0.0
        #: the node whose streams are taken (the first one's), and streams refused
        self.pinned: str | None = None
        self.refused = 0
        #: a verdict said the run is over: every later gradient is over too
        self.finished = False

    def connected(self) -> None:
        """A stream connected (a leader that was restarted, e.g. to train on, starts over)."""
        self.streams += 1
        self.finished = False

    def disconnected(self) -> None:
        """A stream ended: when it was the last, nobody waits for a verdict any more."""
        self.streams = max(0, self.streams - 1)
        if not self.streams:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_result(None)

    def put(self, verdict: Verdict) -> bool:
        """Take a verdict (False: its status is none of :data:`VERDICT_STATUSES`; a slice
        waiting for it is decided here at once)."""
        key = (verdict.worker_id, verdict.msg_id)
        if verdict.status not in VERDICT_STATUSES:
            if (waiting := self._waiting.get(key)) is not None and not waiting.done():
                waiting.set_result(None)
            return False
        ruling = Ruling(verdict.status, verdict.staleness)
        if verdict.status == _FINISHED and not self.finished:
            # the stream is in the leader's order: a slice still waiting was judged after this
            self.finished = True
            for other in self._waiting.values():
                if not other.done():
                    other.set_result(ruling)
        fut = self._waiting.get(key)
        if fut is not None and not fut.done():
            fut.set_result(ruling)
            return True
        kept = self._kept.setdefault(verdict.worker_id, {})
        kept[verdict.msg_id] = ruling
        if len(kept) > VERDICTS_KEPT:
            del kept[next(iter(kept))]
        if len(self._kept) > VERDICT_WORKERS_KEPT:
            del self._kept[next(iter(self._kept))]
        return True

    async def wait(self, worker_id: str, msg_id: int) -> Ruling | None:
        """The leader's verdict on ``worker_id``'s gradient ``msg_id``, once it is here (None:
        no stream is connected, or none came in :attr:`wait_sec`: this server decides)."""
        key = (worker_id, msg_id)
        kept = self._kept.get(worker_id, {})
        ruling = kept.pop(msg_id, None)
        # verdicts on this worker's older gradients will not be asked for any more
        for old in [m for m in kept if m < msg_id]:
            del kept[old]
        if ruling is None and self.finished:
            ruling = Ruling(_FINISHED, 0)
        if ruling is None and self.streams:
            fut: asyncio.Future[Ruling | None] = asyncio.get_running_loop().create_future()
            self._waiting[key] = fut
            started = time.monotonic()
            try:
                ruling = await asyncio.wait_for(fut, self.wait_sec)
            except TimeoutError:
                self.late += 1
                log.warning("no verdict from the leader on gradient %d of worker %s in %.0f s: "
                            "deciding here", msg_id, worker_id, self.wait_sec)
                return None
            finally:
                self._waiting.pop(key, None)
                self.wait_total += time.monotonic() - started
        if ruling is None:
            self.alone += 1
            return None
        self.followed += 1
        return ruling

    def admit(self, node: str, host: str, leader_hosts: frozenset[str]) -> str:
        """Why a ``leader`` stream from ``node`` (its proven node id, "" if none) at ``host``
        is refused, or "" (taken: the first one pins its node). ``leader_hosts``: server 0's
        addresses when ``cluster.servers`` is set here (empty: any host)."""
        if leader_hosts and host not in leader_hosts:
            why = (f"{host} is not the leader's address ({', '.join(sorted(leader_hosts))}, "
                   "server 0 of cluster.servers here)")
        elif not node:
            why = "the stream proved no node identity key"
        elif self.pinned is not None and node != self.pinned:
            why = (f"this server takes the leader's verdicts from node {self.pinned} (the first "
                   f"stream's) and {node} is another; if the leader really moved, restart this "
                   "server (--resume)")
        else:
            self.pinned = node
            return ""
        self.refused += 1
        return why

    def summary(self) -> dict[str, Any]:
        decided = self.followed + self.alone + self.late
        return {"streams": self.streams, "followed": self.followed, "alone": self.alone,
                "late": self.late, "finished": self.finished, "pinned": self.pinned or "",
                "refused": self.refused, "kept": sum(len(k) for k in self._kept.values()),
                "mean_wait_ms": 1e3 * self.wait_total / max(1, self.followed + self.late),
                "followed_share": self.followed / decided if decided else 0.0}
