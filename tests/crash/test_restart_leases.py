"""Writers and readers that outlive the server process: a real ``kvmeta serve`` on a data
directory, a writer still writing its reserved page and a reader still reading a page it was
given, and the server restarted under them (SIGTERM, kill -9, or a power loss: the journal cut
back to its length at the last fsync). Leases are not journaled; the guarantee is that no page
of theirs goes to another key, nor is evicted, before their lease would have ended.

Each test writes real bytes into a page file at the pages the server hands out, the late
writer's included, and then reads every stored key's page back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from tests.crash.faults import helper_pid, sync, until
from tests.support import ServerProcess, kvmeta_check

pytestmark = pytest.mark.slow

PAGES = 4096  # more than one frontier step: new writers get pages past it
PAGE_BYTES = 64
FLAGS = ("--fsync", "batch", "--read-lease", "5")


class PageFile:
    """The shared file's pages, as an engine writes and reads them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(b"\0" * PAGES * PAGE_BYTES)

    def write(self, page: int, key: str) -> None:
        with open(self.path, "r+b") as fh:
            fh.seek(page * PAGE_BYTES)
            fh.write(key.encode().ljust(PAGE_BYTES, b"."))

    def read(self, page: int) -> str:
        with open(self.path, "rb") as fh:
            fh.seek(page * PAGE_BYTES)
            return fh.read(PAGE_BYTES).rstrip(b".").decode()


def _post(server: ServerProcess, op: str, body: dict[str, object]) -> requests.Response:
    resp = server.post(f"/0/{op}", body)
    assert resp.status_code in (200, 204), resp.text
    return resp


def _reserve(server: ServerProcess, keys: list[str]) -> list[int]:
    got = _post(server, "reserve_and_allocate_page_indices", {"keys": [[k, ""] for k in keys]})
    return [page for _, page in got.json()["indices"]]


def _confirm(server: ServerProcess, pairs: list[tuple[str, int]]) -> None:
    _post(server, "confirm_write", {"written_keys_to_confirm": pairs, "pages_to_release": []})


def _write(server: ServerProcess, pages: PageFile, keys: list[str]) -> dict[str, int]:
    """Reserve, write and confirm ``keys``: the pages they were written to (-1: none left)."""
    got = dict(zip(keys, _reserve(server, keys), strict=True))
    written = {k: p for k, p in got.items() if p >= 0}
    for key, page in written.items():
        pages.write(page, key)
    _confirm(server, list(written.items()))
    return written


def _power_loss(server: ServerProcess, data: Path, pages: PageFile) -> int:
    """Nothing more reaches the disk (the fsync helper is stopped), a confirm is acknowledged
    (``batch`` does not wait for its fsync) and its page written, then the machine dies: the
    journal is cut back to its length when the helper stopped. Returns the lost key's page."""
    helper = helper_pid(server)
    os.kill(helper, signal.SIGSTOP)
    segment = sorted(data.glob("journal-*.log"))[-1]
    durable = segment.stat().st_size
    (lost,) = _write(server, pages, ["lost"]).values()
    os.kill(helper, signal.SIGKILL)  # the whole machine goes down (the helper first: it holds
    server.kill()  # the server's stderr open, which ``kill`` reads to its end)
    os.truncate(segment, durable)
    return lost


@pytest.mark.parametrize("how", ["sigterm", "kill-9", "power-loss"])
def test_a_page_leased_before_a_restart_goes_to_no_other_key(
    tmp_path: Path, how: str, make_server: Callable[..., ServerProcess]
) -> None:
    data = tmp_path / "data"
    pages = PageFile(tmp_path / "pages")
    server = make_server("--data-dir", str(data), *FLAGS)
    _post(server, "initialize", {"num_pages": PAGES})
    stored = _write(server, pages, ["s1", "s2", "s3"])
    (late,) = _reserve(server, ["K"])  # a writer still writing page `late`
    (read,) = _post(server, "get_page_indices", {"keys": ["s1"]}).json()["indices"]
    _post(server, "delete_keys", {"keys": ["s1"]})  # while its reader still reads page `read`
    del stored["s1"]
    sync(
        server
    )  # (``batch`` acknowledges before the fsync: what a crash may lose is not tested here)
    lost = late
    if how == "sigterm":
        assert server.stop() == 0
    elif how == "kill-9":
        server.kill()
    else:
        lost = _power_loss(server, data, pages)

    server = make_server("--data-dir", str(data), *FLAGS)
    try:
        # Every free page of the restarted pool is held; the stored ones are still readable.
        got = _post(server, "get_page_indices", {"keys": list(stored)}).json()["indices"]
        assert got == list(stored.values())
        new = _write(server, pages, [f"n{i}" for i in range(64)])
        assert len(new) == 64 and not {late, read, lost} & set(new.values())
        assert _post(server, "exists", {"keys": ["lost"]}).json()["exists"] == [False]
        pages.write(late, "K")  # the late write lands now, inside its lease
        assert pages.read(read) == "s1"  # what its reader is reading, still there
        # Every stored key's page holds that key's bytes, the late write notwithstanding.
        keys = list(stored) + list(new)
        got = _post(server, "get_page_indices", {"keys": keys}).json()["indices"]
        for key, page in zip(keys, got, strict=True):
            if page is not None:
                assert pages.read(page) == key, (key, page)
        # The late writer's confirm changes nothing: its page is not reserved in this run.
        _confirm(server, [("K", late)])
        assert _post(server, "exists", {"keys": ["K"]}).json()["exists"] == [False]
        pool = requests.get(server.url + "/v1/pools", timeout=10).json()["pools"][0]
        assert pool["held_after_restart"] >= 2 and pool["cooling"] >= pool["held_after_restart"]
    finally:
        assert server.stop() == 0
    check = kvmeta_check(data)
    assert check.returncode == 0, check.stdout + check.stderr


def test_pages_never_handed_out_stay_available_after_a_restart(
    tmp_path: Path, make_server: Callable[..., ServerProcess]
) -> None:
    """Only pages below the recorded frontier are held: a restart of a pool that used few of
    its pages costs none of the rest."""
    data = tmp_path / "data"
    server = make_server("--data-dir", str(data), *FLAGS)
    _post(server, "initialize", {"num_pages": 1 << 16})
    _reserve(server, ["a", "b"])
    server.kill()
    server = make_server("--data-dir", str(data), *FLAGS)
    try:
        got = _reserve(server, [f"n{i}" for i in range(2000)])
        assert -1 not in got and not {0, 1} & set(got)
        until(lambda: "holding" in server.log, what="the log line")
        assert "holding" in server.log and "after the restart" in server.log
    finally:
        assert server.stop() == 0
