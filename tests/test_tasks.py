"""Tests of swarmtrain.tasks: built-in tasks, shards, task loading and JSONL data."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from swarmtrain.errors import ConfigError, TaskError
from swarmtrain.tasks import (
    BUILTIN_TASKS,
    DigitsTask,
    Shard,
    Task,
    TaskData,
    TextLM,
    TextLMConfig,
    TextLMTask,
    load_task,
)
from swarmtrain.tasks.textlm import ByteWindowDataset, load_stdlib_corpus

pytestmark = pytest.mark.timeout(60)

TINY_LM = TextLMConfig(context=32, d_model=32, n_heads=2, n_layers=2)


class IndexDataset:
    """A dataset whose samples are their own indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices: torch.Tensor) -> torch.Tensor:
        return indices


@pytest.fixture(scope="module")
def digits_data() -> TaskData:
    return DigitsTask().load_data()


@pytest.fixture(scope="module")
def stdlib_data() -> TaskData:
    return TextLMTask(TINY_LM).load_data()


def _write_jsonl(path: Path, lines: list[Any]) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def _digit_record(label: int) -> dict[str, Any]:
    return {"x": [float((i * (label + 1)) % 17) for i in range(64)], "y": label}


# ---------------------------------------------------------------- digits


def test_digits_plain_training_reaches_95_percent(digits_data: TaskData) -> None:
    task = DigitsTask()
    model = task.build_model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=task.default_learning_rate)
    shard = Shard(digits_data.train, 0, 1, seed=0)
    best = 0.0
    for step in range(1, 1501):
        loss = task.loss(model, shard.next_batch(task.default_batch_size))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            best = max(best, task.evaluate(model, digits_data)["accuracy"])
            if best >= 0.95:
                break
    assert best >= 0.95


def test_digits_split_and_scaling(digits_data: TaskData) -> None:
    assert len(digits_data.train) + len(digits_data.heldout) == 1797
    assert len(digits_data.heldout) == 359
    x, y = digits_data.train.get_batch(torch.arange(len(digits_data.train)))
    assert x.shape == (1438, 64) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    again = DigitsTask().load_data()
    assert torch.equal(
        again.heldout.get_batch(torch.arange(5))[0],
        digits_data.heldout.get_batch(torch.arange(5))[0],
    )


def test_digits_evaluate_restores_mode_and_limits_samples(digits_data: TaskData) -> None:
    task = DigitsTask()
    model = task.build_model()
    model.train()
    result = task.evaluate(model, digits_data, max_samples=10)
    assert model.training
    assert set(result) == {"accuracy", "loss"}
    assert result["accuracy"] * 10 == pytest.approx(round(result["accuracy"] * 10))
    model.eval()
    task.evaluate(model, digits_data)
    assert not model.training


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("task", [DigitsTask(), TextLMTask(TINY_LM)], ids=lambda t: t.name)
def test_build_model_is_deterministic(task: Task) -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    a = task.build_model(seed=7)
    b = task.build_model(seed=7)
    c = task.build_model(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # fork_rng: caller's RNG stream not consumed


# ---------------------------------------------------------------- textlm


def test_textlm_loss_decreases(stdlib_data: TaskData) -> None:
    task = TextLMTask(TINY_LM)
    model = task.build_model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    shard = Shard(stdlib_data.train, 0, 1, seed=0)
    before = task.evaluate(model, stdlib_data, max_samples=64)
    for _ in range(30):
        loss = task.loss(model, shard.next_batch(16))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = task.evaluate(model, stdlib_data, max_samples=64)
    assert set(after) == {"loss", "bits_per_byte"}
    assert after["loss"] < before["loss"] - 0.5
    assert after["bits_per_byte"] == pytest.approx(after["loss"] / 0.6931471805599453)


def test_textlm_windows_and_split(stdlib_data: TaskData) -> None:
    train, heldout = stdlib_data.train, stdlib_data.heldout
    assert isinstance(train, ByteWindowDataset) and isinstance(heldout, ByteWindowDataset)
    total = train.data.numel() + heldout.data.numel()
    assert heldout.data.numel() == total // 10
    assert len(train) == train.data.numel() - TINY_LM.context
    inputs, targets = train.get_batch(torch.tensor([0, 5, len(train) - 1]))
    assert inputs.shape == targets.shape == (3, TINY_LM.context)
    assert inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets[2], train.data[-TINY_LM.context :].long())
    corpus = load_stdlib_corpus()
    assert bytes(train.data[:100].tolist()) == corpus[:100]
    assert bytes(heldout.data[-100:].tolist()) == corpus[-100:]


