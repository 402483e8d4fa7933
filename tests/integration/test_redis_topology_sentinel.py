"""The Redis backend behind Sentinel (primary found by a majority, ROLE checked, re-resolved on
failover) and ``--min-replicas-ack`` (a change is answered only once replicas have it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable, NotReplicated
from kvmeta.store.redis.backend import RedisBackend
from tests.redis_support import RedisServer, ReplicaPair, SentinelGroup, free_port
from tests.support import InProcessServer

pytestmark = pytest.mark.slow
POOL = PoolId("s", 0, "sent")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _cycle(backend: RedisBackend, key: str) -> int:
    await backend.initialize(POOL, 16)
    [(stored, page)] = await backend.reserve(POOL, [key])
    assert not stored
    assert await backend.confirm(POOL, [(key, page)], []) == 0
    assert await backend.get(POOL, [key]) == [page]
    return page


@pytest.fixture(scope="module")
def doomed_group() -> Iterator[SentinelGroup]:
    """A Sentinel group of this module's own: its primary gets killed."""
    with SentinelGroup().start() as made:
        yield made


def test_the_primary_a_majority_names_serves_and_a_kill_fails_over(
    doomed_group: SentinelGroup,
) -> None:
    group = doomed_group
    group.flush()

    async def go() -> float:
        backend = RedisBackend(group.url, failover_timeout=30.0)
        await backend.start()
        try:
            assert backend.describe.startswith("redis sentinel at ")
            page = await _cycle(backend, "a")
            epoch = backend.epoch
            old = group.primary()
            group._wait_replicated(old)
            group.kill_primary(signal.SIGKILL)
            began = time.monotonic()
            assert await backend.get(POOL, ["a"]) == [page]
            took = time.monotonic() - began
            new = group.primary()
            assert new.port != old.port and new.call("ROLE")[0] == "master"
            [(stored, page_b)] = await backend.reserve(POOL, ["b"])
            assert not stored and page_b != page
            assert backend.epoch == epoch  # the data came with replication
            assert await backend.ready()
            return took
        finally:
            await backend.close()

    took = _run(go())
    print(f"sentinel primary kill -9: answered again after {took:.2f}s")


def test_no_majority_of_sentinels_is_refused_naming_what_each_said(
    doomed_group: SentinelGroup,
) -> None:
    """One real Sentinel out of three configured is no majority: start-up names each."""
    real = doomed_group.sentinels[0].addr
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    url = f"redis+sentinel://{real},{','.join(dead)}/{SentinelGroup.NAME}"

    async def go() -> None:
        with pytest.raises(BackendUnavailable) as info:
            await RedisBackend(url).start()
        text = str(info.value)
        assert "no majority of the 3 Sentinels" in text
        assert f"{real} says 127.0.0.1:" in text
        assert all(f"{d} error" in text for d in dead), text

    _run(go())


def test_a_name_the_sentinels_do_not_monitor_is_named(doomed_group: SentinelGroup) -> None:
    url = doomed_group.url.rsplit("/", 1)[0] + "/nosuch"

    async def go() -> None:
        with pytest.raises(BackendUnavailable, match="does not know 'nosuch'"):
            await RedisBackend(url).start()

    _run(go())


def test_min_replicas_ack_waits_for_the_replica_and_refuses_without_it(
    replica_pair: ReplicaPair,
) -> None:
    """Backend level: with the replica up every change is acknowledged by it; with the replica
    frozen (SIGSTOP) a change answers NotReplicated, a read still answers."""

    async def go() -> None:
        backend = RedisBackend(
            replica_pair.primary.url, min_replicas_ack=1, replica_ack_timeout=0.3
        )
        await backend.start()
        try:
            await _cycle(backend, "a")
            os.kill(replica_pair.replica.pid, signal.SIGSTOP)
            with pytest.raises(NotReplicated):
                await backend.get(POOL, ["a"])  # a read lease is a change: it waits too
            assert await backend.exists(POOL, ["a"]) == [True]  # no change: no WAIT
            with pytest.raises(NotReplicated) as info:
                await backend.reserve(POOL, ["b"])
            text = str(info.value)
            assert (
                f"127.0.0.1:{replica_pair.primary.port}" in text or replica_pair.primary.url in text
            )
            assert "0 of 1 replica(s) acknowledged reserve within 0.3s" in text
            assert "safe to retry" in text
            os.kill(replica_pair.replica.pid, signal.SIGCONT)
            [(stored, page_b)] = await backend.reserve(POOL, ["b"])  # the retry joins
            assert not stored
            assert await backend.confirm(POOL, [("b", page_b)], []) == 0
        finally:
            await backend.close()

    _run(go())


def test_a_server_with_min_replicas_ack_answers_503_not_204_without_the_replica(
    replica_pair: ReplicaPair, tmp_path: Path
) -> None:
    server = InProcessServer(
        "--backend",
        replica_pair.primary.url,
        "--min-replicas-ack",
        "1",
        "--replica-ack-timeout",
        "0.3",
        cwd=tmp_path,
    ).start()
    try:
        base = server.url
        assert requests.post(base + "/0/initialize", json={"num_pages": 8}, timeout=10).ok
        body = {"keys": [["k", None]]}
        out = requests.post(base + "/0/reserve_and_allocate_page_indices", json=body, timeout=10)
        [[_hit, page]] = out.json()["indices"]
        os.kill(replica_pair.replica.pid, signal.SIGSTOP)
        confirm = {"written_keys_to_confirm": [["k", page]]}
        resp = requests.post(base + "/0/confirm_write", json=confirm, timeout=10)
        assert resp.status_code == 503, resp.text
        assert "0 of 1 replica(s) acknowledged confirm" in resp.text
        assert "may not survive a failover" in resp.text
        os.kill(replica_pair.replica.pid, signal.SIGCONT)
        resp = requests.post(base + "/0/confirm_write", json=confirm, timeout=10)
        assert resp.status_code == 204, resp.text
        got = requests.post(base + "/0/get_page_indices", json={"keys": ["k"]}, timeout=10)
        assert got.json()["indices"] == [page]
        assert "Redis acknowledgements: WAIT 1 300" in server.log
    finally:
        server.stop()


def test_a_primary_refusing_writes_without_replicas_is_retried_then_503() -> None:
    """min-replicas-to-write on the primary and no replica: NOREPLICAS is retried (a newly
    promoted primary may say it for a moment) until --failover-timeout, then 503 naming it."""
    server = RedisServer().start()

    async def go() -> None:
        backend = RedisBackend(server.url, failover_timeout=0.5)
        await backend.start()
        try:
            with server.client() as client:
                client.config_set("min-replicas-to-write", 1)
            with pytest.raises(BackendUnavailable) as info:
                await backend.initialize(POOL, 8)
            assert "NOREPLICAS" in str(info.value)
            assert "did not recover within --failover-timeout 0.5s" in str(info.value)
        finally:
            await backend.close()

    try:
        _run(go())
    finally:
        server.close()
