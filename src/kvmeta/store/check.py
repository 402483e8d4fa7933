"""``kvmeta check``: verify a data directory offline, without changing it.

Loads the latest snapshot and replays the journal exactly as start-up would (but reports a torn
tail instead of cutting it), then runs the full page invariant on every pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvmeta.core.invariants import InvariantViolation, check_pool
from kvmeta.errors import InvalidRequest, JournalCorrupt
from kvmeta.store.recovery import list_data_dir, recover

__all__ = ["CheckReport", "check_data_dir"]


@dataclass
class CheckReport:
    """What ``kvmeta check`` found; ``ok`` decides the exit code."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_data_dir(directory: Path) -> CheckReport:
    """Check ``directory``; never raises for damage, reports it."""
    from kvmeta.core.pool import Pool

    report = CheckReport()
    if not directory.is_dir():
        report.problems.append(f"{directory} is not a directory")
        return report
    listing = list_data_dir(directory)
    report.lines.append(
        f"{directory}: {len(listing.snapshots)} snapshot(s), {len(listing.segments)} journal "
        f"segment(s), {len(listing.temporaries)} leftover temporary file(s)"
    )
    try:
        state = recover(directory, repair=False)
    except JournalCorrupt as exc:
        report.problems.append(str(exc))
        return report
    report.lines.append(
        f"snapshot {state.snapshot}, {state.records} journal records replayed, "
        f"{state.torn_bytes} torn bytes at the tail (cut at next start) in {state.seconds:.3f} s"
    )
    for pid, (num_pages, entries) in sorted(state.pools.items()):
        try:
            pool = Pool.load(num_pages, list(entries.items()))
            check_pool(pool)
        except (InvalidRequest, InvariantViolation) as exc:
            report.problems.append(f"{pid}: {exc}")
            continue
        report.lines.append(f"{pid}: {num_pages} pages, {len(entries)} stored keys: ok")
    if state.vworld is not None:
        report.lines.append(f"vLLM world size {state.vworld}")
    report.lines.append(f"total: {len(state.pools)} pools, {state.keys} stored keys")
    return report
