"""The fused CPU kernels (swarmtrain/compression/kernels.c) give, bit for bit, what the torch codecs
give, on every size, thread count and special value; they build once per machine, and a
machine that cannot build them falls back to torch with one clear line."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmtrain.compression.kernels import PUB_FP16, PUB_UNIFORM, Kernels, Publication, kernels
from swarmtrain.compression.simple import FP16Codec
from swarmtrain.compression.uniform import UniformCodec
from swarmtrain.roles.ps.adam import adam_step, held_variance_step, make_adam
from swarmtrain.roles.ps.common import LazyGradient
from swarmtrain.roles.ps.flat_adam import FlatAdam

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fast() -> Kernels:
    k = kernels()
    assert k is not None, "the kernels must build on this machine (gcc is installed here)"
    return k


def _pair(n: int, seed: int, scale: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    published = master + torch.randn(n, generator=gen) * scale
    return master, published


SIZES = [0, 1, 7, 8, 15, 16, 17, 1023, 1024, 1025, 4097, 300_001]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", SIZES)
def test_fp16_publication_is_the_codecs_bit_for_bit(fast: Kernels, n: int, threads: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 4)  # slices even of small tensors
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        master, published = _pair(n, n)
        if n > 4:  # saturation both ways, an exact zero, a tie-ish tiny value
            published[:4] = master[:4] - torch.tensor([1e6, -1e6, 0.0, 3e-8])
        item, decoded = FP16Codec().compress_decoded(master - published)
        ours, out = published.clone(), torch.empty(n, dtype=torch.float16)
        resid, norm = fast.publish_fp16(master, ours, out)
        assert torch.equal(out, item.parts["values"])
        assert torch.equal(ours, published + decoded)
        left_out = (master - published) - decoded
        assert resid == pytest.approx(float(left_out.double().square().sum()), rel=1e-5)
        assert norm == pytest.approx(float(master.double().square().sum()), rel=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n,bucket", [(0, 512), (5, 512), (1000, 512), (4100, 64), (300_001, 512),
                                      (70_000, 4096)])
def test_uniform_publication_is_the_codecs_bit_for_bit(
        fast: Kernels, n: int, bucket: int, bits: int, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 4)  # slices even of small tensors
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        master, published = _pair(n, n + bits)
        if n > bucket:
            published[:bucket] = master[:bucket]  # a bucket of zeros: scale 0, codes s
        codec = UniformCodec(bits=bits, bucket_size=bucket)
        item, decoded = codec.compress_decoded(master - published)
        ours = published.clone()
        codes = torch.empty_like(item.parts["codes"])
        scales = torch.empty_like(item.parts["scales"])
        sums = fast.publish_uniform(master, ours, codes, scales, bucket, bits)
        assert sums is not None
        assert torch.equal(scales, item.parts["scales"])
        assert torch.equal(codes, item.parts["codes"])
        assert torch.equal(ours, published + decoded)
        # and the worker's decoder, from the bytes alone, gives what the copy moved by
        assert torch.equal(published + codec.decompress(item), ours)
    finally:
        torch.set_num_threads(old)


def test_a_non_finite_change_is_reported_not_coded(fast: Kernels) -> None:
    master, published = _pair(5000, 1)
    master[4321] = float("nan")
    codes, scales = torch.empty(2500, dtype=torch.uint8), torch.empty(10)
    assert fast.publish_uniform(master, published.clone(), codes, scales, 512, 4) is None
    master[4321] = float("inf")
    assert fast.publish_uniform(master, published.clone(), codes, scales, 512, 4) is None
    out = torch.empty(5000, dtype=torch.float16)
    master[4321] = float("nan")
    resid, _ = fast.publish_fp16(master, published.clone(), out)
    assert resid != resid  # NaN: the caller restarts from the master


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sum_of_squares_is_torchs_and_finds_nan_and_inf(fast: Kernels, dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 1000)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = (torch.randn(300_007, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
        assert fast.sumsq(x) == pytest.approx(float(x.double().square().sum()), rel=1e-5)
        x[12345] = float("nan")
        assert fast.sumsq(x) != fast.sumsq(x)
        x[12345] = float("inf")
        assert fast.sumsq(x) == float("inf")
    finally:
        torch.set_num_threads(old)


def test_wrong_tensors_are_refused_with_what_was_wrong(fast: Kernels) -> None:
    m, p = _pair(100, 2)
    with pytest.raises(TypeError, match="contiguous CPU torch.float32"):
        fast.publish_fp16(m.double(), p, torch.empty(100, dtype=torch.float16))
    with pytest.raises(TypeError, match="not contiguous"):
        fast.publish_fp16(m[::2], p[::2], torch.empty(50, dtype=torch.float16))
    with pytest.raises(ValueError, match="sizes differ"):
        fast.publish_fp16(m, p[:50], torch.empty(100, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 8 // bits"):
        fast.publish_uniform(m, p, torch.empty(50, dtype=torch.uint8), torch.empty(1), 101, 4)


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from swarmtrain.compression.kernels import kernels\n"
            "print('LOADED' if kernels() is not None else 'FALLBACK')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.timeout(400)
def test_they_build_once_into_the_cache_and_a_machine_without_a_compiler_falls_back(tmp_path: Path) -> None:
    cache = {"SWARMTRAIN_CACHE_DIR": str(tmp_path)}
    first = _probe(cache)
    assert "LOADED" in first.stdout, first.stdout + first.stderr
    built = list((tmp_path / "swarmtrain" / "kernels").glob("*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    again = _probe(cache)
    assert "LOADED" in again.stdout and built[0].stat().st_mtime_ns == mtime  # not rebuilt
    broken = _probe({"SWARMTRAIN_CACHE_DIR": str(tmp_path / "other"), "CC": "/nonexistent/cc"})
    assert "FALLBACK" in broken.stdout and "could not build swarmtrain's fused kernels" in broken.stdout
    off = _probe({**cache, "SWARMTRAIN_KERNELS": "0"})
    assert "FALLBACK" in off.stdout and "SWARMTRAIN_KERNELS=0" in off.stdout


@pytest.mark.parametrize("n,ratio", [(1, 1.0), (1000, 0.1), (65536, 0.01), (65537, 0.5), (300_001, 0.05)])
def test_top_k_decoding_is_the_torch_decoders(fast: Kernels, n: int, ratio: float,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from swarmtrain.compression import topk
    from swarmtrain.compression.topk import TopKCodec, decode_topk
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    c = TopKCodec(ratio).compress(g)
    ours = decode_topk(c)
    monkeypatch.setattr(topk, "kernels", lambda: None)
    assert torch.equal(ours, decode_topk(c))


def test_a_top_k_index_out_of_range_is_refused_by_the_kernel_too(fast: Kernels) -> None:
    from swarmtrain.compression.base import Compressed
    from swarmtrain.compression.topk import decode_topk
    from swarmtrain.errors import RemoteProtocolError
    # 70,000 elements: block 1 holds 4,464 of them, and index_low 5,000 there is past the end
    parts = {"values": torch.ones(2, dtype=torch.float16),
             "index_low": torch.tensor([3, 5000], dtype=torch.int32).to(torch.uint16),
             "block_counts": torch.tensor([1, 1], dtype=torch.int32)}
    c = Compressed("topk", (70_000,), "float32", parts, {"k": 2})
    with pytest.raises(RemoteProtocolError, match="out of range"):
        decode_topk(c)


def test_many_top_k_entries_are_checked_in_one_call_as_one_by_one(fast: Kernels) -> None:
    """``topk_check_many`` passes what ``topk_check`` passes entry by entry, and names the
    first entry that fails (bad counts or an index past the last block's end)."""
    from swarmtrain.compression.topk import TopKCodec
    entries = []
    for n in (5, 70_000, 300_001, 65_536):
        c = TopKCodec(0.05).compress(torch.randn(n, generator=torch.Generator().manual_seed(n)))
        entries.append((c.parts["index_low"], c.parts["block_counts"], n))
    assert all(fast.topk_check(*e) == 0 for e in entries) and fast.topk_check_many(entries) == -1
    low = entries[1][0].clone()
    low[-1] = 70_000 - 65_536  # one past the end of the last block
    counts = entries[2][1].clone()
    counts[0] -= 1  # the counts no longer add up to k
    bad_index, bad_counts = (low, entries[1][1], 70_000), (entries[2][0], counts, 300_001)
    for bad, first in (([entries[0], bad_index, entries[2]], 1),
                       ([entries[0], entries[1], bad_counts, bad_index], 2)):
        assert [fast.topk_check(*e) != 0 for e in bad].index(True) == first
        assert fast.topk_check_many(bad) == first


# -- the fused Adam (roles/ps/flat_adam.py over st_adam_apply) ----------------------------

ADAM_SIZES = [1, 7, 1000, 65_536 + 3, 200_001]
LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8


def _flat_params(seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    flat = torch.randn(sum(ADAM_SIZES), generator=torch.Generator().manual_seed(seed))
    return flat, {f"p{i}": t for i, t in enumerate(flat.split(ADAM_SIZES))}


def _flat_adam(flat: torch.Tensor, params: dict[str, torch.Tensor]) -> tuple[FlatAdam, torch.optim.Adam]:
    opt = make_adam(list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    fa = FlatAdam.create(opt, flat, params)
    assert fa is not None
    return fa, opt


def _grads(step: int, scale: float = 1e-3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    # a spread of magnitudes, so the second moment and the division see more than one range
    return [torch.randn(n, generator=gen) * scale * (1 + 100 * (i % 2)) for i, n in enumerate(ADAM_SIZES)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the tensor's scale (a per-element ratio is meaningless
    for the elements that pass through zero)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _adam64(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int) -> None:
    """Decoupled-weight-decay Adam in float64: the reference both float32 ones approximate."""
    b1, b2 = BETAS
    p.mul_(1 - LR * WD)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / (1 - b2 ** step) ** 0.5).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - b1 ** step))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("as_fp16", [False, True])
def test_the_fused_adam_is_torchs_fused_adam_over_many_steps(threads: int, as_fp16: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Against torch.optim.Adam(fused=True, decoupled_weight_decay=True) over 200 steps: the
    same operations in the same order give the same weights; torch's scalar tails (the last
    elements of each of its chunks) round the second moment's update differently, so the bound
    is stated: differences at most 1e-6 of each tensor's largest value (weights and moments),
    and bit-identical weights for all but 0.1 % of the elements. Both are as close to a
    float64 Adam."""
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 64)  # slices cut tensors
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat, params = _flat_params()
        ref = [torch.nn.Parameter(p.detach().clone()) for p in params.values()]
        p64 = [p.detach().double() for p in params.values()]
        m64 = [torch.zeros_like(p) for p in p64]
        v64 = [torch.zeros_like(p) for p in p64]
        torch_opt = torch.optim.Adam(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True,
                                     decoupled_weight_decay=True)
        fa, opt = _flat_adam(flat, params)
        for step in range(1, 201):
            gs = _grads(step)
            if as_fp16:
                gs = [g.half() for g in gs]
            for p, g in zip(ref, gs):
                p.grad = g.float()
            torch_opt.step()
            status, _, _ = fa.step(dict(zip(params, gs)), LR, held=False)
            assert status == 0
            for p, m, v, g in zip(p64, m64, v64, gs):
                _adam64(p, m, v, g.double(), step)
        ours, theirs = flat, torch.cat([p.detach() for p in ref])
        for key, mine in (("exp_avg", fa.exp_avg), ("exp_avg_sq", fa.exp_avg_sq)):
            other = torch.cat([torch_opt.state[p][key] for p in ref])
            assert _rel(mine, other) <= 1e-6, key
        assert _rel(ours, theirs) <= 1e-6
        assert int((ours != theirs).sum()) <= ours.numel() // 1000
        exact = torch.cat(p64)
        err_ours, err_torch = (float((x.double() - exact).abs().max()) for x in (ours, theirs))
        # (float32 rounding over 200 steps: a few 1e-5 from float64, for torch as for us)
        assert err_ours <= 1e-4 and err_ours <= 1.5 * err_torch + 1e-7
        steps = [float(opt.state[p]["step"]) for p in params.values()]
        assert steps == [200.0] * len(ADAM_SIZES)
    finally:
        torch.set_num_threads(old)


def test_the_steps_slices_run_on_torchs_openmp_threads_and_on_the_pool_alike(
        fast: Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with OpenMP, the library shares torch's libgomp (one runtime in the process: the
    same threads run torch's ops and the step's slices, instead of two sets that keep each
    other off the cores); the slices give, bit for bit, what the thread pool it falls back
    to gives, sums included."""
    if sys.platform == "linux" and shutil.which("gcc"):
        assert fast.openmp  # (gcc builds it with OpenMP on this kind of machine)
        maps = Path("/proc/self/maps").read_text().splitlines()
        # (one libgomp.so.1: torch's; other packages bring theirs under other names)
        assert len({line.split()[-1] for line in maps if line.endswith("/libgomp.so.1")}) <= 1
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 1024)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    results = []
    try:
        for openmp in (fast.openmp, False):
            monkeypatch.setattr(fast, "openmp", openmp)
            flat, params = _flat_params()
            fa, _ = _flat_adam(flat, params)
            pub = flat + 1e-3
            out = torch.empty(flat.numel(), dtype=torch.float16)
            sums = []
            for step in range(1, 4):
                gs = dict(zip(params, _grads(step)))
                sums.append(fa.step(gs, LR, held=False,
                                    publication=Publication(PUB_FP16, pub.data_ptr(), out.data_ptr())))
            results.append((flat, fa.exp_avg, fa.exp_avg_sq, pub, out, sums))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_moment_decaying_below_float32s_normal_range_is_flushed_and_the_callers_mode_kept() -> None:
    """A parameter whose gradient stopped has its first moment decay by beta1 every step, through
    the subnormal range (below 2^-126), where each operation costs x86 a hundred cycles: the
    coordinator's step slowed 4x on the digits model after a few thousand updates. The kernel
    flushes such values to 0 (torch would keep them), and the calling thread's floating-point
    mode is as it was afterwards: Python's and torch's arithmetic here still keep subnormals."""
    flat, params = _flat_params()
    fa, _ = _flat_adam(flat, params)
    fa.step(dict(zip(params, _grads(1))), LR, held=False)
    tiny = torch.finfo(torch.float32).tiny
    fa.exp_avg.fill_(tiny * 1.05)  # normal; beta1 (0.9) times it is not
    fa.step({n: torch.zeros_like(p) for n, p in params.items()}, LR, held=False)
    assert int((fa.exp_avg != 0).sum()) == 0
    assert bool(torch.isfinite(flat).all()) and int((fa.exp_avg_sq == 0).sum()) == 0
    one = float(len(params) > 0)
    assert 5e-324 * one > 0.0  # (a subnormal double survives: no flush-to-zero left behind)
    assert float(torch.tensor([tiny / 4]) * one) == pytest.approx(tiny / 4)


