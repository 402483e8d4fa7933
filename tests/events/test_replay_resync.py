"""Catching up: a subscriber away for 50 batches under load resumes from its last sequence number
through the replay socket; after a kill -9 the restarted server's resync makes a subscriber
converge, and nothing a crash undid was ever announced."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.events.events_support import (
    Subscriber,
    endpoints,
    hashed,
    published,
    rebuild,
    replay,
)
from tests.support import ServerProcess, wait_until


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def cycle(url: str, keys: list[str]) -> None:
    reply = requests.post(
        f"{url}/0/reserve_and_allocate_page_indices",
        json={"keys": [[k, None] for k in keys]},
        timeout=30,
    ).json()["indices"]
    pairs = [(k, p) for k, (hit, p) in zip(keys, reply, strict=True) if not hit and p >= 0]
    r = requests.post(f"{url}/0/confirm_write", json={"written_keys_to_confirm": pairs}, timeout=30)
    assert r.status_code in (200, 204), r.text


def stored(url: str, keys: list[str]) -> dict[str, set[str]]:
    """The keys of ``keys`` pool 0 holds, asked in batches: a fast machine writes more keys
    during a load phase than one request may carry (--max-keys)."""
    out: set[str] = set()
    for i in range(0, len(keys), 4096):
        batch = keys[i : i + 4096]
        resp = requests.post(f"{url}/0/exists", json={"keys": batch}, timeout=30)
        assert resp.status_code == 200, resp.text
        out.update(k for k, hit in zip(batch, resp.json()["exists"], strict=True) if hit)
    return hashed({"s:0:kv": out})


@pytest.mark.slow
def test_subscriber_away_under_load_catches_up_through_replay() -> None:
    server = ServerProcess(
        "--in-memory", "--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0",
    ).start()  # fmt: skip
    try:
        ends = endpoints(server)
        assert ends.replay is not None
        url = server.url
        requests.post(f"{url}/0/initialize", json={"num_pages": 256}, timeout=30)
        stop = threading.Event()
        n = [0]

        def load() -> None:
            while not stop.is_set():
                cycle(url, [key(n[0] + i) for i in range(16)])  # evicts once the pool is full
                n[0] += 16

        writer = threading.Thread(target=load, daemon=True)
        sub = Subscriber(ends.pub).start()
        writer.start()
        wait_until(lambda: len(sub.messages) >= 20, what="live batches")
        sub.stop()  # away ...
        away_from = sub.messages[-1][1]
        wait_until(lambda: published(server) > away_from + 50, what="50 batches missed")
        back_at = published(server)
        sub.start()  # ... back: live messages again, and a gap to fill
        wait_until(lambda: sub.messages[-1][1] >= back_at + 5, what="live batches again")
        stop.set()
        writer.join(30)
        sub.wait_for(server)
        sub.close()
        live = {seq: (topic, seq, payload) for topic, seq, payload in sub.messages}
        back = min(seq for seq in live if seq > away_from)
        assert back > away_from + 10, "the subscriber missed nothing: not a test of replay"
        caught = replay(sub_ctx := __import__("zmq").Context(), ends.replay, away_from + 1)
        sub_ctx.term()
        assert [m[1] for m in caught][0] == away_from + 1
        merged = {**{m[1]: m for m in caught}, **live}
        seqs = sorted(merged)
        assert seqs == list(range(seqs[0], seqs[-1] + 1)), "a batch is missing"
        assert seqs[-1] == published(server) - 1
        assert all(m[0].decode() == ends.topic for m in merged.values())
        ordered = [merged[s] for s in seqs if s >= 1]
        used = [key(i) for i in range(n[0])]
        assert rebuild(ordered) == stored(url, used)
    finally:
        server.stop()


def gauges(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in text.splitlines())
        if name.startswith("kvmeta_events_replay_buffer_")
    }


def test_the_replay_buffer_keeps_the_latest_mib_it_is_given() -> None:
    server = ServerProcess(
        "--in-memory", "--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0",
        "--events-buffer-mb", "1",
    ).start()  # fmt: skip
    try:
        ends = endpoints(server)
        assert ends.replay is not None
        requests.post(f"{server.url}/0/initialize", json={"num_pages": 1024}, timeout=30)
        n = 0
        while gauges(server.url)["kvmeta_events_replay_buffer_bytes"] < 0.8 * (1 << 20) or (
            published(server) < 20
        ):
            cycle(server.url, [key(n + i) for i in range(64)])
            n += 64
        for _ in range(50):  # well past the 1 MiB: the oldest batches must have gone
            cycle(server.url, [key(n + i) for i in range(64)])
            n += 64
        time.sleep(0.1)  # the last batch sent (8 ms)
        held = gauges(server.url)
        total = published(server)
        ctx = __import__("zmq").Context()
        caught = replay(ctx, ends.replay, 0)
        ctx.term()
    finally:
        server.stop()
    sizes = [len(payload) for _, _, payload in caught]
    assert held["kvmeta_events_replay_buffer_batches"] == len(caught)
    assert held["kvmeta_events_replay_buffer_bytes"] == sum(sizes) <= 1 << 20
    seqs = [seq for _, seq, _ in caught]
    assert seqs[0] > 0, "nothing was dropped: not a test of the bound"
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert seqs[-1] == total - 1  # up to the live feed
    # Batches go only when the bytes are over the bound: what is kept is within about one
    # batch of it, not far below.
    assert sum(sizes) > (1 << 20) - 2 * max(sizes)


def test_without_a_replay_socket_no_batch_is_kept() -> None:
    server = ServerProcess("--in-memory", "--events", "tcp://127.0.0.1:0").start()
    try:
        endpoints(server)
        requests.post(f"{server.url}/0/initialize", json={"num_pages": 256}, timeout=30)
        for n in range(0, 64 * 20, 64):
            cycle(server.url, [key(n + i) for i in range(64)])
        time.sleep(0.1)
        assert published(server) > 1
        assert gauges(server.url) == {
            "kvmeta_events_replay_buffer_batches": 0.0,
            "kvmeta_events_replay_buffer_bytes": 0.0,
        }
    finally:
        server.stop()


@pytest.mark.slow
def test_kill_9_then_resync_converges_and_undone_changes_were_never_announced(
    tmp_path: Path,
) -> None:
    # batch mode with a long interval: confirms are acknowledged long before they are durable.
    args = ["--data-dir", str(tmp_path), "--fsync", "batch", "--fsync-interval", "6"]
    args += ["--events", "tcp://127.0.0.1:0", "--read-lease", "0"]
    server = ServerProcess(*args).start()
    try:
        url = server.url
        sub = Subscriber(endpoints(server).pub).start()
        requests.post(f"{url}/0/initialize", json={"num_pages": 64}, timeout=30)
        for i in range(4):
            cycle(url, [key(10 * i + j) for j in range(8)])
        requests.post(f"{url}/0/delete_keys", json={"keys": [key(0), key(11)]}, timeout=30)
        sub.wait_for(server, timeout=60)  # made durable by the group fsync, then published
        durable = rebuild(sub.messages)
        assert durable == stored(url, [key(i) for i in range(40)])
        # Acknowledged but not yet durable (the group closes 6 s after its first record, time to
        # spare on a loaded machine for the requests and the kill): not announced.
        before = len(sub.messages)
        cycle(url, [key(100 + j) for j in range(8)])
        requests.post(f"{url}/0/delete_keys", json={"keys": [key(1)]}, timeout=30)
        server.stop(signal.SIGKILL)
        time.sleep(0.5)
        assert len(sub.messages) == before
        sub.close()
    finally:
        server.stop()
    args += ["--events-replay", "tcp://127.0.0.1:0"]
    server = ServerProcess(*args).start()
    try:
        ends = endpoints(server)
        assert ends.replay is not None
        zmq = __import__("zmq")
        ctx = zmq.Context()
        server.wait_for_log("events: resync published")
        resync = replay(ctx, ends.replay, 0)
        ctx.term()
        assert resync[0][1] == 0
        used = [key(i) for i in range(40)] + [key(100 + j) for j in range(8)]
        # The restart recovered exactly what was announced (the undone changes are gone), and
        # the resync says so.
        assert stored(server.url, used) == durable
        assert rebuild(resync) == durable
    finally:
        server.stop()
