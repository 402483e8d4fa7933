"""The router routes alone (``server.prefix_routes``): shapes, limits and errors, no socket."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, NoHashIndex, NotInitialized, PayloadTooLarge
from kvmeta.events.wire import sglang_hash
from kvmeta.server import prefix_routes
from kvmeta.server.http import Request, Response
from kvmeta.service.limits import MAX_DUMP_LIMIT, RequestLimits
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore

S0 = PoolId("s", 0, "kv")
V1 = PoolId("v", 1, "")


def _service(max_keys: int = 65536) -> Service:
    svc = Service(LocalBackend(MemoryStore()), RequestLimits(max_keys=max_keys))
    store = svc.backend.store  # type: ignore[attr-defined]
    store.initialize(S0, 64)
    store.v_register(1, 64, None)
    for pool, keys in ((S0, ["a", "b", "c", "e"]), (V1, ["x", "y"])):
        pages = [p for _, p in store.reserve(pool, keys)]
        store.confirm(pool, list(zip(keys, pages, strict=True)), [])
    return svc


def _match(svc: Service, body: Any) -> Response:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    req = Request("POST", "/v1/prefix_match", "", raw, None)
    return asyncio.run(prefix_routes.prefix_match(svc, req, 0))


def _dump(svc: Service, query: str) -> Response:
    return asyncio.run(prefix_routes.dump(svc, Request("GET", "/v1/dump", query, b"", None), 0))


def _json(resp: Response) -> Any:
    return msgspec.json.decode(resp.body)


def test_prefix_match_answers_each_pool_in_order() -> None:
    svc = _service()
    body = {
        "pools": [
            {"rank": 0, "namespace": "kv", "keys": ["a", "b", "c", "d", "e"]},
            {"dialect": "vllm", "rank": 1, "keys": ["x", "y", "z"]},
            {"rank": 7, "keys": ["a"]},
            {"rank": 0, "namespace": "PoolName.KV", "keys": ["b"]},
        ]
    }
    resp = _match(svc, body)
    assert resp.status == 200
    assert _json(resp) == {
        "matches": [
            {"dialect": "sglang", "rank": 0, "namespace": "kv", "length": 3, "found": True},
            {"dialect": "vllm", "rank": 1, "namespace": "", "length": 2, "found": True},
            {"dialect": "sglang", "rank": 7, "namespace": "kv", "length": 0, "found": False},
            {"dialect": "sglang", "rank": 0, "namespace": "kv", "length": 1, "found": True},
        ]
    }


def test_prefix_match_changes_no_counter() -> None:
    svc = _service()
    before = [vars(p.counters).copy() for p in svc.backend.store.pools.values()]  # type: ignore[attr-defined]
    _match(svc, {"pools": [{"rank": 0, "keys": ["a", "b", "zz"]}]})
    after = [vars(p.counters) for p in svc.backend.store.pools.values()]  # type: ignore[attr-defined]
    assert before == after


def test_prefix_match_limits_name_the_field_and_the_fix() -> None:
    svc = _service(max_keys=4)
    with pytest.raises(PayloadTooLarge) as err:
        _match(svc, {"pools": [{"rank": 0, "keys": ["a"] * 3}, {"rank": 1, "keys": ["a"] * 2}]})
    assert err.value.field == "pools" and "--max-keys" in str(err.value)
    with pytest.raises(PayloadTooLarge) as err:
        _match(svc, {"pools": [{"rank": 0, "keys": []}] * 1025})
    assert err.value.field == "pools"
    with pytest.raises(InvalidRequest) as err:
        _match(svc, {"pools": [{"rank": 0, "keys": ["k" * 2000]}]})
    assert err.value.field == "pools[0].keys" and "--max-key-length" in str(err.value)


def test_prefix_match_refuses_bad_bodies_naming_the_field() -> None:
    svc = _service()
    with pytest.raises(InvalidRequest) as err:
        _match(svc, {"pools": [{"rank": 0, "keys": [], "namespce": "kv"}]})
    assert "namespce" in str(err.value)
    for bad in (
        b"{",
        b"[]",
        b'{"pools": 1}',
        b'{"pools": [{"dialect": "x", "rank": 0, "keys": []}]}',
        b'{"pools": [{"rank": 0, "hashes": ["a"]}]}',
    ):
        with pytest.raises(InvalidRequest):
            _match(svc, bad)


def _hash_service(max_keys: int = 24) -> tuple[Service, list[str]]:
    """A server with --hash-index: pool S0 stores four SHA-256 keys, V1 two keys."""
    svc = Service(LocalBackend(MemoryStore(hash_index=True)), RequestLimits(max_keys=max_keys))
    store = svc.backend.store  # type: ignore[attr-defined]
    store.initialize(S0, 64)
    store.v_register(1, 64, None)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4)]
    for pool, stored in ((S0, keys), (V1, ["x", "y"])):
        pages = [p for _, p in store.reserve(pool, stored)]
        store.confirm(pool, list(zip(stored, pages, strict=True)), [])
    return svc, keys


def test_prefix_match_by_hashes_reads_the_event_feeds_hashes() -> None:
    svc, keys = _hash_service()
    hashes = [sglang_hash(k) for k in keys]
    unsigned = [h % (1 << 64) for h in hashes]
    body = {
        "pools": [
            {"rank": 0, "namespace": "kv", "hashes": hashes},
            {"rank": 0, "namespace": "kv", "hashes": unsigned[:2] + [12345] + unsigned[2:]},
            {"rank": 0, "namespace": "kv", "keys": keys[:3]},
            {"rank": 3, "hashes": hashes},
        ]
    }
    lengths = [(m["length"], m["found"]) for m in _json(_match(svc, body))["matches"]]
    assert lengths == [(4, True), (2, True), (3, True), (0, False)]


def test_prefix_match_by_hashes_errors_name_the_field_and_the_fix() -> None:
    svc, keys = _hash_service()
    h = sglang_hash(keys[0])
    cases: dict[str, tuple[Any, str, str]] = {
        "neither": ({"rank": 0}, "pools[0].keys", "needs `keys`"),
        "both": ({"rank": 0, "keys": keys, "hashes": [h]}, "pools[0].hashes", "one of them"),
        "too big": ({"rank": 0, "hashes": [h, 1 << 64]}, "pools[0].hashes", "signed int64"),
        "too small": ({"rank": 0, "hashes": [-(1 << 63) - 1]}, "pools[0].hashes", "int64"),
        "vllm": ({"dialect": "vllm", "rank": 1, "hashes": [h]}, "hashes", "matched by `keys`"),
        "over --max-keys": ({"rank": 0, "hashes": [h] * 25}, "pools", "--max-keys"),
    }
    for name, (pool, field, words) in cases.items():
        with pytest.raises(InvalidRequest) as err:
            _match(svc, {"pools": [pool]})
        assert err.value.field == field and words in str(err.value), name
    with pytest.raises(InvalidRequest) as err:  # a server without --hash-index
        _match(_service(), {"pools": [{"rank": 0, "hashes": [h]}]})
    assert err.value.field == "hashes" and "--hash-index" in str(err.value)
    assert "send `keys`" in str(err.value)


def test_prefix_match_by_hashes_while_the_index_is_built_says_so() -> None:
    """A Redis pool whose index is being built (``NoHashIndex.building``): 400 naming
    ``hashes``, as for a pool without an index (a router falls back to `keys` for both)."""
    svc, keys = _hash_service()

    async def building(pool: PoolId, hashes: list[int]) -> int:
        raise NoHashIndex.building(pool.rank, pool.namespace)

    svc.backend.prefix_length_hashes = building  # type: ignore[method-assign]
    with pytest.raises(NoHashIndex) as err:
        _match(svc, {"pools": [{"rank": 0, "namespace": "kv", "hashes": [sglang_hash(keys[0])]}]})
    assert err.value.status == 400 and err.value.field == "hashes"
    assert "being built" in str(err.value) and "namespace 'kv'" in str(err.value)
    assert "send `keys`" in str(err.value)


def test_dump_walks_a_pool_in_pages() -> None:
    svc = _service()
    resp = _dump(svc, "rank=0&namespace=kv&limit=3")
    first = _json(resp)
    assert len(first["keys"]) == 3 and first["cursor"] != ""
    rest = _json(_dump(svc, f"rank=0&cursor={first['cursor']}&limit=3"))
    assert sorted(first["keys"] + rest["keys"]) == ["a", "b", "c", "e"] and rest["cursor"] == ""
    assert _json(_dump(svc, "rank=1&dialect=vllm")) == {"keys": ["x", "y"], "cursor": ""}


def test_dump_errors_name_the_parameter() -> None:
    svc = _service()
    with pytest.raises(NotInitialized):
        _dump(svc, "rank=5")
    cases = {
        "": "rank",
        "rank=abc": "rank",
        "rank=99999999999999999999": "rank",
        "rank=0&limit=0": "limit",
        f"rank=0&limit={MAX_DUMP_LIMIT + 1}": "limit",
        "rank=0&dialect=x": "dialect",
        "rank=0&cursor=zz": "cursor",
        "rank=0&rank=1": "rank",
    }
    for query, field in cases.items():
        with pytest.raises(InvalidRequest) as err:
            _dump(svc, query)
        assert err.value.field == field, query
    resp = _dump(svc, "rank=0&nmespace=kv")
    assert resp.status == 200 and any(b"nmespace" in v for _, v in resp.headers)
