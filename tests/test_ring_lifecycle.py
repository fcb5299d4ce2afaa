"""A ring group's lifecycle (issue #19, must-have 2): one :class:`RingState`, moved only along
:data:`RING_TRANSITIONS` by one method that refuses anything else; each legal path is
reachable on a real ring: open -> busy -> idle, an abort, a break, a close."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swarmtrain.roles.peer.links import RingListener
from swarmtrain.roles.peer.ring import RING_TRANSITIONS, RingBroken, RingGroup, RingState, RingStateError
from tests.test_ring import run_ring

pytestmark = pytest.mark.timeout(60)


def _watch(group: RingGroup, during: Any = None) -> list[RingState]:
    """Record the group's state as each collective's frames start to move (and run
    `during(group)` then, if given), and after each ends."""
    seen: list[RingState] = []
    pump = group._pump

    def watched(op: Any) -> None:
        seen.append(group.state)
        if during is not None:
            during(group)
        seen.append(group.state)
        pump(op)

    group._pump = watched  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("start", list(RingState))
def test_every_move_outside_the_table_is_refused_naming_both_states(start: RingState) -> None:
    with RingListener("127.0.0.1", secret=None) as listener:
        group = RingGroup(listener, 0, [listener.address], ring_id="t", epoch=1, secret=None)
        for target in RingState:
            group._state = start  # as if it had got there
            if target in RING_TRANSITIONS[start]:
                continue
            with pytest.raises(RingStateError, match=f"from {start.name} to {target.name}") as info:
                group._move(target)
            assert group.state is start and (info.value.current, info.value.target) == (start, target)
    assert set(RING_TRANSITIONS) == set(RingState)
    assert not RING_TRANSITIONS[RingState.BROKEN] and not RING_TRANSITIONS[RingState.CLOSED]


def test_open_busy_idle_then_closed() -> None:
    def body(group: RingGroup, rank: int) -> Any:
        assert group.state is RingState.IDLE
        seen = _watch(group)
        out = group.all_reduce(torch.full((100,), float(rank + 1)))
        after = group.state
        group.barrier()
        group.close()
        with pytest.raises(RingBroken, match="the group is closed"):
            group.barrier()
        return seen, after, group.state, out

    for seen, after, closed, out in run_ring(2, body):
        assert seen == [RingState.BUSY] * 4 and after is RingState.IDLE and closed is RingState.CLOSED
        assert torch.equal(out, torch.full((100,), 3.0))


def test_a_second_collective_while_one_runs_is_refused_and_the_first_goes_on() -> None:
    refused: list[BaseException] = []

    def again(group: RingGroup) -> None:
        with pytest.raises(RingStateError, match="calls must be sequential") as info:
            group.barrier()
        refused.append(info.value)

    def body(group: RingGroup, rank: int) -> Any:
        if rank == 0:
            _watch(group, again)
        return group.all_reduce(torch.ones(10)), group.state

    for out, state in run_ring(2, body):
        assert torch.equal(out, torch.full((10,), 2.0)) and state is RingState.IDLE
    assert len(refused) == 1 and isinstance(refused[0], RuntimeError)  # as before: a RuntimeError


def test_close_during_a_collective_aborts_it_and_breaks_the_group() -> None:
    def body(group: RingGroup, rank: int) -> Any:
        seen = _watch(group, RingGroup.close if rank == 0 else None)
        with pytest.raises(RingBroken) as info:
            group.all_reduce(torch.ones(1000))
        return seen, group.state, str(info.value)

    (seen0, state0, err0), (_, state1, _) = run_ring(2, body, timeout=30.0)
    assert seen0 == [RingState.BUSY, RingState.ABORTING] and state0 is RingState.BROKEN
    assert "closed during the collective" in err0
    assert state1 is RingState.BROKEN  # the neighbour's links were cut: it breaks at once


def test_a_collective_that_finishes_while_aborting_closes_the_group() -> None:
    def body(group: RingGroup, rank: int) -> Any:
        if rank == 0:
            pump = group._pump

            def then_close(op: Any) -> None:
                pump(op)  # every frame is sent and received
                group.close()
                states.append(group.state)

            group._pump = then_close  # type: ignore[method-assign]
            out = group.all_reduce(torch.ones(10))
            return out, group.state
        return group.all_reduce(torch.ones(10)), group.state

    states: list[RingState] = []
    (out, state), _ = run_ring(2, body)
    assert states == [RingState.ABORTING] and state is RingState.CLOSED
    assert torch.equal(out, torch.full((10,), 2.0))


def test_a_neighbour_leaving_breaks_the_group_for_good() -> None:
    def body(group: RingGroup, rank: int) -> Any:
        if rank == 1:
            group.close()  # never takes part
            return None
        with pytest.raises(RingBroken):
            group.all_reduce(torch.ones(1000))
        broken = group.state
        with pytest.raises(RingBroken, match="broke earlier"):
            group.barrier()
        group.close()  # a no-op on a broken group
        return broken, group.state

    (broken, after), _ = run_ring(2, body, timeout=30.0)
    assert broken is RingState.BROKEN and after is RingState.BROKEN
