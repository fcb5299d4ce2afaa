"""Membership epochs without a network: proposals, acceptance rules, signatures, donors."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from swarmtrain.roles.peer.membership import Candidate, Membership, check_signature
from swarmtrain.transport.identity import Identity
from swarmtrain.wire import Commit, Message, Propose, Reform, Status


def make_nodes(n: int) -> tuple[list[Membership], dict[str, Membership], set[str]]:
    ids = sorted((Identity.generate() for _ in range(n)), key=lambda i: i.peer_id)
    nodes: dict[str, Membership] = {}
    dead: set[str] = set()

    async def send(c: Candidate, msg: Message, timeout: float) -> Message | None:
        if c.peer_id in dead:
            return None
        node = nodes[c.peer_id]
        if isinstance(msg, Propose):
            return node.on_propose(msg)
        if isinstance(msg, Commit):
            return Status(status={"installed": node.on_commit(msg)})
        return None

    for i, ident in enumerate(ids):
        nodes[ident.peer_id] = Membership(ident, ring_address=("10.0.0.1", 9000 + i), send=send,
                                          propose_timeout=0.1, ready=True)
    return list(nodes.values()), nodes, dead


def cands(nodes: list[Membership], me: Membership) -> dict[str, Candidate]:
    return {n.me: Candidate(n.me, "10.0.0.1", 7200, n.ring_address[1]) for n in nodes if n is not me}


def test_the_lowest_id_proposes_and_everyone_installs_the_same_view() -> None:
    nodes, _, _ = make_nodes(4)
    leader = nodes[0]
    assert leader.leader(cands(nodes, leader)) == leader.me
    view = asyncio.run(leader.propose(cands(nodes, leader)))
    assert view.members == tuple(sorted(n.me for n in nodes))
    assert all(n.view == view for n in nodes)
    assert [view.rank(n.me) for n in nodes] == [0, 1, 2, 3]
    assert view.addresses[nodes[2].me] == ("10.0.0.1", 9002)


def test_a_dead_candidate_is_left_out_and_cools_down() -> None:
    nodes, _, dead = make_nodes(4)
    dead.add(nodes[3].me)
    leader = nodes[0]
    view = asyncio.run(leader.propose(cands(nodes, leader)))
    assert nodes[3].me not in view.members and view.world_size == 3
    assert nodes[3].view is None
    assert not leader.needs_new_view(cands(nodes, leader))  # no re-proposal every round


def test_a_node_not_ready_yet_is_left_out_and_asked_again_later() -> None:
    nodes, _, _ = make_nodes(3)
    nodes[2].ready = False  # still starting: it would hold up the first collective
    view = asyncio.run(nodes[0].propose(cands(nodes, nodes[0])))
    assert nodes[2].me not in view.members
    assert nodes[0]._cooldown[nodes[2].me] > 0
    nodes[2].ready = True
    nodes[0]._cooldown.clear()  # time passes
    view = asyncio.run(nodes[0].propose(cands(nodes, nodes[0])))
    assert nodes[2].me in view.members and nodes[2].view == view


def test_a_newcomer_does_not_lead_over_the_members_of_its_view() -> None:
    nodes, _, _ = make_nodes(3)
    asyncio.run(nodes[0].propose(cands(nodes, nodes[0])))
    # nodes[2] has seen nobody through discovery yet, but its view names nodes[0]
    assert nodes[2].leader({}) == nodes[0].me


def test_donor_is_the_member_with_most_rounds() -> None:
    nodes, _, _ = make_nodes(3)
    nodes[2].rounds = lambda: 40
    nodes[1].rounds = lambda: 39
    view = asyncio.run(nodes[0].propose(cands(nodes, nodes[0])))
    assert view.donor == nodes[2].me


def test_stale_and_losing_proposals_are_refused() -> None:
    nodes, _, _ = make_nodes(3)
    a, b, c = nodes
    from swarmtrain.roles.peer.membership import _sign

    asyncio.run(a.propose(cands(nodes, a)))  # everyone is in epoch 1 now
    stale = Propose(epoch=1, proposer=b.me, members=[a.me, b.me, c.me], addresses={})
    ans = c.on_propose(_sign(b.identity, stale))
    assert not ans.ok and "not above" in ans.reason
    # two proposers for the same epoch: the lower id wins, the higher is refused after it
    low = _sign(a.identity, Propose(epoch=5, proposer=a.me, members=[a.me, b.me, c.me], addresses={}))
    high = _sign(b.identity, Propose(epoch=5, proposer=b.me, members=[a.me, b.me, c.me], addresses={}))
    assert c.on_propose(low).ok
    assert not c.on_propose(high).ok


def test_forged_membership_messages_are_refused() -> None:
    nodes, _, _ = make_nodes(3)
    a, b, c = nodes
    from swarmtrain.roles.peer.membership import _sign

    real = _sign(a.identity, Propose(epoch=3, proposer=a.me, members=[a.me, c.me], addresses={}))
    assert check_signature(real)
    tampered = dataclasses.replace(real, members=[a.me, b.me, c.me])
    assert not check_signature(tampered)
    assert not c.on_propose(tampered).ok
    impostor = _sign(b.identity, Propose(epoch=3, proposer=a.me, members=[a.me, c.me], addresses={}))
    assert not check_signature(impostor)  # b's key does not hash to a's id
    assert "signature" in c.on_propose(impostor).reason
    commit = _sign(b.identity, Commit(epoch=9, proposer=a.me, members=[a.me, c.me], addresses={},
                                      donor=a.me))
    assert not c.on_commit(commit) and c.view is None


@pytest.mark.parametrize("n", [1, 2, 5])
def test_views_of_any_size(n: int) -> None:
    nodes, _, _ = make_nodes(n)
    view = asyncio.run(nodes[0].propose(cands(nodes, nodes[0])))
    assert view.world_size == n and view.epoch == 1


def test_renew_commits_the_same_members_under_a_new_epoch() -> None:
    nodes, _, _ = make_nodes(3)
    leader = nodes[0]
    first = asyncio.run(leader.propose(cands(nodes, leader)))
    assert asyncio.run(leader.propose(cands(nodes, leader))) is first  # nothing changed: kept
    renewed = asyncio.run(leader.propose(cands(nodes, leader), known_epoch=first.epoch, renew=True))
    assert renewed.epoch > first.epoch and renewed.members == first.members
    assert all(n.view == renewed for n in nodes)


def test_reform_requests_are_signed_by_the_member_they_name() -> None:
    nodes, _, _ = make_nodes(2)
    a, b = nodes
    real = a.reform_request(4)
    assert real.peer_id == a.me and check_signature(real)
    assert not check_signature(dataclasses.replace(real, epoch=5))  # tampered
    assert not check_signature(Reform(epoch=4, peer_id=a.me))  # unsigned
    assert not check_signature(dataclasses.replace(b.reform_request(4), peer_id=a.me))  # b posing as a
