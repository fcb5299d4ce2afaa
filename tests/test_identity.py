"""Node identity: persistence, file permissions, signatures, peer ids."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.transport.identity import KEY_FILE, Identity, config_dir, peer_id_of, verify

pytestmark = pytest.mark.timeout(30)


def test_created_once_then_reloaded_identical(tmp_path: Path) -> None:
    home = tmp_path / "cfg" / "swarmtrain"
    first = Identity.load_or_create(home)
    second = Identity.load_or_create(home)
    assert first.peer_id == second.peer_id and first.public_key == second.public_key
    assert verify(first.public_key, b"x", second.sign(b"x"))
    assert stat.S_IMODE(os.stat(home / KEY_FILE).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert [p.name for p in home.iterdir()] == [KEY_FILE]  # no temporary file left behind
    assert (home / KEY_FILE).read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_mode_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        Identity.load_or_create(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / KEY_FILE).st_mode) == 0o600


def test_concurrent_first_starts_agree(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: Identity.load_or_create(tmp_path).peer_id, range(16)))
    assert len(ids) == 1


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_key_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    Identity.load_or_create(tmp_path)
    os.chmod(tmp_path / KEY_FILE, mode)
    with pytest.raises(SwarmError, match=r"chmod 600"):
        Identity.load_or_create(tmp_path)


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", b"\x00" * 31],
)
def test_corrupt_key_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(SwarmError, match="corrupt"):
        Identity.load_or_create(tmp_path)


def test_raw_32_byte_key_is_accepted(tmp_path: Path) -> None:
    seed = bytes(range(32))
    path = tmp_path / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, seed)
    os.close(fd)
    a, b = Identity.load_or_create(tmp_path), Identity.load_or_create(tmp_path)
    assert a.peer_id == b.peer_id


def test_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key

    pem = generate_private_key(SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(tmp_path / KEY_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, pem)
    os.close(fd)
    with pytest.raises(SwarmError, match="not an Ed25519 key"):
        Identity.load_or_create(tmp_path)


def test_unwritable_directory_is_a_swarm_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SwarmError, match="cannot load or create"):
        Identity.load_or_create(blocker / "swarmtrain")


def test_signature_verifies_and_tampering_fails() -> None:
    me, other = Identity.generate(), Identity.generate()
    sig = me.sign(b"membership epoch 7")
    assert len(sig) == 64
    assert verify(me.public_key, b"membership epoch 7", sig)
    assert not verify(me.public_key, b"membership epoch 8", sig)
    assert not verify(other.public_key, b"membership epoch 7", sig)
    assert not verify(me.public_key, b"membership epoch 7", bytes(64))
    assert not verify(me.public_key, b"membership epoch 7", sig[:10])
    assert not verify(b"short", b"membership epoch 7", sig)


def test_peer_id_is_derived_from_the_public_key() -> None:
    me = Identity.generate()
    assert len(me.public_key) == 32
    assert peer_id_of(me.public_key) == me.peer_id
    assert len(me.peer_id) == 32 and int(me.peer_id, 16) >= 0
    assert Identity.generate().peer_id != me.peer_id
    assert repr(me) == f"Identity(peer_id={me.peer_id!r}, path=None)"  # no key material
    with pytest.raises(ValueError):
        peer_id_of(b"\x00" * 31)


def test_config_dir_precedence(tmp_path: Path) -> None:
    assert config_dir({"SWARMTRAIN_HOME": "/a", "XDG_CONFIG_HOME": "/b", "HOME": "/c"}) == Path("/a")
    assert config_dir({"XDG_CONFIG_HOME": "/b", "HOME": "/c"}) == Path("/b/swarmtrain")
    assert config_dir({"HOME": "/c"}) == Path("/c/.config/swarmtrain")
    assert config_dir({"SWARMTRAIN_HOME": "", "HOME": "/c"}) == Path("/c/.config/swarmtrain")


def test_default_directory_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARMTRAIN_HOME", str(tmp_path / "home"))
    me = Identity.load_or_create()
    assert me.path == tmp_path / "home" / KEY_FILE and me.path.exists()
