"""Finding a pipeline's stages on the LAN: every `swarmtrain stage` announces itself by mDNS,
and a trainer (or `swarmtrain status`) given no ``--route`` builds one from what it finds.

A stage advertises one DNS-SD service ``stage<I>-<random>._swarm-stage._tcp.local.`` (the
service name is at most 15 bytes, RFC 6763, so not ``_swarmtrain-stage``) whose A records
carry the addresses it listens on and whose TXT record carries ``txtvers``, ``cluster``,
``stage``, ``stages``, ``layers`` (``A:B``), ``shape``, ``origin``, ``steps`` and ``port``.
Nothing secret goes there, and nothing read from there is trusted: a record only says where
to connect. Records that are malformed, out of bounds or of another cluster are ignored
(logged at debug). Before using a stage found this way, :func:`discover_route` asks it for its
status over the authenticated transport (the cluster secret) and leaves out any replica that
does not answer or whose answer disagrees with what it announced; the caller then checks the
route as it checks a ``--route`` (:func:`~swarmtrain.app.pipeline_session.checked_router`).

Address picking, the quieting of python-zeroconf's network-error tracebacks and the choice of
interfaces are peer mode's (:mod:`swarmtrain.roles.peer.discovery`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from zeroconf import DNSQuestionType, InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf import Error as ZeroconfError
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.roles.stage.route import Route, fetch_statuses
from swarmtrain.transport.mdns import (
    browse,
    default_addresses,
    local_ipv4_networks,
    pick_host,
    quiet_zeroconf_network_errors,
)
from swarmtrain.transport.tls import TLSConfig

__all__ = [
    "DEFAULT_CLUSTER",
    "SERVICE_TYPE",
    "StageAnnouncement",
    "StageAnnouncer",
    "announce_stage",
    "build_route",
    "check_cluster_name",
    "decode_txt",
    "discover_route",
    "discover_stages",
    "encode_txt",
    "format_route",
]

log = logging.getLogger("swarmtrain.roles.stage")

SERVICE_TYPE = "_swarm-stage._tcp.local."
DEFAULT_CLUSTER = "swarmtrain"
_TXT_VERSION = "1"
_CLUSTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
_HEX = re.compile(r"[0-9a-f]{0,64}")
_DECIMAL = re.compile(r"[0-9]{1,16}")
#: bounds of what a TXT record may say (far above any real pipeline)
_MAX_STAGES = 1024
_MAX_LAYERS = 1_000_000
_MAX_STEPS = 10**15


def check_cluster_name(name: str, flag: str = "--cluster") -> str:
    """``name`` if it can name a cluster: 1-40 letters, digits, ``_``, ``.``, ``-``, starting
    with a letter or digit.

    Raises:
        ConfigError: naming ``flag`` and what is allowed.
    """
    if not isinstance(name, str) or not _CLUSTER.fullmatch(name):
        raise ConfigError(f"{flag} {name!r}: give 1-40 letters, digits, '_', '.' or '-' (starting with a "
                          "letter or digit), the same on every stage and trainer of one pipeline")
    return name


@dataclass(frozen=True)
class StageAnnouncement:
    """What a stage says about itself on the LAN (never trusted: see the module docstring).

    Attributes:
        cluster: the pipeline's name (``--cluster``); stages of other clusters are ignored.
        stage: index of the stage it serves.
        stages: number of stages of its pipeline.
        layers: the half-open range of model layers it holds.
        shape: its layers' shape signature (:func:`~swarmtrain.roles.stage.compute.shape_signature`).
        origin: the fingerprint of the weights its lineage started from.
        steps: optimizer steps it had taken when it last announced.
        host: where to reach it (from its A records; "" in what a stage announces).
        port: its TCP port.
    """

    cluster: str
    stage: int
    stages: int
    layers: tuple[int, int]
    shape: str
    origin: str
    steps: int
    host: str
    port: int

    @property
    def address(self) -> str:
        """``HOST:PORT``, as a ``--route`` lists it."""
        return f"{self.host}:{self.port}"


def _problem(ann: StageAnnouncement) -> str | None:
    """Why ``ann`` is not a well-formed announcement, or None if it is."""
    if not _CLUSTER.fullmatch(ann.cluster):
        return f"cluster {ann.cluster!r} is not a cluster name"
    if not 1 <= ann.stages <= _MAX_STAGES or not 0 <= ann.stage < ann.stages:
        return f"stage {ann.stage} of {ann.stages} is not 0 <= stage < stages <= {_MAX_STAGES}"
    start, stop = ann.layers
    if not 0 <= start < stop <= _MAX_LAYERS:
        return f"layers {start}:{stop} is not 0 <= start < stop <= {_MAX_LAYERS}"
    if not _HEX.fullmatch(ann.shape) or not _HEX.fullmatch(ann.origin):
        return "shape and origin must be lowercase hex of at most 64 digits"
    if not 0 <= ann.steps <= _MAX_STEPS:
        return f"steps {ann.steps} is not in 0..{_MAX_STEPS}"
    if not 1 <= ann.port <= 65535:
        return f"port {ann.port} is not in 1..65535"
    return None


def encode_txt(ann: StageAnnouncement) -> dict[str, str]:
    """The TXT properties announcing ``ann`` (its host travels in A records, not here).

    Raises:
        ConfigError: ``ann`` is malformed (a decoder would ignore it).
    """
    problem = _problem(ann)
    if problem is not None:
        raise ConfigError(f"cannot announce stage {ann.stage}: {problem}")
    return {
        "txtvers": _TXT_VERSION, "cluster": ann.cluster, "stage": str(ann.stage), "stages": str(ann.stages),
        "layers": f"{ann.layers[0]}:{ann.layers[1]}", "shape": ann.shape, "origin": ann.origin,
        "steps": str(ann.steps), "port": str(ann.port),
    }


def _decimal(text: dict[str, str], key: str) -> int:
    value = text[key]
    if not _DECIMAL.fullmatch(value):
        raise ValueError(f"{key} {value[:40]!r} is not a decimal number of at most 16 digits")
    return int(value)


def decode_txt(properties: Mapping[bytes, bytes | None], host: str) -> StageAnnouncement | None:
    """The announcement a TXT record makes for a stage reached at ``host``, or None (logged
    at debug) if the record is malformed, out of bounds or of another TXT version."""
    try:
        text = {k.decode(): v.decode() for k, v in properties.items() if v is not None}
        if text.get("txtvers") != _TXT_VERSION:
            raise ValueError(f"txtvers {text.get('txtvers', '')[:20]!r} is not {_TXT_VERSION}")
        start, sep, stop = text["layers"].partition(":")
        if not sep:
            raise ValueError(f"layers {text['layers'][:40]!r} is not START:STOP")
        ann = StageAnnouncement(
            cluster=text["cluster"], stage=_decimal(text, "stage"), stages=_decimal(text, "stages"),
            layers=(_decimal({"start": start}, "start"), _decimal({"stop": stop}, "stop")),
            shape=text["shape"], origin=text["origin"], steps=_decimal(text, "steps"), host=host,
            port=_decimal(text, "port"))
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        log.debug("ignoring a malformed stage TXT record from %s: %s", host, exc)
        return None
    problem = _problem(ann) or (None if host else "no address")
    if problem is not None:
        log.debug("ignoring the stage TXT record from %s: %s", host, problem)
        return None
    return ann


def format_route(route: Route) -> str:
    """``[[(H, P), (H, P)], [(H, P)]]`` → ``"H:P,H:P;H:P"``, a string ``--route`` takes."""
    return ";".join(",".join(f"{h}:{p}" for h, p in replicas) for replicas in route)


def _where(anns: Iterable[StageAnnouncement]) -> str:
    by_stage: dict[int, list[str]] = {}
    for a in sorted(anns, key=lambda a: (a.stage, a.host, a.port)):
        by_stage.setdefault(a.stage, []).append(a.address)
    return "; ".join(f"stage {i} at {', '.join(where)}" for i, where in sorted(by_stage.items()))


def _refuse_mixed(anns: Sequence[StageAnnouncement], cluster: str) -> None:
    counts = {a.stages for a in anns}
    if len(counts) > 1:
        says = ", ".join(f"{a.address} (stage {a.stage} of {a.stages})"
                         for a in sorted(anns, key=lambda a: (a.stages, a.stage, a.host, a.port)))
        raise SwarmError(f"the stages of cluster {cluster!r} disagree on the number of stages: {says}. "
                         "Restart them with the same --stages, or give each pipeline its own --cluster")


def _complete(anns: Sequence[StageAnnouncement]) -> bool:
    counts = {a.stages for a in anns}
    return len(counts) == 1 and {a.stage for a in anns} == set(range(counts.pop()))


def build_route(found: Iterable[StageAnnouncement], cluster: str, waited: float | None = None) -> Route:
    """The route through the stages of ``cluster`` in ``found``: every replica of each stage,
    in address order (one address announced twice counts once).

    Args:
        found: announcements, as :func:`discover_stages` returns them.
        cluster: the cluster looked for (others in ``found`` are left out).
        waited: how long the search lasted, for the error message.

    Raises:
        SwarmError: nothing was found, the stages disagree on their number, or some stage
            index has no replica; the message says what was found where and what to run.
    """
    anns = sorted({a for a in found if a.cluster == cluster}, key=lambda a: (a.stage, a.host, a.port))
    within = f" within {waited:g} s" if waited is not None else ""
    if not anns:
        raise SwarmError(
            f"no stage of cluster {cluster!r} announced itself by mDNS{within}. Start `swarmtrain stage "
            f"--stage I --stages N --cluster {cluster}` for every stage on machines of this LAN, or give "
            "--route HOST:PORT;HOST:PORT;... if multicast does not cross between the machines")
    _refuse_mixed(anns, cluster)
    n = anns[0].stages
    route: Route = [[] for _ in range(n)]
    for a in anns:
        if (a.host, a.port) not in route[a.stage]:
            route[a.stage].append((a.host, a.port))
    missing = [i for i, replicas in enumerate(route) if not replicas]
    if missing:
        names = ", ".join(str(i) for i in missing)
        raise SwarmError(
            f"found {len(route) - len(missing)} of the {n} stages of cluster {cluster!r} by mDNS{within}: "
            f"{_where(anns)}; no replica of stage {names}. Start `swarmtrain stage --stage {missing[0]} "
            f"--stages {n} --cluster {cluster}` (with the same --task, model flags and --seed as the "
            "others) on a machine of this LAN" + (" for each missing stage" if len(missing) > 1 else "")
            + ", or give --route")
    return route


class StageAnnouncer:
    """Announces one stage server by mDNS while it serves.

    The addresses announced are ``interfaces`` if given, else the stage's listening address
    if it is one IPv4 address, else every non-loopback IPv4 address of this host (as peer
    mode does).

    Args:
        interfaces: IPv4 addresses of the interfaces to use and announce.
        host_ttl: TTL (s) of the SRV and A records: how long a crashed stage stays visible.
        refresh_every: least seconds between two announcements of a new step count.
    """

    def __init__(self, *, interfaces: Sequence[str] | None = None, host_ttl: int = 10,
                 refresh_every: float = 10.0) -> None:
        if host_ttl < 1 or refresh_every < 0:
            raise ValueError(f"host_ttl must be >= 1 and refresh_every >= 0, got {host_ttl}, {refresh_every}")
        self._interfaces = list(interfaces) if interfaces is not None else None
        self._host_ttl = host_ttl
        self._refresh_every = refresh_every
        self._announced_at = 0.0
        self._azc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None
        self._announced: StageAnnouncement | None = None
        self._name = self._token = ""
        self._starting: asyncio.Task[None] | None = None
        self._updating: asyncio.Task[None] | None = None
        self._addresses: list[str] = []

    @property
    def addresses(self) -> list[str]:
        """The addresses announced (empty before :meth:`start`)."""
        return list(self._addresses)

    async def start(self, ann: StageAnnouncement, listen_host: str) -> None:
        """Start announcing ``ann`` (its ``host`` is ignored) for a server on ``listen_host``.

        Raises:
            SwarmError: ``ann`` is malformed or mDNS cannot start on these interfaces.
        """
        quiet_zeroconf_network_errors()
        self._addresses = self._interfaces or default_addresses(listen_host, local_ipv4_networks())
        properties = encode_txt(ann)
        # a random instance and host name: two stages never collide, so probing succeeds
        self._token = secrets.token_hex(6)
        self._name = f"stage{ann.stage}-{self._token}.{SERVICE_TYPE}"
        try:
            self._azc = AsyncZeroconf(interfaces=self._addresses, ip_version=IPVersion.V4Only)
            self._info = self._service(properties, ann.port)
            await (await self._azc.async_register_service(self._info))
        except (OSError, ZeroconfError) as exc:
            await self._close()
            raise SwarmError(f"cannot announce stage {ann.stage} by mDNS on {', '.join(self._addresses)}: "
                             f"{exc}") from exc
        self._announced = ann
        self._announced_at = asyncio.get_running_loop().time()

    def _service(self, properties: dict[str, str], port: int) -> AsyncServiceInfo:
        return AsyncServiceInfo(SERVICE_TYPE, self._name, port=port, properties=properties,
                                server=f"swarm-stage-{self._token}.local.", host_ttl=self._host_ttl,
                                parsed_addresses=self._addresses)

    def update(self, steps: int) -> None:
        """Announce ``steps`` (in the background) if it changed since the last announcement,
        that was at least ``refresh_every`` seconds ago (each one is a multicast burst) and
        no announcement is still going out."""
        ann, azc = self._announced, self._azc
        now = asyncio.get_running_loop().time()
        if (ann is None or azc is None or steps == ann.steps or now - self._announced_at < self._refresh_every
                or (self._updating is not None and not self._updating.done())):
            return
        ann = replace(ann, steps=min(steps, _MAX_STEPS))
        info = self._service(encode_txt(ann), ann.port)
        self._announced, self._announced_at = ann, now

        async def announce() -> None:
            try:
                await (await azc.async_update_service(info))
            except (OSError, ZeroconfError) as exc:  # a link down: the next refresh tries again
                log.debug("mDNS: could not announce stage %d's steps: %s", ann.stage, exc)

        self._updating = asyncio.create_task(announce(), name=f"announce-steps-stage{ann.stage}")

    async def stop(self) -> None:
        """Say goodbye (browsers drop the stage at once) and close the sockets; idempotent."""
        tasks = [t for t in (self._starting, self._updating) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._starting = self._updating = None
        await self._close()

    async def _close(self) -> None:
        azc, self._azc, self._announced = self._azc, None, None
        if azc is not None:
            await azc.async_unregister_all_services()
            await azc.async_close()

    def start_in_background(self, ann: StageAnnouncement, listen_host: str) -> None:
        """:meth:`start` in a task of its own, logging what it did: a failure is a warning
        (the stage serves anyway; its trainers then need --route)."""

        async def start() -> None:
            try:
                await self.start(ann, listen_host)
            except SwarmError as exc:
                log.warning("%s; the stage serves anyway, but a trainer must be given --route to find it",
                            exc)
                return
            log.info("announcing stage %d of %d of cluster %r by mDNS at %s (port %d)", ann.stage,
                     ann.stages, ann.cluster, ", ".join(self.addresses), ann.port)

        self._starting = asyncio.create_task(start(), name=f"announce-stage{ann.stage}")


def announce_stage(ann: StageAnnouncement, listen_host: str) -> StageAnnouncer:
    """Start announcing the stage ``ann`` describes, served on ``listen_host``, in the
    background (mDNS probing takes about 1.5 s, which the stage does not wait for). When
    mDNS cannot start, a warning says so; the stage serves anyway (its trainers need
    --route). Call :meth:`StageAnnouncer.stop` when the stage stops."""
    announcer = StageAnnouncer()
    announcer.start_in_background(ann, listen_host)
    return announcer


async def discover_stages(cluster: str, timeout: float, *, interfaces: Sequence[str] | None = None,
                          settle: float = 1.0, resolve_timeout: float = 3.0) -> list[StageAnnouncement]:
    """Browse for the stages of ``cluster`` for up to ``timeout`` seconds.

    Returns as soon as every stage index ``0..N-1`` has a replica (all announcing the same N)
    and ``settle`` more seconds have passed (other replicas answering the same query arrive
    then), else at ``timeout`` with what was found.

    Args:
        interfaces: IPv4 addresses of the interfaces to browse on (default: all).
        resolve_timeout: how long the lookup of one stage's records may take.

    Raises:
        SwarmError: the stages found disagree on their number (at once), or mDNS cannot start.
    """
    quiet_zeroconf_network_errors()
    local = local_ipv4_networks()
    loop = asyncio.get_running_loop()
    found: dict[str, StageAnnouncement] = {}
    resolving: dict[str, asyncio.Task[None]] = {}
    changed = asyncio.Event()
    try:
        azc = AsyncZeroconf(interfaces=list(interfaces) if interfaces else InterfaceChoice.All,
                            ip_version=IPVersion.V4Only)
    except OSError as exc:
        raise SwarmError(f"cannot browse for stages by mDNS: {exc}; give --route instead") from exc

    async def resolve(name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        # QM: answers are multicast, so one query reaches every browser's cache
        qm = DNSQuestionType.QM
        if not await info.async_request(azc.zeroconf, resolve_timeout * 1000, question_type=qm):
            log.debug("no answer from %s", name)
            return
        host = pick_host(info.parsed_addresses(IPVersion.V4Only), local) or ""
        ann = decode_txt(info.properties, host)
        if ann is None or ann.port != info.port:
            return
        if ann.cluster != cluster:
            log.debug("ignoring %s: a stage of cluster %r", ann.address, ann.cluster)
            return
        found[name] = ann
        changed.set()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        name = name.lower()
        previous = resolving.pop(name, None)
        if previous is not None:
            previous.cancel()
        if state_change is ServiceStateChange.Removed:
            if found.pop(name, None) is not None:
                changed.set()
        else:
            resolving[name] = asyncio.create_task(resolve(name), name=f"resolve-{name}")

    browser = browse(azc.zeroconf, SERVICE_TYPE, on_change)
    try:
        deadline = loop.time() + timeout
        complete_at: float | None = None
        while True:
            anns = list(found.values())
            _refuse_mixed(anns, cluster)
            now = loop.time()
            if complete_at is None and _complete(anns):
                complete_at = now
            end = deadline if complete_at is None else min(deadline, complete_at + settle)
            if now >= end:
                return anns
            changed.clear()
            try:
                async with asyncio.timeout(end - now):
                    await changed.wait()
            except TimeoutError:
                pass
    finally:
        for task in resolving.values():
            task.cancel()
        await asyncio.gather(*resolving.values(), return_exceptions=True)
        await browser.async_cancel()
        await azc.async_close()


async def discover_route(cluster: str, timeout: float, *, secret: bytes | None, tls: TLSConfig | None = None,
                         interfaces: Sequence[str] | None = None) -> Route:
    """A route through the stages of ``cluster`` found by mDNS within ``timeout`` seconds,
    keeping only the replicas that answer an authenticated status request and say there
    what they announced (stage index and layers); logged as a ``--route`` string.

    Raises:
        SwarmError: as :func:`build_route`, or a stage none of whose replicas passed.
    """
    log.info("looking for the stages of cluster %r by mDNS (up to %g s)", cluster, timeout)
    anns = await discover_stages(cluster, timeout, interfaces=interfaces)
    route = build_route(anns, cluster, waited=timeout)
    said = {(a.stage, a.host, a.port): a for a in anns}  # one address may be announced twice
    statuses = await fetch_statuses(route, secret=secret, tls=tls)
    checked: Route = []
    for i, replicas in enumerate(statuses):
        keep = []
        for (host, port), status in zip(route[i], replicas, strict=True):
            ann = said[(i, host, port)]
            if "error" in status:
                why = f"did not answer an authenticated status request ({status['error']})"
            elif status.get("stage") != ann.stage or list(status.get("layers") or []) != list(ann.layers):
                why = (f"says stage {status.get('stage')} layers {status.get('layers')} when asked, but "
                       f"announced stage {ann.stage} layers {list(ann.layers)}")
            else:
                keep.append((host, port))
                continue
            log.warning("%s announced stage %d of cluster %r by mDNS but %s: not using it",
                        ann.address, i, cluster, why)
        if not keep:
            raise SwarmError(
                f"no replica of stage {i} found by mDNS ({', '.join(f'{h}:{p}' for h, p in route[i])}) "
                "answered an authenticated status request with what it announced: check that every "
                "stage and this process use the same secret (--secret-file or SWARMTRAIN_SECRET) and "
                "that the port is reachable from here, or give --route")
        checked.append(keep)
    log.info("found the stages of cluster %r by mDNS: --route %s", cluster, f'"{format_route(checked)}"')
    return checked
