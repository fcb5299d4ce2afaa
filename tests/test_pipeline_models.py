"""Pipeline mode on users' models: marked points, Hugging Face GPT-2 and Llama, tied weights,
and the yardstick (a GPT-2 trained through three stages equals it trained in one process)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from swarmtrain.app.pipeline_session import load_pipeline_task
from swarmtrain.errors import ConfigError
from swarmtrain.roles.stage import (
    ComputeConfig,
    PipelineTrainer,
    Router,
    RouterConfig,
    StageServer,
    StageServerConfig,
    TrainerConfig,
    build_stage,
    loss_fn_for,
    split_layers,
)
from swarmtrain.roles.stage.kvcache import run_incremental
from swarmtrain.tasks import Shard, seeded_module
from swarmtrain.testing.pipeline import FAST_TIMEOUTS, run_bounded

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `examples` is imported as the CLI's --task imports it
    sys.path.insert(0, str(ROOT))

from examples.pipeline_gpt2 import GPT2BytesTask, gpt2_config  # noqa: E402

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("one_torch_thread")]

SECRET = b"pipeline-models-secret"
SEED = 5
VOCAB = 64


def _gpt2(attn: str = "sdpa", tie: bool = False, n_layer: int = 3) -> nn.Module:
    config = GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16,
                        tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0,
                        attn_implementation=attn)  # type: ignore[call-arg]  # a PretrainedConfig keyword
    return seeded_module(lambda: GPT2LMHeadModel(config), SEED)


def _llama(attn: str = "sdpa") -> nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0,
                         attn_implementation=attn)  # type: ignore[call-arg]  # a PretrainedConfig keyword
    return seeded_module(lambda: LlamaForCausalLM(config), SEED)


def _compose(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_layers_compose_to_the_models_logits_and_gradients(family: str, attn: str) -> None:
    model = _gpt2(attn) if family == "gpt2" else _llama(attn)
    layers = split_layers(model)
    assert len(layers) == 3 + 2  # embedding, three blocks, head
    seq = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    x, y = seq[:, :-1], seq[:, 1:]  # the task's batches: inputs and the next tokens
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(_compose(layers, x), model(input_ids=x).logits, rtol=0, atol=1e-5)

    model.train()  # dropout is off: training mode computes the same, with gradients
    loss_fn = loss_fn_for(model)
    params = list(model.parameters())
    want = torch.autograd.grad(loss_fn(model(input_ids=x).logits, y), params)
    got = torch.autograd.grad(loss_fn(_compose(layers, x), y), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the loss is transformers' own causal-LM loss (which shifts unshifted labels itself)
    with torch.no_grad():
        torch.testing.assert_close(loss_fn(_compose(layers, x), y), model(input_ids=seq, labels=seq).loss,
                                   rtol=0, atol=1e-5)


def test_stages_of_a_gpt2_built_apart_compose_to_the_model() -> None:
    model = _gpt2().eval()
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    out = x
    for a, b in [(0, 2), (2, 4), (4, 5)]:
        stage, _ = build_stage(lambda seed: _gpt2(), SEED, a, b)
        out = stage.eval()(out)
    torch.testing.assert_close(out, model(input_ids=x).logits, rtol=0, atol=1e-5)


def test_gpt2_stages_generate_incrementally_as_the_whole_window() -> None:
    """The HF layers have no incremental forward: a stage recomputes them on the history it
    keeps, which gives the logits of the whole window at every new position."""
    model = _gpt2().eval()
    seq = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    stages = [build_stage(lambda seed: _gpt2(), SEED, a, b)[0].eval() for a, b in [(0, 2), (2, 5)]]
    states: list[Any] = [None, None]
    for start, stop in [(0, 8), (8, 9), (9, 10), (10, 12)]:
        x = seq[:, start:stop]
        for i, stage in enumerate(stages):
            x, states[i] = run_incremental(stage, x, states[i], start)
        with torch.no_grad():
            want = model(input_ids=seq[:, :stop]).logits[:, start:stop]
        torch.testing.assert_close(x, want, rtol=0, atol=1e-5)


class _Marked(nn.Module):
    """A model that says how it splits: a stem, then a head of two parts."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.stem(x)))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.stem, self.body[0], self.body[1], self.out]


def test_a_model_with_pipeline_layers_splits_as_it_says() -> None:
    model = _Marked()
    layers = split_layers(model)
    assert layers == [model.stem, model.body[0], model.body[1], model.out]
    x = torch.randn(5, 4)
    front, _ = build_stage(lambda seed: _Marked(), 0, 0, 2)
    back, loss_fn = build_stage(lambda seed: _Marked(), 0, 2, 4)
    torch.manual_seed(0)
    want = _Marked()
    front.load_state_dict(nn.Sequential(*split_layers(want)[:2]).state_dict())
    back.load_state_dict(nn.Sequential(*split_layers(want)[2:]).state_dict())
    torch.testing.assert_close(back(front(x)), want(x), rtol=0, atol=0)
    targets = torch.tensor([0, 1, 2, 0, 1])
    torch.testing.assert_close(loss_fn(want(x), targets), F.cross_entropy(want(x), targets))


