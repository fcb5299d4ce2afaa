"""Pieces both ends of the parameter server share: model fingerprints and the packing of
compressed tensors into message fields and payload tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from swarmtrain.compression import Codec, Compressed, decompress_any, make_codec, topk_warmup_ratio
from swarmtrain.compression.base import FLOAT_DTYPES, check_header, check_meta_keys, check_parts
from swarmtrain.compression.kernels import kernels
from swarmtrain.compression.topk import INDEX_BLOCK as TOPK_INDEX_BLOCK
from swarmtrain.compression.topk import TopKParts, check_topk
from swarmtrain.config import CompressionConfig
from swarmtrain.errors import ConfigError, ModelMismatch, RemoteProtocolError

__all__ = [
    "codec_for_step",
    "downlink_codec",
    "downlink_kind",
    "global_norm",
    "check_compression_match",
    "payload_bytes",
    "check_fingerprint",
    "FUSED",
    "FUSE_DENSE_MAX_NUMEL",
    "FUSE_MAX_NUMEL",
    "DENSE_CODECS",
    "fuse_dense",
    "fuse_gradients",
    "whole_entry",
    "fused_views",
    "check_fused",
    "entry_spec",
    "pack_compressed",
    "pack_buffers",
    "split_buffers",
    "unpack_compressed",
    "unpack_lazy",
    "LazyGradient",
    "dense_gradient",
]


def _fmt(entry: list[Any]) -> str:
    kind = {"param": "", "frozen": " (frozen)", "buffer": " (buffer)"}.get(str(entry[3]), "")
    return f"'{entry[0]}' {entry[1]} {list(entry[2])}{kind}"


def check_fingerprint(mine: list[list[Any]], theirs: Any) -> None:
    """Raise :class:`ModelMismatch` naming the first difference between two fingerprints
    (:meth:`swarmtrain.core.modelstate.ModelState.fingerprint`: name, dtype, shape and kind —
    trainable, frozen or buffer — of every tensor)."""
    if not isinstance(theirs, list) or not all(
        isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[1], str)
        and isinstance(e[2], list) and all(isinstance(d, int) for d in e[2]) and isinstance(e[3], str)
        for e in theirs
    ):
        raise ModelMismatch("the worker sent a malformed model fingerprint (is it a swarmtrain "
                            "worker of the same version?)")
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if [a[0], a[1], list(a[2]), a[3]] != [b[0], b[1], list(b[2]), b[3]]:
            what = "buffer" if a[3] == "buffer" else "parameter"
            raise ModelMismatch(
                f"model mismatch at {what} #{i}: coordinator has {_fmt(a)}, worker has {_fmt(b)}; "
                "run the same task and model settings on every machine (and freeze the same "
                "parameters on each)"
            )
    if len(mine) != len(theirs):
        longer, who = (mine, "coordinator") if len(mine) > len(theirs) else (theirs, "worker")
        extra = longer[min(len(mine), len(theirs))]
        raise ModelMismatch(
            f"model mismatch: the {who} has {len(longer)} tensors, the other "
            f"{min(len(mine), len(theirs))}; first extra is {_fmt(extra)}"
        )


def codec_for_step(c: CompressionConfig, step: int) -> Codec:
    """The codec for gradient ``step``: during warm-up, top-k density ramps geometrically from
    dense (1.0) down to ``topk_ratio`` over ``warmup_steps`` (as in Deep Gradient Compression).

    Top-k costs 4 bytes per kept element (fp16 value + 16-bit index), so above half density
    the whole tensor in fp16 is both smaller and exact to fp16: those warm-up steps send fp16.
    """
    ratio = c.topk_ratio
    kind = c.type
    if c.type == "topk" and c.warmup_steps:
        ratio = topk_warmup_ratio(step, c.topk_ratio, c.warmup_steps)
        if ratio >= 0.5:
            kind = "fp16"
    return make_codec(kind, topk_ratio=ratio, qsgd_bits=c.qsgd_bits, bucket_size=c.bucket_size,
                      min_compress_numel=c.min_compress_numel)


def downlink_kind(c: CompressionConfig) -> str:
    """The downlink ``c`` asks for, ``auto`` resolved: ``half`` with an fp16 uplink (every answer
    the weights rounded to float16: no published copy, no log, half the bytes of float32),
    ``uniform`` with top-k or QSGD, the uplink's codec otherwise."""
    if c.downlink != "auto":
        return c.downlink
    # Weight deltas are dense (Adam moves every weight) and what the downlink drops is
    # kept in master - published and sent again: a top-k downlink lags far behind and a
    # stochastic coarse QSGD one exceeds the drift bound, while deterministic uniform
    # levels scaled by each bucket's largest delta stay within half a level of the master.
    return {"topk": "uniform", "qsgd": "uniform", "fp16": "half"}.get(c.type, c.type)


