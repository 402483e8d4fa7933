"""``kvmeta events`` as an operator runs it: a child process watching a real ``kvmeta serve
--events`` while SGLang and vLLM workloads go through HTTP. What it prints must be what the
workload did (types, pools, block counts, SGLang's own 64-bit hashes of the keys, reasons);
``--from`` with the replay socket must show what a live watcher saw and then go on live; new
runs and missed batches are said on stderr (a feed the test publishes itself, so the gaps are
where the test puts them); ``--count``, ``--timeout``, Ctrl-C and wrong options have their exit
codes. Every wait is on the printed lines, with a deadline."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import zmq

from kvmeta._types import PoolId
from kvmeta.events.feed import format_time
from kvmeta.events.wire import Encoder
from tests.compat.stock_clients import load, sglang_hash_function
from tests.events.events_support import END, endpoints, events_server_process
from tests.events.workloads import page_key, sglang_workload
from tests.support import ServerProcess, child_env, unused_port

LINE = re.compile(r"(\d\d:\d\d:\d\d\.\d{3}) seq=(\d+) run=(\S+) (\w+) +(.*)")
PROBE = "s:0:probe"  # the pool the tests store into until a watcher shows it has joined
_PROBES = itertools.count()  # each probe a new page key


class Watcher:
    """``kvmeta events ARGS`` in a child process; its stdout and stderr lines as they come."""

    def __init__(self, *args: str) -> None:
        env = child_env()
        self.args = args
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmeta", "events", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def _until(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return
            if self.proc.poll() is not None:
                for reader in self._readers:
                    reader.join(5)
                if done():
                    return
                break
            time.sleep(0.02)
        raise AssertionError(
            f"kvmeta events {self.args}: no {what}\nout: {self.out}\nerr: {self.err}"
        )

    def lines(self, n: int, timeout: float = 60.0) -> list[str]:
        """The first ``n`` lines of stdout, once printed."""
        self._until(lambda: len(self.out) >= n, f"{n} lines", timeout)
        return self.out[:n]

    def said(self, needle: str, timeout: float = 60.0) -> str:
        """The first stderr line holding ``needle``, once said."""
        self._until(lambda: any(needle in x for x in self.err), repr(needle), timeout)
        return next(x for x in self.err if needle in x)

    def exit_code(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it; the exit code."""
        self.proc.send_signal(signal.SIGINT)
        return self.exit_code(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.exit_code(30)


@pytest.fixture
def watchers() -> Iterator[Callable[..., Watcher]]:
    started: list[Watcher] = []

    def start(*args: str) -> Watcher:
        started.append(Watcher(*args))
        return started[-1]

    yield start
    for watcher in started:
        watcher.close()


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    proc = events_server_process()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sglang_int64() -> Any:
    """SGLang's released ``hash_str_to_int64``: the hash its own events carry for a key."""
    return sglang_hash_function()


def parse(line: str) -> dict[str, Any]:
    """A printed line as ``{"time", "seq", "run", "type", field: text}``."""
    match = LINE.fullmatch(line)
    assert match, line
    shown, seq, run, kind, rest = match.groups()
    fields = dict(part.split("=", 1) for part in rest.split())
    return {"time": shown, "seq": int(seq), "run": run, "type": kind, **fields}


def store(url: str, ns: str, chain: list[tuple[str, str | None]]) -> None:
    """An SGLang engine's write of a chain of pages: reserve, then confirm every page."""
    reply = requests.post(
        f"{url}/0/reserve_and_allocate_page_indices",
        json={"keys": chain, "namespace": ns},
        timeout=30,
    ).json()["indices"]
    pairs = [(k, page) for (k, _), (hit, page) in zip(chain, reply, strict=True) if not hit]
    assert all(page >= 0 for _, page in pairs), reply
    r = requests.post(
        f"{url}/0/confirm_write",
        json={"written_keys_to_confirm": pairs, "namespace": ns},
        timeout=30,
    )
    assert r.status_code in (200, 204), r.text


def join(url: str, *watching: Watcher, timeout: float = 60.0) -> None:
    """Store page after page in the probe pool until every watcher has printed one more: a
    SUB socket gets only what is published after its subscription reached the server, and
    from then on it gets every batch in order."""
    requests.post(f"{url}/0/initialize", json={"num_pages": 64, "namespace": "probe"}, timeout=30)
    before = [len(w.out) for w in watching]

    def joined() -> bool:
        return all(
            any(PROBE in x for x in w.out[n:]) for w, n in zip(watching, before, strict=True)
        )

    deadline = time.monotonic() + timeout
    while not joined():
        assert time.monotonic() < deadline, [w.err for w in watching]
        store(url, "probe", [(hashlib.sha256(f"probe {next(_PROBES)}".encode()).hexdigest(), None)])
        end = time.monotonic() + 0.5
        while time.monotonic() < end and not joined():
            time.sleep(0.02)


def after_probe(lines: list[str]) -> list[str]:
    """The lines after the watcher joined (every probe is published before the workload)."""
    last = max(i for i, x in enumerate(lines) if PROBE in x)
    return lines[last + 1 :]


def workload_lines(watcher: Watcher, n: int) -> list[str]:
    """The first ``n`` lines the watcher printed after it joined, once printed."""
    watcher._until(lambda: len(after_probe(watcher.out)) >= n, f"{n} lines after joining", 60)
    return after_probe(watcher.out)[:n]


# ---------------------------------------------------------------------- one workload, known events

A = [page_key(i) for i in range(3)]
B = [page_key(i) for i in range(3, 5)]
M = [page_key(i) for i in range(10, 12)]
V = [hashlib.md5(f"vllm {i}".encode()).hexdigest() for i in range(3)]


def known_workload(url: str) -> None:
    """Each step's events are known: a chain stored, an eviction, a chain naming its parent,
    another namespace, a delete, a clear, and a vLLM rank pool's commit."""
    for ns, pages in (("kv", 4), ("mamba", 8)):
        r = requests.post(
            f"{url}/0/initialize", json={"num_pages": pages, "namespace": ns}, timeout=30
        )
        assert r.status_code == 204, r.text
    store(url, "kv", [(A[0], None), (A[1], A[0]), (A[2], A[1])])  # BlockStored 3
    store(url, "kv", [(B[0], A[2]), (B[1], B[0])])  # 4 pages: evicts 1 (capacity), BlockStored 2
    store(url, "mamba", [(M[0], None), (M[1], M[0])])
    requests.post(f"{url}/0/delete_keys", json={"keys": [B[0], "never stored"]}, timeout=30)
    requests.post(f"{url}/0/clear", json={"namespace": "kv"}, timeout=30)
    client = load("vllm").Hf3fsGlobalMetadataClient(url)
    try:
        client.initialize(0, 16)
        pages = client.allocate_pages_for_keys(0, [(k, "") for k in V])
        client.confirm_write_for_keys(0, [(k, p) for k, p in pages if p >= 0])
    finally:
        client._session.close()


def test_lines_and_json_show_what_the_workload_did(
    server: ServerProcess, watchers: Callable[..., Watcher], sglang_int64: Any
) -> None:
    ends = endpoints(server)
    text = watchers(ends.pub)
    as_json = watchers(ends.pub, "--json", "--replay", str(ends.replay))
    join(server.url, text, as_json)
    known_workload(server.url)
    h = sglang_int64
    want = [
        ("BlockStored", "pool=s:0:kv blocks=3 parent=none"),
        ("BlockRemoved", "pool=s:0:kv blocks=1 reason=capacity"),
        ("BlockStored", f"pool=s:0:kv blocks=2 parent={h(A[2])}"),
        ("BlockStored", "pool=s:0:mamba blocks=2 parent=none"),
        ("BlockRemoved", "pool=s:0:kv blocks=1 reason=delete"),
        ("AllBlocksCleared", "pool=s:0:kv reason=clear"),
        ("BlockStored", "pool=v:0 blocks=3 parent=none"),
    ]
    lines = workload_lines(text, len(want))
    got = [(parse(x)["type"], x.split(maxsplit=4)[4]) for x in lines]
    assert got == want
    run = ends.topic.rsplit("/", 1)[1]
    seqs = [parse(x)["seq"] for x in lines]
    assert all(parse(x)["run"] == run for x in lines) and seqs == sorted(seqs)

    objects = [json.loads(x) for x in workload_lines(as_json, len(want))]
    assert [o["seq"] for o in objects] == seqs  # the same batches, event for event
    assert [parse(x)["time"] for x in lines] == [format_time(o["ts"]) for o in objects]
    assert all(o["topic"] == ends.topic and o["run"] == run for o in objects)
    stored, evicted, chained, mamba, deleted, cleared, vllm = objects
    assert stored["block_hashes"] == [h(k) for k in A] and stored["keys"] == A
    assert stored["parent_block_hash"] is None and stored["parent_key"] is None
    assert stored["medium"] == "EXTERNAL" and stored["tenant"] == "" and stored["reason"] == ""
    assert evicted["type"] == "BlockRemoved" and evicted["reason"] == "capacity"
    (gone,) = evicted["block_hashes"]
    assert gone in {h(k) for k in A}  # the least recently used page of the first chain
    assert chained["block_hashes"] == [h(k) for k in B] and chained["keys"] == B
    assert chained["parent_block_hash"] == h(A[2]) and chained["parent_key"] == A[2]
    assert mamba["pool"] == "s:0:mamba" and mamba["block_hashes"] == [h(k) for k in M]
    assert deleted["block_hashes"] == [h(B[0])] and deleted["reason"] == "delete"
    assert cleared["type"] == "AllBlocksCleared" and cleared["pool"] == "s:0:kv"
    assert cleared["reason"] == "clear" and "block_hashes" not in cleared
    assert vllm["pool"] == "v:0" and vllm["block_hashes"] == V  # a vLLM key's bytes, as text
    assert vllm["parent_block_hash"] is None and vllm["keys"] == []
    text.said(f"kvmeta events: connected to {ends.pub}")
    text.said(f"kvmeta events: following run {run}")
    assert not any("missed" in x or "Traceback" in x for x in text.err + as_json.err)

    # --pool: only those pools, and the clears of every pool (the resync's first event).
    pools = watchers(
        ends.pub, "--replay", str(ends.replay), "--from", "0", "--json", "--pool", "s:0:mamba",
        "v:0", "--count", "3",
    )  # fmt: skip
    assert pools.exit_code() == 0
    shown = [json.loads(x) for x in pools.out]
    assert [(o["seq"], o["type"], o["pool"], o["reason"]) for o in shown] == [
        (0, "AllBlocksCleared", "", "restart-recovery"),
        (mamba["seq"], "BlockStored", "s:0:mamba", ""),
        (vllm["seq"], "BlockStored", "v:0", ""),
    ]
    # --tenant: this server has the default tenant ("") alone.
    default = watchers(
        ends.pub, "--replay", str(ends.replay), "--from", "0", "--json", "--tenant", "",
        "--count", "2",
    )  # fmt: skip
    other = watchers(
        ends.pub, "--replay", str(ends.replay), "--from", "0", "--json", "--tenant", "acme",
        "--timeout", "1",
    )  # fmt: skip
    assert default.exit_code() == 0 and other.exit_code() == 1  # (1: --timeout)
    first, second = map(json.loads, default.out)
    assert (first["seq"], first["type"]) == (0, "AllBlocksCleared")
    assert (second["type"], second["tenant"]) == ("BlockStored", "")
    assert [(o["seq"], o["pool"]) for o in map(json.loads, other.out)] == [(0, "")]
    assert text.interrupt() == 0 and as_json.interrupt() == 0  # Ctrl-C: quietly, status 0
    assert not any("Traceback" in x or "KeyboardInterrupt" in x for x in text.err + as_json.err)


# ---------------------------------------------------------------------- --from, then live


def test_from_replays_what_a_live_watcher_saw_then_goes_on_live(
    server: ServerProcess, watchers: Callable[..., Watcher], sglang_int64: Any
) -> None:
    ends = endpoints(server)
    assert ends.replay is not None
    live = watchers(ends.pub, "--json")
    join(server.url, live)
    _, prefix_of = sglang_workload(server.url, random.Random(5), 30)
    join(server.url, live)  # a probe after the workload: once it is shown, so is all before it
    seen = [json.loads(x) for x in live.out]
    end = next(o["seq"] for o in seen[::-1] if o["pool"] == PROBE)  # that probe's batch
    seen = [o for o in seen if o["seq"] < end]  # every batch before it, whole

    caught = watchers(ends.pub, "--replay", ends.replay, "--from", "0", "--json")
    caught._until(lambda: any(json.loads(x)["seq"] >= end for x in caught.out), "probe", 60)
    replayed = [json.loads(x) for x in caught.out]
    assert replayed[0]["seq"] == 0 and replayed[0]["reason"] == "restart-recovery"
    # Batch for batch, event for event, what the live watcher printed from where it joined.
    assert [o for o in replayed if seen[0]["seq"] <= o["seq"] < end] == seen
    # The events are the workload's: SGLang's hashes of the keys, the prefixes it named.
    reasons = set()
    for o in replayed:
        reasons.add(o["reason"])
        if o["type"] == "BlockStored" and o["pool"] != PROBE:
            assert o["block_hashes"] == [sglang_int64(k) for k in o["keys"]]
            parent = prefix_of[o["keys"][0]]
            assert o["parent_block_hash"] == (None if parent is None else sglang_int64(parent))
    assert reasons == {"restart-recovery", "", "capacity", "delete", "clear"}

    # Then live: the next change is shown once, after what was replayed. (Stored again until
    # it is shown: were the first store's batch published before the watcher's subscription
    # reached the server, the next one's would have it fetched from the replay socket.)
    key = page_key(999)
    deadline = time.monotonic() + 60
    n = 0
    while not any(key in x for x in caught.out):
        assert time.monotonic() < deadline, caught.err
        store(server.url, "probe", [(page_key(999 + n), None)])
        n += 1
        with contextlib.suppress(AssertionError):
            caught._until(lambda: any(key in x for x in caught.out), "live line", 0.5)
    assert caught.interrupt() == 0
    shown = [json.loads(x) for x in caught.out]
    seqs = [o["seq"] for o in shown]
    assert seqs == sorted(seqs) and set(seqs) == set(range(seqs[-1] + 1))  # no gap
    assert len({x for x in caught.out}) == len(caught.out)  # no event shown twice
    (stored,) = [o for o in shown if key in o.get("keys", ())]
    assert stored["seq"] > replayed[-1]["seq"] and stored["pool"] == PROBE
    assert not any("missed" in x for x in caught.err), caught.err
    assert live.interrupt() == 0


# ---------------------------------------------------------------------- restart


def test_a_restart_is_a_new_run_whose_resync_is_shown(
    watchers: Callable[..., Watcher],
) -> None:
    pub, rep = f"tcp://127.0.0.1:{unused_port()}", f"tcp://127.0.0.1:{unused_port()}"
    args = ["--in-memory", "--events", pub, "--events-replay", rep]
    first = ServerProcess(*args).start()
    try:
        watcher = watchers(pub, "--replay", rep)
        join(first.url, watcher)
        old_run = parse(watcher.out[-1])["run"]
    finally:
        first.stop()
    watcher.said("disconnected from")
    shown = len(watcher.out)  # the new run's resync may be shown as soon as it starts
    second = ServerProcess(*args).start()
    try:
        new_run = endpoints(second).topic.rsplit("/", 1)[1]
        join(second.url, watcher)  # its first batch seen live, or the one after it: either way
        notice = watcher.said(f"new run {new_run}")
        assert "restarted" in notice
        after = [parse(x) for x in watcher.out[shown:]]
        # The resync comes first, once, whether it arrived live or from the replay socket.
        assert (after[0]["seq"], after[0]["run"], after[0]["type"]) == (
            0,
            new_run,
            "AllBlocksCleared",
        )
        assert (after[0]["pool"], after[0]["reason"]) == ("*", "restart-recovery")
        assert [x["seq"] for x in after] == sorted({x["seq"] for x in after})  # no duplicate
        assert old_run != new_run and all(x["run"] == new_run for x in after)
        assert not any("missed" in x for x in watcher.err), watcher.err
    finally:
        second.stop()


# ---------------------------------------------------------------------- a feed with gaps


class FakeFeed:
    """A PUB socket and a replay ROUTER the test drives itself, so that batches go missing
    exactly where the test says (the publisher never skips any)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.address = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, tuple[bytes, bytes]] = {}  # what the replay socket holds
        self.asked: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, empty, wanted = self.router.recv_multipart()
            start = int.from_bytes(wanted, "big", signed=True)
            self.asked.append(start)
            for seq in sorted(s for s in self.buffer if s >= start):
                topic, payload = self.buffer[seq]
                self.router.send_multipart([ident, empty, topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, empty, b"", END, b""])

    def send(self, topic: bytes, seq: int, payload: bytes, keep: bool = True) -> None:
        if keep:
            self.buffer[seq] = (topic, payload)
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def _payload(encoding: str, n: int) -> bytes:
    enc = Encoder(encoding, "EXTERNAL")
    return enc.batch(1.5, [enc.stored(PoolId("s", 0, "kv"), [n], None, [f"{n:016x}"], None)])


def _until_shown(feed: FakeFeed, watcher: Watcher, topic: bytes, seq: int, payload: bytes) -> None:
    """Send one batch again and again until the watcher printed it (then it has joined; the
    copies that follow are the same batch, which it must not print twice)."""
    deadline = time.monotonic() + 60
    while not watcher.out:
        assert time.monotonic() < deadline, watcher.err
        feed.send(topic, seq, payload)
        time.sleep(0.05)


@pytest.fixture
def feed() -> Iterator[FakeFeed]:
    fake = FakeFeed()
    yield fake
    fake.close()


def test_missed_batches_and_new_runs_are_said_on_stderr(
    feed: FakeFeed, watchers: Callable[..., Watcher]
) -> None:
    one, two = b"kvmeta/e1/run1", b"kvmeta/e1/run2"
    watcher = watchers(feed.address, "--json")
    _until_shown(feed, watcher, one, 0, _payload("array", 0))  # the positional encoding read too
    feed.send(one, 1, _payload("map", 1))
    feed.send(one, 5, _payload("map", 5))  # 2-4 missed
    feed.send(two, 3, _payload("map", 30))  # a new run, its 0-2 missed
    feed.send(two, 4, b"\xc1")  # not msgpack: said, and the feed goes on
    feed.send(two, 5, _payload("map", 50))
    objects = [json.loads(x) for x in watcher.lines(5)]
    assert [(o["run"], o["seq"], o["block_hashes"]) for o in objects] == [
        ("run1", 0, [0]), ("run1", 1, [1]), ("run1", 5, [5]), ("run2", 3, [30]), ("run2", 5, [50]),
    ]  # fmt: skip
    assert watcher.said("batches 2-4 of run run1 missed") == (
        "kvmeta events: batches 2-4 of run run1 missed: give --replay to fetch missed batches"
    )
    assert "the server restarted" in watcher.said("new run run2 (epoch e1)")
    watcher.said("batches 0-2 of run run2 missed")
    watcher.said("batch 4: not msgpack")
    notices = [x for x in watcher.err if "missed" in x or "new run" in x]
    assert len(notices) == 3, watcher.err  # each once, in the order they happened
    assert notices.index(next(x for x in notices if "new run" in x)) == 1


def test_missed_batches_are_fetched_from_the_replay_socket(
    feed: FakeFeed, watchers: Callable[..., Watcher]
) -> None:
    topic = b"kvmeta/e1/run1"
    watcher = watchers(feed.address, "--replay", feed.replay_address, "--format", "map")
    _until_shown(feed, watcher, topic, 0, _payload("map", 0))
    for seq in (1, 2, 3):
        feed.buffer[seq] = (topic, _payload("map", seq))  # published while the watcher lost them
    feed.send(topic, 4, _payload("map", 4))
    assert [parse(x)["seq"] for x in watcher.lines(5)] == [0, 1, 2, 3, 4]
    assert feed.asked[-1] == 1  # from the one after the last it showed
    # Gone from the buffer as well: said, with what to do.
    feed.buffer = {s: b for s, b in feed.buffer.items() if s < 5}
    feed.buffer[7] = (topic, _payload("map", 7))
    feed.send(topic, 8, _payload("map", 8))
    assert [parse(x)["seq"] for x in watcher.lines(7)][5:] == [7, 8]
    assert watcher.said("batches 5-6 of run run1 missed").endswith(
        "no longer in the replay buffer: rebuild from GET /v1/dump"
    )
    # --format map: an event in the other encoding is said, not shown.
    feed.send(topic, 9, _payload("array", 9))
    watcher.said("batch 9 event 0: an event in the array encoding, not map")
    feed.send(topic, 10, _payload("map", 10))
    assert [parse(x)["seq"] for x in watcher.lines(8)][7:] == [10]
    assert watcher.interrupt() == 0


# ---------------------------------------------------------------------- exit codes


def test_timeout_exits_1_and_count_exits_0(
    server: ServerProcess, watchers: Callable[..., Watcher]
) -> None:
    ends = endpoints(server)
    idle = watchers(ends.pub, "--timeout", "1")
    assert idle.exit_code() == 1
    assert idle.err[-1] == "kvmeta events: no batch for 1 s (--timeout)"
    nobody = watchers(f"tcp://127.0.0.1:{unused_port()}", "--timeout", "0.5")
    assert nobody.exit_code() == 1
    assert "nothing listens at" in nobody.err[0]
    counted = watchers(ends.pub, "--replay", ends.replay, "--from", "0", "--count", "1")
    assert counted.exit_code() == 0
    assert len(counted.out) == 1 and parse(counted.out[0])["reason"] == "restart-recovery"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["tcp://127.0.0.1"], "ADDRESS 'tcp://127.0.0.1'"),
        (["http://127.0.0.1:5557"], "ADDRESS 'http://127.0.0.1:5557'"),
        (["tcp://127.0.0.1:5557", "--replay", "127.0.0.1:5558"], "--replay '127.0.0.1:5558'"),
        (["tcp://127.0.0.1:5557", "--from", "0"], "--from needs --replay"),
        (["tcp://127.0.0.1:5557", "--timeout", "0"], "--timeout"),
        (["tcp://127.0.0.1:5557", "--count", "0"], "--count"),
    ],
)
def test_wrong_options_exit_2_naming_the_option(
    args: list[str], named: str, watchers: Callable[..., Watcher]
) -> None:
    watcher = watchers(*args)
    assert watcher.exit_code() == 2
    assert watcher.out == [] and len(watcher.err) == 1, watcher.err
    assert watcher.err[0].startswith(f"kvmeta: error: {named}")


def test_a_replay_socket_nobody_listens_on_exits_2_at_once(
    watchers: Callable[..., Watcher],
) -> None:
    closed = f"tcp://127.0.0.1:{unused_port()}"
    watcher = watchers("tcp://127.0.0.1:5557", "--replay", closed, "--from", "0")
    assert watcher.exit_code() == 2
    assert time.monotonic() - watcher.started < 8  # refused is told at once, not timed out
    assert watcher.err[-1] == (
        f"kvmeta: error: --replay {closed}: nothing listens there (connection refused): give "
        "the address of the server's replay socket (started with --events-replay), or leave "
        "--replay out"
    )
    assert not any("Traceback" in x for x in watcher.err)


def test_a_replay_address_of_another_kind_of_socket_exits_2(
    server: ServerProcess, watchers: Callable[..., Watcher]
) -> None:
    ends = endpoints(server)
    http = server.url.replace("http://", "tcp://")
    for wrong in (ends.pub, http):  # the PUB socket; the HTTP port, which answers anything
        watcher = watchers(ends.pub, "--replay", wrong, "--from", "0")
        assert watcher.exit_code() == 2
        assert time.monotonic() - watcher.started < 8  # told at once, not timed out
        assert watcher.out == [] and len(watcher.err) == 1, watcher.err
        assert watcher.err[0].startswith(f"kvmeta: error: --replay {wrong}: ")
        assert "--events-replay" in watcher.err[0]


def test_a_reader_that_goes_away_ends_it_quietly(feed: FakeFeed) -> None:
    """``kvmeta events ... | head -1``: the closed pipe ends it with status 0, no traceback."""
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmeta", "events", feed.address],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    topic = b"kvmeta/e1/run1"
    first = threading.Thread(target=proc.stdout.readline, daemon=True)
    first.start()
    deadline = time.monotonic() + 60
    seq = 0
    while first.is_alive():  # until it printed a line: then it has joined
        assert time.monotonic() < deadline
        feed.send(topic, seq, _payload("map", seq))
        seq += 1
        first.join(0.05)
    proc.stdout.close()  # the reader goes away
    while proc.poll() is None:  # its next line meets the closed pipe
        assert time.monotonic() < deadline
        feed.send(topic, seq, _payload("map", seq))
        seq += 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.05)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
