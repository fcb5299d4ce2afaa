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
micro-batches are between their forward and backward. **Weight stashing** (PipeDream's):
such a backward recomputes and differentiates on the weights *its forward used* — the stage
keeps a copy of the trainable parameters of every version a held forward ran on — and the
gradient is then applied to the current weights. Without it the gradient was taken at
weights the forward never saw, inconsistent with the activations the next stages had
trained on. It does not remove the delay itself (the gradient still reaches weights that
moved since): the default textlm at 4 in flight ended 4.11 with it and 4.07 without, against
2.78 for one process after 100 micro-batches, which is why the trainer's default schedule
is synchronous and never steps a stage between a forward and its backward. The copies
cost one stage's parameters per version in flight, and go as soon as no held forward needs
them. The last stage computes loss and backward within the forward, with no staleness.

The stage's state is a :class:`~swarmtrain.roles.stage.weights.StageWeights`: only trainable
parameters are optimized (float32 masters for half-precision ones), and buffers such as
BatchNorm's running statistics change once per micro-batch, in its training forward (the
recomputation before the backward restores them). The inference twin holds its own copy of
those buffers, refreshed after each change under the weights lock, so inference never sees
one half-updated. Layers live on ``device``; everything a stage hands back is on the CPU,
for the wire.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmtrain.core.checkpoint import adam_state_from_tensors, adam_state_to_tensors
from swarmtrain.core.devices import batch_to
from swarmtrain.core.modelstate import ModelState
from swarmtrain.errors import CheckpointError
from swarmtrain.roles.stage.kvcache import SessionCaches, run_incremental
from swarmtrain.roles.stage.partition import LossFn
from swarmtrain.roles.stage.placement import RngState, to_cpu
from swarmtrain.roles.stage.weights import StageWeights, SyncMismatch

__all__ = ["BadInput", "CacheMiss", "ComputeConfig", "StageCompute", "StageOutcome", "StateMismatch",
           "UnknownMicrobatch", "shape_signature", "tensors_fingerprint"]

log = logging.getLogger("swarmtrain.roles.stage")

Key = tuple[str, int]
_Graph = tuple[torch.Tensor, torch.Tensor | None]  # an output and its gradient (None: it is the loss)


class BadInput(ValueError):
    """A request's tensors are unusable (shape, dtype, values); the message says why."""


class UnknownMicrobatch(LookupError):
    """A backward for a micro-batch whose forward this stage does not hold."""


class CacheMiss(LookupError):
    """A cached inference step whose cache this stage does not hold (any more): resend the
    whole window from position 0."""


class StateMismatch(ValueError):
    """A stage state (a checkpoint, a live replica's copy) does not fit these layers."""


#: prefixes of the tensors of :meth:`StageCompute.export_state`
MODEL_PREFIX, MASTER_PREFIX = "model/", "master/"


