"""The append-only journal: records written by the event loop, made durable by a helper process.

``append`` encodes a record into an in-memory buffer (no syscall) and ``wait`` parks a reply
on a future. The first record of a group arms a timer (``call_later(interval)``; ``call_soon``
in ``always`` mode); when it fires, the loop writes the group to the segment file (a copy into
the page cache, cheap per KB) and asks the fsync helper (``store.disk.fsync_helper``, a small
separate process) to fdatasync it. The helper's reply wakes the waiting replies.

Why a process: a Python thread returning from fdatasync must take the GIL back from the busy
event loop, and that hand-over costs CPU in futex wake-ups and context switches on every
group: with a writer thread the journal added CPU to every request even with ``--fsync never``
(benchmarks/README.md, "Implementation costs"). The helper shares no GIL.

Failure (disk full, out of file descriptors, fsync failing, the helper dying over and over):
the journal stops writing at once (a half-written group must never be followed by more), every
waiter gets ``JournalFailed`` and so does every later ``wait``; ``failed`` says why. Records
appended meanwhile are only counted. The owner (``store.disk.local``) then refuses changes and,
once the cause is gone, writes a snapshot of the state in memory into a new segment number and
calls ``recovered``: everything up to then is durable again, and writing resumes in a fresh
segment. The old segment, whose tail may be torn, is covered by that snapshot and deleted. No
waiter is ever left unanswered: each path that stops writing answers them.

A stall (a hung mount, a dying disk: no error, the fsync just never returns) is no failure.
Once the fsync in progress is older than ``stall_timeout`` (``--fsync-timeout``), every waiter
gets ``JournalStalled`` (503) at once and ``refusal`` says why, so the owner refuses changes
meanwhile. Nothing is discarded: when the fsync completes, everything written is durable and
the stall ends by itself (no snapshot needed; one would wait for the same disk).

The loop blocks on the disk in two rare places only: ``rotate`` (once per snapshot: with the
default journal budget about once a second at most under a full load, ``store.disk.compaction``)
fdatasyncs the segment it closes, so that a segment is never torn unless it is the last one
(recovery cuts only a last torn segment), and ``close`` fdatasyncs the final group (unless
stalled). The helper has fsynced the closing segment up to its last group or two, so that
fdatasync has little left to write.

Segments: ``journal-<N>.log`` (N zero-padded), created on their first write. ``rotate`` starts
a new segment at a point the loop chooses, so a snapshot taken at that instant covers exactly
the segments before it and recovery replays only the segments from N on. Each segment's header
names the segment created before it (``codec.segment_header``), and ``on_new_segment`` is told
of each new segment once its header and directory entry are durable, before anything in it is
written or acknowledged (the owner records it in ``HEAD``, ``store.disk.history``): the third place
the loop waits for the disk, once per segment.

fsync modes:
- ``always``: a group closes at the end of the current loop iteration;
- ``batch``: a group closes ``interval`` seconds after its first record, so one fsync covers
  more requests (fewer fsyncs, a little more latency);
- ``never``: as ``batch`` but nothing is fsynced and nobody waits (no helper). A process crash
  loses at most the open group; an OS crash or power loss loses whatever the page cache had
  not written back, and a restored key may then point at a rewritten page.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kvmeta.errors import JournalFailed, JournalStalled
from kvmeta.store.disk.codec import (
    Clear,
    Record,
    RecordTooLarge,
    Remove,
    encode_records,
    segment_header,
)
from kvmeta.store.disk.fsync_link import HELPER, FsyncHelper
from kvmeta.store.disk.mounts import describe_disk

__all__ = [
    "DEFAULT_FSYNC_INTERVAL",
    "DEFAULT_FSYNC_TIMEOUT",
    "FSYNC_MODES",
    "Journal",
    "fsync_dir",
    "segment_path",
    "write_durably",
]

logger = logging.getLogger(__name__)

FSYNC_MODES = ("always", "batch", "never")
# batch mode: longest wait gathering a group before its fsync (seconds).
# 25 ms: measurably less CPU per request than 10 ms (fewer fsyncs and wake-ups; the figure is
# in benchmarks/README.md), while a waiting reply closes its group at once, so no reply waits
# for the timer.
DEFAULT_FSYNC_INTERVAL = 0.025
# An fsync older than this (seconds) means the disk stopped answering: a healthy local disk
# answers in milliseconds, and even a loaded one in well under a second; five seconds is long
# enough for a burst of write-back, short enough that a load balancer moves traffic away soon.
DEFAULT_FSYNC_TIMEOUT = 5.0
# Appends only need the data and the file size on disk, not the mtime: fdatasync is enough.
_sync = getattr(os, "fdatasync", os.fsync)
# The helper may die (OOM killer, an operator's kill); it is restarted, but this many exits
# within _HELPER_WINDOW seconds mean something is wrong with it: the journal fails.
_MAX_HELPER_STARTS = 5
_HELPER_WINDOW = 60.0
_REMOVALS = (Remove, Clear)


def segment_path(directory: Path, segment: int) -> Path:
    return directory / f"journal-{segment:012d}.log"


def fsync_dir(directory: Path) -> None:
    """Make a file's creation or rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` whole or not at all, durably: ``write`` fills a temporary beside it
    (``<name>.tmp``, which start-up deletes), then fsync, rename and a directory fsync, so a
    crash leaves the old file or the new one. A failure removes the temporary (a full disk must
    not keep a half-written one eating the space a retry needs) and raises."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class Journal:
    """One directory of segments, written from the event loop; every method runs on the loop."""

    def __init__(
        self,
        directory: Path,
        segment: int,
        *,
        mode: str = "batch",
        interval: float = DEFAULT_FSYNC_INTERVAL,
        stall_timeout: float = DEFAULT_FSYNC_TIMEOUT,
        loop: asyncio.AbstractEventLoop,
        previous: int = 0,
    ) -> None:
        """``previous``: the last segment created in ``directory`` before ``segment`` (0:
        none), which the next segment's header names."""
        if mode not in FSYNC_MODES:
            raise ValueError(f"fsync mode must be one of {FSYNC_MODES}, got {mode!r}")
        self.directory = directory
        self.mode = mode
        self.interval = interval
        self.stall_timeout = stall_timeout
        self.disk = describe_disk(directory)
        self.loop = loop
        self.waits = mode != "never"
        # Records appended so far, last removal, last written to the file, reported durable.
        self.seq = 0
        self.removal_seq = 0
        self.written_seq = 0
        self.durable_seq = 0
        self.segment = segment
        self.previous = previous
        # Told of each new segment (its number) once its header is durable; may raise OSError.
        self.on_new_segment: Callable[[int], None] | None = None
        self._buf = bytearray()
        self._timer: asyncio.Handle | None = None
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._ticket = 0
        self._failed: JournalFailed | None = None
        self.failed_at = 0.0  # wall-clock time of the failure (0: not failed)
        self.failed_seq = 0  # durable_seq when it failed: later records were not durable
        self.on_fail: Callable[[], None] | None = None
        # Called with the new durable position each time it advances (the change feed waits
        # for it: never announce what a crash can undo). None: no call.
        self.on_durable: Callable[[int], None] | None = None
        self._closed = False
        self._fd = -1
        self._fd_segment = -1
        self._helper: FsyncHelper | None = None
        self._helper_exits: deque[float] = deque(maxlen=_MAX_HELPER_STARTS)
        self._requested = 0  # highest seq the helper was asked to make durable
        # Stall watch: unanswered requests (seq, loop time sent), oldest first.
        self._outstanding: deque[tuple[int, float]] = deque()
        self._last_reply = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stalled_from: float | None = None  # loop time the stalled fsync began
        # Whether changes are refused now (failed or stalled: ``refusal`` says why), kept as a
        # plain attribute so the check before every change costs one attribute read.
        self.refusing = False
        self.stalls = 0
        # Told after a group is written once ``bytes_written`` has reached ``grow_at`` (0:
        # never): the owner's size-driven snapshot (``store.disk.compaction``) waits for it. One
        # comparison per group, so the journal never counts on its own.
        self.grow_at = 0
        self.on_grown: Callable[[], None] | None = None
        # Stats, for metrics.
        self.fsyncs = 0
        self.fsync_seconds_total = 0.0
        self.fsync_seconds_max = 0.0
        self.bytes_written = 0
        self.records = 0

    # ------------------------------------------------------------------ records

    @property
    def failed(self) -> JournalFailed | None:
        """Why the journal stopped writing (None while it works)."""
        return self._failed

    @property
    def stalled(self) -> bool:
        """Whether the fsync in progress is older than ``stall_timeout`` (see the module
        docstring); it ends when the helper answers."""
        return self._stalled_from is not None

    def refusal(self) -> JournalFailed | None:
        """The error to refuse a change with now: the journal failed, or its fsync is stalled
        (None: changes are welcome)."""
        if self._failed is not None:
            return JournalFailed(str(self._failed))
        if self.stalled:
            return self._stall_error()
        return None

    def fsync_pending_seconds(self) -> float:
        """Age of the fsync the helper is working on: since the oldest request it has not
        answered was sent, or since its last answer if later (0: nothing outstanding)."""
        if not self._outstanding:
            return 0.0
        return max(0.0, self.loop.time() - self._busy_since())

    def start(self) -> None:
        """Raises OSError when the helper cannot be started (e.g. no file descriptors)."""
        if self.waits:
            self._start_helper()

    def append(self, record: Record) -> None:
        """Buffer one record (split in several when too big for one frame: the reader refuses
        frames over ``codec.MAX_PAYLOAD``); never blocks on disk (``ChangeSink``)."""
        try:
            frames = encode_records(record)
        except RecordTooLarge as exc:
            # The change is applied in memory already: stop journaling, and the recovery
            # snapshot (which has no per-record limit) makes it durable.
            frames = []
            self._fail(str(exc), "Lower the limit named above")
        self.seq += len(frames) or 1
        if isinstance(record, _REMOVALS):
            self.removal_seq = self.seq
        self.records += len(frames) or 1
        if self._failed is not None:
            return  # nothing is written until ``recovered``: the snapshot will hold it
        for frame in frames:
            self._buf += frame
        if self._timer is None:
            if self.mode == "always":
                self._timer = self.loop.call_soon(self.flush)
            else:
                self._timer = self.loop.call_later(self.interval, self.flush)

    def flush(self) -> None:
        """Close the open group: write it to the segment file and ask for its fsync."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._buf or self._failed is not None:
            return
        data, self._buf = self._buf, bytearray()
        try:
            self._write(data)
        except OSError as exc:
            self._fail(f"cannot write {segment_path(self.directory, self.segment)}: {exc}")
            return
        self.written_seq = self.seq
        self._request()
        if self.grow_at and self.bytes_written >= self.grow_at and self.on_grown is not None:
            self.on_grown()

    def rotate(self) -> int:
        """Start a new segment; records appended from now on go to it. Returns its number.

        Raises:
            StorageError: the closing segment could not be made durable.
        """
        self._close_segment()
        if self._failed is not None:
            raise JournalFailed(str(self._failed))
        self.segment += 1
        return self.segment

    def restart_segment(self) -> int:
        """While failed: the segment number a recovery snapshot starts at (a new one, never
        the segment whose tail may be torn). Writing stays stopped until ``recovered``."""
        self._close_fd()
        self.segment += 1
        return self.segment

    def recovered(self, seq: int) -> None:
        """A snapshot holding every record up to ``seq`` (the last appended) is durable:
        resume writing, in the segment ``restart_segment`` returned.

        Raises:
            OSError: the fsync helper cannot be started; the journal stays failed.
        """
        assert self._failed is not None and seq == self.seq
        if self.waits and self._helper is None:
            self._helper_exits.clear()
            self._start_helper()
        self._buf = bytearray()
        self._failed = None
        self.refusing = self._stalled_from is not None
        self.failed_at = 0.0
        self.written_seq = self._requested = seq
        self._on_durable(seq)

    async def wait(self, seq: int) -> None:
        """Until record ``seq`` is durable (at once in ``never`` mode).

        Raises:
            StorageError: the journal could not be written; the change may not survive a crash.
        """
        if self._failed is not None:
            raise JournalFailed(str(self._failed))
        if not self.waits or self.durable_seq >= seq:
            return
        if self.stalled:
            raise self._stall_error()
        if seq > self.written_seq:
            self.flush()  # someone is waiting: close the group now rather than at its timer
            if self._failed is not None:  # that write failed and answered every waiter
                raise JournalFailed(str(self._failed))
        if self._closed:
            raise JournalFailed(
                f"the journal in {self.directory} is closed (kvmeta is shutting down); this "
                "change may not be durable"
            )
        fut: asyncio.Future[None] = self.loop.create_future()
        self._ticket += 1
        heapq.heappush(self._waiters, (seq, self._ticket, fut))
        await fut

    async def close(self) -> None:
        """Write and fsync everything buffered, then stop the helper. While stalled, only
        write: an fsync on the loop would hang the shutdown (a second signal too) for as long
        as the disk does, and the page cache keeps what was written when the process exits."""
        self._closed = True
        self._cancel_stall_timer()
        if self.stalled:
            self.flush()
            self._close_fd()
        else:
            self._close_segment()
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.stop(self.stall_timeout)

    def _close_segment(self) -> None:
        """Write the open group and fdatasync and close the segment file, on the loop (rotation
        and shutdown only): everything written is then durable."""
        self.flush()
        if self._fd < 0:
            return
        try:
            _sync(self._fd)
        except OSError as exc:
            self._fail(f"cannot fsync {segment_path(self.directory, self._fd_segment)}: {exc}")
        self._close_fd()
        if self._failed is None:
            self._on_durable(self.written_seq)

    def _close_fd(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._fd_segment = -1, -1

    def _write(self, data: bytearray) -> None:
        if self._fd_segment != self.segment or self._fd < 0:
            self._open_segment()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.bytes_written += len(data)

    def _open_segment(self) -> None:
        """Open the current segment, creating it with its header when new."""
        path = segment_path(self.directory, self.segment)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._fd, self._fd_segment = fd, self.segment
        if os.fstat(fd).st_size:
            return
        header = segment_header(self.segment, self.previous)
        os.write(fd, header)
        self.bytes_written += len(header)
        self.previous = self.segment
        if self.on_new_segment is not None:
            _sync(fd)
            fsync_dir(self.directory)
            self.on_new_segment(self.segment)

    def _on_durable(self, seq: int) -> None:
        if seq > self.durable_seq:
            self.durable_seq = seq
        self._prune()
        waiters = self._waiters
        while waiters and waiters[0][0] <= seq:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)
        if self.on_durable is not None:
            self.on_durable(self.durable_seq)

    def _fail(self, reason: str, fix: str = "") -> None:
        """Stop writing (a half-written group must not be followed by more), answer every
        waiter, and tell the owner (``on_fail``), which refuses changes until ``recovered``."""
        if self._failed is not None:
            return
        fix = fix or (
            f"Free space on the file system of {self.directory}, raise the open-files limit "
            "(ulimit -n), or fix its permissions"
        )
        error = JournalFailed(
            f"journal in data directory {self.directory} failed: {reason}. Changes are "
            f"refused (503) until it can write again; reads keep working. {fix}: kvmeta "
            "retries every few seconds and recovers by itself (do not restart it meanwhile: "
            "changes acknowledged since the failure are only in memory until then)"
        )
        logger.error("%s", error)
        self._failed = error
        self.refusing = True
        self.failed_at = time.time()
        self.failed_seq = self.durable_seq
        self._buf = bytearray()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._cancel_stall_timer()
        self._stalled_from = None  # the failure says more, and its recovery ends both
        self._close_fd()  # a descriptor back (EMFILE); never written again
        waiters, self._waiters = self._waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_exception(JournalFailed(str(error)))
        if self.on_fail is not None:
            self.on_fail()

    # ------------------------------------------------------------------ stall watch

    def _busy_since(self) -> float:
        return max(self._outstanding[0][1], self._last_reply)

    def _prune(self) -> None:
        """Forget the requests that are answered: everything up to ``durable_seq``."""
        outstanding = self._outstanding
        while outstanding and outstanding[0][0] <= self.durable_seq:
            outstanding.popleft()

    def _watch(self) -> None:
        """Arm the check of the fsync in progress, due when it turns ``stall_timeout`` old."""
        if self._stall_timer is not None or not self._outstanding or self.stalled:
            return
        due = self._busy_since() + self.stall_timeout
        self._stall_timer = self.loop.call_at(due, self._check_stall)

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _check_stall(self) -> None:
        self._stall_timer = None
        if not self._outstanding or self.stalled or self._failed is not None or self._closed:
            return
        if self.loop.time() - self._busy_since() < self.stall_timeout:
            self._watch()  # the helper answered meanwhile: check its current fsync
            return
        self._stalled_from = self._busy_since()
        self.refusing = True
        self.stalls += 1
        error = self._stall_error()
        logger.error("%s", error)
        waiters, self._waiters = self._waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_exception(self._stall_error())

    def _answered(self, durable: int) -> None:
        """The helper answered (up to ``durable``, or 0 for a segment compacted meanwhile): it
        and the disk are alive, so a stall ends here."""
        self._last_reply = self.loop.time()
        if durable:
            self._on_durable(durable)
        self._prune()
        if self._stalled_from is not None:
            took = self._last_reply - self._stalled_from
            self._stalled_from = None
            self.refusing = self._failed is not None
            logger.warning(
                "the journal's fsync in %s completed after %.1f s: the disk answers again; "
                "everything acknowledged or refused while it hung is durable now, and changes "
                "are accepted again",
                self.directory,
                took,
            )
        self._cancel_stall_timer()
        self._watch()

    def _stall_error(self) -> JournalStalled:
        since = self._stalled_from
        age = self.stall_timeout if since is None else self.loop.time() - since
        return JournalStalled(
            f"the disk holding data directory {self.directory} ({self.disk}) stopped "
            f"answering: the journal's fsync has not completed in {age:.1f} s (--fsync-timeout "
            f"{self.stall_timeout:g}). Changes are refused (503) until it does; reads keep "
            "working. A change refused with this after it was applied (a confirm, delete or "
            "clear waiting for its fsync) stays applied in memory and becomes durable when the "
            "fsync completes: retry it then. Check the disk and its mount (dmesg; the NFS or "
            "iSCSI server); kvmeta resumes by itself"
        )

    # ------------------------------------------------------------------ fsync helper

    def _start_helper(self) -> None:
        self._helper = FsyncHelper(
            self.loop, self.directory, self._on_answers, self._fail, self._helper_exited
        )
        self._requested = 0
        self._outstanding.clear()  # the new helper is asked again, from now
        self._request()

    def _request(self) -> None:
        """Ask the helper to make everything written so far durable (unless already asked).

        The pipe is non-blocking: when it is full the helper is busy, and the request goes out
        when its next reply arrives."""
        helper = self._helper
        if helper is None or self._requested >= self.written_seq or self._fd_segment < 0:
            return
        if not helper.request(self.written_seq, segment_path(self.directory, self._fd_segment)):
            return
        self._requested = self.written_seq
        self._outstanding.append((self.written_seq, self.loop.time()))
        self._watch()

    def _on_answers(self, durable: int, seconds: list[float]) -> None:
        for took in seconds:
            self.fsyncs += 1
            self.fsync_seconds_total += took
            self.fsync_seconds_max = max(self.fsync_seconds_max, took)
        if seconds:
            self._answered(durable)
        self._request()

    def _helper_exited(self, helper: FsyncHelper) -> None:
        code = helper.stop(self.stall_timeout)
        self._helper = None
        if self._closed or self._failed is not None:
            return
        now = time.monotonic()
        exits = self._helper_exits
        exits.append(now)
        if len(exits) == exits.maxlen and now - exits[0] <= _HELPER_WINDOW:
            self._fail(
                f"the journal's fsync helper process ({HELPER}) exited (code {code}) "
                f"{len(exits)} times in {now - exits[0]:.0f} s",
                "Check what kills it (dmesg for the OOM killer) or run it by hand "
                "(python -I -S <path>)",
            )
            return
        logger.warning("the journal's fsync helper exited (code %s); starting a new one", code)
        try:
            self._start_helper()
        except OSError as exc:
            self._fail(f"cannot start the journal's fsync helper ({HELPER}): {exc}")
