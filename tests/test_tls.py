"""Optional mutual TLS: `swarmtrain keys`, the transport over TLS, refusals of wrong
certificates and of TLS/plain mix-ups, and a coordinator and worker training with TLS on.

Everything runs over real loopback TCP on port 0, with certificates made by the code under
test in a temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from swarmtrain.app.cli import main as cli_main
from swarmtrain.config import SecurityConfig, load_worker_config, resolve_tls
from swarmtrain.errors import AuthError, ConfigError, ConnectionLost, SwarmError
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.ctl import ctl_request
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.tasks import DigitsTask
from swarmtrain.transport import Connection, Server, Timeouts, connect, start_server
from swarmtrain.transport.tls import ClusterKeys, TLSConfig, ca_fingerprint, generate_cluster_keys
from swarmtrain.wire import Heartbeat, Status, StatusRequest

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
SECRET = b"tls-test-secret"
SLOW = Timeouts(connect=10, handshake=10, heartbeat_interval=0.5, heartbeat_timeout=20, send=20)


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
    """Run one scenario on a fresh event loop, under an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ClusterKeys:
    """The keys of the cluster under test: a CA, a coordinator and two workers."""
    return generate_cluster_keys(tmp_path_factory.mktemp("keys"), ["coordinator", "worker1", "worker2"])


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> ClusterKeys:
    """Keys of another cluster: another CA, so none of its certificates are ours."""
    return generate_cluster_keys(tmp_path_factory.mktemp("other"), ["coordinator", "worker1"])


def node(keys: ClusterKeys, name: str, ca: Path | None = None) -> TLSConfig:
    cert, key = keys.nodes[name]
    return TLSConfig(cert=cert, key=key, ca=ca or keys.ca)


@contextlib.asynccontextmanager
async def serving(handler: Callable[[Connection, str], Awaitable[None]],
                  tls: TLSConfig | None, secret: bytes | None = SECRET) -> AsyncIterator[Server]:
    srv = await start_server(HOST, 0, handler, secret=secret, timeouts=SLOW, tls=tls)
    try:
        yield srv
    finally:
        await asyncio.wait_for(srv.close(), 15)


async def echo(conn: Connection, role: str) -> None:
    with contextlib.suppress(SwarmError):
        while True:
            await conn.send(await conn.recv(timeout=20))


async def round_trip(port: int, tls: TLSConfig | None, secret: bytes | None = SECRET) -> Connection:
    """Connect, send one message and check it comes back; returns the open connection."""
    conn = await connect(HOST, port, secret=secret, role="worker", timeouts=SLOW, tls=tls)
    await conn.send(StatusRequest())
    assert isinstance(await conn.recv(timeout=10), StatusRequest)
    return conn


# --- swarmtrain keys ------------------------------------------------------------------------


def test_keys_are_private_files_signed_by_the_cluster_ca(cluster: ClusterKeys, stranger: ClusterKeys) -> None:
    ca = x509.load_pem_x509_certificate(cluster.ca.read_bytes())
    assert stat.S_IMODE(cluster.ca_key.stat().st_mode) == 0o600
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert set(cluster.nodes) == {"coordinator", "worker1", "worker2"}
    for name, (cert_path, key_path) in cluster.nodes.items():
        assert cert_path == cluster.ca.parent / f"{name}.pem"
        assert key_path == cluster.ca.parent / f"{name}-key.pem"
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
        assert cert.subject.rfc4514_string() == f"CN={name}"
        years = (cert.not_valid_after_utc - cert.not_valid_before_utc).days / 365
        assert 9.9 < years < 10.1
    other = x509.load_pem_x509_certificate(stranger.nodes["worker1"][0].read_bytes())
    with pytest.raises(InvalidSignature):
        other.verify_directly_issued_by(ca)
    der = ssl.PEM_cert_to_DER_cert(cluster.ca.read_text())
    assert cluster.fingerprint == ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert ca_fingerprint(cluster.ca) == cluster.fingerprint != stranger.fingerprint


