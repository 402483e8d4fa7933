"""Request limits: each has a flag, a default, and an error that says how to raise it.

The checks are applied in one place, the ``Service`` (``service.ops``), which the server and
the in-process clients both run; every check takes the field names of the caller's dialect,
so an error reads the same in-process and over HTTP and never names another dialect's fields.

What a tenant may create (``check_new_pool``) is bounded three ways, in this order: its pool
count (``--max-pools-per-tenant``, or its own ``max_pools``), its pages (its own ``max_pages``,
or else, when the tokens file names several tenants, an equal share of ``--max-total-pages``)
and the pages of all pools together (``--max-total-pages``). A tenant's refusal never tells it
what other tenants hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from operator import itemgetter

from kvmeta.errors import InvalidRequest, PayloadTooLarge, QuotaExceeded, show_number
from kvmeta.store.base import Budget

__all__ = [
    "BYTES_PER_PAGE",
    "CONFIRM_FIELDS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DUMP_LIMIT",
    "MAX_PREFIX_POOLS",
    "NO_CAPS",
    "QUOTA_RETRY_AFTER",
    "ConfirmFields",
    "RequestLimits",
    "TenantCaps",
    "rank_error",
    "show_number",
]

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:\-]+")

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# Router reads (``Service.prefix_match``, ``Service.dump``). A dump page of at most this many keys
# (~1 MiB of JSON at 100-character keys) keeps one reply, and the scan behind it, short;
# a bigger pool is read in more pages. Pools per prefix_match: a router asks about the engines
# it routes to, a handful to a few hundred.
MAX_DUMP_LIMIT = 10000
MAX_PREFIX_POOLS = 1024

# Memory an in-process pool takes per page it has used (measured with tracemalloc: a state byte,
# a key slot, a read-lease double and two int32 LRU links, 26 bytes; the arrays grow with the
# pages used, ``core.pool``). Used to explain --max-pages / --max-total-pages in their errors:
# they bound the pages pools may use, so the memory those pages can grow to.
BYTES_PER_PAGE = 26

# Retry-After of a tenant quota refusal (pages, pools): waiting alone frees nothing (an operator
# or the tenant must act), so clients are told not to hammer.
QUOTA_RETRY_AFTER = 60.0

_REMOVE_POOLS = (
    "Remove pools it no longer uses (a vLLM rank: POST /v1/vllm/ranks/{rank}/remove; "
    "clearing keys frees nothing)"
)
_RELOAD = "in the tokens file (--auth-file) and reload it (SIGHUP)"


@dataclass(frozen=True)
class TenantCaps:
    """One tenant's own limits from the tokens file (None: none given), and how many tenants
    the file names (a tenant without ``max_pages`` then gets an equal share of the pages)."""

    max_pages: int | None = None
    max_pools: int | None = None
    tenants: int = 1


NO_CAPS = TenantCaps()


@dataclass(frozen=True)
class ConfirmFields:
    """What a dialect calls the parts of a confirm, and the op that hands out pages."""

    pairs: str
    release: str
    reserve: str


CONFIRM_FIELDS: dict[str, ConfirmFields] = {
    "s": ConfirmFields("written_keys_to_confirm", "pages_to_release", "reserve"),
    "v": ConfirmFields("confirmations", "pages_to_release", "batch_allocate"),
}


def rank_error(rank: int | str, field: str) -> str:
    """The message for a rank outside a signed 64-bit integer, wherever it came from."""
    return (
        f"`{field}` {show_number(rank)} is out of range: a rank must fit in a signed 64-bit "
        f"integer ({INT64_MIN}..{INT64_MAX}); pass the engine's tensor-parallel rank (0, 1, ...)"
    )


def _gib(pages: int) -> str:
    """Memory that many pages take, roughly."""
    size = pages * BYTES_PER_PAGE
    if size >= 1 << 30:
        return f"~{size / (1 << 30):.1f} GiB"
    return f"~{max(size >> 20, 1)} MiB"


@dataclass(frozen=True)
class RequestLimits:
    """Defaults fit every engine batch seen in the wild (<= 256 keys of <= 80 characters)
    with a wide margin, while keeping one request's CPU time bounded. Page limits keep pools
    from growing to more memory than a small (2-core, 24 GiB) machine has: a pool costs
    ``BYTES_PER_PAGE`` bytes per page it has used, and never uses more than ``num_pages``."""

    max_keys: int = 65536
    max_key_length: int = 1024
    max_namespace_length: int = 128
    max_pages: int = 1 << 24
    max_world_size: int = 4096
    max_total_pages: int = 1 << 27
    # A vLLM deployment has one pool per rank (up to --max-world-size), an SGLang one one per
    # rank and pool name; every pool costs the status sampler and /metrics a little.
    max_pools_per_tenant: int = 4096

    def check_keys(self, keys: list[str], field: str = "keys") -> None:
        """Raises PayloadTooLarge / InvalidRequest naming the limit and its flag."""
        if len(keys) > self.max_keys:
            raise PayloadTooLarge(
                f"`{field}` has {len(keys)} entries, more than the limit of {self.max_keys} per "
                "request; split the batch or raise --max-keys",
                field,
            )
        limit = self.max_key_length
        if not keys or max(map(len, keys)) <= limit:
            return  # the common case, checked in C; the loop below names the culprit
        for key in keys:
            if len(key) > limit:
                raise InvalidRequest(
                    f"a key in `{field}` is {len(key)} characters long, more than the limit of "
                    f"{limit}; use shorter keys (e.g. a hash) or raise --max-key-length",
                    field,
                )

    def check_prefix(self, pools: list[tuple[list[str], list[int] | None]]) -> None:
        """A prefix_match: pool count, keys (or hashes) of all pools together (--max-keys),
        key lengths.

        Raises:
            PayloadTooLarge / InvalidRequest: naming ``pools`` (or ``pools[i].keys``) and the
                fix.
        """
        if len(pools) > MAX_PREFIX_POOLS:
            raise PayloadTooLarge(
                f"`pools` has {len(pools)} entries, more than the limit of {MAX_PREFIX_POOLS} "
                "per request; split the request",
                "pools",
            )
        total = sum(len(keys) if hashes is None else len(hashes) for keys, hashes in pools)
        if total > self.max_keys:
            raise PayloadTooLarge(
                f"`pools[].keys` (or `hashes`) have {total} entries together, more than the "
                f"limit of {self.max_keys} per request; ask fewer (a prefix match stops at "
                "the first miss: send the leading ones first), split the request, or raise "
                "--max-keys",
                "pools",
            )
        for i, (keys, _) in enumerate(pools):
            self.check_keys(keys, f"pools[{i}].keys")

    @staticmethod
    def check_dump_limit(limit: int) -> None:
        if not 1 <= limit <= MAX_DUMP_LIMIT:
            raise InvalidRequest(
                f"`limit` {show_number(limit)} is out of range: pass 1..{MAX_DUMP_LIMIT} keys "
                "per page and follow `cursor` for the rest",
                "limit",
            )

    def check_confirm(
        self, pairs: list[tuple[str, int]], release: list[int], fields: ConfirmFields
    ) -> None:
        """Entry count and key lengths of a confirm, in the caller's dialect."""
        if len(pairs) + len(release) > self.max_keys:
            raise PayloadTooLarge(
                f"`{fields.pairs}` + `{fields.release}` have {len(pairs) + len(release)} "
                f"entries, more than the limit of {self.max_keys} per request; split the batch "
                "or raise --max-keys",
                fields.pairs,
            )
        if pairs and max(map(len, map(itemgetter(0), pairs))) > self.max_key_length:
            self.check_keys([k for k, _ in pairs], fields.pairs)

    def check_namespace(self, namespace: str) -> None:
        if len(namespace) > self.max_namespace_length:
            raise InvalidRequest(
                f"`namespace` is {len(namespace)} characters long, more than the limit of "
                f"{self.max_namespace_length}; use a short pool name or raise "
                "--max-namespace-length",
                "namespace",
            )
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise InvalidRequest(
                f"`namespace` {namespace!r} must be non-empty and use only letters, digits and "
                "`_.:-`; use a plain pool name such as 'kv'",
                "namespace",
            )

    def check_num_pages(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise InvalidRequest(
                f"`num_pages` must be a positive integer, got {show_number(num_pages)}; pass the "
                "number of pages in the pool's backing file (file size // page size)",
                "num_pages",
            )
        if num_pages > self.max_pages:
            raise InvalidRequest(
                f"`num_pages` {show_number(num_pages)} exceeds the limit of {self.max_pages} "
                f"({_gib(self.max_pages)} of memory once used); check the page size computation or "
                "raise --max-pages",
                "num_pages",
            )

    def page_quota(self, tenant: str, caps: TenantCaps) -> tuple[int | None, bool]:
        """The tenant's cap on the pages of its pools (None: none but the total), and whether
        it is its default share: a tokens file naming several tenants splits
        --max-total-pages equally among those without a ``max_pages`` of their own, so none
        of them can take the pages every other tenant needs. The default tenant ("": no
        tokens file, or the all-access --auth-token) has no share."""
        if caps.max_pages is not None:
            return caps.max_pages, False
        if tenant and caps.tenants > 1:
            return self.max_total_pages // caps.tenants, True
        return None, False

    def check_new_pool(self, tenant: str, caps: TenantCaps, budget: Budget, num_pages: int) -> None:
        """A new pool of ``num_pages`` for ``tenant`` (``budget``: what exists now) fits its
        pool count and page quota (429) and --max-total-pages (400)."""
        max_pools = self.max_pools_per_tenant if caps.max_pools is None else caps.max_pools
        if budget.tenant_pools >= max_pools:
            raise _pools_exceeded(tenant, max_pools, budget.tenant_pools, caps.max_pools is None)
        cap, shared = self.page_quota(tenant, caps)
        if cap is not None and budget.tenant_pages + num_pages > cap:
            raise _pages_exceeded(tenant, cap, budget.tenant_pages, num_pages, shared)
        self.check_total_pages(budget.total_pages, num_pages, tenant)

    def check_total_pages(self, used: int, num_pages: int, tenant: str = "") -> None:
        """A new pool of ``num_pages`` fits the budget across all pools (``used`` so far). A
        tenant of a tokens file is not told how many pages are in use: most are others'."""
        if used + num_pages <= self.max_total_pages:
            return
        if tenant:
            raise InvalidRequest(
                f"`num_pages` {num_pages} for a new pool of tenant '{tenant}' does not fit in "
                "the pages left to all tenants together (--max-total-pages); nothing was "
                "created. Use a smaller pool or remove pools this tenant no longer uses, or "
                "ask the server's operator to raise --max-total-pages or to give tenants "
                "max_pages quotas in the tokens file",
                "num_pages",
            )
        raise InvalidRequest(
            f"`num_pages` {num_pages} for a new pool would bring all pools to "
            f"{used + num_pages} pages, more than --max-total-pages {self.max_total_pages} "
            f"({_gib(self.max_total_pages)} of memory once used; {used} pages are in use); use "
            "smaller pools, clear out unused ones, or raise --max-total-pages if the "
            "machine has the memory; nothing was created",
            "num_pages",
        )

    @staticmethod
    def check_rank(rank: int, field: str = "rank") -> None:
        if not INT64_MIN <= rank <= INT64_MAX:
            raise InvalidRequest(rank_error(rank, field), field)

    def check_world_size(self, world_size: int | None) -> None:
        if world_size is not None and world_size > self.max_world_size:
            raise InvalidRequest(
                f"`world_size` {show_number(world_size)} exceeds the limit of "
                f"{self.max_world_size}; pass the tensor-parallel size, or raise --max-world-size",
                "world_size",
            )


def _pages_exceeded(
    tenant: str, cap: int, used: int, requested: int, shared: bool
) -> QuotaExceeded:
    """The 429 of a new pool over its tenant's page quota (its own, or its default share)."""
    if shared:
        what = (
            f"its share of the server's pages, {cap} (it has no max_pages of its own, so "
            "--max-total-pages is divided equally among the tenants of the tokens file)"
        )
        fix = f"or give this tenant its own max_pages {_RELOAD}"
    else:
        what = f"its max_pages {cap}"
        fix = f"or raise max_pages for this tenant {_RELOAD}"
    return QuotaExceeded(
        f"tenant '{tenant}' page quota exceeded: a new pool of {requested} pages would bring "
        f"its pools to {used + requested} pages, more than {what} ({used} pages in use; a "
        "pool's pages count whether they hold keys or not, so clearing keys does not free "
        f"them). {_REMOVE_POOLS}, create smaller ones, {fix}; nothing was created",
        retry_after=QUOTA_RETRY_AFTER,
    )


def _pools_exceeded(tenant: str, cap: int, pools: int, by_flag: bool) -> QuotaExceeded:
    """The 429 of a new pool beyond its tenant's pool count, whatever the pool's size."""
    who = f"tenant '{tenant}'" if tenant else "the default tenant"
    if by_flag:
        limit = f"--max-pools-per-tenant {cap}"
        fix = "raise --max-pools-per-tenant"
        if tenant:
            fix += f", or give this tenant its own max_pools {_RELOAD}"
    else:
        limit = f"its max_pools {cap}"
        fix = f"raise max_pools for this tenant {_RELOAD}"
    return QuotaExceeded(
        f"{who} pool limit reached: it has {pools} pools, the most it may have ({limit}); "
        f"every pool counts, whatever its size. {_REMOVE_POOLS}, or {fix}; nothing was "
        "created",
        retry_after=QUOTA_RETRY_AFTER,
    )
