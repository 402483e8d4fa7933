"""Pool stats say what a reserve can take without evicting, the same on every backend.

A page released (or freed while a reader's lease may still be reading it) is FREE but cools
before it is handed out again. ``free`` counts only the pages a reserve can take now; the
cooling ones are counted apart (``cooling``), so ``free + cooling + reserved + stored`` is
always ``num_pages``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.store.base import Backend, PoolStats
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.redis.backend import RedisBackend
from tests.contract.conftest import Sync
from tests.support import ServerProcess

S0 = PoolId("s", 0, "kv")
LEASE = 60.0  # read leases that outlast the test however loaded the machine

Factory = Callable[[pytest.FixtureRequest, Path], Backend]
FACTORIES: dict[str, Factory] = {
    "memory": lambda request, tmp: LocalBackend(MemoryStore(read_lease=LEASE)),
    "durable": lambda request, tmp: LocalBackend(
        MemoryStore(read_lease=LEASE),
        DurabilityOptions(data_dir=tmp / "data", fsync="never", snapshot_interval=0.0),
    ),
    "redis": lambda request, tmp: RedisBackend(
        request.getfixturevalue("redis_url"), read_lease=LEASE
    ),
}


@pytest.fixture(params=sorted(FACTORIES))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sync]:
    loop = asyncio.new_event_loop()
    built = FACTORIES[request.param](request, tmp_path)
    loop.run_until_complete(built.start())
    sync = Sync(built, loop)
    try:
        yield sync
        sync.check()
    finally:
        loop.run_until_complete(built.close())
        loop.close()


def _stats(b: Sync) -> PoolStats:
    (st,) = b.stats()
    assert st.free + st.cooling + st.reserved + st.stored == st.num_pages
    return st


def _pages(st: PoolStats) -> tuple[int, int, int, int]:
    return st.free, st.cooling, st.reserved, st.stored


def test_a_released_page_cools_and_is_not_counted_free(backend: Sync) -> None:
    backend.initialize(S0, 4)
    (_, a), (_, b) = backend.reserve(S0, ["a", "b"])
    assert backend.confirm(S0, [("a", a)], [b]) == 0  # b's write failed: released
    assert _pages(_stats(backend)) == (2, 1, 0, 1)
    # Two free pages: two new keys get them without evicting anything ...
    assert sorted(p for _, p in backend.reserve(S0, ["c", "d"])) == sorted({0, 1, 2, 3} - {a, b})
    st = _stats(backend)
    assert _pages(st) == (0, 1, 2, 1) and st.counters["evictions"] == 0
    # ... and with free at 0 the next one evicts, though a page is still cooling.
    assert backend.reserve(S0, ["e"]) == [(False, a)]
    st = _stats(backend)
    assert _pages(st) == (0, 1, 3, 0) and st.counters["evictions"] == 1


def test_a_deleted_page_under_a_read_lease_cools(backend: Sync) -> None:
    backend.initialize(S0, 2)
    ((_, page),) = backend.reserve(S0, ["a"])
    backend.confirm(S0, [("a", page)], [])
    assert backend.get(S0, ["a"]) == [page]  # a reader holds the page for LEASE seconds
    assert backend.delete(S0, ["a"]) == 1
    assert _pages(_stats(backend)) == (1, 1, 0, 0)
    assert backend.reserve(S0, ["b", "c"])[1] == (False, -1)  # only the free one is taken
    assert _pages(_stats(backend)) == (0, 1, 1, 0)


def test_the_operator_views_show_cooling_apart(make_server: Callable[..., ServerProcess]) -> None:
    """``/v1/pools`` (so ``kvmeta status --json`` and the status page) and ``/metrics``."""
    server = make_server("--in-memory")
    server.post("/0/initialize", {"num_pages": 4, "namespace": "kv"})
    reply = server.post(
        "/0/reserve_and_allocate_page_indices", {"keys": [["a", None]], "namespace": "kv"}
    ).json()
    page = reply["indices"][0][1]
    body = {"written_keys_to_confirm": [], "pages_to_release": [page], "namespace": "kv"}
    assert server.post("/0/confirm_write", body).status_code == 204
    (pool,) = requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]
    assert {k: pool[k] for k in ("free", "cooling", "reserved", "stored")} == {
        "free": 3,
        "cooling": 1,
        "reserved": 0,
        "stored": 0,
    }
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    states = {
        line.split('state="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvmeta_pool_pages{")
    }
    assert states == {"free": 3, "cooling": 1, "reserved": 0, "stored": 0}
