"""Pipeline mode: attention (KV) caches for generation, at the layer level (pure, CPU).

Stages of a small TextLM run new positions only (``run_incremental``) and must agree with
the full forward at every position; layers without ``forward_incremental`` are recomputed
from their input history; ``SessionCaches`` bounds, evicts and expires per-session states.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn

from swarmtrain.roles.stage import build_stage, split_layers
from swarmtrain.roles.stage.kvcache import (
    CacheMismatch,
    IncrementalLayer,
    SessionCaches,
    run_incremental,
    state_nbytes,
    window_step,
)
from swarmtrain.tasks import TextLMConfig, TextLMTask

pytestmark = pytest.mark.timeout(60)

TASK = TextLMTask(TextLMConfig(context=32, d_model=32, n_heads=2, n_layers=3))
SEED = 5
CUTS = [(0, 2), (2, 4), (4, 5)]  # embedding + block 0 | blocks 1, 2 | head


def _stages(cuts: list[tuple[int, int]] = CUTS) -> list[nn.Sequential]:
    stages = [build_stage(TASK.build_model, SEED, a, b)[0] for a, b in cuts]
    for stage in stages:
        stage.eval()
    return stages


def _full_model() -> nn.Module:
    model = TASK.build_model(SEED)
    model.eval()
    return model


class _Hidden(nn.Module):
    """Runs ``inner`` but hides its ``forward_incremental``: the runner must recompute it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _Pipeline:
    """The stages of one generation session, run incrementally as stage servers would."""

    def __init__(self, stages: list[nn.Sequential]) -> None:
        self.stages = stages
        self.states: list[list[Any] | None] = [None] * len(stages)
        self.length = 0

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        if start == 0:
            self.states = [None] * len(self.stages)
        x = tokens
        for i, stage in enumerate(self.stages):
            x, self.states[i] = run_incremental(stage, x, self.states[i], start)
        self.length = start + tokens.shape[1]
        return x


def _tokens(n: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(11))


def test_textlm_layers_implement_the_protocol() -> None:
    layers = split_layers(_full_model())
    assert all(isinstance(layer, IncrementalLayer) for layer in layers)
    assert not isinstance(_Hidden(layers[1]), IncrementalLayer)


def test_prefill_then_single_steps_match_the_full_forward() -> None:
    tokens = _tokens(TASK.config.context)
    prefill = 5
    model = _full_model()
    with torch.no_grad():
        want = model(tokens)
        want_prefill = model(tokens[:, :prefill])
    pipe = _Pipeline(_stages())
    got = [pipe.step(tokens[:, :prefill], 0)]
    # a prefill from position 0 is the full forward's own arithmetic on those tokens
    assert torch.equal(got[0], want_prefill)
    pos = prefill
    for width in [1] * 10 + [3, 1, 4, 1, 1, 2]:  # single tokens, and chunks after a cache
        got.append(pipe.step(tokens[:, pos:pos + width], pos))
        pos += width
    got.append(pipe.step(tokens[:, pos:], pos))
    assert pipe.length == TASK.config.context
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-5)


def _greedy_uncached(model: nn.Module, prompt: list[int], n_new: int) -> list[int]:
    tokens = list(prompt)
    context = TASK.config.context
    with torch.no_grad():
        for _ in range(n_new):
            window = tokens[-context:]
            tokens.append(int(model(torch.tensor([window]))[0, -1].argmax()))
    return tokens[len(prompt):]


def _greedy_cached(pipe: _Pipeline, prompt: list[int], n_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n_new):
        start, first = window_step(len(tokens), pipe.length, TASK.config.context)
        logits = pipe.step(torch.tensor([tokens[first:]]), start)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_cached_greedy_generation_gives_the_uncached_tokens() -> None:
    prompt = list(b"def ")
    n_new = 40  # 29 steps within the context of 32, then the sliding window
    want = _greedy_uncached(_full_model(), prompt, n_new)
    assert _greedy_cached(_Pipeline(_stages()), prompt, n_new) == want
    assert len(set(want)) > 1  # not a degenerate constant sequence


def test_layers_without_forward_incremental_are_recomputed() -> None:
    tokens = _tokens(20)
    with torch.no_grad():
        want = _full_model()(tokens)
    stages = _stages()
    # hide the embedding, one block of the middle stage and the head
    stages[0][0] = _Hidden(stages[0][0])
    stages[1][0] = _Hidden(stages[1][0])
    stages[2][0] = _Hidden(stages[2][0])
    pipe = _Pipeline(stages)
    got = [pipe.step(tokens[:, :6], 0)]
    for pos in range(6, 20, 2):
        got.append(pipe.step(tokens[:, pos:pos + 1], pos))
        got.append(pipe.step(tokens[:, pos + 1:pos + 2], pos + 1))
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-5)
    # the hidden block's slot holds its whole input history, a copy of its own
    history = pipe.states[1][0]  # type: ignore[index]
    assert isinstance(history, torch.Tensor) and history.shape == (2, 20, TASK.config.d_model)


