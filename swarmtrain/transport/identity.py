"""Node identity: a persistent Ed25519 keypair per node, and the peer id derived from it.

The key lives in ``<config dir>/identity.key`` (PKCS#8 PEM, mode 0600, directory 0700). It is
created on first start and reused afterwards, so a node keeps its peer id across restarts.
The peer id is a hash of the public key: a node cannot claim another node's id without that
node's private key, because everything it says about membership is signed
(:meth:`Identity.sign`) and checked against the public key that hashes to the claimed id
(:func:`verify`, :func:`peer_id_of`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarmtrain.errors import SwarmError
from swarmtrain.fsutil import create_atomic

log = logging.getLogger("swarmtrain.identity")

__all__ = ["KEY_FILE", "PUBLIC_KEY_BYTES", "Identity", "config_dir", "node_identity", "peer_id_of", "verify"]

KEY_FILE = "identity.key"
PUBLIC_KEY_BYTES = 32
_PEER_ID_BYTES = 16  # 128 bits of SHA-256: collisions need ~2^64 keys


def config_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The user's swarmtrain config directory.

    ``$SWARMTRAIN_HOME`` if set, else ``$XDG_CONFIG_HOME/swarmtrain``, else
    ``~/.config/swarmtrain`` (home from ``$HOME``, else the password database).
    """
    if env.get("SWARMTRAIN_HOME"):
        return Path(env["SWARMTRAIN_HOME"])
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]) / "swarmtrain"
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return home / ".config" / "swarmtrain"


def peer_id_of(public_key: bytes) -> str:
    """The peer id of a raw 32-byte Ed25519 public key: 32 hex digits of its SHA-256.

    Raises:
        ValueError: `public_key` is not 32 bytes.
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).digest()[:_PEER_ID_BYTES].hex()


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` is a valid Ed25519 signature of `data` by `public_key`.

    Never raises on bad input (wrong key length, garbage signature): those are just invalid.
    """
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


class Identity:
    """A node's keypair. Build with :meth:`load_or_create` (persistent) or :meth:`generate`.

    Attributes:
        peer_id: ``peer_id_of(public_key)``; 32 lowercase hex digits, stable and sortable.
        public_key: the raw 32-byte Ed25519 public key.
        path: the key file, or None for an ephemeral identity.
    """

    __slots__ = ("_private", "path", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey, path: Path | None = None) -> None:
        self._private = private_key
        self.public_key = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_of(self.public_key)
        self.path = path

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r}, path={self.path!r})"

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `data`."""
        return self._private.sign(data)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity that is never written anywhere (tests, throwaway nodes)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, directory: Path | None = None) -> Identity:
        """Load this node's identity from `directory`, creating it on first use.

        Args:
            directory: where ``identity.key`` lives; :func:`config_dir` by default. Created
                with mode 0700 if missing.
        Returns:
            The identity stored there (a new one if there was none).
        Raises:
            SwarmError: the key file is readable by group or others, is not ours, is corrupt,
                or the directory or file cannot be read or written.
        """
        directory = config_dir() if directory is None else Path(directory)
        path = directory / KEY_FILE
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                return cls(_read_key(path), path)
            except FileNotFoundError:
                pass
            key = Ed25519PrivateKey.generate()
            if _write_new_key(path, key):
                return cls(key, path)
            return cls(_read_key(path), path)  # another process created it first: use theirs
        except OSError as exc:
            raise SwarmError(f"cannot load or create the node identity in {directory}: {exc}") from exc


def node_identity(without_key: str) -> Identity:
    """This node's persistent identity (:meth:`Identity.load_or_create`), or a throwaway key
    when the config directory cannot hold one, with a warning that says ``without_key``
    (what a throwaway key costs the caller) and how to keep the key."""
    try:
        return Identity.load_or_create()
    except SwarmError as exc:
        log.warning("%s; using a throwaway identity key: %s (set SWARMTRAIN_HOME to a writable "
                    "directory to keep the key)", exc, without_key)
        return Identity.generate()


def _read_key(path: Path) -> Ed25519PrivateKey:
    """Read and check the key file; FileNotFoundError if absent, SwarmError if unusable."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SwarmError(f"identity key {path} is not a regular file")
        if st.st_mode & 0o077:
            raise SwarmError(
                f"identity key {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must not be "
                f"readable by group or others; run `chmod 600 {path}` (or delete it to get a new "
                "peer id)"
            )
        if st.st_uid != os.geteuid():
            raise SwarmError(f"identity key {path} belongs to uid {st.st_uid}, not to this user")
        data = f.read(64 * 1024)
    try:
        if len(data) == 32:  # a raw private key is accepted too
            return Ed25519PrivateKey.from_private_bytes(data)
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SwarmError(f"identity key {path} is corrupt ({exc}); delete it to get a new peer id") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SwarmError(f"identity key {path} is a {type(key).__name__}, not an Ed25519 key")
    return key


def _write_new_key(path: Path, key: Ed25519PrivateKey) -> bool:
    """Create `path` holding `key` (mode 0600), atomically; False if it already exists.

    :func:`~swarmtrain.fsutil.create_atomic` hard-links a complete temporary file into
    place, so a concurrent reader sees either no file or a complete one, and a second
    process creating the key at the same time keeps the first one's.
    """
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return create_atomic(path, pem, mode=0o600)
