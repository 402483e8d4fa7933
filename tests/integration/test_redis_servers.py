"""Several real ``kvmeta serve`` processes on one real redis-server.

Concurrent clients of both dialects (SGLang over HTTP; vLLM through the Backend API, the layer
its routes call), the page invariant checked in Redis at the end, a server killed mid-load,
``--workers``, start-up and run-time Redis failures, and the URL/env forms.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.store.redis.backend import RedisBackend
from tests.redis_support import RedisServer
from tests.support import Server, ServerProcess

Make = Callable[..., Server]


def _check(url: str) -> list[str]:
    async def run() -> list[str]:
        backend = RedisBackend(url)
        await backend.start()
        try:
            return (await backend.check()).problems
        finally:
            await backend.close()

    return asyncio.run(run())


def _sglang_writer(
    base: str, client: int, rounds: int, confirmed: dict[str, int], errors: list[str]
) -> None:
    """One engine: reserve 16 keys, confirm them, read them back; records what was confirmed."""
    with requests.Session() as http:
        for r in range(rounds):
            keys = [f"c{client}-{r}-{i}" for i in range(16)]
            body = {"keys": [[k, None] for k in keys]}
            out = http.post(f"{base}/0/reserve_and_allocate_page_indices", json=body, timeout=30)
            pairs = [[k, p] for k, (hit, p) in zip(keys, out.json()["indices"], strict=True)]
            ok = [pair for pair in pairs if pair[1] >= 0]
            resp = http.post(
                f"{base}/0/confirm_write", json={"written_keys_to_confirm": ok}, timeout=30
            )
            if resp.status_code != 204:
                errors.append(resp.text)
            confirmed.update((k, p) for k, p in ok)
            got = http.post(f"{base}/0/get_page_indices", json={"keys": keys}, timeout=30)
            for (key, page), seen in zip(pairs, got.json()["indices"], strict=True):
                if seen is not None and seen != page:
                    errors.append(f"{key}: confirmed page {page}, get says {seen}")


def _vllm_writer(url: str, rank: int, rounds: int, errors: list[str]) -> None:
    async def run() -> None:
        backend = RedisBackend(url, reservation_ttl=60, read_lease=1)
        await backend.start()
        try:
            await backend.v_register(rank, 128, 2)
            pool = PoolId("v", rank, "")
            for r in range(rounds):
                keys = [f"v{r}-{i}" for i in range(8)]
                out = await backend.reserve(pool, keys)
                pairs = [(k, p) for k, (hit, p) in zip(keys, out, strict=True) if not hit]
                if await backend.confirm(pool, [(k, p) for k, p in pairs if p >= 0], []):
                    errors.append(f"rank {rank}: confirm refused")
                await backend.v_exists(keys)
        finally:
            await backend.close()

    asyncio.run(run())


def test_two_servers_and_both_dialects_share_one_state(redis_url: str, make_app: Make) -> None:
    servers = [make_app("--backend", redis_url, "--read-lease", "1") for _ in range(2)]
    requests.post(servers[0].url + "/0/initialize", json={"num_pages": 200}, timeout=10)
    confirmed: list[dict[str, int]] = [{} for _ in range(4)]
    errors: list[str] = []
    threads = [
        threading.Thread(
            target=_sglang_writer, args=(servers[i % 2].url, i, 25, confirmed[i], errors)
        )
        for i in range(4)
    ]
    threads += [
        threading.Thread(target=_vllm_writer, args=(redis_url, r, 25, errors)) for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert _check(redis_url) == []
    # The pool (200 pages) was overrun 2x: what is left maps each key to the page confirmed
    # for it, and no page to two keys, whichever server is asked.
    everything = {k: p for part in confirmed for k, p in part.items()}
    keys = sorted(everything)
    for server in servers:
        got = requests.post(server.url + "/0/get_page_indices", json={"keys": keys}, timeout=30)
        live = {k: p for k, p in zip(keys, got.json()["indices"], strict=True) if p is not None}
        assert 0 < len(live) <= 200
        assert all(everything[k] == p for k, p in live.items())
        assert len(set(live.values())) == len(live)


def test_a_server_killed_mid_load_loses_nothing_confirmed(
    redis_url: str, make_server: Make
) -> None:
    victim = make_server("--backend", redis_url)
    survivor = make_server("--backend", redis_url)
    requests.post(survivor.url + "/0/initialize", json={"num_pages": 100_000}, timeout=10)
    acknowledged: list[str] = []

    def load() -> None:
        with requests.Session() as http:
            for r in range(100_000):
                keys = [f"k{r}-{i}" for i in range(8)]
                try:
                    out = http.post(
                        victim.url + "/0/reserve_and_allocate_page_indices",
                        json={"keys": [[k, None] for k in keys]},
                        timeout=5,
                    ).json()["indices"]
                    pairs = [[k, p] for k, (_, p) in zip(keys, out, strict=True)]
                    resp = http.post(
                        victim.url + "/0/confirm_write",
                        json={"written_keys_to_confirm": pairs},
                        timeout=5,
                    )
                except requests.RequestException:
                    return
                if resp.status_code == 204:
                    acknowledged.extend(keys)

    thread = threading.Thread(target=load)
    thread.start()
    deadline = time.monotonic() + 20
    while len(acknowledged) < 400 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(30)
    assert len(acknowledged) >= 400
    got = requests.post(survivor.url + "/0/exists", json={"keys": acknowledged}, timeout=30)
    assert got.json()["exists"] == [True] * len(acknowledged)
    assert _check(redis_url) == []


def _pids(server: Server, count: int) -> list[int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pids = re.findall(r"kvmeta listening on \S+ \(pid (\d+)\)", server.log)
        if len(pids) >= count:
            return [int(p) for p in pids]
        time.sleep(0.05)
    raise AssertionError(f"{count} workers did not start:\n{server.log}")


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_workers_share_one_port_and_stop_together(redis_url: str, make_server: Make) -> None:
    server = make_server("--backend", redis_url, "--workers", "2")
    pids = _pids(server, 2)
    assert len(set(re.findall(r"listening on (\S+) ", server.log))) == 1  # one port for all
    assert server.pid not in pids
    requests.post(server.url + "/0/initialize", json={"num_pages": 64}, timeout=10)
    before = [_cpu_ticks(pid) for pid in pids]

    def exists(i: int) -> int:  # a new connection each time
        body = {"keys": [f"k{i}"]}
        return requests.post(server.url + "/0/exists", json=body, timeout=10).status_code

    # Every worker accepts on the one socket: whichever is free takes the next connection.
    # Sequential connections can all go to one worker, so they come 8 at a time (a worker busy
    # with one leaves the next to another), in rounds until each worker has served (its CPU
    # time grew), for at most 30 s.
    deadline = time.monotonic() + 30
    with ThreadPoolExecutor(8) as pool:
        for start in itertools.count(0, 200):
            assert set(pool.map(exists, range(start, start + 200))) == {200}
            after = [_cpu_ticks(pid) for pid in pids]
            served = all(a > b for a, b in zip(after, before, strict=True))
            if served or time.monotonic() > deadline:
                break
    assert served, (before, after)
    assert server.stop(signal.SIGTERM) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_crashed_worker_is_restarted(redis_url: str, make_server: Make) -> None:
    server = make_server("--backend", redis_url, "--workers", "2")
    first = _pids(server, 2)
    os.kill(first[0], signal.SIGKILL)
    server.wait_for_log("restarting it")
    later = _pids(server, 3)
    assert later[2] not in first
    assert requests.post(server.url + "/0/initialize", json={"num_pages": 4}, timeout=10).ok


def test_unreachable_redis_fails_at_start_naming_the_url(tmp_path: Path) -> None:
    url = "redis://:hunter2@127.0.0.1:1/0"
    server = ServerProcess("--backend", url, cwd=tmp_path)
    try:
        with pytest.raises(RuntimeError) as info:
            server.start()
    finally:
        server.kill()  # closes its stderr pipe even though it never started
    assert server.proc is not None and server.proc.returncode == 2
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_redis_lost_mid_run_is_503_then_recovers(make_app: Make) -> None:
    own = RedisServer().start()
    try:
        server = make_app("--backend", own.url)
        assert requests.post(server.url + "/0/initialize", json={"num_pages": 4}, timeout=10).ok
        own.stop()
        resp = requests.post(server.url + "/0/exists", json={"keys": ["a"]}, timeout=10)
        assert resp.status_code == 503
        assert own.url in resp.json()["detail"]
        own.start(port=own.port)  # back, but empty: it had no persistence
        resp = requests.post(server.url + "/0/exists", json={"keys": ["a"]}, timeout=10)
        assert resp.status_code == 404 and "not initialized" in resp.json()["detail"]
    finally:
        own.close()


def test_password_url_and_env_fallback(make_app: Make) -> None:
    own = RedisServer(password="s3cret").start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{own.port}/2"
        server = make_app(env={"KVMETA_REDIS_URL": url})
        server.wait_for_log(f"backend: redis at redis://:***@127.0.0.1:{own.port}/2")
        assert "s3cret" not in server.log
        assert requests.post(server.url + "/0/initialize", json={"num_pages": 4}, timeout=10).ok
        with own.client(db=2) as client:
            assert client.exists("kvmeta:2:{s:0:kv}:meta") == 1
    finally:
        own.close()


def test_scripts_are_reloaded_after_redis_forgets_them(redis_server: RedisServer) -> None:
    redis_server.flush()

    async def run() -> None:
        backend = RedisBackend(redis_server.url)
        await backend.start()
        try:
            await backend.initialize(PoolId("s", 0, "kv"), 4)
            with redis_server.client() as client:
                client.script_flush()
            assert await backend.reserve(PoolId("s", 0, "kv"), ["a"]) == [(False, 0)]
        finally:
            await backend.close()

    asyncio.run(run())
