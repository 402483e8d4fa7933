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

A directory with no segment and no snapshot at all has no state to be wrong about: it starts
empty whatever HEAD says (the way to reset a data directory on purpose). A gap is refused at
start-up and by ``kvmeta check`` like any other damage (``recovery.corrupt``),
and ``kvmeta check --repair`` is the way to start again. Directories written before HEAD and
the chain existed have neither: their segments are read as before, and HEAD is written with
the first new segment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from kvmeta.errors import JournalCorrupt
from kvmeta.store.codec import HEADER, predecessor
from kvmeta.store.journal import fsync_dir, segment_path

__all__ = ["HEAD_FILE", "check_history", "read_head", "write_head"]

HEAD_FILE = "HEAD"
# ``recovery.corrupt`` with its directory and mode bound: (file, reason) -> the refusal.
CorruptFactory = Callable[[Path, str], JournalCorrupt]


def _segment_name(segment: int) -> str:
    return segment_path(Path(), segment).name


def write_head(directory: Path, segment: int) -> None:
    """Record ``segment`` as the last segment created in ``directory``, durably.

    Raises:
        OSError: it could not be written (the journal fails, as on any write error).
    """
    path = directory / HEAD_FILE
    tmp = path.with_name(HEAD_FILE + ".tmp")
    try:
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(json.dumps({"segment": segment}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def read_head(directory: Path) -> int | None:
    """The last segment ``directory`` created, or None when it has no HEAD (older kvmeta).

    Raises:
        ValueError: HEAD holds something else (the message says what).
    """
    try:
        text = (directory / HEAD_FILE).read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return None
    try:
        segment = json.loads(text)["segment"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"not a HEAD file ({text[:60]!r})") from None
    if type(segment) is not int or segment < 0:
        raise ValueError(f"not a HEAD file ({text[:60]!r})")
    return segment


def check_history(
    directory: Path,
    segments: list[int],
    snapshot: int | None,
    corrupt: CorruptFactory,
) -> None:
    """Raise when the segments to replay (``segments``, ascending, all >= ``snapshot``) are not
    the whole history after ``snapshot``: one the chain or HEAD names is missing.

    Raises:
        JournalCorrupt: built by ``corrupt(file, reason)``, naming the missing segment.
    """
    if not segments and snapshot is None:
        return  # no state at all: a new start, with no key that could be wrong
    covered = snapshot if snapshot is not None else 1  # segments below it need no file
    present = set(segments)
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
    try:
        head = read_head(directory)
    except (ValueError, OSError) as exc:
        raise corrupt(directory / HEAD_FILE, str(exc)) from None
    if head is not None and head >= covered and head not in present:
        raise corrupt(
            segment_path(directory, head),
            "this journal segment is missing: it is the last one this directory created "
            f"(its {HEAD_FILE} file says so), and no snapshot covers it",
        )


def _missing(follower: int, snapshot: int | None) -> str:
    covered = "no snapshot covers it" if snapshot is None else f"the snapshot ({snapshot}) is older"
    return (
        f"this journal segment is missing: {_segment_name(follower)} follows it (its header "
        f"says so), and {covered}"
    )
