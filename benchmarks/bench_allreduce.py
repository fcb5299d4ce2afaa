"""All-reduce: swarmtrain's ring (``swarmtrain.peer.ring``) against torch.distributed gloo,
side by side in the same processes on the same tensors.

Two settings:

- **loopback**: W = 2, 3, 4 processes on 127.0.0.1, a 100 MB float32 tensor (``--quick``:
  25 MB), SUM. The bar: our bus bandwidth >= 0.8x gloo's.
- **simulated LAN**: one process per host on a :class:`~swarmtrain.testing.SimulatedLAN`
  (network namespaces, needs root), every host's link limited to 100 Mbit/s each way (tbf),
  4 hosts (``--quick``: 3), a 16 MB tensor (``--quick``: 4 MB). gloo fp32 vs ours with the
  fp32, fp16 and int8 wire formats; gloo runs inside the namespaces too (its store and
  rendezvous on host 0's address). The bar: ours int8 >= 3x faster than gloo fp32.

Both settings also run our ring with TLS on (``swarmtrain keys`` certificates, mutual TLS on
every ring link, a second ring in the same processes): what encryption costs on loopback
(CPU-bound) and whether it still fills a 100 Mbit/s link.

Figures: bus bandwidth = 2 (W-1)/W x tensor bytes / time (the per-member traffic of a ring
all-reduce of fp32 data, whatever is actually on the wire, so compressed formats can beat
the link). The limit on the LAN is the link: 100 Mbit/s = 12.5 MB/s of fp32 bus bandwidth
(x2 for fp16, x4 for int8, less the frame headers). Per round, each method runs once after a
gloo barrier (who goes first alternates); a round's time for a method is the slowest
member's; medians over rounds. Ratios to gloo are paired: the median over rounds of the two
times measured back to back in that round, so background load hits both alike.

Run: ``python benchmarks/bench_allreduce.py [--quick] [--skip-lan]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _util import machine, md_table, write_results

HERE = Path(__file__).resolve()
SECRET = b"bench-allreduce"
LAN_RATE_MBIT = 100.0
LAN_STORE_PORT = 29500  # inside our own namespaces: nothing else listens there


# --- one member (a separate process) ---------------------------------------------------


def member(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from swarmtrain.peer.ring import RingGroup, RingListener
    from swarmtrain.transport.tls import TLSConfig

    torch.set_num_threads(1)  # W processes share 2 cores; gloo reduces on one thread too
    host, port = args.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(host, int(port), args.world, args.rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=args.rank,
                            world_size=args.world, timeout=timeout)
    listener = RingListener(args.bind, 0, secret=SECRET)
    store.set(f"ring/{args.rank}", f"{args.bind}:{listener.address[1]}")
    addresses = []
    for r in range(args.world):
        h, p = store.get(f"ring/{r}").decode().rsplit(":", 1)
        addresses.append((h, int(p)))
    group = RingGroup(listener, args.rank, addresses, ring_id="bench", epoch=1, secret=SECRET, timeout=60.0)
    tls_group = tls_listener = None
    if args.tls_dir:
        d = Path(args.tls_dir)
        tls = TLSConfig(cert=d / f"r{args.rank}.pem", key=d / f"r{args.rank}-key.pem", ca=d / "ca.pem")
        tls_listener = RingListener(args.bind, 0, secret=SECRET, tls=tls)
        store.set(f"ringtls/{args.rank}", f"{args.bind}:{tls_listener.address[1]}")
        tls_addresses = []
        for r in range(args.world):
            h, p = store.get(f"ringtls/{r}").decode().rsplit(":", 1)
            tls_addresses.append((h, int(p)))
        tls_group = RingGroup(tls_listener, args.rank, tls_addresses, ring_id="bench-tls", epoch=1,
                              secret=SECRET, timeout=60.0, tls=tls)
    gen = torch.Generator().manual_seed(1234 + args.rank)
    source = torch.randn(args.numel, generator=gen)
    work = torch.empty_like(source)

    def gloo_fp32() -> None:
        dist.all_reduce(work)

    methods: dict[str, Any] = {"gloo fp32": gloo_fp32}
    for wire in args.wires.split(","):
        methods[f"ours {wire}"] = lambda wire=wire: group.all_reduce(work, wire=wire)
    if tls_group is not None:
        for wire in args.tls_wires.split(","):
            methods[f"ours {wire} TLS"] = lambda wire=wire: tls_group.all_reduce(work, wire=wire)
    samples: dict[str, list[list[float]]] = {name: [] for name in methods}
    order = list(methods.items())
    for r in range(args.warmup + args.rounds):
        for name, fn in order if r % 2 else order[::-1]:  # alternate who goes first
            work.copy_(source)
            dist.barrier()
            c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            fn()
            dt, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            if r >= args.warmup:
                samples[name].append([dt, c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime])
    group.close()
    listener.close()
    if tls_group is not None and tls_listener is not None:
        tls_group.close()
        tls_listener.close()
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(samples), flush=True)


# --- the driver ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member_argv(rank: int, world: int, store: str, bind: str, numel: int, rounds: int, warmup: int,
                 wires: str, tls_dir: str, tls_wires: str) -> list[str]:
    return [sys.executable, str(HERE), "--member", "--rank", str(rank), "--world", str(world),
            "--store", store, "--bind", bind, "--numel", str(numel), "--rounds", str(rounds),
            "--warmup", str(warmup), "--wires", wires, "--tls-dir", tls_dir, "--tls-wires", tls_wires]


def _cluster_keys(directory: Path, members: int) -> str:
    """Certificates ``r0`` .. ``r<members-1>`` of one cluster CA, for the TLS rings."""
    from swarmtrain.transport.tls import generate_cluster_keys

    generate_cluster_keys(directory, [f"r{i}" for i in range(members)])
    return str(directory)


def _collect(procs: list[subprocess.Popen[bytes]], timeout: float) -> dict[str, list[tuple[float, float]]]:
    """Wait for the members; per method and round, the slowest member's time and the CPU
    time of all members."""
    per_rank = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"a member did not finish within {timeout:g} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"a member failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
        line = [x for x in out.decode().splitlines() if x.startswith("RESULT ")][-1]
        per_rank.append(json.loads(line.removeprefix("RESULT ")))
    return {name: [(max(rank[name][i][0] for rank in per_rank), sum(rank[name][i][1] for rank in per_rank))
                   for i in range(len(per_rank[0][name]))] for name in per_rank[0]}


def _summary(
    samples: dict[str, list[tuple[float, float]]], world: int, nbytes: int
) -> dict[str, dict[str, float]]:
    bus = 2 * (world - 1) / world * nbytes
    out = {}
    gloo = [t for t, _ in samples["gloo fp32"]]
    for name, rounds in samples.items():
        times = [t for t, _ in rounds]
        med = statistics.median(times)
        out[name] = {"median_s": med, "min_s": min(times), "max_s": max(times), "n": len(times),
                     "bus_GBps": bus / med / 1e9, "cpu_s": statistics.median(c for _, c in rounds),
                     # paired: this method and gloo ran back to back in each round, under the same load
                     "speed_vs_gloo": statistics.median(g / t for g, t in zip(gloo, times))}
    return out


def run_loopback(worlds: list[int], numel: int, rounds: int, warmup: int, keys: str) -> dict[int, Any]:
    results = {}
    for world in worlds:
        store = f"127.0.0.1:{_free_port()}"
        procs = [subprocess.Popen(_member_argv(r, world, store, "127.0.0.1", numel, rounds, warmup, "fp32",
                                               keys, "fp32"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
        results[world] = _summary(_collect(procs, 900), world, 4 * numel)
        g, o, t = (results[world][k] for k in ("gloo fp32", "ours fp32", "ours fp32 TLS"))
        print(f"loopback W={world}: gloo {g['bus_GBps']:.2f} GB/s, ours {o['bus_GBps']:.2f} GB/s, "
              f"ratio {o['speed_vs_gloo']:.2f}; ours with TLS {t['bus_GBps']:.2f} GB/s", flush=True)
    return results


def run_lan(hosts: int, numel: int, rounds: int, warmup: int, keys: str) -> dict[str, Any]:
    from swarmtrain.testing import SimulatedLAN

    with SimulatedLAN(hosts, rate_mbit=LAN_RATE_MBIT) as lan:
        store = f"{lan.hosts[0].address}:{LAN_STORE_PORT}"
        procs = [h.run(_member_argv(r, hosts, store, h.address, numel, rounds, warmup, "fp32,fp16,int8",
                                    keys, "fp32,int8"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(HERE.parent.parent),
                       env={"GLOO_SOCKET_IFNAME": "eth0"})  # gloo binds the LAN interface
                 for r, h in enumerate(lan.hosts)]
        summary = _summary(_collect(procs, 900), hosts, 4 * numel)
    for name, s in summary.items():
        print(f"LAN {name}: {s['median_s']:.2f} s, bus {s['bus_GBps'] * 1e3:.1f} MB/s", flush=True)
    return summary


def _loopback_section(loop: dict[int, Any], numel: int, rounds: int, data: dict[str, Any]) -> list[str]:
    rows, worst = [], float("inf")
    for world, s in loop.items():
        g, o, t = s["gloo fp32"], s["ours fp32"], s["ours fp32 TLS"]
        ratio = o["speed_vs_gloo"]
        worst = min(worst, ratio)
        cells = [[f"{m['median_s'] * 1e3:.0f} ms", f"{m['bus_GBps']:.2f}", f"{m['cpu_s'] * 1e3:.0f} ms"]
                 for m in (g, o)]
        rows.append([world, *cells[0], *cells[1], f"{ratio:.2f}x", f"{t['bus_GBps']:.2f}",
                     f"{o['median_s'] / t['median_s']:.2f}x"])
    bar = "PASS" if worst >= 0.8 else "FAIL"
    data["loopback"] = {"numel": numel, "rounds": rounds, "results": loop, "worst_ratio": worst, "bar": bar}
    return [
        f"Loopback, {4 * numel / 1e6:.0f} MB float32 SUM, one process per member on this "
        f"{os.cpu_count()}-core machine, medians of {rounds} rounds (a round's time = its slowest "
        "member); bus bandwidth = 2(W-1)/W x bytes / time; CPU = user + system time of all members "
        "per all-reduce; ours / gloo = median over rounds of gloo's time / ours in the same round "
        "(paired: load that comes and goes hits both). The limit here is the CPU, not a link: "
        "every byte is copied into and out of the kernel and added, and W processes share the "
        "cores; gloo on the same tensors is the yardstick. \"ours TLS\": the same ring with every "
        "link in mutual TLS (TLS / plain = speed relative to ours without it, from the medians).",
        "",
        md_table(["W", "gloo time", "gloo GB/s", "gloo CPU", "ours time", "ours GB/s", "ours CPU",
                  "ours / gloo", "ours TLS GB/s", "TLS / plain"], rows),
        "",
        f"Bar ours >= 0.8x gloo at every W: **{bar}** (worst {worst:.2f}x).",
        "",
    ]


def _lan_section(lan: dict[str, Any], hosts: int, numel: int, rounds: int, data: dict[str, Any]) -> list[str]:
    link = LAN_RATE_MBIT * 1e6 / 8
    rows = []
    for name, s in lan.items():
        factor = {"fp16": 2, "int8": 4}.get(name.split()[1], 1) if name.startswith("ours") else 1
        limit = 2 * (hosts - 1) / hosts * 4 * numel / (link * factor)
        rows.append([name, f"{s['median_s']:.2f} s", f"{s['bus_GBps'] * 1e3:.1f}",
                     f"{s['speed_vs_gloo']:.2f}x", f"{limit:.2f} s", f"{limit / s['median_s']:.0%}"])
    speedup = lan["ours int8"]["speed_vs_gloo"]
    bar = "PASS" if speedup >= 3 else "FAIL"
    data["lan"] = {"hosts": hosts, "numel": numel, "rate_mbit": LAN_RATE_MBIT, "rounds": rounds,
                   "results": lan, "int8_speedup": speedup, "bar": bar}
    return [
        f"Simulated LAN: {hosts} hosts (network namespaces on a bridge), each link {LAN_RATE_MBIT:.0f} "
        f"Mbit/s each way (tbf), {4 * numel / 1e6:.0f} MB float32 SUM, one process per host, gloo "
        f"and ours in the same processes, medians of {rounds} rounds (speed-ups paired per round). "
        "Limit = the link: "
        "2(W-1)/W x payload bytes / 12.5 MB/s (fp32 payload; half for fp16, a quarter for int8).",
        "",
        md_table(["method", "time", "bus MB/s (fp32-equivalent)", "speed-up vs gloo fp32", "link limit",
                  "of limit"], rows),
        "",
        f"Bar ours int8 >= 3x faster than gloo fp32: **{bar}** ({speedup:.2f}x).",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller tensors, fewer rounds")
    ap.add_argument("--skip-lan", action="store_true", help="loopback only (the LAN part needs root)")
    ap.add_argument("--skip-loopback", action="store_true", help="the simulated LAN part only")
    ap.add_argument("--worlds", default="2,3,4", help="loopback world sizes")
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--numel", "--rounds", "--warmup"):
        ap.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--store", "--bind", "--wires", "--tls-dir", "--tls-wires"):
        ap.add_argument(name, default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.member:
        member(args)
        return 0

    from swarmtrain.testing import netns_available

    numel = (25 if args.quick else 100) * 1_000_000 // 4
    rounds, warmup = (4, 1) if args.quick else (12, 2)
    worlds = [int(w) for w in args.worlds.split(",")]
    lan_ok, why = netns_available()
    lan_hosts, lan_numel = (3, 1_000_000) if args.quick else (4, 4_000_000)
    lan_rounds = 2 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-keys-") as tmp:
        keys = _cluster_keys(Path(tmp), max([*worlds, lan_hosts]))
        loop = {} if args.skip_loopback else run_loopback(worlds, numel, rounds, warmup, keys)
        lan = None if args.skip_lan or not lan_ok else run_lan(lan_hosts, lan_numel, lan_rounds, 1, keys)

    md = ["## All-reduce: swarmtrain ring vs torch.distributed gloo (`benchmarks/bench_allreduce.py`)", ""]
    data: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    if loop:
        md += _loopback_section(loop, numel, rounds, data)
    if lan is not None:
        md += _lan_section(lan, lan_hosts, lan_numel, lan_rounds, data)
    else:
        md += [f"Simulated LAN part skipped: {'--skip-lan' if args.skip_lan else why}.", ""]
    j, m = write_results("allreduce", data, "\n".join(md))
    print("\n".join(md))
    print(f"wrote {j} and {m}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
