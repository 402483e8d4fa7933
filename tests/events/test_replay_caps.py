"""Replay requesters that never read their answers: the server answers a few at a time
(``--events-replay-clients``), queues a bounded number of bytes for them
(``--events-replay-queue-mb``), refuses the rest with a "busy" end marker, and a requester
that reads still gets its whole replay. The process test measures the server's RSS; the others
run a ``ReplayServer`` on this test's event loop with real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import zmq

from kvmeta.errors import ServerUnavailable
from kvmeta.events.replay import BUSY, END_MARKER, ReplayBuffer, ReplayServer
from kvmeta.events.tail import fetch_replay
from tests.events.events_support import Busy, endpoints, metric, published, replay
from tests.support import ServerProcess

REQUESTERS = 100
BATCH = 10_000  # bytes of each batch of the in-process tests


def _confirm(url: str, round_: int, n: int) -> None:
    keys = [hashlib.sha256(f"{round_}-{i}".encode()).hexdigest() for i in range(n)]
    reply = requests.post(
        f"{url}/0/reserve_and_allocate_page_indices",
        json={"keys": [[k, None] for k in keys]},
        timeout=30,
    ).json()["indices"]
    pairs = [[k, p] for k, (_, p) in zip(keys, reply, strict=True)]
    resp = requests.post(
        f"{url}/0/confirm_write", json={"written_keys_to_confirm": pairs}, timeout=30
    )
    assert resp.status_code in (200, 204), resp.text


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _settled_rss(pid: int, seconds: float = 1.0) -> int:
    """The server's RSS once it has stopped growing for ``seconds`` (answers are sent from
    its event loop a slice at a time, so a look right after the requests sees part of them)."""
    last = _rss_bytes(pid)
    since = time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < seconds:
        assert time.monotonic() < deadline, "the server's memory kept growing"
        time.sleep(0.1)
        now = _rss_bytes(pid)
        if now > last:
            last, since = now, time.monotonic()
    return last


def _kept_bytes(server: ServerProcess) -> float:
    """The replay buffer's bytes once the last confirm's batch is in it (the same on two
    looks, the batching window apart)."""
    last = -1.0
    deadline = time.monotonic() + 30
    while True:
        now = metric(server, "kvmeta_events_replay_buffer_bytes")
        if now == last:
            return now
        assert time.monotonic() < deadline, "the replay buffer kept changing"
        last = now
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.soak
def test_requesters_that_never_read_hold_bounded_memory_and_a_reader_still_replays() -> None:
    server = ServerProcess(
        "--in-memory", "--read-lease", "0", "--events", "tcp://127.0.0.1:0",
        "--events-replay", "tcp://127.0.0.1:0", "--events-replay-timeout", "2",
    ).start()  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []
    try:
        ends = endpoints(server)
        assert ends.replay is not None
        url = server.url
        assert requests.post(f"{url}/0/initialize", json={"num_pages": 1 << 18}, timeout=30).ok
        # About 55 KB a batch, as at the SGLang batch-64 cycle: a 25 MiB buffer.
        for round_ in range(470):
            _confirm(url, round_, 300)
        kept = _kept_bytes(server)
        assert kept > 20 << 20
        before = _settled_rss(server.pid)
        for _ in range(REQUESTERS):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 1 << 16)
            dealer.connect(ends.replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(dealer)
        deadline = time.monotonic() + 60
        while metric(server, "kvmeta_events_replay_requests_total") < REQUESTERS:
            assert time.monotonic() < deadline, "the replay requests were not all received"
            time.sleep(0.1)
        grown = _settled_rss(server.pid) - before
        # Unbounded, each request queued a reference to every batch of the buffer: the 100
        # grew the server by 55 MB, twice the buffer.
        assert grown < kept / 4, (
            f"the server grew by {grown / 2**20:.1f} MiB for {REQUESTERS} unread replays of a "
            f"{kept / 2**20:.1f} MiB buffer"
        )
        # Those beyond the answers under way were told so at once.
        assert metric(server, "kvmeta_events_replay_refused_total") >= REQUESTERS - 8
        # A requester that reads gets every batch, up to the newest, once a slot is free
        # (the kernel drops the connections that read nothing for --events-replay-timeout).
        newest = published(server) - 1
        deadline = time.monotonic() + 60
        while True:
            try:
                got = replay(ctx, ends.replay, 0)
            except Busy:
                assert time.monotonic() < deadline, "the replay socket stayed busy"
                time.sleep(0.2)
            else:
                break
        assert [seq for _, seq, _ in got] == list(range(newest + 1))
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        server.stop()


# ---------------------------------------------------------------- in process


def _stalled(ctx: zmq.Context[Any], endpoint: str, start: int = 0) -> zmq.Socket[Any]:
    """A requester that asks and then reads nothing (its socket takes in one message)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 1 << 14)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    return sock


async def _until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


