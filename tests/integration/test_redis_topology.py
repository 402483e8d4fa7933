"""The Redis backend on a real Redis Cluster (3 primaries + 3 replicas): slot routing, MOVED
and ASK while a slot migrates, a primary failing over to its replica, the epoch."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable
from kvmeta.store.redis import RedisBackend, pool_keys
from tests.redis_support import RedisServer

pytestmark = pytest.mark.slow


def _wait(check: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or check}")


class Cluster:
    """3 primaries (slots split evenly) + one replica each, cluster-node-timeout 1000 ms."""

    def __init__(self) -> None:
        self.nodes = [
            RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "1000",
                "--cluster-config-file",
                "nodes.conf",
            ).start()
            for _ in range(6)
        ]
        try:
            self._join()
        except BaseException:
            self.close()
            raise

    def _join(self) -> None:
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for node, (lo, hi) in zip(self.nodes[:3], bounds, strict=True):
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        ids = [self.node_id(n) for n in self.nodes[:3]]
        _wait(
            lambda: all(
                len(n.client().execute_command("CLUSTER", "NODES").decode().splitlines()) == 6
                for n in self.nodes
            ),
            what="meet",
        )
        for replica, primary_id in zip(self.nodes[3:], ids, strict=True):
            _wait(
                lambda r=replica, p=primary_id: r.client().execute_command(
                    "CLUSTER", "REPLICATE", p
                ),
                what="replicate",
            )
        self.wait_ok()

    @staticmethod
    def node_id(node: RedisServer) -> str:
        return str(node.client().execute_command("CLUSTER", "MYID").decode())

    def wait_ok(self) -> None:
        def ok() -> bool:
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                if b"cluster_state:ok" not in n.client().execute_command("CLUSTER", "INFO"):
                    return False
            return True

        _wait(ok, what="cluster_state ok")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def owner(self, key: str) -> RedisServer:
        slot = key_slot(key.encode())
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            for lo, hi, primary, *_ in n.client().execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return next(x for x in self.nodes if x.port == int(primary[1]))
        raise AssertionError(f"no owner for slot {slot}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        pid = self.node_id(primary)
        for n in self.nodes:
            if n is primary or n.proc is None or n.proc.poll() is not None:
                continue
            info = n.client().info("replication")
            if info["role"] == "slave" and info["master_port"] == primary.port:
                return n
        raise AssertionError(f"no replica of {pid}")

    def flush(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                if n.client().info("replication")["role"] == "master":
                    n.client().flushall()

    def close(self) -> None:
        for n in self.nodes:
            n.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    try:
        yield made
    finally:
        made.close()


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _pools_on_each_primary(cluster: Cluster) -> list[PoolId]:
    """One SGLang pool per primary (namespaces chosen by their slot)."""
    found: dict[int, PoolId] = {}
    for i in range(200):
        pid = PoolId("s", 0, f"ns{i}")
        found.setdefault(cluster.owner(pool_keys(pid)[0]).port, pid)
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


def test_pools_on_every_shard_answer_through_one_backend(cluster: Cluster) -> None:
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
    owners = {cluster.owner(pool_keys(p)[0]).port for p in _pools_on_each_primary(cluster)}
    assert len(owners) == 3


def test_a_plain_url_naming_a_cluster_node_switches_to_cluster_mode(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.flush()

    async def go() -> None:
        backend = RedisBackend(cluster.nodes[0].url)
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
            await RedisBackend(cluster.nodes[0].url + "/1").start()

    _run(db_one())


def _primaries(cluster: Cluster) -> list[RedisServer]:
    return [
        n
        for n in cluster.nodes
        if n.proc is not None
        and n.proc.poll() is None
        and n.client().info("replication")["role"] == "master"
    ]


def _start_migration(cluster: Cluster, slot: int, src: RedisServer, dst: RedisServer) -> None:
    """Mark ``slot`` MIGRATING on ``src``/IMPORTING on ``dst`` and move its keys, as a
    resharding tool does, but do not hand the slot over yet (``_finish_migration``)."""
    src_id, dst_id = cluster.node_id(src), cluster.node_id(dst)
    dst.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    names = src.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if names:
        src.client().execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *names)


def _finish_migration(cluster: Cluster, slot: int, dst: RedisServer) -> None:
    dst_id = cluster.node_id(dst)
    for n in _primaries(cluster):
        n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_ask_then_tryagain_then_moved_during_a_slot_migration(cluster: Cluster) -> None:
    """A pool's slot migrates while it is used: its keys already on the target, the slot not
    yet handed over (the source answers ASK, the target TRYAGAIN for a multi-key script whose
    keys are not all there), then handed over (MOVED): the calls wait it out and answer
    right."""
    cluster.flush()
    pid = _pools_on_each_primary(cluster)[0]
    slot = key_slot(pool_keys(pid)[0].encode())
    src = cluster.owner(pool_keys(pid)[0])
    dst = next(n for n in _primaries(cluster) if n is not src)

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
    assert cluster.owner(pool_keys(pid)[0]) is dst


def test_ask_on_a_single_key_command_is_followed(cluster: Cluster) -> None:
    """The pool registry key moved to the target while its slot is still MIGRATING: SADD and
    SMEMBERS get ASK and are sent with ASKING to the target."""
    cluster.flush()
    pools = _pools_on_each_primary(cluster)

    async def go() -> None:
        backend = RedisBackend(cluster.url)
        await backend.start()
        try:
            await backend.initialize(pools[0], 8)
            registry = "kvmeta:pools"
            slot = key_slot(registry.encode())
            src = cluster.owner(registry)
            dst = next(n for n in _primaries(cluster) if n is not src)
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
