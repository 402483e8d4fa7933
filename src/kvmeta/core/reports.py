"""What a pool reports to its store: event counts, and what a confirm did."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ConfirmOutcome", "PoolCounters"]


@dataclass
class PoolCounters:
    """Monotonic event counts for stats and metrics (never reset by ``clear``)."""

    exists_hits: int = 0
    exists_misses: int = 0
    get_hits: int = 0
    get_misses: int = 0
    reservations: int = 0
    reservations_refused: int = 0
    reservations_expired: int = 0
    reserve_hits: int = 0
    commits: int = 0
    confirms_refused: int = 0
    releases: int = 0
    evictions: int = 0
    deletes: int = 0
    clears: int = 0


@dataclass
class ConfirmOutcome:
    """What a confirm did: ``committed`` pairs must be journaled; refusals are only counted."""

    committed: list[tuple[str, int]] = field(default_factory=list)
    refused: list[tuple[str, int]] = field(default_factory=list)
    released: int = 0
