"""No single member steers the model (issue #17, must-have 4; docs/robustness.md).

Pure: the robust combinations against hand-computed values, the slot-per-worker window, and
the screen's reference against the fresh-id ratchet. Live: a real coordinator and workers
(and real peers on a real ring) over loopback, with one crafted attacker among five
(``swarmtrain/testing/attackers.py``) on the digits task."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch

from swarmtrain.config import load_coordinator_config, load_worker_config
from swarmtrain.roles.aggregation import MemberScores, RobustWindow, robust_combine, trim_count
from swarmtrain.roles.peer.training import flatten
from swarmtrain.roles.ps.coordinator import Coordinator
from swarmtrain.roles.ps.screen import NormScreen
from swarmtrain.roles.ps.worker import Worker
from swarmtrain.tasks import DigitsTask
from swarmtrain.testing.attackers import HONEST, run_peers, run_ps

_DIGITS = DigitsTask()

pytestmark = pytest.mark.timeout(240)  # (39 s at half speed)



# -- the combinations, by hand -----------------------------------------------------------

def _members(*rows: list[float]) -> list[dict[str, torch.Tensor]]:
    return [{"g": torch.tensor(r)} for r in rows]


def test_median_is_per_coordinate_and_averages_the_two_middle_values() -> None:
    odd = robust_combine(_members([1, 9], [2, -5], [100, 0]), "median")["g"]
    assert odd.tolist() == [2.0, 0.0]
    even = robust_combine(_members([1, 9], [2, -5], [100, 0], [3, 1]), "median")["g"]
    assert even.tolist() == [2.5, 0.5]  # torch.median would say [2, 0]


def test_trimmed_mean_drops_the_extremes_of_every_coordinate() -> None:
    rows = _members([1, 10], [2, 20], [3, 30], [4, 40], [1e9, -1e9])
    out = robust_combine(rows, "trimmed_mean", trim=0.2)["g"]  # one from each end of five
    assert out.tolist() == pytest.approx([3.0, 20.0])
    assert [trim_count(k, 0.2) for k in (1, 2, 3, 5, 10, 11)] == [0, 0, 1, 1, 2, 2]
    assert trim_count(5, 0.0) == 0 and trim_count(4, 0.45) == 1  # something is always left


def test_clip_scales_every_member_above_the_median_norm_down_to_it() -> None:
    rows = [{"a": torch.tensor([3.0, 4.0])}, {"a": torch.tensor([0.0, 1.0])},
            {"a": torch.tensor([600.0, 800.0])}]  # norms 5, 1, 1000: the reference is 5
    out = robust_combine(rows, "clip")["a"]
    assert out.tolist() == pytest.approx([(3 + 0 + 3) / 3, (4 + 1 + 4) / 3])
    # of two, the smaller norm is the reference: a liar of two cannot raise it (the mean of
    # the two middle norms would put it at half the liar's)
    out = robust_combine(rows[1:], "clip")["a"]
    assert out.tolist() == pytest.approx([(0 + 0.6) / 2, (1 + 0.8) / 2])


def test_a_member_lacking_a_name_counts_as_zeros_for_it_and_bits_repeat() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [{"a": torch.randn(50, generator=gen), "b": torch.randn(3, generator=gen)} for _ in range(4)]
    rows.append({"a": torch.randn(50, generator=gen)})  # no "b": an unused branch
    for mode in ("clip", "trimmed_mean", "median"):
        first, again = robust_combine(rows, mode), robust_combine(rows, mode)
        assert set(first) == {"a", "b"}
        assert all(torch.equal(first[n], again[n]) for n in first)
    zeros = [*rows[:4], {"a": rows[4]["a"], "b": torch.zeros(3)}]  # a skipped branch: no gradient
    for mode in ("clip", "trimmed_mean", "median"):
        assert torch.equal(robust_combine(rows, mode)["b"], robust_combine(zeros, mode)["b"])
    assert not torch.equal(robust_combine(rows, "clip")["b"], robust_combine(rows[:4], "clip")["b"])
    with pytest.raises(ValueError, match="robust mode"):
        robust_combine(rows, "none")


def test_a_window_gives_one_vote_per_worker_however_often_or_much_it_claims() -> None:
    params = {"g": torch.zeros(2)}
    win = RobustWindow(params, "median")
    for _ in range(10):  # a fast liar: ten gradients, each claiming a million samples
        win.add("liar", {"g": torch.tensor([1e6, -1e6])}, 1.0, 1 << 20, sparse=False)
    win.add("a", {"g": torch.tensor([1.0, 1.0])}, 1.0, 32, sparse=False)
    win.add("b", {"g": torch.tensor([2.0, 3.0])}, 0.5, 32, sparse=False)
    win.add("b", {"g": torch.tensor([4.0, 3.0])}, 1.0, 32, sparse=False)  # b's slot: [10/3, 3]
    assert win.members == 3 and win.gradients == 13
    assert win.counted_samples() == 32 + 64 + 64  # no slot counts above the median slot's 64
    combined, sparse = win.take()
    assert combined["g"].tolist() == pytest.approx([10 / 3, 1.0]) and not sparse
    assert win.members == 0 and win.gradients == 0 and win.counted_samples() == 0


@pytest.mark.parametrize("mode", ["clip", "trimmed_mean", "median"])
def test_a_windows_slots_are_reused_without_leaking_into_the_next_or_into_the_last_result(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = [[{"g": torch.randn(6, generator=gen)} for _ in range(4)] for _ in range(2)]
    reused = RobustWindow({"g": torch.zeros(6)}, mode)
    results, copies = [], []
    for window in rows:
        for i, grads in enumerate(window):  # w0 sends twice in the first window only
            reused.add(f"w{i}", grads, 1.0, 32, sparse=False)
        if window is rows[0]:
            reused.add("w0", {"g": torch.ones(6)}, 0.5, 32, sparse=False)
        results.append(reused.take()[0]["g"])
        copies.append(results[-1].clone())  # as it was when the window closed
    fresh = RobustWindow({"g": torch.zeros(6)}, mode)
    for i, grads in enumerate(rows[1]):
        fresh.add(f"w{i}", grads, 1.0, 32, sparse=False)
    assert torch.equal(results[1], fresh.take()[0]["g"])  # the second window knows nothing of the first
    assert torch.equal(results[0], copies[0])  # and the first result was not written over


def test_a_left_out_worker_neither_fills_a_window_nor_counts_toward_its_quorum() -> None:
    """Its slot must not take an honest one's place: windows close on voting members."""
    win = RobustWindow({"g": torch.zeros(2)}, "clip")
    honest = {"a": [1.0, 0.1], "b": [1.0, -0.1], "c": [1.0, 0.2], "d": [1.0, -0.2]}
    for _ in range(12):  # the liar pulls against the four others until it is left out
        for w, g in honest.items():
            win.add(w, {"g": torch.tensor(g)}, 1.0, 32, sparse=False)
        win.add("liar", {"g": torch.tensor([-1.0, 0.0])}, 1.0, 32, sparse=False)
        win.take()
    assert win.scores.excluded() == {"liar"}
    win.add("liar", {"g": torch.tensor([-1.0, 0.0])}, 1.0, 32, sparse=False)
    win.add("a", {"g": torch.tensor([1.0, 0.1])}, 1.0, 32, sparse=False)
    assert win.members == 1 and win.counted_samples() == 32


