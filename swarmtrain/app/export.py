"""Model export: the trained weights as one plain safetensors file.

The file maps every key of the model's ``state_dict()`` to its tensor — parameters, frozen
ones, persistent buffers (BatchNorm statistics, ``num_batches_tracked``) and each name of a
tied weight (GPT-2's ``lm_head.weight`` as well as ``transformer.wte.weight``) — so it
loads with ``strict=True`` into a fresh instance of the plain PyTorch model, with no
swarmtrain code in the way::

    from safetensors.torch import load_file
    from swarmtrain.tasks import load_task

    model = load_task("digits").build_model()
    model.load_state_dict(load_file("model.safetensors"))

Its safetensors metadata says ``format = swarmtrain-model``, the ``task`` and the
``version`` (updates applied) it was taken at.

A sharded cluster (``swarmtrain coordinator --shard i/S``) has S parameter servers, each
holding and exporting its own slice of the parameters (its file's metadata adds
``param_shard = i/S`` and the ``partition`` fingerprint). :func:`merge_exports` (``swarmtrain
export A B ...``) puts the S slices (exported files or checkpoints, in any order) back into
one file of the whole model, after checking that they are the S slices of one partition.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as serialise_safetensors
from torch import nn

from swarmtrain.core.checkpoint import MODEL_PREFIX, Checkpoint, load_checkpoint, newest_valid_checkpoint
from swarmtrain.errors import CheckpointError
from swarmtrain.fsutil import FileWriteError, write_atomic

__all__ = ["MODEL_PREFIX", "ModelSlice", "export_checkpoint", "export_model", "merge_exports",
           "read_model_source", "write_model_file"]

"""Checkpoint tensors of the model's parameters are named ``model/<parameter name>``."""


