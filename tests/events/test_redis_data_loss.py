"""``kvmeta serve --backend redis://... --events`` when Valkey loses its data (restarted without
persistence, or flushed): the server's next request sees the new epoch, and its subscribers'
index, rebuilt from the stream in order, equals what Valkey holds: empty, then the new stores."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest

from tests.events.events_support import (
    Subscriber,
    complete,
    endpoints,
    hashed,
    metric,
    rebuild,
)
from tests.events.workloads import sglang_workload, vllm_workload
from tests.redis_support import RedisServer
from tests.support import ServerProcess

pytestmark = pytest.mark.slow

EVENTS = ("--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0")
HEADER = "X-Kvmeta-Epoch"


def _holds(redis: RedisServer) -> dict[str, set[str]]:
    """Every pool's stored keys as Valkey holds them, by the events' pool label."""
    out: dict[str, set[str]] = {}
    with redis.client() as client:
        for name in client.scan_iter(match="kvmeta:2:*:stored", count=1000):
            text = name.decode()
            tag = text[text.index("{") + 1 : text.index("}")]
            if tag == "v":  # kvmeta:2:{v}:rR:stored
                label = "v:" + text.split(":")[-2].removeprefix("r")
            else:  # kvmeta:2:{s:R:NS}:stored
                label = tag
            keys = {k.decode() for k in client.hkeys(name)}
            if keys:
                out[label] = keys
    return out


def _until_the_hold_ends(redis: RedisServer, timeout: float = 30.0) -> None:
    """Wait until Valkey's clock passes the hold the server set when it noticed the loss, so
    the pools the next workload creates hand out pages."""
    deadline = time.monotonic() + timeout
    with redis.client() as client:
        until = client.get("kvmeta:2:hold_until")
        assert until is not None, "no hold after the data loss"
        while True:
            secs, usecs = client.time()
            if secs + usecs / 1e6 > float(until):
                return
            assert time.monotonic() < deadline, "the hold did not end"
            time.sleep(0.05)


def _resynced(server: ServerProcess, count: int, timeout: float = 30.0) -> float:
    """Whole-server resyncs published, once there are ``count`` (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    done = metric(server, "kvmeta_events_resyncs_total")
    while done < count and time.monotonic() < deadline:
        time.sleep(0.05)
        done = metric(server, "kvmeta_events_resyncs_total")
    return done


def _reasons_after(messages: list[tuple[bytes, int, bytes]], seq: int) -> list[tuple[str, str]]:
    """(type, reason) of the AllBlocksCleared events in batches after ``seq``."""
    out = []
    for _, s, payload in messages:
        if s > seq:
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev["type"] == "AllBlocksCleared":
                    out.append((ev.get("pool", ""), ev.get("reason", "")))
    return out


@pytest.mark.parametrize("how", ["restart", "flushall"])
def test_subscribers_converge_after_valkey_loses_its_data(own_redis: RedisServer, how: str) -> None:
    # --reservation-ttl 1: the hold after the loss (new pools hand out no page) lasts 3 s.
    server = ServerProcess(
        "--backend", own_redis.url, "--read-lease", "0", "--reservation-ttl", "1", *EVENTS
    )
    server.start(timeout=60)
    sub: Subscriber | None = None
    try:
        ends = endpoints(server)
        sub = Subscriber(ends.pub, replay=ends.replay).start()
        sglang_workload(server.url, random.Random(3), 30)
        vllm_workload(server.url, random.Random(4), 12)
        sub.wait_for(server)
        messages = complete(sub.messages, ends.replay)
        before = _holds(own_redis)
        assert before and rebuild(messages) == hashed(before)
        last = messages[-1][1]
        old = server.post("/0/exists", {"keys": ["x"]}).headers[HEADER]

        if how == "restart":
            own_redis.stop()
            own_redis.start(port=own_redis.port)
        else:
            own_redis.flush()
        resp = server.post("/0/exists", {"keys": ["x"]})
        assert resp.status_code == 404 and resp.headers[HEADER] != old
        resyncs = _resynced(server, 2)  # the start's, then the data loss's
        sub.wait_for(server)
        messages = complete(sub.messages, ends.replay)
        assert _holds(own_redis) == {}
        assert rebuild(messages) == {}
        assert resyncs == 2
        assert _reasons_after(messages, last)[0] == ("", "data-lost")

        _until_the_hold_ends(own_redis)
        sglang_workload(server.url, random.Random(5), 20)
        sub.wait_for(server)
        messages = complete(sub.messages, ends.replay)
        after: dict[str, Any] = _holds(own_redis)
        assert after and rebuild(messages) == hashed(after)
    finally:
        if sub is not None:
            sub.close()
        server.stop()
