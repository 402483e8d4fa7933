"""Warnings a caller can cause once per request, logged at a bounded rate.

A refused confirm, an initialize with another size, a second host initialising a pool: each
is one caller's mistake, told to that caller in its reply (``X-Kvmeta-Warning``) and counted
in ``/metrics``. The log is for the operator, who needs to know that it happens, one example
and how often, not every occurrence: an engine stuck in a retry loop sends thousands a second,
and a line per request (up to ~1 KB with a long key) would flood the log and cost more than
the request. So per kind of message the first is logged at once and the rest of the interval
only counted; a summary line then gives the count and the first of them, at most once per
interval while they go on. A kind quiet for a whole interval starts over with a full line.

Summaries are written when the next message of the kind comes after the interval, by
``flush`` (the server calls it every second, and at shutdown so that no count is lost), or
both. One ``LIMITER`` per process; its own lock, as the in-process client may be called from
several threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["INTERVAL", "LIMITER", "MAX_LINE_CHARS", "LogLimiter", "warn_limited"]

INTERVAL = 10.0  # seconds between two lines of one kind, at most one line per interval
MAX_LINE_CHARS = 600  # a longer message (a long key or namespace in it) is cut, with "..."
_EXAMPLE_CHARS = 200  # of the first suppressed message, in the summary line


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(msg: str, args: tuple[object, ...]) -> str:
    return msg % args if args else msg


@dataclass
class _Kind:
    logger: logging.Logger
    since: float  # when the current interval started
    more: int = 0  # messages counted, not logged, in the current interval
    example: str = ""  # the first of them


class LogLimiter:
    """Per kind: the first message logged in full, the rest counted, one summary per
    ``interval``. ``clock`` is for tests."""

    def __init__(
        self, interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: dict[str, _Kind] = {}

    def warning(self, logger: logging.Logger, kind: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` at WARNING on ``logger``, or count it (see the module)."""
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is not None and now - state.since < self.interval:
                state.more += 1
                if state.more == 1:
                    state.example = _cut(_render(msg, args), _EXAMPLE_CHARS)
                return
            summary = self._summary(kind, state, now) if state is not None else None
            if summary is not None:
                # They go on: the summary is this interval's line, and this message the first
                # one counted in the next.
                self._kinds[kind] = _Kind(logger, now, 1, _cut(_render(msg, args), _EXAMPLE_CHARS))
            else:
                self._kinds[kind] = _Kind(logger, now)
        if summary is not None:
            logger.warning("%s", summary)
        else:
            logger.warning("%s", _cut(_render(msg, args), MAX_LINE_CHARS))

    def flush(self, final: bool = False) -> None:
        """Log the summary of each kind whose interval ended (every kind's, when ``final``)."""
        now = self._clock()
        lines: list[tuple[logging.Logger, str]] = []
        with self._lock:
            for kind, state in list(self._kinds.items()):
                if not final and now - state.since < self.interval:
                    continue
                summary = self._summary(kind, state, now)
                if summary is None:
                    del self._kinds[kind]  # a quiet interval: the next one is logged in full
                    continue
                lines.append((state.logger, summary))
                self._kinds[kind] = _Kind(state.logger, now)  # the next interval: counted
        for logger, line in lines:
            logger.warning("%s", line)

    def reset(self) -> None:
        """Forget every kind, counts included (for tests: each starts with a full line)."""
        with self._lock:
            self._kinds.clear()

    def _summary(self, kind: str, state: _Kind, now: float) -> str | None:
        if not state.more:
            return None
        seconds = max(now - state.since, 0.0)
        return (
            f"{kind}: {state.more:,} more like it in the last {seconds:.0f} s (logged once per "
            f"{self.interval:g} s per kind; the first of them: {state.example})"
        )


LIMITER = LogLimiter()


def warn_limited(logger: logging.Logger, kind: str, msg: str, *args: object) -> None:
    """``logger.warning(msg, *args)`` for a message a caller can cause on every request: through
    the process's ``LIMITER``, so a flood of them costs one line per ``INTERVAL``."""
    LIMITER.warning(logger, kind, msg, *args)