def tensors_fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """16 hex digits that change with any bit of any tensor (or a name, shape or dtype):
    BLAKE2b over the tensors in name order. Equal fingerprints mean equal tensors."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        flat = t.to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shape_signature(layers: nn.Module) -> str:
    """16 hex digits naming the layers' state: BLAKE2b of
    :meth:`~swarmtrain.core.modelstate.ModelState.fingerprint` (every parameter's and buffer's
    name, dtype, shape and kind, as the parameter server checks its workers). Two stages built
    from the same model range agree; another width, depth or dtype (or task) does not."""
    described = json.dumps(ModelState(layers).fingerprint()).encode()
    return hashlib.blake2b(described, digest_size=8).hexdigest()


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
        kv_cache_mb: MiB of attention caches of generation sessions kept at most (least
            recently used sessions are dropped first).
        kv_cache_idle: seconds a generation session's cache is kept without use.
    """

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    accumulate: int = 1
    grad_clip: float = 1.0
    cache_size: int = 256
    done_cache_size: int = 256
    applied_history: int = 1 << 16
    kv_cache_mb: float = 256.0
    kv_cache_idle: float = 300.0

    def __post_init__(self) -> None:
        if not self.kv_cache_mb > 0 or not self.kv_cache_idle > 0:
            raise ValueError("ComputeConfig.kv_cache_mb and kv_cache_idle must be > 0")
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
        missing: micro-batches of the step's group this stage does not hold: it applied this
            one but did not step (the trainer resends them, the last with the step).
        grad_sq: with the last micro-batch of a group, when the stage holds them all: the
            squared norm of its mean gradient (the trainer's clipping adds up the stages'),
            the step then coming with :meth:`StageCompute.step_group`.
    """

    y: torch.Tensor | None
    grad: torch.Tensor | None
    done: bool
    cached: bool
    missing: tuple[int, ...] = ()
    grad_sq: float | None = None


@dataclass(frozen=True)
class _Held:
    """A training forward waiting for its backward."""

    input: torch.Tensor
    output: torch.Tensor  # on the CPU, as answered
    rng_state: RngState  # the RNG state the forward ran with (dropout masks)
    version: int  # the weights it ran on (StageCompute.weights_version)


class StageCompute:
    """Layers, optimizer and micro-batch caches of one stage.

    Threading: one thread trains (forward, backward, sync); :meth:`infer` may be called from
    one other thread at the same time.

    Args:
        layers: the stage's layers (train mode); moved to ``device``.
        is_first: stage 0, whose input (token ids, or the data's features) takes no gradient.
        loss_fn: set on the last stage: it turns output and targets into the loss and runs
            the backward as part of the forward.
        config: learning rate, accumulation, cache bounds.
        device: where the layers compute (inputs are moved there, answers back to the CPU).

    Raises:
        ConfigError: a trainable parameter has a dtype that cannot be trained (integer).
    """

    def __init__(
        self, layers: nn.Module, *, is_first: bool, loss_fn: LossFn | None, config: ComputeConfig,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.layers = layers.to(self.device)
        self.is_first = is_first
        self.loss_fn = loss_fn
        self.config = config
        self.weights = StageWeights(self.layers)
        self._infer_layers = _eval_twin(self.layers, self.weights.buffers)  # None: borrow the layers
        self._weights_lock = threading.Lock()  # held while weights change or inference reads
        # None: every parameter of the stage is frozen (it still passes gradients upstream)
        self.optimizer = torch.optim.AdamW(
            self.weights.optimized(), lr=config.learning_rate, weight_decay=config.weight_decay
        ) if self.weights.trainable else None
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
        #: bumped whenever the weights change (an optimizer step, a replica sync)
        self.weights_version = 0
        #: trainable parameters as they were at a version some held forward ran on
        self._stash: dict[int, list[torch.Tensor]] = {}
        self.stashed_backwards = 0  # backwards differentiated on stashed weights
        #: the layers' state signature (names, shapes, dtypes: see :func:`shape_signature`)
        self.shape = shape_signature(self.layers)
        #: fingerprint of the weights this stage's lineage started from (the seed's, here;
        #: a checkpoint's or a live replica's when one is loaded): replicas of one stage
        #: share it, a replica built with another seed does not
        self.origin = tensors_fingerprint(self.weights.synced())
        #: micro-batches whose gradients are in the sums of the coming step (sync schedule)
        self._accumulated_keys: set[Key] = set()
        self._fingerprint: tuple[tuple[int, int], str] | None = None
        self._fingerprint_at = 0.0
        #: per generation session, the inference layers' states (attention keys and values)
        self.kv = SessionCaches(int(config.kv_cache_mb * 2**20), config.kv_cache_idle)
        self.cache_misses = 0  # cached steps refused: resent from position 0 by the client
        self._buffers_version = 0  # bumped when the inference twin's buffers are refreshed
        self._steps_at_sync = 0  # optimizer steps at the end of the last replica sync round
        self.incomplete_steps = 0  # step requests put off: the group was not all here
        self.dropped_microbatches = 0  # summed gradients of abandoned sessions dropped

    def forward(self, session: str, microbatch: int, x: torch.Tensor,
                targets: torch.Tensor | None, step: bool | None = None,
                group: tuple[int, int] | None = None) -> StageOutcome:
        """Training forward; the last stage also computes the loss and applies the backward
        (then steps as ``step`` says: see :meth:`backward`).

        A repeat of a cached forward is answered from the cache; a forward of a micro-batch
        already applied here is answered with its input gradient (``done``).

        Raises:
            BadInput: ``x``/``targets`` are unusable (NaN or infinite values, the layers
                refused them, or the last stage got no targets).
        """
        key = (session, microbatch)
        if key in self._done:
            self.cached_answers += 1
            if step and group is not None:  # a group's last request again: report again
                return self._reported(self._done[key], session, group)
            return self._done[key]
        if key in self._pending:
            self.cached_answers += 1
            return StageOutcome(y=self._pending[key].output, grad=None, done=False, cached=True)
        if key in self._applied:
            raise BadInput(f"micro-batch {microbatch} of session {session!r} was applied here "
                           "and its answer is no longer cached; it cannot be redone")
        inp = self._prepare_input(x)
        if self.loss_fn is None:
            with RngState.drawing(self.device) as rng, torch.no_grad():
                y = to_cpu(self._run_layers(inp))
            self._publish_buffers()
            self.forwards += 1
            held = _Held(inp, y, rng, self.weights_version)
            self._remember(self._pending, key, held, self.config.cache_size)
            return StageOutcome(y=y, grad=None, done=False, cached=False)
        if targets is None:
            raise BadInput("the last stage needs the targets tensor with every training forward")
        if targets.is_floating_point() and not bool(torch.isfinite(targets).all()):
            raise BadInput("targets hold NaN or infinite values")  # the loss would poison the weights
        targets = batch_to(targets, self.device)
        leaf = self._leaf(inp)
        with (RngState.drawing(self.device) as drawn, self.weights.buffers_kept(only_on_error=True),
              torch.enable_grad()):
            replay = drawn if self.weights.scaler.enabled else None
            self.forwards += 1
            loss = self._loss(self._run_layers(leaf), targets)
            if not bool(torch.isfinite(loss.detach()).all()):
                raise BadInput(f"the loss of this micro-batch is {float(loss.detach().reshape(-1)[0])} "
                               "(are all its targets ignored, e.g. -100?): nothing was applied")
        self._publish_buffers()

        def redo() -> _Graph:
            assert replay is not None  # only a loss scale makes a backward be redone
            return self._loss(self._recompute(leaf, replay), targets), None

        return self._apply(key, leaf, redo, first=(loss, None), y=to_cpu(loss.detach().reshape(()).float()),
                           step=step, group=group)

    def backward(self, session: str, microbatch: int, grad: torch.Tensor,
                 step: bool | None = None, group: tuple[int, int] | None = None) -> StageOutcome:
        """Apply the backward of an earlier forward, once; then take the optimizer step on the
        mean of the gradients accumulated since the last one if ``step`` (the trainer's
        synchronous schedule), never if False, or every ``accumulate`` applied micro-batches
        if None. A repeat of an applied backward steps nothing again.

        ``group`` = ``(first, size)`` names the micro-batches of ``session`` that the step this
        micro-batch belongs to covers (synchronous schedule). When the step comes and some of
        them are not in the sums (this replica restarted, or another replica applied them
        before it died), the stage does not step and the outcome lists them in ``missing``;
        the step comes with the last of them, resent. Gradients in the sums from another
        group (a trainer that stopped mid-step, a step another replica took) are dropped
        when a micro-batch of a new group arrives: one process would never have summed them.

        The forward is recomputed from the cached input (with the random state it ran
        with, and without changing the buffers again), so the graph is built on the current
        weights: an optimizer step between a micro-batch's forward and its backward cannot
        invalidate it.

        Raises:
            UnknownMicrobatch: no forward of this micro-batch is held here.
            BadInput: ``grad`` does not match the output or is not finite.
        """
        key = (session, microbatch)
        if key in self._done:
            self.duplicate_backwards += 1
            done = self._done[key]
            outcome = StageOutcome(y=None, grad=done.grad, done=True, cached=True)
            return self._reported(outcome, session, group) if step and group is not None else outcome
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
        grad = batch_to(grad, self.device)

        def redo() -> _Graph:
            return self._recompute(leaf, held.rng_state), grad

        try:
            return self._apply(key, leaf, redo, first=None, y=None, version=held.version, step=step,
                               group=group)
        finally:
            self._drop_unneeded_stash()

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Forward without gradients, in eval mode (dropout off, BatchNorm on its running
        statistics), on the current weights; the answer is on the CPU. Safe to call from a
        second thread while training runs (see the class docstring).

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
        return to_cpu(y)

    def infer_cached(self, session: str, x: torch.Tensor, start: int) -> torch.Tensor:
        """:meth:`infer` for generation, computing only new positions: ``x`` holds positions
        ``start ..`` of the sequence, and the stage keeps per ``session`` what the earlier
        ones left (:func:`~swarmtrain.roles.stage.kvcache.run_incremental`: attention keys and
        values; layers without an incremental forward are recomputed from their input
        history). The answer holds the new positions only. A cache is valid for the weights
        (and buffers) it was computed with: once they change, the next step is a miss.

        Raises:
            CacheMiss: ``start`` is not 0 and this stage holds no cache of ``start``
                positions for ``session`` on the current weights.
            BadInput: as :meth:`infer`.
        """
        inp = self._prepare_input(x)
        with self._weights_lock, torch.no_grad():
            version = (self.weights_version, self._buffers_version)
            states = None
            if start:
                cached = self.kv.get(session)
                if cached is None or cached.length != start or cached.state[0] != version:
                    self.cache_misses += 1
                    why = ("no cache" if cached is None else f"a cache of {cached.length} positions"
                           if cached.length != start else "a cache computed on earlier weights")
                    raise CacheMiss(f"session {session!r}: this stage holds {why}, not {start} positions "
                                    "on its current weights: resend the window from position 0")
                states = cached.state[1]
            layers = self._infer_layers if self._infer_layers is not None else self.layers
            was_training = layers.training
            layers.eval()
            try:
                y, states = run_incremental(layers, inp, states, start)  # type: ignore[arg-type]
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                raise BadInput(f"the stage's layers refused a cached step of shape {tuple(inp.shape)} at "
                               f"position {start}: {exc}") from exc
            finally:
                layers.train(was_training)
            self.kv.put(session, (version, states), start + inp.shape[1], start=start)
        self.inferences += 1
        return to_cpu(y)

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of what replicas average, by name: every trainable parameter (its
        float32 master, for half-precision ones) and every synced buffer (BatchNorm's
        running statistics and counter). Frozen parameters are not in it."""
        return self.weights.snapshot()

    def sync_tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors :meth:`parameters_snapshot` copies (for sizing frame limits)."""
        return self.weights.synced()

    def move_towards(self, mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                     fraction: float = 0.5) -> None:
        """Move ``fraction`` of the way to the other replica (0.5: halfway; 1: take its state;
        0: keep this one's), keeping the work done since ``mine`` was taken: ``(theirs -
        mine) x fraction`` for every trainable parameter and floating buffer, integer buffers
        to the larger count at 0.5 (see :meth:`StageWeights.move_towards`); frozen parameters
        are left alone.

        Raises:
            BadInput: ``theirs`` lacks a tensor, has a different shape or kind, or holds NaN
                or infinite values (the weights are then left as they were).
        """
        if fraction == 0.0:
            try:
                self.weights.check_sync(theirs)  # refused the same, whether or not it moves
            except SyncMismatch as exc:
                raise BadInput(str(exc)) from exc
            return
        self._stash_current()
        try:
            self.weights.move_towards(mine, theirs, self._weights_lock, fraction)
        except SyncMismatch as exc:
            raise BadInput(str(exc)) from exc
        self.weights_version += 1
        self._publish_buffers()

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything that continues this stage's training later or elsewhere, as CPU copies
        (call it on the training thread, between requests): the layers' whole ``state_dict``
        (``model/``: trainable and frozen parameters, buffers, in their dtypes), the float32
        masters of half-precision parameters (``master/``) and the AdamW state (``adam/``);
        and JSON metadata: optimizer steps, micro-batches applied, the lineage's ``origin``,
        the layers' ``shape`` signature, the loss scale and the optimizer's hyperparameters.
        Held forwards and accumulated gradients are not in it (a step boundary is the
        point to take one)."""
        with torch.no_grad():
            tensors = {f"{MODEL_PREFIX}{n}": t.detach().to("cpu", copy=True)
                       for n, t in self.layers.state_dict().items()}
            for n, m in self.weights.masters.items():
                tensors[f"{MASTER_PREFIX}{n}"] = m.detach().to("cpu", copy=True)
            meta: dict[str, Any] = {
                "steps": self.steps, "microbatches": self.microbatches, "origin": self.origin,
                "shape": self.shape, "fingerprint": self.fingerprint(),
                "loss_scale": {"scale": self.weights.scaler.scale, "clean": self.weights.scaler.clean,
                               "overflows": self.weights.scaler.overflows},
            }
            if self.optimizer is not None:
                adam, meta["adam"] = adam_state_to_tensors(self.optimizer, list(self.weights.trainable))
                tensors.update({k: v.detach().to("cpu", copy=True) for k, v in adam.items()})
        return tensors, meta

    def import_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Take over a state :meth:`export_state` gave (a checkpoint, a live replica's copy):
        weights, masters, buffers, optimizer state, step counters and lineage. Held forwards
        and unapplied gradient sums are dropped (they belonged to the old weights). Call on
        the training thread. Everything is checked before anything changes.

        Raises:
            StateMismatch: another shape signature, a tensor missing or of another shape or
                dtype, a non-finite value, or optimizer state that does not fit.
        """
        if meta.get("shape") != self.shape:
            raise StateMismatch(f"it holds layers of shape signature {meta.get('shape')!r}, these layers "
                                f"are {self.shape!r} (another model, width, depth, dtype or layer range)")
        own = self.layers.state_dict()
        for n, t in own.items():
            other = tensors.get(f"{MODEL_PREFIX}{n}")
            if other is None or other.shape != t.shape or other.dtype != t.dtype:
                raise StateMismatch(f"tensor {n!r} is missing or of another shape or dtype")
            if other.is_floating_point() and not bool(torch.isfinite(other).all()):
                raise StateMismatch(f"tensor {n!r} holds NaN or infinite values")
        for n, m in self.weights.masters.items():
            other = tensors.get(f"{MASTER_PREFIX}{n}")
            if other is not None and (other.shape != m.shape or not bool(torch.isfinite(other).all())):
                raise StateMismatch(f"the master copy of {n!r} is of another shape or not finite")
        if self.optimizer is not None:  # checked (and loaded) first: it raises before loading
            if not isinstance(meta.get("adam"), Mapping):
                raise StateMismatch("it holds no optimizer state for these trainable parameters")
            for key, t in tensors.items():
                state_key, _, name = key.removeprefix("adam/").partition("/")
                param = self.weights.trainable.get(name) if key.startswith("adam/") else None
                if param is not None and t.dim() > 0 and (t.shape != param.shape or not t.is_floating_point()
                                                          or not bool(torch.isfinite(t).all())):
                    raise StateMismatch(f"optimizer state {state_key!r} of {name!r} does not fit it "
                                        f"({t.dtype} {tuple(t.shape)}, or not finite)")
            try:
                adam_state_from_tensors(self.optimizer, list(self.weights.trainable), tensors, meta["adam"])
            except CheckpointError as exc:
                raise StateMismatch(str(exc)) from exc
            for state in self.optimizer.state.values():  # onto the layers' device
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(self.device)
        with self._weights_lock, torch.no_grad():
            for n, t in own.items():
                t.copy_(tensors[f"{MODEL_PREFIX}{n}"].to(t.device))
            for n, m in self.weights.masters.items():
                m.copy_(tensors.get(f"{MASTER_PREFIX}{n}", tensors[f"{MODEL_PREFIX}{n}"]).to(m.device))
        scale = meta.get("loss_scale") or {}
        if self.weights.scaler.enabled and isinstance(scale, Mapping):
            self.weights.scaler.scale = float(scale.get("scale", self.weights.scaler.scale))
            self.weights.scaler.clean = int(scale.get("clean", 0))
            self.weights.scaler.overflows = int(scale.get("overflows", 0))
        self.steps = int(meta.get("steps", 0))
        self._steps_at_sync = self.steps  # what it took over is where its replicas are
        self.microbatches = int(meta.get("microbatches", 0))
        self.origin = str(meta.get("origin", self.origin))
        self._pending.clear()
        self._stash.clear()
        self.weights.discard_sums()
        self._accumulated = 0
        self._accumulated_keys.clear()
        self.weights_version += 1
        self._publish_buffers()

    def fingerprint(self, max_age: float = 0.0) -> str:
        """Fingerprint of what replicas keep equal: trainable parameters (their float32
        masters) and synced buffers (:func:`tensors_fingerprint`); two replicas with equal
        fingerprints hold bit-identical weights. Recomputed only when the weights or the
        buffers changed since the last call, and then (with ``max_age``, for status pages of
        a stage in training) at most every ``max_age`` seconds; any thread."""
        key = (self.weights_version, self.forwards)
        cached = self._fingerprint
        if cached is not None and (cached[0] == key or time.monotonic() - self._fingerprint_at < max_age):
            return cached[1]
        self._fingerprint_at = time.monotonic()
        with self._weights_lock:
            value = tensors_fingerprint(self.weights.synced())
        self._fingerprint = (key, value)
        return value

    @property
    def trained_since_sync(self) -> int:
        """Optimizer steps taken since the last replica sync round (all, before the first)."""
        return self.steps - self._steps_at_sync

    def adopt_steps(self, steps: int) -> None:
        """This stage took another replica's whole state in a sync: count its steps (a standby
        that never trained is then where the run is: checkpoints and restarts count from it)."""
        if steps > self.steps:
            self.steps = steps
            self._steps_at_sync = steps

    def synced_at_step(self, step: int | None = None) -> None:
        """A sync round ended; it covered the steps up to ``step`` (default: now)."""
        self._steps_at_sync = self.steps if step is None else min(step, self.steps)

    @property
    def applied_log(self) -> tuple[Key, ...]:
        """The micro-batches applied here, oldest first (the last ``applied_history``)."""
        return tuple(self._applied)

    def status(self) -> dict[str, Any]:
        """Counters, by name, and the loss scale of a float16 stage (1.0 otherwise)."""
        return {
            "steps": self.steps, "microbatches": self.microbatches, "forwards": self.forwards,
            "cached_answers": self.cached_answers, "duplicate_backwards": self.duplicate_backwards,
            "evictions": self.evictions, "answer_evictions": self.answer_evictions,
            "inferences": self.inferences,
            "pending_forwards": len(self._pending),
            "stashed_backwards": self.stashed_backwards, "stashed_versions": len(self._stash),
            "incomplete_steps": self.incomplete_steps, "dropped_microbatches": self.dropped_microbatches,
            "kv_cache": {**dataclasses.asdict(self.kv.stats()), "refused": self.cache_misses},
            "accumulated": self._accumulated,
            "loss_scale": self.weights.scaler.scale, "overflows": self.weights.scaler.overflows,
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

    def _recompute(self, leaf: torch.Tensor, rng: RngState) -> torch.Tensor:
        """The training forward again, for its backward, with the random state it first ran
        with (the caller restores the buffers it changes, once its backward is done)."""
        with rng.replayed(), torch.enable_grad():
            return self._run_layers(leaf)

    def _loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.loss_fn is not None
        # Half-precision logits: the loss in float32, as mixed-precision training computes it.
        logits = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
        try:
            return self.loss_fn(logits, targets)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            raise BadInput(f"loss of output {tuple(out.shape)} against targets of shape "
                           f"{tuple(targets.shape)} and dtype {targets.dtype} failed: {exc}") from exc

    def _leaf(self, inp: torch.Tensor) -> torch.Tensor:
        # Stage 0's input (token ids, the data) takes no gradient; hidden states do (their
        # gradient goes upstream).
        return inp if self.is_first else inp.detach().requires_grad_(True)

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bool or x.is_complex():
            raise BadInput(f"stage input must be a float tensor (or integer token ids on stage 0), "
                           f"got {x.dtype}")
        if self.is_first and not x.is_floating_point():
            return batch_to(x.long(), self.device)
        if not x.is_floating_point():
            raise BadInput(f"stage input must be a float tensor, got {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            raise BadInput("stage input holds NaN or infinite values")
        # A copy that owns its memory (the wire tensor is a view of a whole frame's buffer).
        moved = batch_to(x.detach(), self.device)
        return moved.clone() if moved is x else moved

    def _apply(self, key: Key, inp: torch.Tensor, redo: Callable[[], _Graph], *, first: _Graph | None,
               y: torch.Tensor | None, version: int | None = None, step: bool | None = None,
               group: tuple[int, int] | None = None) -> StageOutcome:
        """Differentiate ``first`` (output, gradient of it; None: the output is the loss), or
        else a recomputation ``redo()``, take the gradients into the step's sums, and step
        every ``accumulate`` micro-batches. A recomputation's changes to the buffers are
        undone after its backward (not before: autograd checks that the tensors it saved,
        BatchNorm's statistics among them, were not modified in between). With a loss scale,
        a backward whose gradients overflowed is redone at the halved scale, down to scale
        1 at most: bounded, and no micro-batch is dropped. A recomputation runs on the weights
        of ``version`` (stashed, if they have changed since)."""
        if group is not None:
            self._drop_other_groups(key[0], group)
        while True:
            with contextlib.ExitStack() as recomputed:
                if first is None:
                    recomputed.enter_context(self.weights.buffers_kept())
                    if version is not None:
                        recomputed.enter_context(self._weights_of(version))
                    out, grad = redo()
                else:
                    (out, grad), first = first, None
                if out.requires_grad:  # not so on stage 0 when every parameter is frozen
                    self._backprop(out, grad)
            upstream = [] if self.is_first or inp.grad is None else [inp.grad.detach()]
            taken = self.weights.absorb(upstream)
            if taken is not None:
                break
            inp.grad = None
        in_grad = to_cpu(taken[0]) if taken else None
        self._remember(self._applied, key, None, self.config.applied_history)
        self.microbatches += 1
        self._accumulated += 1
        self._accumulated_keys.add(key)
        outcome = StageOutcome(y=y, grad=in_grad, done=True, cached=False)
        self._remember(self._done, key, outcome, self.config.done_cache_size)
        if step and group is not None:
            return self._reported(outcome, key[0], group)
        if step if step is not None else self._accumulated >= self.config.accumulate:
            self._step()
        return outcome

    def step_group(self, session: str, group: tuple[int, int], scale: float = 1.0) -> tuple[int, ...]:
        """Take the synchronous step of the micro-batches ``group`` = (first, size) of
        ``session``, their mean gradient multiplied by ``scale`` (the trainer's clipping of
        the whole model's gradient norm; no clipping of this stage's own), if every one of
        them was applied here; else step nothing and return the ones never applied here. A
        group already stepped (none of it in the sums) steps nothing again."""
        missing = self._missing(session, group)
        if not missing and self._holds(session, group):
            self._step(scale=scale, clip=0.0)
        return missing

    def _reported(self, outcome: StageOutcome, session: str, group: tuple[int, int]) -> StageOutcome:
        """``outcome`` of a group's last micro-batch here: with the micro-batches the stage
        lacks, or (it holds them all, not yet stepped) the squared norm of their mean gradient."""
        missing = self._missing(session, group)
        if missing:
            return dataclasses.replace(outcome, missing=missing)
        if not self._holds(session, group):
            return outcome  # stepped already: a repeated request
        return dataclasses.replace(outcome, grad_sq=self.weights.grad_sq(self._accumulated))

    def _holds(self, session: str, group: tuple[int, int]) -> bool:
        return any((session, mb) in self._accumulated_keys for mb in range(group[0], group[0] + group[1]))

    def _missing(self, session: str, group: tuple[int, int]) -> tuple[int, ...]:
        """The micro-batches of ``group`` never applied here (those applied and already
        stepped are not missing)."""
        first, size = group
        keys = [(session, mb) for mb in range(first, first + size)]
        missing = tuple(k[1] for k in keys if k not in self._accumulated_keys and k not in self._applied)
        if missing:
            self.incomplete_steps += 1
            log.info("step of micro-batches %d-%d of session %s put off: %d of them are not here (%s)",
                     first, first + size - 1, session, len(missing),
                     ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else ""))
        return missing

    def _drop_other_groups(self, session: str, group: tuple[int, int]) -> None:
        """Drop gradient sums of micro-batches of another step (see :meth:`backward`)."""
        first, size = group
        stale = [k for k in self._accumulated_keys if k[0] != session or not first <= k[1] < first + size]
        if not stale:
            return
        log.warning("dropped the summed gradients of %d micro-batch(es) (session %s, micro-batch %d, ...) "
                    "whose step was never taken here (it was taken on another replica, or their trainer "
                    "stopped); the step of micro-batches %d-%d of session %s starts clean",
                    len(stale), stale[0][0], stale[0][1], first, first + size - 1, session)
        self.dropped_microbatches += len(stale)
        self.weights.discard_sums()
        self._accumulated = 0
        self._accumulated_keys.clear()

    def _backprop(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        scaler = self.weights.scaler
        if not scaler.enabled:  # unscaled, so the input gradient sent upstream is the true one
            out.backward(None if grad is None else grad.to(out.dtype))
        elif grad is None:
            (out.float() * scaler.scale).backward()
        else:
            out.backward((grad.float() * scaler.scale).to(out.dtype))

    def _step(self, scale: float = 1.0, clip: float | None = None) -> None:
        self._stash_current()
        self.weights.step(self.optimizer, self._accumulated, self.config.grad_clip if clip is None else clip,
                          self._weights_lock, scale)
        self._accumulated = 0
        self._accumulated_keys.clear()
        self.steps += 1
        self.weights_version += 1

    def _stash_current(self) -> None:
        """Before the weights change: keep a copy of them if a held forward ran on them."""
        v = self.weights_version
        if v not in self._stash and any(h.version == v for h in self._pending.values()):
            self._stash[v] = [p.detach().clone() for p in self.weights.trainable.values()]

    def _drop_unneeded_stash(self) -> None:
        if self._stash:
            needed = {h.version for h in self._pending.values()}
            for v in [v for v in self._stash if v not in needed]:
                del self._stash[v]

    @contextlib.contextmanager
    def _weights_of(self, version: int) -> Any:
        """The trainable parameters hold the weights of ``version`` inside (the gradients land
        on the parameters as usual); the current ones are put back on leaving. Without a
        stash for it (the current version, or nothing to differentiate) nothing changes."""
        stashed = self._stash.get(version) if version != self.weights_version else None
        if stashed is None:
            yield
            return
        params = list(self.weights.trainable.values())
        current = [p.data for p in params]
        with self._weights_lock:  # an inference borrowing these layers waits for the swap
            for p, old in zip(params, stashed):
                p.data = old
        self.stashed_backwards += 1
        try:
            yield
        finally:
            with self._weights_lock:
                for p, now in zip(params, current):
                    p.data = now

    def _publish_buffers(self) -> None:
        """Copy the training layers' synced buffers into the inference twin's own."""
        twin = self._infer_layers
        if twin is None or not self.weights.buffers:
            return
        theirs = dict(twin.named_buffers())
        with self._weights_lock, torch.no_grad():
            for name, b in self.weights.buffers.items():
                theirs[name].copy_(b)
            self._buffers_version += 1

    def _remember(self, cache: OrderedDict[Key, Any], key: Key, value: Any, bound: int) -> None:
        cache[key] = value
        if len(cache) > bound:
            cache.popitem(last=False)
            if cache is self._pending:
                self.evictions += 1
            elif cache is self._done:
                self.answer_evictions += 1


def _eval_twin(layers: nn.Module, synced_buffers: dict[str, torch.Tensor]) -> nn.Module | None:
    """A copy of ``layers`` in eval mode whose parameters share the originals' storage: it
    always computes with the current weights, and switching it to eval mode (dropout off,
    BatchNorm on running statistics) never touches the training module another thread is
    running. Buffers the training forwards change (``synced_buffers``: running statistics)
    are the twin's own copies, which the stage refreshes after each change; constant buffers
    (masks) share storage. None when the module cannot be copied (it holds a lock, a file,
    ...): inference then waits for the training work in progress."""
    try:
        twin = copy.deepcopy(layers)
    except (TypeError, RuntimeError, copy.Error) as exc:
        log.warning("the stage's layers cannot be copied for inference (%s): inference will "
                    "wait for the training work in progress", exc)
        return None
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(twin.named_parameters(), layers.named_parameters(), strict=True):
            mine.data = theirs.data
        for (name, buf), (_, orig) in zip(twin.named_buffers(), layers.named_buffers(), strict=True):
            if name in synced_buffers:
                buf.copy_(orig)
            else:
                buf.data = orig.data
    twin.eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin
