"""swarmtrain: train one PyTorch model across many unequal machines on a network.

The Python API for people with their own training script::

    from swarmtrain import Coordinator, Worker

    Worker(model, loss_fn, data_loader, coordinator_host="10.0.0.2").run()

The public names are imported on first use, so ``import swarmtrain`` stays light (it does
not import torch); see docs/python-api.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Coordinator", "SwarmError", "Task", "Worker", "__version__", "load_task"]

if TYPE_CHECKING:
    from swarmtrain.errors import SwarmError
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.roles.ps.worker import Worker
    from swarmtrain.tasks import Task, load_task

# public name -> the module that defines it
_LAZY = {
    "Coordinator": "swarmtrain.roles.ps.coordinator",
    "Worker": "swarmtrain.roles.ps.worker",
    "Task": "swarmtrain.tasks",
    "load_task": "swarmtrain.tasks",
    "SwarmError": "swarmtrain.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
