"""Agreeing who is in: one membership *view* per epoch, the same ordered list on every member.

The proposer is the lowest peer id a node believes alive. It sends PROPOSE(epoch, members)
to every candidate; each answers ACCEPT (or refuses); the proposer then sends COMMIT with
exactly the members that accepted, naming a *donor* (the member with the most completed
rounds) whose state everyone loads before the first round of the epoch. A member accepts a
proposal only for an epoch above any it has seen, and between two proposals for the same
epoch prefers the lower proposer id, so two would-be proposers cannot both win.

Every PROPOSE/ACCEPT/COMMIT, and REFORM (a member's "my ring broke"), is signed with its
sender's Ed25519 key and carries that public key; the sender's peer id must be the hash of
the key, so no node can speak for another id.
The network is injected (``send``), so this module runs and is tested without sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarmtrain.errors import SwarmError
from swarmtrain.peer.identity import PUBLIC_KEY_BYTES, Identity, peer_id_of, verify
from swarmtrain.wire import Accept, Commit, Message, Propose, Reform

__all__ = ["View", "Membership", "Candidate", "signed_bytes", "check_signature"]

log = logging.getLogger("swarmtrain.peer.membership")


@dataclass(frozen=True)
class View:
    """The agreed members of one epoch, in ring order, with their ring addresses."""

    epoch: int
    members: tuple[str, ...]
    addresses: Mapping[str, tuple[str, int]]
    donor: str

    def rank(self, peer_id: str) -> int:
        return self.members.index(peer_id)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def ring_addresses(self) -> list[tuple[str, int]]:
        return [tuple(self.addresses[m]) for m in self.members]  # type: ignore[misc]


@dataclass(frozen=True)
class Candidate:
    """A peer that may be asked to join: where its control and ring ports are."""

    peer_id: str
    host: str
    port: int
    ring_port: int


def signed_bytes(msg: Message) -> bytes:
    """The canonical bytes a membership message's signature covers (all but the signature)."""
    fields = {k: v for k, v in msg.fields().items() if k != "signature"}
    return msgpack.packb([msg.TYPE.name, sorted(fields.items())], use_bin_type=True)


def check_signature(msg: Propose | Accept | Commit | Reform) -> bool:
    """True if ``msg`` is signed by the key whose hash is its sender's peer id."""
    who = msg.peer_id if isinstance(msg, (Accept, Reform)) else msg.proposer
    if not isinstance(msg.public_key, bytes) or len(msg.public_key) != PUBLIC_KEY_BYTES:
        # not a key at all: no signature can be good
        return False
    return peer_id_of(msg.public_key) == who and verify(msg.public_key, signed_bytes(msg), msg.signature)


def _sign(identity: Identity, msg: Any) -> Any:
    import dataclasses

    msg = dataclasses.replace(msg, public_key=identity.public_key)
    return dataclasses.replace(msg, signature=identity.sign(signed_bytes(msg)))


Send = Callable[[Candidate, Message, float], Awaitable[Message | None]]


