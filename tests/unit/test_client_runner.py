"""``client._local.run_now``: the in-process clients drive the server's async ``Service``
without an event loop. The in-memory backend's pauses (bare yields) are stepped over; a
backend that waits on a future is refused with an internal error that says so, in a thread
with or without its own running loop, and that loop stays untouched."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmeta._types import PoolId
from kvmeta.client._local import run_now
from kvmeta.client.sglang import Hf3fsLocalMetadataClient as SGLangLocal
from kvmeta.client.vllm import Hf3fsLocalMetadataClient as VLLMLocal
from kvmeta.errors import KvmetaError, NotInitialized
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import V_EXISTS_STEP, MemoryStore

S0 = PoolId("s", 0, "kv")


class Pausing(LocalBackend):
    """Pauses inside its operations the ways a backend can: bare yields (``asyncio.sleep(0)``,
    as the in-memory backend between chunks of a long walk), a timer or a worker thread."""

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
            await asyncio.to_thread(lambda: 7)

    async def reserve(
        self, pool: PoolId, keys: list[str], parent: str | None = None
    ) -> list[tuple[bool, int]]:
        await self._pause()
        out = await super().reserve(pool, keys, parent)
        await self._pause()
        return out

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        await self._pause()
        return await super().get(pool, keys)  # raises NotInitialized after the pause


def test_an_operation_that_pauses_runs_to_its_end() -> None:
    service = Service(Pausing(MemoryStore(), "bare"))
    run_now(service.initialize(S0, 4))
    assert run_now(service.reserve(S0, ["a", "b"])) == [(False, 0), (False, 1)]
    # an error raised after a pause comes out as itself, with its message
    with pytest.raises(NotInitialized, match="^Rank 5 namespace .kv. not initialized"):
        run_now(service.get(PoolId("s", 5, "kv"), ["a"]))


@pytest.mark.parametrize("wait", ["timer", "thread"])
def test_an_operation_that_waits_is_an_internal_error(wait: str) -> None:
    service = Service(Pausing(MemoryStore(), wait))
    run_now(service.initialize(S0, 4))
    with pytest.raises(KvmetaError, match="^internal error: .*reserve needed an event loop"):
        run_now(service.reserve(S0, ["a"]))
    assert asyncio._get_running_loop() is None


def test_inside_a_running_loop_the_callers_loop_is_left_alone() -> None:
    """An engine may call the in-process client from async code: bare pauses still finish,
    and a wait on the engine's own loop (which this call blocks) is refused, not hung."""

    async def engine() -> None:
        outer = asyncio.get_running_loop()
        client = SGLangLocal()
        client._service.backend = Pausing(client._store, "bare")
        client.initialize(0, 4)
        assert client.reserve_and_allocate_page_indices(0, [("a", None)]) == [(False, 0)]
        client._service.backend = Pausing(client._store, "timer")
        with pytest.raises(KvmetaError, match="needed to wait for <Future pending"):
            client.reserve_and_allocate_page_indices(0, [("b", None)])
        assert asyncio.get_running_loop() is outer
        await asyncio.sleep(0.002)  # the loop still runs: the abandoned timer fires harmlessly

    asyncio.run(engine())


def test_a_walk_that_pauses_in_steps_finishes_in_process() -> None:
    """``LocalBackend.v_exists`` pauses (bare yields) between steps of a large batch."""
    keys = [f"k{i}" for i in range(V_EXISTS_STEP + 5)]
    client = VLLMLocal(limits=RequestLimits(max_keys=len(keys)))
    client.initialize(0, 4)
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
