"""Sharding over a Valkey/Redis cluster: the same pools on 3 primaries vs on 1 node.

    python benchmarks/bench_shards.py [--pools 3] [--clients 1] [--duration 10] [--workers 1]

Starts (on free loopback ports, removed afterwards) a 3-primary cluster without replicas and
one standalone node, and for each a ``kvmeta serve --backend URL --read-lease 0``. ``--pools``
SGLang pools are used, on ranks chosen so that their keys land on different primaries of the
cluster (the same ranks on the single node). Each pool is driven by ``kvmeta bench``'s engine
cycle (exists, reserve, confirm, get; batch 64, pool prefilled so every reserve evicts) with
``--clients`` client processes, all pools at once. Reported per layout: requests/s, kvmeta CPU
µs per request, and each redis-server's CPU (from /proc/PID/stat) as µs per request of the
pool it holds and as a share of one core. The machine's cores bound what sharding can show:
on 2 cores the clients, kvmeta and the shards compete for the same CPUs, so read the per-shard
CPU (work that spreads over machines) next to the throughput (which cannot grow here).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.redis_support import Node, RedisCluster, RedisServer  # noqa: E402
from tests.support import ServerProcess  # noqa: E402

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.bench.driver import BenchConfig, BenchResult, _setup, run_bench  # noqa: E402
from kvmeta.store.redis.backend import pool_keys  # noqa: E402


@dataclass
class Layout:
    name: str
    url: str
    shards: dict[int, int]  # rank -> pid of the redis-server holding its pool
    pids: list[int]  # every redis-server


def pick_ranks(cluster: RedisCluster, pools: int) -> dict[int, Node]:
    """The first ranks whose pools spread evenly over the primaries (round robin)."""
    by_primary: dict[int, list[int]] = {}
    for rank in range(200):
        owner = cluster.primary_for(pool_keys(PoolId("s", rank, "kv"))[0])
        by_primary.setdefault(owner.port, []).append(rank)
    chosen: dict[int, Node] = {}
    queues = list(by_primary.values())
    while len(chosen) < pools:
        for q in queues:
            if q and len(chosen) < pools:
                rank = q.pop(0)
                chosen[rank] = cluster.primary_for(pool_keys(PoolId("s", rank, "kv"))[0])
    return chosen


def measure(layout: Layout, args: argparse.Namespace, cwd: Path) -> dict[str, object]:
    flags = ["--backend", layout.url, "--read-lease", "0", "--workers", str(args.workers)]
    server = ServerProcess(*flags, cwd=cwd).start(60)
    try:
        configs = [
            BenchConfig(
                url=server.url,
                rank=rank,
                pool_pages=args.pool_pages,
                clients=args.clients,
                duration=args.duration,
                warmup=args.warmup,
                prefill=False,
                seed=f"shards-{layout.name}-{rank}",
                server_pid=server.pid,
                backend_pid=layout.shards[rank],
            )
            for rank in layout.shards
        ]
        for cfg in configs:  # prefill first, so every run's window starts together
            cfg.prefill = True
            _setup(cfg)
            cfg.prefill = False
        results: dict[int, BenchResult] = {}

        def one(cfg: BenchConfig) -> None:
            results[cfg.rank] = run_bench(cfg)

        threads = [threading.Thread(target=one, args=(cfg,)) for cfg in configs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Every pool's run measured its own window (they overlap: all start together). kvmeta
        # and a shard serve several pools, so their load is CPU seconds per second of a run's
        # window (averaged over the runs), divided by the requests per second of all pools.
        rps = {rank: r.requests_per_s for rank, r in results.items()}
        total = sum(rps.values())

        def load(cpu: str, ranks: list[int]) -> float:
            runs = [results[r] for r in ranks]
            used: list[float] = [float(getattr(r, cpu) or 0.0) / r.seconds for r in runs]
            return sum(used) / len(used)

        shards: list[dict[str, object]] = []
        redis_all = 0.0
        for pid in layout.pids:
            ranks = [rank for rank, p in layout.shards.items() if p == pid]
            share = load("backend_cpu_s", ranks)
            redis_all += share
            reqs = sum(rps[r] for r in ranks)
            shards.append(
                {
                    "ranks": ranks,
                    "cpu_share": round(share, 3),
                    "us_per_request": round(share / reqs * 1e6, 1) if reqs else None,
                }
            )
        kvmeta = load("server_cpu_s", list(results))
        return {
            "layout": layout.name,
            "requests_per_s": round(total, 1),
            "per_pool_requests_per_s": {r: round(v, 1) for r, v in rps.items()},
            "kvmeta_cpu_share": round(kvmeta, 3),
            "kvmeta_us_per_request": round(kvmeta / total * 1e6, 1) if total else None,
            "redis_us_per_request_total": round(redis_all / total * 1e6, 1) if total else None,
            "shards": shards,
            "refused_keys": sum(r.refused_keys for r in results.values()),
        }
    finally:
        server.kill()


def table(rows: list[dict[str, object]]) -> str:
    out = [
        "| layout | req/s | kvmeta CPU µs/req | redis CPU µs/req (all) | per shard: "
        "µs/req of its pools, share of a core |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        shards = "; ".join(
            f"ranks {s['ranks']}: {s['us_per_request']} µs, {s['cpu_share']:.2f}"
            for s in row["shards"]  # type: ignore[attr-defined]
        )
        out.append(
            f"| {row['layout']} | {row['requests_per_s']} | {row['kvmeta_us_per_request']} | "
            f"{row['redis_us_per_request_total']} | {shards} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, default=3, help="SGLang pools (ranks), default 3")
    parser.add_argument("--clients", type=int, default=1, help="client processes per pool")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--pool-pages", type=int, default=16384)
    parser.add_argument("--workers", type=int, default=1, help="kvmeta serve --workers")
    parser.add_argument("--repeat", type=int, default=3, help="runs per layout; the median")
    parser.add_argument("--json", action="store_true", help="print JSON rows, not a table")
    args = parser.parse_args()

    rows: list[list[dict[str, object]]] = [[], []]
    with tempfile.TemporaryDirectory(prefix="kvmeta-shards-") as tmp:
        with RedisCluster(replicas=0).start() as cluster:
            single = RedisServer().start()
            try:
                chosen = pick_ranks(cluster, args.pools)
                layouts = [
                    Layout(
                        "cluster, 3 primaries",
                        cluster.url,
                        {rank: node.pid for rank, node in chosen.items()},
                        [n.pid for n in cluster.primaries],
                    ),
                    Layout(
                        "single node", single.url, dict.fromkeys(chosen, single.pid), [single.pid]
                    ),
                ]
                # Alternate the layouts, so a change in the machine's load hits both alike.
                for rep in range(args.repeat):
                    for i, layout in enumerate(layouts):
                        cwd = Path(tmp) / f"{i}-{rep}"
                        cwd.mkdir()
                        cluster.flush()
                        single.flush()
                        rows[i].append(measure(layout, args, cwd))
            finally:
                single.close()
    # Each layout's median run by requests/s (its other numbers are that run's).
    medians = [sorted(runs, key=_rps)[len(runs) // 2] for runs in rows]
    print(json.dumps(medians, indent=2) if args.json else table(medians))


def _rps(row: dict[str, object]) -> float:
    return float(row["requests_per_s"])  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
