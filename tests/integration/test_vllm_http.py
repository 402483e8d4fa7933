"""Dialect V over HTTP: every route, status code, shape and error, and the
regression tests for the failures 3, 6, 13 and 14 of docs/guarantees.md on vLLM's routes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import Server


@pytest.fixture
def server(app_server: Server) -> Server:
    """Every test here checks what requests get back: the server runs in this process."""
    return app_server


INIT_ERROR = "Invalid initialization parameters: "


def init(server: Server, rank: int = 0, n: int = 8, **extra: Any) -> None:
    r = server.post(f"/rank/{rank}/initialize", {"role": "worker", "num_pages": n, **extra})
    assert r.status_code == 200, r.text
    assert r.json() == {"message": f"Rank {rank} initialized with {n} pages"}


def allocate(server: Server, rank: int, keys: list[str]) -> list[int]:
    r = server.post("/keys/batch_allocate", {"rank": rank, "keys": [[k, ""] for k in keys]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["rank"] == rank
    assert [key for key, _ in body["results"]] == keys
    return [page for _, page in body["results"]]


def confirm(
    server: Server,
    rank: int,
    pairs: list[tuple[str, int]],
    release: list[int] = (),  # type: ignore[assignment]
) -> None:
    body = {"rank": rank, "confirmations": [list(p) for p in pairs], "pages_to_release": release}
    r = server.post("/keys/confirm_write", body)
    assert r.status_code == 204, r.text
    assert r.content == b""


def save(server: Server, rank: int, keys: list[str]) -> list[int]:
    pages = allocate(server, rank, keys)
    assert all(p >= 0 for p in pages)
    confirm(server, rank, list(zip(keys, pages, strict=True)))
    return pages


def exists(server: Server, keys: list[str]) -> list[bool]:
    r = server.post("/keys/batch_exists", {"keys": keys})
    assert r.status_code == 200, r.text
    return list(r.json()["exists"])


def locations(server: Server, rank: int, keys: list[str]) -> list[int | None]:
    r = server.post("/keys/get_locations", {"rank": rank, "keys": keys})
    assert r.status_code == 200, r.text
    return list(r.json()["locations"])


def test_full_cycle_with_exact_shapes(server: Server) -> None:
    r = server.post("/rank/0/initialize", {"role": "scheduler", "num_pages": 0})
    assert r.status_code == 200
    assert r.json() == {"message": "Scheduler role does not require initialization"}
    init(server, 0, 8)
    init(server, 1, 8)
    r = server.post("/keys/batch_allocate", {"rank": 0, "keys": [["a", ""], ["b", "a"]]})
    assert r.status_code == 200 and r.json() == {"rank": 0, "results": [["a", 0], ["b", 1]]}
    r = server.post(
        "/keys/confirm_write", {"rank": 0, "confirmations": [["a", 0]], "pages_to_release": [1]}
    )
    assert r.status_code == 204 and r.content == b""
    assert exists(server, ["a", "b"]) == [False, False]  # rank 1 has not stored "a"
    save(server, 1, ["a"])
    assert exists(server, ["a", "b"]) == [True, False]
    r = server.post("/keys/get_locations", {"rank": 0, "keys": ["b", "a"]})
    assert r.status_code == 200 and r.json() == {"locations": [None, 0]}
    assert locations(server, 1, ["a"]) == [0]
    r = server.post("/clear", {})
    assert r.status_code == 204 and r.content == b""
    assert exists(server, ["a"]) == [False]
    assert locations(server, 0, ["a"]) == [None]


def test_initialize_is_idempotent_and_keeps_size(server: Server) -> None:
    init(server, 0, 4)
    init(server, 0, 4)
    r = server.post("/rank/0/initialize", {"num_pages": 9})  # role defaults to worker
    assert r.status_code == 200
    message = r.json()["message"]
    assert message.startswith("Rank 0 initialized with 4 pages")
    assert "requested 9 is ignored" in message
    server.wait_for_log("vllm rank 0 re-initialised with num_pages=9 but has 4 pages")
    pages = allocate(server, 0, [f"k{i}" for i in range(6)])
    assert pages == [-1] * 6  # the 4 pages it kept cannot hold 6 keys: all or nothing
    assert allocate(server, 0, [f"k{i}" for i in range(4)]) == [0, 1, 2, 3]


BAD_INITS: list[tuple[Any, str]] = [
    ({"role": "Worker", "num_pages": 8}, "did you mean 'worker'"),
    ({"role": "SCHEDULER"}, "did you mean 'scheduler'"),
    ({"role": "admin", "num_pages": 8}, 'unknown role "admin"'),
    ({"role": 5, "num_pages": 8}, "unknown role 5"),
    ({"role": None, "num_pages": 8}, "unknown role null"),
    ({"role": "worker"}, "needs `num_pages`, which is missing"),
    ({}, "needs `num_pages`, which is missing"),
    ({"num_pages": 0}, "got 0"),
    ({"num_pages": -3}, "got -3"),
    ({"num_pages": "8"}, 'got "8"'),
    ({"num_pages": True}, "got true (a boolean)"),
    ({"num_pages": 1.5}, "got 1.5"),
    ({"num_pages": None}, "got null"),
    ({"num_pages": 8, "world_size": 0}, "`world_size` must be an integer > 0"),
    ({"num_pages": 8, "world_size": "2"}, "`world_size` must be an integer > 0"),
    ({"num_pages": 99999999999999}, "exceeds the limit"),
    (b"{", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INITS)
def test_invalid_initialization_is_400_and_registers_nothing(
    server: Server, body: Any, needle: str
) -> None:
    r = server.post("/rank/0/initialize", body)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert detail.startswith(INIT_ERROR), detail
    assert needle in detail, detail
    if "limit" not in needle:
        assert '{"role": "worker", "num_pages": N}' in detail  # the valid combinations
    r = server.post("/keys/batch_allocate", {"rank": 0, "keys": [["a", ""]]})
    assert r.status_code == 404


def test_world_size_must_cover_the_rank(server: Server) -> None:
    r = server.post("/rank/2/initialize", {"role": "worker", "num_pages": 4, "world_size": 2})
    assert r.status_code == 400
    assert r.json()["detail"].startswith(INIT_ERROR + "rank 2 is outside `world_size` 2")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/keys/batch_allocate", {"rank": 3, "keys": [["k", ""]]}),
        ("/keys/confirm_write", {"rank": 3, "confirmations": [], "pages_to_release": []}),
        ("/keys/confirm_write", {"rank": 3, "confirmations": [["k", 0]]}),
        ("/keys/get_locations", {"rank": 3, "keys": ["k"]}),
    ],
)
def test_failure13_uninitialised_rank_is_404_not_500(
    server: Server, path: str, body: dict[str, Any]
) -> None:
    # The scheduler role registers nothing, so rank 3 is still not a worker afterwards.
    assert server.post("/rank/3/initialize", {"role": "scheduler"}).status_code == 200
    init(server, 0, 4)  # another rank existing does not help rank 3
    r = server.post(path, body)
    assert r.status_code == 404, r.text
    detail = r.json()["detail"]
    assert "Rank 3 not initialized" in detail
    assert "POST /rank/3/initialize" in detail
    assert '"role": "worker"' in detail and "N > 0" in detail


def test_failure13_clear_keeps_rank_registrations(server: Server) -> None:
    init(server, 0, 4)
    init(server, 1, 4)
    save(server, 0, ["a", "b"])
    save(server, 1, ["a", "b"])
    assert exists(server, ["a", "b"]) == [True, True]
    for body in (b"", b"{}", b'{"anything": 1}', b"not json"):  # /clear ignores its body
        assert server.post("/clear", body).status_code == 204
    assert exists(server, ["a", "b"]) == [False, False]
    # Running workers keep working without initialising again; every page is free again.
    assert sorted(save(server, 0, ["c", "d", "e", "f"])) == [0, 1, 2, 3]
    save(server, 1, ["c"])
    assert exists(server, ["c", "d"]) == [True, False]


def test_failure3_duplicates_retries_and_two_writers_share_one_page(server: Server) -> None:
    init(server, 0, 4)
    assert allocate(server, 0, ["a", "a", "b", "a"]) == [0, 0, 1, 0]
    assert allocate(server, 0, ["a", "b"]) == [0, 1]  # a retry, or a second writer
    confirm(server, 0, [("a", 0)])
    confirm(server, 0, [("a", 0)])  # a repeated confirm is an idempotent success
    assert allocate(server, 0, ["a"]) == [0]  # stored: the same page, not a new one
    # b has two holders: a release cannot tell which writer lets go, so none frees it (it
    # waits for a confirm or its lease).
    confirm(server, 0, [], [1])
    confirm(server, 0, [], [1])
    assert allocate(server, 0, ["c", "d"]) == [2, 3]
    # Every page is accounted for. a was committed while another writer of it still held its
    # reservation (that writer may still be writing): it is not evicted before their lease ends.
    assert allocate(server, 0, ["e", "f"]) == [-1, -1]
    assert locations(server, 0, ["a"]) == [0]


def test_failure6_release_of_a_stored_page_after_failed_write_is_ignored(
    server: Server,
) -> None:
    init(server, 0, 3)
    [page_a] = save(server, 0, ["a"])
    # A second save of a (same block again) fails its write and releases every page it got,
    # including a's, which is stored: the release must not free it.
    pages = allocate(server, 0, ["a", "x"])
    assert pages[0] == page_a
    confirm(server, 0, [], pages)
    assert locations(server, 0, ["a", "x"]) == [page_a, None]
    # x's released page cools before reuse; a's page was never freed: y gets the free one.
    assert allocate(server, 0, ["y"]) == [2]
    assert locations(server, 0, ["a"]) == [page_a]


def test_failure14_completeness_follows_registered_ranks(server: Server) -> None:
    init(server, 0, 4)
    save(server, 0, ["early"])
    assert exists(server, ["early"]) == [True]  # one worker: complete
    init(server, 1, 4)  # a rank registered later makes older keys incomplete
    assert exists(server, ["early"]) == [False]
    save(server, 1, ["early"])
    assert exists(server, ["early"]) == [True]
    save(server, 0, ["late"])
    assert exists(server, ["late"]) == [False]
    save(server, 1, ["late"])
    assert exists(server, ["early", "late", "never"]) == [True, True, False]


def test_failure14_world_size_pins_the_required_ranks(server: Server) -> None:
    init(server, 0, 4, world_size=2)
    save(server, 0, ["a"])
    assert exists(server, ["a"]) == [False]  # rank 1 is required even before it registers
    init(server, 1, 4)  # no world_size: the pin stays
    assert exists(server, ["a"]) == [False]
    save(server, 1, ["a"])
    assert exists(server, ["a"]) == [True]


def test_full_pool_evicts_lru_never_a_page_being_read(
    make_app: Callable[..., Server],
) -> None:
    server = make_app("--in-memory", "--read-lease", "30", "--eviction", "lru")
    init(server, 0, 4)
    save(server, 0, ["k0", "k1", "k2", "k3"])
    assert locations(server, 0, ["k0"]) == [0]  # k0 is being read: leased
    # Room for three (k1..k3), not five: never k0's page, never an error, and nothing evicted.
    assert allocate(server, 0, ["n0", "n1", "n2", "n3", "n4"]) == [-1] * 5
    exists = server.post("/keys/batch_exists", {"keys": ["k0", "k1", "k2", "k3"]}).json()
    assert exists == {"exists": [True] * 4}
    assert allocate(server, 0, ["n0", "n1", "n2"]) == [1, 2, 3]  # k1..k3, coldest first
    assert locations(server, 0, ["k0", "k1"]) == [0, None]


BAD_BODIES: list[tuple[str, Any, str]] = [
    (
        "/keys/batch_allocate",
        {"keys": [["a", ""]]},
        "Invalid request format: need 'rank' and 'keys'",
    ),
    ("/keys/batch_allocate", {"rank": 0}, "Invalid request format: need 'rank' and 'keys'"),
    ("/keys/batch_allocate", {"rank": None, "keys": []}, "Invalid request format: need 'rank'"),
    ("/keys/batch_allocate", b"", "Invalid request format: need 'rank' and 'keys'"),
    ("/keys/batch_allocate", {"rank": 0, "keys": "abc"}, "Invalid keys format"),
    ("/keys/batch_allocate", {"rank": 0, "keys": {"a": 1}}, "Invalid keys format"),
    ("/keys/batch_allocate", {"rank": "0", "keys": []}, "$.rank"),
    ("/keys/batch_allocate", {"rank": True, "keys": []}, "$.rank"),
    ("/keys/batch_allocate", {"rank": 0, "keys": [["a"]]}, "$.keys[0]"),
    ("/keys/batch_allocate", {"rank": 0, "keys": [[1, ""]]}, "$.keys[0]"),
    ("/keys/batch_allocate", b"{", "not valid JSON"),
    ("/keys/batch_allocate", b"[0]", "Invalid request format"),
    ("/keys/confirm_write", {"rank": 0}, "Invalid request format: need 'rank' and 'confirmations'"),
    ("/keys/confirm_write", {"confirmations": []}, "need 'rank' and 'confirmations'"),
    ("/keys/confirm_write", {"rank": 0, "confirmations": "a"}, "Invalid confirmations format"),
    ("/keys/confirm_write", {"rank": 0, "confirmations": [["a", "0"]]}, "$.confirmations[0]"),
    ("/keys/confirm_write", {"rank": 0, "confirmations": [["a", 99]]}, "page 99 in `confirmat"),
    ("/keys/confirm_write", {"rank": 0, "confirmations": [["a", -1]]}, "`confirmations`"),
    (
        "/keys/confirm_write",
        {"rank": 0, "confirmations": [], "pages_to_release": [8]},
        "`pages_to_release`",
    ),
    (
        "/keys/confirm_write",
        {"rank": 0, "confirmations": [], "pages_to_release": "1"},
        "$.pages_to_release",
    ),
    ("/keys/batch_exists", {}, "Invalid request format: need 'keys'"),
    ("/keys/batch_exists", {"keys": "a"}, "Invalid keys format"),
    ("/keys/batch_exists", {"keys": [1]}, "$.keys[0]"),
    ("/keys/get_locations", {"keys": ["a"]}, "Invalid request format: need 'rank' and 'keys'"),
    ("/keys/get_locations", {"rank": 0, "keys": 7}, "Invalid keys format"),
    ("/keys/get_locations", {"rank": 0, "keys": [None]}, "$.keys[0]"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_BODIES)
def test_failure12_malformed_bodies_are_400_and_change_nothing(
    server: Server, path: str, body: Any, needle: str
) -> None:
    init(server, 0, 8)
    assert allocate(server, 0, ["a"]) == [0]
    r = server.post(path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert needle in detail, detail
    if detail.startswith("Invalid"):
        assert "Send {" in detail or "outside" in detail  # the fix: the expected shape
    # nothing changed: a is still reserved on page 0; page 1 is next
    assert allocate(server, 0, ["a", "b"]) == [0, 1]


def test_path_ranks_parse_like_the_reference(server: Server) -> None:
    init(server, -1, 2)
    r = server.post("/rank/007/initialize", {"num_pages": 2})
    assert r.json() == {"message": "Rank 7 initialized with 2 pages"}
    assert allocate(server, 7, ["a"]) == [0]
    r = server.post("/rank/x/initialize", {"num_pages": 2})
    assert r.status_code == 422 and "rank" in r.json()["detail"]


def test_unknown_route_and_wrong_method(server: Server) -> None:
    r = server.post("/keys/nope", {})
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = requests.get(server.url + "/keys/batch_exists", timeout=10)
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    r = requests.get(server.url + "/clear", timeout=10)
    assert r.status_code == 405


def test_only_json_bodies_are_read(server: Server) -> None:
    r = requests.post(
        server.url + "/keys/batch_exists",
        data=b'{"keys": ["a"]}',
        headers={"Content-Type": "text/plain"},
        timeout=10,
    )
    assert r.status_code == 415 and "Content-Type 'text/plain'" in r.json()["detail"]
    r = requests.post(
        server.url + "/rank/0/initialize",
        data=b'{"role": "worker", "num_pages": 4}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=10,
    )
    assert r.status_code == 415
    assert server.post("/keys/batch_exists", {"keys": ["a"]}).json() == {"exists": [False]}
    assert requests.get(server.url + "/v1/vllm", timeout=10).json()["ranks"] == []


def test_both_dialects_at_once_with_the_same_rank_numbers(server: Server) -> None:
    # SGLang rank 0 and vLLM rank 0 are different pools of different sizes.
    assert server.post("/0/initialize", {"num_pages": 2}).status_code == 204
    init(server, 0, 4)
    init(server, 1, 4)
    r = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["s", None], ["v", None]]})
    assert r.json() == {"indices": [[False, 0], [False, 1]]}
    assert allocate(server, 0, ["v", "w", "x"]) == [0, 1, 2]  # not affected by S's pages
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["s", 0], ["v", 1]]})
    confirm(server, 0, [("v", 0)])
    save(server, 1, ["v"])
    assert server.post("/0/exists", {"keys": ["s", "v"]}).json() == {"exists": [True, True]}
    assert exists(server, ["s", "v"]) == [False, True]
    assert locations(server, 0, ["v", "s"]) == [0, None]
    # vLLM's /clear leaves SGLang's pools alone, and SGLang's clear leaves vLLM's.
    assert server.post("/clear", b"").status_code == 204
    assert server.post("/0/exists", {"keys": ["s"]}).json() == {"exists": [True]}
    save(server, 0, ["v2"])
    save(server, 1, ["v2"])
    assert server.post("/0/clear", b"").status_code == 204
    assert exists(server, ["v2"]) == [True]
    assert server.post("/0/exists", {"keys": ["s"]}).json() == {"exists": [False]}
    # An S-only rank is not a vLLM rank.
    assert server.post("/5/initialize", {"num_pages": 2}).status_code == 204
    r = server.post("/keys/batch_allocate", {"rank": 5, "keys": [["a", ""]]})
    assert r.status_code == 404


def test_confirm_for_another_keys_page_is_refused_and_bare_keys_allocate(
    server: Server,
) -> None:
    init(server, 0, 4)
    r = server.post("/keys/batch_allocate", {"rank": 0, "keys": ["a", ["b", None]]})
    assert r.json() == {"rank": 0, "results": [["a", 0], ["b", 1]]}
    confirm(server, 0, [("a", 0)])
    confirm(server, 0, [("z", 0), ("y", 1), ("x", 2)])  # not reserved for these keys
    assert locations(server, 0, ["a", "z", "y", "x"]) == [0, None, None, None]
    server.wait_for_log("refused 3 confirm(s)")
    confirm(server, 0, [("b", 1)])  # b's reservation is intact
    assert locations(server, 0, ["b"]) == [1]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
FIELDS = ["rank", "keys", "confirmations", "pages_to_release", "role", "num_pages", "world_size"]
V_PATHS = [
    "/rank/0/initialize",
    "/keys/batch_allocate",
    "/keys/confirm_write",
    "/keys/batch_exists",
    "/keys/get_locations",
    "/clear",
]


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    path=st.sampled_from(V_PATHS),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4) | JSON,
)
def test_failure12_fuzzed_bodies_never_get_a_5xx(server: Server, path: str, body: Any) -> None:
    r = server.post(path, json.dumps(body).encode())
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        assert r.json()["detail"]


@pytest.mark.parametrize(
    "path", ["/rank/0/initialize", "/v1/vllm/world_size", "/keys/batch_allocate"]
)
@pytest.mark.parametrize("body", [b"[Infinity]", b"[1, NaN]", b'{"a": [Infinity]}', b"[1,"])
def test_malformed_json_behind_a_wrong_shape_is_a_400(
    server: Server, path: str, body: bytes
) -> None:
    """The typed decoder stops at the wrong shape first; the explanation re-reads the body
    and finds it is not JSON at all: still a 400 (found by the fuzz test above)."""
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert "JSON" in r.json()["detail"]
