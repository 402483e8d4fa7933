"""The Redis backend on a real Redis Cluster (3 primaries + 3 replicas): slot routing, MOVED
and ASK while a slot migrates, a primary failing over to its replica, the epoch."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable, NotInitialized
from kvmeta.store.redis.backend import RedisBackend, pool_keys
from tests.redis_support import Node, RedisCluster, RedisServer, free_port

pytestmark = pytest.mark.slow


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _pools_on_each_primary(cluster: RedisCluster) -> list[PoolId]:
    """One SGLang pool per primary (namespaces chosen by their slot)."""
    found: dict[int, PoolId] = {}
    for i in range(200):
        pid = PoolId("s", 0, f"ns{i}")
        found.setdefault(cluster.primary_for(pool_keys(pid)[0]).port, pid)
        if len(found) == 3:
            return list(found.values())
    raise AssertionError("pools did not spread")


async def _cycle(backend: RedisBackend, pid: PoolId, key: str) -> int:
    await backend.initialize(pid, 16)
    [(stored, page)] = await backend.reserve(pid, [key])
    assert not stored
    assert await backend.confirm(pid, [(key, page)], []) == 0
    assert await backend.get(pid, [key]) == [page]
    return page


def test_pools_on_every_shard_answer_through_one_backend(redis_cluster: RedisCluster) -> None:
    cluster = redis_cluster
    cluster.flush()

    async def go() -> None:
        backend = RedisBackend(cluster.url)
        await backend.start()
        try:
            assert backend.describe.startswith("redis cluster at ")
            pools = _pools_on_each_primary(cluster)
            for pid in pools:
                await _cycle(backend, pid, "k")
                assert await backend.exists(pid, ["k", "x"]) == [True, False]
            await backend.v_register(0, 8, 1)
            assert (await backend.v_index()).ranks == (0,)
            listed = await backend.pools()
            assert set(pools) <= set(listed) and PoolId("v", 0, "") in listed
            stats = {st.pool: st for st in await backend.stats()}
            assert all(stats[pid].stored == 1 for pid in pools)
            assert (await backend.check()).problems == []
            assert await backend.ready()
        finally:
            await backend.close()

    _run(go())
    # Each primary holds only its own pools' keys (no cross-slot keys anywhere).
    owners = {cluster.primary_for(pool_keys(p)[0]).port for p in _pools_on_each_primary(cluster)}
    assert len(owners) == 3


def test_a_plain_url_naming_a_cluster_node_switches_to_cluster_mode(
    redis_cluster: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = redis_cluster
    cluster.flush()

    async def go() -> None:
        backend = RedisBackend(f"redis://{cluster.primaries[0].addr}")
        await backend.start()
        try:
            assert backend.describe.startswith("redis cluster at ")
            for pid in _pools_on_each_primary(cluster):
                await _cycle(backend, pid, "k")
        finally:
            await backend.close()

    with caplog.at_level("WARNING"):
        _run(go())
    assert "is a Redis Cluster node (cluster_enabled:1): using Cluster mode" in caplog.text

    async def db_one() -> None:
        with pytest.raises(Exception, match="has only database 0"):
            await RedisBackend(f"redis://{cluster.primaries[0].addr}/1").start()

    _run(db_one())


def _primaries(cluster: RedisCluster) -> list[Node]:
    return cluster.current_primaries()


def _start_migration(cluster: RedisCluster, slot: int, src: Node, dst: Node) -> None:
    """Mark ``slot`` MIGRATING on ``src``/IMPORTING on ``dst`` and move its keys, as a
    resharding tool does, but do not hand the slot over yet (``_finish_migration``)."""
    src_id, dst_id = src.call("CLUSTER", "MYID"), dst.call("CLUSTER", "MYID")
    dst.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    names = src.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if names:
        src.client().execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *names)


def _finish_migration(cluster: RedisCluster, slot: int, dst: Node) -> None:
    dst_id = dst.call("CLUSTER", "MYID")
    for n in _primaries(cluster):
        n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_ask_then_tryagain_then_moved_during_a_slot_migration(redis_cluster: RedisCluster) -> None:
    cluster = redis_cluster
    """A pool's slot migrates while it is used: its keys already on the target, the slot not
    yet handed over (the source answers ASK, the target TRYAGAIN for a multi-key script whose
    keys are not all there), then handed over (MOVED): the calls wait it out and answer
    right."""
    cluster.flush()
    pid = _pools_on_each_primary(cluster)[0]
    slot = key_slot(pool_keys(pid)[0].encode())
    src = cluster.primary_for(pool_keys(pid)[0])
    dst = next(n for n in _primaries(cluster) if n.port != src.port)

    async def go() -> None:
        backend = RedisBackend(cluster.url)
        await backend.start()
        try:
            page = await _cycle(backend, pid, "a")
            _start_migration(cluster, slot, src, dst)
            loop = asyncio.get_running_loop()
            finish = loop.run_in_executor(
                None, lambda: (time.sleep(1.0), _finish_migration(cluster, slot, dst))
            )
            assert await backend.get(pid, ["a"]) == [page]
            await finish
            assert await backend.get(pid, ["a"]) == [page]
            [(stored, page_b)] = await backend.reserve(pid, ["b"])
            assert not stored and page_b != page
            assert await backend.confirm(pid, [("b", page_b)], []) == 0
            assert await backend.exists(pid, ["a", "b", "c"]) == [True, True, False]
            assert (await backend.check()).problems == []
        finally:
            await backend.close()

    _run(go())
    assert cluster.primary_for(pool_keys(pid)[0]).port == dst.port


def test_ask_on_a_single_key_command_is_followed(redis_cluster: RedisCluster) -> None:
    cluster = redis_cluster
    """The pool registry key moved to the target while its slot is still MIGRATING: SADD and
    SMEMBERS get ASK and are sent with ASKING to the target."""
    cluster.flush()
    pools = _pools_on_each_primary(cluster)

    async def go() -> None:
        backend = RedisBackend(cluster.url)
        await backend.start()
        try:
            await backend.initialize(pools[0], 8)
            registry = "kvmeta:2:pools"
            slot = key_slot(registry.encode())
            src = cluster.primary_for(registry)
            dst = next(n for n in _primaries(cluster) if n.port != src.port)
            _start_migration(cluster, slot, src, dst)
            try:
                await backend.initialize(pools[1], 8)
                assert set(pools[:2]) <= set(await backend.pools())
                with dst.client().pipeline(transaction=False) as pipe:
                    members = pipe.execute_command("ASKING").smembers(registry).execute()[1]
                assert len(members) == 2  # written on the target, through ASK
            finally:
                _finish_migration(cluster, slot, dst)
            assert set(pools[:2]) <= set(await backend.pools())
        finally:
            await backend.close()

    _run(go())


@pytest.fixture(scope="module")
def doomed_cluster() -> Iterator[RedisCluster]:
    """A cluster of this module's own: its primaries get failed over and killed."""
    with RedisCluster().start() as made:
        yield made


