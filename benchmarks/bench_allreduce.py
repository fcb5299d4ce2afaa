"""All-reduce: swarmtrain's public ``PeerBackend.all_reduce``, the ring inside it
(``swarmtrain.roles.peer.ring.RingGroup``) and torch.distributed gloo, side by side in the same
processes on the same tensors.

Each member process starts a real :class:`~swarmtrain.roles.peer.backend.PeerBackend` (static
peers, no mDNS, a shared secret) next to a gloo process group, and times, per round:

- ``gloo``: ``dist.all_reduce``;
- ``ring``: the backend's current ring, ``backend._current_ring().all_reduce`` (in place);
- ``api``: ``backend.all_reduce(t, op="sum")`` as a user calls it (the defaults: the round
  boundary, up to 5 retries, so the reduce-scatter keeps the input intact until every member
  has joined);
- ``api trainer``: the CLI trainer's call, ``retries=0, boundary=False, check_finite=True``;
- ``api TLS``: ``all_reduce`` of a second backend whose control and ring links use mutual TLS
  (``swarmtrain keys`` certificates).

Two settings:

- **loopback**: W = 2, 3, 4 processes on 127.0.0.1, a 100 MB float32 tensor (``--quick``:
  25 MB), SUM. The bars: the API >= 0.9x the ring and >= gloo's bus bandwidth.
- **simulated LAN**: one process per host on a :class:`~swarmtrain.testing.SimulatedLAN`
  (network namespaces, needs root), every host's link limited to 100 Mbit/s each way (tbf),
  4 hosts (``--quick``: 3), a 16 MB tensor (``--quick``: 4 MB). gloo fp32 vs the API with
  the fp32, fp16 and int8 wire formats (and the ring in fp32); gloo runs inside the
  namespaces too (its store and rendezvous on host 0's address). The bar: the API in int8
  >= 3x faster than gloo fp32.

Figures: bus bandwidth = 2 (W-1)/W x tensor bytes / time (the per-member traffic of a ring
all-reduce of fp32 data, whatever is actually on the wire, so compressed formats can beat
the link). The limit on the LAN is the link: 100 Mbit/s = 12.5 MB/s of fp32 bus bandwidth
(x2 for fp16, x4 for int8, less the frame headers). Per round, each method runs once after a
gloo barrier (who goes first alternates); a round's time for a method is the slowest
member's; medians over rounds. Ratios are paired: the median over rounds of the two times
measured in that round, so background load hits both alike.

Run: ``python benchmarks/bench_allreduce.py [--quick] [--skip-lan]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _util import machine, md_table, write_results

from swarmtrain.testing.local import free_ports

HERE = Path(__file__).resolve()
SECRET = b"bench-allreduce"
LAN_RATE_MBIT = 100.0
LAN_STORE_PORT = 29500  # inside our own namespaces: nothing else listens there
LAN_CONTROL_PORT = 7200  # the backends' control ports there (the TLS one: the next)


# --- one member (a separate process) ---------------------------------------------------


def _backend(args: argparse.Namespace, peers: str, run: str, tls: Any) -> Any:
    """This member's started PeerBackend of `run`; `peers`: every member's control address
    (``host:port``, by rank), this one's included."""
    from swarmtrain.roles.peer.backend import PeerBackend, PeerOptions
    from swarmtrain.transport.identity import Identity

    addresses = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in peers.split(","))]
    host, port = addresses[args.rank]
    options = PeerOptions(run=run, min_peers=args.world, host=host, port=port, mdns=False,
                          static_peers=tuple(a for i, a in enumerate(addresses) if i != args.rank),
                          ring_timeout_sec=60.0, reform_timeout_sec=60.0)
    backend = PeerBackend(options, secret=SECRET, identity=Identity.generate(), tls=tls)
    backend.start()
    backend.wait_for_peers(args.world - 1, timeout=60)
    return backend


