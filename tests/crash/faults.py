"""What the fault tests share: a real ``kvmeta serve`` on a data directory, a driver of confirms
that records what was acknowledged and checks it after a restart, a small file system that
fills up, and the server's fsync helper (to stop or kill it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta.bench.procstat import children
from tests.support import ServerProcess, kvmeta_check, wait_until

PAGES = 1 << 16
KEY_PAD = "k" * 160  # long keys fill the journal quickly


def until(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    wait_until(predicate, timeout, what, interval=0.05)


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "2m") -> Iterator[Path]:
    """A 2 MB tmpfs at ``path``. Needs root (CI runs as root); without it the test fails
    with the reason rather than being skipped, so a run never silently tests less."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs (the disk-full test needs root): {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(fs: Path, leave: int = 400 * 1024) -> Path:
    """Fill the file system ``fs`` but ``leave`` bytes (the journal fills those; a snapshot
    fits once the filler is gone); the filler file, to unlink when space should return."""
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    filler = fs / "filler"
    filler.write_bytes(b"\0" * (free - leave))
    return filler


def resume_after_space(server: ServerProcess, driver: Driver, filler: Path) -> None:
    """Free the space (``fill``) and wait until the server takes changes again: it recovers by
    itself; then five rounds and a sync must succeed."""
    filler.unlink()
    until(lambda: is_ready(server), what="/ready after space was freed")
    with requests.Session() as session:
        for _ in range(5):
            assert driver.round(session) == 204
    sync(server)


def sync(server: ServerProcess) -> None:
    """Return once every change so far is durable (``batch`` acknowledges confirms before their
    fsync; a new pool's initialize waits for its group, which holds everything before it)."""
    resp = server.post("/0/initialize", {"num_pages": 4, "namespace": f"sync{time.monotonic_ns()}"})
    assert resp.status_code in (200, 204), resp.text


def is_ready(server: ServerProcess) -> bool:
    return requests.get(server.url + "/ready", timeout=30).status_code == 200


class Driver:
    """Confirms of long keys from several threads; records what was acknowledged."""

    def __init__(self, server: ServerProcess, prefix: str = KEY_PAD) -> None:
        self.server = server
        self.prefix = prefix
        self.acked: dict[str, int] = {}
        self.refusals: list[str] = []
        self.refused_keys: list[list[str]] = []  # the keys of each refused request
        self.lock = threading.Lock()
        self.counter = 0

    def round(self, session: requests.Session, n: int = 32) -> int:
        """One reserve + confirm of ``n`` new keys; returns the confirm's status."""
        keys = self.new_keys(n)
        pairs = self.reserve(session, keys)
        if pairs is None:
            return 503
        return self.confirm(session, pairs)

    def new_keys(self, n: int = 32) -> list[str]:
        with self.lock:
            self.counter += 1
            tag = self.counter
        return [f"{self.prefix}-{tag}-{j}" for j in range(n)]

    def reserve(self, session: requests.Session, keys: list[str]) -> list[list[Any]] | None:
        """Reserve ``keys``; their ``[key, page]`` pairs, or None when refused (503)."""
        resp = session.post(
            f"{self.server.url}/0/reserve_and_allocate_page_indices",
            json={"keys": [[k, None] for k in keys]},
            timeout=30,
        )
        if resp.status_code != 200:
            self._refused(resp, keys)
            return None
        return [[k, p] for k, (_, p) in zip(keys, resp.json()["indices"], strict=True)]

    def confirm(self, session: requests.Session, pairs: list[list[Any]]) -> int:
        """Confirm reserved ``pairs``; returns the status (an acknowledged one is recorded)."""
        resp = session.post(
            f"{self.server.url}/0/confirm_write",
            json={"written_keys_to_confirm": pairs},
            timeout=30,
        )
        if resp.status_code == 204 or resp.status_code == 200:
            with self.lock:
                self.acked.update((k, p) for k, p in pairs)
        else:
            self._refused(resp, [k for k, _ in pairs])
        return resp.status_code

    def _refused(self, resp: requests.Response, keys: list[str]) -> None:
        assert resp.status_code == 503, (resp.status_code, resp.text)
        with self.lock:
            self.refusals.append(resp.json()["detail"])
            self.refused_keys.append(keys)

    def until_refused(self, threads: int = 3, limit: float = 120.0) -> None:
        """Drive confirms from ``threads`` threads until one is refused; every request must
        get an answer (a request timing out fails the test)."""
        stop = threading.Event()

        def work() -> None:
            with requests.Session() as session:
                while not stop.is_set():
                    if self.round(session) == 503:
                        stop.set()

        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(work) for _ in range(threads)]
            deadline = time.monotonic() + limit
            while not stop.is_set():
                assert time.monotonic() < deadline, "the journal never failed"
                time.sleep(0.05)
            for fut in futures:
                fut.result(timeout=60)  # raises if a request hung or failed otherwise

    def verify_after_restart(self, data: Path, cwd: Path, fsync: str) -> None:
        server = ServerProcess("--data-dir", str(data), "--fsync", fsync, cwd=cwd).start()
        try:
            keys = sorted(self.acked)
            got: list[int | None] = []
            for i in range(0, len(keys), 1000):
                resp = server.post("/0/get_page_indices", {"keys": keys[i : i + 1000]})
                got += resp.json()["indices"]
            lost = [k for k, page in zip(keys, got, strict=True) if page != self.acked[k]]
            assert not lost, f"{len(lost)} of {len(keys)} acknowledged confirms lost"
        finally:
            assert server.stop() == 0
        check = kvmeta_check(data)
        assert check.returncode == 0, check.stdout + check.stderr


def helper_pid(server: ServerProcess, timeout: float = 20.0) -> int:
    """The server's fsync helper (waits for a restarted one to appear)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [c for c in children(server.pid) if b"fsync_helper" in cmdline(c)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no fsync helper"
        time.sleep(0.02)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def serve(data: Path, cwd: Path, fsync: str, *extra: str) -> ServerProcess:
    server = ServerProcess(
        "--data-dir", str(data), "--fsync", fsync, "--read-lease", "0", *extra, cwd=cwd
    ).start()
    assert server.post("/0/initialize", {"num_pages": PAGES}).status_code in (200, 204)
    return server
