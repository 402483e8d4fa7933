"""``procstat.cpu_seconds``: another process's CPU time, finer than a clock tick."""

from __future__ import annotations

import subprocess
import sys

from kvmeta.bench import procstat

# The child burns CPU until its own clock says 3 ms (less than one 10 ms tick), reports the
# exact figure, then waits to be read.
_CHILD = """
import sys, time
while time.process_time() < 0.003:
    pass
print(time.process_time(), flush=True)
sys.stdin.readline()
"""


def test_a_few_milliseconds_of_cpu_are_counted_not_rounded_to_ticks() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        burned = float(child.stdout.readline())
        measured = procstat.cpu_seconds(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    # Tick-sampled utime + stime (a multiple of 10 ms) mostly reads less than was burned.
    assert burned <= measured < burned + 1.0


def test_descendants_are_counted() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_CHILD!r}])",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        burned = float(parent.stdout.readline())
        assert procstat.children(parent.pid)
        measured = procstat.cpu_seconds(parent.pid)
    finally:
        parent.communicate("\n", timeout=30)
    assert measured >= burned
