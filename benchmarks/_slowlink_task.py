"""The model of ``bench_slowlink.py`` as a swarmtrain task, for ``--task _slowlink_task:factory``.

The conformance zoo's Hugging Face GPT-2 case (``tests/conformance/zoo.py``: tied embeddings,
byte vocabulary, stdlib source bytes, held-out next-byte loss), made larger: 4 layers of width
160, 1.27 M parameters, above the size (``FUSE_MAX_NUMEL``, 2^20) from which the coordinator
pools and bounds its copies of the weights and answers may wait for one. The case's build,
loss, data and evaluation are used as they are; this only gives them the Task interface.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmtrain.tasks import Task, TaskData, seeded_module
from tests.conformance.harness import Case
from tests.conformance.zoo import CASES, gpt2

N_LAYER, N_EMBD = 4, 160
LR = 1.5e-3
BATCH = 16


def case(steps: int) -> Case:
    """The GPT-2 case at this benchmark's size, ``steps`` updates of :data:`BATCH` sequences."""
    build = functools.partial(gpt2, n_layer=N_LAYER, n_embd=N_EMBD)
    return dataclasses.replace(CASES["gpt2"], name="gpt2-1.3m", build=lambda seed: seeded_module(build, seed),
                               lr=LR, batch_size=BATCH, steps=steps)


class CaseTask(Task):
    """A conformance case behind the Task interface (the case's loss and held-out evaluation)."""

    name = "gpt2-1.3m"
    default_learning_rate = LR
    default_batch_size = BATCH
    primary_metric = "loss"
    higher_is_better = False

    def __init__(self) -> None:
        self.case = case(steps=0)

    def build_model(self, seed: int = 0) -> nn.Module:
        return self.case.build(seed)

    def load_data(self, path: str | None = None) -> TaskData:
        return self.case.data()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.case.loss(model, batch)

    def evaluate(self, model: nn.Module, data: TaskData, max_samples: int | None = None) -> dict[str, float]:
        return self.case.evaluate(model, data)  # (the case's own held-out set, as in one process)

    def sample_bytes_estimate(self) -> int:
        return 1 << 20


def factory() -> Task:
    return CaseTask()
