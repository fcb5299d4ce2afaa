"""The gradient-norm outlier screen (swarmtrain/roles/ps/screen.py): pure, no network.

Honest norms are lognormal with sigma 1 in log space (a gradient norm is a product of many
factors; sigma 1 is wider than what digits or textlm show between neighbouring steps). Each
bound asserted is stated in the test's docstring; seeds are fixed, so a run is reproducible.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import pytest

from swarmtrain.roles.ps.screen import MAX_WORKERS, NormScreen

FACTOR = 1000.0


def _honest(rng: random.Random, median: float = 1.0) -> float:
    return median * math.exp(rng.gauss(0.0, 1.0))


def _ratio(a: float, b: float) -> float:
    """How far apart two positive numbers are, as a ratio >= 1."""
    return max(a / b, b / a)


@pytest.mark.parametrize("workers", [3, 2])
def test_decaying_honest_norms_are_tracked_and_almost_never_clipped(workers: int) -> None:
    """(a) 200,000 norms from honest workers interleaved, median falling 1e4x over the run
    (the convergence that collapsed the old EMA of accepted norms): at most 1 in 100,000 is
    clipped (the clip threshold is 1000x the median, 6.9 sigma), and at 20 points the
    reference is within 2x of the true median (3 workers; 2.5x with 2)."""
    rng = random.Random(11)
    screen = NormScreen(FACTOR)
    n = 200_000 if workers == 3 else 100_000
    worst = 1.0
    for i in range(n):
        median = 10.0 ** (2 - 4 * i / n)
        screen.check(f"w{i % workers}", _honest(rng, median))
        if i % (n // 20) == n // 20 - 1:
            worst = max(worst, _ratio(screen.reference(), median))
    assert screen.clipped <= n // 100_000, screen.clipped
    assert worst < (2.0 if workers == 3 else 2.5), worst


def _attack(workers: int, liar: Callable[[int], float], *, rounds: int = 3000, start: int = 100,
            seed: int = 5) -> tuple[NormScreen, list[tuple[float, float, float]], float]:
    """``workers - 1`` honest workers (median 1) and one liar, round robin. The liar is honest
    for ``start`` rounds (past warm-up), then sends ``liar(k)``. Returns the screen, the liar's
    (norm, factor returned, reference before) after ``start``, and the worst ratio of the
    reference to the honest median 1 over the whole run after warm-up."""
    rng = random.Random(seed)
    screen = NormScreen(FACTOR)
    sent: list[tuple[float, float, float]] = []
    worst = 1.0
    for r in range(rounds):
        for h in range(workers - 1):
            screen.check(f"honest{h}", _honest(rng))
        ref = screen.reference()
        norm = liar(r - start) if r >= start else _honest(rng)
        scale = screen.check("liar", norm)
        if r >= start:
            sent.append((norm, scale, ref))
        if screen.reference() > 0:
            worst = max(worst, _ratio(screen.reference(), 1.0))
    return screen, sent, worst


def _ramp(k: int) -> float:
    """Each norm 30x the previous from 1e-4, held at 1e18 (reached at k = 15)."""
    return min(1e-4 * 30.0 ** min(k, 15), 1e18)


def _ramps(k: int) -> float:
    """The ramp again and again: 1e-4 ... 1e18, 1e-4 ... (pulls the liar's median both ways)."""
    return 1e-4 * 30.0 ** (k % 16)


@pytest.mark.parametrize("liar", [_ramp, _ramps])
def test_ratchet_attack_one_liar_of_three_is_clipped(liar: Callable[[int], float]) -> None:
    """(b) One worker of three sends norms each 30x the previous (the attack every step of
    which the old screen accepted): every one over factor x reference is clipped to exactly
    that, every one over 3 x factor x honest median is clipped, nothing that reaches the
    weights is over 3 x factor x honest median, and the reference stays within 3x of the
    honest median throughout."""
    screen, sent, worst = _attack(3, liar)
    assert worst < 3.0, worst
    for norm, scale, ref in sent:
        if norm > FACTOR * ref:
            assert scale < 1.0 and norm * scale == pytest.approx(FACTOR * ref, rel=1e-9)
        else:
            assert scale == 1.0
        if norm > 3 * FACTOR:
            assert scale < 1.0
        assert norm * scale <= 3 * FACTOR
    assert screen.clipped >= sum(1 for norm, _, _ in sent if norm > 3 * FACTOR) > 100


@pytest.mark.parametrize("liar", [_ramp, _ramps])
def test_ratchet_attack_one_liar_of_two_is_bounded_by_the_spread(liar: Callable[[int], float]) -> None:
    """(c) The same attack with one honest worker and one liar: no rule can outvote a liar
    that is half the cluster, but the reference stays under 3 x spread x honest median
    (spread = sqrt(factor) = 31.6: the fixed point, times the sampling noise of a 32-norm
    median), so what reaches the weights is at most 3 x spread x factor = 95,000x the
    honest median, and the liar is clipped to factor x reference every time it is over it."""
    screen, sent, worst = _attack(2, liar)
    assert screen.spread == pytest.approx(math.sqrt(FACTOR))
    assert worst < 3 * screen.spread, worst
    for norm, scale, ref in sent:
        assert norm * scale <= FACTOR * ref * (1 + 1e-9)
        assert norm * scale < 3 * screen.spread * FACTOR
    assert screen.clipped > 100


def test_the_two_worker_reference_does_not_creep() -> None:
    """With the liar holding 1e18 for 40,000 rounds, the reference's geometric mean over the
    last 10,000 is within 1.5x of spread x honest median, no higher than over the 10,000
    after the attack began (x 1.2): clamping the honest worker's own values would let its
    upward fluctuations count and not its downward ones, and the reference would creep."""
    rng = random.Random(9)
    screen = NormScreen(FACTOR)
    early: list[float] = []
    late: list[float] = []
    for r in range(40_000):
        screen.check("honest", _honest(rng))
        screen.check("liar", 1e18 if r >= 100 else _honest(rng))
        if 1_000 <= r < 11_000:
            early.append(math.log(screen.reference()))
        elif r >= 30_000:
            late.append(math.log(screen.reference()))
    early_ref, late_ref = (math.exp(sum(v) / len(v)) for v in (early, late))
    assert _ratio(late_ref, screen.spread) < 1.5, late_ref
    assert late_ref < 1.2 * early_ref, (early_ref, late_ref)


@pytest.mark.parametrize("low", [0.0, 1e-30])
@pytest.mark.parametrize("workers", [3, 2])
def test_downward_attack_cannot_sink_the_reference(workers: int, low: float) -> None:
    """(d) A liar sending 0 or 1e-30 (to make honest gradients look like outliers): the
    reference stays over honest median / 3 with three workers and over honest median /
    (3 x spread) with two (the brief asks for over honest median / factor; this is 10x
    tighter), so honest gradients are clipped only over 10x their median: under 1 in 10,000
    with three workers, under 1 in 20 with two."""
    rng = random.Random(7)
    screen = NormScreen(FACTOR)
    lowest = math.inf
    honest_clipped = honest_sent = 0
    for r in range(3000):
        for h in range(workers - 1):
            before = screen.clipped
            screen.check(f"honest{h}", _honest(rng))
            honest_clipped += screen.clipped - before
            honest_sent += 1
        screen.check("liar", low if r >= 100 else _honest(rng))
        if screen.reference() > 0:
            lowest = min(lowest, screen.reference())
    if workers == 3:
        assert lowest > 1 / 3, lowest
        assert honest_clipped / honest_sent < 1e-4, honest_clipped
    else:
        assert lowest > 1 / (3 * screen.spread), lowest
        assert honest_clipped / honest_sent < 0.05, honest_clipped
    assert lowest > 1 / FACTOR


def test_state_dict_round_trips_through_json() -> None:
    """(e) A screen restored from its JSON'd state answers the next 2,000 norms exactly as
    the original does (factors, references, clip count)."""
    rng = random.Random(3)
    a = NormScreen(FACTOR)
    for i in range(500):
        a.check(f"w{i % 3}", _honest(rng) if i % 50 else 1e9)
    b = NormScreen(FACTOR)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.reference() == a.reference() and b.clipped == a.clipped > 0
    for i in range(2000):
        norm = _honest(rng) if i % 7 else 1e12
        assert b.check(f"w{i % 4}", norm) == a.check(f"w{i % 4}", norm)
        assert b.reference() == a.reference()
    assert b.clipped == a.clipped
    assert b.state_dict() == a.state_dict()


def test_bad_state_is_refused_and_leaves_the_screen_as_it_was() -> None:
    screen = NormScreen(FACTOR, warmup=0)
    screen.check("w", 2.0)
    before = screen.state_dict()
    for bad in ({}, {"version": 99}, {**before, "workers": {"w": ["x"]}},
                {**before, "workers": {"w": [math.inf]}}, {**before, "seen": -1}):
        with pytest.raises(ValueError, match="NormScreen state"):
            screen.load_state_dict(bad)
        assert screen.state_dict() == before


def test_a_shorter_window_keeps_the_newest_norms() -> None:
    a = NormScreen(FACTOR, window=32, warmup=0)
    for i in range(32):
        a.check("w", 1e3 if i < 24 else 1.0)
    b = NormScreen(FACTOR, window=4, warmup=0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["workers"]["w"] == [0.0] * 4


def test_factor_zero_disables() -> None:
    """(f) factor 0: every factor is 1.0, nothing is counted, even for 1e300 after 1e-10s."""
    screen = NormScreen(0.0)
    for i in range(100):
        assert screen.check(f"w{i % 2}", 1e-10) == 1.0
    assert screen.check("w0", 1e300) == 1.0
    assert screen.clipped == 0 and screen.reference() == 0.0


def test_nothing_is_clipped_during_warm_up() -> None:
    """(g) warmup 20: the first 20 norms pass whatever they are and the reference is 0.0;
    the 21st is screened against the reference of the first 20."""
    screen = NormScreen(FACTOR, warmup=20)
    for i in range(19):
        assert screen.check(f"w{i % 3}", 1.0) == 1.0
        assert screen.reference() == 0.0
    assert screen.check("w0", 1e30) == 1.0  # the 20th: still warming up
    assert screen.reference() == pytest.approx(1.0)  # the median of medians ignores it
    scale = screen.check("w1", 1e30)
    assert scale == pytest.approx(FACTOR / 1e30)
    assert screen.clipped == 1


def test_zero_norms_are_legal_and_do_not_sink_the_reference() -> None:
    screen = NormScreen(FACTOR)
    for i in range(300):
        assert screen.check(f"w{i % 3}", 0.0 if i % 3 == 0 else 1.0) == 1.0
    assert screen.reference() == pytest.approx(1.0)


def test_a_big_honest_jump_is_followed() -> None:
    """Norms that legitimately jump 1e6x (a new phase of training) are clipped for a
    while, then the reference follows (within 64 norms per worker) and clipping stops."""
    rng = random.Random(4)
    screen = NormScreen(FACTOR)
    for i in range(600):
        screen.check(f"w{i % 3}", _honest(rng))
    jump_clipped = screen.clipped
    for i in range(3 * 64):
        screen.check(f"w{i % 3}", _honest(rng, 1e6))
    assert _ratio(screen.reference(), 1e6) < 2
    at = screen.clipped
    for i in range(600):
        screen.check(f"w{i % 3}", _honest(rng, 1e6))
    assert screen.clipped == at > jump_clipped


def test_forget_drops_the_worker_and_the_reference_follows_the_rest() -> None:
    screen = NormScreen(FACTOR, warmup=0)
    for i in range(300):
        screen.check(f"w{i % 3}", 1.0 if i % 3 else 100.0)  # w0 at 100, w1 and w2 at 1
    screen.forget("w1")  # left: the median of (100, 1) is now their geometric mean
    screen.forget("unknown")
    for _ in range(50):
        screen.check("w2", 1.0)
    assert screen.reference() == pytest.approx(10.0)
    assert set(screen.state_dict()["workers"]) == {"w0", "w2"}


def test_workers_beyond_the_bound_evict_the_least_recently_heard() -> None:
    screen = NormScreen(FACTOR, warmup=0)
    for i in range(MAX_WORKERS + 5):
        screen.check(f"w{i}", 1.0)
    kept = screen.state_dict()["workers"]
    assert len(kept) == MAX_WORKERS and "w0" not in kept and f"w{MAX_WORKERS + 4}" in kept


@pytest.mark.parametrize("norm", [-1.0, math.nan, math.inf])
def test_bad_norms_are_a_caller_error(norm: float) -> None:
    with pytest.raises(ValueError, match="norm must be finite"):
        NormScreen(FACTOR).check("w", norm)


@pytest.mark.parametrize("kwargs", [{"factor": -1.0}, {"factor": math.nan},
                                    {"factor": 10.0, "window": 0}, {"factor": 10.0, "warmup": -1}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        NormScreen(**kwargs)  # type: ignore[arg-type]
