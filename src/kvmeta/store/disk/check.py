"""``kvmeta check``: verify a data directory offline, without changing it.

Loads the latest snapshot and replays the journal exactly as start-up would (but reports a torn
tail instead of cutting it), then runs the full page invariant on every pool.

On a directory a running server holds (its ``LOCK`` is locked) the check still runs, but the
files change under it (appends, snapshots, compaction), so what it finds may be stale or show a
torn tail that is only a write in progress: the report says so, and the exit code is
``store.base.IN_USE`` (3) rather than 0 when nothing was found, because "ok" would not be
definitive.
Exit codes: 0 ok, 1 problems found, 3 no problem found but the directory is in use.

A directory that does not exist, or holds none of the files a server keeps in its data
directory, is a problem, not an empty state: "ok" for a mistyped path (or ``/etc``) would tell
the operator their state is sound when nothing of it was looked at. A server creates ``LOCK``
and ``EPOCH`` on its first start, so a directory one has used passes even with no pools.

Every problem names the way to start again, ``kvmeta check --repair`` (``store.disk.repair``).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvmeta.core.invariants import InvariantViolation, check_pool
from kvmeta.errors import InvalidRequest, JournalCorrupt
from kvmeta.store.base import CheckReport
from kvmeta.store.disk.history import HEAD_FILE, moved
from kvmeta.store.disk.recovery import DataDirListing, corrupt, list_data_dir, recover
from kvmeta.store.epoch import EPOCH_FILE

__all__ = ["check_data_dir", "lock_held"]

# Files of a data directory besides journal segments and snapshots (which ``list_data_dir``
# finds): any one of them marks a directory a server has used.
_MARKERS = ("LOCK", EPOCH_FILE)


def lock_held(directory: Path) -> bool:
    """True when a live process holds ``directory``'s LOCK (a running server). Creates
    nothing: no LOCK file means nobody ever served from it."""
    try:
        fd = os.open(directory / "LOCK", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops our shared lock too
    return False


def _is_data_dir(directory: Path, listing: DataDirListing) -> bool:
    if listing.segments or listing.snapshots:
        return True
    return any((directory / name).is_file() for name in _MARKERS)


def check_data_dir(directory: Path) -> CheckReport:
    """Check ``directory``; never raises for damage, reports it."""
    from kvmeta.core.pool import Pool

    report = CheckReport()
    if not directory.exists():
        report.problems.append(
            f"{directory} does not exist: nothing to check (give the --data-dir the server runs "
            "with)"
        )
        return report
    if not directory.is_dir():
        report.problems.append(f"{directory} is not a directory")
        return report
    listing = list_data_dir(directory)
    if not _is_data_dir(directory, listing):
        report.problems.append(
            f"{directory} is not a kvmeta data directory: it holds none of a server's files "
            "(journal-*.log, snapshot-*.snap, EPOCH, LOCK); give the --data-dir the server runs "
            "with"
        )
        return report
    if lock_held(directory):
        report.in_use = True
        report.lines.append(
            f"NOTE: {directory} is in use by a running kvmeta server (its LOCK is held): the "
            "files change while they are read, so this result may be stale or inconsistent "
            "(e.g. a torn tail that is a write in progress). Stop the server, or check a copy, "
            "for a definitive answer (a copy is reported as one: a server refuses to start on "
            "it; its other findings still hold)."
        )
    report.lines.append(
        f"{directory}: {len(listing.snapshots)} snapshot(s), {len(listing.segments)} journal "
        f"segment(s), {len(listing.temporaries)} leftover temporary file(s)"
    )
    try:
        state = recover(directory, repair=False)
    except JournalCorrupt as exc:
        report.problems.append(str(exc))
        return report
    except OSError as exc:  # a file compacted away by the running server while we read
        report.problems.append(f"cannot read {directory}: {exc}")
        return report
    try:
        why = moved(directory)
    except (ValueError, OSError):
        why = None  # recover() reported an unreadable HEAD already
    if why is not None:
        report.problems.append(str(corrupt(directory, directory / HEAD_FILE, why, in_check=True)))
    report.lines.append(
        f"snapshot {state.snapshot}, {state.records} journal records replayed, "
        f"{state.torn_bytes} torn bytes at the tail (cut at next start) in {state.seconds:.3f} s"
    )
    for pid, (num_pages, entries) in sorted(state.pools.items()):
        try:
            # With the recorded frontier, as a start builds it: memory for the pages used.
            pool = Pool.from_lru(num_pages, dict(entries), frontier=state.frontiers.get(pid))
            check_pool(pool)
        except (InvalidRequest, InvariantViolation) as exc:
            report.problems.append(
                f"{pid}: {exc}. To start again, run `kvmeta check --repair --data-dir "
                f"{directory}`: it keeps every pool and drops every key"
            )
            continue
        report.lines.append(f"{pid}: {num_pages} pages, {len(entries)} stored keys: ok")
    if state.vworld is not None:
        report.lines.append(f"vLLM world size {state.vworld}")
    for tenant, world_size in sorted(state.tworld.items()):
        report.lines.append(f"tenant '{tenant}' vLLM world size {world_size}")
    report.lines.append(f"total: {len(state.pools)} pools, {state.keys} stored keys")
    return report
