"""Real ``kvmeta serve`` processes killed with SIGKILL under concurrent load, then restarted.

With ``--fsync always`` every acknowledged confirm must come back, the page invariant must hold
(``kvmeta check``), and no key may come back mapped to a page that was handed to another writer
after that key was confirmed (the write-ahead rule: the removal had to be durable first).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.bench.procstat import children
from kvmeta.store.disk.check import check_data_dir
from kvmeta.store.disk.recovery import list_data_dir, recover
from tests.support import SRC, ServerProcess

BIG = PoolId("s", 0, "kv")  # never evicts: every acknowledged confirm must survive
SMALL = PoolId("s", 0, "small")  # evicts all the time: the write-ahead rule is what matters
BIG_PAGES, SMALL_PAGES = 1 << 16, 24


@dataclass
class Ledger:
    """What the clients were told, with local monotonic times."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[str, int] = field(default_factory=dict)  # BIG: key -> page, confirm acknowledged
    deleted: set[str] = field(default_factory=set)  # BIG: delete sent (acknowledged or not)
    confirm_sent: dict[str, tuple[int, float]] = field(default_factory=dict)  # SMALL
    handouts: dict[int, list[tuple[str, float]]] = field(default_factory=dict)  # SMALL page ->


def _post(session: requests.Session, url: str, op: str, body: dict[str, object]) -> object:
    resp = session.post(f"{url}/0/{op}", json=body, timeout=10)
    resp.raise_for_status()
    return resp.json() if resp.content else None


def _client(url: str, ledger: Ledger, worker: str, stop: threading.Event) -> None:
    rng = random.Random(worker)
    with requests.Session() as session:
        i = 0
        try:
            while not stop.is_set():
                i += 1
                _big_round(session, url, ledger, f"{worker}-{i}", rng)
                _small_round(session, url, ledger, f"{worker}-{i}")
        except (requests.RequestException, OSError):
            return  # the server was killed


def _big_round(
    session: requests.Session, url: str, ledger: Ledger, tag: str, rng: random.Random
) -> None:
    keys = [f"b{tag}-{j}" for j in range(8)]
    assert _post(session, url, "exists", {"keys": keys}) == {"exists": [False] * 8}
    out = _post(
        session, url, "reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys]}
    )
    pairs = [[k, page] for k, (_, page) in zip(keys, out["indices"], strict=True)]  # type: ignore[index]
    _post(session, url, "confirm_write", {"written_keys_to_confirm": pairs})
    got = _post(session, url, "get_page_indices", {"keys": keys})
    assert got == {"indices": [p for _, p in pairs]}
    with ledger.lock:
        ledger.acked.update((k, p) for k, p in pairs)
        doomed = rng.sample(sorted(ledger.acked.keys() - ledger.deleted), 2)
        ledger.deleted.update(doomed)
    _post(session, url, "delete_keys", {"keys": doomed})


def _small_round(session: requests.Session, url: str, ledger: Ledger, tag: str) -> None:
    keys = [f"s{tag}-{j}" for j in range(4)]
    ns = {"namespace": SMALL.namespace}
    sent = time.monotonic()
    out = _post(
        session, url, "reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys], **ns}
    )
    pairs = [[k, page] for k, (_, page) in zip(keys, out["indices"], strict=True) if page >= 0]  # type: ignore[index]
    with ledger.lock:
        for key, page in pairs:
            ledger.handouts.setdefault(page, []).append((key, sent))
        confirm_at = time.monotonic()
        for key, page in pairs:
            ledger.confirm_sent[key] = (page, confirm_at)
    _post(session, url, "confirm_write", {"written_keys_to_confirm": pairs, **ns})


def _start(data: Path, cwd: Path, fsync: str = "always") -> ServerProcess:
    args = ["--data-dir", str(data), "--fsync", fsync, "--read-lease", "0"]
    args += ["--snapshot-interval", "0.3", "--snapshot-min-records", "30"]
    return ServerProcess(*args, cwd=cwd).start()


def _verify(data: Path, ledger: Ledger, fsync: str) -> None:
    report = check_data_dir(data)
    assert report.ok, report.problems
    state = recover(data, repair=False)
    big = state.pools[BIG][1]
    for key, page in ledger.acked.items():
        if key in ledger.deleted:
            continue
        if fsync == "always":
            assert big.get(key) == page, f"acknowledged confirm {key}->{page} lost"
        else:  # batch: the last group's confirms may be lost, but never remapped
            assert big.get(key) in (page, None), f"{key} came back on another page"
    for key, page in state.pools[SMALL][1].items():
        assert key in ledger.confirm_sent, f"{key} was never written"
        written_page, confirmed_at = ledger.confirm_sent[key]
        assert written_page == page
        later = [k for k, t in ledger.handouts.get(page, []) if k != key and t > confirmed_at]
        assert not later, f"{key}->{page} came back, but page {page} went to {later} after it"


