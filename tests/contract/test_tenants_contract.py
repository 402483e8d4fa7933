"""Tenants are part of the pool identity on every backend (memory, durable, Redis on each
topology), seen through the ``Service``: the same rank, namespace and keys in two tenants are
two pools with their own pages and answers; each tenant has its own vLLM registry; one
tenant's churn never evicts another's pages; a tenant over its page quota gets 429 and nothing
changes; stats and check see every tenant's pools."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import QuotaExceeded
from kvmeta.service.limits import NO_CAPS, TenantCaps
from kvmeta.service.ops import Service
from kvmeta.service.warnings import Outcome
from kvmeta.store.base import Backend
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.redis.backend import pool_prefix
from tests.contract.conftest import BACKENDS

T = TypeVar("T")

A = PoolId("s", 0, "kv", "team-a")
B = PoolId("s", 0, "kv", "team-b")
D = PoolId("s", 0, "kv")  # the default tenant's pool of the same rank and namespace


class SyncService:
    """A started ``Service`` over one backend, called synchronously."""

    def __init__(self, service: Service, loop: asyncio.AbstractEventLoop) -> None:
        self.service = service
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """The operation's value (its caller warnings, if any, are not under test here)."""
        method = getattr(self.service, name)
        return lambda *args: _value(self.run(method(*args)))

    def store(self, pool: PoolId, keys: list[str]) -> list[int]:
        """Reserve and confirm ``keys`` in ``pool``; their pages."""
        out = self.reserve(pool, keys)
        pairs = [(k, page) for k, (hit, page) in zip(keys, out, strict=True) if not hit]
        assert self.confirm(pool, pairs, []) == 0
        return [page for _, page in out]

    def v_store(self, rank: int, keys: list[str], tenant: str) -> None:
        self.store(PoolId("v", rank, "", tenant), keys)


def _value(result: Any) -> Any:
    return result.value if isinstance(result, Outcome) else result


def _durable(ttl: float, lease: float, directory: Path) -> Backend:
    store = MemoryStore(reservation_ttl=ttl, read_lease=lease)
    return LocalBackend(store, DurabilityOptions(data_dir=directory, snapshot_interval=0.0))


@pytest.fixture(params=["durable", *sorted(BACKENDS)])
def svc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SyncService]:
    loop = asyncio.new_event_loop()
    if request.param == "durable":
        backend = _durable(300.0, 0.0, tmp_path / "data")
    else:
        backend = BACKENDS[request.param](
            300.0, 0.0, lambda name: str(request.getfixturevalue(name))
        )
    loop.run_until_complete(backend.start())
    sync = SyncService(Service(backend), loop)
    try:
        yield sync
        assert sync.run(backend.check()).problems == []
    finally:
        loop.run_until_complete(backend.close())
        loop.close()


def test_same_rank_namespace_and_keys_in_two_tenants_are_separate_pools(svc: SyncService) -> None:
    for pool, pages in ((A, 8), (B, 4), (D, 16)):
        assert svc.initialize(pool, pages).created
    keys = ["k0", "k1", "k2"]
    assert svc.store(A, keys) == [0, 1, 2]
    assert svc.exists(B, keys) == [False] * 3 and svc.exists(D, keys) == [False] * 3
    assert svc.get(B, keys) == [None] * 3
    svc.store(B, ["k2", "k1"])  # the same keys, B's own pages
    assert svc.get(B, keys) == [None, 1, 0] and svc.get(A, keys) == [0, 1, 2]
    assert svc.delete(A, ["k1"]) == 1
    assert svc.get(B, keys) == [None, 1, 0] and svc.exists(A, keys) == [True, False, True]
    assert svc.clear(B) == 2
    assert svc.exists(A, keys) == [True, False, True] and svc.exists(B, keys) == [False] * 3
    sizes = {st.pool: (st.num_pages, st.stored) for st in svc.stats()}
    assert sizes == {A: (8, 2), B: (4, 0), D: (16, 0)}  # every tenant's pools listed


def test_one_tenants_churn_never_evicts_another_tenants_pages(svc: SyncService) -> None:
    svc.initialize(A, 4)
    svc.initialize(B, 4)
    mine = svc.store(B, ["b0", "b1", "b2", "b3"])
    for round_ in range(10):  # A writes 10x its pool: it evicts only its own keys
        svc.store(A, [f"a{round_}-{i}" for i in range(4)])
    assert svc.get(B, ["b0", "b1", "b2", "b3"]) == mine
    stats = {st.pool: st for st in svc.stats()}
    assert stats[B].counters["evictions"] == 0 and stats[B].stored == 4
    assert stats[A].counters["evictions"] >= 36 and stats[A].stored == 4


def test_each_tenant_has_its_own_vllm_registry(svc: SyncService) -> None:
    svc.v_register(0, 8, 2, "team-a")
    svc.v_register(1, 8, None, "team-a")
    svc.v_register(0, 4, None, "team-b")
    assert svc.v_index("team-a").view()["ranks"] == [0, 1]
    assert svc.v_index("team-a").world_size == 2
    assert svc.v_index("team-b").view() == {
        "world_size": None,
        "ranks": [0],
        "required": [0],
        "ignored": [],
        "missing": [],
    }
    assert svc.v_index().ranks == ()  # the default tenant registered nothing
    svc.v_store(0, ["blk"], "team-a")
    assert svc.v_exists(["blk"], "team-a") == [False]  # rank 1 of team-a has not stored it
    svc.v_store(1, ["blk"], "team-a")
    assert svc.v_exists(["blk"], "team-a") == [True]
    assert svc.v_exists(["blk"], "team-b") == [False] and svc.v_exists(["blk"]) == [False]
    svc.v_store(0, ["blk", "own"], "team-b")  # team-b needs only its rank 0
    assert svc.v_exists(["blk", "own"], "team-b") == [True, True]
    assert svc.v_exists(["own"], "team-a") == [False]
    svc.v_set_world_size(3, "team-b")
    assert svc.v_exists(["own"], "team-b") == [False] and svc.v_index("team-a").world_size == 2
    svc.v_set_world_size(None, "team-b")
    assert svc.v_clear("team-a") == 2
    assert svc.v_exists(["blk"], "team-b") == [True] and svc.v_exists(["blk"], "team-a") == [False]
    assert svc.v_remove(1, "team-b") is None  # team-b never registered rank 1
    assert svc.v_remove(1, "team-a") == 0
    assert svc.v_index("team-a").ranks == (0,) and svc.v_index("team-b").ranks == (0,)
    pools = sorted(st.pool for st in svc.stats())
    assert pools == [PoolId("v", 0, "", "team-a"), PoolId("v", 0, "", "team-b")]