async def _read_answer(sock: zmq.Socket[Any], timeout: float = 10.0) -> list[list[bytes]]:
    """The messages of one answer, up to its end marker, read while the loop runs."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while True:
        while sock.poll(0):
            frames = sock.recv_multipart()
            got.append(frames)
            if frames[2] == END_MARKER:
                return got
        assert time.monotonic() < deadline, f"no end marker within {timeout} s ({len(got)})"
        await asyncio.sleep(0.002)


def _seqs(answer: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(frames[2], "big", signed=True) for frames in answer]


def _run(
    test: Callable[[ReplayServer, zmq.Context[Any]], Awaitable[None]],
    batches: int = 300,
    **caps: Any,
) -> None:
    async def go() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        buffer = ReplayBuffer(batches=10_000, max_bytes=1 << 30)
        for seq in range(batches):
            buffer.append(seq, b"t", bytes(BATCH))
        server = ReplayServer(ctx, "tcp://127.0.0.1:*", buffer, **caps)
        try:
            server.start(asyncio.get_running_loop())
            await test(server, ctx)
        finally:
            server.close()
            ctx.destroy(0)

    asyncio.run(go())


def test_a_request_beyond_the_answers_under_way_is_told_busy_and_the_slot_frees() -> None:
    async def test(server: ReplayServer, ctx: zmq.Context[Any]) -> None:
        first = _stalled(ctx, server.endpoint)
        second = _stalled(ctx, server.endpoint)
        await _until("two answers under way", lambda: server.in_flight == 2)
        third = ctx.socket(zmq.DEALER)
        third.connect(server.endpoint)
        third.send_multipart([b"", (0).to_bytes(8, "big")])
        assert await _read_answer(third) == [[b"", b"", END_MARKER, BUSY]]
        assert server.refused == 1 and server.in_flight == 2
        # The first requester reads after all: every batch, in order, then the marker; its
        # slot is free again once the marker is written.
        first.setsockopt(zmq.RCVHWM, 1000)
        assert _seqs(await _read_answer(first)) == [*range(300), -1]
        await _until("the first answer's slot free", lambda: server.in_flight == 1)
        third.send_multipart([b"", (290).to_bytes(8, "big")])
        assert _seqs(await _read_answer(third)) == [*range(290, 300), -1]
        assert server.refused == 1
        second.close(0)
        third.close(0)
        first.close(0)

    _run(test, clients=2, queue_bytes=256 << 10)


def test_what_a_connection_that_does_not_read_holds_is_bounded_by_its_share() -> None:
    async def test(server: ReplayServer, ctx: zmq.Context[Any]) -> None:
        stalled = [_stalled(ctx, server.endpoint) for _ in range(3)]
        await _until("three answers under way", lambda: server.in_flight == 3)
        # Long enough for an unbounded answer to have handed over all 3 MB of each.
        for _ in range(50):
            await asyncio.sleep(0.01)
            assert server.queued <= server.queue_bytes
            assert server.queued <= 3 * server.share
        assert server.queued > 0
        for sock in stalled:
            sock.close(0)
        # Gone requesters free their slots and what they held.
        await _until("the answers dropped", lambda: server.in_flight == 0 and server.queued == 0)

    _run(test, clients=4, queue_bytes=4 * 64 << 10)


def test_a_second_request_while_the_answer_is_under_way_is_ignored() -> None:
    """The two answers would interleave on one connection; the first is answered whole."""

    async def test(server: ReplayServer, ctx: zmq.Context[Any]) -> None:
        sock = _stalled(ctx, server.endpoint)
        await _until("an answer under way", lambda: server.in_flight == 1)
        sock.send_multipart([b"", (5).to_bytes(8, "big")])
        await _until("the second request read", lambda: server.requests == 2)
        sock.setsockopt(zmq.RCVHWM, 1000)
        assert _seqs(await _read_answer(sock)) == [*range(300), -1]
        await _until("the slot free", lambda: server.in_flight == 0)
        assert not sock.poll(200), "a second answer followed"
        sock.send_multipart([b"", (298).to_bytes(8, "big")])
        assert _seqs(await _read_answer(sock)) == [298, 299, -1]
        sock.close(0)

    _run(test, clients=2, queue_bytes=128 << 10)


def test_kvmeta_events_asks_again_while_the_replay_socket_is_busy() -> None:
    async def test(server: ReplayServer, ctx: zmq.Context[Any]) -> None:
        stalled = _stalled(ctx, server.endpoint)
        await _until("an answer under way", lambda: server.in_flight == 1)
        loop = asyncio.get_running_loop()
        with pytest.raises(ServerUnavailable, match="busy"):
            await loop.run_in_executor(None, fetch_replay, ctx, server.endpoint, 295, 1.0)
        assert server.refused >= 2  # it asked again before giving up
        refused = server.refused
        fetching = loop.run_in_executor(None, fetch_replay, ctx, server.endpoint, 295, 10.0)
        await _until("the fetch refused while busy", lambda: server.refused > refused)
        stalled.close(0)  # the slot frees: the next try is answered
        got = await fetching
        assert [seq for _, seq, _ in got] == [295, 296, 297, 298, 299]

    _run(test, clients=1, queue_bytes=64 << 10)
