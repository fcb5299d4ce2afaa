"""``textlm``: a byte-level GPT-style language model trained on Python source.

The model is a plain decoder-only transformer (pre-LayerNorm blocks, causal attention through
``scaled_dot_product_attention``, 4x GELU MLP). Its blocks sit in an ``nn.ModuleList`` named
``blocks`` so the pipeline mode can split the model between stages: ``embed`` runs before the
first block and ``logits`` after the last.

The default corpus is the standard library's own ``.py`` files on this machine, so the task
needs no download. Machines with different Python versions see different corpora; give such
clusters the same JSONL file (``[data] path``).
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.errors import TaskError
from swarmtrain.tasks.base import Task, TaskData, evaluation_mode, seeded_module
from swarmtrain.tasks.jsonl import parse_text_record, read_jsonl

__all__ = [
    "VOCAB_SIZE",
    "ByteWindowDataset",
    "TextLM",
    "TextLMConfig",
    "TextLMTask",
    "load_stdlib_corpus",
]

VOCAB_SIZE = 256  # one token per byte value
_CORPUS_CAP_BYTES = 8 * 1024 * 1024
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_HELDOUT_FRACTION = 0.1
_DEFAULT_EVAL_SAMPLES = 256
_EVAL_CHUNK = 32


@dataclass(frozen=True)
class TextLMConfig:
    """Shape of the byte-level transformer."""

    context: int = 128  # tokens (bytes) the model sees at once
    d_model: int = 128  # width of the residual stream
    n_heads: int = 4  # attention heads; must divide d_model
    n_layers: int = 4  # transformer blocks
    dropout: float = 0.0  # dropout on attention, MLP output and embeddings

    def __post_init__(self) -> None:
        for key in ("context", "d_model", "n_heads", "n_layers"):
            if getattr(self, key) < 1:
                raise TaskError(f"TextLMConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.d_model % self.n_heads:
            raise TaskError(
                f"TextLMConfig.d_model ({self.d_model}) must be a multiple of "
                f"n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise TaskError(f"TextLMConfig.dropout must be in [0, 1), got {self.dropout}")


# An attention layer's cache: keys and values of every position so far, (B, heads, T, d / heads).
_KV = tuple[torch.Tensor, torch.Tensor]


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TextLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, d / heads)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_dropout(self.proj(y))

    def forward_incremental(
        self, x_new: torch.Tensor, state: _KV | None, start: int
    ) -> tuple[torch.Tensor, _KV]:
        """Attention output at positions ``start .. start + T_new - 1`` only.

        The new queries attend to every cached key and to the new keys up to their own
        position (causal among the new ones). Eval mode only: dropout is never applied, so
        a module in training mode is refused rather than silently computing something else.

        Args:
            x_new: hidden states (B, T_new, d) of the new positions (already normalised).
            state: ``(keys, values)``, each (B, heads, start, d / heads), from the previous
                call; None on the first (``start == 0``).
            start: the absolute position of ``x_new[:, 0]``: the number of cached positions.

        Returns:
            The output (B, T_new, d) and the new state holding all ``start + T_new`` positions.

        Raises:
            ValueError: training mode, or ``start`` / the batch size disagree with ``state``.
        """
        if self.training:
            raise ValueError("forward_incremental runs in eval mode only: call .eval() first")
        b, t, d = x_new.shape
        cached = 0 if state is None else state[0].shape[2]
        if start != cached or (state is not None and state[0].shape[0] != b):
            raise ValueError(
                f"attention cache holds {cached} positions of a batch of "
                f"{b if state is None else state[0].shape[0]}; got start {start} for a batch of {b}"
            )
        q, k, v = self.qkv(x_new).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if state is None:
            # Copies, not views: a view would keep the whole qkv output (queries too) alive.
            keys = k.clone(memory_format=torch.contiguous_format)
            values = v.clone(memory_format=torch.contiguous_format)
        else:
            keys = torch.cat((state[0], k), dim=2)
            values = torch.cat((state[1], v), dim=2)
        total = start + t
        if t == total:  # nothing cached: the training forward's own causal attention
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:
            # New query i sits at position start + i and sees keys 0 .. start + i.
            query_pos = torch.arange(start, total, device=x_new.device)
            key_pos = torch.arange(total, device=x_new.device)
            mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y), (keys, values)


class _Block(nn.Module):
    def __init__(self, cfg: TextLMConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward_incremental(
        self, x_new: torch.Tensor, state: _KV | None, start: int
    ) -> tuple[torch.Tensor, _KV]:
        """The block's output at the new positions only; ``state`` is its attention's
        ``(keys, values)`` cache (see :meth:`_CausalSelfAttention.forward_incremental`).
        Eval mode only (training mode raises ValueError)."""
        a, state = self.attn.forward_incremental(self.ln_1(x_new), state, start)
        x = x_new + a
        return x + self.mlp(self.ln_2(x)), state


class TextLM(nn.Module):
    """Byte-level decoder-only transformer: ``forward(tokens (B, T)) -> logits (B, T, 256)``.

    The output head is not tied to the token embedding: tied tensors cannot be saved by
    safetensors and would straddle the first and last pipeline stages.
    """

    def __init__(self, cfg: TextLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB_SIZE, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 scheme: N(0, 0.02), residual projections scaled down by depth so the
        # residual stream's variance does not grow with the number of blocks.
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            std = 0.02
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                std = 0.02 / math.sqrt(2 * self.config.n_layers)
            nn.init.normal_(p, mean=0.0, std=std)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings of ``tokens`` (B, T) -> hidden states (B, T, d_model)."""
        t = tokens.shape[1]
        if t > self.config.context:
            raise TaskError(f"sequence of {t} tokens exceeds the context of {self.config.context}")
        pos = torch.arange(t, device=tokens.device)
        return self.emb_dropout(self.tok_emb(tokens) + self.pos_emb(pos))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and output head: hidden states (B, T, d) -> logits (B, T, 256)."""
        return self.head(self.ln_f(hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)


class ByteWindowDataset:
    """Sample ``i`` is the window ``data[i : i + context + 1]`` of a byte stream.

    ``get_batch`` returns ``(inputs, targets)``: the first ``context`` bytes and the same
    window shifted by one, both int64 of shape ``(B, context)``.
    """

    def __init__(self, data: torch.Tensor, context: int) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TaskError(
                f"byte stream must be a 1-D uint8 tensor, got {data.dtype} "
                f"of shape {tuple(data.shape)}"
            )
        self.data = data
        self.context = context
        self._offsets = torch.arange(context + 1)

    def __len__(self) -> int:
        return max(0, self.data.numel() - self.context)

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows starting at ``indices`` as ``(inputs, targets)``."""
        windows = self.data[indices.unsqueeze(1) + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]


