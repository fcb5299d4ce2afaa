"""Cluster-secret authentication: an HMAC-SHA256 challenge–response that proves to each
side that the other knows the secret, without sending it. Fresh 32-byte nonces from both
sides make every proof single-use, so a recorded handshake cannot be replayed.

An open cluster (no secret) is an explicit choice: both sides then use the empty key,
which authenticates nothing but keeps one code path.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["NONCE_BYTES", "new_nonce", "server_proof", "client_proof", "proofs_equal", "secret_hint"]

NONCE_BYTES = 32
_DOMAIN = b"swarmtrain/1 "


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    return hmac.new(secret or b"", _DOMAIN + b"".join(parts), hashlib.sha256).digest()


def server_proof(secret: bytes | None, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the server sends to prove it knows the secret."""
    return _mac(secret, b"server", client_nonce, server_nonce)


def client_proof(secret: bytes | None, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the client sends to prove it knows the secret (bound to the server's nonce)."""
    return _mac(secret, b"client", server_nonce, client_nonce)


def proofs_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


SECRET_HELP = (
    "give every machine of the cluster the same secret: the SWARMTRAIN_SECRET environment "
    "variable, `--secret-file FILE`, or [security] secret_file in the config "
    "(create one with `swarmtrain secret --out FILE`)"
)


def secret_hint() -> str:
    return SECRET_HELP
