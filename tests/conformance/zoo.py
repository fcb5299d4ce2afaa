"""The model zoo: each entry is a :class:`~.harness.Case` — a model factory, its data, how to
get logits from it, a learning rate and a training length — small enough to train in a few
seconds on 2 CPU cores.

| case | model | data | metric |
|---|---|---|---|
| ``gpt2`` | Hugging Face ``GPT2LMHeadModel``, tied embeddings | stdlib source bytes | held-out loss |
| ``bert`` | Hugging Face ``BertForSequenceClassification`` | synthetic token-count task | accuracy |
| ``resnet`` | a ResNet-style CNN with BatchNorm (``nn.Sequential``) | digits as 1x8x8 | accuracy |
| ``frozen`` | an MLP whose first layers are frozen (``requires_grad_(False)``) | digits | accuracy |
| ``layerdrop`` | residual MLP blocks skipped at random in training | digits | accuracy |
| ``lstm`` | embedding, LSTM, linear head (``nn.Sequential``) | synthetic majority-token task | accuracy |
| ``bf16`` | a digits MLP, ``model.to(torch.bfloat16)`` | digits (bf16 inputs) | accuracy |

Nothing is downloaded: the Hugging Face models are built from configs, the data is made
here or read from the Python standard library and scikit-learn's bundled digits.

Every factory is a pure function of its seed (:func:`~swarmtrain.tasks.seeded_module`), so a
coordinator, its workers, every peer and every pipeline stage build the same initial model.
"""

from __future__ import annotations

import dataclasses
import functools
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmtrain.tasks import DigitsTask, TaskData, TensorPairDataset, seeded_module

from .harness import Case

__all__ = ["CASES", "SEQUENTIAL", "case", "scaled"]

# --- data -----------------------------------------------------------------------------------


@functools.cache
def digits_data(image: bool = False, dtype: torch.dtype = torch.float32) -> TaskData:
    """scikit-learn's digits (features / 16, the split of ``DigitsTask``), as 64 features or
    as 1x8x8 images, in ``dtype``."""
    base = DigitsTask().load_data()
    out = []
    for split in (base.train, base.heldout):
        assert isinstance(split, TensorPairDataset)
        x = split.inputs.view(-1, 1, 8, 8) if image else split.inputs
        out.append(TensorPairDataset(x.to(dtype).contiguous(), split.targets))
    return TaskData(train=out[0], heldout=out[1])


# A fixed list of standard-library modules, so every machine reads the same bytes.
_STDLIB_FILES = ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py",
                 "pathlib.py", "json/decoder.py", "json/encoder.py", "shutil.py", "tempfile.py")


class ByteWindows:
    """Windows of ``context + 1`` bytes of a stream, ``stride`` bytes apart: inputs are the
    first ``context`` bytes (int64), targets the same shifted by one."""

    def __init__(self, data: torch.Tensor, context: int, stride: int) -> None:
        self.data, self.context, self.stride = data, context, stride

    def __len__(self) -> int:
        return (self.data.numel() - self.context - 1) // self.stride + 1

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = indices.long().unsqueeze(1) * self.stride + torch.arange(self.context + 1)
        window = self.data[offsets].long()
        return window[:, :-1], window[:, 1:]


@functools.cache
def stdlib_bytes_data(context: int = 32, stride: int = 8) -> TaskData:
    """Bytes of a few stdlib source files; the last 10% of the stream is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    stream = b"\n".join((root / name).read_bytes() for name in _STDLIB_FILES)
    data = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    cut = data.numel() * 9 // 10
    return TaskData(train=ByteWindows(data[:cut], context, stride),
                    heldout=ByteWindows(data[cut:], context, context))


@functools.cache
def token_count_data(n: int = 3000, length: int = 16, vocab: int = 64, seed: int = 5) -> TaskData:
    """A separable sequence task for BERT: position 0 is a [CLS] token (1); label 1 when the
    sequence holds more tokens of the set 2..9 than of 10..17 (ties are dropped), others are
    noise drawn from 18..vocab-1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(18, vocab, (n * 2, length), generator=g)
    kind = torch.randint(0, 3, (n * 2, length), generator=g)  # 0 noise, 1 set A, 2 set B
    x = torch.where(kind == 1, torch.randint(2, 10, x.shape, generator=g), x)
    x = torch.where(kind == 2, torch.randint(10, 18, x.shape, generator=g), x)
    x[:, 0] = 1
    a, b = (kind[:, 1:] == 1).sum(1), (kind[:, 1:] == 2).sum(1)
    keep = a != b
    x, y = x[keep][:n], (a > b)[keep][:n].long()
    cut = n * 4 // 5
    return TaskData(train=TensorPairDataset(x[:cut], y[:cut]), heldout=TensorPairDataset(x[cut:], y[cut:]))