# -- the screen's reference: the ratchet of issue #17 -------------------------------------

def _honest_rounds(screen: NormScreen, rng: random.Random, rounds: int) -> None:
    for _ in range(rounds):
        for w in ("w0", "w1"):
            screen.check(w, rng.uniform(0.5, 2.0))


def test_fresh_worker_ids_cannot_ratchet_the_reference() -> None:
    """Issue #17: gradients each 30x the norm of the last, each under a fresh worker id.
    Every id used to vote from its first norm (and was never forgotten), so the one-norm
    "medians" outvoted the two honest workers and the reference followed them up (to 2e23);
    now an id votes once its window holds 8 norms, and the big gradients are clipped."""
    rng = random.Random(0)
    screen = NormScreen(1000.0)
    _honest_rounds(screen, rng, 150)
    scales = []
    for k in range(40):
        scales.append(screen.check(f"fresh-{k}", 1e-4 * 30.0**k))
        _honest_rounds(screen, rng, 1)
    assert 0.5 <= screen.reference() <= 2.0
    assert all(s < 1.0 for k, s in enumerate(scales) if 1e-4 * 30.0**k > 1000 * 2.0)


def test_an_id_that_stops_sending_stops_voting() -> None:
    rng = random.Random(1)
    screen = NormScreen(1000.0, window=8)
    for _ in range(20):  # three liars earn their votes (a majority of five), then leave
        for w in ("x0", "x1", "x2"):
            screen.check(w, 1e3)
        _honest_rounds(screen, rng, 1)
    assert screen.reference() > 100
    _honest_rounds(screen, rng, 32 * 8)  # they are forgotten; the honest pair decides
    assert 0.5 <= screen.reference() <= 2.0
    assert set(screen.state_dict()["workers"]) == {"w0", "w1"}


# -- live: a parameter server with one attacker of five ----------------------------------

