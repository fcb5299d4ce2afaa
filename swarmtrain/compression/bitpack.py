"""Pack small unsigned codes (2, 4 or 8 bits each) into bytes, vectorized.

Code ``i`` goes to byte ``i // (8 // bits)`` at bit offset ``(i % (8 // bits)) * bits``
(least significant bits first). The unused high bits of the last byte are zero when packing
and ignored when unpacking.
"""

from __future__ import annotations

import torch

__all__ = ["PACK_BITS", "pack_bits", "packed_nbytes", "unpack_bits"]

PACK_BITS = (2, 4, 8)
"""Code widths that divide a byte evenly."""


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes needed for ``count`` codes of ``bits`` bits each."""
    return (count * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes, each ``< 2**bits``, into bytes.

    Args:
        codes: 1-D uint8; values must fit in ``bits`` bits (higher bits would corrupt
            neighbours, so callers guarantee it).
        bits: 2, 4 or 8.

    Returns:
        1-D uint8 tensor of ``packed_nbytes(len(codes), bits)`` bytes (``codes`` itself
        when ``bits == 8``).
    """
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits}")
    if bits == 8:
        return codes
    per_byte = 8 // bits
    count = codes.numel()
    pad = -count % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    grouped = codes.view(-1, per_byte)
    packed = grouped[:, 0].clone()
    # A loop over the 2 or 4 slots of a byte, not over elements.
    for slot in range(1, per_byte):
        packed.bitwise_or_(grouped[:, slot].bitwise_left_shift(slot * bits))
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes as a 1-D uint8 tensor.

    ``packed`` must hold at least ``packed_nbytes(count, bits)`` bytes.
    """
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits}")
    if bits == 8:
        return packed[:count]
    nbytes = packed_nbytes(count, bits)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    mask = (1 << bits) - 1
    codes = packed[:nbytes, None].bitwise_right_shift(shifts).bitwise_and_(mask)
    return codes.view(-1)[:count]
