"""The ``Service`` on its own: the same operations driven two ways (the in-process runner over
the in-memory backend, an event loop over the memory and durable backends) give identical
results; every check runs before the first store call; the page budget holds under
concurrency; warnings and the out-of-range page come from the Service, worded once."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvmeta.service
from kvmeta._types import PoolId
from kvmeta.client._local import run_now
from kvmeta.errors import (
    InvalidRequest,
    KvmetaError,
    NotInitialized,
    PageOutOfRange,
    PayloadTooLarge,
)
from kvmeta.server import sglang, vllm
from kvmeta.server.app import WARNING_HEADER
from kvmeta.server.http import Request
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.service.vllm import INIT_ERROR, SCHEDULER_MESSAGE
from kvmeta.service.warnings import Outcome
from kvmeta.store.base import InitResult
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.unit.store.durable_support import open_backend

S0, S1 = PoolId("s", 0, "kv"), PoolId("s", 1, "kv")
V0 = PoolId("v", 0, "")
LIMITS = RequestLimits(max_keys=4, max_pages=64, max_total_pages=100, max_world_size=4)

Call = Callable[[Service], Coroutine[Any, Any, Any]]


def script() -> list[Call]:
    """Good and bad calls of every operation, in an order that touches every state."""
    return [
        lambda s: s.initialize(S0, 8),
        lambda s: s.initialize(S0, 9),  # size conflict: a warning, not an error
        lambda s: s.initialize(S1, 93),  # over the budget
        lambda s: s.reserve(S0, ["a", "b", "a"]),
        lambda s: s.confirm(S0, [("a", 0), ("b", 1)], []),
        lambda s: s.confirm(S0, [("x", 5)], []),  # refused: a warning
        lambda s: s.confirm(S0, [("a", 8)], []),  # page outside the pool
        lambda s: s.exists(S0, ["a", "b", "c"]),
        lambda s: s.get(S0, ["a", "zz"]),
        lambda s: s.exists(S0, list("abcde")),  # too many keys
        lambda s: s.delete(S0, ["a"]),
        lambda s: s.get(S1, ["a"]),  # not initialized
        lambda s: s.clear(S0),
        lambda s: s.v_initialize(0, "scheduler"),
        lambda s: s.v_initialize(0, "worker", 8, 2),
        lambda s: s.v_initialize(1, "worker", 65),  # over --max-pages, vLLM's wording
        lambda s: s.v_initialize(3, "Worker", 8),
        lambda s: s.v_register(1, 8, None),
        lambda s: s.reserve(V0, ["k"]),
        lambda s: s.confirm(V0, [("k", 0)], [9]),  # release outside the pool, vLLM's words
        lambda s: s.confirm(V0, [("k", 0)], []),
        lambda s: s.v_exists(["k"]),
        lambda s: s.v_set_world_size(True),
        lambda s: s.v_set_world_size(5),
        lambda s: s.v_set_world_size(None),
        lambda s: s.v_exists(["k"]),
        lambda s: s.v_index(),
        lambda s: s.v_remove(1),
        lambda s: s.v_remove(1),
        lambda s: s.v_clear(),
        lambda s: s.stats(),
    ]


def outcome(run: Callable[[], Any]) -> Any:
    try:
        return ("ok", run())
    except KvmetaError as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "field", None))


def test_in_process_runner_and_event_loop_backends_agree(tmp_path: Path) -> None:
    inproc = Service(LocalBackend(MemoryStore(read_lease=0.0)), LIMITS)
    sync = [outcome(lambda c=c: run_now(c(inproc))) for c in script()]

    async def on(backend: Any) -> list[Any]:
        service = Service(backend, LIMITS)
        out = []
        for call in script():
            try:
                out.append(("ok", await call(service)))
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
    assert sync[13][1].value == SCHEDULER_MESSAGE and not sync[13][1].warnings


def test_warnings_travel_with_the_outcome() -> None:
    service = Service(LocalBackend(MemoryStore()), LIMITS)

    async def run() -> None:
        assert (await service.initialize(S0, 8)).warnings == ()
        ((kind, text),) = (await service.initialize(S0, 9)).warnings
        assert kind == "size_conflict" and "already has 8 pages; the requested 9" in text
        refused = await service.confirm(S0, [("a", 3)], [])
        assert refused.value == 1 and refused.warnings[0][0] == "confirm_refused"
        registered = await service.v_initialize(0, "worker", 4)
        assert registered.value == "Rank 0 initialized with 4 pages" and not registered.warnings
        again = await service.v_initialize(0, "worker", 5)
        assert "requested 5 is ignored" in again.value and again.warnings[0][0] == "size_conflict"

    asyncio.run(run())


class NoStore:
    """A backend that must not be called: a bad request is refused before any store call."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"backend.{name} called for a request that should be refused")


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda s: s.initialize(S0, 0), InvalidRequest),
        (lambda s: s.initialize(S0, 65), InvalidRequest),
        (lambda s: s.initialize(PoolId("s", 0, "bad ns"), 8), InvalidRequest),
        (lambda s: s.initialize(PoolId("s", 2**63, "kv"), 8), InvalidRequest),
        (lambda s: s.exists(S0, list("abcde")), PayloadTooLarge),
        (lambda s: s.exists(PoolId("s", -(2**63) - 1, "kv"), ["a"]), InvalidRequest),
        (lambda s: s.reserve(S0, ["k" * 2000]), InvalidRequest),
        (lambda s: s.confirm(S0, [("a", 1)] * 3, [1, 2]), PayloadTooLarge),
        (lambda s: s.get(PoolId("v", 2**64, ""), ["a"]), InvalidRequest),
        (lambda s: s.delete(S0, list("abcde")), PayloadTooLarge),
        (lambda s: s.clear(PoolId("s", 2**64, "kv")), InvalidRequest),
        (lambda s: s.v_initialize(0, "worker", 0), InvalidRequest),
        (lambda s: s.v_initialize(0, "worker", 8, 9), InvalidRequest),
        (lambda s: s.v_register(0, 8, 5), InvalidRequest),
        (lambda s: s.v_exists(list("abcde")), PayloadTooLarge),
        (lambda s: s.v_remove(2**64), InvalidRequest),
        (lambda s: s.v_set_world_size(0), InvalidRequest),
        (lambda s: s.v_set_world_size(5), InvalidRequest),
    ],
)
def test_refused_before_any_store_call(make: Call, error: type[Exception]) -> None:
    with pytest.raises(error):
        asyncio.run(make(Service(NoStore(), LIMITS)))  # type: ignore[arg-type]


