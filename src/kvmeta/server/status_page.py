"""The status page: ``GET /`` and ``/ui`` (one HTML page, its script and style, shipped in
``kvmeta/server/static``) and the JSON it polls, ``GET /v1/status``.

Why a server-side history: the page shows the last ~5 minutes at first load, so the server keeps
a ring of samples (one every ``SAMPLE_SECONDS``) taken from the request counters it already
keeps (``RequestMetrics``) and from the pools' lookup counters. Why cached rates: ``/v1/status``
must stay cheap with thousands of pools (a page polls it every 2 s), so per-pool rates and the
encoded history are computed once per sample, not per request; a request only reads the pools'
current numbers (the same ones ``/v1/pools`` shows) and splices in the cached parts.

Sampling reads pool counters from the backend: free for the in-process stores; for a shared
backend (Redis) only while someone watches (a ``/v1/status`` in the last ``WATCH_SECONDS``), so
an idle status page costs Redis nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from kvmeta.server.access import scope_of
from kvmeta.server.app import Route, json_response
from kvmeta.server.http import Request, Response
from kvmeta.server.metrics import LATENCY_BUCKETS, RouteStats
from kvmeta.server.tokens import Scope
from kvmeta.server.views import pool_view, settings_view
from kvmeta.store.base import PoolStats

if TYPE_CHECKING:  # pragma: no cover
    from kvmeta.server.ops_routes import OpsState

__all__ = [
    "ROUTES",
    "SAMPLE_SECONDS",
    "HISTORY_SAMPLES",
    "PoolRates",
    "Sample",
    "StatusRing",
    "StatusState",
    "percentile",
    "static_file",
]

logger = logging.getLogger(__name__)

SAMPLE_SECONDS = 2.0
HISTORY_SAMPLES = 150  # 5 minutes at one sample every 2 s
WATCH_SECONDS = 10.0
TOP_ROUTES = 6  # the busiest routes get their own line in the chart; the rest sum as "other"

_HTML = b"text/html; charset=utf-8"
_ASSETS: dict[str, tuple[str, bytes]] = {
    # route -> (file in kvmeta/server/static, content type)
    "/": ("status.html", _HTML),
    "/ui": ("status.html", _HTML),
    "/ui/status.js": ("status.js", b"text/javascript; charset=utf-8"),
    "/ui/status.css": ("status.css", b"text/css; charset=utf-8"),
}


def static_file(name: str) -> bytes:
    """A file shipped as package data (``kvmeta/server/static``), whether installed or not."""
    return resources.files("kvmeta.server").joinpath("static").joinpath(name).read_bytes()


def percentile(buckets: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a latency histogram (``LATENCY_BUCKETS`` counts plus +Inf),
    interpolated inside its bucket as Prometheus' ``histogram_quantile`` does; None when empty.
    Values in the +Inf bucket report the highest finite bound."""
    total = sum(buckets)
    if total <= 0:
        return None
    want = q * total
    seen = 0
    for i, n in enumerate(buckets):
        if n and seen + n >= want:
            if i >= len(LATENCY_BUCKETS):
                return LATENCY_BUCKETS[-1]
            lower = LATENCY_BUCKETS[i - 1] if i else 0.0
            upper = LATENCY_BUCKETS[i]
            return lower + (upper - lower) * max(0.0, want - seen) / n
        seen += n
    return LATENCY_BUCKETS[-1]  # pragma: no cover - the loop returns once seen reaches total


class Lookups(NamedTuple):
    """Totals of every pool's lookup counters at one instant."""

    get_hits: int
    get_misses: int
    exists_hits: int
    exists_misses: int

    @classmethod
    def of(cls, pools: Sequence[PoolStats]) -> Lookups:
        gh = gm = eh = em = 0
        for st in pools:
            c = st.counters
            gh += c.get("get_hits", 0)
            gm += c.get("get_misses", 0)
            eh += c.get("exists_hits", 0)
            em += c.get("exists_misses", 0)
        return cls(gh, gm, eh, em)