def downlink_codec(c: CompressionConfig) -> Codec:
    """The codec for weight deltas (coordinator → worker); the ``half`` downlink sends none
    (its answers are rounded weights) and reports fp16's."""
    kind = downlink_kind(c)
    kind = "fp16" if kind == "half" else kind
    bits = c.downlink_bits if kind == "uniform" else c.qsgd_bits
    return make_codec(kind, topk_ratio=c.topk_ratio, qsgd_bits=bits, bucket_size=c.bucket_size,
                      min_compress_numel=c.min_compress_numel)


def check_compression_match(mine: CompressionConfig, theirs: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` naming every [compression] key on which a worker differs."""
    diffs = [f"{k} = {getattr(mine, k)!r} here, {theirs.get(k)!r} on the worker"
             for k in CompressionConfig.SHARED_KEYS if theirs.get(k, getattr(mine, k)) != getattr(mine, k)]
    if diffs:
        raise ConfigError("compression mismatch: " + "; ".join(diffs)
                          + ". Set the same [compression] keys on the coordinator and every worker")


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data a message carries (the frame adds a small header and padding)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


FUSED = "*"
"""The ``codecs`` name of one entry that carries every parameter, flattened and concatenated
in the model's parameter order (the fingerprint guarantees both ends share it): weight
deltas travel this way, one codec call per message instead of one per tensor, and so do the
uncompressed gradients and full weights of a small model (:func:`fuse_gradients`)."""

FUSE_MAX_NUMEL = 1 << 20
"""Models up to this many parameters send their weights as one :data:`FUSED` entry: weight
deltas always, full weights too. Per tensor a message costs its descriptor, codec entry and
checks on both ends, which for a small model's millisecond step is more than copying its
tensors into one. (Dense gradients go as one entry up to a far larger size:
:func:`fuse_gradients`.)"""


#: dense gradients up to this many elements (128 MB in float32) travel as one entry
#: (:func:`fuse_gradients`). Per tensor the coordinator pays ~17 µs of Python per update (1.7 ms
#: for 101 tensors, measured on a 10M-parameter model), against Adam's ~0.65 ms per million
#: parameters: the larger the model, the smaller that share, while the worker's second copy of
#: its gradient, held until it is sent, grows with it; above this size the copy is not made
FUSE_DENSE_MAX_NUMEL = 1 << 25


def fuse_gradients(grads: Mapping[str, torch.Tensor],
                   params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """Every parameter's gradient in one float32 vector, in one copy, for one :data:`FUSED`
    entry (``none``, or coded whole by the fp16 codec): when there is one for every one of
    ``params`` (more than one), in their order, each a float32 CPU tensor, at most
    :data:`FUSE_DENSE_MAX_NUMEL` elements in all; None otherwise (they then travel one
    entry each).

    One entry instead of one per tensor: the coordinator checks, screens and steps it as one
    vector (its fused Adam reads every parameter's slice from it), where a hundred entries
    cost it a hundred headers, checks and views per update on the thread every worker waits
    for (1.7 ms of a 10M-parameter model's 8 ms apply); the worker pays one copy of its
    gradient, a small part of its step, and holds it until the gradient is sent."""
    if len(grads) < 2 or list(grads) != list(params):
        return None
    values = list(grads.values())
    if not all(g.dtype == torch.float32 and g.device.type == "cpu" for g in values):
        return None
    if sum(g.numel() for g in values) > FUSE_DENSE_MAX_NUMEL:
        return None
    return _flatten_dense_tensors(values)  # (a new tensor: gradients need no graph)


def whole_entry(flat: torch.Tensor) -> dict[str, Compressed]:
    """A message's one uncompressed :data:`FUSED` entry for ``flat`` (:func:`fuse_gradients`)."""
    return {FUSED: Compressed(codec="none", shape=(flat.numel(),), dtype="float32", parts={"values": flat},
                              meta={})}


#: the codecs whose gradient travels as one :data:`FUSED` entry (elementwise: coding the
#: flattened gradient codes each tensor's elements as coding it alone would)
DENSE_CODECS = ("none", "fp16")


def fuse_dense(grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], codec: str,
               compress: Callable[[torch.Tensor], Compressed] | None = None) -> dict[str, Compressed] | None:
    """The one :data:`FUSED` entry a worker sends for ``grads`` with a dense ``codec``
    (:data:`DENSE_CODECS`): uncompressed, or coded whole by ``compress`` (fp16's codec, or its
    error feedback); None when they travel one entry each (another codec, or
    :func:`fuse_gradients` does not fuse them)."""
    flat = fuse_gradients(grads, params) if codec in DENSE_CODECS else None
    if flat is None:
        return None
    if codec == "none":
        return whole_entry(flat)
    if compress is None:
        raise ValueError(f"fuse_dense: a {codec} gradient needs its codec's compress")
    return {FUSED: compress(flat)}


def fused_views(flat: torch.Tensor, expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A :data:`FUSED` tensor cut into one view per tensor of ``expected``, shaped like it.

    Raises:
        RemoteProtocolError: ``flat`` is not a 1-D tensor of their total element count.
    """
    check_fused(flat, sum(t.numel() for t in expected.values()))
    return dict(zip(expected, _unflatten_dense_tensors(flat, list(expected.values()))))


def check_fused(flat: torch.Tensor, total: int) -> None:
    """Raise RemoteProtocolError (``shape_mismatch``) unless ``flat`` is 1-D of ``total`` elements."""
    if flat.dim() != 1 or flat.numel() != total:
        raise RemoteProtocolError("shape_mismatch", f"a fused entry of shape {list(flat.shape)} does not "
                                  f"hold the model's {total} elements")


def entry_spec(codecs: Mapping[str, Any], name: str) -> Any:
    """The codec entry that carries tensor ``name``: its own, or the :data:`FUSED` one."""
    spec = codecs.get(name)
    return codecs.get(FUSED) if spec is None else spec


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


#: a gradient as :func:`unpack_lazy` gives it: float32, the fp16 codec's float16 values, or
#: top-k parts (each decodes to the same float32 tensor; see :func:`dense_gradient`)
LazyGradient = torch.Tensor | TopKParts


def dense_gradient(g: LazyGradient) -> torch.Tensor:
    """The float32 tensor a lazily unpacked gradient decodes to."""
    if isinstance(g, TopKParts):
        return g.decode()
    return g if g.dtype == torch.float32 else g.to(torch.float32)


class KnownHeader:
    """The last message header :func:`_unpack` found to be all plain entries (``none``, or
    ``fp16`` read lazily: see :func:`_plain_values`) or, read lazily, ``topk`` ones, so that
    a message with the same header is unpacked without checking each entry's header again.

    A worker sends every gradient with the same header but for the tensors' bytes, so a
    coordinator keeps one of these: of the checks per entry only those on what the payload
    holds remain (each tensor's dtype, size and layout, and a top-k entry's counts and
    indices, in the kernel): ~1 ms less per apply for a hundred tensors. A header that
    differs in anything, or a payload that fails a check, takes the full path, which checks
    and explains it.
    """

    __slots__ = ("codecs", "expected", "how", "plan", "tensor_count")

    def __init__(self) -> None:
        self.codecs: Mapping[str, Any] | None = None
        self.expected: Mapping[str, torch.Tensor] | None = None
        self.how = (False, False, False)  # (subset, lazy, whole) it was checked for
        #: per entry, in the header's order: (name, payload keys, shape, numel, dtype) for a
        #: plain one (one key; shape None when it is one-dimensional: no view is needed),
        #: (name, keys of values / index_low / block_counts, shape, numel, k) for a top-k one
        self.plan: list[tuple[str, tuple[str, ...], torch.Size | None, int, Any]] = []
        self.tensor_count = 0  # payload tensors the plan names

    def unpack(self, codecs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
               expected: Mapping[str, torch.Tensor], subset: bool, lazy: bool,
               whole: bool = False) -> dict[str, LazyGradient] | None:
        """The entries, when ``codecs`` equals the remembered header (None: take the full path)."""
        if (self.expected is not expected or self.how != (subset, lazy, whole)
                or len(tensors) != self.tensor_count or codecs != self.codecs):
            return None
        out: dict[str, LazyGradient] = {}
        topk: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for name, keys, shape, numel, extra in self.plan:
            if len(keys) == 1:
                t = tensors.get(keys[0])
                if not _whole(t, extra, numel):
                    return None
                # (a one-dimensional parameter's gradient is the checked tensor as it is)
                out[name] = t if shape is None else t.view(shape)  # type: ignore[union-attr,assignment]
                continue
            values, low, counts = (tensors.get(k) for k in keys)
            blocks = -(-numel // TOPK_INDEX_BLOCK)
            if not (_whole(values, torch.float16, extra) and _whole(low, torch.uint16, extra)
                    and _whole(counts, torch.int32, blocks)):
                return None
            topk.append((low, counts, numel))  # type: ignore[arg-type]
            out[name] = TopKParts(tuple(shape), numel, values, low, counts)  # type: ignore[arg-type]
        if topk:  # every entry's counts and indices in one call (checked as the full path does)
            fast = kernels()
            if fast is None or fast.topk_check_many(topk) != -1:
                return None
        return out

    def remember(self, codecs: Mapping[str, Any], expected: Mapping[str, torch.Tensor], subset: bool,
                 lazy: bool, out: Mapping[str, LazyGradient], whole: bool = False) -> None:
        """Remember a header whose every entry was plain or (read lazily) top-k, or (``whole``)
        one :data:`FUSED` plain entry (``out``: what the full path gave for it)."""
        plan: list[tuple[str, tuple[str, ...], torch.Size | None, int, Any]] = []
        for name, g in out.items():
            if name == FUSED and isinstance(g, torch.Tensor):  # (whole: every parameter, as it came)
                plan.append((name, (f"{name}/values",), None, g.numel(), g.dtype))
                continue
            shape, numel = expected[name].shape, expected[name].numel()
            if isinstance(g, TopKParts):
                plan.append((name, (f"{name}/values", f"{name}/index_low", f"{name}/block_counts"),
                             shape, numel, g.values.numel()))
            else:
                plan.append((name, (f"{name}/values",), None if len(shape) == 1 else shape, numel, g.dtype))
        self.codecs, self.expected, self.how, self.plan = codecs, expected, (subset, lazy, whole), plan
        self.tensor_count = sum(len(keys) for _, keys, _, _, _ in plan)


def _whole(t: Any, dtype: torch.dtype, numel: int) -> bool:
    """``t`` is a contiguous 1-D CPU tensor of ``dtype`` and ``numel`` elements."""
    return (type(t) is torch.Tensor and t.dtype is dtype and t.dim() == 1 and t.numel() == numel
            and t.is_cpu and t.is_contiguous())


def unpack_lazy(
    codecs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
    *, subset: bool = False, known: KnownHeader | None = None, whole: bool = False,
) -> dict[str, LazyGradient]:
    """:func:`unpack_compressed`, checked the same, but fp16 tensors stay their float16 values
    (shaped) and top-k ones their parts: the coordinator's fused Adam reads them as they came,
    instead of after a full-size float32 decoding pass. ``known``: where the last header of entries
    it can check again is remembered (:class:`KnownHeader`). ``whole``: a :data:`FUSED` ``none``
    or ``fp16`` entry (every parameter's gradient in one vector) comes back as it is,
    ``{FUSED: values}``, instead of cut into a view per parameter (the fused Adam reads it in
    one piece)."""
    return _unpack(codecs, tensors, expected, subset=subset, lazy=True, known=known, whole=whole)


def unpack_compressed(
    codecs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
    *, subset: bool = False, known: KnownHeader | None = None,
) -> dict[str, torch.Tensor]:
    """Decompress every tensor of a message and check it against ``expected`` (name → tensor).

    Args:
        subset: the message may carry only some of ``expected`` (a gradient carries the
            parameters that got one); otherwise it must carry all of them.

    Raises:
        RemoteProtocolError: names, shapes or parts do not match, or a codec rejects its parts.
    """
    # (not lazy: every value is a decoded tensor)
    return cast(dict[str, torch.Tensor], _unpack(codecs, tensors, expected, subset=subset, lazy=False,
                                                 known=known))


def _unpack(codecs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
            expected: Mapping[str, torch.Tensor], *, subset: bool, lazy: bool,
            known: KnownHeader | None = None, whole: bool = False) -> dict[str, LazyGradient]:
    if known is not None:  # (a remembered header is one the checks below passed)
        again = known.unpack(codecs, tensors, expected, subset, lazy, whole)
        if again is not None:
            return again
    fused = set(codecs) == {FUSED} and FUSED not in expected
    shapes = ({FUSED: (sum(t.numel() for t in expected.values()),)} if fused
              else {n: tuple(t.shape) for n, t in expected.items()})
    if not set(codecs) <= set(shapes) or (not subset and set(codecs) != set(shapes)):
        missing = sorted(set(shapes) - set(codecs))[:3]
        extra = sorted(set(codecs) - set(shapes))[:3]
        raise RemoteProtocolError(
            "shape_mismatch", "tensor names differ from the model's (missing "
            f"{missing if not subset else []}, unknown {extra})"
        )
    used = rememberable = 0  # (entries a KnownHeader can check again: plain ones, lazy top-k)
    out: dict[str, LazyGradient] = {}
    for name, spec in codecs.items():
        plain = _plain_values(name, spec, tensors, expected, lazy) if not fused else None
        if plain is not None:
            out[name] = plain
            used += 1
            rememberable += 1
            continue
        if not (isinstance(spec, dict) and isinstance(spec.get("parts"), list)
                and isinstance(spec.get("shape"), list) and isinstance(spec.get("meta"), dict)
                and isinstance(spec.get("codec"), str) and isinstance(spec.get("dtype"), str)):
            raise RemoteProtocolError("bad_codec", f"codec entry for {name!r} is malformed")
        if tuple(spec["shape"]) != shapes[name]:
            raise RemoteProtocolError(
                "shape_mismatch", f"{name!r} has shape {spec['shape']}, the model's is {list(shapes[name])}"
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
        if lazy and c.codec == "fp16" and (name != FUSED or whole):
            out[name] = _fp16_values(c)
        elif lazy and c.codec == "topk" and name != FUSED:
            out[name] = check_topk(c)
            rememberable += kernels() is not None  # (KnownHeader checks them in the kernel)
        else:
            out[name] = decompress_any(c)
    if used != len(tensors):
        raise RemoteProtocolError("bad_codec", "payload carries tensors no codec entry names")
    if fused and whole and codecs[FUSED]["codec"] in _PLAIN_CODECS:
        values = out[FUSED]
        check_fused(cast(torch.Tensor, values), shapes[FUSED][0])
        if known is not None:  # (its one payload tensor, checked again there as a plain entry's)
            known.remember(codecs, expected, subset, lazy, {FUSED: values}, whole=True)
        return {FUSED: values}
    if known is not None and rememberable == len(codecs) and out:
        known.remember(codecs, expected, subset, lazy, out, whole=whole)
    if fused:  # one view per parameter, in the model's order (its shape: every parameter)
        return dict(fused_views(dense_gradient(out[FUSED]), expected))  # (typed wider)
    return out


#: dtype of the one ``values`` part of the codecs :func:`_plain_values` takes
_PLAIN_CODECS = {"none": torch.float32, "fp16": torch.float16}
_VALUES = ["values"]


def _plain_values(name: str, spec: Any, tensors: Mapping[str, torch.Tensor],
                  expected: Mapping[str, torch.Tensor], lazy: bool) -> torch.Tensor | None:
    """The common case of :func:`_unpack` in a few checks instead of the codec's general ones
    (the same ones, in short): a ``none`` entry, or with ``lazy`` an ``fp16`` one, whose one
    ``values`` part is a contiguous 1-D CPU tensor of the codec's dtype and the model's element
    count, under the model's shape, no meta, a float dtype: that part, shaped (a view). None
    for anything else, which the general path then checks and explains."""
    if not isinstance(spec, dict):
        return None
    codec = spec.get("codec")
    want = _PLAIN_CODECS.get(codec) if isinstance(codec, str) else None
    ref = expected.get(name)
    if (want is None or ref is None or (codec == "fp16" and not lazy)
            or spec.get("parts") != _VALUES or spec.get("meta") != {}
            or spec.get("dtype") not in FLOAT_DTYPES):
        return None
    shape = spec.get("shape")
    if not isinstance(shape, list) or tuple(shape) != ref.shape or any(type(d) is not int for d in shape):
        return None
    t = tensors.get(f"{name}/values")
    if (type(t) is not torch.Tensor or t.dtype != want or t.dim() != 1 or t.numel() != ref.numel()
            or t.device.type != "cpu" or not t.is_contiguous()):
        return None
    return t.view(ref.shape)


def _fp16_values(c: Compressed) -> torch.Tensor:
    """The fp16 codec's values, checked as its decoder checks them, shaped, not widened."""
    numel = check_header(c, "fp16")
    check_meta_keys(c, set())
    check_parts(c, {"values": (torch.float16, numel)})
    return c.parts["values"].view(c.shape)


def buffer_key(index: int) -> str:
    """Payload name of the ``index``-th buffer a message lists (codec parts always hold a
    ``/``, so the two never collide)."""
    return f"#{index}"


def pack_buffers(buffers: Mapping[str, torch.Tensor]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Buffer tensors as a message's ``buffers`` name list and ``#i`` payload tensors."""
    names = list(buffers)
    return names, {buffer_key(i): buffers[n].detach().to("cpu").contiguous() for i, n in enumerate(names)}


def split_buffers(
    names: list[str], tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Separate a message's buffer tensors (listed in ``names``) from the rest, checking each
    against the model's buffers ``expected``: known name, listed once, same shape, a floating
    dtype for a floating buffer and an integer one for an integer buffer.

    Returns:
        (buffers by name, the other payload tensors).

    Raises:
        RemoteProtocolError: a listed buffer is unknown, repeated, missing or malformed.
    """
    if not names:
        return {}, dict(tensors)
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise RemoteProtocolError("bad_buffers", "the buffer list repeats a name or is malformed")
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        ref = expected.get(name)
        t = tensors.get(buffer_key(i))
        if ref is None:
            raise RemoteProtocolError("bad_buffers", f"buffer {name!r} is not one the model syncs")
        if t is None:
            raise RemoteProtocolError("bad_buffers", f"buffer {name!r} is listed but not in the payload")
        if tuple(t.shape) != tuple(ref.shape) or t.is_floating_point() != ref.is_floating_point():
            raise RemoteProtocolError(
                "bad_buffers", f"buffer {name!r} arrived as {t.dtype} {list(t.shape)}, the model's is "
                f"{ref.dtype} {list(ref.shape)}")
        out[name] = t
    keys = {buffer_key(i) for i in range(len(names))}
    return out, {k: v for k, v in tensors.items() if k not in keys}


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together (0 for none); NaN or inf if any holds them."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(tensors)))))
