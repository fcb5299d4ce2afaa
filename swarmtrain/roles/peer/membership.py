"""Agreeing who is in: one membership *view* per epoch, the same ordered list on every member.

Proposing. The *leader* proposes: the proposer of the current view while it is alive, else
the lowest live member of that view, else (a node in no view yet) the lowest authenticated
peer id it knows. It sends PROPOSE(epoch, members) to every candidate; each answers ACCEPT
(or refuses, with a code); the proposer then sends COMMIT with the members that accepted,
naming a *donor* whose state everyone loads before the first round of the epoch. A member
accepts a proposal only for an epoch above any it has seen, and between two proposals for
the same epoch prefers the lower proposer id, so two would-be proposers cannot both win.

Partitions. Leadership is sticky: a member of a healthy group (its ring works, its leader
answers heartbeats) refuses a proposal from anyone but its leader, unless the proposer's
state carries more training (``work``: samples) — that is how two groups merge, under the
one with more training, and how a peer that was cut off and comes back is kept from
splitting the group it left: it is refused with code ``follows`` naming the leader, and waits
for that leader to take it in.

The right state wins. The donor is a member of the largest group whose state is not left
behind (the last view it trained in, also while it re-forms), then the one whose state
carries the most training (work, then rounds). A group may only *train* if it holds a quorum
of the views its state descends from, so a peer cut off from its group does not train a copy
that diverges (and would later be the one with more rounds). Each node reports two
*anchors*: the view it has installed and the last view it completed a collective in. A new
view needs, for every anchor of the donor's lineage (anchors linked to the donor's through
shared members) that no later *trained* anchor supersedes, a strict majority of that
anchor's members, or exactly half of them including its lowest id (so of two halves exactly
one goes on). Peers that said goodbye (REFORM ``leave``) do not count. A node that cannot
form such a view is *paused*: it keeps its state, trains nothing, and rejoins when the
partition heals. ``quorum="none"`` turns the rule off (any group trains; the one with more
training wins at the merge).

Every PROPOSE/ACCEPT/COMMIT, and REFORM, is signed with its sender's Ed25519 key and carries
that public key; the sender's peer id must be the hash of the key, so no node can speak for
another id. The network is injected (``send``), so this module runs and is tested without
sockets.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from swarmtrain.errors import SwarmError
from swarmtrain.transport.identity import PUBLIC_KEY_BYTES, Identity, peer_id_of, verify
from swarmtrain.wire import Accept, Commit, Message, Propose, Reform, Status

__all__ = ["AcceptCode", "Anchor", "Candidate", "Membership", "QUORUM_RULES", "ReformKind", "View",
           "check_signature", "has_quorum", "plan_view", "signed_bytes"]

log = logging.getLogger("swarmtrain.roles.peer.membership")


@dataclass(frozen=True)
class View:
    """The agreed members of one epoch, in ring order, with their ring addresses."""

    epoch: int
    members: tuple[str, ...]
    addresses: Mapping[str, tuple[str, int]]
    donor: str
    proposer: str = ""

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


@dataclass(frozen=True)
class Anchor:
    """A view a node's state descends from: installed (``trained`` False) or one it completed
    a collective in (``trained`` True). See the module docstring for the quorum rule."""

    epoch: int
    members: frozenset[str]
    trained: bool

    def to_wire(self) -> list[Any]:
        return [self.epoch, sorted(self.members), self.trained]

    @staticmethod
    def from_wire(raw: Any) -> Anchor | None:
        """An anchor from an ACCEPT, or None if it is malformed (ignored: a newer peer's)."""
        if (isinstance(raw, (list, tuple)) and len(raw) == 3 and isinstance(raw[0], int)
                and isinstance(raw[1], (list, tuple)) and all(isinstance(m, str) for m in raw[1])
                and isinstance(raw[2], bool)):
            return Anchor(raw[0], frozenset(raw[1]), raw[2])
        return None


#: ``majority``: a group trains only with a quorum of the views its state descends from (the
#: default); ``none``: any group trains, and the one with more training wins when they merge
QUORUM_RULES = ("majority", "none")


def has_quorum(members: set[str] | frozenset[str], anchor: frozenset[str],
               left: set[str] | frozenset[str] = frozenset()) -> bool:
    """True if ``members`` hold a strict majority of ``anchor`` (less the peers that left), or
    exactly half of it including its lowest id."""
    counted = anchor - left
    if not counted:
        return True
    n = len(counted & members)
    return 2 * n > len(counted) or (2 * n == len(counted) and min(counted) in members)


@dataclass(frozen=True)
class _Standing:
    """What an accepting member (or the proposer) brings to a view."""

    group: int
    work: int
    rounds: int
    anchors: tuple[Anchor, ...]


def _required(donor: str, standing: Mapping[str, _Standing]) -> list[tuple[str, Anchor]]:
    """The anchors (with who reported them) of the donor's lineage that no later trained
    anchor supersedes: those a view with this donor must hold a quorum of."""
    reported = [(who, a) for who, st in standing.items() for a in st.anchors]
    lineage = [(w, a) for w, a in reported if w == donor]
    members = set().union(*(a.members for _, a in lineage)) if lineage else set()
    grew = True
    while grew:  # anchors linked through shared members belong to the same lineage
        grew = False
        for w, a in reported:
            if (w, a) not in lineage and (a.members & members or w == donor):
                lineage.append((w, a))
                members |= a.members
                grew = True
    return [(w, a) for w, a in lineage if not _superseded(a, (b for _, b in lineage))]


def _superseded(a: Anchor, others: Iterable[Anchor]) -> bool:
    """Whether some view of ``others`` trained after ``a`` with some of its members: a state
    from ``a`` was left behind by the ones that went on."""
    return any(b.trained and b.epoch > a.epoch and b.members & a.members for b in others)


def _working_group(who: str, standing: Mapping[str, _Standing]) -> int:
    """The size of the working group whose state ``who`` holds, to rank donors: the last
    view it completed a collective in (its :meth:`Membership.group` while that view's ring
    works, which is that view's size) — also while it re-forms, so a group whose ring broke a
    moment ago still outranks a peer that trained alone — or 0 if another member here has
    since trained in a later view with some of the same members: ``who``'s state was left
    behind (a cut-off minority, a resumed peer), and never outranks the group that went on."""
    st = standing[who]
    last = max((a for a in st.anchors if a.trained), key=lambda a: a.epoch, default=None)
    if last is None:
        return st.group
    if _superseded(last, (b for other in standing.values() for b in other.anchors)):
        return 0
    return max(st.group, len(last.members))


def plan_view(me: str, standing: Mapping[str, _Standing], *, left: set[str] | frozenset[str] = frozenset(),
              current_donor: str = "", quorum: str = "majority") -> tuple[list[str], str] | None:
    """The members and donor of the view to commit from those that accepted (``standing``,
    which includes ``me``), or None if ``me`` cannot be in a view that may train.

    The donor is the member of the largest working group (:func:`_working_group`), then
    with the most work (then rounds, then the current donor, then the lowest id). A
    member whose anchor of the donor's lineage lacks a quorum here is left out (a newer view
    of it may be training elsewhere); if the donor's own anchor does, the donor and its
    lineage are left out and the next best donor is tried.
    """
    chosen = dict(standing)
    while me in chosen:
        group = {p: _working_group(p, chosen) for p in chosen}
        donor = max(chosen, key=lambda p: (group[p], chosen[p].work, chosen[p].rounds,
                                           p == current_donor, -_rank(p), p))
        if quorum == "none":
            return sorted(chosen), donor
        failing = {w for w, a in _required(donor, chosen) if not has_quorum(set(chosen), a.members, left)}
        if not failing:
            return sorted(chosen), donor
        if donor in failing:  # the donor's lineage cannot go on here: drop all of it
            failing |= {w for w, _ in _required(donor, chosen)}
        for w in failing:
            chosen.pop(w, None)
    return None


class ReformKind(enum.StrEnum):
    """What a REFORM says (its ``kind``; a ``str``, so it is signed and sent as its value)."""

    BROKE = "broke"  #: my ring of the epoch broke: abort yours and agree a new epoch
    JOIN = "join"  #: I am back and not in your view: take me in at your next boundary
    LEAVE = "leave"  #: I am shutting down: do not wait for me, do not count me in a quorum


class AcceptCode(enum.StrEnum):
    """Why a member refused a proposal (an ACCEPT's ``code``; empty when it accepted)."""

    ACCEPTED = ""
    BAD_SIGNATURE = "bad_signature"
    NOT_READY = "not_ready"  #: not taking part yet (or leaving)
    NOT_MEMBER = "not_member"  #: the proposal does not name this member
    FOLLOWS = "follows"  #: it follows another leader, named in the answer
    STALE_EPOCH = "stale_epoch"  #: the proposed epoch is not above the member's
    PROMISED = "promised"  #: it already accepted another proposal of that epoch


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
        rounds: how many training rounds this node has completed.
        work: the training behind this node's state (samples): ranks the donor.
        propose_timeout: how long a proposer waits for each ACCEPT.
        quorum: one of :data:`QUORUM_RULES`.
    """

    identity: Identity
    ring_address: tuple[str, int]
    send: Send
    rounds: Callable[[], int] = lambda: 0
    work: Callable[[], int] = lambda: 0
    propose_timeout: float = 3.0
    quorum: str = "majority"
    view: View | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _accepted: tuple[int, str] = (0, "")
    _cooldown: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)
    #: set once this node's training loop can take part in a new epoch right away; until then
    #: proposals are refused and the proposer asks again a little later
    ready: bool = False
    #: the current view's ring works and its leader answers: proposals from others are refused
    #: unless their state carries more training (set by the backend)
    healthy: bool = False
    #: the last view this node completed a collective in (set by :meth:`trained_in`)
    trained: Anchor | None = None
    #: peers that said goodbye: not counted in any quorum (until they accept a view again)
    left: set[str] = field(default_factory=set)
    #: (leader, epoch it leads, its work, until when) learnt from a ``follows`` refusal: a
    #: better group this node waits (for a while) to be taken in by instead of proposing over it
    follow: tuple[str, int, int, float] | None = None
    #: how long a ``follows`` hint holds if its leader does not take this node in
    FOLLOW_SEC: ClassVar[float] = 15.0
    #: why the last proposal committed nothing ("" if it did): shown while paused
    paused_reason: str = ""
    #: suspects: peers this node believes dead (their proposals may be accepted from others)
    suspects: Callable[[], set[str]] = lambda: set()
    #: called (on the event loop) with each newly installed view
    on_install: Callable[[View], None] = lambda view: None

    def __post_init__(self) -> None:
        if self.quorum not in QUORUM_RULES:
            raise ValueError(f"quorum must be one of {', '.join(QUORUM_RULES)}, got {self.quorum!r}")

    @property
    def me(self) -> str:
        return self.identity.peer_id

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view else 0

    def anchors(self) -> list[Anchor]:
        """The views this node's state descends from: the last it trained in and, if newer,
        the one it has installed."""
        out = [self.trained] if self.trained is not None else []
        v = self.view
        if v is not None and (self.trained is None or self.trained.epoch != v.epoch):
            out.append(Anchor(v.epoch, frozenset(v.members), False))
        return out

    def group(self) -> int:
        """The size of the working group this node's state belongs to: its view's, while that
        view's ring works (a collective of it completed here); 0 while it is re-forming or
        paused. The larger working group's state wins a merge, so a peer that trained alone
        while it looked for the others (or a cut-off minority) never overwrites a group's; to
        pick the donor, a member that re-forms counts the group it last trained in
        (:func:`_working_group`), as its state is still that group's."""
        return len(self.view.members) if self.view is not None and self.healthy else 0

    def trained_in(self, epoch: int) -> None:
        """A collective of ``epoch`` completed here: its view is now this node's trained anchor."""
        v = self.view
        if v is None or v.epoch != epoch:
            return
        if self.trained is None or self.trained.epoch != epoch:
            self.trained = Anchor(epoch, frozenset(v.members), True)
        self.healthy = True

    def my_leader(self) -> str:
        """Whom this node follows in its current view: its proposer while not suspected, else
        the lowest member not suspected (possibly this node)."""
        v = self.view
        if v is None:
            return ""
        sus = self.suspects()
        if v.proposer and v.proposer not in sus:
            return v.proposer
        alive = [p for p in v.members if p == self.me or p not in sus]
        return min(alive) if alive else self.me

    # -- acceptor --------------------------------------------------------------------------

    def on_propose(self, msg: Propose) -> Accept:
        """Answer a proposal (called by the control server)."""
        ok, reason, code = True, "", AcceptCode.ACCEPTED
        leader = self.my_leader()
        if not check_signature(msg):
            ok, reason, code = False, "bad signature", AcceptCode.BAD_SIGNATURE
        elif not self.ready:
            ok, reason, code = False, "not ready yet", AcceptCode.NOT_READY
        elif self.me not in msg.members:
            ok, reason, code = False, "not a member of the proposal", AcceptCode.NOT_MEMBER
        elif (self.healthy and self.view is not None and msg.proposer != leader
              and (msg.group, msg.work, -_rank(msg.proposer)) <= (self.group(), self.work(), -_rank(leader))):
            ok, code = False, AcceptCode.FOLLOWS
            reason = f"following {leader[:8]}'s epoch {self.epoch}, whose state carries as much training"
        elif msg.epoch <= self.epoch:
            ok, code = False, AcceptCode.STALE_EPOCH
            reason = f"epoch {msg.epoch} is not above the current {self.epoch}"
        elif msg.epoch < self._accepted[0] or (
            msg.epoch == self._accepted[0] and msg.proposer > self._accepted[1]
        ):
            ok, code = False, AcceptCode.PROMISED
            reason = f"epoch {msg.epoch}: already accepted {self._accepted[1][:8]}'s"
        if ok:
            self._accepted = (msg.epoch, msg.proposer)
            self.left.discard(msg.proposer)
        return _sign(self.identity, Accept(
            epoch=msg.epoch, peer_id=self.me, ok=ok, rounds=self.rounds(), reason=reason,
            work=self.work(), group=self.group(), anchors=[a.to_wire() for a in self.anchors()], code=code,
            leader=leader if code is AcceptCode.FOLLOWS else "", seen=max(self.epoch, self._accepted[0])))

    def on_commit(self, msg: Commit) -> bool:
        """Install a committed view if it is newer and names us (called by the control server)."""
        if not check_signature(msg) or self.me not in msg.members or msg.epoch <= self.epoch:
            return False
        if (msg.epoch, msg.proposer) != self._accepted:
            return False  # we promised this epoch to another proposer
        self._install(View(msg.epoch, tuple(msg.members),
                           {k: (str(v[0]), int(v[1])) for k, v in msg.addresses.items()}, msg.donor,
                           msg.proposer))
        return True

    def on_leave(self, peer_id: str) -> None:
        """``peer_id`` said goodbye: it no longer counts in any quorum."""
        self.left.add(peer_id)
        if self.view is not None and peer_id in self.view.members:
            self.healthy = False

    def _install(self, view: View) -> None:
        self.view = view
        self.healthy = False  # until a collective of this epoch completes
        self.follow = None
        self.paused_reason = ""
        self.left -= set(view.members)
        self.on_install(view)
        log.info("epoch %d: %d member(s), rank %d, donor %s", view.epoch, view.world_size,
                 view.rank(self.me), view.donor[:8])
        self.changed.set()

    # -- proposer --------------------------------------------------------------------------

    def leader(self, candidates: Mapping[str, Candidate], suspects: frozenset[str] | set[str] = frozenset()
               ) -> str:
        """Who should propose next, as this node sees it: the leader of a better group it
        was told to follow, else its view's leader (:meth:`my_leader`), else (no view yet) the
        lowest id among itself and the authenticated ``candidates``."""
        f = self.follow
        if f is not None and f[0] in candidates and f[0] not in suspects and f[3] > time.monotonic():
            return f[0]
        if self.view is not None:
            return self.my_leader()
        return min({self.me} | {p for p in candidates if p not in suspects})

    def wanted(self, candidates: Mapping[str, Candidate]) -> set[str]:
        """Who should be in the view: me and every candidate not cooling down after failing."""
        now = time.monotonic()
        return {self.me} | {p for p in candidates if self._cooldown.get(p, 0.0) <= now}

    def needs_new_view(self, candidates: Mapping[str, Candidate]) -> bool:
        return self.view is None or set(self.view.members) != self.wanted(candidates)

    def forgive(self, peer_id: str) -> None:
        """``peer_id`` answered again: ask it at the next proposal, without waiting out a pause."""
        self._cooldown.pop(peer_id, None)
        self._failures.pop(peer_id, None)

    async def propose(self, candidates: Mapping[str, Candidate], *, known_epoch: int = 0,
                      min_members: int = 1, renew: bool = False) -> View | None:
        """Propose and commit a view of me and every wanted candidate that accepts.

        Args:
            renew: commit a new epoch even if the members are the current ones (the current
                epoch's ring broke and cannot be used again).

        Returns:
            The new view, the current one if nobody new could join (and not ``renew``), or
            None if nothing was committed: fewer than ``min_members`` accepted, a better
            group's leader was named (:attr:`follow`), or no view with these members may
            train (:attr:`paused_reason` says why); ask again later.

        Raises:
            SwarmError: after several rounds of refusals (another proposer keeps winning).
        """
        epoch = max(self.epoch, self._accepted[0], known_epoch) + 1
        for attempt in range(5):
            wanted = sorted(self.wanted(candidates))
            asked = [candidates[p] for p in wanted if p != self.me]
            addresses: dict[str, list[Any]] = {
                p: [candidates[p].host, candidates[p].ring_port] for p in wanted if p != self.me}
            addresses[self.me] = list(self.ring_address)
            prop = _sign(self.identity, Propose(epoch=epoch, proposer=self.me, members=wanted,
                                                addresses=addresses, work=self.work(), group=self.group()))
            self._accepted = (epoch, self.me)
            answers = await asyncio.gather(*(self.send(c, prop, self.propose_timeout) for c in asked))
            standing = {self.me: _Standing(self.group(), self.work(), self.rounds(), tuple(self.anchors()))}
            seen, follow = 0, None
            best: tuple[int, int, int] = (-1, 0, 0)
            for c, ans in zip(asked, answers):
                good = isinstance(ans, Accept) and ans.peer_id == c.peer_id and check_signature(ans)
                if good and ans.ok:  # type: ignore[union-attr]
                    assert isinstance(ans, Accept)
                    anchors = tuple(a for a in map(Anchor.from_wire, ans.anchors) if a is not None)
                    standing[c.peer_id] = _Standing(ans.group, ans.work, ans.rounds, anchors)
                    self.forgive(c.peer_id)
                    self.left.discard(c.peer_id)
                    continue
                if good and ans.code in (AcceptCode.STALE_EPOCH, AcceptCode.PROMISED):  # type: ignore[union-attr]
                    seen = max(seen, ans.seen)  # type: ignore[union-attr]
                    continue
                if good and ans.code == AcceptCode.FOLLOWS:  # type: ignore[union-attr]
                    assert isinstance(ans, Accept)
                    if (ans.group, ans.work, -_rank(ans.leader)) > best:
                        best = (ans.group, ans.work, -_rank(ans.leader))
                        follow = (ans.leader, ans.seen, ans.work, time.monotonic() + self.FOLLOW_SEC)
                    continue
                if good and ans.code == AcceptCode.NOT_READY:  # type: ignore[union-attr]
                    self._cooldown[c.peer_id] = time.monotonic() + 1.0  # it is starting: soon
                    continue
                # left out; asked again after a short pause (1, 2, 4, 8 s); the backend's
                # probes forgive a peer as soon as it answers again
                self._failures[c.peer_id] = self._failures.get(c.peer_id, 0) + 1
                pause = min(8.0, 2.0 ** (self._failures[c.peer_id] - 1))
                self._cooldown[c.peer_id] = time.monotonic() + pause
                log.info("peer %s did not accept epoch %d (%s)", c.peer_id[:8], epoch,
                         "no answer" if ans is None else getattr(ans, "reason", ans.TYPE.name))
            if follow is not None and follow[0] != self.me:
                self._accepted = (self.epoch, "")  # nothing committed: release our promise
                self.follow = follow
                self.paused_reason = (f"peer {follow[0][:8]} leads a group whose state carries more "
                                      "training; waiting to be taken in")
                log.info("epoch %d not proposed: %s", epoch, self.paused_reason)
                return None
            if seen >= epoch and len(standing) < len(wanted):
                epoch = seen + 1  # someone saw a later epoch: ask again above it
                continue
            plan = plan_view(self.me, standing, left=self.left, current_donor=self.epoch_donor(),
                             quorum=self.quorum)
            if plan is None or len(plan[0]) < min_members:
                self._accepted = (self.epoch, "")  # release our own promise; nothing was committed
                if plan is None:
                    self.paused_reason = self._why_paused(standing)
                return None
            members, donor = plan
            if not renew and self.view is not None and tuple(members) == self.view.members:
                return self.view  # nobody new could join: keep the epoch (no state sync needed)
            commit = _sign(self.identity, Commit(
                epoch=epoch, proposer=self.me, members=members,
                addresses={p: addresses[p] for p in members}, donor=donor))
            others = [p for p in members if p != self.me]
            acks = await asyncio.gather(*(self.send(candidates[p], commit, self.propose_timeout)
                                          for p in others))
            missing = [p for p, a in zip(others, acks)
                       if not (isinstance(a, Status) and a.status.get("installed") is True)]
            if missing and attempt < 4:
                # a member accepted and then did not install (gone, or promised elsewhere):
                # its ring would never form; supersede this epoch at once without it
                for p in missing:
                    self._cooldown[p] = time.monotonic() + 2.0
                log.info("epoch %d: %d member(s) did not install it; proposing again without them",
                         epoch, len(missing))
                epoch += 1
                continue
            self._install(View(epoch, tuple(members),
                               {p: (str(addresses[p][0]), int(addresses[p][1])) for p in members}, donor,
                               self.me))
            assert self.view is not None
            return self.view
        raise SwarmError(f"could not agree on epoch {epoch}: other proposers keep winning")

    def _why_paused(self, standing: Mapping[str, _Standing]) -> str:
        need = [a for _, a in _required(self.me, standing)
                if not has_quorum(set(standing), a.members, self.left)]
        if not need:
            return "no group that may train can be formed with the peers that answered"
        a = max(need, key=lambda a: a.epoch)
        counted = a.members - self.left
        return (f"reaching {len(counted & set(standing))} of the {len(counted)} members of epoch {a.epoch}, "
                f"whose state this peer holds; a majority ({len(counted) // 2 + 1}) is needed to train "
                "(the rest may be training without us); waiting for the partition to heal")

    def reform_request(self, epoch: int, kind: ReformKind = ReformKind.BROKE) -> Reform:
        """A signed REFORM: this node's ring of ``epoch`` broke, or it is back (``join``) or
        leaving (``leave``)."""
        return _sign(self.identity, Reform(epoch=epoch, peer_id=self.me, kind=kind))

    def epoch_donor(self) -> str:
        return self.view.donor if self.view else ""


def _rank(peer_id: str) -> int:
    """Orders peer ids (hex) as numbers; ties go to the lower id."""
    try:
        return int(peer_id, 16)
    except ValueError:
        return 1 << 512
