"""Tests of swarmtrain.config: defaults, files, overrides, every class of error, secrets."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.config import (
    CompressionConfig,
    CoordinatorConfig,
    CoordinatorTrainingConfig,
    PipelineConfig,
    SecurityConfig,
    StageConfig,
    WorkerConfig,
    load_coordinator_config,
    load_pipeline_config,
    load_stage_config,
    load_worker_config,
    overrides_from_kwargs,
    resolve_secret,
    to_dict,
    with_overrides,
)
from swarmtrain.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _toml(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- defaults and loading


def test_coordinator_defaults() -> None:
    cfg = load_coordinator_config()
    assert cfg == CoordinatorConfig()
    assert cfg.network.port == 7100 and cfg.network.host == "0.0.0.0"
    assert cfg.network.send_queue_size == 64
    assert cfg.training.task == "digits" and cfg.training.learning_rate == 0.0
    assert (cfg.training.beta1, cfg.training.beta2, cfg.training.epsilon) == (0.9, 0.999, 1e-8)
    assert cfg.training.min_workers == 1 and cfg.training.max_staleness == 16
    assert cfg.training.staleness_damping is True and cfg.training.resync_interval == 50
    assert cfg.checkpointing.interval == 1000 and cfg.checkpointing.keep == 3
    assert cfg.compression.type == "none" and cfg.compression.qsgd_bits == 8
    assert cfg.compression.min_compress_numel == 256
    assert cfg.data.path == "" and cfg.logging.level == "info"
    assert cfg.security == SecurityConfig(secret="", secret_file="", insecure=False)


def test_worker_defaults() -> None:
    cfg = load_worker_config()
    assert cfg == WorkerConfig()
    assert cfg.network.coordinator_host == "127.0.0.1" and cfg.network.coordinator_port == 7100
    assert cfg.network.reconnect_attempts == 10 and cfg.network.connect_timeout_sec == 10.0
    assert cfg.hardware.num_threads == 0 and cfg.hardware.max_memory_mb == 0
    assert cfg.training.batch_size == 0 and cfg.training.speed == 1.0
    assert cfg.training.max_inflight == 1 and cfg.training.worker_id == ""
    assert cfg.data.shard_index == -1


def test_file_loading_and_int_widened_to_float(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
[network]
port = 7200
heartbeat_interval_sec = 1
[training]
learning_rate = 3e-4
min_workers = 2
staleness_damping = false
[compression]
type = "qsgd"
qsgd_bits = 4
""",
    )
    cfg = load_coordinator_config(path)
    assert cfg.network.port == 7200
    assert cfg.network.heartbeat_interval_sec == 1.0
    assert isinstance(cfg.network.heartbeat_interval_sec, float)
    assert cfg.training.learning_rate == 3e-4 and cfg.training.min_workers == 2
    assert cfg.training.staleness_damping is False
    assert cfg.compression == CompressionConfig(type="qsgd", qsgd_bits=4)
    assert cfg.checkpointing == CoordinatorConfig().checkpointing  # untouched section


