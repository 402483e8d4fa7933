"""The HA topologies the other tests run on are what they claim to be.

A cluster with three primaries each with a linked replica, writes reaching replicas, and a
Sentinel group that really promotes the replica when the primary dies: the contract suite and
the failover drill mean nothing if the fixture under them is a single node in disguise.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.redis_support import RedisCluster, SentinelGroup


def test_cluster_has_three_primaries_each_with_a_linked_replica(
    redis_cluster: RedisCluster,
) -> None:
    roles = {n.port: n.call("ROLE") for n in redis_cluster.nodes}
    primaries = [p for p, r in roles.items() if r[0] == "master"]
    replicas = {p: int(r[2]) for p, r in roles.items() if r[0] == "slave"}
    assert len(primaries) == 3 and len(replicas) == 3
    assert sorted(replicas.values()) == sorted(primaries)  # one replica per primary
    for node in redis_cluster.nodes:
        assert node.cluster_state() == "ok"
        if node.port in replicas:
            assert node.info("replication")["master_link_status"] == "up"
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    assert len(redis_cluster.url.split(",")) == 3


def test_cluster_routes_keys_and_replicates_writes(
    redis_cluster_url: str, redis_cluster: RedisCluster
) -> None:
    owners = set()
    for tag in ("a", "b", "c", "d", "e", "f", "g", "h"):
        key = f"{{{tag}}}:x"
        primary = redis_cluster.primary_for(key)
        owners.add(primary.port)
        primary.call("SET", key, tag)
        assert primary.call("WAIT", 1, 10_000) == 1
        replica = next(
            n
            for n in redis_cluster.nodes
            if n.port != primary.port
            and n.call("ROLE")[0] == "slave"
            and int(n.call("ROLE")[2]) == primary.port
        )
        with replica.client() as client:
            client.execute_command("READONLY")
            assert client.get(key) == tag
    assert len(owners) > 1  # the keys land on more than one shard
    with redis_cluster.client() as client:
        assert client.get("{a}:x") == b"a"
    redis_cluster.flush()
    with redis_cluster.client() as client:
        assert client.get("{a}:x") is None


def test_sentinel_group_names_the_primary(
    redis_sentinel: SentinelGroup, redis_sentinel_url: str
) -> None:
    primary = redis_sentinel.primary()
    assert primary.call("ROLE")[0] == "master"
    replica = redis_sentinel.replica()
    assert replica.call("ROLE")[0] == "slave"
    primary.call("SET", "k", "v")
    assert primary.call("WAIT", 1, 10_000) == 1
    assert replica.call("GET", "k") == "v"
    assert redis_sentinel_url.endswith("/kvmeta")
    assert len(redis_sentinel_url.removeprefix("redis+sentinel://").split(",")) == 3


@pytest.mark.slow
def test_sentinels_promote_the_replica_when_the_primary_dies() -> None:
    with SentinelGroup().start() as group:  # a throwaway group: this one loses its primary
        old = group.primary()
        replica = group.replica()
        old.call("SET", "k", "v")
        old.call("WAIT", 1, 10_000)
        group.kill_primary(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if group.primary() is replica and replica.call("ROLE")[0] == "master":
                    break
            except Exception:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"replica not promoted within 30 s; logs under {group.root}")
        assert replica.call("GET", "k") == "v"
        replica.call("SET", "k2", "v2")  # writable now


@pytest.mark.slow
def test_cluster_replica_takes_over_a_killed_primary() -> None:
    with RedisCluster().start() as cluster:
        key = "{pool}:x"
        old = cluster.primary_for(key)
        old.call("SET", key, "v")
        old.call("WAIT", 1, 10_000)
        cluster.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                new = cluster.primary_for(key)
                if new is not old and new.call("ROLE")[0] == "master":
                    break
            except Exception:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"no replica took over within 30 s; logs under {cluster.root}")
        cluster.wait_ok()
        assert new.call("GET", key) == "v"
        assert len(cluster.current_primaries()) == 3