class TextLMTask(Task):
    """Byte-level language modelling; metric: held-out loss (nats per byte)."""

    name = "textlm"
    default_learning_rate = 1e-3
    default_batch_size = 16
    primary_metric = "loss"
    higher_is_better = False

    def __init__(self, config: TextLMConfig | None = None) -> None:
        self.config = config or TextLMConfig()

    def build_model(self, seed: int = 0) -> nn.Module:
        """A :class:`TextLM` of :attr:`config`'s shape, initialised deterministically."""
        return seeded_module(lambda: TextLM(self.config), seed)

    def load_data(self, path: str | None = None) -> TaskData:
        """The stdlib corpus, or a JSONL file of ``{"text": ...}`` lines joined with newlines.

        The last 10% of the byte stream is held out.

        Raises:
            TaskError: no data can be found, a record is malformed, or either split is
                shorter than one window.
        """
        if path:
            texts = read_jsonl(path, parse_text_record)
            stream = "\n".join(texts).encode("utf-8")
            source = f"data file {path!r}"
        else:
            stream = load_stdlib_corpus()
            source = "the standard-library corpus"
        data = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        split = len(stream) - int(len(stream) * _HELDOUT_FRACTION)
        window = self.config.context + 1
        if len(stream) - split < window:
            raise TaskError(
                f"{source} has {len(stream)} bytes: too few for a held-out split of at least "
                f"one {window}-byte window; give at least {math.ceil(window / _HELDOUT_FRACTION)}"
                " bytes"
            )
        return TaskData(
            train=ByteWindowDataset(data[:split], self.config.context),
            heldout=ByteWindowDataset(data[split:], self.config.context),
        )

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) on ``(inputs, targets)``."""
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))

    def evaluate(
        self, model: nn.Module, data: TaskData, max_samples: int | None = None
    ) -> dict[str, float]:
        """Held-out ``{"loss", "bits_per_byte"}`` on up to ``max_samples`` (default 256)
        windows spread evenly over the held-out stream (the same windows every call)."""
        available = len(data.heldout)
        limit = _DEFAULT_EVAL_SAMPLES if max_samples is None else max_samples
        n = min(available, max(1, limit))
        starts = torch.linspace(0, available - 1, n).round().long()
        total = 0.0
        tokens = 0
        with evaluation_mode(model):
            for lo in range(0, n, _EVAL_CHUNK):
                inputs, targets = data.heldout.get_batch(starts[lo : lo + _EVAL_CHUNK])
                logits = model(inputs)
                total += float(
                    F.cross_entropy(
                        logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="sum"
                    )
                )
                tokens += targets.numel()
        loss = total / tokens
        return {"loss": loss, "bits_per_byte": loss / math.log(2)}

    def sample_bytes_estimate(self) -> int:
        """Activations and their gradients for one window, fp32, with 2x slack."""
        c = self.config
        per_block = c.context * c.d_model * 12 + c.n_heads * c.context * c.context * 2
        floats = c.n_layers * per_block + c.context * (2 * c.d_model + 2 * VOCAB_SIZE)
        return floats * 4 * 2 * 2


def load_stdlib_corpus(cap_bytes: int = _CORPUS_CAP_BYTES) -> bytes:
    """The standard library's ``.py`` sources, concatenated in a fixed order.

    Directories are walked in sorted order, skipping ``site-packages`` and test directories;
    files are joined with a newline and the result is cut at ``cap_bytes``.

    Raises:
        TaskError: the standard library is not found or holds no ``.py`` files.
    """
    root = sysconfig.get_paths().get("stdlib", "")
    hint = 'pass a JSONL file of {"text": ...} lines as the data path ([data] path)'
    if not root or not os.path.isdir(root):
        raise TaskError(f"the Python standard library was not found (looked in {root!r}); {hint}")
    parts: list[bytes] = []
    size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, fname), "rb") as f:
                    content = f.read(cap_bytes - size)
            except OSError:
                continue  # an unreadable file is skipped the same way on every run
            parts.append(content + b"\n")
            size += len(content) + 1
            if size >= cap_bytes:
                return b"".join(parts)[:cap_bytes]
    if not parts:
        raise TaskError(f"no .py files found in the standard library at {root!r}; {hint}")
    return b"".join(parts)
