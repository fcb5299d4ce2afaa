"""Client-driven pipeline training (as in Petals): the trainer walks each micro-batch through
the stages and back, several micro-batches at a time.

For each micro-batch the trainer sends the batch forward through stage 0 … S-1 (the last
stage computes the loss and its own backward at once), then the gradient backward through
stage S-2 … 0, each to the replica that did that stage's forward. It keeps every stage's
input until the micro-batch is done, so when that replica dies (or evicted the activations)
it redoes the forward at that stage on a live replica and sends the same gradient there:
stages after it have already applied their backward and are not asked again, so no
gradient is applied twice and no micro-batch is lost. Up to ``max_inflight`` micro-batches
are in flight, so while one waits on stage 2 another runs on stage 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.pipeline.buffers import Priority
from swarmtrain.pipeline.partition import LossFn
from swarmtrain.pipeline.router import MicrobatchLost, Replica, ReplicaFailed, Router
from swarmtrain.tasks.base import Dataset, Shard

__all__ = ["MicrobatchFailed", "PipelineTrainer", "TrainerConfig"]

log = logging.getLogger("swarmtrain.pipeline")


class MicrobatchFailed(SwarmError):
    """A micro-batch could not be completed within the redo budget."""


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer feeds the pipeline.

    Attributes:
        batch_size: samples per micro-batch.
        max_inflight: micro-batches in the pipeline at once.
        max_redos: forwards redone at one stage for one micro-batch before giving up.
        seed: seed of the order the training samples are drawn in.
        session: names this run's micro-batches on the stages ("" = a random id).
    """

    batch_size: int = 16
    max_inflight: int = 4
    max_redos: int = 8
    seed: int = 0
    session: str = ""

    def __post_init__(self) -> None:
        for key in ("batch_size", "max_inflight", "max_redos"):
            if getattr(self, key) < 1:
                raise ConfigError(f"TrainerConfig.{key} must be >= 1, got {getattr(self, key)}")


