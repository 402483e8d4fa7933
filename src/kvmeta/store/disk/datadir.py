"""The files of a durable local backend: its data directory (journal, snapshots) and the
SGLang persistence file, and the background work that keeps them (``DataDir``). The requests'
side of durability, what waits for the disk, is ``store.disk.local``.

Start-up recovers the data directory (snapshot + journal replay), or imports an SGLang
persistence file into an empty one (as one snapshot, before any journal record: all or
nothing). While serving, every durable change goes to the journal and ``LocalBackend`` makes
replies wait as the write-ahead rule needs (docs/durability.md):

- initialize (pool creation, vLLM rank registration) waits until it is durable
  (``--fsync always|batch``): engines must never see "not initialized" after a restart;
- a reserve reply waits only when it hands out a page while a removal (eviction, delete,
  clear) is not yet durable: a crash must never bring back ``old key -> page`` once that page
  may hold a new key's bytes. Pure hits never wait;
- ``--fsync always``: confirm, delete and clear replies also wait, so every acknowledged
  change survives a crash. ``batch`` does not make them wait: a crash may forget the last
  group's confirms (a cache miss, never wrong data: their pages come back FREE, and a page is
  handed out again only after its removal is durable) and bring back keys whose delete was
  not yet durable (their pages were not handed out since, by the rule above). Waiting there
  would multiply the CPU per request, because each waiting reply is a task, a future and a
  wake-up, and each fdatasync costs CPU too (benchmarks/README.md, "Implementation costs").

Journal failure (disk full, out of file descriptors, fsync failing): from the first failed
write on, every change (initialize, reserve, confirm, delete, clear, vLLM register/clear) is
refused with ``JournalFailed`` (503) *before* it touches the state, ``ready()`` is False and
``failure`` says why; reads keep working. A background task retries about every second (backing
off to 8 s) by writing a snapshot of the in-memory state at a new segment number: the state
holds every change that was acknowledged (in ``batch`` mode confirms are acknowledged before
their fsync), so once that snapshot is durable nothing acknowledged is lost, the torn segment
is deleted, and writing resumes in a fresh segment. The window: if the process dies while the
journal is failed, changes acknowledged after the last durable group are lost (``batch``:
confirms and deletes of up to one group before the failure; ``always``: nothing acknowledged).

Journal stall (an fsync older than ``--fsync-timeout``: the disk stopped answering): the same
refusals and the same not-ready, but the replies waiting for that fsync are answered 503 too
(their changes stay applied in memory), and it ends by itself when the fsync completes, which
makes all of it durable (``store.disk.journal``). No periodic snapshot is taken meanwhile: its
rotation fsyncs on the event loop and would hang every request, reads too.

Snapshots are taken every ``--snapshot-interval`` seconds once ``--snapshot-min-records``
records have accumulated, as soon as the journal since the newest one outgrows its budget
(``store.disk.compaction``: ``--snapshot-journal-bytes``, ``--snapshot-journal-ratio``), and at
shutdown; see ``store.disk.snapshot`` for why they never stop the server. A failed size-driven
snapshot is retried after 1 s, backing off to 8 s: each attempt starts a new segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvmeta.errors import JournalFailed, StorageError
from kvmeta.store.disk.compaction import DEFAULT_JOURNAL_BYTES, DEFAULT_JOURNAL_RATIO, JournalBudget
from kvmeta.store.disk.history import read_head, write_head
from kvmeta.store.disk.journal import (
    DEFAULT_FSYNC_INTERVAL,
    DEFAULT_FSYNC_TIMEOUT,
    Journal,
    segment_path,
)
from kvmeta.store.disk.legacy import LegacyPool, read_legacy, write_legacy
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.recovery import gc_paused, install, list_data_dir, lock_data_dir, recover
from kvmeta.store.disk.snapshot import StoreImage, capture, snapshot_path, write_snapshot
from kvmeta.store.epoch import data_dir_epoch

__all__ = ["DataDir", "DurabilityOptions"]

logger = logging.getLogger(__name__)

# After a journal failure: first retry after this many seconds, doubling up to _RETRY_MAX.
_RETRY_FIRST = 1.0
_RETRY_MAX = 8.0


@dataclass(frozen=True)
class DurabilityOptions:
    """The durability knobs, in one value (``data_dir`` None: legacy file only, no journal)."""

    data_dir: Path | None
    fsync: str = "batch"
    fsync_interval: float = DEFAULT_FSYNC_INTERVAL
    fsync_timeout: float = DEFAULT_FSYNC_TIMEOUT
    snapshot_interval: float = 300.0
    snapshot_min_records: int = 100_000
    snapshot_journal_bytes: int = DEFAULT_JOURNAL_BYTES  # 0: no byte limit
    snapshot_journal_ratio: float = DEFAULT_JOURNAL_RATIO  # 0: no ratio limit
    persistence_path: Path | None = None
    save_interval: float = 60.0


class DataDir:
    """The files of a local backend's state, kept in ``options.data_dir`` across restarts
    (or only in the SGLang persistence file), and the tasks that keep them: snapshots, the
    retries after a journal failure, the SGLang file's rewrites."""

    def __init__(self, store: MemoryStore, options: DurabilityOptions) -> None:
        self.store = store
        self.options = options
        self.journal: Journal | None = None
        # The data directory's id (``store.epoch``); None: no data directory, the state is
        # new at each start like plain memory (an SGLang persistence file is rewritten only
        # every ``--save-interval``, so a restart may have lost pools created since).
        self.epoch: str | None = None
        self.snapshots = 0
        self.snapshot_stall_max = 0.0
        self._snapshot_records = 0
        self._budget = JournalBudget(options.snapshot_journal_ratio, options.snapshot_journal_bytes)
        self._grown = asyncio.Event()  # the journal outgrew its budget (``store.disk.compaction``)
        self._snapshot_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._lock_fd = -1
        self._closed = False
        self._retry_wake = asyncio.Event()

    @property
    def describe(self) -> str:
        opts = self.options
        if opts.data_dir is None:
            return f"memory, SGLang file {opts.persistence_path} (no journal)"
        return f"memory + journal in {opts.data_dir} (fsync {opts.fsync})"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> Journal | None:
        """Recover (or import) the state into the store and open the journal it writes to
        next (None: no data directory). The caller attaches the journal, then ``start``s the
        upkeep."""
        opts = self.options
        loop = asyncio.get_running_loop()
        if opts.data_dir is not None:
            directory = opts.data_dir
            self._open_dir(directory)
            listing = list_data_dir(directory)
            for tmp in listing.temporaries:
                tmp.unlink()
            # Before recovery: a directory that had no state gets a new epoch even when the
            # legacy import below fills it (new state in a new place).
            self.epoch = data_dir_epoch(directory, has_state=not listing.empty)
            state = recover(directory)
            install(self.store, state, directory)
            self._budget.snapshot_bytes = _size(directory, state.snapshot)
            self._budget.backlog = state.journal_bytes
            previous = max(list_data_dir(directory).segments, default=0)
            if read_head(directory) is None:  # a directory an older kvmeta wrote
                write_head(directory, previous)
            logger.info(
                "recovered %d pools, %d keys from %s (snapshot %s, %d journal records, %d torn "
                "bytes cut) in %.3f s",
                len(state.pools),
                state.keys,
                directory,
                state.snapshot,
                state.records,
                state.torn_bytes,
                state.seconds,
            )
            if listing.empty and opts.persistence_path is not None:
                await self._import_into(directory, opts.persistence_path, state.next_segment)
            self.journal = Journal(
                directory,
                state.next_segment,
                mode=opts.fsync,
                interval=opts.fsync_interval,
                stall_timeout=opts.fsync_timeout,
                loop=loop,
                previous=previous,
            )
            self.journal.on_new_segment = functools.partial(write_head, directory)
            self.journal.on_fail = self._retry_wake.set
            self.journal.on_grown = self._grown.set
            self.journal.grow_at = self._budget.grow_at()
            self.journal.start()
        elif opts.persistence_path is not None:
            self._import_legacy(opts.persistence_path)
        return self.journal

    def start(self) -> None:
        """Start the background upkeep (snapshots, retries, the SGLang file's rewrites)."""
        opts = self.options
        if self.journal is not None:
            self._tasks.append(asyncio.create_task(self._recover_when_possible()))
        if opts.data_dir is not None and opts.snapshot_interval > 0:
            self._tasks.append(asyncio.create_task(self._every(opts.snapshot_interval, False)))
        if self.journal is not None and self._budget.limit() > 0:
            if self._budget.due(self.journal.bytes_written):
                self._grown.set()  # the replayed journal alone is over budget: compact it now
            self._tasks.append(asyncio.create_task(self._when_grown()))
        if opts.persistence_path is not None and opts.save_interval > 0:
            self._tasks.append(asyncio.create_task(self._every(opts.save_interval, True)))

    def _open_dir(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot use data directory {directory}: {exc}; pass a writable --data-dir "
                "(or --in-memory)"
            ) from None
        fd = lock_data_dir(
            directory,
            f"cannot use data directory {directory}",
            "pass a writable --data-dir (or --in-memory)",
            f"data directory {directory} is in use by another kvmeta process; stop it or pass "
            "another --data-dir",
        )
        self._lock_fd = fd

    def _import_legacy(self, path: Path) -> bool:
        """Load the SGLang file's pools into the store, unjournaled; False: there is no file."""
        if not path.exists():
            logger.info("no SGLang persistence file at %s yet: nothing to import", path)
            return False
        pools = read_legacy(path)
        for pid, num_pages, entries in pools:
            if pid not in self.store.pools:
                self.store.load_pool(pid, num_pages, entries)
        logger.info(
            "imported %d pools, %d keys from SGLang persistence file %s",
            len(pools),
            sum(len(e) for _, _, e in pools),
            path,
        )
        return True

    async def _import_into(self, directory: Path, path: Path, segment: int) -> None:
        """The first start on an empty data directory imports the SGLang file as snapshot
        ``segment``, before the journal starts: the snapshot is written whole (temporary file,
        fsync, rename, directory fsync) or not at all, so a crash or a full disk half-way
        leaves the directory empty and the next start imports again. (Journaled as commits
        instead, the part written before a crash would be taken for the whole: the next start
        would find a journal and skip the import.)

        Raises:
            StorageError: the snapshot could not be written; nothing of the import was kept.
        """
        if not self._import_legacy(path):
            return
        image = self._capture()
        try:
            written = await self._write_image(directory, segment, image)
        except OSError as exc:
            raise StorageError(
                f"cannot write the state imported from SGLang persistence file {path} into "
                f"{directory}: {exc}. Nothing of the import was kept, and the import runs "
                f"again at the next start: free space on the file system of {directory} (the "
                "import needs about as much as the file) or fix its permissions, then start "
                "kvmeta again"
            ) from None
        self._budget.snapshot_bytes = written.stat().st_size
        logger.info("the import is durable in %s", written)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        journal = self.journal
        if journal is not None and journal.stalled:
            # Its rotation would fsync on the loop and hang the shutdown with the disk.
            logger.error(
                "no final snapshot: %s; the next start replays the journal (the journal's "
                "records since its last completed fsync reach the disk once it answers again)",
                journal.refusal(),
            )
        elif journal is not None:
            try:
                await self.snapshot()
            except OSError as exc:
                self._log_final_snapshot_failure(journal, exc)
        if journal is not None:
            await journal.close()
        if self.options.persistence_path is not None:
            await self.save_legacy()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _log_final_snapshot_failure(self, journal: Journal, exc: OSError) -> None:
        if journal.failed is None:
            logger.error(
                "final snapshot failed (%s); the journal has every change and the next start "
                "replays it",
                exc,
            )
            return
        lost = journal.seq - journal.failed_seq
        logger.error(
            "final snapshot failed (%s) while the journal in %s has been failed since %s: the "
            "last %d journal record(s) (changes made since the last durable group before the "
            "failure) exist only in memory and are lost now. After the restart, confirms "
            "acknowledged in that window come back missing (cache misses, never wrong pages: "
            "their pages come back free) and keys deleted in it come back. Fix the cause "
            "first (%s).",
            exc,
            self.options.data_dir,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(journal.failed_at)),
            lost,
            journal.failed,
        )

    @property
    def failure(self) -> str | None:
        """Why changes are refused (the journal cannot be written, or its disk stopped
        answering), or None."""
        journal = self.journal
        refusal = None if journal is None else journal.refusal()
        return None if refusal is None else str(refusal)

    async def _recover_when_possible(self) -> None:
        """While the journal is failed, try to make the in-memory state durable again."""
        delay = _RETRY_FIRST
        last_error = ""
        while True:
            journal = self.journal
            if journal is None or journal.failed is None:
                delay, last_error = _RETRY_FIRST, ""
                self._retry_wake.clear()
                await self._retry_wake.wait()
                continue
            await asyncio.sleep(delay)
            if journal.failed is None or self._closed:
                continue
            try:
                await self.snapshot()
            except OSError as exc:
                if str(exc) != last_error:
                    logger.warning("journal still failed, retrying: %s", exc)
                    last_error = str(exc)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            logger.warning(
                "journal in %s recovered: a snapshot of the state in memory is durable (it "
                "holds every change acknowledged while the journal was failed); changes are "
                "accepted again",
                self.options.data_dir,
            )

    async def _every(self, interval: float, legacy: bool) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                if legacy:
                    await self.save_legacy()
                elif self.failure is not None:
                    continue  # _recover_when_possible takes the snapshot that recovers
                elif self._records_since_snapshot() >= self.options.snapshot_min_records:
                    await self.snapshot()
            except OSError as exc:
                logger.error("periodic %s failed: %s", "save" if legacy else "snapshot", exc)

    async def _when_grown(self) -> None:
        """Snapshot whenever the journal outgrows its budget (``store.disk.compaction``)."""
        delay = _RETRY_FIRST
        while True:
            await self._grown.wait()
            self._grown.clear()
            journal = self.journal
            if journal is None or self.failure is not None or self._closed:
                continue  # _recover_when_possible's snapshot resets the budget
            if not self._budget.due(journal.bytes_written):
                continue  # a snapshot was taken since the journal said so
            try:
                await self.snapshot()
            except OSError as exc:
                logger.error(
                    "snapshot for the journal's size failed (retry in %g s): %s", delay, exc
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                self._grown.set()
                continue
            delay = _RETRY_FIRST

    def _records_since_snapshot(self) -> int:
        return 0 if self.journal is None else self.journal.records - self._snapshot_records

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self) -> Path | None:
        """Take a snapshot now and drop the journal segments it covers. While the journal is
        failed this is how it recovers (see the module docstring).

        Raises:
            OSError: the snapshot could not be written (or the journal not restarted).
        """
        journal, directory = self.journal, self.options.data_dir
        if journal is None or directory is None:
            return None
        async with self._snapshot_lock:
            if journal.failed is not None:
                return await self._recovery_snapshot(journal, directory)
            return await self._snapshot(journal, directory)

    def _capture(self) -> StoreImage:
        # The GC is paused only for this synchronous copy: gc.disable is process-wide, and
        # held across an await it would stop collection for every other coroutine too.
        with gc_paused():
            image = capture(self.store)
        self.snapshot_stall_max = max(self.snapshot_stall_max, image.capture_seconds)
        return image

    async def _snapshot(self, journal: Journal, directory: Path) -> Path:
        # Rotation and capture in one loop step: the image is exactly segments < segment.
        segment = journal.rotate()
        mark = journal.bytes_written
        image = self._capture()
        self._snapshot_records = journal.records
        path = await self._write_image(directory, segment, image)
        self._snapshotted(journal, path, mark)
        return path

    async def _recovery_snapshot(self, journal: Journal, directory: Path) -> Path:
        """Write the in-memory state at a new segment number, then resume the journal there.

        Changes are refused meanwhile, but a request that passed that check before the
        failure may still change the state while the file is written; then capture again."""
        segment = journal.restart_segment()
        for _ in range(10):
            image = self._capture()
            seq = journal.seq
            path = await self._write_image(directory, segment, image)
            if journal.seq == seq:
                journal.recovered(seq)
                self._snapshot_records = journal.records
                self._snapshotted(journal, path, journal.bytes_written)
                return path
        raise JournalFailed(f"the state kept changing while {directory} was being recovered")

    def _snapshotted(self, journal: Journal, path: Path, mark: int) -> None:
        """The snapshot at ``path`` is durable and covers the journal written before ``mark``."""
        self._budget.snapshotted(path.stat().st_size, mark, journal.bytes_written)
        journal.grow_at = self._budget.grow_at()

    async def _write_image(self, directory: Path, segment: int, image: StoreImage) -> Path:
        started = time.perf_counter()
        path = await asyncio.to_thread(self._write_and_compact, directory, segment, image)
        self.snapshots += 1
        logger.info(
            "snapshot %s written: %d pools, %.3f s (event loop paused %.1f ms to copy)",
            path.name,
            len(image.pools),
            time.perf_counter() - started,
            image.capture_seconds * 1e3,
        )
        return path

    @staticmethod
    def _write_and_compact(directory: Path, segment: int, image: StoreImage) -> Path:
        path = write_snapshot(directory, segment, image)
        listing = list_data_dir(directory)
        for old in listing.snapshots:
            if old < segment:
                snapshot_path(directory, old).unlink(missing_ok=True)
        for old in listing.segments:
            if old < segment:
                segment_path(directory, old).unlink(missing_ok=True)
        return path

    async def save_legacy(self) -> None:
        """Rewrite the SGLang persistence file from a consistent copy, off the loop."""
        path = self.options.persistence_path
        if path is None:
            return
        with gc_paused():  # only around the synchronous copy (see _capture)
            image = capture(self.store)
        await asyncio.to_thread(_write_legacy_image, path, image)


def _size(directory: Path, snapshot: int | None) -> int:
    return 0 if snapshot is None else snapshot_path(directory, snapshot).stat().st_size


def _write_legacy_image(path: Path, image: StoreImage) -> None:
    pools: list[LegacyPool] = [(img.pid, img.num_pages, img.items()) for img in image.pools]
    write_legacy(path, pools)
