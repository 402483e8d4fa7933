"""Test support: a real ``kvmeta serve`` subprocess on an ephemeral port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from kvmeta.bench import procstat

SRC = Path(__file__).resolve().parents[1] / "src"
_LISTEN_RE = re.compile(r"kvmeta listening on (https?)://([^\s:]+|\[[^\]]+\]):(\d+)")


def wait_until(
    predicate: Callable[[], object], timeout: float = 30.0, what: str = "", interval: float = 0.01
) -> None:
    """Poll ``predicate`` until it is true: a test waits exactly as long as the condition takes,
    never a fixed sleep that is too long on a quiet machine and too short on a loaded one."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, (
            f"timed out after {timeout} s waiting for {what or predicate}"
        )
        time.sleep(interval)


def child_env() -> dict[str, str]:
    """The environment for a ``python -m kvmeta`` child: this checkout's source first on its
    path (installed or not), no ``KVMETA_*`` setting of the caller's, and no drain window on
    SIGTERM (a test that wants one passes ``--drain-seconds``, which wins over the variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["KVMETA_DRAIN_SECONDS"] = "0"
    return env


# Servers started by this test process, by kind: a session summary reports how many tests
# still pay for a child process (``tests/conftest.py``).
STARTS = {"process": 0, "in_process": 0}


class Server:
    """What a test sees of a running server: its URL, its log, a JSON POST.

    ``ServerProcess`` (a child process) and ``InProcessServer`` (a thread of the test
    process) share it, so a helper taking a ``Server`` works with either."""

    url: str
    port: int

    @property
    def log(self) -> str:
        raise NotImplementedError

    @property
    def lines(self) -> list[str]:
        return self.log.splitlines(keepends=True)

    def wait_for_log(self, needle: str, timeout: float = 10.0) -> None:
        try:
            wait_until(lambda: needle in self.log, timeout, repr(needle))
        except AssertionError:
            raise AssertionError(f"{needle!r} not in server log:\n{self.log}") from None

    def post(self, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        if body is not None and not isinstance(body, (bytes, str)):
            return requests.post(self.url + path, json=body, timeout=30, **kwargs)
        return requests.post(self.url + path, data=body, timeout=30, **kwargs)


class ServerProcess(Server):
    """``kvmeta serve`` in a child process; ``url`` is set once it listens.

    Its stderr goes to an unnamed file, not a pipe: whatever the server logged before it
    answered a request is in ``log`` when the answer arrives (a thread draining a pipe could
    still be behind on a loaded machine).
    """

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None
    ) -> None:
        self.args = list(args)
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.port = 0
        self._stderr = -1  # a file descriptor

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log(self) -> str:
        if self._stderr < 0:
            return ""
        return os.pread(self._stderr, 1 << 30, 0).decode(errors="replace")

    def start(self, timeout: float = 20.0) -> ServerProcess:
        STARTS["process"] += 1
        args = list(self.args)
        if "--port" not in args:
            args += ["--port", "0"]
        env = child_env()
        env.update(self.env or {})
        if self._stderr < 0:
            self._stderr, path = tempfile.mkstemp(prefix="kvmeta-serve-", suffix=".log")
            os.unlink(path)
            weakref.finalize(self, os.close, self._stderr)
        else:
            os.ftruncate(self._stderr, 0)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmeta", "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=self.cwd,
        )
        self.url = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTEN_RE.search(self.log)
            if match:
                host = match.group(2)
                self.port = int(match.group(3))
                self.url = f"{match.group(1)}://{host}:{self.port}"
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvmeta serve exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"kvmeta serve did not start within {timeout}s:\n{self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the server and wait for it; returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"server ignored {sig} for {timeout}s:\n{self.log}") from None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cpu_seconds(self) -> float:
        """CPU time of the server (and the processes it started) so far."""
        return procstat.cpu_seconds(self.pid)


def until_released(server: ServerProcess, timeout: float = 60.0) -> None:
    """Until no pool of a restarted server holds pages for the previous run's leases any
    more (``held_after_restart``: the pages it kept from new writers after the restart)."""
    deadline = time.monotonic() + timeout
    while True:
        pools = requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]
        if not any(p.get("held_after_restart") for p in pools):
            return
        assert time.monotonic() < deadline, f"pages still held after {timeout} s: {pools}"
        time.sleep(0.1)


def unused_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A loopback URL that accepts connections and never answers (to test client timeouts)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for conn in accepted:
            conn.close()
        listener.close()


def kvmeta_check(data: Path) -> subprocess.CompletedProcess[str]:
    """``kvmeta check --data-dir data`` in another process, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "check", "--data-dir", str(data)],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
    )


