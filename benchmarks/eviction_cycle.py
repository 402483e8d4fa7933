"""In-process CPU of each ``--eviction`` policy at the batch-64 engine cycle, per request kind.

    python benchmarks/eviction_cycle.py [--rounds 4] [--cycles 3000] [--pages 65536]

A ``Pool`` of ``--pages`` pages is filled with 64-key chains, then each measured cycle is an
engine's four requests for a fresh chain: ``exists``, ``reserve`` (every key evicts a page),
``confirm`` and ``get``. Printed: the process CPU time per cycle of each request kind, per
policy, the policies in alternating order each round (the machine's other jobs then weigh on
both alike), and the median and range over the rounds. The pool alone: no HTTP, no JSON, so the
differences show whole; ``kvmeta bench pair`` measures them on a server.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvmeta.core import EVICTION_POLICIES  # noqa: E402
from kvmeta.core.pool import Pool  # noqa: E402

KINDS = ("exists", "reserve", "confirm", "get")


def _chains(count: int, start: int) -> list[list[str]]:
    return [
        [hashlib.sha256(f"{i}-{j}".encode()).hexdigest() for j in range(64)]
        for i in range(start, start + count)
    ]


def measure(policy: str, pages: int, cycles: int) -> dict[str, float]:
    """Microseconds of process CPU per cycle, by request kind."""
    pool = Pool(pages, read_lease=0.0, policy=EVICTION_POLICIES[policy])
    fill = pages // 64 + 1
    chains = _chains(fill + cycles, 0)
    spent = dict.fromkeys(KINDS, 0.0)
    clock = time.process_time
    for n, keys in enumerate(chains):
        a = clock()
        pool.exists(keys)
        b = clock()
        out = pool.reserve(keys, 1.0, [])
        c = clock()
        pairs = [(key, page) for key, (_, page) in zip(keys, out, strict=True)]
        d = clock()
        pool.confirm(pairs, [], 1.0)
        e = clock()
        pool.get(keys, 1.0)
        f = clock()
        if n >= fill:
            for kind, took in zip(KINDS, (b - a, c - b, e - d, f - e), strict=True):
                spent[kind] += took
    return {kind: took / cycles * 1e6 for kind, took in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--pages", type=int, default=65536)
    args = parser.parse_args()
    names = list(EVICTION_POLICIES)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(measure(name, args.pages, args.cycles))
    for name in names:
        cells = []
        for kind in (*KINDS, "cycle"):
            values = [sum(run.values()) if kind == "cycle" else run[kind] for run in runs[name]]
            cells.append(
                f"{kind} {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
            )
        print(f"{name:<7} us per 64-key cycle: " + ", ".join(cells))


if __name__ == "__main__":
    main()
