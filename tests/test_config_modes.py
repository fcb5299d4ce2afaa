"""One config tree for every mode: each key has exactly one flag (generated from its metadata,
with the key's default), [stage], [pipeline] and [model] load like the other sections, and
every server's limits come from one section through one builder."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.app import cli
from swarmtrain.config import (
    MODES,
    CoordinatorConfig,
    PeerConfig,
    PipelineConfig,
    ServerLimitsConfig,
    StageConfig,
    StageLimitsConfig,
    WorkerConfig,
    field_infos,
    load_config,
    load_pipeline_config,
    load_stage_config,
    overrides_from_kwargs,
    to_dict,
)
from swarmtrain.config.loading import _keyword_names
from swarmtrain.errors import ConfigError
from swarmtrain.transport.endpoints import ServerLimits

pytestmark = pytest.mark.timeout(60)

#: flags a mode's command needs before its config loads (keys whose load must set them)
REQUIRED_ARGS = {"stage": ["--stage", "0", "--stages", "1"]}


def _mode_parser(mode: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[mode]
    return parser


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _toml(cfg_dict: dict[str, dict[str, Any]]) -> str:
    return "".join(f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
                   for section, keys in cfg_dict.items())


# ---------------------------------------------------------------- flags generated from the fields


@pytest.mark.parametrize("mode", list(MODES))
def test_every_key_of_the_mode_has_exactly_one_flag_whose_default_is_the_keys(mode: str) -> None:
    parser = _mode_parser(mode)
    flag_keys = cli.config_flag_keys(parser)
    actions = {a.dest: a for a in parser._actions}
    for info in field_infos(MODES[mode]):
        dests = [d for d, dotted in flag_keys.items() if dotted == info.dotted]
        if not info.cli:
            assert info.dotted == "security.secret" and dests == [], info.dotted  # the one exception
            continue
        assert len(dests) == 1, f"{mode}: {info.dotted} has flags {dests}"
        action = actions[dests[0]]
        assert action.default == info.default, (mode, info.dotted, action.default, info.default)
        assert tuple(action.option_strings) == info.flags
        assert info.flags[0] in parser.format_help(), (mode, info.flags[0])
    # and with no flags given, the command's config is the defaults (the flags override nothing)
    args = cli.build_parser().parse_args([mode, *REQUIRED_ARGS.get(mode, [])])
    loaded = load_config(MODES[mode], None, cli.config_overrides(args))
    defaults = MODES[mode]()
    assert to_dict(loaded) == to_dict(defaults) | (
        {"stage": {**to_dict(defaults)["stage"], "stage": 0, "stages": 1}} if mode == "stage" else {})


def test_the_existing_flags_keep_their_names_and_keys() -> None:
    expected = {
        "coordinator": {"--host": "network.host", "--port": "network.port", "--lr": "training.learning_rate",
                        "--learning-rate": "training.learning_rate",
                        "--eval-interval": "training.eval_interval_sec",
                        "--checkpoint-dir": "checkpointing.directory", "--compression": "compression.type",
                        "--checkpoint-interval": "checkpointing.interval", "--export": "checkpointing.export",
                        "--data": "data.path", "--log-level": "logging.level", "--run-log": "logging.run_log",
                        "--insecure": "security.insecure", "--tls-ca": "security.tls_ca",
                        "--min-workers": "training.min_workers", "--max-steps": "training.max_steps",
                        "--http-port": "ops.http_port", "--topk-ratio": "compression.topk_ratio"},
        "worker": {"--host": "network.coordinator_host", "--port": "network.coordinator_port",
                   "--threads": "hardware.num_threads", "--shard": "data.shard_index",
                   "--reconnect-delay": "network.reconnect_delay_sec", "--worker-id": "training.worker_id",
                   "--device": "training.device", "--message-compute-ms": "training.message_compute_ms"},
        "peer": {"--run": "peer.run", "--peers": "peer.peers", "--wire": "training.wire",
                 "--threads": "hardware.num_threads", "--inner-seconds": "training.inner_seconds"},
        "stage": {"--stage": "stage.stage", "--lr": "stage.learning_rate", "--threads": "stage.threads",
                  "--sync-with": "stage.sync_with", "--no-announce": "stage.announce",
                  "--max-request-mb": "stage.max_request_mb", "--context": "model.context",
                  "--keep-checkpoints": "stage.keep_checkpoints", "--http-port": "ops.http_port"},
        "pipeline": {"--route": "pipeline.route", "--discover-timeout": "pipeline.discover_timeout",
                     "--stage-wait": "pipeline.stage_wait", "--run-log": "logging.run_log",
                     "--n-layers": "model.n_layers", "--task": "model.task"},
    }
    for mode, flags in expected.items():
        parser = _mode_parser(mode)
        keys = cli.config_flag_keys(parser)
        by_flag = {s: keys[a.dest] for a in parser._actions if a.dest in keys for s in a.option_strings}
        for flag, dotted in flags.items():
            assert by_flag.get(flag) == dotted, (mode, flag, by_flag.get(flag))


def test_a_flag_overrides_the_environment_which_overrides_the_file(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stage.toml"
    path.write_text("[stage]\nstage = 1\nstages = 3\nport = 7400\nsync_every = 4\n")
    assert load_stage_config(path).stage.port == 7400
    monkeypatch.setenv("SWARMTRAIN_STAGE__PORT", "7500")
    assert load_stage_config(path).stage.port == 7500
    args = cli.build_parser().parse_args(["stage", "--config", str(path), "--port", "7600"])
    cfg = load_stage_config(args.config, cli.config_overrides(args))
    assert (cfg.stage.port, cfg.stage.stage, cfg.stage.stages, cfg.stage.sync_every) == (7600, 1, 3, 4)


def test_a_repeatable_flag_replaces_the_files_list(tmp_path: Path) -> None:
    path = tmp_path / "stage.toml"
    path.write_text('[stage]\nstage = 0\nstages = 2\nsync_with = ["10.0.0.9:7300"]\n')
    assert load_stage_config(path).stage.sync_with == ("10.0.0.9:7300",)
    args = cli.build_parser().parse_args(["stage", "--config", str(path), "--sync-with", "a:1",
                                          "--sync-with", "b:2"])
    assert load_stage_config(path, cli.config_overrides(args)).stage.sync_with == ("a:1", "b:2")


def test_a_flag_value_out_of_range_is_refused_with_the_keys_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["pipeline", "--microbatches", "0"], "pipeline.microbatches = 0 is out of range"),
                       (["coordinator", "--port", "70000"], "allowed: 0 <= port <= 65535"),
                       (["stage", "--stage", "0", "--stages", "1", "--device", "tpu"],
                        "stage.device = 'tpu' is not allowed")):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(argv)
        assert exc.value.code == 2
        assert says in capsys.readouterr().err, argv


def test_a_stage_may_name_one_gpu_of_several() -> None:
    """``cuda:N`` for a stage, in a file or by flag (the other devices are listed choices)."""
    from swarmtrain.app.pipeline_session import StageOptions

    assert StageOptions(stage=0, stages=2, device="cuda:1").device == "cuda:1"
    args = cli.build_parser().parse_args(["stage", "--stage", "0", "--stages", "2", "--device", "cuda:0"])
    assert load_stage_config(None, cli.config_overrides(args)).stage.device == "cuda:0"
    with pytest.raises(ConfigError, match=r"'cuda', 'mps' or cuda:N \(--device\)"):
        load_stage_config(None, {"stage.stage": 0, "stage.stages": 2, "stage.device": "cuda:x"})


def test_a_stage_needs_its_place_in_the_pipeline_from_a_flag_or_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stage.stage, stage.stages must be set: give --stage and --stages"):
        load_stage_config(None, {})
    path = tmp_path / "stage.toml"
    path.write_text("[stage]\nstages = 2\n")
    with pytest.raises(ConfigError, match=r"stage.stage must be set: give --stage"):
        load_stage_config(path)
    assert load_stage_config(path, {"stage.stage": 1}).stage.stage == 1
    with pytest.raises(ConfigError, match="--stage 2 --stages 2: need 0 <= stage < stages"):
        load_stage_config(path, {"stage.stage": 2})


# ---------------------------------------------------------------- [stage], [pipeline] and [model] files


def _changed(cls: type) -> dict[str, dict[str, Any]]:
    """A value other than the default for every key of ``cls`` (one that passes its checks)."""
    out: dict[str, dict[str, Any]] = {}
    for info in field_infos(cls):
        value: Any
        if info.choices is not None:
            value = next(c for c in info.choices if c != info.default)
        elif info.type is bool:
            value = not info.default
        elif info.type is str:
            value = {"layers": "0:2", "cluster": "lab-1", "route": "10.0.0.2:7300;10.0.0.3:7300",
                     "checkpoint_dir": "ckpt", "tls_cert": "", "tls_key": "", "tls_ca": ""}.get(
                info.key, f"x-{info.key}")
        elif info.type == tuple[str, ...]:
            value = ["10.0.0.4:7300", "10.0.0.5:7300"]
        elif info.key in ("stage", "stages"):
            value = {"stage": 1, "stages": 3}[info.key]
        else:
            value = info.default + 1
            value = value if value != 65536 else 7
        out.setdefault(info.section, {})[info.key] = value
    return out


@pytest.mark.parametrize("cls", [StageConfig, PipelineConfig])
def test_stage_and_pipeline_configs_round_trip_through_toml(tmp_path: Path, cls: type) -> None:
    values = _changed(cls)
    path = tmp_path / "a.toml"
    path.write_text(_toml(values))
    cfg = load_config(cls, path)
    for section, keys in values.items():
        for key, value in keys.items():
            got = getattr(getattr(cfg, section), key)
            assert got == (tuple(value) if isinstance(value, list) else value), (section, key, got)
    again = tmp_path / "b.toml"
    again.write_text(_toml(to_dict(cfg, redact_secrets=False)))
    assert load_config(cls, again) == cfg


def test_a_bad_key_in_stage_or_pipeline_says_what_was_meant(tmp_path: Path) -> None:
    path = tmp_path / "stage.toml"
    path.write_text("[stage]\nstage = 0\nsync_evry = 2\n")
    says = r"unknown key 'stage.sync_evry' \(did you mean 'sync_every'\?\)"
    with pytest.raises(ConfigError, match=says) as info:
        load_stage_config(path)
    assert str(info.value).startswith(f"{path}: ") and "allowed keys in [stage]" in str(info.value)
    path.write_text("[pipelin]\nchunks = 2\n")
    with pytest.raises(ConfigError, match=r"unknown section \[pipelin\] \(did you mean 'pipeline'\?\)"):
        load_pipeline_config(path)
    path.write_text("[pipeline]\nschedule = 'later'\n")
    with pytest.raises(ConfigError, match="pipeline.schedule = 'later' is not allowed; allowed values: "
                                          "'sync', 'async'"):
        load_pipeline_config(path)


def test_the_pipeline_command_reports_a_bad_config_file(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pipeline.toml"
    path.write_text("[pipeline]\nmicrobatch = 10\n")
    assert cli.main(["pipeline", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "swarmtrain pipeline: error:" in err and "did you mean 'microbatches'?" in err


# ---------------------------------------------------------------- keyword overrides and limits


def test_keyword_overrides_take_keys_and_flag_names() -> None:
    worker, coord = WorkerConfig(), CoordinatorConfig()
    assert overrides_from_kwargs(worker, {"host": "10.0.0.2", "port": 7101, "threads": 2}) == {
        "network.coordinator_host": "10.0.0.2", "network.coordinator_port": 7101, "hardware.num_threads": 2}
    assert overrides_from_kwargs(coord, {"lr": 1e-3, "checkpoint_dir": "c", "min_workers": 2}) == {
        "training.learning_rate": 1e-3, "checkpointing.directory": "c", "training.min_workers": 2}
    with pytest.raises(ConfigError, match=r"'min_worker' is not a config key \(did you mean 'min_workers'"):
        overrides_from_kwargs(coord, {"min_worker": 2})
    assert overrides_from_kwargs(StageConfig(), {"stages": 2, "d_model": 32, "announce": False}) == {
        "stage.stages": 2, "model.d_model": 32, "stage.announce": False}
    with pytest.raises(ConfigError, match="'no_announce' is not a config key"):  # it would read backwards
        overrides_from_kwargs(StageConfig(), {"no_announce": True})
    for mode, cls in MODES.items():  # no plain name is ambiguous in any mode (docs/python-api.md)
        assert {n: d for n, d in _keyword_names(cls).items() if len(d) > 1} == {}, mode


def test_every_server_takes_its_limits_from_one_section_through_one_builder() -> None:
    from swarmtrain.app.pipeline_session import StageOptions
    from swarmtrain.roles.peer.backend import PeerOptions
    from swarmtrain.roles.stage.stage import StageServerConfig

    names = [f.name for f in dataclasses.fields(ServerLimitsConfig)]
    for cls in (CoordinatorConfig().network, PeerConfig().network, StageConfig().stage, PeerOptions(),
                StageServerConfig(), StageOptions()):
        assert isinstance(cls, ServerLimitsConfig), type(cls)
        for name in names:  # the same field object's metadata: defined once
            mine = next(f for f in dataclasses.fields(cls) if f.name == name)
            theirs = next(f for f in dataclasses.fields(ServerLimitsConfig) if f.name == name)
            assert mine.metadata is theirs.metadata or mine.metadata == theirs.metadata
    limits = dict(max_connections=9, max_connections_per_address=3, max_failed_auth=2)
    assert PeerOptions(**limits).server_limits() == ServerLimits(9, 3, 2)
    assert StageServerConfig(**limits).server_limits() == ServerLimits(9, 3, 2)
    coord = load_config(CoordinatorConfig, None, {f"network.{k}": v for k, v in limits.items()}
                        | {"network.ctl_slots": 1})
    assert coord.network.server_limits() == ServerLimits(9, 3, 2, ctl_slots=1)
    assert issubclass(StageServerConfig, StageLimitsConfig) and issubclass(StageOptions, StageLimitsConfig)


def test_the_roles_take_a_config_and_leave_loading_to_the_caller(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``Coordinator(...)`` and ``Worker(...)`` read no file and no variable: the caller loads
    (``load_coordinator_config``), the keywords adjust what it passes."""
    import torch

    from swarmtrain.config import load_coordinator_config, load_worker_config
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.roles.ps.worker import Worker

    monkeypatch.setenv("SWARMTRAIN_HOME", str(tmp_path))  # the worker's node key goes there
    monkeypatch.setenv("SWARMTRAIN_TRAINING__MIN_WORKERS", "3")
    model = torch.nn.Linear(2, 1)
    assert Coordinator(model, learning_rate=1e-3).config.training.min_workers == 1
    loaded = Coordinator(model, load_coordinator_config(), learning_rate=1e-3, max_steps=7).config
    assert (loaded.training.min_workers, loaded.training.max_steps) == (3, 7)
    monkeypatch.delenv("SWARMTRAIN_TRAINING__MIN_WORKERS")
    monkeypatch.setenv("SWARMTRAIN_TRAINING__BATCH_SIZE", "5")
    data = [(torch.zeros(1, 2), torch.zeros(1, 1))]
    worker = Worker(model, torch.nn.functional.mse_loss, data, host="10.0.0.2", insecure=True)
    assert (worker.config.network.coordinator_host, worker.config.training.batch_size) == ("10.0.0.2", 0)
    from_env = Worker(model, torch.nn.functional.mse_loss, data, load_worker_config())
    assert from_env.config.training.batch_size == 5
