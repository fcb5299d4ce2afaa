"""Loading a mode's config: defaults, then the TOML file, then ``SWARMTRAIN_<SECTION>__<KEY>``
environment variables, then overrides (CLI flags, Python keywords); and the secret and TLS
files a security section names."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from swarmtrain.config.peer import PeerConfig
from swarmtrain.config.pipeline import PipelineConfig, StageConfig
from swarmtrain.config.ps import CoordinatorConfig, WorkerConfig
from swarmtrain.config.schema import (
    _check_value,
    _did_you_mean,
    _field_specs,
    _Section,
    _sections,
    field_infos,
)
from swarmtrain.config.sections import ClientSecurityConfig, SecurityConfig
from swarmtrain.errors import ConfigError

if TYPE_CHECKING:
    from swarmtrain.transport.tls import TLSConfig

__all__ = ["ENV_PREFIX", "MODES", "SECRET_ENV_VAR", "apply_kwargs", "load_config", "load_coordinator_config",
           "load_peer_config", "load_pipeline_config", "load_stage_config", "load_worker_config",
           "overrides_from_kwargs", "resolve_secret", "resolve_tls", "to_dict", "with_overrides"]

SECRET_ENV_VAR = "SWARMTRAIN_SECRET"
_REDACTED = "<redacted>"

#: every mode's whole config, by the command that reads it
MODES: dict[str, type] = {"coordinator": CoordinatorConfig, "worker": WorkerConfig, "peer": PeerConfig,
                          "stage": StageConfig, "pipeline": PipelineConfig}


AnyConfig = CoordinatorConfig | WorkerConfig | PeerConfig | StageConfig | PipelineConfig
C = TypeVar("C", bound=AnyConfig)
_Layers = dict[str, dict[str, tuple[Any, str]]]  # section -> key -> (value, where it came from)


def load_coordinator_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> CoordinatorConfig:
    """Load a coordinator config: defaults, then the TOML file, then ``overrides``.

    Args:
        path: TOML file, or None for defaults only.
        overrides: dotted keys (``"network.port"``) to values; None values are ignored.
            String values for non-string keys are parsed (``"7200"``, ``"true"``).

    Raises:
        ConfigError: the file is missing or malformed, or a section, key, type or value is
            not allowed; the message names the file or override and the key.
    """
    return _load(CoordinatorConfig, path, overrides)


def load_worker_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> WorkerConfig:
    """Load a worker config; as :func:`load_coordinator_config`."""
    return _load(WorkerConfig, path, overrides)


def load_peer_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PeerConfig:
    """Load a peer config; as :func:`load_coordinator_config`."""
    return _load(PeerConfig, path, overrides)


def load_stage_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> StageConfig:
    """Load a stage config; as :func:`load_coordinator_config`. ``stage.stage`` and
    ``stage.stages`` must be set (by the file, a variable or an override)."""
    return _load(StageConfig, path, overrides)


def load_pipeline_config(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PipelineConfig:
    """Load a pipeline trainer's config; as :func:`load_coordinator_config`."""
    return _load(PipelineConfig, path, overrides)