class Sample(NamedTuple):
    """One point of the charts: rates over the interval that ended at ``t`` (wall clock)."""

    t: float
    rps: dict[str, float]  # "METHOD /pattern" -> requests/s (routes with none left out)
    p50: float | None  # seconds, over every route's requests in the interval
    p99: float | None
    hit_ratio: float | None  # get hits / get lookups in the interval (None: no lookups)
    exists_hit_ratio: float | None


def _ratio(hits: int, misses: int) -> float | None:
    total = hits + misses
    return round(hits / total, 4) if total > 0 else None


class StatusRing:
    """The last ``capacity`` samples. ``observe`` is given cumulative totals and the time (so a
    test drives it without a clock); each call after the first appends one sample of deltas.
    Totals that go down (a pool cleared or dropped) count as zero, never as negative rates."""

    def __init__(self, capacity: int = HISTORY_SAMPLES) -> None:
        self.samples: deque[Sample] = deque(maxlen=capacity)
        self.taken = 0  # samples appended so far (the page shows it changing)
        self._last: tuple[float, dict[str, tuple[int, list[int]]], Lookups | None] | None = None

    def observe(
        self, now: float, wall: float, routes: Sequence[RouteStats], lookups: Lookups | None
    ) -> Sample | None:
        """Record the totals at monotonic ``now`` (wall clock ``wall``); the new sample, or
        None for the first call (a baseline) or a clock that did not move."""
        totals = {
            f"{rs.method} {rs.pattern}": (sum(rs.statuses.values()), list(rs.buckets))
            for rs in routes
        }
        last, self._last = self._last, (now, totals, lookups)
        if last is None:
            return None
        then, before, before_lookups = last
        dt = now - then
        if dt <= 0:
            self._last = last
            return None
        rps: dict[str, float] = {}
        merged = [0] * (len(LATENCY_BUCKETS) + 1)
        for name, (count, buckets) in totals.items():
            old_count, old_buckets = before.get(name, (0, [0] * len(buckets)))
            done = count - old_count
            if done > 0:
                rps[name] = round(done / dt, 3)
                for i, (new, old) in enumerate(zip(buckets, old_buckets, strict=True)):
                    merged[i] += max(0, new - old)
        hit = exists_hit = None
        if lookups is not None and before_lookups is not None:
            d = [max(0, a - b) for a, b in zip(lookups, before_lookups, strict=True)]
            hit, exists_hit = _ratio(d[0], d[1]), _ratio(d[2], d[3])
        sample = Sample(
            t=round(wall, 3),
            rps=rps,
            p50=percentile(merged, 0.5),
            p99=percentile(merged, 0.99),
            hit_ratio=hit,
            exists_hit_ratio=exists_hit,
        )
        self.samples.append(sample)
        self.taken += 1
        return sample

    def history(self, top: int = TOP_ROUTES) -> dict[str, Any]:
        """The samples as chart series: one array per quantity, the ``top`` busiest routes as
        their own series and the rest summed as ``other``; latencies in milliseconds."""
        samples = list(self.samples)
        volume: dict[str, float] = {}
        for s in samples:
            for name, r in s.rps.items():
                volume[name] = volume.get(name, 0.0) + r
        busiest = sorted(volume, key=lambda n: (-volume[n], n))[:top]
        rps = {name: [s.rps.get(name, 0.0) for s in samples] for name in busiest}
        if len(volume) > len(busiest):
            kept = set(busiest)
            rps["other"] = [
                round(sum(r for n, r in s.rps.items() if n not in kept), 3) for s in samples
            ]

        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000, 3)

        return {
            "interval": SAMPLE_SECONDS,
            "taken": self.taken,
            "t": [s.t for s in samples],
            "rps": rps,
            "p50_ms": [ms(s.p50) for s in samples],
            "p99_ms": [ms(s.p99) for s in samples],
            "hit_ratio": [s.hit_ratio for s in samples],
            "exists_hit_ratio": [s.exists_hit_ratio for s in samples],
        }


PoolKey = tuple[str, int, str, str]  # (dialect, rank, namespace, tenant)


