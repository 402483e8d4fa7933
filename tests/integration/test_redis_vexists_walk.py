"""vLLM completeness on Redis runs as a walk of short scripts, never one long one.

A script holds the whole Redis while it runs. ``v_exists`` walks the required ranks in spans,
one script each, each doing at most ``V_EXISTS_CHUNK`` key lookups and carrying only the keys
still complete; a batch the first rank lacks is one script. A registry that changes between
two scripts of one walk makes the next one refuse, and the walk starts again from a fresh read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

import kvmeta.store.redis.vexists as redis_vexists
from kvmeta._types import PoolId
from kvmeta.store.redis.backend import POOL_PARTS, RedisBackend

CHUNK = 64


async def _store(b: RedisBackend, rank: int, keys: list[str]) -> None:
    pool = PoolId("v", rank, "")
    pages = [page for _, page in await b.reserve(pool, keys)]
    assert await b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0


class _Scripts:
    """The ``v_exists`` scripts a backend runs: keys asked, ranks spanned, the reply's code."""

    def __init__(self, b: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.after_first: Any = None
        real = b._run

        async def counting(script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
            reply = await real(script, keys, args)
            if script == "v_exists":
                span = (len(keys) - 2) // len(POOL_PARTS)
                self.calls.append((len(msgspec.json.decode(args[0])), span, int(reply[0])))
                if len(self.calls) == 1 and self.after_first is not None:
                    await self.after_first()
            return reply

        monkeypatch.setattr(b, "_run", counting)

    def lookups(self) -> list[int]:
        return [keys * span for keys, span, _ in self.calls]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_vexists, "V_EXISTS_CHUNK", CHUNK)


def test_the_walk_runs_in_scripts_of_bounded_work(
    redis_url: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks, keys = 16, [f"block-{i}" for i in range(16)]
    half = [f"half-{i}" for i in range(100)]  # more than one script's worth on one rank

    async def scenario() -> None:
        b = RedisBackend(redis_url)
        await b.start()
        try:
            for rank in range(ranks):
                await b.v_register(rank, 256, None)
                await _store(b, rank, keys if rank >= 8 else keys + half)
            scripts = _Scripts(b, monkeypatch)
            assert await b.v_exists(keys + half) == [True] * 16 + [False] * 100
            # 116 keys on each of ranks 0..8 (two slices a rank), rank 8 lacks the 100
            # halves, then 16 on ranks 9..15 (four ranks a script): many scripts, none over
            # CHUNK lookups
            assert max(scripts.lookups()) <= CHUNK
            assert sum(scripts.lookups()) == 9 * 116 + 7 * 16
            assert [span for _, span, _ in scripts.calls[-2:]] == [4, 3]
            assert all(code == 0 for _, _, code in scripts.calls)

            scripts.calls.clear()
            assert await b.v_exists([f"unknown-{i}" for i in range(60)]) == [False] * 60
            assert scripts.calls == [(60, 1, 0)]  # one script: rank 0 has none of them
        finally:
            await b.close()

    asyncio.run(scenario())


def test_a_registry_changed_during_a_walk_restarts_it(
    redis_url: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks, keys = 8, [f"block-{i}" for i in range(32)]

    async def scenario() -> None:
        b, other = RedisBackend(redis_url), RedisBackend(redis_url)
        await b.start()
        await other.start()
        try:
            for rank in range(ranks):
                await b.v_register(rank, 64, None)
                await _store(b, rank, keys)
            assert await b.v_exists(keys) == [True] * 32
            scripts = _Scripts(b, monkeypatch)

            async def register_next() -> None:  # another server, between two scripts
                await other.v_register(ranks, 64, None)

            scripts.after_first = register_next
            assert await b.v_exists(keys) == [False] * 32  # rank 8 is required and empty
            codes = [code for _, _, code in scripts.calls]
            assert codes[0] == 0 and codes[1] == redis_vexists.V_STALE, codes
            assert (await b.v_index()).required == list(range(9))
        finally:
            await b.close()
            await other.close()

    asyncio.run(scenario())
