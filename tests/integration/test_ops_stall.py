"""``/v1/check`` and ``/metrics`` on big state must not stall request serving.

The process tests measure the slowest ``exists`` answered while the operator route runs; the
numbers are printed (``pytest -s``) so a run shows check/metrics time against serving latency.
Their state is a tenth of the largest a server holds (2 x 10^5 pages, 2,000 pools): what keeps
serving going at any size is that each step the backend takes on the event loop is bounded,
and the in-process tests assert that bound per step (pages copied by the check, pools read
per stats chunk), not a total.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

import kvmeta.store.disk.local as local_backend
from kvmeta._types import PoolId
from kvmeta.core.invariants import PoolCopy
from kvmeta.core.pool import Pool
from kvmeta.store.base import STATS_CHUNK
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.support import ServerProcess

Make = Callable[..., ServerProcess]

# A generous bound on a loaded 2-core machine (a busy machine alone delays a request by
# tenths of a second); the old code stalled 2 s (/v1/check) and 4 s (/metrics) here.
MAX_LATENCY = 1.0


def stall_bound(took: float) -> float:
    """The slowest ``exists`` allowed while an operator call took ``took`` seconds.

    A call that blocks the event loop delays a concurrent request by about its whole duration;
    one that yields delays it by one chunk. On a machine so loaded that the call itself takes
    many seconds, a fixed bound fails for the load alone, so half the call's duration is allowed
    too: still far below what a blocking call causes.
    """
    return max(MAX_LATENCY, 0.5 * took)


class _Prober:
    """Sends ``exists`` in a loop on one keep-alive connection and keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                started = time.monotonic()
                resp = session.post(self.url + "/0/exists", json={"keys": ["a"]}, timeout=60)
                took = time.monotonic() - started
                assert resp.status_code == 200
                self.worst = max(self.worst, took)
                self.count += 1
                time.sleep(0.01)

    def __enter__(self) -> _Prober:
        self._thread.start()
        time.sleep(0.3)
        self.worst = 0.0  # only what happens during the measured call counts
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _fill(server: ServerProcess, rank: int, num_pages: int) -> None:
    assert server.post(f"/{rank}/initialize", {"num_pages": num_pages}).status_code == 204
    with requests.Session() as session:
        step = 50_000
        for start in range(0, num_pages, step):
            keys = [f"r{rank}-{i:07d}" for i in range(start, min(num_pages, start + step))]
            got = session.post(
                f"{server.url}/{rank}/reserve_and_allocate_page_indices",
                json={"keys": [[k, ""] for k in keys]},
                timeout=120,
            ).json()["indices"]
            pairs = [[k, p] for k, (_, p) in zip(keys, got, strict=True)]
            resp = session.post(
                f"{server.url}/{rank}/confirm_write",
                json={"written_keys_to_confirm": pairs},
                timeout=120,
            )
            assert resp.status_code == 204


def test_check_of_big_pools_does_not_stall_serving(make_server: Make) -> None:
    server = make_server("--in-memory", "--read-lease", "0")
    for rank in (0, 1):
        _fill(server, rank, 100_000)
    with _Prober(server.url) as probe:
        started = time.monotonic()
        resp = requests.get(server.url + "/v1/check", timeout=300)
        took = time.monotonic() - started
    body = resp.json()
    print(
        f"\n/v1/check 2 x 10^5 stored pages: {took:.2f} s; concurrent exists: "
        f"{probe.count} answered, slowest {probe.worst * 1000:.0f} ms"
    )
    assert resp.status_code == 200 and body["ok"] is True and body["checked"] == 2, body
    assert probe.count > 0
    assert probe.worst < stall_bound(took), f"exists waited {probe.worst:.2f} s behind /v1/check"


