"""CPU time of another process, read from /proc.

Server CPU seconds per request is steadier than wall-clock throughput on a shared machine:
other processes slow the server down but do not add to its own utime + stime.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["children", "cpu_seconds", "rss_bytes"]

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every process it started: utime + stime of all threads, of
    live descendants (kvmeta's fsync helper, ``--workers`` processes) and of reaped children.

    Raises:
        FileNotFoundError: no such process (or not Linux).
    """
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = text.rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    total = ticks / _TICK
    for child in children(pid):
        try:
            total += cpu_seconds(child)
        except FileNotFoundError:
            pass  # exited meanwhile; once reaped it counts in our cutime
    return total


def children(pid: int) -> list[int]:
    """Pids of the processes ``pid`` started that are still running."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes."""
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * _PAGE
