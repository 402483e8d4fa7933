"""``kvmeta.lograte``: per kind, the first warning logged at once, the rest counted, one summary
line per interval stating the count; a kind quiet for an interval starts over."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

from kvmeta.lograte import MAX_LINE_CHARS, LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


LOG = logging.getLogger("test.lograte")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """The messages LOG writes, as they are written."""
    handler = _Lines()
    LOG.addHandler(handler)
    try:
        yield handler.lines
    finally:
        LOG.removeHandler(handler)


def _counts(lines: list[str]) -> int:
    """Messages the lines account for: one per full line, N per summary."""
    total = 0
    for line in lines:
        match = re.search(r"([\d,]+) more like it", line)
        total += int(match.group(1).replace(",", "")) if match else 1
    return total


def test_a_flood_is_one_line_then_one_summary_per_interval(logged: list[str]) -> None:
    clock = Clock()
    limiter = LogLimiter(interval=10.0, clock=clock)
    for i in range(1000):
        limiter.warning(LOG, "confirm_refused", "refused key %r", f"k{i}")
        limiter.flush()  # the server's once-a-second flush: nothing due yet
    assert logged == ["refused key 'k0'"]
    clock.now += 10.0
    limiter.flush()
    assert logged[1] == (
        "confirm_refused: 999 more like it in the last 10 s (logged once per 10 s per kind; "
        "the first of them: refused key 'k1')"
    )
    # It goes on: counted, one summary per interval; the last count at shutdown.
    for _ in range(4321):
        limiter.warning(LOG, "confirm_refused", "refused key %r", "x")
    clock.now += 3.0
    limiter.flush(final=True)
    assert logged[2].startswith("confirm_refused: 4,321 more like it in the last 3 s")
    assert len(logged) == 3 and _counts(logged) == 1000 + 4321


def test_without_flush_the_next_message_brings_the_summary(logged: list[str]) -> None:
    clock = Clock()
    limiter = LogLimiter(interval=10.0, clock=clock)
    for _ in range(21):  # 2 per second for 10 s
        limiter.warning(LOG, "size_conflict", "pool %s", "p")
        clock.now += 0.5
    # The 21st came 10 s after the first: it brings the summary of the 19 between them, and
    # is the first counted in the next interval (shown at shutdown).
    assert len(logged) == 2 and logged[1].startswith("size_conflict: 19 more like it")
    limiter.flush(final=True)
    assert len(logged) == 3 and logged[2].startswith("size_conflict: 1 more like it")
    assert _counts(logged) == 21


def test_a_quiet_kind_starts_over_and_kinds_are_apart(logged: list[str]) -> None:
    clock = Clock()
    limiter = LogLimiter(interval=10.0, clock=clock)
    limiter.warning(LOG, "a", "first a")
    limiter.warning(LOG, "b", "first b")
    limiter.warning(LOG, "a", "second a")
    clock.now += 10.0
    limiter.flush()
    clock.now += 10.0
    limiter.flush()  # a's interval after its summary was quiet: forgotten
    limiter.warning(LOG, "a", "third a")
    assert logged[:2] == ["first a", "first b"]
    assert logged[2].startswith("a: 1 more like it") and "second a" in logged[2]
    assert logged[3] == "third a"
    assert len(logged) == 4


def test_a_long_message_is_cut(logged: list[str]) -> None:
    limiter = LogLimiter(interval=10.0, clock=Clock())
    limiter.warning(LOG, "k", "key %r", "x" * 5000)
    assert len(logged[0]) == MAX_LINE_CHARS and logged[0].endswith("...")
