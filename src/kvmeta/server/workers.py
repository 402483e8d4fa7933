"""``kvmeta serve --workers N``: N server processes sharing one port, supervised by a parent.

Each worker is a full server (its own event loop and Redis connections); state is in the shared
backend, which is why config refuses ``--workers`` without one. The parent binds the listening
socket once, without SO_REUSEPORT, and every forked worker accepts on that same socket (the
kernel hands each new connection to one of them). Why not SO_REUSEPORT per worker: the kernel
would then let any other process of the same user join the port, and a second ``--workers``
group (say, with another ``--backend``) would silently split the clients with this one. Binding
once makes a second server on the port fail at start-up with one clear line, and ``--port 0``
needs nothing special. The parent only supervises: it forwards SIGTERM/SIGINT
to the workers (which are in their own process group, so a terminal's Ctrl-C reaches them once,
through the parent), restarts a worker that dies, and gives up if workers keep dying at start-up.
Each worker drains on SIGTERM itself (``--drain-seconds``), so every worker's ``/ready`` answers
503 for the window. The start-up facts are logged once, by the first worker's first start.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from kvmeta.config import Settings
from kvmeta.errors import KvmetaError
from kvmeta.server.http import bind_sockets

__all__ = ["run_workers"]

logger = logging.getLogger("kvmeta.server")

# A worker that dies this soon after starting counts as a start-up failure; this many in a row
# (e.g. Redis unreachable, port taken) stop the whole server instead of looping forever.
_FAST_FAIL_SECONDS = 2.0
_MAX_FAST_FAILS = 3
_PR_SET_PDEATHSIG = 1


ServeOne = Callable[[Settings, list[socket.socket], bool], None]


def _worker_main(
    index: int,
    settings: Settings,
    serve_one: ServeOne,
    sockets: list[socket.socket],
    parent: int,
    announce: bool,
) -> None:
    os.setpgid(0, 0)  # signals come from the parent only (see module docstring)
    if sys.platform == "linux":
        # Die with the parent even if it is SIGKILLed, instead of serving on as an orphan.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # The parent died before the line above took effect. Compared with the parent's own
        # pid, not with 1: in a container the parent is pid 1, and every worker would leave.
        if os.getppid() != parent:
            return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Forked with the supervisor's SIGHUP handler, which would send SIGHUP on to the workers
    # started before this one: ignore it until the worker's loop takes SIGHUP over (a worker
    # reads the tokens file after this point, so it misses no reload).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        serve_one(settings, sockets, announce)
    except KvmetaError as exc:
        logger.error("worker %d: %s", index, exc)
        sys.exit(2)


class _Supervisor:
    def __init__(
        self, settings: Settings, serve_one: ServeOne, sockets: list[socket.socket]
    ) -> None:
        self.settings = settings
        self.serve_one = serve_one
        self.sockets = sockets
        self.ctx = multiprocessing.get_context("fork")
        self.workers: dict[int, tuple[BaseProcess, float]] = {}
        self.stopping = False
        self.fast_fails = 0
        self.gave_up = False
        self.announced = False

    def spawn(self, index: int) -> None:
        announce = not self.announced
        self.announced = True
        proc = self.ctx.Process(
            target=_worker_main,
            args=(index, self.settings, self.serve_one, self.sockets, os.getpid(), announce),
            name=f"kvmeta-worker-{index}",
            daemon=False,
        )
        proc.start()
        self.workers[index] = (proc, time.monotonic())

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Pass the signal on: each worker drains on SIGTERM, stops on SIGINT or a second one."""
        if not self.stopping:
            logger.info(
                "received %s: stopping %d workers", signal.Signals(signum).name, len(self.workers)
            )
        self.stopping = True
        self.signal_workers(signum)

    def signal_workers(self, signum: int) -> None:
        for proc, _ in self.workers.values():
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signum)

    def on_hangup(self, signum: int, frame: FrameType | None) -> None:
        """SIGHUP: each worker re-reads the tokens file (--auth-file)."""
        for proc, _ in self.workers.values():
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGHUP)

    def reap(self) -> int:
        """Wait for workers; restart crashed ones unless stopping. Returns the exit code."""
        status = 0
        while self.workers:
            sentinels = {proc.sentinel: index for index, (proc, _) in self.workers.items()}
            for sentinel in wait(list(sentinels), timeout=1.0):
                index = sentinels[sentinel]  # type: ignore[index]
                proc, started = self.workers.pop(index)
                proc.join()
                code = proc.exitcode or 0
                proc.close()
                status = max(status, abs(code))
                if not self.stopping:
                    self._restart(index, code, started)
        # Workers that ended cleanly but at once still failed to serve: a service manager must
        # see a failure to restart the server.
        return max(status, 1) if self.gave_up else status

    def _restart(self, index: int, code: int, started: float) -> None:
        fast = time.monotonic() - started < _FAST_FAIL_SECONDS
        self.fast_fails = self.fast_fails + 1 if fast else 0
        if self.fast_fails >= _MAX_FAST_FAILS:
            logger.error("workers keep failing at start-up (exit %d): stopping", code)
            self.stopping = self.gave_up = True
            self.signal_workers(signal.SIGINT)  # no drain: they are not serving
            return
        logger.warning("worker %d exited with %d: restarting it", index, code)
        if fast:
            time.sleep(1.0)
        self.spawn(index)


def run_workers(settings: Settings, serve_one: ServeOne) -> int:
    """Run ``settings.workers`` copies of ``serve_one`` on one port until signalled.

    Raises:
        CannotListen: the port is taken (by anyone, another kvmeta group included).
    """
    sockets = bind_sockets(settings.host, settings.port)
    settings = replace(settings, port=sockets[0].getsockname()[1])
    supervisor = _Supervisor(settings, serve_one, sockets)
    previous = {s: signal.signal(s, supervisor.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, supervisor.on_hangup)
    try:
        for index in range(settings.workers):
            supervisor.spawn(index)
        logger.info("started %d workers on port %d", settings.workers, settings.port)
        return supervisor.reap()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for sock in sockets:
            sock.close()
