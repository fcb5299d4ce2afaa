"""Finding the other peers of a run: mDNS/DNS-SD on the LAN, or a static address list.

Every peer advertises one DNS-SD service ``<peer id>._swarmtrain._tcp.local.`` whose TXT
record carries ``id``, ``pk`` (public key, hex), ``port`` (control), ``ring``, ``v`` (protocol
version), ``run`` and ``profile``. Whatever arrives from the network is validated; a record
that is malformed, whose id is not the hash of its key, or that belongs to another run or
protocol version is ignored (logged at debug), never an error.

A peer that stops sends goodbye packets and vanishes from the others' view at once. A peer
that crashes cannot say goodbye; its address records carry a short TTL (``host_ttl``) and
known peers are re-resolved (from cache while fresh, by query once stale), so it vanishes
after about ``host_ttl + resolve_timeout`` seconds. Discovery is not the failure detector of
a training round, though: the membership layer's timeouts are.

Two processes started with one identity (one ``identity.key``) advertise one name. mDNS
probing catches that only if the first one's records arrive while the second probes; so a
record of our own name carrying other ports is caught too: it is logged as an error naming
the id and the fix, and :meth:`Discovery.wait_for_peers` raises it (:attr:`Discovery.conflict`).

A network link that goes down makes python-zeroconf's sends fail (ENETUNREACH,
EADDRNOTAVAIL...); those are logged as one line without a traceback (a warning once per
socket, then at debug), not as the traceback python-zeroconf attaches to them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from zeroconf import (
    DNSQuestionType,
    IPVersion,
    NonUniqueNameException,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from swarmtrain.errors import ConfigError, SwarmError, SwarmTimeout
from swarmtrain.transport.identity import KEY_FILE, PUBLIC_KEY_BYTES, config_dir, peer_id_of
from swarmtrain.transport.mdns import (
    browse,
    default_addresses,
    local_ipv4_networks,
    pick_host,
    quiet_zeroconf_network_errors,
)

__all__ = [
    "DEFAULT_PORT",
    "SERVICE_TYPE",
    "Discovery",
    "MdnsDiscovery",
    "PeerInfo",
    "StaticDiscovery",
    "decode_txt",
    "encode_txt",
    "parse_peer_list",
    "peers_on_this_host",
    "shared_identity_message",
]

log = logging.getLogger(__name__)

SERVICE_TYPE = "_swarmtrain._tcp.local."
DEFAULT_PORT = 7200
_PEER_ID = re.compile(r"[0-9a-f]{32}")
_PROFILE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_MAX_RUN = 64


@dataclass(frozen=True)
class PeerInfo:
    """What a peer says about itself.

    Attributes:
        peer_id: ``peer_id_of(public_key)``.
        host: an address of the peer (IPv4 from mDNS, or as given in a static list).
        port: its control port (the asyncio transport).
        ring_port: its bulk all-reduce port.
        run: the run name; peers of other runs are ignored.
        version: its wire protocol version; peers of other versions are ignored.
        profile: its hardware profile name (``laptop``, ``rpi4``...).
        public_key: raw Ed25519 public key, to verify its signed membership messages.
    """

    peer_id: str
    host: str
    port: int
    ring_port: int
    run: str
    version: int
    profile: str
    public_key: bytes


def _problem(info: PeerInfo) -> str | None:
    """Why `info` is not a well-formed peer description, or None if it is."""
    if not isinstance(info.public_key, bytes) or len(info.public_key) != PUBLIC_KEY_BYTES:
        return "public key is not 32 bytes"
    if not isinstance(info.peer_id, str) or peer_id_of(info.public_key) != info.peer_id:
        return f"peer id {info.peer_id!r} is not the hash of its public key"
    for name, port in (("port", info.port), ("ring port", info.ring_port)):
        if type(port) is not int or not 1 <= port <= 65535:
            return f"{name} {port!r} is not in 1..65535"
    if type(info.version) is not int or not 0 <= info.version <= 255:
        return f"protocol version {info.version!r} is not in 0..255"
    if not isinstance(info.run, str) or not 1 <= len(info.run) <= _MAX_RUN or not info.run.isprintable():
        return f"run name {info.run!r} is not 1..{_MAX_RUN} printable characters"
    if not isinstance(info.profile, str) or not _PROFILE.fullmatch(info.profile):
        return f"profile {info.profile!r} is not a short name"
    if not isinstance(info.host, str) or not info.host or len(info.host) > 253:
        return f"host {info.host!r} is not an address"
    return None


def encode_txt(info: PeerInfo) -> dict[str, str]:
    """The TXT properties advertising `info` (its host travels in A records, not here)."""
    return {
        "id": info.peer_id,
        "pk": info.public_key.hex(),
        "port": str(info.port),
        "ring": str(info.ring_port),
        "v": str(info.version),
        "run": info.run,
        "profile": info.profile,
    }


def decode_txt(properties: Mapping[bytes, bytes | None], host: str) -> PeerInfo | None:
    """The peer a TXT record describes, or None (logged at debug) if it is malformed."""
    try:
        text = {k.decode(): v.decode() for k, v in properties.items() if v is not None}
        if not _PEER_ID.fullmatch(text["id"]) or not re.fullmatch(r"[0-9a-f]{64}", text["pk"]):
            raise ValueError("id or pk is not lowercase hex of the right length")
        numbers = [text[k] for k in ("port", "ring", "v")]
        if not all(re.fullmatch(r"[0-9]{1,5}", n) for n in numbers):
            raise ValueError(f"port, ring and v must be decimal numbers, got {numbers}")
        info = PeerInfo(
            peer_id=text["id"],
            host=host,
            port=int(text["port"]),
            ring_port=int(text["ring"]),
            run=text["run"],
            version=int(text["v"]),
            profile=text["profile"],
            public_key=bytes.fromhex(text["pk"]),
        )
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        log.debug("ignoring malformed TXT record %r: %s", properties, exc)
        return None
    problem = _problem(info)
    if problem is not None:
        log.debug("ignoring TXT record of %s: %s", info.peer_id, problem)
        return None
    return info


def shared_identity_message(peer_id: str, where: str = "") -> str:
    """What to tell the user when another process advertises `peer_id`, ours, at `where`
    (``host:port``; "" when unknown)."""
    return (
        f"another peer already advertises peer id {peer_id} (this peer's) "
        f"{f'at {where}' if where else 'on this network'}: two peers share one identity, one "
        f"{KEY_FILE} (by default {config_dir() / KEY_FILE}: $SWARMTRAIN_HOME, else "
        "$XDG_CONFIG_HOME/swarmtrain, else ~/.config/swarmtrain); give each peer its own "
        "directory with SWARMTRAIN_HOME=DIR (a new identity is made there on first start)"
    )


def peers_on_this_host(
    peers: Iterable[PeerInfo], local: Sequence[ipaddress.IPv4Interface] | None = None
) -> list[PeerInfo]:
    """Those of `peers` whose address is one of this host's (`local`, by default this host's
    IPv4 interface addresses) or a loopback address: other processes on this machine.

    A peer known by a host name other than ``localhost`` is not counted (no lookups here), nor
    one in another network namespace (a container) of this machine.
    """
    mine = {n.ip for n in (local_ipv4_networks() if local is None else local)}
    out = []
    for p in peers:
        try:
            ip = ipaddress.ip_address("127.0.0.1" if p.host == "localhost" else p.host)
        except ValueError:
            continue
        if ip.is_loopback or ip in mine:
            out.append(p)
    return out


def parse_peer_list(text: str) -> list[tuple[str, int]]:
    """Parse ``"10.0.0.2:7200,10.0.0.3,[fd00::3]:7201,pi.local"`` (port 7200 by default).

    Empty entries are skipped and duplicates dropped, order kept.

    Raises:
        ConfigError: an entry is not ``host[:port]`` with a valid address or host name and a
            port in 1..65535.
    """
    out: list[tuple[str, int]] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        m = re.fullmatch(r"\[([^\]]+)\](?::(\w*))?|([^:\[\]]+)(?::(\w*))?", entry)
        if m is None:
            raise ConfigError(
                f"peers: bad entry {entry!r}; expected host:port, e.g. 10.0.0.2:7200 or [fd00::2]:7200"
            )
        host, port_text = (m[1], m[2]) if m[1] is not None else (m[3], m[4])
        try:
            ipaddress.ip_address(host)
        except ValueError:
            labels = host.removesuffix(".").split(".")
            if m[1] is not None or len(host) > 253 or not all(_LABEL.fullmatch(x) for x in labels):
                raise ConfigError(f"peers: {host!r} in {entry!r} is not an IP address or host name") from None
        if port_text is None:
            port = DEFAULT_PORT
        elif port_text.isdigit() and 1 <= int(port_text) <= 65535:
            port = int(port_text)
        else:
            raise ConfigError(f"peers: port {port_text!r} in {entry!r} must be a number in 1..65535")
        if (host, port) not in out:
            out.append((host, port))
    return out


class Discovery(ABC):
    """Keeps the set of live peers of this node's run and protocol version."""

    def __init__(self) -> None:
        self._me: PeerInfo | None = None
        self._peers: dict[str, PeerInfo] = {}
        self._listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()
        #: set (to the message) when another process advertises our peer id
        self.conflict: str | None = None
        self._started = False

    @abstractmethod
    async def start(self, me: PeerInfo) -> None:
        """Start advertising `me` (if the method can) and looking for its peers."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop looking and advertising; idempotent."""

    def peers(self) -> dict[str, PeerInfo]:
        """Known live peers by id: same run and protocol version as us, ourselves excluded."""
        return dict(self._peers)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on the event loop whenever :meth:`peers` changes."""
        self._listeners.append(callback)

    async def wait_for_peers(self, min_peers: int, timeout: float) -> list[PeerInfo]:
        """Wait until at least `min_peers` other peers are known.

        Returns:
            The known peers, sorted by peer id, as soon as there are enough.
        Raises:
            SwarmTimeout: phase ``discovery``, saying "found X of Y peers" and what to check.
            SwarmError: another process advertises this peer's id (:attr:`conflict`).
        """
        if self._me is None:
            raise SwarmError("wait_for_peers before start()")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self._peers) < min_peers:
            if self.conflict is not None:
                raise SwarmError(self.conflict)
            changed = self._changed
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await changed.wait()
            except TimeoutError:
                detail = (
                    f"found {len(self._peers)} of {min_peers} peers for run '{self._me.run}' "
                    f"(protocol v{self._me.version}); {self._hint()}"
                )
                raise SwarmTimeout("discovery", timeout, detail) from None
        return sorted(self._peers.values(), key=lambda p: p.peer_id)

    def _hint(self) -> str:
        return "are the other peers running, with the same run name and swarmtrain version?"

    def _acceptable(self, info: PeerInfo) -> bool:
        """Whether `info` (already well-formed) is a peer of ours, other than us."""
        me = self._me
        if me is None or info.peer_id == me.peer_id:
            return False
        if info.run != me.run or info.version != me.version:
            log.debug("ignoring peer %s of run %r v%d", info.peer_id, info.run, info.version)
            return False
        return True

    def _report_conflict(self, other: PeerInfo) -> None:
        """`other` carries our peer id but is not us: say so once, loudly, and wake waiters."""
        if self.conflict is not None:
            return
        self.conflict = shared_identity_message(other.peer_id, f"{other.host}:{other.port}")
        if self._started:  # while start() probes, the error it raises says it
            log.error("%s", self.conflict)
        self._changed.set()
        self._changed = asyncio.Event()

    def _set_peers(self, peers: dict[str, PeerInfo]) -> None:
        """Replace the known peers; tell the listeners if anything changed."""
        if peers == self._peers:
            return
        self._peers = peers
        self._changed.set()
        self._changed = asyncio.Event()
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:
                log.exception("discovery listener %r failed", callback)

    def _put(self, info: PeerInfo) -> None:
        self._set_peers({**self._peers, info.peer_id: info})

    def _drop(self, peer_id: str) -> None:
        if peer_id in self._peers:
            self._set_peers({k: v for k, v in self._peers.items() if k != peer_id})


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("discovery task %s failed", task.get_name(), exc_info=task.exception())


class MdnsDiscovery(Discovery):
    """Discovery by mDNS/DNS-SD (python-zeroconf), IPv4.

    The addresses advertised (and the interfaces used) are `interfaces` if given, else
    ``me.host`` if it is a specific IPv4 address, else every non-loopback IPv4 address of this
    host (loopback only if there is none): loopback is left out because the others must be
    able to reach a peer at what it advertises. A peer advertising several addresses is
    reached at one on a subnet we share.

    Args:
        interfaces: IPv4 addresses of the interfaces to use and advertise.
        host_ttl: TTL (s) of our SRV and A records, which bounds how long a crashed peer
            stays visible to the others.
        resolve_timeout: how long (s) one resolution of a peer's records may take.
    """

    def __init__(
        self, *, interfaces: Sequence[str] | None = None, host_ttl: int = 10, resolve_timeout: float = 3.0
    ) -> None:
        super().__init__()
        if host_ttl < 1 or resolve_timeout <= 0:
            raise ValueError("host_ttl must be >= 1 and resolve_timeout > 0")
        self._interfaces = list(interfaces) if interfaces is not None else None
        self._host_ttl = host_ttl
        self._resolve_timeout = resolve_timeout
        self._azc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._resolving: dict[str, asyncio.Task[None]] = {}
        # Peers of ours we have seen and not seen leave: rechecked even while they do not
        # answer, so one back from a network cut reappears (its PTR outlives its A/SRV).
        self._candidates: set[str] = set()
        self._liveness: asyncio.Task[None] | None = None
        self._local: list[ipaddress.IPv4Interface] = []

    async def start(self, me: PeerInfo) -> None:
        """Register our service and browse for others.

        Raises:
            SwarmError: `me` is malformed, or another node advertises the same peer id (two
                processes sharing one identity directory).
        """
        quiet_zeroconf_network_errors()
        self._local = local_ipv4_networks()
        addresses = self._interfaces or default_addresses(me.host, self._local)
        problem = _problem(replace(me, host=addresses[0]))
        if problem is not None:
            raise SwarmError(f"cannot advertise this peer: {problem}")
        self._me = me
        try:
            self._azc = AsyncZeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
        except OSError as exc:
            raise SwarmError(f"cannot start mDNS on {', '.join(addresses)}: {exc}") from exc
        self._browser = browse(self._azc.zeroconf, SERVICE_TYPE, self._on_change)
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{me.peer_id}.{SERVICE_TYPE}",
            port=me.port,
            properties=encode_txt(me),
            server=f"swarmtrain-{me.peer_id}.local.",
            host_ttl=self._host_ttl,
            parsed_addresses=addresses,
        )
        try:
            await (await self._azc.async_register_service(info))
        except NonUniqueNameException:
            await self.stop()
            raise SwarmError(self.conflict or shared_identity_message(me.peer_id)) from None
        self._started = True
        if self.conflict is not None:
            log.error("%s", self.conflict)
        self._liveness = asyncio.create_task(self._check_liveness(), name="mdns-liveness")
        self._liveness.add_done_callback(_log_crash)

    async def stop(self) -> None:
        """Say goodbye (peers drop us at once), stop browsing and close the sockets."""
        tasks = [t for t in (self._liveness, *self._resolving.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._liveness, self._resolving, self._candidates = None, {}, set()
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._azc is not None:
            azc, self._azc = self._azc, None
            await azc.async_unregister_all_services()
            await azc.async_close()
        self._set_peers({})

    def _hint(self) -> str:
        return (
            "is multicast blocked between the machines (firewall, Wi-Fi isolation)? "
            "if so use --peers host:port,..."
        )

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        """Browser callback, on the event loop."""
        name = name.lower()  # DNS names are case-insensitive
        peer_id = name.removesuffix("." + SERVICE_TYPE)
        if not _PEER_ID.fullmatch(peer_id):
            log.debug("ignoring service %r: not named <peer id>.%s", name, SERVICE_TYPE)
            return
        previous = self._resolving.pop(peer_id, None)
        if previous is not None:
            previous.cancel()
        if state_change is ServiceStateChange.Removed:
            self._candidates.discard(peer_id)
            self._drop(peer_id)
        else:
            self._spawn_resolve(peer_id, attempts=3)

    def _spawn_resolve(self, peer_id: str, attempts: int) -> None:
        task = asyncio.create_task(self._resolve(peer_id, attempts), name=f"resolve-{peer_id}")
        task.add_done_callback(_log_crash)
        self._resolving[peer_id] = task

    async def _resolve(self, peer_id: str, attempts: int) -> None:
        """Fetch the peer's records (cache first) and update it; drop it if they are gone."""
        name = f"{peer_id}.{SERVICE_TYPE}"
        try:
            for _ in range(attempts):
                info = await self._lookup(name)
                if info is not None:
                    break
            else:
                log.debug("no answer from %s; dropping it", name)
                self._drop(peer_id)
                return
            host = pick_host(info.parsed_addresses(IPVersion.V4Only), self._local)
            peer = decode_txt(info.properties, host or "")
            if peer is None or host is None or peer.peer_id != peer_id:
                log.debug("ignoring service %r: bad records (host %s)", name, host)
            elif self._is_impostor_of_me(peer):
                self._report_conflict(peer)
            elif self._acceptable(peer):
                self._candidates.add(peer_id)
                self._put(peer)
        finally:
            if self._resolving.get(peer_id) is asyncio.current_task():
                del self._resolving[peer_id]

    def _is_impostor_of_me(self, peer: PeerInfo) -> bool:
        """Whether `peer`, well-formed and with a key hashing to its id, is another process
        advertising our id: our own records carry our ports (the ring port is a free port
        the kernel chose, so two processes nearly always differ in it)."""
        me = self._me
        return (me is not None and peer.peer_id == me.peer_id
                and (peer.port, peer.ring_port) != (me.port, me.ring_port))

    async def _lookup(self, name: str) -> AsyncServiceInfo | None:
        if self._azc is None:
            return None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        # QM: answers are multicast, so one query refreshes every peer's cache.
        ok = await info.async_request(
            self._azc.zeroconf, self._resolve_timeout * 1000, question_type=DNSQuestionType.QM
        )
        return info if ok else None

    async def _check_liveness(self) -> None:
        """Re-resolve every candidate every few seconds: free while its records are fresh in
        the cache, a query once they expire; a crashed or cut-off peer fails to answer."""
        while True:
            await asyncio.sleep(max(1.0, self._host_ttl / 4))
            for peer_id in self._candidates - set(self._resolving):
                self._spawn_resolve(peer_id, attempts=1)


