#!/usr/bin/env python3
"""Redis memory per stored key: what to size ``maxmemory`` from.

One private valkey-server (or ``--server``); one SGLang pool of ``--keys`` pages, filled through
``RedisBackend`` as an engine fills it (reserve and confirm of 64 fresh 64-hex keys at a time),
then Redis's ``used_memory`` after against before, per stored key. Each key is one entry in
key -> page, page -> key and the LRU. With
``--hash-index`` the pool also keeps its block-hash index.

    python benchmarks/bench_redis_memory.py [--keys 200000] [--hash-index]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.redis_support import REDIS_SERVER, RedisServer  # noqa: E402

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.store.redis.backend import RedisBackend  # noqa: E402

POOL = PoolId("s", 0, "bench")
WARM = PoolId("s", 1, "warm")
BATCH = 64


def _key(pool: PoolId, i: int) -> str:
    """A 64-hex key like HiCache's chain digests (distinct leading digits: distinct hashes)."""
    return hashlib.sha256(f"{pool}:{i}".encode()).hexdigest()


async def fill(url: str, pool: PoolId, keys: int, hash_index: bool) -> int:
    """Stored keys after filling a fresh pool of ``keys`` pages."""
    backend = RedisBackend(url, read_lease=0.0, hash_index=hash_index, functions=True)
    await backend.start()
    try:
        await backend.initialize(pool, keys)
        stored = 0
        for start in range(0, keys, BATCH):
            batch = [_key(pool, i) for i in range(start, min(start + BATCH, keys))]
            got = await backend.reserve(pool, batch)
            pairs = [(k, page) for k, (_, page) in zip(batch, got, strict=True) if page >= 0]
            refused = await backend.confirm(pool, pairs, [])
            stored += len(pairs) - refused
        return stored
    finally:
        await backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--hash-index", action="store_true")
    parser.add_argument("--server", default=REDIS_SERVER)
    args = parser.parse_args()
    server = RedisServer(binary=args.server).start()
    try:
        with server.client() as r:
            url = server.url
            # The function library and the registries first, on another pool, so that the
            # measured growth is the pool's (its few fixed keys are noise at this many keys).
            asyncio.run(fill(url, WARM, 64, args.hash_index))
            before = int(r.info("memory")["used_memory"])
            stored = asyncio.run(fill(url, POOL, args.keys, args.hash_index))
            after = int(r.info("memory")["used_memory"])
    finally:
        server.close()
    per_key = (after - before) / max(stored, 1)
    index = " with the block-hash index" if args.hash_index else ""
    print(f"{stored} stored keys{index}: {per_key:.0f} bytes of Redis used_memory per key")
    return 0


if __name__ == "__main__":
    sys.exit(main())
