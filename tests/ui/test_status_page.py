"""The status page in a real browser (headless Chromium driven by selenium) against a real
``kvmeta serve`` with ``--auth-token`` and load on it: the page signs in with Basic (any user,
the token as password), its pool rows show the numbers of ``/v1/pools`` once the load stops,
and its charts keep updating. A screenshot is kept under ``tests/ui/artifacts/``.

The browser comes from ``tests/ui/conftest.py`` (headless Chromium through selenium).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta.client.sglang import Hf3fsGlobalMetadataClient
from tests.support import ServerProcess

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TOKEN = "ui-test-token"
AUTH = ("anyone", TOKEN)
POOLS = ((0, "kv"), (1, "kv"), (0, "draft"))

pytestmark = pytest.mark.slow


def _wait(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Load:
    """reserve / confirm / get / exists through kvmeta's client, in a thread, until stopped."""

    def __init__(self, url: str) -> None:
        self.client = Hf3fsGlobalMetadataClient(url, auth_token=TOKEN)
        for rank, ns in POOLS:
            self.client.initialize(rank, 64, namespace=ns)
        self.stop = threading.Event()
        self.calls = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(7)
        c = self.client
        try:
            while not self.stop.is_set():
                rank, ns = rng.choice(POOLS)
                keys = [f"k{i}" for i in rng.sample(range(150), 8)]
                got = c.reserve_and_allocate_page_indices(rank, [(k, None) for k in keys], ns)
                pairs = zip(keys, got, strict=True)
                fresh = [(k, page) for k, (stored, page) in pairs if not stored and page >= 0]
                c.confirm_write(rank, fresh[: len(fresh) - 1], [p for _, p in fresh[-1:]], ns)
                c.get_page_indices(rank, [f"k{rng.randrange(150)}" for _ in range(8)], ns)
                c.exists(rank, [f"k{rng.randrange(150)}" for _ in range(4)], ns)
                self.calls += 4
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert self.error is None, f"load failed: {self.error!r}"

    def __exit__(self, *exc: object) -> None:
        self.halt()


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--in-memory", "--auth-token", TOKEN).start()
    try:
        yield proc
    finally:
        proc.stop()


def _body(driver: Any, name: str) -> int:
    return int(driver.find_element("tag name", "body").get_attribute(f"data-{name}") or 0)


def _points(driver: Any, chart: str) -> int:
    return int(driver.find_element("id", chart).get_attribute("data-points") or 0)


def _rows(driver: Any) -> dict[str, dict[str, str]]:
    """The pools table, read in one script: the page rebuilds its rows at every poll, so
    element handles found in one call may be gone by the next."""
    rows: dict[str, dict[str, str]] = driver.execute_script(
        """
        const rows = {};
        for (const tr of document.querySelectorAll("#pools tbody tr")) {
          const cells = {};
          for (const td of tr.querySelectorAll("td[data-field]")) {
            cells[td.dataset.field] = td.innerText.trim();
          }
          rows[tr.dataset.pool] = cells;
        }
        return rows;
        """
    )
    return rows


def _pct(text: str) -> float | None:
    return None if text == "-" else float(text.rstrip("%")) / 100


def test_status_page_in_a_browser(server: ServerProcess, browser: Any) -> None:
    host = server.url.split("://", 1)[1]
    with Load(server.url) as load:
        browser.get(f"http://{AUTH[0]}:{TOKEN}@{host}/ui")
        assert browser.title == "kvmeta status"
        _wait("the page's first update", lambda: _body(browser, "updated") >= 1)
        _wait("three pool rows", lambda: len(_rows(browser)) == 3)
        first = {c: _points(browser, c) for c in ("chart-rps", "chart-latency", "chart-hits")}
        samples = _body(browser, "samples")
        _wait(
            "the charts to update",
            lambda: (
                _body(browser, "samples") >= samples + 2
                and _points(browser, "chart-rps") > first["chart-rps"]
                and _points(browser, "chart-latency") > first["chart-latency"]
            ),
        )
        _wait("hit ratio points", lambda: _points(browser, "chart-hits") > 0)
        assert browser.find_element("id", "error").get_attribute("hidden") is not None
        assert load.calls > 0
    # Quiesce, let the server take a sample after the last change, and let the page show it.
    status = requests.get(server.url + "/v1/status", auth=AUTH, timeout=30).json()
    after = status["history"]["taken"] + 1

    def sampled() -> bool:
        doc = requests.get(server.url + "/v1/status", auth=AUTH, timeout=30).json()
        return bool(doc["history"]["taken"] >= after)

    _wait("a sample after the load stopped", sampled)
    _wait("the page to show it", lambda: _body(browser, "samples") >= after)
    pools = requests.get(server.url + "/v1/pools", auth=AUTH, timeout=30).json()["pools"]
    rows = _rows(browser)
    assert len(rows) == len(pools) == 3
    for pool in pools:
        row = rows[f"{pool['dialect']}/{pool['rank']}/{pool['namespace']}"]
        for field in ("num_pages", "reserved", "stored"):
            assert int(row[field]) == pool[field], (field, row, pool)
        # Cooling pages turn free as their grace ends, also after the load stopped: the page
        # and /v1/pools read them at different times, so only their sum is the same.
        shown = int(row["free"]) + int(row["cooling"])
        assert shown == pool["free"] + pool["cooling"], (row, pool)
        for field in ("hit_rate", "exists_hit_rate"):
            shown = _pct(row[field])
            if pool[field] is None:
                assert shown is None
            else:
                assert shown is not None and abs(shown - pool[field]) < 0.0006, (field, row)
        assert abs(float(row["occupancy"].rstrip("%")) / 100 - pool["occupancy"]) < 0.0006
    assert any(p["counters"]["get_hits"] for p in pools)  # the load did hit
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
