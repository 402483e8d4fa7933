"""vLLM completeness on Redis (``RedisBackend.v_exists``): the walk over the required ranks,
in scripts of bounded work.

A Lua script holds the whole Redis while it runs, every pool of every tenant. A completeness
check costs a lookup per key on each required rank that has all the ranks before it had, so
one script for a batch of 65,536 keys on 2,048 ranks would hold Redis for seconds. The walk
goes instead in spans of ranks, one ``v_exists.lua`` script each, carrying only the keys still
complete so far: each script does at most ``V_EXISTS_CHUNK`` lookups (a single rank with more
candidate keys than that is asked in slices), and the walk ends at the first span after which
no key is left. A batch of unknown keys, or of blocks the first rank lacks, is one script.

Every script checks that the registry still requires the ranks the walk started from (the
plan), and refuses, changing nothing, when not: the walk starts again from a fresh read. The
answer thus follows one registry state, and a key reported complete was stored on each
required rank when that rank's script ran.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmeta.store.base import VIndex

__all__ = ["V_EXISTS_CHUNK", "V_STALE", "VPlan", "walk"]

# Key lookups per script: a few milliseconds of Redis (HMGET fields, the candidates' JSON and
# a registry check of one SMISMEMBER per 1,000 required ranks); more on a busy machine.
V_EXISTS_CHUNK = 1 << 12
# v_exists.lua's answer when the registry no longer requires the plan's ranks.
V_STALE = 9

_encode = msgspec.json.Encoder().encode

# One script run: (KEYS, ARGV) -> the decoded reply.
Run = Callable[[tuple[str, ...], list[Any]], Awaitable[list[Any]]]


@dataclass(frozen=True)
class VPlan:
    """The required ranks a walk starts from: ``0..count-1``, the world size when ``pinned``,
    else the contiguous run of registered ranks. ``count`` 0: nothing is complete (no rank 0,
    or a rank the world size requires is not registered)."""

    count: int
    pinned: bool

    @classmethod
    def of(cls, index: VIndex) -> VPlan:
        if index.missing or not index.required:
            return cls(0, index.world_size is not None)
        return cls(len(index.required), index.world_size is not None)


async def walk(
    plan: VPlan,
    keys: list[str],
    registry: tuple[str, str],
    rank_keys: Callable[[int], tuple[str, ...]],
    run: Run,
) -> list[bool] | None:
    """Which of ``keys`` every rank of ``plan`` has STORED; None when a script found the
    registry changed (nothing was changed: read it again and walk again)."""
    assert plan.count > 0
    left = keys
    at = list(range(len(keys)))  # where each key of ``left`` is in ``keys``
    rank = 0
    flags = [str(plan.count), "1" if plan.pinned else "0"]
    while left and rank < plan.count:
        span = max(1, min(plan.count - rank, V_EXISTS_CHUNK // len(left)))
        names = list(registry)
        for r in range(rank, rank + span):
            names += rank_keys(r)
        kept: list[int] = []
        for start in range(0, len(left), V_EXISTS_CHUNK):
            part = left if len(left) <= V_EXISTS_CHUNK else left[start : start + V_EXISTS_CHUNK]
            reply = await run(tuple(names), [_encode(part), *flags])
            if int(reply[0]) == V_STALE:
                return None
            kept += (start + int(i) - 1 for i in reply[1:])
        left = [left[i] for i in kept]
        at = [at[i] for i in kept]
        rank += span
    out = [False] * len(keys)
    for i in at:
        out[i] = True
    return out
