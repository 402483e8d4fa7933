"""A real ``kvmeta serve`` whose journal fails: a full file system, no file descriptors, a
stopped or dying fsync helper, and power loss modelled by cutting the journal back.

Each run checks what the operator is promised: changes answer 503 naming the data directory,
``/ready`` is false and ``/health`` says why, reads keep working, every request gets a reply,
the server recovers by itself once the cause is gone, and after a kill -9 and a restart every
acknowledged confirm is there and ``kvmeta check`` passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvmeta.bench.procstat import children
from kvmeta.store.disk.recovery import list_data_dir
from tests.crash.faults import (
    PAGES,
    Driver,
    cmdline,
    fill,
    helper_pid,
    is_ready,
    resume_after_space,
    serve,
    small_filesystem,
    sync,
    until,
)
from tests.support import SRC, ServerProcess, kvmeta_check

pytestmark = pytest.mark.slow


def _assert_failed_state(server: ServerProcess, data: Path, driver: Driver) -> None:
    assert driver.refusals and all(str(data) in r for r in driver.refusals), driver.refusals
    ready = requests.get(server.url + "/ready", timeout=30)
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert str(data) in ready.json()["detail"]
    health = requests.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert str(data) in health.json()["reason"]
    # Reads keep working; changes are refused.
    some = sorted(driver.acked)[:5]
    got = server.post("/0/get_page_indices", {"keys": some})
    assert got.status_code == 200 and got.json()["indices"] == [driver.acked[k] for k in some]
    assert server.post("/0/exists", {"keys": some}).json() == {"exists": [True] * len(some)}
    assert server.post("/0/delete_keys", {"keys": some}).status_code == 503
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    assert "kvmeta_journal_failed 1.0" in metrics


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_disk_full_refuses_changes_then_recovers_losing_nothing(tmp_path: Path, fsync: str) -> None:
    with small_filesystem(tmp_path / "fs") as fs:
        data = fs / "data"
        server = ServerProcess(
            "--data-dir", str(data), "--fsync", fsync, "--read-lease", "0", cwd=tmp_path
        ).start()
        try:
            assert server.post("/0/initialize", {"num_pages": PAGES}).status_code in (200, 204)
            filler = fill(fs)
            driver = Driver(server)
            driver.until_refused()
            assert "No space left on device" in driver.refusals[0]
            _assert_failed_state(server, data, driver)
            resume_after_space(server, driver, filler)
            assert "recovered" in server.log
        finally:
            server.kill()  # kill -9: no final snapshot
        driver.verify_after_restart(data, tmp_path, fsync)


def test_stopped_fsync_helper_makes_always_confirms_wait_then_complete(tmp_path: Path) -> None:
    server = serve(tmp_path / "data", tmp_path, "always")
    try:
        driver = Driver(server)
        with requests.Session() as session:
            assert driver.round(session) == 204
            helper = helper_pid(server)
            os.kill(helper, signal.SIGSTOP)  # a disk that does not answer
            try:
                with ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(driver.round, requests.Session())
                    time.sleep(1.5)
                    assert not pending.done(), "an always-mode confirm replied before its fsync"
                    assert requests.get(server.url + "/health", timeout=30).ok  # not stuck
                    os.kill(helper, signal.SIGCONT)
                    assert pending.result(timeout=60) == 204
            finally:
                os.kill(helper, signal.SIGCONT)
            assert driver.round(session) == 204
    finally:
        server.kill()
    driver.verify_after_restart(tmp_path / "data", tmp_path, "always")


def test_power_loss_at_the_last_fsync_keeps_every_acknowledged_confirm(tmp_path: Path) -> None:
    """Model: the helper stops (nothing more reaches the disk), more confirms are written to
    the page cache but never acknowledged, the machine dies: the journal is cut back to its
    length at the last fsync (plus a few bytes of a torn frame)."""
    data = tmp_path / "data"
    server = serve(data, tmp_path, "always", "--snapshot-interval", "0")
    pending_keys: list[str] = []
    try:
        driver = Driver(server)
        with requests.Session() as session:
            for _ in range(20):
                assert driver.round(session) == 204
        helper = helper_pid(server)
        os.kill(helper, signal.SIGSTOP)
        segment = data / f"journal-{list_data_dir(data).segments[-1]:012d}.log"
        durable = segment.stat().st_size  # every acknowledged confirm is in here, fsynced
        late = Driver(server, "late")
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(late.round, requests.Session()) for _ in range(3)]
            until(lambda: segment.stat().st_size > durable, what="unacknowledged writes")
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            # The stopped helper holds the server's stderr open: kill it before reaping.
            os.kill(helper, signal.SIGKILL)
            server.kill()
            for fut in futures:
                with contextlib.suppress(requests.RequestException):
                    fut.result(timeout=60)
        assert not late.acked  # none of them was acknowledged
        pending_keys = [f"late-{i}-0" for i in range(1, 4)]
    finally:
        server.kill()
    with open(segment, "r+b") as fh:
        fh.truncate(durable + 5)  # the power cut tore the next frame
    driver.verify_after_restart(data, tmp_path, "always")
    server = ServerProcess("--data-dir", str(data), cwd=tmp_path).start()
    try:
        got = server.post("/0/exists", {"keys": pending_keys}).json()["exists"]
        assert got == [False] * len(pending_keys)
    finally:
        server.stop()


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_a_helper_that_keeps_dying_fails_the_journal_then_recovers(
    tmp_path: Path, fsync: str
) -> None:
    data = tmp_path / "data"
    server = serve(data, tmp_path, fsync)
    stop = threading.Event()
    statuses: list[int] = []

    def killer() -> None:
        while not stop.is_set():
            for pid in children(server.pid):
                if b"fsync_helper" in cmdline(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    try:
        driver = Driver(server)
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        try:
            with requests.Session() as session:
                deadline = time.monotonic() + 90
                while not driver.refusals:
                    assert time.monotonic() < deadline, "the journal never failed"
                    statuses.append(driver.round(session, 4))
            assert "fsync helper" in driver.refusals[0] and str(data) in driver.refusals[0]
            _assert_failed_state(server, data, driver)
        finally:
            stop.set()
            thread.join(10)
        until(lambda: is_ready(server), what="/ready once the helper stays up")
        with requests.Session() as session:
            assert driver.round(session) == 204
        sync(server)
    finally:
        server.kill()
    assert set(statuses) <= {204, 503}
    driver.verify_after_restart(data, tmp_path, fsync)


def test_out_of_file_descriptors_fails_the_journal_then_recovers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = serve(data, tmp_path, "batch")
    fillers: list[socket.socket] = []
    try:
        driver = Driver(server)
        session = requests.Session()
        assert driver.round(session) == 204  # the one connection kept for the test's requests
        used = len(os.listdir(f"/proc/{server.pid}/fd"))
        limit = used + 16
        subprocess.run(
            ["prlimit", "--pid", str(server.pid), f"--nofile={limit}:{limit}"], check=True
        )
        # Connections until the server cannot accept more (every descriptor in use).
        for _ in range(limit * 2):
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            fillers.append(conn)
            if len(os.listdir(f"/proc/{server.pid}/fd")) >= limit:
                break
        until(lambda: len(os.listdir(f"/proc/{server.pid}/fd")) >= limit, what="fds used up")
        os.kill(helper_pid(server), signal.SIGKILL)  # its replacement needs descriptors
        until(lambda: driver.round(session) == 503, what="a refused change")
        assert "Too many open files" in driver.refusals[-1], driver.refusals
        _assert_failed_state_on(session, server, data, driver)
        for conn in fillers:
            conn.close()
        fillers.clear()
        until(
            lambda: session.get(server.url + "/ready", timeout=30).status_code == 200,
            what="/ready after descriptors were freed",
        )
        assert driver.round(session) == 204
        sync(server)
        session.close()
    finally:
        for conn in fillers:
            conn.close()
        server.kill()
    driver.verify_after_restart(data, tmp_path, "batch")


def _assert_failed_state_on(
    session: requests.Session, server: ServerProcess, data: Path, driver: Driver
) -> None:
    ready = session.get(server.url + "/ready", timeout=30)
    assert ready.status_code == 503 and str(data) in ready.json()["detail"]
    health = session.get(server.url + "/health", timeout=30).json()
    assert health["status"] == "degraded" and str(data) in health["reason"]
    some = sorted(driver.acked)[:3]
    got = session.post(server.url + "/0/get_page_indices", json={"keys": some}, timeout=30)
    assert got.json()["indices"] == [driver.acked[k] for k in some]


def test_middle_record_length_damage_stops_start_up_and_check_exits_1(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = serve(data, tmp_path, "always", "--snapshot-interval", "0")
    try:
        driver = Driver(server)
        with requests.Session() as session:
            for _ in range(10):
                assert driver.round(session, 4) == 204
    finally:
        server.kill()
    segment = data / f"journal-{list_data_dir(data).segments[-1]:012d}.log"
    raw = bytearray(segment.read_bytes())
    at = 8
    for _ in range(5):  # the sixth record's length field
        at += 8 + int.from_bytes(raw[at : at + 4], "little")
    raw[at : at + 4] = (1 << 20).to_bytes(4, "little")
    segment.write_bytes(bytes(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--data-dir", str(data), "--port", "0"],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "JournalCorrupt" in proc.stderr or "will not start" in proc.stderr, proc.stderr
    assert segment.name in proc.stderr and f"byte {at}" in proc.stderr
    assert segment.read_bytes() == bytes(raw)  # kept as it was
    check = kvmeta_check(data)
    assert check.returncode == 1 and f"byte {at}" in check.stderr, check.stdout + check.stderr