def member(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from swarmtrain.transport.tls import TLSConfig

    torch.set_num_threads(1)  # W processes share 2 cores; gloo reduces on one thread too
    host, port = args.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(host, int(port), args.world, args.rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=args.rank,
                            world_size=args.world, timeout=timeout)
    backends = {"": _backend(args, args.peers, "bench", None)}
    if args.tls_dir:
        d = Path(args.tls_dir)
        tls = TLSConfig(cert=d / f"r{args.rank}.pem", key=d / f"r{args.rank}-key.pem", ca=d / "ca.pem")
        backends[" TLS"] = _backend(args, args.tls_peers, "bench-tls", tls)
    dist.barrier()
    for b in backends.values():  # every member at once: the first epoch waits for all of them
        b.refresh(timeout=120)
        if b.world_size != args.world:
            raise RuntimeError(f"the first epoch has {b.world_size} members, not {args.world}")
    plain = backends[""]
    gen = torch.Generator().manual_seed(1234 + args.rank)
    source = torch.randn(args.numel, generator=gen)
    work = torch.empty_like(source)

    def gloo_fp32() -> None:
        dist.all_reduce(work)

    methods: dict[str, Any] = {"gloo fp32": gloo_fp32,
                               "ring fp32": lambda: plain._current_ring().all_reduce(work)}
    for wire in args.wires.split(","):
        methods[f"api {wire}"] = lambda wire=wire: plain.all_reduce(work, op="sum", wire=wire)
    if args.trainer:
        methods["api fp32 trainer"] = lambda: plain.all_reduce(work, op="sum", retries=0, boundary=False,
                                                               check_finite=True)
    if " TLS" in backends:
        secure = backends[" TLS"]
        for wire in args.tls_wires.split(","):
            methods[f"api {wire} TLS"] = lambda wire=wire: secure.all_reduce(work, op="sum", wire=wire)
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
    epochs = {name: b.epoch for name, b in backends.items()}
    dist.barrier()
    for b in backends.values():
        b.close()
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"samples": samples, "epochs": epochs}), flush=True)


# --- the driver ------------------------------------------------------------------------




def _member_argv(rank: int, world: int, store: str, peers: list[str], tls_peers: list[str], numel: int,
                 rounds: int, warmup: int, wires: str, tls_dir: str, tls_wires: str,
                 trainer: bool) -> list[str]:
    return [sys.executable, str(HERE), "--member", "--rank", str(rank), "--world", str(world),
            "--store", store, "--peers", ",".join(peers), "--tls-peers", ",".join(tls_peers),
            "--numel", str(numel), "--rounds", str(rounds), "--warmup", str(warmup), "--wires", wires,
            "--tls-dir", tls_dir, "--tls-wires", tls_wires, *(["--trainer"] if trainer else [])]


def _cluster_keys(directory: Path, members: int) -> str:
    """Certificates ``r0`` .. ``r<members-1>`` of one cluster CA, for the TLS rings."""
    from swarmtrain.transport.tls import generate_cluster_keys

    generate_cluster_keys(directory, [f"r{i}" for i in range(members)])
    return str(directory)


def _collect(procs: list[subprocess.Popen[bytes]], timeout: float) -> dict[str, list[tuple[float, float]]]:
    """Wait for the members; per method and round, the slowest member's time and the CPU
    time of all members. Every member must have stayed in its first epoch (no re-forming
    inside a measurement)."""
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
    epochs = {json.dumps(r["epochs"], sort_keys=True) for r in per_rank}
    if len(epochs) != 1:
        raise RuntimeError(f"the members ended in different epochs: {sorted(epochs)}")
    samples = [r["samples"] for r in per_rank]
    return {name: [(max(rank[name][i][0] for rank in samples), sum(rank[name][i][1] for rank in samples))
                   for i in range(len(samples[0][name]))] for name in samples[0]}


def _summary(
    samples: dict[str, list[tuple[float, float]]], world: int, nbytes: int
) -> dict[str, dict[str, float]]:
    bus = 2 * (world - 1) / world * nbytes
    out = {}
    times = {name: [t for t, _ in rounds] for name, rounds in samples.items()}
    for name, rounds in samples.items():
        med = statistics.median(times[name])
        out[name] = {"median_s": med, "min_s": min(times[name]), "max_s": max(times[name]), "n": len(rounds),
                     "bus_GBps": bus / med / 1e9, "cpu_s": statistics.median(c for _, c in rounds)}
        # paired: this method and the other ran in the same round, under the same load
        for other, key in (("gloo fp32", "speed_vs_gloo"), ("ring fp32", "speed_vs_ring")):
            out[name][key] = statistics.median(o / t for o, t in zip(times[other], times[name]))
    return out


