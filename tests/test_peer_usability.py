"""Peer mode's rough edges (issue #16): the CLI offers only flags peer mode uses, peers sharing
a machine share its cores, a shared identity is named, a link going down logs one line, and
every rank ends with a useful line."""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import json
import logging
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from swarmtrain.app import cli
from swarmtrain.app.session import CoreShare, _env_threads, _raise_identity_conflict, peer_summary
from swarmtrain.config import load_peer_config
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.roles.peer import discovery as disc
from swarmtrain.roles.peer.discovery import SERVICE_TYPE, MdnsDiscovery, PeerInfo, peers_on_this_host
from swarmtrain.roles.peer.membership import View
from swarmtrain.testing import Host, SimulatedLAN
from swarmtrain.transport import mdns
from swarmtrain.transport.identity import Identity
from swarmtrain.wire.frame import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(30)


def make_peer(host: str = "10.0.0.2", port: int = 7200, ring_port: int = 7201) -> PeerInfo:
    ident = Identity.generate()
    return PeerInfo(ident.peer_id, host, port, ring_port, "r1", PROTOCOL_VERSION, "laptop", ident.public_key)


# --- 1. the peer parser offers only what peer mode uses ----------------------------------------


def _peer_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["peer"]


def test_every_peer_flag_sets_a_peer_config_key_or_is_used_by_cmd_peer() -> None:
    used_by_cmd_peer = {"help", "config", "log_json", "status_file"}
    dests = {a.dest for a in _peer_parser()._actions}
    flag_keys = cli.config_flag_keys(_peer_parser())
    assert dests - used_by_cmd_peer - set(flag_keys) == set()
    cfg = load_peer_config(None)
    for dotted in flag_keys.values():  # and each names a real key of the peer config
        section, _, key = dotted.partition(".")
        assert hasattr(getattr(cfg, section), key), dotted


def test_peer_refuses_compression_flags_as_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in (["--compression", "fp16"], ["--topk-ratio", "0.1"]):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(["peer", *flag])
        assert exc.value.code == 2
        assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
    assert "--compression" not in _peer_parser().format_help()
    assert "--wire" in _peer_parser().format_help()


def test_a_peer_config_refuses_the_shard_key_peer_mode_ignores(tmp_path: Path) -> None:
    path = tmp_path / "peer.toml"
    path.write_text("[data]\nshard_index = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'data.shard_index'"):
        load_peer_config(path)


# --- 3. peers on one machine share its cores --------------------------------------------------


def test_peers_on_this_host_are_those_at_a_local_or_loopback_address() -> None:
    local = [ipaddress.IPv4Interface("10.0.0.1/24"), ipaddress.IPv4Interface("127.0.0.1/8")]
    here, loop, named, there = (make_peer("10.0.0.1"), make_peer("127.0.0.2"), make_peer("localhost"),
                                make_peer("10.0.0.9"))
    far_name = make_peer("pi.local")
    assert peers_on_this_host([here, loop, named, there, far_name], local) == [here, loop, named]


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_automatic_threads_are_shared_out_among_the_peers_of_this_machine(torch_threads: None) -> None:
    torch.set_num_threads(4)
    share = CoreShare(cores=4, threads=4, auto=True)
    share.seen(3)
    assert torch.get_num_threads() == 4  # only the training thread changes it, in apply()
    share.apply()
    assert share.threads == torch.get_num_threads() == 1
    share.seen(2)
    share.apply()
    assert torch.get_num_threads() == 2
    share.seen(9)  # more peers than cores: one thread each, never zero
    share.apply()
    assert torch.get_num_threads() == 1


