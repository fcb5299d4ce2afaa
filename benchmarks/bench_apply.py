"""Coordinator apply rate for a ~10M-parameter model, against plain Adam and memory bandwidth.

Measured side by side in one run, for each torch thread count asked for:

(a) baseline: ``torch.optim.Adam(foreach=True).step()`` on the model with gradients set, plus
    ``fused=True`` (the fastest plain Adam here) and the default for-loop Adam for reference;
(b) swarmtrain: ``Coordinator._apply_gradient(rec, msg)``, the coordinator's whole apply path
    (decompress, the norm screen that also finds NaN/Inf, Adam step, and the publication of
    the update into the shared downlink log, with the answer to the worker) on a
    ``Gradients`` message whose tensors went through the real codec, ``pack_compressed``,
    ``encode_bytes`` and ``Decoder`` (so they are views over one received buffer, as in
    production); codecs ``none``, ``fp16``, ``topk``. Each piece is also timed on its own;
(c) the memory bandwidth of this machine and the Adam rate it allows.

GB/s is "Adam bytes": 28 bytes per parameter per step (Adam reads param, grad, exp_avg,
exp_avg_sq and writes param, exp_avg, exp_avg_sq, 4 bytes each), divided by the time per
step or per apply. The swarmtrain rows use the same definition, so their GB/s ratio to the
baseline equals their rate ratio; the apply path really moves more bytes (see the notes).

Run: ``python benchmarks/bench_apply.py [--quick] [--threads 1,2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _util import Timing, interleaved, machine, md_table, report

from swarmtrain.compression import make_codec
from swarmtrain.compression.kernels import kernels
from swarmtrain.config import CoordinatorConfig, load_coordinator_config
from swarmtrain.roles.ps import coordinator as coordinator_module
from swarmtrain.roles.ps.common import fuse_dense, pack_compressed, unpack_compressed, unpack_lazy
from swarmtrain.roles.ps.coordinator import Coordinator, WorkerRecord
from swarmtrain.tasks import TextLMConfig, TextLMTask
from swarmtrain.wire import Decoder, Gradients, UpdateStatus, encode_bytes, measure
from swarmtrain.wire.pool import MIN_BYTES, PAYLOADS

#: the ~10M-parameter model: a byte-level GPT of the textlm task (10,069,120 params, 101 tensors)
MODEL = TextLMConfig(context=128, d_model=320, n_heads=8, n_layers=8)
ADAM_BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v; float32
CODECS = ("none", "fp16", "topk")
LR = 1e-3


def build_model() -> torch.nn.Module:
    return TextLMTask(MODEL).build_model(seed=0)


def fake_grads(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in model.named_parameters()}


# -------------------------------------------------------------------------------- (c) memory


class MemoryKernels:
    """Streaming kernels over ``mb`` MB float32 tensors (far beyond any cache).

    copy   c.copy_(a)   counted 2 x size (read a, write c; a write-allocate read of c, if
                        the CPU does one, is not counted, so this can understate traffic)
    rmw    a.add_(b)    counted 3 x size (read a, read b, write a): Adam's access pattern,
                        every written line was read first, so no extra write-allocate traffic
    read   a.sum()      counted 1 x size
    """

    FACTORS = {"copy": 2, "rmw": 3, "read": 1}

    def __init__(self, mb: int = 256) -> None:
        n = mb * 2**20 // 4
        self.a, self.b, self.c = torch.randn(n), torch.zeros(n), torch.empty(n)
        self.size = self.a.nbytes

    def fns(self) -> dict[str, Callable[[int], Any]]:
        a, b, c = self.a, self.b, self.c
        return {"mem copy": lambda _: c.copy_(a), "mem rmw": lambda _: a.add_(b),
                "mem read": lambda _: a.sum()}

    def result(self, t: dict[str, Timing]) -> dict[str, Any]:
        out = {}
        for k, factor in self.FACTORS.items():
            tk = t[f"mem {k}"]
            out[k] = {"GBps": factor * self.size / tk.median / 1e9,
                      "GBps_best": factor * self.size / min(tk.samples) / 1e9, **tk.to_dict()}
        return out


# -------------------------------------------------------------------------------- (a) baseline


BASELINES = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}


def adam_baseline(grads: dict[str, torch.Tensor], kind: dict[str, bool]) -> Callable[[int], Any]:
    """``opt.step`` of a plain Adam on a fresh model whose ``.grad`` are ``grads``."""
    model = build_model()
    params = list(model.parameters())
    for p, g in zip(params, grads.values()):
        p.grad = g
    opt = torch.optim.Adam(params, lr=LR, foreach=kind.get("foreach"), fused=kind.get("fused"))
    return lambda _: opt.step()


# -------------------------------------------------------------------------------- (b) swarmtrain


#: the pieces the socket hands the decoder in the receive rows (a loopback recv here returns
#: 64 KiB to a few MiB at a time)
RECV_CHUNK = 1 << 18


def gradient_frame(grads: dict[str, torch.Tensor], cfg: Any) -> bytes:
    """A worker's Gradients frame as a worker builds it: compressed by the real codec (none and
    fp16 as one entry for the whole gradient, common.fuse_dense; top-k per tensor), packed, framed."""
    c = cfg.compression
    codec = make_codec(c.type, topk_ratio=c.topk_ratio, qsgd_bits=c.qsgd_bits,
                       bucket_size=c.bucket_size, min_compress_numel=c.min_compress_numel)
    items = (fuse_dense(grads, grads, c.type, codec.compress)
             or {n: codec.compress(g) for n, g in grads.items()})
    codecs, tensors = pack_compressed(items)
    return encode_bytes(Gradients(msg_id=1, version=0, samples=32, loss=2.5, codecs=codecs,
                                  tensors=tensors))


def receive(frame: memoryview, *, measure: bool = True) -> Gradients:
    """``frame`` through a :class:`Decoder` as the coordinator's connection feeds it: the
    socket's copy into the payload buffer is a copy of RECV_CHUNK pieces here, and with
    ``measure`` (the default for GRADIENTS) each piece's sums of squares are taken after it."""
    dec = Decoder() if measure else Decoder(measure=())
    for i in range(0, len(frame), RECV_CHUNK):
        dec.feed(frame[i:i + RECV_CHUNK])
    msg = dec.next_message()
    if not isinstance(msg, Gradients):
        raise RuntimeError(f"decoded {type(msg).__name__}, expected Gradients")
    return msg


