"""A step of the Valkey host's wall clock never ends a lease early, and never holds a page for
the length of the step.

Leases on Redis are measured with Valkey's ``TIME``. The Valkey here runs under libfaketime
with its clock read from a file, so a test steps it at run time as NTP stepping a drifted
clock, a VM resumed or a failover to a primary whose clock differs would. A real ``kvmeta
serve`` serves the engine's requests on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tests.redis_support import SteppedRedis
from tests.support import Server

pytestmark = pytest.mark.slow

Make = Callable[..., Server]


@pytest.fixture
def stepped() -> Iterator[SteppedRedis]:
    server = SteppedRedis().start()
    try:
        yield server
    finally:
        server.close()


def _init(server: Server, pages: int) -> None:
    resp = server.post("/0/initialize", {"num_pages": pages})
    assert resp.status_code == 204, resp.text


def _reserve(server: Server, key: str) -> list[object]:
    resp = server.post("/0/reserve_and_allocate_page_indices", {"keys": [[key, None]]})
    assert resp.status_code == 200, resp.text
    (got,) = resp.json()["indices"]
    return list(got)


def test_a_forward_step_longer_than_the_reservation_never_hands_its_page_on(
    stepped: SteppedRedis, make_app: Make
) -> None:
    server = make_app("--backend", stepped.url, "--reservation-ttl", "300")
    _init(server, 1)
    assert _reserve(server, "k") == [False, 0]
    stepped.step(600)
    # k's writer may still be writing page 0: 600 s of Valkey's clock are not 600 s of time.
    assert _reserve(server, "other") == [False, -1]
    assert _reserve(server, "k") == [False, 0]  # k's lease still runs: the same page


def test_a_forward_step_longer_than_the_read_lease_never_evicts_a_page_being_read(
    stepped: SteppedRedis, make_app: Make
) -> None:
    server = make_app("--backend", stepped.url, "--read-lease", "5")
    _init(server, 1)
    assert _reserve(server, "k") == [False, 0]
    resp = server.post("/0/confirm_write", {"written_keys_to_confirm": [["k", 0]]})
    assert resp.status_code == 204, resp.text
    resp = server.post("/0/get_page_indices", {"keys": ["k"]})
    assert resp.json() == {"indices": [0]}  # page 0 is read-leased for 5 s from here
    stepped.step(6)
    assert _reserve(server, "other") == [False, -1]  # not evicted from under its reader
    assert server.post("/0/exists", {"keys": ["k"]}).json() == {"exists": [True]}


def test_a_backward_step_does_not_hold_a_reservation_for_the_length_of_the_step(
    stepped: SteppedRedis, make_app: Make
) -> None:
    """A clock stepped an hour back must not hold a 1 s reservation for an hour: its page is
    handed out again within a few seconds of real time (the lease and the step bound)."""
    server = make_app("--backend", stepped.url, "--reservation-ttl", "1")
    _init(server, 1)
    assert _reserve(server, "k") == [False, 0]
    stepped.step(-3600)
    start = time.monotonic()
    while (got := _reserve(server, "other")) != [False, 0]:
        assert got == [False, -1], got
        assert time.monotonic() - start < 60, "the page is still held a minute after the step"
        time.sleep(0.05)
    assert time.monotonic() - start >= 1.0 - 0.05  # and not before k's lease ended