def run_loopback(worlds: list[int], numel: int, rounds: int, warmup: int, keys: str) -> dict[int, Any]:
    results = {}
    for world in worlds:
        store_port, *ports = free_ports(1 + 2 * world)
        store = f"127.0.0.1:{store_port}"
        peers = [f"127.0.0.1:{p}" for p in ports[:world]]
        tls_peers = [f"127.0.0.1:{p}" for p in ports[world:]]
        argv = [_member_argv(r, world, store, peers, tls_peers, numel, rounds, warmup, "fp32", keys, "fp32",
                             True) for r in range(world)]
        procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in argv]
        results[world] = s = _summary(_collect(procs, 900), world, 4 * numel)
        api, trainer = s["api fp32"], s["api fp32 trainer"]
        print(f"loopback W={world}: gloo {s['gloo fp32']['bus_GBps']:.2f} GB/s, "
              f"ring {s['ring fp32']['bus_GBps']:.2f}, api {api['bus_GBps']:.2f} (api/ring "
              f"{api['speed_vs_ring']:.2f}, api/gloo {api['speed_vs_gloo']:.2f}), trainer's call "
              f"{trainer['bus_GBps']:.2f} (/ring {trainer['speed_vs_ring']:.2f}, /gloo "
              f"{trainer['speed_vs_gloo']:.2f}); api with TLS {s['api fp32 TLS']['bus_GBps']:.2f} GB/s",
              flush=True)
    return results


def run_lan(hosts: int, numel: int, rounds: int, warmup: int, keys: str) -> dict[str, Any]:
    from swarmtrain.testing import SimulatedLAN

    with SimulatedLAN(hosts, rate_mbit=LAN_RATE_MBIT) as lan:
        store = f"{lan.hosts[0].address}:{LAN_STORE_PORT}"
        peers = [f"{h.address}:{LAN_CONTROL_PORT}" for h in lan.hosts]
        tls_peers = [f"{h.address}:{LAN_CONTROL_PORT + 1}" for h in lan.hosts]
        procs = [h.run(_member_argv(r, hosts, store, peers, tls_peers, numel, rounds, warmup,
                                    "fp32,fp16,int8", keys, "fp32,int8", False),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(HERE.parent.parent),
                       env={"GLOO_SOCKET_IFNAME": "eth0"})  # gloo binds the LAN interface
                 for r, h in enumerate(lan.hosts)]
        summary = _summary(_collect(procs, 900), hosts, 4 * numel)
    for name, s in summary.items():
        print(f"LAN {name}: {s['median_s']:.2f} s, bus {s['bus_GBps'] * 1e3:.1f} MB/s", flush=True)
    return summary


