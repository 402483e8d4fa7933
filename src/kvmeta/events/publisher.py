"""The KV event publisher: the backend's change feed (``store.changes``) out on ZeroMQ.

Changes arrive on the event loop once durable (the backend's rule); they are turned into the
engines' events and sent as one batch every few milliseconds (``_GATHER``), so a burst
of requests costs one encode and one send, not one per request. Each batch gets the next sequence
number of this run and is kept for replay (``--events-buffer`` batches).

Topic: ``kvmeta/<backend epoch>/<run>``, ``run`` new at each start. A subscriber sees a new
run as a new topic and sequence numbers from 0 again; the run's first batches are its
*resync*: one ``AllBlocksCleared`` for the whole server, then per pool ``AllBlocksCleared`` and
``BlockStored`` of every key it holds (``Backend.dump``), all with reason
``restart-recovery``. Changes made meanwhile are held and published right after, so a
subscriber that applies the run in order ends with the pools' state.

SGLang's parent block: the reserve request names each key's prefix key (``note_reserve``); it
is kept per pool until the key's confirm is published, within ``_PREFIX_CAP`` keys overall
(the oldest are forgotten first: their events then carry no parent).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import Any

import zmq

from kvmeta._types import PoolId
from kvmeta.errors import NotInitialized
from kvmeta.events.replay import ReplayServer
from kvmeta.events.wire import BlockHash, Encoder, Event, sglang_hash, sglang_hashes
from kvmeta.store.changes import CLEARED, REASON_RESTART, REMOVED, STORED, Change

__all__ = ["LAG_BUCKETS", "EventStats", "Publisher", "bindable"]

logger = logging.getLogger(__name__)

# Events per batch at most (a resync or a long loop pass is cut into several batches), and
# keys per resync BlockStored event.
_MAX_EVENTS = 1024
_DUMP_PAGE = 2048
# Prefix keys remembered from reserves, all pools together (about 250 bytes each), and how
# many are noted between two compactions of their tables (``Publisher._compact``).
_PREFIX_CAP = 1 << 17
_COMPACT_EVERY = 1 << 14
# Changes are gathered this long (seconds) before their batch is sent: fewer, larger batches
# cost less per change (each ZeroMQ send is dear on the server: 2 ms measured +28 % CPU per
# request, 5 ms +19 %, 10 ms +20 % at the batch-64 cycle) for a few milliseconds of lag.
_GATHER = 0.005
# Seconds from a change reaching the publisher to its batch being sent.
LAG_BUCKETS: tuple[float, ...] = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


@dataclass
class EventStats:
    """Counters for ``/metrics`` (plain ints: only the loop thread writes them)."""

    events: int = 0
    blocks: int = 0
    batches: int = 0
    resyncs: int = 0
    lag_count: int = 0
    lag_sum: float = 0.0
    lag_max: float = 0.0
    lag_buckets: list[int] = field(default_factory=lambda: [0] * len(LAG_BUCKETS))
    replay: ReplayServer | None = None

    @property
    def replay_requests(self) -> int:
        return 0 if self.replay is None else self.replay.requests

    def lag(self, seconds: float) -> None:
        self.lag_count += 1
        self.lag_sum += seconds
        if seconds > self.lag_max:
            self.lag_max = seconds
        for i, bound in enumerate(LAG_BUCKETS):
            if seconds <= bound:
                self.lag_buckets[i] += 1
                break


def bindable(endpoint: str) -> str:
    """``tcp://host:0`` (a free port, as ``--port 0``) in ZeroMQ's spelling ``tcp://host:*``."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class Publisher:
    """One PUB socket (and optionally one replay ROUTER socket) fed by ``on_changes``."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        buffer: int = 10_000,
        encoding: str = "map",
        medium: str = "EXTERNAL",
        epoch: str = "",
    ) -> None:
        self.encoder = Encoder(encoding, medium)
        self.run = uuid.uuid4().hex[:8]
        self.topic = f"kvmeta/{epoch}/{self.run}".encode()
        self.stats = EventStats()
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 1000)
        self.replay: ReplayServer | None = None
        try:
            self.pub.bind(bindable(endpoint))
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint:
                self.replay = ReplayServer(self._ctx, bindable(replay_endpoint), self.buffer)
                self.stats.replay = self.replay
        except zmq.ZMQError:
            self.close()
            raise
        # Events made from the changes reported since the last batch (made at once, while the
        # keys are fresh in the CPU caches; sent together).
        self._pending: list[Event] = []
        self._pending_blocks = 0
        self._first_at = 0.0
        self._first_wall = 0.0
        self._holding = False
        self._scheduled = False  # a flush is due (call_later)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefixes: dict[PoolId, dict[str, str | None]] = {}
        self._noted = 0

    # ------------------------------------------------------------------ inputs

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if self.replay is not None:
            self.replay.start(loop)
        self._schedule()  # changes reported before the loop was known

    def on_changes(self, changes: list[Change]) -> None:
        """The backend's change listener: make the events now, send them within ``_GATHER``."""
        if not self._pending:
            self._first_at = time.perf_counter()
            self._first_wall = time.time()
        for change in changes:
            self._pending_blocks += self._events_of(change, self._pending)
        if not self._scheduled:
            self._schedule()

    def _schedule(self) -> None:
        if self._holding or self._loop is None or not self._pending:
            return
        self._scheduled = True
        self._loop.call_later(_GATHER, self.flush)

    def note_reserve(self, pool: PoolId, pairs: Iterable[tuple[str, str | None]]) -> None:
        """Remember each reserved key's prefix key (SGLang's ``[key, prefix_key]`` pairs)."""
        known = self._prefixes.get(pool)
        if known is None:
            known = self._prefixes[pool] = {}
        before = len(known)
        known.update(pairs)
        self._noted += len(known) - before
        if self._noted > _COMPACT_EVERY:
            self._compact()

    def _compact(self) -> None:
        """Copy the prefix tables (most entries are popped by their confirm soon after: a
        dict that had many keys deleted keeps its size and gets slower to probe; a copy is
        as small as what is left), and forget the oldest half of any pool over the cap."""
        total = sum(len(known) for known in self._prefixes.values())
        fresh: dict[PoolId, dict[str, str | None]] = {}
        for pool, known in self._prefixes.items():
            if not known:
                continue
            if total > _PREFIX_CAP:
                known = dict(islice(known.items(), len(known) // 2, None))
            else:
                known = dict(known)
            fresh[pool] = known
        self._prefixes = fresh
        self._noted = 0

    # ------------------------------------------------------------------ output

    def flush(self) -> None:
        """Send everything queued (also called at shutdown)."""
        self._scheduled = False
        if self._holding or not self._pending:
            return
        events, self._pending = self._pending, []
        blocks, self._pending_blocks = self._pending_blocks, 0
        self._send(events, blocks, self._first_at, self._first_wall)

    def _send(self, events: list[Event], blocks: int, since: float, ts: float = 0.0) -> None:
        """``ts``: when the first change reached the publisher (a subscriber's receive time
        minus ``ts`` is the whole publish lag); 0: now."""
        stats = self.stats
        ts = ts or time.time()
        for i in range(0, len(events), _MAX_EVENTS):
            chunk = events if len(events) <= _MAX_EVENTS else events[i : i + _MAX_EVENTS]
            payload = self.encoder.batch(ts, chunk)
            seq = self.seq
            self.seq += 1
            try:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:  # pragma: no cover - a PUB socket drops rather than blocks
                pass
            self.buffer.append((seq, self.topic, payload))
            stats.batches += 1
        stats.events += len(events)
        stats.blocks += blocks
        if since:
            stats.lag(time.perf_counter() - since)

    def _events_of(self, change: Change, out: list[Event]) -> int:
        pool, keys = change.pool, change.keys
        enc = self.encoder
        if change.kind == STORED:
            if pool.dialect != "s":
                out.append(enc.stored(pool, list(map(str.encode, keys)), None, (), None))
                return len(keys)
            self._stored_runs(pool, keys, out)
            return len(keys)
        if change.kind == REMOVED:
            hashes: Sequence[BlockHash]
            if pool.dialect == "s":
                hashes = sglang_hashes(keys)
            else:
                hashes = list(map(str.encode, keys))
            out.append(enc.removed(pool, hashes, change.reason))
            return len(keys)
        if change.kind == CLEARED:
            self._prefixes.pop(pool, None)
            out.append(enc.cleared(pool, change.reason))
        return 0

    def _stored_runs(self, pool: PoolId, keys: tuple[str, ...], out: list[Event]) -> None:
        """One BlockStored per chain: a key continues the run when its prefix key is the key
        before it (SGLang confirms a sequence's pages in order)."""
        known = self._prefixes.get(pool)
        if known is None:
            parents: list[str | None] = [None] * len(keys)
        else:
            parents = list(map(known.pop, keys, repeat(None)))
        if parents[1:] == list(keys[:-1]):  # one chain: the usual confirm of a sequence
            self._emit_run(pool, keys, parents[0], out)
            return
        run: list[str] = []
        run_parent: str | None = None
        last: str | None = None
        for key, parent in zip(keys, parents, strict=True):
            if run and (parent is None or parent != last):
                self._emit_run(pool, run, run_parent, out)
                run = []
            if not run:
                run_parent = parent
            run.append(key)
            last = key
        if run:
            self._emit_run(pool, run, run_parent, out)

    def _emit_run(
        self, pool: PoolId, run: Sequence[str], parent: str | None, out: list[Event]
    ) -> None:
        hashes: Sequence[BlockHash] = sglang_hashes(run)
        parent_hash = None if parent is None else sglang_hash(parent)
        out.append(self.encoder.stored(pool, hashes, parent_hash, run, parent))

    # ------------------------------------------------------------------ resync

    async def resync(self, backend: Any) -> None:
        """Publish what the backend holds (see the module docstring); live changes wait."""
        self._holding = True
        started = time.perf_counter()
        pools = 0
        keys_sent = 0
        try:
            enc = self.encoder
            self._send([enc.cleared(None, REASON_RESTART)], 0, 0.0)
            for st in await backend.stats():
                pool = st.pool
                events: list[Event] = [enc.cleared(pool, REASON_RESTART)]
                cursor = ""
                try:
                    while True:
                        keys, cursor = await backend.dump(pool, cursor, _DUMP_PAGE)
                        if keys:
                            events.append(self._resync_stored(pool, keys))
                            keys_sent += len(keys)
                        if len(events) >= 8 or (events and not cursor):
                            self._send(events, sum(_blocks(e) for e in events), 0.0)
                            events = []
                        if not cursor:
                            break
                except NotInitialized:  # removed meanwhile: its drop is among the held changes
                    if events:
                        self._send(events, 0, 0.0)
                pools += 1
            self.stats.resyncs += 1
        finally:
            self._holding = False
            self.flush()  # what changed meanwhile, right after the resync
        logger.info(
            "events: resync published %d pools, %d keys in %.3f s (run %s)",
            pools,
            keys_sent,
            time.perf_counter() - started,
            self.run,
        )

    def _resync_stored(self, pool: PoolId, keys: list[str]) -> Event:
        hashes: list[BlockHash]
        if pool.dialect == "s":
            return self.encoder.stored(pool, sglang_hashes(keys), None, keys, None, REASON_RESTART)
        hashes = list(map(str.encode, keys))
        return self.encoder.stored(pool, hashes, None, (), None, REASON_RESTART)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Send what is queued, then close the sockets (waiting up to 1 s for slow readers)."""
        self._holding = False
        self.flush()
        if self.replay is not None:
            self.replay.close()
        self.pub.close()
        self._ctx.term()


def _blocks(event: Event) -> int:
    hashes = getattr(event, "block_hashes", None)
    return len(hashes) if hashes is not None else 0
