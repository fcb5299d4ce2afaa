"""A simulated LAN: N hosts as Linux network namespaces joined by a bridge.

Layout of one LAN (run id ``<pid>-<kk>``, ``kk`` = third octet of its subnet in hex)::

    netns st-<pid>-<kk>-sw      bridge br0, one port p-h<i> per host (mcast snooping off)
    netns st-<pid>-<kk>-h<i>    lo up; eth0 = 10.213.<k>.<i+1>/24, veth peer of p-h<i>

Nothing is created in the root namespace: the bridge lives in its own "switch" namespace and
each veth pair is created there with its other end moved straight into the host namespace.
The hosts have no default route, so the only addresses a process inside can reach are the
ones of this LAN (and its own loopback).

Collisions between parallel runs: each LAN holds an exclusive ``flock`` on
``/run/swarmtrain-lan/<k>.lock`` for its lifetime, so no two live LANs on this machine share
a subnet; namespace names embed the creating pid and ``k``, so they are unique too (and
``ip netns add`` refuses an existing name, which turns any surprise into an error). The kernel
drops the lock when the process dies, however it dies.

Cleanup: :meth:`SimulatedLAN.close` runs from ``__exit__``, from ``atexit`` and from a SIGTERM
handler that then chains to the previous one. Whatever still survives (``kill -9``, a test
timeout that calls ``os._exit``) is removed by :func:`cleanup_stale`, which every new LAN
calls first: it deletes namespaces whose name carries the pid of a process that is gone.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Self

from swarmtrain.errors import SwarmError, SwarmTimeout

__all__ = ["Host", "LanError", "SimulatedLAN", "cleanup_stale", "netns_available"]

DEFAULT_PREFIX = "st-"
_SUBNET_PREFIX = "10.213"  # this run's /24 is 10.213.<k>.0/24, k in 0..255
_LOCK_DIR = Path("/run/swarmtrain-lan")
_MAX_HOSTS = 250
_CMD_TIMEOUT = 20.0  # one `ip`/`tc` invocation
_KILL_GRACE = 3.0  # SIGTERM -> SIGKILL
_HOST_IF = "eth0"

_File = int | IO[Any] | None


class LanError(SwarmError):
    """Building, changing or tearing down the simulated LAN failed."""


def _cmd(*argv: str, timeout: float = _CMD_TIMEOUT) -> str:
    """Run one `ip`/`tc` command; return its stdout or raise LanError with command and stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LanError(f"`{shlex.join(argv)}` could not run: {exc}") from exc
    if done.returncode != 0:
        raise LanError(
            f"`{shlex.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _cmd("ip", "netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(netns: str) -> None:
    """SIGKILL every process still inside `netns` (ones that left our process groups)."""
    for pid in _cmd("ip", "netns", "pids", netns).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete_netns(netns: str) -> None:
    """Kill what still runs inside `netns` and delete it; raise LanError if either fails."""
    _kill_netns_pids(netns)
    deadline = time.monotonic() + _KILL_GRACE
    while _cmd("ip", "netns", "pids", netns).split():
        if time.monotonic() > deadline:
            raise LanError(f"processes in {netns} survived SIGKILL for {_KILL_GRACE:g} s")
        time.sleep(0.02)
    _cmd("ip", "netns", "delete", netns)


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces left by dead runs: named ``<prefix><pid>-<hex>-<role>``, pid gone.

    Namespaces whose creator is still alive, and names that do not follow the pattern, are
    left alone. Processes still running inside a stale namespace are killed.

    Returns:
        The names of the namespaces removed.
    Raises:
        LanError: listing namespaces failed.
    """
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)-[0-9a-f]+-[a-z]+\d*")
    removed = []
    for name in _list_netns():
        match = pattern.fullmatch(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            _delete_netns(name)
        except LanError:
            if name in _list_netns():  # else a parallel cleanup got there first
                raise
        removed.append(name)
    return removed


@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether this process can build a simulated LAN, and if not, why.

    Checks for root, for `ip` and `tc`, and creates (then deletes) a throwaway namespace
    with a veth pair and a tbf qdisc. The answer is cached for the process.

    Returns:
        ``(True, "")``, or ``(False, reason)`` with a sentence saying what is missing.
    """
    if os.geteuid() != 0:
        return False, "the simulated LAN needs root (network namespaces); not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not on PATH"
    probe = f"{DEFAULT_PREFIX}{os.getpid()}-{secrets.token_hex(2)}-probe"
    try:
        _cmd("ip", "netns", "add", probe)
        _cmd("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _cmd("tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", *_tbf_args(10.0))
    except LanError as exc:
        return False, f"cannot build a network namespace with veth and tbf: {exc}"
    finally:
        try:
            if probe in _list_netns():
                _cmd("ip", "netns", "delete", probe)
        except LanError:
            pass  # left for cleanup_stale once this process is gone
    return True, ""


def _tbf_args(mbit: float) -> list[str]:
    """tbf parameters for `mbit` megabit/s.

    With R = rate in bytes/s: burst = max(R / 100, 16 KiB), i.e. 10 ms of traffic (enough
    for timer granularity down to HZ=100) but never fewer than ~10 full frames; limit =
    burst + R / 20, i.e. at most ~50 ms of queueing before tbf drops, like a modest switch
    buffer. GSO super-packets larger than the burst are segmented by tbf itself.
    """
    rate = mbit * 1e6 / 8
    burst = max(int(rate / 100), 16 * 1024)
    limit = burst + int(rate / 20)
    return ["tbf", "rate", f"{round(mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit)]


def _claim_subnet() -> tuple[int, int]:
    """Lock a free /24; returns (lock fd, third octet). The lock lives as long as the fd."""
    _LOCK_DIR.mkdir(mode=0o755, exist_ok=True)
    octets = list(range(256))
    random.shuffle(octets)
    for k in octets:
        fd = os.open(_LOCK_DIR / f"{k}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return fd, k
    raise LanError(f"all 256 subnets {_SUBNET_PREFIX}.*.0/24 are held by live LANs")


class Host:
    """One machine of the LAN. Created by :class:`SimulatedLAN`, not directly.

    Attributes:
        name: short label, ``h0``, ``h1``...
        netns: the network namespace's name, unique per run.
        address: this host's IPv4 address on the LAN (on interface ``eth0``).
    """

    def __init__(self, lan: SimulatedLAN, name: str, netns: str, address: str) -> None:
        self.name = name
        self.netns = netns
        self.address = address
        self._lan = lan
        self._port = f"p-{name}"  # the bridge-side end of this host's veth pair
        self._procs: list[subprocess.Popen[Any]] = []
        self._rate: float | None = None
        self._blocked: set[str] = set()

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r})"

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        stdin: _File = subprocess.DEVNULL,
        stdout: _File = None,
        stderr: _File = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[Any]:
        """Start `argv` inside this host, in a new session (its own process group).

        The process inherits this process's environment (PATH, the Python environment), with
        `env` laid over it, so ``[sys.executable, "-m", "swarmtrain", ...]`` works. It is
        killed, with its whole process group, when the LAN closes.

        Raises:
            LanError: the LAN is closed, or the process could not start.
        """
        if self._lan.closed:
            raise LanError(f"{self.name}: the LAN is closed")
        full_env = {**os.environ, **(env or {})}
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv],
                env=full_env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise LanError(f"{self.name}: cannot start {shlex.join(argv)}: {exc}") from exc
        self._procs.append(proc)
        return proc

    def check_output(
        self, argv: list[str], timeout: float, *, env: dict[str, str] | None = None
    ) -> str:
        """Run `argv` inside this host to completion and return its stdout (text).

        Raises:
            LanError: the command exited non-zero (the message carries its stderr).
            SwarmTimeout: it ran longer than `timeout` seconds (its process group is killed).
        """
        proc = self.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SwarmTimeout(f"command in {self.name}", timeout, shlex.join(argv)) from None
        finally:
            if proc.returncode is None:
                _kill_group(proc, signal.SIGKILL)
                proc.wait(timeout=_KILL_GRACE)
        if proc.returncode != 0:
            raise LanError(
                f"{self.name}: `{shlex.join(argv)}` exited {proc.returncode}: "
                f"{err.decode(errors='replace').strip()}"
            )
        return str(out.decode(errors="replace"))

    def set_rate(self, mbit: float | None) -> None:
        """Limit this host's link to `mbit` megabit/s each way (tbf); None removes the limit.

        Egress is shaped on the host's ``eth0``, ingress on the bridge port towards it, so a
        flow between two hosts runs at the smaller of the sender's and receiver's limits.
        """
        if mbit is not None and not mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {mbit!r}")
        for netns, dev in ((self.netns, _HOST_IF), (self._lan.switch_netns, self._port)):
            if mbit is not None:
                _cmd("tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *_tbf_args(mbit))
            elif self._rate is not None:
                _cmd("tc", "-n", netns, "qdisc", "del", "dev", dev, "root")
        self._rate = mbit

    def cut(self) -> None:
        """Cut this host off the LAN by taking its bridge port down (a pulled cable).

        The host keeps its address and routes; what it sends is lost and nothing reaches it,
        so peers on both sides see silence and time out rather than get an immediate error.
        """
        _cmd("ip", "-n", self._lan.switch_netns, "link", "set", self._port, "down")

    def restore(self) -> None:
        """Reconnect the host after :meth:`cut`."""
        _cmd("ip", "-n", self._lan.switch_netns, "link", "set", self._port, "up")

    def block(self, others: list[Host]) -> None:
        """Lose every unicast IPv4 packet this host sends to ``others``: it routes them via a
        gateway address nobody holds, so they wait for an ARP answer that never comes and are
        dropped (connections time out; nothing is refused). Call it on both sides for a
        two-way split. Multicast still crosses, so mDNS advertisements are heard from peers
        that cannot be reached: the harder case, where an advertised peer must not count.
        :meth:`unblock` removes it."""
        for other in others:
            if other.address not in self._blocked:
                _cmd("ip", "-n", self.netns, "route", "add", f"{other.address}/32", "via",
                     self._lan.nowhere, "dev", _HOST_IF)
                self._blocked.add(other.address)

    def unblock(self) -> None:
        """Remove every :meth:`block` route of this host."""
        for addr in sorted(self._blocked):
            _cmd("ip", "-n", self.netns, "route", "del", f"{addr}/32")
        self._blocked.clear()


def _kill_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_processes(procs: list[subprocess.Popen[Any]]) -> None:
    """SIGTERM the groups of the running `procs`, SIGKILL them after a grace period.

    Only groups whose leader we have not reaped yet are signalled: a reaped leader's pid may
    since belong to someone else. Their leftovers are found by the namespace sweep instead.
    """
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        _kill_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # Also reaches children left in the group (its id stays taken while any exists).
        _kill_group(proc, signal.SIGKILL)
    for proc in running:
        try:
            proc.wait(timeout=_KILL_GRACE)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel; the namespace deletion reports it


class SimulatedLAN:
    """N hosts in network namespaces on one bridge; a context manager.

    Args:
        n_hosts: number of hosts, 1..250.
        rate_mbit: if given, every host's link is limited to this many megabit/s each way.
        prefix: namespace-name prefix (default ``st-``).
    Raises:
        ValueError: bad arguments.
        LanError: the namespaces could not be built (whatever was built is removed).
    """

    def __init__(
        self, n_hosts: int, *, rate_mbit: float | None = None, prefix: str | None = None
    ) -> None:
        if not 1 <= n_hosts <= _MAX_HOSTS:
            raise ValueError(f"n_hosts must be in 1..{_MAX_HOSTS}, got {n_hosts}")
        self._prefix = DEFAULT_PREFIX if prefix is None else prefix
        if not re.fullmatch(r"[a-z][a-z0-9_.-]*-", self._prefix) or len(self._prefix) > 16:
            raise ValueError(
                f"prefix must look like 'st-' (lowercase, ends in '-'), got {prefix!r}"
            )
        self.hosts: list[Host] = []
        self.closed = False
        self._namespaces: list[str] = []  # created so far, in creation order
        self._close_lock = threading.RLock()
        cleanup_stale(self._prefix)
        self._lock_fd: int | None
        self._lock_fd, k = _claim_subnet()
        self.subnet = f"{_SUBNET_PREFIX}.{k}.0/24"
        self.run_id = f"{os.getpid()}-{k:02x}"
        self.switch_netns = self._netns_name("sw")
        #: an address on the LAN's subnet that no host holds (:meth:`Host.block` routes to it)
        self.nowhere = f"{_SUBNET_PREFIX}.{k}.254"
        _register(self)
        try:
            self._build(n_hosts, k)
            if rate_mbit is not None:
                for host in self.hosts:
                    host.set_rate(rate_mbit)
        except BaseException as exc:
            try:
                self.close()
            except LanError as cleanup_exc:
                exc.add_note(f"cleaning up the half-built LAN failed too: {cleanup_exc}")
            raise

    def _netns_name(self, role: str) -> str:
        return f"{self._prefix}{self.run_id}-{role}"

    def _add_netns(self, name: str) -> None:
        _cmd("ip", "netns", "add", name)
        self._namespaces.append(name)

    def _build(self, n_hosts: int, k: int) -> None:
        sw = self.switch_netns
        self._add_netns(sw)
        _cmd("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _cmd("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(n_hosts):
            host = Host(self, f"h{i}", self._netns_name(f"h{i}"), f"{_SUBNET_PREFIX}.{k}.{i + 1}")
            self._add_netns(host.netns)
            ns, port = host.netns, host._port
            _cmd(*f"ip -n {sw} link add {port} type veth peer name {_HOST_IF} netns {ns}".split())
            _cmd("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            _cmd("ip", "-n", ns, "link", "set", "lo", "up")
            _cmd("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", _HOST_IF)
            _cmd("ip", "-n", ns, "link", "set", _HOST_IF, "up")
            # Multicast (mDNS discovery) needs a route; it can only go onto this LAN.
            _cmd("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", _HOST_IF)
            self.hosts.append(host)

    def split(self, *groups: list[int]) -> None:
        """Partition the LAN: hosts (by index) in different groups cannot reach each other
        (unicast is dropped in the switch, both ways: :meth:`Host.block`). :meth:`heal` ends it."""
        for g in groups:
            others = [self.hosts[i] for h in groups if h is not g for i in h]
            for i in g:
                self.hosts[i].block(others)

    def heal(self) -> None:
        """End every :meth:`split`."""
        for h in self.hosts:
            h.unblock()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process started in a host, delete the namespaces, free the subnet.

        Idempotent; safe to call again after a partial failure (it resumes where it stopped).

        Raises:
            LanError: something could not be removed (every step is still attempted).
        """
        with self._close_lock:
            self.closed = True
            for host in self.hosts:
                _stop_processes(host._procs)
                host._procs.clear()
            errors = []  # what still runs inside a namespace is killed on its deletion
            while self._namespaces:
                name = self._namespaces.pop()
                try:
                    _delete_netns(name)
                except LanError as exc:
                    errors.append(str(exc))
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            _live_lans.discard(self)
            if errors:
                raise LanError("cleanup incomplete: " + "; ".join(errors))


# Belt and braces: close live LANs at interpreter exit and on SIGTERM.
_live_lans: set[SimulatedLAN] = set()
_atexit_installed = False
_sigterm_installed = False
_previous_sigterm: Any = None


def _close_all() -> None:
    for lan in list(_live_lans):
        try:
            lan.close()
        except LanError:
            pass  # at exit or on SIGTERM there is no one left to report to; cleanup_stale will


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _close_all()
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
    elif _previous_sigterm != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _register(lan: SimulatedLAN) -> None:
    global _atexit_installed, _sigterm_installed, _previous_sigterm
    _live_lans.add(lan)
    if not _atexit_installed:
        atexit.register(_close_all)
        _atexit_installed = True
    # signal.signal only works in the main thread; a LAN built elsewhere relies on atexit.
    if not _sigterm_installed and threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True
