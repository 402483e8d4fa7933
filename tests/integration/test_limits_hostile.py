"""Small requests that used to cost gigabytes, minutes or a 500: each is a 400/422 naming the
field and its limit, changes nothing, and leaves a server that still serves, snapshots and
shuts down cleanly (exit 0, the last confirm kept across a restart)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support import Server, ServerProcess

FLAGS = (
    "--max-pages",
    "4096",
    "--max-total-pages",
    "6000",
    "--max-world-size",
    "8",
    "--snapshot-interval",
    "0.2",
    "--snapshot-min-records",
    "1",
)
DEEP = b'{"keys": ["a"], "namespace": "kv", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_OBJ = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
HUGE = "9" * 5000


def pools(server: Server) -> list[dict[str, Any]]:
    resp = requests.get(server.url + "/v1/pools", timeout=30)
    assert resp.status_code == 200, resp.text
    return [
        {k: p[k] for k in ("dialect", "rank", "namespace", "num_pages", "free", "stored")}
        for p in resp.json()["pools"]
    ]


def wait_until(done: Callable[[], bool], server: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, server.log
        time.sleep(0.05)


def rejected(resp: requests.Response, status: int, *needles: str) -> None:
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    for needle in needles:
        assert needle in detail, detail


# (path, body, status, words the message must contain)
HOSTILE: list[tuple[str, Any, int, tuple[str, ...]]] = [
    # pages: one pool above --max-pages; a new pool above the total budget
    ("/1/initialize", {"num_pages": 1 << 28}, 400, ("num_pages", "--max-pages")),
    ("/1/initialize", {"num_pages": 4001}, 400, ("num_pages", "--max-total-pages", "6000")),
    ("/rank/1/initialize", {"num_pages": 4001}, 400, ("num_pages", "--max-total-pages")),
    # vLLM world sizes
    ("/rank/0/initialize", {"num_pages": 8, "world_size": 10**7}, 400, ("world_size", "8")),
    ("/rank/0/initialize", {"num_pages": 8, "world_size": 2**63 + 5}, 400, ("world_size",)),
    ("/rank/0/initialize", {"num_pages": 8, "world_size": 2**64}, 400, ("world_size",)),
    # ranks beyond a signed 64-bit integer, in the path and in bodies
    ("/99999999999999999999/initialize", {"num_pages": 8}, 422, ("rank",)),
    ("/9223372036854775808/initialize", {"num_pages": 8}, 422, ("rank",)),
    (f"/{HUGE}/initialize", {"num_pages": 8}, 422, ("rank",)),
    (f"/rank/{HUGE}/initialize", {"num_pages": 8}, 422, ("rank",)),
    ("/rank/9223372036854775808/initialize", {"num_pages": 8}, 422, ("rank",)),
    ("/keys/batch_allocate", {"rank": 2**63, "keys": [["k", None]]}, 400, ("rank",)),
    ("/keys/confirm_write", {"rank": 2**64 + 1, "confirmations": []}, 400, ("rank",)),
    ("/keys/get_locations", {"rank": -(2**63) - 1, "keys": ["k"]}, 400, ("rank",)),
    ("/keys/batch_allocate", f'{{"rank": {HUGE}, "keys": []}}', 400, ("rank",)),
    ("/rank/0/initialize", f'{{"num_pages": 8, "world_size": {HUGE}}}', 400, ("world_size",)),
    ("/rank/0/initialize", f'{{"num_pages": {HUGE}}}', 400, ("num_pages",)),
    ("/0/initialize", f'{{"num_pages": {HUGE}}}', 400, ("num_pages",)),
    # deeply nested JSON
    ("/0/exists", DEEP, 400, ("nested",)),
    ("/0/initialize", DEEP_OBJ, 400, ("nested",)),
    ("/keys/batch_exists", DEEP, 400, ("nested",)),
    ("/keys/batch_allocate", DEEP_OBJ, 400, ("nested",)),
    ("/rank/0/initialize", DEEP_OBJ, 400, ("nested",)),
    ("/keys/confirm_write", b'{"rank": 0, "confirmations": ' + b"[" * 100_000 + b"}", 400, ()),
]


@pytest.fixture
def durable(make_app: Callable[..., Server], tmp_path: Path) -> Server:
    server = make_app("--data-dir", str(tmp_path / "data"), *FLAGS)
    assert server.post("/0/initialize", {"num_pages": 1000}).status_code == 204
    reply = server.post("/rank/0/initialize", {"num_pages": 1000})
    assert reply.status_code == 200, reply.text
    return server


@pytest.mark.parametrize(
    ("path", "body", "status", "needles"),
    HOSTILE,
    ids=[f"{i}:{h[0][:40]}" for i, h in enumerate(HOSTILE)],
)
def test_hostile_value_is_a_4xx_naming_the_field(
    durable: ServerProcess, path: str, body: Any, status: int, needles: tuple[str, ...]
) -> None:
    before = pools(durable)
    rejected(durable.post(path, body), status, *needles)
    assert pools(durable) == before
    # still serving
    assert durable.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [False]}


def test_after_every_hostile_value_snapshots_and_shutdown_keep_the_last_confirm(
    make_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    server = make_server("--data-dir", str(data), *FLAGS)
    assert server.post("/0/initialize", {"num_pages": 1000}).status_code == 204
    assert server.post("/rank/0/initialize", {"num_pages": 1000}).status_code == 200
    before = pools(server)
    for path, body, status, _ in HOSTILE:
        assert server.post(path, body).status_code == status, path
    assert pools(server) == before
    # the last confirm, then a snapshot, then SIGTERM
    reply = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["last", None]]})
    ((hit, page),) = reply.json()["indices"]
    assert not hit
    snapshots = server.log.count(" written: ")
    resp = server.post("/0/confirm_write", {"written_keys_to_confirm": [["last", page]]})
    assert resp.status_code == 204
    wait_until(lambda: server.log.count(" written: ") > snapshots, server)
    assert server.stop() == 0, server.log
    again = make_server("--data-dir", str(data), *FLAGS)
    assert again.post("/0/get_page_indices", {"keys": ["last"]}).json() == {"indices": [page]}
    assert again.stop() == 0, again.log


def test_budget_counts_existing_pools_and_reinitialise_still_works(
    durable: ServerProcess,
) -> None:
    # 2000 of 6000 pages are used: 4000 more fit exactly, then nothing does
    assert durable.post("/2/initialize", {"num_pages": 4000}).status_code == 204
    rejected(durable.post("/3/initialize", {"num_pages": 1}), 400, "--max-total-pages")
    # re-initialising an existing pool allocates nothing: still fine at a full budget
    assert durable.post("/2/initialize", {"num_pages": 4000}).status_code == 204
    assert durable.post("/rank/0/initialize", {"num_pages": 1000}).status_code == 200