class PoolRates:
    """Per-pool evictions/s and refused reservations/s between the last two samples, kept so
    that a status request only looks them up. A sample is taken in pieces (``begin``, ``add``
    per piece of pools, ``end``), so its pools need not all be in memory at once."""

    def __init__(self) -> None:
        self.rates: dict[PoolKey, tuple[float, float]] = {}
        self._last: tuple[float, dict[PoolKey, tuple[int, int]]] | None = None
        # The sample being taken: its time, counts, rates, and the interval (None: no rates,
        # the first sample or a clock that did not move).
        self._now = 0.0
        self._current: dict[PoolKey, tuple[int, int]] = {}
        self._rates: dict[PoolKey, tuple[float, float]] = {}
        self._dt: float | None = None

    def begin(self, now: float) -> None:
        self._now = now
        self._current, self._rates = {}, {}
        self._dt = None
        if self._last is not None and now > self._last[0]:
            self._dt = now - self._last[0]

    def add(self, pools: Sequence[PoolStats]) -> list[tuple[float, float] | None]:
        """Take ``pools`` into the sample; each one's rates as the sample will show them."""
        current, out = self._current, []
        dt, before = self._dt, (self._last[1] if self._last is not None else {})
        for st in pools:
            key = (st.pool.dialect, st.pool.rank, st.pool.namespace, st.pool.tenant)
            counts = current[key] = (
                st.counters.get("evictions", 0),
                st.counters.get("reservations_refused", 0),
            )
            if dt is None:  # no new rates this time: the last ones stay
                out.append(self.rates.get(key))
                continue
            old = before.get(key)
            if old is None:  # a new pool: no rate yet
                out.append(None)
                continue
            rate = self._rates[key] = (
                round(max(0, counts[0] - old[0]) / dt, 3),
                round(max(0, counts[1] - old[1]) / dt, 3),
            )
            out.append(rate)
        return out

    def end(self) -> None:
        if self._last is None or self._dt is not None:
            self._last = (self._now, self._current)
        if self._dt is not None:
            self.rates = self._rates
        self.abort()

    def abort(self) -> None:
        """Drop the sample being taken (its backend failed midway): nothing changes."""
        self._current, self._rates = {}, {}
        self._dt = None

    def update(self, now: float, pools: Sequence[PoolStats]) -> None:
        """A whole sample at once."""
        self.begin(now)
        self.add(pools)
        self.end()


class _Digest:
    """One sample of the pools, taken piece by piece: the lookup totals, the rates, and the
    pool rows encoded as JSON as each piece comes (bytes: nothing for the garbage collector to
    walk), all of them and each tenant's."""

    def __init__(self, rates: PoolRates, now: float) -> None:
        self.rates = rates
        rates.begin(now)
        self.lookups = [0, 0, 0, 0]
        self.parts: list[bytes] = []
        self.tenant_parts: dict[str, list[bytes]] = {}

    def add(self, pools: Sequence[PoolStats]) -> None:
        if not pools:
            return
        rows = []
        tenants: dict[str, list[dict[str, Any]]] = {}
        for st, rate in zip(pools, self.rates.add(pools), strict=True):
            row = status_pool(pool_view(st), rate)
            rows.append(row)
            if st.pool.tenant:
                tenants.setdefault(st.pool.tenant, []).append(row)
        for i, total in enumerate(Lookups.of(pools)):
            self.lookups[i] += total
        self.parts.append(_items(rows))
        for tenant, mine in tenants.items():
            self.tenant_parts.setdefault(tenant, []).append(_items(mine))

    def end(self) -> tuple[Lookups, msgspec.Raw, dict[str, msgspec.Raw]]:
        self.rates.end()
        by_tenant = {t: _array(parts) for t, parts in self.tenant_parts.items()}
        return Lookups(*self.lookups), _array(self.parts), by_tenant


def _items(rows: list[dict[str, Any]]) -> bytes:
    """The rows as the items of a JSON array, without its brackets."""
    return msgspec.json.encode(rows)[1:-1]


def _array(parts: list[bytes]) -> msgspec.Raw:
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")


class _DiskState(NamedTuple):
    segment_bytes: int | None  # size of the newest journal segment
    snapshot_mtime: float | None  # wall clock time of the newest snapshot file


