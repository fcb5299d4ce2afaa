"""Fused CPU kernels for the coordinator's hot path, built on first use.

The downlink publication (``master − published``, its fp16 or uniform coding, the published
copy moved by what was coded, and the two norms of the drift bound) is one pass over memory
here, where the torch ops it replaces make six or more; so are a top-k gradient's decoding
and the screen's sum of squares; and the coordinator's Adam step, fused with the gradient's
decoding and that publication (:meth:`Kernels.adam_apply`, used by roles/ps/flat_adam.py). The C source is
``swarmtrain/compression/kernels.c``; it is compiled once per machine with the C compiler ``cc``
(or ``$CC``) into ``~/.cache/swarmtrain/kernels/`` (``$SWARMTRAIN_CACHE_DIR``, or
``$XDG_CACHE_HOME``), the way DeepSpeed builds its CPU Adam, and loaded with ctypes. Every
kernel gives, bit for bit, what the torch code gives (tests/test_kernels.py holds them to
it), so a worker decoding with torch holds exactly what the coordinator's copy holds.

No compiler, a failed build, ``SWARMTRAIN_KERNELS=0``, or tensors these kernels do not take
(not float32, not contiguous, not on the CPU): :func:`kernels` returns None and the caller
runs its torch code, which is equally correct and slower. One log line says why.

ctypes lets go of the GIL for the duration of a call, so a tensor is cut into slices that
run on ``torch.get_num_threads()`` threads at once. The Adam step's slices run on OpenMP's
threads when the library is built with it (it is tried first): torch's CPU build runs its own
work on OpenMP and ships the libgomp the library then shares, so one set of threads does both,
where a pool of our own competed for the cores with torch's threads spinning for their next
op (measured: 7.5 ms against 5.4 for a 10M-parameter step on 2 threads). The other kernels
run on a small thread pool.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

__all__ = ["G_F16", "G_F32", "G_NONE", "G_TOPK", "PUB_FP16", "PUB_HALF", "PUB_NONE", "PUB_SNAPSHOT",
           "PUB_UNIFORM", "SEG_FIELDS", "Kernels", "Publication", "kernels"]

log = logging.getLogger("swarmtrain.kernels")
T = TypeVar("T")

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
#: tried first: the Adam step's slices on the OpenMP threads torch runs its own work on
#: (kernels.c, st_adam_apply_slices); a compiler without OpenMP builds without it
OPENMP = ["-fopenmp"]
#: slices smaller than this are not worth a thread
MIN_SLICE = 1 << 18

_lock = threading.Lock()
_loaded: Kernels | None = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("SWARMTRAIN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "swarmtrain" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, flags: Sequence[str] = FLAGS) -> Path:
    """Compile the kernels (once per source, compiler, flags and CPU) and return the path."""
    key = hashlib.sha256(b"\0".join([
        SOURCE.read_bytes(), cc.encode(), " ".join(flags).encode(), _cpu_flags().encode(),
        platform.machine().encode(), sys.version.encode()])).hexdigest()[:16]
    out = _cache_dir() / f"swarmtrain-kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside it and rename: processes building at once each get a whole library
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class Kernels:
    """The loaded kernels, each taking torch tensors (checked) and running on slices."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        p, i64, f64p = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_double)
        lib.st_publish_fp16.argtypes = [p, p, p, i64, f64p]
        lib.st_publish_fp16.restype = None
        lib.st_round_half.argtypes = [p, p, i64, f64p]
        lib.st_round_half.restype = None
        lib.st_publish_uniform.argtypes = [p, p, p, p, i64, i64, ctypes.c_int, f64p]
        lib.st_publish_uniform.restype = ctypes.c_int
        lib.st_topk_decode.argtypes = [p, p, p, i64, p, i64]
        lib.st_topk_decode.restype = ctypes.c_int
        lib.st_sumsq_f32.argtypes = lib.st_sumsq_f16.argtypes = [p, i64]
        lib.st_sumsq_f32.restype = lib.st_sumsq_f16.restype = ctypes.c_double
        lib.st_sumsq_many.argtypes = [p, p, p, i64]
        lib.st_sumsq_many.restype = ctypes.c_double
        lib.st_sumsq_ranges.argtypes = [p, p, i64, i64, p]
        lib.st_sumsq_ranges.restype = None
        lib.st_topk_check.argtypes = [p, p, i64, i64, i64]
        lib.st_topk_check.restype = ctypes.c_int
        lib.st_topk_check_many.argtypes = [p, p, p, p, p, i64]
        lib.st_topk_check_many.restype = i64
        lib.st_adam_apply.argtypes = [p, p, i64, p, p, p, i64, i64, p, ctypes.c_int, ctypes.c_int,
                                      p, p, p, i64, ctypes.c_int, f64p]
        lib.st_adam_apply.restype = ctypes.c_int
        lib.st_adam_apply_slices.argtypes = [p, p, i64, p, p, p, p, ctypes.c_int, p, ctypes.c_int,
                                             ctypes.c_int, p, p, p, i64, ctypes.c_int, p, p]
        lib.st_adam_apply_slices.restype = None
        lib.st_openmp.argtypes = []
        lib.st_openmp.restype = ctypes.c_int
        #: the Adam step's slices run on OpenMP's threads (torch's), not on the pool below
        self.openmp = bool(lib.st_openmp())
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    # -- slicing --------------------------------------------------------------------------

    def _slices(self, n: int, align: int = 1) -> list[tuple[int, int]]:
        """[lo, hi) ranges covering n, each a multiple of ``align`` long (but the last)."""
        if n == 0:
            return [(0, 0)]
        threads = max(1, torch.get_num_threads())
        count = max(1, min(threads, n // MIN_SLICE))
        step = -(-n // count)
        step = -(-step // align) * align
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def _run(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """Run the calls, the first on this thread and the others on the pool, at once."""
        if len(calls) == 1:
            return [calls[0]()]
        threads = len(calls)
        if self._pool is None or self._pool_size < threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="swarm-kernel")
            self._pool_size = threads
        futures = [self._pool.submit(c) for c in calls[1:]]
        first = calls[0]()
        return [first, *(f.result() for f in futures)]

    # -- kernels --------------------------------------------------------------------------

    def _two_sums(self, n: int, call: Callable[[int, int, ctypes.Array[ctypes.c_double]], None]
                  ) -> tuple[float, float]:
        """``call(lo, hi, sums)`` on each slice of ``n`` elements at once (each writes its two
        sums into its own array); the two sums over all slices."""
        slices = self._slices(n)
        sums = [(ctypes.c_double * 2)() for _ in slices]
        self._run([partial(call, lo, hi, s) for (lo, hi), s in zip(slices, sums)])
        return sum(s[0] for s in sums), sum(s[1] for s in sums)

    def publish_fp16(self, master: torch.Tensor, published: torch.Tensor,
                     out: torch.Tensor) -> tuple[float, float]:
        """``out = fp16(master − published)`` (saturating), ``published += float(out)``;
        returns (Σ (delta − sent)², Σ master²)."""
        _check(master, torch.float32, published, out)
        _check(published, torch.float32)
        _check(out, torch.float16)
        mp, pp, op = master.data_ptr(), published.data_ptr(), out.data_ptr()
        return self._two_sums(master.numel(), lambda lo, hi, s: self._lib.st_publish_fp16(
            mp + 4 * lo, pp + 4 * lo, op + 2 * lo, hi - lo, s))

    def round_half(self, master: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
        """``out = fp16(master)`` (saturating at ±65504); returns (Σ (master − float(out))²,
        Σ master²): the weights rounded as a PUB_HALF publication rounds them."""
        _check(master, torch.float32, out)
        _check(out, torch.float16)
        mp, op = master.data_ptr(), out.data_ptr()
        return self._two_sums(master.numel(), lambda lo, hi, s: self._lib.st_round_half(
            mp + 4 * lo, op + 2 * lo, hi - lo, s))

    def publish_uniform(self, master: torch.Tensor, published: torch.Tensor, codes: torch.Tensor,
                        scales: torch.Tensor, bucket: int, bits: int) -> tuple[float, float] | None:
        """The uniform codec on ``master − published`` (see kernels.c), ``published`` moved by
        what it decodes to; (Σ (delta − sent)², Σ master²), or None when a bucket holds NaN
        or inf (``published`` is then not to be trusted)."""
        _check(master, torch.float32, published)
        _check(published, torch.float32)
        _check(codes, torch.uint8)
        _check(scales, torch.float32)
        n = master.numel()
        per_byte = 8 // bits
        if bucket % per_byte or codes.numel() != (n * bits + 7) // 8 or scales.numel() != -(-n // bucket):
            raise ValueError("publish_uniform: bucket must be a multiple of 8 // bits and the "
                             "outputs sized for the codec")
        mp, pp, cp, sp = master.data_ptr(), published.data_ptr(), codes.data_ptr(), scales.data_ptr()
        slices = self._slices(n, align=bucket)
        sums = [(ctypes.c_double * 2)() for _ in slices]

        def call(lo: int, hi: int, s: ctypes.Array[ctypes.c_double]) -> int:
            return int(self._lib.st_publish_uniform(mp + 4 * lo, pp + 4 * lo, cp + lo * bits // 8,
                                                    sp + 4 * (lo // bucket), hi - lo, bucket, bits, s))

        bad = self._run([partial(call, lo, hi, s) for (lo, hi), s in zip(slices, sums)])
        if any(bad):
            return None
        return sum(s[0] for s in sums), sum(s[1] for s in sums)

    def topk_decode(self, values: torch.Tensor, index_low: torch.Tensor, counts: torch.Tensor,
                    numel: int) -> torch.Tensor | None:
        """The dense float32 tensor of a top-k part set whose counts add up to k (the decoder
        checked that); None when an index is out of range."""
        _check(values, torch.float16, index_low)
        _check(index_low, torch.uint16)
        _check(counts, torch.int32)
        if counts.numel() != -(-numel // 65536):
            raise ValueError(f"topk_decode: {counts.numel()} block counts for {numel} elements")
        out = torch.empty(numel, dtype=torch.float32)
        bad = self._lib.st_topk_decode(values.data_ptr(), index_low.data_ptr(), counts.data_ptr(),
                                       counts.numel(), out.data_ptr(), numel)
        return None if bad else out

    def sumsq_many(self, tensors: Sequence[torch.Tensor]) -> float:
        """Σ x² over all ``tensors`` (float32 or float16, contiguous) in one call per thread,
        each thread taking an equal share of the elements (tensors cut where needed): the
        screen's norm of a gradient of a hundred tensors without a hundred calls."""
        pieces: list[tuple[int, int, int]] = []
        for t in tensors:
            if t.dtype not in (torch.float32, torch.float16):
                raise TypeError(f"sumsq takes float32 or float16, not {t.dtype}")
            _check(t, t.dtype)
            if t.numel():
                pieces.append((t.data_ptr(), t.numel(), t.element_size()))
        total = sum(n for _, n, _ in pieces)
        shares: list[list[tuple[int, int, int]]] = []
        for lo, hi in self._slices(total):  # cut the concatenation at the slice bounds
            share, pos = [], 0
            for ptr, n, size in pieces:
                a, b = max(lo, pos), min(hi, pos + n)
                if a < b:
                    share.append((ptr + size * (a - pos), b - a, size))
                pos += n
            shares.append(share)

        def call(share: list[tuple[int, int, int]]) -> float:
            count = len(share)
            ptrs = (ctypes.c_int64 * count)(*(p for p, _, _ in share))
            lens = (ctypes.c_int64 * count)(*(n for _, n, _ in share))
            half = (ctypes.c_int32 * count)(*(int(size == 2) for _, _, size in share))
            return float(self._lib.st_sumsq_many(ptrs, lens, half, count))

        return float(sum(self._run([partial(call, share) for share in shares])))

    def sumsq_ranges(self, base: int, ranges: ctypes.Array[ctypes.c_int64], count: int, hi: int,
                     out: ctypes.Array[ctypes.c_double]) -> None:
        """Advance the sums of squares ``out[i]`` of the ``count`` float ranges of the buffer
        at address ``base`` (``ranges[4i:4i+4]`` = start byte, end byte, element size 4 or 2,
        bytes summed so far, which this moves) over what lies below byte ``hi``, on this
        thread. The caller (:mod:`swarmtrain.wire.measure`) checked the ranges against the
        buffer."""
        self._lib.st_sumsq_ranges(base, ranges, count, hi, out)

    def topk_check(self, index_low: torch.Tensor, counts: torch.Tensor, numel: int) -> int:
        """The top-k decoder's checks on contiguous parts: 0 (fine), 1 (the block counts are
        negative or do not add up to k = the number of indices) or 2 (an index >= numel)."""
        _check(index_low, torch.uint16)
        _check(counts, torch.int32)
        return int(self._lib.st_topk_check(index_low.data_ptr(), counts.data_ptr(), counts.numel(),
                                           index_low.numel(), numel))

    def topk_check_many(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> int:
        """:meth:`topk_check` over many entries (index_low, block counts, numel) in one call:
        -1 when all pass, else the index of the first that fails. The caller checked that
        every index_low is a contiguous CPU uint16 tensor and every counts one int32 (as
        :class:`~swarmtrain.roles.ps.common.KnownHeader` does before it asks)."""
        count = len(parts)
        row = ctypes.c_int64 * count
        return int(self._lib.st_topk_check_many(
            row(*(low.data_ptr() for low, _, _ in parts)), row(*(c.data_ptr() for _, c, _ in parts)),
            row(*(c.numel() for _, c, _ in parts)), row(*(low.numel() for low, _, _ in parts)),
            row(*(n for _, _, n in parts)), count))

    def sumsq(self, x: torch.Tensor) -> float:
        """Σ x² of a float32 or float16 tensor (NaN or inf when it holds them)."""
        if x.dtype not in (torch.float32, torch.float16):
            raise TypeError(f"sumsq takes float32 or float16, not {x.dtype}")
        _check(x, x.dtype)
        fn = self._lib.st_sumsq_f32 if x.dtype == torch.float32 else self._lib.st_sumsq_f16
        size, ptr = x.element_size(), x.data_ptr()
        def call(lo: int, hi: int) -> float:
            return float(fn(ptr + size * lo, hi - lo))

        parts = self._run([partial(call, lo, hi) for lo, hi in self._slices(x.numel())])
        return float(sum(parts))

    def adam_apply(self, segments: Sequence[int], scalars: Sequence[float], p: torch.Tensor,
                   m: torch.Tensor, v: torch.Tensor, hyper: Sequence[float], *, held: bool,
                   publication: Publication | None = None) -> tuple[int, float, float]:
        """One Adam step (or a held-variance one) over the flat float32 ``p`` with moments
        ``m``, ``v``, fused with the gradient's decoding and the downlink ``publication``.

        Args:
            segments: SEG_FIELDS ints per parameter, in flat order (see kernels.c: offset,
                numel, gradient kind, pointers).
            scalars: 3 floats per parameter, its step scalars.
            hyper: (decay?, 1 - lr * wd, 1 - beta1, beta2, 1 - beta2, eps, -lr, clamp).

        Returns:
            (0, or 1 for a top-k index out of range, 2 for NaN/inf in the publication;
            then the sums of the publication kernels).

        The segments' sizes and pointers are the caller's to get right (FlatAdam builds
        them); dtypes and layout of the tensors are checked here.
        """
        _check(p, torch.float32, m, v)
        _check(m, torch.float32)
        _check(v, torch.float32)
        count = len(segments) // SEG_FIELDS
        if len(segments) != SEG_FIELDS * count or len(scalars) != 3 * count or len(hyper) != 8:
            raise ValueError("adam_apply: segments, scalars or hyper are not shaped for kernels.c")
        # (array.array takes a list of numbers several times faster than a ctypes array does)
        seg, sca = array.array("q", segments), array.array("d", scalars)
        pub = publication or Publication(PUB_NONE)
        align = pub.bucket if pub.mode == PUB_UNIFORM else 64
        hyp = (ctypes.c_double * 8)(*hyper)
        args = (seg.buffer_info()[0], sca.buffer_info()[0], count, p.data_ptr(), m.data_ptr(), v.data_ptr())
        rule = 1 if held else 0
        slices = self._slices(p.numel(), align=align)
        if self.openmp and len(slices) > 1:  # one call: the slices on OpenMP's threads
            count = len(slices)
            bounds = (ctypes.c_int64 * (count + 1))(*(lo for lo, _ in slices), slices[-1][1])
            flat_sums = (ctypes.c_double * (2 * count))()
            status = (ctypes.c_int * count)()
            self._lib.st_adam_apply_slices(*args, bounds, count, hyp, rule, pub.mode, pub.published, pub.out,
                                           pub.scales, pub.bucket, pub.bits, flat_sums, status)
            return (max(status), sum(flat_sums[2 * t] for t in range(count)),
                    sum(flat_sums[2 * t + 1] for t in range(count)))
        sums = [(ctypes.c_double * 2)() for _ in slices]

        def call(lo: int, hi: int, s: ctypes.Array[ctypes.c_double]) -> int:
            return int(self._lib.st_adam_apply(*args, lo, hi, hyp, rule, pub.mode, pub.published, pub.out,
                                               pub.scales, pub.bucket, pub.bits, s))

        bad = self._run([partial(call, lo, hi, s) for (lo, hi), s in zip(slices, sums)])
        return max(bad), sum(s[0] for s in sums), sum(s[1] for s in sums)


#: columns of :meth:`Kernels.adam_apply`'s segment rows (kernels.c's seg[]) and their values
SEG_FIELDS = 7
G_NONE, G_F32, G_F16, G_TOPK = 0, 1, 2, 3
PUB_NONE, PUB_FP16, PUB_UNIFORM, PUB_SNAPSHOT, PUB_HALF = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Publication:
    """Where :meth:`Kernels.adam_apply` publishes: ``mode`` (PUB_*), the published copy and
    the codec's outputs as data pointers (0 where the mode has none), bucket and bits for
    the uniform codec. The snapshot modes' outputs (PUB_SNAPSHOT's float32 copy, PUB_HALF's
    weights rounded to float16) are in the segment rows."""

    mode: int
    published: int = 0
    out: int = 0
    scales: int = 0
    bucket: int = 1
    bits: int = 8


def _check(t: torch.Tensor, dtype: torch.dtype, *same_size: torch.Tensor) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise TypeError(f"kernels take contiguous CPU {dtype} tensors, got {t.dtype} on {t.device}"
                        f"{'' if t.is_contiguous() else ', not contiguous'}")
    for other in same_size:
        if other.numel() != t.numel():
            raise ValueError(f"sizes differ: {t.numel()} and {other.numel()}")


def _load(cc: str) -> ctypes.CDLL:
    """The library built with OpenMP, or without it when that build or its loading fails."""
    try:
        return ctypes.CDLL(str(_build(cc, [*FLAGS, *OPENMP])))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.info("swarmtrain's kernels are built without OpenMP (%s): the Adam step's slices run "
                 "on a thread pool of their own", exc)
        return ctypes.CDLL(str(_build(cc)))


def kernels() -> Kernels | None:
    """The kernels, built and loaded on the first call (None, said once, if they cannot be)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get("SWARMTRAIN_KERNELS", "1").strip().lower() in ("0", "no", "off", "false"):
            log.info("fused kernels off (SWARMTRAIN_KERNELS=0): the coordinator uses torch ops")
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            log.info("no C compiler (cc) found: the coordinator's Adam and downlink use torch ops, "
                     "which is slower (install gcc to build swarmtrain's fused kernels)")
            return None
        try:
            _loaded = Kernels(_load(cc))
            log.debug("fused kernels loaded (%s)", _cache_dir())
            from swarmtrain.wire import measure  # a GRADIENTS frame's norm, summed as it arrives

            measure.use_kernel(_loaded.sumsq_ranges)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("could not build swarmtrain's fused kernels (%s): the coordinator's Adam "
                        "and downlink use torch ops, which is slower", exc)
        return _loaded
