"""Peer discovery: TXT codec, validation, static lists (no network), mDNS on a simulated LAN."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from zeroconf import DNSIncoming, ServiceInfo, ServiceStateChange

from swarmtrain.errors import ConfigError, SwarmError, SwarmTimeout
from swarmtrain.roles.peer.discovery import (
    SERVICE_TYPE,
    MdnsDiscovery,
    PeerInfo,
    StaticDiscovery,
    decode_txt,
    encode_txt,
    parse_peer_list,
)
from swarmtrain.roles.stage.discovery import SERVICE_TYPE as STAGE_SERVICE_TYPE
from swarmtrain.roles.stage.discovery import discover_stages
from swarmtrain.testing import Host, SimulatedLAN
from swarmtrain.transport import mdns
from swarmtrain.transport.identity import Identity
from swarmtrain.wire.frame import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(30)


def make_peer(run: str = "r1", version: int = PROTOCOL_VERSION, host: str = "10.0.0.2") -> PeerInfo:
    ident = Identity.generate()
    return PeerInfo(ident.peer_id, host, 7200, 7201, run, version, "laptop", ident.public_key)


def txt_bytes(props: dict[str, str]) -> dict[bytes, bytes | None]:
    return {k.encode(): v.encode() for k, v in props.items()}


# --- TXT records ---------------------------------------------------------------------------


def test_txt_round_trip_through_zeroconf_encoding() -> None:
    peer = make_peer()
    info = ServiceInfo(
        SERVICE_TYPE, f"{peer.peer_id}.{SERVICE_TYPE}", port=peer.port, properties=encode_txt(peer)
    )
    assert decode_txt(info.properties, peer.host) == peer
    assert set(encode_txt(peer)) == {"id", "pk", "port", "ring", "v", "run", "profile"}


@pytest.mark.parametrize(
    "change",
    [
        {"id": None},
        {"pk": None},
        {"port": None},
        {"pk": "zz" * 32},
        {"pk": "ab" * 31},
        {"id": "AB" * 16},
        {"port": "0"},
        {"port": "70000"},
        {"port": "-1"},
        {"port": "7e3"},
        {"ring": ""},
        {"v": "x"},
        {"v": "300"},
        {"run": ""},
        {"run": "x" * 65},
        {"run": "bad\nname"},
        {"profile": "not a profile!"},
    ],
)
def test_malformed_txt_is_ignored(change: dict[str, str | None]) -> None:
    props: dict[str, str | None] = {**encode_txt(make_peer()), **change}
    raw = {k.encode(): (v.encode() if v is not None else None) for k, v in props.items()}
    assert decode_txt(raw, "10.0.0.2") is None


def test_undecodable_txt_is_ignored() -> None:
    raw = txt_bytes(encode_txt(make_peer()))
    assert decode_txt({**raw, b"run": b"\xff\xfe"}, "10.0.0.2") is None
    assert decode_txt({b"\xff": b"x", **raw}, "10.0.0.2") is None
    assert decode_txt({}, "10.0.0.2") is None


def test_forged_id_is_ignored() -> None:
    victim, forger = make_peer(), make_peer()
    forged = {**encode_txt(forger), "id": victim.peer_id}
    assert decode_txt(txt_bytes(forged), "10.0.0.9") is None


# --- address list --------------------------------------------------------------------------


def test_parse_peer_list() -> None:
    assert parse_peer_list("10.0.0.2:7200,10.0.0.3") == [("10.0.0.2", 7200), ("10.0.0.3", 7200)]
    assert parse_peer_list(" pi.local:7300 , [fd00::3]:7201, [fd00::4] ,") == [
        ("pi.local", 7300),
        ("fd00::3", 7201),
        ("fd00::4", 7200),
    ]
    assert parse_peer_list("a:1,a:1,a") == [("a", 1), ("a", 7200)]
    assert parse_peer_list("") == []


@pytest.mark.parametrize(
    "text",
    ["10.0.0.2:0", "10.0.0.2:65536", "10.0.0.2:x", "10.0.0.2:", "fd00::3", "-bad-:1", "a b:1", "[x]:1"],
)
def test_parse_peer_list_rejects_bad_entries(text: str) -> None:
    with pytest.raises(ConfigError, match="peers"):
        parse_peer_list(text)


def test_pick_host_prefers_a_shared_subnet() -> None:
    local = [ipaddress.IPv4Interface("127.0.0.1/8"), ipaddress.IPv4Interface("10.1.0.5/24")]
    assert mdns.pick_host(["127.0.0.1", "172.17.0.1", "10.1.0.9"], local) == "10.1.0.9"
    assert mdns.pick_host(["127.0.0.1", "172.17.0.1"], local) == "172.17.0.1"
    assert mdns.pick_host(["127.0.0.1"], local) == "127.0.0.1"
    assert mdns.pick_host([], local) is None


# --- static discovery with a fake probe ----------------------------------------------------


class FakeNetwork:
    """Answers probes from a table; an address missing from it refuses the connection."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, int], PeerInfo | None | str] = {}

    async def probe(self, host: str, port: int) -> PeerInfo | None:
        answer = self.nodes.get((host, port), "refused")
        if answer == "refused":
            raise ConnectionRefusedError(f"{host}:{port}")
        if answer == "hang":
            await asyncio.sleep(3600)
        assert not isinstance(answer, str)
        return answer


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_static_discovery_with_a_fake_probe() -> None:
    async def main() -> None:
        me, a, b = make_peer(), make_peer(host="whatever"), make_peer()
        other_run, other_version = make_peer(run="r2"), make_peer(version=PROTOCOL_VERSION + 1)
        forged = replace(make_peer(), peer_id=a.peer_id)
        net = FakeNetwork()
        net.nodes = {
            ("h0", 1): me,  # the list may name this node itself
            ("h1", 1): a,
            ("h2", 1): b,
            ("h3", 1): other_run,
            ("h4", 1): other_version,
            ("h5", 1): forged,
            ("h6", 1): None,
            ("h7", 1): "hang",
        }
        addresses = [*net.nodes, ("h8", 1)]
        d = StaticDiscovery(addresses, net.probe, interval=0.05, probe_timeout=0.2)
        changes: list[set[str]] = []
        d.add_listener(lambda: changes.append(set(d.peers())))
        await d.start(me)
        found = await d.wait_for_peers(2, timeout=5)
        assert [p.peer_id for p in found] == sorted([a.peer_id, b.peer_id])
        assert d.peers()[a.peer_id] == replace(a, host="h1", port=1)  # the address probed
        await asyncio.sleep(0.5)  # more rounds, the hanging probe timed out: nothing else
        assert set(d.peers()) == {a.peer_id, b.peer_id} and len(changes) == 1

        net.nodes[("h2", 1)] = "refused"  # b goes away, then comes back
        await until(lambda: b.peer_id not in d.peers())
        net.nodes[("h2", 1)] = b
        await until(lambda: b.peer_id in d.peers())
        assert changes[-2:] == [{a.peer_id}, {a.peer_id, b.peer_id}]
        await d.stop()
        assert d.peers() == {}
        await d.stop()

    asyncio.run(main())