def test_metrics_of_2k_pools_is_capped_and_does_not_stall_serving(make_server: Make) -> None:
    server = make_server("--in-memory", "--read-lease", "0", "--max-pools-per-tenant", "2000")

    def init(ranks: range) -> None:
        with requests.Session() as session:
            for rank in ranks:
                resp = session.post(
                    f"{server.url}/{rank}/initialize", json={"num_pages": 4}, timeout=60
                )
                assert resp.status_code == 204

    total = 2_000
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(init, [range(i, total, 4) for i in range(4)]))
    with _Prober(server.url) as probe:
        started = time.monotonic()
        resp = requests.get(server.url + "/metrics", timeout=300)
        took = time.monotonic() - started
    text = resp.text
    print(
        f"\n/metrics with {total} pools: {len(resp.content) / 1e6:.2f} MB in {took:.2f} s; "
        f"concurrent exists: {probe.count} answered, slowest {probe.worst * 1000:.0f} ms"
    )
    assert resp.status_code == 200
    per_pool = [line for line in text.splitlines() if line.startswith("kvmeta_pool_size_pages{")]
    assert len(per_pool) == 256 + 1, per_pool[-3:]  # --metrics-max-pools, plus one _other
    other = [line for line in per_pool if 'rank="_other"' in line]
    assert other == [
        'kvmeta_pool_size_pages{dialect="s",namespace="_other",rank="_other",tenant=""} '
        f"{4.0 * (total - 256)}"
    ]
    assert len(resp.content) < 2_000_000
    assert probe.worst < stall_bound(took), f"exists waited {probe.worst:.2f} s behind /metrics"


class _LoopTurns:
    """Counts the event loop's turns (a task that yields at once, every turn): what a backend
    does between two counts ran in one step, holding every request behind it."""

    def __init__(self) -> None:
        self.turns = 0

    async def run(self, body: Coroutine[Any, Any, Any]) -> Any:
        async def spin() -> None:
            while True:
                self.turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(spin())
        await asyncio.sleep(0)
        try:
            return await body
        finally:
            task.cancel()


def test_each_step_of_a_check_copies_a_bounded_number_of_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many pools: the check copies them on the loop a batch at a time (at most
    ``_CHECK_BATCH_PAGES`` pages past the first pool of a batch, at most 256 pools), and the
    loop turns between batches; one big pool is copied in one step (its copy is consistent)."""
    store = MemoryStore(read_lease=0.0)
    sizes = [40_000] + [3_000] * 600 + [20] * 700
    for rank, size in enumerate(sizes):
        store.initialize(PoolId("s", rank, "kv"), size)
    turns = _LoopTurns()
    copied: Counter[int] = Counter()  # loop turn -> pages copied during it
    pools: Counter[int] = Counter()  # loop turn -> pools copied during it
    copy = local_backend.copy_pool

    def counting(pool: Pool) -> PoolCopy:
        copied[turns.turns] += pool.num_pages
        pools[turns.turns] += 1
        return copy(pool)

    monkeypatch.setattr(local_backend, "copy_pool", counting)
    report = asyncio.run(turns.run(LocalBackend(store).check()))
    assert report.problems == [] and report.checked == len(sizes)
    assert sum(copied.values()) == sum(sizes) and sum(pools.values()) == len(sizes)
    bound = local_backend._CHECK_BATCH_PAGES + max(sizes)
    assert max(copied.values()) <= bound, (max(copied.values()), bound)
    assert max(pools.values()) <= 256, max(pools.values())
    assert len(copied) >= sum(sizes) // bound + len(sizes) // 256  # the loop turned between


def test_stats_are_read_in_chunks_with_the_loop_turning_between() -> None:
    """``stats()`` (behind ``/metrics`` and ``/v1/pools``) reads ``STATS_CHUNK`` pools per
    step, whatever the number of pools."""
    store = MemoryStore(read_lease=0.0)
    total = 2 * STATS_CHUNK + 7
    for rank in range(total):
        store.initialize(PoolId("s", rank, "kv"), 4)
    backend = LocalBackend(store)
    turns = _LoopTurns()
    chunks: list[tuple[int, int]] = []  # (pools, loop turn it was read in)

    async def read() -> None:
        async for chunk in backend.stats_chunks():
            chunks.append((len(chunk), turns.turns))

    asyncio.run(turns.run(read()))
    assert [n for n, _ in chunks] == [STATS_CHUNK, STATS_CHUNK, 7]
    seen = [turn for _, turn in chunks]
    assert seen == sorted(set(seen)), seen  # each chunk in a turn of its own
    assert len(asyncio.run(backend.stats())) == total
