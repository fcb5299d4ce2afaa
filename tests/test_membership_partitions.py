"""The membership rules through partitions, without a network: quorums of the views a state
descends from, a paused minority, sticky leaders, merges under the larger working group."""

from __future__ import annotations

import asyncio

from swarmtrain.roles.peer.membership import (
    Anchor,
    Candidate,
    Membership,
    _Standing,
    has_quorum,
    plan_view,
)
from swarmtrain.transport.identity import Identity
from swarmtrain.wire import Commit, Message, Propose, Status


class Net:
    """Nodes that reach each other unless a split says otherwise."""

    def __init__(self, n: int) -> None:
        ids = sorted((Identity.generate() for _ in range(n)), key=lambda i: i.peer_id)
        self.nodes: list[Membership] = []
        self.groups: list[set[str]] | None = None
        for i, ident in enumerate(ids):
            self.nodes.append(Membership(ident, ring_address=("10.0.0.1", 9000 + i),
                                         send=self._sender(ident.peer_id), propose_timeout=0.1, ready=True))
        self.by_id = {n.me: n for n in self.nodes}

    def _sender(self, me: str):  # type: ignore[no-untyped-def]
        async def send(c: Candidate, msg: Message, timeout: float) -> Message | None:
            if not self.reach(me, c.peer_id):
                return None
            node = self.by_id[c.peer_id]
            if isinstance(msg, Propose):
                return node.on_propose(msg)
            if isinstance(msg, Commit):
                return Status(status={"installed": node.on_commit(msg)})
            return None
        return send

    def reach(self, a: str, b: str) -> bool:
        return self.groups is None or any(a in g and b in g for g in self.groups)

    def split(self, *groups: list[Membership]) -> None:
        self.groups = [{n.me for n in g} for g in groups]

    def cands(self, me: Membership) -> dict[str, Candidate]:
        return {n.me: Candidate(n.me, "10.0.0.1", 7200, n.ring_address[1]) for n in self.nodes
                if n is not me and self.reach(me.me, n.me)}

    def propose(self, me: Membership, **kw: object) -> object:
        return asyncio.run(me.propose(self.cands(me), **kw))  # type: ignore[arg-type]

    def train(self, members: list[Membership], samples: int) -> None:
        """A round completes on every member of their (shared) view."""
        for n in members:
            assert n.view is not None
            n.trained_in(n.view.epoch)
            w = n.work() + samples
            n.work = lambda w=w: w  # type: ignore[misc]


def test_quorum_is_a_strict_majority_or_the_half_with_the_lowest_id() -> None:
    group = frozenset("abcd")
    assert has_quorum({"a", "b", "c"}, group) and has_quorum({"b", "c", "d"}, group)
    assert has_quorum({"a", "d"}, group) and not has_quorum({"b", "c"}, group)
    assert not has_quorum({"a"}, group)
    assert has_quorum({"a"}, group, left={"b", "c", "d"})  # those that said goodbye do not count
    assert has_quorum({"x"}, frozenset())  # a newcomer answers to nobody


def test_a_cut_off_leader_pauses_and_the_rest_go_on_and_win_the_merge() -> None:
    net = Net(4)
    a, b, c, d = net.nodes
    view = net.propose(a)
    assert view is not None
    net.train(net.nodes, 100)
    net.split([a], [b, c, d])
    for n in net.nodes:
        n.healthy = False  # everyone's ring broke
    assert net.propose(a, renew=True, known_epoch=1) is None  # 1 of 4: it may not train
    assert "1 of the 4" in a.paused_reason
    b.suspects = lambda: {a.me}  # type: ignore[method-assign]
    c.suspects = d.suspects = b.suspects  # type: ignore[method-assign]
    assert b.leader(net.cands(b), {a.me}) == b.me  # the lowest live member takes over
    three = net.propose(b, renew=True, known_epoch=1)
    assert three is not None and set(three.members) == {b.me, c.me, d.me}  # type: ignore[attr-defined]
    net.train([b, c, d], 96)
    net.groups = None  # healed: a proposes again, and is told whom to follow
    a.suspects = lambda: set()  # type: ignore[method-assign]
    assert net.propose(a, renew=True, known_epoch=1) is None
    assert a.follow is not None and a.follow[0] == b.me and a.leader(net.cands(a)) == b.me
    four = net.propose(b)
    assert four is not None and four.world_size == 4  # type: ignore[attr-defined]
    assert four.donor in (b.me, c.me, d.me)  # type: ignore[attr-defined]
    assert all(n.view == four for n in net.nodes)


