"""The write-ahead rule under a slow disk: no reply hands out a page whose previous key's removal
is not durable, whichever way the reply gets the page (issue: a second writer joining a
reservation used to get an evicted page at once)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from kvmeta._types import PoolId
from kvmeta.core import check_pool
from kvmeta.store.disk.local import LocalBackend
from tests.unit.store.durable_support import S0, cycle, open_backend


@asynccontextmanager
async def stalled_disk(b: LocalBackend) -> AsyncIterator[None]:
    """The journal's fsync helper stopped (SIGSTOP): nothing becomes durable until the end."""
    journal = b.journal
    assert journal is not None and journal._helper is not None
    pid = journal._helper.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def replied(coro: object, within: float = 0.3) -> bool:
    """Whether the awaitable finished within ``within`` seconds (it keeps running if not)."""
    task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
    done, _ = await asyncio.wait({task}, timeout=within)
    return bool(done)


def _full_pool_of_one(tmp_path: Path, keys: list[list[str]]) -> None:
    """Pool of one page holding "k1" durably; while the disk stalls, a first writer's reserve
    evicts k1 in place; then each batch in ``keys`` is reserved by another writer."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.05)
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 1)
            await cycle(b, S0, ["k1"])
            await j.wait(j.seq)
            async with stalled_disk(b):
                first = asyncio.ensure_future(b.reserve(S0, ["new"]))
                await asyncio.sleep(0.1)
                assert not first.done()  # evicted k1 in place: waits for the removal
                removal = j.seq
                others = [asyncio.ensure_future(b.reserve(S0, batch)) for batch in keys]
                await asyncio.sleep(0.3)
                for task in others:
                    # Before the fix a joining writer got page 0 here, at once.
                    assert not task.done(), "a reply handed out page 0 before k1's removal"
                assert j.durable_seq < removal
            replies = await asyncio.gather(first, *others)
            assert j.durable_seq >= removal
            assert all(page == 0 for out in replies for _, page in out)
            check_pool(b.store.pool(S0))
        finally:
            await b.close()

    asyncio.run(main())


def test_second_writer_of_the_same_key_waits_for_the_eviction(tmp_path: Path) -> None:
    _full_pool_of_one(tmp_path, [["new"]])


def test_retry_with_a_duplicate_key_waits_for_the_eviction(tmp_path: Path) -> None:
    _full_pool_of_one(tmp_path, [["new", "new"], ["new"]])


def test_page_released_and_handed_out_again_waits_for_the_eviction(tmp_path: Path) -> None:
    """The evicted page goes back to FREE (its reservation runs out) before the removal of its
    old key is durable; the next writer to get it must wait too."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.05)
        j = b.journal
        assert j is not None
        now = [0.0]
        b.store.clock = lambda: now[0]
        try:
            await b.initialize(S0, 1)
            await cycle(b, S0, ["k1"])
            await j.wait(j.seq)
            async with stalled_disk(b):
                first = asyncio.ensure_future(b.reserve(S0, ["new"]))
                await asyncio.sleep(0.1)
                removal = j.seq
                now[0] += b.store.reservation_ttl + 1  # the first writer's lease runs out
                assert not await replied(b.reserve(S0, ["other"]))
                assert j.durable_seq < removal
            assert await first == [(False, 0)]
        finally:
            await b.close()

    asyncio.run(main())


def test_a_removed_rank_registered_again_waits_for_its_removal_and_no_other_rank_does(
    tmp_path: Path,
) -> None:
    """A rank registered again reuses its page file: not before its removal is durable. The
    wait is that rank's own: registering another rank reuses no page of the removed one."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.05)
        try:
            await b.v_register(0, 8, None)
            await b.v_register(1, 8, None)
            async with stalled_disk(b):
                removal = asyncio.ensure_future(b.v_remove(1))
                await asyncio.sleep(0.05)
                assert not removal.done()  # replies once durable
                again = asyncio.ensure_future(b.v_register(1, 8, None))
                other = asyncio.ensure_future(b.v_register(2, 8, None))
                await asyncio.sleep(0.2)
                assert PoolId("v", 1, "") not in b.store.pools, "registered before the removal"
                assert PoolId("v", 2, "") in b.store.pools, "another rank waited for it"
            await asyncio.gather(removal, again, other)
            assert PoolId("v", 1, "") in b.store.pools
        finally:
            await b.close()

    asyncio.run(main())
