"""``kvmeta serve --events``: every event decodes with the engines' released event classes, and
a subscriber that applies them holds exactly the pools' stored keys."""

from __future__ import annotations

import random
import types
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import requests

from tests.compat.stock_clients import load, load_events, sglang_hash_function
from tests.events.events_support import (
    Subscriber,
    complete,
    endpoints,
    events_server_process,
    hashed,
    observed_sglang_workload,
    rebuild,
)
from tests.events.workloads import page_key, sglang_state, vllm_workload
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def sglang_events() -> types.ModuleType:
    return load_events("sglang")


@pytest.fixture(scope="module")
def vllm_events() -> types.ModuleType:
    return load_events("vllm")


@pytest.fixture(scope="module")
def sglang_int64() -> Any:
    return sglang_hash_function()


@pytest.fixture
def events_server() -> Iterator[ServerProcess]:
    server = events_server_process()
    yield server
    server.stop()


def test_sglang_events_decode_with_both_engines_classes_and_rebuild_the_pools(
    events_server: ServerProcess,
    sglang_events: types.ModuleType,
    vllm_events: types.ModuleType,
    sglang_int64: Any,
) -> None:
    ends = endpoints(events_server)
    messages, used, prefix_of = observed_sglang_workload(events_server, 7, 60)
    reasons = set()
    chained = 0
    for topic, _, payload in messages:
        assert topic.decode() == ends.topic
        stock = msgspec.msgpack.decode(payload, type=sglang_events.KVEventBatch)
        # vLLM's classes read them too (its block hashes are ``bytes | int``).
        as_vllm = msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)
        assert [type(e).__name__ for e in as_vllm.events] == [
            type(e).__name__ for e in stock.events
        ]
        raw = msgspec.msgpack.decode(payload)[1]
        assert len(stock.events) == len(raw)
        for event, plain in zip(stock.events, raw, strict=True):
            if isinstance(event, sglang_events.AllBlocksCleared):
                reasons.add(plain["reason"])
                continue
            assert event.medium == "EXTERNAL"
            if isinstance(event, sglang_events.BlockRemoved):
                assert "keys" not in plain  # (a removal names blocks stored before)
                reasons.add(plain["reason"])
                continue
            keys = plain["keys"]
            # The engine's own 64-bit form of each page key.
            assert event.block_hashes == [sglang_int64(k) for k in keys]
            assert plain.get("parent_key") == prefix_of[keys[0]]
            want_parent = None if prefix_of[keys[0]] is None else sglang_int64(prefix_of[keys[0]])
            assert event.parent_block_hash == want_parent
            assert all(prefix_of[b] == a for a, b in zip(keys, keys[1:], strict=False))
            chained += len(keys) > 1
    assert reasons == {"restart-recovery", "capacity", "delete", "clear"}
    assert chained > 0
    assert rebuild(messages) == hashed(sglang_state(events_server.url, used))