def test_wait_for_peers_timeout_says_found_x_of_y() -> None:
    async def main() -> None:
        me, a = make_peer(run="exp-7"), make_peer(run="exp-7")
        net = FakeNetwork()
        net.nodes = {("h1", 1): a}
        d = StaticDiscovery([("h1", 1), ("h2", 1)], net.probe, interval=0.05)
        with pytest.raises(SwarmError, match="before start"):
            await d.wait_for_peers(1, 0.1)
        await d.start(me)
        t0 = time.monotonic()
        with pytest.raises(SwarmTimeout) as info:
            await d.wait_for_peers(3, timeout=0.5)
        assert time.monotonic() - t0 > 0.4  # it waited for its timeout (the test's own ends a hang)
        assert info.value.phase == "discovery"
        assert "found 1 of 3 peers for run 'exp-7'" in str(info.value)
        assert "h2:1" in str(info.value)
        assert [p.peer_id for p in await d.wait_for_peers(1, timeout=5)] == [a.peer_id]
        await d.stop()

    asyncio.run(main())


def test_mdns_timeout_hints_at_static_peers() -> None:
    d = MdnsDiscovery()
    d._me = make_peer()
    with pytest.raises(SwarmTimeout, match=r"found 0 of 2 peers .*multicast.*--peers host:port"):
        asyncio.run(d.wait_for_peers(2, timeout=0.05))