def _state(svc: SyncService) -> dict[PoolId, tuple[int, int]]:
    return {st.pool: (st.num_pages, st.stored) for st in svc.stats()}


def test_a_tenant_over_its_page_quota_gets_429_and_nothing_changes(svc: SyncService) -> None:
    caps = {"team-a": TenantCaps(max_pages=12)}
    svc.service.tenant_caps = lambda tenant: caps.get(tenant, NO_CAPS)
    svc.initialize(A, 8)
    svc.store(A, ["x"])
    before = _state(svc)
    other = PoolId("s", 0, "other", "team-a")
    with pytest.raises(QuotaExceeded) as err:
        svc.initialize(other, 5)
    assert err.value.status == 429 and err.value.retry_after > 0
    message = str(err.value)
    for part in ("tenant 'team-a'", "max_pages 12", "8 pages in use", "new pool of 5 pages"):
        assert part in message, message
    assert "tokens file" in message and "nothing was created" in message
    with pytest.raises(QuotaExceeded, match="tenant 'team-a'"):
        svc.v_register(0, 5, 1, "team-a")  # a vLLM rank creates a pool too
    with pytest.raises(QuotaExceeded, match="tenant 'team-a'"):
        svc.v_initialize(0, "worker", 5, None, "team-a")
    assert _state(svc) == before
    assert svc.v_index("team-a").ranks == () and svc.v_index("team-a").world_size is None
    assert svc.initialize(A, 8).created is False  # re-initialising an existing pool passes
    assert svc.initialize(A, 99).num_pages == 8
    assert svc.initialize(B, 64).created  # another tenant: no cap
    assert svc.initialize(PoolId("s", 1, "kv"), 64).created  # nor the default tenant
    assert svc.initialize(other, 4).created  # exactly at the cap
    with pytest.raises(QuotaExceeded, match="12 pages in use"):
        svc.v_register(0, 1, None, "team-a")
    assert svc.get(A, ["x"]) == [0]


def test_a_tenant_at_its_pool_count_gets_429_and_removing_one_makes_room(
    svc: SyncService,
) -> None:
    """Every backend counts each tenant's pools (``Backend.budget``), vLLM ranks included."""
    caps = {"team-a": TenantCaps(max_pools=2)}
    svc.service.tenant_caps = lambda tenant: caps.get(tenant, NO_CAPS)
    svc.initialize(A, 1)
    svc.v_register(0, 1, None, "team-a")
    before = _state(svc)
    for create in (
        lambda: svc.initialize(PoolId("s", 1, "kv", "team-a"), 1),
        lambda: svc.v_register(1, 1, None, "team-a"),
    ):
        with pytest.raises(QuotaExceeded, match="its max_pools 2") as err:
            create()
        assert "has 2 pools" in str(err.value) and err.value.status == 429
    assert _state(svc) == before
    assert svc.initialize(A, 1).created is False  # an existing pool is not a new one
    assert svc.initialize(B, 1).created and svc.initialize(D, 1).created  # others: no cap
    assert svc.v_remove(0, "team-a") == 0
    assert svc.v_register(1, 1, None, "team-a").created


def test_stats_and_check_see_every_tenant(svc: SyncService) -> None:
    pools = [A, B, D, PoolId("s", 3, "x:y", "t.1"), PoolId("s", 3, "x", "t_2")]
    for pool in pools:
        svc.initialize(pool, 2)
        svc.store(pool, [f"{pool.tenant}-key"])
    svc.v_register(0, 2, None, "t.1")
    assert sorted(st.pool for st in svc.stats()) == sorted([*pools, PoolId("v", 0, "", "t.1")])
    report = svc.run(svc.service.backend.check())
    assert report.ok and report.checked == len(pools) + 1
    for pool in pools:
        assert svc.get(pool, [f"{pool.tenant}-key"]) == [0]


def test_redis_key_names_per_tenant() -> None:
    """The default tenant keeps today's names; a tenant's own hash tag cannot spell another's."""
    assert pool_prefix(D) == "kvmeta:2:{s:0:kv}:"
    assert pool_prefix(PoolId("v", 3, "")) == "kvmeta:2:{v}:r3:"
    assert pool_prefix(A) == "kvmeta:2:{team-a|s:0:kv}:"
    assert pool_prefix(PoolId("v", 3, "", "team-a")) == "kvmeta:2:{team-a|v}:r3:"
    tricky = [
        PoolId("s", 0, "kv|s:0:kv", "a"),
        PoolId("s", 0, "kv", "a|s:0:kv"),
        PoolId("s", 0, "a|s:0:kv", ""),
        PoolId("s", 0, "kv", "a"),
        PoolId("s", 0, "v}:r0", ""),
        PoolId("v", 0, "", "s:0:kv"),
    ]
    assert len({pool_prefix(p) for p in tricky}) == len(tricky)
