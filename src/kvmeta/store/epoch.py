"""Backend epochs: ids that change exactly when a backend's state may have been lost or replaced.

A data directory keeps its epoch in its own small file, ``EPOCH`` (one line: the id), beside
the journal and snapshots rather than inside a snapshot: snapshots come and go (compaction,
recovery snapshots), a data directory may have none yet, and the id must outlive them all. It
is written once, to ``EPOCH.tmp``, fsynced, renamed and the directory fsynced, so a crash
leaves either no file or the whole one (start-up deletes ``*.tmp`` leftovers); it is never
rewritten while the state lives. The rules (``data_dir_epoch``):

- a directory without state (no journal segment, no snapshot) gets a new id, even if an
  ``EPOCH`` file is there: whatever state that id named is gone;
- a directory with state keeps its id: restarts, ``kill -9`` and journal-failure recovery never
  replace the state, so they never change the epoch;
- a directory with state but no ``EPOCH`` (written before epochs existed) gets a new id once;
- an ``EPOCH`` file that cannot be parsed is replaced by a new id, with a warning: a new epoch
  costs clients one idempotent re-initialise, a wrong "same" epoch could hide a lost state;
- ``kvmeta check --repair``, which drops every key, writes a new id (``renew_epoch``).
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

from kvmeta.errors import StorageError
from kvmeta.store.disk.journal import write_durably

__all__ = ["EPOCH_FILE", "data_dir_epoch", "new_epoch", "renew_epoch"]

logger = logging.getLogger(__name__)

EPOCH_FILE = "EPOCH"
_VALID = re.compile(r"^[A-Za-z0-9-]{8,64}$")


def new_epoch() -> str:
    """A fresh random id (128 bits, 32 hex digits)."""
    return uuid.uuid4().hex


def data_dir_epoch(directory: Path, has_state: bool) -> str:
    """The epoch of ``directory`` (locked by the caller), creating it when the rules say so.

    Raises:
        StorageError: the file cannot be read or written (naming the file and the fix).
    """
    path = directory / EPOCH_FILE
    if has_state:
        try:
            text = path.read_text(encoding="ascii", errors="replace").strip()
        except FileNotFoundError:
            text = None
        except OSError as exc:
            raise StorageError(
                f"cannot read {path}: {exc}; make it readable by the kvmeta user (or pass "
                "another --data-dir)"
            ) from None
        if text is not None and _VALID.match(text):
            return text
        if text is not None:
            logger.warning(
                "%s does not hold an epoch id (%r): writing a new one; clients with "
                "auto_reinitialize will initialise their pools again (a no-op for pools kept)",
                path,
                text[:40],
            )
    epoch = new_epoch()
    _write(path, epoch)
    return epoch


def renew_epoch(directory: Path) -> str:
    """A new epoch for ``directory`` whose state was replaced by ``kvmeta check --repair``
    (every key dropped): clients and subscribers must not take it for the state they knew.

    Raises:
        StorageError: the file cannot be written.
    """
    epoch = new_epoch()
    _write(directory / EPOCH_FILE, epoch)
    return epoch


def _write(path: Path, epoch: str) -> None:
    try:
        write_durably(path, lambda fh: fh.write((epoch + "\n").encode("ascii")))
    except OSError as exc:
        raise StorageError(
            f"cannot write {path}: {exc}; free space on that disk or make {path.parent} "
            "writable (or pass another --data-dir)"
        ) from None
