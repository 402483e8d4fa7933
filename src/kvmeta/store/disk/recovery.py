"""Recovery: the latest snapshot plus a replay of the journal segments after it.

Replay runs on plain dicts (key -> page, insertion order = LRU order as of commit order) and
only then builds each ``Pool`` with ``Pool.from_lru``, which checks that no page or key appears
twice. Reservations and leases are not durable: every page not STORED comes back FREE, and
``install`` holds the ones below each pool's recorded frontier for one lease
(``Pool.hold_after_restart``), because a writer or reader of the old process may still use them.

A torn last record (the process died mid-append) is cut off with a WARNING. Every other kind of
damage, a missing segment included (``store.disk.history``), raises ``JournalCorrupt`` naming the
file, the offset and the options: kvmeta never starts empty over a data directory it could not
read, because its next snapshot would destroy the evidence.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kvmeta._types import PoolId
from kvmeta.core.pool import Pool
from kvmeta.errors import InvalidRequest, JournalCorrupt, StorageError
from kvmeta.store.disk.codec import (
    HEADER,
    Clear,
    Commit,
    Drop,
    FrameError,
    NewPool,
    Record,
    Remove,
    RemovePages,
    TenantWorldSize,
    WorldSize,
    decode_frames,
    page_numbers,
)
from kvmeta.store.disk.history import check_history
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.snapshot import SnapshotError, read_snapshot

__all__ = [
    "DataDirListing",
    "Recovered",
    "corrupt",
    "install",
    "list_data_dir",
    "lock_data_dir",
    "recover",
    "set_tenant_world",
]

logger = logging.getLogger(__name__)

_SEGMENT_RE = re.compile(r"^journal-(\d{12})\.log$")
_SNAPSHOT_RE = re.compile(r"^snapshot-(\d{12})\.snap$")


@dataclass
class DataDirListing:
    """What a data directory holds, by number, ascending."""

    segments: list[int]
    snapshots: list[int]
    temporaries: list[Path]

    @property
    def empty(self) -> bool:
        return not self.segments and not self.snapshots


@dataclass
class Recovered:
    """The state rebuilt from disk, plus what it took to rebuild it."""

    pools: dict[PoolId, tuple[int, dict[str, int]]] = field(default_factory=dict)
    # Each pool's recorded frontier (absent: not recorded, any page may have been handed out).
    frontiers: dict[PoolId, int] = field(default_factory=dict)
    vworld: int | None = None  # the default tenant's vLLM world size
    tworld: dict[str, int] = field(default_factory=dict)  # other tenants' vLLM world sizes
    snapshot: int | None = None
    next_segment: int = 1
    records: int = 0
    segments: int = 0
    journal_bytes: int = 0  # in the segments replayed (after the snapshot), torn bytes left out
    torn_bytes: int = 0
    seconds: float = 0.0
    # Page -> key of pools whose removals name pages (format 4), built at the first one: an
    # entry may be stale (the key moved on), so a removal checks the key -> page dict too.
    owners: dict[PoolId, list[str | None]] = field(default_factory=dict, repr=False)

    @property
    def keys(self) -> int:
        return sum(len(entries) for _, entries in self.pools.values())


def list_data_dir(directory: Path) -> DataDirListing:
    segments, snapshots, temporaries = [], [], []
    for entry in os.scandir(directory):
        if m := _SEGMENT_RE.match(entry.name):
            segments.append(int(m.group(1)))
        elif m := _SNAPSHOT_RE.match(entry.name):
            snapshots.append(int(m.group(1)))
        elif entry.name.endswith(".tmp"):
            temporaries.append(Path(entry.path))
    return DataDirListing(sorted(segments), sorted(snapshots), temporaries)


def lock_data_dir(directory: Path, cannot: str, fix: str, busy: str) -> int:
    """The descriptor holding ``directory``'s LOCK exclusively: one server (or repair) at a
    time. The refusals say ``cannot: <error>; fix`` and ``busy``.

    Raises:
        StorageError: LOCK cannot be opened, or another process holds it.
    """
    try:
        fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(f"{cannot}: {exc}; {fix}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StorageError(busy) from None
    return fd


def corrupt(directory: Path, file: Path, reason: str, *, in_check: bool = False) -> JournalCorrupt:
    """The start-up refusal, with the way forward (``in_check``: said by ``kvmeta check``,
    which must not advise running itself for details).

    The way forward is never an older state: a restored backup, or the journal cut before the
    damage, undoes every eviction and delete after that point while their pages were handed to
    other keys and rewritten since. ``kvmeta check --repair`` keeps the pools and drops the
    keys (``store.disk.repair``)."""
    details = "" if in_check else f"Run `kvmeta check --data-dir {directory}` for details. "
    return JournalCorrupt(
        f"{file}: {reason}. kvmeta will not start on a data directory it cannot read to its "
        f"end (it would overwrite the evidence, and an older state serves wrong pages). "
        f"{details}To start again, run `kvmeta check --repair --data-dir {directory}`: it "
        "keeps every pool and drops every key (the cache starts empty, never a wrong page) "
        f"and moves the journal and snapshot files into {directory}/retired-<time>/. Do not "
        "move journal files away or restore an older copy of the directory instead: its keys "
        "point at pages that were handed to other keys since. Or start with another "
        "--data-dir (or --in-memory) and keep this one for inspection."
    )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Millions of small objects are created and all survive: the cyclic GC would only rescan
    them again and again (it doubles recovery time at 10^6 keys)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def recover(directory: Path, *, repair: bool = True) -> Recovered:
    """Rebuild the durable state of ``directory``.

    ``repair`` truncates a torn tail (start-up); ``kvmeta check`` passes False and only reports.

    Raises:
        JournalCorrupt: a snapshot or journal is damaged beyond a torn tail, or replay finds an
            impossible sequence of records.
    """
    with gc_paused():
        return _recover(directory, repair)


def _recover(directory: Path, repair: bool) -> Recovered:
    started = time.perf_counter()
    listing = list_data_dir(directory)
    out = Recovered()
    keeps_head = False  # the snapshot was written by a kvmeta that keeps HEAD
    if listing.snapshots:
        out.snapshot = listing.snapshots[-1]
        path = directory / f"snapshot-{out.snapshot:012d}.snap"
        try:
            snap = read_snapshot(path)
        except (SnapshotError, OSError) as exc:
            raise corrupt(directory, path, str(exc), in_check=not repair) from None
        out.vworld = snap.vworld
        out.tworld = dict(snap.tworld)
        keeps_head = snap.head
        for pid, num_pages, keys, pages in snap.pools:
            out.pools[pid] = (num_pages, dict(zip(keys, pages, strict=True)))
        out.frontiers.update(snap.frontiers)
    first = out.snapshot if out.snapshot is not None else 0
    segments = [s for s in listing.segments if s >= first]
    refuse = partial(corrupt, directory, in_check=not repair)
    # Whether the files are a copy: start-up refuses one; ``kvmeta check`` reports it apart,
    # and still checks what the files hold.
    check_history(
        directory, segments, out.snapshot, refuse, snapshot_keeps_head=keeps_head, identity=repair
    )
    last_nonempty = _last_nonempty(directory, segments)
    for segment in segments:
        path = directory / f"journal-{segment:012d}.log"
        if segment == segments[-1] and path.stat().st_size < len(HEADER):
            # Created, but the crash came before its header was written: nothing in it.
            logger.warning("%s: removing a journal file cut short before its header", path)
            if repair:
                path.unlink()
            continue
        _replay_segment(directory, path, out, repair, is_last=segment == last_nonempty)
        out.segments += 1
    top = max([*listing.segments, *listing.snapshots, 0])
    out.next_segment = top + 1
    out.seconds = time.perf_counter() - started
    return out


def _last_nonempty(directory: Path, segments: list[int]) -> int | None:
    for segment in reversed(segments):
        if (directory / f"journal-{segment:012d}.log").stat().st_size > len(HEADER):
            return segment
    return segments[-1] if segments else None


def _replay_segment(
    directory: Path, path: Path, out: Recovered, repair: bool, *, is_last: bool
) -> None:
    data = path.read_bytes()
    try:
        decoded = decode_frames(data, last=is_last)
    except FrameError as exc:
        raise corrupt(directory, path, str(exc), in_check=not repair) from None
    out.journal_bytes += len(data) - decoded.torn_bytes
    if decoded.torn_at is not None:
        if not is_last:
            raise corrupt(
                directory, path, f"damaged record at byte {decoded.torn_at}", in_check=not repair
            )
        out.torn_bytes += decoded.torn_bytes
        logger.warning(
            "%s: cut off a torn last record (%d bytes at byte %d): the process stopped while "
            "writing it, so its change was never acknowledged",
            path,
            decoded.torn_bytes,
            decoded.torn_at,
        )
        if repair:
            os.truncate(path, decoded.torn_at)
    for index, record in enumerate(decoded.records):
        try:
            _apply(out, record)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            raise corrupt(
                directory,
                path,
                f"record {index} ({record.__struct_config__.tag!r}) cannot apply: {exc}",
                in_check=not repair,
            ) from None
        out.records += 1


def _apply(out: Recovered, record: Record) -> None:
    # Most frequent kinds first: replay runs this once per record.
    if isinstance(record, Commit):
        entries = out.pools[record.pool][1]
        owners = out.owners.get(record.pool)
        for key, page in record.entries:
            entries.pop(key, None)
            entries[key] = page
        if owners is not None:
            for key, page in record.entries:
                owners[page] = key
    elif isinstance(record, RemovePages):
        entries = out.pools[record.pool][1]
        owners = out.owners.get(record.pool)
        if owners is None:
            owners = out.owners[record.pool] = _owners(*out.pools[record.pool])
        for page in page_numbers(record):
            owner = owners[page]
            if owner is not None and entries.get(owner) == page:
                del entries[owner]
                owners[page] = None
    elif isinstance(record, Remove):
        entries = out.pools[record.pool][1]
        for key, page in record.entries:
            if entries.get(key) == page:
                del entries[key]
    elif isinstance(record, Clear):
        out.pools[record.pool][1].clear()
    elif isinstance(record, NewPool):
        if record.pool not in out.pools:
            out.pools[record.pool] = (record.num_pages, {})
            if record.frontier >= 0:
                out.frontiers[record.pool] = record.frontier
        elif record.frontier > out.frontiers.get(record.pool, record.frontier):
            out.frontiers[record.pool] = record.frontier
    elif isinstance(record, Drop):
        out.pools.pop(record.pool, None)
        out.frontiers.pop(record.pool, None)
        out.owners.pop(record.pool, None)
    elif isinstance(record, WorldSize):
        out.vworld = record.world_size
    elif isinstance(record, TenantWorldSize):
        set_tenant_world(out.tworld, record)
    else:
        raise ValueError(f"unknown record type {type(record).__name__}")


def set_tenant_world(tworld: dict[str, int], record: TenantWorldSize) -> None:
    """Apply a tenant's world size record (None: unpinned) to the tenants' world sizes; the
    repair's replay keeps them by the same rule."""
    if record.world_size is None:
        tworld.pop(record.tenant, None)
    else:
        tworld[record.tenant] = record.world_size