def test_textlm_model_structure() -> None:
    model = TextLMTask(TINY_LM).build_model()
    assert isinstance(model, TextLM)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    tokens = torch.randint(0, 256, (2, 20))
    x = model.embed(tokens)
    for block in model.blocks:
        x = block(x)
    assert torch.allclose(model.logits(x), model(tokens))
    assert model(tokens).shape == (2, 20, 256)
    with pytest.raises(TaskError, match="context"):
        model(torch.zeros(1, 33, dtype=torch.int64))


def test_textlm_config_validation() -> None:
    with pytest.raises(TaskError, match="n_heads"):
        TextLMConfig(d_model=30, n_heads=4)
    with pytest.raises(TaskError, match="dropout"):
        TextLMConfig(dropout=1.0)


def test_textlm_missing_stdlib_says_to_pass_jsonl(monkeypatch: pytest.MonkeyPatch) -> None:
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": "/nonexistent/stdlib"})
    with pytest.raises(TaskError, match="standard library was not found.*JSONL"):
        TextLMTask(TINY_LM).load_data()


def test_sample_bytes_estimates_are_positive_and_scale() -> None:
    assert DigitsTask().sample_bytes_estimate() > 0
    small = TextLMTask(TINY_LM).sample_bytes_estimate()
    assert TextLMTask().sample_bytes_estimate() > small > 0


# ---------------------------------------------------------------- shards


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), count=st.integers(1, 12))
def test_shards_partition_dataset(n: int, count: int) -> None:
    ds = IndexDataset(n)
    covered: list[int] = []
    for i in range(count):
        if (i + 1) * n // count == i * n // count:
            with pytest.raises(TaskError, match="empty"):
                Shard(ds, i, count)
            continue
        shard = Shard(ds, i, count, seed=3)
        assert (shard.start, shard.stop) == (i * n // count, (i + 1) * n // count)
        epoch = shard.next_batch(len(shard))
        assert sorted(epoch.tolist()) == list(range(shard.start, shard.stop))
        covered.extend(epoch.tolist())
    assert sorted(covered) == list(range(n))


def test_shard_wraps_to_new_permutation() -> None:
    shard = Shard(IndexDataset(100), 1, 4, seed=0)  # covers [25, 50)
    assert len(shard) == 25
    batches = [shard.next_batch(10) for _ in range(5)]  # 50 samples = exactly 2 epochs
    assert all(b.numel() == 10 for b in batches)
    drawn = torch.cat(batches).tolist()
    assert sorted(drawn[:25]) == list(range(25, 50))
    assert sorted(drawn[25:]) == list(range(25, 50))
    assert drawn[:25] != drawn[25:]  # a fresh permutation each epoch
    assert shard.epoch == 2
    big = shard.next_batch(60)  # larger than the shard: spans several permutations
    assert big.numel() == 60 and set(big.tolist()) == set(range(25, 50))
    shard.reset()
    assert torch.equal(torch.cat([shard.next_batch(10) for _ in range(5)]), torch.cat(batches))


def test_shard_bad_arguments() -> None:
    ds = IndexDataset(10)
    for index, count in [(-1, 2), (2, 2), (0, 0)]:
        with pytest.raises(ConfigError):
            Shard(ds, index, count)
    with pytest.raises(ConfigError, match="batch size"):
        Shard(ds, 0, 1).next_batch(0)


def test_shard_of_real_task_data(digits_data: TaskData) -> None:
    x, y = Shard(digits_data.train, 2, 3, seed=1).next_batch(8)
    assert x.shape == (8, 64) and y.shape == (8,)


# ---------------------------------------------------------------- load_task


@pytest.fixture
def user_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_load_builtin_tasks() -> None:
    assert set(BUILTIN_TASKS) == {"digits", "textlm"}
    digits, textlm = load_task("digits"), load_task("textlm")
    assert isinstance(digits, DigitsTask) and digits.name == "digits"
    assert isinstance(textlm, TextLMTask) and textlm.name == "textlm"
    assert textlm.primary_metric == "loss" and not textlm.higher_is_better
    assert digits.primary_metric == "accuracy" and digits.higher_is_better


@pytest.mark.usefixtures("user_module_path")
@pytest.mark.parametrize("attr", ["factory", "instance", "TinyDigitsTask"])
def test_load_user_task(attr: str) -> None:
    task = load_task(f"usertask_example:{attr}")
    assert task.name == "tiny-digits"


def test_load_task_by_dotted_module_path() -> None:
    assert isinstance(load_task("swarmtrain.tasks.textlm:TextLMTask"), TextLMTask)


@pytest.mark.usefixtures("user_module_path")
@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("mnist", r"unknown task 'mnist'.*digits, textlm"),
        ("", r"unknown task ''.*built-in tasks"),
        ("no_such_module_xyz:factory", r"module 'no_such_module_xyz' not found.*digits, textlm"),
        ("usertask_example:missing", r"has no attribute 'missing'"),
        ("usertask_example:not_a_task", r"is a int, not a Task"),
        ("usertask_example:bad_factory", r"returned a str, not a Task"),
        ("usertask_example:broken_factory", r"raised RuntimeError: dataset server unreachable"),
        ("swarmtrain.errors:TaskError", r"class TaskError is not a subclass of Task"),
        ("usertask_example:", r"malformed"),
    ],
)
def test_load_task_errors(spec: str, pattern: str) -> None:
    with pytest.raises(TaskError, match=pattern) as info:
        load_task(spec)
    assert repr(spec) in str(info.value)


