"""The status page when its server stops answering, in a real browser (headless Chromium).

A page left open on a wall screen must not show a dead server's last numbers as if they were
live. Killed (SIGKILL: connections refused) or stopped (SIGSTOP: the kernel still accepts
connections, nothing answers, so only a timeout tells), the page must turn to a red
"disconnected since <time>" banner within a bounded wait, grey its numbers and keep them (the
last known values, visibly stale), and come back by itself once a server answers on the same
address again: the banner gone, the numbers live. A screenshot of the disconnected page is kept
under ``tests/ui/artifacts/``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmeta.client.sglang import Hf3fsGlobalMetadataClient
from tests.support import ServerProcess

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TOKEN = "ui-disconnect-token"
POLL_SECONDS = 2.0  # the page's poll interval (status.js)
# One poll interval to notice, one more for a request that times out, and slack for a loaded
# machine: the page must say so well before someone would read the numbers as live.
NOTICE_SECONDS = 4 * POLL_SECONDS

pytestmark = pytest.mark.slow


def _wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def _view(driver: Any) -> dict[str, Any]:
    """What the page shows, read in one script (the page rebuilds its rows at every poll)."""
    view: dict[str, Any] = driver.execute_script(
        """
        const banner = document.getElementById("disconnected");
        const main = getComputedStyle(document.querySelector("main"));
        const rows = {};
        for (const tr of document.querySelectorAll("#pools tbody tr")) {
          const cells = {};
          for (const td of tr.querySelectorAll("td[data-field]")) {
            cells[td.dataset.field] = td.innerText.trim();
          }
          rows[tr.dataset.pool] = cells;
        }
        return {
          banner: banner && !banner.hidden && banner.offsetParent !== null
            ? banner.innerText.trim() : "",
          bannerColor: banner ? getComputedStyle(banner).backgroundColor : "",
          state: document.getElementById("state").innerText.trim(),
          filter: main.filter,
          opacity: parseFloat(main.opacity),
          updated: parseInt(document.body.dataset.updated || "0"),
          rows: rows,
        };
        """
    )
    return view


def _greyed(view: dict[str, Any]) -> bool:
    return "grayscale" in view["filter"] and view["opacity"] < 1


def _live(view: dict[str, Any], after: int) -> bool:
    return not view["banner"] and not _greyed(view) and view["updated"] > after


def _fill(url: str) -> None:
    """Two pools with confirmed pages, so the page has numbers that survive a restart."""
    client = Hf3fsGlobalMetadataClient(url, auth_token=TOKEN)
    for rank in (0, 1):
        client.initialize(rank, 32, namespace="kv")
        keys = [f"k{i}" for i in range(5 + rank)]
        got = client.reserve_and_allocate_page_indices(rank, [(k, None) for k in keys], "kv")
        client.confirm_write(
            rank, [(k, page) for k, (_, page) in zip(keys, got, strict=True)], [], "kv"
        )


def _open(driver: Any, server: ServerProcess) -> dict[str, Any]:
    host = server.url.split("://", 1)[1]
    driver.get(f"http://anyone:{TOKEN}@{host}/ui")
    return _wait(
        "the page's first update with both pools",
        lambda: (v := _view(driver))["updated"] >= 1 and len(v["rows"]) == 2 and v,
        60.0,
    )


def _assert_disconnected(driver: Any, before: dict[str, Any]) -> dict[str, Any]:
    view = _wait(
        "the disconnected banner",
        lambda: "disconnected since" in (v := _view(driver))["banner"] and v,
        NOTICE_SECONDS,
    )
    assert view["bannerColor"] not in ("", "rgba(0, 0, 0, 0)"), view  # a coloured banner
    assert _greyed(view), view
    assert view["rows"] == before["rows"], "the last values must stay on the page"
    assert "DISCONNECTED" in view["state"], view
    return view


def test_killed_server_shows_disconnected_then_recovers(tmp_path: Path, browser: Any) -> None:
    data = tmp_path / "data"
    first = ServerProcess("--data-dir", str(data), "--auth-token", TOKEN).start()
    second: ServerProcess | None = None
    try:
        _fill(first.url)
        before = _open(browser, first)
        assert not before["banner"] and not _greyed(before), before
        first.kill()  # SIGKILL: nothing listens on the port any more
        down = _assert_disconnected(browser, before)
        ARTIFACTS.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "status-page-disconnected.png"))
        # Still disconnected (and still showing the same numbers) a poll later.
        time.sleep(POLL_SECONDS)
        again = _view(browser)
        assert "disconnected since" in again["banner"] and again["rows"] == before["rows"]

        second = ServerProcess(
            "--data-dir", str(data), "--auth-token", TOKEN, "--port", str(first.port)
        ).start()
        assert second.url == first.url
        live = _wait(
            "the page to recover", lambda: _live(v := _view(browser), down["updated"]) and v, 30.0
        )
        # The restarted server serves the same data directory: the same confirmed pages.
        for pool, row in before["rows"].items():
            assert live["rows"][pool]["stored"] == row["stored"], (pool, live["rows"])
        assert "DISCONNECTED" not in live["state"]
    finally:
        first.kill()
        if second is not None:
            second.stop()


def test_stopped_server_times_out_to_disconnected_then_recovers(
    tmp_path: Path, browser: Any
) -> None:
    server = ServerProcess("--data-dir", str(tmp_path / "data"), "--auth-token", TOKEN).start()
    stopped = False
    try:
        _fill(server.url)
        before = _open(browser, server)
        server.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        stopped = True
        down = _assert_disconnected(browser, before)
        server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        stopped = False
        _wait("the page to recover", lambda: _live(_view(browser), down["updated"]), 30.0)
    finally:
        if stopped:
            server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        server.stop()
