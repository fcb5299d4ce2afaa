"""Checkpoint store: bit-exact round trips, atomic writes, pruning, corruption, full disks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmtrain.core.checkpoint import (
    CheckpointStore,
    adam_state_from_tensors,
    adam_state_to_tensors,
)
from swarmtrain.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype, name
        assert tensor.shape == b[name].shape, name
        # torch.equal treats NaN != NaN and -0.0 == 0.0; compare the raw bytes instead.
        assert _raw_bytes(tensor) == _raw_bytes(b[name]), name


def _raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).contiguous().view(torch.uint8).tolist())


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return {
        "model/w.f32": base,
        "model/w.f64": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "model/w.bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "model/w.f16": torch.randn(2, 7, generator=g).to(torch.float16),
        "model/idx.i64": torch.tensor([-(2**62), 0, 2**62 + 12345], dtype=torch.int64),
        "model/mask.bool": torch.tensor([True, False, True]),
        "model/u8": torch.arange(0, 256, dtype=torch.uint8),
        "adam/step/w": torch.tensor(17.0),
        "scalar.i32": torch.tensor(-5, dtype=torch.int32),
        "empty": torch.empty(0, 3),
        "specials": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
        "transposed": base.t(),
        "slice.a": base[:3],
        "slice.b": base[3:],
    }


def test_round_trip_is_bit_exact_across_dtypes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpts")
    tensors = _sample_tensors()
    meta = {"version": "0.1.0", "config": {"lr": 0.1, "betas": [0.9, 0.999]}, "loss": 1 / 3}
    path = store.save(42, tensors, meta)
    assert path == tmp_path / "ckpts" / "ckpt-000000000042"
    assert sorted(os.listdir(path)) == ["meta.json", "tensors.safetensors"]

    ckpt = store.latest()
    assert ckpt is not None
    assert ckpt.step == 42 and ckpt.path == path and ckpt.meta == meta
    _assert_bit_equal(ckpt.tensors, {k: v.contiguous() for k, v in tensors.items()})
    # Loaded tensors own writable memory.
    ckpt.tensors["model/w.f32"].add_(1.0)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="JSON"):
        store.save(1, {"a": torch.zeros(1)}, {"bad": object()})
    with pytest.raises(CheckpointError, match="step"):
        store.save(-1, {"a": torch.zeros(1)}, {})
    with pytest.raises(ConfigError):
        CheckpointStore(tmp_path, keep=0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("keep", [1, 2, 3, 5])
def test_keeps_only_the_newest_k(tmp_path: Path, keep: int) -> None:
    store = CheckpointStore(tmp_path, keep=keep)
    steps = [10, 20, 30, 40]
    for step in steps:
        store.save(step, {"w": torch.full((2,), float(step))}, {"step": step})
    assert [p.name for p in store.list()] == [f"ckpt-{s:012d}" for s in steps[-keep:]]
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 40


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(5, {"w": torch.zeros(2)}, {"n": 1})
    store.save(5, {"w": torch.ones(2)}, {"n": 2})
    ckpt = store.latest()
    assert ckpt is not None and ckpt.meta == {"n": 2}
    assert torch.equal(ckpt.tensors["w"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000005"]


def test_crash_during_rename_leaves_old_checkpoints_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, {"w": torch.ones(3)}, {"step": 1})

    def crash(src: object, dst: object) -> None:
        raise OSError(5, "Input/output error (simulated crash)")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(CheckpointError, match="simulated crash"):
        store.save(2, {"w": torch.zeros(3)}, {"step": 2})
    monkeypatch.undo()

    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000001"]
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1


def test_failed_replacement_of_a_step_puts_the_old_one_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    store.save(5, {"w": torch.ones(3)}, {"n": 1})
    real_replace = os.replace
    calls: list[tuple[str, str]] = []

    def fail_second_rename(src: str, dst: str) -> None:
        calls.append((str(src), str(dst)))
        if len(calls) == 2:  # the old step is aside, the new one fails to move in
            raise OSError(5, "Input/output error (simulated)")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second_rename)
    with pytest.raises(CheckpointError, match="simulated"):
        store.save(5, {"w": torch.zeros(3)}, {"n": 2})
    monkeypatch.undo()

    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000005"]
    ckpt = store.latest()
    assert ckpt is not None and ckpt.meta == {"n": 1}


def test_stale_temp_dirs_are_removed_at_start(tmp_path: Path) -> None:
    CheckpointStore(tmp_path).save(1, {"w": torch.ones(3)}, {})
    # What a process killed mid-save leaves behind: a half-written temp directory.
    stale = tmp_path / ".tmp-ckpt-000000000002-999-abcd"
    stale.mkdir()
    (stale / "tensors.safetensors").write_bytes(b"\x00" * 10)
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("keep me")

    store = CheckpointStore(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000001", "notes.txt"]
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1 and store.last_skipped == []


def _flip_byte(path: Path) -> None:
    f = path / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    f = path / "tensors.safetensors"
    f.write_bytes(f.read_bytes()[:-7])


def _delete_meta(path: Path) -> None:
    (path / "meta.json").unlink()


def _garbage_meta(path: Path) -> None:
    (path / "meta.json").write_text('{"format": "swarmtrain-checkp')


def _future_version(path: Path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = 99
    (path / "meta.json").write_text(json.dumps(meta))


def _lying_index(path: Path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta["tensors"]["w"]["shape"] = [4]
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_byte, "SHA-256"),
        (_truncate, "truncated"),
        (_delete_meta, "meta.json is missing"),
        (_garbage_meta, "not valid JSON"),
        (_future_version, "unknown format version 99"),
        (_lying_index, "do not match"),
    ],
)
def test_corrupt_newest_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object, reason: str
) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, {"w": torch.ones(3)}, {"step": 1})
    newest = store.save(2, {"w": torch.full((3,), 2.0)}, {"step": 2})
    assert callable(damage)
    damage(newest)

    with caplog.at_level(logging.WARNING, logger="swarmtrain.core.checkpoint"):
        ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
    assert torch.equal(ckpt.tensors["w"], torch.ones(3))
    assert len(store.last_skipped) == 1
    skipped_path, skipped_reason = store.last_skipped[0]
    assert skipped_path == newest and reason in skipped_reason
    assert str(newest) in caplog.text and reason in caplog.text
    with pytest.raises(CheckpointError, match=reason):
        store.load(newest)


def test_known_corrupt_checkpoints_do_not_count_towards_keep(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.save(1, {"w": torch.ones(1)}, {})
    _flip_byte(store.save(2, {"w": torch.ones(1)}, {}))
    assert store.latest() is not None and store.last_skipped
    # Resumed from step 1; the next save must not prune step 1 in favour of the bad step 2.
    store.save(3, {"w": torch.ones(1)}, {})
    assert [p.name for p in store.list()] == ["ckpt-000000000001", "ckpt-000000000003"]


def test_unwritable_directory_gives_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the parent directory should be")
    store = CheckpointStore(blocker / "ckpts")
    with pytest.raises(CheckpointError) as info:
        store.save(1, {"w": torch.ones(1)}, {})
    message = str(info.value)
    assert str(blocker / "ckpts") in message and "[checkpointing] directory" in message
    assert store.latest() is None


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 64 KiB tmpfs (mounted rw) and a read-only one; both unmounted afterwards."""
    mounts = [tmp_path / "full", tmp_path / "ro"]
    mounted: list[Path] = []
    try:
        for mount, opts in zip(mounts, ["size=64k", "size=64k,ro"]):
            mount.mkdir()
            result = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mount)],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            )
            if result.returncode != 0:
                reason = f"cannot mount a tmpfs (needs root): {result.stderr.strip()}"
                if os.environ.get("SWARMTRAIN_REQUIRE_NETNS") == "1":
                    pytest.fail(reason)
                pytest.skip(reason)
            mounted.append(mount)
        yield mounts[0], mounts[1]
    finally:
        for mount in mounted:
            subprocess.run(["umount", str(mount)], check=True, timeout=10)


