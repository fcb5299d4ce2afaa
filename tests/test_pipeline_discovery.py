"""Pipeline stages found by mDNS (swarmtrain/roles/stage/discovery.py): the TXT record (round
trip, hostile records ignored), the route built from what was found (replicas grouped, a
missing stage or a mix of stage counts refused, saying what to run), real mDNS over loopback
(announce, refresh, goodbye; announcements that do not hold up to an authenticated status
are left out), and three `swarmtrain stage` processes on a simulated LAN found by a
`swarmtrain pipeline` given no --route."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from torch import nn

from swarmtrain.app.cli import build_parser
from swarmtrain.app.pipeline_session import PipelineOptions, StageOptions
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.roles.stage.discovery import (
    StageAnnouncement,
    StageAnnouncer,
    build_route,
    check_cluster_name,
    decode_txt,
    discover_route,
    discover_stages,
    encode_txt,
    format_route,
)
from swarmtrain.roles.stage.stage import StageServer, StageServerConfig
from swarmtrain.testing import SimulatedLAN
from swarmtrain.testing.fuzz_engine import dead_port
from swarmtrain.testing.pipeline import FAST_TIMEOUTS, run_bounded
from swarmtrain.testing.procs import LanProcesses, swarm_cmd

pytestmark = pytest.mark.timeout(60)

ANN = StageAnnouncement(cluster="lab-1", stage=1, stages=3, layers=(2, 4), shape="0123456789abcdef",
                        origin="fedcba9876543210", steps=12, host="", port=7301)
LOOPBACK = ["127.0.0.1"]


def _txt(ann: StageAnnouncement = ANN, **changes: str | None) -> dict[bytes, bytes | None]:
    """``ann``'s TXT record as the network delivers it, with ``changes`` (None: key removed)."""
    props: dict[str, str | None] = {**encode_txt(ann), **changes}
    return {k.encode(): v.encode() for k, v in props.items() if v is not None}


def _at(stage: int, host: str, port: int = 7300, stages: int = 3,
        cluster: str = "lab-1") -> StageAnnouncement:
    return replace(ANN, cluster=cluster, stage=stage, stages=stages, layers=(stage, stage + 1), host=host,
                   port=port)


# -- the TXT record ------------------------------------------------------------------------


def test_a_txt_record_round_trips_and_carries_no_secret() -> None:
    props = encode_txt(ANN)
    assert set(props) == {"txtvers", "cluster", "stage", "stages", "layers", "shape", "origin", "steps",
                          "port"}
    assert decode_txt(_txt(), "10.0.0.3") == replace(ANN, host="10.0.0.3")
    assert decode_txt(_txt(), "10.0.0.3").address == "10.0.0.3:7301"  # type: ignore[union-attr]


@pytest.mark.parametrize("changes", [
    {"stage": None}, {"stages": None}, {"layers": None}, {"cluster": None}, {"port": None}, {"shape": None},
    {"txtvers": None}, {"txtvers": "2"},
    {"stage": "-1"}, {"stage": "1e3"}, {"stage": " 1"}, {"stage": "\u0661"}, {"stage": ""},
    {"stage": "9" * 5000}, {"steps": "9" * 17}, {"steps": "99999999999999999"},
    {"stage": "3"}, {"stages": "0"}, {"stages": "100000"},
    {"layers": "4:2"}, {"layers": "2:2"}, {"layers": "x:y"}, {"layers": "1:2:3"}, {"layers": "7"},
    {"layers": "0:99999999"},
    {"port": "0"}, {"port": "70000"}, {"port": "7301 "},
    {"shape": "XYZ"}, {"shape": "a" * 65}, {"origin": "0x12"},
    {"cluster": ""}, {"cluster": "a b"}, {"cluster": "x" * 41}, {"cluster": "-lead"},
    {"cluster": "\u00e9t\u00e9"},
], ids=repr)
def test_hostile_txt_records_are_ignored_without_crashing(changes: dict[str, str | None]) -> None:
    assert decode_txt(_txt(**changes), "10.0.0.3") is None


