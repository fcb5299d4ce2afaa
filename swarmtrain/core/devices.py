"""Where a machine computes: ``--device auto|cpu|cuda|mps`` (config ``training.device``).

The model and every batch are moved to the device; tensors go back to the CPU only for the
wire (codecs, frames and checkpoints are CPU-only). ``auto`` takes CUDA if torch sees a GPU,
else Apple's MPS if available, else the CPU. Only the CPU path is exercised by the tests here
(no accelerator on the machines this project is tested on); the CUDA and MPS paths follow the
PyTorch documentation's idiom (``torch.device``, ``Module.to``, ``Tensor.to(non_blocking)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from swarmtrain.errors import ConfigError

__all__ = ["DEVICE_CHOICES", "batch_to", "resolve_device"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` for a ``training.device`` value.

    Raises:
        ConfigError: the name is unknown, or names an accelerator this machine lacks.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"training.device = {name!r}, but torch sees no CUDA GPU on this machine "
                              "(torch.cuda.is_available() is False); use 'auto' or 'cpu', or install "
                              "a CUDA build of torch")
        return torch.device(name)
    if name == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError("training.device = 'mps', but Apple's MPS is not available here; "
                              "use 'auto' or 'cpu'")
        return torch.device("mps")
    raise ConfigError(f"training.device = {name!r} is not one of {', '.join(DEVICE_CHOICES)}")


def batch_to(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists and dicts) on ``device``;
    anything else unchanged. A no-op on the CPU for CPU tensors."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        to = getattr(batch, "to", None)
        if callable(to):  # e.g. a Hugging Face BatchEncoding
            return to(device)
        return {k: batch_to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        items = [batch_to(v, device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [batch_to(v, device) for v in batch]
    return batch
