"""``kvmeta serve --backend redis://... --events``: a subscriber holds exactly what Redis holds,
from one server, from two servers on the same Redis, and after a ``kill -9`` and restart."""

from __future__ import annotations

import random
import signal
from typing import Any

import msgspec
import pytest
import zmq

from tests.events.events_support import (
    Subscriber,
    apply,
    complete,
    connect,
    endpoints,
    hashed,
    published,
    rebuild,
    resync_run,
)
from tests.events.workloads import sglang_state, sglang_workload, vllm_state, vllm_workload
from tests.support import ServerProcess

EVENTS = ("--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0")


def redis_events_server(redis_url: str) -> ServerProcess:
    return ServerProcess("--backend", redis_url, "--read-lease", "0", *EVENTS).start(timeout=60)


@pytest.mark.slow
def test_one_server_on_redis_subscriber_holds_exactly_the_pools(redis_url: str) -> None:
    server = redis_events_server(redis_url)
    try:
        ends = endpoints(server)
        sub = Subscriber(ends.pub).start()
        try:
            used, _ = sglang_workload(server.url, random.Random(11), 60)
            vused = vllm_workload(server.url, random.Random(5), 30)
            sub.wait_for(server)
        finally:
            sub.close()
        messages = complete(sub.messages, ends.replay)
        reasons = set()
        for _, _, payload in messages:
            for ev in msgspec.msgpack.decode(payload)[1]:
                if "reason" in ev:
                    reasons.add(ev["reason"])
        assert {"capacity", "delete", "clear"} <= reasons
        want = {**sglang_state(server.url, used), **vllm_state(server.url, vused)}
        assert rebuild(messages) == hashed(want)
    finally:
        server.stop()


class Arrived:
    """A subscriber per server, only to know when each server's stream is all in."""

    def __init__(self, servers: list[ServerProcess]) -> None:
        self.servers = servers
        self.subs = [Subscriber(endpoints(s).pub).start() for s in servers]
        self.before = [published(s) for s in servers]  # the resyncs, sent before we joined

    def wait(self) -> None:
        for sub, server, before in zip(self.subs, self.servers, self.before, strict=True):
            if published(server) > before:
                sub.wait_for(server)

    def close(self) -> None:
        for sub in self.subs:
            sub.close()


@pytest.mark.slow
def test_two_servers_on_one_redis_union_of_their_streams_is_the_store(redis_url: str) -> None:
    a = redis_events_server(redis_url)
    b = redis_events_server(redis_url)
    try:
        url_a, url_b = a.url, b.url
        ends = [endpoints(a), endpoints(b)]
        # One SUB socket connected to both, so the arrival order is the one a router sees.
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 0)
        connect(sock, *(e.pub for e in ends))
        counts = Arrived([a, b])
        arrived: list[bytes] = []

        def drain() -> None:
            counts.wait()
            while sock.poll(500):
                arrived.append(sock.recv_multipart()[2])

        rng = random.Random(13)
        # Mixed, one server after the other: each phase is in the subscriber before the next
        # server touches the same keys (see docs/events.md about changes to one key made
        # through two servers at once).
        used: dict[str, list[str]] = {"kv": [], "mamba": []}
        for phase in range(4):
            url = (url_a, url_b)[phase % 2]
            more, _ = sglang_workload(url, rng, 20)
            for ns, keys in more.items():
                used[ns] += keys
            drain()
        vused = vllm_workload(url_b, random.Random(2), 20)
        drain()
        vused += vllm_workload(url_a, random.Random(4), 20)
        drain()
        counts.close()
        sock.close(0)
        ctx.term()
        # Both servers' resyncs came before the workload (each covers all of Redis: empty).
        state: dict[str, set[Any]] = {}
        for payload in arrived:
            apply(state, payload)
        got = {pool: hashes for pool, hashes in state.items() if hashes}
        want = {**sglang_state(url_a, used), **vllm_state(url_a, vused)}
        assert want == {**sglang_state(url_b, used), **vllm_state(url_b, vused)}
        assert got == hashed(want)
        # Each server published only its own changes: neither stream alone is the store.
        assert all(published(s) > 1 for s in (a, b))
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
def test_kill_9_on_redis_restarted_server_resyncs_to_redis_state(redis_url: str) -> None:
    a = redis_events_server(redis_url)
    b = redis_events_server(redis_url)
    try:
        used, _ = sglang_workload(a.url, random.Random(17), 30)
        vused = vllm_workload(b.url, random.Random(19), 20)
        a.stop(signal.SIGKILL)
        # Changes through the other server while the first is down.
        more, _ = sglang_workload(b.url, random.Random(23), 10)
        for ns, keys in more.items():
            used[ns] += keys
        a = ServerProcess(*a.args).start(timeout=60)
        ends = endpoints(a)
        resync = resync_run(a)
        assert all(topic.decode() == ends.topic for topic, _, _ in resync)
        want = {**sglang_state(b.url, used), **vllm_state(b.url, vused)}
        assert want  # not a test of an empty store
        assert rebuild(resync) == hashed(want)
    finally:
        a.stop()
        b.stop()
