"""Redis calls whose outcome kvmeta cannot know: Redis stops answering after a script was sent
and runs it later, when kvmeta has already answered 503. The subscriber's view must still end
equal to what Redis holds (the pool is stated again, reason ``resync``), for a confirm, a
delete, and under concurrent load with Redis stopped twice."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import requests

from tests.events.events_support import Subscriber, endpoints, hashed, metric, rebuild
from tests.redis_support import RedisServer
from tests.support import ServerProcess, wait_until

pytestmark = pytest.mark.slow

POOL = "s:0:kv"


def key(i: int) -> str:
    return hashlib.sha256(f"doubt{i}".encode()).hexdigest()


class Setup:
    def __init__(self) -> None:
        self.redis = RedisServer().start()
        # A call fails after 2 s without an answer (the read timeout), is sent again and fails
        # again 2 s later, past --failover-timeout 1: a stop of 6 s leaves kvmeta no reply.
        self.server = ServerProcess(
            "--backend", self.redis.url, "--read-lease", "0", "--failover-timeout", "1",
            "--events", "tcp://127.0.0.1:0",
        ).start(timeout=60)  # fmt: skip
        self.url = self.server.url
        self.sub = Subscriber(endpoints(self.server).pub).start()
        resp = requests.post(f"{self.url}/0/initialize", json={"num_pages": 64}, timeout=30)
        assert resp.ok, resp.text

    def close(self) -> None:
        self.sub.close()
        self.server.stop()
        self.redis.close()

    def stopped(self, call: Callable[[], int], seconds: float = 6.0) -> int:
        """``call``'s status with Redis stopped until ``seconds`` after it was sent."""
        status: list[int] = []
        os.kill(self.redis.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=lambda: status.append(call()))
            thread.start()
            thread.join(seconds)
        finally:
            os.kill(self.redis.pid, signal.SIGCONT)
        thread.join(60)
        return status[0]

    def stored(self, keys: list[str]) -> dict[str, set[Any]]:
        resp = requests.post(f"{self.url}/0/exists", json={"keys": keys}, timeout=30)
        assert resp.status_code == 200, resp.text
        hits = resp.json()["exists"]
        return hashed({POOL: {k for k, hit in zip(keys, hits, strict=True) if hit}})

    def converges(self, keys: list[str], timeout: float = 30.0) -> dict[str, set[Any]]:
        """The store's keys among ``keys``, once the subscriber's view equals them."""
        deadline = time.monotonic() + timeout
        while True:
            want = self.stored(keys)
            if rebuild(self.sub.messages) == want:
                return want
            assert time.monotonic() < deadline, (len(rebuild(self.sub.messages)), len(want))
            time.sleep(0.2)

    def reasons(self) -> set[str]:
        return {
            ev.get("reason", "")
            for _, _, payload in self.sub.messages
            for ev in msgspec.msgpack.decode(payload)[1]
        }

    def pool_resyncs(self) -> int:
        return int(metric(self.server, "kvmeta_events_pool_resyncs_total"))


@pytest.fixture
def setup() -> Iterator[Setup]:
    s = Setup()
    yield s
    s.close()


def _reserve(url: str, keys: list[str], session: Any = requests) -> list[list[Any]]:
    resp = session.post(
        f"{url}/0/reserve_and_allocate_page_indices",
        json={"keys": [[k, None] for k in keys]},
        timeout=30,
    )
    assert resp.status_code in (200, 503), resp.text
    return [] if resp.status_code == 503 else [
        [k, p] for k, (hit, p) in zip(keys, resp.json()["indices"], strict=True)
        if not hit and p >= 0  # (-1: every page is reserved by others just now)
    ]  # fmt: skip


def _confirm(url: str, pairs: list[list[Any]], session: Any = requests) -> int:
    body = {"written_keys_to_confirm": pairs}
    return int(session.post(f"{url}/0/confirm_write", json=body, timeout=60).status_code)


def _delete(url: str, keys: list[str], session: Any = requests) -> int:
    return int(session.post(f"{url}/0/delete_keys", json={"keys": keys}, timeout=60).status_code)


def test_a_confirm_redis_ran_after_kvmeta_gave_up_on_it_reaches_the_subscriber(
    setup: Setup,
) -> None:
    keys = [key(i) for i in range(8)]
    pairs = _reserve(setup.url, keys)
    assert setup.stopped(lambda: _confirm(setup.url, pairs)) == 503
    want = setup.converges(keys)
    assert want[POOL] == hashed({POOL: set(keys)})[POOL], "Redis did not run the confirm"
    assert "resync" in setup.reasons()
    assert setup.pool_resyncs() >= 1


def test_a_delete_redis_ran_after_kvmeta_gave_up_on_it_reaches_the_subscriber(
    setup: Setup,
) -> None:
    keys = [key(i) for i in range(8)]
    assert _confirm(setup.url, _reserve(setup.url, keys)) in (200, 204)
    setup.converges(keys)
    assert setup.stopped(lambda: _delete(setup.url, keys[:5])) == 503
    want = setup.converges(keys)
    assert want.get(POOL) == hashed({POOL: set(keys[5:])})[POOL], "Redis did not run the delete"


@pytest.mark.soak
def test_under_load_with_redis_stopped_twice_the_view_ends_equal_to_redis(setup: Setup) -> None:
    universe = [key(i) for i in range(300)]  # 64 pages: reserves evict all the time
    stop = threading.Event()
    statuses: list[int] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        with requests.Session() as session:
            while not stop.is_set():
                keys = rng.sample(universe, rng.randint(1, 12))
                if rng.random() < 0.2:
                    statuses.append(_delete(setup.url, keys, session))
                    continue
                pairs = _reserve(setup.url, keys, session)
                if pairs:
                    statuses.append(_confirm(setup.url, pairs, session))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()

    def answered(more: int, status: int | None = None) -> Callable[[], bool]:
        """Once the workers got ``more`` replies (of ``status``) beyond those they have now."""
        count = (lambda: statuses.count(status)) if status else (lambda: len(statuses))
        target = count() + more
        return lambda: count() >= target

    try:
        for _ in range(2):
            wait_until(answered(30), what="load served")
            os.kill(setup.redis.pid, signal.SIGSTOP)
            # Stopped until calls in flight are answered 503 (no reply from Redis: kvmeta
            # cannot know whether they ran), then Redis runs them.
            wait_until(answered(1, 503), timeout=60, what="a call answered 503")
            os.kill(setup.redis.pid, signal.SIGCONT)
        wait_until(answered(30), what="load served after Redis came back")
    finally:
        os.kill(setup.redis.pid, signal.SIGCONT)
        stop.set()
        for t in threads:
            t.join(120)
    assert 503 in statuses and set(statuses) <= {200, 204, 503}
    setup.converges(universe)
    assert setup.pool_resyncs() >= 1
