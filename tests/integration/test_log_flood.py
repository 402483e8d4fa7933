"""A caller that makes the same mistake on every request (a refused confirm, an initialize
with another size) costs the server's log a bounded number of lines that state the count,
not a line per request."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import requests

from tests.support import ServerProcess

FLOOD = 1000


def _accounted(lines: list[str]) -> int:
    """Requests the lines account for: one per full line, N per "N more like it" summary."""
    total = 0
    for line in lines:
        match = re.search(r"([\d,]+) more like it", line)
        total += int(match.group(1).replace(",", "")) if match else 1
    return total


@pytest.mark.slow
def test_a_flood_of_refused_confirms_is_summarised(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server("--in-memory")
    with requests.Session() as http:
        assert http.post(server.url + "/0/initialize", json={"num_pages": 8}).status_code == 204
        for i in range(FLOOD):
            r = http.post(
                server.url + "/0/confirm_write",
                json={"written_keys_to_confirm": [[f"key-{i}", 3]]},  # page 3 never reserved
            )
            assert r.status_code == 204 and "confirm_refused" in r.headers["X-Kvmeta-Warning"]
            r = http.post(server.url + "/0/initialize", json={"num_pages": 16 + i})
            assert r.status_code == 204 and "size_conflict" in r.headers["X-Kvmeta-Warning"]
    assert server.stop() == 0  # at shutdown the last counts are written
    for what in ("confirm(s) for pages not reserved", "re-initialised with num_pages"):
        lines = [line for line in server.log.splitlines() if what in line]
        # One full line, then at most one summary per 10 s interval (and one at shutdown).
        assert 2 <= len(lines) <= 8, lines
        assert "more like it" in lines[-1], lines
        assert _accounted(lines) == FLOOD, lines
