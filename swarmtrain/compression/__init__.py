"""Gradient and weight compression: pure tensor functions, no I/O.

Codecs (``none``, ``fp16``, ``topk``, ``qsgd``, ``uniform``) turn a tensor into a :class:`Compressed`
(named 1-D parts for the wire plus small meta scalars) and back; :func:`decompress_any`
decodes any of them from the :class:`Compressed` alone. :class:`ErrorFeedback` keeps what
a lossy codec dropped for the next step; :class:`SizeAdaptive` leaves small tensors
uncompressed. :func:`quantize_int8` / :func:`dequantize_int8` are the linear format for
compressed collectives.
"""

from swarmtrain.compression.base import FP16_MAX, Codec, Compressed, to_fp16_clamped
from swarmtrain.compression.bitpack import pack_bits, packed_nbytes, unpack_bits
from swarmtrain.compression.codecs import (
    CODEC_NAMES,
    LOSSLESS_CODECS,
    SizeAdaptive,
    decompress_any,
    make_codec,
)
from swarmtrain.compression.feedback import ErrorFeedback
from swarmtrain.compression.qsgd import QSGDCodec
from swarmtrain.compression.simple import FP16Codec, NoneCodec, dequantize_int8, quantize_int8
from swarmtrain.compression.topk import TopKCodec, topk_count, topk_warmup_ratio
from swarmtrain.compression.uniform import UniformCodec

__all__ = [
    "CODEC_NAMES",
    "FP16_MAX",
    "LOSSLESS_CODECS",
    "Codec",
    "Compressed",
    "ErrorFeedback",
    "FP16Codec",
    "NoneCodec",
    "QSGDCodec",
    "SizeAdaptive",
    "TopKCodec",
    "UniformCodec",
    "decompress_any",
    "dequantize_int8",
    "make_codec",
    "pack_bits",
    "packed_nbytes",
    "quantize_int8",
    "to_fp16_clamped",
    "topk_count",
    "topk_warmup_ratio",
    "unpack_bits",
]
