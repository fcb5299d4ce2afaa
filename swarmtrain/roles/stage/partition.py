"""Turning a task's model into an ordered list of layers and grouping them into stages.

A pipeline stage holds a contiguous range of layers. :func:`split_layers` takes the layers a
model marks with ``pipeline_layers()``, knows the shape of
:class:`~swarmtrain.tasks.textlm.TextLM` (embedding, blocks, final norm + head) and of the
Hugging Face causal LMs in :mod:`~swarmtrain.roles.stage.adapters`, and falls back to the
children of an ``nn.Sequential``. :func:`plan_stages` sizes the ranges by each
node's speed, bounded by its memory. :func:`build_stage` rebuilds the model from the task
with a fixed seed and keeps one range, so every replica of a stage starts bit-identical
without any weights being sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.errors import ConfigError
from swarmtrain.roles.stage.adapters import hf_causal_lm_layers, is_hf_causal_lm, marked_layers
from swarmtrain.tasks.base import seeded_module
from swarmtrain.tasks.textlm import TextLM

__all__ = [
    "LayerCost",
    "LossFn",
    "NodeSpec",
    "build_stage",
    "estimate_layer_costs",
    "loss_fn_for",
    "plan_stages",
    "split_layers",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Parameters, their gradients and AdamW's two moments: four float32 copies per parameter.
_TRAINING_COPIES = 4


class _TextLMEmbedding(nn.Module):
    """Layer 0 of a TextLM: tokens (B, T) int64 -> hidden states (B, T, d)."""

    def __init__(self, model: TextLM) -> None:
        super().__init__()
        self.context = model.config.context
        self.tok_emb = model.tok_emb
        self.pos_emb = model.pos_emb
        self.emb_dropout = model.emb_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context of {self.context}")
        pos = torch.arange(t, device=tokens.device)
        return self.emb_dropout(self.tok_emb(tokens) + self.pos_emb(pos))

    def forward_incremental(
        self, tokens: torch.Tensor, state: None, start: int
    ) -> tuple[torch.Tensor, None]:
        """Embeddings of the tokens at positions ``start .. start + T_new - 1``.

        Stateless (the position is all it needs to know): ``state`` is None in and out.
        Eval mode only: dropout is never applied, so training mode is refused.

        Raises:
            ValueError: training mode, ``start < 0``, or ``start + T_new`` exceeds the context.
        """
        if self.training:
            raise ValueError("forward_incremental runs in eval mode only: call .eval() first")
        t = tokens.shape[1]
        if start < 0 or start + t > self.context:
            raise ValueError(
                f"positions {start} .. {start + t - 1} are outside the context of {self.context}"
            )
        pos = torch.arange(start, start + t, device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(pos), None


class _TextLMHead(nn.Module):
    """Last layer of a TextLM: hidden states (B, T, d) -> logits (B, T, 256)."""

    def __init__(self, model: TextLM) -> None:
        super().__init__()
        self.ln_f = model.ln_f
        self.head = model.head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(hidden))

    def forward_incremental(
        self, hidden: torch.Tensor, state: None, start: int
    ) -> tuple[torch.Tensor, None]:
        """Logits at the new positions: position-wise, so no state (None in and out)."""
        return self.head(self.ln_f(hidden)), None


def split_layers(model: nn.Module) -> list[nn.Module]:
    """The model as an ordered list of layers whose composition is the model's forward.

    The layers share their parameters with ``model`` (no copies). The first kind that
    applies decides:

    1. the model's own ``pipeline_layers()`` (see
       :func:`~swarmtrain.roles.stage.adapters.marked_layers` for the contract);
    2. a :class:`TextLM`: embedding, then each block, then final norm + head;
    3. a Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM``: embedding, each decoder
       block, final norm + ``lm_head`` (see
       :func:`~swarmtrain.roles.stage.adapters.hf_causal_lm_layers`);
    4. an ``nn.Sequential``: its children.

    Args:
        model: the task's model.

    Returns:
        The layers, first to last.

    Raises:
        ConfigError: the model is of none of these kinds, a Hugging Face model of another
            family, or a ``pipeline_layers()`` that breaks its contract (the message says
            how to split it).
    """
    marked = marked_layers(model)
    if marked is not None:
        return marked
    if isinstance(model, TextLM):
        return [_TextLMEmbedding(model), *model.blocks, _TextLMHead(model)]
    hf = hf_causal_lm_layers(model)
    if hf is not None:
        return hf
    if isinstance(model, nn.Sequential):
        layers = list(model.children())
        if not layers:
            raise ConfigError("cannot split an empty nn.Sequential into pipeline stages")
        return layers
    raise ConfigError(
        f"cannot split a {type(model).__name__} into pipeline stages: give it a pipeline_layers() "
        "method returning its layers in order (each takes one tensor and returns one), or use a "
        "TextLM, a Hugging Face GPT2LMHeadModel / LlamaForCausalLM, or an nn.Sequential of the layers"
    )


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _sequential_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


def loss_fn_for(model: nn.Module) -> LossFn:
    """The loss the last stage computes from its output and the targets.

    TextLM and the Hugging Face causal LMs: mean next-token cross-entropy over all positions
    of logits (B, T, V) against targets (B, T) that the task has already shifted by one
    (``targets[:, t]`` is the token after ``inputs[:, t]``, as ``TextLMTask``'s batches);
    a model with ``pipeline_layers()``: cross-entropy over the output's last dimension
    (classes last: (B, C) against (B,), or (B, T, C) against (B, T)); ``nn.Sequential``:
    ``F.cross_entropy(output, targets)`` (classification).
    """
    if isinstance(model, TextLM) or is_hf_causal_lm(model) or hasattr(model, "pipeline_layers"):
        return _next_token_loss
    return _sequential_loss


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs to hold and to run.

    Attributes:
        compute: relative compute per sample (multiply-adds of its weight matrices; only
            ratios matter).
        memory_bytes: bytes to train it: parameters, gradients and AdamW state.
    """

    compute: float
    memory_bytes: int


def estimate_layer_costs(layers: Sequence[nn.Module]) -> list[LayerCost]:
    """Rough costs of ``layers``: compute from matrix weights, memory from all parameters.

    An embedding is a lookup, so its table counts for memory but hardly for compute.
    """
    costs = []
    for layer in layers:
        numel = sum(p.numel() for p in layer.parameters())
        matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        costs.append(LayerCost(compute=float(matmul) + 1.0, memory_bytes=numel * 4 * _TRAINING_COPIES))
    return costs


@dataclass(frozen=True)
class NodeSpec:
    """A machine that can hold one stage.

    Attributes:
        name: how errors and plans name it.
        speed: relative compute speed (> 0; only ratios matter).
        memory_bytes: most bytes of layer state it may hold (> 0).
    """

    name: str
    speed: float
    memory_bytes: int

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ConfigError(f"node {self.name!r}: speed must be > 0, got {self.speed}")
        if self.memory_bytes <= 0:
            raise ConfigError(f"node {self.name!r}: memory_bytes must be > 0, got {self.memory_bytes}")


def plan_stages(layer_costs: Sequence[LayerCost], nodes: Sequence[NodeSpec]) -> list[tuple[int, int]]:
    """Split layers into one contiguous, non-empty range per node, in node order.

    The plan minimises the slowest stage's time (its compute divided by its node's speed)
    among the plans where every stage fits its node's memory; ties go to the plan that
    gives earlier nodes fewer layers. Exact dynamic programming, O(nodes × layers²).

    Args:
        layer_costs: each layer's cost, first to last.
        nodes: the machines, in pipeline order (the first holds layer 0).

    Returns:
        ``[(start, stop), ...]``, one half-open layer range per node, covering every layer.

    Raises:
        ConfigError: no nodes, fewer layers than nodes, or no plan fits the memory (the
            message gives the model's total and the nodes' memory).
    """
    n, s = len(layer_costs), len(nodes)
    if s == 0:
        raise ConfigError("plan_stages needs at least one node")
    if n < s:
        raise ConfigError(f"cannot give {s} nodes a stage each: the model has only {n} layers")
    compute = [0.0]
    memory = [0]
    for c in layer_costs:
        compute.append(compute[-1] + c.compute)
        memory.append(memory[-1] + c.memory_bytes)
    # best[k][j]: the smallest slowest-stage time placing layers [0, j) on nodes [0, k).
    best = [[math.inf] * (n + 1) for _ in range(s + 1)]
    cut = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = 0.0
    for k in range(1, s + 1):
        node = nodes[k - 1]
        for j in range(k, n - (s - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == math.inf or memory[j] - memory[i] > node.memory_bytes:
                    continue
                t = max(best[k - 1][i], (compute[j] - compute[i]) / node.speed)
                if t < best[k][j]:
                    best[k][j], cut[k][j] = t, i
    if best[s][n] == math.inf:
        total = memory[n]
        largest = max(c.memory_bytes for c in layer_costs)
        raise ConfigError(
            f"the model does not fit on these nodes: training it needs {_mib(total)} "
            f"(largest layer {_mib(largest)}) and the nodes hold "
            + ", ".join(f"{nd.name} {_mib(nd.memory_bytes)}" for nd in nodes)
            + " in contiguous stages; add nodes or memory, or use a smaller model"
        )
    ranges: list[tuple[int, int]] = []
    j = n
    for k in range(s, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def build_stage(
    model_factory: Callable[[int], nn.Module], seed: int, start: int, stop: int
) -> tuple[nn.Sequential, LossFn]:
    """Build the layers ``[start, stop)`` of the model ``model_factory(seed)`` builds.

    Every replica calling this with the same arguments gets bit-identical parameters (the
    factory must be deterministic in ``seed``, as ``Task.build_model`` is).

    Args:
        model_factory: e.g. ``task.build_model``.
        seed: the initialisation seed shared by every stage and replica.
        start: first layer of the stage.
        stop: one past its last layer.

    Returns:
        The stage's layers as an ``nn.Sequential`` (in train mode), and the loss function a
        last stage applies to its output.

    Raises:
        ConfigError: the range is empty or outside the model's layers, or a parameter is
            shared (tied) between a layer of the range and one outside it.
    """
    model = seeded_module(lambda: model_factory(seed), seed)
    layers = split_layers(model)
    if not 0 <= start < stop <= len(layers):
        raise ConfigError(
            f"stage layer range [{start}, {stop}) is not within the model's {len(layers)} layers"
        )
    _refuse_shared_across(layers, start, stop)
    stage = nn.Sequential(*layers[start:stop])
    stage.train()
    return stage, loss_fn_for(model)


def _refuse_shared_across(layers: Sequence[nn.Module], start: int, stop: int) -> None:
    """Refuse a parameter held both by a layer in ``[start, stop)`` and by one outside it.

    Each stage trains its own copy, so a tied tensor (GPT-2's ``lm_head.weight`` is its
    token embedding's by default) would silently become two untied ones. Ties within one
    stage are fine: that stage holds the one tensor and sums both uses' gradients into it.
    """
    inside = {id(p): (i, name) for i in range(start, stop) for name, p in layers[i].named_parameters()}
    for j, layer in enumerate(layers):
        if start <= j < stop:
            continue
        for name, p in layer.named_parameters():
            if id(p) in inside:
                i, own = inside[id(p)]
                raise ConfigError(
                    f"layer {i}'s parameter {own!r} is the same tensor as layer {j}'s {name!r} (tied "
                    f"weights), and a stage of layers [{start}, {stop}) would split the two: keep both "
                    "layers in one stage, or untie them (build a Hugging Face model with "
                    "tie_word_embeddings=False)"
                )
