"""CPU time of another process, read from /proc.

Server CPU seconds per request is steadier than wall-clock throughput on a shared machine:
other processes slow the server down but do not add to its own utime + stime.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds", "rss_bytes"]

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds.

    Raises:
        FileNotFoundError: no such process (or not Linux).
    """
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes."""
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * _PAGE
