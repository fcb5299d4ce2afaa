"""Where a stage computes: its layers on a device, its answers back on the CPU.

A stage's layers and inputs live on one ``torch.device`` (see :mod:`swarmtrain.core.devices`);
what it sends is moved to the CPU (:func:`to_cpu`), as the wire carries CPU tensors only. A
backward recomputes its forward with the random state that forward ran with
(:class:`RngState`): the CPU generator's and, on CUDA or MPS, the device's, which draws the
dropout masks there. Only the CPU path is exercised by the tests (no accelerator on the
machines this project is tested on); the CUDA and MPS calls are PyTorch's documented
``torch.cuda.get_rng_state``/``set_rng_state`` and ``torch.mps`` equivalents.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["RngState", "to_cpu"]


@dataclass(frozen=True)
class RngState:
    """The random state a forward ran with: the CPU generator's and the device's (CUDA and
    MPS draw dropout masks from their own generators)."""

    cpu: torch.Tensor
    device: torch.device
    on_device: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """The random state now, of the CPU and of ``device``."""
        return cls(torch.get_rng_state(), device, _device_rng(device))

    @classmethod
    @contextlib.contextmanager
    def drawing(cls, device: torch.device) -> Iterator[RngState]:
        """The random state now, with the process's generators held until the block (the
        forward that draws from them) is done, so that a replay of it draws the same."""
        with _DRAWS:
            yield cls.capture(device)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run a block with this random state, then put the generators back as they were."""
        with _DRAWS:
            cpu_now, device_now = torch.get_rng_state(), _device_rng(self.device)
            torch.set_rng_state(self.cpu)
            _set_device_rng(self.device, self.on_device)
            try:
                yield
            finally:
                torch.set_rng_state(cpu_now)
                _set_device_rng(self.device, device_now)


#: the generators are the process's, not a stage's: stages that share a process (threads)
#: would otherwise draw between another's capture and its forward, or during its replay (set
#: and put back around the recompute), and a recomputed forward would drop other layers or
#: dropout masks than the forward whose output went on. Held by a training forward from its
#: capture to its end, and by a replay.
_DRAWS = threading.RLock()


def _device_rng(device: torch.device) -> torch.Tensor | None:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "mps":
        return torch.mps.get_rng_state()
    return None


def _set_device_rng(device: torch.device, state: torch.Tensor | None) -> None:
    if state is None:
        return
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type == "mps":
        torch.mps.set_rng_state(state)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU (itself if it is there already): the wire carries CPU tensors only."""
    return t if t.device.type == "cpu" else t.to("cpu")