def test_ps_ratchet_and_huge_claims_do_not_steer_a_robust_coordinator(
        caplog: pytest.LogCaptureFixture) -> None:
    """The ratchet sequence of issue #17 (norms 1e-4 x 30**k up to 1e18) and a liar claiming
    2**20 samples per (sign-flipped) gradient: with ``robust = "median"`` the model reaches
    its target and ends near the clean run; with ``none`` the claims take the model over."""
    caplog.set_level(logging.ERROR)
    clean, _ = run_ps("median", None)
    ratchet, c = run_ps("median", "ratchet")
    claims, _ = run_ps("median", "huge_samples")
    plain, _ = run_ps("none", "huge_samples")
    assert c.stats["applied"] > 0 and c.workers[f"w{HONEST}"].steps > 10  # it was heard
    for m in (clean, ratchet, claims):
        assert m["accuracy"] >= 0.9, (clean, ratchet, claims)
    assert ratchet["loss"] <= 1.25 * clean["loss"], (clean, ratchet)
    assert claims["loss"] <= 2.0 * clean["loss"], (clean, claims)
    assert plain["accuracy"] < 0.5 and plain["loss"] > 10 * clean["loss"], plain


# -- members that pull against the others are left out ----------------------------------

def _rounds(scores: MemberScores, n: int, *, signal: float, liar: bool, seed: int = 0,
            decay: float = 0.0) -> int | None:
    """``n`` combinations of 4 honest members (a shared gradient of size ``signal`` plus unit
    noise per member; the signal shrinking by ``decay`` per round, as near an optimum) and, if
    ``liar``, a fifth sending -10x its own honest gradient; the round the liar was left out."""
    gen = torch.Generator().manual_seed(seed)
    true = torch.randn(64, generator=gen)
    true /= true.norm()
    caught = None
    for r in range(n):
        g = signal * (1.0 - decay) ** r * true
        members = [(f"h{i}", {"w": g + torch.randn(64, generator=gen) / 8}) for i in range(4)]
        if liar:
            members.append(("liar", {"w": -10 * (g + torch.randn(64, generator=gen) / 8)}))
        scores.update(members)
        assert not any(f"h{i}" in scores.excluded() for i in range(4)), (r, scores.summary())
        if caught is None and "liar" in scores.excluded():
            caught = r
    return caught


def test_a_sign_flipped_member_is_left_out_within_a_few_rounds_and_honest_ones_never() -> None:
    scores = MemberScores()
    caught = _rounds(scores, 200, signal=1.0, liar=True)
    # by its 5th combination (the 8th, before the small-sample threshold: half of a 15-round
    # DiLoCo run went by first, and digits DiLoCo ended 1.10-1.15x the clean loss)
    assert caught is not None and caught <= 4, caught
    assert scores.voting(["h0", "h1", "liar", "h2", "h3"]) == [0, 1, 3, 4]
    assert scores.voting(["h0", "liar"]) == [0, 1]  # never fewer than a majority vote
    assert scores.exclusions == 1  # left out once, not once per round


def test_a_left_out_member_is_taken_back_only_once_it_agrees_again() -> None:
    """Hysteresis: a liar whose agreement hovers just above the margin (-0.04 > -0.05) stays
    out; it was taken back at once before (a CI run saw one flap in and out five times)."""
    scores = MemberScores()

    def rounds(n: int, c: float) -> None:  # the liar's cosine with the others' sum is c exactly
        liar = torch.tensor([c, (1 - c * c) ** 0.5])
        for _ in range(n):
            scores.update([*((f"h{i}", {"w": torch.tensor([1.0, 0.0])}) for i in range(4)),
                           ("liar", {"w": liar})])

    rounds(20, -0.3)
    assert scores.excluded() == {"liar"}
    rounds(scores.rounds, -0.04)  # its whole history now says -0.04: not significant, still < 0
    assert scores.excluded() == {"liar"} and scores.exclusions == 1
    rounds(scores.rounds, 0.1)
    assert scores.excluded() == frozenset() and scores.exclusions == 1


def test_honest_members_are_never_left_out_over_100000_combinations_as_the_signal_fades() -> None:
    """The long-run guard: an honest member's agreement with the others is positive on average
    however small the shared gradient gets (down to pure noise), so no honest member is ever
    left out, and a forgotten member's history does not pile up."""
    scores = MemberScores()
    assert _rounds(scores, 100_000, signal=1.0, liar=False, decay=1e-4, seed=1) is None
    assert scores.exclusions == 0 and len(scores.summary()["agreement"]) == 4  # type: ignore[arg-type]


def test_a_ps_sign_flipper_is_left_out_and_the_model_learns_as_without_it(
        caplog: pytest.LogCaptureFixture) -> None:
    # Two runs of each: one pair's loss ratio spreads with sd 0.065 around 1.01 (12 pairs here,
    # two CPU hogs beside them), and the loaded clean-clone CI box once drew 1.32 (0.202 vs
    # 0.153); the bar is on the pairs' mean losses (the bench's 2 %: several runs)
    cleans = [run_ps("trimmed_mean", None)[0] for _ in range(2)]
    attacks = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="swarmtrain"):
            attacked, coord = run_ps("trimmed_mean", "sign_flip")
        attacks.append(attacked)
        assert coord.status()["robust"]["excluded"] == [f"w{HONEST}"], coord.status()["robust"]
        assert coord.status()["refusals"].get("member_excluded") == 1
        assert any("is left out of the robust combination" in r.getMessage() for r in caplog.records)
        assert attacked["accuracy"] >= 0.9, attacked
    mean_clean = sum(m["loss"] for m in cleans) / 2
    mean_attacked = sum(m["loss"] for m in attacks) / 2
    assert mean_attacked <= 1.25 * mean_clean, (cleans, attacks)


# -- live: five peers on a real ring, one attacker ---------------------------------------

def test_peers_gather_and_combine_identically_and_a_scaled_liar_does_not_steer() -> None:
    clean, _ = run_peers("median", None)
    attacked, trainers = run_peers("median", "scaled")
    plain, _ = run_peers("none", "huge_samples")
    weights = {flatten(t.strategy.params).numpy().tobytes() for t in trainers}
    assert len(weights) == 1  # every member applied the same bits
    assert attacked["accuracy"] >= 0.9 and clean["accuracy"] >= 0.9
    assert attacked["loss"] <= 1.25 * clean["loss"], (clean, attacked)
    assert plain["accuracy"] < 0.5 and not plain["loss"] < 10 * clean["loss"], plain
    # a sign-flipped liar is left out by every member alike, and the rest learn as without it
    flipped, trainers = run_peers("median", "sign_flip")
    assert len({flatten(t.strategy.params).numpy().tobytes() for t in trainers}) == 1
    assert len({tuple(t.scores.summary()["excluded"]) for t in trainers}) == 1  # type: ignore[arg-type]
    assert len(trainers[0].scores.excluded()) == 1 and flipped["accuracy"] >= 0.9
    # and its samples are not counted as trained: the last round's are the 4 honest batches
    assert {t._round_weight for t in trainers} == {HONEST * 32}
    assert flipped["loss"] <= 1.1 * clean["loss"], (clean, flipped)


def test_diloco_outer_step_is_combined_robustly_and_identically() -> None:
    """The DiLoCo contribution (the change over H inner steps) goes through the same gather:
    a sign-flipped liar's change is outvoted, every member ends with the same bits."""
    initial = _DIGITS.evaluate(_DIGITS.build_model(), _DIGITS.load_data())["loss"]
    robust, trainers = run_peers("trimmed_mean", "sign_flip", rounds=6, mode="diloco",
                                        inner_steps=5)
    weights = {flatten(t.strategy.params).numpy().tobytes() for t in trainers}
    assert len(weights) == 1
    assert robust["loss"] < 0.5 * initial, (initial, robust)


def test_a_lone_worker_still_trains_under_a_robust_coordinator() -> None:
    """The quorum is never more than the connected workers: one worker's windows close on
    its own (and are only as robust as it is, docs/robustness.md)."""
    data = _DIGITS.load_data()

    async def main() -> Coordinator:
        c = Coordinator(_DIGITS.build_model(), load_coordinator_config(overrides={
            "network.host": "127.0.0.1", "network.port": 0, "checkpointing.interval": 0,
            "training.learning_rate": 3e-3, "training.max_steps": 20, "training.robust": "median",
            "training.aggregate_samples": 64}), task_name="digits", secret=b"lone")
        await c.start()
        w = Worker(_DIGITS.build_model(), _DIGITS.loss, data.train, load_worker_config(overrides={
            "network.coordinator_port": c.port, "hardware.num_threads": 1, "training.batch_size": 32,
            "training.accumulation_steps": 1, "network.reconnect_attempts": 0,
            "training.probe_seconds": 0.1}), task_name="digits", secret=b"lone")
        task = asyncio.create_task(w.run_async())
        try:
            await asyncio.wait_for(c.run(), 60)
            await asyncio.wait_for(task, 30)
        finally:
            await c.close()
        return c

    c = asyncio.run(main())
    assert c.version == 20
    assert c.stats["applied"] == 40  # two gradients of 32 per window of 64
