"""What a coordinator calls out to, as typed protocols instead of attributes set from outside.

:class:`CheckpointHook` is what :class:`~swarmtrain.roles.ps.checkpointing.CoordinatorCheckpointer`
provides: the coordinator asks it to save after applied updates and at shutdown, and never
needs to know how or where the checkpoint is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from swarmtrain.roles.ps.coordinator import Coordinator
    from swarmtrain.wire import CheckpointMsg

__all__ = ["CheckpointHook"]


class CheckpointHook(Protocol):
    """Checkpoints a coordinator: attached with ``Coordinator.attach_checkpointer``."""

    async def maybe_save(self, coord: Coordinator) -> None:
        """Save if enough updates were applied since the last save (called after each)."""

    async def save_now(self, coord: Coordinator) -> CheckpointMsg:
        """Save now (``ctl checkpoint``, shutdown); the answer says whether and where."""

    def restore(self, coord: Coordinator) -> bool:
        """Load the newest valid checkpoint into ``coord``; False if there is none."""
