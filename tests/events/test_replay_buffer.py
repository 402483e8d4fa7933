"""``ReplayBuffer``: the latest batches, bounded in batches and in bytes; and the publisher
keeps one only with a replay socket."""

from __future__ import annotations

import pytest

from kvmeta.events.publisher import Publisher
from kvmeta.events.replay import ReplayBuffer


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