def test_pipeline_layers_that_break_the_contract_are_refused() -> None:
    class Copies(_Marked):
        def pipeline_layers(self) -> list[nn.Module]:
            return [nn.Linear(4, 8), self.body, self.out]

    class LeavesOut(_Marked):
        def pipeline_layers(self) -> list[nn.Module]:
            return [self.stem, self.body]

    class Empty(_Marked):
        def pipeline_layers(self) -> list[nn.Module]:
            return []

    with pytest.raises(ConfigError, match="share the model's parameters, not copy them"):
        split_layers(Copies())
    with pytest.raises(ConfigError, match=r"leaves out trainable parameters of the model \(out.weight"):
        split_layers(LeavesOut())
    with pytest.raises(ConfigError, match="returned no layers"):
        split_layers(Empty())


def test_tied_embeddings_are_refused_across_stages_and_kept_within_one() -> None:
    def factory(seed: int) -> nn.Module:
        return _gpt2(tie=True)

    layers = split_layers(factory(0))
    n = len(layers)
    for a, b in [(0, 2), (2, n)]:
        with pytest.raises(ConfigError, match="tie_word_embeddings=False") as info:
            build_stage(factory, SEED, a, b)
        assert "wte.weight" in str(info.value) and "lm_head.weight" in str(info.value)
    build_stage(factory, SEED, 1, 3)  # blocks only: nothing tied in or out
    whole, _ = build_stage(factory, SEED, 0, n)  # both ends in one stage: one tensor
    head: Any = whole[n - 1]
    embedding: Any = whole[0]
    assert head.lm_head.weight is embedding.wte.weight


def test_other_hf_models_and_attention_implementations_are_refused() -> None:
    bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=16))
    with pytest.raises(ConfigError, match="supported families are GPT2LMHeadModel, LlamaForCausalLM.*"
                                          "pipeline_layers"):
        split_layers(bert)
    model: Any = _gpt2()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="attn_implementation='sdpa'"):
        split_layers(model)


def test_the_example_task_is_loaded_by_its_module_path() -> None:
    task = load_pipeline_task("examples.pipeline_gpt2:task")
    assert isinstance(task, GPT2BytesTask)
    model = task.build_model(3)
    assert isinstance(model, GPT2LMHeadModel) and model.lm_head.weight is not model.transformer.wte.weight
    assert len(split_layers(model)) == gpt2_config().n_layer + 2
    with pytest.raises(ConfigError, match="shape the textlm task only"):
        load_pipeline_task("examples.pipeline_gpt2:task", d_model=32)


@pytest.fixture(scope="module")
def gpt2_data() -> Any:
    return GPT2BytesTask().load_data()


def test_gpt2_through_three_synchronous_stages_trains_as_one_process(gpt2_data: Any) -> None:
    """The yardstick: 8 steps of 4 chunks of 8 windows through three stages give the weights
    and the held-out loss of 8 AdamW steps of 32 windows in one plain PyTorch process."""
    task = GPT2BytesTask()
    steps, chunks, micro, lr, evals = 8, 4, 8, 3e-3, 64
    ranges = [(0, 2), (2, 4), (4, 6)]
    stages = []
    for i, (a, b) in enumerate(ranges):
        layers, loss_fn = build_stage(task.build_model, SEED, a, b)
        stages.append(StageServer(
            layers, stage=i, layer_range=(a, b), loss_fn=loss_fn if i == 2 else None,
            compute=ComputeConfig(learning_rate=lr, weight_decay=0.0, grad_clip=0.0),
            config=StageServerConfig(timeouts=FAST_TIMEOUTS), secret=SECRET, name=f"gpt2-{i}"))

    async def main() -> float:
        for srv in stages:
            await srv.start()
        router = Router([[srv.address] for srv in stages], secret=SECRET,
                        config=RouterConfig(timeouts=FAST_TIMEOUTS))
        try:
            trainer = PipelineTrainer(router, gpt2_data.train, TrainerConfig(  # no clipping anywhere
                batch_size=micro, schedule="sync", chunks=chunks, seed=1, grad_clip=0.0))
            assert len(await trainer.train(steps * chunks)) == steps * chunks
            heldout_loss: float = await trainer.evaluate(gpt2_data.heldout, loss_fn_for(task.build_model(0)),
                                                         max_samples=evals)
            return heldout_loss
        finally:
            await router.close()
            for srv in stages:
                await srv.close()

    piped_loss = run_bounded(main(), 60.0)
    assert [srv.compute.steps for srv in stages] == [steps] * 3
    piped = [p.detach().clone() for srv in stages for p in srv.compute.layers.parameters()]

    model = task.build_model(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    shard = Shard(gpt2_data.train, 0, 1, seed=1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(model, shard.next_batch(micro * chunks)).backward()
        opt.step()
    alone = [p.detach() for layer in split_layers(model) for p in layer.parameters()]
    alone_loss = task.evaluate(model, gpt2_data, max_samples=evals)["loss"]
    start_loss = task.evaluate(task.build_model(SEED), gpt2_data, max_samples=evals)["loss"]

    gap = max(float((a - b).abs().max()) for a, b in zip(piped, alone, strict=True))
    print(f"\nGPT-2 yardstick: max weight gap {gap:.2e}; held-out loss {start_loss:.4f} at the start, "
          f"pipeline {piped_loss:.6f}, one process {alone_loss:.6f}")
    assert gap < 1e-4, gap
    assert abs(piped_loss - alone_loss) <= 0.01 * alone_loss, (piped_loss, alone_loss)
    assert alone_loss < start_loss - 0.1  # it did learn something
