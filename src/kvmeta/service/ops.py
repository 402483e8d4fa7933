"""The operations of both dialects, once: ``Service``.

Each method is the operation: it validates the request with ``RequestLimits`` in the caller's
dialect (field names come from ``limits.CONFIRM_FIELDS``) before any store call, so a rejected
request changes nothing; checks a new pool against the page budget; awaits the ``Backend``;
words the store's refusals in the caller's dialect; and returns the value, with the caller
warnings it earned (``Outcome``) where an outcome keeps its compatible reply but deserves a
word. The dialect modules (``server.sglang``, ``server.vllm``) only turn wire shapes into these
calls and results back into wire shapes; the in-process clients (``client._local``) drive the
same coroutines synchronously over the in-memory backend. Nothing else decides what is checked,
in which order, or what an error or a warning says.

An operation that reads state before it changes it (the page budget of a new pool) holds the
initialize lock over both, so two creations cannot both pass one budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, NotInitialized, PageOutOfRange
from kvmeta.lograte import warn_limited
from kvmeta.service.limits import CONFIRM_FIELDS, NO_CAPS, RequestLimits, TenantCaps
from kvmeta.service.vllm import (
    INIT_ERROR,
    SCHEDULER_MESSAGE,
    check_initialize,
    check_world_size_body,
    ignored_rank_warning,
    worker_message,
)
from kvmeta.service.warnings import Outcome, batch_refused, confirm_refused, size_conflict
from kvmeta.store.base import Backend, InitResult, PoolStats, VIndex

__all__ = ["Service", "no_tenant_caps"]

logger = logging.getLogger("kvmeta.service.ops")

_MISSING: Any = object()

ReserveObserver = Callable[[PoolId, list[tuple[str, str | None]], list[str]], None]


def no_tenant_caps(tenant: str) -> TenantCaps:
    """The default: no tenant has limits of its own (the flags apply to every tenant)."""
    return NO_CAPS


class Service:
    """What kvmeta does, independent of wire dialect and backend."""

    def __init__(
        self,
        backend: Backend,
        limits: RequestLimits | None = None,
        tenant_caps: Callable[[str], TenantCaps] = no_tenant_caps,
    ) -> None:
        self.backend = backend
        self.limits = limits or RequestLimits()
        # Each tenant's own quotas (the tokens file's), checked when a pool is created; by
        # default no tenant has any (the flags still apply).
        self.tenant_caps = tenant_caps
        # Budget check and creation must not interleave with another creation.
        self._init_lock = asyncio.Lock()
        # Told each SGLang reserve's [key, prefix key] pairs, and their keys, when KV events
        # are on (the publisher's parent hashes); None: not called.
        self.reserve_observer: ReserveObserver | None = None

    async def _check_budget(self, pool: PoolId, num_pages: int) -> None:
        """A new pool must fit its tenant's pool count and page quota (429) and
        --max-total-pages (400); re-initialising an existing one allocates nothing and always
        passes. Called under the initialize lock, with the creation that follows."""
        budget = await self.backend.budget(pool)
        if not budget.exists:
            tenant = pool.tenant
            self.limits.check_new_pool(tenant, self.tenant_caps(tenant), budget, num_pages)

    # ------------------------------------------------------------------ pools (both dialects)

    async def initialize(self, pool: PoolId, num_pages: int) -> Outcome[InitResult]:
        """Create a pool whole or not at all: rank, size and budget are checked first."""
        limits = self.limits
        limits.check_rank(pool.rank)
        limits.check_num_pages(num_pages)
        if pool.dialect == "s":
            limits.check_namespace(pool.namespace)
        async with self._init_lock:
            await self._check_budget(pool, num_pages)
            result = await self.backend.initialize(pool, num_pages)
        if result.created:
            logger.info("Created pool %s with %d pages", pool, num_pages)
        return Outcome(result, (size_conflict(pool, result),) if result.conflict else ())

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return await self.backend.exists(pool, keys)

    async def reserve(
        self, pool: PoolId, keys: list[str], parent: str | None = None
    ) -> list[tuple[bool, int]]:
        """``parent``: the prefix key the request names for its first key (None or "": none),
        which only orders eviction (``Backend.reserve``); it is looked up, never stored, so
        it has no length limit of its own."""
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return await self.backend.reserve(pool, keys, parent or None)

    async def confirm(
        self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]
    ) -> Outcome[int]:
        """The value is how many pairs were refused (pages not reserved for their key). The
        page range is the store's to check (atomically with the confirm); a page outside it
        comes back typed and is named here in the caller's dialect."""
        fields = CONFIRM_FIELDS[pool.dialect]
        self.limits.check_rank(pool.rank)
        self.limits.check_confirm(pairs, release, fields)
        try:
            refused = await self.backend.confirm(pool, pairs, release)
        except PageOutOfRange as exc:
            raise exc.for_caller(fields.pairs, fields.reserve) from None
        return Outcome(refused, (confirm_refused(refused),) if refused else ())

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return await self.backend.get(pool, keys)

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return await self.backend.delete(pool, keys)

    async def clear(self, pool: PoolId) -> int:
        self.limits.check_rank(pool.rank)
        return await self.backend.clear(pool)

    async def stats(self) -> list[PoolStats]:
        return await self.backend.stats()

    # ------------------------------------------------------------------ router reads

    async def prefix_match(
        self, pools: list[tuple[PoolId, list[str], list[int] | None]]
    ) -> list[int | None]:
        """Per pool, how many of its keys (or, when ``hashes`` is given, of SGLang's 64-bit
        block hashes: ``Backend.prefix_length_hashes``), from the first, are stored; None: no
        such pool (a router asks about engines that may not have started yet: not an error).
        A pure read (``Backend.prefix_length``): no LRU touch, no counter. O(request): each
        pool's walk stops at its first miss."""
        limits = self.limits
        limits.check_prefix([(keys, hashes) for _, keys, hashes in pools])
        for pool, _, _ in pools:
            limits.check_rank(pool.rank)
        backend = self.backend
        out: list[int | None] = []
        for pool, keys, hashes in pools:
            try:
                if hashes is None:
                    out.append(await backend.prefix_length(pool, keys))
                else:
                    out.append(await backend.prefix_length_hashes(pool, hashes))
            except NotInitialized:
                out.append(None)
        return out

    async def dump(self, pool: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        """One page of a pool's stored keys (``Backend.dump``), for an indexer to bootstrap."""
        self.limits.check_rank(pool.rank)
        self.limits.check_dump_limit(limit)
        return await self.backend.dump(pool, cursor, limit)

    # ------------------------------------------------------------------ vLLM's key-centric index

    async def v_initialize(
        self,
        rank: int,
        role: Any = "worker",
        num_pages: Any = _MISSING,
        world_size: Any = None,
        tenant: str = "",
        change_world: bool = True,
    ) -> Outcome[str]:
        """vLLM's ``initialize`` whole, with its fields as decoded: role and fields
        (``service.vllm.check_initialize``), then the limits, every error in the reference
        server's ``Invalid initialization parameters: `` words. The value is the reply
        message. ``change_world`` as ``v_register``."""
        self.limits.check_rank(rank)  # (over HTTP the router checks the path rank first)
        fields = {"role": role, "world_size": world_size}
        if num_pages is not _MISSING:
            fields["num_pages"] = num_pages
        worker = check_initialize(rank, **fields)
        if worker is None:
            return Outcome(SCHEDULER_MESSAGE)
        try:
            done = await self.v_register(
                rank, worker.num_pages, worker.world_size, tenant, change_world
            )
        except InvalidRequest as exc:  # a limit such as --max-pages, in vLLM's framing
            raise InvalidRequest(INIT_ERROR + str(exc), exc.field) from None
        result = done.value
        return Outcome(worker_message(rank, result.num_pages, result.requested), done.warnings)

    async def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> Outcome[InitResult]:
        """A worker rank's pool (a validated registration: ``v_initialize`` checks the body).
        ``change_world`` false (a token without the admin right): a ``world_size`` that would
        move the tenant's pinned one is refused by the store, atomically (``Forbidden``)."""
        limits = self.limits
        limits.check_rank(rank)
        limits.check_num_pages(num_pages)
        limits.check_world_size(world_size)
        pool = PoolId("v", rank, "", tenant)
        backend = self.backend
        async with self._init_lock:
            await self._check_budget(pool, num_pages)
            result = await backend.v_register(rank, num_pages, world_size, tenant, change_world)
            if result.created:
                logger.info("Registered %s with %d pages", pool, num_pages)
            warning = ignored_rank_warning(rank, await backend.v_index(tenant))
        if warning:
            warn_limited(logger, "ignored_rank", "%s", warning)
        return Outcome(result, (size_conflict(pool, result),) if result.conflict else ())

    async def v_allocate(
        self, pool: PoolId, keys: list[str], parent: str | None = None
    ) -> Outcome[list[tuple[bool, int]]]:
        """vLLM's batch_allocate: a reserve on a vLLM pool, which every store grants whole or
        not at all (``core.pool.Pool.reserve``); a refused batch earns a caller warning, as
        its reply (-1 per new key) looks like the reference server's partial one."""
        out = await self.reserve(pool, keys, parent)
        refused = sum(1 for _, page in out if page < 0)
        return Outcome(out, (batch_refused(refused, pool.rank),) if refused else ())

    async def v_exists(self, keys: list[str], tenant: str = "") -> list[bool]:
        self.limits.check_keys(keys)
        return await self.backend.v_exists(keys, tenant)

    async def v_clear(self, tenant: str = "") -> int:
        return await self.backend.v_clear(tenant)

    async def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> int | None:
        """The number of keys dropped, or None when the rank was not registered; refused
        (``RankInUse``) while its pages are in use, unless ``force``."""
        self.limits.check_rank(rank)
        dropped = await self.backend.v_remove(rank, tenant, force)
        if dropped is not None:
            pool = PoolId("v", rank, "", tenant)
            how = " (forced: writes and reads in flight on it, if any, were dropped)"
            logger.warning(
                "Removed %s and its %d stored keys%s", pool, dropped, how if force else ""
            )
        return dropped

    async def v_set_world_size(self, world_size: Any = _MISSING, tenant: str = "") -> int | None:
        """Pin (a positive int) or unpin (None) the ranks that make a key complete; the value
        is the world size now set. ``world_size`` as decoded (missing: not given at all)."""
        size = check_world_size_body({} if world_size is _MISSING else {"world_size": world_size})
        self.limits.check_world_size(size)
        await self.backend.v_set_world_size(size, tenant)
        owner = f" of tenant '{tenant}'" if tenant else ""
        if size is None:
            logger.info(
                "vLLM world_size%s unset: the contiguous registered ranks from 0 count", owner
            )
        else:
            logger.info("vLLM world_size%s set to %d", owner, size)
        return size

    async def v_index(self, tenant: str = "") -> VIndex:
        return await self.backend.v_index(tenant)
