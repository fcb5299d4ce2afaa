"""The control plane of a peer: an authenticated asyncio server that answers who-are-you,
PROPOSE, COMMIT and status requests, a pool of client connections for asking others, and
liveness watches on the current members (heartbeats of the transport: a member that dies
or goes silent is reported within the heartbeat timeout, whatever the ring is doing).

Nothing on the control port carries a tensor: peers send PEER_HELLO, PROPOSE, COMMIT and
REFORM, ``swarmtrain ctl`` sends its commands, and the answers are PEER_INFO, ACCEPT, STATUS
or ERROR (the joiner's state travels over the ring, by broadcast). So every frame, either
way, is held to a msgpack header (:data:`PEER_FRAME_LIMITS`: 1 MiB, room for a proposal of
thousands of members; :data:`CTL_FRAME_LIMITS` from ``ctl``: 64 KiB) and no payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.errors import SwarmError
from swarmtrain.roles.peer.membership import Candidate, Membership
from swarmtrain.transport import Connection, Server, Timeouts, connect, start_server
from swarmtrain.transport.endpoints import ServerLimits
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import (
    Commit,
    Error,
    Limits,
    Message,
    PeerHello,
    PeerInfoMsg,
    Propose,
    Reform,
    Status,
    StatusRequest,
)

__all__ = ["CTL_FRAME_LIMITS", "ControlPlane", "PEER_FRAME_LIMITS"]

log = logging.getLogger("swarmtrain.roles.peer.control")

#: what a frame between peers' control planes may carry (both ways): membership messages only
PEER_FRAME_LIMITS = Limits(max_header_bytes=1 << 20, max_payload_bytes=0, max_tensors=0)
#: what a frame from ``swarmtrain ctl`` may carry: a command
CTL_FRAME_LIMITS = Limits(max_header_bytes=64 << 10, max_payload_bytes=0, max_tensors=0)


@dataclass
class ControlPlane:
    """Serves and asks membership questions; watches members' liveness.

    Args:
        run: the run name; peers of other runs are refused.
        info: returns this node's PEER_INFO answer.
        status: returns this node's status dict.
        on_member_lost: called with a peer id when a watched member's connection dies.
        tls: mutual TLS for every control connection (None = plain TCP).
        server_limits: connections the control server holds at most, in total and per
            address, and the failed-handshake lockout.
    """

    run: str
    secret: bytes | None
    timeouts: Timeouts
    info: Callable[[], PeerInfoMsg]
    status: Callable[[], dict[str, Any]]
    on_member_lost: Callable[[str], None]
    on_reform: Callable[[Reform], None] = lambda msg: None
    #: True for a member that announced it is leaving (its closing connection is routine)
    said_goodbye: Callable[[str], bool] = lambda peer_id: False
    tls: TLSConfig | None = None
    server_limits: ServerLimits = ServerLimits()
    membership: Membership | None = None
    server: Server | None = None
    _pool: dict[str, Connection] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _watched: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def start(self, host: str, port: int) -> int:
        self.server = await start_server(
            host, port, self._serve, secret=self.secret, tls=self.tls, timeouts=self.timeouts,
            limits=PEER_FRAME_LIMITS, role_limits={"peer": PEER_FRAME_LIMITS, "ctl": CTL_FRAME_LIMITS},
            server_limits=self.server_limits)
        return self.server.port

    async def close(self) -> None:
        for t in self._watched.values():
            t.cancel()
        await asyncio.gather(*self._watched.values(), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._pool.values()), return_exceptions=True)
        if self.server is not None:
            await self.server.close()

    # -- serving ---------------------------------------------------------------------------

    async def _serve(self, conn: Connection, role: str) -> None:
        if role not in ("peer", "ctl"):
            await conn.close(Error(code="bad_role", message=f"this is a peer; role {role!r} is not served"))
            return
        assert self.server is not None
        note = self.server.admission.note_refused  # counted with what the server turned away
        with contextlib.suppress(SwarmError, ConnectionError):
            while True:
                msg = await conn.recv()
                answer = self._answer(msg)
                if isinstance(answer, Error):
                    note(answer.code)
                await conn.send(answer)

    def _answer(self, msg: Message) -> Message:
        m = self.membership
        if isinstance(msg, PeerHello):
            if msg.run != self.run:
                return Error(code="other_run", fatal=False, message=f"this peer trains run {self.run!r}")
            return self.info()
        if isinstance(msg, StatusRequest):
            return Status(status=self.status())
        if m is None:
            return Error(code="not_ready", fatal=False, message="membership not started yet")
        if isinstance(msg, Propose):
            return m.on_propose(msg)
        if isinstance(msg, Commit):
            installed = m.on_commit(msg)
            return Status(status={"installed": installed, "epoch": m.epoch})
        if isinstance(msg, Reform):
            self.on_reform(msg)
            return Status(status={"epoch": m.epoch, "leader": m.my_leader()})
        return Error(code="unexpected", fatal=False, message=f"a peer does not answer {msg.TYPE.name}")

    # -- asking ----------------------------------------------------------------------------

    async def _conn(self, c: Candidate, timeout: float) -> Connection:
        conn = self._pool.get(c.peer_id)
        if conn is None or conn.is_closed:
            timeouts = Timeouts(connect=timeout, handshake=timeout,
                                heartbeat_interval=self.timeouts.heartbeat_interval,
                                heartbeat_timeout=self.timeouts.heartbeat_timeout)
            conn = await connect(c.host, c.port, secret=self.secret, tls=self.tls, role="peer",
                                 limits=PEER_FRAME_LIMITS, timeouts=timeouts)
            self._pool[c.peer_id] = conn
        return conn

    async def ask(self, c: Candidate, msg: Message, timeout: float) -> Message | None:
        """Send ``msg`` to a candidate and return its answer, or None if it does not answer."""
        lock = self._locks.setdefault(c.peer_id, asyncio.Lock())
        try:
            async with lock:
                async with asyncio.timeout(timeout):
                    conn = await self._conn(c, timeout)
                await conn.send(msg, timeout=timeout)
                return await conn.recv(timeout=timeout, phase=f"answer to {msg.TYPE.name}")
        except (SwarmError, ConnectionError, OSError, TimeoutError) as exc:
            log.debug("no answer from %s:%d: %s", c.host, c.port, exc)
            dropped = self._pool.pop(c.peer_id, None)
            if dropped is not None:
                dropped.abort(SwarmError("dropped after a failed request"))
            return None

    async def probe(self, host: str, port: int, timeout: float = 3.0) -> PeerInfoMsg | None:
        """Ask the node at host:port who it is (for static peer lists)."""
        ans = await self.probe_detail(host, port, timeout)
        return ans if isinstance(ans, PeerInfoMsg) else None

    async def probe_detail(self, host: str, port: int, timeout: float = 3.0) -> PeerInfoMsg | SwarmError:
        """Ask the node at host:port who it is, over an authenticated connection: its answer,
        or what went wrong (:class:`~swarmtrain.errors.AuthError` if the secrets differ)."""
        try:
            conn = await connect(host, port, secret=self.secret, tls=self.tls, role="peer",
                                 limits=PEER_FRAME_LIMITS,
                                 timeouts=Timeouts(connect=timeout, handshake=timeout))
        except SwarmError as exc:
            return exc
        except (ConnectionError, OSError) as exc:
            return SwarmError(f"cannot reach {host}:{port}: {exc}")
        try:
            await conn.send(PeerHello(run=self.run))
            ans = await conn.recv(timeout=timeout, phase="peer hello")
            if isinstance(ans, PeerInfoMsg):
                return ans
            return SwarmError(f"{host}:{port} answered {ans.TYPE.name}: "
                              f"{getattr(ans, 'message', '') or getattr(ans, 'code', '')}")
        except SwarmError as exc:
            return exc
        except ConnectionError as exc:
            return SwarmError(f"{host}:{port} closed the connection: {exc}")
        finally:
            await conn.close()

    # -- liveness --------------------------------------------------------------------------

    def watch(self, members: dict[str, Candidate]) -> None:
        """Keep a heartbeating connection to each of ``members``; stop watching the others."""
        for pid in list(self._watched):
            if pid not in members:
                self._watched.pop(pid).cancel()
        for pid, c in members.items():
            if pid not in self._watched or self._watched[pid].done():
                self._watched[pid] = asyncio.create_task(self._watch_one(c))

    async def _watch_one(self, c: Candidate) -> None:
        try:
            conn = await self._conn(c, self.timeouts.heartbeat_timeout)
            await conn.wait_closed()
            reason = conn.close_reason
        except (SwarmError, ConnectionError, OSError, TimeoutError) as exc:
            reason = exc
        if self.said_goodbye(c.peer_id):
            log.info("member %s has left", c.peer_id[:8])
        else:
            log.warning("lost member %s (%s)", c.peer_id[:8], reason)
        self._pool.pop(c.peer_id, None)
        self.on_member_lost(c.peer_id)
