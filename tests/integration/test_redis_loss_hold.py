"""After Valkey loses its data, kvmeta hands out no page of a pool created anew until every
lease of the lost state has ended: the engines re-initialise their pools, each new allocator
starts at page 0, and a writer given page 0 before the loss may still be writing it.

Valkey restarted without persistence, and a FLUSHALL; a real ``kvmeta serve`` notices the loss
at its next readiness probe (a FLUSHALL breaks no connection: see test_redis_epoch.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import requests

from kvmeta.store.redis.backend import STEP_BOUND
from tests.redis_support import RedisServer
from tests.support import Server

pytestmark = pytest.mark.slow

Make = Callable[..., Server]


def _init(server: Server) -> None:
    resp = server.post("/0/initialize", {"num_pages": 4})
    assert resp.status_code == 204, resp.text


def _reserve(server: Server, key: str) -> list[object]:
    resp = server.post("/0/reserve_and_allocate_page_indices", {"keys": [[key, None]]})
    assert resp.status_code == 200, resp.text
    (got,) = resp.json()["indices"]
    return list(got)


def _refused(server: Server) -> int:
    pools = requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]
    (pool,) = pools
    return int(pool["counters"]["reservations_refused"])


def _notice(server: Server) -> None:
    assert requests.get(server.url + "/ready", timeout=30).status_code == 200


@pytest.mark.parametrize("how", ["restart", "flushall"])
def test_a_pool_created_after_a_data_loss_hands_out_no_page(
    own_redis: RedisServer, make_app: Make, how: str
) -> None:
    server = make_app("--backend", own_redis.url)
    _init(server)
    assert _reserve(server, "K") == [False, 0]  # K's writer may write page 0 for 300 s
    own_redis.lose_data(how)
    _notice(server)
    _init(server)  # the engine re-initialises its pool: a new allocator, from page 0
    assert _reserve(server, "L") == [False, -1]
    assert _refused(server) == 1
    assert "Redis lost its data: pools created until Valkey time" in server.log
    with own_redis.client() as client:
        assert client.exists("kvmeta:2:hold_until")


def test_the_hold_ends_after_the_longest_lease_and_the_clock_step_bound(
    own_redis: RedisServer, make_app: Make
) -> None:
    server = make_app("--backend", own_redis.url, "--reservation-ttl", "1", "--read-lease", "0")
    _init(server)
    assert _reserve(server, "K") == [False, 0]
    lost = time.monotonic()
    own_redis.flush()
    _notice(server)
    _init(server)
    got = _reserve(server, "L")
    while got == [False, -1]:
        assert time.monotonic() - lost < 60, "the hold did not end"
        got = _reserve(server, "L")
    held = time.monotonic() - lost
    assert got == [False, 0]
    assert held >= 1.0 + STEP_BOUND, held  # --reservation-ttl 1, plus the step bound