def test_chosen_threads_that_oversubscribe_warn_once_naming_the_fix(
    caplog: pytest.LogCaptureFixture, torch_threads: None
) -> None:
    caplog.set_level(logging.WARNING, logger="swarmtrain")
    share = CoreShare(cores=2, threads=2, auto=False)
    share.seen(1)
    assert not caplog.records  # alone: 2 threads on 2 cores is fine
    share.seen(4)
    share.seen(4)
    share.apply()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "4 swarmtrain peers" in record.getMessage() and "--threads 1" in record.getMessage()
    assert share.threads == 2  # a chosen count is never changed
    single = CoreShare(cores=2, threads=1, auto=False)
    single.seen(4)  # one thread each does not spin: nothing to say
    assert len(caplog.records) == 1


@pytest.mark.parametrize(("value", "threads"), [("2", 2), (" 3 ", 3), ("0", 0), ("x", 0), ("", 0)])
def test_omp_num_threads_counts_as_a_chosen_thread_count(value: str, threads: int) -> None:
    assert _env_threads({"OMP_NUM_THREADS": value}) == threads


# --- 4. two processes with one identity --------------------------------------------------------


class FakeServiceInfo:
    def __init__(self, peer: PeerInfo, addresses: list[str]) -> None:
        self.properties = {k.encode(): v.encode() for k, v in disc.encode_txt(peer).items()}
        self._addresses = addresses

    def parsed_addresses(self, version: Any = None) -> list[str]:
        return self._addresses


def test_a_record_of_our_own_id_with_other_ports_names_the_shared_identity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        me = make_peer("10.0.0.1")
        records: dict[str, FakeServiceInfo] = {}

        async def lookup(name: str) -> Any:
            return records.get(name)

        d = MdnsDiscovery()
        d._me, d._local, d._started = me, [ipaddress.IPv4Interface("10.0.0.1/24")], True
        d._lookup = lookup  # type: ignore[method-assign]

        async def resolve_own() -> None:
            d._on_change(None, SERVICE_TYPE, f"{me.peer_id}.{SERVICE_TYPE}", disc.ServiceStateChange.Added)  # type: ignore[arg-type]
            await asyncio.gather(*d._resolving.values())

        records[f"{me.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(me, ["10.0.0.1"])
        await resolve_own()  # our own records: nothing wrong
        assert d.conflict is None and d.peers() == {}
        records[f"{me.peer_id}.{SERVICE_TYPE}"] = FakeServiceInfo(replace(me, port=7300, ring_port=40001),
                                                                  ["10.0.0.1"])
        waiter = asyncio.create_task(d.wait_for_peers(1, timeout=20))
        await asyncio.sleep(0)
        await resolve_own()
        with pytest.raises(SwarmError) as exc:
            await asyncio.wait_for(waiter, 10)  # at once, not after the discovery timeout
        assert not isinstance(exc.value, TimeoutError)
        for text in (str(exc.value), d.conflict or ""):
            assert f"{me.peer_id} (this peer's) at 10.0.0.1:7300" in text
            assert "two peers share one identity" in text and "SWARMTRAIN_HOME=DIR" in text
        await resolve_own()  # said once
        errors = [r for r in caplog.records if "share one identity" in r.getMessage()]
        assert [r.levelno for r in errors] == [logging.ERROR] and d.peers() == {}

    caplog.set_level(logging.ERROR, logger="swarmtrain.roles.peer.discovery")
    asyncio.run(main())


def test_run_peer_turns_the_discovery_timeout_into_the_shared_identity_error(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    backend = SimpleNamespace(discovery=SimpleNamespace(conflict="another peer already advertises ..."),
                              identity=SimpleNamespace(path=key))
    cause = TimeoutError("found 0 of 1")
    with pytest.raises(SwarmError, match=f"advertises .*; this peer's identity is {key}") as exc:
        _raise_identity_conflict(cast(Any, backend), cause)
    assert exc.value.__cause__ is cause
    _raise_identity_conflict(cast(Any, SimpleNamespace(discovery=SimpleNamespace(conflict=None))))


# An mDNS agent: starts discovery with the identity in argv[1] and ports argv[2], argv[3]
# (argv[4] "noprobe": register without probing, as when two probes miss each other), waits
# argv[5] s for one peer and prints one JSON line: what happened.
DUPLICATE_AGENT = r"""
import asyncio, json, sys
from pathlib import Path
from zeroconf.asyncio import AsyncZeroconf
from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.roles.peer.discovery import MdnsDiscovery, PeerInfo
from swarmtrain.transport.identity import Identity
from swarmtrain.wire.frame import PROTOCOL_VERSION

if sys.argv[4] == "noprobe":
    register = AsyncZeroconf.async_register_service
    async def unprobed(self, info, *args, **kwargs):
        kwargs["cooperating_responders"] = True
        return await register(self, info, *args, **kwargs)
    AsyncZeroconf.async_register_service = unprobed

async def main():
    ident = Identity.load_or_create(Path(sys.argv[1]))
    me = PeerInfo(ident.peer_id, "", int(sys.argv[2]), int(sys.argv[3]), "dup", PROTOCOL_VERSION,
                  "laptop", ident.public_key)
    d = MdnsDiscovery()
    try:
        await d.start(me)
    except SwarmError as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return
    print(json.dumps({"ready": ident.peer_id}), flush=True)
    try:
        await d.wait_for_peers(1, float(sys.argv[5]))
        print(json.dumps({"found": True}), flush=True)
    except SwarmTimeout as exc:
        print(json.dumps({"timeout": str(exc)}), flush=True)
    except SwarmError as exc:
        print(json.dumps({"conflict": str(exc)}), flush=True)
    await d.stop()

asyncio.run(main())
"""


def _json_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no answer within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"agent exited (rc={proc.poll()})"
    answer: dict[str, Any] = json.loads(line)
    return answer


MakeLan = Callable[..., SimulatedLAN]


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_a_duplicate_that_slipped_past_probing_is_named_on_one_machine(
    lan_factory: MakeLan, tmp_path: Path
) -> None:
    host: Host = lan_factory(1).hosts[0]

    def agent(port: int, probe: str, wait: float) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", DUPLICATE_AGENT, str(tmp_path), str(port), str(port + 1), probe,
                str(wait)]
        return host.run(argv, stdout=subprocess.PIPE)

    first = agent(7200, "probe", 30)
    peer_id = _json_line(first, 30)["ready"]
    second = agent(7300, "noprobe", 5)
    assert _json_line(second, 30) == {"ready": peer_id}
    answer = _json_line(first, 40)
    assert "conflict" in answer, answer  # not a "found 0 of 1" timeout
    assert f"{peer_id} (this peer's) at {host.address}:7300" in answer["conflict"]
    assert "SWARMTRAIN_HOME" in answer["conflict"]
    _json_line(second, 30)
    for proc in (first, second):
        assert proc.wait(timeout=20) == 0


# --- 5. a link going down logs one line --------------------------------------------------------


def _zeroconf_record(caplog: pytest.LogCaptureFixture, exc: BaseException) -> logging.LogRecord:
    caplog.clear()
    logging.getLogger("zeroconf").warning("Error with socket 7 (('10.0.0.2', 5353))): %s", exc, exc_info=exc)
    [record] = caplog.records
    return record


def test_zeroconf_network_errors_lose_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    mdns.quiet_zeroconf_network_errors()
    mdns.quiet_zeroconf_network_errors()  # idempotent
    assert logging.getLogger("zeroconf").filters.count(mdns._ZEROCONF_FILTER) == 1
    caplog.set_level(logging.DEBUG, logger="zeroconf")
    for code in (errno.ENETUNREACH, errno.EADDRNOTAVAIL):
        record = _zeroconf_record(caplog, OSError(code, "gone"))
        assert record.exc_info is None and record.levelno == logging.WARNING
        text = logging.Formatter().format(record)
        assert "Traceback" not in text and "\n" not in text
        assert "('10.0.0.2', 5353)" in text and "a network link is down" in text
    other = _zeroconf_record(caplog, ValueError("a bug"))  # anything else keeps its traceback
    assert other.exc_info is not None and "ValueError: a bug" in logging.Formatter().format(other)


# Runs mDNS discovery (TTL 2 s) in a host and prints what python-zeroconf logged, once it
# logged a network error or after argv[1] seconds; with a root handler, as the CLI has.
DOWN_AGENT = r"""
import asyncio, json, logging, sys, time
from swarmtrain.roles.peer.discovery import MdnsDiscovery, PeerInfo
from swarmtrain.transport.identity import Identity
from swarmtrain.wire.frame import PROTOCOL_VERSION

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(self.format(record))
keep = Keep()
logging.basicConfig(level=logging.WARNING, handlers=[keep], force=True)

async def main():
    ident = Identity.generate()
    d = MdnsDiscovery(host_ttl=2)
    me = PeerInfo(ident.peer_id, "", 7200, 7201, "down", PROTOCOL_VERSION, "laptop", ident.public_key)
    await d.start(me)
    await d.wait_for_peers(1, 30)
    print(json.dumps({"found": True}), flush=True)
    deadline = time.monotonic() + float(sys.argv[1])
    while not any("Errno" in line for line in lines) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    print(json.dumps({"logged": lines}), flush=True)
    await d.stop()

asyncio.run(main())
"""


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_a_link_going_down_logs_one_line_without_a_traceback(lan_factory: MakeLan) -> None:
    lan = lan_factory(2)
    agents = [h.run([sys.executable, "-c", DOWN_AGENT, "20"], stdout=subprocess.PIPE) for h in lan.hosts]
    for proc in agents:
        assert _json_line(proc, 40) == {"found": True}
    cut = lan.hosts[1]
    subprocess.run(["ip", "-n", cut.netns, "link", "set", "eth0", "down"], check=True, timeout=10)
    logged = _json_line(agents[1], 40)["logged"]
    errors = [line for line in logged if "Errno" in line]
    assert errors, f"no network error logged within 20 s of the link going down: {logged}"
    assert all("\n" not in line and "Traceback" not in line for line in logged), logged
    assert "a network link is down" in errors[0]
    for proc in agents:
        proc.kill()
        proc.wait(timeout=10)


# --- 6. every rank ends with a useful line -----------------------------------------------------


def _trainer(peer_ids: list[str], *, metrics: dict[str, float] | None = None, view: bool = True) -> Any:
    members = tuple(sorted(peer_ids))
    v = View(3, members, {m: ("10.0.0.1", 1) for m in members}, members[0]) if view else None
    backend = SimpleNamespace(view=v, epoch=3 if view else 0)
    strategy = SimpleNamespace(round=30, last_loss=0.25)
    return SimpleNamespace(backend=backend, strategy=strategy, samples=1234, metrics=metrics or {},
                           evaluate=lambda m: {})


def test_the_final_line_is_useful_on_every_rank() -> None:
    ids = sorted(Identity.generate().peer_id for _ in range(3))
    line = peer_summary(_trainer(ids), ids[2])
    assert line.startswith(f"peer {ids[2][:8]} done after 30 rounds (epoch 3, rank 2 of 3): ")
    assert "1234 samples" in line and "last loss 0.2500" in line
    assert f"held-out metrics are reported by rank 0 (peer {ids[0][:8]})" in line
    assert "{}" not in line
    line0 = peer_summary(_trainer(ids, metrics={"accuracy": 0.9, "loss": 0.3}), ids[0])
    assert "rank 0 of 3" in line0 and "held-out accuracy 0.9000, loss 0.3000" in line0
    assert "in no group" in peer_summary(_trainer(ids, view=False), ids[1])


def test_the_final_line_says_when_there_is_no_loss_yet() -> None:
    ids = sorted(Identity.generate().peer_id for _ in range(2))
    trainer = _trainer(ids)
    trainer.strategy.last_loss = float("nan")
    assert "no loss yet" in peer_summary(trainer, ids[1])
