"""Parameter shards: which server of a sharded parameter-server cluster holds which tensors.

A cluster of S coordinator processes ("servers") splits the model's trainable parameters
into S groups, one per server; server ``i`` keeps master weights, Adam state, a version
counter and a downlink log for its group alone. (These are *parameter* shards; the *data*
shards a worker trains on are :mod:`swarmtrain.roles.ps.shards`, a different thing.)

Every process computes the partition itself from the model, with no message: the function is
pure and deterministic (the same names, sizes and S give the same groups on every machine),
and its :attr:`Partition.fingerprint` travels in the handshake so that two processes that
disagree (another model, another S, another swarmtrain) are refused with a clear error instead
of training mismatched slices.

Groups hold whole tensors, balanced by bytes: largest tensor first onto the lightest group
(ties to the lower index). A tensor larger than ``total / S`` is not split into row ranges; its
group is then heavier than the others (the benchmark's 10M-parameter model has no such tensor;
:attr:`Partition.imbalance` says how far off a partition is). Buffers (BatchNorm statistics)
and frozen parameters belong to group 0, the leader's: they are small and the leader is the one
server that always holds a whole model's worth of non-trainable state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from swarmtrain.errors import ConfigError

__all__ = ["Partition", "ServerSpec", "group_module", "parse_server_spec", "partition_parameters",
           "partition_model"]


@dataclass(frozen=True)
class Partition:
    """The parameter groups of an S-server cluster.

    Attributes:
        count: S, the number of servers.
        groups: the parameter names of each group, in the model's parameter order.
        group_bytes: the bytes of each group's tensors.
        fingerprint: a short hash of everything above and the tensors' sizes: equal on two
            processes exactly when they computed the same partition.
    """

    count: int
    groups: tuple[tuple[str, ...], ...]
    group_bytes: tuple[int, ...]
    fingerprint: str

    def group_of(self, name: str) -> int:
        """The index of the group holding parameter ``name``."""
        for i, names in enumerate(self.groups):
            if name in names:
                return i
        raise KeyError(name)

    @property
    def imbalance(self) -> float:
        """The heaviest group's bytes over the mean (1.0 = perfectly balanced)."""
        total = sum(self.group_bytes)
        return max(self.group_bytes) * self.count / total if total else 1.0


def partition_parameters(params: Sequence[tuple[str, int]], count: int) -> Partition:
    """Split ``params`` (``(name, bytes)`` in the model's order) into ``count`` groups.

    Largest first onto the group with the fewest bytes so far (ties: the lower group index,
    then the earlier parameter), so the result depends on nothing but the arguments.

    Raises:
        ConfigError: ``count`` < 1, more groups than parameters, or a repeated name.
    """
    if count < 1:
        raise ConfigError(f"a cluster needs at least 1 parameter server, got {count}")
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        raise ConfigError("parameter names repeat: the partition needs each name once")
    if count > len(params):
        raise ConfigError(f"{count} parameter servers for a model of {len(params)} trainable tensors: "
                          f"each server needs at least one tensor; use at most {len(params)} servers")
    order = sorted(range(len(params)), key=lambda i: (-params[i][1], i))
    loads = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        target = min(range(count), key=lambda g: (loads[g], g))
        loads[target] += params[i][1]
        members[target].append(i)
    groups = tuple(tuple(params[i][0] for i in sorted(m)) for m in members)
    digest = hashlib.sha256(json.dumps(
        {"count": count, "params": [[n, b] for n, b in params], "groups": groups},
        separators=(",", ":")).encode()).hexdigest()[:16]
    return Partition(count=count, groups=groups, group_bytes=tuple(loads), fingerprint=digest)


def partition_model(model: nn.Module, count: int) -> Partition:
    """The partition of ``model``'s trainable parameters over ``count`` servers."""
    return partition_parameters(
        [(n, p.numel() * p.element_size()) for n, p in model.named_parameters() if p.requires_grad],
        count)


def group_module(model: nn.Module, names: Iterable[str], *, with_rest: bool) -> nn.Module:
    """A module holding ``model``'s parameters ``names`` (the same tensor objects, under the
    same dotted names), and with ``with_rest`` also its frozen parameters and persistent
    buffers: the part of the model one server holds, and the view of it a worker's replica
    has. The module is a container only (it has no ``forward``)."""
    root = nn.Module()
    wanted = set(names)
    persistent = set(model.state_dict(keep_vars=True))

    def place(dotted: str) -> tuple[nn.Module, str]:
        *path, leaf = dotted.split(".")
        node = root
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        return node, leaf

    for name, p in model.named_parameters():
        if name in wanted or (with_rest and not p.requires_grad):
            node, leaf = place(name)
            node.register_parameter(leaf, p)
    if with_rest:
        for name, b in model.named_buffers():
            if name in persistent:
                node, leaf = place(name)
                node.register_buffer(leaf, b)
    return root


@dataclass(frozen=True)
class ServerSpec:
    """Which server of the cluster this process is: ``index`` of ``count`` (``--shard i/S``)."""

    index: int
    count: int

    @property
    def leader(self) -> bool:
        """Server 0 leads: data-shard assignment, the run's length, evaluation, the status."""
        return self.index == 0

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_server_spec(text: str, servers: Sequence[str] = ()) -> ServerSpec:
    """``"i/S"`` (or ``""``: a single server, or S from ``servers`` with i given alone as ``"i"``).

    Raises:
        ConfigError: not ``i/S`` with 0 <= i < S, or S differs from ``len(servers)``.
    """
    text = text.strip()
    if not text:
        return ServerSpec(0, max(1, len(servers)))
    head, sep, tail = text.partition("/")
    try:
        index = int(head)
        count = int(tail) if sep else len(servers)
    except ValueError:
        raise ConfigError(f"cluster.shard {text!r}: expected i/S, e.g. 0/2 for the first of two "
                          "parameter servers") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"cluster.shard {text!r}: expected i/S with 0 <= i < S (e.g. 1/2)")
    if servers and len(servers) != count:
        raise ConfigError(f"cluster.shard {text!r} says {count} servers, cluster.servers lists "
                          f"{len(servers)}: list every server once, in index order")
    return ServerSpec(index, count)

