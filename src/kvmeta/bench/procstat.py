"""CPU time of another process, read from /proc.

Server CPU seconds per request is steadier than wall-clock throughput on a shared machine:
other processes slow the server down but do not add to its own utime + stime.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["children", "cpu_seconds", "rss_bytes"]

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every process it started: all its threads, its live
    descendants (kvmeta's fsync helper, ``--workers`` processes) and its reaped children.

    A live process is read from its CPU-time clock, exact to the nanosecond; ``utime`` and
    ``stime`` in ``/proc/PID/stat`` are sampled in clock ticks (10 ms), so a short run of a
    fast server could read as no CPU at all. Reaped children only exist as ticks.

    Raises:
        FileNotFoundError: no such process (or not Linux).
    """
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = text.rsplit(")", 1)[1].split()
    total = (int(fields[13]) + int(fields[14])) / _TICK  # cutime, cstime: reaped children
    try:
        total += time.clock_gettime(_process_cpu_clock(pid))
    except OSError:  # the clock is refused (not Linux, or a restricted sandbox): ticks
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    for child in children(pid):
        try:
            total += cpu_seconds(child)
        except FileNotFoundError:
            pass  # exited meanwhile; once reaped it counts in our cutime
    return total


def _process_cpu_clock(pid: int) -> int:
    """The clock id of ``pid``'s CPU time, as glibc's ``clock_getcpuclockid`` makes it (the
    kernel's ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``); Python only offers it for
    threads of its own process."""
    return ((~pid) << 3) | 2


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
