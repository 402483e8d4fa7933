"""A ZeroMQ subscriber of ``kvmeta serve --events`` for the tests, and a model of a pool's keys
rebuilt from the events (what a router's indexer does)."""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import requests
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvmeta.events.wire import sglang_hash
from tests.events.workloads import sglang_workload
from tests.support import ServerProcess

_EVENTS_RE = re.compile(
    r"kvmeta events on (\S+) \(topic (\S+), format (\w+)(?:, replay on (\S+))?\)"
)
END = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Endpoints:
    pub: str
    topic: str
    replay: str | None


def endpoints(server: ServerProcess) -> Endpoints:
    """The addresses the server logged (it binds ``tcp://127.0.0.1:0`` to free ports)."""
    server.wait_for_log("kvmeta events on", timeout=30)
    found = list(_EVENTS_RE.finditer(server.log))
    assert found, server.log
    match = found[-1]  # the latest start's
    return Endpoints(match.group(1), match.group(2), match.group(4))


def metric(server: ServerProcess, name: str) -> float:
    """The value of the unlabelled metric ``name`` in the server's ``/metrics``."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def published(server: ServerProcess) -> int:
    """Batches the server says it published (``kvmeta_events_batches_total``)."""
    return int(metric(server, "kvmeta_events_batches_total"))


def connect(sock: zmq.Socket[Any], *endpoints: str) -> None:
    """Connect ``sock`` to each endpoint and return once every connection is made: a SUB
    socket gets only what is published after that, so a test waits for the handshakes rather
    than sleeping and hoping."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        for endpoint in endpoints:
            sock.connect(endpoint)
        for _ in endpoints:
            assert monitor.poll(30_000), f"no connection to {endpoints} in 30 s"
            recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(0)


@dataclass
class Subscriber:
    """Collects ``(topic, seq, payload)`` of every message on a background thread."""

    endpoint: str
    replay: str | None = None  # the server's --events-replay, to fill in missed batches
    messages: list[tuple[bytes, int, bytes]] = field(default_factory=list)
    ctx: zmq.Context[Any] = field(default_factory=zmq.Context)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Subscriber:
        """Connect, and return once the connection to the server is made (a SUB socket gets
        only what is published after that; ``wait_for`` with a replay endpoint fills in what
        it missed before its subscription reached the server)."""
        self._stop.clear()
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 0)
        connect(sock, self.endpoint)
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()
        return self

    def _run(self, sock: zmq.Socket[Any]) -> None:
        try:
            while not self._stop.is_set():
                if sock.poll(50):
                    topic, seq, payload = sock.recv_multipart()
                    with self._lock:
                        self.messages.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            sock.close(0)

    def fill_gaps(self) -> None:
        """Fetch the batches missed below the newest one received from the replay socket, as
        a router does, and keep ``messages`` in sequence order."""
        assert self.replay is not None
        with self._lock:
            have = {seq for _, seq, _ in self.messages}
            newest = max(have, default=-1)
        missing = set(range(newest)) - have
        if not missing:
            return
        fetched = [m for m in replay(self.ctx, self.replay, min(missing)) if m[1] in missing]
        with self._lock:
            self.messages[:] = sorted([*self.messages, *fetched], key=lambda m: m[1])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def wait_for(self, server: ServerProcess, timeout: float = 60.0) -> None:
        """Until the last batch the server published has arrived and no other followed it for
        a while: the publisher gathers a request's events for a few milliseconds before it
        sends them, so a count read just after the last request can miss that request's
        batch."""
        deadline = time.monotonic() + timeout
        caught_up_at = -1
        while time.monotonic() < deadline:
            want = published(server)
            if self.messages and self.messages[-1][1] >= want - 1:
                if want == caught_up_at:
                    if self.replay is not None:
                        self.fill_gaps()
                    return
                caught_up_at = want
                time.sleep(0.3)
                continue
            caught_up_at = -1
            time.sleep(0.1)
        raise AssertionError(f"got {len(self.messages)} messages, server published {want}")

    def close(self) -> None:
        self.stop()
        self.ctx.term()


