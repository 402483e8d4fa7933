"""A real ``kvmeta serve`` under a stream of confirms keeps its data directory bounded by
snapshots taken for the journal's size, and a kill -9 loses none of its confirmed keys."""

from __future__ import annotations

import re
from pathlib import Path

import requests

from kvmeta.store.disk.recovery import list_data_dir
from tests.support import ServerProcess

LIMIT = 32 * 1024  # --snapshot-journal-bytes
PAGES = 512  # small: every round evicts, so the state stays small while the journal grows
_BYTES_RE = re.compile(r"^kvmeta_journal_bytes_total (\S+)$", re.MULTILINE)


def _start(data: Path, cwd: Path) -> ServerProcess:
    args = ["--data-dir", str(data), "--fsync", "always", "--read-lease", "0"]
    # Snapshots by time only at shutdown: every snapshot while it runs is one for the size.
    args += ["--snapshot-interval", "0", "--snapshot-journal-bytes", str(LIMIT)]
    args += ["--snapshot-journal-ratio", "0"]
    return ServerProcess(*args, cwd=cwd).start()


def _disk(data: Path) -> tuple[int, int]:
    """(bytes of every file in the data directory, bytes of its largest snapshot)."""
    total = snap = 0
    for path in data.iterdir():
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue  # compacted between the listing and the stat
        total += size
        if path.suffix in (".snap", ".tmp"):
            snap = max(snap, size)
    return total, snap


def _journal_written(server: ServerProcess) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    match = _BYTES_RE.search(text)
    assert match, "no kvmeta_journal_bytes_total in /metrics"
    return float(match.group(1))


def _round(server: ServerProcess, n: int) -> list[str]:
    keys = [f"{n:06d}-{i:02d}-{'k' * 48}" for i in range(32)]
    out = server.post("/0/reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys]})
    pairs = [[k, page] for k, (_, page) in zip(keys, out.json()["indices"], strict=True)]
    assert server.post("/0/confirm_write", {"written_keys_to_confirm": pairs}).ok
    return keys


def _pages(server: ServerProcess, keys: list[str]) -> list[int | None]:
    return list(server.post("/0/get_page_indices", {"keys": keys}).json()["indices"])


def test_a_confirm_stream_keeps_the_data_directory_bounded_and_survives_kill_9(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    server = _start(data, tmp_path)
    try:
        server.post("/0/initialize", {"num_pages": PAGES})
        confirmed: list[str] = []
        most = biggest = 0
        n = 0
        while _journal_written(server) < 12 * LIMIT:
            for _ in range(10):
                n += 1
                confirmed += _round(server, n)
                total, snap = _disk(data)
                most, biggest = max(most, total), max(biggest, snap)
        snapshots = list_data_dir(data).snapshots
        assert snapshots, "no snapshot was taken for the journal's size"
        # Two snapshots (the newest and the one being written), the budget, and slack for
        # the journal written while a snapshot is.
        assert most <= 2 * biggest + 2 * LIMIT, (most, biggest)
        expected = _pages(server, confirmed)
        assert sum(p is not None for p in expected) > PAGES // 2
        server.kill()  # SIGKILL: no final snapshot
        server = _start(data, tmp_path)
        assert _pages(server, confirmed) == expected
    finally:
        server.kill()
