"""The operations of both dialects, once: validation order, limits, page budget, errors,
the store calls, caller warnings and log lines.

The server runs over an async ``Backend`` (its durable and Redis backends await journal
fsyncs and network round trips); the in-process clients run over a synchronous
``MemoryStore``. Both stores have the same method names with the same arguments, so an
operation here is written once, as a generator that never does I/O itself (the "sans-I/O"
style):

- it validates the request with ``RequestLimits`` (in the caller's dialect: field names are
  passed in, ``limits.CONFIRM_FIELDS``), raising before any store call, so a rejected request
  changes nothing;
- it ``yield``s each store call it needs as a ``StoreCall`` (method name, arguments) and
  receives the result, or has the store's exception thrown back in at the ``yield``;
- it returns the operation's value, with the caller warnings (``service.warnings``) for
  outcomes that keep their compatible reply but deserve a word (``Outcome``).

A driver performs the calls: ``run_sync`` calls the store directly (``client._local``, under its
lock), ``run_async`` awaits the backend (``service.ops.Service``). Nothing else decides what is
checked, in which order, or what an error says. An operation that reads state before it
changes it (the page budget of a new pool) needs the two calls to be atomic: the sync driver's
caller holds one lock over the whole operation; ``Service`` holds its initialize lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, NotInitialized
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
from kvmeta.service.warnings import (
    CallerWarning,
    batch_refused,
    confirm_refused,
    size_conflict,
)
from kvmeta.store.base import Budget, InitResult, PoolStats, VIndex

__all__ = [
    "Op",
    "Operations",
    "Outcome",
    "StoreCall",
    "no_tenant_caps",
    "run_async",
    "run_sync",
]

logger = logging.getLogger("kvmeta.service.ops")

T = TypeVar("T")

# Fields the store's own page-range check names (``core.pool``, in dialect S's words).
_PAGE_FIELDS = frozenset(("written_keys_to_confirm", "pages_to_release"))
_MISSING: Any = object()


def no_tenant_caps(tenant: str) -> TenantCaps:
    """The default: no tenant has limits of its own (the flags apply to every tenant)."""
    return NO_CAPS


# One call on the store, ``(method, args)``: ``getattr(store, method)(*args)``, awaited on an
# async backend. A plain tuple (a NamedTuple costs ~0.4 us more per request).
StoreCall = tuple[str, tuple[Any, ...]]


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """An operation's value and the caller warnings it earned (``(kind, text)`` pairs: the
    server sends each as ``X-Kvmeta-Warning: kind: text``, in-process clients log it)."""

    value: T
    warnings: list[CallerWarning] = field(default_factory=list)


# An operation: yields store calls, receives their results, returns its value.
Op = Generator[StoreCall, Any, T]


def run_sync(op: Op[T], store: Any) -> T:
    """Run ``op`` on a synchronous store (``MemoryStore``); the caller provides atomicity."""
    try:
        call = next(op)
        while True:
            try:
                result = getattr(store, call[0])(*call[1])
            except Exception as exc:  # the op may name it in its caller's words, or re-raise
                call = op.throw(exc)
            else:
                call = op.send(result)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def run_async(op: Op[T], backend: Any) -> T:
    """Run ``op`` on an async ``Backend``, awaiting each call (journal waits, round trips)."""
    try:
        call = next(op)
        while True:
            try:
                result = await getattr(backend, call[0])(*call[1])
            except Exception as exc:
                call = op.throw(exc)
            else:
                call = op.send(result)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


class Operations:
    """Every operation of both dialects as an ``Op``. Stateless apart from the limits and the
    tenants' own quotas, so one instance serves any number of drivers."""

    def __init__(
        self,
        limits: RequestLimits | None = None,
        tenant_caps: Callable[[str], TenantCaps] = no_tenant_caps,
    ) -> None:
        self.limits = limits or RequestLimits()
        # Each tenant's own quotas (the tokens file's), checked when a pool is created.
        self.tenant_caps = tenant_caps

    # ------------------------------------------------------------------ pools (both dialects)

    def _budget(self, pool: PoolId, num_pages: int) -> Op[None]:
        """A new pool must fit its tenant's pool count and page quota (429) and
        --max-total-pages (400); re-initialising an existing one allocates nothing and always
        passes."""
        budget: Budget = yield ("budget", (pool,))
        if budget.exists:
            return
        tenant = pool.tenant
        self.limits.check_new_pool(tenant, self.tenant_caps(tenant), budget, num_pages)

    def initialize(self, pool: PoolId, num_pages: int) -> Op[Outcome[InitResult]]:
        """Create a pool whole or not at all: rank, size and budget are checked first."""
        limits = self.limits
        limits.check_rank(pool.rank)
        limits.check_num_pages(num_pages)
        if pool.dialect == "s":
            limits.check_namespace(pool.namespace)
        yield from self._budget(pool, num_pages)
        result: InitResult = yield ("initialize", (pool, num_pages))
        if result.created:
            logger.info("Created pool %s with %d pages", pool, num_pages)
        return Outcome(result, [size_conflict(pool, result)] if result.conflict else [])

    def exists(self, pool: PoolId, keys: list[str]) -> Op[list[bool]]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return (yield ("exists", (pool, keys)))  # type: ignore[no-any-return]

    def reserve(self, pool: PoolId, keys: list[str]) -> Op[list[tuple[bool, int]]]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return (yield ("reserve", (pool, keys)))  # type: ignore[no-any-return]

    def confirm(
        self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]
    ) -> Op[Outcome[int]]:
        """The value is how many pairs were refused (pages not reserved for their key)."""
        fields = CONFIRM_FIELDS[pool.dialect]
        self.limits.check_rank(pool.rank)
        self.limits.check_confirm(pairs, release, fields)
        try:
            refused: int = yield ("confirm", (pool, pairs, release))
        except InvalidRequest as exc:
            if exc.field not in _PAGE_FIELDS:
                raise
            # The store refused a page outside the pool (nothing was applied; the page range is
            # checked there, atomically with the confirm): name it in the caller's dialect.
            stats: list[PoolStats] = yield ("stats", ())
            for st in stats:
                if st.pool == pool:
                    self.limits.check_pages(pairs, release, st.num_pages, fields)
            raise
        return Outcome(refused, [confirm_refused(refused)] if refused else [])

    def get(self, pool: PoolId, keys: list[str]) -> Op[list[int | None]]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return (yield ("get", (pool, keys)))  # type: ignore[no-any-return]

    def delete(self, pool: PoolId, keys: list[str]) -> Op[int]:
        self.limits.check_rank(pool.rank)
        self.limits.check_keys(keys)
        return (yield ("delete", (pool, keys)))  # type: ignore[no-any-return]

    def clear(self, pool: PoolId) -> Op[int]:
        self.limits.check_rank(pool.rank)
        return (yield ("clear", (pool,)))  # type: ignore[no-any-return]

    def stats(self) -> Op[list[PoolStats]]:
        return (yield ("stats", ()))  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ router reads

    def prefix_match(
        self, pools: list[tuple[PoolId, list[str], list[int] | None]]
    ) -> Op[list[int | None]]:
        """Per pool, how many of its keys (or, when ``hashes`` is given, of SGLang's 64-bit
        block hashes: ``Backend.prefix_length_hashes``), from the first, are stored; None: no
        such pool (a router asks about engines that may not have started yet: not an error).
        A pure read (``Backend.prefix_length``): no LRU touch, no counter. O(request): each
        pool's walk stops at its first miss."""
        limits = self.limits
        limits.check_prefix([(keys, hashes) for _, keys, hashes in pools])
        for pool, _, _ in pools:
            limits.check_rank(pool.rank)
        out: list[int | None] = []
        for pool, keys, hashes in pools:
            try:
                if hashes is None:
                    length: int = yield ("prefix_length", (pool, keys))
                else:
                    length = yield ("prefix_length_hashes", (pool, hashes))
            except NotInitialized:
                out.append(None)
            else:
                out.append(length)
        return out

    def dump(self, pool: PoolId, cursor: str, limit: int) -> Op[tuple[list[str], str]]:
        """One page of a pool's stored keys (``Backend.dump``), for an indexer to bootstrap."""
        self.limits.check_rank(pool.rank)
        self.limits.check_dump_limit(limit)
        return (yield ("dump", (pool, cursor, limit)))  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ vLLM's key-centric index

    def v_initialize(
        self,
        rank: int,
        role: Any = "worker",
        num_pages: Any = _MISSING,
        world_size: Any = None,
        tenant: str = "",
    ) -> Op[Outcome[str]]:
        """vLLM's ``initialize`` whole: role and fields (``service.vllm.check_initialize``),
        then the limits, every error in the reference server's ``Invalid initialization
        parameters: `` words. The value is the reply message."""
        self.limits.check_rank(rank)  # (over HTTP the router checks the path rank first)
        fields = {"role": role, "world_size": world_size}
        if num_pages is not _MISSING:
            fields["num_pages"] = num_pages
        worker = check_initialize(rank, **fields)
        if worker is None:
            return Outcome(SCHEDULER_MESSAGE)
        try:
            done = yield from self.v_register(rank, worker.num_pages, worker.world_size, tenant)
        except InvalidRequest as exc:  # a limit such as --max-pages, in vLLM's framing
            raise InvalidRequest(INIT_ERROR + str(exc), exc.field) from None
        result = done.value
        return Outcome(worker_message(rank, result.num_pages, result.requested), done.warnings)

    def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> Op[Outcome[InitResult]]:
        """A worker rank's pool (a validated registration: ``v_initialize`` checks the body).
        ``change_world`` false (a token without the admin right): a ``world_size`` that would
        move the tenant's pinned one is refused by the store, atomically (``Forbidden``)."""
        limits = self.limits
        limits.check_rank(rank)
        limits.check_num_pages(num_pages)
        limits.check_world_size(world_size)
        pool = PoolId("v", rank, "", tenant)
        yield from self._budget(pool, num_pages)
        call = (rank, num_pages, world_size, tenant, change_world)
        result: InitResult = yield ("v_register", call)
        if result.created:
            logger.info("Registered %s with %d pages", pool, num_pages)
        index: VIndex = yield ("v_index", (tenant,))
        warning = ignored_rank_warning(rank, index)
        if warning:
            warn_limited(logger, "ignored_rank", "%s", warning)
        return Outcome(result, [size_conflict(pool, result)] if result.conflict else [])

    def v_allocate(self, pool: PoolId, keys: list[str]) -> Op[Outcome[list[tuple[bool, int]]]]:
        """vLLM's batch_allocate: a reserve on a vLLM pool, which every store grants whole or
        not at all (``core.pool.Pool.reserve``); a refused batch earns a caller warning, as
        its reply (-1 per new key) looks like the reference server's partial one."""
        out: list[tuple[bool, int]] = yield from self.reserve(pool, keys)
        refused = sum(1 for _, page in out if page < 0)
        return Outcome(out, [batch_refused(refused, pool.rank)] if refused else [])

    def v_exists(self, keys: list[str], tenant: str = "") -> Op[list[bool]]:
        self.limits.check_keys(keys)
        return (yield ("v_exists", (keys, tenant)))  # type: ignore[no-any-return]

    def v_clear(self, tenant: str = "") -> Op[int]:
        return (yield ("v_clear", (tenant,)))  # type: ignore[no-any-return]

    def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> Op[int | None]:
        """The number of keys dropped, or None when the rank was not registered; refused
        (``RankInUse``) while its pages are in use, unless ``force``."""
        self.limits.check_rank(rank)
        dropped: int | None = yield ("v_remove", (rank, tenant, force))
        if dropped is not None:
            pool = PoolId("v", rank, "", tenant)
            how = " (forced: writes and reads in flight on it, if any, were dropped)"
            logger.warning(
                "Removed %s and its %d stored keys%s", pool, dropped, how if force else ""
            )
        return dropped

    def v_set_world_size(self, world_size: Any, tenant: str = "") -> Op[None]:
        """Pin (a positive int) or unpin (None) the ranks that make a key complete."""
        size = check_world_size_body({"world_size": world_size})
        self.limits.check_world_size(size)
        yield ("v_set_world_size", (size, tenant))
        owner = f" of tenant '{tenant}'" if tenant else ""
        if size is None:
            logger.info(
                "vLLM world_size%s unset: the contiguous registered ranks from 0 count", owner
            )
        else:
            logger.info("vLLM world_size%s set to %d", owner, size)

    def v_index(self, tenant: str = "") -> Op[VIndex]:
        return (yield ("v_index", (tenant,)))  # type: ignore[no-any-return]
