"""Find the current primary of a Sentinel group: the address a majority of the configured
Sentinels agree on.

A majority (more than half of those configured, not of those that answered) keeps a Sentinel
that is partitioned with an old primary from sending writes there alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmeta.errors import BackendUnavailable
from kvmeta.store.redis_url import RedisTarget

__all__ = ["resolve_primary"]

logger = logging.getLogger("kvmeta.store.redis")


async def _ask(target: RedisTarget, host: str, port: int, timeout: float) -> tuple[str, int] | str:
    """One Sentinel's answer: the primary's address, or a short text saying why there is none."""
    client = aioredis.Redis(
        host=host,
        port=port,
        password=target.sentinel_password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        ssl=target.url.startswith("rediss+"),
    )
    try:
        reply = await asyncio.wait_for(
            client.execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.master
            ),
            timeout * 2,
        )
    except (RedisError, OSError, asyncio.TimeoutError) as exc:
        return f"error {exc or type(exc).__name__}"
    finally:
        await client.aclose()
    if not reply:
        return f"does not know {target.master!r}"
    addr, port_text = (x.decode() if isinstance(x, bytes) else str(x) for x in reply[:2])
    return addr, int(port_text)


async def resolve_primary(target: RedisTarget, *, timeout: float) -> tuple[str, int]:
    """Ask every Sentinel at once and return the address more than half of them name.

    Raises:
        BackendUnavailable: no majority; the message says what each Sentinel answered.
    """
    answers = await asyncio.gather(*(_ask(target, h, p, timeout) for h, p in target.hosts))
    votes = Counter(a for a in answers if isinstance(a, tuple))
    said = ", ".join(
        f"{h}:{p} says {a[0]}:{a[1]}" if isinstance(a, tuple) else f"{h}:{p} {a}"
        for (h, p), a in zip(target.hosts, answers, strict=True)
    )
    logger.debug("Sentinels for %r: %s", target.master, said)
    if votes:
        addr, count = votes.most_common(1)[0]
        if count * 2 > len(target.hosts):
            return addr
    raise BackendUnavailable(
        f"no majority of the {len(target.hosts)} Sentinels names a primary for "
        f"{target.master!r} ({said})"
    )
