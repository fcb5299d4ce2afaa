"""Peer membership's enums (pure, no network): a REFORM's kind and an ACCEPT's refusal code
travel, and are signed, as exactly the bytes of the plain strings they replaced, and come back
(byte by byte) equal to their members with their signatures still good."""

from __future__ import annotations

import dataclasses

import pytest

from swarmtrain.roles.peer.membership import (
    AcceptCode,
    Membership,
    ReformKind,
    _sign,
    check_signature,
    signed_bytes,
)
from swarmtrain.wire import Accept, Propose, Reform
from swarmtrain.wire.frame import Decoder, encode_bytes
from tests.test_membership import make_nodes

pytestmark = pytest.mark.timeout(60)


def _decode_byte_by_byte(data: bytes) -> object:
    dec = Decoder()
    for i in range(len(data)):
        dec.feed(data[i:i + 1])
    msg = dec.next_message()
    assert msg is not None and dec.next_message() is None
    return msg


def test_a_reform_of_every_kind_is_signed_and_sent_as_its_plain_string() -> None:
    assert {k.value for k in ReformKind} == {"broke", "join", "leave"}
    (a,) = make_nodes(1)[0]
    for kind in ReformKind:
        msg = a.reform_request(4, kind)
        plain = dataclasses.replace(msg, kind=kind.value)
        assert signed_bytes(msg) == signed_bytes(plain) and encode_bytes(msg) == encode_bytes(plain)
        back = _decode_byte_by_byte(encode_bytes(msg))
        assert isinstance(back, Reform) and type(back.kind) is str
        assert back.kind == kind and ReformKind(back.kind) is kind and check_signature(back)
    assert a.reform_request(4).kind is ReformKind.BROKE  # the default


def _proposal(proposer: Membership, members: list[str], epoch: int) -> Propose:
    addresses = {m: ["10.0.0.1", 9000 + i] for i, m in enumerate(members)}
    msg: Propose = _sign(proposer.identity, Propose(epoch=epoch, proposer=proposer.me, members=members,
                                                    addresses=addresses))
    return msg


def test_an_accept_code_is_signed_and_sent_as_its_plain_string() -> None:
    assert {c.value for c in AcceptCode} == {"", "bad_signature", "not_ready", "not_member", "follows",
                                             "stale_epoch", "promised"}
    (a, b), _, _ = make_nodes(2)
    answers = {
        AcceptCode.ACCEPTED: b.on_propose(_proposal(a, [a.me, b.me], 1)),
        AcceptCode.NOT_MEMBER: b.on_propose(_proposal(a, [a.me], 2)),
        AcceptCode.BAD_SIGNATURE: b.on_propose(dataclasses.replace(_proposal(a, [a.me, b.me], 3), epoch=4)),
    }
    b.ready = False
    answers[AcceptCode.NOT_READY] = b.on_propose(_proposal(a, [a.me, b.me], 5))
    for code, answer in answers.items():
        assert answer.code is code and answer.ok == (code is AcceptCode.ACCEPTED)
        plain = dataclasses.replace(answer, code=code.value)
        assert signed_bytes(answer) == signed_bytes(plain) and encode_bytes(answer) == encode_bytes(plain)
        back = _decode_byte_by_byte(encode_bytes(answer))
        assert isinstance(back, Accept) and type(back.code) is str
        assert back.code == code and AcceptCode(back.code) is code and check_signature(back)
