"""Power loss at any journal boundary never maps a key onto another key's bytes.

A hypothesis state machine drives the journaled ``LocalBackend`` itself (its write-ahead rule,
``WriteAhead.before`` / ``after``, decides when a reserve runs and when its reply may leave:
a reply that waits for the disk is a suspended call, resumed whenever the disk moves) with
several writers, joins, retried reserves and confirms, duplicate and repeated releases,
deletes, clears, lease expiry and a disk that makes records durable only when the test says
so. Writers write a page's bytes (``disk[page] = key``) only once their reply has left, and
only while their lease lasts. At any step the power may fail: the journal is cut anywhere
between its durable length and its full length (un-fsynced records may or may not have reached
the disk), the state is replayed from that prefix, and every recovered ``key -> page`` must
find its own bytes there.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmeta._types import PoolId
from kvmeta.core import Pool, check_pool
from kvmeta.core.pool import RELEASE_GRACE
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.recovery import Recovered, _apply
from tests.unit.store.durable_support import FakeJournal, journaled, now

P = PoolId("s", 0, "kv")
PAGES = 2
TTL = 30.0
RETRY_WINDOW = 2.0  # the engines' clients resend a request within about two seconds
KEYS = st.sampled_from([f"k{i}" for i in range(3)])


@dataclass
class Writer:
    keys: list[str]
    sent: float
    call: Coroutine[Any, Any, list[tuple[bool, int]]] | None  # the reserve, until it replies
    out: list[tuple[bool, int]] = field(default_factory=list)
    written: list[tuple[str, int]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    done: bool = False  # written (or given up); confirm next


class PowerLoss(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.disk: dict[int, str] = {}  # page -> key whose bytes it holds
        self.waiting: list[Writer] = []  # reserve replies not yet sent
        self.writers: list[Writer] = []  # replies sent, write not yet confirmed
        self.confirms: list[tuple[float, list[tuple[str, int]], list[int]]] = []
        self._boot(FakeJournal(auto=False), None)

    def _boot(self, journal: FakeJournal, recovered: Recovered | None) -> None:
        self.journal = journal
        self.store = MemoryStore(reservation_ttl=TTL, read_lease=0.0, clock=lambda: self.now)
        self.backend = journaled(self.store, journal)
        if recovered is None or P not in recovered.pools:
            self.store.initialize(P, PAGES)
        else:
            num_pages, entries = recovered.pools[P]
            self.store.load_pool(P, num_pages, list(entries.items()))

    @property
    def pool(self) -> Pool:
        return self.store.pool(P)

    # ------------------------------------------------------------------ the engine's side

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3))
    def reserve(self, keys: list[str]) -> None:
        """The reserve runs at once, or once the disk has the removals it waits for."""
        self.waiting.append(Writer(keys, self.now, self.backend.reserve(P, keys)))
        self._send_replies()

    @precondition(lambda self: self.writers or self.waiting)
    @rule(data=st.data())
    def retried_reserve(self, data: st.DataObject) -> None:
        """A client resends a reserve (or a second writer asks for the same keys): it joins."""
        self.reserve(data.draw(st.sampled_from(self.writers + self.waiting)).keys)

    @precondition(lambda self: any(not w.done for w in self.writers))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """A writer writes its pages (most writes succeed); it confirms in a later step."""
        writer = data.draw(st.sampled_from([w for w in self.writers if not w.done]))
        writer.done = True
        if self.now - writer.sent >= TTL:
            return  # a writer past its lease touches nothing (guarantees: --reservation-ttl)
        for key, (hit, page) in zip(writer.keys, writer.out, strict=True):
            if hit or page < 0:
                continue
            if data.draw(st.integers(0, 3)):
                self.disk[page] = key
                writer.written.append((key, page))
            else:
                writer.failed.append(page)
        if data.draw(st.booleans()):
            writer.failed += writer.failed  # a client that names a failed page twice

    @precondition(lambda self: any(w.done for w in self.writers))
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        writer = data.draw(st.sampled_from([w for w in self.writers if w.done]))
        self.writers.remove(writer)
        if self.now - writer.sent >= TTL:
            return
        now(self.backend.confirm(P, writer.written, writer.failed))
        self.confirms.append((self.now, writer.written, writer.failed))

    @precondition(lambda self: self.confirms)
    @rule(data=st.data())
    def retried_confirm(self, data: st.DataObject) -> None:
        sent, ok, failed = data.draw(st.sampled_from(self.confirms))
        if self.now - sent <= RETRY_WINDOW:
            now(self.backend.confirm(P, ok, failed))

    @rule(keys=st.lists(KEYS, max_size=3))
    def get_and_delete(self, keys: list[str]) -> None:
        now(self.backend.get(P, keys))
        now(self.backend.delete(P, keys))

    @rule()
    def clear(self) -> None:
        now(self.backend.clear(P))

    @rule(dt=st.sampled_from([0.5, RETRY_WINDOW, RELEASE_GRACE, TTL]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.pool.expire(self.now)

    # ------------------------------------------------------------------ the disk

    @rule(data=st.data())
    def fsync(self, data: st.DataObject) -> None:
        journal = self.journal
        self.sync(data.draw(st.integers(journal.durable_seq, journal.seq)))

    def sync(self, seq: int) -> None:
        self.journal.durable_seq = max(self.journal.durable_seq, seq)
        self._send_replies()

    def _send_replies(self) -> None:
        """Resume every waiting reserve: those whose wait is over run on and reply."""
        for writer in list(self.waiting):
            assert writer.call is not None
            try:
                writer.call.send(None)
            except StopIteration as done:
                writer.out, writer.call = done.value, None
                self.waiting.remove(writer)
                self.writers.append(writer)

    @rule(data=st.data())
    def power_loss(self, data: st.DataObject) -> None:
        journal = self.journal
        # Most often nothing beyond the last fsync survives: the case that tests the rule.
        cut = data.draw(
            st.one_of(st.just(journal.durable_seq), st.integers(journal.durable_seq, journal.seq))
        )
        recovered = Recovered()
        for record in journal.records[:cut]:
            _apply(recovered, record)
        survivor = FakeJournal(auto=False)
        survivor.records = journal.records[:cut]
        survivor.seq = survivor.durable_seq = cut
        for writer in self.waiting:  # the process died with these replies unsent
            assert writer.call is not None
            writer.call.close()
        self.waiting, self.writers, self.confirms = [], [], []
        self._boot(survivor, recovered)
        self.every_key_finds_its_own_bytes("after power loss")

    @invariant()
    def page_invariant(self) -> None:
        check_pool(self.pool)
        self.every_key_finds_its_own_bytes("while running")

    def every_key_finds_its_own_bytes(self, when: str) -> None:
        for key, page in self.pool._stored.items():
            assert self.disk.get(page) == key, (
                f"{when}: {key!r} -> page {page}, which holds {self.disk.get(page)!r}'s bytes"
            )


TestPowerLoss = PowerLoss.TestCase
TestPowerLoss.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)
