"""The router routes and the prefix-hit metrics over HTTP: what a router and
an operator see over HTTP, on the in-memory and the Redis backends."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import requests

from tests.support import Server


def _store(server: Server, rank: int, keys: list[str], ns: str = "kv") -> None:
    out = server.post(
        f"/{rank}/reserve_and_allocate_page_indices",
        {"keys": [[k, ""] for k in keys], "namespace": ns},
    )
    pairs = [[k, page] for k, (_, page) in zip(keys, out.json()["indices"], strict=True)]
    r = server.post(f"/{rank}/confirm_write", {"written_keys_to_confirm": pairs, "namespace": ns})
    assert r.status_code == 204


def _v_store(server: Server, rank: int, keys: list[str]) -> None:
    out = server.post("/keys/batch_allocate", {"rank": rank, "keys": keys}).json()["results"]
    r = server.post("/keys/confirm_write", {"rank": rank, "confirmations": out})
    assert r.status_code == 204


def _metric(text: str, name: str, labels: str) -> float:
    """The value of the series ``name`` whose labels are exactly ``labels`` (any order)."""
    want = sorted(labels.split(","))
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and sorted(head[len(name) + 1 : -1].split(",")) == want:
            return float(value)
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


def _exercise(server: Server) -> None:
    assert server.post("/0/initialize", {"num_pages": 64, "namespace": "kv"}).status_code == 204
    _store(server, 0, ["a", "b", "c", "e"])
    server.post("/rank/0/initialize", {"num_pages": 16})
    _v_store(server, 0, ["x", "y"])

    matched = server.post(
        "/v1/prefix_match",
        {
            "pools": [
                {"rank": 0, "keys": ["a", "b", "c", "d", "e"]},
                {"dialect": "vllm", "rank": 0, "keys": ["x", "z"]},
                {"rank": 3, "namespace": "kv", "keys": ["a"]},
            ]
        },
    )
    assert matched.status_code == 200, matched.text
    assert [(m["length"], m["found"]) for m in matched.json()["matches"]] == [
        (3, True),
        (1, True),
        (0, False),
    ]
    hashes = server.post("/v1/prefix_match", {"pools": [{"rank": 0, "hashes": [1]}]})
    assert hashes.status_code == 400 and "--hash-index" in hashes.json()["detail"]

    seen: list[str] = []
    cursor = ""
    while True:
        page = requests.get(
            server.url + "/v1/dump",
            params={"rank": 0, "namespace": "kv", "cursor": cursor, "limit": 2},
            timeout=10,
        )
        assert page.status_code == 200, page.text
        seen += page.json()["keys"]
        cursor = page.json()["cursor"]
        if not cursor:
            break
    assert sorted(seen) == ["a", "b", "c", "e"]
    v = requests.get(server.url + "/v1/dump?rank=0&dialect=vllm", timeout=10).json()
    assert sorted(v["keys"]) == ["x", "y"] and v["cursor"] == ""
    missing = requests.get(server.url + "/v1/dump?rank=5", timeout=10)
    assert missing.status_code == 404 and "Rank 5" in missing.json()["detail"]
    too_many = requests.get(server.url + "/v1/dump?rank=0&limit=100000", timeout=10)
    assert too_many.status_code == 400 and "limit" in too_many.json()["detail"]

    # The router reads changed no pool counter (hit ratios are the engines' alone).
    pools = requests.get(server.url + "/v1/pools", timeout=10).json()["pools"]
    (s0,) = [p for p in pools if p["dialect"] == "s"]
    assert s0["counters"]["exists_hits"] == 0 and s0["counters"]["exists_misses"] == 0

    # Engines' exists calls: leading hits per call.
    assert server.post("/0/exists", {"keys": ["a", "b", "c", "d", "e"]}).json()["exists"] == [
        True,
        True,
        True,
        False,
        True,
    ]
    server.post("/0/exists", {"keys": ["q", "a"]})
    server.post("/0/exists", {"keys": ["a", "b"]})
    server.post("/keys/batch_exists", {"keys": ["x", "y", "z"]})

    text = requests.get(server.url + "/metrics", timeout=10).text
    s = 'dialect="s",namespace="kv",rank="0",tenant=""'
    assert _metric(text, "kvmeta_prefix_keys_asked_total", s) == 9
    assert _metric(text, "kvmeta_prefix_leading_hits_total", s) == 5  # 3 + 0 + 2
    assert _metric(text, "kvmeta_prefix_hit_length_bucket", s + ',le="0"') == 1
    assert _metric(text, "kvmeta_prefix_hit_length_bucket", s + ',le="2"') == 2
    assert _metric(text, "kvmeta_prefix_hit_length_bucket", s + ',le="4"') == 3
    assert _metric(text, "kvmeta_prefix_hit_length_count", s) == 3
    v_all = 'dialect="v",namespace="",rank="all",tenant=""'
    assert _metric(text, "kvmeta_prefix_keys_asked_total", v_all) == 3
    assert _metric(text, "kvmeta_prefix_leading_hits_total", v_all) == 2


def test_router_routes_and_prefix_metrics_in_memory(
    make_app: Callable[..., Server],
) -> None:
    _exercise(make_app("--in-memory", "--read-lease", "0"))


@pytest.mark.slow
def test_router_routes_and_prefix_metrics_on_redis(
    make_app: Callable[..., Server], redis_url: str
) -> None:
    _exercise(make_app("--backend", redis_url, "--read-lease", "0"))
