"""Prometheus metrics: per-pool state read from the backend at scrape time, per-route request
counts and latency histograms, auth failures and journal fsync statistics.

Why not prometheus-client's ``Counter``/``Histogram`` on the request path: each ``observe``
takes a lock, a noticeable share of a request's whole CPU budget (benchmarks/README.md,
"Implementation costs"). Requests are served on one event loop thread, so plain ints and a
bucket list per route, updated without locks, are exact; a custom collector turns them into
metric families only when Prometheus scrapes. Labels are bounded: dialect, rank, namespace,
tenant (from the tokens file), route pattern, method and status, never keys; and pool series
are capped (``--metrics-max-pools``): the first pools in (dialect, rank, namespace, tenant)
order keep their own series, the others are summed per dialect and tenant under
``rank="_other", namespace="_other"``, so thousands of pools cannot make a scrape megabytes
long (benchmarks/README.md, "Operator routes"). The text is rendered in a thread
(``render_metrics_async``) so a scrape never stalls serving. The pool and durability series,
read from the backend, are made in ``metrics_pools``.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Iterator
from time import perf_counter
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvmeta.errors import KvmetaError
from kvmeta.server.app import RouteHandler
from kvmeta.server.http import Request, Response
from kvmeta.server.metrics_pools import (
    OTHER,
    POOL_LABELS,
    cap_pools,
    durability_metrics,
    pool_metrics,
)
from kvmeta.store.base import PoolStats

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "OTHER",
    "PREFIX_BUCKETS",
    "PREFIX_HITS",
    "REFUSED_BATCHES",
    "PrefixHits",
    "RequestMetrics",
    "RouteStats",
    "cap_pools",
    "render_metrics",
    "render_metrics_async",
]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# Seconds; from a request that needs no disk wait (well under a millisecond) up to one that
# waits for an fsync. Finer around 1 ms, where the latency targets are (a p99 read from the
# histogram is interpolated within one bucket: from 1 to 2.5 ms that overstated a true 1.3 ms
# p99 as 2 ms).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class RouteStats:
    """Counts and latency buckets of one (method, route pattern)."""

    __slots__ = ("method", "pattern", "statuses", "buckets", "seconds")

    def __init__(self, method: str, pattern: str) -> None:
        self.method = method
        self.pattern = pattern
        self.statuses: dict[int, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # last one: +Inf
        self.seconds = 0.0

    def copy(self) -> RouteStats:
        """A copy to render elsewhere while this one keeps counting."""
        other = RouteStats(self.method, self.pattern)
        other.statuses = dict(self.statuses)
        other.buckets = list(self.buckets)
        other.seconds = self.seconds
        return other

    def record(self, status: int, seconds: float) -> None:
        statuses = self.statuses
        statuses[status] = statuses.get(status, 0) + 1
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.seconds += seconds


class RequestMetrics:
    """Per-route instrumentation; ``wrap`` is given to ``App.wrap_handlers``."""

    def __init__(self) -> None:
        self.routes: list[RouteStats] = []

    def wrap(self, method: str, pattern: str, handler: RouteHandler) -> RouteHandler:
        stats = RouteStats(method, pattern)
        self.routes.append(stats)
        record = stats.record

        async def timed(request: Request, rank: int) -> Response:
            start = perf_counter()
            try:
                response = await handler(request, rank)
            except KvmetaError as exc:
                record(exc.status, perf_counter() - start)
                raise
            except Exception:
                record(500, perf_counter() - start)
                raise
            record(response.status, perf_counter() - start)
            return response

        return timed


# Leading-hit lengths (keys) of one exists call: 0 (nothing to load), then powers of two up
# to 1024 (engines ask 64-256 keys a call; 4 * the largest batch seen in the wild).
PREFIX_BUCKETS: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_PREFIX_ROW = 2 + len(PREFIX_BUCKETS) + 1  # asked, leading, buckets (last one: +Inf)


class PrefixHits:
    """Leading hits of the engines' exists calls, per pool.

    An engine loads the pages of a prefix up to the first one missing, so the run of present
    keys from the start of an exists answer is what the storage tier really saves it; per-key
    hits (``kvmeta_pool_lookups``) count the pages after a gap too. One row of plain ints per
    pool, updated on the loop without locks like ``RouteStats``: a call costs a C-speed scan
    of the answer to its first miss and a few int additions (its cost: benchmarks/README.md,
    "Router endpoints")."""

    def __init__(self) -> None:
        # pool key -> [keys asked, leading hits, bucket counts...]; a SGLang pool's key is its
        # PoolId (no per-call label strings), vLLM's batch_exists is ("v", "all", "", tenant).
        self.pools: dict[tuple[Any, ...], list[int]] = {}
        self._v_all: dict[str, tuple[str, str, str, str]] = {}

    def record(self, pool: tuple[Any, ...], exists: list[bool]) -> None:
        # One C-speed scan to the first miss; an answer that ends with a hit may have none,
        # and asking first is cheaper than the ValueError of a failed ``index``.
        if not exists:
            lead = 0
        elif exists[-1] and False not in exists:
            lead = len(exists)
        else:
            lead = exists.index(False)
        row = self.pools.get(pool)
        if row is None:
            row = self.pools[pool] = [0] * _PREFIX_ROW
        row[0] += len(exists)
        row[1] += lead
        row[2 + bisect.bisect_left(PREFIX_BUCKETS, lead)] += 1

    def record_vllm(self, exists: list[bool], tenant: str = "") -> None:
        """vLLM's batch_exists: completeness across every required rank of ``tenant``."""
        key = self._v_all.get(tenant)
        if key is None:
            key = self._v_all[tenant] = ("v", "all", "", tenant)
        self.record(key, exists)

    def copy(self, tenant: str | None = None) -> dict[tuple[str, str, str, str], list[int]]:
        """Rows by (dialect, rank, namespace, tenant) labels, copied to render elsewhere; only
        ``tenant``'s rows when one is given (a tenant's view of /metrics)."""
        return {
            (str(k[0]), str(k[1]), str(k[2]), str(k[3])): list(row)
            for k, row in self.pools.items()
            if tenant is None or k[3] == tenant
        }