class SlowBudget(LocalBackend):
    """Yields to the loop between reading the budget and creating the pool, as a journaled
    or networked backend does."""

    async def budget(self, pool: PoolId) -> Any:
        budget = await super().budget(pool)
        await asyncio.sleep(0)
        return budget


def test_budget_check_and_creation_do_not_interleave() -> None:
    store = MemoryStore()
    service = Service(SlowBudget(store), LIMITS)

    async def run() -> list[Any]:
        calls = [service.initialize(PoolId("s", r, "kv"), 60) for r in range(3)]
        calls += [service.v_register(r, 60, None) for r in range(2)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run())
    assert sum(not isinstance(r, Exception) for r in results) == 1
    assert all(isinstance(r, InvalidRequest) for r in results if isinstance(r, Exception))
    assert sum(p.num_pages for p in store.pools.values()) == 60


def test_not_initialized_comes_from_the_store_in_the_dialects_words() -> None:
    service = Service(LocalBackend(MemoryStore()))
    with pytest.raises(NotInitialized, match="Rank 3 not initialized|rank 3"):
        asyncio.run(service.get(PoolId("v", 3, ""), ["a"]))


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
        refused = await service.confirm(V0, [("a", 3)], [])
        assert refused.value == 1 and refused.warnings[0][0] == "confirm_refused"

    asyncio.run(run())


# ---------------------------------------------------------------------- the out-of-range page


class NoStats(LocalBackend):
    """Counts ``stats`` calls: naming a page outside the pool must not read every pool."""

    stats_calls = 0

    async def stats(self) -> Any:
        NoStats.stats_calls += 1
        return await super().stats()

    def stats_chunks(self, size: int = 256) -> Any:
        NoStats.stats_calls += 1
        return super().stats_chunks(size)


