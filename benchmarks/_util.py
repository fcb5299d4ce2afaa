"""Helpers shared by the benchmarks: timing, machine description, result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "Timing", "interleaved", "machine", "md_table", "time_calls", "write_results"]


class Timing:
    """Per-call wall times of one measured operation (seconds)."""

    def __init__(self, samples: Sequence[float]) -> None:
        if not samples:
            raise ValueError("no timing samples")
        self.samples = list(samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    def quantile(self, q: float) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    def to_dict(self) -> dict[str, float]:
        return {"median_ms": self.median * 1e3, "mean_ms": self.mean * 1e3,
                "p10_ms": self.quantile(0.1) * 1e3, "p90_ms": self.quantile(0.9) * 1e3,
                "n": len(self.samples)}


def time_calls(fn: Callable[[int], Any], iters: int, warmup: int) -> Timing:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``iters`` times timed one by one."""
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(warmup, warmup + iters):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return Timing(out)


def interleaved(
    fns: dict[str, Callable[[int], Any]], rounds: int, warmup: int, per_round: int = 1,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Timing]:
    """Time every function of ``fns`` in turn, ``rounds`` times (``per_round`` calls each).

    Interleaving puts the same background load on every measurement (this machine is shared
    with other work), so ratios between them stay meaningful when absolute times move.
    """
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    i = warmup
    for r in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn(i)
                samples[name].append(time.perf_counter() - t0)
                i += 1
        if progress is not None:
            progress(r)
    return {name: Timing(s) for name, s in samples.items()}


def machine_jiffies() -> tuple[int, int, int]:
    """(busy, total, stolen) jiffies of all CPUs from /proc/stat; stolen = the time the
    hypervisor ran something else while this virtual machine had work (counted in busy)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    total = sum(vals[:8])
    return total - idle, total, vals[7]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "loadavg": os.getloadavg(),
            "torch": torch.__version__, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``results/NAME.json`` and ``results/NAME.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    j, m = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    j.write_text(json.dumps(data, indent=2, default=str) + "\n")
    m.write_text(markdown.rstrip() + "\n")
    return j, m


def report(name: str, data: dict[str, Any], markdown: str) -> None:
    """Write ``results/NAME.{json,md}`` (:func:`write_results`), print the markdown and where
    it went, with ``data["seconds"]`` (the run's duration)."""
    j, m = write_results(name, data, markdown)
    print()
    print(markdown)
    print(f"\nwrote {j} and {m} in {data['seconds']:.0f} s")


def toml_section(name: str, keys: dict[str, Any]) -> str:
    """A ``[name]`` TOML section of ``keys``: strings, numbers and booleans, each written as
    JSON writes it, which TOML reads the same (``true``, not Python's ``True``)."""
    return f"\n[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())


def compression_toml(keys: dict[str, Any]) -> str:
    """A ``[compression]`` TOML section of ``keys``."""
    return toml_section("compression", keys)


def wait_files(paths: list[Path], timeout: float, what: str, procs: Sequence[Any]) -> None:
    """Wait until every file of ``paths`` exists; exit saying ``what`` was not ready once
    ``timeout`` seconds passed or a process of ``procs`` (Popen) exited first."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not ready in {timeout:.0f} s ({sum(p.exists() for p in paths)} "
                             f"of {len(paths)})")
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise SystemExit(f"{what}: a process exited ({dead[0].args[-12:]}, code {dead[0].returncode})")
        time.sleep(0.2)