def test_keys_never_overwrite_and_check_names(cluster: ClusterKeys, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_cluster_keys(cluster.ca.parent, ["worker1"])
    for bad in (["a b"], ["x", "x"], ["ca"], []):
        with pytest.raises(ConfigError):
            generate_cluster_keys(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()


def test_keys_command_prints_fingerprint_and_config(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["keys", "--out", str(tmp_path / "k"), "--names", "coordinator,gpu-box"]) == 0
    out = capsys.readouterr().out
    assert ca_fingerprint(tmp_path / "k" / "ca.pem") in out
    assert 'tls_cert = "gpu-box.pem"' in out and 'tls_ca = "ca.pem"' in out
    assert (tmp_path / "k" / "gpu-box-key.pem").exists()
    assert cli_main(["keys", "--out", str(tmp_path / "k"), "--names", "coordinator"]) == 2  # exists


# --- config ---------------------------------------------------------------------------------


def test_config_needs_all_three_tls_keys_and_existing_files(cluster: ClusterKeys, tmp_path: Path) -> None:
    assert resolve_tls(SecurityConfig()) is None
    with pytest.raises(ConfigError, match=r"security\.tls_cert set but security\.tls_key, security\.tls_ca"):
        load_worker_config(overrides={"security.tls_cert": "a.pem"})
    cert, key = cluster.nodes["worker1"]
    cfg = load_worker_config(overrides={"security.tls_cert": str(cert), "security.tls_key": str(key),
                                        "security.tls_ca": str(cluster.ca)})
    assert resolve_tls(cfg.security) == TLSConfig(cert=cert, key=key, ca=cluster.ca)
    missing = SecurityConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match=r"security\.tls_ca: .*nope\.pem.* not a file.*swarmtrain keys"):
        resolve_tls(missing)
    # a certificate with another node's key is caught when the context is built
    mixed = TLSConfig(cert=cert, key=cluster.nodes["worker2"][1], ca=cluster.ca)
    with pytest.raises(ConfigError, match="tls_key"):
        mixed.client_context()


# --- the transport over TLS -----------------------------------------------------------------


def test_tls_connection_carries_messages_and_still_checks_the_secret(cluster: ClusterKeys) -> None:
    seen: list[str] = []

    async def who(conn: Connection, role: str) -> None:
        cert = conn.transport.get_extra_info("peercert") or {}
        seen.append(dict(x[0] for x in cert.get("subject", ()))["commonName"])
        await echo(conn, role)

    async def main() -> None:
        async with serving(who, node(cluster, "coordinator")) as srv:
            conn = await round_trip(srv.port, node(cluster, "worker1"))
            ssl_object = conn.transport.get_extra_info("ssl_object")
            assert ssl_object is not None and ssl_object.version() in ("TLSv1.2", "TLSv1.3")
            await conn.send(Heartbeat(time=1.0, step=3))
            await conn.close()
            # good certificates alone are not enough: the cluster secret is still checked
            with pytest.raises(AuthError, match="different cluster secret"):
                await connect(HOST, srv.port, secret=b"another secret", role="worker", timeouts=SLOW,
                              tls=node(cluster, "worker2"))
            assert srv.failed_handshakes == 1

    run(main())
    assert seen == ["worker1"]


def test_client_certificate_from_another_ca_is_refused_and_server_serves_on(
        cluster: ClusterKeys, stranger: ClusterKeys) -> None:
    async def main() -> None:
        async with serving(echo, node(cluster, "coordinator")) as srv:
            # the stranger trusts our CA (so it accepts our server) but its own certificate is
            # signed by its CA: the server must refuse it
            with pytest.raises(AuthError, match="does not accept this node's certificate") as info:
                await round_trip(srv.port, node(stranger, "worker1", ca=cluster.ca))
            assert "swarmtrain keys" in str(info.value)
            # a stranger that also trusts only its own CA refuses our server's certificate
            with pytest.raises(AuthError, match="certificate this node does not trust") as info:
                await round_trip(srv.port, node(stranger, "worker1"))
            assert str(stranger.ca) in str(info.value)
            # no certificate at all is refused too (a server-side requirement)
            bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
            _, writer = await asyncio.wait_for(asyncio.open_connection(HOST, srv.port, ssl=bare), 10)
            writer.close()
            with contextlib.suppress(OSError):
                await asyncio.wait_for(writer.wait_closed(), 10)

            async def refused(n: int) -> bool:
                while srv.failed_handshakes < n:
                    await asyncio.sleep(0.02)
                return True

            assert await asyncio.wait_for(refused(3), 10)
            conn = await round_trip(srv.port, node(cluster, "worker1"))  # still serving
            await conn.close()
            assert srv.failed_handshakes == 3

    run(main())


def test_plain_client_to_tls_server_is_refused_clearly(cluster: ClusterKeys,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with serving(echo, node(cluster, "coordinator")) as srv:
            with pytest.raises(ConnectionLost, match="has TLS on, this node needs it too"):
                await round_trip(srv.port, None)
            while srv.failed_handshakes < 1:
                await asyncio.sleep(0.02)
            conn = await round_trip(srv.port, node(cluster, "worker2"))
            await conn.close()

    with caplog.at_level("WARNING", logger="swarmtrain.transport"):
        run(main())
    assert any("does not speak TLS" in r.getMessage() for r in caplog.records), caplog.text


def test_tls_client_to_plain_server_is_refused_clearly(cluster: ClusterKeys,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with serving(echo, None) as srv:
            with pytest.raises(ConnectionLost, match="does not speak TLS.*TLS is on here but off there"):
                await round_trip(srv.port, node(cluster, "worker1"))
            while srv.failed_handshakes < 1:
                await asyncio.sleep(0.02)
            conn = await round_trip(srv.port, None)
            await conn.close()

    with caplog.at_level("WARNING", logger="swarmtrain.transport"):
        run(main())
    assert any("the peer speaks TLS but this node has TLS off" in r.getMessage()
               for r in caplog.records), caplog.text


# --- roles over TLS -------------------------------------------------------------------------

TASK = DigitsTask()
DATA = TASK.load_data()


def tls_keys(tls: TLSConfig) -> dict[str, str]:
    return {"security.tls_cert": str(tls.cert), "security.tls_key": str(tls.key),
            "security.tls_ca": str(tls.ca)}


def test_coordinator_and_worker_train_over_tls_and_refuse_outsiders(
        cluster: ClusterKeys, stranger: ClusterKeys) -> None:
    from swarmtrain.config import load_coordinator_config

    def worker(port: int, tls: TLSConfig | None, name: str) -> Worker:
        cfg = load_worker_config(overrides={
            "network.coordinator_port": port, "hardware.num_threads": 1, "training.batch_size": 32,
            "network.reconnect_attempts": 0, "training.probe_seconds": 0.2,
            "training.accumulation_steps": 1, "training.worker_id": name,
            **(tls_keys(tls) if tls else {})})
        return Worker(TASK.build_model(), TASK.loss, DATA.train, cfg, task_name="digits", secret=SECRET)

    async def main() -> tuple[Coordinator, Worker]:
        cfg = load_coordinator_config(overrides={
            "network.host": HOST, "network.port": 0, "checkpointing.interval": 0,
            "training.max_steps": 30, "training.eval_interval_sec": 0.5, "training.learning_rate": 3e-3,
            **tls_keys(node(cluster, "coordinator"))})
        c = Coordinator(TASK.build_model(), cfg, evaluate=lambda m: TASK.evaluate(m, DATA),
                        task_name="digits", secret=SECRET)
        await c.start()
        try:
            assert c.tls is not None
            with pytest.raises(AuthError, match="certificate"):
                await worker(c.port, node(stranger, "worker1", ca=cluster.ca), "stranger").run_async()
            with pytest.raises(SwarmError, match="has TLS on, this node needs it too"):
                await worker(c.port, None, "plain").run_async()
            status = await ctl_request(HOST, c.port, "status", secret=SECRET, timeout=10,
                                       tls=node(cluster, "worker2"))
            assert isinstance(status, Status)
            with pytest.raises(ConnectionLost):
                await ctl_request(HOST, c.port, "status", secret=SECRET, timeout=10)
            good = worker(c.port, node(cluster, "worker1"), "good")
            task = asyncio.create_task(good.run_async())
            await asyncio.wait_for(c.run(), 90)
            await asyncio.wait_for(task, 30)
            return c, good
        finally:
            await c.close()

    c, good = run(main(), timeout=110)
    assert c.version >= 30
    assert set(c.workers) == {"good"} and c.workers["good"].steps >= 30
    assert good.steps >= 30
