"""The machinery of the config sections: the field metadata (:func:`_opt`), the generic
checker every section runs (:class:`_Section`), and the view of a mode's keys the CLI and
the docs are generated from (:func:`field_infos`)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarmtrain.errors import ConfigError

__all__ = ["FieldInfo", "field_infos", "reused", "section_values"]

_TOML_TYPE_NAMES: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string",
                                    tuple[str, ...]: "array of strings"}


def _opt(default: Any, help: str, *, flag: str | tuple[str, ...] = "", cli: bool = True,
         required: bool = False, metavar: str = "", **checks: Any) -> Any:
    """A config field with its help text, its command-line flag and its checks.

    Args:
        default: the value when no file, variable or flag sets it.
        help: what the key means (the flag's help and the docs' row).
        flag: the flag's name(s), the first one shown; default ``--key-with-dashes``. A
            boolean whose default is True gets ``--no-...`` (setting it False).
        cli: False keeps the key off the command line (``security.secret``: other users of
            the machine would see it in the process list).
        required: a file, a variable or the flag must set it (its default serves only
            sections built in Python).
        metavar: how the flag's help names its value (default: by the type).
        **checks: ``ge``, ``gt``, ``le``, ``lt`` (bounds) or ``choices``; with ``choices``,
            ``pattern=(regex, words)`` allows the strings the regex matches too (``words``
            names them in messages: ``("cuda:[0-9]+", "cuda:N")``).
    """
    names = (flag,) if isinstance(flag, str) and flag else tuple(flag)
    return field(default=default, metadata={"help": help, "flags": names, "cli": cli,
                                            "required": required, "metavar": metavar, **checks})


def reused(section: type, name: str) -> Any:
    """The field ``name`` of ``section`` again (same default, help and checks), for a class
    derived from config sections that needs one more key of another section."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


class _Section:
    """Base of every section: validates each field against its type and metadata."""

    SECTION: ClassVar[str]
    # (a, b) pairs of fields where a must be strictly less than b
    LESS_THAN: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _check_value(type(self), f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        for a, b in self.LESS_THAN:
            if not getattr(self, a) < getattr(self, b):
                raise ConfigError(
                    f"{self.SECTION}.{a} ({getattr(self, a)}) must be less than "
                    f"{self.SECTION}.{b} ({getattr(self, b)})"
                )


_SPECS: dict[type, dict[str, tuple[Any, Mapping[str, Any]]]] = {}


def _field_specs(cls: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """Field name -> (type, metadata) of a section class, resolved once per class; the keys of
    a base marked ``TRAILING`` (the shared server limits) come after the section's own, in
    its tables, its flags' help and its messages."""
    if cls not in _SPECS:
        hints = typing.get_type_hints(cls)
        fields = sorted(dataclasses.fields(cls), key=lambda f: _trailing(cls, f.name))  # stable
        _SPECS[cls] = {f.name: (hints[f.name], f.metadata) for f in fields}
    return _SPECS[cls]


def _trailing(cls: type, name: str) -> bool:
    """Whether the class of ``cls``'s MRO that declares field ``name`` is marked ``TRAILING``."""
    owner = next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))
    return bool(owner.__dict__.get("TRAILING", False))


def _type_name(t: Any) -> str:
    return _TOML_TYPE_NAMES.get(t, getattr(t, "__name__", str(t)))


