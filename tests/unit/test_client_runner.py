"""``client._local.run_now``: the in-process clients drive the server's async ``Service``
without an event loop while it never waits, and finish it on the client's private loop when
it does; errors, values and the caller's own running loop come out as they went in."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvmeta._types import PoolId
from kvmeta.client._local import run_now
from kvmeta.client.sglang import Hf3fsLocalMetadataClient as SGLangLocal
from kvmeta.client.vllm import Hf3fsLocalMetadataClient as VLLMLocal
from kvmeta.errors import NotInitialized
from kvmeta.service.ops import Service
from kvmeta.store.disk.memory import MemoryBackend, MemoryStore

S0 = PoolId("s", 0, "kv")


@pytest.fixture
def loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Pausing(MemoryBackend):
    """Pauses inside its operations the ways a backend can: bare yields (``asyncio.sleep(0)``,
    as the in-memory backend between chunks of a long walk), a timer and a worker thread."""

    def __init__(self, store: MemoryStore, wait: str) -> None:
        super().__init__(store)
        self.wait = wait

    async def _pause(self) -> None:
        if self.wait == "bare":
            for _ in range(3):
                await asyncio.sleep(0)
        elif self.wait == "timer":
            await asyncio.sleep(0.001)
        else:
            assert await asyncio.to_thread(lambda: 7) == 7

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        await self._pause()
        out = await super().reserve(pool, keys)
        await self._pause()
        return out

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        await self._pause()
        return await super().get(pool, keys)  # raises NotInitialized after a wait


@pytest.mark.parametrize("wait", ["bare", "timer", "thread"])
def test_an_operation_that_suspends_runs_to_its_end(loop: Any, wait: str) -> None:
    service = Service(Pausing(MemoryStore(), wait))
    run_now(service.initialize(S0, 4), loop)
    assert run_now(service.reserve(S0, ["a", "b"]), loop) == [(False, 0), (False, 1)]
    # an error raised after a wait comes out as itself, with its message
    with pytest.raises(NotInitialized, match="^Rank 5 namespace .kv. not initialized"):
        run_now(service.get(PoolId("s", 5, "kv"), ["a"]), loop)
    assert not loop.is_running() and asyncio._get_running_loop() is None


def test_bare_yields_never_start_the_loop(loop: Any) -> None:
    """The in-memory backend's only pauses are bare yields: stepped over, the loop stays
    idle (nothing scheduled on it ever runs)."""
    ran: list[int] = []
    loop.call_soon(ran.append, 1)
    service = Service(Pausing(MemoryStore(), "bare"))
    run_now(service.initialize(S0, 4), loop)
    assert run_now(service.reserve(S0, ["a"]), loop) == [(False, 0)]
    assert ran == []


def test_a_future_failing_is_raised_inside_the_operation(loop: Any) -> None:
    """A waited-on future's exception reaches the coroutine at its ``await``, as a task
    would deliver it, so the operation's own handling runs."""

    async def op() -> str:
        try:
            await asyncio.to_thread(lambda: 1 / 0)
        except ZeroDivisionError:
            return "handled inside"
        return "not raised"

    assert run_now(op(), loop) == "handled inside"


def test_in_process_clients_work_inside_a_running_loop() -> None:
    """An engine may call the in-process client from async code: its loop stays the
    running one, before and after, even when an operation had to be finished."""

    async def engine() -> None:
        outer = asyncio.get_running_loop()
        client = SGLangLocal()
        client._service.backend = Pausing(client._store, "timer")  # waits on a timer
        client.initialize(0, 4)
        assert client.reserve_and_allocate_page_indices(0, [("a", None)]) == [(False, 0)]
        assert asyncio.get_running_loop() is outer

    asyncio.run(engine())


def test_a_walk_that_pauses_in_steps_finishes_in_process() -> None:
    """``MemoryBackend.v_exists`` pauses between steps of a large batch (bare yields)."""
    from kvmeta.store.disk.memory import V_EXISTS_STEP

    client = VLLMLocal()
    client.initialize(0, 4)
    keys = [f"k{i}" for i in range(V_EXISTS_STEP + 5)]
    client._service.limits = client._service.limits.__class__(max_keys=len(keys))
    assert client.batch_key_exists(keys) == [False] * len(keys)


def test_one_lock_per_operation_across_threads() -> None:
    client = SGLangLocal()
    client.initialize(0, 4096)
    pages: list[int] = []

    def work(t: int) -> None:
        for i in range(50):
            ((_, page),) = client.reserve_and_allocate_page_indices(0, [(f"{t}-{i}", None)])
            client.confirm_write(0, [(f"{t}-{i}", page)], [])
            pages.append(page)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pages) == len(set(pages)) == 400
    assert all(client.exists(0, [f"{t}-{i}" for i in range(50)]) == [True] * 50 for t in range(8))