#: bytes read between the two receives of a frame (2 x the 32 MiB last-level cache here)
EVICT_BYTES = 64 << 20


@functools.cache
def _evictor() -> torch.Tensor:
    return torch.ones(EVICT_BYTES // 4)


class ApplyBench:
    """A coordinator with one registered worker, and the pieces of its apply path."""

    PIECES = ("decompress", "screen", "adam", "publish")
    RECEIVES = ("receive", "receive unmeasured", "norm after")

    def __init__(self, codec_name: str, grads: dict[str, torch.Tensor]) -> None:
        self.codec_name = codec_name
        # (the track's periodic restart is kept out of the apply: timed as `snapshot`)
        cfg = load_coordinator_config(overrides={"compression.type": codec_name,
                                                 "training.learning_rate": LR,
                                                 "training.resync_interval": 10**9})
        self.coord = Coordinator(build_model(), cfg, task_name="bench")
        self.frame = memoryview(gradient_frame(grads, cfg))
        self.rx = receive(self.frame)
        self.wire_bytes = sum(t.numel() * t.element_size() for t in self.rx.tensors.values())
        self.rec = WorkerRecord("bench", "127.0.0.1:0", {}, 32, 0.0, [0])
        self.coord.workers[self.rec.worker_id] = self.rec
        self.coord._snapshot_for(self.rec)  # what registration does: the published weights
        self._msg_id = 0
        self.sums_ms: list[float] = []  # per timed receive: the sums of squares taken on arrival
        self.grads = unpack_compressed(self.rx.codecs, self.rx.tensors, self.coord.params)
        # what the fused Adam reads: fp16 values and top-k parts as they came
        self.lazy = unpack_lazy(self.rx.codecs, self.rx.tensors, self.coord.params, whole=True)

    def close(self) -> None:
        self.coord._apply_pool.shutdown(wait=True)
        self.coord._eval_pool.shutdown(wait=True)

    def apply(self, _: int) -> None:
        """The production call; the periodic full resync is kept out (timed as ``snapshot``)."""
        self._msg_id += 1
        msg = dataclasses.replace(self.rx, msg_id=self._msg_id, version=self.coord.version)
        status, _reply = self.coord._apply_gradient(self.rec, msg)
        if status != "applied":
            raise RuntimeError(f"gradient was {status}, not applied")

    def evict(self, _: int) -> None:
        """Read a buffer twice the size of the last-level cache, so that neither receive
        starts with the frame cached by the one before it (as a frame off the socket is not):
        timed, not reported."""
        _evictor().sum()

    def receive(self, _: int) -> None:
        """The frame's receive as the coordinator's connection does it: into a payload buffer
        from the pool, the sums of squares taken piece by piece (the norm screen's pass), the
        time spent in those sums kept in ``self.sums_ms`` (timed in place: the difference of
        two whole receives is within their noise)."""
        fast = kernels()
        if fast is None:
            receive(self.frame)
            return
        spent = [0.0]

        def timed(*args: Any, inner: Callable[..., None] = fast.sumsq_ranges) -> None:
            t0 = time.perf_counter()
            inner(*args)
            spent[0] += time.perf_counter() - t0

        measure.use_kernel(timed)
        try:
            receive(self.frame)
        finally:
            measure.use_kernel(fast.sumsq_ranges)
        self.sums_ms.append(spent[0] * 1e3)

    def receive_unmeasured(self, _: int) -> None:
        """The same receive without the sums (their cost is the difference)."""
        receive(self.frame, measure=False)

    def norm_after(self, _: int) -> None:
        """The screen's norm read after the frame, as it was before the sums were taken on
        arrival (one pass over the gradient in memory)."""
        plain = dataclasses.replace(self.rx, tensors=dict(self.rx.tensors))
        if not math.isfinite(coordinator_module._gradient_norm(plain, self.grads)):
            raise RuntimeError("the benchmark gradients are finite")

    def decompress(self, _: int) -> None:
        """The unpacking the apply does: checks only for fp16 and top-k with the fused Adam
        (it decodes them in its pass), a float32 decoding otherwise."""
        if self.coord._flat_adam is not None:
            unpack_lazy(self.rx.codecs, self.rx.tensors, self.coord.params, whole=True)
        else:
            unpack_compressed(self.rx.codecs, self.rx.tensors, self.coord.params)

    def screen(self, _: int) -> None:
        """The screen ``Coordinator._refusal`` runs on the apply thread: the norm (which also
        finds NaN/Inf) from the sums taken on arrival."""
        if not math.isfinite(coordinator_module._gradient_norm(self.rx, self.grads)):
            raise RuntimeError("the benchmark gradients are finite")

    def adam(self, _: int) -> None:
        """The optimizer step of Coordinator._adam, without the publication the apply fuses
        into it (timed apart as ``publish``)."""
        if self.coord._flat_adam is not None:
            self.coord._flat_adam.step(self.lazy, LR, held=False)
            return
        for name, p in self.coord.params.items():
            p.grad = self.grads[name]
        self.coord.optimizer.param_groups[0]["lr"] = LR
        self.coord.optimizer.step()
        for p in self.coord.params.values():
            p.grad = None

    def publish(self, _: int) -> None:
        """One publication into the downlink log (the version moves, as after an update) and
        the worker's answer from it."""
        self.coord.version += 1
        self.coord._update_for(self.rec, 0, UpdateStatus.APPLIED)

    def snapshot(self, _: int) -> None:
        """What a restart of the published track costs: the published copy reset to the
        master and the full weights copied for the answers."""
        self.coord.version += 1
        self.coord.downlink.fine._reset(self.coord._flat_master(), self.coord.version)
        self.coord._full_update(self.rec, 0, UpdateStatus.APPLIED)

    def fns(self) -> dict[str, Callable[[int], Any]]:
        c = self.codec_name
        return {f"{c} apply": self.apply, f"{c} decompress": self.decompress,
                f"{c} screen": self.screen, f"{c} adam": self.adam,
                f"{c} publish": self.publish, f"{c} snapshot": self.snapshot,
                f"{c} evict 1": self.evict, f"{c} receive": self.receive,
                f"{c} evict 2": self.evict, f"{c} receive unmeasured": self.receive_unmeasured,
                f"{c} norm after": self.norm_after}

    def result(self, t: dict[str, Timing]) -> dict[str, Any]:
        c = self.codec_name
        total = t[f"{c} apply"]
        parts = {k: t[f"{c} {k}"] for k in self.PIECES}
        snapshot, delta = t[f"{c} snapshot"], parts["publish"]
        every = CoordinatorConfig().training.resync_interval  # the default
        # One apply in resync_interval sends a full snapshot instead of a delta.
        amortized = total.median + (snapshot.median - delta.median) / every
        return {
            "wire_bytes": self.wire_bytes,
            "apply": total.to_dict(),
            "apply_amortized_resync_ms": amortized * 1e3,
            "parts": {k: v.to_dict() for k, v in parts.items()},
            "receive": {k: t[f"{c} {k}"].to_dict() for k in self.RECEIVES},
            # the sums' cost on the receiving thread: with it, the coordinator's whole CPU per
            # update is this plus the receive's unavoidable copy
            "measuring_ms": statistics.median(self.sums_ms[-len(t[f"{c} receive"].samples):]),
            "other_ms": (total.median - sum(v.median for v in parts.values())) * 1e3,
            "resync_snapshot": snapshot.to_dict(),
            "resync_interval": every,
            "coordinator_adam": ("swarmtrain's fused kernel (decoding, Adam and publication in one pass)"
                                 if self.coord._flat_adam is not None else
                                 {k: self.coord.optimizer.defaults.get(k) for k in ("fused", "foreach")}),
        }


# -------------------------------------------------------------------------------- driver


def run(threads: list[int], rounds: int, warmup: int) -> dict[str, Any]:
    model = build_model()
    nparams = sum(p.numel() for p in model.parameters())
    ntensors = len(list(model.parameters()))
    grads = fake_grads(model)
    del model
    adam_bytes = ADAM_BYTES_PER_PARAM * nparams
    result: dict[str, Any] = {
        "machine": machine(), "rounds": rounds, "warmup": warmup,
        "model": {"kind": "TextLM (swarmtrain.tasks.textlm)", "config": dataclasses.asdict(MODEL),
                  "params": nparams, "tensors": ntensors},
        "adam_bytes_per_step": adam_bytes, "by_threads": {},
    }
    for th in threads:
        torch.set_num_threads(th)
        print(f"-- {th} thread(s): setting up", flush=True)
        mem = MemoryKernels()
        fns = dict(mem.fns())
        for label, kind in BASELINES.items():
            fns[f"adam {label}"] = adam_baseline(grads, kind)
        benches = [ApplyBench(c, grads) for c in CODECS]
        for b in benches:
            fns.update(b.fns())
        t0 = time.perf_counter()

        def progress(r: int, t0: float = t0) -> None:
            print(f"   round {r + 1}/{rounds} ({time.perf_counter() - t0:.0f} s)", flush=True)

        timings = interleaved(fns, rounds, warmup, progress=progress)
        r: dict[str, Any] = {"membw": mem.result(timings), "loadavg_after": os.getloadavg()}
        r["adam_bound_steps_per_s"] = r["membw"]["rmw"]["GBps"] * 1e9 / adam_bytes
        r["baseline"] = {label: timings[f"adam {label}"].to_dict() for label in BASELINES}
        r["swarmtrain"] = {b.codec_name: b.result(timings) for b in benches}
        for b in benches:
            b.close()
        del benches, fns, mem
        gc.collect()
        result["by_threads"][str(th)] = r
    return result


def to_markdown(res: dict[str, Any]) -> str:
    m = res["model"]
    per_step = res["adam_bytes_per_step"]
    adam_kind = next(iter(next(iter(res["by_threads"].values()))["swarmtrain"].values()))[
        "coordinator_adam"]
    out = [
        "## Coordinator apply rate (`benchmarks/bench_apply.py`)",
        "",
        f"Model: TextLM {m['config']}: **{m['params']:,} parameters** in {m['tensors']} tensors. "
        f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, torch "
        f"{res['machine']['torch']}. All measurements of one thread count are interleaved: "
        f"{res['rounds']} rounds, each timing every operation once in turn (after "
        f"{res['warmup']} warm-up calls each), so background load hits all of them alike; "
        "figures are medians. Load average at start: "
        f"{' / '.join(f'{x:.2f}' for x in res['machine']['loadavg'])} (this machine is shared).",
        "",
        f"GB/s = Adam bytes per step / time: 28 B/param (read p, g, m, v; write p, m, v) = "
        f"{per_step / 1e6:.0f} MB per step or apply. \"vs foreach\" / \"vs fused\" = rate / "
        "the plain torch Adam rate (foreach=True / fused=True) at the same thread count. "
        "\"of bound\" = rate / (read-modify-write memory bandwidth / 28 B per param). "
        f"The coordinator's own optimizer in this run: Adam {adam_kind}.",
        "",
    ]
    for th, r in res["by_threads"].items():
        ref = r["baseline"]["foreach"]["median_ms"]
        ref_fused = r["baseline"]["fused"]["median_ms"]
        bound = r["adam_bound_steps_per_s"]
        rows: list[list[Any]] = []
        for label, t in r["baseline"].items():
            rate = 1e3 / t["median_ms"]
            rows.append([f"torch Adam {label}", "-", t["median_ms"], rate, per_step * rate / 1e9,
                         ref / t["median_ms"], ref_fused / t["median_ms"], rate / bound])
        for codec, s in r["swarmtrain"].items():
            # the apply thread's call plus the sums of squares the receiving thread took (the
            # screen's pass, moved to arrival): every check the update pays for
            ms = s["apply"]["median_ms"] + max(0.0, s.get("measuring_ms", 0.0))
            rate = 1e3 / ms
            rows.append([f"swarmtrain apply, {codec}", f"{s['wire_bytes'] / 1e6:.1f}", ms, rate,
                         per_step * rate / 1e9, ref / ms, ref_fused / ms, rate / bound])
        mb = r["membw"]
        out += [
            f"### {th} thread(s)",
            "",
            f"Memory bandwidth: copy {mb['copy']['GBps']:.1f} GB/s, read-modify-write "
            f"(`a.add_(b)`, 3 x size) {mb['rmw']['GBps']:.1f} GB/s (best call "
            f"{mb['rmw']['GBps_best']:.1f}), read {mb['read']['GBps']:.1f} GB/s. Adam bound: "
            f"{mb['rmw']['GBps']:.1f} GB/s / {per_step / 1e6:.0f} MB = **{bound:.0f} steps/s**. "
            f"Load average after: {' / '.join(f'{x:.2f}' for x in r['loadavg_after'])}.",
            "",
            md_table(["what", "gradient MB on wire", "ms", "per s", "GB/s", "vs foreach",
                      "vs fused", "of bound"], rows),
            "",
            "Split of the apply (each piece timed on its own, same tensors; ms):",
            "",
        ]
        split_rows = []
        for codec, s in r["swarmtrain"].items():
            p = s["parts"]
            split_rows.append([
                codec, s["apply"]["median_ms"], p["decompress"]["median_ms"],
                p["screen"]["median_ms"], p["adam"]["median_ms"],
                p["publish"]["median_ms"], s["other_ms"],
                s["resync_snapshot"]["median_ms"], s["apply_amortized_resync_ms"],
            ])
        out += [
            md_table(["codec", "apply", "decompress", "norm screen", "Adam", "publish + answer",
                      "rest", "track restart", "apply incl. restart"], split_rows),
            "",
        ]
        recv_rows = []
        for codec, s in r["swarmtrain"].items():
            rc = s.get("receive")
            if rc:
                recv_rows.append([codec, rc["receive unmeasured"]["median_ms"], rc["receive"]["median_ms"],
                                  s["measuring_ms"], rc["norm after"]["median_ms"],
                                  s["apply"]["median_ms"], s["apply"]["median_ms"] + s["measuring_ms"]])
        if recv_rows:
            out += [
                f"Receiving the gradient (the frame fed to the decoder in {RECV_CHUNK >> 10} KiB "
                "pieces, each copied in as the socket would, the frame out of cache before each "
                "receive; \"sums on arrival\" is the time inside the sums' kernel during the "
                "measured receive, not the difference of the two receives; ms):",
                "",
                md_table(["codec", "receive, pooled buffer", "receive, pooled + sums on arrival",
                          "sums on arrival", "the same norm read after the frame (before)",
                          "apply", "apply + sums on arrival"], recv_rows),
                "",
            ]
    quiet = res.get("quiet_receive")
    if quiet:
        out += [
            "### The receive in a process that does nothing else",
            "",
            "A coordinator's event loop does little but receive, so the allocator rarely has a freed "
            "40 MB block at hand: each codec's payload size received 9 times in a new process into a new "
            "buffer per frame (as before the pool) and into the pool (medians; page faults per frame).",
            "",
            md_table(["codec", "payload MB", "new buffer per frame ms", "page faults", "pooled ms",
                      "page faults (pooled)"],
                     [[c, q["nbytes"] / 1e6, q["fresh"]["median_ms"], q["fresh"]["page_faults"],
                       q["pooled"]["median_ms"], q["pooled"]["page_faults"]] for c, q in quiet.items()]),
            "",
        ]
    every = next(iter(next(iter(res['by_threads'].values()))['swarmtrain'].values()))['resync_interval']
    out += [
        "Notes: \"publish + answer\" is one publication into the shared downlink log (the "
        "compressed change since the last one, encoded once whatever the number of workers) "
        "and the answer to one worker from it; with a lossless downlink it is the copy of the "
        "weights every answer of that version shares, with fp16's half downlink the weights rounded "
        "to float16 (timed apart, outside the step: the copy a joining worker or a window step "
        "gets; in the apply the step writes it). With fp16 and no compression the gradient is one "
        "fused entry, as a worker sends it. The apply rows keep the periodic restart "
        f"of the published track (every `resync_interval` = {every} publications) out of the "
        "timed call; \"apply incl. restart\" adds it back amortized (apply + (restart - publish) "
        "/ resync_interval). \"rest\" is apply minus the four pieces (bookkeeping and noise). "
        "With swarmtrain's fused Adam kernel (the coordinator's optimizer line above) the apply "
        "does not run the pieces one after the other: \"decompress\" only checks fp16 and top-k "
        "gradients (the kernel reads float16 values and top-k parts as they came), and the "
        "publication is made in Adam's pass: the new weights rounded to float16 (fp16's half "
        "downlink), or with no compression the copy the answers share, in the step's own loop "
        "from the weights in "
        "registers; the uniform coding (top-k's downlink) in a pass of its own after the step; "
        "\"Adam\" and \"publish + answer\" are timed apart, so \"rest\" is negative by what the "
        "fusion saves. The swarmtrain rows of the first table are the apply **plus** the sums of "
        "squares taken as the gradient arrived (on the receiving thread, while the pieces are in "
        "cache: the norm screen's pass, which \"norm screen\" then only adds up); the receive "
        "itself (the copy off the socket) is in no Adam baseline and in no row there, and is "
        "given in the receive tables. A new buffer per frame (before the pool) is timed only in "
        "a process that does nothing else: here, where large temporaries are freed all the "
        "time, glibc mostly hands a 40 MB request memory it kept, which a coordinator's event "
        "loop seldom has (bench_scale.py: 64 ms per none update before the pool, 24-40 after).",
    ]
    return "\n".join(out)


def receive_in_a_quiet_process(nbytes: int, calls: int = 9) -> dict[str, Any]:
    """The receive of an ``nbytes`` float32 payload timed in a new process that does nothing
    else, as a coordinator's event loop does little else: into a new buffer per frame (before
    the pool) and into the pool; medians in ms and page faults per frame."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--receive-child", str(nbytes), "--calls", str(calls)],
                         capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _receive_child(nbytes: int, calls: int) -> None:
    import json
    import resource

    from swarmtrain.core.hardware import tune_allocator

    tune_allocator()
    frame = memoryview(encode_bytes(Gradients(
        msg_id=1, version=0, samples=1, loss=1.0, codecs={},
        tensors={"g/values": torch.randn(nbytes // 4)})))
    res: dict[str, Any] = {"nbytes": nbytes}
    for label, floor in (("fresh", 1 << 62), ("pooled", MIN_BYTES)):
        PAYLOADS.min_bytes = floor
        receive(frame, measure=False)  # (warm)
        times, before = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            t0 = time.perf_counter()
            receive(frame, measure=False)
            times.append(time.perf_counter() - t0)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
        res[label] = {"median_ms": sorted(times)[calls // 2] * 1e3, "page_faults": faults}
    print(json.dumps(res))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    ap.add_argument("--receive-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=9, help=argparse.SUPPRESS)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=0, help="timed calls per operation")
    args = ap.parse_args(argv)
    if args.receive_child:
        _receive_child(args.receive_child, args.calls)
        return 0
    from swarmtrain.core.hardware import tune_allocator

    tune_allocator()  # as every `swarmtrain` command does at start-up
    threads = [int(x) for x in args.threads.split(",") if x]
    rounds = args.rounds or (4 if args.quick else 30)
    warmup = 1 if args.quick else 2
    start = time.perf_counter()
    res = run(threads, rounds, warmup)
    res["quiet_receive"] = {c: receive_in_a_quiet_process(s["wire_bytes"])
                            for c, s in next(iter(res["by_threads"].values()))["swarmtrain"].items()}
    res["seconds"] = time.perf_counter() - start
    report("apply", res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
