"""Requests at random times, for measuring a server at a chosen load rather than flat out.

A client that sends its next request as soon as the last is answered measures capacity: the
machine is overloaded by construction, and every per-request cost is inflated by whatever
the overload does to scheduling and caches. At a fixed rate, two servers (events off and on,
say) serve the same requests per second, so their CPU per request compares like for like.

The times are a Poisson process (exponential gaps), not a fixed schedule: senders on fixed
schedules at rates that are multiples of each other lock into one phase of each other for a
whole run, and that run measures one point of the cycle instead of all of them.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable

__all__ = ["Pacer", "arrivals"]


def arrivals(rate: float, seed: str) -> Callable[[], float]:
    """The gaps (seconds) of a Poisson process of ``rate`` per second, from ``seed``
    (0: no gaps, back to back)."""
    if not rate:
        return lambda: 0.0
    return functools.partial(random.Random(seed).expovariate, rate)


class Pacer:
    """One sender's schedule at ``rate`` requests per second (Poisson arrivals).

    ``wait`` sleeps until the next request is due and returns the time a latency counts from.
    A sender that falls behind (a slow answer) sends at once until it has caught up, and each
    such request counts from its due time: its latency includes the time it waited to be sent,
    as it would have waited in a real queue (counting from the send would hide the very delays
    a slow server causes). A request the sender slept for counts from the wake-up: a sleep
    overshoots by 100-400 us on a busy machine, and that is the sender's timer, not the
    server."""

    def __init__(
        self,
        rate: float,
        seed: str,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        """``sleep`` waits for the next due time (default ``time.sleep``); one that returns
        early lets the sender stop without waiting for a request it will not send."""
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        self._gap = arrivals(rate, seed)
        self._clock = clock
        self._sleep = sleep
        self._due = clock() + self._gap()

    def wait(self) -> float:
        due = self._due
        self._due = due + self._gap()
        ahead = due - self._clock()
        if ahead <= 0:
            return due
        (self._sleep or time.sleep)(ahead)
        return self._clock()
