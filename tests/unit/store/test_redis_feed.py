"""``store.redis.feed.ChangeSequencer``: a pool's changes in Redis's counter order whatever
order the replies arrive in; a call that failed after it was sent reported ``UNSURE``; and
``settle``, which a pool's resync waits on, so that no older change follows it."""

from __future__ import annotations

import asyncio

from kvmeta._types import PoolId
from kvmeta.store.changes import REMOVED, STORED, UNSURE, Change
from kvmeta.store.redis.feed import ChangeSequencer

POOL = PoolId("s", 0, "kv")
OTHER = PoolId("s", 1, "kv")


def _seq() -> tuple[ChangeSequencer, list[Change]]:
    seen: list[Change] = []
    feed = ChangeSequencer()
    feed.listener = seen.extend
    return feed, seen


def stored(*keys: str) -> Change:
    return Change(POOL, STORED, keys)


def test_replies_out_of_order_are_delivered_in_counter_order() -> None:
    feed, seen = _seq()
    first, second = feed.begin(POOL), feed.begin(POOL)
    feed.end(second, 2, Change(POOL, REMOVED, ("x",), "delete"))
    assert seen == [] and feed.held() == 1  # counter 1 may still come from ``first``
    feed.end(first, 1, stored("x"))
    assert [c.kind for c in seen] == [STORED, REMOVED]
    assert feed.held() == 0


def test_a_failed_call_may_have_changed_the_pool_and_says_so_after_what_is_ready() -> None:
    feed, seen = _seq()
    first, second = feed.begin(POOL), feed.begin(POOL)
    feed.end(second, 1, stored("a"))
    assert seen == []
    feed.end(first, unsure=True)  # its counter is unknown: what ``second`` did goes first
    assert seen == [stored("a"), Change(POOL, UNSURE, ())]
    other = feed.begin(OTHER)
    feed.end(other)  # a failure known to have changed nothing reports nothing
    assert seen == [stored("a"), Change(POOL, UNSURE, ())]


def test_settle_waits_for_the_calls_in_flight_not_for_later_ones() -> None:
    async def go() -> list[str]:
        feed, seen = _seq()
        order: list[str] = []
        early = feed.begin(POOL)
        # ``late`` took counter 3 and answered; counters 1-2 may still come from ``early``.
        late = feed.begin(POOL)
        feed.end(late, 3, stored("c"))
        assert seen == []
        settled = asyncio.ensure_future(feed.settle(POOL, 3))
        await asyncio.sleep(0.02)
        assert not settled.done()
        after = feed.begin(POOL)  # sent after the counter was read: its floor is 3
        assert after.floor == 3
        feed.end(early, 2, stored("b"))
        order.append("early ended")
        await asyncio.wait_for(settled, 1)
        order.append("settled")
        assert seen == [stored("b"), stored("c")]  # everything up to 3, in order
        assert not after.done  # settle did not wait for it
        feed.end(after, 4, stored("d"))
        assert seen[-1] == stored("d")
        return order

    assert asyncio.run(go()) == ["early ended", "settled"]


def test_settle_on_an_idle_pool_returns_at_once() -> None:
    feed, _ = _seq()
    asyncio.run(asyncio.wait_for(feed.settle(POOL, 10), 1))