@pytest.mark.soak
@pytest.mark.parametrize("fsync", ["always", "batch"])
def test_kill_9_under_load_loses_nothing_acknowledged(tmp_path: Path, fsync: str) -> None:
    """``always``: every acknowledged confirm survives. ``batch`` (the default): the last
    group's confirms may be lost, and the write-ahead rule holds all the same."""
    data = tmp_path / "data"
    ledger = Ledger()
    server = _start(data, tmp_path, fsync)
    server.post("/0/initialize", {"num_pages": BIG_PAGES})
    server.post("/0/initialize", {"num_pages": SMALL_PAGES, "namespace": SMALL.namespace})
    rng = random.Random(4)
    try:
        for round_ in range(5):
            stop = threading.Event()
            workers = [
                threading.Thread(target=_client, args=(server.url, ledger, f"{round_}.{w}", stop))
                for w in range(4)
            ]
            for w in workers:
                w.start()
            time.sleep(rng.uniform(0.4, 1.2))
            helper = _fsync_helper(server.pid)
            server.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            server.kill()
            _assert_exits(helper)  # the fsync helper does not outlive its server
            stop.set()
            for w in workers:
                w.join(15)
            _verify(data, ledger, fsync)
            server = _start(data, tmp_path, fsync)
            assert "recovered 2 pools" in server.log
            sample = sorted(ledger.acked.keys() - ledger.deleted)[-50:]
            got = server.post("/0/get_page_indices", {"keys": sample}).json()["indices"]
            if fsync == "always":
                assert got == [ledger.acked[k] for k in sample]
            else:
                assert all(g in (ledger.acked[k], None) for k, g in zip(sample, got, strict=True))
        assert len(ledger.acked) > 200 and len(ledger.confirm_sent) > 100
    finally:
        server.kill()


def _fsync_helper(pid: int) -> int:
    helpers = [
        c for c in children(pid) if b"fsync_helper" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]
    assert len(helpers) == 1, children(pid)
    return helpers[0]


def _assert_exits(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped by init
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running {timeout} s after its server died")


def test_sigterm_writes_a_final_snapshot_and_exits_quickly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = _start(data, tmp_path)
    server.post("/0/initialize", {"num_pages": 1 << 17})
    for n in range(10):
        keys = [[f"k{n}-{j}", None] for j in range(4096)]
        pages = server.post("/0/reserve_and_allocate_page_indices", {"keys": keys}).json()
        pairs = [[k, p] for (k, _), (_, p) in zip(keys, pages["indices"], strict=True)]
        assert server.post("/0/confirm_write", {"written_keys_to_confirm": pairs}).ok
    started = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0
    # Quickly: well inside stop()'s own 15 s, with room for a loaded machine's snapshot fsync.
    assert time.monotonic() - started < 12
    listing = list_data_dir(data)
    assert listing.snapshots and all(s >= listing.snapshots[-1] for s in listing.segments)
    server = _start(data, tmp_path)
    try:
        assert "40960 keys" in server.log and "0 journal records" in server.log
        assert server.post("/0/exists", {"keys": ["k9-4095"]}).json() == {"exists": [True]}
    finally:
        server.kill()


def test_second_signal_exits_at_once_without_damage(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = _start(data, tmp_path)
    server.post("/0/initialize", {"num_pages": 64})
    server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", 0]]})
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(5) in (0, 1)
    server.kill()
    assert check_data_dir(data).ok
    assert recover(data, repair=False).pools[BIG][1] == {"a": 0}


def test_corrupt_journal_stops_start_up_naming_the_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = _start(data, tmp_path)
    server.post("/0/initialize", {"num_pages": 64})
    server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None], ["b", None]]})
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", 0], ["b", 1]]})
    server.kill()  # SIGKILL: no final snapshot
    segment = data / f"journal-{list_data_dir(data).segments[-1]:012d}.log"
    raw = bytearray(segment.read_bytes())
    raw[12] ^= 0x55
    segment.write_bytes(bytes(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--data-dir", str(data), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(SRC)},
    )
    assert proc.returncode == 2
    assert segment.name in proc.stderr and "kvmeta check" in proc.stderr
    assert segment.read_bytes() == bytes(raw)
    check = subprocess.run(
        [sys.executable, "-m", "kvmeta", "check", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(SRC)},
    )
    assert check.returncode == 1 and segment.name in check.stderr


def test_legacy_file_imported_by_a_real_server_and_written_back(tmp_path: Path) -> None:
    legacy = tmp_path / "sglang.json"
    legacy.write_text(
        json.dumps(
            {
                "0": {"num_pages": 8, "free_pages": [], "key_to_index": [["a", 3], ["b", 5]]},
                "2:mamba": {"num_pages": 4, "free_pages": [], "key_to_index": [["m", 1]]},
            }
        )
    )
    server = ServerProcess(
        "--data-dir", str(tmp_path / "data"), "--persistence-path", str(legacy), cwd=tmp_path
    ).start()
    try:
        got = server.post("/0/get_page_indices", {"keys": ["a", "b", "c"]}).json()
        assert got == {"indices": [3, 5, None]}
        got = server.post("/2/get_page_indices", {"keys": ["m"], "namespace": "mamba"}).json()
        assert got == {"indices": [1]}
        server.post("/0/reserve_and_allocate_page_indices", {"keys": [["c", None]]})
        server.post("/0/confirm_write", {"written_keys_to_confirm": [["c", 0]]})
        assert server.stop() == 0
    finally:
        server.kill()
    doc = json.loads(legacy.read_text())
    assert doc["2:mamba"]["key_to_index"] == [["m", 1]]
    assert sorted(doc["0"]["key_to_index"]) == [["a", 3], ["b", 5], ["c", 0]]
