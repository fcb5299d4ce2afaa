"""The fused CPU kernels (swarmtrain/compression/kernels.c) give, bit for bit, what the torch codecs
give, on every size, thread count and special value; they build once per machine, and a
machine that cannot build them falls back to torch with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmtrain.compression.kernels import Kernels, kernels
from swarmtrain.compression.simple import FP16Codec
from swarmtrain.compression.uniform import UniformCodec

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
