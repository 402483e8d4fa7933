"""kvmeta follows the primary the Sentinels promoted even when the old one comes back.

A primary that stalls (a long fork, a VM pause, a starved CPU on a loaded machine) for longer
than the Sentinels' ``down-after-milliseconds`` is failed over while it is still alive. When
it resumes it still says ``ROLE master`` and answers every command; the Sentinels demote it
only seconds later (they wait for it to look stable first). A kvmeta server whose connections
to it never broke sees no error, only writes that its replicas no longer acknowledge
(``--min-replicas-ack``): it must take that as the sign to ask the Sentinels again and move,
not answer 503 until the old primary is demoted.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kvmeta._types import PoolId
from kvmeta.store.redis.backend import RedisBackend, pool_keys
from tests.redis_support import Node, SentinelGroup

pytestmark = pytest.mark.slow
POOL = PoolId("s", 0, "follow")
SWITCH_TIMEOUT = 60.0  # the Sentinels' failover; generous: the machine has 2 shared cores


def _wait(what: str, done: object, timeout: float = SWITCH_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if done():  # type: ignore[operator]
                return
        except Exception:  # a node still resyncing, a Sentinel mid-failover
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _majority_names(group: SentinelGroup, node: Node) -> bool:
    named = 0
    for sentinel in group.sentinels:
        _host, port = sentinel.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", group.NAME)
        named += int(port) == node.port
    return named * 2 > len(group.sentinels)


@pytest.mark.timeout(300)
def test_a_stalled_primary_that_returns_is_left_for_the_promoted_one() -> None:
    with SentinelGroup(replicas=2).start() as group:
        old = group.primary()

        async def go() -> None:
            backend = RedisBackend(
                group.url, failover_timeout=30.0, min_replicas_ack=1, replica_ack_timeout=1.0
            )
            await backend.start()
            try:
                await backend.initialize(POOL, 64)
                [(_, page)] = await backend.reserve(POOL, ["before"])
                assert await backend.confirm(POOL, [("before", page)], []) == 0
                epoch = backend.epoch

                assert old.proc is not None
                old.proc.send_signal(signal.SIGSTOP)  # the stall: no error reaches kvmeta
                try:
                    new = await asyncio.to_thread(_promoted, group, old)
                finally:
                    old.proc.send_signal(signal.SIGCONT)
                assert old.call("ROLE")[0] == "master"  # back, and still says primary

                began = time.monotonic()
                [(stored, page)] = await backend.reserve(POOL, ["after"])
                assert not stored
                assert await backend.confirm(POOL, [("after", page)], []) == 0
                took = time.monotonic() - began
                # The write is on the primary the Sentinels promoted (with its replica), not
                # on the old one that kvmeta was connected to.
                stored_hash = pool_keys(POOL)[1]
                assert new.call("HGET", stored_hash, "after") == str(page)
                assert await backend.get(POOL, ["before", "after"]) == [
                    int(new.call("HGET", stored_hash, "before")),
                    page,
                ]
                assert backend.epoch == epoch
                print(f"\nwrite after the stalled primary returned: {took:.2f}s")
            finally:
                await backend.close()

        asyncio.run(go())


def _promoted(group: SentinelGroup, old: Node) -> Node:
    """Wait until a majority of the Sentinels names another primary and the other replica
    follows it; return that primary."""
    found: list[Node] = []

    def switched() -> bool:
        new = group.primary()
        if new is old or not _majority_names(group, new):
            return False
        others = [n for n in group.data if n is not old and n is not new]
        if not all(int(n.call("ROLE")[2]) == new.port for n in others):
            return False
        found[:] = [new]
        return True

    _wait("the Sentinels to promote a replica of the stalled primary", switched)
    return found[0]


@pytest.mark.timeout(300)
def test_a_failover_is_followed_without_waiting_for_a_request_to_fail() -> None:
    """The Sentinels' ``+switch-master`` announcements make kvmeta ask them again at once: with
    no request in flight, its primary moves to the promoted node (the old one is alive, so no
    connection error would ever have told it)."""
    with SentinelGroup(replicas=1).start() as group:
        old = group.primary()

        async def go() -> float:
            backend = RedisBackend(group.url, failover_timeout=30.0)
            await backend.start()
            topo = backend._topo
            try:
                assert topo is not None and topo.primaries()[0].port == old.port
                await backend.initialize(POOL, 64)
                group.sentinels[0].call("SENTINEL", "FAILOVER", group.NAME)
                new = await asyncio.to_thread(_promoted, group, old)
                switched = time.monotonic()
                while topo.primaries() == [] or topo.primaries()[0].port != new.port:
                    assert time.monotonic() - switched < 10.0, "kvmeta did not follow"
                    await asyncio.sleep(0.01)
                followed = time.monotonic() - switched
                # and it answers from there
                assert await backend.exists(POOL, ["x"]) == [False]
                return followed
            finally:
                await backend.close()

        print(f"\nfollowed {asyncio.run(go()):.2f}s after a majority of Sentinels switched")