@pytest.mark.parametrize(
    ("pool", "pairs", "release", "field", "text"),
    [
        (
            S0,
            [("a", 8)],
            [],
            "written_keys_to_confirm",
            "page 8 in `written_keys_to_confirm` is outside this pool's pages 0..7; confirm "
            "only pages returned by reserve",
        ),
        (
            S0,
            [],
            [-1],
            "pages_to_release",
            "page -1 in `pages_to_release` is outside this pool's pages 0..7; release only "
            "pages returned by reserve",
        ),
        (
            V0,
            [("a", 8)],
            [],
            "confirmations",
            "page 8 in `confirmations` is outside this pool's pages 0..7; confirm only pages "
            "returned by batch_allocate",
        ),
        (
            V0,
            [("a", 1)],
            [10**30],
            "pages_to_release",
            "page a number of about 31 digits in `pages_to_release` is outside this pool's "
            "pages 0..7; release only pages returned by batch_allocate",
        ),
    ],
)
def test_out_of_range_page_is_worded_once_in_the_callers_dialect_without_stats(
    pool: PoolId, pairs: list[tuple[str, int]], release: list[int], field: str, text: str
) -> None:
    store = MemoryStore()
    service = Service(NoStats(store))
    NoStats.stats_calls = 0

    async def run() -> None:
        await service.initialize(S0, 8)
        await service.v_register(0, 8, None)
        await service.initialize(S1, 4)  # another pool: its size must not be the one named
        await service.reserve(pool, ["a"])
        with pytest.raises(InvalidRequest) as info:
            await service.confirm(pool, pairs, release)
        # the class a 400 maps back to: in-process and HTTP callers get the same error
        assert type(info.value) is InvalidRequest
        assert str(info.value) == text and info.value.field == field

    asyncio.run(run())
    assert NoStats.stats_calls == 0


def test_the_store_reports_the_page_typed() -> None:
    """The store names the page, the pool's size and the list it was in; its own words are
    SGLang's (the store's field names)."""
    store = MemoryStore()
    store.initialize(S0, 4)
    with pytest.raises(PageOutOfRange) as info:
        store.confirm(S0, [("a", 0)], [1, 99])
    exc = info.value
    assert (exc.page, exc.num_pages, exc.in_release, exc.field) == (99, 4, True, "pages_to_release")
    worded = exc.for_caller("confirmations", "batch_allocate")
    assert worded.field == "pages_to_release" and str(worded).endswith("by batch_allocate")
    assert isinstance(exc, InvalidRequest) and exc.status == 400


# ---------------------------------------------------------------------- one driver, typed calls


def test_service_methods_are_the_operations() -> None:
    """No generator protocol, no string dispatch: each operation is an async method whose
    calls on the ``Backend`` mypy checks (``tests/unit/test_typing.py`` runs it strictly)."""
    ops = inspect.getsource(kvmeta.service.ops)
    assert "getattr(" not in ops and "yield" not in ops
    assert not hasattr(kvmeta.service, "core")
    for name, method in inspect.getmembers(Service, inspect.isfunction):
        if not name.startswith("_"):
            assert inspect.iscoroutinefunction(method), name
            assert inspect.signature(method).return_annotation not in (
                "Any",
                inspect.Parameter.empty,
            ), name


# ---------------------------------------------------------------------- warnings: one place


class Scripted(Service):
    """Returns the warnings it is told to, whatever happened: the handlers must send exactly
    those, and build none of their own."""

    said: tuple[tuple[str, str], ...] = ()

    async def confirm(self, pool: PoolId, pairs: Any, release: Any) -> Outcome[int]:
        return Outcome(3, self.said)  # 3 refused: a handler re-building would say so

    async def initialize(self, pool: PoolId, num_pages: int) -> Outcome[InitResult]:
        return Outcome(InitResult(False, 4, 5), self.said)  # a size conflict, ditto

    async def v_initialize(self, rank: int, *args: Any, **kw: Any) -> Outcome[str]:
        return Outcome("hello", self.said)


ROUTES = [
    (sglang.ROUTES, "/{rank}/initialize", {"num_pages": 5}),
    (sglang.ROUTES, "/{rank}/confirm_write", {}),
    (vllm.ROUTES, "/keys/confirm_write", {"rank": 0, "confirmations": []}),
    (vllm.ROUTES, "/rank/{rank}/initialize", {"num_pages": 5}),
]


@pytest.mark.parametrize("said", [(), (("size_conflict", "from the service"),)])
@pytest.mark.parametrize(("table", "pattern", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_handlers_send_the_services_warnings_and_build_none(
    table: Any, pattern: str, body: dict[str, Any], said: Any
) -> None:
    service = Scripted(LocalBackend(MemoryStore()))
    service.said = said
    (route,) = [r for r in table if r.pattern == pattern]
    request = Request(route.method, route.pattern, "", msgspec.json.encode(body), None)
    response = asyncio.run(route.handler(service, request, 0))
    assert response.status < 300
    assert list(response.headers) == [
        (WARNING_HEADER, f"{kind}: {text}".encode()) for kind, text in said
    ]
