"""The configuration of every mode: one tree of frozen dataclasses.

Each TOML section is a frozen dataclass; each field carries its help text, its allowed values
and its command-line flag in the field metadata (:func:`_opt`), and one generic checker
validates every field of every section (also when a section is built directly in Python).
The CLI flags (``swarmtrain.app.cli``), the Python keyword overrides
(:func:`overrides_from_kwargs`) and docs/config.md (:func:`render_config_doc`) are all
generated from that metadata. Precedence: defaults < file < ``SWARMTRAIN_<SECTION>__<KEY>``
environment variables < overrides (CLI flags, as dotted keys: ``{"network.port": 7200}``).

The modes and their sections (:data:`MODES`):

- ``coordinator`` (:class:`CoordinatorConfig`) and ``worker`` (:class:`WorkerConfig`): the
  parameter server;
- ``peer`` (:class:`PeerConfig`): peer mode;
- ``stage`` (:class:`StageConfig`) and ``pipeline`` (:class:`PipelineConfig`): pipeline mode.

Servers of every mode share one limits section (:class:`ServerLimitsConfig`, whose keys sit
in the mode's ``[network]`` or ``[stage]``) and one builder of the transport's
``ServerLimits`` from it (:meth:`ServerLimitsConfig.server_limits`).
"""

from __future__ import annotations

from swarmtrain.config.docs import DOC_BEGIN, DOC_END, config_reference, render_config_doc
from swarmtrain.config.loading import (
    ENV_PREFIX,
    MODES,
    SECRET_ENV_VAR,
    AnyConfig,
    apply_kwargs,
    load_config,
    load_coordinator_config,
    load_peer_config,
    load_pipeline_config,
    load_stage_config,
    load_worker_config,
    overrides_from_kwargs,
    resolve_secret,
    resolve_tls,
    to_dict,
    with_overrides,
)
from swarmtrain.config.peer import (
    PeerConfig,
    PeerDataConfig,
    PeerDiscoveryConfig,
    PeerNetworkConfig,
    PeerTrainingConfig,
)
from swarmtrain.config.pipeline import (
    ModelConfig,
    PipelineConfig,
    PipelineTrainingConfig,
    StageConfig,
    StageLimitsConfig,
    StageServingConfig,
)
from swarmtrain.config.ps import (
    CoordinatorConfig,
    CoordinatorDataConfig,
    CoordinatorNetworkConfig,
    CoordinatorTrainingConfig,
    WorkerConfig,
    WorkerDataConfig,
    WorkerNetworkConfig,
    WorkerTrainingConfig,
)
from swarmtrain.config.schema import FieldInfo, field_infos, reused, section_values
from swarmtrain.config.sections import (
    CheckpointingConfig,
    ClientSecurityConfig,
    CompressionConfig,
    ConsoleLoggingConfig,
    HardwareConfig,
    LoggingConfig,
    OpsConfig,
    SecurityConfig,
    ServerLimitsConfig,
)

__all__ = [
    "DOC_BEGIN",
    "DOC_END",
    "ENV_PREFIX",
    "MODES",
    "SECRET_ENV_VAR",
    "AnyConfig",
    "CheckpointingConfig",
    "ClientSecurityConfig",
    "CompressionConfig",
    "ConsoleLoggingConfig",
    "CoordinatorConfig",
    "CoordinatorDataConfig",
    "CoordinatorNetworkConfig",
    "CoordinatorTrainingConfig",
    "FieldInfo",
    "HardwareConfig",
    "LoggingConfig",
    "ModelConfig",
    "OpsConfig",
    "PeerConfig",
    "PeerDataConfig",
    "PeerDiscoveryConfig",
    "PeerNetworkConfig",
    "PeerTrainingConfig",
    "PipelineConfig",
    "PipelineTrainingConfig",
    "SecurityConfig",
    "ServerLimitsConfig",
    "StageConfig",
    "StageLimitsConfig",
    "StageServingConfig",
    "WorkerConfig",
    "WorkerDataConfig",
    "WorkerNetworkConfig",
    "WorkerTrainingConfig",
    "apply_kwargs",
    "config_reference",
    "field_infos",
    "load_config",
    "load_coordinator_config",
    "load_peer_config",
    "load_pipeline_config",
    "load_stage_config",
    "load_worker_config",
    "overrides_from_kwargs",
    "render_config_doc",
    "resolve_secret",
    "resolve_tls",
    "reused",
    "section_values",
    "to_dict",
    "with_overrides",
]
