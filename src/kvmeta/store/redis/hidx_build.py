"""Building a pool's block-hash index (``--hash-index``) from its stored keys, in the background.

A pool created without an index gets one when a server with the flag initialises it: the
initialize answers at once, and a task of that server walks the pool's stored keys in chunks
of ``build_chunk`` (one short script each, see ``_lib.lua`` ``hidx_fill_chunk``) while every
script maintains the index. One server walks a build: the initialize that asks for the walk
claims it in Redis in the same script (``_lib.lua`` ``hidx_claim``), and each step stamps the
time, so servers initialising the pool meanwhile leave it to that one. A walk its server leaves
by closing cleanly is released (``RedisBackend.close``) and taken over at once; one cut short
otherwise (the process killed, Redis unreachable for longer than ``failover_timeout``) once it
has taken no step for ``walk_stale`` seconds. Either way by the next initialise of the pool by
a server with the flag or by a lookup on one (``_resume_stopped_build``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable, KvmetaError
from kvmeta.store.redis.calls import ScriptCalls
from kvmeta.store.redis.layout import pool_keys
from kvmeta.store.redis.replies import text

__all__ = ["BUILD_CHUNK", "WALK_STALE", "HashIndexBuilds"]

logger = logging.getLogger("kvmeta.store.redis.backend")

# Stored keys per chunk of building a pool's hash index (``hidx_fill.lua``): a few ms of Redis
# each (benchmarks/README.md, "Prefix lookup by block hash"); twice as big chunks took twice as
# long each and no less in all. A pool with no more stored keys than this
# gets its index built inside its initialize.
BUILD_CHUNK = 500
# A build's walk is one server's (``_lib.lua`` ``hidx_claim``) until that server releases it
# as it closes, or until it has taken no step for this long (a server that stopped without
# closing, or lost Redis); then the next server with --hash-index that initialises the pool,
# or that a lookup finds waiting for the build, takes it over: far above one step's time (a
# few ms of Redis, a round trip, a failover's retries within --failover-timeout).
WALK_STALE = 30.0


class HashIndexBuilds(ScriptCalls):
    """The index builds this server walks, as part of ``RedisBackend``."""

    build_chunk: int
    walk_stale: float  # seconds without a step after which a walk counts as stopped
    # This server's name in the claim of a build it walks (meta hbw, ``_lib.lua``
    # ``hidx_claim``): its own steps go on, another server's only after ``walk_stale``.
    _walker: str
    _builds: dict[PoolId, asyncio.Task[None]]  # pools whose index this walks
    # Pools whose walk this server may hold in Redis: started here and neither finished nor
    # left to another server (a walk stopped by a failure keeps its claim), so ``close``
    # releases each.
    _walked: set[PoolId]

    async def _resume_stopped_build(self, pool: PoolId, stamp: Any) -> None:
        """A lookup found ``pool``'s index being built: take the walk over when no server
        holds it, so a stopped build does not wait for the pool's next initialise. ``stamp``
        (meta ``hbt``, Redis time of the walk's latest step) is None once the walk's server
        released it as it closed: taken over at once. Otherwise the walk is taken over when
        it has taken no step for ``walk_stale`` seconds (its server was killed, or lost
        Redis); live walks stamp each step, so a walk under way is left alone. Of servers
        whose lookups find a stopped walk at once, the first step of one takes it over and
        the others' first steps find it taken (``_lib.lua`` ``hidx_claim``): one walks."""
        task = self._builds.get(pool)
        if task is not None and not task.done():
            return
        if stamp is None:
            self._start_build(pool)  # released: a walk as any other (its first step claims it)
            return
        meta = pool_keys(pool)[0]
        seconds, micros = await self._command(meta, "TIME")
        still = int(seconds) + int(micros) / 1e6 - float(text(stamp))
        if still < self.walk_stale:
            return
        self._start_build(pool, f"{still:.0f} s")

    def _start_build(self, pool: PoolId, idle: str | None = None) -> None:
        """Walk ``pool``'s stored keys into its hash index in the background (``_build``),
        unless this server walks it already. ``idle``: taking over a walk that has taken no
        step for that long (its first step claims it, or finds it taken)."""
        task = self._builds.get(pool)
        if task is not None and not task.done():
            return
        self._walked.add(pool)
        self._builds[pool] = asyncio.create_task(self._build(pool, idle), name=f"hash index {pool}")

    async def _build(self, pool: PoolId, idle: str | None = None) -> None:
        """Build ``pool``'s hash index: ``hidx_fill`` chunk by chunk, each on the normal call
        path (retries across a failover), until the chunk that completes it. Each step goes on
        only while the walk is this server's (``_lib.lua`` ``hidx_claim``): claimed by this
        server's initialize, or by the first step here (a walk released by its server, or
        ``idle``: one that has taken no step for that long). A step that finds another
        server's walk live stops this one: that server walks it. A walk always starts from
        the first stored key (HSCAN cursor 0): its cursor is this task's alone, and adding a
        key's page again changes nothing. A failure leaves the pool marked as being built,
        and its walk is taken over once it has taken no step for ``walk_stale`` seconds (or
        at once, if ``close`` released it), by the next initialise with the flag or a lookup
        (``_resume_stopped_build``)."""
        keys, cursor, visited = pool_keys(pool), "0", 0
        started = time.monotonic()
        if idle is None:
            logger.info("%s: building its block-hash index from its stored keys", pool)
        ended = False  # built, the pool gone, or the walk another server's: nothing held
        try:
            while True:
                args = [cursor, self.build_chunk, self._walker, self.walk_stale]
                reply = await self._run("hidx_fill", keys, args)
                code = int(reply[0])
                ended = code != 0 or text(reply[1]) == "0"
                if code == 1:
                    return  # the pool went away (Redis lost its data)
                if code == 2:
                    logger.info(
                        "%s: another kvmeta server walks the build of its block-hash index; "
                        "this one leaves it (after %d keys)",
                        pool,
                        visited,
                    )
                    return
                if idle is not None:
                    logger.warning(
                        "%s: the build of its block-hash index has taken no step for %s; "
                        "resuming it here",
                        pool,
                        idle,
                    )
                    idle = None
                cursor, visited = text(reply[1]), visited + int(reply[2])
                if cursor == "0":
                    break
        except KvmetaError as exc:
            logger.warning(
                "%s: building its block-hash index stopped after %d keys: %s; lookups by hash "
                "answer 'being built' until a server with --hash-index resumes it (at the "
                "pool's next initialise or at a lookup, once the walk has taken no step for "
                "%.0f s, or when this server releases it as it closes)",
                pool,
                visited,
                exc,
                self.walk_stale,
            )
            return
        finally:
            if self._builds.get(pool) is asyncio.current_task():
                del self._builds[pool]
                if ended:
                    self._walked.discard(pool)
        logger.info(
            "%s: block-hash index built (%d stored keys visited in %.1fs)",
            pool,
            visited,
            time.monotonic() - started,
        )

    async def _stop_walks(self) -> None:
        """Stop this server's walks and release their claims (``close``). The walks' tasks
        finish before the release, so no step of theirs stamps a claim again after it."""
        builds = list(self._builds.values())
        for task in builds:
            task.cancel()
        await asyncio.gather(*builds, return_exceptions=True)
        await self._release_walks(sorted(self._walked))
        self._walked.clear()

    async def _release_walks(self, pools: list[PoolId]) -> None:
        """Let go of the walks of ``pools``' index builds (``_lib.lua`` ``hidx_release``): a
        rolling restart gives every server a new id, so a claim left in place would keep
        lookups by hash answering "being built" for ``walk_stale`` seconds before any server
        resumed the walk. The normal call path, bounded by ``failover_timeout`` in all, so a
        Redis that does not answer delays shutdown no longer than one call's retries would;
        a claim not released is taken over once stale, as after a crash."""
        if not pools or self._topo is None:
            return
        calls = [self._run("hidx_release", pool_keys(pool), [self._walker]) for pool in pools]
        replies: list[Any]
        try:
            replies = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), self.failover_timeout
            )
        except asyncio.TimeoutError:
            late = BackendUnavailable(
                f"Redis did not answer within --failover-timeout {self.failover_timeout:g}s"
            )
            replies = [late] * len(pools)
        for pool, reply in zip(pools, replies, strict=True):
            if isinstance(reply, BaseException):
                logger.warning(
                    "%s: could not release this server's walk of its block-hash index build "
                    "(%s); a server with --hash-index resumes it once the walk has taken no "
                    "step for %.0f s",
                    pool,
                    reply,
                    self.walk_stale,
                )
            elif int(reply[0]):
                logger.info(
                    "%s: released the walk of its block-hash index build; the next server "
                    "with --hash-index to initialise the pool or look it up by hash resumes it",
                    pool,
                )
