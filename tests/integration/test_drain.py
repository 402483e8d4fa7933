"""Drain on SIGTERM (``--drain-seconds``): ``/ready`` answers 503 for the window while requests
are still served, then the server stops as before (final snapshot, exit 0); a second signal,
or SIGINT, stops without waiting out the window."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

from kvmeta.store.disk.recovery import list_data_dir
from tests.support import ServerProcess, child_env

Make = Callable[..., ServerProcess]


def until_draining(server: ServerProcess, timeout: float = 20.0) -> requests.Response:
    """Poll ``/ready`` until it answers 503 (the signal has been handled)."""
    deadline = time.monotonic() + timeout
    while True:
        got = requests.get(server.url + "/ready", timeout=10)
        if got.status_code == 503:
            return got
        assert got.status_code == 200, got.text
        assert time.monotonic() < deadline, f"/ready still 200 {timeout} s after SIGTERM"
        time.sleep(0.02)


def test_sigterm_answers_ready_503_while_serving_requests(make_server: Make) -> None:
    server = make_server("--in-memory", "--drain-seconds", "120")
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    assert requests.get(server.url + "/ready", timeout=10).status_code == 200
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    ready = until_draining(server)
    assert ready.json()["ready"] is False and "draining" in ready.json()["detail"]
    # Still serving: a pool request, a new pool, liveness and metrics.
    reserved = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    assert reserved.status_code == 200, reserved.text
    page = reserved.json()["indices"][0][1]
    assert server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", page]]}).ok
    assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [True]}
    assert server.post("/1/initialize", {"num_pages": 4}).status_code == 204
    assert requests.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    assert "\nkvmeta_ready 0.0\n" in requests.get(server.url + "/metrics", timeout=10).text
    assert server.proc.poll() is None
    assert "received SIGTERM: draining for 120 s" in server.log
    # A second signal stops at once, cleanly.
    assert server.stop(signal.SIGTERM) == 0
    assert "received SIGTERM while draining: finishing in-flight requests" in server.log
    assert "kvmeta stopped" in server.log


def test_the_window_ends_in_the_usual_stop(make_server: Make, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = make_server("--data-dir", str(data), "--drain-seconds", "2")
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    assert server.proc is not None
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    until_draining(server)
    assert server.proc.wait(60) == 0
    assert time.monotonic() - signalled >= 2.0  # never before the window is over
    assert "drained: finishing in-flight requests" in server.log
    assert "kvmeta stopped" in server.log
    assert list_data_dir(data).snapshots  # the final snapshot, as without a drain


def test_sigint_stops_without_the_window(make_server: Make) -> None:
    server = make_server("--in-memory", "--drain-seconds", "120")
    assert server.stop(signal.SIGINT) == 0
    assert "received SIGINT: finishing in-flight requests" in server.log
    assert "draining" not in server.log


def test_no_window_with_drain_seconds_0(make_server: Make) -> None:
    server = make_server("--in-memory", "--drain-seconds", "0")
    assert server.stop(signal.SIGTERM) == 0
    assert "received SIGTERM: finishing in-flight requests" in server.log
    assert "draining" not in server.log


# Sends SIGTERM to itself while the start-up facts are logged, just after the listening line
# (whoever waits for that line may signal at that moment), then serves as `kvmeta serve`.
_SIGNAL_AT_START = """
import os, signal, sys
from kvmeta.server import oplog
from kvmeta.cli import main

logged = oplog.log_startup

def log_startup(*args, **kwargs):
    logged(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)

oplog.log_startup = log_startup
sys.exit(main(["serve", "--in-memory", "--port", "0"]))
"""


def test_a_signal_just_after_the_listening_line_stops_cleanly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_AT_START],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "received SIGTERM: finishing in-flight requests" in done.stderr
    assert "kvmeta stopped" in done.stderr
