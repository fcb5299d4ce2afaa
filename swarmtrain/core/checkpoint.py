"""Checkpoints on disk: tensors in safetensors, metadata in JSON, written atomically.

Layout of a checkpoint directory (the ``[checkpointing] directory`` of the config)::

    <directory>/
        ckpt-000000000100/
            tensors.safetensors   every tensor (weights, optimizer state), flat names
            meta.json             format version, step, size + SHA-256 of the tensors file,
                                  name/dtype/shape of every tensor, and the caller's metadata
        ckpt-000000000200/
        .tmp-ckpt-...             only while a save is in progress (or after a crash)

A save writes both files into a fresh ``.tmp-ckpt-*`` directory, flushes and fsyncs them,
fsyncs that directory, renames it to ``ckpt-{step:012d}`` and fsyncs the parent, so a
checkpoint is either complete or absent. Any failure removes the temporary directory and
raises :class:`~swarmtrain.errors.CheckpointError`; existing checkpoints are not touched.
Saving a step that already exists replaces it: the old directory is first renamed to a
``.tmp-ckpt-*`` name, so a crash between the two renames loses only that step and the
previous checkpoints are still there. Only after a successful save are older checkpoints
pruned, keeping the newest ``keep`` (checkpoints found corrupt by :meth:`latest` do not
count and are deleted with the old ones; checkpoints with a higher step than the one just
saved, left by an abandoned run, are never pruned and are replaced when training reaches
their step again). Stale ``.tmp-ckpt-*`` directories are removed when a store is opened,
so only one process may write to a directory at a time.

Loading verifies everything before trusting anything: meta.json parses and has a known
format version, the tensors file has the recorded size and SHA-256, it parses as
safetensors (never pickle), and its tensors match the recorded names, dtypes and shapes.
Tensors come back bit-identical, dtype included. Caller metadata comes back as JSON gives
it (tuples as lists, dictionary keys as strings).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import load as parse_safetensors  # JSON header + raw bytes: no pickle
from safetensors.torch import save as serialise_safetensors

from swarmtrain.errors import CheckpointError, ConfigError
from swarmtrain.fsutil import fsync_directory, write_new_file

__all__ = [
    "MODEL_PREFIX",
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointStore",
    "FailureStreak",
    "adam_state_from_tensors",
    "adam_state_to_tensors",
    "load_checkpoint",
]

FORMAT_VERSION = 1
_FORMAT = "swarmtrain-checkpoint"
_TENSORS_FILE = "tensors.safetensors"
_META_FILE = "meta.json"
_TMP_PREFIX = ".tmp-ckpt-"
_NAME_RE = re.compile(r"ckpt-(\d{12})")
_MAX_STEP = 10**12 - 1
_ADAM_PREFIX = "adam/"
# model weights inside a checkpoint are stored under this prefix (what `swarmtrain export` reads)
MODEL_PREFIX = "model/"
_HINT = "free disk space, fix the permissions, or point [checkpointing] directory elsewhere"

log = logging.getLogger("swarmtrain.core.checkpoint")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint as loaded from disk.

    Attributes:
        step: the training step it was taken at.
        tensors: every tensor, flat names (``model/fc1.weight``, ``adam/exp_avg/fc1.weight``).
        meta: the caller's JSON metadata (config, version, optimizer scalars...).
        path: the checkpoint directory it was loaded from, if any.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path | None = None


class CheckpointStore:
    """A directory of checkpoints, the newest ``keep`` of which are kept.

    Args:
        directory: where checkpoints live; created on the first save.
        keep: how many checkpoints to keep, at least 1.

    Raises:
        ConfigError: if ``keep`` is below 1.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        if keep < 1:
            raise ConfigError(f"checkpoint keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.last_skipped: builtins.list[tuple[Path, str]] = []
        self._known_bad: set[Path] = set()
        self._remove_stale_temps()

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
        """Write a checkpoint atomically, then prune old ones.

        Args:
            step: training step, 0 <= step < 10**12.
            tensors: flat name -> tensor; any dtype, layout or device (copied to CPU).
            meta: JSON-serialisable metadata.

        Returns:
            The checkpoint directory.

        Raises:
            CheckpointError: on bad arguments or any I/O failure (nothing partial is left
                behind and existing checkpoints are unchanged).
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
            raise CheckpointError(
                f"checkpoint step must be an int in [0, {_MAX_STEP}], got {step!r}"
            )
        data, index = _serialise_tensors(tensors)
        envelope = {
            "format": _FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "tensors_file": {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            },
            "tensors": index,
            "meta": dict(meta),
        }
        try:
            meta_text = json.dumps(envelope, indent=1, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {exc}") from exc

        final = self.directory / f"ckpt-{step:012d}"
        tmp = self.directory / f"{_TMP_PREFIX}{step:012d}-{os.getpid()}-{secrets.token_hex(4)}"
        aside: Path | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            write_new_file(tmp / _TENSORS_FILE, data)
            write_new_file(tmp / _META_FILE, meta_text.encode())
            fsync_directory(tmp)
            if final.exists():
                aside = tmp.with_name(f"{tmp.name}-replaced")
                os.replace(final, aside)
            os.replace(tmp, final)
            fsync_directory(self.directory)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if aside is not None and not final.exists():
                self._put_back(aside, final)
            raise CheckpointError(
                f"could not write checkpoint for step {step} to {self.directory}: {exc}; {_HINT}"
            ) from exc
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self._known_bad.discard(final)
        self._prune(step)
        return final

    def latest(self) -> Checkpoint | None:
        """Load the newest valid checkpoint, skipping (and logging) unusable newer ones.

        Returns:
            The checkpoint, or None if there is no valid one. ``self.last_skipped`` lists
            the ``(path, reason)`` of every checkpoint skipped on the way.
        """
        ckpt, self.last_skipped = newest_valid_checkpoint(self.directory)
        self._known_bad.update(path for path, _ in self.last_skipped)
        if ckpt is not None and self.last_skipped:
            log.warning("resuming from older checkpoint %s (step %d)", ckpt.path, ckpt.step)
        elif ckpt is None and self.last_skipped:
            log.warning("no valid checkpoint in %s; starting from scratch", self.directory)
        return ckpt

    def list(self) -> builtins.list[Path]:
        """Return the checkpoints present (valid or not), oldest first."""
        return list_checkpoints(self.directory)

    def load(self, path: str | os.PathLike[str]) -> Checkpoint:
        """Load and verify one checkpoint directory.

        Raises:
            CheckpointError: if it is missing, incomplete, corrupt or of an unknown format;
                the message names the path and the reason.
        """
        return load_checkpoint(path)

    def _prune(self, saved_step: int) -> None:
        older = [p for p in self.list() if int(p.name[5:]) < saved_step]
        good = [p for p in older if p not in self._known_bad]
        keep = set(good[max(0, len(good) - self.keep + 1) :])
        for path in older:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
                self._known_bad.discard(path)

    @staticmethod
    def _put_back(aside: Path, final: Path) -> None:
        try:
            os.replace(aside, final)
        except OSError as exc:
            log.error("could not move the replaced checkpoint %s back to %s: %s", aside, final, exc)

    def _remove_stale_temps(self) -> None:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if name.startswith(_TMP_PREFIX):
                log.info("removing unfinished checkpoint %s", self.directory / name)
                shutil.rmtree(self.directory / name, ignore_errors=True)


class FailureStreak:
    """Failed checkpoint attempts of one writer (the coordinator, a stage), said the way an
    operator wants them: the first of a streak as an ERROR with the reason, each later one as
    a WARNING with the count and the last good checkpoint, and the first success after them.

    Args:
        what: how the log names the checkpoints ("checkpoint", "stage 2 checkpoint").
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0  # every failed attempt
        self.in_a_row = 0  # since the last good one

    def failed(self, exc: Exception, *, at: str, retry: str, last_good: str) -> int:
        """Count and log a failed attempt at ``at`` (e.g. "version 10"); how many in a row."""
        self.failures += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            log.error("%s at %s failed, training goes on with the last good one%s: %s", self.what, at,
                      retry, exc)
        else:
            log.warning("%s still failing (%d attempts in a row, last good checkpoint: %s): %s", self.what,
                        self.in_a_row, last_good, exc)
        return self.in_a_row

    def succeeded(self) -> None:
        """A checkpoint was written: the streak, if any, is over (and said to be)."""
        if self.in_a_row:
            log.info("%ss are written again after %d failed attempt(s)", self.what, self.in_a_row)
        self.in_a_row = 0


def list_checkpoints(directory: Path) -> list[Path]:
    """The checkpoint directories in ``directory`` (valid or not), oldest first.

    Raises:
        CheckpointError: the directory exists but cannot be listed.
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {directory}: {exc}") from exc
    return [directory / n for n in sorted(n for n in names if _NAME_RE.fullmatch(n))]


def newest_valid_checkpoint(directory: Path) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint in ``directory`` that loads and verifies (None if none does), and
    the ``(path, reason)`` of every newer one skipped. Reads only: nothing is cleaned up, so it
    is safe while a coordinator writes there."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return _load_verified(path), skipped
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, exc)
    return None, skipped


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Load and verify one checkpoint directory without opening a store (so nothing in its
    parent directory is touched: safe while a coordinator writes there).

    Raises:
        CheckpointError: if it is missing, incomplete, corrupt or of an unknown format;
            the message names the path and the reason.
    """
    path = Path(path)
    try:
        return _load_verified(path)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path} is unusable: {exc}") from exc


