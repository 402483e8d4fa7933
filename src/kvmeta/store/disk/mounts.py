"""Which file system holds a directory, in words an operator can act on."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["describe_disk"]


def describe_disk(directory: Path) -> str:
    """The file system holding ``directory``, e.g. ``/dev/sdb1 mounted at /data, ext4``.

    Read once at start-up: a stat on a hung mount would block the event loop just when the
    message is needed."""
    try:
        mount = directory.resolve()
        while not os.path.ismount(mount) and mount != mount.parent:
            mount = mount.parent
        found: list[str] = []
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = [_unescape(f) for f in line.split()]
                if len(fields) >= 3 and fields[1] == str(mount):
                    found = fields  # the last mount on a path is the one in use
    except OSError:
        return "its file system"
    if found:
        return f"{found[0]} mounted at {mount}, {found[2]}"
    return f"the file system mounted at {mount}"


def _unescape(field: str) -> str:
    """/proc/self/mounts writes a space as \\040 (and tab, newline, backslash likewise)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
