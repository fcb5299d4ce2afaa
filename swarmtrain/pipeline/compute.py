"""The arithmetic of one pipeline stage, without a network: forward, backward, optimizer.

:class:`StageCompute` is driven by one training thread (the stage server's compute thread);
:meth:`StageCompute.infer` alone may run at the same time on another thread: it uses an
eval-mode twin of the layers that shares their parameter storage, and a lock keeps it from
reading weights while the optimizer (or a replica sync) is changing them. It caches each
training micro-batch's (input, output) between its forward and its backward, remembers which
backwards it has applied so none is applied twice, and steps its own AdamW every
``accumulate`` applied micro-batches. Caches are bounded: the oldest entry is evicted and
counted.

Training forwards run without autograd; the backward recomputes the forward from the cached
input and then differentiates it (activation recomputation, as Petals servers do). So a
stage holds no autograd graph between requests, and its optimizer may step while other
micro-batches are between their forward and backward; those backwards then use the new
weights (the weight staleness of asynchronous pipelines such as PipeDream-2BW). The last
stage computes loss and backward within the forward, with no staleness.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmtrain.pipeline.partition import LossFn

__all__ = ["BadInput", "ComputeConfig", "StageCompute", "StageOutcome", "UnknownMicrobatch"]

log = logging.getLogger("swarmtrain.pipeline")

Key = tuple[str, int]


class BadInput(ValueError):
    """A request's tensors are unusable (shape, dtype, values); the message says why."""


class UnknownMicrobatch(LookupError):
    """A backward for a micro-batch whose forward this stage does not hold."""


@dataclass(frozen=True)
class ComputeConfig:
    """How a stage trains.

    Attributes:
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        accumulate: applied micro-batches per optimizer step (gradients are averaged).
        grad_clip: clip the gradient norm to this before a step (0 = no clipping).
        cache_size: most forwards held waiting for their backward.
        done_cache_size: most answers to applied backwards kept for repeats.
        applied_history: most micro-batch ids remembered as applied (ids only, no tensors).
    """

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    accumulate: int = 1
    grad_clip: float = 1.0
    cache_size: int = 256
    done_cache_size: int = 256
    applied_history: int = 1 << 16

    def __post_init__(self) -> None:
        for key in ("accumulate", "cache_size", "done_cache_size", "applied_history"):
            if getattr(self, key) < 1:
                raise ValueError(f"ComputeConfig.{key} must be >= 1, got {getattr(self, key)}")
        if not self.learning_rate > 0:
            raise ValueError(f"ComputeConfig.learning_rate must be > 0, got {self.learning_rate}")


@dataclass(frozen=True)
class StageOutcome:
    """What a forward or backward produced.

    Attributes:
        y: the output (forward), the loss (last stage), or None (backward).
        grad: gradient of the stage input, when the backward has been applied (None on
            stage 0 or before the backward).
        done: the micro-batch's backward has been applied here.
        cached: answered from a cache (nothing was computed or applied).
    """

    y: torch.Tensor | None
    grad: torch.Tensor | None
    done: bool
    cached: bool


@dataclass(frozen=True)
class _Held:
    """A training forward waiting for its backward."""

    input: torch.Tensor
    output: torch.Tensor
    rng_state: torch.Tensor  # the CPU RNG state the forward ran with (dropout masks)