def test_undecodable_bytes_keys_without_values_and_no_address_are_ignored() -> None:
    assert decode_txt({**_txt(), b"cluster": b"\xff\xfe"}, "10.0.0.3") is None
    assert decode_txt({**_txt(), b"stage": None}, "10.0.0.3") is None
    assert decode_txt(_txt(), "") is None
    assert decode_txt({**_txt(), b"extra": b"fine"}, "h") == replace(ANN, host="h")  # unknown keys: ignored


@settings(max_examples=300, deadline=None)
@given(hs.dictionaries(hs.sampled_from([k.encode() for k in encode_txt(ANN)]) | hs.binary(max_size=8),
                       hs.none() | hs.binary(max_size=80) | hs.text(max_size=30).map(str.encode),
                       max_size=12))
def test_random_txt_records_never_raise(props: dict[bytes, bytes | None]) -> None:
    ann = decode_txt({**_txt(), **props}, "10.0.0.9")
    assert ann is None or encode_txt(ann)  # what is accepted is well-formed


def test_what_cannot_be_announced_or_named_is_refused_locally() -> None:
    with pytest.raises(ConfigError, match="cannot announce stage 3"):
        encode_txt(replace(ANN, stage=3))
    assert check_cluster_name("lab_1.a-b") == "lab_1.a-b"
    for bad in ("", "a b", "x" * 41, ".x"):
        with pytest.raises(ConfigError, match="--cluster"):
            check_cluster_name(bad)
    with pytest.raises(ConfigError, match="--cluster"):
        PipelineOptions(cluster="a/b")
    with pytest.raises(ConfigError, match="--cluster"):
        StageOptions(stage=0, stages=2, cluster="a b")
    with pytest.raises(ConfigError, match="--discover-timeout"):
        PipelineOptions(discover_timeout=0)


def test_the_commands_take_no_route_a_cluster_and_a_discovery_timeout() -> None:
    parser = build_parser()
    pl = parser.parse_args(["pipeline"])
    assert (pl.route, pl.cluster, pl.discover_timeout) == ("", "swarmtrain", 10.0)
    ss = parser.parse_args(["status", "--cluster", "lab", "--discover-timeout", "2.5"])
    assert (ss.route, ss.cluster, ss.discover_timeout) == ("", "lab", 2.5)
    st = parser.parse_args(["stage", "--stage", "0", "--stages", "2"])
    assert (st.cluster, st.announce) == ("swarmtrain", True)
    assert parser.parse_args(["stage", "--stage", "0", "--stages", "2", "--no-announce"]).announce is False


# -- building the route --------------------------------------------------------------------


def test_the_route_groups_every_replica_of_each_stage_in_address_order() -> None:
    found = [_at(2, "10.0.0.5"), _at(1, "10.0.0.4"), _at(0, "10.0.0.2"), _at(1, "10.0.0.3"),
             _at(1, "10.0.0.3"),  # one stage seen twice (two browse answers)
             _at(1, "10.0.0.3", port=7400), _at(0, "10.0.0.9", cluster="other")]
    route = build_route(found, "lab-1")
    assert route == [[("10.0.0.2", 7300)], [("10.0.0.3", 7300), ("10.0.0.3", 7400), ("10.0.0.4", 7300)],
                     [("10.0.0.5", 7300)]]
    assert format_route(route) == "10.0.0.2:7300;10.0.0.3:7300,10.0.0.3:7400,10.0.0.4:7300;10.0.0.5:7300"


def test_a_missing_stage_is_named_with_what_was_found_where_and_what_to_run() -> None:
    found = [_at(0, "10.0.0.2"), _at(2, "10.0.0.5"), _at(2, "10.0.0.6")]
    with pytest.raises(SwarmError) as err:
        build_route(found, "lab-1", waited=10)
    said = str(err.value)
    assert "found 2 of the 3 stages of cluster 'lab-1' by mDNS within 10 s" in said, said
    assert "stage 0 at 10.0.0.2:7300; stage 2 at 10.0.0.5:7300, 10.0.0.6:7300" in said, said
    assert "no replica of stage 1" in said and "swarmtrain stage --stage 1 --stages 3 --cluster lab-1" in said
    with pytest.raises(SwarmError, match=r"no replica of stage 0, 2\. .*for each missing stage"):
        build_route([_at(1, "h")], "lab-1")
    with pytest.raises(SwarmError, match=r"no stage of cluster 'lab-1' announced itself.*--route"):
        build_route([_at(0, "h", cluster="lab-2")], "lab-1")


