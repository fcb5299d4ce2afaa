"""Every refusal is counted where an operator looks (issue 17, must-have 5): connection-level
refusals by reason in ``ctl status`` and on ``/metrics`` of a coordinator and a stage, the
counter's bounds, and room for ``ctl`` on a server whose every general slot is held."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading

import pytest

from swarmtrain.app.ops import serve_coordinator, serve_stage
from swarmtrain.app.ops.serve import STATUS_MAX_AGE
from swarmtrain.transport import connect
from swarmtrain.transport.refusals import MAX_REASONS, OTHER, RefusalCounter, merge_refusals
from swarmtrain.wire import Error, Hello, StageSync, Status, StatusRequest, Welcome
from tests.test_limits import _first_error, _from, _wrong_secret_from
from tests.test_metrics import aget, parse, value
from tests.test_pipeline_core import FAST
from tests.test_pipeline_core import SECRET as STAGE_SECRET
from tests.test_pipeline_core import _server as stage_server
from tests.test_ps_inprocess import SECRET, coordinator
from tests.test_transport import eventually, run

pytestmark = pytest.mark.timeout(120)


def test_the_counter_keeps_a_bounded_set_of_well_formed_reasons() -> None:
    c = RefusalCounter()
    c.count("auth_failed")
    c.count("auth_failed", 2)
    for bad in ("Auth Failed", "x" * 100, "", "a-b", "\x00"):
        c.count(bad)
    assert c["auth_failed"] == 3 and c[OTHER] == 5 and c["never"] == 0
    for i in range(200):  # more distinct reasons than the counter keeps
        c.count(f"reason_{i}")
    snap = c.snapshot()
    assert len(snap) == MAX_REASONS and c.total() == 3 + 5 + 200
    assert snap[OTHER] == 5 + 200 - (MAX_REASONS - 2)  # all but the first kept fold into other
    threads = [threading.Thread(target=lambda: [c.count("auth_failed") for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert c["auth_failed"] == 4003
    assert merge_refusals([c, {"auth_failed": 1, "tls": 2}])["auth_failed"] == 4004


def test_a_coordinator_counts_each_refusal_by_reason_in_ctl_status_and_on_metrics() -> None:
    async def scenario() -> None:
        coord = coordinator(**{"network.max_connections": 4, "network.max_connections_per_address": 2,
                               "network.max_failed_auth": 2, "network.ctl_slots": 1,
                               "network.handshake_timeout_sec": 30.0})
        await coord.start()
        http = await serve_coordinator(coord, "127.0.0.1", 0)
        held = []
        try:
            port = coord.port
            for _ in range(2):  # a wrong secret, twice: then that address is locked out
                answer = await _wrong_secret_from("127.0.0.2", port)
                assert isinstance(answer, Error) and answer.code == "auth_failed"
            assert (await _first_error(await _from("127.0.0.2", port))).code == "auth_rate_limited"
            junk = await _from("127.0.0.3", port)  # HTTP on the framed port: a bad preamble
            junk.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _first_error(junk)).code == "bad_magic"
            short = await _from("127.0.0.3", port)  # a 31-byte nonce
            short.send(Hello(role="worker", nonce=b"n" * 31))
            assert (await _first_error(short)).code == "bad_handshake"
            for source in ("127.0.0.4", "127.0.0.4", "127.0.0.5", "127.0.0.5"):  # every general slot
                held.append(await _from(source, port))
            assert coord._server is not None
            server = coord._server
            await eventually(lambda: server.admission.open_connections() == 4, what="four slots held")
            over = await _from("127.0.0.4", port)  # past its address's cap: no reserve for it
            assert (await _first_error(over)).code == "too_many_connections"
            # a worker may start its handshake in the ctl reserve, and is refused once it says who it is
            worker = await _from("127.0.0.6", port)
            refused = await worker.client_handshake(SECRET)
            if not (isinstance(refused, Error) and refused.code == "too_many_connections"):
                refused = await _first_error(worker)
            assert refused.code == "too_many_connections" and "kept for ctl" in refused.message
            await eventually(lambda: server.admission.open_connections() == 4, what="the reserve freed")
            conn = await connect("127.0.0.1", port, secret=SECRET, role="ctl", timeouts=FAST)
            await conn.send(StatusRequest())
            reply = await conn.recv(timeout=10)
            await conn.close()
            assert isinstance(reply, Status), reply
            refusals = reply.status["refusals"]
            want = {"auth_failed": 2, "auth_rate_limited": 1, "bad_magic": 1, "bad_handshake": 1,
                    "too_many_connections": 2}
            assert {k: refusals.get(k) for k in want} == want, refusals
            coord.refusals.count("out_of_range")  # what a role counts itself joins the same table
            scrape = parse((await aget(http.port, "/metrics"))[2])
            for reason, n in {**want, "out_of_range": 1}.items():
                assert value(scrape, "swarmtrain_refusals_total", reason=reason) == n, reason
            status = json.loads((await aget(http.port, "/api/status"))[2])
            assert status["refusals"]["out_of_range"] == 1
            await asyncio.sleep(STATUS_MAX_AGE)  # a new snapshot: the HTTP port's own answers
            scrape = parse((await aget(http.port, "/metrics"))[2])
            assert value(scrape, "swarmtrain_http_responses_total", code="200") >= 2
        finally:
            for peer in held:
                peer.close()
            await http.close()
            await coord.close()

    run(scenario(), timeout=90)


def test_an_authenticated_ctl_over_its_frame_limit_is_closed_and_counted() -> None:
    async def scenario() -> None:
        coord = coordinator()
        await coord.start()
        try:
            conn = await connect("127.0.0.1", coord.port, secret=SECRET, role="ctl", timeouts=FAST)
            await conn.send(Welcome(session="x" * 100_000, proof=b""))  # a 100 KiB header
            answer = await conn.recv(timeout=10)
            assert isinstance(answer, Error) and answer.code == "oversize_header", answer
            assert str(1 << 16) in answer.message  # a ctl's header limit: 64 KiB
            await conn.close()
            await eventually(lambda: coord.status()["refusals"].get("oversize_header") == 1,
                             what="the malformed frame counted")
        finally:
            await coord.close()

    run(scenario(), timeout=90)


def test_a_stage_counts_refused_handshakes_and_requests_by_reason() -> None:
    async def scenario() -> None:
        stage = stage_server(0, 2, 0)
        await stage.start()
        http = await serve_stage(stage, "127.0.0.1", 0)
        try:
            answer = await _wrong_secret_from("127.0.0.2", stage.port)
            assert isinstance(answer, Error) and answer.code == "auth_failed"
            conn = await connect("127.0.0.1", stage.port, secret=STAGE_SECRET, role="pipeline", timeouts=FAST)
            await conn.send(StageSync(req=1, round=0, step=0))  # replica sync is for role stage
            reply = await conn.recv(timeout=10)
            assert getattr(reply, "code", None) == "unexpected", reply
            await conn.close()
            await eventually(lambda: stage.status()["refusals"].get("auth_failed") == 1, what="counted")
            assert stage.status()["refusals"]["unexpected"] == 1
            scrape = parse((await aget(http.port, "/metrics"))[2])
            assert value(scrape, "swarmtrain_refusals_total", reason="auth_failed") == 1
            assert value(scrape, "swarmtrain_refusals_total", reason="unexpected") == 1
        finally:
            await http.close()
            await stage.close()

    run(scenario(), timeout=90)


def test_eight_addresses_hold_every_slot_and_swarmtrain_ctl_status_still_answers(tmp_path) -> None:
    """256 idle connections, 32 from each of 127.0.0.2..9, fill the default caps; the CLI still
    gets its status through the ctl reserve, and a worker does not."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)

    async def scenario() -> None:
        coord = coordinator(**{"network.handshake_timeout_sec": 60.0})
        await coord.start()
        socks: list[socket.socket] = []
        try:
            port = coord.port
            assert coord._server is not None
            limits = coord._server.limits
            assert (limits.max_connections, limits.max_per_address) == (256, 32)
            loop = asyncio.get_running_loop()
            for i in range(2, 10):
                for _ in range(32):
                    s = socket.socket()
                    s.setblocking(False)
                    s.bind((f"127.0.0.{i}", 0))
                    socks.append(s)
                    await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 10)
            server = coord._server
            await eventually(lambda: server.admission.open_connections() == 256, timeout=30,
                             what="every general slot held")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "swarmtrain", "ctl", "status", "--host", "127.0.0.1",
                "--port", str(port), "--secret-file", str(secret_file), "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "SWARMTRAIN_SECRET": ""})
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            status = json.loads(out)["status"]
            assert status["version"] == 0 and "refusals" in status
            worker = await _from("127.0.0.1", port)
            refused = await worker.client_handshake(SECRET)
            if not isinstance(refused, Error):
                refused = await _first_error(worker)
            assert refused.code == "too_many_connections"
            assert server.refused["too_many_connections"] >= 1
        finally:
            for s in socks:
                s.close()
            await coord.close()

    run(scenario(), timeout=90)