class StageCompute:
    """Layers, optimizer and micro-batch caches of one stage.

    Threading: one thread trains (forward, backward, sync); :meth:`infer` may be called from
    one other thread at the same time.

    Args:
        layers: the stage's layers (train mode).
        is_first: stage 0, whose input (token ids) takes no gradient.
        loss_fn: set on the last stage: it turns output and targets into the loss and runs
            the backward as part of the forward.
        config: learning rate, accumulation, cache bounds.
    """

    def __init__(
        self, layers: nn.Module, *, is_first: bool, loss_fn: LossFn | None, config: ComputeConfig
    ) -> None:
        self.layers = layers
        self.is_first = is_first
        self.loss_fn = loss_fn
        self.config = config
        self._infer_layers = _eval_twin(layers)  # None: inference borrows the training layers
        self._weights_lock = threading.Lock()  # held while weights change or inference reads
        self.optimizer = torch.optim.AdamW(
            layers.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        self._pending: OrderedDict[Key, _Held] = OrderedDict()
        self._done: OrderedDict[Key, StageOutcome] = OrderedDict()
        self._applied: OrderedDict[Key, None] = OrderedDict()
        # applied micro-batches in order (for audits), as far back as applied_history
        self.steps = 0
        self.microbatches = 0
        self.forwards = 0
        self.cached_answers = 0
        self.duplicate_backwards = 0
        self.evictions = 0  # forwards dropped before their backward came
        self.answer_evictions = 0  # answers to applied backwards dropped from the cache
        self.inferences = 0
        self._accumulated = 0

    def forward(self, session: str, microbatch: int, x: torch.Tensor,
                targets: torch.Tensor | None) -> StageOutcome:
        """Training forward; the last stage also computes the loss and applies the backward.

        A repeat of a cached forward is answered from the cache; a forward of a micro-batch
        already applied here is answered with its input gradient (``done``).

        Raises:
            BadInput: ``x``/``targets`` are unusable (NaN or infinite values, the layers
                refused them, or the last stage got no targets).
        """
        key = (session, microbatch)
        if key in self._done:
            self.cached_answers += 1
            return self._done[key]
        if key in self._pending:
            self.cached_answers += 1
            return StageOutcome(y=self._pending[key].output, grad=None, done=False, cached=True)
        if key in self._applied:
            raise BadInput(f"micro-batch {microbatch} of session {session!r} was applied here "
                           "and its answer is no longer cached; it cannot be redone")
        inp = self._prepare_input(x)
        if self.loss_fn is None:
            rng = torch.get_rng_state()
            with torch.no_grad():
                y = self._run_layers(inp)
            self.forwards += 1
            self._remember(self._pending, key, _Held(inp, y, rng), self.config.cache_size)
            return StageOutcome(y=y, grad=None, done=False, cached=False)
        if targets is None:
            raise BadInput("the last stage needs the targets tensor with every training forward")
        if targets.is_floating_point() and not bool(torch.isfinite(targets).all()):
            raise BadInput("targets hold NaN or infinite values")  # the loss would poison the weights
        leaf = self._leaf(inp)
        with torch.enable_grad():
            y = self._run_layers(leaf)
            self.forwards += 1
            try:
                loss = self.loss_fn(y, targets)
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                raise BadInput(f"loss of output {tuple(y.shape)} against targets of shape "
                               f"{tuple(targets.shape)} and dtype {targets.dtype} failed: {exc}") from exc
        if not bool(torch.isfinite(loss.detach()).all()):
            raise BadInput(f"the loss of this micro-batch is {float(loss.detach().reshape(-1)[0])} "
                           "(are all its targets ignored, e.g. -100?): nothing was applied")
        return self._apply(key, leaf, loss, None, y=loss.detach().reshape(()).float())

    def backward(self, session: str, microbatch: int, grad: torch.Tensor) -> StageOutcome:
        """Apply the backward of an earlier forward, once.

        The forward is recomputed from the cached input (with the random state it ran
        with), so the graph is built on the current weights: an optimizer step between a
        micro-batch's forward and its backward cannot invalidate it.

        Raises:
            UnknownMicrobatch: no forward of this micro-batch is held here.
            BadInput: ``grad`` does not match the output or is not finite.
        """
        key = (session, microbatch)
        if key in self._done:
            self.duplicate_backwards += 1
            done = self._done[key]
            return StageOutcome(y=None, grad=done.grad, done=True, cached=True)
        if key in self._applied:
            raise BadInput(f"micro-batch {microbatch} of session {session!r} was applied here "
                           "and its answer is no longer cached")
        held = self._pending.get(key)
        if held is None:
            raise UnknownMicrobatch(f"no forward of micro-batch {microbatch} of session {session!r} "
                                    "is held here (never done here, or evicted): redo the forward")
        if grad.shape != held.output.shape or not grad.is_floating_point():
            raise BadInput(f"grad must be a float tensor of the output's shape {tuple(held.output.shape)}, "
                           f"got {grad.dtype} {tuple(grad.shape)}")
        if not bool(torch.isfinite(grad).all()):
            raise BadInput("grad holds NaN or infinite values")
        del self._pending[key]
        leaf = self._leaf(held.input)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(held.rng_state)
            out = self._run_layers(leaf)
        return self._apply(key, leaf, out, grad.to(out.dtype), y=None)

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Forward without gradients, in eval mode (dropout off), on the current weights.
        Safe to call from a second thread while training runs (see the class docstring).

        Raises:
            BadInput: ``x`` holds NaN or infinite values, or the layers refused it.
        """
        inp = self._prepare_input(x)
        with self._weights_lock, torch.no_grad():
            if self._infer_layers is not None:
                y = self._run_layers(inp, self._infer_layers)
            else:  # no twin: borrow the training layers in eval mode; training waits meanwhile
                was_training = self.layers.training
                self.layers.eval()
                try:
                    y = self._run_layers(inp, self.layers)
                finally:
                    self.layers.train(was_training)
        self.inferences += 1
        return y

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter, by name."""
        return {name: p.detach().clone() for name, p in self.layers.named_parameters()}

    def move_towards(self, mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
        """Add ``(theirs - mine) / 2`` to every parameter: halfway to the other replica.

        Raises:
            BadInput: ``theirs`` lacks a parameter, has a different shape, or holds NaN or
                infinite values (the weights are then left as they were).
        """
        params = dict(self.layers.named_parameters())
        for name, p in params.items():
            other = theirs.get(name)
            if other is None or other.shape != p.shape or not other.is_floating_point():
                raise BadInput(f"replica sync: parameter {name!r} missing or of another shape/dtype")
            if not bool(torch.isfinite(other).all()):
                raise BadInput(f"replica sync: parameter {name!r} holds NaN or infinite values")
        with self._weights_lock, torch.no_grad():
            for name, p in params.items():
                p.add_((theirs[name].to(p.dtype) - mine[name]) * 0.5)

    @property
    def applied_log(self) -> tuple[Key, ...]:
        """The micro-batches applied here, oldest first (the last ``applied_history``)."""
        return tuple(self._applied)

    def status(self) -> dict[str, int]:
        """Counters, by name."""
        return {
            "steps": self.steps, "microbatches": self.microbatches, "forwards": self.forwards,
            "cached_answers": self.cached_answers, "duplicate_backwards": self.duplicate_backwards,
            "evictions": self.evictions, "answer_evictions": self.answer_evictions,
            "inferences": self.inferences,
            "pending_forwards": len(self._pending),
        }

    # -- internals -------------------------------------------------------------------------

    def _run_layers(self, inp: torch.Tensor, layers: nn.Module | None = None) -> torch.Tensor:
        if layers is None and self._infer_layers is None:  # inference may borrow the layers
            with self._weights_lock:
                return self._run_layers(inp, self.layers)
        try:
            out: torch.Tensor = (layers or self.layers)(inp)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            raise BadInput(f"the stage's layers refused an input of shape {tuple(inp.shape)} "
                           f"and dtype {inp.dtype}: {exc}") from exc
        return out

    def _leaf(self, inp: torch.Tensor) -> torch.Tensor:
        # Token ids take no gradient; hidden states do (their gradient goes upstream).
        return inp if self.is_first else inp.detach().requires_grad_(True)

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.is_floating_point() or x.dtype == torch.bool:
                raise BadInput(f"stage 0 takes integer token ids, got {x.dtype}")
            return x.long()
        if not x.is_floating_point():
            raise BadInput(f"stage input must be a float tensor, got {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            raise BadInput("stage input holds NaN or infinite values")
        # A copy that owns its memory (the wire tensor is a view of a whole frame's buffer).
        return x.detach().clone()

    def _apply(self, key: Key, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None,
               *, y: torch.Tensor | None) -> StageOutcome:
        # Unscaled, so the input gradient sent upstream is the true one; _step averages.
        out.backward(grad)
        in_grad = None if self.is_first or inp.grad is None else inp.grad.detach()
        outcome = StageOutcome(y=y, grad=in_grad, done=True, cached=False)
        self._remember(self._done, key, outcome, self.config.done_cache_size)
        self._remember(self._applied, key, None, self.config.applied_history)
        self.microbatches += 1
        self._accumulated += 1
        if self._accumulated >= self.config.accumulate:
            self._step()
        return outcome

    def _step(self) -> None:
        with torch.no_grad():
            for p in self.layers.parameters():
                if p.grad is not None:
                    p.grad.div_(self._accumulated)  # the mean over the micro-batches
        if self.config.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.layers.parameters(), self.config.grad_clip)
        with self._weights_lock:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulated = 0
        self.steps += 1

    def _remember(self, cache: OrderedDict[Key, Any], key: Key, value: Any, bound: int) -> None:
        cache[key] = value
        if len(cache) > bound:
            cache.popitem(last=False)
            if cache is self._pending:
                self.evictions += 1
            elif cache is self._done:
                self.answer_evictions += 1


def _eval_twin(layers: nn.Module) -> nn.Module | None:
    """A copy of ``layers`` in eval mode whose parameters and buffers share the originals'
    storage: it always computes with the current weights, and switching it to eval mode
    (dropout off) never touches the training module another thread is running. None when
    the module cannot be copied (it holds a lock, a file, ...): inference then waits for the
    training work in progress."""
    try:
        twin = copy.deepcopy(layers)
    except (TypeError, RuntimeError, copy.Error) as exc:
        log.warning("the stage's layers cannot be copied for inference (%s): inference will "
                    "wait for the training work in progress", exc)
        return None
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(twin.named_parameters(), layers.named_parameters(), strict=True):
            mine.data = theirs.data
        for (_, buf), (_, orig) in zip(twin.named_buffers(), layers.named_buffers(), strict=True):
            buf.data = orig.data
    twin.eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin
