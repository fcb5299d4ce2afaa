"""Shard assignment as workers join and leave (pure, no network)."""

from __future__ import annotations

import random

import pytest

from swarmtrain.roles.ps.shards import ShardPlanner


def covered(p: ShardPlanner) -> bool:
    return not p.orphans()


def test_first_worker_holds_everything_then_shares() -> None:
    p = ShardPlanner(3)
    assert p.join("a") == {"a": [0, 1, 2]}
    ch = p.join("b")
    assert ch["b"] == [2] and ch["a"] == [0, 1]
    ch = p.join("c")
    assert ch == {"c": [1], "a": [0]}
    assert covered(p)


def test_leaver_shards_go_to_the_least_loaded_and_return_on_rejoin() -> None:
    p = ShardPlanner(3)
    for w in "abc":
        p.join(w)
    ch = p.leave("b")
    assert covered(p) and len(ch) == 1
    taker = next(iter(ch))
    assert len(p.assigned[taker]) == 2
    ch = p.join("b")  # takes one back from the worker holding two
    assert len(p.assigned["b"]) == 1 and covered(p)
    assert all(len(s) == 1 for s in p.assigned.values())


def test_more_workers_than_shards_share_the_least_held() -> None:
    p = ShardPlanner(2)
    for w in "abcd":
        p.join(w)
    assert sorted(len(p.holders(s)) for s in range(2)) == [2, 2]


def test_pinned_worker_keeps_its_shard_and_never_takes_orphans() -> None:
    p = ShardPlanner(3)
    p.join("a")
    p.join("pin", pinned=1)
    assert p.assigned["pin"] == [1] and 1 not in p.assigned["a"]
    p.join("b")
    p.leave("b")
    assert p.assigned["pin"] == [1] and covered(p)
    with pytest.raises(ValueError):
        p.join("x", pinned=7)


def test_random_churn_keeps_every_shard_covered() -> None:
    rng = random.Random(0)
    p = ShardPlanner(5)
    live: set[str] = set()
    for step in range(500):
        if live and rng.random() < 0.45:
            w = rng.choice(sorted(live))
            p.leave(w)
            live.discard(w)
        else:
            w = f"w{rng.randrange(8)}"
            p.join(w)
            live.add(w)
        assert set(p.assigned) == live
        assert covered(p) or not live, (step, p.assigned)
        assert all(p.assigned[w] for w in live)