def _owners(num_pages: int, entries: dict[str, int]) -> list[str | None]:
    """Page -> key of a pool's replayed entries.

    Raises:
        IndexError: a page out of the pool's range (a damaged journal).
    """
    owners: list[str | None] = [None] * num_pages
    for key, page in entries.items():
        owners[page] = key
    return owners


def install(store: MemoryStore, state: Recovered, directory: Path) -> None:
    """Load recovered pools into ``store`` (no journaling: they are already on disk).

    Raises:
        JournalCorrupt: the replayed state maps one page to two keys or a page out of range.
    """
    now = store.clock()
    held = 0
    with gc_paused():
        for pid, (num_pages, entries) in state.pools.items():
            try:
                pool = Pool.from_lru(
                    num_pages,
                    entries,
                    reservation_ttl=store.reservation_ttl,
                    read_lease=store.read_lease,
                    frontier=state.frontiers.get(pid),
                    policy=store.policy,
                )
            except InvalidRequest as exc:
                raise corrupt(directory, directory, f"{pid}: {exc}") from None
            held += pool.hold_after_restart(now)
            store.add_pool(pid, pool)
        store.vllm_world_size = state.vworld
        for tenant, world_size in state.tworld.items():
            store.vllm_world_sizes[tenant] = world_size
    if held:
        logger.warning(
            "holding %d free page(s) for %.0f s after the restart: writers and readers of the "
            "previous run may still use them (leases are not journaled; docs/guarantees.md)",
            held,
            max(store.reservation_ttl, store.read_lease),
        )
    # The recovered keys live until evicted: keep the collector from rescanning them.
    gc.freeze()