@dataclass
class Membership:
    """The membership state of one node.

    Args:
        identity: this node's key pair.
        ring_address: where this node's ring listener accepts connections.
        send: ``await send(candidate, message, timeout)`` returns the answer or None (no answer).
        rounds: how many training rounds this node has completed (picks the donor).
        propose_timeout: how long a proposer waits for each ACCEPT.
    """

    identity: Identity
    ring_address: tuple[str, int]
    send: Send
    rounds: Callable[[], int] = lambda: 0
    propose_timeout: float = 3.0
    view: View | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _accepted: tuple[int, str] = (0, "")
    _cooldown: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)
    #: set once this node's training loop can take part in a new epoch right away; until then
    #: proposals are refused and the proposer asks again a little later
    ready: bool = False
    #: called (on the event loop) with each newly installed view
    on_install: Callable[[View], None] = lambda view: None

    @property
    def me(self) -> str:
        return self.identity.peer_id

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view else 0

    # -- acceptor --------------------------------------------------------------------------

    def on_propose(self, msg: Propose) -> Accept:
        """Answer a proposal (called by the control server)."""
        ok, reason = True, ""
        if not check_signature(msg):
            ok, reason = False, "bad signature"
        elif not self.ready:
            ok, reason = False, "not ready yet"
        elif self.me not in msg.members:
            ok, reason = False, "not a member of the proposal"
        elif msg.epoch <= self.epoch:
            ok, reason = False, f"epoch {msg.epoch} is not above the current {self.epoch}"
        elif msg.epoch < self._accepted[0] or (
            msg.epoch == self._accepted[0] and msg.proposer > self._accepted[1]
        ):
            ok, reason = False, f"epoch {msg.epoch}: already accepted {self._accepted[1][:8]}'s"
        if ok:
            self._accepted = (msg.epoch, msg.proposer)
        return _sign(self.identity, Accept(epoch=msg.epoch, peer_id=self.me, ok=ok,
                                           rounds=self.rounds(), reason=reason))

    def on_commit(self, msg: Commit) -> bool:
        """Install a committed view if it is newer and names us (called by the control server)."""
        if not check_signature(msg) or self.me not in msg.members or msg.epoch <= self.epoch:
            return False
        if (msg.epoch, msg.proposer) != self._accepted:
            return False  # we promised this epoch to another proposer
        self._install(View(msg.epoch, tuple(msg.members),
                           {k: (str(v[0]), int(v[1])) for k, v in msg.addresses.items()}, msg.donor))
        return True

    def _install(self, view: View) -> None:
        self.view = view
        self.on_install(view)
        log.info("epoch %d: %d member(s), rank %d, donor %s", view.epoch, view.world_size,
                 view.rank(self.me), view.donor[:8])
        self.changed.set()

    # -- proposer --------------------------------------------------------------------------

    def leader(self, candidates: Mapping[str, Candidate], suspects: frozenset[str] | set[str] = frozenset()
               ) -> str:
        """The lowest peer id believed alive proposes. The current view's members count even
        before discovery has shown them to us, so a newcomer does not propose over them."""
        members = set(self.view.members) if self.view else set()
        return min({self.me} | {p for p in set(candidates) | members if p not in suspects})

    def wanted(self, candidates: Mapping[str, Candidate]) -> set[str]:
        """Who should be in the view: me and every candidate not cooling down after failing."""
        now = time.monotonic()
        return {self.me} | {p for p in candidates if self._cooldown.get(p, 0.0) <= now}

    def needs_new_view(self, candidates: Mapping[str, Candidate]) -> bool:
        return self.view is None or set(self.view.members) != self.wanted(candidates)

    async def propose(self, candidates: Mapping[str, Candidate], *, known_epoch: int = 0,
                      min_members: int = 1, renew: bool = False) -> View | None:
        """Propose and commit a view of me and every wanted candidate that accepts.

        Args:
            renew: commit a new epoch even if the members are the current ones (the current
                epoch's ring broke and cannot be used again).

        Returns:
            The new view, the current one if nobody new could join (and not ``renew``), or
            None if fewer than ``min_members`` accepted (nothing is committed; ask again later).

        Raises:
            SwarmError: after several rounds of refusals (another proposer keeps winning).
        """
        epoch = max(self.epoch, self._accepted[0], known_epoch) + 1
        for _ in range(5):
            wanted = sorted(self.wanted(candidates))
            asked = [candidates[p] for p in wanted if p != self.me]
            addresses: dict[str, list[Any]] = {
                p: [candidates[p].host, candidates[p].ring_port] for p in wanted if p != self.me}
            addresses[self.me] = list(self.ring_address)
            prop = _sign(self.identity, Propose(epoch=epoch, proposer=self.me, members=wanted,
                                                addresses=addresses))
            self._accepted = (epoch, self.me)
            answers = await asyncio.gather(*(self.send(c, prop, self.propose_timeout) for c in asked))
            accepted, rounds, higher = [self.me], {self.me: self.rounds()}, 0
            for c, ans in zip(asked, answers):
                if isinstance(ans, Accept) and ans.peer_id == c.peer_id and check_signature(ans) and ans.ok:
                    accepted.append(c.peer_id)
                    rounds[c.peer_id] = ans.rounds
                    self._cooldown.pop(c.peer_id, None)
                    self._failures.pop(c.peer_id, None)
                elif isinstance(ans, Accept) and check_signature(ans) and "epoch" in ans.reason:
                    higher += 1
                elif isinstance(ans, Accept) and ans.reason == "not ready yet":
                    self._cooldown[c.peer_id] = time.monotonic() + 1.0  # it is starting: soon
                else:  # left out; asked again after a growing pause (5 s, 10 s, ... 5 min)
                    self._failures[c.peer_id] = self._failures.get(c.peer_id, 0) + 1
                    backoff = min(300.0, 5.0 * 2 ** (self._failures[c.peer_id] - 1))
                    self._cooldown[c.peer_id] = time.monotonic() + backoff
                    log.info("peer %s did not accept epoch %d (%s)", c.peer_id[:8], epoch,
                             "no answer" if ans is None else getattr(ans, "reason", ans.TYPE.name))
            if higher and len(accepted) < len(wanted):
                epoch += 5  # someone saw a later epoch: jump past it and ask again
                continue
            members = sorted(accepted)
            if len(members) < min_members:
                self._accepted = (epoch, "")  # release our own promise; nothing was committed
                return None
            if not renew and self.view is not None and tuple(members) == self.view.members:
                return self.view  # nobody new could join: keep the epoch (no state sync needed)
            donor = max(members, key=lambda p: (rounds[p], p == self.epoch_donor(), -int(p, 16)))
            commit = _sign(self.identity, Commit(
                epoch=epoch, proposer=self.me, members=members,
                addresses={p: addresses[p] for p in members}, donor=donor))
            await asyncio.gather(*(self.send(candidates[p], commit, self.propose_timeout)
                                   for p in members if p != self.me))
            self._install(View(epoch, tuple(members),
                               {p: (str(addresses[p][0]), int(addresses[p][1])) for p in members}, donor))
            assert self.view is not None
            return self.view
        raise SwarmError(f"could not agree on epoch {epoch}: other proposers keep winning")

    def reform_request(self, epoch: int) -> Reform:
        """A signed REFORM: this node's ring of ``epoch`` broke (sent to the proposer)."""
        return _sign(self.identity, Reform(epoch=epoch, peer_id=self.me))

    def epoch_donor(self) -> str:
        return self.view.donor if self.view else ""