def test_a_stage_of_plain_layers_runs_by_recomputation() -> None:
    stage = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3)).eval()
    x = torch.randn(2, 7, 4)
    y1, states = run_incremental(stage, x[:, :3], None, 0)
    y2, states = run_incremental(stage, x[:, 3:], states, 3)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat((y1, y2), dim=1), stage(x), rtol=0, atol=1e-6)
    assert [s.shape[1] for s in states] == [7, 7, 7]


def test_incremental_calls_refuse_misuse() -> None:
    stage = _stages([(0, 5)])[0]
    _, states = run_incremental(stage, _tokens(30), None, 0)
    with pytest.raises(ValueError, match="outside the context of 32"):
        run_incremental(stage, _tokens(3), states, 30)
    with pytest.raises(ValueError, match="holds 30 positions"):
        run_incremental(stage, _tokens(1), states, 29)
    with pytest.raises(ValueError, match="first call"):
        run_incremental(stage, _tokens(1), None, 4)
    with pytest.raises(ValueError, match="4 states given"):
        run_incremental(stage, _tokens(1), states[:4], 30)
    with pytest.raises(ValueError, match="batch of 1"):
        run_incremental(stage, _tokens(1, batch=1), states, 30)
    stage.train()
    with pytest.raises(ValueError, match="eval mode only"):
        run_incremental(stage, _tokens(1), states, 30)


def test_window_step_sends_only_new_positions_within_the_context() -> None:
    assert window_step(5, 0, 32) == (0, 0)  # prefill
    assert window_step(6, 5, 32) == (5, 5)  # one new token
    assert window_step(32, 31, 32) == (31, 31)
    assert window_step(33, 32, 32) == (0, 1)  # past the context: restart with the window
    assert window_step(40, 32, 32) == (0, 8)
    with pytest.raises(ValueError):
        window_step(5, 5, 32)