def _check_type(expected: Any, value: Any) -> tuple[Any, bool]:
    """``(value, ok)``: ints widened for float fields, lists of strings made tuples."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), True
    if expected == tuple[str, ...]:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        return (tuple(value) if ok else value), ok
    origin = typing.get_origin(expected) or expected
    if not isinstance(origin, type):  # e.g. an Optional of a role's own class: not checked here
        return value, True
    return value, isinstance(value, origin) and not (isinstance(value, bool) and origin is not bool)


def _check_value(cls: type, name: str, value: Any) -> Any:
    """Return ``value`` (ints widened to float for float fields) or raise ConfigError."""
    expected, meta = _field_specs(cls)[name]
    key = f"{cls.SECTION}.{name}"  # type: ignore[attr-defined]
    value, ok = _check_type(expected, value)
    if not ok:
        raise ConfigError(
            f"{key}: expected {_type_name(expected)}, got {value!r} ({_type_name(type(value))})"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    choices, pattern = meta.get("choices"), meta.get("pattern")
    if choices is not None and value not in choices and not (
            pattern is not None and isinstance(value, str) and re.fullmatch(pattern[0], value)):
        allowed = ", ".join(repr(c) for c in choices) + (f" or {pattern[1]}" if pattern else "")
        raise ConfigError(
            f"{key} = {value!r} is not allowed; allowed values: {allowed}{_flag_hint(name, meta)}")
    lower = [(meta[op], sym) for op, sym in (("ge", "<="), ("gt", "<")) if op in meta]
    upper = [(meta[op], sym) for op, sym in (("le", "<="), ("lt", "<")) if op in meta]
    in_range = all(value >= b if s == "<=" else value > b for b, s in lower) and all(
        value <= b if s == "<=" else value < b for b, s in upper
    )
    if not in_range:
        text = " ".join([*(f"{b} {s}" for b, s in lower), name, *(f"{s} {b}" for b, s in upper)])
        raise ConfigError(f"{key} = {value!r} is out of range; allowed: {text}{_flag_hint(name, meta)}")
    return value


def _flag_hint(name: str, meta: Mapping[str, Any]) -> str:
    """`` (--flag)``: the flag that sets a config key, for its error messages; "" for a key
    with no flag and for the plain fields of the roles' own classes."""
    if "help" not in meta or not meta.get("cli", True):
        return ""
    flags = meta.get("flags") or ("--" + name.replace("_", "-"),)
    return f" ({flags[0]})"


def section_values(section: Any) -> dict[str, Any]:
    """The fields of a section (or of a class derived from sections) by name, unconverted
    (``dataclasses.asdict`` would turn tuples into lists): ``Derived(**section_values(s))``."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


@dataclass(frozen=True)
class FieldInfo:
    """One key of a mode's config, as the CLI and the docs see it.

    Attributes:
        section: the TOML section (``network``).
        key: the key in it (``port``).
        section_cls: the section's class (checks a value with :meth:`check`).
        type: ``bool``, ``int``, ``float``, ``str`` or ``tuple[str, ...]``.
        default: the value when nothing sets it.
        help: what it means.
        flags: its command-line flag names (the first is the main one); a boolean that
            defaults to True has one ``--no-...`` flag that sets it False.
        cli: whether it has a flag at all.
        required: whether a load must set it.
        choices: the allowed values, or None.
        open_choices: ``choices`` are not all (a pattern allows more, such as ``cuda:N``).
        metavar: how a flag's help names the value ("" = by the type).
    """

    section: str
    key: str
    section_cls: type
    type: Any
    default: Any
    help: str
    flags: tuple[str, ...]
    cli: bool
    required: bool
    choices: tuple[Any, ...] | None
    open_choices: bool
    metavar: str

    @property
    def dotted(self) -> str:
        """``section.key``, the override's name."""
        return f"{self.section}.{self.key}"

    @property
    def allowed(self) -> str:
        """The allowed values in words (``">= 0 and <= 65535"``, ``"'fp32', 'fp16'"``), or ""."""
        meta = _field_specs(self.section_cls)[self.key][1]
        if self.choices is not None:
            pattern = meta.get("pattern")
            return ", ".join(repr(c) for c in self.choices) + (f" or {pattern[1]}" if pattern else "")
        words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        return " and ".join(f"{words[op]} {meta[op]}" for op in ("ge", "gt", "le", "lt") if op in meta)

    def check(self, value: Any) -> Any:
        """``value`` checked (and converted) as this key's, or ConfigError."""
        return _check_value(self.section_cls, self.key, value)


def field_infos(cls: type, sections: typing.Iterable[str] | None = None) -> Iterator[FieldInfo]:
    """Every key of the config class ``cls`` (a value of :data:`MODES`), section by section,
    or of the ``sections`` named only."""
    for name, section_cls in _sections(cls).items():
        if sections is not None and name not in sections:
            continue
        for key, (typ, meta) in _field_specs(section_cls).items():
            default = next(f.default for f in dataclasses.fields(section_cls)  # type: ignore[arg-type]
                           if f.name == key)
            flags = meta.get("flags") or (f"--{key.replace('_', '-')}",)
            if typ is bool and default is True:
                flags = tuple(f"--no-{f[2:]}" for f in flags)
            choices = meta.get("choices")
            yield FieldInfo(name, key, section_cls, typ, default, meta.get("help", ""), flags,
                            meta.get("cli", True), meta.get("required", False),
                            tuple(choices) if choices is not None else None, "pattern" in meta,
                            meta.get("metavar", ""))


def _sections(cls: type) -> dict[str, type[_Section]]:
    """Section name -> section class of a whole config class (e.g. :class:`PeerConfig`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
