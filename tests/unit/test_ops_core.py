"""The operations core (``service.core``) on its own: one op sequence, two drivers (a sync
``MemoryStore`` as in-process, an async backend as the server), identical results; every
check runs before the first store call; the page budget holds under concurrency."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, KvmetaError, NotInitialized, PayloadTooLarge
from kvmeta.service.core import Op, Operations, run_async, run_sync
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.service.vllm import INIT_ERROR, SCHEDULER_MESSAGE
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.unit.store.durable_support import open_backend

S0, S1 = PoolId("s", 0, "kv"), PoolId("s", 1, "kv")
V0 = PoolId("v", 0, "")
LIMITS = RequestLimits(max_keys=4, max_pages=64, max_total_pages=100, max_world_size=4)


def script(ops: Operations) -> list[Op[Any]]:
    """Good and bad calls of every operation, in an order that touches every state."""
    return [
        ops.initialize(S0, 8),
        ops.initialize(S0, 9),  # size conflict: a warning, not an error
        ops.initialize(S1, 93),  # over the budget
        ops.reserve(S0, ["a", "b", "a"]),
        ops.confirm(S0, [("a", 0), ("b", 1)], []),
        ops.confirm(S0, [("x", 5)], []),  # refused: a warning
        ops.confirm(S0, [("a", 8)], []),  # page outside the pool
        ops.exists(S0, ["a", "b", "c"]),
        ops.get(S0, ["a", "zz"]),
        ops.exists(S0, list("abcde")),  # too many keys
        ops.delete(S0, ["a"]),
        ops.get(S1, ["a"]),  # not initialized
        ops.clear(S0),
        ops.v_initialize(0, "scheduler"),
        ops.v_initialize(0, "worker", 8, 2),
        ops.v_initialize(1, "worker", 65),  # over --max-pages, vLLM's wording
        ops.v_initialize(3, "Worker", 8),
        ops.v_register(1, 8, None),
        ops.reserve(V0, ["k"]),
        ops.confirm(V0, [("k", 0)], [9]),  # release outside the pool, named in vLLM's words
        ops.confirm(V0, [("k", 0)], []),
        ops.v_exists(["k"]),
        ops.v_set_world_size(True),
        ops.v_set_world_size(5),
        ops.v_set_world_size(None),
        ops.v_exists(["k"]),
        ops.v_index(),
        ops.v_remove(1),
        ops.v_remove(1),
        ops.v_clear(),
        ops.stats(),
    ]


def outcome(run: Any) -> Any:
    try:
        return ("ok", run())
    except KvmetaError as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "field", None))


def test_sync_store_and_async_backends_agree(tmp_path: Path) -> None:
    store = MemoryStore(read_lease=0.0)
    sync = [outcome(lambda op=op: run_sync(op, store)) for op in script(Operations(LIMITS))]

    async def on(backend: Any) -> list[Any]:
        out = []
        for op in script(Operations(LIMITS)):
            try:
                out.append(("ok", await run_async(op, backend)))
            except KvmetaError as exc:
                out.append((type(exc).__name__, str(exc), getattr(exc, "field", None)))
        return out

    async def durable() -> list[Any]:
        backend = await open_backend(tmp_path)  # waits for its journal on every mutation
        try:
            return await on(backend)
        finally:
            await backend.close()

    plain = asyncio.run(on(LocalBackend(MemoryStore(read_lease=0.0))))
    journaled = asyncio.run(durable())
    for name, got in (("memory", plain), ("durable", journaled)):
        # (stats differ only in timing-free counters; compare all but the last reply)
        assert got[:-1] == sync[:-1], name
    kinds = [row[0] for row in sync]
    assert kinds.count("ok") >= 20 and "PayloadTooLarge" in kinds and "NotInitialized" in kinds
    page_error = sync[19]
    assert page_error[0] == "InvalidRequest" and page_error[2] == "pages_to_release"
    assert "`pages_to_release`" in page_error[1] and "batch_allocate" in page_error[1]
    assert sync[15][1].startswith(INIT_ERROR) and "--max-pages" in sync[15][1]
    assert sync[13] == ("ok", run_sync(Operations().v_initialize(0, "scheduler"), store))
    assert sync[13][1].value == SCHEDULER_MESSAGE


def test_warnings_travel_with_the_outcome() -> None:
    ops, store = Operations(LIMITS), MemoryStore()
    assert run_sync(ops.initialize(S0, 8), store).warnings == []
    ((kind, text),) = run_sync(ops.initialize(S0, 9), store).warnings
    assert kind == "size_conflict" and "already has 8 pages; the requested 9" in text
    refused = run_sync(ops.confirm(S0, [("a", 3)], []), store)
    assert refused.value == 1 and refused.warnings[0][0] == "confirm_refused"
    registered = run_sync(ops.v_initialize(0, "worker", 4), store)
    assert registered.value == "Rank 0 initialized with 4 pages" and not registered.warnings
    again = run_sync(ops.v_initialize(0, "worker", 5), store)
    assert "requested 5 is ignored" in again.value and again.warnings[0][0] == "size_conflict"


class NoStore:
    """A store that must not be called: a bad request is refused before any store call."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"store.{name} called for a request that should be refused")


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda o: o.initialize(S0, 0), InvalidRequest),
        (lambda o: o.initialize(S0, 65), InvalidRequest),
        (lambda o: o.initialize(PoolId("s", 0, "bad ns"), 8), InvalidRequest),
        (lambda o: o.initialize(PoolId("s", 2**63, "kv"), 8), InvalidRequest),
        (lambda o: o.exists(S0, list("abcde")), PayloadTooLarge),
        (lambda o: o.exists(PoolId("s", -(2**63) - 1, "kv"), ["a"]), InvalidRequest),
        (lambda o: o.reserve(S0, ["k" * 2000]), InvalidRequest),
        (lambda o: o.confirm(S0, [("a", 1)] * 3, [1, 2]), PayloadTooLarge),
        (lambda o: o.get(PoolId("v", 2**64, ""), ["a"]), InvalidRequest),
        (lambda o: o.delete(S0, list("abcde")), PayloadTooLarge),
        (lambda o: o.clear(PoolId("s", 2**64, "kv")), InvalidRequest),
        (lambda o: o.v_initialize(0, "worker", 0), InvalidRequest),
        (lambda o: o.v_initialize(0, "worker", 8, 9), InvalidRequest),
        (lambda o: o.v_register(0, 8, 5), InvalidRequest),
        (lambda o: o.v_exists(list("abcde")), PayloadTooLarge),
        (lambda o: o.v_remove(2**64), InvalidRequest),
        (lambda o: o.v_set_world_size(0), InvalidRequest),
        (lambda o: o.v_set_world_size(5), InvalidRequest),
    ],
)
def test_refused_before_any_store_call(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        run_sync(make(Operations(LIMITS)), NoStore())


class SlowStats(LocalBackend):
    """Yields to the loop between reading the budget and creating the pool, as a journaled
    or networked backend does."""

    async def stats(self) -> Any:
        stats = await super().stats()
        await asyncio.sleep(0)
        return stats


def test_budget_check_and_creation_do_not_interleave() -> None:
    store = MemoryStore()
    service = Service(SlowStats(store), LIMITS)

    async def run() -> list[Any]:
        calls = [service.initialize(PoolId("s", r, "kv"), 60) for r in range(3)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run())
    assert sum(not isinstance(r, Exception) for r in results) == 1
    assert all(isinstance(r, InvalidRequest) for r in results if isinstance(r, Exception))
    assert sum(p.num_pages for p in store.pools.values()) == 60


def test_not_initialized_comes_from_the_store_in_the_dialects_words() -> None:
    with pytest.raises(NotInitialized, match="Rank 3 not initialized|rank 3"):
        run_sync(Operations().get(PoolId("v", 3, ""), ["a"]), MemoryStore())


def test_service_runs_vllm_initialize_whole() -> None:
    """What the dialect-V route needs in one call: fields as decoded, reply and warnings."""
    service = Service(LocalBackend(MemoryStore()), LIMITS)

    async def run() -> None:
        with pytest.raises(InvalidRequest, match="needs `num_pages`, which is missing"):
            await service.v_initialize(0, role="worker")
        assert (await service.v_initialize(0, role="scheduler")).value == SCHEDULER_MESSAGE
        done = await service.v_initialize(0, role="worker", num_pages=8, world_size=2)
        assert done.value == "Rank 0 initialized with 8 pages" and not done.warnings
        again = await service.v_initialize(0, num_pages=9)
        assert again.warnings[0][0] == "size_conflict"
        with pytest.raises(InvalidRequest, match=f"^{INIT_ERROR}.*--max-pages"):
            await service.v_initialize(1, num_pages=65)
        refused = await service.confirm_outcome(V0, [("a", 3)], [])
        assert refused.value == 1 and refused.warnings[0][0] == "confirm_refused"

    asyncio.run(run())
