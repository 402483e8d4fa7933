"""The KV event publisher: the backend's change feed (``store.changes``) out on ZeroMQ.

Changes arrive on the event loop once durable (the backend's rule); each is turned into the
engines' events and encoded at once, while its keys are fresh in the CPU caches (the SGLang
hashes go straight from the hex keys to msgpack, ``hash_body``: no Python int per
key), and the encoded events are sent as one batch every few milliseconds (``_GATHER``), so a
burst of requests costs one send, not one per request. Holding the changes (or the requests'
objects) until the batch is sent measured dearer: the held objects push the next requests'
memory out of the caches and give the cyclic GC more to walk. Each batch gets the next sequence
number of this run and is kept for replay (``--events-buffer`` batches).

Topic: ``kvmeta/<backend epoch>/<run>``, ``run`` new at each start. A subscriber sees a new
run as a new topic and sequence numbers from 0 again; the run's first batches are its
*resync*: one ``AllBlocksCleared`` for the whole server, then per pool ``AllBlocksCleared`` and
``BlockStored`` of every key it holds (``Backend.dump``), all with reason
``restart-recovery``. Changes made meanwhile are held and published right after, so a
subscriber that applies the run in order ends with the pools' state.

A pool the backend reports ``UNSURE`` (a Redis call that failed after it was sent: Redis may
have run it without anyone announcing it) is stated again the same way, alone, with reason
``resync``: once the backend has settled the pool's earlier changes (``settle_changes``, so no
older change follows the pool's new state), everything queued is sent, then the pool's
``AllBlocksCleared`` and ``BlockStored`` of what it holds, the changes made meanwhile after.
Pools are resynced one at a time; while the backend does not answer, the pool waits and is
tried again, so the subscribers' view converges once Redis is back.

A backend that reports ``LOST`` (Redis lost its data: its epoch changed) gets the start's
resync again, whole, with reason ``data-lost``: what is queued is sent, then one
``AllBlocksCleared`` for the whole server and every pool the backend holds now (none, or the
ones created since), the changes made meanwhile after. The run and topic stay (the topic names
the epoch the run started in); sequence numbers go on.

SGLang's parent block: the reserve request names each key's prefix key (``note_reserve``), kept
(``events.parents``) until the key's confirm is published.

Removals: an eviction's hashes are made from its keys, as a confirm's are. (Keeping each
confirm's hash array until its keys were evicted, to cut the eviction's from it, measured no
cheaper per request beyond the noise: benchmarks/README.md, Events.)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvmeta._types import PoolId
from kvmeta.errors import NotInitialized
from kvmeta.events.listen import ListenGuard
from kvmeta.events.parents import Parents
from kvmeta.events.replay import ReplayBuffer, ReplayServer
from kvmeta.events.wire import (
    Encoder,
    Event,
    Hashes,
    hash_array,
    hash_body,
    sglang_hash,
)
from kvmeta.store.changes import (
    CLEARED,
    LOST,
    REASON_DATA_LOST,
    REASON_RESTART,
    REASON_RESYNC,
    REMOVED,
    STORED,
    UNSURE,
    Change,
)

__all__ = ["LAG_BUCKETS", "EventStats", "Publisher", "bindable"]

logger = logging.getLogger(__name__)

# Events per batch at most (a resync or a long loop pass is cut into several batches), and
# keys per resync BlockStored event.
_MAX_EVENTS = 1024
_DUMP_PAGE = 2048
# Changes are gathered this long (seconds) before their batch is sent: fewer, larger batches
# cost less per change. Each batch costs about the same whatever its size (the socket wakes
# ZeroMQ's I/O thread, which writes it to each subscriber: about 100-150 us of CPU on a busy
# 2-core machine, against 5 us for a send with warm caches): with 5 ms batches that work was
# about a fifth of the events' cost at the batch-64 cycle. The lag a subscriber sees is this
# window plus a few milliseconds (p99 about 11 ms measured; the target is at most 20 ms).
_GATHER = 0.008
# A frame out through the socket's compiled ``send``: pyzmq's ``send_multipart`` and its
# Python ``send`` wrapper check arguments these calls do not use (2.8 against 5.9 us a batch).
_SEND_FRAME = zmq.backend.Socket.send
_MORE = zmq.SNDMORE | zmq.NOBLOCK
# A pool resync that failed (the backend did not answer) is tried again after this many
# seconds, doubling up to the second value; and a pool resynced waits this long before another
# pass (a backend failing every call must not have the publisher dump its pools back to back).
_RESYNC_RETRY = (0.2, 5.0)
_RESYNC_PAUSE = 0.5
# Seconds from a change reaching the publisher to its batch being sent.
LAG_BUCKETS: tuple[float, ...] = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


@dataclass
class EventStats:
    """Counters for ``/metrics`` (plain ints: only the loop thread writes them)."""

    events: int = 0
    blocks: int = 0
    batches: int = 0
    resyncs: int = 0
    pool_resyncs: int = 0
    lag_count: int = 0
    lag_sum: float = 0.0
    lag_max: float = 0.0
    lag_buckets: list[int] = field(default_factory=lambda: [0] * len(LAG_BUCKETS))
    replay: ReplayServer | None = None
    guards: list[ListenGuard] = field(default_factory=list)

    @property
    def listen_pauses(self) -> int:
        """Times an event socket stopped listening, short of descriptors (``events.listen``)."""
        return sum(g.pauses for g in self.guards)

    @property
    def replay_requests(self) -> int:
        return 0 if self.replay is None else self.replay.requests

    @property
    def replay_refused(self) -> int:
        return 0 if self.replay is None else self.replay.refused

    @property
    def replay_answers(self) -> tuple[int, int]:
        """(answers under way, bytes they have not yet written to their connections)."""
        if self.replay is None:
            return 0, 0
        return self.replay.in_flight, self.replay.queued

    @property
    def replay_buffer(self) -> tuple[int, int]:
        """(batches, bytes) kept for replay now (none without a replay socket)."""
        if self.replay is None:
            return 0, 0
        return len(self.replay.buffer), self.replay.buffer.bytes

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
        buffer_bytes: int = 256 << 20,
        queue: int = 1_000,
        replay_clients: int = 8,
        replay_queue_bytes: int = 64 << 20,
        replay_timeout: float = 30.0,
        encoding: str = "map",
        medium: str = "EXTERNAL",
        epoch: str = "",
        keys: bool = True,
    ) -> None:
        self.encoder = Encoder(encoding, medium)
        # Whether SGLang pools' ``BlockStored`` carry their page keys (``--events-keys``).
        self.keys = keys
        self.run = uuid.uuid4().hex[:8]
        self.topic = f"kvmeta/{epoch}/{self.run}".encode()
        self.stats = EventStats()
        # The batches a replay answers from: only with a replay socket (``replay``).
        self.buffer: ReplayBuffer | None = None
        self.seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        # Batches ZeroMQ queues for each subscriber (``--events-queue``): one that stops
        # reading misses later batches (and replays them) instead of the server keeping every
        # batch for it (a stalled subscriber grew the server by 5 MB/s at the batch-64 cycle).
        self.pub.setsockopt(zmq.SNDHWM, queue)
        self.pub.setsockopt(zmq.LINGER, 1000)
        self.replay: ReplayServer | None = None
        try:
            self.pub.bind(bindable(endpoint))
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint:
                self.buffer = ReplayBuffer(buffer, buffer_bytes)
                self.replay = ReplayServer(
                    self._ctx,
                    bindable(replay_endpoint),
                    self.buffer,
                    clients=replay_clients,
                    queue_bytes=replay_queue_bytes,
                    timeout=replay_timeout,
                )
                self.stats.replay = self.replay
        except zmq.ZMQError:
            self.close()
            raise
        # The events of the changes reported since the last batch, each encoded at once (while
        # its keys are fresh in the CPU caches; no Python object per key outlives the call),
        # sent together.
        self._pending: list[msgspec.Raw] = []
        self._pending_blocks = 0
        self._first_at = 0.0
        self._first_wall = 0.0
        self._holding = False
        self._scheduled = False  # a flush is due (call_later)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each reserved key's prefix key, until its confirm names it as its parent.
        self.parents = Parents()
        # Pools reported UNSURE, waiting to be stated again (``_resync_unsure``), the task
        # doing it, and the backend it reads (known from ``resync``); resyncs take turns.
        self._unsure: dict[PoolId, None] = {}
        self._unsure_task: asyncio.Task[None] | None = None
        self._backend: Any = None
        self._resync_lock = asyncio.Lock()
        self._closed = False
        # A LOST change waiting for its whole-server resync (``_resync_lost``), and the task.
        self._lost = False
        self._lost_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ inputs

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        guards = [ListenGuard(self.pub, self.endpoint, "--events")]
        if self.replay is not None:
            self.replay.start(loop)
            guards.append(ListenGuard(self.replay.sock, self.replay.endpoint, "--events-replay"))
        for guard in guards:
            guard.start(loop)
        self.stats.guards = guards
        self._schedule()  # changes reported before the loop was known

    def on_changes(self, changes: list[Change]) -> None:
        """The backend's change listener: encode the events now, send them within
        ``_GATHER``."""
        if not self._pending:
            self._first_at = time.perf_counter()
            self._first_wall = time.time()
        for change in changes:
            self._add(change)
        if not self._scheduled:
            self._schedule()

    def note_reserve(
        self,
        pool: PoolId,
        pairs: Sequence[tuple[str, str | None]],
        keys: Sequence[str] | None = None,
    ) -> None:
        """Remember each reserved key's prefix key (SGLang's ``[key, prefix_key]`` pairs);
        ``keys``: the pairs' keys, when the caller has them already."""
        if pairs:
            self.parents.note(pool, pairs, keys)

    def _schedule(self) -> None:
        if self._holding or self._loop is None or not self._pending:
            return
        self._scheduled = True
        self._loop.call_later(_GATHER, self.flush)

    # ------------------------------------------------------------------ output

    def flush(self) -> None:
        """Send everything queued (also called at shutdown)."""
        self._scheduled = False
        if self._holding or not self._pending:
            return
        events, self._pending = self._pending, []
        blocks, self._pending_blocks = self._pending_blocks, 0
        self._send(events, blocks, self._first_at, self._first_wall)

    def _add(self, change: Change) -> None:
        """Queue the change's events, encoded."""
        pool, kind, keys, reason = change
        out = self._pending
        enc = self.encoder
        if kind == CLEARED:
            self.parents.forget(pool)
            out.append(enc.raw(enc.cleared(pool, reason)))
            return
        if not keys:  # (UNSURE and LOST changes have none: off the path of the usual ones)
            if kind == UNSURE:
                self._doubt(pool)
            elif kind == LOST:
                self._forget_all()
                self._lost = True
                self._resync_lost_soon()
            return
        self._pending_blocks += len(keys)
        if pool.dialect != "s":
            raw_keys = list(map(str.encode, keys))
            if kind == STORED:
                out.append(enc.raw(enc.stored(pool, raw_keys, None, (), None)))
            else:
                out.append(enc.raw(enc.removed(pool, raw_keys, reason)))
            return
        if type(keys) is not tuple:
            keys = tuple(keys)
        if kind == REMOVED:
            out.append(enc.raw(enc.removed(pool, _hashes(keys), reason)))
            return
        named = self.keys
        for run, parent in self.parents.runs(pool, keys):
            parent_hash = None if parent is None else sglang_hash(parent)
            out.append(
                enc.raw(enc.stored(pool, _hashes(run), parent_hash, run if named else (), parent))
            )

    def _send(
        self, events: Sequence[Event | msgspec.Raw], blocks: int, since: float, ts: float = 0.0
    ) -> None:
        """``ts``: when the first change reached the publisher (a subscriber's receive time
        minus ``ts`` is the whole publish lag); 0: now."""
        stats = self.stats
        ts = ts or time.time()
        pub = self.pub
        topic = self.topic
        kept = self.buffer
        for i in range(0, len(events), _MAX_EVENTS):
            chunk = events if len(events) <= _MAX_EVENTS else events[i : i + _MAX_EVENTS]
            payload = self.encoder.batch(ts, chunk)
            seq = self.seq
            self.seq += 1
            try:
                _SEND_FRAME(pub, topic, _MORE)
                _SEND_FRAME(pub, seq.to_bytes(8, "big"), _MORE)
                _SEND_FRAME(pub, payload, zmq.NOBLOCK)
            except zmq.Again:  # pragma: no cover - a PUB socket drops rather than blocks
                pass
            if kept is not None:
                kept.append(seq, topic, payload)
            stats.batches += 1
        stats.events += len(events)
        stats.blocks += blocks
        if since:
            stats.lag(time.perf_counter() - since)

    # ------------------------------------------------------------------ resync

    async def resync(self, backend: Any) -> None:
        """Publish what the backend holds (see the module docstring); live changes wait."""
        self._backend = backend
        async with self._resync_lock:
            self._lost = False  # (a loss reported before: this resync reads the state after it)
            await self._resync_all(backend, REASON_RESTART)
        self._resync_unsure_soon()  # pools reported before the backend was known
        self._resync_lost_soon()

    async def _resync_all(self, backend: Any, reason: str) -> None:
        self._holding = True
        started = time.perf_counter()
        pools = 0
        keys_sent = 0
        try:
            enc = self.encoder
            self._send([enc.cleared(None, reason)], 0, 0.0)
            for st in await backend.stats():
                # (a pool removed meanwhile: its drop is among the held changes)
                keys_sent += await self._state_pool(backend, st.pool, reason)
                pools += 1
            self.stats.resyncs += 1
        finally:
            self._holding = False
            self.flush()  # what changed meanwhile, right after the resync
        why = (
            ""
            if reason == REASON_RESTART
            else f", after the backend's epoch changed to {backend.epoch}"
        )
        logger.info(
            "events: resync published %d pools, %d keys in %.3f s (run %s%s)",
            pools,
            keys_sent,
            time.perf_counter() - started,
            self.run,
            why,
        )

    # ------------------------------------------------------------------ lost state

    def _forget_all(self) -> None:
        """Drop the parents kept per pool: the pools' keys may all be gone."""
        self.parents.clear()

    def _resync_lost_soon(self) -> None:
        if not self._lost or self._closed or self._loop is None or self._backend is None:
            return
        if self._lost_task is None or self._lost_task.done():
            self._lost_task = self._loop.create_task(self._resync_lost())

    async def _resync_lost(self) -> None:
        """The whole-server resync after ``LOST`` (the module docstring); while the backend
        does not answer it waits and tries again, as a pool's resync does. Losses reported
        while one runs make one more."""
        delay = _RESYNC_RETRY[0]
        while self._lost:
            try:
                async with self._resync_lock:
                    if not self._lost:
                        return
                    self._lost = False
                    self.flush()  # the changes before the loss, before the clear of them all
                    await self._resync_all(self._backend, REASON_DATA_LOST)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the backend did not answer: try again later
                self._lost = True
                logger.warning(
                    "events: cannot read the backend for the resync after it lost its data "
                    "(%s); trying again in %.1f s",
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RESYNC_RETRY[1])

    async def _state_pool(self, backend: Any, pool: PoolId, reason: str) -> int:
        """Send ``pool``'s ``AllBlocksCleared`` and ``BlockStored`` of every key it holds (a
        pool gone meanwhile holds nothing: its clear alone); the keys sent."""
        events: list[Event] = [self.encoder.cleared(pool, reason)]
        blocks = 0
        sent = 0
        cursor = ""
        try:
            while True:
                keys, cursor = await backend.dump(pool, cursor, _DUMP_PAGE)
                if keys:
                    events.append(self._resync_stored(pool, keys, reason))
                    blocks += len(keys)
                if len(events) >= 8 or (events and not cursor):
                    self._send(events, blocks, 0.0)
                    sent += blocks
                    events, blocks = [], 0
                if not cursor:
                    return sent
        except NotInitialized:
            if events:
                self._send(events, blocks, 0.0)
            return sent + blocks

    def _resync_stored(self, pool: PoolId, keys: list[str], reason: str) -> Event:
        if pool.dialect == "s":
            named = keys if self.keys else ()
            return self.encoder.stored(pool, _hashes(keys), None, named, None, reason)
        hashes = list(map(str.encode, keys))
        return self.encoder.stored(pool, hashes, None, (), None, reason)

    # ------------------------------------------------------------------ unsure pools

    def _doubt(self, pool: PoolId) -> None:
        """Queue ``pool`` for a resync (the module docstring) and make sure one runs."""
        self._unsure[pool] = None
        self._resync_unsure_soon()

    def _resync_unsure_soon(self) -> None:
        if not self._unsure or self._closed or self._loop is None or self._backend is None:
            return
        if self._unsure_task is None or self._unsure_task.done():
            self._unsure_task = self._loop.create_task(self._resync_unsure())

    async def _resync_unsure(self) -> None:
        delay = _RESYNC_RETRY[0]
        while self._unsure:
            pool = next(iter(self._unsure))
            del self._unsure[pool]
            try:
                async with self._resync_lock:
                    await self._resync_pool(pool)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the backend did not answer: try again later
                self._unsure[pool] = None
                logger.warning(
                    "events: cannot read %s back for its resync (%s); trying again in %.1f s",
                    pool,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RESYNC_RETRY[1])
                continue
            delay = _RESYNC_RETRY[0]
            await asyncio.sleep(_RESYNC_PAUSE)

    async def _resync_pool(self, pool: PoolId) -> None:
        """State ``pool`` again: what it holds now, after everything older was sent."""
        backend = self._backend
        await backend.settle_changes(pool)
        self.flush()  # every older change first: none may follow the pool's new state
        self._holding = True
        try:
            keys_sent = await self._state_pool(backend, pool, REASON_RESYNC)
            self.stats.pool_resyncs += 1
        finally:
            self._holding = False
            self.flush()
        logger.warning(
            "events: %s stated again (%d key(s)) after a backend call that may have changed it "
            "failed without a reply",
            pool,
            keys_sent,
        )

    async def cancel_resyncs(self) -> None:
        """Stop resyncing unsure pools and a lost state (at shutdown, before the backend
        closes)."""
        self._closed = True
        for task in (self._unsure_task, self._lost_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Send what is queued, then close the sockets (waiting up to 1 s for slow readers)."""
        self._holding = False
        self.flush()
        for guard in self.stats.guards:
            guard.close()
        if self.replay is not None:
            self.replay.close()
        self.pub.close()
        self._ctx.term()


def _hashes(keys: Sequence[str]) -> Hashes:
    """A run's SGLang hashes, as their msgpack array when every key is 64 hex digits."""
    body = hash_body(keys)
    return [sglang_hash(k) for k in keys] if body is None else hash_array(len(keys), body)
