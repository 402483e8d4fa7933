"""A router's loop on a real ``kvmeta serve --hash-index --events``: it indexes the KV event
feed by block hash, then asks ``POST /v1/prefix_match`` with those very hashes, and the server
answers what it would for the page keys (SGLang's own hash function makes the hashes)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.compat.stock_clients import sglang_hash_function
from tests.events.events_support import observed_sglang_workload, rebuild
from tests.events.workloads import sglang_state
from tests.support import ServerProcess

EVENTS = ("--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0")


@pytest.fixture(params=["memory", "durable", pytest.param("redis", marks=pytest.mark.slow)])
def hash_server(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[ServerProcess]:
    where = {
        "memory": ["--in-memory"],
        "durable": ["--data-dir", str(tmp_path)],
        "redis": ["--backend", str(request.getfixturevalue("redis_url"))],
    }[request.param]
    server = ServerProcess(*where, "--read-lease", "0", "--hash-index", *EVENTS).start(timeout=60)
    yield server
    server.stop()


def _lengths(server: ServerProcess, pools: list[dict[str, Any]]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(pools), 1000):
        r = server.post("/v1/prefix_match", {"pools": pools[i : i + 1000]})
        assert r.status_code == 200, r.text
        out += [m["length"] for m in r.json()["matches"]]
    return out


def test_prefix_match_by_the_feeds_hashes_answers_as_by_keys(hash_server: ServerProcess) -> None:
    int64 = sglang_hash_function()
    hash_server.wait_for_log("hash index: on (--hash-index)", timeout=30)
    messages, used, prefix_of = observed_sglang_workload(hash_server, 11, 60)
    view = rebuild(messages)  # the router's index: pool -> hashes
    stored = sglang_state(hash_server.url, used)
    assert view.keys() == stored.keys() and stored

    for label, hashes in view.items():
        ns = label.split(":", 2)[2]
        # Every hash the router holds is stored, and one it does not hold ends the run.
        run = sorted(hashes)
        assert _lengths(hash_server, [{"rank": 0, "namespace": ns, "hashes": run}]) == [len(run)]
        absent = max(run) + 1 if max(run) < (1 << 63) - 1 else min(run) - 1
        probe = run[:3] + [absent] + run[3:]
        assert _lengths(hash_server, [{"rank": 0, "namespace": ns, "hashes": probe}]) == [
            min(3, len(run))
        ]
        # Key by key, over every key the workload used (stored, evicted, deleted, cleared).
        keys = sorted(set(used[ns]))
        single = [{"rank": 0, "namespace": ns, "hashes": [int64(k)]} for k in keys]
        found = _lengths(hash_server, single)
        assert {k for k, n in zip(keys, found, strict=True) if n} == stored[label]

        # Prefix chains (first page first), by keys and by hashes: the same answers.
        rng = random.Random(5)
        chains = []
        for key in rng.sample(keys, min(60, len(keys))):
            chain = [key]
            while (before := prefix_of[chain[-1]]) is not None:
                chain.append(before)
            chains.append(chain[::-1])
        by_keys = _lengths(hash_server, [{"rank": 0, "namespace": ns, "keys": c} for c in chains])
        by_hashes = _lengths(
            hash_server,
            [{"rank": 0, "namespace": ns, "hashes": [int64(k) for k in c]} for c in chains],
        )
        assert by_hashes == by_keys and any(by_keys)
