"""Top-k sparsification: keep the k largest magnitudes, send them with compact indices.

Index encoding ("blocked uint16"): the kept indices are sorted and the index space is cut
into blocks of 65536. Each index sends only its low 16 bits (``index_low``, uint16) and the
receiver learns the high bits from the number of kept indices in each block
(``block_counts``, int32, one per block). That is 2 bytes per kept element plus 4 bytes per
65536 elements of the tensor, for any tensor size, and it decodes with one vectorized
``repeat_interleave``. At ratio 0.1 a float32 tensor shrinks to 0.1 of its size (plus
6.1e-6 for the counts): 2 bytes of fp16 value + 2 bytes of index per kept element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarmtrain.compression.base import (
    Codec,
    Compressed,
    check_header,
    check_meta_keys,
    check_parts,
    dtype_name,
    flat_float32,
    meta_int,
    to_fp16_clamped,
)
from swarmtrain.compression.kernels import kernels
from swarmtrain.errors import ConfigError, RemoteProtocolError

__all__ = ["INDEX_BLOCK", "TopKCodec", "TopKParts", "check_topk", "decode_topk", "topk_count",
           "topk_warmup_ratio"]

INDEX_BLOCK = 1 << 16
"""Width of an index block; each kept index sends its offset in its block as uint16."""


def topk_count(numel: int, ratio: float) -> int:
    """Number of elements top-k keeps: ``max(1, ceil(ratio * numel))``, 0 for an empty tensor.

    ``ratio * numel`` is rounded to 6 decimals before the ceiling so that float error does
    not add an element (``0.1 * 30`` is ``3.0000000000000004`` in binary floating point).
    """
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(round(ratio * numel, 6))))


def _num_blocks(numel: int) -> int:
    return -(-numel // INDEX_BLOCK)


def _check_ratio(ratio: float, param: str) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        raise ConfigError(f"{param} must be a number in (0, 1], got {ratio!r}")


class TopKCodec(Codec):
    """Keep the ``topk_count(numel, ratio)`` largest ``|x|``; the rest decode to zero.

    Wire (k kept elements, B = ceil(numel / 65536) blocks)::

        values        float16[k]   kept values, by ascending index, clamped to ±65504
        index_low     uint16[k]    kept index mod 65536, ascending within each block
        block_counts  int32[B]     how many kept indices fall in each block of 65536
        meta          {"k": k}

    Pair it with :class:`~swarmtrain.compression.ErrorFeedback` so that what is dropped
    (and the fp16 rounding of what is kept) is sent later instead of lost.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.1) -> None:
        """Args:
            ratio: fraction of elements to keep, in (0, 1].

        Raises:
            ConfigError: ratio out of range.
        """
        _check_ratio(ratio, "topk_ratio")
        self.ratio = float(ratio)

    def __repr__(self) -> str:
        return f"TopKCodec(ratio={self.ratio})"

    def compress(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Compressed:
        flat = flat_float32(tensor)
        numel = flat.numel()
        k = topk_count(numel, self.ratio)
        if k == numel:
            indices = torch.arange(numel)
        else:
            _, unordered = torch.topk(flat.abs(), k, sorted=False)
            if k * 64 < numel:
                indices = unordered.sort().values  # few: sorting them is cheapest
            else:
                # Marking a mask and reading it back sorts the indices in O(numel), which
                # measured ~3x faster than torch.sort on k = numel / 10 indices.
                mask = torch.zeros(numel, dtype=torch.bool)
                mask[unordered] = True
                indices = mask.nonzero(as_tuple=True)[0]
        if numel <= INDEX_BLOCK:  # one block: the index is its own low part
            low, counts = indices.to(torch.uint16), torch.tensor([k] if numel else [], dtype=torch.int32)
        else:
            low = indices.bitwise_and(INDEX_BLOCK - 1).to(torch.uint16)
            counts = torch.bincount(indices.bitwise_right_shift(16),
                                    minlength=_num_blocks(numel)).to(torch.int32)
        parts = {"values": to_fp16_clamped(flat[indices]), "index_low": low, "block_counts": counts}
        return Compressed(self.name, tuple(tensor.shape), dtype_name(tensor), parts, {"k": k})

    def decompress(self, c: Compressed) -> torch.Tensor:
        return decode_topk(c)

    def subtract_decoded_(self, target: torch.Tensor, c: Compressed) -> None:
        """Only the kept positions change: a few small ops instead of a full-size decode
        (``c`` was made here, so it is trusted: nothing is validated)."""
        k = int(c.meta["k"])
        if k:
            idx = _kept_indices(c.parts["index_low"], c.parts["block_counts"], k)
            target.view(-1).index_add_(0, idx, c.parts["values"].to(torch.float32), alpha=-1.0)

    def estimate_wire_bytes(self, numel: int) -> int:
        return 4 * topk_count(numel, self.ratio) + 4 * _num_blocks(numel)


@dataclass(frozen=True)
class TopKParts:
    """A top-k gradient's wire parts, checked (counts add up to k, every index in range) but
    not decoded: the coordinator's fused Adam decodes them a cache-sized block at a time."""

    shape: tuple[int, ...]
    numel: int
    values: torch.Tensor  # float16, k
    index_low: torch.Tensor  # uint16, k
    block_counts: torch.Tensor  # int32, one per INDEX_BLOCK elements

    def decode(self) -> torch.Tensor:
        """The dense float32 tensor (``decode_topk``'s result)."""
        fast = kernels()
        if fast is not None and self.numel and all(
                t.is_contiguous() for t in (self.values, self.index_low, self.block_counts)):
            out = fast.topk_decode(self.values, self.index_low, self.block_counts, self.numel)
            if out is not None:  # (checked: every index is in range)
                return out.view(self.shape)
        out = torch.zeros(self.numel, dtype=torch.float32)
        k = self.values.numel()
        if k:
            kept = _kept_indices(self.index_low, self.block_counts.to(torch.int64), k)
            out[kept] = self.values.to(torch.float32)
        return out.view(self.shape)


def check_topk(c: Compressed) -> TopKParts:
    """The parts of a ``topk`` :class:`Compressed`, checked as :func:`decode_topk` checks them.

    Raises:
        RemoteProtocolError: malformed parts, counts that do not add up to ``k``, or an
            index outside ``[0, numel)``.
    """
    numel = check_header(c, TopKCodec.name)
    check_meta_keys(c, {"k"})
    k = meta_int(c, "k", 0, numel)
    blocks = _num_blocks(numel)
    check_parts(
        c,
        {
            "values": (torch.float16, k),
            "index_low": (torch.uint16, k),
            "block_counts": (torch.int32, blocks),
        },
    )
    fast = kernels()
    low, block_counts = c.parts["index_low"], c.parts["block_counts"]
    if fast is not None and low.is_contiguous() and block_counts.is_contiguous():
        bad = fast.topk_check(low, block_counts, numel)  # one call, not a few torch ops
    else:
        bad = _topk_check(low, block_counts, numel, k)
    if bad == 1:
        raise RemoteProtocolError(
            "bad_topk_counts", f"topk: block counts must be >= 0 and sum to k={k}"
        )
    if bad == 2:
        raise RemoteProtocolError("bad_topk_index", f"topk: index out of range [0, {numel})")
    return TopKParts(tuple(c.shape), numel, c.parts["values"], c.parts["index_low"], c.parts["block_counts"])


def _topk_check(low: torch.Tensor, block_counts: torch.Tensor, numel: int, k: int) -> int:
    """:meth:`Kernels.topk_check` in torch ops."""
    blocks = block_counts.numel()
    counts = block_counts.to(torch.int64)
    if blocks and (int(counts.min()) < 0 or int(counts.sum()) != k):
        return 1
    last = int(counts[-1]) if blocks else 0
    # only the last block can be short: its low parts must stay below its length
    if last and int(low[k - last:].to(torch.int32).max()) >= numel - (blocks - 1) * INDEX_BLOCK:
        return 2
    return 0


def decode_topk(c: Compressed) -> torch.Tensor:
    """Decode a ``topk`` :class:`Compressed` from its parts and meta alone.

    Duplicate indices are not rejected (one of the values wins); they cannot crash.

    Raises:
        RemoteProtocolError: malformed parts, counts that do not add up to ``k``, or an
            index outside ``[0, numel)``.
    """
    return check_topk(c).decode()


def topk_warmup_ratio(step: int, target: float, warmup_steps: int) -> float:
    """Top-k ratio for a warm-up that starts dense and decays geometrically to ``target``.

    As in Deep Gradient Compression's warm-up, density shrinks exponentially:
    ``ratio(step) = target ** (step / warmup_steps)``: 1.0 at step 0, ``target`` from
    ``warmup_steps`` on. With ``warmup_steps == 0`` it is always ``target``.

    Raises:
        ConfigError: ``target`` outside (0, 1] or ``warmup_steps`` negative.
    """
    _check_ratio(target, "target")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if step >= warmup_steps:
        return float(target)
    if step <= 0:
        return 1.0
    return float(target ** (step / warmup_steps))


def _kept_indices(index_low: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Full int64 indices from their low 16 bits and the per-block counts."""
    indices = index_low.to(torch.int64)
    if counts.numel() > 1:
        block_start = torch.arange(0, counts.numel() * INDEX_BLOCK, INDEX_BLOCK)
        indices.add_(torch.repeat_interleave(block_start, counts.to(torch.int64), output_size=k))
    return indices