@functools.cache
def majority_token_data(n: int = 3000, length: int = 20, vocab: int = 16, classes: int = 4,
                        seed: int = 6) -> TaskData:
    """A sequence task for the LSTM: label = the signal token (0..classes-1) that occurs most
    often (the lowest on a tie) among noise tokens classes..vocab-1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(classes, vocab, (n, length), generator=g)
    signal = torch.rand(n, length, generator=g) < 0.4
    x = torch.where(signal, torch.randint(0, classes, (n, length), generator=g), x)
    counts = torch.stack([(x == c).sum(1) for c in range(classes)], dim=1)
    y = counts.argmax(dim=1)
    cut = n * 4 // 5
    return TaskData(train=TensorPairDataset(x[:cut], y[:cut]), heldout=TensorPairDataset(x[cut:], y[cut:]))


# --- models ---------------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a (projected, when the shape changes) skip, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def resnet(width: int = 16) -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()),
        ResidualBlock(width, width),
        ResidualBlock(width, 2 * width, stride=2),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10)),
    )


def digits_mlp() -> nn.Sequential:
    """The ``digits`` task's 64-128-64-10 MLP (initialised from the caller's seed)."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def frozen_backbone_mlp() -> nn.Sequential:
    """The digits MLP with its first layer (64-128 and its ReLU) frozen at the seeded
    initialisation, as a fine-tune freezes a backbone; the 128-64-10 head trains."""
    model = digits_mlp()
    for layer in list(model)[:2]:
        layer.requires_grad_(False)
    return model


class LayerDrop(nn.Module):
    """A residual MLP block skipped with probability ``p`` in training (always run in eval):
    on a skipped step its parameters get no gradient at all (``grad`` stays None)."""

    def __init__(self, width: int, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.ReLU(),
                                  nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and float(torch.rand(())) < self.p:
            return x
        return x + self.body(x)


def layerdrop_mlp(width: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), LayerDrop(width), LayerDrop(width),
                         nn.Linear(width, 10))


class LastHidden(nn.Module):
    """An LSTM over (B, T, d) that returns its last hidden state (B, hidden)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(x)
        return h[-1]


def lstm_classifier(vocab: int = 16, d: int = 32, hidden: int = 64, classes: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab, d), LastHidden(d, hidden), nn.Linear(hidden, classes))


def bf16_mlp() -> nn.Sequential:
    return digits_mlp().to(torch.bfloat16)


def gpt2(n_layer: int = 2, n_embd: int = 32, context: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=context, n_embd=n_embd, n_layer=n_layer, n_head=2,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def bert(vocab: int = 64, hidden: int = 32, layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=32,
                        num_labels=2,  # type: ignore[call-arg]  # a PretrainedConfig keyword
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _hf_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits


def _plain_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    return lambda seed: seeded_module(factory, seed)


# --- the cases ------------------------------------------------------------------------------

CASES: dict[str, Case] = {c.name: c for c in [
    Case("gpt2", _seeded(gpt2), stdlib_bytes_data, _hf_logits, kind="lm", lr=3e-3, batch_size=16, steps=320),
    Case("bert", _seeded(bert), token_count_data, _hf_logits, kind="classify", lr=2e-3, batch_size=32,
         steps=250, timing_repeats=3),
    Case("resnet", _seeded(resnet), lambda: digits_data(image=True), _plain_logits, kind="classify", lr=3e-3,
         batch_size=32, steps=360, buffers=True),
    Case("frozen", _seeded(frozen_backbone_mlp), digits_data, _plain_logits, kind="classify", lr=3e-3,
         batch_size=32, steps=400),
    Case("layerdrop", _seeded(layerdrop_mlp), digits_data, _plain_logits, kind="classify", lr=3e-3,
         batch_size=32, steps=600, repeats=5),
    Case("lstm", _seeded(lstm_classifier), majority_token_data, _plain_logits, kind="classify", lr=1e-2,
         batch_size=32, steps=500),
    Case("bf16", _seeded(bf16_mlp), lambda: digits_data(dtype=torch.bfloat16), _plain_logits,
         kind="classify", lr=3e-3, batch_size=32, steps=600),
]}

#: the cases that are an ``nn.Sequential`` of their layers, which the pipeline can split
SEQUENTIAL = ("resnet", "frozen", "layerdrop", "lstm", "bf16")


def case(name: str) -> Case:
    return CASES[name]


def scaled(name: str, **changes: Any) -> Case:
    """A case with other fields (e.g. ``steps=``), for the benchmark's larger runs."""
    return dataclasses.replace(CASES[name], **changes)