def self_signed_cert(directory: Path, name: str = "") -> tuple[Path, Path]:
    """A fresh self-signed certificate for 127.0.0.1/localhost and its key (PEM, unencrypted),
    made by the ``openssl`` command."""
    cert, key = directory / f"{name}cert.pem", directory / f"{name}key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


class _ThreadLog(logging.Handler):
    """The log lines of one in-process server, rendered with its ``--log-format`` formatter."""

    def __init__(self, level: str, fmt: str) -> None:
        super().__init__(level.upper())
        from kvmeta.cli import log_formatter

        self.setFormatter(log_formatter(fmt))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + "\n")


_SERVER_THREADS: dict[int, _ThreadLog] = {}  # loop thread -> its server's log
_LOGS: list[_ThreadLog] = []  # the logs of the servers running
_CALL_HANDLERS = logging.Logger.callHandlers


def _server_logs(record: logging.LogRecord) -> list[_ThreadLog]:
    """The logs a record belongs to: its server's if a server's loop logged it; every running
    server's if a server's helper thread did (a ``kvmeta`` record of neither the test's main
    thread nor an in-process client); else none (the test's own)."""
    own = _SERVER_THREADS.get(record.thread or 0)
    if own is not None:
        return [own]
    if (
        _LOGS
        and record.thread != threading.main_thread().ident
        and record.name.startswith("kvmeta.")
        and not record.name.startswith("kvmeta.client")
    ):
        return list(_LOGS)
    return []


def _level_of_the_test(logger: logging.Logger) -> int:
    """The level ``logger`` has for the test's records: its own or its parents', passing over
    the ``kvmeta`` level set for the servers' records."""
    node: logging.Logger | None = logger
    kvmeta = logging.getLogger("kvmeta")
    while node is not None:
        if node.level and node is not kvmeta:
            return node.level
        node = node.parent
    return logging.NOTSET


def _call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
    """Records sorted as two processes would sort them: a server's go to its log only, never
    to the test's handlers (``caplog``, pytest's report), so that no server line can satisfy
    an assertion about a client's log or the other way round."""
    logs = _server_logs(record)
    if logs:
        for log in logs:
            if record.levelno >= log.level:
                log.handle(record)
        return
    if record.levelno >= _level_of_the_test(self):
        _CALL_HANDLERS(self, record)


def _attach(log: _ThreadLog) -> None:
    """While servers run, the ``kvmeta`` loggers make every record (a server applies its
    ``--log-level``; the test's records are held to the levels it set) and sort them."""
    _LOGS.append(log)
    logging.Logger.callHandlers = _call_handlers  # type: ignore[method-assign]
    logging.getLogger("kvmeta").setLevel(logging.DEBUG)


def _detach(log: _ThreadLog) -> None:
    if log in _LOGS:
        _LOGS.remove(log)
    if not _LOGS:
        logging.getLogger("kvmeta").setLevel(logging.NOTSET)
        logging.Logger.callHandlers = _CALL_HANDLERS  # type: ignore[method-assign]


def _reset_process_counters() -> None:
    """Zero the per-process series a fresh ``kvmeta serve`` starts with (``/metrics``): in a
    test process they would carry the counts of the servers of earlier tests."""
    from kvmeta.lograte import LIMITER
    from kvmeta.server import app, metrics

    for kind in app.CALLER_WARNINGS:
        app.CALLER_WARNINGS[kind] = 0
    metrics.PREFIX_HITS.__init__()  # type: ignore[misc]
    for dialect in metrics.REFUSED_BATCHES:
        metrics.REFUSED_BATCHES[dialect] = 0
    metrics.EVENTS.clear()
    LIMITER.reset()