def test_full_disk_keeps_last_good_checkpoint(tiny_tmpfs: tuple[Path, Path]) -> None:
    full, _ = tiny_tmpfs
    store = CheckpointStore(full, keep=3)
    small = {"w": torch.arange(1024, dtype=torch.float32)}  # 4 KiB
    good = store.save(1, small, {"step": 1})

    big = {"w": torch.zeros(64 * 1024, dtype=torch.float32)}  # 256 KiB, more than the disk
    with pytest.raises(CheckpointError) as info:
        store.save(2, big, {"step": 2})
    message = str(info.value)
    assert "No space left on device" in message and "free disk space" in message
    assert str(full) in message

    assert sorted(os.listdir(full)) == [good.name]
    ckpt = store.latest()
    assert ckpt is not None and ckpt.step == 1
    _assert_bit_equal(ckpt.tensors, small)
    # Training goes on: once there is room again, saving works.
    store.save(3, small, {"step": 3})
    assert [p.name for p in store.list()] == [good.name, "ckpt-000000000003"]


def test_read_only_filesystem_gives_clear_error(tiny_tmpfs: tuple[Path, Path]) -> None:
    _, read_only = tiny_tmpfs
    with pytest.raises(CheckpointError, match="Read-only file system"):
        CheckpointStore(read_only).save(1, {"w": torch.ones(1)}, {})


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(count)]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps, lr: torch.optim.Adam(ps, lr=lr, betas=(0.8, 0.99)),
        lambda ps, lr: torch.optim.Adam(ps, lr=lr, amsgrad=True, weight_decay=0.01),
        lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
    ],
    ids=["adam", "adam-amsgrad", "adamw"],
)
def test_optimizer_resume_is_bit_exact(tmp_path: Path, make_opt: object) -> None:
    assert callable(make_opt)
    batches = _batches(10)
    model = _model(seed=0)
    opt = make_opt(model.parameters(), 0.01)
    names = [n for n, _ in model.named_parameters()]
    _train(model, opt, batches[:5])

    opt_tensors, opt_meta = adam_state_to_tensors(opt, names)
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()} | opt_tensors
    CheckpointStore(tmp_path).save(5, tensors, {"optimizer": opt_meta, "step": 5})
    _train(model, opt, batches[5:])

    # A fresh process: different initial weights and learning rate, both overwritten.
    resumed = _model(seed=123)
    resumed_opt = make_opt(resumed.parameters(), 0.5)
    ckpt = CheckpointStore(tmp_path).latest()
    assert ckpt is not None
    resumed.load_state_dict(
        {k.removeprefix("model/"): v for k, v in ckpt.tensors.items() if k.startswith("model/")}
    )
    adam_state_from_tensors(resumed_opt, names, ckpt.tensors, ckpt.meta["optimizer"])
    assert resumed_opt.param_groups[0]["lr"] == 0.01
    _train(resumed, resumed_opt, batches[5:])

    _assert_bit_equal(dict(model.state_dict()), dict(resumed.state_dict()))
    after, _ = adam_state_to_tensors(opt, names)
    resumed_after, _ = adam_state_to_tensors(resumed_opt, names)
    _assert_bit_equal(after, resumed_after)


def test_optimizer_state_for_another_model_is_refused() -> None:
    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    _train(model, opt, _batches(1))
    tensors, meta = adam_state_to_tensors(opt, names)
    other = torch.optim.Adam(_model(seed=0).parameters())
    with pytest.raises(CheckpointError, match="unknown parameter"):
        adam_state_from_tensors(other, [f"x.{n}" for n in names], tensors, meta)
    with pytest.raises(CheckpointError, match="SGD"):
        adam_state_from_tensors(torch.optim.SGD(model.parameters(), lr=0.1), names, tensors, meta)
