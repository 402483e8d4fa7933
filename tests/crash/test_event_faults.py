"""KV events when the journal fails: a real ``kvmeta serve --events`` on a data directory
whose disk fills up, whose fsync helper stops, and whose machine loses power (the journal cut
back to its length at the last fsync).

What a subscriber is promised (docs/events.md): an event leaves only once its change is
durable, so nothing announced is ever undone by a crash or refused by a failing journal; and
after a restart the new run's resync states exactly what the store recovered. Each test
rebuilds a router's index from the events and compares it with the store, not only the
replies.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta.store.disk.recovery import list_data_dir
from tests.crash.faults import (
    PAGES,
    Driver,
    fill,
    helper_pid,
    is_ready,
    resume_after_space,
    small_filesystem,
    sync,
    until,
)
from tests.events.events_support import Subscriber, endpoints, hashed, rebuild, resync_run
from tests.support import ServerProcess, kvmeta_check

pytestmark = pytest.mark.slow

POOL = "s:0:kv"  # the pool the drivers write (SGLang rank 0, the default namespace)
EVENTS = (
    *("--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0"),
    *("--read-lease", "0"),
)


def _server(data: Path, cwd: Path, fsync: str, *extra: str) -> ServerProcess:
    args = ("--data-dir", str(data), "--fsync", fsync, *EVENTS, *extra)
    return ServerProcess(*args, cwd=cwd).start()


@contextmanager
def _subscribed(server: ServerProcess) -> Iterator[Subscriber]:
    ends = endpoints(server)
    sub = Subscriber(ends.pub, ends.replay).start()
    try:
        yield sub
    finally:
        sub.close()


def _all_keys(*drivers: Driver) -> list[str]:
    """Every key the drivers asked for, acknowledged or not (``Driver.round``'s names)."""
    return [
        f"{d.prefix}-{t}-{j}" for d in drivers for t in range(1, d.counter + 1) for j in range(32)
    ]


def _held(server: ServerProcess, keys: list[str]) -> set[str]:
    held: set[str] = set()
    with requests.Session() as session:
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            resp = session.post(f"{server.url}/0/exists", json={"keys": batch}, timeout=30)
            assert resp.status_code == 200, resp.text
            held.update(k for k, hit in zip(batch, resp.json()["exists"], strict=True) if hit)
    return held


def _index(messages: list[tuple[bytes, int, bytes]]) -> set[Any]:
    """The driven pool's blocks as a router's index holds them after ``messages``."""
    return rebuild(messages).get(POOL, set())


def _blocks(keys: set[str]) -> set[Any]:
    return hashed({POOL: keys}).get(POOL, set())


def _segment(data: Path) -> Path:
    return data / f"journal-{list_data_dir(data).segments[-1]:012d}.log"


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_power_loss_undoes_nothing_that_was_announced(tmp_path: Path, fsync: str) -> None:
    """The fsync helper stops (nothing more reaches the disk); confirms go on (``batch``
    acknowledges them before their fsync, ``always`` holds the reply); the machine dies and the
    journal is cut back to its length when the helper stopped, plus a torn frame."""
    data = tmp_path / "data"
    server = _server(data, tmp_path, fsync, "--snapshot-interval", "0")
    try:
        with _subscribed(server) as sub:
            assert server.post("/0/initialize", {"num_pages": PAGES}).status_code in (200, 204)
            driver = Driver(server)
            with requests.Session() as session:
                for _ in range(20):
                    assert driver.round(session) == 204
            sync(server)
            sub.wait_for(server)
            assert _index(sub.messages) == _blocks(set(driver.acked))

            helper = helper_pid(server)
            os.kill(helper, signal.SIGSTOP)  # everything on disk now is fsynced
            segment = _segment(data)
            durable = segment.stat().st_size
            late = Driver(server, "late")
            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(late.round, requests.Session()) for _ in range(6)]
                until(lambda: segment.stat().st_size > durable, what="writes after the fsync")
                if fsync == "batch":  # acknowledged, not durable
                    until(lambda: len(late.acked) >= 32, what="a late confirm acknowledged")
                time.sleep(1.0)  # time for a wrong announcement to reach the subscriber
                announced = list(sub.messages)
                server.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                os.kill(helper, signal.SIGKILL)  # it holds the server's stderr open
                server.kill()
                for fut in futures:
                    with suppress(requests.RequestException):
                        fut.result(timeout=60)
    finally:
        server.kill()
    assert (fsync == "batch") == bool(late.acked)
    # Nothing written after the helper stopped was announced: the index is what was durable.
    assert _index(announced) == _blocks(set(driver.acked))

    with open(segment, "r+b") as fh:
        fh.truncate(durable + 5)  # the power cut tore the next frame
    server = _server(data, tmp_path, fsync, "--events-replay", "tcp://127.0.0.1:0")
    try:
        held = _held(server, _all_keys(driver, late))
        assert set(driver.acked) <= held  # ``batch`` may lose what it acknowledged, not more
        assert not held & set(late.acked) or fsync == "batch"
        # The resync states exactly what the store recovered, and it contains every block the
        # crashed run announced: a router that applies the new run ends with the store.
        resynced = _index(resync_run(server))
        assert resynced == _blocks(held)
        assert _index(announced) <= resynced
    finally:
        assert server.stop() == 0
    check = kvmeta_check(data)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_disk_full_announces_no_refused_change_and_resumes_when_space_returns(
    tmp_path: Path, fsync: str
) -> None:
    with small_filesystem(tmp_path / "fs") as fs:
        data = fs / "data"
        server = _server(data, tmp_path, fsync)
        try:
            with _subscribed(server) as sub:
                assert server.post("/0/initialize", {"num_pages": PAGES}).status_code in (200, 204)
                late = Driver(server, "late")  # reserved now, confirmed once the journal failed
                with requests.Session() as session:
                    reserved = late.reserve(session, late.new_keys())
                assert reserved is not None
                filler = fill(fs)
                driver = Driver(server)
                driver.until_refused()
                assert "No space left on device" in driver.refusals[0]
                assert not is_ready(server)
                # A change that arrives while the journal is failed is refused before it is
                # applied: it changes nothing and is never announced.
                with requests.Session() as session:
                    assert late.confirm(session, reserved) == 503
                assert not is_ready(server)
                time.sleep(1.0)  # time for a wrong announcement to reach the subscriber
                sub.wait_for(server)
                # What the store holds now is what the index holds: no refused confirm was
                # announced, and every acknowledged one is there (announced once durable).
                held = _held(server, _all_keys(driver, late))
                assert set(driver.acked) <= held
                assert not held & set(_all_keys(late))
                assert _index(sub.messages) <= _blocks(held)
                refused = set(_all_keys(driver, late)) - held
                assert not _index(sub.messages) & _blocks(refused)
                # A request refused by the write that failed was applied before it (``always``:
                # a confirm waits for its group): it stays applied, all of it, unannounced until
                # the recovery makes it durable (docs/durability.md, journal failures). With
                # ``batch`` no confirm waits: each was refused before it was applied.
                for keys in driver.refused_keys:
                    assert len(held & set(keys)) in ((0, len(keys)) if fsync == "always" else (0,))

                resume_after_space(server, driver, filler)
                sub.wait_for(server)
                held = _held(server, _all_keys(driver))
                assert set(driver.acked) <= held
                assert _index(sub.messages) == _blocks(held)
                announced = list(sub.messages)
        finally:
            server.kill()  # kill -9: no final snapshot
        server = _server(data, tmp_path, fsync, "--events-replay", "tcp://127.0.0.1:0")
        try:
            held = _held(server, _all_keys(driver))
            assert set(driver.acked) <= held
            resynced = _index(resync_run(server))
            assert resynced == _blocks(held) == _index(announced)
        finally:
            assert server.stop() == 0