# The server's one instance: the dialect handlers record, ``/metrics`` renders (per process,
# like every other series with --workers).
PREFIX_HITS = PrefixHits()


# Batches refused whole, by dialect: vLLM's batch_allocate gives every new key of a batch a
# page or none (``core.pool.Pool.reserve``); SGLang's batches are per key, so only "v" counts.
# Per process, like ``PREFIX_HITS``.
REFUSED_BATCHES: dict[str, int] = {"v": 0}


def _prefix_metrics(
    rows: dict[tuple[str, str, str, str], list[int]], max_pools: int | None
) -> Iterator[Metric]:
    asked = CounterMetricFamily(
        "kvmeta_prefix_keys_asked",
        'keys asked by the engines\' exists (SGLang) and batch_exists (vLLM, rank "all") calls',
        labels=POOL_LABELS,
    )
    leading = CounterMetricFamily(
        "kvmeta_prefix_leading_hits",
        "keys present from the start of each exists answer up to its first miss: the pages an "
        "engine loads",
        labels=POOL_LABELS,
    )
    lengths = HistogramMetricFamily(
        "kvmeta_prefix_hit_length",
        "leading-hit length (keys) of each exists / batch_exists call",
        labels=POOL_LABELS,
    )
    ordered = sorted(rows.items())
    if max_pools is not None and len(ordered) > max_pools:
        summed: dict[tuple[str, str], list[int]] = {}
        for labels, row in ordered[max_pools:]:
            agg = summed.setdefault((labels[0], labels[3]), [0] * _PREFIX_ROW)
            for i, n in enumerate(row):
                agg[i] += n
        ordered = ordered[:max_pools] + [
            ((dialect, OTHER, OTHER, tenant), row)
            for (dialect, tenant), row in sorted(summed.items())
        ]
    bounds = [str(b) for b in PREFIX_BUCKETS] + ["+Inf"]
    for labels, row in ordered:
        asked.add_metric(list(labels), row[0])
        leading.add_metric(list(labels), row[1])
        cumulative, total = [], 0
        for bound, n in zip(bounds, row[2:], strict=True):
            total += n
            cumulative.append((bound, total))
        lengths.add_metric(list(labels), cumulative, row[1])
    yield from (asked, leading, lengths)


