"""The vLLM index at scale, in process: a large ``batch_exists`` lets other requests run while
it walks the ranks, and registering a rank does not walk every pool of every tenant."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

import kvmeta.store.disk.memory as memory
from kvmeta._types import PoolId
from kvmeta.config import Settings
from kvmeta.server.http import Request
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore


def _stored_everywhere(store: MemoryStore, ranks: int, keys: list[str]) -> None:
    for rank in range(ranks):
        store.v_register(rank, len(keys), None)
        pool = PoolId("v", rank, "")
        pages = [page for _, page in store.reserve(pool, keys)]
        assert store.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0


def test_a_large_batch_exists_lets_other_requests_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys stored on every rank are the walk's worst case (a lookup per key on each rank): it
    pauses every ``V_EXISTS_STEP`` lookups, and a /health sent after it answers before it."""
    step, ranks = 256, 16
    monkeypatch.setattr(memory, "V_EXISTS_STEP", step, raising=False)
    keys = [f"block-{i}" for i in range(step)]
    store = MemoryStore()
    _stored_everywhere(store, ranks, keys)
    app = build_app(Settings(in_memory=True), Service(LocalBackend(store)))
    body = msgspec.json.encode({"keys": [*keys, "missing"]})

    async def scenario() -> tuple[list[str], int, Any]:
        done: list[str] = []
        turns = 0

        async def ticker() -> None:  # one count per turn of the loop it gets
            nonlocal turns
            while "batch_exists" not in done:
                turns += 1
                await asyncio.sleep(0)

        async def call(name: str, request: Request) -> Any:
            response = await app(request)
            done.append(name)
            return response

        exists = asyncio.create_task(
            call("batch_exists", Request("POST", "/keys/batch_exists", "", body, None))
        )
        health = asyncio.create_task(call("health", Request("GET", "/health", "", b"", None)))
        tick = asyncio.create_task(ticker())
        reply, _, _ = await asyncio.gather(exists, health, tick)
        return done, turns, reply

    done, turns, reply = asyncio.run(scenario())
    assert done == ["health", "batch_exists"]  # not held up by the walk
    # 16 ranks x 256 keys = 16 steps: the loop turned between each (a walk in one piece
    # gives the ticker no turn before it ends)
    assert turns >= ranks - 1
    assert reply.status == 200
    assert msgspec.json.decode(reply.body) == {"exists": [True] * step + [False]}


class _CountingPools(dict[PoolId, Any]):
    """``MemoryStore.pools`` that counts the walks over all its pools."""

    walks = 0

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()

    def keys(self) -> Any:
        type(self).walks += 1
        return super().keys()

    def items(self) -> Any:
        type(self).walks += 1
        return super().items()

    def values(self) -> Any:
        type(self).walks += 1
        return super().values()


def test_registering_a_rank_does_not_walk_every_pool() -> None:
    """Each registration reads the tenant's registry (for the ignored-rank warning): from the
    tenant's own ranks, not by going through every pool of every tenant."""
    store = MemoryStore()
    for rank in range(300):  # other pools: SGLang's, another tenant's ranks
        store.initialize(PoolId("s", rank, "kv"), 4)
        store.initialize(PoolId("v", rank, "", "other"), 4)
    store.pools = _CountingPools(store.pools)
    service = Service(LocalBackend(store))

    async def scenario() -> list[bool]:
        for rank in (0, 1, 2, 77):
            await service.v_register(rank, 4, None)
        await service.v_remove(77)
        return await service.v_exists(["k"])

    assert asyncio.run(scenario()) == [False]
    assert _CountingPools.walks == 0
    assert store.vllm_ranks() == [0, 1, 2]
    assert store.vllm_ranks("other") == list(range(300))
