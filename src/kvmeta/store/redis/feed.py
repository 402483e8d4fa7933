"""The Redis backend's change feed in Redis's order, though replies arrive in any order.

Two requests of one server on one pool run on two connections: Redis executes them in one order
and the replies may be read in the other (a confirm of X, then a delete of X, read as "removed
X" then "stored X", which leaves a subscriber believing X is stored). So each script that
reports changes bumps its pool's change counter in the same atomic script and returns it
(``_lib.lua`` ``feed``), and this module delivers a pool's changes in counter order.

When may a change with counter ``c`` go? Only this server's own calls still in flight can
bring an earlier one (counter values taken by other kvmeta servers are theirs to report, and
never awaited). A call sent after the reply carrying counter ``f`` arrived runs in Redis after
that call, so whatever counter it takes is above ``f``: each call remembers the highest counter
of its pool seen when it started (its floor), and ``c`` goes once every call still in flight
on the pool has a floor of at least ``c``. A change is held at most until the calls that were
in flight when it arrived have answered (or failed): never behind calls started later.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from dataclasses import dataclass, field
from itertools import count

from kvmeta._types import PoolId
from kvmeta.store.changes import EVERY_POOL, LOST, UNSURE, Change, ChangeListener

__all__ = ["ChangeSequencer", "Ticket"]

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Ticket:
    """One change-reporting call in flight on ``pool``."""

    pool: PoolId
    floor: int  # the highest change counter of the pool seen when the call started
    done: bool = False


@dataclass(slots=True)
class _PoolFeed:
    floor: int = 0
    inflight: list[Ticket] = field(default_factory=list)
    pending: list[tuple[int, int, Change]] = field(default_factory=list)  # a heap by counter


class ChangeSequencer:
    """Per pool: the calls in flight and the changes held until they may go (see the module)."""

    def __init__(self) -> None:
        self.listener: ChangeListener | None = None
        self._pools: dict[PoolId, _PoolFeed] = {}
        self._order = count()  # ties (a counter seen twice: never, but heap entries must sort)

    def begin(self, pool: PoolId) -> Ticket:
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = _PoolFeed()
        ticket = Ticket(pool, state.floor)
        state.inflight.append(ticket)
        return ticket

    def end(
        self,
        ticket: Ticket,
        counter: int | None = None,
        change: Change | None = None,
        unsure: bool = False,
    ) -> None:
        """The call answered (``counter``/``change``: what it changed) or failed (None: nothing
        to announce, for a failed call may not have been made durable; ``unsure``: it may have
        changed the pool all the same, reported ``UNSURE`` after what is ready)."""
        state = self._pools[ticket.pool]
        state.inflight.remove(ticket)
        ticket.done = True
        if counter is not None:
            state.floor = max(state.floor, counter)
            if change is not None:
                heapq.heappush(state.pending, (counter, next(self._order), change))
        ready: list[Change] = []
        low = min((t.floor for t in state.inflight), default=None)
        while state.pending and (low is None or state.pending[0][0] <= low):
            ready.append(heapq.heappop(state.pending)[2])
        if not state.inflight and not state.pending:
            # Forgetting the floor is safe: a later call starting from 0 only holds more.
            del self._pools[ticket.pool]
        if unsure:
            ready.append(Change(ticket.pool, UNSURE, ()))
        if ready and self.listener is not None:
            try:
                self.listener(ready)
            except Exception:  # the request succeeded: a subscriber's bug must not fail it
                logger.exception(
                    "change listener failed on %d change(s) of %s", len(ready), ticket.pool
                )

    def lost(self) -> None:
        """Report that Redis lost its data (``LOST``): every pool may be gone. The changes
        still held are dropped: those of the lost data must not follow the listener's full
        read of the state, and those of the new data are in that read, which comes after."""
        for state in self._pools.values():
            state.pending.clear()
        if self.listener is None:
            return
        try:
            self.listener([Change(EVERY_POOL, LOST, ())])
        except Exception:  # the request succeeded: a subscriber's bug must not fail it
            logger.exception("change listener failed on the report that Redis lost its data")

    async def settle(self, pool: PoolId, counter: int) -> None:
        """``counter``: the pool's change counter, read from Redis just now. Return once every
        change of this server up to it has been delivered (or reported unsure): the calls sent
        from now on take higher counters (``counter`` becomes the pool's floor), so only the
        calls in flight now can hold one, and they end within the backend's retry bound."""
        state = self._pools.get(pool)
        if state is None:
            return
        state.floor = max(state.floor, counter)
        waiting = list(state.inflight)
        while not all(ticket.done for ticket in waiting):
            await asyncio.sleep(0.005)

    def held(self) -> int:
        """Changes waiting for an earlier call (tests, diagnostics)."""
        return sum(len(s.pending) for s in self._pools.values())