class _Snapshot:
    """A collector over data gathered (asynchronously) just before the scrape renders."""

    def __init__(self) -> None:
        self.pools: list[PoolStats] = []
        self.durability: dict[str, float] = {}
        self.requests: list[RouteStats] = []
        self.auth_failures: int | None = None
        # {"host"|"origin"|"content_type": count} refused by server.guard, or None (a tenant)
        self.refused: dict[str, int] | None = None
        # {"forbidden"|"rate_limited": {tenant: count}} with a tokens file, else None
        self.tenant_counters: dict[str, dict[str, int]] | None = None
        self.server_wide = True  # False: a tenant's view (no server-wide series)
        self.info: dict[str, str] = {}
        self.ready = True
        self.max_pools: int | None = None
        self.prefix: dict[tuple[str, str, str, str], list[int]] = {}
        self.tenant: str | None = None  # a tenant's view: only its prefix rows

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvmeta_info", "server build and settings", labels=list(self.info))
        info.add_metric(list(self.info.values()), 1)
        yield info
        yield GaugeMetricFamily("kvmeta_ready", "1 when /ready answers 200", value=self.ready)
        yield from pool_metrics(cap_pools(self.pools, self.max_pools))
        yield from _request_metrics(self.requests)
        yield from _prefix_metrics(self.prefix, self.max_pools)
        if self.auth_failures is not None:
            yield CounterMetricFamily(
                "kvmeta_auth_failures", "requests refused 401", value=self.auth_failures
            )
        if self.refused is not None:
            refused = CounterMetricFamily(
                "kvmeta_requests_refused",
                "requests refused for their Host (403), Origin (403) or Content-Type (415), "
                "by header: what a browser led by another site's page sends",
                labels=["header"],
            )
            for header, count in sorted(self.refused.items()):
                refused.add_metric([header], count)
            yield refused
        if self.tenant_counters is not None:
            yield from _tenant_metrics(self.tenant_counters)
        yield from durability_metrics(self.durability)


