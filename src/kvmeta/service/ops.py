"""The operations of both dialects, over any backend, with limits applied.

Dialect modules (``server.sglang``, ``server.vllm``) only turn wire shapes into these calls and
results back into wire shapes; embedded clients call the store directly but through the same
limits. Everything a request may change is validated before the backend is called, so a
rejected request changes nothing.
"""

from __future__ import annotations

import logging
from operator import itemgetter

from kvmeta._types import PoolId
from kvmeta.service.limits import RequestLimits
from kvmeta.service.vllm import ignored_rank_warning
from kvmeta.store.base import Backend, InitResult, PoolStats, VIndex

__all__ = ["Service"]

logger = logging.getLogger(__name__)


class Service:
    """What the server does, independent of wire dialect and backend."""

    def __init__(self, backend: Backend, limits: RequestLimits | None = None) -> None:
        self.backend = backend
        self.limits = limits or RequestLimits()

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        self.limits.check_num_pages(num_pages)
        if pool.dialect == "s":
            self.limits.check_namespace(pool.namespace)
        result = await self.backend.initialize(pool, num_pages)
        if result.created:
            logger.info("Created pool %s with %d pages", pool, num_pages)
        return result

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        self.limits.check_keys(keys)
        return await self.backend.exists(pool, keys)

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        self.limits.check_keys(keys)
        return await self.backend.reserve(pool, keys)

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        if len(pairs) + len(release) > self.limits.max_keys:
            self.limits.check_keys(
                [k for k, _ in pairs] + [""] * len(release), "confirmations + pages_to_release"
            )
        if pairs and max(map(len, map(itemgetter(0), pairs))) > self.limits.max_key_length:
            self.limits.check_keys([k for k, _ in pairs], "confirmations")
        return await self.backend.confirm(pool, pairs, release)

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        self.limits.check_keys(keys)
        return await self.backend.get(pool, keys)

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        self.limits.check_keys(keys)
        return await self.backend.delete(pool, keys)

    async def clear(self, pool: PoolId) -> int:
        return await self.backend.clear(pool)

    # vLLM's key-centric index -------------------------------------------------------------

    async def v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult:
        self.limits.check_num_pages(num_pages)
        result = await self.backend.v_register(rank, num_pages, world_size)
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
        await self.backend.v_set_world_size(world_size)
        if world_size is None:
            logger.info("vLLM world_size unset: the contiguous registered ranks from 0 count")
        else:
            logger.info("vLLM world_size set to %d", world_size)

    async def v_index(self) -> VIndex:
        return await self.backend.v_index()

    async def stats(self) -> list[PoolStats]:
        return await self.backend.stats()
