"""The journal's side of the fsync helper process (``store.disk.fsync_helper``).

One ``FsyncHelper`` is one running helper: it is asked, over a non-blocking pipe, to fdatasync
a segment up to a record, and its answers are read on the event loop and handed to the
journal, which owns every decision (what to ask, what a failure means, whether to start a
new helper after one exited). A process rather than a thread: see ``store.disk.journal``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["HELPER", "FsyncHelper"]

HELPER = str(Path(__file__).with_name("fsync_helper.py"))


class FsyncHelper:
    """A started helper process and its two pipes, read and written on ``loop``.

    ``on_answers(durable, seconds)``: the helper answered; ``durable`` is the highest record
    it made durable (0: none, e.g. a segment compacted meanwhile) and ``seconds`` how long each
    fdatasync took. ``on_error(reason)``: it reported a failed fsync or said something it
    should not. ``on_exit(helper)``: its pipe closed (it exited).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        directory: Path,
        on_answers: Callable[[int, list[float]], None],
        on_error: Callable[[str], None],
        on_exit: Callable[[FsyncHelper], None],
    ) -> None:
        """Raises OSError when the process cannot be started (e.g. no file descriptors)."""
        self.loop = loop
        self.directory = directory
        self.on_answers = on_answers
        self.on_error = on_error
        self.on_exit = on_exit
        self._replies = b""
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", HELPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
            start_new_session=True,  # Ctrl-C stops the server, which then stops the helper
        )
        assert process.stdin is not None and process.stdout is not None
        self._stdin, self._stdout = process.stdin, process.stdout
        os.set_blocking(self._stdin.fileno(), False)
        os.set_blocking(self._stdout.fileno(), False)
        loop.add_reader(self._stdout.fileno(), self._on_reply)
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def request(self, seq: int, segment: Path) -> bool:
        """Ask for ``segment`` to be durable up to record ``seq``; False when the request did
        not go out (the pipe is full: the helper is busy; or it died: its reader sees EOF)."""
        try:
            os.write(self._stdin.fileno(), b"%d %s\n" % (seq, os.fsencode(segment)))
        except OSError:  # BlockingIOError included
            return False
        return True

    def _on_reply(self) -> None:
        try:
            data = os.read(self._stdout.fileno(), 65536)
        except BlockingIOError:
            return
        if not data:
            self.on_exit(self)
            return
        lines, _, self._replies = (self._replies + data).rpartition(b"\n")
        durable = 0
        seconds: list[float] = []
        for line in lines.split(b"\n") if lines else ():
            if line.startswith(b"E "):
                message = line[2:].decode(errors="replace")
                self.on_error(f"cannot fsync the journal in {self.directory}: {message}")
                return
            try:
                seq, micros = line.split()
                seconds.append(int(micros) / 1e6)
            except ValueError:
                self.on_error(f"the journal's fsync helper ({HELPER}) answered {line[:80]!r}")
                return
            durable = max(durable, int(seq))
        self.on_answers(durable, seconds)

    def stop(self, timeout: float) -> int:
        """Close its pipes (it exits when stdin closes) and reap it; returns its exit code.

        A helper stuck in an fsync gets ``timeout`` to finish, then SIGKILL; one the kernel
        holds in the fsync even so is left to exit by itself (-1)."""
        self.loop.remove_reader(self._stdout.fileno())
        try:
            self._stdin.close()
        except OSError:
            pass  # a dead helper's pipe: EPIPE on the last flush
        code = -1
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(timeout)
        self._stdout.close()
        return code
