"""The ``/metrics`` series read from the backend at scrape time: each pool's pages and
counters (``kvmeta_pool_*``), capped at ``--metrics-max-pools`` series, and the backend's
durability statistics (``kvmeta_journal_*``, ``kvmeta_redis_*``).

Apart from ``server.metrics`` (which counts requests on the loop and renders the scrape) as
they hold the tables of names and help texts of the store's own figures.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmeta.store.base import PoolStats

__all__ = ["OTHER", "POOL_LABELS", "cap_pools", "durability_metrics", "pool_metrics"]

OTHER = "_other"  # rank and namespace label of the pools summed beyond --metrics-max-pools

POOL_LABELS = ("dialect", "rank", "namespace", "tenant")

# PoolCounters field -> labels of the two multi-outcome families.
_LOOKUPS: dict[str, tuple[str, str]] = {
    "exists_hits": ("exists", "hit"),
    "exists_misses": ("exists", "miss"),
    "get_hits": ("get", "hit"),
    "get_misses": ("get", "miss"),
}
_RESERVATIONS: dict[str, str] = {
    "reservations": "granted",
    "reservations_expired": "expired",
    "reservations_refused": "refused",
}
_POOL_SIMPLE: dict[str, str] = {
    "reserve_hits": "keys asked to reserve that were already stored",
    "commits": "pages committed by confirm_write",
    "confirms_refused": "confirms refused (page not reserved for that key)",
    "releases": "reserved pages released by their writers",
    "evictions": "stored pages evicted (in the --eviction policy's order) to make room",
    "deletes": "keys deleted",
    "clears": "pool clears",
}
_DURABILITY: dict[str, tuple[str, str, bool]] = {
    # key -> (metric, help, is_counter)
    "fsyncs": ("kvmeta_journal_fsyncs", "journal fsync calls", True),
    "fsync_seconds_total": ("kvmeta_journal_fsync_seconds", "time spent in fsync", True),
    "fsync_seconds_max": ("kvmeta_journal_fsync_seconds_max", "slowest fsync so far", False),
    "journal_bytes": ("kvmeta_journal_bytes", "bytes appended to the journal", True),
    "journal_records": ("kvmeta_journal_records", "records appended to the journal", True),
    "snapshots": ("kvmeta_snapshots", "snapshots written", True),
    "snapshot_stall_seconds_max": (
        "kvmeta_snapshot_stall_seconds_max",
        "longest event-loop pause to capture a snapshot",
        False,
    ),
    "reserve_waits": (
        "kvmeta_reserve_disk_waits",
        "reserves that waited for a removal to be durable",
        True,
    ),
    "reserve_wait_seconds": (
        "kvmeta_reserve_disk_wait_seconds_total",
        "seconds reserves spent waiting for a removal to be durable",
        True,
    ),
    "journal_failed": (
        "kvmeta_journal_failed",
        "1 while the journal cannot be written (changes answer 503; see /health)",
        False,
    ),
    "fsync_stalled": (
        "kvmeta_journal_fsync_stalled",
        "1 while a journal fsync is older than --fsync-timeout: the disk stopped answering "
        "(changes answer 503; see /health)",
        False,
    ),
    "fsync_stalls": (
        "kvmeta_journal_fsync_stalls",
        "times a journal fsync outlasted --fsync-timeout",
        True,
    ),
    "fsync_pending_seconds": (
        "kvmeta_journal_fsync_pending_seconds",
        "age of the journal fsync in progress (0: none)",
        False,
    ),
    "redis_primaries": (
        "kvmeta_redis_primaries",
        "Redis/Valkey primaries holding the state, at the last readiness probe",
        False,
    ),
    "redis_replicas_min": (
        "kvmeta_redis_replicas_min",
        "the fewest connected replicas of any primary (below --min-replicas-ack: writes 503)",
        False,
    ),
}


def cap_pools(pools: list[PoolStats], max_pools: int | None) -> list[tuple[list[str], PoolStats]]:
    """(labels, stats) per series: the first ``max_pools`` pools in (dialect, rank, namespace)
    order as they are, the rest summed per dialect and tenant with rank and namespace ``_other``.
    The order is stable, so a pool keeps its series until pools sorting before it appear."""
    ordered = sorted(pools, key=lambda st: st.pool)
    if max_pools is None or len(ordered) <= max_pools:
        rest: list[PoolStats] = []
    else:
        ordered, rest = ordered[:max_pools], ordered[max_pools:]
    out = [
        ([st.pool.dialect, str(st.pool.rank), st.pool.namespace, st.pool.tenant], st)
        for st in ordered
    ]
    summed: dict[tuple[str, str], PoolStats] = {}
    for st in rest:
        group = (st.pool.dialect, st.pool.tenant)
        agg = summed.get(group)
        if agg is None:
            agg = summed[group] = PoolStats(st.pool, 0, 0, 0, 0, {}, 0)
        agg.num_pages += st.num_pages
        agg.free += st.free
        agg.cooling += st.cooling
        agg.held_after_restart += st.held_after_restart
        agg.reserved += st.reserved
        agg.stored += st.stored
        agg.size_conflicts += st.size_conflicts
        if st.dead is not None:
            agg.dead = (agg.dead or 0) + st.dead
        for name, value in st.counters.items():
            agg.counters[name] = agg.counters.get(name, 0) + value
    out.extend(
        ([dialect, OTHER, OTHER, tenant], agg) for (dialect, tenant), agg in sorted(summed.items())
    )
    return out


def pool_metrics(pools: list[tuple[list[str], PoolStats]]) -> Iterator[Metric]:
    size = GaugeMetricFamily("kvmeta_pool_size_pages", "pages in the pool", labels=POOL_LABELS)
    pages = GaugeMetricFamily(
        "kvmeta_pool_pages",
        "pages by state (free: a reserve takes them without evicting; cooling: freed, not "
        "handed out again until a read lease or the release grace ends)",
        labels=[*POOL_LABELS, "state"],
    )
    keys = GaugeMetricFamily("kvmeta_pool_keys", "keys stored in the pool", labels=POOL_LABELS)
    held = GaugeMetricFamily(
        "kvmeta_pool_restart_held_pages",
        "cooling pages held after a restart until the previous run's leases would have ended",
        labels=POOL_LABELS,
    )
    conflicts = CounterMetricFamily(
        "kvmeta_pool_size_conflicts",
        "re-initialisations asking for another num_pages (misconfiguration)",
        labels=POOL_LABELS,
    )
    lookups = CounterMetricFamily(
        "kvmeta_pool_lookups",
        "keys looked up, by op and result",
        labels=[*POOL_LABELS, "op", "result"],
    )
    reservations = CounterMetricFamily(
        "kvmeta_pool_reservations",
        "new page reservations by outcome (granted, expired unconfirmed, refused: no page)",
        labels=[*POOL_LABELS, "outcome"],
    )
    dead = GaugeMetricFamily(
        "kvmeta_dead_pages",
        "stored pages whose parent page (the previous key of the request that stored them) is "
        "gone, so no leading-hit lookup reaches them; only pools whose eviction policy learns "
        "parents (--eviction prefix) report it",
        labels=POOL_LABELS,
    )
    simple = {
        name: CounterMetricFamily(f"kvmeta_pool_{name}", help_, labels=POOL_LABELS)
        for name, help_ in _POOL_SIMPLE.items()
    }
    for labels, st in pools:
        size.add_metric(labels, st.num_pages)
        for state, value in (
            ("free", st.free),
            ("cooling", st.cooling),
            ("reserved", st.reserved),
            ("stored", st.stored),
        ):
            pages.add_metric([*labels, state], value)
        keys.add_metric(labels, st.stored)
        held.add_metric(labels, st.held_after_restart)
        conflicts.add_metric(labels, st.size_conflicts)
        if st.dead is not None:
            dead.add_metric(labels, st.dead)
        for name, value in st.counters.items():
            if name in _LOOKUPS:
                lookups.add_metric([*labels, *_LOOKUPS[name]], value)
            elif name in _RESERVATIONS:
                reservations.add_metric([*labels, _RESERVATIONS[name]], value)
            elif name in simple:
                simple[name].add_metric(labels, value)
    yield from (size, pages, keys, held, conflicts, dead, lookups, reservations, *simple.values())


def durability_metrics(stats: dict[str, float]) -> Iterator[Metric]:
    for key, value in sorted(stats.items()):
        name, help_, is_counter = _DURABILITY.get(
            key, (f"kvmeta_durability_{key}", f"backend durability statistic {key}", False)
        )
        family = CounterMetricFamily if is_counter else GaugeMetricFamily
        yield family(name, help_, value=float(value))