# --- SessionCaches ---------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(nbytes: int) -> list[Any]:
    return [None, (torch.zeros(nbytes // 8), torch.zeros(nbytes // 8))]  # float32: 4 bytes each


def test_state_nbytes_counts_each_storage_once() -> None:
    base = torch.zeros(10, 4)  # 160 bytes
    assert state_nbytes([None, (base, base[2:], base.T)]) == 160
    assert state_nbytes({"a": base, "b": [torch.zeros(3, dtype=torch.float64)]}) == 184
    assert state_nbytes(None) == 0


def test_session_caches_evict_least_recently_used_within_the_byte_bound() -> None:
    caches = SessionCaches(max_bytes=1000, clock=_Clock())
    caches.put("a", _state(400), 4, start=0)
    caches.put("b", _state(400), 4, start=0)
    assert caches.stats().bytes == 800
    hit = caches.get("a")  # "a" is now the most recently used: "b" goes first
    assert hit is not None and hit.length == 4
    caches.put("c", _state(400), 4, start=0)
    assert caches.get("b") is None
    assert caches.get("a") is not None and caches.get("c") is not None
    # a session's new state replaces its old one
    caches.put("c", _state(480), 5, start=4)
    stats = caches.stats()
    assert (stats.sessions, stats.bytes, stats.evictions) == (2, 880, 1)
    # a state larger than the whole bound is not kept, and counts as an eviction
    caches.put("d", _state(1200), 3, start=0)
    stats = caches.stats()
    assert (stats.sessions, stats.evictions, caches.get("d")) == (2, 2, None)
    assert (stats.hits, stats.misses) == (3, 1)
    caches.drop("a")
    caches.drop("never")
    assert caches.stats().bytes == 480


def test_session_caches_expire_idle_sessions() -> None:
    clock = _Clock()
    caches = SessionCaches(max_bytes=10_000, idle_seconds=300, clock=clock)
    caches.put("old", _state(80), 2, start=0)
    clock.now += 200
    caches.put("young", _state(80), 2, start=0)
    clock.now += 150  # "old" idle 350 s, "young" 150 s
    assert caches.get("old") is None
    assert caches.get("young") is not None  # use resets its idle time
    clock.now += 299
    stats = caches.stats()
    assert (stats.sessions, stats.expired, stats.bytes) == (1, 1, 80)
    clock.now += 1
    stats = caches.stats()
    assert (stats.sessions, stats.expired, stats.bytes) == (0, 2, 0)
    assert (stats.hits, stats.misses) == (1, 1)


def test_session_caches_refuse_a_start_other_than_the_cached_length() -> None:
    caches = SessionCaches(clock=_Clock())
    with pytest.raises(CacheMismatch, match="no cache, not 3: cache miss, resend from position 0"):
        caches.put("s", _state(80), 4, start=3)
    caches.put("s", _state(80), 4, start=0)
    with pytest.raises(CacheMismatch, match="a cache of 4 positions, not 5"):
        caches.put("s", _state(80), 6, start=5)
    with pytest.raises(ValueError, match="must end after it"):
        caches.put("s", _state(80), 4, start=4)
    entry = caches.get("s")
    assert entry is not None and entry.length == 4  # refusals leave the cache as it was
    caches.put("s", _state(80), 2, start=0)  # start 0 restarts the session
    entry = caches.get("s")
    assert entry is not None and entry.length == 2
    with pytest.raises(ValueError):
        SessionCaches(max_bytes=0)
    with pytest.raises(ValueError):
        SessionCaches(idle_seconds=0)


def test_session_caches_are_consistent_under_threads() -> None:
    caches = SessionCaches(max_bytes=50 * 800)

    def generate(worker: int) -> None:
        for session in range(20):
            name = f"w{worker}-{session}"
            caches.put(name, _state(80), 1, start=0)
            for length in range(1, 10):
                if caches.get(name) is None:
                    break  # evicted by another worker: resend from 0, as a client would
                try:
                    caches.put(name, _state(80 * (length + 1)), length + 1, start=length)
                except CacheMismatch as exc:
                    # evicted by another worker between the get and the put (the put is what
                    # a client relies on, not the get: it says so, and the client resends from 0);
                    # never a cache of another length
                    assert "holds no cache" in str(exc), exc
                    break
            caches.stats()

    with ThreadPoolExecutor(max_workers=4) as pool:
        for future in [pool.submit(generate, w) for w in range(4)]:
            future.result(timeout=30)  # re-raises a worker's error
    stats = caches.stats()
    assert stats.bytes <= caches.max_bytes and stats.evictions > 0
    held = [caches.get(f"w{w}-{s}") for w in range(4) for s in range(20)]
    assert stats.bytes == sum(state_nbytes(e.state) for e in held if e is not None)
    assert stats.sessions == sum(e is not None for e in held)


# --- through stage servers and the trainer ----------------------------------------------------


def _pipeline_servers(kv_cache_mb: float = 256.0) -> list[Any]:
    from swarmtrain.roles.stage import ComputeConfig, StageServer, StageServerConfig
    from swarmtrain.testing.pipeline import FAST_TIMEOUTS

    out = []
    for i, (a, b) in enumerate(CUTS):
        layers, loss_fn = build_stage(TASK.build_model, 1, a, b)
        last = i == len(CUTS) - 1
        out.append(StageServer(layers, stage=i, layer_range=(a, b), loss_fn=loss_fn if last else None,
                               compute=ComputeConfig(kv_cache_mb=kv_cache_mb if i == 1 else 256.0),
                               config=StageServerConfig(timeouts=FAST_TIMEOUTS), secret=b"kv", name=f"kv{i}"))
    return out


def _generate_both_ways(kv_cache_mb: float, prompt: bytes, n_new: int) -> dict[str, Any]:
    from swarmtrain.roles.stage import PipelineTrainer, Router, RouterConfig
    from swarmtrain.testing.pipeline import FAST_TIMEOUTS, run_bounded

    async def main() -> dict[str, Any]:
        servers = _pipeline_servers(kv_cache_mb)
        for s in servers:
            await s.start()
        route = [[s.address] for s in servers]
        router = Router(route, secret=b"kv", config=RouterConfig(timeouts=FAST_TIMEOUTS))
        trainer = PipelineTrainer(router, TASK.load_data().heldout, context=TASK.config.context)
        try:
            out = {f"{how}-{temp}": await trainer.generate(prompt, n_new, temp, seed=3, cache=how == "cached")
                   for how in ("cached", "uncached") for temp in (0.0, 1.0)}
            out["kv"] = servers[1].status()["kv_cache"]
            out["misses"] = trainer.cache_misses
            out["inferences"] = [s.compute.inferences for s in servers]
            return out
        finally:
            await router.close()
            for s in servers:
                await s.close()

    return run_bounded(main(), 90)  # type: ignore[no-any-return]


def test_generation_with_the_stages_caches_gives_the_bytes_it_gives_without() -> None:
    """Greedy and sampled, within the context and past it (sliding window): the same bytes,
    and the middle stage answered from its cache."""
    out = _generate_both_ways(256.0, b"import os\n", 40)  # 10 + 40 > context 32: slides past it
    assert out["cached-0.0"] == out["uncached-0.0"] and out["cached-1.0"] == out["uncached-1.0"], out
    assert len(set(out["cached-1.0"])) > 5  # sampled bytes vary: a real comparison
    assert out["kv"]["hits"] > 0 and out["misses"] == 0, out


def test_a_stage_that_cannot_keep_the_cache_is_sent_the_window_again() -> None:
    """A middle stage whose cache budget holds no session refuses every cached step; the
    trainer sends the whole window again each time and the bytes are still the same."""
    out = _generate_both_ways(1e-4, b"def f(x):", 12)
    assert out["cached-0.0"] == out["uncached-0.0"] and out["cached-1.0"] == out["uncached-1.0"], out
    assert out["misses"] >= 12 and out["kv"]["refused"] >= 12, out
