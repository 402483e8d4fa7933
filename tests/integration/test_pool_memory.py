"""A pool's memory follows the pages it uses, so a pool far larger than the machine (an hf3fs
file of 1-byte marker pages: ~2^40 pages) is created and served in kilobytes. The memory check
stays as a backstop: a pool whose first pages cannot be had is refused with a 413 naming the
memory and the fix, before anything is created, and the server keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, PayloadTooLarge
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore

HUGE = 1 << 48
LIMITS = RequestLimits(max_pages=HUGE, max_total_pages=HUGE * 4)


def test_a_pool_bigger_than_the_memory_is_created_and_serves() -> None:
    store = MemoryStore()
    service = Service(LocalBackend(store), LIMITS)
    pid = PoolId("s", 0, "kv")

    async def run() -> None:
        assert (await service.initialize(pid, HUGE)).value.created
        assert (await service.v_register(0, HUGE, None)).value.created
        [(stored, page)] = await service.reserve(pid, ["a"])
        assert not stored and page == 0
        await service.confirm(pid, [("a", 0)], [])
        assert await service.exists(pid, ["a", "b"]) == [True, False]

    asyncio.run(run())
    assert store.pool(pid).capacity == 1025 and store.total_pages == 2 * HUGE


def test_a_pool_whose_first_pages_cannot_be_had_is_a_413(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MemoryError while creating a pool is a 413 that created nothing, never a 500."""
    store = MemoryStore()
    service = Service(LocalBackend(store), LIMITS)

    def no_memory(*_: Any, **__: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(MemoryStore, "_new_pool", no_memory)

    async def failed() -> None:
        with pytest.raises(PayloadTooLarge, match="the allocation") as err:
            await service.initialize(PoolId("s", 0, "kv"), 8)
        assert err.value.status == 413 and err.value.field == "num_pages"
        assert "nothing was created" in str(err.value)
        with pytest.raises(InvalidRequest, match="out of memory"):
            await service.v_register(0, HUGE, None)  # a vLLM rank's pool too
        assert await service.stats() == []

    asyncio.run(failed())
    monkeypatch.undo()
    assert asyncio.run(service.initialize(PoolId("s", 0, "kv"), 8)).value.created
    assert sorted(store.pools) == [PoolId("s", 0, "kv")]
    assert store.total_pages == 8 and store.vllm_ranks() == []


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_over_http_a_2_to_the_40_page_pool_is_created_and_serves(make_server: Any) -> None:
    pages = 1 << 40
    server = make_server("--in-memory", "--max-pages", str(pages), "--max-total-pages", str(HUGE))
    before = _rss_kib(server.pid)
    assert server.post("/0/initialize", {"num_pages": pages}).status_code == 204
    reply = server.post("/rank/0/initialize", {"role": "worker", "num_pages": pages})
    assert reply.ok, reply.text
    reserved = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    assert reserved.status_code == 200, reserved.text
    assert reserved.json()["indices"] == [[False, 0]]
    assert server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", 0]]}).ok
    assert server.post("/0/exists", {"keys": ["a", "b"]}).json() == {"exists": [True, False]}
    far = server.post("/0/confirm_write", {"written_keys_to_confirm": [["b", pages - 1]]})
    assert far.ok, far.text  # a page never handed out: refused quietly, as any FREE page
    assert server.post("/0/exists", {"keys": ["b"]}).json() == {"exists": [False]}
    pools = requests.get(f"{server.url}/v1/pools", timeout=30).json()["pools"]
    [pool] = [p for p in pools if p["dialect"] == "s"]
    assert pool["num_pages"] == pages and pool["stored"] == 1
    assert pool["free"] == pages - 1 and pool["counters"]["confirms_refused"] == 1
    # A few hundred KiB for the two pools (the first step of their arrays), not terabytes.
    assert _rss_kib(server.pid) - before < 64 * 1024
