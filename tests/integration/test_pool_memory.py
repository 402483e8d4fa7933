"""A pool the machine cannot hold is refused with a 413 naming the memory and the fix, before
anything is allocated or created; the server keeps serving. No test allocates much: the size
asked for (2^48 pages) fails the memory check up front, or, with it out of the way, the first
allocation at once on any machine, whatever its overcommit setting (its first array alone is
256 TiB, more than a process's whole address space)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, PayloadTooLarge
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.store.memory import MemoryBackend, MemoryStore

HUGE = 1 << 48
LIMITS = RequestLimits(max_pages=HUGE, max_total_pages=HUGE * 4)


def _refused_then_served(store: MemoryStore) -> None:
    service = Service(MemoryBackend(store), LIMITS)

    async def run() -> None:
        with pytest.raises(PayloadTooLarge) as err:
            await service.initialize(PoolId("s", 0, "kv"), HUGE)
        assert err.value.status == 413 and err.value.field == "num_pages"
        for part in (f"`num_pages` {HUGE}", "TiB of memory", "--max-pages"):
            assert part in str(err.value), str(err.value)
        assert "nothing was created" in str(err.value)
        with pytest.raises(InvalidRequest, match="TiB of memory"):
            await service.v_register(0, HUGE, None)  # a vLLM rank's pool too
        assert await service.stats() == []
        assert (await service.initialize(PoolId("s", 0, "kv"), 8)).created

    asyncio.run(run())
    assert sorted(store.pools) == [PoolId("s", 0, "kv")]
    assert store.total_pages == 8 and store.vllm_ranks() == []


def test_a_pool_bigger_than_the_memory_is_refused_before_allocating() -> None:
    _refused_then_served(MemoryStore())


def test_a_failed_allocation_is_the_same_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the available memory cannot be read, the allocation itself fails (MemoryError):
    the same 413, not a 500."""
    from kvmeta.store import headroom

    monkeypatch.setattr(headroom, "memory_headroom", lambda: None)
    _refused_then_served(MemoryStore())


def test_over_http_a_413_and_the_server_still_serves(make_server: Any) -> None:
    server = make_server("--in-memory", "--max-pages", str(HUGE), "--max-total-pages", str(HUGE))
    url = server.url
    reply = requests.post(f"{url}/0/initialize", json={"num_pages": HUGE}, timeout=30)
    assert reply.status_code == 413, reply.text
    assert "--max-pages" in reply.json()["detail"]
    reply = requests.post(f"{url}/rank/0/initialize", json={"num_pages": HUGE}, timeout=30)
    assert reply.status_code == 400 and "memory" in reply.json()["detail"], reply.text
    assert requests.get(f"{url}/v1/pools", timeout=30).json()["pools"] == []
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    assert requests.post(f"{url}/0/initialize", json={"num_pages": 8}, timeout=30).ok
