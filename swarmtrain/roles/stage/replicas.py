"""Replicas of one stage keep their weights together by periodic parameter averaging.

A :class:`ReplicaSync` belongs to one stage server and averages its state with each of its
sync peers (other servers of the same stage) in turn. The state averaged is the stage's
trainable parameters (the float32 masters of half-precision ones) and its buffers
(BatchNorm's running statistics and counters); frozen parameters never travel and are never
moved. One round with one peer:

1. take a snapshot ``mine`` of that state on the compute thread;
2. send it (STAGE_SYNC); the peer moves halfway towards ``mine`` and answers with
   ``theirs``, its own state as it was just before;
3. move halfway towards ``theirs`` on the compute thread: ``p += (theirs - mine) / 2``
   (an integer buffer, a counter, goes to the larger count instead: ``max(mine, theirs)``
   plus what it counted since ``mine``).

Two replicas that did not train during the round end up identical, at the average; work
done during the round is kept on top of it. Configure each pair on one side only (else a
pair averages twice per period). Optimizer state is not averaged. A peer that fails is
logged and counted; training goes on without it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmtrain.errors import SwarmError
from swarmtrain.transport import Connection, Timeouts, connect
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import Limits, StageError, StageSync

__all__ = ["ReplicaState", "ReplicaSync", "fetch_replica_state", "sync_fractions"]

log = logging.getLogger("swarmtrain.roles.stage")

OnComputeThread = Callable[..., Awaitable[Any]]


class ReplicaSync:
    """Parameter (and buffer) averaging of one stage server with its sync peers.

    Args:
        peers: ``(host, port)`` of the replicas to average with.
        on_compute_thread: runs ``kind`` (``"snapshot"`` → synced tensors by name, or
            ``"sync_apply"`` with ``mine=`` and ``theirs=``) on the server's compute thread.
        step: the server's optimizer step now (sent along, informational).
        secret: the cluster secret.
        timeouts: transport timeouts of the connections to peers.
        round_timeout: most seconds one round with one peer may take.
        name: how logs name the server.
        tls: mutual TLS for the connections to peers (None = plain TCP).
    """

    def __init__(self, peers: Sequence[tuple[str, int]], *, on_compute_thread: OnComputeThread,
                 step: Callable[[], int], secret: bytes | None, timeouts: Timeouts,
                 round_timeout: float, name: str, tls: TLSConfig | None = None,
                 trained: Callable[[], int] | None = None) -> None:
        self.peers = list(peers)
        self._on_compute_thread = on_compute_thread
        self._step = step
        self._trained = trained
        self._secret = secret
        self._tls = tls
        self._timeouts = timeouts
        self._round_timeout = round_timeout
        self._name = name
        self._conns: dict[tuple[str, int], Connection] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Future[int] | None = None
        self.rounds = 0
        self.failures = 0
        #: the optimizer step at the snapshot of the newest round that succeeded with a peer
        self.last_synced_step = 0

    async def sync_now(self) -> int:
        """Average with every peer once, now.

        Returns:
            How many peers the round succeeded with.
        """
        ok = 0
        for peer in self.peers:
            try:
                async with asyncio.timeout(self._round_timeout):
                    await self._sync_with(peer)
                ok += 1
            except (SwarmError, OSError, TimeoutError) as exc:
                self.failures += 1
                log.warning("%s: parameter sync with %s:%d failed: %s", self._name, *peer, exc)
                conn = self._conns.pop(peer, None)
                if conn is not None:
                    conn.abort(SwarmError("sync failed"))
        self.rounds += 1
        return ok

    def start_round(self) -> None:
        """Start a round in the background unless one is running; call on the event loop."""
        if self.peers and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self.sync_now())

    async def close(self) -> None:
        """Stop a running round and close the connections to peers."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for conn in self._conns.values():
            await conn.close()
        self._conns.clear()

    async def _sync_with(self, peer: tuple[str, int]) -> None:
        conn = self._conns.get(peer)
        if conn is None or conn.is_closed:
            conn = await connect(*peer, secret=self._secret, tls=self._tls, role="stage",
                                 timeouts=self._timeouts)
            self._conns[peer] = conn
        mine = await self._on_compute_thread("snapshot")
        at_step = self._step()
        trained = {} if self._trained is None else {"trained": self._trained()}
        req = next(self._ids)
        await conn.send(StageSync(req=req, round=req, step=at_step, tensors=mine, meta=trained))
        while True:
            answer = await conn.recv(timeout=self._round_timeout, phase="sync")
            if isinstance(answer, StageError):
                raise SwarmError(f"replica refused the sync: {answer.message} [{answer.code}]")
            if isinstance(answer, StageSync) and answer.reply and answer.req == req:
                break
        await self._on_compute_thread("sync_apply", mine=mine, theirs=dict(answer.tensors),
                                      meta={**answer.meta, "at_step": at_step, "their_step": answer.step})
        self.last_synced_step = max(self.last_synced_step, at_step)


