"""``kvmeta check --repair``: make a damaged data directory safe to start on.

A journal that cannot be read to its end has lost changes, and the lost changes include
evictions and deletes whose pages were handed to other keys and rewritten since. Any older
state (the one before the damage, or a restored backup) would bring back ``old key -> page``
over another key's bytes: the one failure kvmeta must never have. So the repair keeps what is
safe and needed to go on, every pool (dialect, rank, namespace, size, tenant) and the vLLM
world sizes, and drops every key: the cache starts empty, and no page is ever served from a
history with a hole in it.

Pools are read from the newest snapshot that reads (one whose checksum fails is still read for
its pools when its meta and lengths are intact, ``snapshot.read_snapshot_pools``) and from
every pool record of the journal after it, damaged stretches stepped over
(``codec.salvage_records``). The result is written as a new snapshot numbered above every file
in the directory, so the next start loads it and replays nothing older; then the directory
gets a new epoch (its keys are gone: clients and event subscribers must not take it for the
state they knew) and every older journal segment and snapshot is moved into
``retired-<time>/`` inside it, kept for inspection. Each step is safe to interrupt: running
the repair again finishes it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmeta._types import PoolId
from kvmeta.errors import StorageError
from kvmeta.store.disk import codec, snapshot
from kvmeta.store.disk.codec import (
    Drop,
    FrameError,
    NewPool,
    Record,
    TenantWorldSize,
    WorldSize,
    salvage_records,
)
from kvmeta.store.disk.history import read_head, write_head
from kvmeta.store.disk.journal import fsync_dir, segment_path
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.recovery import list_data_dir, lock_data_dir, set_tenant_world
from kvmeta.store.disk.snapshot import (
    SnapshotData,
    SnapshotError,
    capture,
    read_snapshot,
    read_snapshot_pools,
    snapshot_path,
    write_snapshot,
)
from kvmeta.store.epoch import renew_epoch

__all__ = ["RepairReport", "repair_data_dir"]

RETIRED_PREFIX = "retired-"


@dataclass
class Salvage:
    """What the repair keeps: pools in the order first seen, and vLLM world sizes."""

    pools: dict[PoolId, int] = field(default_factory=dict)
    vworld: int | None = None
    tworld: dict[str, int] = field(default_factory=dict)
    keys: int = 0  # keys of the snapshot read (dropped)
    records: int = 0  # journal records read after it (their keys dropped)
    notes: list[str] = field(default_factory=list)
    dropped: set[PoolId] = field(default_factory=set)  # vLLM ranks removed
    named: set[PoolId] = field(default_factory=set)  # pools that keys' records name


@dataclass
class RepairReport:
    """What ``repair_data_dir`` did, as lines for the operator."""

    lines: list[str] = field(default_factory=list)


def repair_data_dir(directory: Path) -> RepairReport:
    """Keep every pool of ``directory``, drop every key, retire the old files.

    Raises:
        StorageError: the directory is in use, was written by a newer kvmeta, or cannot be
            written; the message names the fix.
    """
    if not directory.is_dir():
        raise StorageError(f"{directory} is not a directory; pass the server's --data-dir")
    lock = _lock(directory)
    try:
        return _repair(directory)
    finally:
        os.close(lock)


def _lock(directory: Path) -> int:
    return lock_data_dir(
        directory,
        f"cannot repair {directory}",
        "run the repair as the user kvmeta runs as",
        f"data directory {directory} is in use by a running kvmeta server; stop it, then run "
        "the repair again",
    )


def _repair(directory: Path) -> RepairReport:
    report = RepairReport()
    listing = list_data_dir(directory)
    if listing.empty:  # starts empty anyway (``store.disk.history``)
        report.lines.append(f"{directory} holds no journal and no snapshot: nothing to repair")
        return report
    found = salvage(directory)
    report.lines += found.notes
    try:
        head = read_head(directory)
    except (ValueError, OSError):
        head = None  # rewritten below
    last = 0 if head is None else head.segment
    # Above every file and the last segment HEAD names: nothing older is replayed after it.
    number = max([*listing.segments, *listing.snapshots, last]) + 1
    store = MemoryStore()
    for pid, num_pages in found.pools.items():
        store.initialize(pid, num_pages)
    store.vllm_world_size = found.vworld
    store.vllm_world_sizes.update(found.tworld)
    try:
        path = write_snapshot(directory, number, capture(store))
        epoch = renew_epoch(directory)
        write_head(directory, number - 1)
        retired = _retire(directory, number)
    except OSError as exc:
        raise StorageError(
            f"cannot write the repaired state into {directory}: {exc}; free space on its file "
            "system or fix its permissions, then run the repair again (what it wrote so far "
            "is safe)"
        ) from None
    for pid, num_pages in found.pools.items():
        report.lines.append(f"kept {pid}: {num_pages} pages, no keys")
    report.lines.append(
        f"dropped every key ({found.keys} in the snapshot read, and those of {found.records} "
        f"journal records after it): the cache starts empty, so no key can come back on a "
        "page that was handed to another key since"
    )
    report.lines.append(f"wrote {path.name} ({len(found.pools)} pools); new epoch {epoch}")
    if retired is not None:
        report.lines.append(f"moved the older journal segments and snapshots to {retired}")
    report.lines.append(f"{directory} is ready: the next `kvmeta serve` starts from {path.name}")
    return report


def salvage(directory: Path) -> Salvage:
    """Every pool readable in ``directory`` (see the module docstring).

    Raises:
        StorageError: a file was written by a newer kvmeta (which must do the repair).
    """
    out = Salvage()
    listing = list_data_dir(directory)
    base = 0
    for number in reversed(listing.snapshots):
        snap = _read_snapshot(snapshot_path(directory, number), out)
        if snap is not None:
            base = number
            for pid, num_pages, keys, _ in snap.pools:
                out.pools[pid] = num_pages
                out.keys += len(keys)
            out.vworld = snap.vworld
            out.tworld = dict(snap.tworld)
            break
    for segment in listing.segments:
        if segment < base:
            continue  # covered by the snapshot
        path = segment_path(directory, segment)
        data = path.read_bytes()
        _refuse_newer(path, data, codec.VERSION)
        try:
            records, skipped = salvage_records(data)
        except FrameError as exc:
            out.notes.append(f"{path.name}: {exc}: no pool read from it")
            continue
        if skipped:
            out.notes.append(
                f"{path.name}: stepped over {skipped} damaged stretch(es); pools read from "
                f"the {len(records)} records around them"
            )
        for record in records:
            _apply(out, record)
        out.records += len(records)
    for pid in sorted(out.named - out.pools.keys() - out.dropped):
        out.notes.append(
            f"{pid}: its keys are in the journal, but the record that created it is not "
            "readable (its size is unknown): it is not kept, and its engines get 'not "
            "initialized' until they initialize it again (restart them)"
        )
    return out


def _read_snapshot(path: Path, out: Salvage) -> SnapshotData | None:
    try:
        data = path.read_bytes()
    except OSError as exc:
        out.notes.append(f"{path.name}: cannot read it ({exc}): no pool read from it")
        return None
    _refuse_newer(path, data, snapshot.VERSION)
    try:
        return read_snapshot(path)
    except SnapshotError as exc:
        reason = str(exc)
    try:
        snap = read_snapshot_pools(path)
    except SnapshotError as exc:
        out.notes.append(f"{path.name}: {reason}, and its pools cannot be read ({exc})")
        return None
    out.notes.append(f"{path.name}: {reason}; its pools were read from its intact meta")
    return snap


def _refuse_newer(path: Path, data: bytes, version: int) -> None:
    if len(data) > 4 and data[4] > version:
        raise StorageError(
            f"{path} was written by a newer kvmeta (format {data[4]}, this one reads up to "
            f"{version}): run the repair with that version"
        )


def _apply(out: Salvage, record: Record) -> None:
    if isinstance(record, NewPool):
        out.pools.setdefault(record.pool, record.num_pages)
        out.dropped.discard(record.pool)
    elif isinstance(record, Drop):
        out.pools.pop(record.pool, None)
        out.dropped.add(record.pool)
    elif isinstance(record, WorldSize):
        out.vworld = record.world_size
    elif isinstance(record, TenantWorldSize):
        set_tenant_world(out.tworld, record)
    else:
        out.named.add(record.pool)


def _retire(directory: Path, number: int) -> Path | None:
    """Move every journal segment, snapshot and leftover temporary below ``number`` into a
    new ``retired-<time>`` directory; returns it (None: nothing to move)."""
    listing = list_data_dir(directory)
    old = [segment_path(directory, s) for s in listing.segments if s < number]
    old += [snapshot_path(directory, s) for s in listing.snapshots if s < number]
    old += listing.temporaries
    if not old:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = directory / f"{RETIRED_PREFIX}{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = directory / f"{RETIRED_PREFIX}{stamp}-{n}"
    target.mkdir()
    for path in old:
        os.rename(path, target / path.name)
    fsync_dir(target)
    fsync_dir(directory)
    return target