def test_vllm_events_decode_with_vllms_classes_and_rebuild_the_rank_pools(
    events_server: ServerProcess, vllm_events: types.ModuleType
) -> None:
    ends = endpoints(events_server)
    sub = Subscriber(ends.pub).start()
    try:
        used = vllm_workload(events_server.url, random.Random(3), 40)
        requests.post(f"{events_server.url}/v1/vllm/ranks/1/remove", timeout=30)
        sub.wait_for(events_server)
    finally:
        sub.close()
    messages = complete(sub.messages, ends.replay)
    reasons = set()
    for _, _, payload in messages:
        batch = msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)
        raw = msgspec.msgpack.decode(payload)[1]
        for event, plain in zip(batch.events, raw, strict=True):
            if isinstance(event, vllm_events.AllBlocksCleared):
                reasons.add(plain["reason"])
                continue
            assert "keys" not in plain  # vLLM's block hashes are the keys' bytes
            assert {h.decode() for h in event.block_hashes} <= set(used)
            assert event.medium == "EXTERNAL"
            if isinstance(event, vllm_events.BlockRemoved):
                reasons.add(plain["reason"])
    assert reasons == {"restart-recovery", "capacity", "clear", "drop"}
    keys = sorted(set(used))
    found = load("vllm").Hf3fsGlobalMetadataClient(events_server.url).get_key_locations(0, keys)
    locations = {k for k, page in zip(keys, found, strict=True) if page is not None}
    assert rebuild(messages) == hashed({"v:0": locations})


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_without_keys_events_still_decode_and_rebuild_the_pools_by_hash(
    encoding: str,
    sglang_events: types.ModuleType,
    vllm_events: types.ModuleType,
    sglang_int64: Any,
) -> None:
    """``--events-keys off``: ``BlockStored`` lose kvmeta's ``keys`` field (an empty array in the
    positional form, whose fields have fixed places) and keep everything else: the engines'
    classes decode them, the hashes and parents are the same, and applying them rebuilds the
    pools."""
    server = ServerProcess(
        "--in-memory", "--read-lease", "0", "--events", "tcp://127.0.0.1:0",
        "--events-replay", "tcp://127.0.0.1:0", "--events-keys", "off",
        "--events-format", encoding,
    ).start()  # fmt: skip
    try:
        messages, used, prefix_of = observed_sglang_workload(server, 11, 40)
        state = sglang_state(server.url, used)
    finally:
        server.stop()
    by_hash = {sglang_int64(k): k for keys in used.values() for k in keys}
    stored = 0
    for _, _, payload in messages:
        if encoding == "map":  # (the current releases' classes read the map form)
            events = msgspec.msgpack.decode(payload, type=sglang_events.KVEventBatch).events
            msgspec.msgpack.decode(payload, type=vllm_events.KVEventBatch)
        else:
            events = msgspec.msgpack.decode(payload)[1]
        for event, plain in zip(events, msgspec.msgpack.decode(payload)[1], strict=True):
            if encoding == "map":
                if not isinstance(event, sglang_events.BlockStored):
                    continue
                assert "keys" not in plain
                hashes, parent_hash = event.block_hashes, event.parent_block_hash
            else:
                if plain[0] != "BlockStored":
                    continue
                assert len(plain) == 12 and plain[7] == []  # the keys' place, empty
                hashes, parent_hash = plain[1], plain[2]
            stored += 1
            parent = prefix_of[by_hash[hashes[0]]]
            assert parent_hash == (None if parent is None else sglang_int64(parent))
    assert stored > 0
    if encoding == "map":
        assert rebuild(messages) == hashed(state)


def test_array_format_puts_the_engines_fields_first(
    sglang_events: types.ModuleType, sglang_int64: Any
) -> None:
    server = ServerProcess(
        "--in-memory", "--events", "tcp://127.0.0.1:0", "--events-format", "array",
        "--events-replay", "tcp://127.0.0.1:0",
    ).start()  # fmt: skip
    try:
        ends = endpoints(server)
        sub = Subscriber(ends.pub).start()
        try:
            url = server.url
            requests.post(f"{url}/0/initialize", json={"num_pages": 4}, timeout=30)
            keys = [page_key(i) for i in range(3)]
            reply = requests.post(
                f"{url}/0/reserve_and_allocate_page_indices",
                json={"keys": [[keys[0], None], [keys[1], keys[0]], [keys[2], keys[1]]]},
                timeout=30,
            ).json()["indices"]
            pairs = [(k, p) for k, (_, p) in zip(keys, reply, strict=True)]
            requests.post(
                f"{url}/0/confirm_write", json={"written_keys_to_confirm": pairs}, timeout=30
            )
            requests.post(f"{url}/0/delete_keys", json={"keys": keys[:1]}, timeout=30)
            sub.wait_for(server)
            messages = complete(sub.messages, ends.replay)
        finally:
            sub.close()
    finally:
        server.stop()
    events = [e for _, seq, p in messages if seq > 0 for e in msgspec.msgpack.decode(p)[1]]
    stored, removed = events
    shared = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
    assert sglang_events.BlockStored.__struct_fields__[:6] == shared
    assert stored[0] == "BlockStored"
    fields = dict(zip(shared, stored[1:7], strict=True))
    assert fields["block_hashes"] == [sglang_int64(k) for k in keys]
    assert fields["parent_block_hash"] is None and fields["token_ids"] == []
    assert stored[6] == "EXTERNAL" and stored[7] == keys and stored[8] == "s:0:kv"
    assert removed[0] == "BlockRemoved" and removed[2] == "EXTERNAL" and removed[3] == "s:0:kv"
    assert removed[1] == [sglang_int64(keys[0])]
