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
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import torch

from swarmtrain.config import PeerDiscoveryConfig, PeerNetworkConfig, PeerTrainingConfig, reused
from swarmtrain.errors import AuthError, StateError, SwarmError, SwarmTimeout
from swarmtrain.roles.peer.control import ControlPlane
from swarmtrain.roles.peer.discovery import Discovery, MdnsDiscovery, PeerInfo, StaticDiscovery
from swarmtrain.roles.peer.membership import Candidate, Membership, ReformKind, View, check_signature
from swarmtrain.roles.peer.ring import RingBroken, RingGroup, RingListener
from swarmtrain.transport import Timeouts
from swarmtrain.transport.auth import cluster_secret
from swarmtrain.transport.identity import Identity, peer_id_of
from swarmtrain.transport.refusals import RefusalCounter, merge_refusals
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import PROTOCOL_VERSION, PeerInfoMsg, Reform

__all__ = ["BackendStateError", "Lifecycle", "NonFiniteResult", "PeerBackend", "PeerOptions",
           "load_state_bytes", "state_bytes"]

log = logging.getLogger("swarmtrain.roles.peer")
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


#: a peer that does not answer is asked again at most this many probe intervals later
PROBE_BACKOFF_CAP = 4


def probe_backoff(interval: float, fails: int) -> float:
    """Seconds until a peer that failed ``fails`` probes in a row (``fails >= 1``) is asked
    again: ``interval`` doubling per failure, capped at ``PROBE_BACKOFF_CAP`` intervals (so a
    peer that comes back is seen within a few intervals, however long it was away)."""
    return interval * min(2 ** (fails - 1), PROBE_BACKOFF_CAP)


class NonFiniteResult(SwarmError):
    """An all-reduce result holds NaN or Inf (asked for with ``check_finite=True``): some
    member contributed a non-finite value. Every member holds the same reduced bits, so every
    member raises alike and can skip the step alike."""


class Lifecycle(enum.Enum):
    """Where a :class:`PeerBackend` is in its life. What may follow what, and on which call,
    is :data:`_LIFECYCLE`; :meth:`PeerBackend._move` refuses anything else."""

    NEW = "new"  #: built: start() next
    STARTING = "starting"  #: start() is bringing up the control loop, the listeners, discovery
    RUNNING = "running"  #: collectives, epochs, recovery
    STOPPING = "stopping"  #: interrupt() was called: every wait ends with RingBroken; close() next
    CLOSING = "closing"  #: close() is saying goodbye and closing every connection
    CLOSED = "closed"  #: nothing runs any more; a closed backend does not start again


class _Step(enum.Enum):
    """What moves a :class:`PeerBackend` from one :class:`Lifecycle` state to the next."""

    START = "start()"
    STARTED = "the end of start()"
    INTERRUPT = "interrupt()"
    CLOSE = "close()"
    CLOSED = "the end of close()"


#: the lifecycle's transitions: for each state, the steps allowed in it and the state each
#: leads to (anything else is refused). An interrupt is allowed everywhere, as signal handlers
#: call it whenever they fire: before start() the peer never starts, while starting it stops
#: as soon as it is up, and once stopping or closing it changes nothing. close() before
#: start() has nothing to close.
_LIFECYCLE: dict[Lifecycle, dict[_Step, Lifecycle]] = {
    Lifecycle.NEW: {_Step.START: Lifecycle.STARTING, _Step.INTERRUPT: Lifecycle.CLOSED,
                    _Step.CLOSE: Lifecycle.CLOSED},
    Lifecycle.STARTING: {_Step.STARTED: Lifecycle.RUNNING, _Step.INTERRUPT: Lifecycle.STOPPING,
                         _Step.CLOSE: Lifecycle.CLOSING},
    Lifecycle.RUNNING: {_Step.INTERRUPT: Lifecycle.STOPPING, _Step.CLOSE: Lifecycle.CLOSING},
    Lifecycle.STOPPING: {_Step.STARTED: Lifecycle.STOPPING, _Step.INTERRUPT: Lifecycle.STOPPING,
                         _Step.CLOSE: Lifecycle.CLOSING},
    Lifecycle.CLOSING: {_Step.INTERRUPT: Lifecycle.CLOSING, _Step.CLOSED: Lifecycle.CLOSED},
    Lifecycle.CLOSED: {_Step.INTERRUPT: Lifecycle.CLOSED, _Step.CLOSE: Lifecycle.CLOSED},
}


class BackendStateError(StateError):
    """A :class:`PeerBackend` was asked for something its :class:`Lifecycle` state does not
    allow (start() twice, start() after close(), a collective before start()...)."""


#: the ring listener's refusal names that mean what a control server's ERROR codes say
_RING_REASONS = {"auth": "auth_failed", "malformed": "bad_handshake", "version": "unsupported_version"}