def test_a_failing_listener_does_not_stop_the_others() -> None:
    async def main() -> None:
        me, a = make_peer(), make_peer()
        net = FakeNetwork()
        net.nodes = {("h1", 1): a}
        d = StaticDiscovery([("h1", 1)], net.probe, interval=0.05)
        calls: list[str] = []

        def broken() -> None:
            raise RuntimeError("a bug in a listener")

        d.add_listener(lambda: calls.append("first"))
        d.add_listener(broken)
        d.add_listener(lambda: calls.append("last"))
        await d.start(me)
        await d.wait_for_peers(1, timeout=5)
        assert calls == ["first", "last"]
        await d.stop()

    asyncio.run(main())


# --- mDNS record handling, with the network lookups faked ----------------------------------


class FakeServiceInfo:
    def __init__(self, peer: PeerInfo, addresses: list[str]) -> None:
        self.properties = txt_bytes(encode_txt(peer))
        self._addresses = addresses

    def parsed_addresses(self, version: Any = None) -> list[str]:
        return self._addresses


def test_mdns_record_handling_without_network() -> None:
    async def main() -> None:
        me, a, other_run = make_peer(), make_peer(), make_peer(run="r2")
        records: dict[str, FakeServiceInfo] = {}

        async def lookup(name: str) -> Any:
            return records.get(name)

        d = MdnsDiscovery()
        d._me, d._local = me, [ipaddress.IPv4Interface("10.0.0.1/24")]
        d._lookup = lookup  # type: ignore[method-assign]
        changes: list[set[str]] = []
        d.add_listener(lambda: changes.append(set(d.peers())))

        async def event(peer_id: str, change: ServiceStateChange, name: str | None = None) -> None:
            d._on_change(None, SERVICE_TYPE, name or f"{peer_id}.{SERVICE_TYPE}", change)  # type: ignore[arg-type]
            await asyncio.gather(*d._resolving.values())

        Added, Updated, Removed = (
            ServiceStateChange.Added,
            ServiceStateChange.Updated,
            ServiceStateChange.Removed,
        )
        records[f"{a.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(a, ["127.0.0.1", "10.0.0.7"])
        records[f"{other_run.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(other_run, ["10.0.0.8"])
        records[f"{me.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(me, ["10.0.0.1"])
        await event(a.peer_id, Added)
        await event(other_run.peer_id, Added)
        await event(me.peer_id, Added)
        await event("x", Added, name=f"not-a-peer-id.{SERVICE_TYPE}")
        assert d.peers() == {a.peer_id: replace(a, host="10.0.0.7")}
        # An instance name that is not the id in its TXT record is someone posing as another.
        records[f"{'0' * 32}.{SERVICE_TYPE}"] = FakeServiceInfo(other_run, ["10.0.0.8"])
        await event("0" * 32, Added)
        assert set(d.peers()) == {a.peer_id}

        moved = replace(a, ring_port=9999)
        records[f"{a.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(moved, ["10.0.0.7"])
        await event(a.peer_id, Updated)
        assert d.peers()[a.peer_id].ring_port == 9999
        await event(a.peer_id, Removed)
        assert d.peers() == {} and changes == [{a.peer_id}, {a.peer_id}, set()]

        await event(a.peer_id, Added)
        del records[f"{a.peer_id}.{SERVICE_TYPE}"]  # stops answering, as a crashed peer
        await d._resolve(a.peer_id, attempts=1)
        assert d.peers() == {} and d._candidates == {a.peer_id}  # still rechecked
        records[f"{a.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(a, ["10.0.0.7"])
        await d._resolve(a.peer_id, attempts=1)  # back after a network cut
        assert set(d.peers()) == {a.peer_id}
        await event(a.peer_id, Removed)
        assert d._candidates == set()

    asyncio.run(main())


# --- the questions a browser asks, on loopback ------------------------------------------------


def _mdns_listener() -> socket.socket:
    """A socket that sees every mDNS packet sent on loopback (bound beside zeroconf's own)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("", 5353))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                    socket.inet_aton("224.0.0.251") + socket.inet_aton("127.0.0.1"))
    sock.setblocking(False)
    return sock


def _questions(sock: socket.socket) -> list[tuple[str, bool]]:
    """(name, asks for a unicast answer) of every question the socket has received, probes aside."""
    out = []
    while True:
        try:
            data = sock.recv(9000)
        except BlockingIOError:
            return out
        packet = DNSIncoming(data)
        if packet.is_query() and not packet.is_probe():  # a probe (QU by the RFC) claims a name
            out += [(q.name.lower(), q.unicast) for q in packet.questions]


def test_browsers_ask_for_multicast_answers_which_every_socket_on_the_host_receives() -> None:
    # A unicast answer (QU, python-zeroconf's default first question) goes to one of the sockets
    # bound to port 5353 on the asking host, not necessarily the asker's: a stage browse then
    # found nothing for a second, and a CI run's 2-second browse missed a stage. Both modes'
    # browsers ask QM questions from the first one on.
    async def main() -> list[tuple[str, bool]]:
        sock = _mdns_listener()
        try:
            peer = MdnsDiscovery(interfaces=["127.0.0.1"])
            await peer.start(make_peer(host="127.0.0.1"))
            try:
                await discover_stages(f"t-{os.getpid()}", 1.0, interfaces=["127.0.0.1"])
            finally:
                await peer.stop()
            return _questions(sock)
        finally:
            sock.close()

    asked = asyncio.run(main())
    browsing = [(name, unicast) for name, unicast in asked if name in (SERVICE_TYPE, STAGE_SERVICE_TYPE)]
    assert {name for name, _ in browsing} == {SERVICE_TYPE, STAGE_SERVICE_TYPE}, asked
    assert not any(unicast for _, unicast in browsing), browsing


# --- mDNS on a simulated LAN ---------------------------------------------------------------

# A discovery agent driven over stdin, one command a line, answering one JSON line each:
#   wait N T    -> {"peers": {id: host}} or {"timeout": message, "peers": ...}
#   peers       -> {"peers": {id: host}}
#   absent ID T  -> {"ok": bool, "at": wall-clock time ID last left our view}
#   present ID T -> {"ok": bool, "at": wall-clock time ID last entered our view}
#   stop         -> {"stopped": seconds stop() took}, then exit
# Its first line is {"ready": peer id, "start_s": ..., "t0": wall-clock time before start()};
# each wait also reports "found_at", the wall-clock time the last of the peers was seen.
AGENT = r"""
import asyncio, json, sys, time
from pathlib import Path
from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.roles.peer.discovery import MdnsDiscovery, PeerInfo
from swarmtrain.transport.identity import Identity

def say(**kw):
    print(json.dumps(kw), flush=True)

async def main(run, version, host_ttl, key_dir):
    ident = Identity.load_or_create(Path(key_dir)) if key_dir else Identity.generate()
    me = PeerInfo(ident.peer_id, "", 7200, 7201, run, version, "laptop", ident.public_key)
    d = MdnsDiscovery(host_ttl=host_ttl)
    shown, events = set(), {"present": {}, "absent": {}}
    def on_change():
        now, peers = time.time(), set(d.peers())
        events["present"].update(dict.fromkeys(peers - shown, now))
        events["absent"].update(dict.fromkeys(shown - peers, now))
        shown.clear()
        shown.update(peers)
    d.add_listener(on_change)
    t0 = time.time()
    try:
        await d.start(me)
    except SwarmError as exc:
        say(error=str(exc))
        return
    say(ready=ident.peer_id, start_s=time.time() - t0, t0=t0)
    loop = asyncio.get_running_loop()
    view = lambda: {pid: p.host for pid, p in d.peers().items()}
    while True:
        cmd, *args = (await loop.run_in_executor(None, sys.stdin.readline)).split() or ["stop"]
        if cmd == "wait":
            try:
                found = await d.wait_for_peers(int(args[0]), float(args[1]))
                say(peers=view(), found_at=max([events["present"][p.peer_id] for p in found], default=t0))
            except SwarmTimeout as exc:
                say(timeout=str(exc), peers=view())
        elif cmd == "peers":
            say(peers=view())
        elif cmd in events:
            deadline = time.monotonic() + float(args[1])
            while (args[0] in d.peers()) != (cmd == "present") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            say(ok=(args[0] in d.peers()) == (cmd == "present"), at=events[cmd].get(args[0]))
        else:
            t = time.monotonic()
            await d.stop()
            say(stopped=time.monotonic() - t)
            return

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
"""


class Agent:
    def __init__(self, host: Host, run: str, *, host_ttl: int = 10, key_dir: str = "") -> None:
        self.host = host
        argv = [sys.executable, "-c", AGENT, run, str(PROTOCOL_VERSION), str(host_ttl), key_dir]
        self.proc = host.run(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.peer_id = ""
        self.t0 = 0.0

    def started(self) -> dict[str, Any]:
        first = self.read(timeout=30)
        self.peer_id, self.t0 = first.get("ready", ""), first.get("t0", 0.0)
        return first

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"{self.host.name}: no answer within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"{self.host.name}: agent exited (rc={self.proc.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str, timeout: float = 30) -> dict[str, Any]:
        self.send(command)
        return self.read(timeout)


def start_agents(agents: list[Agent]) -> None:
    for agent in agents:
        assert "ready" in agent.started()


MakeLan = Callable[..., SimulatedLAN]


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_four_hosts_find_each_other_but_not_another_run(lan_factory: MakeLan) -> None:
    lan = lan_factory(5)
    agents = [Agent(h, "run-a") for h in lan.hosts[:4]]
    stranger = Agent(lan.hosts[4], "run-b")
    start_agents([*agents, stranger])
    ids = {a.peer_id: a.host.address for a in agents}
    for agent in agents:
        agent.send("wait 3 30")
    for agent in agents:
        answer = agent.read(timeout=40)
        expected = {pid: addr for pid, addr in ids.items() if pid != agent.peer_id}
        assert answer["peers"] == expected, answer  # exactly the other three, at their LAN address
        print(f"{agent.host.name}: all 3 peers known {answer['found_at'] - agent.t0:.2f} s after start()")
    answer = stranger.ask("wait 1 3")
    assert "found 0 of 1 peers for run 'run-b'" in answer["timeout"] and answer["peers"] == {}
    for agent in agents:  # the stranger has been announcing for seconds: still not seen
        assert stranger.peer_id not in agent.ask("peers")["peers"]
    for agent in [*agents, stranger]:
        assert agent.ask("stop")["stopped"] < 5


def wait_event(agent: Agent, event: str, peer_id: str, since: float, bound: float, what: str) -> None:
    """Assert `agent` sees `peer_id` become `event` (present/absent) within `bound` s of `since`."""
    answer = agent.ask(f"{event} {peer_id} {bound + 5}", timeout=bound + 15)
    assert answer["ok"], f"{agent.host.name}: {what} not {event} after {bound + 5} s"
    assert answer["at"] - since < bound, f"{agent.host.name}: {what} {event} after {answer['at'] - since} s"
    print(f"{agent.host.name}: {what} {event} after {answer['at'] - since:.3f} s")


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_stopped_cut_off_and_crashed_peers(lan_factory: MakeLan) -> None:
    """Bounds (host_ttl 4 s, resolve timeout 3 s, recheck every 1 s): a peer that stops is
    gone from the others' view within 2 s (goodbye packets); one cut off or killed within
    host_ttl + recheck + resolve timeout + 2 s slack = 10 s; a cut-off peer is back within
    recheck + resolve timeout + 2 s slack = 6 s of its link coming back."""
    lan = lan_factory(3)
    h0, h1, h2 = lan.hosts
    # Two peers share host h0: both bind the mDNS port there and must still see each other.
    agents = [Agent(h, "run-a", host_ttl=4) for h in (h0, h0, h1, h2)]
    start_agents(agents)
    for agent in agents:
        assert len(agent.ask("wait 3 30", timeout=40)["peers"]) == 3
    stopping, flaky, survivors = agents[3], agents[2], agents[:2]

    t = time.time()
    assert stopping.ask("stop")["stopped"] < 5
    for agent in [*survivors, flaky]:
        wait_event(agent, "absent", stopping.peer_id, t, 2, "stopped peer")

    h1.cut()
    t = time.time()
    for agent in survivors:
        wait_event(agent, "absent", flaky.peer_id, t, 10, "cut-off peer")
    for agent in survivors:  # and the cut-off peer loses them
        wait_event(flaky, "absent", agent.peer_id, t, 10, "peer beyond the cut")
    h1.restore()
    t = time.time()
    for agent in survivors:
        wait_event(agent, "present", flaky.peer_id, t, 6, "reconnected peer")
        wait_event(flaky, "present", agent.peer_id, t, 6, "peer beyond the mended cut")

    t = time.time()
    os.killpg(flaky.proc.pid, signal.SIGKILL)
    for agent in survivors:
        wait_event(agent, "absent", flaky.peer_id, t, 10, "killed peer")


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_a_second_node_with_the_same_identity_is_refused(lan_factory: MakeLan, tmp_path: Path) -> None:
    lan = lan_factory(2)
    first = Agent(lan.hosts[0], "run-a", key_dir=str(tmp_path))
    assert "ready" in first.started()
    second = Agent(lan.hosts[1], "run-a", key_dir=str(tmp_path))
    answer = second.read(timeout=30)
    assert "already advertises peer id" in answer["error"] and first.peer_id in answer["error"]
