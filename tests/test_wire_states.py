"""The frame decoder's lifecycle (issue #19, must-have 2): one :class:`DecoderState`, moved only
along :data:`DECODER_TRANSITIONS`; every state is reachable and an illegal move is refused."""

from __future__ import annotations

import pytest

from swarmtrain.errors import LocalProtocolError, RemoteProtocolError
from swarmtrain.wire import Decoder, Gradients, Heartbeat, encode_bytes
from swarmtrain.wire.frame import DECODER_TRANSITIONS, DecoderState

pytestmark = pytest.mark.timeout(60)


class _Recording(Decoder):
    """A decoder that keeps every move it makes."""

    def __init__(self) -> None:
        self.moves: list[tuple[DecoderState, DecoderState]] = []
        super().__init__()

    def _move(self, to: DecoderState) -> None:
        self.moves.append((self.state, to))
        super()._move(to)


def test_every_move_of_a_decoder_is_in_its_table_and_every_state_is_reached() -> None:
    import torch

    good, bad = _Recording(), _Recording()
    frames = encode_bytes(Heartbeat(time=1.0)) + encode_bytes(
        Gradients(msg_id=1, version=0, samples=1, loss=1.0, codecs={}, tensors={"g": torch.ones(3)}))
    for i in range(len(frames)):
        good.feed(frames[i : i + 1])
    with pytest.raises(RemoteProtocolError):
        bad.feed(b"HTTP/1.1 200 OK\r\n\r\n\0\0\0")
    moves = good.moves + bad.moves
    assert all(b in DECODER_TRANSITIONS[a] for a, b in moves)
    assert {b for _, b in moves} == set(DecoderState)
    assert good.state is DecoderState.PREAMBLE and bad.state is DecoderState.BROKEN
    assert set(DECODER_TRANSITIONS) == set(DecoderState) and not DECODER_TRANSITIONS[DecoderState.BROKEN]


def test_a_broken_decoder_stays_broken() -> None:
    dec = Decoder()
    with pytest.raises(RemoteProtocolError, match="bad_magic|not a swarmtrain peer"):
        dec.feed(b"GET / HTTP/1.1\r\n\r\n\r\n")
    assert dec.state is DecoderState.BROKEN
    with pytest.raises(RemoteProtocolError):
        dec.feed(encode_bytes(Heartbeat(time=1.0)))
    assert dec.end_of_stream() is None  # the error was already reported


@pytest.mark.parametrize(("start", "target"), [
    (a, b) for a in DecoderState for b in DecoderState if b not in DECODER_TRANSITIONS[a]])
def test_an_illegal_move_is_refused_naming_both_states(start: DecoderState, target: DecoderState) -> None:
    dec = Decoder()
    dec._state = start  # as if it had got there
    with pytest.raises(LocalProtocolError, match=f"from {start.name} to {target.name}") as info:
        dec._move(target)
    assert info.value.code == "illegal_transition" and dec.state is start