def test_a_two_two_split_lets_exactly_the_half_with_the_lowest_id_train() -> None:
    net = Net(4)
    a, b, c, d = net.nodes
    net.propose(a)
    net.train(net.nodes, 10)
    net.split([a, b], [c, d])
    for n in net.nodes:
        n.healthy = False
    c.suspects = d.suspects = lambda: {a.me, b.me}  # type: ignore[method-assign]
    assert net.propose(c, renew=True, known_epoch=1) is None  # half, without the lowest id
    assert d.view is not None and d.view.epoch == 1
    half = net.propose(a, renew=True, known_epoch=1)
    assert half is not None and set(half.members) == {a.me, b.me}  # type: ignore[attr-defined]


def test_a_view_installed_but_not_trained_in_still_binds_its_members() -> None:
    # a and b installed {a, b} (epoch 6), a completed its first collective, b did not, then
    # a was cut off: b's installed anchor keeps {b, c, d} from training (a may be, alone)
    four = Anchor(5, frozenset("abcd"), True)
    pair = Anchor(6, frozenset("ab"), False)
    standing = {"b": _Standing(0, 50, 5, (four, pair)), "c": _Standing(0, 50, 5, (four,)),
                "d": _Standing(0, 50, 5, (four,))}
    assert plan_view("c", standing) is None
    assert plan_view("a", {"a": _Standing(0, 52, 6, (Anchor(6, frozenset("ab"), True),))}) is not None
    # a commit lost on b: a installed {a, b} but never trained in it, so a alone may not train
    lost = {"a": _Standing(0, 50, 5, (four, Anchor(6, frozenset("ab"), False)))}
    assert plan_view("a", lost) is None
    assert plan_view("b", {p: _Standing(0, 50, 5, (four,)) for p in "bcd"}) is not None
    # quorum "none": any group trains
    assert plan_view("c", standing, quorum="none") is not None


def test_a_stale_peer_whose_old_group_has_moved_on_joins_without_blocking_it() -> None:
    old = Anchor(5, frozenset("0abc"), True)  # its group; "0" is gone for good
    moved = Anchor(9, frozenset("bef"), True)  # b went on with e and f
    standing = {"a": _Standing(0, 10, 5, (old,)), "b": _Standing(3, 90, 9, (moved,)),
                "e": _Standing(3, 90, 9, (moved,)), "f": _Standing(3, 90, 9, (moved,))}
    plan = plan_view("b", standing)
    assert plan is not None and plan[0] == ["a", "b", "e", "f"] and plan[1] in "bef"


def test_a_healthy_group_refuses_a_smaller_one_and_is_joined_by_it() -> None:
    net = Net(4)
    j, a, b, c = net.nodes  # j has the lowest id
    net.split([j], [a, b, c])
    assert net.propose(j) is not None  # alone, as a newcomer may train
    net.train([j], 10_000)  # fast, alone: more samples than the group
    assert net.propose(a) is not None
    net.train([a, b, c], 960)
    net.groups = None
    assert net.propose(j) is None  # the group (3 working) refuses it: follows a
    assert j.follow is not None and j.follow[0] == a.me
    merged = net.propose(a)
    assert merged is not None and merged.world_size == 4  # type: ignore[attr-defined]
    assert merged.donor in (a.me, b.me, c.me)  # type: ignore[attr-defined]


def test_a_group_re_forming_keeps_its_state_when_a_peer_alone_proposes() -> None:
    # the late joiner of test_peer_lan.py: it formed a view alone (min-peers 1) and proposes
    # to merge while the group's members re-form (a ring broke: a member slow under load, or
    # an epoch of the group's own leader that the joiner did not install), so they accept it;
    # the group's state, not the joiner's round 0, is the one the merged view starts from
    net = Net(4)
    j, a, b, c = net.nodes
    net.split([j], [a, b, c])
    assert net.propose(a) is not None
    net.train([a, b, c], 10 * 3 * 5 * 32)
    assert net.propose(j) is not None
    net.train([j], 0)  # its first state sync completed; no round yet
    net.groups = None
    for n in (a, b, c):
        n.healthy = False
    merged = net.propose(j)
    assert merged is not None and merged.world_size == 4  # type: ignore[attr-defined]
    assert merged.donor in (a.me, b.me, c.me)  # type: ignore[attr-defined]
    # but a copy the group has trained past counts for nothing while the group re-forms: a
    # completed round 5 of four (work 400 + 100) as the ring broke, b, c and d redid it
    # without a (400 + 75) in epoch 2; a's copy, with more work, descends from epoch 1
    four, three = Anchor(1, frozenset("abcd"), True), Anchor(2, frozenset("bcd"), True)
    standing = {"a": _Standing(0, 500, 5, (four,)), **{p: _Standing(0, 475, 5, (three,)) for p in "bcd"}}
    plan = plan_view("a", standing)
    assert plan is not None and plan[1] in "bcd"
