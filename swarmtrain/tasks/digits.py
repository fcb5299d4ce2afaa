"""``digits``: classify scikit-learn's 8x8 handwritten digits with a small MLP.

The data (1797 images, 64 features 0..16, 10 classes) ships with scikit-learn, so the task
needs no network. Plain single-process Adam reaches about 97% held-out accuracy in seconds,
which makes it the smoke test of every training mode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.errors import TaskError
from swarmtrain.tasks.base import (
    Task,
    TaskData,
    TensorPairDataset,
    evaluation_mode,
    seeded_module,
)
from swarmtrain.tasks.jsonl import parse_digits_record, read_jsonl

__all__ = ["DIGITS_CLASSES", "DIGITS_FEATURES", "DIGITS_MAX_VALUE", "DigitsTask"]

DIGITS_FEATURES = 64  # 8x8 pixels
DIGITS_CLASSES = 10
DIGITS_MAX_VALUE = 16.0  # pixel intensities run 0..16; features are divided by this
_SPLIT_SEED = 1234  # fixed shuffle, so every machine gets the same split
_HELDOUT_FRACTION = 0.2
_EVAL_CHUNK = 512


class DigitsTask(Task):
    """MLP 64-128-64-10 on scikit-learn's digits; metric: held-out accuracy."""

    name = "digits"
    default_learning_rate = 3e-3
    default_batch_size = 32
    primary_metric = "accuracy"
    higher_is_better = True

    def build_model(self, seed: int = 0) -> nn.Module:
        """A 64-128-64-10 ReLU MLP, initialised deterministically from ``seed``."""
        return seeded_module(
            lambda: nn.Sequential(
                nn.Linear(DIGITS_FEATURES, 128),
                nn.ReLU(),
                nn.Linear(128, 64),
                nn.ReLU(),
                nn.Linear(64, DIGITS_CLASSES),
            ),
            seed,
        )

    def load_data(self, path: str | None = None) -> TaskData:
        """scikit-learn's digits, or a JSONL file of ``{"x": [64 numbers 0..16], "y": 0..9}``.

        Features are divided by 16; rows are shuffled with a fixed seed and the last 20%
        are held out.

        Raises:
            TaskError: the JSONL file is unreadable, malformed, or has fewer than 2 records.
        """
        if path:
            records = read_jsonl(path, parse_digits_record)
            if len(records) < 2:
                raise TaskError(
                    f"data file {path!r} has {len(records)} record; digits needs at least 2 "
                    "(one to train on, one to hold out)"
                )
            x = torch.tensor([r[0] for r in records], dtype=torch.float32)
            y = torch.tensor([r[1] for r in records], dtype=torch.int64)
        else:
            x, y = _load_sklearn_digits()
        x = x / DIGITS_MAX_VALUE
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
        x, y = x[order], y[order]
        n_heldout = max(1, int(len(y) * _HELDOUT_FRACTION))
        n_train = len(y) - n_heldout
        return TaskData(
            train=TensorPairDataset(x[:n_train], y[:n_train]),
            heldout=TensorPairDataset(x[n_train:], y[n_train:]),
        )

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy of ``model`` on ``(features, labels)``."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(
        self, model: nn.Module, data: TaskData, max_samples: int | None = None
    ) -> dict[str, float]:
        """Held-out ``{"accuracy", "loss"}`` on the first ``max_samples`` rows (all if None)."""
        n = len(data.heldout)
        if max_samples is not None:
            n = min(n, max(1, max_samples))
        total_loss = 0.0
        correct = 0
        with evaluation_mode(model):
            for lo in range(0, n, _EVAL_CHUNK):
                idx = torch.arange(lo, min(n, lo + _EVAL_CHUNK))
                x, y = data.heldout.get_batch(idx)
                logits = model(x)
                total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
        return {"accuracy": correct / n, "loss": total_loss / n}

    def sample_bytes_estimate(self) -> int:
        """About 4 KiB: the MLP's activations and gradients for one row, with slack."""
        floats = DIGITS_FEATURES + 128 + 64 + DIGITS_CLASSES
        return floats * 4 * 4  # fp32; forward + backward, x2 slack for autograd buffers


def _load_sklearn_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # imported lazily: sklearn is slow to import

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    return x, y