class Busy(Exception):
    """The replay socket refused the request: too many answers under way."""


def replay(ctx: zmq.Context[Any], endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay socket for every batch from ``start`` (a REQ-style request on DEALER);
    ``Busy`` when it refuses."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(30_000), "no end marker from the replay socket"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END:
                assert topic == b""
                if payload.startswith(b"busy"):
                    assert not out
                    raise Busy(payload.decode())
                assert payload == b""
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(0)


def apply(state: dict[str, set[Any]], payload: bytes) -> None:
    """Apply one batch as an indexer does, by block hash (kvmeta's ``pool`` field says which
    pool; an ``AllBlocksCleared`` without one clears every pool of the server)."""
    _, events = msgspec.msgpack.decode(payload)[:2]
    for ev in events:
        kind = ev["type"]
        pool = ev.get("pool", "")
        if kind == "AllBlocksCleared":
            if pool == "":
                state.clear()
            else:
                state.pop(pool, None)
        elif kind == "BlockStored":
            state.setdefault(pool, set()).update(ev["block_hashes"])
        elif kind == "BlockRemoved":
            state.setdefault(pool, set()).difference_update(ev["block_hashes"])


def resync_run(server: ServerProcess) -> list[tuple[bytes, int, bytes]]:
    """A (re)started server's run from its first batch (its resync), from its replay socket."""
    ends = endpoints(server)
    assert ends.replay is not None
    server.wait_for_log("events: resync published", timeout=60)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        run = replay(ctx, ends.replay, 0)
    finally:
        ctx.term()
    assert run and run[0][1] == 0
    return run


def rebuild(messages: list[tuple[bytes, int, bytes]]) -> dict[str, set[Any]]:
    state: dict[str, set[Any]] = {}
    for _, _, payload in messages:
        apply(state, payload)
    return {pool: hashes for pool, hashes in state.items() if hashes}


def hashed(stored: dict[str, set[str]]) -> dict[str, set[Any]]:
    """The block hashes of stored keys per pool: SGLang's int64 form, or a vLLM key's bytes."""
    return {
        pool: {sglang_hash(k) for k in keys}
        if pool.startswith("s:")
        else {k.encode() for k in keys}
        for pool, keys in stored.items()
        if keys
    }


def complete(messages: list[tuple[bytes, int, bytes]], replay_endpoint: str | None) -> list[Any]:
    """The live messages plus any the subscriber missed while joining (a SUB socket gets only
    what is sent after it connected), from the replay socket: every batch from 0, in order."""
    assert replay_endpoint is not None
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        replayed = replay(ctx, replay_endpoint, 0)
    finally:
        ctx.term()
    merged = {seq: (topic, seq, payload) for topic, seq, payload in replayed}
    for topic, seq, payload in messages:
        assert merged.get(seq, (topic, seq, payload)) == (topic, seq, payload)
        merged[seq] = (topic, seq, payload)
    seqs = sorted(merged)
    assert seqs == list(range(len(seqs))), "a batch is missing"
    return [merged[seq] for seq in seqs]


def observed_sglang_workload(
    server: ServerProcess, seed: int, cycles: int
) -> tuple[list[tuple[bytes, int, bytes]], dict[str, list[str]], dict[str, str | None]]:
    """``sglang_workload`` on ``server`` with a subscriber listening throughout: every batch
    published (the replay socket fills in what the subscriber missed while joining), and the
    workload's keys per pool and prefixes."""
    ends = endpoints(server)
    sub = Subscriber(ends.pub).start()
    try:
        used, prefix_of = sglang_workload(server.url, random.Random(seed), cycles)
        sub.wait_for(server)
    finally:
        sub.close()
    return complete(sub.messages, ends.replay), used, prefix_of


def events_server_process() -> ServerProcess:
    """A started in-memory ``kvmeta serve`` publishing events, with a replay socket (both on
    free ports: ``endpoints`` reads them)."""
    return ServerProcess(
        "--in-memory", "--read-lease", "0", "--events", "tcp://127.0.0.1:0",
        "--events-replay", "tcp://127.0.0.1:0",
    ).start()  # fmt: skip
