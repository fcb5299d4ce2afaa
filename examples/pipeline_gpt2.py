"""A Hugging Face GPT-2 trained in pipeline mode on the byte-level data of the ``textlm`` task.

The model is ``transformers``' own ``GPT2LMHeadModel``, built from a config (no download);
the pipeline splits it into an embedding layer, one layer per block and the head (see "Your
own model" in docs/pipeline-mode.md). Run from the repository's root, so that ``examples``
can be imported (``python -m`` puts the working directory on the import path):

    python -m swarmtrain stage --task examples.pipeline_gpt2:task --stage 0 --stages 3 --port 7300
    python -m swarmtrain stage --task examples.pipeline_gpt2:task --stage 1 --stages 3 --port 7301
    python -m swarmtrain stage --task examples.pipeline_gpt2:task --stage 2 --stages 3 --port 7302
    python -m swarmtrain pipeline --task examples.pipeline_gpt2:task \\
        --route "127.0.0.1:7300;127.0.0.1:7301;127.0.0.1:7302" --microbatches 200
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from swarmtrain.tasks import TaskData, TextLMConfig, TextLMTask, seeded_module

CONTEXT = 64


def gpt2_config() -> GPT2Config:
    """A tiny byte-level GPT-2 (one token per byte value).

    ``tie_word_embeddings=False``: GPT-2 ties ``lm_head.weight`` to the token embedding by
    default, and a tied tensor would straddle the first and last stages (the pipeline
    refuses it). Dropout is off so that a pipeline and one process compute the same thing.
    """
    return GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=CONTEXT,
                      tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)


class _Logits(nn.Module):
    """``model(tokens)`` -> logits, for code that calls a model on the inputs alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits
        return logits


class GPT2BytesTask(TextLMTask):
    """``textlm``'s data (byte windows of Python source, 64 bytes) with a Hugging Face GPT-2."""

    name = "gpt2-bytes"

    def __init__(self) -> None:
        # The shape the data and the estimates use; the model itself is gpt2_config().
        super().__init__(TextLMConfig(context=CONTEXT, d_model=64, n_heads=4, n_layers=4))

    def build_model(self, seed: int = 0) -> nn.Module:
        """A ``GPT2LMHeadModel`` of :func:`gpt2_config`, initialised from ``seed``."""
        return seeded_module(lambda: GPT2LMHeadModel(gpt2_config()), seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) on ``(inputs, targets)``."""
        inputs, targets = batch
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, model: nn.Module, data: TaskData, max_samples: int | None = None) -> dict[str, float]:
        """Held-out ``{"loss", "bits_per_byte"}``, as ``textlm`` measures them."""
        return super().evaluate(_Logits(model), data, max_samples)


def task() -> GPT2BytesTask:
    """The factory ``--task examples.pipeline_gpt2:task`` names."""
    return GPT2BytesTask()
