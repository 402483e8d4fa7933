"""``ReplayBuffer``: the latest batches, bounded in batches and in bytes; the publisher keeps
one only with a replay socket; and ``ReplayServer`` answers a slice per turn of the loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq

from kvmeta.events import replay
from kvmeta.events.publisher import Publisher
from kvmeta.events.replay import ReplayBuffer, ReplayServer


def seqs(buffer: ReplayBuffer) -> list[int]:
    return [seq for seq, _, _ in buffer]


def test_the_oldest_batches_go_first_past_the_batch_count() -> None:
    buffer = ReplayBuffer(batches=3, max_bytes=1 << 20)
    for seq in range(5):
        buffer.append(seq, b"t", bytes(10))
    assert seqs(buffer) == [2, 3, 4]
    assert len(buffer) == 3 and buffer.bytes == 30


def test_the_oldest_batches_go_first_past_the_bytes() -> None:
    buffer = ReplayBuffer(batches=100, max_bytes=250)
    for seq in range(10):
        buffer.append(seq, b"t", bytes(100))
        assert buffer.bytes <= 250
        assert buffer.bytes == sum(len(p) for _, _, p in buffer)
    assert seqs(buffer) == [8, 9]


def test_the_newest_batch_stays_even_when_larger_than_the_bytes() -> None:
    """A replay always reaches the live feed: the latest batch is kept whatever its size."""
    buffer = ReplayBuffer(batches=10, max_bytes=50)
    buffer.append(0, b"t", bytes(10))
    buffer.append(1, b"t", bytes(500))
    assert seqs(buffer) == [1] and buffer.bytes == 500
    buffer.append(2, b"t", bytes(10))
    assert seqs(buffer) == [2] and buffer.bytes == 10


@pytest.mark.parametrize(("batches", "max_bytes"), [(0, 10), (10, 0), (-1, -1)])
def test_a_buffer_holds_at_least_one_batch(batches: int, max_bytes: int) -> None:
    with pytest.raises(ValueError, match="at least one batch"):
        ReplayBuffer(batches, max_bytes)


def test_a_publisher_keeps_batches_only_with_a_replay_socket() -> None:
    without = Publisher("tcp://127.0.0.1:0")
    with_replay = Publisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer=2, buffer_bytes=1 << 20
    )
    try:
        for pub in (without, with_replay):
            for _ in range(3):
                pub._send([pub.encoder.cleared(None, "clear")], 0, 0.0)  # noqa: SLF001
        assert without.buffer is None
        assert without.stats.replay_buffer == (0, 0)
        assert with_replay.buffer is not None
        assert seqs(with_replay.buffer) == [1, 2]
        assert with_replay.stats.replay_buffer == (2, with_replay.buffer.bytes)
        assert with_replay.buffer.bytes > 0
    finally:
        without.close()
        with_replay.close()


def test_since_starts_at_a_sequence_number() -> None:
    buffer = ReplayBuffer(batches=5, max_bytes=1 << 20)
    assert list(buffer.since(0)) == [] and buffer.first() is None
    for seq in range(10, 17):
        buffer.append(seq, b"t", bytes(1))
    assert buffer.first() == 12
    assert [s for s, _, _ in buffer.since(14)] == [14, 15, 16]
    assert [s for s, _, _ in buffer.since(3)] == [12, 13, 14, 15, 16]  # older: from the first
    assert list(buffer.since(99)) == []


def _answer_frames(dealer: zmq.Socket[Any]) -> list[int]:
    """The sequence numbers the dealer has received so far (-1: the end marker)."""
    got = []
    while dealer.poll(200):
        _, _, seq, _ = dealer.recv_multipart()
        got.append(int.from_bytes(seq, "big", signed=True))
    return got


def test_a_replay_is_answered_a_slice_per_turn_of_the_loop_and_ends_early_if_overtaken() -> None:
    """A whole buffer sent at once kept every other request waiting (0.2 s for 10,000
    batches); a batch that left the buffer meanwhile ends the answer at what was sent."""

    async def go() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        buffer = ReplayBuffer(batches=1000, max_bytes=1 << 30)
        for seq in range(300):
            buffer.append(seq, b"t", bytes(100))
        server = ReplayServer(ctx, "tcp://127.0.0.1:*", buffer)
        dealer = ctx.socket(zmq.DEALER)
        try:
            server.start(asyncio.get_running_loop())
            dealer.connect(server.endpoint)  # the request waits in its queue until connected
            frames = [b"peer", b"", (10).to_bytes(8, "big")]
            identity = None
            dealer.send_multipart([b"", (10).to_bytes(8, "big")])
            deadline = time.monotonic() + 10
            while identity is None:  # the request as the ROUTER reads it (its peer's id)
                assert time.monotonic() < deadline
                if server.sock.poll(100):
                    frames = server.sock.recv_multipart()
                    identity = frames[0]
            server._answer(frames)  # the loop does not turn during the next lines
            first = _answer_frames(dealer)
            assert first == list(range(10, 10 + replay._SLICE))
            await asyncio.sleep(0.05)
            rest = _answer_frames(dealer)
            assert rest == [*range(10 + replay._SLICE, 300), -1]

            # Overtaken: the buffer moves past the next batch to send before the loop turns.
            server._answer(frames)
            assert _answer_frames(dealer) == list(range(10, 10 + replay._SLICE))
            for seq in range(300, 1300):
                buffer.append(seq, b"t", bytes(100))
            await asyncio.sleep(0.05)
            assert _answer_frames(dealer) == [-1]

            # Closed with the rest of an answer scheduled: the rest is dropped, no error.
            errors: list[dict[str, Any]] = []
            asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
            server._answer(frames)
            server.close()
            await asyncio.sleep(0.05)
            assert errors == []
        finally:
            dealer.close(0)
            server.close()
            ctx.term()

    asyncio.run(go())
