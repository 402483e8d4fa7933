"""The epoch of a server on Redis when Valkey loses its data: the first request after the loss
carries the new epoch (``X-Kvmeta-Epoch``, ``/health``, ``/v1/pools``), and kvmeta's clients
with ``auto_reinitialize`` re-create their pools from that reply. Valkey restarted without
persistence (the server's connections close while it is idle, so no call fails) and a
FLUSHALL that keeps every connection and the functions library."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import requests

from kvmeta import sglang, vllm
from tests.redis_support import RedisServer
from tests.support import Server

pytestmark = pytest.mark.slow

HEADER = "X-Kvmeta-Epoch"
Make = Callable[..., Server]


def _epoch(server: Server) -> str:
    health = requests.get(server.url + "/health", timeout=30)
    return str(health.json()["epoch"])


@pytest.mark.parametrize("how", ["restart", "flushall"])
def test_the_next_request_carries_the_new_epoch(
    own_redis: RedisServer, make_app: Make, how: str
) -> None:
    server = make_app("--backend", own_redis.url)
    assert server.post("/0/initialize", {"num_pages": 8}).ok
    before = server.post("/0/exists", {"keys": ["a"]}).headers[HEADER]
    assert before == _epoch(server)
    own_redis.lose_data(how)
    resp = server.post("/0/exists", {"keys": ["a"]})
    assert resp.status_code == 404, resp.text  # the pool went with the data
    after = resp.headers[HEADER]
    assert after != before
    assert _epoch(server) == after
    pools = requests.get(server.url + "/v1/pools", timeout=30).json()
    assert pools["server"]["epoch"] == after
    with own_redis.client() as client:
        assert client.get("kvmeta:2:epoch") == after.encode()
    assert f"Redis epoch changed from {before} to {after}" in server.log


@pytest.mark.parametrize("how", ["restart", "flushall"])
def test_clients_re_create_their_pools_after_valkey_lost_its_data(
    own_redis: RedisServer, make_app: Make, how: str
) -> None:
    server = make_app("--backend", own_redis.url)
    s_client = sglang.Hf3fsGlobalMetadataClient(server.url, auto_reinitialize=True)
    v_client = vllm.Hf3fsGlobalMetadataClient(server.url, auto_reinitialize=True)
    try:
        s_client.initialize(0, 8, "kv")
        s_client.initialize(0, 4, "mamba")
        v_client.initialize(0, 8, world_size=1)
        [(_, page)] = s_client.reserve_and_allocate_page_indices(0, [("a", None)], "kv")
        s_client.confirm_write(0, [("a", page)], [], "kv")
        old = s_client.epoch
        own_redis.lose_data(how)
        # vLLM's exists answers [False] whether its rank is registered or not: only the epoch
        # of that reply tells the client its registration is gone.
        assert v_client.batch_key_exists(["a"]) == [False]
        assert v_client.epoch != old
        registry = requests.get(server.url + "/v1/vllm", timeout=30).json()
        assert registry["ranks"] == [0] and registry["world_size"] == 1
        assert s_client.exists(0, ["a"], "kv") == [False]
        assert s_client.epoch == v_client.epoch
        pools = requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]
        shapes = sorted((p["dialect"], p["namespace"], p["num_pages"]) for p in pools)
        assert shapes == [("s", "kv", 8), ("s", "mamba", 4), ("v", "", 8)], shapes
    finally:
        s_client.close()
        v_client.close()


def test_a_readiness_probe_notices_a_flush_nobody_asked_about(
    own_redis: RedisServer, make_app: Make
) -> None:
    """With no request finding a pool gone, the next ``/ready`` probe reads the epoch again:
    a FLUSHALL breaks no connection and keeps kvmeta's code."""
    server = make_app("--backend", own_redis.url)
    before = _epoch(server)
    own_redis.flush()
    ready = requests.get(server.url + "/ready", timeout=30)
    assert ready.status_code == 200
    assert ready.headers[HEADER] != before
    assert _epoch(server) == ready.headers[HEADER]