def test_stages_announcing_different_stage_counts_are_refused() -> None:
    found = [_at(0, "10.0.0.2"), _at(1, "10.0.0.3", stages=2), _at(2, "10.0.0.5")]
    with pytest.raises(SwarmError, match=r"disagree on the number of stages: 10\.0\.0\.3:7300 "
                       r"\(stage 1 of 2\), 10\.0\.0\.2:7300 \(stage 0 of 3\).*same --stages"):
        build_route(found, "lab-1")


# -- real mDNS over loopback ---------------------------------------------------------------


def _cluster() -> str:
    """A cluster of this test alone (tests run side by side on one loopback)."""
    return f"t-{uuid.uuid4().hex[:12]}"


def test_announced_stages_are_found_their_steps_refreshed_and_their_goodbye_heard() -> None:
    cluster = _cluster()

    async def main() -> None:
        announcers = [StageAnnouncer(interfaces=LOOPBACK, refresh_every=0) for _ in range(3)]
        try:
            await asyncio.gather(*(a.start(_at(i, "", port=7300 + i, cluster=cluster), "127.0.0.1")
                                   for i, a in enumerate(announcers)))
            found = await discover_stages(cluster, 10, interfaces=LOOPBACK, settle=0.5)
            assert sorted((a.stage, a.address) for a in found) == [
                (0, "127.0.0.1:7300"), (1, "127.0.0.1:7301"), (2, "127.0.0.1:7302")]
            announcers[1].update(40)
            found = await discover_stages(cluster, 10, interfaces=LOOPBACK, settle=0.5)
            assert {a.stage: a.steps for a in found}[1] == 40
            await announcers[2].stop()  # goodbye packets: a new browse does not find it
            # Two of three stages never complete the route, so this browse lasts its whole timeout.
            # The stages answered the last browse under a second ago, and mDNS holds a record's
            # next multicast a second (RFC 6762, section 14): 2 s left one slow CI run no margin.
            found = await discover_stages(cluster, 5, interfaces=LOOPBACK)
            assert sorted(a.stage for a in found) == [0, 1]
        finally:
            for a in announcers:
                await a.stop()

    run_bounded(main(), 40)


def test_found_stages_are_used_only_once_their_authenticated_status_agrees(
        caplog: pytest.LogCaptureFixture) -> None:
    """A real stage 0 and stage 1 over loopback, plus two announcements that do not hold up:
    a "stage 1" at stage 0's port and a "stage 1" where nothing listens. The route keeps the
    two real ones; a wrong secret finds no stage it may use."""
    cluster, secret = _cluster(), b"discovery-test-secret"

    async def main() -> None:
        servers = [StageServer(nn.Sequential(nn.Linear(4, 4)), stage=i, layer_range=(i, i + 1), loss_fn=None,
                               config=StageServerConfig(timeouts=FAST_TIMEOUTS), secret=secret, name=f"d{i}")
                   for i in range(2)]
        announcers: list[StageAnnouncer] = []
        try:
            for s in servers:
                await s.start()
            says = [_at(0, "", port=servers[0].port, stages=2, cluster=cluster),
                    _at(1, "", port=servers[1].port, stages=2, cluster=cluster),
                    _at(1, "", port=servers[0].port, stages=2, cluster=cluster),
                    _at(1, "", port=dead_port(), stages=2, cluster=cluster)]
            announcers.extend(StageAnnouncer(interfaces=LOOPBACK) for _ in says)
            await asyncio.gather(*(a.start(ann, "127.0.0.1") for a, ann in zip(announcers, says)))
            with caplog.at_level(logging.INFO, logger="swarmtrain.roles.stage"):
                route = await discover_route(cluster, 10, secret=secret, interfaces=LOOPBACK)
            assert route == [[("127.0.0.1", servers[0].port)], [("127.0.0.1", servers[1].port)]]
            logged = caplog.text
            assert f"--route \"{format_route(route)}\"" in logged, logged
            assert f"127.0.0.1:{servers[0].port} announced stage 1" in logged and "says stage 0" in logged
            assert "did not answer an authenticated status request" in logged, logged
            with pytest.raises(SwarmError, match="no replica of stage 0 .*answered an authenticated status"):
                await discover_route(cluster, 10, secret=b"another-secret", interfaces=LOOPBACK)
        finally:
            for a in announcers:
                await a.stop()
            for s in servers:
                await s.close()

    run_bounded(main(), 50)


