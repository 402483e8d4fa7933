"""``--eviction``: a server asked for leaf-first eviction gives up a chain's tail before its
older head, reports dead pages, keeps its eviction order across a restart; LRU does not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import Server

NS = "kv"


def _store(server: Server, keys: list[str]) -> None:
    """One request's pages, in order: reserved, then confirmed."""
    body = {"keys": [[k, None] for k in keys], "namespace": NS}
    got = server.post("/0/reserve_and_allocate_page_indices", body).json()["indices"]
    pairs = [[k, p] for k, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
    body = {"written_keys_to_confirm": pairs, "namespace": NS}
    assert server.post("/0/confirm_write", body).status_code == 204


def _stored(server: Server, keys: list[str]) -> list[bool]:
    reply = server.post("/0/exists", {"keys": keys, "namespace": NS})
    assert reply.status_code == 200
    return list(reply.json()["exists"])


def _dead_pages(server: Server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return {
        sample.labels["namespace"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvmeta_dead_pages"
    }


def _chain_then_evict(server: Server) -> list[bool]:
    """A <- B <- C in a 3-page pool; B and C read again (an engine holding A in its host
    cache asks only for the rest), then one new key: which of A, B, C are left."""
    assert server.post("/0/initialize", {"num_pages": 3, "namespace": NS}).status_code == 204
    _store(server, ["A", "B", "C"])
    server.post("/0/get_page_indices", {"keys": ["B", "C"], "namespace": NS})
    _store(server, ["x"])
    return _stored(server, ["A", "B", "C"])


def test_prefix_eviction_keeps_the_chains_head(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--read-lease", "0", "--eviction", "prefix")
    assert _chain_then_evict(server) == [True, True, False]
    assert _dead_pages(server) == {NS: 0.0}


def test_lru_evicts_the_head_and_reports_no_dead_pages(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--read-lease", "0", "--eviction", "lru")
    assert _chain_then_evict(server) == [False, True, True]  # B and C are dead now
    assert _dead_pages(server) == {}  # an LRU pool keeps no parents to count them by


def test_the_order_survives_a_restart(make_app: Callable[..., Server], tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    flags = ("--data-dir", data, "--read-lease", "0", "--eviction", "prefix")
    first = make_app(*flags)
    assert first.post("/0/initialize", {"num_pages": 3, "namespace": NS}).status_code == 204
    _store(first, ["A", "B", "C"])
    first.stop()
    again = make_app(*flags)
    assert again.post("/0/initialize", {"num_pages": 3, "namespace": NS}).status_code == 204
    # The leaf C was first to go before the restart, and still is; parents are relearned.
    _store(again, ["x"])
    assert _stored(again, ["A", "B", "C"]) == [True, True, False]
    assert requests.get(again.url + "/v1/check", timeout=10).json()["ok"] is True