@dataclass(frozen=True)
class PeerOptions(PeerNetworkConfig, PeerDiscoveryConfig):
    """How a peer finds others, how long each phase may take, and what its control server and
    its ring listener each admit: the keys of a peer's [network] and [peer] sections
    (:class:`~swarmtrain.config.PeerNetworkConfig`, :class:`~swarmtrain.config.PeerDiscoveryConfig`,
    where each is described) and the all-reduce's ``wire`` format, with what only a running
    process knows.

    Attributes:
        mdns: find peers by mDNS (else only ``static_peers``).
        static_peers: ``(host, port)`` of peers to ask directly (``peer.peers`` parsed).
        profile: hardware profile name advertised to others; detected if empty.
    """

    wire: str = reused(PeerTrainingConfig, "wire")
    mdns: bool = True
    static_peers: tuple[tuple[str, int], ...] = ()
    profile: str = ""


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
    #: the training behind this node's state (samples, or member-collectives for callers of
    #: :meth:`all_reduce`): carried with the state, it picks the donor when groups merge
    work: int = 0
    #: REFORM requests refused: unsigned, or not signed by the member they name
    forged_reforms: int = 0
    #: what this peer refused itself, by reason code (``backend.refusals.count("code")``);
    #: ``status()["refusals"]`` adds what the control server and the ring listener turned away
    refusals: RefusalCounter = field(default_factory=RefusalCounter)
    #: the digest of the state every member loaded at the start of :attr:`digest_epoch`
    state_digest: str = ""
    digest_epoch: int = 0
    #: peers whose authenticated answer confirmed their id: only these count as candidates
    _verified: dict[str, Candidate] = field(default_factory=dict)
    _probe_next: dict[str, float] = field(default_factory=dict)
    _probe_fails: dict[str, int] = field(default_factory=dict)
    #: discovered peers that failed authentication (wrong secret?): address -> reason
    unauthenticated: dict[str, str] = field(default_factory=dict)
    _probing: set[str] = field(default_factory=set)
    _probe_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: when each peer said goodbye: for LEAVING_SEC its answers are those of a process that is
    #: shutting down; an answer after that is a restarted peer, welcome again
    _left_at: dict[str, float] = field(default_factory=dict)
    LEAVING_SEC: ClassVar[float] = 5.0
    FORGET_AFTER_FAILS: ClassVar[int] = 150
    _lifecycle: Lifecycle = Lifecycle.NEW
    #: guards :attr:`_lifecycle` (start and close run on the caller's thread, interrupt on any);
    #: reentrant, as a signal handler calling interrupt() may run inside :meth:`_move`
    _lifecycle_lock: threading.RLock = field(default_factory=threading.RLock)
    #: the signed goodbye went out (at most once: from interrupt() or from close())
    _goodbye_said: bool = False
    #: why the current ring was closed when nothing went wrong (a member said goodbye), so
    #: the training loop reports it as routine; "" otherwise
    routine_close: str = ""
    _wake_probe: asyncio.Event = field(default_factory=asyncio.Event)
    _state: list[torch.Tensor] | None = None
    _synced_epoch: int = 0
    #: sync_state has just run the round boundary: the step's collective does not run it again
    _at_boundary: bool = False
    _ring_view: View | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _ring: RingGroup | None = None
    #: guards :attr:`_ring` (and the bytes of the rings let go of); reentrant, as a signal
    #: handler calling interrupt() may run while its thread holds it
    _ring_lock: threading.RLock = field(default_factory=threading.RLock)
    _suspects: dict[str, float] = field(default_factory=dict)
    _known: dict[str, Candidate] = field(default_factory=dict)
    #: bytes (sent, received) by the rings this backend has let go of; the current ring's
    #: own counters hold the rest (:attr:`bytes_sent`, :attr:`bytes_received`)
    _retired_bytes: tuple[int, int] = (0, 0)
    GOODBYE_SEC: ClassVar[float] = 0.5  # telling the members we leave
    CLOSE_POLITELY_SEC: ClassVar[float] = 1.0  # mDNS goodbyes and closing connections
    CLOSE_FORCE_SEC: ClassVar[float] = 0.5  # then cancelling whatever is left

    # -- life cycle ------------------------------------------------------------------------

    def __post_init__(self) -> None:
        # a str secret is its UTF-8 bytes; an empty or non-secret one is refused here
        self.secret = cluster_secret(self.secret)

    @property
    def lifecycle(self) -> Lifecycle:
        """Where this backend is in its life (see :class:`Lifecycle`)."""
        return self._lifecycle

    @property
    def stopping(self) -> bool:
        """True once :meth:`interrupt` or :meth:`close` was called: waits end at once."""
        return self._lifecycle in (Lifecycle.STOPPING, Lifecycle.CLOSING, Lifecycle.CLOSED)

    def _move(self, step: _Step) -> tuple[Lifecycle, Lifecycle]:
        """Take ``step`` from the current state (:data:`_LIFECYCLE`): the states before and after.

        Raises:
            BackendStateError: ``step`` is not allowed in the current state.
        """
        with self._lifecycle_lock:
            while True:
                now = self._lifecycle
                after = _LIFECYCLE[now].get(step)  # (hashing an Enum calls Python code)
                if after is None:
                    allowed = ", ".join(s.value for s in _LIFECYCLE[now]) or "nothing"
                    hint = "; build a new PeerBackend" if now is Lifecycle.CLOSED else ""
                    raise BackendStateError(f"peer backend is {now.value}: {step.value} is not allowed "
                                            f"then (allowed: {allowed}){hint}")
                # A signal handler runs on this thread only at a call or a backward jump, so none
                # can run between this check and the store; one that ran during the lookup
                # (interrupt()) moved the state on: decide again from there.
                if self._lifecycle is now:
                    self._lifecycle = after
                    return now, after

    def start(self) -> None:
        """Start listening, advertising and discovering (returns when ready).

        Raises:
            BackendStateError: started before, closed, or interrupted before it started.
        """
        self._move(_Step.START)
        self.identity = self.identity or Identity.load_or_create()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-peer-control",
                                        daemon=True)
        self._thread.start()
        self._call(self._start_async(), timeout=30)
        self._move(_Step.STARTED)

    async def _start_async(self) -> None:
        o = self.options
        assert self.identity is not None
        if not o.profile:
            from swarmtrain.core import hardware

            self.options = o = replace(o, profile=hardware.detect().profile.value)
        self.listener = RingListener(o.host, o.ring_port, secret=self.secret, tls=self.tls,
                                     limits=o.server_limits())
        self.control = ControlPlane(
            run=o.run, secret=self.secret, tls=self.tls,
            timeouts=Timeouts(handshake=o.propose_timeout_sec, heartbeat_interval=o.heartbeat_interval_sec,
                              heartbeat_timeout=o.heartbeat_timeout_sec),
            info=self._info, status=self.status, on_member_lost=self._member_lost,
            on_reform=self._reform_requested, server_limits=o.server_limits(),
            said_goodbye=lambda peer_id: peer_id in self.membership.left)
        self.port = await self.control.start(o.host, o.port)
        advertise = o.advertise_host or ("" if o.host in ("0.0.0.0", "::") else o.host)
        self.ring_address = (advertise or "127.0.0.1", self.listener.address[1])
        self.membership = Membership(self.identity, ring_address=self.ring_address,
                                     send=self.control.ask, rounds=lambda: self.rounds,
                                     work=lambda: self.work, propose_timeout=o.propose_timeout_sec,
                                     quorum=o.quorum, suspects=self._live_suspects)
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
        self.discovery.add_listener(self._discovery_changed)
        self._probe_task = asyncio.create_task(self._probe_forever(), name="swarm-peer-probe")
        log.info("peer %s of run %r: control port %d, ring port %d", self.identity.peer_id[:8],
                 o.run, self.port, self.listener.address[1])

    def close(self) -> None:
        """Leave: stop advertising, close the ring and every connection. Closing a closed
        backend (or one never started) does nothing.

        Raises:
            BackendStateError: another thread is closing it right now.
        """
        if self._move(_Step.CLOSE)[1] is Lifecycle.CLOSED:
            return
        try:
            with self._ring_lock:
                if self._ring is not None:
                    self._retire(self._ring)
                    self._ring.close()
                    self._ring = None
            if self._loop is not None:
                try:
                    self._call(self._close_async(),
                               timeout=self.CLOSE_POLITELY_SEC + self.CLOSE_FORCE_SEC + 5)
                finally:
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    if self._thread is not None:
                        self._thread.join(timeout=10)
                    self._loop.close()
                    self._loop = None
        finally:
            self._move(_Step.CLOSED)

    async def _close_async(self) -> None:
        self._probe_task.cancel()
        await self._say_goodbye()
        try:
            async with asyncio.timeout(self.CLOSE_POLITELY_SEC):
                await asyncio.gather(self.discovery.stop(), self.control.close())
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

    async def _say_goodbye(self) -> None:
        """Tell every member we are leaving (a signed REFORM ``leave``), so none waits for our
        heartbeats to stop and none counts us in a quorum; at most :attr:`GOODBYE_SEC`. From
        here on proposals are refused (a leaving peer joins nothing)."""
        self.membership.ready = False
        v = self.view
        if v is None or self.identity is None or self._goodbye_said:
            return
        self._goodbye_said = True
        msg = self.membership.reform_request(v.epoch, ReformKind.LEAVE)
        members = [c for p, c in self._candidates().items() if p in v.members]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.GOODBYE_SEC):
                await asyncio.gather(*(self.control.ask(c, msg, self.GOODBYE_SEC) for c in members))

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        if self._loop is None:
            coro.close()  # it never runs: closed, so Python does not warn that it was never awaited
            raise BackendStateError(f"peer backend is {self._lifecycle.value}: call start() first"
                                    if self._lifecycle is Lifecycle.NEW else
                                    f"peer backend is {self._lifecycle.value}: its control loop is gone")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except SwarmTimeout:
            raise  # a named phase inside the call (reform, discovery...): its own name and limit
        except concurrent.futures.CancelledError:
            if self.stopping:  # close() ends every task on the control loop, this call's too
                raise RingBroken("close", None, "this peer was closed during the call") from None
            raise
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

    def _discovered(self) -> dict[str, Candidate]:
        """Every peer discovery shows, authenticated or not (an advertisement proves nothing)."""
        me = self.identity.peer_id if self.identity else ""
        return {p.peer_id: Candidate(p.peer_id, p.host, p.port, p.ring_port)
                for p in self.discovery.peers().values() if p.peer_id != me}

    def _candidates(self) -> dict[str, Candidate]:
        """Peers to consider: those an authenticated answer confirmed (a stranger that only
        advertises, or fails the handshake, never counts), plus the current members (their
        ring and heartbeats are authenticated; liveness watches catch members that died)."""
        found = dict(self._verified)
        self._known.update(self._discovered())
        self._known.update(found)
        v = self.view
        for pid in v.members if v else ():
            if pid not in found and pid in self._known and pid != self.membership.me:
                found[pid] = self._known[pid]
        return found

    def _discovery_changed(self) -> None:
        """Discovery saw a peer come or go: probe now rather than at the next tick."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_probe.set)

    async def _probe_forever(self) -> None:
        """Ask every discovered peer outside the current view who it is, cheaply and often
        (every ``probe_interval``, backing off to 4x that while it does not answer:
        :func:`probe_backoff`): a peer is a candidate once its authenticated answer confirms
        its id, and a suspect or a peer cooling down after a failure is forgiven as soon as it
        answers again, so a mended link or a resumed process is taken in within seconds."""
        while True:
            try:
                await asyncio.wait_for(self._wake_probe.wait(), self.options.probe_interval_sec)
            except TimeoutError:
                pass
            self._wake_probe.clear()
            now = time.monotonic()
            v = self.view
            watched = set(v.members) if v is not None and self.membership.healthy else set()
            targets = {**{p: c for p, c in self._known.items() if p not in watched},
                       **{p: c for p, c in self._discovered().items() if p not in watched}}
            for pid, c in targets.items():
                if pid in self._probing or self._probe_next.get(pid, 0.0) > now:
                    continue
                self._probing.add(pid)
                task = asyncio.create_task(self._probe_one(pid, c), name=f"swarm-peer-probe-{pid[:8]}")
                self._probe_tasks.add(task)  # the loop holds tasks weakly
                task.add_done_callback(self._probe_tasks.discard)

    async def _probe_one(self, pid: str, c: Candidate) -> None:
        try:
            ans = await self.control.probe_detail(c.host, c.port,
                                                  timeout=max(1.0, self.options.probe_interval_sec))
        finally:
            self._probing.discard(pid)
        where = f"{c.host}:{c.port}"
        left_at = self._left_at.get(pid)
        if left_at is not None and time.monotonic() - left_at < self.LEAVING_SEC:
            return  # it said goodbye and is shutting down: its last answers do not bring it back
        if isinstance(ans, PeerInfoMsg) and ans.peer_id == pid and ans.run == self.options.run \
                and isinstance(ans.public_key, bytes) and peer_id_of(ans.public_key) == pid:
            self._left_at.pop(pid, None)
            first = pid not in self._verified
            self._verified[pid] = Candidate(pid, c.host, c.port, ans.ring_port)
            self._probe_fails.pop(pid, None)
            self._probe_next[pid] = time.monotonic() + self.options.probe_interval_sec
            self.unauthenticated.pop(where, None)
            if self._suspects.pop(pid, None) is not None or first:
                log.debug("peer %s at %s answers", pid[:8], where)
            self.membership.forgive(pid)
            return
        fails = self._probe_fails[pid] = self._probe_fails.get(pid, 0) + 1
        if isinstance(ans, AuthError):
            # a stranger (another secret): invisible, asked again rarely; said once
            if where not in self.unauthenticated:
                log.warning("peer %s at %s failed authentication (%s): it is ignored; if it "
                            "should take part, give both the same cluster secret", pid[:8], where, ans)
            self.unauthenticated[where] = str(ans)
            self._verified.pop(pid, None)
            self._probe_next[pid] = time.monotonic() + 30.0
            return
        if isinstance(ans, PeerInfoMsg):
            why = (f"it answers as {ans.peer_id[:8]} of run {ans.run!r}" if ans.peer_id != pid or
                   ans.run != self.options.run else "its key does not match its id")
            if where not in self.unauthenticated:
                log.warning("peer advertised as %s at %s is ignored: %s", pid[:8], where, why)
            self.unauthenticated[where] = why
            self._verified.pop(pid, None)
            self._probe_next[pid] = time.monotonic() + 30.0
            return
        self._probe_next[pid] = time.monotonic() + probe_backoff(self.options.probe_interval_sec, fails)
        if fails >= 2 and self._verified.pop(pid, None) is not None:
            log.debug("peer %s at %s stopped answering: no longer a candidate", pid[:8], where)
        member = self.view is not None and pid in self.view.members
        if fails >= self.FORGET_AFTER_FAILS and pid not in self._discovered() and not member:
            # silent for FORGET_AFTER_FAILS probes (ten minutes at the default interval) and
            # no longer advertised: stop asking
            for table in (self._known, self._probe_next, self._probe_fails, self._left_at):
                table.pop(pid, None)

    def wait_for_peers(self, min_peers: int, timeout: float) -> list[PeerInfo]:
        """Block until ``min_peers`` other peers of this run are known and have proved, over
        an authenticated connection, that they hold the cluster secret and their id's key.

        Raises:
            SwarmTimeout: "found X of Y peers" after ``timeout`` seconds (naming the peers
                that failed authentication, if any).
        """
        return self._call(self._wait_for_peers_async(min_peers, timeout), timeout + 5)

    async def _wait_for_peers_async(self, min_peers: int, timeout: float) -> list[PeerInfo]:
        deadline = time.monotonic() + timeout
        while len(self._verified) < min_peers:
            conflict = self.discovery.conflict
            if conflict:  # another process advertises our id: waiting cannot help
                raise SwarmError(conflict)
            if time.monotonic() > deadline:
                strangers = "; ".join(f"{w}: {why}" for w, why in self.unauthenticated.items())
                raise SwarmTimeout("discovery", timeout,
                                   f"found {len(self._verified)} of {min_peers} peers of run "
                                   f"{self.options.run!r} that authenticate"
                                   + (f" (ignored: {strangers})" if strangers else ""))
            self._wake_probe.set()
            await asyncio.sleep(0.1)
        shown = self.discovery.peers()
        return [shown[p] for p in self._verified if p in shown]

    def _member_lost(self, peer_id: str) -> None:
        """A watched member died or went silent: abort the ring so collectives fail fast."""
        self._suspects[peer_id] = time.monotonic() + 30.0
        self.membership.healthy = False
        self._probe_next.pop(peer_id, None)  # asked again at the next probe: is it back?
        with self._ring_lock:
            if self._ring is not None:
                self._ring.close()

    def _epoch_installed(self, view: View) -> None:
        """A newer epoch supersedes the current ring: abort it, so a member still inside a
        collective of the old epoch fails fast and moves on instead of waiting for peers
        that have already left that ring."""
        self.listener.supersede(self.options.run, view.epoch)  # a ring still forming gives up
        with self._ring_lock:
            if self._ring is not None and self._ring.epoch < view.epoch:
                self._ring.close()

    def _reform_requested(self, msg: Reform) -> None:
        """A signed REFORM. ``broke``: a member's ring broke: abort ours too (our collective
        cannot finish either), so our training loop recovers and, as proposer, agrees the next
        epoch. ``join``: a peer is back and asks to be taken in: forgive it now. ``leave``: a
        member is shutting down: it no longer counts in any quorum, and we stop waiting for it."""
        if not check_signature(msg):
            self.forged_reforms += 1
            log.warning("ignoring a REFORM that %s did not sign (unsigned or forged; %d so far)",
                        msg.peer_id[:8], self.forged_reforms)
            return
        v = self.view
        if msg.kind == ReformKind.JOIN:
            self._suspects.pop(msg.peer_id, None)
            self.membership.forgive(msg.peer_id)
            if msg.peer_id in self._known and msg.peer_id not in self._verified:
                self._probe_next.pop(msg.peer_id, None)
                self._wake_probe.set()
            log.debug("peer %s asks to be taken in", msg.peer_id[:8])
            return
        if msg.kind == ReformKind.LEAVE:
            self._left_at[msg.peer_id] = time.monotonic()  # first: the trainer reads it (left_recently)
            log.info("peer %s is leaving", msg.peer_id[:8])
            self.membership.on_leave(msg.peer_id)
            self._suspects[msg.peer_id] = time.monotonic() + 30.0
            self._verified.pop(msg.peer_id, None)
            if v is not None and msg.peer_id in v.members:
                with self._ring_lock:
                    if self._ring is not None:
                        self.routine_close = f"member {msg.peer_id[:8]} left"
                        self._ring.close()
            return
        if v is not None and msg.peer_id in v.members and msg.epoch >= v.epoch:
            log.info("member %s reports epoch %d broke", msg.peer_id[:8], msg.epoch)
            self.membership.healthy = False
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

    def left_recently(self) -> str:
        """A member of the current view that said goodbye in the last LEAVING_SEC ("" if
        none): a ring that breaks then broke because of a leave (the members close their
        rings as they hear of it), even if this node's own ring was not closed for it yet."""
        v = self.view
        now = time.monotonic()
        for peer, at in list(self._left_at.items()):
            if now - at < self.LEAVING_SEC and (v is None or peer in v.members):
                return peer
        return ""

    def propose_if_needed(self) -> bool:
        """At the start of a round: if this node leads and peers came or went, agree a new
        epoch (members pick it up before their next collective). True if one was agreed."""
        return self._call(self._propose_async(), self.options.propose_timeout_sec * 10 + 10)

    async def _propose_async(self, *, renew: bool = False, known_epoch: int = 0) -> bool:
        self.membership.ready = True
        sus = self._live_suspects()
        cands = {p: c for p, c in self._candidates().items() if p not in sus}
        m = self.membership
        if m.leader(cands, sus) != m.me or not (renew or m.needs_new_view(cands)):
            return False
        self._learn_own_address(cands)
        # the first epoch waits for min_peers members: training starts with all of them
        first, before = m.view is None, m.epoch
        view = await m.propose(cands, known_epoch=known_epoch, renew=renew,
                               min_members=self.options.min_peers if first else 1)
        return view is not None and view.epoch != before

    def refresh(self, timeout: float | None = None) -> bool:
        """At a round boundary, before a collective: wait for the first epoch if there is none
        yet; as proposer, agree a new epoch if peers came or went (:meth:`propose_if_needed`);
        rebuild the ring if the epoch changed. True if it changed.

        Raises:
            SwarmTimeout: phase ``reform`` if no first epoch is agreed within
                ``reform_timeout`` (nobody proposed us in), ``peer control`` after ``timeout``.
        """
        return self._call(self._refresh_async(), timeout or self.options.reform_timeout_sec + 10)

    async def _refresh_async(self) -> bool:
        self.membership.ready = True
        if self.membership.view is None:
            await self._await_first_probes()
        if not await self._propose_async() and self.membership.view is None:
            await self._await_view(0, deadline=time.monotonic() + self.options.reform_timeout_sec)
        return await self._ensure_ring()

    async def _await_first_probes(self) -> None:
        """Before the first epoch: let every peer discovery already shows answer (or fail)
        once, so a newcomer to a running group joins it instead of training alone first.
        At most :attr:`FIRST_PROBE_SEC`."""
        deadline = time.monotonic() + self.FIRST_PROBE_SEC
        while time.monotonic() < deadline:
            pending = [p for p in self._discovered()
                       if p not in self._verified and p not in self._probe_fails]
            if not pending:
                return
            self._wake_probe.set()
            await asyncio.sleep(0.05)

    FIRST_PROBE_SEC: ClassVar[float] = 3.0

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

    #: how often a paused peer says why it is not training
    PAUSED_NOTE_SEC: ClassVar[float] = 10.0

    async def _await_view(self, above: int, deadline: float | None) -> None:
        """Wait for a committed view with an epoch above ``above``. As leader, propose it
        (again every half second while no view that may train can be formed: *paused*); else
        tell the leader our ring broke, or ask it to take us in, and treat it as gone if it is
        silent. Without a ``deadline`` this waits for as long as it takes (a partition heals
        when it heals) and says every :attr:`PAUSED_NOTE_SEC` why it is waiting."""
        m = self.membership
        noted = time.monotonic()
        while m.epoch <= above:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise SwarmTimeout("reform", self.options.reform_timeout_sec,
                                   f"no new epoch after epoch {above}; authenticated peers: "
                                   f"{sorted(p[:8] for p in self._verified) or 'none'}")
            if self.stopping:
                raise RingBroken("reform", None, "this peer is stopping")
            if above and now - noted > self.PAUSED_NOTE_SEC:
                noted = now
                log.info("paused since epoch %d (no training): %s", above,
                         m.paused_reason or "waiting for the group to take this peer in")
            sus = self._live_suspects()
            cands = {p: c for p, c in self._candidates().items() if p not in sus}
            leader = m.leader(cands, sus)
            if leader == m.me:
                if not await self._propose_async(renew=above > 0, known_epoch=above):
                    await asyncio.sleep(0.5)  # not enough members ready, or paused
                continue
            m.changed.clear()
            if leader in cands:  # tell the leader our ring broke, or that we are back
                broke = m.view is not None and leader in m.view.members
                kind = ReformKind.BROKE if broke else ReformKind.JOIN
                answer = await self.control.ask(cands[leader], m.reform_request(above, kind),
                                                self.options.propose_timeout_sec)
                if answer is None:
                    log.info("leader %s does not answer: treating it as gone", leader[:8])
                    self._suspects[leader] = time.monotonic() + 30.0
                    m.follow = None
                    continue
            try:
                async with asyncio.timeout(self.options.propose_timeout_sec * 3):
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
            self.routine_close = ""
            if old is not None:
                self._retire(old)
        if old is not None:
            old.close()
        return True

    def _build_ring(self, v: View) -> RingGroup:
        assert self.identity is not None
        return RingGroup(self.listener, v.rank(self.identity.peer_id), v.ring_addresses(),
                         ring_id=self.options.run, epoch=v.epoch, secret=self.secret,
                         timeout=self.options.ring_timeout_sec, tls=self.tls)

    def recover(self, failed_epoch: int) -> None:
        """After a broken ring: agree a new epoch without the lost peers and rebuild the ring.
        Waits as long as no view that may train can be formed (paused: a partition heals when
        it heals), until :meth:`interrupt`.

        Raises:
            RingBroken: the new ring could not be formed, or :meth:`interrupt` was called.
        """
        self._call(self._recover_async(failed_epoch), self.FOREVER_SEC)

    #: "no limit" for waits that end when the network or the user says so
    FOREVER_SEC: ClassVar[float] = 365 * 86400.0

    async def _recover_async(self, failed_epoch: int) -> None:
        """A broken ring's epoch is spent (its connections are gone on some members): the
        next collective needs a view of a later epoch, even if nobody left — the proposer
        then commits the same members under a new epoch number."""
        m = self.membership
        m.healthy = False
        if m.epoch <= failed_epoch:
            await self._await_view(failed_epoch, deadline=None)
        await self._ensure_ring()

    def interrupt(self) -> None:
        """Stop waiting (from any thread): a collective in progress and a paused recovery end
        with :class:`RingBroken`, so the caller's loop can wind down (:meth:`close` next).
        Allowed any number of times in any state: before :meth:`start` it means the peer never
        starts; while starting, it stops as soon as it is up (waits end at once)."""
        before, _ = self._move(_Step.INTERRUPT)
        if before not in (Lifecycle.RUNNING, Lifecycle.STOPPING):
            return  # nothing is up to wake yet (or close() is taking it all down)
        if self._loop is not None:
            # goodbye first: the members then read our ring closing as a leave, not a failure
            with contextlib.suppress(SwarmError, concurrent.futures.CancelledError, RuntimeError):
                self._call(self._say_goodbye(), self.GOODBYE_SEC + 1.0)
        with self._ring_lock:
            if self._ring is not None:
                self._ring.close()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.membership.changed.set)

    @property
    def paused(self) -> bool:
        """True while this peer waits for a view it may train in (its ring is broken and no
        quorum is reachable)."""
        return bool(self.membership.paused_reason) and not self.membership.healthy

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
        """Broadcast the registered state (and the rounds and work counters) from the donor
        of the ring's epoch. Received into a buffer first: a broken broadcast changes nothing."""
        view = self._ring_view
        assert view is not None and view.epoch == ring.epoch and self._state is not None
        parts = [torch.tensor([self.rounds, self.work], dtype=torch.int64), *self._state]
        flat = state_bytes(parts)
        self.broadcast_state(flat, ring)
        load_state_bytes(flat, parts)
        self.rounds, self.work = int(parts[0][0]), int(parts[0][1])
        self._synced_epoch = ring.epoch
        log.info("epoch %d: state of %d collective(s) loaded from donor %s (digest %s)", ring.epoch,
                 self.rounds, view.donor[:8], self.state_digest)

    def broadcast_state(self, flat: torch.Tensor, ring: RingGroup | None = None) -> str:
        """Copy the epoch's donor's ``flat`` (uint8 bytes: :func:`state_bytes`) into every
        member's, then check that every member holds the same bytes: each hashes what it
        holds and the members compare the digests in one small all-reduce. Returns the digest
        (also kept as :attr:`state_digest` for :attr:`digest_epoch`).

        Raises:
            RingBroken: a member died, or the digests differ (phase ``state_digest``; the
                epoch is then spent and a new one re-sends the state).
        """
        import hashlib

        ring = ring or self._current_ring()
        view = self._ring_view
        assert view is not None and view.epoch == ring.epoch
        ring.broadcast(flat, root=view.rank(view.donor))
        digest = hashlib.blake2b(flat.numpy().data, digest_size=8).digest()
        b = torch.tensor(list(digest), dtype=torch.float32)
        both = torch.cat([b, b * b])  # sum x, sum x^2: equal iff (sum x)^2 == W sum x^2
        ring.all_reduce(both, "sum", wire="fp32")
        w = ring.world_size
        if not bool(torch.equal(both[:8] * both[:8], w * both[8:])):
            raise RingBroken("state_digest", None, f"the members of epoch {ring.epoch} hold different "
                             "state after the state broadcast; re-sending it in a new epoch")
        self.state_digest, self.digest_epoch = digest.hex(), ring.epoch
        self.membership.trained_in(ring.epoch)
        return self.state_digest

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean", *, weight: float | None = None,
                   wire: str | None = None, retries: int = 5, boundary: bool = True,
                   check_finite: bool = False) -> torch.Tensor:
        """All-reduce ``tensor`` in place over the current members; on a broken ring, agree a
        new epoch and retry with the original input (at most ``retries`` times).

        No copy of ``tensor`` is kept for a retry: with ``retries`` no member writes its tensor
        before every member has joined the collective (``keep_input``, see
        :class:`~swarmtrain.wire.ring.AllReduceSchedule`), so a ring that breaks before
        that (an epoch that moved on, a member lost or a REFORM between collectives) leaves
        every input as it was, and the retry reduces exactly the callers' inputs. A ring that
        breaks later leaves partial sums in some tensors: those members still take part in
        the next attempt, so nobody waits for them, but its result is void on every member,
        and every member raises :class:`RingBroken` (phase ``retry``): skip the step
        everywhere. ``retries=0`` (the CLI's trainer) sums in place from the first frame.

        Args:
            op: ``sum`` or ``mean``; with ``weight``, the result is Σ wᵢxᵢ / Σ wᵢ.
            wire: ``fp32``, ``fp16`` or ``int8`` (default: the options').
            boundary: first run the round boundary (:meth:`refresh`: joiners are taken in and
                leavers dropped). The CLI's trainer passes False: it runs its own boundary.
            check_finite: raise :class:`NonFiniteResult` if the result holds NaN or Inf
                (otherwise it is returned as it is; every member gets the same bits). Costs
                one read of the 1/W of the result each member owns, while it is in cache.

        Raises:
            RingBroken: after ``retries`` failures, or phase ``retry`` (see above); ``tensor``
                is then undefined. NonFiniteResult: see ``check_finite``.
        """
        if boundary and not self._at_boundary:
            self.refresh()
        self._at_boundary = False
        intact = True  # every attempt so far left ``tensor`` holding the caller's input

        def reduce(ring: RingGroup) -> torch.Tensor:
            nonlocal intact
            try:
                out = ring.all_reduce(tensor, op, weight=weight, wire=wire or self.options.wire,
                                      check_finite=check_finite, valid=intact, keep_input=retries > 0)
            except RingBroken:
                intact = intact and ring.input_intact
                raise
            return out

        out, ring = self._retrying("the all-reduce", reduce, retries)
        if ring.result_void:
            log.warning("epoch %d: the retried all-reduce is void (a member's input was already part "
                        "reduced); no member uses it", ring.epoch)
            raise RingBroken("retry", None, f"the all-reduce of epoch {ring.epoch} is void on every "
                             "member: a member's tensor held partial sums of an attempt that broke, not "
                             "its input; skip this step")
        self.rounds += 1
        self.work += ring.world_size  # member-collectives, unless the caller counts its own
        if check_finite and not ring.result_finite:
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

    def _retrying(self, what: str, run: Callable[[RingGroup], T], retries: int) -> tuple[T, RingGroup]:
        """``run`` on the current ring (its epoch's state loaded first); on a broken ring,
        agree a new epoch and run again, at most ``retries`` more times. One retry loop: the
        state load and the collective share it."""
        for attempt in range(retries + 1):
            try:
                ring = self._ready_ring(0)
                result = run(ring)
                self.membership.trained_in(ring.epoch)
                return result, ring
            except RingBroken as exc:
                if attempt == retries:
                    raise
                epoch = exc.epoch if exc.epoch is not None else self.epoch
                log.warning("epoch %d ring broke in %s (%s); re-forming", epoch, what, exc)
                self.recover(epoch)
        raise AssertionError("unreachable")

    def _retire(self, ring: RingGroup) -> None:
        """Keep the bytes ``ring`` moved, as this backend lets go of it (with ``_ring_lock``
        held, so :meth:`_bytes_moved` never counts a ring twice or not at all)."""
        self._retired_bytes = (self._retired_bytes[0] + ring.bytes_sent,
                               self._retired_bytes[1] + ring.bytes_received)

    def _bytes_moved(self) -> tuple[int, int]:
        """Bytes (sent, received) by every collective so far: the rings let go of, plus the
        current one's own counters."""
        with self._ring_lock:
            ring, (sent, received) = self._ring, self._retired_bytes
        if ring is None:
            return sent, received
        return sent + ring.bytes_sent, received + ring.bytes_received

    @property
    def bytes_sent(self) -> int:
        """Bytes this peer sent in collectives (ring frames: headers and payloads), all epochs."""
        return self._bytes_moved()[0]

    @property
    def bytes_received(self) -> int:
        """Bytes this peer received in collectives, all epochs."""
        return self._bytes_moved()[1]

    def status(self) -> dict[str, Any]:
        v = self.view
        sent, received = self._bytes_moved()
        server = self.control.server
        return {"peer_id": self.identity.peer_id if self.identity else "", "run": self.options.run,
                "epoch": self.epoch, "members": list(v.members) if v else [],
                "rank": v.rank(self.identity.peer_id) if v and self.identity else -1,
                "world_size": self.world_size, "rounds": self.rounds, "work": self.work,
                "leader": self.membership.my_leader(), "healthy": self.membership.healthy,
                "paused": self.paused, "paused_reason": self.membership.paused_reason,
                "state_digest": self.state_digest, "digest_epoch": self.digest_epoch,
                "authenticated_peers": sorted(self._verified),
                "unauthenticated": dict(self.unauthenticated),
                # frames served on the control port, by message type
                "traffic": self.control.server.traffic() if self.control.server is not None else {},
                # connections turned away (by reason) and failed handshakes, per listener
                "control_refused": server.admission.refusals() if server is not None else {},
                "control_failed_handshakes": server.failed_handshakes if server is not None else 0,
                "ring_refused": self.listener.admission.refusals(),
                "ring_failed_handshakes": self.listener.admission.failed_handshakes,
                "forged_reforms": self.forged_reforms,
                # everything refused, by reason: both listeners' connections and messages
                "refusals": self.all_refusals(),
                "bytes_sent": sent, "bytes_received": received}

    def all_refusals(self) -> dict[str, int]:
        """What this peer refused, by reason, in the codes of the control server's ERRORs:
        the control server's and the ring listener's connections (the ring's own names
        ``auth``, ``malformed`` and ``version`` counted as ``auth_failed``, ``bad_handshake``
        and ``unsupported_version``), messages (:attr:`refusals`) and forged REFORMs."""
        server = self.control.server
        ring = [{_RING_REASONS.get(why, why): n} for why, n in self.listener.admission.refusals().items()]
        forged = [{"forged_reform": self.forged_reforms}] if self.forged_reforms else []
        control = [server.refused] if server is not None else []
        return merge_refusals([self.refusals, *ring, *forged, *control])