class PipelineTrainer:
    """Trains the model held by the stages behind ``router`` on ``train_data``.

    Args:
        router: reaches the replicas of every stage.
        train_data: dataset whose ``get_batch`` gives ``(inputs, targets)``.
        config: batch size, micro-batches in flight, redo budget.
        context: longest sequence the model takes (for :meth:`generate`); None = no cut.
        on_microbatch: called on the event loop with (micro-batch, loss) as each completes
            (progress reports).
    """

    def __init__(self, router: Router, train_data: Dataset, config: TrainerConfig = TrainerConfig(),
                 *, context: int | None = None,
                 on_microbatch: Callable[[int, float], None] | None = None) -> None:
        self.router = router
        self.on_microbatch = on_microbatch
        self.config = config
        self.context = context
        self.session = config.session or secrets.token_hex(6)
        self._shard = Shard(train_data, 0, 1, seed=config.seed)
        self._next_microbatch = 0
        self.loss_history: list[tuple[int, float]] = []  # (micro-batch, loss), in completion order
        self.redone_forwards = 0  # forwards redone at a stage whose replica failed or forgot
        # (stage, micro-batch) -> how many backwards were acknowledged (must be exactly 1)
        self.acknowledged: Counter[tuple[int, int]] = Counter()
        # (stage, micro-batch) -> the replica that acknowledged it, for audits
        self.acknowledged_by: dict[tuple[int, int], str] = {}

    @property
    def resends(self) -> int:
        """Requests resent to another replica, plus forwards redone after a failure."""
        return self.router.resends + self.redone_forwards

    async def train(self, microbatches: int) -> list[float]:
        """Run ``microbatches`` more micro-batches through the pipeline.

        Returns:
            Their losses, in micro-batch order.

        Raises:
            MicrobatchFailed: a micro-batch could not be completed (redo budget spent).
            StageUnavailable: no replica of a stage answered (all gone or banned too long).
            RefusedError: a stage refused a request as malformed (a bug or a model mismatch).
        """
        sem = asyncio.Semaphore(self.config.max_inflight)
        first = self._next_microbatch
        losses: dict[int, float] = {}

        async def run(mb: int, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            try:
                losses[mb] = await self._microbatch(mb, *batch)
            finally:
                sem.release()

        try:
            async with asyncio.TaskGroup() as group:
                for mb in range(first, first + microbatches):
                    await sem.acquire()
                    group.create_task(run(mb, self._shard.next_batch(self.config.batch_size)))
        except ExceptionGroup as failed:  # the first failure says what went wrong
            raise failed.exceptions[0] from failed
        finally:
            self._next_microbatch = first + microbatches
        return [losses[mb] for mb in range(first, first + microbatches)]

    async def evaluate(self, heldout: Dataset, loss_fn: LossFn, max_samples: int = 256,
                       chunk: int = 32) -> float:
        """Mean loss on up to ``max_samples`` held-out samples spread evenly over the set,
        through the stages without gradients (the same samples on every call).

        ``loss_fn`` must be a mean over the elements of the targets (as cross-entropy is), so
        chunk means weighted by their target counts give the overall mean.
        """
        n = min(len(heldout), max(1, max_samples))
        starts = torch.linspace(0, len(heldout) - 1, n).round().long()
        total, count = 0.0, 0
        for lo in range(0, n, chunk):
            inputs, targets = heldout.get_batch(starts[lo : lo + chunk])
            out = await self._infer(inputs, Priority.INFERENCE_NORMAL)
            total += float(loss_fn(out, targets)) * targets.numel()
            count += targets.numel()
        return total / count

    async def generate(self, prompt_bytes: bytes, n_new: int, temperature: float = 0.0,
                       seed: int = 0) -> bytes:
        """Continue ``prompt_bytes`` by ``n_new`` bytes, one stage pass per byte, at urgent
        inference priority (stages serve it before training work).

        Args:
            prompt_bytes: the start of the text (not empty).
            n_new: bytes to add.
            temperature: 0 = greedy (the most likely byte), else sample from
                ``softmax(logits / temperature)``.
            seed: seed of the sampling.

        Returns:
            The ``n_new`` generated bytes (without the prompt).

        Raises:
            ConfigError: empty prompt or negative arguments.
        """
        if not prompt_bytes or n_new < 0 or temperature < 0:
            raise ConfigError("generate needs a non-empty prompt, n_new >= 0 and temperature >= 0")
        tokens = list(prompt_bytes)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n_new):
            window = tokens[-self.context:] if self.context else tokens
            logits = await self._infer(torch.tensor([window], dtype=torch.int64), Priority.INFERENCE_URGENT)
            last = logits[0, -1].float()
            if temperature == 0:
                token = int(last.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(last / temperature, dim=0), 1, generator=gen))
            tokens.append(token)
        return bytes(tokens[len(prompt_bytes):])

    # -- one micro-batch -------------------------------------------------------------------

    async def _infer(self, x: torch.Tensor, priority: Priority) -> torch.Tensor:
        for stage in range(self.router.num_stages):
            x = await self.router.infer(stage, self.session, x, priority)
        return x

    async def _microbatch(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        last = self.router.num_stages - 1
        stage_inputs: list[torch.Tensor] = []
        replicas: list[Replica] = []
        x = inputs
        loss, grad = math.nan, None
        for stage in range(last + 1):
            stage_inputs.append(x)
            replica, res = await self.router.forward(
                stage, self.session, mb, x, targets if stage == last else None)
            replicas.append(replica)
            if stage == last:
                if not res.done:
                    raise MicrobatchFailed(f"the last stage ({replica.name}) did not apply the backward")
                self._acknowledge(stage, mb, replica)
                loss = float(res.tensors["y"])
                grad = res.tensors.get("grad")
            elif res.done:
                raise MicrobatchFailed(f"{replica.name} says micro-batch {mb} is done before its "
                                       "later stages ran; is another trainer using session "
                                       f"{self.session!r}?")
            else:
                x = res.tensors["y"]
        for stage in range(last - 1, -1, -1):
            if grad is None:
                raise MicrobatchFailed(f"stage {stage + 1} sent no input gradient for micro-batch {mb}")
            grad = await self._backward(stage, mb, stage_inputs[stage], replicas[stage], grad)
        if not math.isfinite(loss):
            log.warning("micro-batch %d: loss is %s", mb, loss)
        self.loss_history.append((mb, loss))
        if self.on_microbatch is not None:
            self.on_microbatch(mb, loss)
        return loss

    async def _backward(self, stage: int, mb: int, stage_input: torch.Tensor, replica: Replica,
                        grad: torch.Tensor) -> torch.Tensor | None:
        """The backward at ``stage``; on a failed or forgetful replica, redo the forward at
        this stage on a live one (later stages already applied theirs) and go on there."""
        for _ in range(self.config.max_redos):
            try:
                answer = await self.router.backward(replica, self.session, mb, grad)
                self._acknowledge(stage, mb, replica)
                return answer.tensors.get("grad")
            except (ReplicaFailed, MicrobatchLost) as exc:
                log.info("micro-batch %d: backward at %s failed (%s); redoing its forward there",
                         mb, replica.name, exc)
            self.redone_forwards += 1
            replica, res = await self.router.forward(stage, self.session, mb, stage_input)
            if res.done:  # that replica had applied this backward already (answer was lost)
                self._acknowledge(stage, mb, replica)
                return res.tensors.get("grad")
        raise MicrobatchFailed(f"micro-batch {mb}: backward at stage {stage} failed "
                               f"{self.config.max_redos} times")

    def _acknowledge(self, stage: int, mb: int, replica: Replica) -> None:
        self.acknowledged[(stage, mb)] += 1
        self.acknowledged_by[(stage, mb)] = replica.name