class InProcessServer(Server):
    """The server ``kvmeta serve FLAGS`` runs, in a thread of the test process.

    The same flags parser, ``Settings`` and ``server.runner.run`` (backend, app, dialects,
    auth, guard, operator routes, metrics, HTTP server on uvloop): only the process is left
    out, so a request -> reply test pays no interpreter start-up and no imports. It listens on
    an ephemeral loopback port, so ``requests`` and raw sockets talk to it as to a child
    process. Tests where the process is the point (signals, exit codes, ``--workers``, fd
    limits, memory, crashes, the CLI, whatever it writes to stderr outside the log) use
    ``ServerProcess``; so do tests that time serving against load, which would share this
    interpreter's lock with the test here. Per-process series (caller warnings, prefix hits,
    refused batches) start at zero with each server, and servers running at once share them.
    """

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None
    ) -> None:
        self.args = list(args)
        self.env = env
        self.cwd = Path(cwd) if cwd is not None else None
        self.url = ""
        self.port = 0
        self.settings: Any = None
        self._handler: _ThreadLog | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None

    @property
    def log(self) -> str:
        return "".join(self._handler.lines) if self._handler else ""

    def _settings(self) -> Any:
        """Settings as ``kvmeta serve`` reads them: flags > environment > settings file."""
        from kvmeta.cli import build_parser
        from kvmeta.config import settings_from_args
        from kvmeta.config_file import config_path, load_config_file

        args = list(self.args)
        if "--port" not in args:
            args += ["--port", "0"]
        environ = child_env()
        environ.update(self.env or {})
        parsed = build_parser().parse_args(["serve", *args])
        path = config_path(parsed, environ)
        file_values = load_config_file(path) if path else None
        settings = settings_from_args(parsed, environ, file_values=file_values)
        assert settings.workers == 1, "--workers needs processes: use ServerProcess"
        if not Path(settings.data_dir).is_absolute():  # relative to a child process's cwd
            self.cwd = self.cwd or Path(tempfile.mkdtemp(prefix="kvmeta-"))
            settings = dataclasses.replace(settings, data_dir=str(self.cwd / settings.data_dir))
        return settings

    def start(self, timeout: float = 30.0) -> InProcessServer:
        """Raises what ``kvmeta serve`` would refuse to start with (``KvmetaError``)."""
        from kvmeta.server.runner import serve_checks

        STARTS["in_process"] += 1
        self.settings = settings = self._settings()
        serve_checks(settings)
        _reset_process_counters()
        handler = self._handler = _ThreadLog(settings.log_level, settings.log_format)
        _attach(handler)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(settings, started), name="kvmeta-inproc", daemon=True
        )
        self._thread.start()
        if not started.wait(timeout):
            self.stop()
            raise RuntimeError(f"kvmeta serve did not start within {timeout}s:\n{self.log}")
        if self._failure is not None:
            self._thread.join(timeout)
            self._thread = None
            self._detach()
            failure, self._failure = self._failure, None
            raise failure
        match = _LISTEN_RE.search(self.log)
        assert match, self.log
        self.port = int(match.group(3))
        self.url = f"{match.group(1)}://{match.group(2)}:{self.port}"
        return self

    def _serve(self, settings: Any, started: threading.Event) -> None:
        import uvloop

        from kvmeta.server.runner import run

        assert self._handler is not None
        _SERVER_THREADS[threading.get_ident()] = self._handler
        loop = self._loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            ready = asyncio.Event()
            stop = self._stop = asyncio.Event()
            task = asyncio.ensure_future(run(settings, ready=ready, stop=stop))
            waiter = asyncio.ensure_future(ready.wait())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            started.set()
            waiter.cancel()
            await task

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # a start-up refusal: raised by start() in the test
            self._failure = exc
        finally:
            started.set()
            loop.close()
            _SERVER_THREADS.pop(threading.get_ident(), None)

    def stop(self, timeout: float = 15.0) -> int:
        """Stop as SIGTERM does with no drain window (final snapshot, ``kvmeta stopped``)."""
        if self._thread is None:
            return 0
        loop, stop = self._loop, self._stop
        if self._thread.is_alive() and loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"server did not stop in {timeout}s:\n{self.log}"
        self._thread = None
        self._detach()
        if self._failure is not None and not isinstance(self._failure, SystemExit):
            raise self._failure
        return 0

    kill = stop

    def _detach(self) -> None:
        if self._handler is not None:
            _detach(self._handler)
