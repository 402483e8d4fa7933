"""The append-only journal: records buffered by the event loop, written and fsynced by a thread.

The event loop never touches the disk: ``append`` encodes a record into an in-memory buffer
(one lock, no syscalls) and ``wait`` parks a reply on a future. A background thread swaps the
buffer out, writes it to the current segment file and fsyncs it (group commit: every record
buffered while the previous fsync ran goes down in the next one), then wakes the waiting
replies through ``call_soon_threadsafe``.

Segments: ``journal-<N>.log`` (N zero-padded). ``rotate`` starts a new segment at a point the
loop chooses, so a snapshot taken at that instant covers exactly the segments before it and
recovery replays only the segments from N on.

fsync modes:
- ``always``: the thread writes and fsyncs as soon as anything is buffered;
- ``batch``: it waits up to ``interval`` seconds after the first buffered record, so one fsync
  covers more requests (fewer fsyncs, a little more latency);
- ``never``: it writes every ``interval`` seconds and never fsyncs; nobody waits. A process
  crash loses at most the buffered records; an OS crash or power loss loses whatever the page
  cache had not written back, and a restored key may then point at a rewritten page.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvmeta.errors import StorageError
from kvmeta.store.codec import HEADER, encode_record

__all__ = ["DEFAULT_FSYNC_INTERVAL", "FSYNC_MODES", "Journal", "fsync_dir", "segment_path"]

logger = logging.getLogger(__name__)

FSYNC_MODES = ("always", "batch", "never")
# batch mode: longest wait gathering a group before its fsync (seconds).
DEFAULT_FSYNC_INTERVAL = 0.01
# Appends only need the data and the file size on disk, not the mtime: fdatasync is enough.
_sync = getattr(os, "fdatasync", os.fsync)
_REMOVALS = ("remove", "clear")


def segment_path(directory: Path, segment: int) -> Path:
    return directory / f"journal-{segment:012d}.log"


def fsync_dir(directory: Path) -> None:
    """Make a file's creation or rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """One writer thread over one directory of segments. ``append``/``rotate``/``wait`` are
    called from the event loop only."""

    def __init__(
        self,
        directory: Path,
        segment: int,
        *,
        mode: str = "batch",
        interval: float = DEFAULT_FSYNC_INTERVAL,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        if mode not in FSYNC_MODES:
            raise ValueError(f"fsync mode must be one of {FSYNC_MODES}, got {mode!r}")
        self.directory = directory
        self.mode = mode
        self.interval = interval
        self.loop = loop
        self.waits = mode != "never"
        # Loop side: records appended so far, last removal, what the thread reported durable.
        self.seq = 0
        self.removal_seq = 0
        self.durable_seq = 0
        self.segment = segment
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._ticket = 0
        self._failed: StorageError | None = None
        # Shared with the thread, under _lock.
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._buf_seq = 0
        self._sealed: list[tuple[int, bytearray]] = []
        self._kick = threading.Event()
        self._kicked = False
        self._stopping = False
        # Thread side.
        self._fd = -1
        self._fd_segment = -1
        self._thread = threading.Thread(target=self._run, name="kvmeta-journal", daemon=True)
        # Stats (written by the thread, read anywhere: plain numbers, torn reads impossible).
        self.fsyncs = 0
        self.fsync_seconds_total = 0.0
        self.fsync_seconds_max = 0.0
        self.bytes_written = 0
        self.records = 0

    # ------------------------------------------------------------------ loop side

    def start(self) -> None:
        self._thread.start()

    def append(self, record: tuple[Any, ...]) -> None:
        """Buffer one record; never blocks on disk (``ChangeSink``)."""
        frame = encode_record(record)
        with self._lock:
            self._buf += frame
            self.seq += 1
            self._buf_seq = self.seq
            if not self._kicked:
                self._kicked = True
                self._kick.set()
        if record[0] in _REMOVALS:
            self.removal_seq = self.seq
        self.records += 1

    def rotate(self) -> int:
        """Start a new segment; records appended from now on go to it. Returns its number."""
        with self._lock:
            self._sealed.append((self.segment, self._buf))
            self._buf = bytearray()
            self.segment += 1
            if not self._kicked:
                self._kicked = True
                self._kick.set()
            return self.segment

    async def wait(self, seq: int) -> None:
        """Until record ``seq`` is durable (at once in ``never`` mode).

        Raises:
            StorageError: the journal could not be written; the change may not survive a crash.
        """
        if self._failed is not None:
            raise self._failed
        if not self.waits or self.durable_seq >= seq:
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._ticket += 1
        heapq.heappush(self._waiters, (seq, self._ticket, fut))
        await fut

    def _on_durable(self, seq: int) -> None:
        if seq > self.durable_seq:
            self.durable_seq = seq
        waiters = self._waiters
        while waiters and waiters[0][0] <= seq:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)

    def _on_failure(self, error: StorageError) -> None:
        self._failed = error
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(error)
        self._waiters.clear()

    async def close(self) -> None:
        """Write and fsync everything buffered, then stop the thread."""
        with self._lock:
            self._stopping = True
            self._kick.set()
        await asyncio.to_thread(self._thread.join)
        self._on_durable(self.seq)

    # ------------------------------------------------------------------ thread side

    def _run(self) -> None:
        try:
            while True:
                self._kick.wait()
                if self.mode != "always":
                    time.sleep(self.interval)
                with self._lock:
                    sealed, self._sealed = self._sealed, []
                    buf, self._buf = self._buf, bytearray()
                    seq, segment, stopping = self._buf_seq, self.segment, self._stopping
                    self._kicked = False
                    self._kick.clear()
                for old_segment, data in sealed:
                    if data:  # an empty sealed segment needs no file (a snapshot covers it)
                        self._write(old_segment, data)
                self._write(segment, buf)
                if self.mode != "never" or stopping:
                    self._fsync()
                if self.waits:
                    self.loop.call_soon_threadsafe(self._on_durable, seq)
                if stopping:
                    break
        except OSError as exc:
            error = StorageError(
                f"cannot write the journal in {self.directory}: {exc}; changes since the last "
                "durable group may not survive a crash. Free disk space or fix permissions, then "
                "restart kvmeta."
            )
            logger.error("%s", error)
            self.loop.call_soon_threadsafe(self._on_failure, error)
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _write(self, segment: int, data: bytearray) -> None:
        if segment != self._fd_segment:
            self._open(segment)
        if not data:
            return
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.bytes_written += len(data)

    def _open(self, segment: int) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
        path = segment_path(self.directory, segment)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size == 0:
            os.write(fd, HEADER)
            os.fsync(fd)
            fsync_dir(self.directory)
        self._fd, self._fd_segment = fd, segment

    def _fsync(self) -> None:
        started = time.perf_counter()
        _sync(self._fd)
        took = time.perf_counter() - started
        self.fsyncs += 1
        self.fsync_seconds_total += took
        if took > self.fsync_seconds_max:
            self.fsync_seconds_max = took
