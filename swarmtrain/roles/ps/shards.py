"""Which worker trains on which data shards, as workers come and go.

Invariant: whenever at least one unpinned worker is connected, every shard is held by some
worker, so no data is left untrained when a machine drops out. A joining worker takes the
orphaned shards, or else one shard from the worker holding the most, or else shares the
least-held shard. A leaving worker's orphaned shards go to the workers holding the fewest.
Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from swarmtrain.errors import ConfigError

__all__ = ["ShardPlanner"]


class ShardPlanner:
    """Assigns ``num_shards`` shards to workers; each method returns the changed assignments."""

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise ConfigError(f"num_shards must be >= 1, got {num_shards} (set training.num_shards, "
                              "or 0 for one shard per min_workers)")
        self.num_shards = num_shards
        self.assigned: dict[str, list[int]] = {}
        self.pinned: dict[str, int] = {}

    def holders(self, shard: int) -> list[str]:
        return sorted(w for w, s in self.assigned.items() if shard in s)

    def orphans(self) -> list[int]:
        held = {s for shards in self.assigned.values() for s in shards}
        return [s for s in range(self.num_shards) if s not in held]

    def join(self, worker: str, pinned: int | None = None) -> dict[str, list[int]]:
        """Add (or re-add) ``worker``; returns {worker: shards} for every worker whose set changed."""
        changed: dict[str, list[int]] = {}
        if worker in self.assigned:
            changed.update(self.leave(worker))
        if pinned is not None:
            if not 0 <= pinned < self.num_shards:
                raise ConfigError(f"shard {pinned} is out of range: there are {self.num_shards} shards "
                                  f"(0..{self.num_shards - 1}); pin one of them, or -1 for automatic")
            self.pinned[worker] = pinned
            self.assigned[worker] = [pinned]
            for other, shards in self.assigned.items():  # others may let go of it now
                if other != worker and other not in self.pinned and pinned in shards and len(shards) > 1:
                    shards.remove(pinned)
                    changed[other] = list(shards)
        elif orphans := self.orphans():
            self.assigned[worker] = orphans
        else:
            donors = [w for w, s in self.assigned.items() if w not in self.pinned and len(s) > 1]
            if donors:
                donor = max(donors, key=lambda w: (len(self.assigned[w]), w))
                self.assigned[worker] = [self.assigned[donor].pop()]
                changed[donor] = list(self.assigned[donor])
            else:
                shard = min(range(self.num_shards), key=lambda s: (len(self.holders(s)), s))
                self.assigned[worker] = [shard]
        changed[worker] = list(self.assigned[worker])
        return changed

    def leave(self, worker: str) -> dict[str, list[int]]:
        """Remove ``worker``; its orphaned shards go to the unpinned workers holding the fewest."""
        self.pinned.pop(worker, None)
        shards = self.assigned.pop(worker, [])
        changed: dict[str, list[int]] = {}
        takers = [w for w in self.assigned if w not in self.pinned]
        for shard in shards:
            if self.holders(shard) or not takers:
                continue
            taker = min(takers, key=lambda w: (len(self.assigned[w]), w))
            self.assigned[taker].append(shard)
            self.assigned[taker].sort()
            changed[taker] = list(self.assigned[taker])
        return changed