def load_config(
    cls: type[C], path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> C:
    """Load the config of class ``cls`` (a value of :data:`MODES`); as
    :func:`load_coordinator_config`."""
    return _load(cls, path, overrides)


def with_overrides(cfg: C, overrides: Mapping[str, Any]) -> C:
    """A copy of ``cfg`` with dotted-key ``overrides`` applied and validated."""
    layers: _Layers = {}
    for section, values in to_dict(cfg, redact_secrets=False).items():
        layers[section] = {k: (v, "config") for k, v in values.items()}
    _apply_overrides(type(cfg), layers, overrides)
    return _build(type(cfg), layers)


def overrides_from_kwargs(cfg: AnyConfig, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Turn Python keyword arguments into dotted overrides for ``cfg``'s type.

    A plain name is a key or the name of a key's flag (``--`` dropped, ``-`` as ``_``) in
    one of the sections: ``min_workers=2`` is ``training.min_workers``, and a worker's
    ``host="10.0.0.2"`` (its flag ``--host``) is ``network.coordinator_host``. A dotted name
    (``**{"network.port": 7200}``) passes through unchanged.

    Raises:
        ConfigError: a plain name matches no key, or keys in several sections.
    """
    names = _keyword_names(type(cfg))
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if "." in name:
            out[name] = value
            continue
        owners = sorted(names.get(name, ()))
        if not owners:
            known = [i.key for i in field_infos(type(cfg))]
            raise ConfigError(
                f"keyword argument {name!r} is not a config key{_did_you_mean(name, names)}; "
                f"allowed: {', '.join(known)}"
            )
        if len(owners) > 1:
            raise ConfigError(
                f"keyword argument {name!r} is a key of several sections; give one of "
                f"{', '.join(owners)} as a dotted key"
            )
        out[owners[0]] = value
    return out


def _keyword_names(cls: type) -> dict[str, set[str]]:
    """Keyword name -> the dotted keys it names: each key's own name, and its flags' names
    (not a ``--no-...`` flag's: ``no_announce=True`` would read as the opposite)."""
    names: dict[str, set[str]] = {}
    for info in field_infos(cls):
        negated = info.type is bool and info.default is True
        flags = () if negated or not info.cli else info.flags
        for name in (info.key, *(f[2:].replace("-", "_") for f in flags)):
            names.setdefault(name, set()).add(info.dotted)
    return names


def apply_kwargs(cfg: C, kwargs: Mapping[str, Any]) -> C:
    """``cfg`` with Python keyword overrides applied (:func:`overrides_from_kwargs`): what the
    ``**overrides`` of ``Coordinator(...)`` and ``Worker(...)`` do."""
    return with_overrides(cfg, overrides_from_kwargs(cfg, kwargs)) if kwargs else cfg


def to_dict(cfg: AnyConfig, *, redact_secrets: bool = True) -> dict[str, dict[str, Any]]:
    """``cfg`` as a nested plain dict ``{section: {key: value}}``, e.g. for checkpoints.

    Args:
        redact_secrets: replace a non-empty ``security.secret`` with a placeholder, so the
            dict can be written to checkpoints, logs and status pages.
    """
    out = {name: {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
           for name, section in dataclasses.asdict(cfg).items()}  # a list key as TOML's array
    if redact_secrets and out["security"]["secret"]:
        out["security"]["secret"] = _REDACTED
    return out


def resolve_secret(sec: ClientSecurityConfig, env: Mapping[str, str] = os.environ) -> bytes | None:
    """The cluster secret: ``secret``, else ``secret_file``'s content, else $SWARMTRAIN_SECRET.

    Returns:
        The secret as bytes, or None when none of the three is set.

    Raises:
        ConfigError: ``secret_file`` is set but cannot be read or is empty.
    """
    if sec.secret:
        return sec.secret.encode("utf-8")
    if sec.secret_file:
        try:
            with open(sec.secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ConfigError(
                f"security.secret_file: cannot read {sec.secret_file!r}: {e.strerror or e}"
            ) from e
        if not secret:
            raise ConfigError(f"security.secret_file: {sec.secret_file!r} is empty")
        return secret
    from_env = env.get(SECRET_ENV_VAR, "")
    return from_env.encode("utf-8") if from_env else None


def resolve_tls(sec: ClientSecurityConfig) -> TLSConfig | None:
    """The TLS files of ``sec``, or None when TLS is off (``tls_cert``, ``tls_key``, ``tls_ca`` empty).

    Raises:
        ConfigError: a file named by ``tls_cert``, ``tls_key`` or ``tls_ca`` does not exist.
    """
    from swarmtrain.transport.tls import KEYS_HELP, TLSConfig

    if not sec.tls_cert:
        return None
    for key in SecurityConfig.TLS_KEYS:
        path = getattr(sec, key)
        if not os.path.isfile(path):
            raise ConfigError(f"security.{key}: {path!r} is not a file; {KEYS_HELP}")
    return TLSConfig(cert=Path(sec.tls_cert), key=Path(sec.tls_key), ca=Path(sec.tls_ca))


def _load(
    cls: type[C], path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None
) -> C:
    layers: _Layers = {name: {} for name in _sections(cls)}
    if path is not None:
        _apply_file(cls, layers, os.fspath(path))
    _apply_env(cls, layers, os.environ)
    _apply_overrides(cls, layers, overrides or {})
    _check_required(cls, layers)
    return _build(cls, layers)


def _check_required(cls: type, layers: _Layers) -> None:
    """Refuse a load that leaves a required key (``stage.stage``) at its Python default."""
    missing = [i for i in field_infos(cls) if i.required and i.key not in layers[i.section]]
    if missing:
        raise ConfigError(
            f"{', '.join(i.dotted for i in missing)} must be set: give "
            f"{' and '.join(i.flags[0] for i in missing)} (or set them in the config file's "
            f"[{missing[0].section}] section)")


#: ``SWARMTRAIN_<SECTION>__<KEY>=value`` sets ``[section] key`` (over the file, under flags)
ENV_PREFIX = "SWARMTRAIN_"


def _apply_env(cls: type, layers: _Layers, env: Mapping[str, str]) -> None:
    """Config keys from environment variables (containers): ``SWARMTRAIN_TRAINING__BATCH_SIZE=4``
    is ``[training] batch_size = 4``. Only names with a double underscore are config keys
    (``SWARMTRAIN_SECRET`` and the like are not); an unknown one is an error naming it."""
    sections = _sections(cls)
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        section, _, key = var[len(ENV_PREFIX):].lower().partition("__")
        where = f"environment variable {var}"
        if section not in sections:
            raise ConfigError(f"{where}: no config section {section!r}; sections are "
                              f"{', '.join(sections)} (SWARMTRAIN_<SECTION>__<KEY>)")
        _set_key(sections, layers, section, key, value, where)


def _apply_file(cls: type, layers: _Layers, path: str) -> None:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path!r} not found") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    sections = _sections(cls)
    for name, table in doc.items():
        if name not in sections:
            raise ConfigError(
                f"{path}: unknown section [{name}]{_did_you_mean(name, sections)}; "
                f"allowed sections: {', '.join(sections)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{name}] must be a table (a section), got {table!r}")
        for key, value in table.items():
            _check_key(sections[name], name, key, path)
            layers[name][key] = (value, path)


def _apply_overrides(cls: type, layers: _Layers, overrides: Mapping[str, Any]) -> None:
    sections = _sections(cls)
    for dotted, value in overrides.items():
        if value is None:
            continue
        name, _, key = dotted.partition(".")
        where = f"override {dotted!r}"
        if name not in sections or not key:
            raise ConfigError(
                f"{where}: expected 'section.key' with section one of: {', '.join(sections)}"
            )
        _set_key(sections, layers, name, key, value, where)


def _set_key(sections: dict[str, type[_Section]], layers: _Layers, section: str, key: str, value: Any,
             where: str) -> None:
    """Check that ``section.key`` exists, parse a string ``value`` for its type, and layer it
    (named ``where`` in any later error)."""
    _check_key(sections[section], section, key, where)
    expected = _field_specs(sections[section])[key][0]
    layers[section][key] = (_parse_string(value, expected), where)


def _parse_string(value: Any, expected: Any) -> Any:
    """CLI strings for non-string keys: "7200" -> 7200, "true" -> True, "a,b" -> ("a", "b")
    for a list; else unchanged."""
    if not isinstance(value, str) or expected is str:
        return value
    if expected == tuple[str, ...]:
        return tuple(part.strip() for part in value.split(",") if part.strip())
    text = value.strip().lower()
    if expected is bool:
        return {"true": True, "false": False}.get(text, value)
    try:
        return expected(text)
    except ValueError:
        return value


def _check_key(section_cls: type[_Section], name: str, key: str, where: str) -> None:
    allowed = list(_field_specs(section_cls))
    if key not in allowed:
        raise ConfigError(
            f"{where}: unknown key '{name}.{key}'{_did_you_mean(key, allowed)}; "
            f"allowed keys in [{name}]: {', '.join(allowed)}"
        )


def _build(cls: type[C], layers: _Layers) -> C:
    sections = _sections(cls)
    built: dict[str, Any] = {}
    for name, section_cls in sections.items():
        values = layers.get(name, {})
        kwargs = {}
        for key, (value, where) in values.items():
            try:
                kwargs[key] = _check_value(section_cls, key, value)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        try:
            built[name] = section_cls(**kwargs)
        except ConfigError as e:
            origins = sorted({where for _, where in values.values()})
            raise ConfigError(f"{', '.join(origins) or 'defaults'}: {e}") from None
    return cls(**built)
