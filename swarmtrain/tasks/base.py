"""The task abstraction: what to train (model, loss, data, evaluation), with no distribution.

A :class:`Task` bundles a deterministic model factory, a loss, a dataset and an evaluation.
Roles (coordinator, worker, peer, stage) wrap a task; the task never knows it is distributed.
A :class:`Shard` is the contiguous slice of a training set one worker draws its batches from.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from swarmtrain.errors import ConfigError, TaskError

__all__ = [
    "Dataset",
    "Shard",
    "Task",
    "TaskData",
    "TensorPairDataset",
    "evaluation_mode",
    "seeded_module",
]


@runtime_checkable
class Dataset(Protocol):
    """A finite, indexed source of samples."""

    def __len__(self) -> int:
        """Number of samples (valid indices are ``0 .. len - 1``)."""
        ...

    def get_batch(self, indices: torch.Tensor) -> Any:
        """Gather the samples at ``indices`` (int64, 1-D) into what :meth:`Task.loss` takes."""
        ...


@dataclass
class TaskData:
    """The two splits of a task's data."""

    train: Dataset  # what workers shard and train on
    heldout: Dataset  # what evaluate() measures; never trained on


class Task(ABC):
    """A model factory, a loss, a dataset and an evaluation.

    Subclasses set the class attributes below and implement the abstract methods. Models are
    plain ``nn.Module``; every method must behave the same on every machine given the same
    arguments (a coordinator and its workers build the model independently).
    """

    name: str  # "digits", "textlm", or the user's own name
    default_learning_rate: float  # a good Adam learning rate (used when the config says 0)
    default_batch_size: int  # a sensible per-step batch on a laptop-class CPU
    primary_metric: str  # key of evaluate()'s result used for progress and targets
    higher_is_better: bool  # direction of primary_metric

    @abstractmethod
    def build_model(self, seed: int = 0) -> nn.Module:
        """Build the model with parameters that are a pure function of ``seed``.

        Args:
            seed: initialisation seed; the same seed gives bit-identical parameters.

        Returns:
            A freshly initialised model in train mode.
        """

    @abstractmethod
    def load_data(self, path: str | None = None) -> TaskData:
        """Load the task's data and split it deterministically.

        Args:
            path: optional JSONL file replacing the built-in data.

        Returns:
            The train and held-out splits.

        Raises:
            TaskError: the data cannot be found or a record is malformed.
        """

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of ``model`` on ``batch`` (a scalar tensor that ``backward()`` works on)."""

    @abstractmethod
    def evaluate(
        self, model: nn.Module, data: TaskData, max_samples: int | None = None
    ) -> dict[str, float]:
        """Measure ``model`` on the held-out split, without gradients.

        The model is put in eval mode for the measurement and its previous mode is restored.

        Args:
            model: the model to measure.
            data: the task's data; only ``data.heldout`` is used.
            max_samples: evaluate on at most this many held-out samples (task default if None).

        Returns:
            Metrics by name; always includes ``"loss"`` and :attr:`primary_metric`.
        """

    @abstractmethod
    def sample_bytes_estimate(self) -> int:
        """Rough bytes of memory one training sample needs (activations and their gradients)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


@dataclass
class TensorPairDataset:
    """A dataset of ``(inputs, targets)`` rows held in two tensors with the same first dim."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            raise TaskError(
                f"inputs have {self.inputs.shape[0]} rows but targets have {self.targets.shape[0]}"
            )

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at ``indices`` as ``(inputs, targets)``."""
        return self.inputs[indices], self.targets[indices]


def seeded_module(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Call ``factory`` with the global torch RNG seeded, leaving the caller's RNG untouched.

    Default ``nn`` initialisers draw from the global generator; forking it makes the
    parameters a pure function of ``seed`` without side effects on the caller.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Run a block with ``model.eval()`` and no gradients, then restore the previous mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class Shard:
    """Contiguous range ``[start, stop)`` of a dataset's indices that one worker trains on.

    Shard ``i`` of ``n`` covers indices ``[i*len//n, (i+1)*len//n)``, so the ``n`` shards
    partition the dataset. Batches are drawn without replacement from a seeded random
    permutation of the range; when a permutation is used up (an epoch), a new one starts.
    """

    def __init__(self, dataset: Dataset, index: int, count: int, seed: int = 0) -> None:
        """Select shard ``index`` of ``count``.

        Raises:
            ConfigError: ``count < 1`` or ``index`` not in ``[0, count)``.
            TaskError: the dataset is too small for this shard to hold any sample.
        """
        if count < 1:
            raise ConfigError(f"shard count must be >= 1, got {count}")
        if not 0 <= index < count:
            raise ConfigError(f"shard index must be in [0, {count}), got {index}")
        n = len(dataset)
        self.dataset = dataset
        self.index = index
        self.count = count
        self.seed = seed
        self.start = index * n // count
        self.stop = (index + 1) * n // count
        if self.stop <= self.start:
            raise TaskError(f"shard {index} of {count} is empty: the dataset has only {n} samples")
        self._generator = torch.Generator()
        self._order = torch.empty(0, dtype=torch.int64)
        self._cursor = 0
        self.epoch = 0  # permutations started so far
        self.reset()

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"Shard({self.index}/{self.count}, [{self.start}, {self.stop}), epoch={self.epoch})"

    def reset(self) -> None:
        """Go back to the state just after construction (same sequence of batches again)."""
        self._generator.manual_seed(self.seed)
        self._order = torch.empty(0, dtype=torch.int64)
        self._cursor = 0
        self.epoch = 0

    def next_indices(self, batch_size: int) -> torch.Tensor:
        """The dataset indices (int64, 1-D) of the next batch; see :meth:`next_batch`."""
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        parts: list[torch.Tensor] = []
        needed = batch_size
        while needed > 0:
            if self._cursor >= self._order.numel():
                # int32 halves the memory of the permutation (30 MB for a textlm epoch)
                dtype = torch.int32 if len(self) < 2**31 else torch.int64
                self._order = torch.randperm(len(self), generator=self._generator, dtype=dtype)
                self._cursor = 0
                self.epoch += 1
            take = min(needed, self._order.numel() - self._cursor)
            parts.append(self._order[self._cursor : self._cursor + take].long() + self.start)
            self._cursor += take
            needed -= take
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def next_batch(self, batch_size: int) -> Any:
        """Draw the next ``batch_size`` samples.

        A batch that crosses the end of an epoch is completed from the next permutation, so
        every batch has exactly ``batch_size`` samples and no sample repeats within an epoch.

        Raises:
            ConfigError: ``batch_size < 1``.
        """
        return self.dataset.get_batch(self.next_indices(batch_size))
