"""Client-driven pipeline training (as in Petals): the trainer walks each micro-batch through
the stages and back, several micro-batches at a time.

For each micro-batch the trainer sends the batch forward through stage 0 … S-1 (the last
stage computes the loss and its own backward at once), then the gradient backward through
stage S-2 … 0, each to the replica that did that stage's forward. It keeps every stage's
input until the micro-batch is done, so when that replica dies (or evicted the activations)
it redoes the forward at that stage on a live replica and sends the same gradient there:
stages after it have already applied their backward and are not asked again, so no
gradient is applied twice and no micro-batch is lost.

Two schedules (``TrainerConfig.schedule``):

- ``sync`` (the default; GPipe's, as ``torch.distributed.pipelining`` runs it): an optimizer
  step takes ``chunks`` micro-batches. The trainer sends them all at once, so while one waits
  on stage 2 another runs on stage 0; each stage accumulates their gradients and steps when
  the last of them is applied there (the trainer says which: it holds that request until the
  others are acknowledged at that stage, and sends it with ``step``); the next group starts
  once the whole group is done (a flush). Every forward and backward of a group runs on the
  same weights, so the run is one process's at a batch of ``chunks x batch_size``, bit for
  bit up to the order of float sums. A group's micro-batches go to one replica of each stage
  (chosen when the first of them gets there), so that replica holds all of the group's
  gradients; one that lacks some at the step (it restarted, or took over from a replica that
  died) says which, and the trainer gives them to it again (:meth:`_complete_step`).
- ``async`` (the earlier behaviour): up to ``max_inflight`` micro-batches in flight without
  flushes, each stage stepping on its own count (``accumulate``). Faster per sample on a
  deep pipeline, but a micro-batch's gradient is then applied to weights that moved since its
  forward (stashing keeps forward and backward consistent, not the delay): the default
  textlm ended at 4.1 against one process's 2.8 after 100 micro-batches at 4 in flight.
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
from swarmtrain.roles.stage.buffers import Priority
from swarmtrain.roles.stage.kvcache import window_step
from swarmtrain.roles.stage.partition import LossFn
from swarmtrain.roles.stage.router import CacheMissed, MicrobatchLost, Replica, ReplicaFailed, Router
from swarmtrain.tasks.base import Dataset, Shard

__all__ = ["MicrobatchFailed", "PipelineTrainer", "TrainerConfig"]

log = logging.getLogger("swarmtrain.roles.stage")


class MicrobatchFailed(SwarmError):
    """A micro-batch could not be completed within the redo budget."""


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer feeds the pipeline.

    Attributes:
        batch_size: samples per micro-batch.
        schedule: ``sync`` (one optimizer step per ``chunks`` micro-batches, flushed: one
            process's run at a batch of ``chunks x batch_size``) or ``async`` (``max_inflight``
            micro-batches in flight, stages stepping on their own count; weight staleness).
        chunks: with ``sync``, micro-batches per optimizer step (all in flight at once).
        max_inflight: with ``async``, micro-batches in the pipeline at once.
        max_redos: forwards redone at one stage for one micro-batch before giving up.
        grad_clip: with ``sync``, clip the whole model's gradient norm to this before each
            step, as one process clips it (0 = no clipping): each stage reports its share,
            and the trainer sends the stages the one factor. With ``async`` each stage clips
            its own part (its ``ComputeConfig.grad_clip``).
        seed: seed of the order the training samples are drawn in.
        session: names this run's micro-batches on the stages ("" = a random id).
    """

    batch_size: int = 16
    schedule: str = "sync"
    chunks: int = 8
    max_inflight: int = 4
    max_redos: int = 8
    grad_clip: float = 1.0
    seed: int = 0
    session: str = ""

    def __post_init__(self) -> None:
        for key in ("batch_size", "chunks", "max_inflight", "max_redos"):
            if getattr(self, key) < 1:
                raise ConfigError(f"TrainerConfig.{key} must be >= 1, got {getattr(self, key)}")
        if not self.grad_clip >= 0:
            raise ConfigError(f"TrainerConfig.grad_clip must be >= 0, got {self.grad_clip}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"TrainerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")


SCHEDULES = ("sync", "async")


class _Group:
    """The micro-batches of one synchronous step: at each stage, which of them carries the
    step (the last to get there, sent once the others are acknowledged there), the replica
    the group uses, and what each micro-batch brought to each stage (its input, the
    gradient of its output, its targets), kept until the step so that a stage that lost some
    of them (a replica that died, a stage restarted from a checkpoint) can be given them
    again."""

    def __init__(self, first: int, size: int, stages: int) -> None:
        self.first = first
        self.size = size
        self.arrived = [0] * stages
        self.applied = [0] * stages
        self.replica: list[Replica | None] = [None] * stages
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> stage input
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> gradient of its output
        self.targets: dict[int, torch.Tensor] = {}
        self.grad_sq: dict[int, float] = {}  # per stage: the squared norm of its mean gradient
        self._changed = asyncio.Condition()

    @property
    def span(self) -> tuple[int, int]:
        return self.first, self.size

    async def step_flag(self, stage: int) -> bool:
        """Whether this micro-batch's training work at ``stage`` takes the step; the last one
        returns only once every other one of the group was applied there."""
        self.arrived[stage] += 1
        if self.arrived[stage] < self.size:
            return False
        async with self._changed:
            await self._changed.wait_for(lambda: self.applied[stage] >= self.size - 1)
        return True

    async def applied_at(self, stage: int) -> None:
        self.applied[stage] += 1
        async with self._changed:
            self._changed.notify_all()


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
        #: micro-batches given again to a stage that did not hold them at its step
        self.replayed = 0
        #: (stage, micro-batch) -> the replica a replay applied it on, for audits
        self.replayed_by: dict[tuple[int, int], str] = {}
        self.cache_misses = 0  # generation steps a stage had no cache for (window sent again)
        self.grad_norms: list[float] = []  # the whole model's gradient norm at each sync step

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
        first = self._next_microbatch
        losses: dict[int, float] = {}
        try:
            if self.config.schedule == "sync":
                for lo in range(first, first + microbatches, self.config.chunks):
                    size = min(self.config.chunks, first + microbatches - lo)
                    group = _Group(lo, size, self.router.num_stages)
                    async with asyncio.TaskGroup() as tasks:  # a flush: the whole group, then the next
                        for mb in range(lo, lo + size):
                            batch = self._shard.next_batch(self.config.batch_size)
                            tasks.create_task(self._run_into(losses, mb, batch, group))
                    await self._step_group(group)
            else:
                await self._train_async(first, microbatches, losses)
        except ExceptionGroup as failed:  # the first failure says what went wrong
            raise failed.exceptions[0] from failed
        finally:
            self._next_microbatch = first + microbatches
        return [losses[mb] for mb in range(first, first + microbatches)]

    async def _run_into(self, losses: dict[int, float], mb: int, batch: tuple[torch.Tensor, torch.Tensor],
                        group: _Group | None) -> None:
        losses[mb] = await self._microbatch(mb, *batch, group=group)

    async def _train_async(self, first: int, microbatches: int, losses: dict[int, float]) -> None:
        sem = asyncio.Semaphore(self.config.max_inflight)

        async def run(mb: int, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            try:
                await self._run_into(losses, mb, batch, None)
            finally:
                sem.release()

        async with asyncio.TaskGroup() as tasks:
            for mb in range(first, first + microbatches):
                await sem.acquire()
                tasks.create_task(run(mb, self._shard.next_batch(self.config.batch_size)))

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
                       seed: int = 0, *, cache: bool = True) -> bytes:
        """Continue ``prompt_bytes`` by ``n_new`` bytes, at urgent inference priority (stages
        serve it before training work).

        With ``cache`` (the default), each stage keeps the session's attention keys and
        values, so the prompt goes through once and every new byte costs one position's
        compute; the stages a session used are asked again (the replica holding its cache),
        and a stage that lost the cache (restarted, evicted, another replica, weights changed
        by training) gets the whole window again. Past the model's context the window slides
        (the last ``context`` bytes at positions 0 …), so each further byte is a whole window
        again, as without the cache. Without ``cache`` every byte reruns the whole window.
        Both give the same bytes (up to float rounding in attention sums).

        Args:
            prompt_bytes: the start of the text (not empty).
            n_new: bytes to add.
            temperature: 0 = greedy (the most likely byte), else sample from
                ``softmax(logits / temperature)``.
            seed: seed of the sampling.
            cache: keep attention caches on the stages.

        Returns:
            The ``n_new`` generated bytes (without the prompt).

        Raises:
            ConfigError: empty prompt or negative arguments.
        """
        if not prompt_bytes or n_new < 0 or temperature < 0:
            raise ConfigError("generate needs a non-empty prompt, n_new >= 0 and temperature >= 0")
        tokens = list(prompt_bytes)
        gen = torch.Generator().manual_seed(seed)
        session = f"{self.session}-gen-{secrets.token_hex(4)}"
        context = self.context or 1 << 30
        held = 0  # positions the stages hold for the session
        replicas: list[Replica | None] = [None] * self.router.num_stages
        for _ in range(n_new):
            if cache:
                logits, held = await self._cached_step(session, tokens, held, context, replicas)
            else:
                window = torch.tensor([tokens[-context:]], dtype=torch.int64)
                logits = await self._infer(window, Priority.INFERENCE_URGENT)
            last = logits[0, -1].float()
            if temperature == 0:
                token = int(last.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(last / temperature, dim=0), 1, generator=gen))
            tokens.append(token)
        return bytes(tokens[len(prompt_bytes):])

    async def _cached_step(self, session: str, tokens: list[int], held: int, context: int,
                           replicas: list[Replica | None]) -> tuple[torch.Tensor, int]:
        """One generation step through the stages' caches: the logits of the positions sent,
        and how many positions the stages now hold."""
        for attempt in range(2):
            start, first = window_step(len(tokens), held if attempt == 0 else 0, context)
            x = torch.tensor([tokens[first:]], dtype=torch.int64)
            try:
                for stage in range(self.router.num_stages):
                    replicas[stage], x = await self.router.infer_cached(stage, session, x, start,
                                                                         prefer=replicas[stage])
                return x, start + len(tokens) - first
            except CacheMissed as exc:
                self.cache_misses += 1
                log.info("generation session %s: %s; sending the whole window again", session, exc)
        raise SwarmError(f"generation session {session}: a stage refused its cache twice in a row")

    # -- one micro-batch -------------------------------------------------------------------

    async def _infer(self, x: torch.Tensor, priority: Priority) -> torch.Tensor:
        for stage in range(self.router.num_stages):
            x = await self.router.infer(stage, self.session, x, priority)
        return x

    async def _microbatch(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor,
                          group: _Group | None = None) -> float:
        last = self.router.num_stages - 1
        stage_inputs: list[torch.Tensor] = []
        replicas: list[Replica] = []
        x = inputs
        loss, grad = math.nan, None
        if group is not None:
            group.targets[mb] = targets
        for stage in range(last + 1):
            stage_inputs.append(x)
            if group is not None:
                group.inputs[(stage, mb)] = x
            step = None if group is None or stage != last else await group.step_flag(stage)
            if group is not None and group.replica[stage] is None:  # the group's replica here
                group.replica[stage] = self.router.choose(stage)
            replica, res = await self.router.forward(
                stage, self.session, mb, x, targets if stage == last else None, step=step,
                prefer=None if group is None else group.replica[stage],
                group=None if group is None else group.span)
            replicas.append(replica)
            if group is not None:
                group.replica[stage] = replica
            if stage == last:
                if not res.done:
                    raise MicrobatchFailed(f"the last stage ({replica.name}) did not apply the backward")
                self._acknowledge(stage, mb, replica)
                if group is not None:
                    if step:
                        await self._reported(stage, group, replica, res.missing, res.grad_sq)
                    await group.applied_at(stage)
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
            if group is not None:
                group.grads[(stage, mb)] = grad
            step = None if group is None else await group.step_flag(stage)
            grad = await self._backward(stage, mb, stage_inputs[stage], replicas[stage], grad, step, group)
            if group is not None:
                await group.applied_at(stage)
        if not math.isfinite(loss):
            log.warning("micro-batch %d: loss is %s", mb, loss)
        self.loss_history.append((mb, loss))
        if self.on_microbatch is not None:
            self.on_microbatch(mb, loss)
        return loss

    async def _backward(self, stage: int, mb: int, stage_input: torch.Tensor, replica: Replica,
                        grad: torch.Tensor, step: bool | None = None,
                        group: _Group | None = None) -> torch.Tensor | None:
        """The backward at ``stage`` (``step``: the synchronous schedule's step decision); on a
        failed or forgetful replica, redo the forward at this stage on a live one (later
        stages already applied theirs) and go on there. A step the stage put off because
        it lacks some of the group's micro-batches is completed by giving it them again."""
        span = None if group is None else group.span
        for _ in range(self.config.max_redos):
            try:
                answer = await self.router.backward(replica, self.session, mb, grad, step=step, group=span)
                self._acknowledge(stage, mb, replica)
                if step and group is not None:
                    await self._reported(stage, group, replica, answer.missing, answer.grad_sq)
                return answer.tensors.get("grad")
            except (ReplicaFailed, MicrobatchLost) as exc:
                log.info("micro-batch %d: backward at %s failed (%s); redoing its forward there",
                         mb, replica.name, exc)
            self.redone_forwards += 1
            replica, res = await self.router.forward(
                stage, self.session, mb, stage_input, step=None if step is None else False,
                prefer=None if group is None else group.replica[stage], group=span)
            if group is not None:
                group.replica[stage] = replica
            if res.done:  # that replica had applied this backward already (answer was lost)
                self._acknowledge(stage, mb, replica)
                if step and group is not None:  # its report went with the lost answer: ask again
                    replica, missing, grad_sq = await self._replay(stage, group, mb, replica, step=True)
                    await self._reported(stage, group, replica, missing, grad_sq)
                return res.tensors.get("grad")
        raise MicrobatchFailed(f"micro-batch {mb}: backward at stage {stage} failed "
                               f"{self.config.max_redos} times")

    async def _reported(self, stage: int, group: _Group, replica: Replica, missing: list[int],
                        grad_sq: float) -> None:
        """The answer to a group's last request at ``stage``: the stage's gradient norm
        share, or the micro-batches it lacks (given again, until it reports)."""
        if missing:
            grad_sq = await self._complete_step(stage, group, replica, missing)
        group.grad_sq[stage] = grad_sq

    async def _step_group(self, group: _Group) -> None:
        """Once a group is done everywhere: clip the whole model's gradient norm (each stage
        reported its share) and have every stage take the step, giving a stage that lost
        some of the group (it restarted since, or its replica died) the group again."""
        unknown = [s for s in range(self.router.num_stages) if group.grad_sq.get(s, -1.0) < 0]
        if unknown:
            log.warning("stages %s did not report their gradient norm for micro-batches %d-%d: clipping "
                        "without them", unknown, group.first, group.first + group.size - 1)
        norm = math.sqrt(sum(max(0.0, v) for v in group.grad_sq.values()))
        clip = self.config.grad_clip
        scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        self.grad_norms.append(norm)

        async def step(stage: int) -> None:
            for _ in range(self.config.max_redos):
                replica, answer = await self.router.step(stage, self.session, group.span, scale,
                                                         prefer=group.replica[stage])
                group.replica[stage] = replica
                if not answer.missing:
                    return
                await self._complete_step(stage, group, replica, answer.missing)
            raise MicrobatchFailed(f"stage {stage} did not take the step of micro-batches {group.first}-"
                                   f"{group.first + group.size - 1}")

        async with asyncio.TaskGroup() as tasks:
            for stage in range(self.router.num_stages):
                tasks.create_task(step(stage))

    async def _complete_step(self, stage: int, group: _Group, replica: Replica, missing: list[int]) -> float:
        """``replica`` cannot take ``stage``'s step of ``group``: it lacks ``missing`` (it
        restarted, or another replica that applied them is gone). Give it each of them again
        (its input and the gradient its output got), the last as the group's last, until it
        has them all; its gradient norm share then."""
        log.warning("%s lacks %d micro-batch(es) of the step of micro-batches %d-%d (%s); giving them "
                    "to it again", replica.name, len(missing), group.first, group.first + group.size - 1,
                    ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else ""))
        grad_sq = -1.0
        for _ in range(self.config.max_redos):
            if not missing:
                return grad_sq
            *rest, final = missing
            for m in rest:
                replica, _, _ = await self._replay(stage, group, m, replica, step=False)
            replica, missing, grad_sq = await self._replay(stage, group, final, replica, step=True)
        raise MicrobatchFailed(f"stage {stage} did not get all of micro-batches {group.first}-"
                               f"{group.first + group.size - 1} within {self.config.max_redos} rounds")

    async def _replay(self, stage: int, group: _Group, mb: int, replica: Replica,
                      *, step: bool) -> tuple[Replica, list[int], float]:
        """Micro-batch ``mb``'s forward and backward at ``stage`` again, on ``replica`` if it is
        live; the replica that took it, and (with ``step``) what it says is still missing and
        its gradient norm share."""
        self.replayed += 1
        span = group.span
        last = stage == self.router.num_stages - 1
        x = group.inputs[(stage, mb)]
        targets = group.targets[mb] if last else None
        replica, res = await self.router.forward(stage, self.session, mb, x, targets, step=step,
                                                 prefer=replica, group=span)
        group.replica[stage] = replica
        if last or res.done:
            self.replayed_by[(stage, mb)] = replica.name
            return replica, list(res.missing), res.grad_sq
        for _ in range(self.config.max_redos):
            try:
                answer = await self.router.backward(replica, self.session, mb, group.grads[(stage, mb)],
                                                    step=step, group=span)
                self.replayed_by[(stage, mb)] = replica.name
                return replica, list(answer.missing), answer.grad_sq
            except (ReplicaFailed, MicrobatchLost):
                replica, res = await self.router.forward(stage, self.session, mb, x, step=False, group=span)
                group.replica[stage] = replica
                if res.done:
                    self.replayed_by[(stage, mb)] = replica.name
                    return replica, list(res.missing), res.grad_sq
        raise MicrobatchFailed(f"micro-batch {mb}: could not be given again to stage {stage}")

    def _acknowledge(self, stage: int, mb: int, replica: Replica) -> None:
        self.acknowledged[(stage, mb)] += 1
        self.acknowledged_by[(stage, mb)] = replica.name

