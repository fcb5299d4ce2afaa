"""Cluster-secret authentication: HMAC-SHA256 proofs over the handshake transcript, so each
side proves it knows the secret without sending it, *and* that it saw the same handshake.

Every proof covers a domain string, a direction label, the protocol version, everything the
client claims (role, node id, software) and both fresh 32-byte nonces (see
:class:`Transcript`). So a recorded handshake cannot be replayed (the nonces are new), a
relay without the secret cannot change what a client claims (the role is in the proof), a
proof cannot be reflected back (the labels differ per direction) and two sessions cannot be
spliced (each proof names both of its session's nonces). Every field is length-prefixed, so
no two different transcripts are the same bytes.

A client with a node identity (an Ed25519 key, :class:`swarmtrain.transport.identity.Identity`)
also signs the transcript (:func:`identity_statement`): the server then knows that
``HELLO.node`` is the peer id of a key the client holds, not just a name it typed.

An open cluster (no secret) is an explicit choice: both sides then use the empty key,
which authenticates nothing but keeps one code path.

The MAC itself (and the ring link's proofs) is in :mod:`swarmtrain.wire.handshake`, sans-IO,
shared by both handshakes; this module adds the transport's transcript and its proofs.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.errors import ConfigError
from swarmtrain.wire.frame import PROTOCOL_VERSION
from swarmtrain.wire.handshake import (
    DOMAIN,
    NONCE_BYTES,
    length_prefixed,
    mac,
    new_nonce,
    proofs_equal,
    ring_client_proof,
    ring_server_proof,
)

__all__ = ["cluster_secret", "NONCE_BYTES", "DOMAIN", "Transcript", "new_nonce", "mac", "server_proof",
           "client_proof",
           "welcome_proof", "identity_statement", "ring_server_proof", "ring_client_proof", "proofs_equal",
           "secret_hint", "SECRET_HELP"]


def cluster_secret(value: bytes | bytearray | memoryview | str | None) -> bytes | None:
    """A cluster secret as the handshake uses it: bytes, or None for an open cluster.

    A ``str`` (what people type: ``secret="our-lab-secret"``) is its UTF-8 bytes, as
    ``[security] secret`` and ``SWARMTRAIN_SECRET`` are. An empty one would authenticate
    nothing while looking set, and anything else is not a secret: both are refused here,
    when a node is made, rather than in the first handshake of a server that is already up.

    Raises:
        ConfigError: an empty secret, or one that is neither bytes nor str.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ConfigError(f"the cluster secret must be bytes or str, got {type(value).__name__}; pass "
                          "the secret itself (or secret=None and set SWARMTRAIN_SECRET)")
    secret = bytes(value)
    if not secret:
        raise ConfigError("the cluster secret is empty, which would authenticate nothing: pass a "
                          "real secret (`swarmtrain secret --out FILE` makes one), or secret=None "
                          "with --insecure for an open cluster")
    return secret


@dataclass(frozen=True)
class Transcript:
    """What a transport handshake authenticates: HELLO's claims, CHALLENGE's answer and the
    protocol version both sides speak.

    Attributes:
        role: ``HELLO.role``.
        client_nonce: ``HELLO.nonce``.
        server_nonce: ``CHALLENGE.nonce``.
        node: ``HELLO.node`` (the node id the client claims; empty if none).
        software: ``HELLO.software``.
        open_cluster: ``CHALLENGE.open_cluster``.
        version: the protocol version (every frame's preamble carries it too).
    """

    role: str
    client_nonce: bytes
    server_nonce: bytes
    node: str = ""
    software: str = ""
    open_cluster: bool = False
    version: int = PROTOCOL_VERSION

    def fields(self) -> tuple[bytes, ...]:
        return (bytes([self.version]), self.role.encode(), self.node.encode(), self.software.encode(),
                self.client_nonce, self.server_nonce, bytes([self.open_cluster]))


def server_proof(secret: bytes | None, t: Transcript) -> bytes:
    """CHALLENGE.proof: the server knows the secret and answers this very HELLO."""
    return mac(secret, b"server", *t.fields())


def client_proof(secret: bytes | None, t: Transcript) -> bytes:
    """AUTH.proof: the client knows the secret and claims exactly what HELLO said."""
    return mac(secret, b"client", *t.fields())


def identity_statement(t: Transcript) -> bytes:
    """What a client with a node identity signs (Ed25519) in AUTH: this very transcript, under
    its own label, so the signature proves that the key behind ``t.node`` took part in this
    session (both nonces are fresh) and cannot serve any other session, direction or purpose."""
    return length_prefixed(DOMAIN, b"node identity", *t.fields())


def welcome_proof(secret: bytes | None, t: Transcript, session: str) -> bytes:
    """WELCOME.proof: the server accepted this session (binds the session id too)."""
    return mac(secret, b"welcome", *t.fields(), session.encode())


SECRET_HELP = (
    "give every machine of the cluster the same secret: the SWARMTRAIN_SECRET environment "
    "variable, `--secret-file FILE`, or [security] secret_file in the config "
    "(create one with `swarmtrain secret --out FILE`)"
)


def secret_hint() -> str:
    return SECRET_HELP
