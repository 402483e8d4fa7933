"""``kvmeta bench`` reaches a Redis with the server's own reading of the URL: credentials and
connection parameters in the query string reach the node as they do for ``kvmeta serve``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmeta.bench.redisstat import RedisCpu, primaries_of
from tests.redis_support import RedisServer


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    server = RedisServer(password="pw").start()
    try:
        yield server
    finally:
        server.close()


def test_a_password_in_the_query_reaches_the_node(locked: RedisServer) -> None:
    url = f"{locked.url}/0?password=pw"
    cpu = RedisCpu(url)
    try:
        assert cpu.nodes == [f"127.0.0.1:{locked.port}"]
        sample = cpu.sample()
        assert list(sample) == cpu.nodes and sample[cpu.nodes[0]] > 0
    finally:
        cpu.close()


def test_a_unix_socket_is_named_by_its_path(locked: RedisServer) -> None:
    path = locked.unix_url.removeprefix("unix://")
    assert primaries_of(f"{locked.unix_url}?db=0&password=pw") == [f"unix:{path}"]
    assert primaries_of(f"redis://:pw@127.0.0.1:{locked.port}/0") == [f"127.0.0.1:{locked.port}"]