def _request_metrics(routes: list[RouteStats]) -> Iterator[Metric]:
    counts = CounterMetricFamily(
        "kvmeta_http_requests",
        "requests answered, by route pattern, method and status",
        labels=["route", "method", "status"],
    )
    latency = HistogramMetricFamily(
        "kvmeta_http_request_duration_seconds",
        "time in the route handler (excludes HTTP parsing)",
        labels=["route", "method"],
    )
    bounds = [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    for rs in routes:
        for status, n in sorted(rs.statuses.items()):
            counts.add_metric([rs.pattern, rs.method, str(status)], n)
        cumulative, total = [], 0
        for bound, n in zip(bounds, rs.buckets, strict=True):
            total += n
            cumulative.append((bound, total))
        latency.add_metric([rs.pattern, rs.method], cumulative, rs.seconds)
    yield counts
    yield latency


_TENANT_COUNTERS = {
    "forbidden": ("kvmeta_tenant_forbidden", "requests refused 403 (outside the token's scope)"),
    "rate_limited": (
        "kvmeta_tenant_rate_limited",
        "requests refused 429 (over the tenant's requests_per_second)",
    ),
}


def _tenant_metrics(counters: dict[str, dict[str, int]]) -> Iterator[Metric]:
    for key, (name, help_) in _TENANT_COUNTERS.items():
        family = CounterMetricFamily(name, help_, labels=["tenant"])
        for tenant, value in sorted(counters.get(key, {}).items()):
            family.add_metric([tenant], value)
        yield family


# The standard ``process_*`` series (CPU seconds, resident and virtual memory, open and most
# descriptors, start time; read from /proc/self at each scrape, so with --workers they are the
# answering worker's) and ``python_info``: what every Prometheus exporter exposes, so stock
# dashboards and alert rules (descriptors near the limit) work on kvmeta too.
_PROCESS = ProcessCollector(registry=None)
_PLATFORM = PlatformCollector(registry=None)


def render_metrics(snapshot: _Snapshot) -> bytes:
    """The Prometheus text exposition of ``snapshot``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(snapshot)
    if snapshot.server_wide:
        registry.register(_CallerWarnings())
        registry.register(_EventMetrics())
        registry.register(_PROCESS)
        registry.register(_PLATFORM)
    return generate_latest(registry)


async def render_metrics_async(snapshot: _Snapshot) -> bytes:
    """``render_metrics`` in a thread (with 10^4 pools it takes seconds of pure Python); the
    route counters are copied first, on the loop, as they keep changing."""
    snapshot.requests = [rs.copy() for rs in snapshot.requests]
    snapshot.prefix = PREFIX_HITS.copy(None if snapshot.server_wide else snapshot.tenant)
    return await asyncio.to_thread(render_metrics, snapshot)


def new_snapshot(**fields: Any) -> _Snapshot:
    snap = _Snapshot()
    for name, value in fields.items():
        setattr(snap, name, value)
    return snap


class _CallerWarnings:
    """``kvmeta_caller_warnings_total{kind}``: replies that carried an ``X-Kvmeta-Warning``
    (kinds are a fixed set, see ``server.app.WARNING_KINDS``), and
    ``kvmeta_refused_batches_total{dialect}`` (``REFUSED_BATCHES``)."""

    def collect(self) -> Iterator[Metric]:
        from kvmeta.server.app import CALLER_WARNINGS

        family = CounterMetricFamily(
            "kvmeta_caller_warnings",
            "caller mistakes answered as the reference servers do, with an X-Kvmeta-Warning "
            "header, by kind",
            labels=["kind"],
        )
        for kind, count in sorted(CALLER_WARNINGS.items()):
            family.add_metric([kind], count)
        yield family
        refused = CounterMetricFamily(
            "kvmeta_refused_batches",
            "vLLM batch_allocate calls whose new keys did not all fit, so none got a page "
            "(all or nothing), by dialect",
            labels=["dialect"],
        )
        for dialect, count in sorted(REFUSED_BATCHES.items()):
            refused.add_metric([dialect], count)
        yield refused


# The KV event publisher's counters (``events.publisher.EventStats``) while ``--events`` is on;
# set once by ``server.runner``. A module-level source like ``CALLER_WARNINGS``: one publisher
# per process.
EVENTS: list[Any] = []


class _EventMetrics:
    """``kvmeta_events_*``: what the publisher sent, replays asked, and how long changes
    waited in the publisher (change reported durable -> batch sent)."""

    def collect(self) -> Iterator[Metric]:
        if not EVENTS:
            return
        from kvmeta.events.publisher import LAG_BUCKETS

        st = EVENTS[0]
        for name, help_, value in (
            ("kvmeta_events_published", "KV events published (BlockStored, ...)", st.events),
            ("kvmeta_events_blocks", "keys (blocks) named by published events", st.blocks),
            ("kvmeta_events_batches", "event batches (ZeroMQ messages) published", st.batches),
            ("kvmeta_events_replay_requests", "replay requests answered", st.replay_requests),
            (
                "kvmeta_events_replay_refused",
                "replay requests answered busy (--events-replay-clients answers under way)",
                st.replay_refused,
            ),
            (
                "kvmeta_events_resyncs",
                "whole-server resyncs published (at a start, and after the backend lost its data)",
                st.resyncs,
            ),
            (
                "kvmeta_events_pool_resyncs",
                "pools stated again after a backend call failed without a reply",
                st.pool_resyncs,
            ),
            (
                "kvmeta_events_listen_pauses",
                "times an event socket stopped listening, the process short of descriptors",
                st.listen_pauses,
            ),
        ):
            yield CounterMetricFamily(name, help_, value=value)
        lag = HistogramMetricFamily(
            "kvmeta_events_publish_lag_seconds",
            "seconds from a change reaching the publisher (durable) to its batch being sent",
        )
        cumulative, total = [], 0
        for bound, n in zip(LAG_BUCKETS, list(st.lag_buckets), strict=True):
            total += n
            cumulative.append((str(bound), total))
        cumulative.append(("+Inf", st.lag_count))
        lag.add_metric([], cumulative, st.lag_sum)
        yield lag
        yield GaugeMetricFamily(
            "kvmeta_events_publish_lag_seconds_max",
            "longest publish lag seen since the start",
            value=st.lag_max,
        )
        batches, size = st.replay_buffer
        yield GaugeMetricFamily(
            "kvmeta_events_replay_buffer_batches",
            "event batches kept for replay (--events-buffer; 0 without --events-replay)",
            value=batches,
        )
        yield GaugeMetricFamily(
            "kvmeta_events_replay_buffer_bytes",
            "bytes of event batches kept for replay (--events-buffer-mb)",
            value=size,
        )
        answers, queued = st.replay_answers
        yield GaugeMetricFamily(
            "kvmeta_events_replay_answers",
            "replay answers under way (--events-replay-clients at most)",
            value=answers,
        )
        yield GaugeMetricFamily(
            "kvmeta_events_replay_queued_bytes",
            "bytes of replay answers not yet written to their connections "
            "(--events-replay-queue-mb)",
            value=queued,
        )
