"""A subscriber that stops reading: the server queues at most ``--events-queue`` batches for it
(it used to queue 100,000, growing by megabytes a second under load), the later ones are
dropped for that subscriber alone, and the replay socket gives them back."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import zmq

from tests.events.events_support import connect, endpoints, metric, published, replay
from tests.support import ServerProcess, wait_until

pytestmark = pytest.mark.slow

BATCHES = 60
KEYS = 2000  # a BlockStored of 2,000 keys: about 150 KB, so the socket buffers hold few


def _confirm(url: str, round_: int, n: int = KEYS) -> None:
    keys = [hashlib.sha256(f"{round_}-{i}".encode()).hexdigest() for i in range(n)]
    reply = requests.post(
        f"{url}/0/reserve_and_allocate_page_indices",
        json={"keys": [[k, None] for k in keys]},
        timeout=30,
    ).json()["indices"]
    pairs = [[k, p] for k, (_, p) in zip(keys, reply, strict=True)]
    body = {"written_keys_to_confirm": pairs}
    resp = requests.post(f"{url}/0/confirm_write", json=body, timeout=30)
    assert resp.status_code in (200, 204), resp.text


def test_a_subscriber_that_stops_reading_misses_batches_beyond_its_queue_then_replays() -> None:
    server = ServerProcess(
        "--in-memory", "--read-lease", "0", "--events", "tcp://127.0.0.1:0",
        "--events-replay", "tcp://127.0.0.1:0", "--events-queue", "5",
    ).start()  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        ends = endpoints(server)
        assert ends.replay is not None
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 1 << 16)
        connect(sub, ends.pub)
        url = server.url
        assert requests.post(f"{url}/0/initialize", json={"num_pages": 1 << 18}, timeout=30).ok
        first = published(server)
        for round_ in range(BATCHES):  # not read meanwhile
            _confirm(url, round_)
            time.sleep(0.02)  # each confirm its own batch (batches gather 8 ms)
        wait_until(lambda: published(server) - first >= BATCHES, what="every batch published")
        last = published(server)
        assert last - first >= BATCHES
        got: list[int] = []
        while sub.poll(1000):
            _, seq, _ = sub.recv_multipart()
            got.append(int.from_bytes(seq, "big"))
        # What the queue, the socket buffers and the receive queue hold, not everything.
        assert got and len(got) < (last - first) // 2, (len(got), last - first)
        assert got == sorted(got)
        missing = sorted(set(range(first, last)) - set(got))
        assert missing
        again = [seq for _, seq, _ in replay(ctx, ends.replay, missing[0])]
        assert set(missing) <= set(again)
    finally:
        sub.close(0)
        ctx.term()
        server.stop()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_replay_requests_that_are_never_read_do_not_copy_the_buffer() -> None:
    """Each answer queued for a requester that does not read refers to the buffer's batches:
    eight such requests used to hold eight copies of the whole buffer in the server."""
    server = ServerProcess(
        "--in-memory", "--read-lease", "0", "--events", "tcp://127.0.0.1:0",
        "--events-replay", "tcp://127.0.0.1:0",
    ).start()  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []
    try:
        ends = endpoints(server)
        assert ends.replay is not None
        url = server.url
        assert requests.post(f"{url}/0/initialize", json={"num_pages": 1 << 18}, timeout=30).ok
        # Batches of 300 keys (about 55 KB, as at the batch-64 cycle): below the size from
        # which pyzmq sends without a copy by default.
        for round_ in range(200):
            _confirm(url, round_, 300)
        seen = [-1.0]

        def settled() -> bool:
            """The buffer holds every batch: its size is past 8 MiB and no longer grows."""
            now = metric(server, "kvmeta_events_replay_buffer_bytes")
            done, seen[0] = now == seen[0] and now > 8 << 20, now
            return done

        wait_until(settled, interval=0.05, what="every batch in the replay buffer")
        kept = metric(server, "kvmeta_events_replay_buffer_bytes")
        assert kept > 8 << 20
        before = _rss_bytes(server.pid)
        for _ in range(8):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 1 << 16)
            dealer.connect(ends.replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(dealer)
        deadline = time.monotonic() + 30
        while metric(server, "kvmeta_events_replay_requests_total") < 8:
            assert time.monotonic() < deadline, "the replays were not answered"
            time.sleep(0.1)
        time.sleep(1.0)
        grown = _rss_bytes(server.pid) - before
        assert grown < kept, (
            f"the server grew by {grown >> 20} MiB for a {int(kept) >> 20} MiB buffer"
        )
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        server.stop()
