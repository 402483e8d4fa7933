"""What a backend must provide: the async interface the service layer calls.

Two implementations: ``store.disk`` (the core in this process, optionally journaled to a
data directory) and ``store.redis`` (state in Redis/Valkey, shared by many servers). Both keep
exactly the semantics of ``core.pool``; the shared behavioural test suite runs against each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest
from kvmeta.store.changes import ChangeListener

__all__ = [
    "STATS_CHUNK",
    "Backend",
    "Budget",
    "IN_USE",
    "CheckReport",
    "InitResult",
    "PoolStats",
    "VIndex",
    "parse_cursor",
    "required_ranks",
]


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


# Pools per piece of ``Backend.stats_chunks``: a piece holds the loop for milliseconds at most
# (benchmarks/README.md, "Operator routes").
STATS_CHUNK = 256


class Budget(NamedTuple):
    """What creating a pool is checked against (``Backend.budget``): whether it exists already,
    the pages of all pools together (--max-total-pages), and its tenant's pages (max_pages)
    and pools (--max-pools-per-tenant / max_pools)."""

    exists: bool
    total_pages: int
    tenant_pages: int
    tenant_pools: int


@dataclass
class PoolStats:
    """One pool's occupancy and event counts, for /v1/pools, metrics and ``kvmeta status``.

    The page counts add up to ``num_pages``: ``free`` is what a reserve can take without
    evicting, and ``cooling`` the FREE pages held back until a read lease (or the grace after
    a release) ends, which a reserve cannot take yet.
    """

    pool: PoolId
    num_pages: int
    free: int
    reserved: int
    stored: int
    counters: dict[str, int] = field(default_factory=dict)
    size_conflicts: int = 0
    cooling: int = 0  # released or freed pages not handed out again yet (not in ``free``)
    # Of ``cooling``: FREE pages held after a restart until the old process's leases would
    # have ended (``Pool.hold_after_restart``).
    held_after_restart: int = 0
    # Stored pages whose parent is gone (unreachable for a leading-hit lookup), for policies
    # that learn parents (``--eviction prefix``); None: the policy does not track them.
    dead: int | None = None


# ``kvmeta check``'s exit code when the directory it checked is in use by a running server.
IN_USE = 3


@dataclass
class CheckReport:
    """What a consistency check found: a backend's page invariants over ``checked`` pools
    (``GET /v1/check``) or a data directory read offline (``kvmeta check``: ``lines`` to print,
    ``in_use`` when a server holds it). One class for both, so a problem reads the same
    wherever it was found; ``ok`` and ``exit_code`` decide the outcome."""

    problems: list[str] = field(default_factory=list)  # one line per violation; empty: ok
    checked: int = 0
    lines: list[str] = field(default_factory=list)
    in_use: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        if self.problems:
            return 1
        return IN_USE if self.in_use else 0

    @property
    def summary(self) -> str:
        if self.problems:
            found = f"{len(self.problems)} problem(s) found"
            return found + (" (the directory is in use: may be stale)" if self.in_use else "")
        if self.in_use:
            return (
                "no problem found, but the directory is in use by a running server: not definitive"
            )
        return "ok"


def required_ranks(ranks: Collection[int], world_size: int | None) -> range:
    """The vLLM worker ranks a key must be stored on to be complete (every backend's rule).

    With a world size: ranks ``0..world_size-1``, registered or not (a missing one makes nothing
    complete). Without: the contiguous run ``0..k-1`` of registered ranks, because vLLM's
    tensor-parallel workers are numbered from 0 without gaps. So a later contiguous rank makes
    older keys incomplete (honest), while a stray registration (``77`` next to ``0, 1``) or a
    rank beyond the world size counts for nothing instead of hiding every block.
    """
    if world_size is not None:
        return range(world_size)
    k = 0
    while k in ranks:
        k += 1
    return range(k)


@dataclass(frozen=True)
class VIndex:
    """The vLLM rank registry as an operator sees it (``GET /v1/vllm``)."""

    world_size: int | None
    ranks: tuple[int, ...]  # registered worker ranks, ascending

    @property
    def required(self) -> list[int]:
        return list(required_ranks(self.ranks, self.world_size))

    @property
    def ignored(self) -> list[int]:
        """Registered but not counted for completeness (stray, or beyond the world size)."""
        needed = required_ranks(self.ranks, self.world_size)
        return [r for r in self.ranks if r not in needed]

    @property
    def missing(self) -> list[int]:
        """Required by the world size but not registered: nothing is complete meanwhile."""
        have = set(self.ranks)
        return [r for r in required_ranks(self.ranks, self.world_size) if r not in have]

    def view(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "ranks": list(self.ranks),
            "required": self.required,
            "ignored": self.ignored,
            "missing": self.missing,
        }


def parse_cursor(cursor: str) -> int:
    """A dump cursor (``Backend.dump``): decimal digits, as both backends' cursors are (a
    page number, a Redis SCAN cursor); ``""``: the start.

    Raises:
        InvalidRequest: not a cursor a dump returned.
    """
    if cursor == "":
        return 0
    # (Redis answers an error, not a page, to a SCAN cursor beyond 64 bits.)
    digits = cursor.isascii() and cursor.isdigit() and len(cursor) <= 20
    if not digits or int(cursor) >= 1 << 64:
        shown = cursor if len(cursor) <= 40 else cursor[:37] + "..."
        raise InvalidRequest(
            f'`cursor` {shown!r} is not a cursor a dump returned; pass "" to start, then '
            'each reply\'s `cursor` until it is ""',
            "cursor",
        )
    return int(cursor)


class Backend(Protocol):
    """State of all pools. Every method is atomic with respect to every other call.

    Besides the pool operations, each backend answers what the operator routes ask
    (``describe``, ``failure``, ``check``, ``durability_stats``), so the server never has to
    guess what a backend can do.
    """

    name: str

    @property
    def describe(self) -> str:
        """Where the state lives, for the start-up log and ``/v1/pools`` (no passwords)."""
        ...

    @property
    def epoch(self) -> str:
        """Who holds the state: an opaque id that changes exactly when the backend's state may
        have been lost or replaced, and never otherwise (memory: each process start; a data
        directory: created with it and kept in it; Redis: re-created when Redis lost its data).

        Servers send it on every reply (``X-Kvmeta-Epoch``), so a client that sees it change
        knows its pools may be gone and initialises them again. Read on every reply: it must
        be a cached value (no I/O), ASCII letters, digits and ``-`` only."""
        ...

    @property
    def failure(self) -> str | None:
        """Why changes are refused right now (a journal that cannot be written), or None;
        ``/health`` says "degraded" and ``/ready`` fails meanwhile."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool: ...

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult: ...

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]: ...

    async def reserve(
        self, pool: PoolId, keys: list[str], parent: str | None = None
    ) -> list[tuple[bool, int]]:
        """``parent``: the prefix key the request names for its first key (the wire's ``[key,
        prefix_key]`` pairs; None: none). A hint for the eviction order (``Pool.reserve``); a
        store whose order does not follow chains ignores it."""
        ...

    async def confirm(
        self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]
    ) -> int: ...

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]: ...

    async def delete(self, pool: PoolId, keys: list[str]) -> int: ...

    async def clear(self, pool: PoolId) -> int: ...

    # The vLLM index is per tenant: each tenant has its own ranks (pools
    # ``PoolId("v", rank, "", tenant)``) and world size; ``tenant`` follows each operation's own
    # parameters (only ``v_remove``'s ``force`` flag comes after it, so that calls naming the
    # tenant by position keep their meaning).

    async def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> InitResult:
        """Register a worker rank (create its pool, or keep it) and, when ``world_size`` is
        given, pin the tenant's world size to it, atomically.

        Raises:
            Forbidden: ``change_world`` is false (the caller lacks the admin right) and
                ``world_size`` differs from the tenant's pinned world size; nothing was
                changed. Pinning the first one, or the same one, is always allowed.
        """
        ...

    async def v_exists(self, keys: list[str], tenant: str = "") -> list[bool]: ...

    async def v_clear(self, tenant: str = "") -> int: ...

    async def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> int | None:
        """Deregister a worker rank and drop its pool; the number of keys dropped, or None
        when the rank was not registered (idempotent).

        Raises:
            RankInUse: a lease on its pages is live (a reservation, a read lease, a released
                page's grace) and not ``force``; nothing was changed.
        """
        ...

    async def v_set_world_size(self, world_size: int | None, tenant: str = "") -> None:
        """Pin (an int) or unpin (None) the ranks that make a key complete."""
        ...

    async def v_index(self, tenant: str = "") -> VIndex: ...

    async def stats(self) -> list[PoolStats]: ...

    def stats_chunks(self, size: int = STATS_CHUNK) -> AsyncIterator[list[PoolStats]]:
        """``stats`` in pieces of at most ``size`` pools, with the loop free between pieces, for
        a caller that digests them as they come (the status sampler): with thousands of pools
        neither the reading nor the digesting holds the loop for long, and each piece's objects
        are garbage before the next is read. A pool removed meanwhile is left out."""
        ...

    async def budget(self, pool: PoolId) -> Budget:
        """Whether ``pool`` exists, the pages of all pools together (--max-total-pages), and
        the pages and pools of ``pool.tenant`` (its quotas). Runs only when a pool is created."""
        ...

    async def check(self) -> CheckReport:
        """The full page-invariant check of every pool: O(state), for diagnostics. It must not
        stall the other calls for long (check copies or chunks, not the whole state at once)."""
        ...

    def set_change_listener(self, listener: ChangeListener | None) -> None:
        """Report every durable change of stored keys to ``listener`` (``store.changes``), or
        stop reporting (None). Off by default: reporting costs nothing until it is set."""
        ...

    async def dump(self, pool: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        """Up to about ``limit`` stored keys of ``pool`` from ``cursor`` (``""``: the start), and
        the cursor to continue from (``""``: done). Like Redis SCAN: a key stored for the
        whole walk is returned at least once; one changed meanwhile may or may not be.
        Raises ``NotInitialized`` for a pool that does not exist."""
        ...

    async def settle_changes(self, pool: PoolId) -> None:
        """Return once every change of ``pool`` made before this call has been reported (or
        reported ``UNSURE``), so that a ``dump`` begun now is not followed by an older change.
        Immediate where changes are reported in the order they are made (this process's
        state); the Redis backend waits for its calls in flight (``store.redis.feed``)."""
        ...

    async def prefix_length(self, pool: PoolId, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first miss): what a
        router asks. A pure read: no LRU touch, no counter, no lease, so routers polling it
        change neither what is evicted next nor the engines' hit ratios. Raises
        ``NotInitialized`` for a pool that does not exist."""
        ...

    async def prefix_length_hashes(self, pool: PoolId, hashes: list[int]) -> int:
        """``prefix_length`` by SGLang's signed 64-bit block hashes (``core.hash_index``): how
        many, from the first, belong to stored keys. A pure read like ``prefix_length``.
        Raises ``NotInitialized`` for a pool that does not exist, and ``NoHashIndex`` for one
        that keeps no hash index (a vLLM pool; an SGLang pool without ``--hash-index``)."""
        ...

    def durability_stats(self) -> dict[str, float]:
        """Counters of the local journal and snapshots for ``/metrics`` (``kvmeta_durability_*``);
        empty when no state is kept on this machine's disk."""
        ...
