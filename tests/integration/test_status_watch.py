"""``kvmeta status --watch``: the table redrawn in place on a terminal, frame after frame in a
pipe, and Ctrl-C ends it with exit code 0."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvmeta.status import CLEAR, watch
from tests.support import SRC, InProcessServer, Server, ServerProcess, unused_port

TOKEN = "watch-token"
HEADER = "kvmeta 0.1.0 at "


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    proc = InProcessServer("--in-memory", "--auth-token", TOKEN).start()
    try:
        proc.post("/0/initialize", {"num_pages": 8}, headers={"Authorization": f"Bearer {TOKEN}"})
        yield proc
    finally:
        proc.stop()


def test_watch_redraws_in_place_on_a_terminal(server: ServerProcess) -> None:
    out = io.StringIO()
    naps: list[float] = []
    assert watch(server.url, TOKEN, 0.5, out, tty=True, frames=3, sleep=naps.append) == 0
    text = out.getvalue()
    assert text.count(CLEAR) == 3 and text.startswith(CLEAR)
    assert text.count(HEADER) == 3 and "sglang rank 0 kv" in text
    assert naps == [0.5, 0.5]


def test_watch_in_a_pipe_prints_plain_frames() -> None:
    out = io.StringIO()
    down = f"http://127.0.0.1:{unused_port()}"
    assert watch(down, None, 0.01, out, tty=False, frames=2, sleep=lambda s: None) == 0
    text = out.getvalue()
    assert "\x1b" not in text
    assert text.count("Ctrl-C to quit") == 2  # an unreachable server is shown, not fatal


def test_watch_subprocess_exits_0_on_ctrl_c(server: ServerProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["KVMETA_AUTH_TOKEN"] = TOKEN
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmeta", "status", "--url", server.url, "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while sum(HEADER in line for line in lines) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, f"watch exited early: {proc.stderr and proc.stderr.read()}"
            time.sleep(0.1)
        time.sleep(0.5)  # ~1 s of watching in all once the interpreter is up
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    frames = sum(HEADER in line for line in lines)
    assert code == 0, stderr
    assert frames >= 2, "".join(lines)
    assert not any("\x1b" in line for line in lines)  # not a terminal: no escape codes
    assert "Traceback" not in stderr
