"""The operations of both dialects, over any backend, with limits applied.

Dialect modules (``server.sglang``, ``server.vllm``) only turn wire shapes into these calls and
results back into wire shapes; embedded clients call the store directly but through the same
limits. Everything a request may change is validated before the backend is called, so a
rejected request changes nothing: in particular a pool is created whole or not at all (its
rank, size, world size and the page budget are checked first).
"""

from __future__ import annotations

import asyncio
import logging

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest
from kvmeta.service.limits import CONFIRM_FIELDS, RequestLimits
from kvmeta.service.vllm import ignored_rank_warning
from kvmeta.store.base import Backend, InitResult, PoolStats, VIndex

__all__ = ["Service"]

logger = logging.getLogger(__name__)

# Fields the backends' own page-range check names (in dialect S's words).
_PAGE_FIELDS = frozenset(("written_keys_to_confirm", "pages_to_release"))


class Service:
    """What the server does, independent of wire dialect and backend."""

    def __init__(self, backend: Backend, limits: RequestLimits | None = None) -> None:
        self.backend = backend
        self.limits = limits or RequestLimits()
        # Budget check and creation must not interleave with another initialize.
        self._init_lock = asyncio.Lock()
        # Pool sizes seen (sizes never change), to name a bad page in the caller's dialect.
        self._sizes: dict[PoolId, int] = {}

    async def _check_budget(self, pool: PoolId, num_pages: int) -> None:
        """A new pool must fit --max-total-pages; re-initialising an existing one allocates
        nothing and always passes."""
        exists, total = await self.backend.budget(pool)
        if not exists:
            self.limits.check_total_pages(total, num_pages)

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        self.limits.check_rank(pool.rank)
        self.limits.check_num_pages(num_pages)
        if pool.dialect == "s":
            self.limits.check_namespace(pool.namespace)
        async with self._init_lock:
            await self._check_budget(pool, num_pages)
            result = await self.backend.initialize(pool, num_pages)
        self._sizes[pool] = result.num_pages
        if result.created:
            logger.info("Created pool %s with %d pages", pool, num_pages)
        return result

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        self.limits.check_keys(keys)
        return await self.backend.exists(pool, keys)

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return await self.backend.reserve(pool, keys)

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (pages not reserved for their key)."""
        fields = CONFIRM_FIELDS[pool.dialect]
        self.limits.check_rank(pool.rank)
        self.limits.check_confirm(pairs, release, fields)
        try:
            return await self.backend.confirm(pool, pairs, release)
        except InvalidRequest as exc:
            if exc.field not in _PAGE_FIELDS:
                raise
            # The backend refused a page outside the pool (nothing was applied): name it in
            # the caller's dialect through the shared check.
            for fresh in (False, True):
                size = await self._size(pool, fresh)
                if size is not None:
                    self.limits.check_pages(pairs, release, size, fields)
            raise

    async def _size(self, pool: PoolId, fresh: bool) -> int | None:
        if fresh or pool not in self._sizes:
            self._sizes.update((st.pool, st.num_pages) for st in await self.backend.stats())
        return self._sizes.get(pool)

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return await self.backend.get(pool, keys)

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        self.limits.check_keys(keys)
        return await self.backend.delete(pool, keys)

    async def clear(self, pool: PoolId) -> int:
        return await self.backend.clear(pool)

    # vLLM's key-centric index -------------------------------------------------------------

    async def v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult:
        self.limits.check_rank(rank)
        self.limits.check_num_pages(num_pages)
        self.limits.check_world_size(world_size)
        pool = PoolId("v", rank, "")
        async with self._init_lock:
            await self._check_budget(pool, num_pages)
            result = await self.backend.v_register(rank, num_pages, world_size)
        self._sizes[pool] = result.num_pages
        if result.created:
            logger.info("Registered vLLM worker rank %d with %d pages", rank, num_pages)
        warning = ignored_rank_warning(rank, await self.backend.v_index())
        if warning:
            logger.warning("%s", warning)
        return result

    async def v_exists(self, keys: list[str]) -> list[bool]:
        self.limits.check_keys(keys)
        return await self.backend.v_exists(keys)

    async def v_clear(self) -> int:
        return await self.backend.v_clear()

    async def v_remove(self, rank: int) -> int | None:
        dropped = await self.backend.v_remove(rank)
        if dropped is not None:
            logger.warning("Removed vLLM worker rank %d and its %d stored keys", rank, dropped)
        return dropped

    async def v_set_world_size(self, world_size: int | None) -> None:
        self.limits.check_world_size(world_size)
        await self.backend.v_set_world_size(world_size)
        if world_size is None:
            logger.info("vLLM world_size unset: the contiguous registered ranks from 0 count")
        else:
            logger.info("vLLM world_size set to %d", world_size)

    async def v_index(self) -> VIndex:
        return await self.backend.v_index()

    async def stats(self) -> list[PoolStats]:
        return await self.backend.stats()
