"""Start ``kvmeta serve`` as a child process for a benchmark, on a free port.

The server runs this interpreter and the kvmeta package this module came from, so a checkout
benchmarks its own source whether installed or not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvmeta.errors import KvmetaError

__all__ = ["LaunchedServer"]

_LISTEN_RE = re.compile(r"kvmeta listening on (http)://([^\s:]+):(\d+) \(pid (\d+)\)")
_SRC = str(Path(__file__).resolve().parents[2])


class LaunchedServer:
    """``kvmeta serve`` in ``mode`` "memory" (``--in-memory``) or "durable" (the default,
    journal in a temporary data directory); a context manager that stops it on exit."""

    def __init__(
        self, mode: str = "durable", extra: list[str] | None = None, src: str | None = None
    ) -> None:
        if mode not in ("memory", "durable"):
            raise ValueError(f"launch mode must be 'memory' or 'durable', got {mode!r}")
        self.mode = mode
        self.extra = list(extra or [])
        self.src = src or _SRC  # another checkout's src/ serves before/after comparisons
        self.url = ""
        self.pid = 0
        self.lines: list[str] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvmeta-bench-")
        args = ["--host", "127.0.0.1", "--port", "0", *self.extra]
        if self.mode == "memory":
            args.append("--in-memory")
        else:
            args += ["--data-dir", os.path.join(self._tmp.name, "data")]
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
        while not self.url:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = "".join(self.lines[-20:]).strip() or "(no output)"
                raise KvmetaError(
                    f"the launched `kvmeta serve {' '.join(args)}` did not start; its log:\n{log}"
                )
            time.sleep(0.02)
        self.pid = self._proc.pid

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            if len(self.lines) < 1000:
                self.lines.append(line)
            match = _LISTEN_RE.search(line)
            if match and not self.url:
                self.url = f"http://{match.group(2)}:{match.group(3)}"

    def stop(self) -> None:
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            if self._reader is not None:
                self._reader.join(5)
            if proc.stderr is not None:
                proc.stderr.close()
            self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
