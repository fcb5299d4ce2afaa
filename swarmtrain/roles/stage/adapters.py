"""Splitting models the pipeline did not define: marked points and Hugging Face causal LMs.

A stage runs ``nn.Sequential(*layers[a:b])``, so every layer takes one tensor and returns
one tensor. Two ways to turn a user's model into such layers:

- **Marked points**: the model has a method ``pipeline_layers(self) -> list[nn.Module]``
  (see :func:`marked_layers` for the contract).
- **Hugging Face causal LMs** by their top-level children (:func:`hf_causal_lm_layers`):
  ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` become an embedding layer, one layer per
  decoder block and a head (final norm + ``lm_head``). Each block runs with no cache and no
  padding mask: every sequence is whole, causal attention over positions ``0 .. T - 1``.

``transformers`` is never imported here: a model of its classes can only exist once the
user has imported it, so the classes are looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from swarmtrain.errors import ConfigError

__all__ = ["hf_causal_lm_layers", "is_hf_causal_lm", "marked_layers"]

_SUPPORTED_HF = ("GPT2LMHeadModel", "LlamaForCausalLM")


def marked_layers(model: nn.Module) -> list[nn.Module] | None:
    """The layers a model marks with its ``pipeline_layers()`` method, checked.

    The contract of ``pipeline_layers(self) -> list[nn.Module]``: each layer takes one
    tensor and returns one tensor (the first takes the batch's inputs, the last returns
    what the loss takes); applying them in order is the model's forward; they hold the
    model's own parameters (modules of the model, or small wrappers around them), not
    copies; and every trainable parameter of the model is in one of them.

    Returns:
        The layers, or None if the model has no ``pipeline_layers`` attribute.

    Raises:
        ConfigError: ``pipeline_layers`` is not callable, returns no layers or something
            other than modules, gives a layer a parameter the model does not have, or
            leaves a trainable parameter of the model out.
    """
    method = getattr(model, "pipeline_layers", None)
    if method is None:
        return None
    name = type(model).__name__
    if not callable(method):
        raise ConfigError(f"{name}.pipeline_layers must be a method returning the layers, "
                          f"got a {type(method).__name__}")
    layers = list(method())
    if not layers:
        raise ConfigError(f"{name}.pipeline_layers() returned no layers")
    owned = {id(p): n for n, p in model.named_parameters()}
    covered: set[int] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ConfigError(f"{name}.pipeline_layers()[{i}] is a {type(layer).__name__}, not an nn.Module")
        for pname, p in layer.named_parameters():
            if id(p) not in owned:
                raise ConfigError(f"{name}.pipeline_layers()[{i}] has a parameter {pname!r} that is not "
                                  "one of the model's: the layers must share the model's parameters, not "
                                  "copy them")
            covered.add(id(p))
    left_out = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if left_out:
        raise ConfigError(f"{name}.pipeline_layers() leaves out trainable parameters of the model "
                          f"({', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''}): no stage "
                          "would train them; put them in a layer or freeze them (requires_grad=False)")
    return layers


def _transformers_class(name: str) -> type | None:
    """``transformers.<name>`` if ``transformers`` is imported and has it, else None."""
    module = sys.modules.get("transformers")
    if module is None:
        return None
    try:
        cls = getattr(module, name)
    except (AttributeError, ImportError):
        return None
    return cls if isinstance(cls, type) else None


def _is_instance(model: nn.Module, class_name: str) -> bool:
    cls = _transformers_class(class_name)
    return cls is not None and isinstance(model, cls)


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM that :func:`hf_causal_lm_layers` splits."""
    return any(_is_instance(model, name) for name in _SUPPORTED_HF)


