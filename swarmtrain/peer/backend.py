"""`PeerBackend`: zero-configuration collectives for a training loop, with membership that
survives failures.

The control plane (discovery, membership, liveness) runs on an asyncio loop in a
background thread; collectives run on the caller's thread over the ring of the current
epoch. When a member dies or goes silent, its heartbeats stop, the ring is aborted (so a
collective in progress fails fast instead of hanging), the survivors agree a new epoch,
and :meth:`all_reduce` is retried on the new ring with the caller's original input.

Every collective begins at a round boundary: the proposer takes in joiners and drops
leavers there, and every member moves to the newest epoch. State registered with
:meth:`PeerBackend.sync_state` is loaded from the epoch's donor on the first collective of
every new epoch, on every member, so a joiner holds the group's state before it contributes.

    backend = PeerBackend(PeerOptions(run="myrun"), secret=b"...")
    backend.start()
    backend.wait_for_peers(2, timeout=60)
    for batch in loader:
        backend.sync_state(list(model.parameters()))
        grads = backend.all_reduce(grads, op="mean")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import torch

from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.peer.control import ControlPlane
from swarmtrain.peer.discovery import Discovery, MdnsDiscovery, PeerInfo, StaticDiscovery
from swarmtrain.peer.identity import Identity
from swarmtrain.peer.membership import Candidate, Membership, View, check_signature
from swarmtrain.peer.ring import RingBroken, RingGroup, RingListener
from swarmtrain.transport import Timeouts
from swarmtrain.transport.endpoints import ServerLimits
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import PROTOCOL_VERSION, PeerInfoMsg, Reform

__all__ = ["NonFiniteResult", "PeerBackend", "PeerOptions", "load_state_bytes", "state_bytes"]

log = logging.getLogger("swarmtrain.peer")
T = TypeVar("T")


def state_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` back to back as one flat uint8 CPU buffer: a state broadcast carries every
    dtype exactly (int64 counters, float64, half-precision weights)."""
    return torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def load_state_bytes(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a buffer made by :func:`state_bytes` back into ``tensors`` (the inverse)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            t.copy_(flat[offset:offset + n].clone().view(t.dtype).view_as(t))
            offset += n


class NonFiniteResult(SwarmError):
    """An all-reduce result holds NaN or Inf (asked for with ``check_finite=True``): some
    member contributed a non-finite value. Every member holds the same reduced bits, so every
    member raises alike and can skip the step alike."""


@dataclass(frozen=True)
class PeerOptions:
    """How a peer finds others, how long each phase may take (seconds), and what its control
    server and its ring listener each admit (``max_connections``, per address, and the failed
    handshakes after which an address is refused for a minute: :class:`ServerLimits`)."""

    run: str = "default"
    min_peers: int = 1
    host: str = "0.0.0.0"
    port: int = 7200
    ring_port: int = 0
    advertise_host: str = ""
    mdns: bool = True
    static_peers: tuple[tuple[str, int], ...] = ()
    profile: str = ""  #: hardware profile name advertised to others; detected if empty
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    propose_timeout: float = 3.0
    ring_timeout: float = 120.0
    reform_timeout: float = 60.0
    wire: str = "fp32"
    max_connections: int = 256
    max_connections_per_address: int = 32
    max_failed_auth: int = 10

    @property
    def server_limits(self) -> ServerLimits:
        return ServerLimits(max_connections=self.max_connections,
                            max_per_address=self.max_connections_per_address,
                            max_failed_auth=self.max_failed_auth)


@dataclass
class PeerBackend:
    """Collectives over a ring of peers that find each other and agree membership per epoch.

    Args:
        options: see :class:`PeerOptions`.
        secret: the cluster secret (authenticates control and ring connections).
        identity: this node's key pair (default: the persistent one in the config directory).
        tls: mutual TLS for the control and the ring connections (None = plain TCP).
    """

    options: PeerOptions = field(default_factory=PeerOptions)
    secret: bytes | None = None
    identity: Identity | None = None
    tls: TLSConfig | None = None
    #: all-reduces completed by the group, carried with the state: the member with the most
    #: is the donor of a new epoch (the CLI's trainer sets it to its round instead)
    rounds: int = 0
    #: REFORM requests refused: unsigned, or not signed by the member they name
    forged_reforms: int = 0
    _state: list[torch.Tensor] | None = None
    _synced_epoch: int = 0
    #: sync_state has just run the round boundary: the step's collective does not run it again
    _at_boundary: bool = False
    _ring_view: View | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _ring: RingGroup | None = None
    _ring_lock: threading.Lock = field(default_factory=threading.Lock)
    _suspects: dict[str, float] = field(default_factory=dict)
    _known: dict[str, Candidate] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    _closed_bytes: tuple[int, int] = (0, 0)
    CLOSE_POLITELY_SEC: ClassVar[float] = 8.0  # goodbyes and closing connections
    CLOSE_FORCE_SEC: ClassVar[float] = 4.0  # then cancelling whatever is left

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start listening, advertising and discovering (returns when ready)."""
        self.identity = self.identity or Identity.load_or_create()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-peer-control",
                                        daemon=True)
        self._thread.start()
        self._call(self._start_async(), timeout=30)

    async def _start_async(self) -> None:
        o = self.options
        assert self.identity is not None
        if not o.profile:
            from swarmtrain import hardware

            self.options = o = replace(o, profile=hardware.detect().profile.value)
        self.listener = RingListener(o.host, o.ring_port, secret=self.secret, tls=self.tls,
                                     limits=o.server_limits)
        self.control = ControlPlane(
            run=o.run, secret=self.secret, tls=self.tls,
            timeouts=Timeouts(handshake=o.propose_timeout, heartbeat_interval=o.heartbeat_interval,
                              heartbeat_timeout=o.heartbeat_timeout),
            info=self._info, status=self.status, on_member_lost=self._member_lost,
            on_reform=self._reform_requested, server_limits=o.server_limits)
        self.port = await self.control.start(o.host, o.port)
        advertise = o.advertise_host or ("" if o.host in ("0.0.0.0", "::") else o.host)
        self.ring_address = (advertise or "127.0.0.1", self.listener.address[1])
        self.membership = Membership(self.identity, ring_address=self.ring_address,
                                     send=self.control.ask, rounds=lambda: self.rounds,
                                     propose_timeout=o.propose_timeout)
        self.membership.on_install = self._epoch_installed
        self.control.membership = self.membership
        self.discovery: Discovery
        if o.static_peers:
            self.discovery = StaticDiscovery(list(o.static_peers), probe=self._probe_peer)
        else:
            self.discovery = MdnsDiscovery()
        me = PeerInfo(peer_id=self.identity.peer_id, host=advertise, port=self.port,
                      ring_port=self.listener.address[1], run=o.run, version=PROTOCOL_VERSION,
                      profile=o.profile, public_key=self.identity.public_key)
        await self.discovery.start(me)
        log.info("peer %s of run %r: control port %d, ring port %d", self.identity.peer_id[:8],
                 o.run, self.port, self.listener.address[1])

    def close(self) -> None:
        """Leave: stop advertising, close the ring and every connection."""
        with self._ring_lock:
            if self._ring is not None:
                self._ring.close()
                self._ring = None
        if self._loop is not None:
            try:
                self._call(self._close_async(), timeout=self.CLOSE_POLITELY_SEC + self.CLOSE_FORCE_SEC + 5)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                if self._thread is not None:
                    self._thread.join(timeout=10)
                self._loop.close()
                self._loop = None

    async def _close_async(self) -> None:
        try:
            async with asyncio.timeout(self.CLOSE_POLITELY_SEC):
                await self.discovery.stop()
                await self.control.close()
        except TimeoutError:
            log.warning("peer shutdown: saying goodbye took over %.0f s; closing anyway",
                        self.CLOSE_POLITELY_SEC)
        self.listener.close()
        # connections opened for probes and by peers are still running: end them here, so
        # the loop closes with nothing pending. A task that ignores one cancellation gets more.
        rest = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
        deadline = time.monotonic() + self.CLOSE_FORCE_SEC
        while rest and time.monotonic() < deadline:
            for t in rest:
                t.cancel()
            _, rest = await asyncio.wait(rest, timeout=0.5)
        if rest:
            log.warning("peer shutdown: %d task(s) would not stop: %s", len(rest),
                        ", ".join(sorted(t.get_name() for t in rest)))

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        assert self._loop is not None, "call start() first"
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except SwarmTimeout:
            raise  # a named phase inside the call (reform, discovery...): its own name and limit
        except concurrent.futures.TimeoutError:
            if fut.done():  # finished meanwhile, or failed with a timeout of its own: its outcome
                return fut.result(0)
            fut.cancel()
            raise SwarmTimeout("peer control", timeout) from None

    # -- who is there ----------------------------------------------------------------------

    def _info(self) -> PeerInfoMsg:
        assert self.identity is not None
        return PeerInfoMsg(peer_id=self.identity.peer_id, public_key=self.identity.public_key,
                           ring_port=self.listener.address[1], run=self.options.run,
                           profile=self.options.profile, epoch=self.membership.epoch, rounds=self.rounds)

    async def _probe_peer(self, host: str, port: int) -> PeerInfo | None:
        ans = await self.control.probe(host, port)
        if ans is None:
            return None
        return PeerInfo(peer_id=ans.peer_id, host=host, port=port, ring_port=ans.ring_port,
                        run=ans.run, version=PROTOCOL_VERSION, profile=ans.profile,
                        public_key=ans.public_key)

    def _candidates(self) -> dict[str, Candidate]:
        """Peers to consider: those discovery shows, plus the current members it has not
        shown yet (discovery can lag; liveness watches catch members that really died)."""
        found = {p.peer_id: Candidate(p.peer_id, p.host, p.port, p.ring_port)
                 for p in self.discovery.peers().values()}
        self._known.update(found)
        v = self.view
        for pid in v.members if v else ():
            if pid not in found and pid in self._known and pid != self.membership.me:
                found[pid] = self._known[pid]
        return found

    def wait_for_peers(self, min_peers: int, timeout: float) -> list[PeerInfo]:
        """Block until ``min_peers`` other peers of this run are known.

        Raises:
            SwarmTimeout: "found X of Y peers" after ``timeout`` seconds.
        """
        return self._call(self.discovery.wait_for_peers(min_peers, timeout), timeout + 5)

    def _member_lost(self, peer_id: str) -> None:
        """A watched member died or went silent: abort the ring so collectives fail fast."""
        self._suspects[peer_id] = time.monotonic() + 30.0
        with self._ring_lock:
            if self._ring is not None:
                self._ring.close()

    def _epoch_installed(self, view: View) -> None:
        """A newer epoch supersedes the current ring: abort it, so a member still inside a
        collective of the old epoch fails fast and moves on instead of waiting for peers
        that have already left that ring."""
        with self._ring_lock:
            if self._ring is not None and self._ring.epoch < view.epoch:
                self._ring.close()

    def _reform_requested(self, msg: Reform) -> None:
        """A member's ring broke: abort ours too (our collective cannot finish either), so our
        training loop recovers and, as proposer, agrees the next epoch."""
        if not check_signature(msg):
            self.forged_reforms += 1
            log.warning("ignoring a REFORM that %s did not sign (unsigned or forged; %d so far)",
                        msg.peer_id[:8], self.forged_reforms)
            return
        v = self.view
        if v is not None and msg.peer_id in v.members and msg.epoch >= v.epoch:
            log.info("member %s reports epoch %d broke", msg.peer_id[:8], msg.epoch)
            with self._ring_lock:
                if self._ring is not None and self._ring.epoch <= msg.epoch:
                    self._ring.close()

    def _live_suspects(self) -> set[str]:
        now = time.monotonic()
        return {p for p, until in self._suspects.items() if until > now}

    # -- epochs ----------------------------------------------------------------------------

    @property
    def view(self) -> View | None:
        return self.membership.view

    @property
    def rank(self) -> int:
        v = self.view
        assert v is not None and self.identity is not None, "no epoch agreed yet"
        return v.rank(self.identity.peer_id)

    @property
    def world_size(self) -> int:
        return self.view.world_size if self.view else 1

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def propose_if_needed(self) -> bool:
        """At the start of a round: if this node leads and peers came or went, agree a new
        epoch (members pick it up before their next collective). True if one was agreed."""
        return self._call(self._propose_async(), self.options.propose_timeout * 10 + 10)

    async def _propose_async(self) -> bool:
        self.membership.ready = True
        cands = {p: c for p, c in self._candidates().items() if p not in self._live_suspects()}
        m = self.membership
        if m.leader(cands, self._live_suspects()) == m.me and m.needs_new_view(cands):
            self._learn_own_address(cands)
            # the first epoch waits for min_peers members: training starts with all of them
            first = m.view is None
            view = await m.propose(cands, min_members=self.options.min_peers if first else 1)
            return view is not None
        return False

    def refresh(self, timeout: float | None = None) -> bool:
        """At a round boundary, before a collective: wait for the first epoch if there is none
        yet; as proposer, agree a new epoch if peers came or went (:meth:`propose_if_needed`);
        rebuild the ring if the epoch changed. True if it changed.

        Raises:
            SwarmTimeout: phase ``reform`` if no first epoch is agreed within
                ``reform_timeout`` (nobody proposed us in), ``peer control`` after ``timeout``.
        """
        return self._call(self._refresh_async(), timeout or self.options.reform_timeout + 10)

    async def _refresh_async(self) -> bool:
        self.membership.ready = True
        if not await self._propose_async() and self.membership.view is None:
            await self._await_view(0)
        return await self._ensure_ring()

    def _learn_own_address(self, cands: dict[str, Candidate]) -> None:
        """The address others reach our ring listener at: configured, or the source address
        the kernel would use toward a peer (a UDP connect sends nothing)."""
        if self.options.advertise_host or not cands:
            return
        import socket

        host = next(iter(cands.values())).host
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((host, 9))
                mine = s.getsockname()[0]
            except OSError:
                return
        self.ring_address = (mine, self.listener.address[1])
        self.membership.ring_address = self.ring_address

    async def _await_view(self, above: int) -> None:
        """Wait for a committed view with an epoch above ``above``; take over proposing if the
        expected proposer stays silent."""
        m = self.membership
        deadline = time.monotonic() + self.options.reform_timeout
        while m.epoch <= above:
            if time.monotonic() > deadline:
                raise SwarmTimeout("reform", self.options.reform_timeout,
                                   f"no new epoch after epoch {above}; peers: {sorted(self._candidates())}")
            cands = {p: c for p, c in self._candidates().items() if p not in self._live_suspects()}
            leader = m.leader(cands, self._live_suspects())
            if leader == m.me:
                if not await self._propose_async():
                    await asyncio.sleep(0.5)  # not enough members ready yet
                continue
            m.changed.clear()
            if above and leader in cands:  # tell the proposer our ring broke; it is gone if silent
                answer = await self.control.ask(cands[leader], m.reform_request(above),
                                                self.options.propose_timeout)
                if answer is None:
                    log.info("proposer %s does not answer: treating it as gone", leader[:8])
                    self._suspects[leader] = time.monotonic() + 30.0
                    continue
            try:
                async with asyncio.timeout(self.options.propose_timeout * 3):
                    await m.changed.wait()
            except TimeoutError:
                pass

    async def _ensure_ring(self) -> bool:
        v = self.membership.view
        assert v is not None
        with self._ring_lock:
            current = self._ring
        if current is not None and current.epoch == v.epoch:
            return False
        members = {p: self._candidates().get(p) for p in v.members if p != self.membership.me}
        self.control.watch({p: c for p, c in members.items() if c is not None})
        loop = asyncio.get_running_loop()
        ring = await loop.run_in_executor(None, self._build_ring, v)
        with self._ring_lock:
            old, self._ring, self._ring_view = self._ring, ring, v
        if old is not None:
            self._account(old, closing=True)
            old.close()
        return True

    def _build_ring(self, v: View) -> RingGroup:
        assert self.identity is not None
        return RingGroup(self.listener, v.rank(self.identity.peer_id), v.ring_addresses(),
                         ring_id=self.options.run, epoch=v.epoch, secret=self.secret,
                         timeout=self.options.ring_timeout, tls=self.tls)

    def recover(self, failed_epoch: int) -> None:
        """After a broken ring: agree a new epoch without the lost peers and rebuild the ring."""
        self._call(self._recover_async(failed_epoch), self.options.reform_timeout + 30)

    async def _recover_async(self, failed_epoch: int) -> None:
        """A broken ring's epoch is spent (its connections are gone on some members): the
        next collective needs a view of a later epoch, even if nobody left — the proposer
        then commits the same members under a new epoch number."""
        m = self.membership
        if m.epoch <= failed_epoch:
            cands = {p: c for p, c in self._candidates().items() if p not in self._live_suspects()}
            if m.leader(cands, self._live_suspects()) == m.me:
                self._learn_own_address(cands)
                await m.propose(cands, known_epoch=failed_epoch, renew=True)
            else:
                await self._await_view(failed_epoch)
        await self._ensure_ring()

    # -- collectives -----------------------------------------------------------------------

    def sync_state(self, tensors: Sequence[torch.Tensor], *, retries: int = 5) -> bool:
        """At the top of every step, on every member: the round boundary, and the state that
        a new epoch starts from.

        Runs :meth:`refresh` (as proposer, takes in joiners and drops leavers; moves to the
        newest epoch) and registers ``tensors`` (weights, optimizer state: any dtype, any
        shape) as this run's state. On the first collective of every new epoch, this call's
        or a later one's (an epoch can change inside :meth:`all_reduce` too), every member
        loads the state of the epoch's *donor* (the member with the most :attr:`rounds`)
        into its tensors, in place. So a joiner holds the group's current state before it
        contributes, and the first epoch starts everyone from the same state.

        Args:
            tensors: the state, in the same order and shapes on every member.
            retries: times to re-form and try again if the ring breaks while loading.

        Returns:
            True if the state was loaded (or sent, on the donor) by this call.

        Raises:
            SwarmTimeout: as for :meth:`refresh`. RingBroken: after ``retries`` failures.
        """
        self._state = list(tensors)
        self.refresh()
        before = self._synced_epoch
        self._ready_ring(retries)
        self._at_boundary = True  # the step's collective needs no second boundary
        return self._synced_epoch != before

    def _current_ring(self) -> RingGroup:
        with self._ring_lock:
            ring = self._ring
        if ring is None:
            raise SwarmError("no ring yet: call refresh() (or wait_for_peers) first")
        return ring

    def _ready_ring(self, retries: int) -> RingGroup:
        """The current ring, once the registered state has been loaded on it if it belongs to
        an epoch not synced yet: that broadcast is the first collective of every epoch on
        every member, whichever call moved it there."""
        for attempt in range(retries + 1):
            ring = self._current_ring()
            if self._state is None or ring.epoch == self._synced_epoch:
                return ring
            try:
                self._load_donor_state(ring)
                return ring
            except RingBroken as exc:
                if attempt == retries:
                    raise
                log.warning("epoch %d ring broke while loading the state (%s); re-forming",
                            ring.epoch, exc)
                self.recover(ring.epoch)
        raise AssertionError("unreachable")

    def _load_donor_state(self, ring: RingGroup) -> None:
        """Broadcast the registered state (and the rounds counter) from the donor of the
        ring's epoch. Received into a buffer first: a broken broadcast changes nothing."""
        view = self._ring_view
        assert view is not None and view.epoch == ring.epoch and self._state is not None
        parts = [torch.tensor([self.rounds], dtype=torch.int64), *self._state]
        flat = state_bytes(parts)
        ring.broadcast(flat, root=view.rank(view.donor))
        load_state_bytes(flat, parts)
        self.rounds = int(parts[0])
        self._synced_epoch = ring.epoch
        log.info("epoch %d: state of %d collective(s) loaded from donor %s", ring.epoch,
                 self.rounds, view.donor[:8])

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean", *, weight: float | None = None,
                   wire: str | None = None, retries: int = 5, boundary: bool = True,
                   check_finite: bool = False) -> torch.Tensor:
        """All-reduce ``tensor`` in place over the current members; on a broken ring, agree a
        new epoch and retry with the original input (at most ``retries`` times).

        Args:
            op: ``sum`` or ``mean``; with ``weight``, the result is Σ wᵢxᵢ / Σ wᵢ.
            wire: ``fp32``, ``fp16`` or ``int8`` (default: the options').
            boundary: first run the round boundary (:meth:`refresh`: joiners are taken in and
                leavers dropped). The CLI's trainer passes False: it runs its own boundary.
            check_finite: raise :class:`NonFiniteResult` if the result holds NaN or Inf
                (otherwise it is returned as it is; every member gets the same bits).

        Raises:
            RingBroken: after ``retries`` failures. NonFiniteResult: see ``check_finite``.
        """
        if boundary and not self._at_boundary:
            self.refresh()
        self._at_boundary = False
        original = tensor.clone()

        def reduce(ring: RingGroup) -> torch.Tensor:
            out = ring.all_reduce(tensor, op, weight=weight, wire=wire or self.options.wire)
            self._account(ring)
            return out

        out, ring = self._retrying("the all-reduce", reduce, retries, lambda: tensor.copy_(original))
        self.rounds += 1
        if check_finite and not bool(torch.isfinite(out).all()):
            raise NonFiniteResult(f"the all-reduce result of epoch {ring.epoch} holds NaN or Inf: a "
                                  "member contributed a non-finite value; skip this step everywhere")
        return out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Copy rank ``root``'s ``tensor`` into every member's, in place (no retry: a rank
        names another member in another epoch).

        Raises:
            RingBroken: a member died or the epoch changed; call :meth:`refresh` and decide again.
        """
        return self._ready_ring(0).broadcast(tensor, root)

    def barrier(self, *, retries: int = 5) -> None:
        """Return once every member has entered the barrier (a round boundary: see
        :meth:`refresh`); on a broken ring, agree a new epoch and wait again.

        Raises:
            RingBroken: after ``retries`` failures.
        """
        if not self._at_boundary:
            self.refresh()
        self._at_boundary = False
        self._retrying("the barrier", lambda ring: ring.barrier(), retries)

    def _retrying(self, what: str, run: Callable[[RingGroup], T], retries: int,
                  before_retry: Callable[[], object] = lambda: None) -> tuple[T, RingGroup]:
        """``run`` on the current ring (its epoch's state loaded first); on a broken ring,
        agree a new epoch and run again, at most ``retries`` more times. One retry loop: the
        state load and the collective share it."""
        for attempt in range(retries + 1):
            try:
                ring = self._ready_ring(0)
                return run(ring), ring
            except RingBroken as exc:
                if attempt == retries:
                    raise
                epoch = exc.epoch if exc.epoch is not None else self.epoch
                log.warning("epoch %d ring broke in %s (%s); re-forming", epoch, what, exc)
                before_retry()
                self.recover(epoch)
        raise AssertionError("unreachable")

    def _account(self, ring: RingGroup, *, closing: bool = False) -> None:
        """Bytes moved by collectives: those of closed rings plus the current one's."""
        if closing:
            self._closed_bytes = (self._closed_bytes[0] + ring.bytes_sent,
                                  self._closed_bytes[1] + ring.bytes_received)
            self.bytes_sent, self.bytes_received = self._closed_bytes
        else:
            self.bytes_sent = self._closed_bytes[0] + ring.bytes_sent
            self.bytes_received = self._closed_bytes[1] + ring.bytes_received

    def status(self) -> dict[str, Any]:
        v = self.view
        server = self.control.server
        return {"peer_id": self.identity.peer_id if self.identity else "", "run": self.options.run,
                "epoch": self.epoch, "members": list(v.members) if v else [],
                "rank": v.rank(self.identity.peer_id) if v and self.identity else -1,
                "world_size": self.world_size, "rounds": self.rounds,
                # frames served on the control port, by message type
                "traffic": self.control.server.traffic() if self.control.server is not None else {},
                # connections turned away (by reason) and failed handshakes, per listener
                "control_refused": server.admission.refusals() if server is not None else {},
                "control_failed_handshakes": server.failed_handshakes if server is not None else 0,
                "ring_refused": self.listener.admission.refusals(),
                "ring_failed_handshakes": self.listener.admission.failed_handshakes,
                "forged_reforms": self.forged_reforms,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}
