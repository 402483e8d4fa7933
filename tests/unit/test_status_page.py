"""The status page's pieces without a socket: the ring of samples (time passed in), per-pool
rates, percentiles from histogram buckets, the assets from package data, and the cost of
``GET /v1/status`` with 1,000 pools."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvmeta.config import Settings
from kvmeta.server.http import Request
from kvmeta.server.metrics import LATENCY_BUCKETS, RouteStats
from kvmeta.server.runner import build_app
from kvmeta.server.status_page import (
    Lookups,
    PoolRates,
    StatusRing,
    StatusState,
    percentile,
    static_file,
)
from kvmeta.server.tokens import ALL_ACCESS
from kvmeta.service.ops import Service
from kvmeta.store.base import PoolId, PoolStats
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore


def _route(method: str, pattern: str, count: int, seconds: float) -> RouteStats:
    rs = RouteStats(method, pattern)
    for _ in range(count):
        rs.record(200, seconds)
    return rs


def test_ring_samples_deltas_with_time_passed_in() -> None:
    ring = StatusRing(capacity=3)
    get = _route("POST", "/{rank}/get_page_indices", 10, 0.0003)
    assert ring.observe(100.0, 1000.0, [get], Lookups(5, 5, 0, 0)) is None  # baseline
    for _ in range(40):
        get.record(200, 0.0003)
    sample = ring.observe(102.0, 1002.0, [get], Lookups(35, 15, 4, 0))
    assert sample is not None
    assert sample.t == 1002.0
    assert sample.rps == {"POST /{rank}/get_page_indices": 20.0}
    assert sample.hit_ratio == 0.75  # 30 hits of 40 lookups in the interval, not 35/50
    assert sample.exists_hit_ratio == 1.0
    assert sample.p50 is not None and 0.00025 <= sample.p50 <= 0.0005
    # nothing happened: no rate, no latency, no ratio (not 0%)
    quiet = ring.observe(104.0, 1004.0, [get], Lookups(35, 15, 4, 0))
    assert quiet is not None
    assert quiet.rps == {} and quiet.p50 is None and quiet.hit_ratio is None
    # a clock that did not move adds nothing; counters that went down count as zero
    assert ring.observe(104.0, 1004.0, [get], None) is None
    after_clear = ring.observe(106.0, 1006.0, [get], Lookups(0, 0, 0, 0))
    assert after_clear is not None and after_clear.hit_ratio is None
    ring.observe(108.0, 1008.0, [get], None)
    assert len(ring.samples) == 3 and ring.taken == 4  # capacity bounds the history
    history = ring.history()
    assert history["t"] == [1004.0, 1006.0, 1008.0]
    assert set(history) >= {"rps", "p50_ms", "p99_ms", "hit_ratio", "exists_hit_ratio"}


def test_history_keeps_the_busiest_routes_and_sums_the_rest() -> None:
    ring = StatusRing()
    routes = [_route("POST", f"/r{i}", 0, 0.001) for i in range(9)]
    ring.observe(0.0, 0.0, routes, None)
    for i, rs in enumerate(routes):
        for _ in range(i + 1):
            rs.record(200, 0.001)
    ring.observe(1.0, 1.0, routes, None)
    rps = ring.history(top=3)["rps"]
    assert list(rps) == ["POST /r8", "POST /r7", "POST /r6", "other"]
    assert rps["other"] == [float(sum(range(1, 7)))]


def test_percentile_interpolates_in_buckets() -> None:
    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    assert percentile(buckets, 0.5) is None
    i = LATENCY_BUCKETS.index(0.001)
    lower = LATENCY_BUCKETS[i - 1]
    buckets[i] = 100  # all in (lower, 0.001]
    p50 = percentile(buckets, 0.5)
    assert p50 is not None and abs(p50 - (lower + 0.001) / 2) < 1e-9
    buckets[-1] = 100  # half beyond the last bound
    assert percentile(buckets, 0.99) == LATENCY_BUCKETS[-1]


def _stats(rank: int, evictions: int, refused: int) -> PoolStats:
    counters = {"evictions": evictions, "reservations_refused": refused}
    return PoolStats(PoolId("s", rank, "kv"), 8, 8, 0, 0, counters, 0)


def test_pool_rates_between_samples() -> None:
    rates = PoolRates()
    rates.update(10.0, [_stats(0, 0, 0)])
    assert rates.rates == {}
    rates.update(12.0, [_stats(0, 10, 4), _stats(1, 5, 5)])
    assert rates.rates == {("s", 0, "kv", ""): (5.0, 2.0)}  # rank 1 is new: no rate yet
    rates.update(14.0, [_stats(0, 0, 0), _stats(1, 5, 9)])  # rank 0 cleared: zero, not negative
    assert rates.rates == {("s", 0, "kv", ""): (0.0, 0.0), ("s", 1, "kv", ""): (0.0, 2.0)}


def test_assets_ship_as_package_data() -> None:
    html = static_file("status.html").decode()
    assert "/ui/status.js" in html and "/ui/status.css" in html
    assert "http://" not in html and "https://" not in html  # no CDN
    js = static_file("status.js").decode()
    assert "/v1/status" in js and "https://" not in js and "import " not in js
    assert static_file("status.css")


def test_status_with_1000_pools_answers_every_pool_and_a_full_history() -> None:
    """The page polls every 2 s; with 1,000 pools its answer still holds every pool and the
    whole history. Every sample runs on the test's clock (a sample on the host's monotonic
    clock would fall before the test's times on a host up for less than 1,300 s). What an
    answer costs is measured in benchmarks/bench_status.py, not asserted here."""
    service = Service(LocalBackend(MemoryStore()))
    app = build_app(Settings(in_memory=True), service)
    (state,) = [
        job.__self__  # type: ignore[attr-defined]
        for job in app.background
        if isinstance(getattr(job, "__self__", None), StatusState)
    ]

    async def answer() -> dict[str, Any]:
        for rank in range(1000):
            body = msgspec.json.encode({"num_pages": 64})
            resp = await app(Request("POST", f"/{rank}/initialize", "", body, None))
            assert resp.status == 204
        for i in range(151):  # a full history (150 samples), and rates for every pool
            await state.sample(now=1000.0 + 2 * i, wall=1e9 + 2 * i)
        resp = await app(Request("GET", "/v1/status", "", b"", None))
        assert resp.status == 200
        doc: dict[str, Any] = msgspec.json.decode(resp.body)
        return doc

    loop = asyncio.new_event_loop()
    try:
        doc = loop.run_until_complete(answer())
    finally:
        loop.close()
    assert len(doc["pools"]) == 1000
    assert len(doc["history"]["t"]) == 150
    assert all(p["evictions_per_s"] == 0.0 for p in doc["pools"])


@pytest.mark.parametrize("path", ["/", "/ui", "/ui/status.js", "/ui/status.css"])
def test_page_routes_answer_their_files(path: str) -> None:
    app = build_app(Settings(in_memory=True), Service(LocalBackend(MemoryStore())))

    async def go() -> Any:
        return await app(Request("GET", path, "", b"", None))

    loop = asyncio.new_event_loop()
    try:
        resp = loop.run_until_complete(go())
    finally:
        loop.close()
    assert resp.status == 200
    name = {"/ui/status.js": "status.js", "/ui/status.css": "status.css"}.get(path, "status.html")
    assert resp.body == static_file(name)
    kind = {"status.js": b"text/javascript", "status.css": b"text/css"}.get(name, b"text/html")
    assert resp.content_type.startswith(kind)


def test_a_sample_of_many_pools_lets_the_loop_run_between_small_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sampler reads every pool on the loop (the in-process store is not thread-safe):
    with thousands of pools one pass held the loop for hundreds of ms, so every request waited.
    It reads them in chunks and lets the loop run between them: counted here, not timed, as
    how many pools were read while another task did not get to run."""
    from kvmeta.core.pool import Pool

    pools = 3000
    service = Service(LocalBackend(MemoryStore()))
    app = build_app(Settings(in_memory=True), service)
    (state,) = [
        job.__self__
        for job in app.background
        if isinstance(getattr(job, "__self__", None), StatusState)
    ]
    ticks = 0
    read_at: list[int] = []  # the ticker's count when each pool was read
    expire = Pool.expire

    def counted(pool: Pool, now: float) -> None:
        read_at.append(ticks)
        expire(pool, now)

    async def go() -> None:
        nonlocal ticks
        for rank in range(pools):
            await service.initialize(PoolId("s", rank, "kv"), 1)
        monkeypatch.setattr(Pool, "expire", counted)
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        await state.sample_pools(1000.0, 1e9)
        done.set()
        await task

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(go())
    finally:
        loop.close()
    assert len(read_at) == pools
    longest = max(read_at.count(t) for t in set(read_at))
    assert longest <= 512, f"{longest} pools read without letting the loop run"
    assert len(msgspec.json.decode(state.pools_for(ALL_ACCESS))) == pools