def _replica_of(cluster: RedisCluster, primary: Node) -> Node:
    for node in cluster.nodes:
        if node.alive() and node.port != primary.port:
            info = node.info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == primary.port:
                return node
    raise AssertionError(f"no replica of {primary}")


def _has_library(node: Node) -> bool:
    return bool(node.call("FUNCTION", "LIST", "LIBRARYNAME", "kvmeta"))


def test_a_clean_failover_keeps_answers_code_and_epoch(doomed_cluster: RedisCluster) -> None:
    """CLUSTER FAILOVER on a replica: the pool's slot moves to it (MOVED), its data and
    kvmeta's functions came with replication, and the epoch stays (no data was lost)."""
    cluster = doomed_cluster
    cluster.flush()
    pid = _pools_on_each_primary(cluster)[0]

    async def go() -> None:
        backend = RedisBackend(cluster.url)
        await backend.start()
        try:
            page = await _cycle(backend, pid, "a")
            epoch = backend.epoch
            old = cluster.primary_for(pool_keys(pid)[0])
            replica = _replica_of(cluster, old)
            cluster._wait_replicated(old)
            replica.call("CLUSTER", "FAILOVER")
            _wait(lambda: replica.call("ROLE")[0] == "master", "the replica to take over")
            assert _has_library(replica)  # replicated with the data, not installed by us
            assert await backend.get(pid, ["a"]) == [page]
            assert await backend.confirm(pid, [("a", page)], []) == 0
            assert backend.epoch == epoch
        finally:
            await backend.close()

    _run(go())


