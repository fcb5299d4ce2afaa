"""Codecs, error feedback and helpers of swarmtrain.compression (pure tensor tests)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarmtrain.compression import (
    CODEC_NAMES,
    FP16_MAX,
    Codec,
    Compressed,
    ErrorFeedback,
    FP16Codec,
    NoneCodec,
    QSGDCodec,
    SizeAdaptive,
    TopKCodec,
    UniformCodec,
    decompress_any,
    dequantize_int8,
    make_codec,
    pack_bits,
    packed_nbytes,
    quantize_int8,
    topk_count,
    topk_warmup_ratio,
    unpack_bits,
)
from swarmtrain.errors import ConfigError, LocalProtocolError, RemoteProtocolError

FP16_EPS = 2.0**-11  # unit roundoff of float16 (round to nearest)
FP16_SUBNORMAL_HALF_STEP = 2.0**-25  # float16's subnormals are 2**-24 apart

ALL_CODECS: list[Callable[[], Codec]] = [
    NoneCodec,
    FP16Codec,
    lambda: TopKCodec(0.1),
    lambda: TopKCodec(1.0),
    lambda: QSGDCodec(8, 16),
    lambda: QSGDCodec(4, 5),
    lambda: QSGDCodec(2, 3),
    lambda: UniformCodec(8, 16),
    lambda: UniformCodec(4, 5),
    lambda: UniformCodec(2, 3),
]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


# --- none / fp16 ------------------------------------------------------------------------


def test_none_round_trips_bit_exactly_without_copy() -> None:
    x = randn(7, 13)
    x[0, 0] = float("nan")
    x[0, 1] = -0.0
    c = NoneCodec().compress(x)
    assert c.parts["values"].data_ptr() == x.data_ptr()  # contiguous float32: a view
    y = NoneCodec().decompress(c)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_none_converts_other_float_dtypes() -> None:
    x = randn(5).to(torch.float64)
    c = NoneCodec().compress(x)
    assert c.dtype == "float64" and c.parts["values"].dtype == torch.float32
    assert torch.equal(NoneCodec().decompress(c), x.float())


def test_fp16_within_half_precision_and_saturates() -> None:
    x = randn(1000) * 100
    y = FP16Codec().decompress(FP16Codec().compress(x))
    assert torch.allclose(y, x, rtol=FP16_EPS, atol=FP16_SUBNORMAL_HALF_STEP)
    big = torch.tensor([1e6, -1e6, 65520.0, float("inf"), float("nan"), 3.0])
    out = FP16Codec().decompress(FP16Codec().compress(big))
    assert out[:4].tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, FP16_MAX]
    assert math.isnan(out[4]) and out[5] == 3.0


# --- top-k ------------------------------------------------------------------------------


def test_topk_count_avoids_float_error() -> None:
    assert topk_count(30, 0.1) == 3
    assert topk_count(10, 0.1) == 1
    assert topk_count(1, 0.1) == 1
    assert topk_count(0, 0.5) == 0
    assert topk_count(1001, 0.1) == 101
    assert topk_count(17, 1.0) == 17


def test_topk_keeps_exactly_the_k_largest_magnitudes() -> None:
    x = randn(50, 41, seed=3)
    codec = TopKCodec(0.07)
    k = topk_count(x.numel(), 0.07)
    c = codec.compress(x)
    assert c.meta == {"k": k}
    y = codec.decompress(c).reshape(-1)
    flat = x.reshape(-1)
    reference = set(torch.argsort(flat.abs(), descending=True)[:k].tolist())
    kept = set(torch.nonzero(y).view(-1).tolist())
    assert kept == reference
    idx = torch.tensor(sorted(reference))
    assert torch.equal(y[idx], flat[idx].half().float())
    mask = torch.ones_like(y, dtype=torch.bool)
    mask[idx] = False
    assert not y[mask].any()


def test_topk_indices_across_many_blocks() -> None:
    numel = 3 * 65536 + 123
    x = torch.zeros(numel)
    hot = torch.tensor([0, 65535, 65536, 2 * 65536 + 7, numel - 1])
    x[hot] = torch.tensor([5.0, -4.0, 3.0, -2.0, 1.0])
    codec = TopKCodec(5 / numel)
    c = codec.compress(x)
    assert c.parts["block_counts"].tolist() == [2, 1, 1, 1]
    assert torch.equal(codec.decompress(c), x)


def test_error_feedback_residual_is_exactly_what_was_not_sent() -> None:
    x = randn(997, seed=5) * 3
    ef = ErrorFeedback(TopKCodec(0.1))
    c = ef.compress("w", x)
    sent = decompress_any(c)
    residual = ef.state_dict()["w"]
    assert torch.equal(residual, x - sent)
    kept = sent != 0
    # Dropped coordinates keep their whole value; kept ones keep their fp16 rounding error.
    assert torch.equal(residual[~kept], x[~kept])
    assert torch.equal(residual[kept], x[kept] - x[kept].half().float())
    assert (residual[kept].abs() <= FP16_EPS * x[kept].abs()).all()
    assert ef.residual_norm() == pytest.approx(float(residual.double().norm()), rel=1e-9)


def test_error_feedback_eventually_sends_every_coordinates_mass() -> None:
    g = gen(7)
    ef = ErrorFeedback(TopKCodec(0.1))
    magnitudes = 0.1 + 0.9 * torch.rand(100, generator=g)
    total_in = torch.zeros(100, dtype=torch.float64)
    total_sent = torch.zeros(100, dtype=torch.float64)
    ever_sent = torch.zeros(100, dtype=torch.bool)
    for _ in range(200):
        grad = magnitudes * (1 + 0.1 * torch.randn(100, generator=g))
        sent = decompress_any(ef.compress("w", grad))
        total_in += grad.double()
        total_sent += sent.double()
        ever_sent |= sent != 0
    assert ever_sent.all()
    final = total_sent + ef.state_dict()["w"].double()
    assert torch.allclose(final, total_in, rtol=1e-5, atol=1e-4)


def test_error_feedback_state_and_lossless_codec() -> None:
    x = randn(64)
    ef = ErrorFeedback(TopKCodec(0.25))
    ef.compress("a", x)
    ef.compress("b", x[:10])
    state = ef.state_dict()
    other = ErrorFeedback(TopKCodec(0.25))
    other.load_state_dict(state)
    assert other.residual_norm() == ef.residual_norm() > 0
    assert torch.equal(ef.compress("a", x).parts["values"], other.compress("a", x).parts["values"])
    with pytest.raises(ValueError, match="shape"):
        ef.compress("a", x[:3])
    ef.reset()
    assert ef.residual_norm() == 0.0 and ef.state_dict() == {}
    before = x.clone()
    adaptive = ErrorFeedback(make_codec("topk", topk_ratio=0.25, min_compress_numel=20))
    for _ in range(3):
        adaptive.compress("big", x)
        adaptive.compress("small", x[:10])
    half = ErrorFeedback(TopKCodec(0.5))
    assert [half.compress("h", x.to(torch.bfloat16)).dtype for _ in range(2)] == ["bfloat16"] * 2
    assert set(adaptive.state_dict()) == {"big"}  # the uncompressed tensor leaves no residual
    assert torch.equal(x, before)


def test_topk_warmup_ratio_is_geometric() -> None:
    assert topk_warmup_ratio(0, 0.01, 100) == 1.0
    assert topk_warmup_ratio(50, 0.01, 100) == pytest.approx(0.1)
    assert topk_warmup_ratio(100, 0.01, 100) == 0.01
    assert topk_warmup_ratio(10**6, 0.01, 100) == 0.01
    assert topk_warmup_ratio(0, 0.01, 0) == 0.01
    ratios = [topk_warmup_ratio(s, 0.001, 30) for s in range(31)]
    assert all(a > b for a, b in itertools.pairwise(ratios))
    with pytest.raises(ConfigError, match="warmup_steps"):
        topk_warmup_ratio(0, 0.1, -1)
    with pytest.raises(ConfigError, match="target"):
        topk_warmup_ratio(0, 0.0, 10)


# --- QSGD -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_is_unbiased_with_variance_within_the_bound(bits: int) -> None:
    size, draws = 64, 2000
    x = randn(3 * size + 21, seed=bits) * torch.linspace(0.01, 3, 3 * size + 21)
    x[5] = 0.0
    codec = QSGDCodec(bits, size)
    g = gen(100 + bits)
    decoded = torch.stack([codec.decompress(codec.compress(x, generator=g)) for _ in range(draws)])
    s = 2 ** (bits - 1) - 1
    buckets = [slice(i, min(i + size, x.numel())) for i in range(0, x.numel(), size)]
    # Each coordinate is N/s times a Bernoulli(p) shifted by an integer level.
    norm = torch.cat([x[b].norm().expand(b.stop - b.start) for b in buckets])
    p = x.abs() / norm * s - torch.floor(x.abs() / norm * s)
    var = (norm / s) ** 2 * p * (1 - p)
    mean_error = (decoded.double().mean(0) - x.double()).abs()
    assert (mean_error <= 6 * torch.sqrt(var / draws) + 1e-6 * norm).all()
    sq_error = (decoded - x).pow(2)
    for b in buckets:
        n = b.stop - b.start
        empirical = float(sq_error[:, b].sum(1).mean())
        exact = float(var[b].sum())
        bound = min(n / s**2, math.sqrt(n) / s) * float(x[b].norm()) ** 2
        assert empirical <= bound
        assert empirical == pytest.approx(exact, rel=0.1)


def test_qsgd_is_reproducible_and_handles_zero_buckets() -> None:
    x = torch.cat([torch.zeros(40), randn(25)])
    codec = QSGDCodec(4, 20)
    a, b = codec.compress(x, generator=gen(1)), codec.compress(x, generator=gen(1))
    assert torch.equal(a.parts["codes"], b.parts["codes"])
    assert a.parts["norms"][:2].tolist() == [0.0, 0.0]
    y = codec.decompress(a)
    assert not y[:40].any() and torch.isfinite(y).all()
    # Every decoded value is a level of its bucket: sign * norm * l / s, |l| <= s.
    assert (y[40:].abs() <= a.parts["norms"][2:].repeat_interleave(20)[:25] + 1e-6).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 7, 8, 9, 1001])
def test_bit_packing_round_trips(bits: int, count: int) -> None:
    codes = torch.randint(0, 2**bits, (count,), dtype=torch.uint8, generator=gen(count))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, bits)
    assert packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_bit_packing_order_is_low_bits_first() -> None:
    assert pack_bits(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [
        1 | 2 << 2 | 3 << 4,
        3,
    ]
    assert pack_bits(torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8), 4).tolist() == [0x5A, 0xF]


# --- int8 linear format -----------------------------------------------------------------


def test_int8_quantization_error_within_half_a_step() -> None:
    x = randn(333) * 7
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert int(q.abs().max()) == 127 and scale == pytest.approx(float(x.abs().max()) / 127)
    assert ((dequantize_int8(q, scale) - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    zq, zscale = quantize_int8(torch.zeros(4))
    assert zscale == 0.0 and not dequantize_int8(zq, zscale).any()
    eq, _ = quantize_int8(torch.zeros(0))
    assert eq.numel() == 0


# --- every codec: shapes, sizes, composition ----------------------------------------------

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, which=st.integers(0, len(ALL_CODECS) - 1), seed=st.integers(0, 2**16))
@example(shape=(5, 7), which=3, seed=48463)  # top-k 1.0 (float16 values): a subnormal
def test_round_trip_any_shape(shape: tuple[int, ...], which: int, seed: int) -> None:
    codec = ALL_CODECS[which]()
    x = torch.randn(shape, generator=gen(seed))
    c = codec.compress(x, generator=gen(seed))
    assert c.shape == shape and c.wire_bytes() == codec.estimate_wire_bytes(x.numel())
    assert all(p.dim() == 1 and p.is_contiguous() for p in c.parts.values())
    y = codec.decompress(c)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(decompress_any(c), y)
    if codec.name == "none" or isinstance(codec, TopKCodec) and codec.ratio == 1.0:
        # relative to the value, but below float16's smallest normal (6.1e-5) its spacing is
        # fixed (2**-24): a subnormal is off by up to half of it
        assert torch.allclose(y, x, rtol=FP16_EPS, atol=FP16_SUBNORMAL_HALF_STEP)
    if isinstance(codec, QSGDCodec):  # every decoded value is within its bucket's norm
        assert (y.abs() <= float(x.norm()) * (1 + 1e-6)).all()


@pytest.mark.parametrize("factory", ALL_CODECS)
def test_empty_and_scalar_tensors(factory: Callable[[], Codec]) -> None:
    codec = factory()
    for x in (torch.zeros(0), torch.zeros(3, 0), torch.tensor(2.5), torch.tensor([-1.5])):
        y = codec.decompress(codec.compress(x, generator=gen()))
        assert y.shape == x.shape
        if codec.name != "qsgd":  # uniform: a lone element is its bucket's maximum, exact
            assert torch.equal(y, x)


def test_wire_sizes_match_the_declared_layouts() -> None:
    numel = 100_000
    x = randn(numel)
    expected = {
        "none": 4 * numel,
        "fp16": 2 * numel,
        "topk": 4 * 10_000 + 4 * 2,  # fp16 value + uint16 index per kept, int32 per block
        "qsgd8": numel + 4 * 196,  # 1 byte per element + a float32 norm per 512 bucket
        "qsgd4": numel // 2 + 4 * 196,
        "qsgd2": numel // 4 + 4 * 196,
        "uniform4": numel // 2 + 4 * 196,  # the same layout as qsgd: codes + a float32 scale
    }
    codecs = {
        "none": make_codec("none"),
        "fp16": make_codec("fp16"),
        "topk": make_codec("topk", topk_ratio=0.1),
        "qsgd8": make_codec("qsgd", qsgd_bits=8),
        "qsgd4": make_codec("qsgd", qsgd_bits=4),
        "qsgd2": make_codec("qsgd", qsgd_bits=2),
        "uniform4": make_codec("uniform", qsgd_bits=4),
    }
    for key, codec in codecs.items():
        c = codec.compress(x, generator=gen())
        assert c.wire_bytes() == codec.estimate_wire_bytes(numel) == expected[key], key
    assert expected["topk"] <= 0.16 * expected["none"]


def test_size_adaptive_routes_by_size_and_decodes_both() -> None:
    codec = make_codec("topk", topk_ratio=0.1, min_compress_numel=100)
    assert isinstance(codec, SizeAdaptive)
    small, large = randn(99), randn(100)
    cs, cl = codec.compress(small), codec.compress(large)
    assert (cs.codec, cl.codec) == ("none", "topk")
    assert torch.equal(codec.decompress(cs), small)
    assert torch.count_nonzero(codec.decompress(cl)) == 10
    assert codec.estimate_wire_bytes(99) == 4 * 99
    assert codec.estimate_wire_bytes(100) == 4 * 10 + 4
    assert not isinstance(make_codec("topk"), SizeAdaptive)


def test_decoding_reads_meta_not_the_receivers_config() -> None:
    x = randn(300)
    for sender, receiver in [
        (TopKCodec(0.5), TopKCodec(0.01)),
        (QSGDCodec(2, 7), QSGDCodec(8, 512)),
    ]:
        c = sender.compress(x, generator=gen())
        assert torch.equal(receiver.decompress(c), sender.decompress(c))
        assert torch.equal(decompress_any(c), sender.decompress(c))


def test_make_codec_rejects_bad_config_naming_the_parameter() -> None:
    assert {make_codec(n).name for n in CODEC_NAMES} == set(CODEC_NAMES)
    bad: list[tuple[dict[str, object], str]] = [
        ({"name": "zip"}, "compression type"),
        ({"name": "topk", "topk_ratio": 0.0}, "topk_ratio"),
        ({"name": "topk", "topk_ratio": 1.5}, "topk_ratio"),
        ({"name": "topk", "topk_ratio": float("nan")}, "topk_ratio"),
        ({"name": "qsgd", "qsgd_bits": 3}, "qsgd_bits"),
        ({"name": "qsgd", "qsgd_bits": True}, "qsgd_bits"),
        ({"name": "qsgd", "bucket_size": 0}, "bucket_size"),
        ({"name": "none", "min_compress_numel": -1}, "min_compress_numel"),
    ]
    for kwargs, param in bad:
        with pytest.raises(ConfigError, match=param):
            make_codec(**kwargs)  # type: ignore[arg-type]


def test_compress_rejects_non_float_and_ignores_autograd() -> None:
    for codec in (NoneCodec(), FP16Codec(), TopKCodec(), QSGDCodec()):
        with pytest.raises(LocalProtocolError):
            codec.compress(torch.arange(5))
    with pytest.raises(LocalProtocolError, match="finite"):
        QSGDCodec().compress(torch.tensor([1.0, float("inf")]))
    w = randn(10).requires_grad_()
    y = TopKCodec(0.5).decompress(TopKCodec(0.5).compress(w))
    assert not y.requires_grad


# --- malformed input from the network -----------------------------------------------------


def valid(codec: Codec, numel: int = 70_000) -> Compressed:
    return codec.compress(randn(numel), generator=gen())


def with_part(c: Compressed, name: str, value: torch.Tensor) -> Compressed:
    return dataclasses.replace(c, parts={**c.parts, name: value})


def malformed_cases() -> list[tuple[str, Codec, Compressed]]:
    topk, qsgd8, qsgd2 = TopKCodec(0.1), QSGDCodec(8, 512), QSGDCodec(2, 100)
    t, q8, q2, n = valid(topk), valid(qsgd8), valid(qsgd2), valid(NoneCodec(), 10)
    uni = UniformCodec(8, 512)
    u8 = valid(uni)
    low, counts = t.parts["index_low"], t.parts["block_counts"]
    out_of_range = low.clone()
    out_of_range[-1] = 70_000 - 65536  # last block: index 70000 == numel
    balanced_negative = torch.tensor([int(counts.sum()) + 1, -1], dtype=torch.int32)
    empty = valid(NoneCodec(), 0)
    return [
        ("codec name", topk, dataclasses.replace(t, codec="qsgd")),
        ("negative dim", topk, dataclasses.replace(t, shape=(-70_000,))),
        ("shape too big", NoneCodec(), dataclasses.replace(empty, shape=(0, 2**48, 2**48))),
        ("dim beyond int64", NoneCodec(), dataclasses.replace(empty, shape=(0, 2**64))),
        ("too many dims", NoneCodec(), dataclasses.replace(empty, shape=(1,) * 40 + (0,))),
        ("shape not ints", NoneCodec(), dataclasses.replace(n, shape=(10.0,))),  # type: ignore[arg-type]
        ("dtype", NoneCodec(), dataclasses.replace(n, dtype="int64")),
        ("renamed part", NoneCodec(), Compressed("none", (10,), "float32", {"v": torch.zeros(10)})),
        ("extra part", NoneCodec(), with_part(n, "extra", torch.zeros(1))),
        ("part dtype", NoneCodec(), with_part(n, "values", torch.zeros(10, dtype=torch.float64))),
        ("part length", NoneCodec(), with_part(n, "values", torch.zeros(11))),
        ("part 2-D", NoneCodec(), with_part(n, "values", torch.zeros(2, 5))),
        ("part not tensor", NoneCodec(), with_part(n, "values", [0.0] * 10)),  # type: ignore[arg-type]
        ("meta extra", NoneCodec(), dataclasses.replace(n, meta={"k": 1})),
        ("topk index range", topk, with_part(t, "index_low", out_of_range)),
        ("topk counts sum", topk, with_part(t, "block_counts", counts + 1)),
        (
            "topk counts negative",
            topk,
            with_part(t, "block_counts", counts * torch.tensor([1, -1])),
        ),
        ("topk counts negative, sum ok", topk, with_part(t, "block_counts", balanced_negative)),
        ("topk k > numel", topk, dataclasses.replace(t, shape=(5,))),
        ("topk k type", topk, dataclasses.replace(t, meta={"k": 7000.0})),
        ("topk k bool", topk, dataclasses.replace(valid(topk, 10), meta={"k": True})),
        ("topk index dtype", topk, with_part(t, "index_low", low.to(torch.int32))),
        ("qsgd bits", qsgd8, dataclasses.replace(q8, meta={"bits": 3, "bucket_size": 512})),
        ("qsgd bucket 0", qsgd8, dataclasses.replace(q8, meta={"bits": 8, "bucket_size": 0})),
        ("qsgd meta missing", qsgd8, dataclasses.replace(q8, meta={"bits": 8})),
        (
            "qsgd bucket vs norms",
            qsgd8,
            dataclasses.replace(q8, meta={"bits": 8, "bucket_size": 256}),
        ),
        (
            "qsgd bits vs codes",
            qsgd8,
            dataclasses.replace(q8, meta={"bits": 4, "bucket_size": 512}),
        ),
        ("qsgd negative norm", qsgd8, with_part(q8, "norms", -q8.parts["norms"])),
        ("qsgd nan norm", qsgd8, with_part(q8, "norms", q8.parts["norms"] * float("nan"))),
        ("qsgd code 255", qsgd8, with_part(q8, "codes", torch.full_like(q8.parts["codes"], 255))),
        (
            "qsgd 2-bit code 3",
            qsgd2,
            with_part(q2, "codes", torch.full_like(q2.parts["codes"], 255)),
        ),
        ("uniform negative scale", uni, with_part(u8, "scales", -u8.parts["scales"])),
        ("uniform inf scale", uni, with_part(u8, "scales", u8.parts["scales"] * float("inf"))),
        ("uniform code 255", uni, with_part(u8, "codes", torch.full_like(u8.parts["codes"], 255))),
        ("uniform bits", uni, dataclasses.replace(u8, meta={"bits": 5, "bucket_size": 512})),
        ("uniform part name", uni, Compressed("uniform", u8.shape, "float32",
                                              {"norms": u8.parts["scales"], "codes": u8.parts["codes"]},
                                              u8.meta)),
    ]


@pytest.mark.parametrize("case", malformed_cases(), ids=lambda case: case[0])
def test_decompress_rejects_malformed_input(case: tuple[str, Codec, Compressed]) -> None:
    _, codec, c = case
    with pytest.raises(RemoteProtocolError):
        codec.decompress(c)
    with pytest.raises(RemoteProtocolError):
        decompress_any(c)


def test_decompress_any_rejects_unknown_codec() -> None:
    with pytest.raises(RemoteProtocolError, match="codec"):
        decompress_any(Compressed("zstd", (1,), "float32", {}))


part_dtypes = st.sampled_from(
    [torch.float32, torch.float16, torch.uint8, torch.uint16, torch.int32, torch.int64]
)


@st.composite
def random_part(draw: st.DrawFn, length: int, dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = draw(st.binary(min_size=length * itemsize, max_size=length * itemsize))
    if not data:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


@st.composite
def garbage(draw: st.DrawFn) -> Compressed:
    """A valid compressed tensor with one to three random corruptions."""
    codec = draw(st.sampled_from(ALL_CODECS))()
    shape = tuple(draw(st.lists(st.integers(0, 70), max_size=2)))
    c = codec.compress(torch.randn(shape, generator=gen()), generator=gen())
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["values", "length", "dtype", "meta", "shape", "codec"]))
        name = draw(st.sampled_from(sorted(c.parts)))
        part = c.parts[name]
        if kind == "values":
            c = with_part(c, name, draw(random_part(part.numel(), part.dtype)))
        elif kind == "length":
            c = with_part(c, name, draw(random_part(draw(st.integers(0, 80)), part.dtype)))
        elif kind == "dtype":
            c = with_part(c, name, draw(random_part(part.numel(), draw(part_dtypes))))
        elif kind == "meta":
            key = draw(st.sampled_from(["k", "bits", "bucket_size"]))
            value = draw(st.one_of(st.integers(-3, 300), st.floats(), st.booleans()))
            c = dataclasses.replace(c, meta={**c.meta, key: value})
        elif kind == "shape":
            c = dataclasses.replace(c, shape=tuple(draw(st.lists(st.integers(0, 70), max_size=3))))
        else:
            c = dataclasses.replace(c, codec=draw(st.sampled_from(CODEC_NAMES)))
    return c


@settings(max_examples=300, deadline=None)
@given(c=garbage())
def test_corrupted_input_only_ever_raises_remote_protocol_error(c: Compressed) -> None:
    try:
        y = decompress_any(c)
    except RemoteProtocolError:
        return
    assert y.shape == c.shape and y.dtype == torch.float32


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_uniform_error_is_within_half_a_level_and_the_bucket_maximum_is_exact(bits: int) -> None:
    x = randn(10_000) * torch.linspace(0.01, 10, 10_000)  # buckets of very different scales
    codec = UniformCodec(bits, 128)
    y = codec.decompress(codec.compress(x))
    levels = 2 ** (bits - 1) - 1
    for b in range(0, 10_000, 128):
        xb, yb = x[b:b + 128], y[b:b + 128]
        half_level = float(xb.abs().max()) / levels / 2
        assert float((yb - xb).abs().max()) <= half_level * (1 + 1e-5)
        i = int(xb.abs().argmax())
        assert math.isclose(float(yb[i]), float(xb[i]), rel_tol=1e-6)
    assert torch.equal(codec.decompress(codec.compress(x)), y)  # deterministic: no generator


def test_uniform_with_error_feedback_sends_the_sum_of_gradients() -> None:
    ef = ErrorFeedback(UniformCodec(2, 64))
    grads = [randn(1000, seed=s) for s in range(50)]
    sent = sum(decompress_any(ef.compress("w", g)) for g in grads)
    assert isinstance(sent, torch.Tensor)
    # what was sent plus what is held back is exactly what came in
    held = sum(grads) - sent
    assert ef.residual_norm() == pytest.approx(float(torch.linalg.vector_norm(held)), rel=1e-4)
    assert float(held.abs().max()) <= float(max(g.abs().max() for g in grads))  # bounded, not growing


def test_uniform_rejects_non_finite_input_and_bad_config() -> None:
    with pytest.raises(LocalProtocolError, match="NaN"):
        UniformCodec(4).compress(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ConfigError, match="bits"):
        UniformCodec(3)
    with pytest.raises(ConfigError, match="bucket_size"):
        UniformCodec(4, 0)


@pytest.mark.parametrize("numel", [1000, 65_536, 200_003])
def test_topk_feedback_fast_path_keeps_exactly_what_a_full_decode_would(numel: int) -> None:
    ef = ErrorFeedback(TopKCodec(0.01))
    g1, g2 = randn(numel, seed=1) * 1e5, randn(numel, seed=2)  # 1e5: some values clamp in fp16
    s1 = ef.compress("w", g1)
    expect = g1 - decompress_any(s1)
    assert torch.equal(ef._residuals["w"], expect)
    s2 = ef.compress("w", g2)
    assert torch.equal(ef._residuals["w"], (g2 + expect) - decompress_any(s2))
    assert torch.equal(g1, randn(numel, seed=1) * 1e5)  # the caller's gradient is untouched


@pytest.mark.parametrize("factory", ALL_CODECS)
def test_compress_decoded_is_exactly_what_the_receiver_decodes(factory: Callable[[], Codec]) -> None:
    codec = SizeAdaptive(factory(), min_numel=50)
    for x in (randn(10_000, seed=3), randn(3, 7, seed=4), randn(0)):
        c, decoded = codec.compress_decoded(x, generator=gen())
        assert torch.equal(decoded, decompress_any(c)) and decoded.shape == x.shape