def test_overrides_win_over_file_and_none_is_ignored(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[network]\nport = 7200\n[training]\nmin_workers = 3\n")
    cfg = load_coordinator_config(
        path, {"network.port": 7300, "training.min_workers": None, "training.seed": 5}
    )
    assert cfg.network.port == 7300
    assert cfg.training.min_workers == 3  # None means "flag not given"
    assert cfg.training.seed == 5


def test_string_overrides_are_parsed() -> None:
    cfg = load_worker_config(
        overrides={
            "network.coordinator_port": "7200",
            "training.speed": "0.5",
            "security.insecure": "true",
            "training.worker_id": "7",
        }
    )
    assert cfg.network.coordinator_port == 7200
    assert cfg.training.speed == 0.5
    assert cfg.security.insecure is True
    assert cfg.training.worker_id == "7"


def test_with_overrides_and_to_dict() -> None:
    base = load_coordinator_config(overrides={"security.secret": "hunter2"})
    changed = with_overrides(base, {"training.max_steps": 100, "compression.type": "fp16"})
    assert changed.training.max_steps == 100 and changed.compression.type == "fp16"
    assert changed.security.secret == "hunter2"  # not lost to redaction
    assert base.training.max_steps == 0  # frozen original untouched
    with pytest.raises(ConfigError, match="training.max_steps"):
        with_overrides(base, {"training.max_steps": -1})
    d = to_dict(changed)
    assert d["training"]["max_steps"] == 100 and d["network"]["port"] == 7100
    assert d["security"]["secret"] == "<redacted>"
    assert to_dict(changed, redact_secrets=False)["security"]["secret"] == "hunter2"
    assert set(to_dict(WorkerConfig())) == {
        "network",
        "security",
        "hardware",
        "training",
        "data",
        "compression",
        "logging",
    }


@pytest.mark.parametrize("cfg", [CoordinatorConfig(), WorkerConfig()], ids=["coord", "worker"])
def test_overrides_from_kwargs(cfg: CoordinatorConfig | WorkerConfig) -> None:
    sections = to_dict(cfg)
    plain = [k for values in sections.values() for k in values]
    assert len(plain) == len(set(plain))  # every key name is unique, so kwargs map uniquely
    for section, values in sections.items():
        for key in values:
            assert overrides_from_kwargs(cfg, {key: None}) == {f"{section}.{key}": None}
    assert overrides_from_kwargs(cfg, {"logging.level": "debug", "seed": 3}) == {
        "logging.level": "debug",
        "training.seed": 3,
    }
    changed = with_overrides(cfg, overrides_from_kwargs(cfg, {"seed": 3}))
    assert changed.training.seed == 3
    with pytest.raises(ConfigError, match=r"'sed' is not a config key \(did you mean 'seed'"):
        overrides_from_kwargs(cfg, {"sed": 3})


def test_sections_validate_when_built_in_python() -> None:
    with pytest.raises(ConfigError, match="training.min_workers = 0 is out of range"):
        CoordinatorTrainingConfig(min_workers=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CompressionConfig().type = "fp16"  # type: ignore[misc]


# ---------------------------------------------------------------- examples


@pytest.mark.parametrize(
    ("name", "loader", "default"),
    [
        ("coordinator.toml", load_coordinator_config, CoordinatorConfig()),
        ("worker.toml", load_worker_config, WorkerConfig()),
        ("stage.toml", load_stage_config, StageConfig()),
        ("pipeline.toml", load_pipeline_config, PipelineConfig()),
    ],
)
def test_example_files_load_and_list_every_key(name: str, loader: Any, default: Any) -> None:
    path = EXAMPLES / name
    cfg = loader(path)
    with open(path, "rb") as f:
        written = tomllib.load(f)
    loaded = to_dict(cfg, redact_secrets=False)
    assert written.keys() == loaded.keys()
    for section, values in loaded.items():
        assert written[section].keys() == values.keys(), f"[{section}] keys differ"
        for key, value in values.items():
            assert written[section][key] == value, f"{section}.{key} not loaded as written"
    differing = {
        (s, k)
        for s, values in to_dict(default).items()
        for k, v in values.items()
        if loaded[s][k] != v
    }
    assert len(differing) <= 3  # examples mostly show defaults; the rest show typical edits
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"key without a comment: {line!r}"


# ---------------------------------------------------------------- errors


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file '/nonexistent/c.toml' not found"):
        load_coordinator_config("/nonexistent/c.toml")


def test_malformed_toml(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[network\nport = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_worker_config(path)
    assert str(path) in str(info.value) and "line 1" in str(info.value)


def test_unknown_section(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[netwrok]\nport = 1\n")
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(path)
    msg = str(info.value)
    assert str(path) in msg and "unknown section [netwrok]" in msg
    assert "did you mean 'network'" in msg and "network, security, training" in msg


def test_top_level_key_is_not_a_section(tmp_path: Path) -> None:
    path = _toml(tmp_path, "port = 7100\n")
    with pytest.raises(ConfigError, match="unknown section \\[port\\]"):
        load_coordinator_config(path)
    path = _toml(tmp_path, "network = 7100\n")
    with pytest.raises(ConfigError, match="\\[network\\] must be a table"):
        load_coordinator_config(path)


def test_unknown_key_lists_allowed_keys(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[training]\nbatch_size = 8\n")
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(path)  # batch_size is a worker key, not a coordinator key
    msg = str(info.value)
    assert str(path) in msg and "unknown key 'training.batch_size'" in msg
    assert "allowed keys in [training]: task, learning_rate, beta1" in msg
    with pytest.raises(ConfigError, match=r"override 'hardware.threads'.*did you mean"):
        load_worker_config(overrides={"hardware.threads": 2})
    with pytest.raises(ConfigError, match="section.key"):
        load_worker_config(overrides={"threads": 2})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[network]\nport = "7100"\n', r"network.port: expected integer, got '7100' \(string\)"),
        ("[network]\nport = 71.5\n", r"network.port: expected integer, got 71.5 \(number\)"),
        ("[network]\nport = true\n", r"network.port: expected integer, got True \(boolean\)"),
        (
            "[training]\nstaleness_damping = 1\n",
            r"training.staleness_damping: expected boolean, got 1 \(integer\)",
        ),
        ('[training]\nbeta1 = "0.9"\n', r"training.beta1: expected number, got '0.9'"),
        ("[training]\ntask = 3\n", r"training.task: expected string, got 3"),
        ("[training]\nlearning_rate = nan\n", r"training.learning_rate: expected a finite number"),
        ("[network]\nhost = [1]\n", r"network.host: expected string, got \[1\]"),
    ],
)
def test_wrong_types(tmp_path: Path, text: str, expected: str) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_coordinator_config(path)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"network.port": 70000},
            r"network.port = 70000 is out of range; allowed: 0 <= port <= 65535",
        ),
        ({"network.port": -1}, r"allowed: 0 <= port <= 65535"),
        ({"training.beta2": 1.0}, r"training.beta2 = 1.0 .*allowed: 0.0 <= beta2 < 1.0"),
        ({"training.epsilon": 0}, r"training.epsilon = 0.0 .*allowed: 0.0 < epsilon"),
        ({"training.min_workers": 0}, r"allowed: 1 <= min_workers"),
        ({"training.resync_interval": 0}, r"allowed: 1 <= resync_interval"),
        ({"checkpointing.keep": 0}, r"checkpointing.keep = 0"),
        ({"compression.topk_ratio": 1.5}, r"allowed: 0.0 < topk_ratio <= 1.0"),
        (
            {"compression.type": "gzip"},
            (
                r"compression.type = 'gzip' is not allowed; "
                r"allowed values: 'none', 'fp16', 'topk', 'qsgd'"
            ),
        ),
        ({"compression.qsgd_bits": 3}, r"allowed values: 2, 4, 8"),
        ({"logging.level": "verbose"}, r"allowed values: 'debug', 'info', 'warning', 'error'"),
        (
            {"network.heartbeat_timeout_sec": 1.0},
            r"heartbeat_interval_sec \(2.0\) must be less than network.heartbeat_timeout_sec",
        ),
    ],
)
def test_coordinator_out_of_range(overrides: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        load_coordinator_config(overrides=overrides)
    assert str(info.value).startswith(f"override {next(iter(overrides))!r}: ")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"training.speed": 0}, r"allowed: 0.0 < speed <= 1.0"),
        ({"training.speed": 1.5}, r"training.speed = 1.5"),
        ({"training.max_inflight": 9}, r"max_inflight <= 8"),
        ({"data.shard_index": -2}, r"allowed: -1 <= shard_index"),
        ({"network.coordinator_port": 0}, r"allowed: 1 <= coordinator_port <= 65535"),
        ({"network.reconnect_attempts": -1}, r"network.reconnect_attempts = -1"),
        ({"hardware.num_threads": -1}, r"hardware.num_threads = -1"),
        ({"training.accumulation_steps": -1}, r"training.accumulation_steps = -1"),
    ],
)
def test_worker_out_of_range(overrides: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_worker_config(overrides=overrides)


def test_range_error_from_file_names_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[network]\nport = 99999\n")
    with pytest.raises(ConfigError, match=r"network.port = 99999 is out of range") as info:
        load_coordinator_config(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------- secrets


def test_resolve_secret_precedence(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("  from-file\n")
    env = {"SWARMTRAIN_SECRET": "from-env"}
    both = SecurityConfig(secret="inline", secret_file=str(secret_file))
    assert resolve_secret(both, env) == b"inline"
    assert resolve_secret(SecurityConfig(secret_file=str(secret_file)), env) == b"from-file"
    assert resolve_secret(SecurityConfig(), env) == b"from-env"
    assert resolve_secret(SecurityConfig(), {}) is None
    assert resolve_secret(SecurityConfig(), {"SWARMTRAIN_SECRET": ""}) is None


def test_resolve_secret_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"security.secret_file: cannot read '{missing}'"):
        resolve_secret(SecurityConfig(secret_file=str(missing)), {})
    blank = tmp_path / "blank"
    blank.write_text("\n \n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_secret(SecurityConfig(secret_file=str(blank)), {"SWARMTRAIN_SECRET": "x"})


def test_resolve_secret_default_env_is_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SWARMTRAIN_SECRET", "process-env")
    assert os.environ["SWARMTRAIN_SECRET"] == "process-env"
    assert resolve_secret(SecurityConfig()) == b"process-env"


def test_environment_variables_set_config_keys_between_the_file_and_the_flags(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from swarmtrain.config import load_worker_config

    cfg_file = tmp_path / "worker.toml"
    cfg_file.write_text("[training]\nbatch_size = 8\nspeed = 0.5\n")
    monkeypatch.setenv("SWARMTRAIN_TRAINING__BATCH_SIZE", "4")
    monkeypatch.setenv("SWARMTRAIN_NETWORK__COORDINATOR_HOST", "coordinator")
    monkeypatch.setenv("SWARMTRAIN_SECRET", "not-a-config-key")  # no double underscore: ignored
    cfg = load_worker_config(cfg_file)
    assert (cfg.training.batch_size, cfg.training.speed) == (4, 0.5)  # env over file
    assert cfg.network.coordinator_host == "coordinator"
    assert load_worker_config(cfg_file, {"training.batch_size": 2}).training.batch_size == 2  # flags win
    monkeypatch.setenv("SWARMTRAIN_TRAINING__BATCH_SIZ", "4")
    with pytest.raises(ConfigError, match="SWARMTRAIN_TRAINING__BATCH_SIZ"):
        load_worker_config(cfg_file)
    monkeypatch.delenv("SWARMTRAIN_TRAINING__BATCH_SIZ")
    monkeypatch.setenv("SWARMTRAIN_TRAINING__BATCH_SIZE", "many")
    with pytest.raises(ConfigError, match="SWARMTRAIN_TRAINING__BATCH_SIZE"):
        load_worker_config(cfg_file)