def _serialise_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, Any]]:
    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"checkpoint tensors must map str to Tensor, got {name!r}")
        t = tensor.detach().to("cpu")
        # safetensors wants dense, contiguous tensors that share no storage.
        storage = t.untyped_storage().data_ptr() if t.numel() else 0
        if not t.is_contiguous() or (storage and storage in seen_storages):
            t = t.clone(memory_format=torch.contiguous_format)
            storage = t.untyped_storage().data_ptr()
        seen_storages.add(storage)
        prepared[name] = t
    try:
        data = serialise_safetensors(prepared)
    except (ValueError, TypeError, safetensors.SafetensorError) as exc:
        raise CheckpointError(f"cannot serialise checkpoint tensors: {exc}") from exc
    return data, _describe(prepared)


def _load_verified(path: Path) -> Checkpoint:
    try:
        meta_text = (path / _META_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{_META_FILE} is missing (incomplete checkpoint)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {_META_FILE}: {exc}") from exc
    try:
        envelope = json.loads(meta_text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{_META_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(envelope, dict) or envelope.get("format") != _FORMAT:
        raise CheckpointError(f"{_META_FILE} is not a swarmtrain checkpoint description")
    if envelope.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"unknown format version {envelope.get('format_version')!r} "
            f"(this swarmtrain reads version {FORMAT_VERSION})"
        )
    try:
        step, index, meta = envelope["step"], envelope["tensors"], envelope["meta"]
        size, digest = int(envelope["tensors_file"]["size"]), envelope["tensors_file"]["sha256"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{_META_FILE} lacks a valid field: {exc!r}") from exc
    if not isinstance(step, int) or not isinstance(meta, dict):
        raise CheckpointError(f"{_META_FILE} has a malformed step or metadata")
    match = _NAME_RE.fullmatch(path.name)
    if match is not None and int(match.group(1)) != step:
        raise CheckpointError(f"{_META_FILE} says step {step} but the directory is {path.name}")
    try:
        data = (path / _TENSORS_FILE).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {_TENSORS_FILE}: {exc}") from exc
    if len(data) != size:
        raise CheckpointError(f"{_TENSORS_FILE} is {len(data)} bytes, expected {size} (truncated?)")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{_TENSORS_FILE} fails its SHA-256 check (corrupt)")
    try:
        tensors = parse_safetensors(data)
    except (safetensors.SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{_TENSORS_FILE} does not parse as safetensors: {exc}") from exc
    if _describe(tensors) != index:
        raise CheckpointError(f"the tensors do not match their names/dtypes/shapes in {_META_FILE}")
    return Checkpoint(step=step, tensors=dict(tensors), meta=meta, path=path)


def _describe(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The JSON index of a checkpoint's tensors: name -> dtype and shape."""
    return {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in tensors.items()
    }


def adam_state_to_tensors(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an Adam/AdamW optimizer's state into tensors and JSON metadata, keyed by name.

    Args:
        optimizer: the optimizer (any whose per-parameter state is tensors and scalars).
        names: one name per parameter, in the order of ``optimizer.param_groups`` flattened
            (for one group over ``model.parameters()``: the ``model.named_parameters()`` names).

    Returns:
        ``(tensors, meta)``: tensors named ``adam/{state key}/{param name}`` (the live state,
        not copies: save them before the next step), and meta with the optimizer class,
        the param groups' hyperparameters and any non-tensor state.

    Raises:
        ValueError: if ``names`` does not have one entry per parameter.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(names) or len(set(names)) != len(names):
        raise ValueError(f"need {len(params)} distinct parameter names, got {len(names)} names")
    name_of = {id(p): n for p, n in zip(params, names)}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, name in zip(params, names):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_ADAM_PREFIX}{key}/{name}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    groups = []
    for group in optimizer.param_groups:
        hyper = {
            k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"
        }
        hyper["params"] = [name_of[id(p)] for p in group["params"]]
        groups.append(hyper)
    meta = {"optimizer": type(optimizer).__name__, "param_groups": groups, "scalar_state": scalars}
    return tensors, meta


def adam_state_from_tensors(
    optimizer: torch.optim.Optimizer,
    names: list[str],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
) -> None:
    """Restore state saved by :func:`adam_state_to_tensors` into a fresh optimizer.

    Continuing afterwards gives bit-identical results to never having stopped. Tensors
    not starting with ``adam/`` are ignored, so a whole checkpoint's tensors can be passed.
    The state tensors are copied, so the optimizer never aliases ``tensors``.

    Raises:
        CheckpointError: if the saved state does not fit this optimizer (class, groups or
            parameter names differ).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(names):
        raise CheckpointError(f"need {len(params)} parameter names, got {len(names)}")
    index_of = {n: i for i, n in enumerate(names)}
    saved_groups = meta.get("param_groups")
    if meta.get("optimizer") != type(optimizer).__name__ or not isinstance(saved_groups, list):
        raise CheckpointError(
            f"checkpoint holds {meta.get('optimizer')!r} state, not {type(optimizer).__name__}"
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved_groups)} param groups, optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        if key.startswith(_ADAM_PREFIX):
            state_key, _, name = key[len(_ADAM_PREFIX) :].partition("/")
            if name not in index_of:
                raise CheckpointError(
                    f"checkpoint has optimizer state for unknown parameter {name!r}"
                )
            state.setdefault(index_of[name], {})[state_key] = tensor.clone()
    for name, values in dict(meta.get("scalar_state", {})).items():
        if name not in index_of:
            raise CheckpointError(f"checkpoint has optimizer state for unknown parameter {name!r}")
        state.setdefault(index_of[name], {}).update(values)
    groups = []
    position = 0
    for current, saved in zip(optimizer.param_groups, saved_groups):
        current_names = names[position : position + len(current["params"])]
        position += len(current["params"])
        if sorted(saved.get("params", [])) != sorted(current_names):
            raise CheckpointError(
                "checkpoint param groups hold other parameters than the optimizer's"
            )
        group = {
            k: tuple(v) if isinstance(current.get(k), tuple) else v
            for k, v in saved.items()
            if k != "params"
        }
        group["params"] = [index_of[n] for n in current_names]
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
