"""A subscriber that stops reading: the server queues at most ``--events-queue`` batches for it
(it used to queue 100,000, growing by megabytes a second under load), the later ones are
dropped for that subscriber alone, and the replay socket gives them back."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
import requests
import zmq

from tests.events.events_support import endpoints, published, replay
from tests.support import ServerProcess

pytestmark = pytest.mark.slow

BATCHES = 60
KEYS = 2000  # a BlockStored of 2,000 keys: about 150 KB, so the socket buffers hold few


def _confirm(url: str, round_: int) -> None:
    keys = [hashlib.sha256(f"{round_}-{i}".encode()).hexdigest() for i in range(KEYS)]
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
        sub.connect(ends.pub)
        time.sleep(0.5)
        url = server.url
        assert requests.post(f"{url}/0/initialize", json={"num_pages": 1 << 18}, timeout=30).ok
        first = published(server)
        for round_ in range(BATCHES):  # not read meanwhile
            _confirm(url, round_)
            time.sleep(0.02)  # each confirm its own batch (batches gather 8 ms)
        time.sleep(0.5)
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
