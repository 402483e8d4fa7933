"""``kvmeta serve`` as process 1 of its own PID namespace, as the container image and every
Kubernetes pod run it (the entry point is exec'd, no init process before it): a ``--workers``
group keeps its workers, and both a group and a durable server stop cleanly on SIGTERM (process
1 gets no default signal handling from the kernel)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.support import child_env

_LISTEN = re.compile(r"kvmeta listening on (http://\S+) \(pid (\d+)\)")


def _can_unshare() -> str:
    """'' when this machine lets us make a PID namespace, else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare(1) (util-linux) on PATH"
    done = subprocess.run(
        [unshare, "--pid", "--fork", "--kill-child", "true"], capture_output=True, text=True
    )
    return "" if done.returncode == 0 else f"unshare --pid refused: {done.stderr.strip()}"


class Pid1Server:
    """``kvmeta serve`` run by ``unshare --pid --fork``: it is pid 1 inside, like a container's
    entry point. Its stderr goes to an unnamed file (read with ``log``)."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self._log, path = tempfile.mkstemp(prefix="kvmeta-pid1-", suffix=".log")
        os.unlink(path)
        weakref.finalize(self, os.close, self._log)
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "kvmeta",
             "serve", "--port", "0", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            env=child_env(), cwd=cwd, start_new_session=True,
        )  # fmt: skip

    @property
    def log(self) -> str:
        return os.pread(self._log, 1 << 24, 0).decode(errors="replace")

    def wait_listening(self, count: int, timeout: float = 30.0) -> tuple[str, set[str]]:
        """(url, the pids that logged their listening line) once ``count`` have."""
        deadline = time.monotonic() + timeout
        while True:
            found = _LISTEN.findall(self.log)
            if len({pid for _, pid in found}) >= count:
                return found[0][0], {pid for _, pid in found}
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log}"
            assert time.monotonic() < deadline, f"{count} listening lines not seen:\n{self.log}"
            time.sleep(0.05)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM to the session: unshare ignores it, kvmeta (pid 1 inside) gets it."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def pid1(tmp_path: Path) -> Iterator[list[Pid1Server]]:
    why = _can_unshare()
    assert not why, f"cannot run a server as pid 1 here (run the tests as root): {why}"
    started: list[Pid1Server] = []
    yield started
    for server in started:
        server.kill()


def test_a_workers_group_as_pid_1_keeps_its_workers(
    pid1: list[Pid1Server], redis_url: str, tmp_path: Path
) -> None:
    server = Pid1Server("--backend", redis_url, "--workers", "2", cwd=tmp_path)
    pid1.append(server)
    url, pids = server.wait_listening(2)
    assert "exited with" not in server.log and "keep failing" not in server.log, server.log
    assert requests.post(url + "/0/initialize", json={"num_pages": 4}, timeout=30).ok
    for _ in range(10):
        got = requests.post(url + "/0/get_page_indices", json={"keys": ["k"]}, timeout=30)
        assert got.json() == {"indices": [None]}, got.text
    assert "exited with" not in server.log, server.log
    assert server.terminate() == 0, server.log
    assert server.log.count("kvmeta stopped") == 2, server.log


def test_a_durable_server_as_pid_1_stops_on_sigterm(pid1: list[Pid1Server], tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Pid1Server("--data-dir", str(data), cwd=tmp_path)
    pid1.append(server)
    url, pids = server.wait_listening(1)
    assert pids == {"1"}, server.log
    assert requests.post(url + "/0/initialize", json={"num_pages": 4}, timeout=30).ok
    assert server.terminate() == 0, server.log
    assert "kvmeta stopped" in server.log
    assert list(data.glob("snapshot-*.snap")), "no snapshot written at shutdown"
