"""Whether a Redis/Valkey primary may evict kvmeta's keys on its own.

Redis evicts keys one at a time. A pool is eleven keys (``store.redis.POOL_PARTS``) that only
make sense together: with its ``meta`` key evicted and its ``stored``/``pk``/``lru`` keys left,
every call answers "not initialized", the engine initialises again, and a new allocator would
hand out pages that the stored keys still name (``initialize.lua`` refuses that now, but the
pool is lost to its engine until an operator clears it). So kvmeta runs only where no key of
its own can be evicted:

- ``noeviction``: writes fail (OOM, a 503 that changes nothing) instead of evicting;
- ``volatile-*``: only keys with a TTL are evicted, and kvmeta sets none.

The policy is checked whatever ``maxmemory`` is: with ``maxmemory 0`` nothing is evicted yet,
but an operator may set a limit at run time (``CONFIG SET maxmemory``) without restarting
kvmeta, and the policy then applies at once. Read from ``INFO memory`` rather than
``CONFIG GET``: managed Redis services often refuse ``CONFIG`` but answer ``INFO``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from kvmeta.errors import BackendUnavailable
from kvmeta.store.redis.nodes import Node

__all__ = ["SAFE_POLICIES", "EvictionWatch", "eviction_problem", "parse_info"]

logger = logging.getLogger("kvmeta.store.redis.backend")

# A policy is safe when it is one of these or starts with ``volatile-``.
SAFE_POLICIES = ("noeviction",)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_info(raw: Any) -> dict[str, str]:
    """An ``INFO`` reply read off a raw connection: ``field:value`` lines."""
    out = {}
    for line in _text(raw).splitlines():
        field, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            out[field] = value.strip()
    return out


def _safe(policy: str) -> bool:
    return policy in SAFE_POLICIES or policy.startswith("volatile-")


def _limit(info: dict[str, str]) -> str:
    human = info.get("maxmemory_human")
    raw = info.get("maxmemory", "")
    if raw in ("", "0"):
        return "maxmemory 0 (no limit yet: one set later at run time evicts at once)"
    return f"maxmemory {human or raw}"


async def eviction_problem(addr: str, call: Callable[..., Awaitable[Any]]) -> str | None:
    """Why the primary at ``addr`` may evict kvmeta's keys (None: it cannot). ``call`` sends
    one command to it (``Node.call``). A server whose ``INFO memory`` names no policy (not
    Redis's own INFO) is taken as it is: there is nothing to check.

    Raises:
        RedisError, OSError: the node did not answer (the caller maps these as for any call).
    """
    info = parse_info(await call("INFO", "memory"))
    policy = info.get("maxmemory_policy")
    if policy is None or _safe(policy):
        return None
    return (
        f"Redis primary {addr} has maxmemory-policy {policy} ({_limit(info)}): it evicts any "
        "key when memory runs short, one key at a time, which leaves kvmeta pools with part of "
        "their keys and can hand out pages still in use. Run CONFIG SET maxmemory-policy "
        "noeviction on every primary and replica (or a volatile-* policy: kvmeta sets no TTLs, "
        "so those never evict its keys), and put the same line in their config files"
    )


class EvictionWatch:
    """Each primary's policy as last seen, logged when it turns evicting or back. ``check``
    reads the primaries now (every ``/ready`` probe); ``linked`` has a node checked in the
    background once a link to it opens (a failover's new primary, a restarted node), so the
    log says so even where nothing probes ``/ready``."""

    def __init__(self, primaries: Callable[[], list[Node]]) -> None:
        self._primaries = primaries
        self.problems: dict[str, str] = {}  # primary address -> why it may evict
        self._due: dict[str, Node] = {}  # nodes with a new link, not checked since
        self._task: asyncio.Task[None] | None = None

    async def check(self, nodes: Sequence[Node]) -> list[str]:
        """The problems of ``nodes`` now (empty: none may evict kvmeta's keys).

        Raises:
            RedisError, OSError: a node did not answer.
        """
        found = await asyncio.gather(*(eviction_problem(node.addr, node.call) for node in nodes))
        for node, problem in zip(nodes, found, strict=True):
            self._note(node.addr, problem)
        return [problem for problem in found if problem]

    def linked(self, node: Node) -> None:
        """A link to ``node`` opened: read its policy soon (the caller's call goes on)."""
        self._due[node.addr] = node
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._due:
            addr, node = self._due.popitem()
            if node not in self._primaries():
                continue  # a seed or a demoted node: /ready reads the primaries themselves
            try:
                self._note(addr, await eviction_problem(addr, node.call))
            except (RedisError, OSError, asyncio.TimeoutError, BackendUnavailable) as exc:
                logger.debug("Redis %s: maxmemory-policy not read (%s)", addr, exc)

    def _note(self, addr: str, problem: str | None) -> None:
        if problem == self.problems.get(addr):
            return
        if problem is None:
            del self.problems[addr]
            logger.warning("Redis primary %s no longer evicts kvmeta's keys", addr)
            return
        self.problems[addr] = problem
        logger.error("%s; /ready answers 503 meanwhile", problem)

    async def close(self) -> None:
        task, self._task = self._task, None
        self._due.clear()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
