"""Optional mutual TLS: a cluster CA, one certificate per node, and the SSL contexts.

Every node holds a certificate signed by the cluster's own CA (made by ``swarmtrain keys``)
and verifies the other side's certificate against that CA, in both directions. Host names
are not checked: nodes are addressed by IP, and the CA is the trust anchor. The cluster-secret
handshake still runs inside TLS, so a node needs both a CA-signed certificate and the secret.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.errors import AuthError, ConfigError, ConnectionLost, SwarmError
from swarmtrain.fsutil import create_atomic

__all__ = [
    "TLSConfig",
    "ClusterKeys",
    "KEYS_HELP",
    "generate_cluster_keys",
    "ca_fingerprint",
    "describe_tls_error",
    "PendingTLS",
    "server_refusal_reason",
    "client_tls_error",
    "closed_in_handshake",
]

KEYS_HELP = (
    "make the cluster's keys once with `swarmtrain keys --out DIR`, give each node its NAME.pem, "
    "NAME-key.pem and the same ca.pem, and set [security] tls_cert, tls_key and tls_ca on every node"
)

_VALID_DAYS = 3650


@dataclass(frozen=True)
class TLSConfig:
    """Where this node's certificate, its private key and the cluster CA certificate are.

    Attributes:
        cert: this node's certificate (PEM), signed by the cluster CA.
        key: this node's private key (PEM, unencrypted; keep it mode 0600).
        ca: the cluster CA certificate (PEM): peers must present a certificate it signed.
    """

    cert: Path
    key: Path
    ca: Path

    def server_context(self) -> ssl.SSLContext:
        """An SSL context for listening: requires and verifies the client's certificate.

        Raises:
            ConfigError: a file is missing, unreadable, or not a matching cert/key pair.
        """
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """An SSL context for connecting: verifies the server's certificate, presents ours.

        Raises:
            ConfigError: a file is missing, unreadable, or not a matching cert/key pair.
        """
        return self._context(ssl.Purpose.SERVER_AUTH)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        server_side = purpose is ssl.Purpose.CLIENT_AUTH
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # nodes are addressed by IP; the cluster CA is the trust anchor
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=os.fspath(self.ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"security.tls_ca: cannot load the CA certificate {str(self.ca)!r}: "
                              f"{_reason(exc)}; {KEYS_HELP}") from exc
        try:
            ctx.load_cert_chain(certfile=os.fspath(self.cert), keyfile=os.fspath(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"security.tls_cert / security.tls_key: cannot load the certificate {str(self.cert)!r} "
                f"with the key {str(self.key)!r}: {_reason(exc)} (are they a pair from the same "
                f"`swarmtrain keys` run?)") from exc
        return ctx


@dataclass(frozen=True)
class ClusterKeys:
    """What :func:`generate_cluster_keys` wrote.

    Attributes:
        ca: the CA certificate (give it to every node).
        ca_key: the CA private key (keep it off the nodes; needed only to add nodes later).
        nodes: node name -> (certificate, private key).
        fingerprint: SHA-256 of the CA certificate (DER), hex with colons, for comparing by eye.
    """

    ca: Path
    ca_key: Path
    nodes: dict[str, tuple[Path, Path]]
    fingerprint: str


def generate_cluster_keys(directory: str | os.PathLike[str], names: Sequence[str]) -> ClusterKeys:
    """Create a cluster CA and one CA-signed certificate per node name in ``directory``.

    Writes ``ca.pem``, ``ca-key.pem`` and, per name, ``NAME.pem`` and ``NAME-key.pem``;
    keys are EC P-256 and written mode 0600; certificates are valid for about ten years.

    Args:
        directory: where to write (created if missing).
        names: node names (letters, digits, ``-``, ``_``, ``.``), e.g. ``coordinator``.

    Returns:
        The paths written and the CA fingerprint.

    Raises:
        ConfigError: a name is empty, repeated or has other characters, or a file already
            exists (nothing is overwritten: delete the old keys first to replace them).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    names = list(names)
    if not names:
        raise ConfigError("no node names given: name at least one node, e.g. --names coordinator,worker1")
    for name in names:
        if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
            raise ConfigError(f"node name {name!r} is not allowed: use letters, digits, '-', '_' and '.'")
        if name in ("ca", "ca-key") or name.endswith("-key"):
            raise ConfigError(f"node name {name!r} would clash with the CA's or a key's file name")
    if len(set(names)) != len(names):
        raise ConfigError(f"node names repeat: {', '.join(names)}")
    out = Path(directory)
    planned = [out / "ca.pem", out / "ca-key.pem"]
    planned += [out / f"{n}{suffix}" for n in names for suffix in (".pem", "-key.pem")]
    existing = [str(p) for p in planned if p.exists()]
    if existing:
        raise ConfigError(f"refusing to overwrite {', '.join(existing)}: delete the old keys first "
                          "or choose another --out directory")
    out.mkdir(parents=True, exist_ok=True)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=_VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarmtrain cluster CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / "ca-key.pem", key_pem(ca_key), private=True)
    _write(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM), private=False)

    nodes: dict[str, tuple[Path, Path]] = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                           critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = out / f"{name}.pem", out / f"{name}-key.pem"
        _write(key_path, key_pem(key), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
        nodes[name] = (cert_path, key_path)
    return ClusterKeys(ca=out / "ca.pem", ca_key=out / "ca-key.pem", nodes=nodes,
                       fingerprint=ca_fingerprint(out / "ca.pem"))


def ca_fingerprint(ca: str | os.PathLike[str]) -> str:
    """SHA-256 of a PEM certificate's DER bytes, as colon-separated hex (``AB:CD:...``).

    Raises:
        ConfigError: the file cannot be read or holds no PEM certificate.
    """
    try:
        pem = Path(ca).read_text(encoding="ascii")
        der = ssl.PEM_cert_to_DER_cert(pem)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the certificate {os.fspath(ca)!r}: {exc}") from exc
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def describe_tls_error(exc: BaseException) -> str:
    """A short human reason for an SSL failure (the verify message or OpenSSL's reason)."""
    return _reason(exc)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return str(exc.verify_message)
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.strerror:
        return str(exc.strerror)
    return str(exc) or type(exc).__name__


def _write(path: Path, data: bytes, *, private: bool) -> None:
    # a key file is 0600 from its first byte (never briefly readable by others), and a crash
    # leaves no half-written key or certificate under its name
    if not create_atomic(path, data, mode=0o600 if private else 0o644):
        raise ConfigError(f"refusing to overwrite {path}, created meanwhile by another process: "
                          "delete the old keys first or choose another --out directory")


# -- turning TLS failures into errors that say what to do ---------------------------------


class PendingTLS(asyncio.Protocol):
    """Holds an accepted TCP connection, unread, until ``loop.start_tls`` takes it over.

    The server upgrades each connection itself (rather than ``create_server(ssl=...)``) so
    that a failed TLS handshake reaches it as an exception it can log and count.
    """

    def __init__(self, on_made: Callable[[asyncio.Transport], object]) -> None:
        self._on_made = on_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # the client's first bytes are for the TLS layer
        self._on_made(transport)


def server_refusal_reason(exc: BaseException, handshake_timeout: float) -> str:
    """Why a client failed this server's TLS handshake, for the server's log."""
    reason = describe_tls_error(exc)
    if isinstance(exc, TimeoutError) or "taking longer" in str(exc):
        return f"no TLS handshake within {handshake_timeout:g} s"
    if isinstance(exc, ssl.SSLCertVerificationError) or "certificate" in reason:
        return (f"its TLS certificate is refused ({reason}): it was not signed by this cluster's "
                f"CA; {KEYS_HELP}")
    if isinstance(exc, ConnectionError):
        return (f"it broke off the TLS handshake ({type(exc).__name__}): it most likely does not "
                f"trust this server's certificate (signed by another cluster CA?); {KEYS_HELP}")
    if isinstance(exc, ssl.SSLError) and _not_tls(reason):
        return (f"it does not speak TLS ({reason}) and this server requires TLS: set [security] "
                "tls_cert, tls_key and tls_ca on that node too")
    return f"TLS handshake failed: {reason}"


def _not_tls(reason: str) -> bool:
    """True for OpenSSL reasons that mean the other side sent something other than TLS."""
    return any(r in reason for r in ("wrong version number", "http request", "record layer failure",
                                     "packet length too long", "unexpected record"))


def client_tls_error(where: str, exc: ssl.SSLError, tls: TLSConfig) -> SwarmError:
    """The error for a TLS handshake with the server at ``where`` that failed."""
    reason = describe_tls_error(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return AuthError(
            f"{where} presented a TLS certificate this node does not trust ({reason}): it was not "
            f"signed by the cluster CA in {tls.ca}; {KEYS_HELP}")
    if "alert" in reason:  # the server sent an alert: it refused our certificate
        return AuthError(
            f"{where} does not accept this node's TLS certificate {tls.cert} ({reason}): was it "
            f"signed by the same cluster CA as that node's? {KEYS_HELP}")
    if _not_tls(reason):
        return ConnectionLost(
            f"{where} does not speak TLS ({reason}): TLS is on here but off there; set [security] "
            "tls_cert, tls_key and tls_ca on that node too, or remove them here")
    return ConnectionLost(f"TLS handshake with {where} failed: {reason}")


#: the fix when the other side has TLS on and this node has it off
TLS_NEEDED_HERE = "this node needs it too: set [security] tls_cert, tls_key and tls_ca (see docs/tls.md)"


def closed_in_handshake(where: str, exc: ConnectionLost, tls: TLSConfig | None,
                         answered: bool) -> SwarmError:
    """The error for a server that closed the connection during the secret handshake."""
    if tls is None:
        return ConnectionLost(f"{exc}; if {where} has TLS on, {TLS_NEEDED_HERE}")
    if answered:
        return exc
    # with TLS 1.3 the server checks our certificate after our side of the TLS handshake has
    # completed: a refused certificate shows here, as a close before the server's first answer
    return AuthError(
        f"{where} closed the connection right after the TLS handshake, before answering: it "
        f"does not accept this node's certificate {tls.cert} (not signed by the cluster CA it "
        f"trusts?); that node's log says why; {KEYS_HELP}")