def test_a_killed_primary_is_replaced_within_the_failover_timeout(
    doomed_cluster: RedisCluster,
) -> None:
    """kill -9 of the primary serving a pool: calls wait for the automatic promotion
    (cluster-node-timeout 1000 ms) and then answer from the promoted replica."""
    cluster = doomed_cluster
    cluster.wait_ok()
    cluster.flush()
    pid = _pools_on_each_primary(cluster)[1]

    async def go() -> float:
        backend = RedisBackend(cluster.url, failover_timeout=30.0)
        await backend.start()
        try:
            page = await _cycle(backend, pid, "a")
            epoch = backend.epoch
            victim = cluster.primary_for(pool_keys(pid)[0])
            cluster._wait_replicated(victim)
            victim.kill(signal.SIGKILL)
            began = time.monotonic()
            assert await backend.get(pid, ["a"]) == [page]
            took = time.monotonic() - began
            [(stored, page_b)] = await backend.reserve(pid, ["b"])
            assert not stored and page_b != page
            assert backend.epoch == epoch
            assert await backend.ready()
            return took
        finally:
            await backend.close()

    took = _run(go())
    print(f"cluster primary kill -9: answered again after {took:.2f}s")


def _sockets_to(ports: set[int]) -> list[str]:
    """This process's open TCP sockets whose peer is one of ``ports`` (from /proc: each fd's
    socket inode, looked up in /proc/net/tcp), so a test sees what ``close()`` left open."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(remote.rsplit(":", 1)[1], 16) in ports:
                found.append(f"{local}->{remote} state {fields[3]}")
    return found


def test_close_after_a_failover_leaves_no_connection_open(doomed_cluster: RedisCluster) -> None:
    """A failover under concurrent calls (MOVED starts a background slot-map refresh), some
    calls cancelled, then ``close()``: no socket to the cluster stays open and nothing is left
    for the garbage collector to warn about (no ResourceWarning: unclosed Connection)."""
    cluster = doomed_cluster
    cluster.wait_ok()
    cluster.flush()
    pids = _pools_on_each_primary(cluster)
    ports = {node.port for node in cluster.nodes}
    before = _sockets_to(ports)

    async def go() -> tuple[list[str], list[str]]:
        backend = RedisBackend(cluster.url, failover_timeout=30.0)
        await backend.start()
        assert backend._topo is not None
        nodes = backend._topo._nodes
        calls: list[asyncio.Future[Any]] = []
        try:
            for pid in pids:
                await _cycle(backend, pid, "a")
            old = cluster.primary_for(pool_keys(pids[0])[0])
            replica = _replica_of(cluster, old)
            cluster._wait_replicated(old)
            replica.call("CLUSTER", "FAILOVER")
            _wait(lambda: replica.call("ROLE")[0] == "master", "the replica to take over")
            # The pool's first call gets MOVED and starts a background refresh of the slot
            # map; close while it, and calls on every shard, are in flight.
            await backend.get(pids[0], ["a"])
            calls = [asyncio.ensure_future(backend.get(pid, ["a"])) for pid in pids * 8]
            await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            for call in calls[1::2]:
                call.cancel()
        finally:
            nodes = dict(nodes)
            await backend.close()
        await asyncio.gather(*calls, return_exceptions=True)
        # Closed transports release their sockets on later loop turns: on a loaded machine that
        # can take a while, so wait up to 5 s for them rather than a fixed pause.
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not _sockets_to(ports):
                break
        # For the message if a socket is left: connections the nodes made that are still open,
        # and any task still running (which would hold them).
        still = [f"{n.addr} {link.transport!r}" for n in nodes.values() for link in n.links]
        me = asyncio.current_task()
        still += [repr(t) for t in asyncio.all_tasks() if t is not me]
        return _sockets_to(ports), still

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        left, still = _run(go())
        gc.collect()
    assert before == []
    assert left == [], f"open after close(); of the nodes' own connections: {still}"
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


async def _connections_gone(backend: RedisBackend) -> None:
    """Until the backend has seen every connection to its primaries close: its next call then
    opens a new one without any call failing (what an idle server sees after a restart)."""
    deadline = time.monotonic() + 30
    while any(node.links for node in backend._primaries()):
        assert time.monotonic() < deadline, "the backend did not notice its connections close"
        await asyncio.sleep(0.01)


def test_the_epoch_changes_when_redis_lost_its_data(redis_server: Any) -> None:
    """FLUSHALL then every connection dropped (what a restart without persistence looks
    like to kvmeta): the next call finds kvmeta:2:epoch gone and makes a new one, also when
    the backend noticed the dropped connections before that call (no call failed)."""

    async def go() -> None:
        redis_server.flush()
        backend = RedisBackend(redis_server.url)
        await backend.start()
        try:
            first = backend.epoch
            assert first and first.isalnum()
            await backend.initialize(PoolId("s", 0, "e"), 4)
            with redis_server.client() as client:
                client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            await _connections_gone(backend)
            await backend.initialize(PoolId("s", 0, "e"), 4)
            assert backend.epoch == first  # a reconnect alone changes nothing
            with redis_server.client() as client:
                client.flushall()
                client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            await _connections_gone(backend)
            await backend.initialize(PoolId("s", 0, "e"), 4)
            assert backend.epoch != first
        finally:
            await backend.close()

    _run(go())


def test_the_epoch_changes_on_a_flush_the_connections_survive(redis_server: Any) -> None:
    """FLUSHALL alone (the functions library stays, no connection drops): the first call that
    finds its pool gone reads the epoch again before it answers, and sees it changed."""

    async def go() -> None:
        redis_server.flush()
        backend = RedisBackend(redis_server.url)
        await backend.start()
        pool = PoolId("s", 0, "flushed")
        try:
            first = backend.epoch
            await _cycle(backend, pool, "a")
            redis_server.flush()
            with pytest.raises(NotInitialized):
                await backend.exists(pool, ["a"])
            second = backend.epoch
            assert second != first
            with redis_server.client() as client:
                assert client.get("kvmeta:2:epoch") == second.encode()
            redis_server.flush()
            with pytest.raises(NotInitialized):
                await backend.dump(pool, "", 10)
            assert backend.epoch not in (first, second)
        finally:
            await backend.close()

    _run(go())


def test_a_restart_keeps_the_epoch_with_an_aof_and_changes_it_without() -> None:
    """A whole-Redis restart: with appendonly on, the data and the epoch come back (nothing to
    re-initialise); with no persistence, Redis comes back empty and the epoch changes, so
    engines know to initialise their pools again."""
    pid = PoolId("s", 0, "restart")

    async def restart_and_look(server: RedisServer) -> tuple[str, str, list[int | None]]:
        backend = RedisBackend(server.url, failover_timeout=30.0)
        await backend.start()
        try:
            page = await _cycle(backend, pid, "a")
            before = backend.epoch
            port = server.port
            server.stop()
            server.start(port=port)
            await _connections_gone(backend)  # no call fails: the next one connects anew
            await backend.initialize(pid, 16)  # reconnects, then reads the epoch again
            return before, backend.epoch, [page, *await backend.get(pid, ["a"])]
        finally:
            await backend.close()

    durable = RedisServer("--appendonly", "yes", "--appendfsync", "always")
    try:
        before, after, (page, got) = _run(restart_and_look(durable.start()))
    finally:
        durable.close()
    assert after == before and got == page
    volatile = RedisServer()
    try:
        before, after, (page, got) = _run(restart_and_look(volatile.start()))
    finally:
        volatile.close()
    assert after != before and got is None


def test_unreachable_cluster_seeds_stop_start_up_naming_each() -> None:
    ports = [free_port(), free_port()]
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    async def go() -> None:
        with pytest.raises(BackendUnavailable) as info:
            await RedisBackend(url).start()
        text = str(info.value)
        assert "no Cluster node answered CLUSTER SLOTS" in text
        assert all(f"127.0.0.1:{p}:" in text for p in ports), text

    _run(go())


def test_concurrent_refreshes_share_one_round_of_questions(redis_cluster: RedisCluster) -> None:
    """Calls failing at once each ask for a refresh: one round of ``CLUSTER SLOTS`` answers
    them all (each round asks every known node; one per caller would multiply that), and a
    ``MOVED`` during that round joins it rather than starting another."""

    async def go() -> tuple[int, int]:
        backend = RedisBackend(redis_cluster.url)
        await backend.start()
        topo = backend._topo
        assert topo is not None
        rounds = 0
        one_round = topo._refresh

        async def counted(raise_errors: bool = False) -> None:
            nonlocal rounds
            rounds += 1
            await one_round(raise_errors)

        topo._refresh = counted  # type: ignore[method-assign]
        try:
            first = asyncio.ensure_future(topo.refresh())
            await asyncio.sleep(0)
            node = topo.primaries()[0]
            topo.moved(0, node.host, node.port)  # a MOVED while the round runs
            await asyncio.gather(first, *(topo.refresh() for _ in range(20)))
            during = rounds
            await topo.refresh()  # a failure after the round ended: a round of its own
            return during, rounds
        finally:
            await backend.close()

    assert _run(go()) == (1, 2)
