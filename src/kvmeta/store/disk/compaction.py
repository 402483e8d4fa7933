"""When the journal has grown enough that a snapshot should replace it.

The journal grows with every change, while the state it describes stays the size of the cache:
the engine cycle writes about 650 bytes of journal per request (~4 MB/s at full speed) over a
state of a few MB. With time-driven snapshots alone the data directory grows by gigabytes
between two of them, and a restart after a crash replays all of it before it listens. So a
snapshot is also due once the journal written since the newest snapshot reaches the sooner of

    max(--snapshot-journal-bytes, snapshot size)
    max(--snapshot-journal-ratio x snapshot size, RATIO_FLOOR)

(a flag that is 0 leaves its term out; both 0: time-driven snapshots only). The bytes bound the
disk and the replay after a crash; the ratio makes a mid-sized state compact before the bytes
are reached (its snapshot is cheap, and a journal many times the state is mostly changes that
cancel out). Each term has a floor, because a snapshot costs CPU in proportion to the state (at
10^6 keys about 0.6 s of walking and encoding) and the journal it replaces pays for it: the
ratio's, RATIO_FLOOR, keeps a tiny state from snapshotting after every few groups (as Redis's
auto-aof-rewrite-min-size does); the bytes', the snapshot's own size, keeps a state bigger than
the bytes from snapshotting back to back (its restart is dominated by loading the snapshot
anyway, and replaying as much journal again at most doubles it).

The older files go only once the new snapshot is durable, and the journal keeps growing while
it is written: so the snapshot starts early by the journal bytes written while recent ones were
being written (at most half the limit), and under a steady load the journal on disk stays
near the limit. The data directory then holds at most two snapshots (the newest and the one
being written) and the limit's worth of journal:

    disk <= 2 x snapshot + limit

Journal bytes a start-up replayed (segments after the newest snapshot) count too: a server
restarted after a crash with a long journal snapshots at once, so a second crash does not
replay it again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_JOURNAL_BYTES", "DEFAULT_JOURNAL_RATIO", "RATIO_FLOOR", "JournalBudget"]

# 64 MiB of engine-cycle journal replays in well under a second on top of the snapshot's own
# load (benchmarks/README.md, "Durability"), and at ~14 MB/s it is one snapshot every ~5 s.
DEFAULT_JOURNAL_BYTES = 64 << 20
DEFAULT_JOURNAL_RATIO = 2.0
# The ratio term's lower bound: 16 MiB replays in a fraction of a second, and at ~14 MB/s a
# tiny state still snapshots only about once a second.
RATIO_FLOOR = 16 << 20


@dataclass
class JournalBudget:
    """How much journal the data directory holds since its newest snapshot, against the limit.

    ``written`` arguments are the journal's ``bytes_written`` (a counter that only grows)."""

    ratio: float = DEFAULT_JOURNAL_RATIO
    cap: int = DEFAULT_JOURNAL_BYTES
    snapshot_bytes: int = 0  # the newest snapshot's file size (0: none yet)
    mark: int = 0  # ``written`` when the newest snapshot's first segment began
    backlog: int = 0  # journal since the newest snapshot from before this process: replayed
    lead: int = 0  # journal written while recent snapshots were being written

    def limit(self) -> int:
        """Journal bytes since the newest snapshot that make the next one due (0: never)."""
        limits = []
        if self.cap > 0:
            limits.append(max(self.cap, self.snapshot_bytes))
        if self.ratio > 0:
            limits.append(max(int(self.ratio * self.snapshot_bytes), RATIO_FLOOR))
        return min(limits, default=0)

    def since(self, written: int) -> int:
        """Journal bytes on disk since the newest snapshot."""
        return self.backlog + written - self.mark

    def threshold(self) -> int:
        """Journal bytes since the newest snapshot at which the next one starts (0: never):
        the limit, less the journal the last snapshot's writing took."""
        limit = self.limit()
        return limit - min(self.lead, limit // 2)

    def due(self, written: int) -> bool:
        threshold = self.threshold()
        return threshold > 0 and self.since(written) >= threshold

    def grow_at(self) -> int:
        """The ``written`` at which a snapshot becomes due, for ``Journal.grow_at`` (0: never)."""
        threshold = self.threshold()
        return 0 if threshold <= 0 else max(1, self.mark - self.backlog + threshold)

    def snapshotted(self, snapshot_bytes: int, mark: int, written: int) -> None:
        """A snapshot of ``snapshot_bytes`` is durable; it covers the journal written before
        ``mark`` (and every segment from before this process). ``written``: the journal's
        bytes now, so ``written - mark`` were written while the snapshot was."""
        self.snapshot_bytes = snapshot_bytes
        self.mark = mark
        self.backlog = 0
        # The longest recent writing, decaying: one quick snapshot must not make the next late.
        self.lead = max(written - mark, self.lead * 3 // 4)