def _loopback_section(loop: dict[int, Any], numel: int, rounds: int, data: dict[str, Any]) -> list[str]:
    rows = []
    worst = {"api / ring": float("inf"), "api / gloo": float("inf"), "trainer / ring": float("inf"),
             "trainer / gloo": float("inf")}
    for world, s in loop.items():
        g, ring, api, trainer, tls = (s[k] for k in ("gloo fp32", "ring fp32", "api fp32", "api fp32 trainer",
                                                    "api fp32 TLS"))
        ratios = {"api / ring": api["speed_vs_ring"], "api / gloo": api["speed_vs_gloo"],
                  "trainer / ring": trainer["speed_vs_ring"], "trainer / gloo": trainer["speed_vs_gloo"]}
        for k, v in ratios.items():
            worst[k] = min(worst[k], v)
        rows.append([world, f"{g['bus_GBps']:.2f}", f"{ring['bus_GBps']:.2f}", f"{api['bus_GBps']:.2f}",
                     f"{trainer['bus_GBps']:.2f}", *(f"{v:.2f}x" for v in ratios.values()),
                     f"{api['median_s'] * 1e3:.0f} ms", f"{api['cpu_s'] * 1e3:.0f} ms",
                     f"{tls['bus_GBps']:.2f}", f"{api['median_s'] / tls['median_s']:.2f}x"])
    bar = "PASS" if min(worst["api / ring"], worst["trainer / ring"]) >= 0.9 and min(
        worst["api / gloo"], worst["trainer / gloo"]) >= 1.0 else "FAIL"
    data["loopback"] = {"numel": numel, "rounds": rounds, "results": loop, "worst": worst, "bar": bar}
    return [
        f"Loopback, {4 * numel / 1e6:.0f} MB float32 SUM, one process per member on this "
        f"{os.cpu_count()}-core machine, medians of {rounds} rounds (a round's time = its slowest "
        "member); bus bandwidth = 2(W-1)/W x bytes / time, in GB/s. **api** = "
        "`PeerBackend.all_reduce(t, op=\"sum\")` with its defaults (round boundary, retries: the "
        "input is kept intact until every member has joined); **trainer** = the CLI trainer's call "
        "(`retries=0, boundary=False, check_finite=True`); **ring** = the backend's own ring "
        "(`RingGroup.all_reduce`, summing in place); gloo on the same tensors is the yardstick. "
        "Ratios are speeds, paired per round (median over rounds of the other's time / this one's). "
        "api CPU = user + system time of all members per call. The limit here is the CPU, not a "
        "link: every byte is copied into and out of the kernel and added, and W processes share the "
        "cores. \"api TLS\": a second backend whose links are all mutual TLS (TLS / plain: its speed "
        "relative to api, from the medians).",
        "",
        md_table(["W", "gloo", "ring", "api", "trainer", "api / ring", "api / gloo", "trainer / ring",
                  "trainer / gloo", "api time", "api CPU", "api TLS", "TLS / plain"], rows),
        "",
        f"Bars, at every W: api and trainer >= 0.9x ring and >= 1.0x gloo: **{bar}** (worst: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()) + ").",
        "",
    ]


def _lan_section(lan: dict[str, Any], hosts: int, numel: int, rounds: int, data: dict[str, Any]) -> list[str]:
    link = LAN_RATE_MBIT * 1e6 / 8
    rows = []
    for name, s in lan.items():
        factor = {"fp16": 2, "int8": 4}.get(name.split()[1], 1)
        limit = 2 * (hosts - 1) / hosts * 4 * numel / (link * factor)
        rows.append([name, f"{s['median_s']:.2f} s", f"{s['bus_GBps'] * 1e3:.1f}",
                     f"{s['speed_vs_gloo']:.2f}x", f"{limit:.2f} s", f"{limit / s['median_s']:.0%}"])
    speedup = lan["api int8"]["speed_vs_gloo"]
    bar = "PASS" if speedup >= 3 else "FAIL"
    data["lan"] = {"hosts": hosts, "numel": numel, "rate_mbit": LAN_RATE_MBIT, "rounds": rounds,
                   "results": lan, "int8_speedup": speedup, "bar": bar}
    return [
        f"Simulated LAN: {hosts} hosts (network namespaces on a bridge), each link {LAN_RATE_MBIT:.0f} "
        f"Mbit/s each way (tbf), {4 * numel / 1e6:.0f} MB float32 SUM, one process per host, gloo "
        f"and ours in the same processes, medians of {rounds} rounds (speed-ups paired per round). "
        "api = `PeerBackend.all_reduce(t, op=\"sum\", wire=...)` with its defaults; ring = its ring "
        "in place. Limit = the link: "
        "2(W-1)/W x payload bytes / 12.5 MB/s (fp32 payload; half for fp16, a quarter for int8).",
        "",
        md_table(["method", "time", "bus MB/s (fp32-equivalent)", "speed-up vs gloo fp32", "link limit",
                  "of limit"], rows),
        "",
        f"Bar api int8 >= 3x faster than gloo fp32: **{bar}** ({speedup:.2f}x).",
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
    for name in ("--store", "--peers", "--tls-peers", "--wires", "--tls-dir", "--tls-wires"):
        ap.add_argument(name, default="", help=argparse.SUPPRESS)
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
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

    md = ["## All-reduce: `PeerBackend.all_reduce`, its ring and torch.distributed gloo "
          "(`benchmarks/bench_allreduce.py`)", ""]
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
