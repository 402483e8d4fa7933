"""The Redis backend's epoch: the ``kvmeta:2:epoch`` key, created when absent (a new or emptied
Redis) and read again whenever Redis may have lost its data, before the next reply.

Nothing in the protocol says "Redis lost its data": a restart without persistence closes the
connections (an idle server just opens new ones, and no call fails), kvmeta's functions library
is gone with the data (installed again on the first miss, no call fails either), and a
``FLUSHALL`` breaks nothing at all. So each of these is a *doubt* (``doubt``): a new link to a
node, kvmeta's code missing on a node, a call retried across a failure or moved to another
primary, a pool or vLLM rank Redis says is gone, a ``/ready`` probe. The backend's next reply
waits (``settle``) for a read of the key that began after the doubt; concurrent calls share one
read, so none answers from the new data under the old epoch while another is reading it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvmeta.store.epoch import new_epoch

__all__ = ["EPOCH_COMMANDS", "RedisEpoch"]

logger = logging.getLogger("kvmeta.store.redis.backend")

# The commands a read sends (``hold``: the script that sets the hold after a loss): a call of
# these settles no doubt (it is the read).
EPOCH_COMMANDS = ("SET", "GET", "hold")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _seen(read: asyncio.Future[None]) -> None:
    """Retrieve a shared read's failure: its callers may all have given up on it."""
    if not read.cancelled():
        read.exception()


class RedisEpoch:
    """The epoch as last read, and the doubts no read has covered yet.

    ``doubts`` counts doubts, ``read_for`` the doubts the latest finished read began after: the
    backend's call path compares the two (two attribute reads: it runs on every call) and
    ``settle``s when they differ.
    """

    def __init__(
        self,
        key: str,
        command: Callable[..., Awaitable[Any]],
        lost: Callable[[], None],
        hold_key: str = "",
        hold: Callable[[], Awaitable[float]] | None = None,
    ) -> None:
        """``command(key, *args)`` sends one command routed by ``key`` (the backend's retrying
        call); ``lost()`` is told when a read finds another epoch than the last one.

        ``hold_key``: the key holding the end of the hold after a data loss (``_lib.lua``
        ``hold_after_loss``), read with every read of the epoch into ``hold_until``. ``hold()``
        sets it when a read finds the data lost, before the new epoch is created or reported:
        writers and readers of the lost pools may still use their pages, and new pools start
        at page 0. None: no hold is set (a backend whose test clock is not Valkey's)."""
        self.key = key
        self._command = command
        self._lost = lost
        self._hold_key = hold_key
        self._hold = hold
        # The hold's end (seconds of Valkey's time) as last read; 0: none.
        self.hold_until = 0.0
        self.value = ""
        self.doubts = 0
        self.read_for = 0
        self._read: asyncio.Future[None] | None = None

    def doubt(self) -> None:
        """Redis may have lost its data since the last read: the next reply waits for one."""
        self.doubts += 1

    async def start(self) -> None:
        """The first read (start-up): it covers the doubts so far (start-up's own links)."""
        doubts = self.doubts
        await self.read()
        self.read_for = doubts

    async def settle(self) -> None:
        """Read again until a read covers every doubt so far (at most twice: a doubt raised
        during a read, such as by the read's own new link, gets one more read)."""
        for _ in range(2):
            if self.doubts == self.read_for:
                return
            read = self._read
            if read is None or read.done():
                read = self._read = asyncio.ensure_future(self._read_for(self.doubts))
                read.add_done_callback(_seen)
            await asyncio.shield(read)

    async def recheck(self) -> None:
        """``doubt`` then ``settle``: Redis said something kvmeta made is gone."""
        self.doubt()
        await self.settle()

    async def _read_for(self, doubts: int) -> None:
        await self.read()
        self.read_for = max(self.read_for, doubts)

    async def read(self) -> None:
        """Read the key; create it (SET NX: another server may create it first) only when it
        is missing, so a read stays a read where writes are refused (a primary short of
        ``min-replicas-to-write`` still answers lookups).

        Raises:
            BackendUnavailable: Redis did not answer within the backend's retry bound.
        """
        key = self.key
        value = await self._command(key, "GET", key)
        held = False
        if value is None:
            if self.value:  # known before: the data is lost (hold before a new epoch exists)
                held = await self._set_hold()
            await self._command(key, "SET", key, new_epoch(), "NX")
            value = await self._command(key, "GET", key)
        epoch = _text(value)
        old = self.value
        if old and epoch != old and not held:
            await self._set_hold()
        if self._hold_key:
            until = await self._command(self._hold_key, "GET", self._hold_key)
            self.hold_until = float(_text(until)) if until is not None else 0.0
        self.value = epoch
        if old and epoch != old:
            logger.warning(
                "Redis epoch changed from %s to %s: Redis lost its data (restart without "
                "persistence, flush, or a failover to a replica without it); engines "
                "re-initialise their pools",
                old,
                epoch,
            )
            self._lost()

    async def _set_hold(self) -> bool:
        """Set the hold after a data loss (``hold``), and log it; False if there is none."""
        if self._hold is None:
            return False
        until = await self._hold()
        logger.warning(
            "Redis lost its data: pools created until Valkey time %.3f hand out no page "
            "(engines may still use pages of the lost pools); reserves of new keys get -1 "
            "until then",
            until,
        )
        return True
