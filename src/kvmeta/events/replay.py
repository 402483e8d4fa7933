"""The replay socket: a ZeroMQ ROUTER that answers "every batch from sequence N".

The protocol is the engines' (their subscribers already speak it): a request is one frame,
the first sequence number wanted as 8 bytes big-endian (a REQ socket adds the empty delimiter
frame; a DEALER may send it or not, and the answer mirrors what it sent). The answer is each
buffered batch with a sequence number >= N as ``topic, sequence, payload`` (the frames of the
live stream), then the end marker ``b"", -1 as 8 bytes signed big-endian, b""``. Batches older
than the buffer are gone: when the first sequence answered is above N, the subscriber missed
some and must rebuild from ``GET /v1/dump`` (docs/events.md).

It runs on the event loop: a replay is non-blocking sends of buffered bytes, ``_SLICE`` batches
per turn of the loop (a whole buffer at once kept every HTTP request waiting 0.2 s), and the
socket's high-water mark holds a whole buffer plus its marker. Payloads are sent without a copy
(the queued answer refers to the buffer's bytes): copied, a requester that does not read held a
copy of the whole buffer in the server, per request (8 unread replays of a 55 MB buffer added
444 MB). A batch that leaves the buffer while an answer is under way ends that answer early
(its marker follows the last batch sent): the subscriber sees the gap and asks again.

The buffer (``ReplayBuffer``) exists only with a replay socket: nobody could read it
otherwise, and a batch kept is memory that is never reused until it leaves the buffer (at the
SGLang batch-64 cycle a batch is 40-70 KB, so 10,000 of them are half a gigabyte, and each new
one is fresh memory the kernel must fault in: about 150 us of CPU more per batch than an
encoding whose memory is freed once sent). It is bounded in batches and in bytes, whichever
is reached first, since a batch's size ranges from one event to 1,024 of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator
from itertools import islice

import zmq

from kvmeta.events.reader import SocketReader

__all__ = ["END_MARKER", "ReplayBuffer", "ReplayServer"]

logger = logging.getLogger(__name__)

END_MARKER = (-1).to_bytes(8, "big", signed=True)
# Seconds between looks at the socket besides its wake-ups (``events.reader``).
_SAFETY_POLL = 1.0
# Batches sent per turn of the event loop in a replay answer.
_SLICE = 64
_MORE = zmq.SNDMORE | zmq.NOBLOCK


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


class ReplayServer:
    """Serves ``buffer`` (``(seq, topic, payload)``, oldest first) on a bound ROUTER socket."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        buffer: ReplayBuffer,
    ) -> None:
        self.buffer = buffer
        self.requests = 0
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 2 * (buffer.batches + 1))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.copy_threshold = 0  # ``copy=False`` never copies (pyzmq copies below 64 KB)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._reader = SocketReader(self.sock, self._answer, _SAFETY_POLL)
        self._loop: asyncio.AbstractEventLoop | None = None

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
        self._send_from(head, max(start, 0), True)

    def _send_from(self, head: list[bytes], start: int, first: bool) -> None:
        """Send the batches from ``start``, ``_SLICE`` of them, then the rest on the loop's
        next turn; the marker once the newest was sent (or the next one left the buffer)."""
        sock = self.sock
        if sock.closed:  # (a rest scheduled before the server closed)
            return
        send = sock.send
        try:
            oldest = self.buffer.first()
            if first or oldest is None or oldest <= start:
                sent = 0
                for seq, topic, payload in self.buffer.since(start):
                    if sent == _SLICE and self._loop is not None:
                        self._loop.call_soon(self._send_from, head, seq, False)
                        return
                    for frame in head:
                        send(frame, _MORE)
                    send(topic, _MORE)
                    send(seq.to_bytes(8, "big"), _MORE)
                    send(payload, zmq.NOBLOCK, copy=False)
                    sent += 1
            sock.send_multipart([*head, b"", END_MARKER, b""], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("replay answer cut short: the subscriber is not reading")

    def close(self) -> None:
        self._reader.close()
        self.sock.close(0)
