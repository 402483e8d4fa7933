#!/usr/bin/env python3
"""Before/after: the same benchmark against servers run from different source trees.

Runs are interleaved (A, B, A, B, ...), each on a fresh server, so load from other processes
on a shared machine hits both sides alike; prints each side's median and the B/A ratio.

    git archive <commit> src | tar -x -C /tmp/before
    python benchmarks/compare_trees.py before=/tmp/before/src after=src --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.bench.commands import server_args  # noqa: E402
from kvmeta.bench.driver import BenchConfig  # noqa: E402
from kvmeta.bench.launch import Launch, run_on  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="LABEL=PATH to a checkout's src directory")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dialect", default="s")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pool-pages", type=int, default=65536)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--mode", default="memory", choices=("memory", "durable"))
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `kvmeta serve` flag for both trees, repeatable; as with `kvmeta bench`, "
        "--read-lease=0 unless one of them sets --read-lease",
    )
    parser.add_argument("--json", help="write every run to this file")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.repeat):
        for label, src in trees.items():
            launch = Launch(args.mode, server_args(args.server_arg), src=str(Path(src).resolve()))
            cfg = BenchConfig(
                dialect=args.dialect,
                batch=args.batch,
                pool_pages=args.pool_pages,
                clients=args.clients,
                duration=args.duration,
            )
            runs[label].append(run_on(cfg, launch))
    first = None
    for label, results in runs.items():
        cpu = [r["cpu_us_per_request"] for r in results]
        med = statistics.median(cpu)
        first = first or med
        rps = statistics.median(r["requests_per_s"] for r in results)
        print(
            f"{label:>10}: median {med:7.1f} us CPU/request  ({med / first:.2f}x of the first)"
            f"  runs {[round(c, 1) for c in cpu]}  req/s {rps:.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
