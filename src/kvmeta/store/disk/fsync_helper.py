"""The journal's fsync process: makes segment files durable on request, nothing else.

Run by ``store.disk.journal`` as ``python -I -S fsync_helper.py`` (standard library only, so it
starts quickly). Protocol, one line per message on stdin/stdout:

- request ``<seq> <path>``: records up to ``seq`` are written to ``path``; make them durable;
- reply ``<seq> <microseconds>``: done (the time the fdatasync took), or ``E <message>``.

Requests that arrive while a sync runs are answered together by the next one (group commit).
The first sync of a path also syncs its directory, so a new segment's name is durable too.
The process exits when stdin closes, so it never outlives the server.

Why a process and not a thread: a Python thread that returns from fdatasync must take the GIL
back from the busy event loop, and each hand-over costs CPU in futex wake-ups, two or more
per group (measured in benchmarks/README.md, "Implementation costs"). This process has its own
interpreter and no GIL to share; its only cost is the fsync itself.
"""

from __future__ import annotations

import os
import sys
import time

_sync = getattr(os, "fdatasync", os.fsync)


def _sync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def serve(rfd: int, wfd: int) -> None:
    fd, fd_path = -1, ""
    pending = b""
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            return
        pending += chunk
        if b"\n" not in pending:
            continue
        lines, pending = pending.rsplit(b"\n", 1)
        # In order: a later path's records count only once every earlier path is synced.
        seq = 0
        try:
            new_dir = ""
            for line in lines.split(b"\n"):
                number, path = line.decode().split(" ", 1)
                if path != fd_path:
                    if fd >= 0:
                        _sync(fd)
                        os.close(fd)
                        fd = -1
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError:
                        # Compacted away after a snapshot: the server fsynced it at rotation.
                        fd_path = ""
                        continue
                    fd_path = new_dir = path
                seq = max(seq, int(number))
            started = time.perf_counter()
            if fd >= 0:
                _sync(fd)
            if new_dir:
                _sync_dir(new_dir)
            took = int((time.perf_counter() - started) * 1e6)
            reply = b"%d %d\n" % (seq, took)
        except (OSError, ValueError) as exc:
            reply = b"E " + str(exc).replace("\n", " ").encode() + b"\n"
        os.write(wfd, reply)


if __name__ == "__main__":
    try:
        serve(sys.stdin.fileno(), sys.stdout.fileno())
    except KeyboardInterrupt:  # the server's Ctrl-C reaches the whole process group
        pass
