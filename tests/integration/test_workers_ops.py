"""``--workers N`` as an operator sees it: the start-up facts logged once (each worker still
logs its listening line with its pid), and a SIGTERM that drains every worker."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable

import requests

from tests.support import ServerProcess

Make = Callable[..., ServerProcess]


def _worker_pids(server: ServerProcess, count: int) -> set[int]:
    deadline = time.monotonic() + 30
    while True:
        pids = {int(p) for p in re.findall(r"kvmeta listening on \S+ \(pid (\d+)\)", server.log)}
        if len(pids) >= count:
            return pids
        assert time.monotonic() < deadline, f"{count} workers did not start:\n{server.log}"
        time.sleep(0.05)


def test_the_start_up_block_is_logged_once(redis_url: str, make_server: Make) -> None:
    server = make_server("--backend", redis_url, "--workers", "3")
    assert len(_worker_pids(server, 3)) == 3
    server.wait_for_log("tls: off")
    server.wait_for_log("started 3 workers")
    for fact in ("backend: ", "state: shared backend", "leases: ", "limits: ", "auth: off"):
        # (matched with the logger's name: "backend: " also ends the Redis backend's logger name)
        count = sum(f"kvmeta.server: {fact}" in line for line in server.lines)
        assert count == 1, f"{fact!r} logged {count} times:\n{server.log}"


def test_sigterm_drains_every_worker(redis_url: str, make_server: Make) -> None:
    server = make_server("--backend", redis_url, "--workers", "2", "--drain-seconds", "120")
    pids = _worker_pids(server, 2)
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:
        draining = {int(p) for p in re.findall(r"draining for 120 s \(pid (\d+)\)", server.log)}
        if draining == pids:
            break
        assert time.monotonic() < deadline, f"not every worker drains:\n{server.log}"
        time.sleep(0.05)
    for _ in range(20):  # a new connection each time: whichever worker takes it
        assert requests.get(server.url + "/ready", timeout=10).status_code == 503
        assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [False]}
    assert server.proc.poll() is None
    assert server.stop(signal.SIGTERM) == 0  # the second signal: every worker stops now
    assert server.log.count("received SIGTERM while draining") == 2