# -- the commands on a simulated LAN -------------------------------------------------------

MODEL = ("--task", "textlm", "--context", "16", "--d-model", "16", "--n-heads", "2", "--n-layers", "2")
ENV = {"SWARMTRAIN_SECRET": "pipeline-discovery-secret"}
LAN_CLUSTER = "lan-found"


@pytest.fixture
def procs(lan_factory: Callable[..., SimulatedLAN], tmp_path: Path) -> Iterator[LanProcesses]:
    ps = LanProcesses(lan_factory(4), tmp_path, ENV)
    yield ps
    ps.stop_all()


@pytest.mark.netns
@pytest.mark.timeout(180)  # 25 s on the clean-clone CI, 42 s on a machine at half its speed
def test_a_trainer_without_route_finds_three_stages_on_the_lan_and_trains(procs: LanProcesses) -> None:
    hosts = procs.lan.hosts
    for i in range(3):  # stage 1 listens on every address (0.0.0.0), the others on one
        host = "0.0.0.0" if i == 1 else hosts[i].address
        procs.start(f"s{i}", i, "stage", *MODEL, "--stage", str(i), "--stages", "3", "--seed", "2",
                    "--host", host, "--port", "0", "--threads", "1", "--checkpoint-dir", "none",
                    "--cluster", LAN_CLUSTER)
    ports = [procs.wait(f"s{i}", lambda s: bool(s.get("running")), 60, f"stage {i} to listen")["port"]
             for i in range(3)]
    route = ";".join(f"{hosts[i].address}:{ports[i]}" for i in range(3))

    trainer = procs.start("trainer", 3, "pipeline", *MODEL, "--cluster", LAN_CLUSTER, "--microbatches", "8",
                          "--batch-size", "4", "--chunks", "4", "--eval-every", "0", "--eval-samples", "8",
                          "--run-log", "none")
    try:
        rc = trainer.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the trainer did not finish in 120 s\n{procs.logs()}") from None
    said = " ".join((procs.tmp / "trainer.log").read_text().split())
    assert rc == 0, f"trainer exited {rc}\n{procs.logs()}"
    assert f"found the stages of cluster '{LAN_CLUSTER}' by mDNS: --route \"{route}\"" in said, said
    st = procs.status("trainer")
    assert st is not None and st["state"] == "finished" and st["done"] == 8, st

    # `status` finds them too; with stage 2 gone (its goodbye heard), the trainer says what is missing
    status = hosts[3].run(swarm_cmd("status", "--cluster", LAN_CLUSTER, "--json", "--discover-timeout", "5"),
                          env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = (b.decode() for b in status.communicate(timeout=30))
    assert status.returncode == 0, stderr
    assert re.search(r'"route_stage": 2', stdout) and f"{hosts[2].address}:{ports[2]}" in stdout, stdout
    procs.procs["s2"].terminate()
    procs.procs["s2"].wait(timeout=30)
    missing = procs.start("missing", 3, "pipeline", *MODEL, "--cluster", LAN_CLUSTER, "--microbatches", "4",
                          "--discover-timeout", "3", "--run-log", "none")
    assert missing.wait(timeout=30) == 2
    said = " ".join((procs.tmp / "missing.log").read_text().split())
    assert (f"stage 0 at {hosts[0].address}:{ports[0]}; stage 1 at {hosts[1].address}:{ports[1]}; "
            "no replica of stage 2") in said, said
    assert f"swarmtrain stage --stage 2 --stages 3 --cluster {LAN_CLUSTER}" in said, said
