"""Whether the files of a data directory are its whole history since its snapshot.

A journal segment that is gone (deleted, moved away, left out of a restore) takes its changes
with it, and among them evictions and deletes whose pages went to other keys since: replaying
the segments around it would bring those keys back on other keys' bytes. Each kind of gap is
found by what survives it:

- a segment in the middle: the segment after it names it (its header's distance back,
  ``codec.segment_header``), so a segment that names one that is neither on disk nor covered
  by the snapshot is a gap;
- the last segment (and every segment after the snapshot): nothing after it names it, so the
  directory keeps a note of the last segment it created, ``HEAD``. It is written (temporary
  file, fsync, rename, directory fsync) when a segment is created, after that segment's header
  and directory entry are durable and before any record in it can be acknowledged: after any
  crash the segment HEAD names is on disk, or covered by a later snapshot (which deletes the
  segments it covers). HEAD naming a segment that is neither is a gap.

A copy of the directory is an older state too when it is started on: a backup restored, or
files copied back by hand, lack the evictions and deletes made since, while the engines' page
files went on. Its files look whole, so HEAD also pins the directory it was written in: the
inode numbers of the directory, of HEAD itself (the temporary's, kept by the rename) and of the
segment it names. cp, rsync and tar create new files, so a copy has other numbers (``moved``).
Two restores keep them and are not seen: a block-level snapshot of the whole file system (LVM,
ZFS, a cloud disk), and files overwritten in place (``cp`` onto the existing ones) with a copy
taken during the current segment; after either, ``kvmeta check --repair`` is for the operator
to run.

A directory with no segment and no snapshot at all has no state to be wrong about: it starts
empty whatever HEAD says (the way to reset a data directory on purpose). Every gap or copy is
refused at start-up and by ``kvmeta check`` like any other damage (``recovery.corrupt``), and
``kvmeta check --repair`` is the way to start again: it writes a HEAD for the directory as it
is. Directories written before HEAD and the chain existed have neither: they are read as
before, and start-up writes their HEAD. Snapshots say that their kvmeta keeps HEAD (``head``
in their meta), so HEAD missing beside such a snapshot, or beside a segment with a chain, is
refused as files restored without it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvmeta.errors import JournalCorrupt
from kvmeta.store.disk.codec import HEADER, predecessor
from kvmeta.store.disk.journal import segment_path, write_durably

__all__ = ["HEAD_FILE", "Head", "check_history", "moved", "read_head", "write_head"]

HEAD_FILE = "HEAD"
# ``recovery.corrupt`` with its directory and mode bound: (file, reason) -> the refusal.
CorruptFactory = Callable[[Path, str], JournalCorrupt]


def _segment_name(segment: int) -> str:
    return segment_path(Path(), segment).name


@dataclass(frozen=True)
class Head:
    """What HEAD says: the last segment created, and the inode numbers of the directory, of
    HEAD itself and of that segment when it was written (empty: written before they were)."""

    segment: int
    inodes: dict[str, int] = field(default_factory=dict)


def write_head(directory: Path, segment: int) -> None:
    """Record ``segment`` as the last segment created in ``directory``, with the inode numbers
    that pin HEAD to this directory, durably.

    Raises:
        OSError: it could not be written (the journal fails, as on any write error).
    """

    def write(fh: BinaryIO) -> None:
        # The temporary's inode is HEAD's once renamed: a copy of HEAD gets another one.
        inodes = {"dir": os.stat(directory).st_ino, "head": os.fstat(fh.fileno()).st_ino}
        with contextlib.suppress(FileNotFoundError):
            inodes["segment"] = os.stat(segment_path(directory, segment)).st_ino
        fh.write((json.dumps({"segment": segment, "inodes": inodes}) + "\n").encode("ascii"))

    write_durably(directory / HEAD_FILE, write)


def read_head(directory: Path) -> Head | None:
    """What ``directory``'s HEAD says, or None when it has none (older kvmeta).

    Raises:
        ValueError: HEAD holds something else (the message says what).
    """
    try:
        text = (directory / HEAD_FILE).read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return None
    try:
        body = json.loads(text)
        segment, inodes = body["segment"], body.get("inodes", {})
        ok = type(segment) is int and segment >= 0 and isinstance(inodes, dict)
        if ok and all(type(v) is int for v in inodes.values()):
            return Head(segment, {str(k): v for k, v in inodes.items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    raise ValueError(f"not a HEAD file ({text[:60]!r})")


def moved(directory: Path) -> str | None:
    """Why ``directory`` is not where its HEAD was written (its files are a copy: a restored
    backup, or a directory copied with cp, rsync or tar), or None: no HEAD, or the inode
    numbers HEAD recorded are still those of the directory, HEAD and its segment.

    Raises:
        ValueError: HEAD holds something else.
        OSError: HEAD cannot be read.
    """
    head = read_head(directory)
    if head is None:
        return None
    now = {"dir": directory, "head": directory / HEAD_FILE}
    now["segment"] = segment_path(directory, head.segment)
    differ = []
    for name, recorded in head.inodes.items():
        path = now.get(name)
        if path is None:
            continue
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            continue  # the segment was compacted away: the snapshot covers it
        if inode != recorded:
            differ.append("the directory" if name == "dir" else path.name)
    if not differ:
        return None
    return (
        f"this is not the directory its {HEAD_FILE} file was written in: the inode numbers of "
        f"{', '.join(differ)} differ from those {HEAD_FILE} recorded, so these files are a copy "
        "(a backup restored, or the directory copied with cp, rsync or tar) of a state that "
        "may be older than the page files: its keys may point at pages rewritten since"
    )


def check_history(
    directory: Path,
    segments: list[int],
    snapshot: int | None,
    corrupt: CorruptFactory,
    *,
    snapshot_keeps_head: bool = False,
    identity: bool = True,
) -> None:
    """Raise when the segments to replay (``segments``, ascending, all >= ``snapshot``) are not
    the whole history after ``snapshot`` of this very directory: a segment the chain or HEAD
    names is missing, HEAD is missing while files written with one are there, or (``identity``)
    the files are a copy (``moved``). ``snapshot_keeps_head``: the snapshot was written by a
    kvmeta that keeps HEAD.

    Raises:
        JournalCorrupt: built by ``corrupt(file, reason)``, naming the file.
    """
    if not segments and snapshot is None:
        return  # no state at all: a new start, with no key that could be wrong
    covered = snapshot if snapshot is not None else 1  # segments below it need no file
    chained = _check_chain(directory, segments, snapshot, covered, corrupt)
    head_path = directory / HEAD_FILE
    try:
        head = read_head(directory)
        why = moved(directory) if identity else None
    except (ValueError, OSError) as exc:
        raise corrupt(head_path, str(exc)) from None
    if head is None:
        written_with = chained or ("the snapshot" if snapshot_keeps_head else None)
        if written_with is not None:
            raise corrupt(
                head_path,
                f"missing, while {written_with} was written by a kvmeta that keeps one: the "
                "directory's files were restored or copied without it, or it was deleted",
            )
        return
    if why is not None:
        raise corrupt(head_path, why)
    if head.segment >= covered and head.segment not in segments:
        raise corrupt(
            segment_path(directory, head.segment),
            "this journal segment is missing: it is the last one this directory created "
            f"(its {HEAD_FILE} file says so), and no snapshot covers it (deleted, moved away, "
            "or older files restored over the directory)",
        )


def _check_chain(
    directory: Path,
    segments: list[int],
    snapshot: int | None,
    covered: int,
    corrupt: CorruptFactory,
) -> str | None:
    """Raise at the first segment whose header names one that is missing or not the one
    before it; returns the name of a segment that has a chain (None: none has)."""
    present = set(segments)
    chained: str | None = None
    before: int | None = None  # the segment replayed before this one
    for segment in segments:
        path = segment_path(directory, segment)
        with open(path, "rb") as fh:
            header = fh.read(len(HEADER))
        if len(header) < len(HEADER):
            continue  # created, never written: recovery removes it
        prev = predecessor(header, segment)
        if prev is None:
            before = segment  # an older kvmeta's segment: it does not say
            continue
        chained = path.name
        if prev < 0:
            raise corrupt(path, f"its header names segment {prev}, which cannot exist")
        if prev < covered:
            if before is not None:  # it says it comes first, yet one is replayed before it
                raise corrupt(
                    path,
                    f"its header says it follows {_segment_name(prev)}, but "
                    f"{_segment_name(before)} lies between them",
                )
        elif prev not in present:
            raise corrupt(segment_path(directory, prev), _missing(segment, snapshot))
        elif prev != before:  # ``before`` lies between: both are on disk
            raise corrupt(
                path,
                f"its header says it follows {_segment_name(prev)}, but "
                f"{_segment_name(before or prev)} lies between them",
            )
        before = segment
    return chained


def _missing(follower: int, snapshot: int | None) -> str:
    covered = "no snapshot covers it" if snapshot is None else f"the snapshot ({snapshot}) is older"
    return (
        f"this journal segment is missing: {_segment_name(follower)} follows it (its header "
        f"says so), and {covered}"
    )
