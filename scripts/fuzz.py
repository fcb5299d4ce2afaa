"""The long fuzz campaign against live swarmtrain nodes (the bounded one runs in CI:
tests/test_fuzz_live.py). See docs/fuzzing.md.

    python scripts/fuzz.py [--targets coordinator,ctl,stage,...] [--seconds 300] [--seed N]

Targets (all by default): coordinator (role worker), ctl (the coordinator's operator role),
stage (stage 0), stage-mid (a middle stage), stage-last (the stage with the loss),
stage-replica (a stage as role ``stage``: replica syncs), peer (a peer's control port), ring
(a peer's ring listener and a ring member mid all-reduce). Each target gets ``--seconds`` of
inputs. Exit code 1 on any crash, hang or failed health
check.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from swarmtrain.testing.fuzz import TARGETS, FuzzReport


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", "--target", dest="targets", default=",".join(TARGETS),
                        help=f"comma-separated targets out of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--seconds", type=float, default=300.0, help="time budget per target (default 300)")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000,
                        help="campaign seed (default: from the clock; printed, to replay a run)")
    parser.add_argument("--concurrency", type=int, default=16, help="connections in flight (default 16)")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or args.seconds <= 0 or args.concurrency < 1:
        parser.error(f"unknown target(s) {unknown}; choose from {list(TARGETS)}" if unknown
                     else "--seconds must be > 0 and --concurrency >= 1")
    # the nodes log every refusal at WARNING; the report says what matters (the fuzzer's
    # own capture still sees ERROR records of the nodes)
    logging.basicConfig(level=logging.CRITICAL)

    def progress(r: FuzzReport) -> None:
        print(f"  [{r.target}] {r.total} inputs, {len(r.crashes)} crashes, {len(r.hangs)} hangs", flush=True)

    failed = False
    reports = []
    print(f"fuzzing {', '.join(targets)} for {args.seconds:.0f} s each, seed {args.seed}", flush=True)
    for name in targets:
        report = asyncio.run(TARGETS[name](10**9, seconds=args.seconds, seed=args.seed,
                                           concurrency=args.concurrency, progress=progress))
        print(report.summary(), flush=True)
        reports.append(report)
        failed |= not report.ok
    print(f"\nsummary (seed {args.seed}):")
    for r in reports:
        rate = r.total / max(r.elapsed, 1e-9)
        print(f"  {r.target:14s} {r.total:7d} inputs {r.elapsed:6.1f} s {rate:6.1f}/s  "
              f"crashes {len(r.crashes)}  hangs {len(r.hangs)}  health {'ok' if not r.health else 'FAILED'}"
              )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