def hf_causal_lm_layers(model: nn.Module) -> list[nn.Module] | None:
    """A Hugging Face causal LM as pipeline layers, or None if ``model`` is no HF model.

    ``GPT2LMHeadModel``: token + position embeddings + dropout (positions ``0 .. T - 1``),
    each of ``transformer.h``, then ``ln_f`` + ``lm_head``. ``LlamaForCausalLM``:
    ``embed_tokens``, each of ``model.layers`` (rotary position embeddings of positions
    ``0 .. T - 1`` computed in the layer by the model's own ``rotary_emb``), then ``norm`` +
    ``lm_head``. Layers take token ids (B, T) or hidden states (B, T, d); the head returns
    logits (B, T, vocab), as the HF model's ``forward(input_ids=...).logits``.

    Raises:
        ConfigError: an HF model of another family (the message names the supported ones
            and ``pipeline_layers()``), or an attention implementation other than
            ``"sdpa"`` or ``"eager"``.
    """
    hf: Any = model  # transformers' classes are not imported here, so not typed here
    if _is_instance(model, "GPT2LMHeadModel"):
        _check_attention(model)
        t = hf.transformer
        return [_GPT2Embedding(t.wte, t.wpe, t.drop, hf.config.n_positions),
                *(_HFBlock(block, hf.config) for block in t.h),
                _HFHead(t.ln_f, hf.lm_head)]
    if _is_instance(model, "LlamaForCausalLM"):
        _check_attention(model)
        inner = hf.model
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is None:
            raise ConfigError(f"this transformers version's {type(model).__name__} has no model.rotary_emb "
                              "(its rotary embeddings live in each attention layer): splitting it into "
                              "pipeline stages needs a newer transformers")
        blocks = inner.layers[: hf.config.num_hidden_layers]
        return [_LlamaEmbedding(inner.embed_tokens),
                *(_LlamaBlock(block, rotary, hf.config) for block in blocks),
                _HFHead(inner.norm, hf.lm_head)]
    if _is_instance(model, "PreTrainedModel"):
        raise ConfigError(f"cannot split a Hugging Face {type(model).__name__} into pipeline stages: the "
                          f"supported families are {', '.join(_SUPPORTED_HF)}; for another model, give it "
                          "(or a wrapper) a pipeline_layers() method returning its layers")
    return None


def _check_attention(model: nn.Module) -> None:
    impl = _attention_implementation(getattr(model, "config", None))
    if impl not in ("sdpa", "eager"):
        raise ConfigError(f"{type(model).__name__} uses attention implementation {impl!r}: pipeline stages "
                          "run 'sdpa' or 'eager' (build the model with attn_implementation='sdpa')")


def _attention_implementation(config: Any) -> str:
    return str(getattr(config, "_attn_implementation", None) or "eager")


def _causal_mask(config: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    """The attention mask the HF model itself builds for an unpadded batch.

    SDPA: None (the attention then runs ``is_causal``); eager: an additive (1, 1, T, T)
    mask, 0 on and below the diagonal and the dtype's minimum above it.
    """
    if _attention_implementation(config) == "sdpa":
        return None
    t = hidden.shape[1]
    full = torch.full((t, t), torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=hidden.device)
    return full.triu(1)[None, None]


def _hidden_of(out: Any) -> torch.Tensor:
    """A block's hidden states: transformers 5 returns the tensor, 4.x a tuple headed by it."""
    return out if isinstance(out, torch.Tensor) else out[0]


class _GPT2Embedding(nn.Module):
    """Layer 0 of a GPT-2: tokens (B, T) int64 -> hidden states (B, T, d)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module, context: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop
        self.context = context

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context of {self.context}")
        pos = torch.arange(t, device=tokens.device)
        out: torch.Tensor = self.drop(self.wte(tokens) + self.wpe(pos))
        return out


class _LlamaEmbedding(nn.Module):
    """Layer 0 of a Llama: tokens (B, T) int64 -> hidden states (B, T, d); positions enter
    in each block, as rotary embeddings."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(tokens)
        return out


class _HFBlock(nn.Module):
    """One GPT-2 block on hidden states (B, T, d): causal, no cache."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = _causal_mask(self.config, hidden)
        return _hidden_of(self.block(hidden, attention_mask=mask, use_cache=False))


class _LlamaBlock(nn.Module):
    """One Llama decoder layer on hidden states (B, T, d), with the rotary embeddings of
    positions ``0 .. T - 1`` from the model's shared ``rotary_emb`` (it has no parameters)."""

    def __init__(self, block: nn.Module, rotary: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out = self.block(hidden, attention_mask=_causal_mask(self.config, hidden), position_ids=pos,
                         position_embeddings=self.rotary(hidden, pos), use_cache=False)
        return _hidden_of(out)


class _HFHead(nn.Module):
    """Last layer: final norm and ``lm_head``, hidden states (B, T, d) -> logits (B, T, vocab)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out
