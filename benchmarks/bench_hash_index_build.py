#!/usr/bin/env python3
"""How long building an existing pool's block-hash index holds Redis, and how long it takes.

One private valkey-server (or ``--server``); one SGLang pool created without the index whose
stored hash is filled with ``--keys`` 64-hex keys (written directly: the build reads only the
stored hash and meta); then a ``RedisBackend(hash_index=True)`` initialises it and its
background walk builds the index in chunks of ``--chunk`` keys. Reported: each build script's
own time in Redis (``SLOWLOG``, every command logged: the longest is how long any other client
waits behind the build at most), the walk's total time, the longest reply a client pinging
every millisecond saw meanwhile, and the index's memory per key. ``--old REV`` then builds the
same index with REV's initialize script (before the walk: one script over the whole pool).

    python benchmarks/bench_hash_index_build.py --keys 1000000 --old 8783db0
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare_lua import read_lua  # noqa: E402
from tests.redis_support import REDIS_SERVER, RedisServer  # noqa: E402

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.store.redis.backend import BUILD_CHUNK, POOL_PARTS, RedisBackend, pool_keys  # noqa: E402

POOL = PoolId("s", 0, "bench")


def fill(r: redis.Redis, count: int) -> None:
    keys = pool_keys(POOL)
    stored = keys[POOL_PARTS.index("stored")]
    step = 10_000
    for start in range(0, count, step):
        pipe = r.pipeline(transaction=False)
        mapping = {
            f"{(i * 0x9E3779B97F4A7C15) % (1 << 64):016x}{i:048x}": i
            for i in range(start, min(start + step, count))
        }
        pipe.hset(stored, mapping=mapping)  # type: ignore[arg-type]
        pipe.execute()
    r.hset(keys[0], "next", count)


def slowlog(r: redis.Redis, name: str) -> list[int]:
    """Durations (us) of the logged calls of kvmeta function ``name`` (or EVAL scripts)."""
    out = []
    for entry in r.slowlog_get(1_000_000):
        command = entry["command"]
        text = command.decode() if isinstance(command, bytes) else str(command)
        if name in text:
            out.append(int(entry["duration"]))
    return out


class Prober(threading.Thread):
    """PINGs every millisecond; the longest round trip it saw."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis(port=port)
        self.stop = threading.Event()
        self.longest = 0.0

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            self.r.ping()
            self.longest = max(self.longest, time.perf_counter() - t)
            time.sleep(0.001)


def ms(us: float) -> str:
    return f"{us / 1000:.1f} ms"


async def build(port: int, r: redis.Redis, args: argparse.Namespace) -> None:
    plain = RedisBackend(f"redis://127.0.0.1:{port}/0", functions=True)
    await plain.start()
    await plain.initialize(POOL, args.keys)
    await plain.close()
    fill(r, args.keys)
    before = int(r.info("memory")["used_memory"])
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", 1_000_000)
    r.slowlog_reset()
    indexed = RedisBackend(
        f"redis://127.0.0.1:{port}/0", hash_index=True, build_chunk=args.chunk, functions=True
    )
    await indexed.start()
    probe = Prober(port)
    probe.start()
    t0 = time.perf_counter()
    await indexed.initialize(POOL, args.keys)
    answered = time.perf_counter() - t0
    task = indexed._builds.get(POOL)
    if task is not None:
        await task
    total = time.perf_counter() - t0
    probe.stop.set()
    probe.join()
    await indexed.close()
    r.config_set("slowlog-log-slower-than", 10_000)
    chunks = slowlog(r, "kvmeta_hidx_fill")
    init = slowlog(r, "kvmeta_initialize")
    after = int(r.info("memory")["used_memory"])
    meta = r.hmget(pool_keys(POOL)[0], "hx", "hb")
    print(f"{args.keys} stored keys, chunks of {args.chunk}: index complete {meta[0] == b'1'}")
    print(f"  initialize answered in {answered * 1000:.1f} ms (script {ms(max(init))})")
    print(
        f"  {len(chunks)} hidx_fill scripts: longest {ms(max(chunks))}, median "
        f"{ms(statistics.median(chunks))}, p99 {ms(sorted(chunks)[int(len(chunks) * 0.99)])}, "
        f"sum {sum(chunks) / 1e6:.2f} s"
    )
    print(f"  walk total {total:.2f} s; longest PING meanwhile {probe.longest * 1000:.1f} ms")
    print(f"  index memory {(after - before) / args.keys:.0f} bytes per key")
    if args.old:
        keys = pool_keys(POOL)
        r.hdel(keys[0], "hx", "hb")
        r.delete(keys[POOL_PARTS.index("hidx")])
        script = read_lua(args.old, "_lib") + "\n" + read_lua(args.old, "initialize")
        r.slowlog_reset()
        r.config_set("slowlog-log-slower-than", 0)
        t = time.perf_counter()
        r.eval(script, len(keys), *keys, args.keys, "1")
        wall = time.perf_counter() - t
        r.config_set("slowlog-log-slower-than", 10_000)
        old = slowlog(r, "initialize")
        print(f"  {args.old}'s initialize (one script): {ms(max(old or [wall * 1e6]))} in Redis")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=BUILD_CHUNK)
    parser.add_argument("--old", help="git revision whose initialize builds in one script")
    parser.add_argument("--server", default=REDIS_SERVER)
    args = parser.parse_args()
    server = RedisServer(binary=args.server).start()
    try:
        with server.client() as r:
            asyncio.run(build(server.port, r, args))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
