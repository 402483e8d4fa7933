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


def _sglang_named_parent(server: Server, prefix: str) -> list[bool]:
    """A, then B naming ``prefix`` as its prefix key, then Z, in a 3-page pool; then one new
    key: which of A, B, Z are left."""
    assert server.post("/0/initialize", {"num_pages": 3, "namespace": NS}).status_code == 204
    _store(server, ["A"])
    body = {"keys": [["B", prefix]], "namespace": NS}
    ((_, page),) = server.post("/0/reserve_and_allocate_page_indices", body).json()["indices"]
    body = {"written_keys_to_confirm": [["B", page]], "namespace": NS}
    assert server.post("/0/confirm_write", body).status_code == 204
    _store(server, ["Z"])
    _store(server, ["x"])
    return _stored(server, ["A", "B", "Z"])


def _vllm_named_parent(server: Server, prefix: str) -> list[int | None]:
    """The same on a vLLM rank: the pages of A, B, Z left (None: evicted)."""
    body = {"role": "worker", "num_pages": 3}
    assert server.post("/rank/0/initialize", body).status_code == 200
    for key, named in (("A", ""), ("B", prefix), ("Z", ""), ("x", "")):
        got = server.post("/keys/batch_allocate", {"rank": 0, "keys": [[key, named]]}).json()
        ((_, page),) = got["results"]
        body = {"rank": 0, "confirmations": [[key, page]], "pages_to_release": []}
        assert server.post("/keys/confirm_write", body).status_code == 204
    reply = server.post("/keys/get_locations", {"rank": 0, "keys": ["A", "B", "Z"]})
    return list(reply.json()["locations"])


def test_a_named_prefix_key_is_the_first_keys_parent(make_app: Callable[..., Server]) -> None:
    # Named, A has a stored child and B (the coldest leaf) goes; not named, A is the coldest
    # leaf and goes, and B is dead. Both dialects carry [key, prefix_key] pairs.
    for prefix, left in (("A", [True, False, True]), ("", [False, True, True])):
        server = make_app("--in-memory", "--read-lease", "0", "--eviction", "prefix")
        assert _sglang_named_parent(server, prefix) == left, prefix
        assert _dead_pages(server) == {NS: 0.0}  # a parent never told is not counted
        server = make_app("--in-memory", "--read-lease", "0", "--eviction", "prefix")
        pages = _vllm_named_parent(server, prefix)
        assert [page is not None for page in pages] == left, prefix


def test_a_named_prefix_key_changes_nothing_under_lru(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--read-lease", "0", "--eviction", "lru")
    assert _sglang_named_parent(server, "A") == [False, True, True]


def test_the_in_process_clients_evict_leaf_first_and_read_the_prefix_key() -> None:
    from kvmeta.errors import ConfigError
    from kvmeta.sglang import Hf3fsLocalMetadataClient as SglangLocal
    from kvmeta.vllm import Hf3fsLocalMetadataClient as VllmLocal

    for named, left in (("A", [True, False, True]), ("", [False, True, True])):
        sglang = SglangLocal(read_lease=0.0)  # leaf-first by default, as ``kvmeta serve``
        sglang.initialize(0, 3)
        vllm = VllmLocal(read_lease=0.0)
        vllm.initialize(0, 3)
        for key, prefix in (("A", ""), ("B", named), ("Z", ""), ("x", "")):
            ((_, page),) = sglang.reserve_and_allocate_page_indices(0, [(key, prefix)])
            sglang.confirm_write(0, [(key, page)], [])
            ((_, page),) = vllm.allocate_pages_for_keys(0, [(key, prefix)])
            vllm.confirm_write_for_keys(0, [(key, page)], [])
        assert sglang.exists(0, ["A", "B", "Z"]) == left, named
        pages = vllm.get_key_locations(0, ["A", "B", "Z"])
        assert [page is not None for page in pages] == left, named
    lru = SglangLocal(read_lease=0.0, eviction="lru")
    lru.initialize(0, 1)
    for key in ("A", "B"):
        ((_, page),) = lru.reserve_and_allocate_page_indices(0, [(key, "")])
        lru.confirm_write(0, [(key, page)], [])
    assert lru.exists(0, ["A", "B"]) == [False, True]
    try:
        SglangLocal(eviction="fifo")
    except ConfigError as exc:
        assert "eviction='fifo'" in str(exc) and "'lru' or 'prefix'" in str(exc)
    else:
        raise AssertionError("an unknown eviction policy was accepted")
