"""The whole-Redis views of ``RedisBackend``: the pool list, the size budget, per-pool stats and
the page-invariant check.

Whole-pool work runs as many short scripts, one bounded chunk each, looped from Python: one
long script would stall every pool on that Redis for its whole duration.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from urllib.parse import unquote

from kvmeta._types import PoolId
from kvmeta.core.pool import PoolCounters
from kvmeta.store.base import STATS_CHUNK, Budget, CheckReport, PoolStats
from kvmeta.store.redis.calls import ScriptCalls
from kvmeta.store.redis.layout import TENANTS, pool_keys, s_registry, v_keys
from kvmeta.store.redis.replies import text

__all__ = ["CHECK_CHUNK", "COUNTERS", "PoolReports"]

# Entries per check script call: a few milliseconds of Redis time per chunk (measured in
# benchmarks/README.md, "Redis backend"), so other pools wait at most that long behind a check
# of any size.
CHECK_CHUNK = 1000
_CHECK_PARTS = ("pk", "stored", "reserved", "free", "cool", "lru", "resq", "hidx", "totals")
_MAX_PROBLEMS = 20
_BUDGET_BATCH = 64  # pool sizes read concurrently by ``budget``
# The pool's event counters (``c:<name>`` in a pool's meta hash), named once, in the core: a
# counter added to ``PoolCounters`` is reported here at once (the Lua bumps it by name).
COUNTERS = tuple(f.name for f in dataclasses.fields(PoolCounters))


class PoolReports(ScriptCalls):
    """Pools, budget, stats and check, as part of ``RedisBackend``."""

    async def pools(self) -> list[PoolId]:
        """Every pool known to this Redis, every tenant's, sorted like ``MemoryStore.stats``."""
        listed = await self._command(TENANTS, "SMEMBERS", TENANTS)
        tenants = ["", *sorted(unquote(text(t)) for t in listed)]
        out = []
        for tenant in tenants:
            registry = s_registry(tenant)
            ranks = v_keys(tenant)[0]
            s_members = await self._command(registry, "SMEMBERS", registry)
            v_members = await self._command(ranks, "SMEMBERS", ranks)
            out += [PoolId("v", int(r), "", tenant) for r in v_members]
            for member in s_members:
                rank, ns = text(member).split(":", 1)
                out.append(PoolId("s", int(rank), unquote(ns), tenant))
        return sorted(out)

    async def budget(self, pool: PoolId) -> Budget:
        """O(pools) but cheap: one HGET of each pool's size, ``_BUDGET_BATCH`` at a time
        concurrently (pools are created once per engine start, and they live in Redis)."""
        pids = await self.pools()
        sizes: dict[PoolId, int] = {}
        for i in range(0, len(pids), _BUDGET_BATCH):
            batch = pids[i : i + _BUDGET_BATCH]
            metas = [pool_keys(pid)[0] for pid in batch]
            found = await asyncio.gather(*(self._command(m, "HGET", m, "n") for m in metas))
            for pid, n in zip(batch, found, strict=True):
                if n is not None:  # None: listed before it was created (see _sadd_pool)
                    sizes[pid] = int(n)
        tenant = [n for pid, n in sizes.items() if pid.tenant == pool.tenant]
        return Budget(pool in sizes, sum(sizes.values()), sum(tenant), len(tenant))

    async def stats(self) -> list[PoolStats]:
        out: list[PoolStats] = []
        async for chunk in self.stats_chunks():
            out += chunk
        return out

    async def stats_chunks(self, size: int = STATS_CHUNK) -> AsyncIterator[list[PoolStats]]:
        """One script call per pool: every call frees the loop while it waits for Redis."""
        pids = await self.pools()
        for i in range(0, len(pids), size):
            chunk = [await self._pool_stats(pid) for pid in pids[i : i + size]]
            yield [st for st in chunk if st is not None]

    async def _pool_stats(self, pid: PoolId) -> PoolStats | None:
        """None: listed before it was created (see _sadd_pool)."""
        reply = await self._run("stats", pool_keys(pid), [])
        if int(reply[0]):
            return None
        n, reserved, stored = int(reply[1]), int(reply[2]), int(reply[3])
        # Only counters are read: meta also holds fields that are not integers (the time
        # of a hash-index build's latest step, hbt).
        meta = {text(reply[4][i]): reply[4][i + 1] for i in range(0, len(reply[4]), 2)}
        cooling = int(reply[5])
        return PoolStats(
            pool=pid,
            num_pages=n,
            free=n - reserved - stored - cooling,
            reserved=reserved,
            stored=stored,
            counters={name: int(meta.get("c:" + name, 0)) for name in COUNTERS},
            size_conflicts=int(meta.get("conflicts", 0)),
            cooling=cooling,
        )

    async def check(self) -> CheckReport:
        """Page-invariant violations in every pool (empty: consistent; at most 20 per pool).

        O(pool) in total but in chunks of ``CHECK_CHUNK`` entries, one short read-only script
        each (see ``check.lua``), so checking a big pool never stalls Redis for other pools.
        Each entry is checked atomically against the rest of the pool and the size totals in
        one call, so requests served between chunks cannot cause a false report.
        """
        problems = []
        checked = 0
        for pid in await self.pools():
            keys = pool_keys(pid)
            found: list[str] = []
            listed_only = False
            for part in _CHECK_PARTS:
                cursor = "0"
                while len(found) < _MAX_PROBLEMS:
                    reply = await self._run("check", keys, [part, cursor, CHECK_CHUNK])
                    if int(reply[0]):
                        listed_only = True  # listed before it was created (see _sadd_pool)
                        break
                    found += [f"{pid}: {text(msg)}" for msg in reply[2:]]
                    cursor = text(reply[1])
                    if cursor == "0":
                        break
            checked += not listed_only
            problems += found[:_MAX_PROBLEMS]
        return CheckReport(problems=problems, checked=checked)