def sync_fractions(mine_trained: int, theirs_trained: int | None) -> tuple[float, float]:
    """How far each replica of a sync round moves towards the other: ``(mine, theirs)``, from
    the optimizer steps each took since its last round. A replica that did not train while
    the other did takes the other's state (1.0) and the other keeps its own (0.0): under the
    synchronous schedule one replica trains and the others stand by, and averaging with a
    standby would undo half of the training since the last round. Both trained (the
    asynchronous schedule spreads micro-batches over replicas) or neither: halfway each
    (0.5). ``theirs_trained`` None (a peer that does not say): halfway."""
    if theirs_trained is None:
        return 0.5, 0.5
    if mine_trained == 0 and theirs_trained > 0:
        return 1.0, 0.0
    if theirs_trained == 0 and mine_trained > 0:
        return 0.0, 1.0
    return 0.5, 0.5


@dataclass(frozen=True)
class ReplicaState:
    """The whole state of a live replica, as a joining one copies it.

    Attributes:
        peer: ``(host, port)`` it came from.
        tensors: ``model/``, ``master/`` and ``adam/`` tensors (see
            :meth:`~swarmtrain.roles.stage.compute.StageCompute.export_state`).
        meta: optimizer steps, lineage, shape signature, fingerprint, optimizer settings.
    """

    peer: tuple[str, int]
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def steps(self) -> int:
        return int(self.meta.get("steps", 0))


async def fetch_replica_state(peers: Sequence[tuple[str, int]], *, secret: bytes | None, timeouts: Timeouts,
                              timeout: float, max_bytes: int, tls: TLSConfig | None = None,
                              name: str = "stage") -> ReplicaState | None:
    """Ask each of ``peers`` (live replicas of this stage) for its whole state and keep the
    one that has trained most (the most optimizer steps); None if none answered.

    Args:
        peers: replicas to ask.
        secret: the cluster secret.
        timeouts: transport timeouts.
        timeout: most seconds one peer may take to answer.
        max_bytes: most payload bytes one answer may carry (the state of these layers, with
            the optimizer's, is about four times their parameters).
        tls: mutual TLS (None = plain TCP).
        name: how logs name the asking stage.
    """
    async def ask(peer: tuple[str, int]) -> ReplicaState | None:
        try:
            async with asyncio.timeout(timeout):
                conn = await connect(*peer, secret=secret, tls=tls, role="stage", timeouts=timeouts,
                                     limits=Limits(max_payload_bytes=max_bytes))
                try:
                    await conn.send(StageSync(req=1, round=0, step=0, join=True))
                    while True:
                        answer = await conn.recv(timeout=timeout, phase="join")
                        if isinstance(answer, StageError):
                            raise SwarmError(f"it refused: {answer.message} [{answer.code}]")
                        if isinstance(answer, StageSync) and answer.reply and answer.join:
                            return ReplicaState(peer, dict(answer.tensors), dict(answer.meta))
                finally:
                    await conn.close()
        except (SwarmError, OSError, TimeoutError) as exc:
            log.warning("%s: could not copy the state of the replica at %s:%d (%s)", name, *peer, exc)
            return None

    found = [s for s in await asyncio.gather(*(ask(p) for p in peers)) if s is not None]
    return max(found, key=lambda s: s.steps, default=None)
