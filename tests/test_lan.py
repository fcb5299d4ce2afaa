"""The simulated LAN: reachability, isolation, cut/restore, shaping, cleanup."""

from __future__ import annotations

import ipaddress
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import conftest
import pytest

from swarmtrain.testing import Host, LanError, SimulatedLAN, cleanup_stale
from swarmtrain.testing import lan as lan_module
from swarmtrain.testing.lan import _cmd, _list_netns

pytestmark = pytest.mark.timeout(90)
netns = pytest.mark.netns

MakeLan = Callable[..., SimulatedLAN]

# Each script prints its listening port (bound to port 0) as its first line.
ECHO_SERVER = """
import socket
srv = socket.create_server(("0.0.0.0", 0))
srv.settimeout(60)
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(10)
        conn.sendall(conn.recv(1024))
"""

ECHO_CLIENT = """
import socket, sys
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with socket.create_connection((addr, port), timeout=timeout) as sock:
    sock.sendall(b"hello from " + sys.argv[4].encode())
    print(sock.recv(1024).decode())
"""

SINK = """
import socket, time
srv = socket.create_server(("0.0.0.0", 0))
srv.settimeout(30)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(30)
buf = bytearray(1 << 16)
total, first = 0, None
while n := conn.recv_into(buf):
    if first is None:
        first, n = time.monotonic(), 0  # time from the first chunk on; count what follows
    total += n
print(total, time.monotonic() - first, flush=True)
"""

SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as sock:
    sock.sendall(bytes(int(sys.argv[3])))
"""

SLEEPER_WITH_ESCAPED_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""

MCAST_RECEIVER = """
import socket, struct
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("", 0))
group = struct.pack("4s4s", socket.inet_aton("224.0.0.251"), socket.inet_aton("0.0.0.0"))
sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
sock.settimeout(20)
print(sock.getsockname()[1], flush=True)
data, (src, _) = sock.recvfrom(1024)
print(data.decode(), src, flush=True)
"""

MCAST_SENDER = """
import socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
for _ in range(20):
    sock.sendto(b"announce", ("224.0.0.251", int(sys.argv[1])))
    time.sleep(0.1)
"""


def _start(host: Host, script: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start `script` in `host`, return the process and the first line it prints."""
    proc = host.run([sys.executable, "-c", script, *args], stdout=subprocess.PIPE)
    return proc, _read_line(proc, timeout=15)


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no line from pid {proc.pid} within {timeout} s")
        byte = os.read(proc.stdout.fileno(), 1)  # unbuffered: never reads past the line
        if not byte:
            raise AssertionError(f"pid {proc.pid} exited (rc={proc.poll()}) before a line")
        line += byte
    return line.decode().strip()


def _echo(client: Host, server: Host, port: str, timeout: float = 5) -> str:
    argv = [sys.executable, "-c", ECHO_CLIENT, server.address, port, str(timeout), client.name]
    return client.check_output(argv, timeout=timeout + 15).strip()


