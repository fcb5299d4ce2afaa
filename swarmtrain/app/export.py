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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save as serialise_safetensors
from torch import nn

from swarmtrain.core.checkpoint import MODEL_PREFIX, Checkpoint, load_checkpoint, newest_valid_checkpoint
from swarmtrain.errors import CheckpointError
from swarmtrain.fsutil import FileWriteError, write_atomic

__all__ = ["MODEL_PREFIX", "export_checkpoint", "export_model", "write_model_file"]

"""Checkpoint tensors of the model's parameters are named ``model/<parameter name>``."""


def write_model_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], *,
                     task: str = "", version: int = 0) -> Path:
    """Write ``tensors`` to ``path`` as safetensors, atomically (:func:`~swarmtrain.fsutil.write_atomic`).

    Args:
        path: the file to write (its directory is created); an existing file is replaced.
        tensors: parameter name -> tensor (copied to contiguous CPU tensors).
        task: the task name, kept in the file's metadata.
        version: updates applied, kept in the file's metadata.

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
    data = serialise_safetensors(plain, metadata={"format": "swarmtrain-model", "task": task,
                                                  "version": str(version)})
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
                 version: int = 0) -> Path:
    """Write ``model``'s whole ``state_dict`` to ``path`` (see :func:`write_model_file`)."""
    return write_model_file(path, model.state_dict(), task=task, version=version)


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
    if (src / "meta.json").exists():
        ckpt = load_checkpoint(src)
    else:
        newest, skipped = newest_valid_checkpoint(src)
        if newest is None:
            found = f" ({len(skipped)} unusable: {skipped[0][1]})" if skipped else ""
            raise CheckpointError(f"no valid checkpoint in {src}{found}; expected ckpt-* directories "
                                  "written by `swarmtrain coordinator --checkpoint-interval N`")
        ckpt = newest
    tensors = {name[len(MODEL_PREFIX):]: t for name, t in ckpt.tensors.items()
               if name.startswith(MODEL_PREFIX)}
    if not tensors:
        raise CheckpointError(f"checkpoint {ckpt.path} holds no model/ tensors")
    return write_model_file(out, tensors, task=str(ckpt.meta.get("task", "")), version=ckpt.step), ckpt
