"""Removing a vLLM rank while its pages are in use, through the HTTP API, on every backend.

A worker of the rank may be writing a block (a reservation) or reading one (a read lease)
when an operator removes the rank; the worker then registers again by itself (vLLM's client
re-initialises on "not initialized"). Its pages must not go to new blocks while those writes
and reads may still land: the removal is refused (409, nothing changed) until the last lease
ends, unless the operator forces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvmeta.config import Settings
from kvmeta.server.http import Request
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from tests.contract.conftest import Sync, TestClock

PAGES = 4


class Http:
    """The whole app (routing, error mapping) in process, on the backend's own loop."""

    def __init__(self, sync: Sync) -> None:
        self.sync = sync
        self.app = build_app(Settings(), Service(sync.backend))

    def __call__(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        path, _, query = path.partition("?")
        raw = b"" if body is None else msgspec.json.encode(body)
        resp = self.sync.loop.run_until_complete(self.app(Request(method, path, query, raw, None)))
        return resp.status, msgspec.json.decode(resp.body) if resp.body else None

    def register(self, rank: int) -> None:
        status, body = self("POST", f"/rank/{rank}/initialize", {"num_pages": PAGES})
        assert status == 200, body

    def allocate(self, rank: int, key: str) -> int:
        status, body = self("POST", "/keys/batch_allocate", {"rank": rank, "keys": [key]})
        assert status == 200, body
        ((_, page),) = body["results"]
        assert page >= 0
        return int(page)

    def located(self, rank: int, key: str) -> int | None:
        status, body = self("POST", "/keys/get_locations", {"rank": rank, "keys": [key]})
        assert status == 200, body
        return body["locations"][0]  # type: ignore[no-any-return]


def test_a_rank_with_a_write_in_flight_keeps_its_page_from_the_next_block(
    make_backend: Callable[..., Sync],
) -> None:
    http = Http(make_backend(ttl=300.0))
    http.register(0)
    http.register(1)
    page_a = http.allocate(1, "block-a")  # the worker of rank 1 starts writing block-a
    removed, reply = http("POST", "/v1/vllm/ranks/1/remove")
    http.register(1)  # the running worker registers again by itself
    page_b = http.allocate(1, "block-b")
    assert page_b != page_a, (
        f"the re-registered rank handed page {page_a}, still being written for block-a, to "
        f"block-b (the removal answered {removed}: {reply})"
    )
    assert removed == 409, reply
    assert "in use" in reply["detail"] and "force" in reply["detail"]
    assert http("GET", "/v1/vllm")[1]["ranks"] == [0, 1]  # nothing changed
    # The first writer's confirm lands: its reservation was never dropped.
    status, _ = http(
        "POST", "/keys/confirm_write", {"rank": 1, "confirmations": [["block-a", page_a]]}
    )
    assert status == 204
    assert http.located(1, "block-a") == page_a


def test_a_rank_being_read_is_kept_until_the_read_lease_ends(
    make_backend: Callable[..., Sync],
) -> None:
    http = Http(make_backend(ttl=300.0, lease=60.0))
    http.register(1)
    page = http.allocate(1, "blk")
    confirm = {"rank": 1, "confirmations": [["blk", page]]}
    assert http("POST", "/keys/confirm_write", confirm)[0] == 204
    assert http.located(1, "blk") == page  # a worker reads it: a read lease
    status, reply = http("POST", "/v1/vllm/ranks/1/remove")
    assert status == 409, reply
    assert "0 page(s) reserved" in reply["detail"]
    assert http.located(1, "blk") == page  # still there


def test_a_rank_is_removed_once_its_leases_end(make_backend: Callable[..., Sync]) -> None:
    clock = TestClock()
    http = Http(make_backend(ttl=1.0, clock=clock))
    http.register(1)
    http.allocate(1, "abandoned")  # a writer that died: its lease runs out by itself
    status, reply = http("POST", "/v1/vllm/ranks/1/remove")
    assert status == 409, reply
    clock.advance(0.9)
    status, reply = http("POST", "/v1/vllm/ranks/1/remove")
    assert status == 409, reply  # the lease still holds
    clock.advance(0.2)
    result = http("POST", "/v1/vllm/ranks/1/remove")
    assert result[0] == 200 and result[1]["removed"] is True, result


def test_force_removes_a_rank_in_use_and_its_writer_is_refused(
    make_backend: Callable[..., Sync],
) -> None:
    http = Http(make_backend(ttl=300.0))
    http.register(1)
    page = http.allocate(1, "block-a")
    for bad in ("yes", "2", ""):
        status, reply = http("POST", f"/v1/vllm/ranks/1/remove?force={bad}")
        assert status == 400 and "`force`" in reply["detail"], reply
    status, reply = http("POST", "/v1/vllm/ranks/1/remove?force=true")
    assert status == 200 and reply["removed"] is True, reply
    assert http("GET", "/v1/vllm")[1]["ranks"] == []
    http.register(1)  # afresh: empty
    status, _ = http(
        "POST", "/keys/confirm_write", {"rank": 1, "confirmations": [["block-a", page]]}
    )
    assert status == 204  # answered, but refused: the page is not reserved in the new pool
    assert http.located(1, "block-a") is None
    status, reply = http("POST", "/v1/vllm/ranks/1/remove?force=false")
    assert status == 200 and reply["removed"] is True, reply  # nothing in use now
