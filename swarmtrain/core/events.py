"""What a role reports its events and metrics to (the user surface's run log implements it).

Roles never import the user surface: a coordinator or peer is given an object with these two
methods (``swarmtrain.app.runlog.RunLog`` in the CLI sessions) and calls it.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["RunRecorder"]


class RunRecorder(Protocol):
    """Receives a role's events and metrics lines."""

    def event(self, event: str, **data: Any) -> None:
        """Record one event (a worker joined, a checkpoint written, ...)."""

    def metrics(self, *, force: bool = False, **data: Any) -> bool:
        """Record a metrics line (may be rate-limited unless ``force``); True if written."""