def write_model_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], *,
                     task: str = "", version: int = 0, shard: Mapping[str, Any] | None = None,
                     extra: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` to ``path`` as safetensors, atomically (:func:`~swarmtrain.fsutil.write_atomic`).

    Args:
        path: the file to write (its directory is created); an existing file is replaced.
        tensors: parameter name -> tensor (copied to contiguous CPU tensors).
        task: the task name, kept in the file's metadata.
        version: updates applied, kept in the file's metadata.
        shard: for one parameter server's slice, its ``{"index", "count", "partition"}``
            (kept as ``param_shard = "i/S"`` and ``partition``).
        extra: more metadata entries.

    Returns:
        The path written.

    Raises:
        CheckpointError: if there are no tensors or the file cannot be written.
    """
    if not tensors:
        raise CheckpointError("there are no model tensors to export")
    out = Path(path)
    plain = {n: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
             for n, t in tensors.items()}
    metadata = {"format": "swarmtrain-model", "task": task, "version": str(version), **(extra or {})}
    if shard:
        metadata["param_shard"] = f"{int(shard['index'])}/{int(shard['count'])}"
        metadata["partition"] = str(shard["partition"])
    data = serialise_safetensors(plain, metadata=metadata)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write the model to {out}: {exc}; choose another path") from exc
    try:
        write_atomic(out, data)
    except FileWriteError as exc:
        raise CheckpointError(f"cannot export the model: {exc}") from exc
    return out


def export_model(model: nn.Module, path: str | os.PathLike[str], *, task: str = "",
                 version: int = 0, shard: Mapping[str, Any] | None = None) -> Path:
    """Write ``model``'s whole ``state_dict`` to ``path`` (see :func:`write_model_file`)."""
    return write_model_file(path, model.state_dict(), task=task, version=version, shard=shard)


def _load_checkpoint_source(src: Path) -> Checkpoint:
    if (src / "meta.json").exists():
        return load_checkpoint(src)
    newest, skipped = newest_valid_checkpoint(src)
    if newest is None:
        found = f" ({len(skipped)} unusable: {skipped[0][1]})" if skipped else ""
        raise CheckpointError(f"no valid checkpoint in {src}{found}; expected ckpt-* directories "
                              "written by `swarmtrain coordinator --checkpoint-interval N`")
    return newest


@dataclass
class ModelSlice:
    """A model's tensors as one export or checkpoint holds them: the whole model, or one
    parameter server's slice (``shard`` = index, count and partition fingerprint)."""

    source: Path
    tensors: dict[str, torch.Tensor]
    task: str
    version: int
    shard: dict[str, Any] | None

    def describe(self) -> str:
        if self.shard is None:
            return f"{self.source} (a whole model, version {self.version})"
        return (f"{self.source} (parameter server {self.shard['index']}/{self.shard['count']}, "
                f"version {self.version})")


def read_model_source(source: str | os.PathLike[str]) -> ModelSlice:
    """The model tensors of ``source``: a file ``swarmtrain`` exported, a checkpoint
    directory (``ckpt-*``) or a checkpoint store (its newest valid checkpoint).

    Raises:
        CheckpointError: nothing usable there, saying what was expected.
    """
    src = Path(source)
    if src.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(src), framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{src} is not a safetensors file swarmtrain exported: {exc}") from exc
        if meta.get("format") != "swarmtrain-model":
            raise CheckpointError(f"{src} is not a model file swarmtrain exported (its metadata "
                                  f"says format {meta.get('format')!r}, not 'swarmtrain-model')")
        shard = None
        if "param_shard" in meta:
            try:
                index, count = (int(x) for x in meta["param_shard"].split("/"))
            except ValueError:
                raise CheckpointError(f"{src}: param_shard {meta['param_shard']!r} is not i/S") from None
            shard = {"index": index, "count": count, "partition": meta.get("partition", "")}
        try:
            version = int(meta.get("version", "0"))
        except ValueError:
            version = 0
        return ModelSlice(src, tensors, meta.get("task", ""), version, shard)
    if not src.is_dir():
        raise CheckpointError(f"{src} is neither a model file nor a directory; give a file "
                              "`swarmtrain` exported, the coordinator's checkpoint directory "
                              "(--checkpoint-dir) or one ckpt-* directory in it")
    ckpt = _load_checkpoint_source(src)
    return ModelSlice(ckpt.path or src, *_model_of(ckpt))


def _model_of(ckpt: Checkpoint) -> tuple[dict[str, torch.Tensor], str, int, dict[str, Any] | None]:
    """A checkpoint's model tensors (``model/`` names stripped), task, step and server place."""
    tensors = {name[len(MODEL_PREFIX):]: t for name, t in ckpt.tensors.items()
               if name.startswith(MODEL_PREFIX)}
    if not tensors:
        raise CheckpointError(f"checkpoint {ckpt.path} holds no model/ tensors")
    shard = ckpt.meta.get("param_shard")
    place = dict(shard) if isinstance(shard, dict) else None
    return tensors, str(ckpt.meta.get("task", "")), ckpt.step, place


def export_checkpoint(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> tuple[Path, Checkpoint]:
    """Export the model of a checkpoint to ``out``.

    Args:
        source: a checkpoint directory (``ckpt-000000000100``, holding ``meta.json``), or a
            checkpoint store (the coordinator's ``--checkpoint-dir``), whose newest valid
            checkpoint is used.
        out: the safetensors file to write.

    Returns:
        The path written and the checkpoint exported.

    Raises:
        CheckpointError: no valid checkpoint at ``source``, it holds no model tensors, or
            ``out`` cannot be written.
    """
    src = Path(source)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; give the coordinator's checkpoint "
                              "directory (--checkpoint-dir) or one ckpt-* directory in it")
    ckpt = _load_checkpoint_source(src)
    tensors, task, step, shard = _model_of(ckpt)
    return write_model_file(out, tensors, task=task, version=step, shard=shard), ckpt


def merge_exports(sources: Sequence[str | os.PathLike[str]],
                  out: str | os.PathLike[str]) -> tuple[Path, list[ModelSlice]]:
    """Write the whole model of a sharded cluster to ``out`` from its servers' slices.

    Args:
        sources: one source per parameter server, in any order: each a file ``swarmtrain``
            exported or a checkpoint (see :func:`read_model_source`). A single source of a
            whole model is exported as it is.
        out: the safetensors file to write; its ``version`` is the lowest of the slices'
            (each server counts its own updates), ``versions`` lists them by server.

    Returns:
        The path written and the slices read, by server index.

    Raises:
        CheckpointError: the sources are not the S slices of one partition (a server
            missing or given twice, slices of another partition or task, a whole model among
            slices, a tensor in two slices), naming what is wrong and what to give.
    """
    if not sources:
        raise CheckpointError("give at least one exported model file or checkpoint")
    slices = [read_model_source(s) for s in sources]
    if len(slices) == 1 and slices[0].shard is None:
        one = slices[0]
        return write_model_file(out, one.tensors, task=one.task, version=one.version), slices
    whole = [s for s in slices if s.shard is None]
    if whole:
        raise CheckpointError(
            f"{whole[0].describe()} is a whole model, the others are parameter servers' slices: "
            "give the slices of one sharded cluster only")
    first = slices[0].shard
    assert first is not None
    count, partition = int(first["count"]), first.get("partition")
    for s in slices:
        assert s.shard is not None
        if int(s.shard["count"]) != count or s.shard.get("partition") != partition:
            raise CheckpointError(
                f"{s.describe()} is a slice of another cluster than {slices[0].describe()} "
                f"(partition {s.shard.get('partition')} of {s.shard['count']} servers, not "
                f"{partition} of {count}): give the slices of one cluster")
    tasks = {s.task for s in slices if s.task}
    if len(tasks) > 1:
        raise CheckpointError(f"the slices are of different tasks ({', '.join(sorted(tasks))})")
    by_index: dict[int, ModelSlice] = {}
    for s in slices:
        assert s.shard is not None
        i = int(s.shard["index"])
        if i in by_index:
            raise CheckpointError(f"parameter server {i}/{count} is given twice: "
                                  f"{by_index[i].source} and {s.source}")
        by_index[i] = s
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise CheckpointError(
            f"{'the slices of parameter servers' if len(missing) > 1 else 'the slice of parameter server'} "
            f"{', '.join(f'{i}/{count}' for i in missing)} {'are' if len(missing) > 1 else 'is'} "
            f"missing: give all {count} "
            f"(each server's export or checkpoint directory), e.g. `swarmtrain export "
            f"{' '.join(f'<server {i}>' for i in range(count))} --out model.safetensors`")
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for i in range(count):
        for name, t in by_index[i].tensors.items():
            if name in merged:
                raise CheckpointError(f"tensor {name!r} is in the slices of servers {owner[name]} "
                                      f"and {i}: these are not slices of one partition")
            merged[name] = t
            owner[name] = i
    ordered = [by_index[i] for i in range(count)]
    versions = ",".join(str(s.version) for s in ordered)
    path = write_model_file(out, merged, task=next(iter(tasks), ""),
                            version=min(s.version for s in ordered),
                            extra={"versions": versions, "merged_from": f"{count} parameter servers"})
    return path, ordered
