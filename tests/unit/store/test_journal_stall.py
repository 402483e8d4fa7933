"""A journal fsync that never completes (the helper stopped with SIGSTOP, as a hung disk):
past ``--fsync-timeout`` the waiting change answers ``JournalStalled``, every later change is
refused without touching the state, reads keep working, and everything is back, and durable,
once the fsync completes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import JournalFailed, JournalStalled
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state

S1 = PoolId("s", 1, "kv")
BOUND = 0.3


async def _until(predicate: object, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("mode", ["batch", "always"])
def test_a_stalled_fsync_refuses_changes_until_it_completes(tmp_path: Path, mode: str) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync=mode, fsync_timeout=BOUND)
        try:
            await b.initialize(S0, 8)
            await cycle(b, S0, ["a", "b"])
            journal = b.journal
            assert journal is not None and journal._helper is not None
            assert journal.fsync_pending_seconds() == 0.0 and not journal.stalled
            helper = journal._helper.pid
            os.kill(helper, signal.SIGSTOP)
            try:
                # initialize waits for its fsync in both modes.
                with pytest.raises(JournalStalled, match="stopped answering") as info:
                    await asyncio.wait_for(b.initialize(S1, 4), timeout=20)
                assert info.value.status == 503 and isinstance(info.value, JournalFailed)
                assert str(tmp_path) in str(info.value) and journal.disk in str(info.value)
                assert journal.stalled and not await b.ready()
                assert b.failure is not None and "stopped answering" in b.failure
                stats = b.durability_stats()
                assert stats["fsync_stalled"] == 1.0 and stats["fsync_stalls"] == 1.0
                assert stats["fsync_pending_seconds"] >= BOUND
                assert stats["journal_failed"] == 0.0  # a stall is not a write failure
                assert S1 in b.store.pools  # applied in memory, as after a journal failure
                before = state(b)
                for change in (
                    b.initialize(PoolId("s", 2, "kv"), 8),
                    b.reserve(S0, ["c"]),
                    b.confirm(S0, [("c", 3)], []),
                    b.delete(S0, ["a"]),
                    b.clear(S0),
                    b.v_register(0, 8, 2),
                ):
                    with pytest.raises(JournalStalled):
                        await asyncio.wait_for(change, timeout=1)  # refused at once
                assert state(b) == before
                assert await b.exists(S0, ["a", "b"]) == [True, True]
            finally:
                os.kill(helper, signal.SIGCONT)
            await _until(lambda: not journal.stalled)
            assert await b.ready() and b.failure is None
            assert b.durability_stats()["fsync_stalled"] == 0.0
            assert (await b.initialize(S1, 4)).num_pages == 4  # the retry: idempotent
            await cycle(b, S0, ["c"])
            after = state(b)
        finally:
            await crash(b)
        b = await open_backend(tmp_path, fsync=mode)
        try:
            assert state(b) == after
            assert S1 in b.store.pools
        finally:
            await b.close()

    asyncio.run(main())
