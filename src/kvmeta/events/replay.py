"""The replay socket: a ZeroMQ ROUTER that answers "every batch from sequence N".

The protocol is the engines' (their subscribers already speak it): a request is one frame,
the first sequence number wanted as 8 bytes big-endian (a REQ socket adds the empty delimiter
frame; a DEALER may send it or not, and the answer mirrors what it sent). The answer is each
buffered batch with a sequence number >= N as ``topic, sequence, payload`` (the frames of the
live stream), then the end marker ``b"", -1 as 8 bytes signed big-endian, b""``. Batches older
than the buffer are gone: when the first sequence answered is above N, the subscriber missed
some and must rebuild from ``GET /v1/dump`` (docs/events.md).

It runs on the event loop: a replay is non-blocking sends of buffered bytes, ``_SLICE`` batches
per turn of the loop at most (a whole buffer at once kept every HTTP request waiting).
Payloads are sent without a copy (the queued answer refers to the buffer's bytes): copied, a
requester that does not read held a copy of the whole buffer in the server, per request
(measured: benchmarks/README.md, "KV events"). A batch that leaves the buffer while an answer
is under way ends that answer early (its marker follows the last batch sent): the subscriber
sees the gap and asks again.

Even referring to the buffer, every batch handed to ZeroMQ costs its records of the frames, and
a batch that left the buffer stays alive while an answer holds it: requesters that never read
grew the server without bound in their number (the same section). So answers are capped: at
most ``clients`` are under way at once (a request beyond them gets at once the end marker with
``BUSY`` in its last frame), and a connection has at most its share of ``queue_bytes`` handed
to ZeroMQ and not yet written to it, all connections together at most ``queue_bytes``
(``_Peer``; what ZeroMQ wrote is known from one tracked frame per chunk: it releases a
connection's frames in order, once written). An answer without room waits, looked at every
``_POLL`` seconds; its slot is free once its marker is handed over. A requester that reads
nothing holds its share only until the kernel drops its connection: the socket's TCP user
timeout (``timeout``) also bounds how long a receive window may stay shut, and a dropped
connection's frames are released.

The buffer (``ReplayBuffer``) exists only with a replay socket: nobody could read it otherwise,
and a batch kept is memory that is never reused until it leaves the buffer (under the engine
cycle 10,000 batches are hundreds of MB, and each new one is fresh memory the kernel must fault
in, which costs CPU per batch: benchmarks/README.md, "KV events"). It is bounded in batches and
in bytes, whichever is reached first, since a batch's size ranges from one event to 1,024 of
them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator
from itertools import islice
from time import monotonic

import zmq

from kvmeta.events.reader import SocketReader

__all__ = ["BUSY", "BUSY_PREFIX", "END_MARKER", "ReplayBuffer", "ReplayServer"]

logger = logging.getLogger(__name__)

END_MARKER = (-1).to_bytes(8, "big", signed=True)
# Seconds between looks at the socket besides its wake-ups (``events.reader``).
_SAFETY_POLL = 1.0
# Batches sent per turn of the event loop in a replay answer.
_SLICE = 64
_MORE = zmq.SNDMORE | zmq.NOBLOCK
# Bytes an answer is charged per batch handed to ZeroMQ besides its payload: ZeroMQ's and
# pyzmq's records of its frames (about 400 measured), so that many small batches count too.
_FRAME_COST = 512
# Seconds between looks at the answers waiting for ZeroMQ to write what they handed it, doubling
# up to the second while none of them moves.
_POLL = 0.005
_POLL_MAX = 0.1
# Seconds between two warnings about refused requests (the count in between is in the next).
_REFUSALS_LOG = 10.0
# The largest value ZeroMQ's integer options take.
_INT_MAX = (1 << 31) - 1
# The last frame of the end marker that refuses a request (the end marker proper has b""):
# it starts with ``BUSY_PREFIX``, what a requester checks.
BUSY_PREFIX = b"busy"
BUSY = BUSY_PREFIX + (
    b": the replay socket is answering as many requests as it takes "
    b"(--events-replay-clients); ask again shortly"
)


class ReplayBuffer:
    """The latest batches ``(seq, topic, payload)``, oldest first: at most ``batches`` of
    them and at most ``max_bytes`` of payload (the newest batch is kept even when it alone is
    larger, so a replay always reaches the live feed)."""

    def __init__(self, batches: int, max_bytes: int) -> None:
        if batches < 1 or max_bytes < 1:
            raise ValueError(
                "a replay buffer holds at least one batch and one byte, got "
                f"{batches} batches, {max_bytes} bytes"
            )
        self.batches = batches
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[tuple[int, bytes, bytes]] = deque()

    def append(self, seq: int, topic: bytes, payload: bytes) -> None:
        items = self._items
        items.append((seq, topic, payload))
        self.bytes += len(payload)
        while len(items) > 1 and (len(items) > self.batches or self.bytes > self.max_bytes):
            self.bytes -= len(items.popleft()[2])

    def __iter__(self) -> Iterator[tuple[int, bytes, bytes]]:
        return iter(self._items)

    def since(self, seq: int) -> Iterator[tuple[int, bytes, bytes]]:
        """The batches from sequence number ``seq`` on (the buffer's are consecutive)."""
        items = self._items
        if not items:
            return iter(())
        return islice(items, max(0, seq - items[0][0]), None)

    def first(self) -> int | None:
        """The oldest sequence number kept (None: empty)."""
        return self._items[0][0] if self._items else None

    def __len__(self) -> int:
        return len(self._items)


class _Peer:
    """A requester's connection: its answer under way (``sending``: from ``next``, not yet
    ended by its marker), and what was handed to ZeroMQ for it and not yet written (``queued``
    bytes charged; ``chunks``: the tracker of each chunk's last frame with the bytes its release
    frees; ``carry``: bytes handed after the last tracked frame, freed with the next one)."""

    __slots__ = ("carry", "chunks", "first", "head", "next", "queued", "sending", "told", "waiting")

    def __init__(self) -> None:
        self.head: list[bytes] = []
        self.next = 0
        self.first = True  # nothing of this answer sent yet
        self.sending = False
        self.told = False  # a request overlapping this answer was logged
        self.waiting = False  # looked at by the next ``_poll``
        self.chunks: deque[tuple[zmq.MessageTracker, int]] = deque()
        self.queued = 0
        self.carry = 0

    def begin(self, head: list[bytes], start: int) -> None:
        self.head = head
        self.next = start
        self.first = True
        self.sending = True
        self.told = False

    def release(self) -> int:
        """Drop the chunks ZeroMQ has written; the bytes that frees."""
        chunks = self.chunks
        freed = 0
        while chunks and chunks[0][0].done:
            freed += chunks.popleft()[1]
        self.queued -= freed
        return freed


class ReplayServer:
    """Serves ``buffer`` (``(seq, topic, payload)``, oldest first) on a bound ROUTER socket:
    at most ``clients`` answers at once, with at most ``queue_bytes`` handed to ZeroMQ and not
    yet written (each connection its share of them); a connection that accepts nothing for
    ``timeout`` seconds is dropped (TCP)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        buffer: ReplayBuffer,
        *,
        clients: int = 8,
        queue_bytes: int = 64 << 20,
        timeout: float = 30.0,
    ) -> None:
        if clients < 1 or queue_bytes < 1 or not timeout > 0:
            raise ValueError(
                "a replay socket answers at least one request with at least one byte queued "
                f"and a timeout > 0, got {clients} clients, {queue_bytes} bytes, {timeout} s"
            )
        self.buffer = buffer
        self.clients = clients
        self.queue_bytes = queue_bytes
        self.share = max(1, queue_bytes // clients)  # bytes one connection may have queued
        self.requests = 0
        self.refused = 0
        self.in_flight = 0  # answers under way
        self.queued = 0  # bytes charged for what ZeroMQ holds, every connection together
        self._peers: dict[bytes, _Peer] = {}
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        # A send to a connection whose queue is full (or that is gone) fails instead of being
        # dropped silently: the answer waits (or ends) instead of missing batches.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Messages queued per connection: its share fills first (a batch is charged at least
        # ``_FRAME_COST``); this bounds the refusals queued for a requester that does not read.
        self.sock.setsockopt(zmq.SNDHWM, min(self.share // _FRAME_COST + 16, _INT_MAX))
        # TCP_USER_TIMEOUT on Linux: a receive window shut this long drops the connection too.
        self.sock.setsockopt(zmq.TCP_MAXRT, min(max(1, round(timeout * 1000)), _INT_MAX))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.copy_threshold = 0  # ``copy=False`` never copies (pyzmq copies below 64 KB)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._reader = SocketReader(self.sock, self._answer, _SAFETY_POLL)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.TimerHandle | None = None
        self._interval = _POLL
        self._written = 0  # bytes ZeroMQ wrote for the answers, since the start
        self._refusals_logged = -_REFUSALS_LOG
        self._refusals_unlogged = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader.start(loop)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"":
            head = [frames[0], b""]
        elif len(frames) == 2:
            head = [frames[0]]
        else:
            logger.warning("replay request of %d frames ignored (expected [b'', seq])", len(frames))
            return
        wanted = frames[-1]
        if len(wanted) != 8:
            logger.warning("replay request ignored: the sequence must be 8 bytes big-endian")
            return
        start = int.from_bytes(wanted, "big", signed=True)
        self.requests += 1
        peer = self._peers.get(frames[0])
        if peer is not None and peer.sending:
            # Its answer would interleave with the one being sent (a REQ socket cannot ask so;
            # a DEALER that does gets the answer to its first request).
            if not peer.told:
                peer.told = True
                logger.warning(
                    "events: a replay request from a connection whose answer is still being "
                    "sent was ignored: send the next request after the end marker"
                )
            return
        if self.in_flight >= self.clients:
            self._refuse(head)
            return
        if peer is None:
            peer = self._peers[frames[0]] = _Peer()
        peer.begin(head, max(start, 0))
        self.in_flight += 1
        self._step(peer)

    def _refuse(self, head: list[bytes]) -> None:
        self.refused += 1
        self._refusals_unlogged += 1
        try:
            self.sock.send_multipart([*head, b"", END_MARKER, BUSY], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # its queue is full (it does not read) or it left: nobody to tell
        now = monotonic()
        if now - self._refusals_logged >= _REFUSALS_LOG:
            logger.warning(
                "events: %d replay request(s) answered busy: %d answers are under way "
                "(--events-replay-clients %d); the requesters are told to ask again",
                self._refusals_unlogged,
                self.in_flight,
                self.clients,
            )
            self._refusals_logged = now
            self._refusals_unlogged = 0

    def _step(self, peer: _Peer) -> None:
        """Hand ZeroMQ the answer's next batches, as many as there is room for (``_SLICE`` at
        most), the rest on the loop's next turn or once ZeroMQ wrote enough; the marker once
        the newest was sent (or the next one left the buffer). The connection is forgotten
        once ZeroMQ wrote all it was handed."""
        peer.waiting = False
        if self.sock.closed:  # (a rest scheduled before the server closed)
            return
        freed = peer.release()
        self.queued -= freed
        self._written += freed
        try:
            if peer.sending:
                items, more = self._chunk(peer)
                if items:
                    if self._hand(peer, items) and self._loop is not None:
                        self._loop.call_soon(self._step, peer)
                        return
                elif not more:
                    self._end(peer)
        except zmq.Again:  # its queue is full: wait for ZeroMQ to write some
            pass
        except zmq.ZMQError:  # the requester left (or was dropped): nobody to answer
            self._forget(peer)
            return
        if peer.sending or peer.queued:
            self._wait(peer)
        else:
            self._forget(peer)

    def _chunk(self, peer: _Peer) -> tuple[list[tuple[int, bytes, bytes]], bool]:
        """The batches to hand now, and whether more follow them."""
        buffer = self.buffer
        oldest = buffer.first()
        if not peer.first and (oldest is None or oldest > peer.next):
            return [], False  # the next batch left the buffer: the answer ends here
        room = min(self.share - peer.queued, self.queue_bytes - self.queued)
        items: list[tuple[int, bytes, bytes]] = []
        cost = 0
        for item in buffer.since(peer.next):
            charge = len(item[2]) + _FRAME_COST
            if len(items) == _SLICE or (cost + charge > room and (items or peer.queued)):
                return items, True
            items.append(item)
            cost += charge
        return items, False

    def _hand(self, peer: _Peer, items: list[tuple[int, bytes, bytes]]) -> bool:
        """Send ``items``, tracking the last payload; False when ZeroMQ's queue for the
        connection filled first (the rest waits). ``ZMQError`` when the connection is gone."""
        send = self.sock.send
        ident, *rest = peer.head
        last = len(items) - 1
        handed = 0
        tracker: zmq.MessageTracker | None = None
        full = False
        for i, (seq, topic, payload) in enumerate(items):
            try:
                send(ident, _MORE)  # (a full queue or a gone peer fails here, at the first frame)
            except zmq.Again:
                full = True
                break
            for frame in rest:
                send(frame, _MORE)
            send(topic, _MORE)
            send(seq.to_bytes(8, "big"), _MORE)
            if i == last:
                tracker = _tracked(send(payload, zmq.NOBLOCK, copy=False, track=True))
            else:
                send(payload, zmq.NOBLOCK, copy=False)
            handed += len(payload) + _FRAME_COST
            peer.next = seq + 1
            peer.first = False
        self._charge(peer, handed, tracker)
        return not full

    def _end(self, peer: _Peer) -> None:
        """Hand over the end marker (tracked: once written, so is everything before it)."""
        send = self.sock.send
        for frame in peer.head:  # (a full queue or a gone peer fails at the first frame)
            send(frame, _MORE)
        send(b"", _MORE)
        send(END_MARKER, _MORE)
        self._charge(peer, _FRAME_COST, _tracked(send(b"", zmq.NOBLOCK, copy=False, track=True)))
        peer.sending = False
        self.in_flight -= 1

    def _charge(self, peer: _Peer, handed: int, tracker: zmq.MessageTracker | None) -> None:
        peer.queued += handed
        self.queued += handed
        if tracker is None:
            peer.carry += handed
        else:
            peer.chunks.append((tracker, peer.carry + handed))
            peer.carry = 0

    def _forget(self, peer: _Peer) -> None:
        ident = peer.head[0]
        if self._peers.get(ident) is peer:
            del self._peers[ident]
        if peer.sending:
            peer.sending = False
            self.in_flight -= 1
        self.queued -= peer.queued  # (ZeroMQ drops a gone connection's frames)
        peer.queued = 0
        peer.chunks.clear()

    def _wait(self, peer: _Peer) -> None:
        peer.waiting = True
        if self._poller is None and self._loop is not None:
            self._poller = self._loop.call_later(self._interval, self._poll)

    def _poll(self) -> None:
        """Look at the waiting connections again. Asking the socket for its state first has
        ZeroMQ take in what its I/O thread reported (a dropped connection's frames are released
        then), and hands over the requests that came meanwhile (that look takes their wake-up)."""
        self._poller = None
        sock = self.sock
        if sock.closed:
            return
        if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._reader.read()
        before = (self.in_flight, self._written, len(self._peers))
        for peer in [p for p in self._peers.values() if p.waiting]:
            self._step(peer)
        # Connections that do not move (requesters not reading) are looked at less often.
        moved = (self.in_flight, self._written, len(self._peers)) != before
        self._interval = _POLL if moved else min(2 * self._interval, _POLL_MAX)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        self._reader.close()
        self.sock.close(0)


def _tracked(tracker: zmq.MessageTracker | None) -> zmq.MessageTracker:
    """The tracker of a frame sent with ``track=True`` (pyzmq returns one for those)."""
    assert tracker is not None
    return tracker