# ---------------------------------------------------------------- JSONL


def test_digits_jsonl_happy_path(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [_digit_record(i % 10) for i in range(20)] + [""])
    data = DigitsTask().load_data(path)
    assert (len(data.train), len(data.heldout)) == (16, 4)
    x, y = data.train.get_batch(torch.arange(16))
    assert float(x.max()) == 1.0  # 16 / 16
    rows = {tuple(r) for r in (x * 16).tolist()}
    assert all(tuple(_digit_record(int(lbl))["x"]) in rows for lbl in y.tolist())


def test_textlm_jsonl_happy_path(tmp_path: Path) -> None:
    texts = [f"line {i}: def f(x): return x * {i}" for i in range(40)]
    path = _write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    data = TextLMTask(TINY_LM).load_data(path)
    stream = "\n".join(texts).encode()
    assert isinstance(data.train, ByteWindowDataset) and isinstance(data.heldout, ByteWindowDataset)
    assert bytes(data.train.data.tolist()) + bytes(data.heldout.data.tolist()) == stream
    assert data.heldout.data.numel() == len(stream) // 10


@pytest.mark.parametrize(
    ("lines", "bad_line", "pattern"),
    [
        ([_digit_record(1), "{not json"], 2, "not valid JSON"),
        ([_digit_record(1), [1, 2]], 2, "expected a JSON object, got array"),
        ([_digit_record(1), {"y": 3}], 2, "missing key 'x'"),
        ([{"x": [0.0] * 64}], 1, "missing key 'y'"),
        ([_digit_record(1), {"x": [0.0] * 63, "y": 1}], 2, "64 numbers, got 63"),
        (
            [_digit_record(1), _digit_record(2), {"x": [0.0] * 64, "y": 10}],
            3,
            r"'y' = 10 out of range.*0\.\.9",
        ),
        ([{"x": [0.0] * 64, "y": 1.5}], 1, "integer label"),
        ([{"x": ["a"] * 64, "y": 1}], 1, "finite number"),
        ([{"x": "abc", "y": 1}], 1, "array of 64 numbers"),
    ],
)
def test_digits_jsonl_errors(tmp_path: Path, lines: list[Any], bad_line: int, pattern: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TaskError, match=pattern) as info:
        DigitsTask().load_data(path)
    assert f"{path}, line {bad_line}" in str(info.value)


def test_textlm_jsonl_errors(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [{"text": "ok"}, {"txt": "typo"}])
    with pytest.raises(TaskError, match=r"line 2: missing key 'text'.*'txt'"):
        TextLMTask(TINY_LM).load_data(path)
    path = _write_jsonl(tmp_path / "t2.jsonl", [{"text": 5}])
    with pytest.raises(TaskError, match=r"line 1: 'text' must be a string, got number"):
        TextLMTask(TINY_LM).load_data(path)
    path = _write_jsonl(tmp_path / "t3.jsonl", [{"text": "too short"}])
    with pytest.raises(TaskError, match=r"too few.*at least 330 bytes"):
        TextLMTask(TINY_LM).load_data(path)


def test_jsonl_file_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TaskError, match="empty"):
        DigitsTask().load_data(str(empty))
    with pytest.raises(TaskError, match="cannot read data file .*missing.jsonl"):
        TextLMTask(TINY_LM).load_data(str(tmp_path / "missing.jsonl"))
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(TaskError, match="line 1: not valid UTF-8"):
        TextLMTask(TINY_LM).load_data(str(bad_utf8))
    one = _write_jsonl(tmp_path / "one.jsonl", [_digit_record(3)])
    with pytest.raises(TaskError, match="at least 2"):
        DigitsTask().load_data(one)


def test_a_user_task_under_the_working_directory_loads_without_it_on_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed `swarmtrain` command's path starts at its bin directory, not at the
    working directory: `--task mytasks.small:task` must still find ./mytasks/small.py."""
    (tmp_path / "mytasks").mkdir()
    (tmp_path / "mytasks" / "__init__.py").write_text("")
    (tmp_path / "mytasks" / "small.py").write_text(
        "from swarmtrain.tasks import DigitsTask\n\ndef task():\n    return DigitsTask()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), os.getcwd())])
    assert isinstance(load_task("mytasks.small:task"), DigitsTask)
