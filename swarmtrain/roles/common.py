"""Pieces both ends of the parameter server share: model fingerprints and the packing of
compressed tensors into message fields and payload tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from swarmtrain.compression import Compressed, decompress_any
from swarmtrain.errors import ModelMismatch, RemoteProtocolError

__all__ = [
    "fingerprint",
    "check_fingerprint",
    "pack_compressed",
    "unpack_compressed",
]


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """[[name, dtype, shape], ...] of a model's parameters, in order."""
    return [[n, str(p.dtype).removeprefix("torch."), list(p.shape)] for n, p in named]


def _fmt(entry: list[Any]) -> str:
    return f"'{entry[0]}' {entry[1]} {list(entry[2])}"


def check_fingerprint(mine: list[list[Any]], theirs: Any) -> None:
    """Raise :class:`ModelMismatch` naming the first difference between two fingerprints."""
    if not isinstance(theirs, list) or not all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) for e in theirs
    ):
        raise ModelMismatch("the worker sent a malformed model fingerprint")
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if [a[0], a[1], list(a[2])] != [b[0], b[1], list(b[2])]:
            raise ModelMismatch(
                f"model mismatch at parameter #{i}: coordinator has {_fmt(a)}, worker has {_fmt(b)}; "
                "run the same task and model settings on every machine"
            )
    if len(mine) != len(theirs):
        longer, who = (mine, "coordinator") if len(mine) > len(theirs) else (theirs, "worker")
        extra = longer[min(len(mine), len(theirs))]
        raise ModelMismatch(
            f"model mismatch: the {who} has {len(longer)} parameters, the other "
            f"{min(len(mine), len(theirs))}; first extra is {_fmt(extra)}"
        )


def pack_compressed(
    items: Mapping[str, Compressed],
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split compressed tensors into a ``codecs`` header map and ``name/part`` payload tensors."""
    codecs: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, c in items.items():
        codecs[name] = {"codec": c.codec, "shape": list(c.shape), "dtype": c.dtype, "meta": c.meta,
                        "parts": list(c.parts)}
        for part, t in c.parts.items():
            tensors[f"{name}/{part}"] = t
    return codecs, tensors


def unpack_compressed(
    codecs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Decompress every tensor of a message and check it against ``expected`` (name → tensor).

    Raises:
        RemoteProtocolError: names, shapes or parts do not match, or a codec rejects its parts.
    """
    if set(codecs) != set(expected):
        missing = sorted(set(expected) - set(codecs))[:3]
        extra = sorted(set(codecs) - set(expected))[:3]
        raise RemoteProtocolError(
            "shape_mismatch", f"tensor names differ from the model's (missing {missing}, unknown {extra})"
        )
    used = 0
    out: dict[str, torch.Tensor] = {}
    for name, spec in codecs.items():
        if not (isinstance(spec, dict) and isinstance(spec.get("parts"), list)
                and isinstance(spec.get("shape"), list) and isinstance(spec.get("meta"), dict)
                and isinstance(spec.get("codec"), str) and isinstance(spec.get("dtype"), str)):
            raise RemoteProtocolError("bad_codec", f"codec entry for {name!r} is malformed")
        if tuple(spec["shape"]) != tuple(expected[name].shape):
            raise RemoteProtocolError(
                "shape_mismatch",
                f"{name!r} has shape {spec['shape']}, the model's is {list(expected[name].shape)}",
            )
        parts = {}
        for part in spec["parts"]:
            key = f"{name}/{part}"
            if not isinstance(part, str) or key not in tensors:
                raise RemoteProtocolError("bad_codec", f"part {key!r} is missing from the payload")
            parts[part] = tensors[key]
        used += len(parts)
        c = Compressed(codec=spec["codec"], shape=tuple(spec["shape"]), dtype=spec["dtype"],
                       parts=parts, meta=spec["meta"])
        out[name] = decompress_any(c)
    if used != len(tensors):
        raise RemoteProtocolError("bad_codec", "payload carries tensors no codec entry names")
    return out