class StaticDiscovery(Discovery):
    """Discovery from a fixed address list, for networks where multicast is blocked.

    Args:
        addresses: ``(host, control port)`` of the possible peers; may include this node.
        probe: asks the node at ``host:port`` who it is; None (or OSError, SwarmError,
            timeout) if nobody useful answers. The returned host and port are replaced by the
            address probed.
        interval: seconds between probe rounds.
        probe_timeout: limit for one probe; `interval` by default.
    """

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        probe: Callable[[str, int], Awaitable[PeerInfo | None]],
        interval: float = 2.0,
        probe_timeout: float | None = None,
    ) -> None:
        super().__init__()
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self._addresses = list(addresses)
        self._probe = probe
        self._interval = interval
        self._probe_timeout = interval if probe_timeout is None else probe_timeout
        self._task: asyncio.Task[None] | None = None

    async def start(self, me: PeerInfo) -> None:
        """Start probing in the background (the first round begins at once)."""
        self._me = me
        self._task = asyncio.create_task(self._probe_forever(), name="static-discovery")
        self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        """Stop probing; idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._set_peers({})

    def _hint(self) -> str:
        listed = ", ".join(f"{h}:{p}" for h, p in self._addresses) or "(none)"
        return f"are they running and reachable at the listed addresses {listed}?"

    async def _probe_forever(self) -> None:
        while True:
            found = await asyncio.gather(*(self._probe_one(h, p) for h, p in self._addresses))
            self._set_peers({p.peer_id: p for p in found if p is not None})
            await asyncio.sleep(self._interval)

    async def _probe_one(self, host: str, port: int) -> PeerInfo | None:
        try:
            async with asyncio.timeout(self._probe_timeout):
                info = await self._probe(host, port)
        except (OSError, SwarmError) as exc:  # TimeoutError is an OSError
            log.debug("probe of %s:%d failed: %s", host, port, exc)
            return None
        if info is None:
            return None
        info = replace(info, host=host, port=port)
        problem = _problem(info)
        if problem is not None:
            log.debug("ignoring the answer of %s:%d: %s", host, port, problem)
            return None
        return info if self._acceptable(info) else None
