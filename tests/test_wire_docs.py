"""docs/protocol.md's tables of the peer ring's formats match the code: the ring link
handshake (:mod:`swarmtrain.wire.handshake`) and the ring frames (:mod:`swarmtrain.wire.ring`):
fields, offsets, sizes, limits and error codes."""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

from swarmtrain.roles.peer.ring import DEFAULT_SEGMENT_BYTES
from swarmtrain.wire import handshake, ring

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "protocol.md").read_text()


def _section(heading: str) -> str:
    start = DOC.index(heading)
    end = DOC.find("\n#", start + len(heading))
    return DOC[start:] if end < 0 else DOC[start:end]


def _rows(text: str, columns: int) -> list[list[str]]:
    """The cells of every table row of `text` with `columns` cells (the header row and the
    separator row left out)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == columns and not set(cells[0]) <= set("-: "):
            rows.append(cells)
    return rows[1:] if rows else rows


def _codes_raised(module_path: str, pattern: str) -> set[str]:
    return set(re.findall(pattern, (ROOT / module_path).read_text()))


def test_the_ring_frame_header_table_is_the_header_struct() -> None:
    rows = _rows(_section("## Peer mode: ring frames"), 5)
    fields = [f.name for f in dataclasses.fields(ring.FrameHeader)]
    assert [r[3].strip("`") for r in rows] == fields
    offset = 0
    for (doc_offset, size, _type, _name, _), code in zip(rows, ring.HEADER.format[1:], strict=True):
        assert (int(doc_offset), int(size)) == (offset, struct.calcsize("<" + code)), rows
        offset += int(size)
    assert offset == ring.HEADER.size == 20 and f"`struct` format `{ring.HEADER.format}`" in DOC
    assert ring.CHECKED_BYTES == 16 and "first 16 header bytes of every frame" in DOC


def test_the_ring_frame_kinds_codecs_limits_and_errors_are_the_code_s() -> None:
    text = " ".join(_section("## Peer mode: ring frames").split())
    kinds = {ring.KIND_ALL_REDUCE: "all-reduce", ring.KIND_BROADCAST: "broadcast",
             ring.KIND_BARRIER: "barrier"}
    assert ", ".join(f"{k} {n}" for k, n in kinds.items()) in text
    assert ", ".join(f"{c} {w}" for w, c in ring.WIRES.items()) in text
    assert f"{ring.CODEC_RAW} raw bytes" in text
    assert "default 1 MiB, at most 2³⁰; at least 64 KB" in text
    assert DEFAULT_SEGMENT_BYTES == 1 << 20 and ring.MIN_SEGMENT_BYTES == 64 << 10
    documented = {r[0].strip("`") for r in _rows(_section("## Peer mode: ring frames"), 2)}
    raised = _codes_raised("swarmtrain/wire/ring.py", r'RemoteProtocolError\(\s*"(\w+)"') | {
        "ring_desync", "truncated_frame"}  # RingDesync's and TruncatedFrame's own codes
    assert documented == raised


def test_the_ring_handshake_tables_are_the_handshake_s() -> None:
    section = _section("### The ring link handshake")
    rows = _rows(section, 6)
    sizes: dict[str, int] = {}
    for message, offset, size, _type, _field, _ in rows:
        assert int(offset) == sizes.get(message, 0), (message, offset)  # contiguous, in order
        sizes[message] = int(offset) + (int(size) if size != "len" else 0)
    assert sizes == {"opening": handshake.OPENING_BYTES, "hello": handshake.SERVER_HELLO_BYTES,
                     "announcement": handshake.PROOF_BYTES + handshake.ANNOUNCE.size, "status": 1}
    assert handshake.ANNOUNCE.format == "<QIH"  # epoch uint64, from_rank uint32, len uint16
    assert [r[3] for r in rows if r[0] == "announcement"][1:4] == ["uint64 LE", "uint32 LE", "uint16 LE"]
    assert f"at most {handshake.MAX_RING_ID_BYTES}" in section
    assert " ".join(f"{b:02x}" for b in handshake.MAGIC) in section
    assert f"up to {handshake.SERVER_HELLO_BYTES} bytes in all" in section
    assert {int(r[0]) for r in _rows(section, 2) if r[0].isdigit()} == {int(c) for c in handshake.Refusal}
    documented = {r[0].strip("`") for r in _rows(section, 3)}
    raised = _codes_raised("swarmtrain/wire/handshake.py", r'RingHandshakeError\(\s*"(\w+)"') | set(
        handshake.REFUSAL_CODES.values())
    assert documented == raised
