"""The engine cycle directly on ``core.pool.Pool`` and ``MemoryStore``: no HTTP, no JSON.

Key-ops per second counts every key of every call (exists, reserve, confirm, get), as the HTTP
benchmark does. Memory per stored key is measured with tracemalloc over a pool filled with
64-hex-character keys: everything the pool allocates for it, the key string included.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
import tracemalloc
from typing import Any

import msgspec

from kvmeta._types import PoolId
from kvmeta.core.hash_index import HashIndex
from kvmeta.core.pool import Pool
from kvmeta.store.disk.memory import MemoryStore

__all__ = ["app_caller", "format_report", "memory_per_key", "run", "sglang_script"]


def _keys(n: int, seed: str) -> list[str]:
    last = hashlib.sha256(seed.encode()).digest()
    out = []
    for _ in range(n):
        last = hashlib.sha256(last).digest()
        out.append(last.hex())
    return out


def _pool_cycle(pool: Pool, batches: list[list[str]], clock: list[float]) -> int:
    ops = 0
    for keys in batches:
        now = clock[0] = clock[0] + 1e-4
        pool.exists(keys)
        evicted: list[tuple[str, int]] = []
        indices = pool.reserve(keys, now, evicted)
        pairs = [(k, p) for k, (hit, p) in zip(keys, indices, strict=True) if not hit and p >= 0]
        pool.confirm(pairs, [], now)
        pool.get(keys, now)
        ops += 4 * len(keys)
    return ops


def _store_cycle(store: MemoryStore, pid: PoolId, batches: list[list[str]]) -> int:
    ops = 0
    for keys in batches:
        store.exists(pid, keys)
        indices = store.reserve(pid, keys)
        pairs = [(k, p) for k, (hit, p) in zip(keys, indices, strict=True) if not hit and p >= 0]
        store.confirm(pid, pairs, [])
        store.get(pid, keys)
        ops += 4 * len(keys)
    return ops


def _fill(pool: Pool, keys: list[str], now: float) -> None:
    """Reserve and confirm ``keys`` as the wire does: each request body is decoded apart, so
    the reserve and the confirm bring their own string objects for the same keys."""
    step = 8192
    for i in range(0, len(keys), step):
        chunk = [k.encode().decode() for k in keys[i : i + step]]  # the reserve body's
        evicted: list[tuple[str, int]] = []
        indices = pool.reserve(chunk, now, evicted)
        written = [(k.encode().decode(), p) for k, (_, p) in zip(chunk, indices, strict=True)]
        pool.confirm(written, [], now)


def key_ops_per_s(batch: int, pool_pages: int, cycles: int, layer: str) -> float:
    """Best of five timed passes of ``cycles`` cycles on a prefilled pool (so every reserve
    evicts); read leases are off, as in the HTTP benchmark."""
    best = 0.0
    for rep in range(5):
        batches = [_keys(batch, f"{rep}-{i}") for i in range(cycles)]
        if layer == "pool":
            pool = Pool(pool_pages, read_lease=0.0)
            _fill(pool, _keys(pool_pages, f"fill-{rep}"), 0.0)
            clock = [1.0]
            t0 = time.process_time()
            ops = _pool_cycle(pool, batches, clock)
        else:
            store = MemoryStore(read_lease=0.0)
            pid = PoolId("s", 0, "kv")
            store.initialize(pid, pool_pages)
            _fill(store.pools[pid], _keys(pool_pages, f"fill-{rep}"), time.monotonic())
            t0 = time.process_time()
            ops = _store_cycle(store, pid, batches)
        best = max(best, ops / (time.process_time() - t0))
    return best


def app_caller(auth_token: str | None = None) -> Any:
    """A fresh in-memory app (default limits, read leases off; requiring ``auth_token`` when
    given, and sending it) and a function that runs one request through it to the response
    bytes, exactly as ``server.http`` does, minus sockets."""
    from kvmeta.config import Settings
    from kvmeta.server.http import Request, render
    from kvmeta.server.runner import build_app, build_backend
    from kvmeta.service.ops import Service

    settings = Settings(in_memory=True, read_lease=0.0, auth_token=auth_token)
    app = build_app(settings, Service(build_backend(settings)))
    auth = f"Bearer {auth_token}".encode() if auth_token else None

    def call(path: str, body: bytes) -> bytes:
        coro = app(Request("POST", path, "", body, auth))
        try:
            coro.send(None)
        except StopIteration as stop:
            return render(stop.value, True)
        raise RuntimeError(f"{path} suspended: the in-memory app should never wait")

    return call


def app_us_per_request(
    batch: int, pool_pages: int, cycles: int, auth_token: str | None = None
) -> float:
    """Server-side CPU per request of the S cycle without the socket layer: routing, JSON
    decoding, limits, service, store, pool, encoding and rendering. Request bodies are recorded
    on one app and replayed on a second, identically prefilled one, so only server work is
    timed (the pool is deterministic when leases are off). Best of three passes."""
    script, setup = sglang_script(batch, pool_pages, 3 * cycles, "app", auth_token=auth_token)
    replay = app_caller(auth_token)
    for path, body in script[:setup]:
        replay(path, body)
    best = float("inf")
    per_pass = 4 * cycles
    for n in range(3):
        part = script[setup + n * per_pass : setup + (n + 1) * per_pass]
        t0 = time.process_time()
        for path, body in part:
            replay(path, body)
        best = min(best, (time.process_time() - t0) / per_pass)
    return best * 1e6


def sglang_script(
    batch: int,
    pool_pages: int,
    cycles: int,
    seed: str,
    *,
    chains: bool = False,
    auth_token: str | None = None,
) -> tuple[list[tuple[str, bytes]], int]:
    """The SGLang engine's requests on rank 0's ``kv`` pool: initialize and fill it (the
    first ``setup`` requests), then ``cycles`` cycles of exists, reserve, confirm, get of
    ``batch`` new keys each (every reserve evicts ``batch`` keys). Recorded on a fresh app, so
    each confirm names the pages its reserve got; replayed on another fresh app, the same
    requests get the same replies (the pool is deterministic with read leases off).
    ``chains``: each reserved key names the key before it as its prefix (as SGLang sends a
    sequence's pages); otherwise no prefix. Returns ``(script, setup)``."""
    enc = msgspec.json.encode
    dec = msgspec.json.decode
    recorder = app_caller(auth_token)

    def pairs(keys: list[str]) -> list[list[str | None]]:
        if not chains:
            return [[k, None] for k in keys]
        return [[k, p] for k, p in zip(keys, [None, *keys[:-1]], strict=True)]

    script: list[tuple[str, bytes]] = [("/0/initialize", enc({"num_pages": pool_pages}))]
    recorder(*script[0])
    fill = _keys(pool_pages, f"{seed}-fill")
    for i in range(0, pool_pages, 8192):
        chunk = fill[i : i + 8192]
        body = enc({"keys": pairs(chunk)})
        script.append(("/0/reserve_and_allocate_page_indices", body))
        reply = dec(recorder(script[-1][0], body).split(b"\r\n\r\n", 1)[1])
        written = [[k, p] for k, (_, p) in zip(chunk, reply["indices"], strict=True)]
        script.append(("/0/confirm_write", enc({"written_keys_to_confirm": written})))
        recorder(*script[-1])
    setup = len(script)
    for i in range(cycles):
        keys = _keys(batch, f"{seed}-{i}")
        script.append(("/0/exists", enc({"keys": keys})))
        recorder(*script[-1])
        body = enc({"keys": pairs(keys)})
        script.append(("/0/reserve_and_allocate_page_indices", body))
        reply = dec(recorder(script[-1][0], body).split(b"\r\n\r\n", 1)[1])
        written = [[k, p] for k, (hit, p) in zip(keys, reply["indices"], strict=True) if not hit]
        script.append(("/0/confirm_write", enc({"written_keys_to_confirm": written})))
        recorder(*script[-1])
        script.append(("/0/get_page_indices", enc({"keys": keys})))
        recorder(*script[-1])
    return script, setup


def memory_per_key(n: int = 200_000) -> dict[str, float]:
    """Traced bytes of a full pool of ``n`` pages divided by ``n`` (keys created inside).

    Filled as the wire fills it (``_fill``), so a pool that kept the confirm's copy of a key
    besides the reserve's would show it here."""
    keys = _keys(n, "memory")
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        pool = Pool(n, read_lease=0.0)
        empty = tracemalloc.get_traced_memory()[0] - base
        _fill(pool, keys, 0.0)
        gc.collect()
        full = tracemalloc.get_traced_memory()[0] - base
        index = HashIndex(pool.stored_keys())  # what --hash-index adds
        indexed = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert pool.stored_count == n and len(index) == n
    return {
        "pages": n,
        "bytes_per_stored_key": full / n,
        "bytes_per_page_empty": empty / n,
        "hash_index_bytes_per_key": (indexed - full) / n,
        "key_str_bytes": 49 + 64,
    }


def run(
    batch: int = 64, pool_pages: int = 65536, out: str | None = None, auth_token: str | None = None
) -> dict[str, Any]:
    cycles = 2000
    result: dict[str, Any] = {
        "batch": batch,
        "pool_pages": pool_pages,
        "cycles": cycles,
        "pool_key_ops_per_s": key_ops_per_s(batch, pool_pages, cycles, "pool"),
        "store_key_ops_per_s": key_ops_per_s(batch, pool_pages, cycles, "store"),
        "app_us_per_request": app_us_per_request(batch, pool_pages, 1000, auth_token),
        "app_auth_token": auth_token is not None,
        "memory": memory_per_key(),
        "targets": {"key_ops_per_s": 1_000_000, "bytes_per_stored_key": 230},
    }
    if out:
        with open(out + ".json", "w") as fh:
            json.dump(result, fh, indent=2, sort_keys=True)
    return result


def format_report(result: dict[str, Any]) -> str:
    mem = result["memory"]
    return "\n".join(
        [
            f"core cycle, batch {result['batch']}, pool {result['pool_pages']} pages (full):",
            f"  Pool        {result['pool_key_ops_per_s']:>12,.0f} key-ops/s",
            f"  MemoryStore {result['store_key_ops_per_s']:>12,.0f} key-ops/s "
            "(target >= 1,000,000)",
            f"  app         {result['app_us_per_request']:>12.1f} us CPU per request "
            "(HTTP layer excluded"
            + ("; with the --auth-token check)" if result.get("app_auth_token") else ")"),
            f"  memory      {mem['bytes_per_stored_key']:>12.1f} bytes per stored key "
            f"(64-hex key, structures included; target <= 230)",
            f"  hash index  {mem['hash_index_bytes_per_key']:>12.1f} bytes per stored key more "
            "(--hash-index)",
        ]
    )
