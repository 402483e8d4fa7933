"""What a backend must provide: the async interface the service layer calls.

Two implementations: ``store.memory`` (the core in this process, optionally journaled to a
data directory) and ``store.redis`` (state in Redis/Valkey, shared by many servers). Both keep
exactly the semantics of ``core.pool``; the shared behavioural test suite runs against each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvmeta._types import PoolId

__all__ = ["Backend", "InitResult", "PoolStats"]


@dataclass(frozen=True)
class InitResult:
    """Outcome of initialize: ``num_pages`` is the pool's real size, which wins over a
    ``requested`` size that differs (re-initialising never resizes: byte ranges would overlap)."""

    created: bool
    num_pages: int
    requested: int

    @property
    def conflict(self) -> bool:
        return self.requested != self.num_pages


@dataclass
class PoolStats:
    """One pool's occupancy and event counts, for /v1/pools, metrics and ``kvmeta status``."""

    pool: PoolId
    num_pages: int
    free: int
    reserved: int
    stored: int
    counters: dict[str, int] = field(default_factory=dict)
    size_conflicts: int = 0


class Backend(Protocol):
    """State of all pools. Every method is atomic with respect to every other call."""

    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool: ...

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult: ...

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]: ...

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]: ...

    async def confirm(
        self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]
    ) -> int: ...

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]: ...

    async def delete(self, pool: PoolId, keys: list[str]) -> int: ...

    async def clear(self, pool: PoolId) -> int: ...

    async def v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult: ...

    async def v_exists(self, keys: list[str]) -> list[bool]: ...

    async def v_clear(self) -> int: ...

    async def stats(self) -> list[PoolStats]: ...