def _alive(pid: int) -> bool:
    """Running (zombies count as gone: pid 1 here may be slow to reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _measure_mbit(sender: Host, receiver: Host, nbytes: int) -> float:
    sink, port = _start(receiver, SINK)
    sender.check_output([sys.executable, "-c", SENDER, receiver.address, port, str(nbytes)], 60)
    total, seconds = _read_line(sink, timeout=60).split()
    assert int(total) > nbytes * 0.9
    return int(total) * 8 / float(seconds) / 1e6


@netns
def test_hosts_reach_each_other_over_tcp(lan_factory: MakeLan) -> None:
    lan = lan_factory(3)
    _, port = _start(lan.hosts[0], ECHO_SERVER)
    for client in lan.hosts[1:]:
        assert _echo(client, lan.hosts[0], port) == f"hello from {client.name}"


@netns
def test_addresses_are_distinct_and_inside_the_subnet(lan_factory: MakeLan) -> None:
    lan = lan_factory(4)
    subnet = ipaddress.ip_network(lan.subnet)
    addresses = [ipaddress.ip_address(h.address) for h in lan.hosts]
    assert subnet.prefixlen == 24 and subnet.is_private
    assert all(a in subnet for a in addresses)
    assert len(set(addresses)) == 4
    assert len({h.netns for h in lan.hosts} | {lan.switch_netns}) == 5
    assert all(len(f"p-{h.name}") <= 15 for h in lan.hosts)
    # lo is up in every host, so processes can use 127.0.0.1 inside too.
    assert "127.0.0.1" in lan.hosts[0].check_output(["ip", "-4", "addr", "show", "lo"], 10)


@netns
def test_two_lans_at_once_do_not_collide_and_are_isolated(lan_factory: MakeLan) -> None:
    with ThreadPoolExecutor(2) as pool:  # built concurrently, to race for subnets and names
        a, b = pool.map(lambda _: lan_factory(2), range(2), timeout=60)
    lans = [a, b]
    assert a.subnet != b.subnet
    names_a = {a.switch_netns, *(h.netns for h in a.hosts)}
    names_b = {b.switch_netns, *(h.netns for h in b.hosts)}
    assert not names_a & names_b
    assert (names_a | names_b) <= set(_list_netns())
    for lan in lans:
        _, port = _start(lan.hosts[0], ECHO_SERVER)
        assert _echo(lan.hosts[1], lan.hosts[0], port) == "hello from h1"
    # No route leads out of a LAN, not even to the other LAN on the same machine.
    with pytest.raises(LanError, match="unreachable"):
        _echo(a.hosts[1], b.hosts[0], port)


@netns
def test_cut_host_is_unreachable_until_restored(lan_factory: MakeLan) -> None:
    lan = lan_factory(2)
    server, client = lan.hosts
    proc, port = _start(server, ECHO_SERVER)
    assert _echo(client, server, port) == "hello from h1"
    server.cut()
    with pytest.raises(LanError, match="timed out"):
        _echo(client, server, port, timeout=1.5)
    assert proc.poll() is None  # a cut host keeps running, it is just off the network
    server.restore()
    assert _echo(client, server, port) == "hello from h1"


@netns
@pytest.mark.serial  # measures throughput against the shaped rate
def test_rate_limit_holds_in_both_directions(lan_factory: MakeLan) -> None:
    lan = lan_factory(2)
    free, limited = lan.hosts
    limited.set_rate(20)
    # Into the limited host (shaped on its bridge port), then out of it (shaped on its eth0).
    for sender, receiver in ((free, limited), (limited, free)):
        ratio = _measure_mbit(sender, receiver, 3_000_000) / 20
        print(f"{sender.name}->{receiver.name}: {ratio:.2f} of the limit")
        assert 0.3 <= ratio <= 1.1


@netns
@pytest.mark.serial
def test_lan_wide_rate_and_its_removal(lan_factory: MakeLan) -> None:
    lan = lan_factory(2, rate_mbit=40)
    ratio = _measure_mbit(lan.hosts[0], lan.hosts[1], 4_000_000) / 40
    print(f"h0->h1 at 40 Mbit: {ratio:.2f} of the limit")
    assert 0.3 <= ratio <= 1.1
    for host in lan.hosts:
        host.set_rate(None)
        assert "tbf" not in host.check_output(["tc", "qdisc", "show", "dev", "eth0"], 10)
    assert "tbf" not in _cmd("tc", "-n", lan.switch_netns, "qdisc", "show")


@netns
def test_multicast_reaches_other_hosts(lan_factory: MakeLan) -> None:
    lan = lan_factory(2)
    receiver, port = _start(lan.hosts[1], MCAST_RECEIVER)
    lan.hosts[0].check_output([sys.executable, "-c", MCAST_SENDER, port], 30)
    assert _read_line(receiver, timeout=20) == f"announce {lan.hosts[0].address}"


@netns
def test_close_removes_namespaces_and_processes_even_on_error() -> None:
    conftest.require_netns()
    pids = []
    with pytest.raises(RuntimeError, match="boom"), SimulatedLAN(2) as lan:
        names = {lan.switch_netns, *(h.netns for h in lan.hosts)}
        for host in lan.hosts:
            proc, child = _start(host, SLEEPER_WITH_ESCAPED_CHILD)
            pids += [proc.pid, int(child)]
        assert all(_alive(pid) for pid in pids)
        raise RuntimeError("boom")
    assert lan.closed
    assert not names & set(_list_netns())
    assert not [pid for pid in pids if _alive(pid)]
    lan.close()  # idempotent
    with pytest.raises(LanError, match="closed"):
        lan.hosts[0].run(["true"])


@netns
def test_failed_build_removes_what_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    conftest.require_netns()
    mine = f"st-{os.getpid()}-"  # only this process's namespaces: others may run in parallel
    before = {name for name in _list_netns() if name.startswith(mine)}

    def failing_cmd(*argv: str, timeout: float = 20.0) -> str:
        if "route" in argv and argv[2].endswith("-h1"):  # the second host's last step
            raise LanError("injected failure")
        return _cmd(*argv, timeout=timeout)

    monkeypatch.setattr(lan_module, "_cmd", failing_cmd)
    with pytest.raises(LanError, match="injected"):
        SimulatedLAN(3)
    assert {name for name in _list_netns() if name.startswith(mine)} <= before


@netns
def test_cleanup_stale_removes_only_namespaces_of_dead_pids() -> None:
    conftest.require_netns()
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale, live = f"st-{dead.pid}-beef-h0", f"st-{os.getpid()}-beef-h0"
    for name in (stale, live):
        _cmd("ip", "netns", "add", name)
    try:
        removed = cleanup_stale()
        assert stale in removed and live not in removed
        names = set(_list_netns())
        assert stale not in names and live in names
    finally:
        for name in {stale, live} & set(_list_netns()):
            _cmd("ip", "netns", "delete", name)


def test_require_netns_skips_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "netns_available", lambda: (False, "not root"))
    monkeypatch.delenv("SWARMTRAIN_REQUIRE_NETNS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not root"):
        conftest.require_netns()
    monkeypatch.setenv("SWARMTRAIN_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="not root"):
        conftest.require_netns()