def _disk_state(directory: Path) -> _DiskState:
    """The newest journal segment's size and newest snapshot's time, from a directory listing
    (the names sort by segment number: ``journal-<N>.log``, ``snapshot-<N>.snap``)."""
    journal: os.DirEntry[str] | None = None
    snapshot: os.DirEntry[str] | None = None
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith("journal-") and name.endswith(".log"):
                    if journal is None or name > journal.name:
                        journal = entry
                elif name.startswith("snapshot-") and name.endswith(".snap"):
                    if snapshot is None or name > snapshot.name:
                        snapshot = entry
        size = journal.stat().st_size if journal is not None else None
        mtime = snapshot.stat().st_mtime if snapshot is not None else None
    except OSError:
        return _DiskState(None, None)
    return _DiskState(size, mtime)


class StatusState:
    """The ring, the cached rates and what the last sample saw of the journal."""

    def __init__(self, ops: OpsState) -> None:
        self.ops = ops
        self.ring = StatusRing()
        self.rates = PoolRates()
        self.watched_until = 0.0
        self.last_fsync_at: float | None = None  # monotonic time a sample saw fsyncs grow
        self._fsyncs: float | None = None
        self.disk = _DiskState(None, None)
        self._history = msgspec.Raw(msgspec.json.encode(self.ring.history()))
        self._pools = msgspec.Raw(b"[]")
        self._tenant_pools: dict[str, msgspec.Raw] = {}  # the rows of each tenant's pools
        self.pools_at: tuple[float, float] | None = None  # (monotonic, wall) of the pool rows
        self._pools_lock = asyncio.Lock()
        settings = ops.settings
        local_dir = not settings.backend and not settings.in_memory
        self.data_dir = Path(settings.data_dir) if local_dir else None
        # In-process stores answer stats from memory; a shared one costs a network round trip.
        self.local = not settings.backend

    async def sample(self, now: float | None = None, wall: float | None = None) -> None:
        """Take one sample (the background loop calls it every ``SAMPLE_SECONDS``)."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        lookups: Lookups | None = None
        if self.local or now < self.watched_until:
            lookups = await self.sample_pools(now, wall)
        self.ring.observe(now, wall, self.ops.metrics.routes, lookups)
        fsyncs = self.ops.backend.durability_stats().get("fsyncs")
        if fsyncs is not None:
            if self._fsyncs is not None and fsyncs > self._fsyncs:
                self.last_fsync_at = now
            self._fsyncs = fsyncs
        if self.data_dir is not None:
            self.disk = await asyncio.to_thread(_disk_state, self.data_dir)
        self._history = msgspec.Raw(msgspec.json.encode(self.ring.history()))

    def pools_for(self, scope: Scope) -> msgspec.Raw:
        """The pool rows a token may see: all, or its own tenant's."""
        if scope.all_access:
            return self._pools
        return self._tenant_pools.get(scope.tenant, _NO_ROWS)

    async def sample_pools(self, now: float, wall: float) -> Lookups | None:
        """Read every pool once (on the loop: the in-process store is not thread-safe) and
        turn them into rates and the encoded pool rows, ``STATS_CHUNK`` pools at a time with
        the loop free in between: with thousands of pools one pass held the loop for hundreds
        of ms, and its objects, alive until it ended, set off full garbage collections. None
        when the backend could not be read."""
        async with self._pools_lock:  # one digest at a time: it moves the rates' baseline
            digest = _Digest(self.rates, now)
            chunks = self.ops.backend.stats_chunks()
            while True:
                try:
                    pools = await anext(chunks)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # noqa: BLE001 - a backend outage must not stop sampling
                    self.rates.abort()  # the partial sample goes; the baseline stays
                    logger.debug("status sample could not read pool stats: %s", exc)
                    return None
                digest.add(pools)
                await asyncio.sleep(0)
            lookups, rows, by_tenant = digest.end()
        self._pools = rows
        self._tenant_pools = by_tenant
        self.pools_at = (now, round(wall, 3))
        return lookups

    async def run(self) -> None:
        """Sample forever (cancelled at shutdown)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.sample()
            except Exception:  # pragma: no cover - a bug here must not end the server
                logger.exception("status sample failed")
            # Keep to the grid so that samples are SAMPLE_SECONDS apart on average.
            await asyncio.sleep(SAMPLE_SECONDS - loop.time() % SAMPLE_SECONDS)

    def backend_view(self, ready: bool, reason: str, server_wide: bool = True) -> dict[str, Any]:
        """The backend box of the page. A tenant's token (``server_wide`` False) gets what
        ``/metrics`` gives it: the backend's kind and readiness, none of the server-wide
        journal, fsync, snapshot and replication numbers, nor the data directory."""
        backend = self.ops.backend
        if not server_wide:
            return {
                "name": backend.name,
                "describe": backend.name,
                "epoch": backend.epoch,
                "ready": ready,
                "reason": reason or None,
                **dict.fromkeys(_SERVER_WIDE),
                "durability": {},
            }
        settings = self.ops.settings
        now = time.monotonic()
        durability = backend.durability_stats()
        mtime = self.disk.snapshot_mtime
        return {
            "name": backend.name,
            "describe": backend.describe,
            "epoch": backend.epoch,
            "ready": ready,
            "reason": reason or None,
            "fsync": None if settings.backend else settings.fsync,
            "data_dir": str(self.data_dir) if self.data_dir is not None else None,
            "journal_failed": bool(durability.get("journal_failed", 0.0)),
            "last_fsync_seconds_ago": None
            if self.last_fsync_at is None
            else round(now - self.last_fsync_at, 1),
            "journal_segment_bytes": self.disk.segment_bytes,
            "snapshot_age_seconds": None if mtime is None else round(time.time() - mtime, 1),
            "durability": durability,
            # Redis: primaries and the fewest replicas of any, from the last readiness probe.
            "role": _role(durability),
            "replicas": durability.get("redis_replicas_min"),
        }


# What only the operator's token sees of the backend (None for a tenant's token).
_SERVER_WIDE = (
    "fsync",
    "data_dir",
    "journal_failed",
    "last_fsync_seconds_ago",
    "journal_segment_bytes",
    "snapshot_age_seconds",
    "role",
    "replicas",
)


def _role(durability: dict[str, float]) -> str | None:
    primaries = durability.get("redis_primaries")
    if primaries is None:
        return None
    return "primary" if primaries == 1 else f"{int(primaries)} primaries"


_NO_ROWS = msgspec.Raw(b"[]")
# A tenant's token sees no server-wide history (request rates of every tenant together).
_NO_HISTORY = msgspec.Raw(msgspec.json.encode(StatusRing().history()))


def status_pool(view: dict[str, Any], rates: tuple[float, float] | None) -> dict[str, Any]:
    view["evictions_per_s"] = rates[0] if rates else None
    view["refused_per_s"] = rates[1] if rates else None
    return view


async def status(state: StatusState, req: Request, rank: int) -> Response:
    """Pools as the last sample saw them (at most ``SAMPLE_SECONDS`` old, ``pools_at`` says
    when); read now only when no recent sample has them (a shared backend nobody watched)."""
    ops = state.ops
    now = time.monotonic()
    state.watched_until = now + WATCH_SECONDS
    if state.pools_at is None or now - state.pools_at[0] > 2 * SAMPLE_SECONDS + 1:
        await state.sample_pools(now, time.time())
    ok, reason = await ops.ready()
    scope = scope_of(req)
    return json_response(
        {
            "server": settings_view(ops.settings, ops.backend, scope.all_access),
            "backend": state.backend_view(ok, reason, scope.all_access),
            "uptime_seconds": round(now - ops.started, 3),
            "time": round(time.time(), 3),
            "pools_at": state.pools_at[1] if state.pools_at else None,
            "pools": state.pools_for(scope),
            "history": state._history if scope.all_access else _NO_HISTORY,
        }
    )


async def asset(state: StatusState, req: Request, rank: int) -> Response:
    name, content_type = _ASSETS[req.path]
    body = state_asset(name)
    return Response(200, body, content_type, ((b"cache-control", b"no-cache"),))


_CACHE: dict[str, bytes] = {}


def state_asset(name: str) -> bytes:
    body = _CACHE.get(name)
    if body is None:
        body = _CACHE[name] = static_file(name)
    return body


ROUTES = (
    *(Route("GET", path, asset) for path in _ASSETS),
    Route("GET", "/v1/status", status),
)
