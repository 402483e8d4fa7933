"""Find the current primary of a Sentinel group: the address a majority of the configured
Sentinels agree on; and hear the moment it changes.

A majority (more than half of those configured, not of those that answered) keeps a Sentinel
that is partitioned with an old primary from sending writes there alone. ``watch_switches``
listens to every Sentinel's ``+switch-master`` announcements, so a failover is followed as
soon as the Sentinels make it rather than when the next request fails; what it hears only
starts a new round of questions (the majority still decides).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmeta.errors import BackendUnavailable
from kvmeta.store.redis.url import RESP, RedisTarget

__all__ = ["resolve_primary", "watch_switches"]

logger = logging.getLogger("kvmeta.store.redis.backend")


SWITCH_CHANNEL = "+switch-master"
_RESUBSCRIBE = 1.0  # seconds before a lost subscription to a Sentinel is made again


def _sentinel(target: RedisTarget, host: str, port: int, timeout: float | None) -> aioredis.Redis:
    return aioredis.Redis(
        host=host,
        port=port,
        password=target.sentinel_password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        ssl=target.url.startswith("rediss+"),
        protocol=RESP,
    )


async def _ask(target: RedisTarget, host: str, port: int, timeout: float) -> tuple[str, int] | str:
    """One Sentinel's answer: the primary's address, or a short text saying why there is none."""
    client = _sentinel(target, host, port, timeout)
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


async def watch_switches(
    target: RedisTarget, on_switch: Callable[[], Awaitable[None]], *, timeout: float
) -> None:
    """Until cancelled: await ``on_switch()`` whenever a configured Sentinel announces a new
    primary for ``target.master`` (each Sentinel announces its own switch, so the last of a
    majority's announcements comes once the majority agrees). A Sentinel that cannot be
    reached is subscribed to again every ``_RESUBSCRIBE`` seconds."""
    await asyncio.gather(*(_watch_one(target, h, p, on_switch, timeout) for h, p in target.hosts))


async def _watch_one(
    target: RedisTarget,
    host: str,
    port: int,
    on_switch: Callable[[], Awaitable[None]],
    timeout: float,
) -> None:
    while True:
        client = _sentinel(target, host, port, None)  # (a subscription waits as long as needed)
        pubsub = client.pubsub()
        try:
            await asyncio.wait_for(pubsub.subscribe(SWITCH_CHANNEL), timeout * 2)
            logger.debug("Sentinel %s:%d: subscribed to %s", host, port, SWITCH_CHANNEL)
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                data = message["data"]
                text = data.decode() if isinstance(data, bytes) else str(data)
                # "<name> <old ip> <old port> <new ip> <new port>"
                if text.split(" ", 1)[0] == target.master:
                    logger.info("Sentinel %s:%d announces %s", host, port, text)
                    await on_switch()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            logger.debug("Sentinel %s:%d subscription: %s", host, port, exc)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
            await client.aclose()
        await asyncio.sleep(_RESUBSCRIBE)
