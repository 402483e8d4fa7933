"""A Valkey that may evict kvmeta's keys: kvmeta refuses to start on it, ``/ready`` answers
503 once its policy turns evicting, and a pool whose keys were partly evicted (its ``meta``
key gone, the others left) is never initialised again over the pages its stored keys name."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.errors import NotInitialized, PoolDamaged
from kvmeta.store.redis.backend import RedisBackend, pool_keys
from tests.redis_support import RedisServer
from tests.support import Server, ServerProcess

pytestmark = pytest.mark.slow

TOKEN = "eviction-token"
Make = Callable[..., Server]


def _config(server: RedisServer, **settings: str) -> None:
    with server.client() as client:
        for name, value in settings.items():
            client.config_set(name.replace("_", "-"), value)


def _start_fails(tmp_path: Path, url: str) -> list[str]:
    """Start ``kvmeta serve --backend url``, expect exit 2; the lines of its error."""
    server = ServerProcess("--backend", url, cwd=tmp_path)
    try:
        with pytest.raises(RuntimeError) as info:
            server.start()
    finally:
        server.kill()
    assert server.proc is not None and server.proc.returncode == 2, str(info.value)
    return [ln for ln in server.log.splitlines() if "error" in ln.lower()]


@pytest.mark.parametrize(
    ("maxmemory", "policy"),
    [("8mb", "allkeys-lru"), ("8mb", "allkeys-random"), ("0", "allkeys-lfu")],
)
def test_start_is_refused_while_the_policy_evicts_any_key(
    own_redis: RedisServer, tmp_path: Path, maxmemory: str, policy: str
) -> None:
    """With maxmemory 0 too: an operator may set a limit later without restarting kvmeta,
    and the policy then evicts at once."""
    _config(own_redis, maxmemory=maxmemory, maxmemory_policy=policy)
    lines = _start_fails(tmp_path, own_redis.url)
    assert len(lines) == 1, lines
    (line,) = lines
    assert "Traceback" not in line
    assert f"maxmemory-policy {policy}" in line, line
    assert "CONFIG SET maxmemory-policy noeviction" in line and "volatile-" in line, line
    assert f"127.0.0.1:{own_redis.port}" in line, line


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru", "volatile-ttl"])
def test_start_is_allowed_when_the_policy_never_evicts_kvmeta_keys(
    own_redis: RedisServer, make_app: Make, policy: str
) -> None:
    _config(own_redis, maxmemory="8mb", maxmemory_policy=policy)
    server = make_app("--backend", own_redis.url)
    assert requests.get(server.url + "/ready", timeout=10).status_code == 200


def test_ready_turns_503_when_the_policy_turns_evicting(
    own_redis: RedisServer, make_app: Make
) -> None:
    server = make_app("--backend", own_redis.url, "--auth-token", TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(server.url + "/ready", timeout=10).status_code == 200
    _config(own_redis, maxmemory="8mb", maxmemory_policy="allkeys-lru")
    bare = requests.get(server.url + "/ready", timeout=10)
    assert (bare.status_code, bare.json()) == (503, {"ready": False})
    told = requests.get(server.url + "/ready", headers=auth, timeout=10)
    assert told.status_code == 503
    detail = told.json()["detail"]
    assert "maxmemory-policy allkeys-lru" in detail, detail
    assert "CONFIG SET maxmemory-policy noeviction" in detail, detail
    status = requests.get(server.url + "/v1/status", headers=auth, timeout=10).json()
    assert status["backend"]["ready"] is False
    assert "allkeys-lru" in status["backend"]["reason"]
    _config(own_redis, maxmemory_policy="volatile-lfu")
    assert requests.get(server.url + "/ready", timeout=10).status_code == 200


async def _until(done: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_new_connection_reads_the_policy_again(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """After a failover or a restart kvmeta's next call connects anew: the node's policy is
    read again then and logged, with nothing probing ``/ready``."""

    async def go() -> None:
        backend = RedisBackend(own_redis.url)
        await backend.start()
        try:
            pool = PoolId("s", 0, "kv")
            await backend.initialize(pool, 4)
            _config(own_redis, maxmemory="8mb", maxmemory_policy="allkeys-lfu")
            with own_redis.client() as client:
                client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            (node,) = backend._primaries()
            await _until(lambda: not node.links)  # the backend saw its connection go
            await backend.exists(pool, ["a"])  # served over a new connection
            await _until(lambda: bool(backend._eviction.problems))
            _config(own_redis, maxmemory_policy="noeviction")
            assert await backend.ready()
            assert not backend._eviction.problems
        finally:
            await backend.close()

    with caplog.at_level("WARNING", logger="kvmeta.store.redis.backend"):
        _run(go())
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "maxmemory-policy allkeys-lfu" in errors[0], errors
    assert "/ready answers 503" in errors[0]
    assert any("no longer evicts" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- partial eviction


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _snapshot(server: RedisServer, pool: PoolId) -> dict[str, Any]:
    """Every key of ``pool`` and what it holds (hashes as dicts, the rest by type)."""
    out: dict[str, Any] = {}
    with server.client() as client:
        for key in pool_keys(pool):
            kind = client.type(key).decode()
            if kind == "hash":
                out[key] = client.hgetall(key)
            elif kind == "zset":
                out[key] = client.zrange(key, 0, -1, withscores=True)
            elif kind == "list":
                out[key] = client.lrange(key, 0, -1)
    return out


@pytest.mark.parametrize("dialect", ["s", "v"])
def test_initialize_refuses_a_pool_whose_meta_key_is_gone(
    own_redis: RedisServer, dialect: str
) -> None:
    """What an ``allkeys-*`` policy does to a pool, key by key: its meta goes, its stored keys
    stay. Re-initialising used to start the allocator at page 0 under those keys; now it is
    refused, every call answers "not initialized", and no page is handed out twice."""
    pool = PoolId(dialect, 0, "" if dialect == "v" else "kv")
    keys = [f"{i:064x}" for i in range(6)]

    async def go() -> None:
        backend = RedisBackend(own_redis.url)
        await backend.start()
        try:
            await backend.initialize(pool, 8)
            reserved = await backend.reserve(pool, keys)
            pages = [page for _, page in reserved]
            assert sorted(pages) == list(range(6))
            assert await backend.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0
            with own_redis.client() as client:
                assert client.delete(pool_keys(pool)[0]) == 1  # the meta key, evicted
            before = _snapshot(own_redis, pool)
            for _ in range(3):  # engines retry: every try refused, nothing changed
                with pytest.raises(PoolDamaged) as info:
                    await backend.initialize(pool, 8)
                with pytest.raises(NotInitialized):
                    await backend.reserve(pool, ["new-key"])
                with pytest.raises(NotInitialized):
                    await backend.get(pool, keys[:1])
            assert _snapshot(own_redis, pool) == before
            text = str(info.value)
            assert info.value.status == 503
            assert "stored" in text and "pk" in text and "meta" in text, text
            assert "evicted or deleted" in text, text
            assert "maxmemory-policy noeviction" in text, text
            prefix = pool_keys(pool)[0].removesuffix("meta")
            assert f"--pattern '{prefix}*'" in text, text
            # The fix the message names: the leftover keys deleted, the pool starts afresh.
            with own_redis.client() as client:
                client.unlink(*client.keys(prefix.replace("{", "\\{") + "*"))
            created = await backend.initialize(pool, 8)
            assert created.created
        finally:
            await backend.close()

    _run(go())


def test_a_partly_evicted_pool_answers_503_over_http(
    own_redis: RedisServer, make_app: Make
) -> None:
    server = make_app("--backend", own_redis.url)
    assert server.post("/0/initialize", {"num_pages": 4}).ok
    reserve = "/0/reserve_and_allocate_page_indices"
    [[_, page]] = server.post(reserve, {"keys": [["a", None]]}).json()["indices"]
    assert server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", page]]}).ok
    with own_redis.client() as client:
        client.delete(pool_keys(PoolId("s", 0, "kv"))[0])
    resp = server.post("/0/initialize", {"num_pages": 4})
    assert resp.status_code == 503, resp.text
    assert "evicted or deleted" in resp.json()["detail"]
    assert server.post(reserve, {"keys": [["b", None]]}).status_code == 404
