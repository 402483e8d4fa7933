"""The server's face of the operations core: ``Service`` runs ``service.core`` ops on an async
``Backend``.

Dialect modules (``server.sglang``, ``server.vllm``) only turn wire shapes into these calls and
results back into wire shapes. What is checked, in which order, and what an error or a caller
warning says lives in ``service.core``, which the in-process clients run too; here are only the
awaits and the lock that keeps a pool's budget check and its creation together.

Two kinds of methods: the ``*_outcome`` ones (and ``v_initialize``) return an ``Outcome`` with
the caller warnings to send; the plain ones return the bare value, for callers that build the
warnings themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvmeta._types import PoolId
from kvmeta.service.core import Op, Operations, Outcome, run_async
from kvmeta.service.limits import RequestLimits, TenantCaps
from kvmeta.store.base import Backend, InitResult, PoolStats, VIndex

__all__ = ["Service"]

_MISSING: Any = object()


class Service:
    """What the server does, independent of wire dialect and backend."""

    def __init__(self, backend: Backend, limits: RequestLimits | None = None) -> None:
        self.backend = backend
        self.ops = Operations(limits)
        self.limits = self.ops.limits
        # Budget check and creation must not interleave with another initialize.
        self._init_lock = asyncio.Lock()
        # Told each SGLang reserve's [key, prefix key] pairs, and their keys, when KV events
        # are on (the publisher's parent hashes); None: not called.
        self.reserve_observer: (
            Callable[[PoolId, list[tuple[str, str | None]], list[str]], None] | None
        ) = None

    @property
    def tenant_caps(self) -> Callable[[str], TenantCaps]:
        """Each tenant's own quotas (pages, pools: ``RequestLimits.check_new_pool``), checked
        when a pool is created; by default no tenant has any (the flags still apply)."""
        return self.ops.tenant_caps

    @tenant_caps.setter
    def tenant_caps(self, caps: Callable[[str], TenantCaps]) -> None:
        self.ops.tenant_caps = caps

    async def _creating(self, op: Op[Outcome[Any]]) -> Outcome[Any]:
        """Run an op that creates a pool: its budget check and creation under one lock."""
        async with self._init_lock:
            return await run_async(op, self.backend)

    # ------------------------------------------------------------------ pools (both dialects)

    async def initialize_outcome(self, pool: PoolId, num_pages: int) -> Outcome[InitResult]:
        return await self._creating(self.ops.initialize(pool, num_pages))

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        return (await self.initialize_outcome(pool, num_pages)).value

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        return await run_async(self.ops.exists(pool, keys), self.backend)

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        return await run_async(self.ops.reserve(pool, keys), self.backend)

    async def v_allocate(self, pool: PoolId, keys: list[str]) -> Outcome[list[tuple[bool, int]]]:
        """vLLM's batch_allocate (all or nothing), with the warning of a refused batch."""
        return await run_async(self.ops.v_allocate(pool, keys), self.backend)

    async def confirm_outcome(
        self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]
    ) -> Outcome[int]:
        return await run_async(self.ops.confirm(pool, pairs, release), self.backend)

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (pages not reserved for their key)."""
        return (await self.confirm_outcome(pool, pairs, release)).value

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        return await run_async(self.ops.get(pool, keys), self.backend)

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        return await run_async(self.ops.delete(pool, keys), self.backend)

    async def clear(self, pool: PoolId) -> int:
        return await run_async(self.ops.clear(pool), self.backend)

    async def stats(self) -> list[PoolStats]:
        return await run_async(self.ops.stats(), self.backend)

    # ------------------------------------------------------------------ router reads

    async def prefix_match(
        self, pools: list[tuple[PoolId, list[str], list[int] | None]]
    ) -> list[int | None]:
        return await run_async(self.ops.prefix_match(pools), self.backend)

    async def dump(self, pool: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        return await run_async(self.ops.dump(pool, cursor, limit), self.backend)

    # ------------------------------------------------------------------ vLLM's key-centric index

    async def v_initialize(
        self,
        rank: int,
        role: Any = "worker",
        num_pages: Any = _MISSING,
        world_size: Any = None,
        tenant: str = "",
    ) -> Outcome[str]:
        """vLLM's initialize whole (role, fields, limits, all in its reference wording); the
        value is the reply message."""
        if num_pages is _MISSING:
            op = self.ops.v_initialize(rank, role, world_size=world_size, tenant=tenant)
        else:
            op = self.ops.v_initialize(rank, role, num_pages, world_size, tenant)
        return await self._creating(op)

    async def v_register_outcome(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> Outcome[InitResult]:
        op = self.ops.v_register(rank, num_pages, world_size, tenant, change_world)
        return await self._creating(op)

    async def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> InitResult:
        """``change_world`` false: a ``world_size`` other than the tenant's pinned one is
        refused (``Forbidden``), for a token without the admin right."""
        outcome = await self.v_register_outcome(rank, num_pages, world_size, tenant, change_world)
        return outcome.value

    async def v_exists(self, keys: list[str], tenant: str = "") -> list[bool]:
        return await run_async(self.ops.v_exists(keys, tenant), self.backend)

    async def v_clear(self, tenant: str = "") -> int:
        return await run_async(self.ops.v_clear(tenant), self.backend)

    async def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> int | None:
        return await run_async(self.ops.v_remove(rank, tenant, force), self.backend)

    async def v_set_world_size(self, world_size: int | None, tenant: str = "") -> None:
        await run_async(self.ops.v_set_world_size(world_size, tenant), self.backend)

    async def v_index(self, tenant: str = "") -> VIndex:
        return await run_async(self.ops.v_index(tenant), self.backend)
