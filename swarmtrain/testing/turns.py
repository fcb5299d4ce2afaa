"""A virtual clock for compute, so that tests of unequal workers' speeds do not depend on the
load of the machine they run on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ComputeTurns"]


class ComputeTurns:
    """Workers' computations take turns: a worker waits for its turn, and the turns go round
    the workers in ``order``, one slot each per round. A worker whose step costs ``n`` slots
    then runs at ``1/n`` of the speed of one whose step costs one, whatever the load on the
    machine; a wall-clock throttle (``hardware.Throttle``) stretches unevenly under load, as
    its sleep does not stretch and the other workers' computing does. Time a worker spends
    outside its computation (sending, waiting for an answer) costs no slots: the clock stands
    still until it takes its turn. Once ``done()`` is true, every wait ends at once.

    Args:
        order: the workers' names, each once.
        done: whether the run is over (polled while waiting).
    """

    def __init__(self, order: list[str], done: Callable[[], bool]) -> None:
        self.order, self.done, self.turn = list(order), done, 0
        self._cond = threading.Condition()

    def take(self, name: str, timeout: float = 60.0) -> None:
        """Wait for ``name``'s turn (or ``done()``) and pass the turn on.

        Raises:
            TimeoutError: the turn did not come within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.order[self.turn] != name and not self.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} waited {timeout} s for its compute turn")
                self._cond.wait(0.05)  # no one notifies done(): look again
            self.turn = (self.turn + 1) % len(self.order)
            self._cond.notify_all()

    def loss(self, name: str, slots: int, loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``loss_fn(model, batch)``, costing ``slots`` turns of ``name`` before it runs."""
        def loss(model: Any, batch: Any) -> Any:
            for _ in range(slots):
                self.take(name)
            return loss_fn(model, batch)
        return loss
