"""`PeerBackend`'s lifecycle: the transition table (every step it does not list is refused
with a clear error, every state is reachable and every state can reach CLOSED), the calls
that are refused before start() and after close(), and the legal paths on a real backend
(one peer on loopback, static peers, no mDNS)."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import pytest

from swarmtrain.roles.peer.backend import (
    _LIFECYCLE,
    BackendStateError,
    Lifecycle,
    PeerBackend,
    PeerOptions,
    _Step,
)
from swarmtrain.roles.peer.ring import RingBroken
from swarmtrain.testing.local import free_ports
from swarmtrain.transport.identity import Identity

pytestmark = pytest.mark.timeout(90)
JOIN = 20.0  # seconds: generous bound for a call that should end promptly


def test_the_table_takes_each_listed_step_and_refuses_every_other() -> None:
    assert set(_LIFECYCLE) == set(Lifecycle)
    for state in Lifecycle:
        for step in _Step:
            b = PeerBackend()
            b._lifecycle = state
            after = _LIFECYCLE[state].get(step)
            if after is not None:
                assert b._move(step) == (state, after) and b.lifecycle is after
                continue
            with pytest.raises(BackendStateError) as err:
                b._move(step)
            assert f"peer backend is {state.value}: {step.value} is not allowed" in str(err.value)
            assert b.lifecycle is state  # a refused step changes nothing


def test_every_state_is_reachable_and_closed_is_reachable_from_every_state() -> None:
    def reachable(start: Lifecycle) -> set[Lifecycle]:
        seen, todo = {start}, [start]
        while todo:
            for after in _LIFECYCLE[todo.pop()].values():
                if after not in seen:
                    seen.add(after)
                    todo.append(after)
        return seen

    assert reachable(Lifecycle.NEW) == set(Lifecycle)
    for state in Lifecycle:
        assert Lifecycle.CLOSED in reachable(state)
    assert set(_LIFECYCLE[Lifecycle.CLOSED].values()) == {Lifecycle.CLOSED}  # no way back
    for state in Lifecycle:  # a signal handler may interrupt in any state
        assert _Step.INTERRUPT in _LIFECYCLE[state]


def test_before_start_a_call_is_refused_and_close_or_interrupt_end_the_backend_for_good() -> None:
    b = PeerBackend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(BackendStateError, match="peer backend is new: call start"):
            b.refresh()
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert b.lifecycle is Lifecycle.NEW
    b.close()
    assert b.lifecycle is Lifecycle.CLOSED and b.stopping
    b.close()  # closing twice does nothing
    with pytest.raises(BackendStateError, match="closed: start.. is not allowed.*build a new PeerBackend"):
        b.start()

    interrupted = PeerBackend()
    interrupted.interrupt()  # a signal before start(): the peer never starts
    interrupted.interrupt()
    assert interrupted.lifecycle is Lifecycle.CLOSED
    with pytest.raises(BackendStateError, match="closed"):
        interrupted.start()


def test_an_interrupt_from_a_signal_handler_inside_a_step_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler runs on the thread it interrupted: one calling interrupt() while that
    thread is inside start()'s own step must neither deadlock on the lifecycle lock nor be
    overwritten by the step it interrupted (the peer then never starts)."""
    b = PeerBackend()

    class SignalDuringLookup(dict):  # type: ignore[type-arg]
        fired = False

        def get(self, key: object, default: object = None) -> object:
            if not SignalDuringLookup.fired:
                SignalDuringLookup.fired = True
                b.interrupt()  # as a SIGINT handler would, between two bytecodes of _move()
            return super().get(key, default)

    monkeypatch.setitem(_LIFECYCLE, Lifecycle.NEW, SignalDuringLookup(_LIFECYCLE[Lifecycle.NEW]))
    raised: list[BaseException] = []

    def start() -> None:
        try:
            b.start()
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            raised.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(JOIN)
    assert not thread.is_alive(), "start() deadlocked on the interrupt inside its own step"
    assert SignalDuringLookup.fired and b.lifecycle is Lifecycle.CLOSED
    assert len(raised) == 1 and isinstance(raised[0], BackendStateError), raised
    assert "peer backend is closed: start() is not allowed" in str(raised[0])


@pytest.fixture
def lone_peer() -> Iterator[PeerBackend]:
    """A started peer that waits for a second one that never comes (its static peer is a
    port nobody listens on)."""
    port, nobody = free_ports(2)
    b = PeerBackend(PeerOptions(run="lifecycle-test", min_peers=2, host="127.0.0.1", port=port, mdns=False,
                                static_peers=(("127.0.0.1", nobody),), propose_timeout_sec=1.0,
                                reform_timeout_sec=60.0),
                    secret=b"lifecycle-secret", identity=Identity.generate())
    try:
        b.start()
        yield b
    finally:
        b.close()


def _waiting_for_the_first_epoch(b: PeerBackend) -> tuple[threading.Thread, list[BaseException]]:
    """refresh() on a thread: it waits for the first epoch, which needs a peer that never comes."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            b.refresh()
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            raised.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, raised


def _until(cond: Callable[[], bool], what: str) -> None:
    """Poll ``cond`` until it holds; fail after JOIN seconds."""
    deadline = time.monotonic() + JOIN
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {JOIN} s: {what}")
        threading.Event().wait(0.01)


def test_running_then_interrupt_ends_a_wait_then_close(lone_peer: PeerBackend) -> None:
    b = lone_peer
    assert b.lifecycle is Lifecycle.RUNNING and not b.stopping
    with pytest.raises(BackendStateError, match="running: start.. is not allowed"):
        b.start()
    thread, raised = _waiting_for_the_first_epoch(b)
    b.interrupt()
    thread.join(JOIN)
    assert not thread.is_alive(), "refresh() still waits after interrupt()"
    assert len(raised) == 1 and isinstance(raised[0], RingBroken), raised
    assert b.lifecycle is Lifecycle.STOPPING and b.stopping
    b.interrupt()  # again: nothing changes
    assert b.lifecycle is Lifecycle.STOPPING
    b.close()
    assert b.lifecycle is Lifecycle.CLOSED
    with pytest.raises(BackendStateError, match="closed: call|its control loop is gone"):
        b.refresh()


def test_an_interrupt_from_a_signal_handler_while_its_thread_holds_the_ring_lock_returns(
        lone_peer: PeerBackend) -> None:
    """The training thread takes the ring lock to read the current ring and the byte totals;
    a signal handler that interrupts it there runs interrupt() on that same thread."""
    b = lone_peer
    done = threading.Event()

    def handler_inside_the_lock() -> None:
        with b._ring_lock:
            b.interrupt()
        done.set()

    threading.Thread(target=handler_inside_the_lock, daemon=True).start()
    assert done.wait(JOIN), "interrupt() deadlocked on the ring lock its own thread held"
    assert b.lifecycle is Lifecycle.STOPPING


def test_close_from_another_thread_ends_a_wait_with_ring_broken(lone_peer: PeerBackend) -> None:
    """close() without interrupt() first, while the training thread waits: the wait ends with
    RingBroken, as after interrupt(), not with a bare CancelledError (close() cancels every
    task of the control loop, the waiting call's too)."""
    b = lone_peer
    thread, raised = _waiting_for_the_first_epoch(b)
    _until(lambda: b.membership.ready, "refresh() running on the control loop")
    b.close()
    thread.join(JOIN)
    assert not thread.is_alive(), "refresh() still waits after close()"
    assert len(raised) == 1 and isinstance(raised[0], RingBroken), raised
    assert b.lifecycle is Lifecycle.CLOSED