def test_the_fused_adam_steps_only_parameters_with_a_gradient_and_reads_top_k_in_place() -> None:
    """A parameter without a gradient is not stepped (no decay, no state); a top-k gradient
    read as its parts steps as its decoded float32 tensor does, bit for bit."""
    from swarmtrain.compression.topk import TopKCodec, check_topk

    flat_a, params_a = _flat_params()
    flat_b, params_b = _flat_params()
    fa, opt_a = _flat_adam(flat_a, params_a)
    fb, _ = _flat_adam(flat_b, params_b)
    before = params_a["p1"].clone()
    for step in range(1, 6):
        gs = _grads(step)
        sparse = {n: check_topk(TopKCodec(0.05).compress(g)) for n, g in zip(params_a, gs) if n != "p1"}
        fa.step(sparse, LR, held=False)
        fb.step({n: g.decode() for n, g in sparse.items()}, LR, held=False)
    assert torch.equal(flat_a, flat_b) and torch.equal(fa.exp_avg_sq, fb.exp_avg_sq)
    assert torch.equal(params_a["p1"], before) and params_a["p1"] not in opt_a.state


def test_the_held_variance_step_is_adams_held_variance_step() -> None:
    """The held-variance kernel against roles/ps/adam.py's torch code, after dense steps
    taught the second moment (some of it left at 0: those take the gradient's square):
    within 1e-6 of the largest weight, bit-identical for 99 % of the weights."""
    flat_a, params_a = _flat_params()
    fa, opt_a = _flat_adam(flat_a, params_a)
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params_a.items()}
    opt_b = make_adam(list(ref.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(1, 4):  # dense steps; a gradient that is zero in places
        gs = _grads(step)
        gs[2][:100] = 0
        fa.step(dict(zip(params_a, gs)), LR, held=False)
        fa.count_variance_update(dict(zip(params_a, gs)))
        for p, g in zip(ref.values(), gs):
            p.grad = g
        adam_step(opt_b, LR, sparse=False, hold=True)
    grads = {n: g * (torch.rand(g.shape, generator=torch.Generator().manual_seed(7)) < 0.1)
             for n, g in zip(params_a, _grads(9, scale=1e-2))}
    assert fa.can_hold(grads)
    for _ in range(20):
        fa.step(grads, LR, held=True)
        for n, p in ref.items():
            p.grad = grads[n]
        assert held_variance_step(opt_b, LR)
    theirs = torch.cat([p.detach() for p in ref.values()])
    # (a last-place difference now and then: torch's scalar tails, its separate kernels)
    assert _rel(flat_a, theirs) <= 1e-6 and int((flat_a != theirs).sum()) <= flat_a.numel() // 100
    other_v = torch.cat([opt_b.state[p]["exp_avg_sq"] for p in ref.values()])
    assert _rel(fa.exp_avg_sq, other_v) <= 1e-6
    assert [float(opt_a.state[p]["step"]) for p in params_a.values()] == [23.0] * len(ADAM_SIZES)


def _mixed_grads(step: int, kinds: str, names: list[str]) -> dict[str, LazyGradient]:
    """Gradients of every kind the kernel reads: float32, float16 values, top-k parts (all of
    one kind, or mixed), and none at all for p1 (not stepped, but published all the same)."""
    from swarmtrain.compression.topk import TopKCodec, check_topk

    out: dict[str, LazyGradient] = {}
    for i, (n, g) in enumerate(zip(names, _grads(step))):
        kind = kinds if kinds != "mixed" else ("f32", "f16", "topk")[i % 3]
        if n == "p1":
            continue
        if kind == "f16":
            out[n] = g.half()
        elif kind == "topk":
            out[n] = check_topk(TopKCodec(0.05).compress(g))
        else:
            out[n] = g
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grads", ["f32", "f16", "topk", "mixed"])
@pytest.mark.parametrize("codec", ["fp16", "uniform", "snapshot", "half"])
def test_a_publication_fused_into_the_step_is_the_publication_after_it(
        fast: Kernels, codec: str, grads: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishing each new weight while the step writes it (the fp16 coding and the snapshot
    copy in the step's own loop, the uniform coding block by block after it) gives, bit for
    bit, the entry, the published copy and the snapshot the publication kernels give on the
    stepped weights: for every kind of gradient, a parameter without one, plain and
    held-variance steps, slices cut across tensors."""
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 1024)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat_a, params_a = _flat_params()
        flat_b, params_b = _flat_params()
        fa, _ = _flat_adam(flat_a, params_a)
        fb, _ = _flat_adam(flat_b, params_b)
        n = flat_a.numel()
        pub_a = flat_a + torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-3
        pub_b = pub_a.clone()
        for step in (1, 2):
            dense = {k: g for k, g in zip(params_a, _grads(step))}
            for f in (fa, fb):  # dense steps first, so that a held step has a variance to hold
                f.step(dense, LR, held=False)
                f.count_variance_update(dense)
        for step, held in ((3, False), (4, True)):
            gs = _mixed_grads(step, grads, list(params_a))
            held = held and fa.can_hold(gs)
            if codec == "fp16":
                out_a, out_b = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.float16)
                target = Publication(PUB_FP16, pub_a.data_ptr(), out_a.data_ptr())
                _, resid, norm = fa.step(gs, LR, held=held, publication=target)
                fb.step(gs, LR, held=held)
                expected = fast.publish_fp16(flat_b, pub_b, out_b)
                assert torch.equal(out_a, out_b)
            elif codec == "uniform":
                bucket, bits = 512, 4
                codes_a, codes_b = (torch.empty((n * bits + 7) // 8, dtype=torch.uint8) for _ in range(2))
                scales_a, scales_b = (torch.empty(-(-n // bucket)) for _ in range(2))
                target = Publication(PUB_UNIFORM, pub_a.data_ptr(), codes_a.data_ptr(), scales_a.data_ptr(),
                                     bucket, bits)
                _, resid, norm = fa.step(gs, LR, held=held, publication=target)
                fb.step(gs, LR, held=held)
                sums = fast.publish_uniform(flat_b, pub_b, codes_b, scales_b, bucket, bits)
                assert sums is not None
                expected = sums
                assert torch.equal(codes_a, codes_b) and torch.equal(scales_a, scales_b)
            elif codec == "half":  # the weights rounded to float16 (the half downlink's answers)
                half = torch.full((n,), float("nan"), dtype=torch.float16)
                _, resid, norm = fa.step(gs, LR, held=held, snapshot=half)
                fb.step(gs, LR, held=held)
                after = torch.empty(n, dtype=torch.float16)
                expected = fast.round_half(flat_b, after)
                assert torch.equal(half, after) and torch.equal(half, flat_b.to(torch.float16))
            else:
                snap = torch.full((n,), float("nan"))
                fa.step(gs, LR, held=held, snapshot=snap)
                fb.step(gs, LR, held=held)
                assert torch.equal(snap, flat_b)
            assert torch.equal(flat_a, flat_b) and torch.equal(pub_a, pub_b)
            assert torch.equal(fa.exp_avg, fb.exp_avg) and torch.equal(fa.exp_avg_sq, fb.exp_avg_sq)
            if codec != "snapshot":
                assert resid == pytest.approx(expected[0], rel=1e-5)
                assert norm == pytest.approx(expected[1], rel=1e-5)
    finally:
        torch.set_num_threads(old)


def test_a_state_loaded_into_the_optimizer_is_stepped_from(tmp_path: Path) -> None:
    """The optimizer's state stays torch's (checkpoints save it as they do torch's): a state
    loaded with load_state_dict replaces the views, and the next fused step continues from it
    exactly as an uninterrupted run."""
    flat_a, params_a = _flat_params()
    fa, opt_a = _flat_adam(flat_a, params_a)
    for step in range(1, 4):
        fa.step(dict(zip(params_a, _grads(step))), LR, held=False)
    saved = {k: v for k, v in opt_a.state_dict().items()}
    saved = {"state": {i: {k: t.clone() for k, t in s.items()} for i, s in saved["state"].items()},
             "param_groups": saved["param_groups"]}
    weights = flat_a.clone()
    fa.step(dict(zip(params_a, _grads(4))), LR, held=False)
    flat_b, params_b = _flat_params()
    flat_b.copy_(weights)
    fb, opt_b = _flat_adam(flat_b, params_b)
    opt_b.load_state_dict(saved)
    fb.step(dict(zip(params_b, _grads(4))), LR, held=False)
    assert torch.equal(flat_a, flat_b) and torch.equal(fa.exp_avg, fb.exp_avg)
    assert all(opt_b.state[p]["exp_avg"] is m and opt_b.state[p]["step"] is t
               for p, m, t in zip(params_b.values(), fb._m_views, fb._step_views))
    assert fb.steps.tolist() == [4.0] * len(ADAM_SIZES)


@pytest.mark.parametrize("codec", ["none", "fp16", "topk"])
def test_the_coordinators_apply_with_the_fused_adam_is_its_torch_apply(codec: str) -> None:
    """The coordinator's whole apply (decoding, screen, Adam, publication, answer) with the
    fused kernel and with torch's Adam: the same weights (to the stated bound), the same
    answers' layout, the published copy as close."""
    from swarmtrain.compression import make_codec
    from swarmtrain.config import load_coordinator_config
    from swarmtrain.roles.ps.common import pack_compressed
    from swarmtrain.roles.ps.coordinator import Coordinator, WorkerRecord
    from swarmtrain.wire import Gradients

    def coordinator(fused: bool) -> tuple[Coordinator, WorkerRecord]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))
        cfg = load_coordinator_config(overrides={"compression.type": codec, "training.learning_rate": 1e-3,
                                                 "training.weight_decay": 0.01})
        c = Coordinator(model, cfg, task_name="t")
        if not fused:
            c._flat_adam = None
        assert (c._flat_adam is not None) == fused
        rec = WorkerRecord("w", "", {}, 32, 0.0, [0])
        c.workers["w"] = rec
        c._snapshot_for(rec)
        return c, rec

    (a, ra), (b, rb) = coordinator(True), coordinator(False)
    up = make_codec(codec, topk_ratio=0.1)
    for i in range(1, 8):
        gen = torch.Generator().manual_seed(i)
        g = {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in a.params.items()}
        codecs, tensors = pack_compressed({n: up.compress(t) for n, t in g.items()})
        replies = []
        for c, rec in ((a, ra), (b, rb)):
            msg = Gradients(msg_id=i, version=c.version, samples=32, loss=1.0, codecs=codecs, tensors=tensors)
            status, reply = c._apply_gradient(rec, msg)
            assert status == "applied" and reply is not None
            replies.append(reply)
        assert replies[0].version == replies[1].version and replies[0].full == replies[1].full
        ours, theirs = replies[0].tensor_map(), replies[1].tensor_map()
        assert sorted(ours) == sorted(theirs)
        for name, t in ours.items():  # what the worker adds or takes: the same, to the bound
            assert torch.allclose(t.float(), theirs[name].float(), rtol=1e-5, atol=1e-6), name
    for n in a.params:
        assert torch.allclose(a.params[n], b.params[n], rtol=1e-5, atol=1e-7), n
    if codec == "fp16":  # (the half downlink: the weights rounded, no published copy)
        assert a.downlink.fine.rounded and a.downlink.fine.published is None
        assert {t.dtype for t in replies[0].tensor_map().values()} == {torch.float16}
    if not a.downlink.fine.whole:
        pa, pb = a.downlink.fine.published, b.downlink.fine.published
        assert pa is not None and pb is not None and torch.allclose(pa, pb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_sum_of_squares_of_many_tensors_is_theirs_and_finds_nan(
        fast: Kernels, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("swarmtrain.compression.kernels.MIN_SLICE", 64)  # slices cut tensors
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(5)
        ts = [torch.randn(n, generator=gen).to(dt) for n, dt in
              [(0, torch.float32), (1, torch.float16), (1000, torch.float32), (70_001, torch.float16),
               (129, torch.float32)]]
        exact = sum(float(t.double().square().sum()) for t in ts)
        assert fast.sumsq_many(ts) == pytest.approx(exact, rel=1e-6)
        assert fast.sumsq_many([]) == 0.0
        ts[3][70_000] = float("nan")
        assert math.isnan(fast.sumsq_many(ts))
    finally:
        torch.set_num_threads(old)


def test_rounding_to_half_saturates_and_sums_what_it_left_out(fast: Kernels) -> None:
    """The half downlink's rounding: float16 to nearest as torch rounds, ±65504 beyond the
    range (never inf), and the sums of what rounding left out and of the weights (the drift
    the coordinator checks against max_drift), NaN where a weight is NaN."""
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(4))
    out = torch.empty(x.numel(), dtype=torch.float16)
    resid, norm = fast.round_half(x, out)
    assert torch.equal(out, x.to(torch.float16))
    assert resid == pytest.approx(float((x.double() - out.double()).square().sum()), rel=1e-6)
    assert norm == pytest.approx(float(x.double().square().sum()), rel=1e-6)
    assert math.sqrt(resid / norm) < 2.0 ** -11  # (within one rounding: the drift bound's scale)
    x[5], x[9000] = 1e6, -7e4
    resid, _ = fast.round_half(x, out)
    assert float(out[5]) == 65504.0 and float(out[9000]) == -65504.0
    assert resid > (1e6 - 65504.0) ** 2
    x[7] = float("nan")
    assert math.isnan(fast.round_half(x, out)[0])
