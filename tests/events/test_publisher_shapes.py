"""The publisher's events for every shape of reserve and confirm, against a plain model.

The publisher encodes each change at once, keeps chain-shaped reserves as one entry and makes
SGLang hashes without Python ints; a subscriber must not be able to tell: the events (kinds,
order, pools, hashes, runs and their parents) must equal what a per-key model of the rules in
``kvmeta.events.publisher`` gives, for chains, subsets, reorders, repeats, several pools in one
batch, clears in the middle of a batch, and keys that are not hex.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.events.publisher import Publisher
from kvmeta.events.wire import (
    hash_array,
    hash_body,
    pool_label,
    sglang_hash,
    sglang_hashes,
)
from kvmeta.store.changes import (
    CLEARED,
    REASON_CAPACITY,
    REASON_CLEAR,
    REASON_DELETE,
    REMOVED,
    STORED,
    Change,
)

ODD_KEYS = [
    "a" * 63,
    "b" * 65,
    "0123456789ABCDEFxyz",  # hex head, anything after
    "ffffffffffffffff",  # exactly 16 digits, the top of the unsigned range
    "8000000000000000" + "0" * 48,  # the signed minimum
    "0x" + "1" * 62,  # int() accepts the prefix, a strict decoder does not
    " " + "a" * 63,  # int() strips spaces
    "1_2" + "3" * 61,  # int() accepts separators
    "é" * 64,  # not ASCII
    "short",
    "",
    "g" * 64,  # not hex at all
]


def test_hashes_of_keys_whose_lengths_differ_but_total_64_each() -> None:
    """A 63- and a 65-character key add up to 128: the whole-string fast path must not
    read the second key's head one character late."""
    keys = ["a" * 63, "0123456789abcdef" * 4 + "0"]
    assert sglang_hashes(keys) == [sglang_hash(k) for k in keys]


@pytest.mark.parametrize("key", ODD_KEYS)
def test_hash_arrays_are_the_per_key_hashes_or_none(key: str) -> None:
    """The one-step array (header and hashes from one hex decode) says what ``sglang_hash``
    says of each key, or None when a key's head is not 16 hex digits."""
    good = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(3)]
    for keys in ([key], [*good, key], [key, *good], good):
        raw = raw_hash_array(keys)
        if raw is not None:
            assert msgspec.msgpack.decode(raw) == [sglang_hash(k) for k in keys]
        else:
            assert any(len(k) < 16 or not _strict_hex(k[:16]) for k in keys)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 64, 1024, 1025, 65535, 65536])
def test_hash_array_headers(n: int) -> None:
    keys = [f"{i:016x}" + "0" * 48 for i in range(n)]
    raw = raw_hash_array(keys)
    assert raw is not None
    assert msgspec.msgpack.decode(raw) == list(range(n))
    assert sglang_hashes(keys) == list(range(n))
    assert raw_hash_array(keys[1:]) is not None  # (a cached format of another length)


def raw_hash_array(keys: Sequence[str]) -> bytes | None:
    """The msgpack array of the keys' SGLang hashes, as the publisher embeds it."""
    body = hash_body(keys)
    return None if body is None else bytes(hash_array(len(keys), body))


def _strict_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


# ---------------------------------------------------------------------- the model


class Model:
    """The publisher's rules, per key: each reserve notes every key's prefix (the newest
    note wins), a confirm takes its keys' notes and is cut into runs where a key's prefix is
    not the key before it; a clear forgets the pool's notes."""

    def __init__(self) -> None:
        self.prefixes: dict[PoolId, dict[str, str | None]] = {}
        self.events: list[tuple[Any, ...]] = []

    def note(self, pool: PoolId, pairs: list[tuple[str, str | None]]) -> None:
        self.prefixes.setdefault(pool, {}).update(pairs)

    def change(self, change: Change) -> None:
        pool, kind, keys, reason = change
        label = pool_label(pool)
        if kind == CLEARED:
            self.prefixes.pop(pool, None)
            self.events.append(("AllBlocksCleared", label, reason))
            return
        if pool.dialect != "s":
            hashes = [k.encode() for k in keys]
            tag = "BlockStored" if kind == STORED else "BlockRemoved"
            self.events.append((tag, label, hashes, None, [], None, reason))
            return
        if kind == REMOVED:
            self.events.append(
                ("BlockRemoved", label, [sglang_hash(k) for k in keys], None, [], None, reason)
            )
            return
        known = self.prefixes.get(pool, {})
        parents = [known.pop(k, None) for k in keys]
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or parents[i] is None or parents[i] != keys[i - 1]:
                run = list(keys[start:i])
                parent = parents[start]
                self.events.append(
                    (
                        "BlockStored",
                        label,
                        [sglang_hash(k) for k in run],
                        None if parent is None else sglang_hash(parent),
                        run,
                        parent,
                        "",
                    )
                )
                start = i


def make_publisher(**options: Any) -> Publisher:
    """A publisher whose every batch stays readable here: its replay buffer (kept only with a
    replay socket) large enough for a whole test."""
    return Publisher(
        "tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        buffer=1_000_000,
        buffer_bytes=1 << 40,
        **options,
    )


def published(pub: Publisher) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    assert pub.buffer is not None
    for _, _, payload in pub.buffer:
        _, events = msgspec.msgpack.decode(payload)
        for e in events:
            if isinstance(e, list):  # the positional form (``wire.Array*`` field order)
                e = _as_map(e)
            if e["type"] == "AllBlocksCleared":
                out.append((e["type"], e.get("pool", ""), e.get("reason", "")))
                continue
            out.append(
                (
                    e["type"],
                    e["pool"],
                    e["block_hashes"],
                    e.get("parent_block_hash"),
                    list(e.get("keys", [])),
                    e.get("parent_key"),
                    e.get("reason", ""),
                )
            )
    return out


_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "keys", "pool", "parent_key", "reason", "tenant"),
    "BlockRemoved": ("block_hashes", "medium", "pool", "reason", "tenant"),
    "AllBlocksCleared": ("medium", "pool", "reason", "tenant"),
}  # fmt: skip


def _as_map(event: list[Any]) -> dict[str, Any]:
    fields = _POSITIONAL[event[0]]
    assert len(event) == 1 + len(fields)
    return {"type": event[0], **dict(zip(fields, event[1:], strict=True))}


def key_of(i: int) -> str:
    return hashlib.sha256(f"k{i}".encode()).hexdigest()


def workload(rng: random.Random, pools: list[PoolId], steps: int) -> list[tuple[str, Any]]:
    """Reserves ("note") and changes as SGLang and the store would make them: each key has
    one prefix for good (its chain), chains are reserved whole or in part, confirmed whole,
    in part, reordered or with repeats, sometimes twice noted, sometimes never confirmed;
    removals (of what a confirm stored, whole, reordered or in part, and of any keys), clears,
    vLLM pools and non-hex keys mixed into the same batches."""
    ops: list[tuple[str, Any]] = []
    prefix_of: dict[str, str | None] = {}
    confirmed: list[tuple[str, ...]] = []  # (pools apart or not: a hash is the key's alone)
    n = 0
    for _ in range(steps):
        pool = rng.choice(pools)
        roll = rng.random()
        if pool.dialect == "v":
            keys = tuple(key_of(n + i) for i in range(rng.randint(1, 5)))
            n += len(keys)
            kind = STORED if roll < 0.6 else REMOVED
            reason = "" if kind == STORED else REASON_DELETE
            ops.append(("change", Change(pool, kind, keys, reason)))
            continue
        if roll < 0.05:
            ops.append(("change", Change(pool, CLEARED, (), REASON_CLEAR)))
            continue
        if roll < 0.15:
            keys = tuple(rng.choice(list(prefix_of) or [key_of(0)]) for _ in range(3))
            ops.append(("change", Change(pool, REMOVED, keys, REASON_CAPACITY)))
            continue
        if roll < 0.2 and len(confirmed) >= 2:  # evictions that do not line up with confirms
            first, second = confirmed.pop(0), confirmed[0]
            cut, into = rng.randint(1, len(first)), rng.randint(0, len(second))
            ops.append(("change", Change(pool, REMOVED, first[:cut], REASON_CAPACITY)))
            if cut < len(first) or into:
                removed = first[cut:] + second[:into]
                ops.append(("change", Change(pool, REMOVED, removed, REASON_CAPACITY)))
            confirmed[0] = second[into:]
            if not confirmed[0]:
                confirmed.pop(0)
            continue
        if roll < 0.25 and confirmed:  # an eviction of what one confirm stored
            keys = confirmed.pop(rng.randrange(len(confirmed)))
            how = rng.random()
            if how < 0.15:
                keys = keys[::-1]  # in another order
            elif how < 0.3:
                keys = keys[: max(1, len(keys) // 2)]  # in part
            ops.append(("change", Change(pool, REMOVED, keys, REASON_CAPACITY)))
            continue
        # a chain, continuing an earlier key sometimes
        prev: str | None = rng.choice(list(prefix_of)) if prefix_of and rng.random() < 0.3 else None
        chain: list[str] = []
        for _ in range(rng.randint(1, 8)):
            key = key_of(n) if rng.random() < 0.95 else rng.choice(ODD_KEYS[:8]) + str(n)
            n += 1
            prefix_of.setdefault(key, prev)
            chain.append(key)
            prev = key
        pairs = [(k, prefix_of[k]) for k in chain]
        shape = rng.random()
        if shape < 0.1:  # keys of other chains in the same reserve: not a chain
            pairs += [(k, prefix_of[k]) for k in rng.sample(list(prefix_of), 2)]
        ops.append(("note", (pool, pairs)))
        if shape < 0.15:
            ops.append(("note", (pool, list(pairs))))  # noted twice
        keys = [k for k, _ in pairs]
        confirm = rng.random()
        if confirm < 0.55:
            out = keys
        elif confirm < 0.7:
            out = keys[rng.randint(1, len(keys)) :]  # leading hits left out
        elif confirm < 0.8:
            out = rng.sample(keys, len(keys))  # another order
        elif confirm < 0.85:
            out = keys + keys[:1]  # a repeat
        elif confirm < 0.9:
            out = keys[: len(keys) // 2]
        else:
            out = []  # never confirmed (lease expired)
        if out:
            ops.append(("change", Change(pool, STORED, tuple(out))))
            confirmed.append(tuple(out))
        if rng.random() < 0.2:
            ops.append(("flush", None))
    return ops


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("seed", range(6))
def test_events_equal_the_per_key_model(seed: int, encoding: str) -> None:
    rng = random.Random(seed)
    pools = [PoolId("s", 0, "kv"), PoolId("s", 0, "mamba"), PoolId("s", 1, "kv")]
    pools.append(PoolId("v", 2, ""))
    pub = make_publisher(encoding=encoding)
    model = Model()
    try:
        for op, arg in workload(rng, pools, 400):
            if op == "note":
                pub.note_reserve(*arg)
                model.note(*arg)
            elif op == "change":
                pub.on_changes([arg])
                model.change(arg)
            else:
                pub.flush()
        pub.flush()
        got = published(pub)
    finally:
        pub.close()
    assert got == model.events


def test_clear_in_the_middle_of_a_batch_keeps_the_order_and_forgets_the_notes() -> None:
    pool, other = PoolId("s", 0, "kv"), PoolId("s", 0, "mamba")
    a, b, c = key_of(1), key_of(2), key_of(3)
    pub = make_publisher()
    try:
        pub.note_reserve(pool, [(a, None), (b, a)])
        pub.note_reserve(other, [(a, None), (b, a)])
        pub.on_changes([Change(pool, REMOVED, (c,), REASON_CAPACITY)])
        pub.on_changes([Change(pool, CLEARED, (), REASON_CLEAR)])
        pub.on_changes([Change(pool, STORED, (a, b))])  # its note went with the clear
        pub.on_changes([Change(other, STORED, (a, b))])  # the other pool's note still holds
        pub.flush()
        got = published(pub)
    finally:
        pub.close()
    assert len(pub.buffer) == 1  # one batch
    assert [(e[0], e[1]) for e in got] == [
        ("BlockRemoved", "s:0:kv"),
        ("AllBlocksCleared", "s:0:kv"),
        ("BlockStored", "s:0:kv"),
        ("BlockStored", "s:0:kv"),
        ("BlockStored", "s:0:mamba"),
    ]
    assert [e[5] for e in got[2:]] == [None, None, None]  # no notes: one run per key
    assert got[4][4] == [a, b]


def test_a_chain_noted_again_with_the_same_first_key_names_the_newest_parent() -> None:
    pool = PoolId("s", 0, "kv")
    a, b, c, x = key_of(1), key_of(2), key_of(3), key_of(4)
    pub = make_publisher()
    try:
        pub.note_reserve(pool, [(b, a), (c, b)])
        pub.note_reserve(pool, [(b, x), (c, b)])
        pub.on_changes([Change(pool, STORED, (b, c))])
        pub.note_reserve(pool, [(b, a), (c, b)])
        pub.on_changes([Change(pool, STORED, (c,))])  # not the kept chain: per key
        pub.on_changes([Change(pool, STORED, (b,))])
        pub.flush()
        got = published(pub)
    finally:
        pub.close()
    assert [(e[4], e[5]) for e in got] == [([b, c], x), ([c], b), ([b], a)]


def note_chain(pub: Publisher, pool: PoolId, run: tuple[str, ...]) -> None:
    """The reserve of ``run`` as one chain (each key's prefix the key before it)."""
    pub.note_reserve(pool, [(k, p) for k, p in zip(run, (None, *run[:-1]), strict=True)])


def removals_of(pub: Publisher) -> list[Any]:
    """The hashes of every ``BlockRemoved`` published so far, in order."""
    pub.flush()
    return [e[2] for e in published(pub) if e[0] == "BlockRemoved"]


def test_an_eviction_carries_its_keys_hashes_whatever_the_confirms_were() -> None:
    """An eviction of one confirm's keys, in its order or not, after a clear or not: its
    ``BlockRemoved`` carries each key's SGLang hash, in the eviction's order."""
    pool = PoolId("s", 0, "kv")
    run = tuple(key_of(i) for i in range(8))
    pub = make_publisher()
    try:
        note_chain(pub, pool, run)
        pub.on_changes([Change(pool, STORED, run), Change(pool, REMOVED, run, REASON_CAPACITY)])
        pub.on_changes([Change(pool, STORED, run)])
        pub.on_changes([Change(pool, REMOVED, run[::-1], REASON_CAPACITY)])
        pub.on_changes([Change(pool, STORED, run), Change(pool, CLEARED, (), REASON_CLEAR)])
        pub.on_changes([Change(pool, STORED, run), Change(pool, REMOVED, run, REASON_CAPACITY)])
        removed = removals_of(pub)
    finally:
        pub.close()
    assert removed == [sglang_hashes(run), sglang_hashes(run[::-1]), sglang_hashes(run)]


def test_evictions_that_cut_across_confirms_carry_their_keys_hashes() -> None:
    """A data directory evicts ahead of need by the pages it lacks, so its evictions take the
    end of one confirm and the start of the next: each eviction's hashes are its keys'."""
    pool = PoolId("s", 0, "kv")
    runs = [tuple(key_of(100 * r + i) for i in range(64)) for r in range(6)]
    pub = make_publisher()
    try:
        for run in runs:
            note_chain(pub, pool, run)
            pub.on_changes([Change(pool, STORED, run)])
        lru = [key for run in runs for key in run]
        sizes = [100, 64, 64, 1, 127, 28]  # the first one: what the spare lacked at first
        removals = []
        for size in sizes:
            removals.append(tuple(lru[:size]))
            lru = lru[size:]
            pub.on_changes([Change(pool, REMOVED, removals[-1], REASON_CAPACITY)])
        assert not lru
        removed = removals_of(pub)
    finally:
        pub.close()
    assert removed == [sglang_hashes(keys) for keys in removals]


def test_removals_in_other_groupings_than_the_confirms_carry_their_keys_hashes() -> None:
    """Removals that take part of a confirm, run past it into a short one, skip keys, or
    come in a different grouping than the stores: each carries its own keys' hashes."""
    pool = PoolId("s", 0, "kv")
    a = tuple(key_of(i) for i in range(16))
    short = tuple(key_of(50 + i) for i in range(3))
    b = tuple(key_of(100 + i) for i in range(16))
    c = tuple(key_of(200 + i) for i in range(8))
    d = tuple(key_of(300 + i) for i in range(8))
    runs = [tuple(key_of(1000 + 100 * r + i) for i in range(8)) for r in range(40)]
    pub = make_publisher()
    try:
        for run in (a, short, b, c, d, *runs):
            note_chain(pub, pool, run)
            pub.on_changes([Change(pool, STORED, run)])
        asked = [a[:10], a[10:] + short, b[:4], b[8:], c[4:] + d[:4], c[:4], *runs]
        for keys in asked:
            reason = REASON_DELETE if keys in (b[:4], b[8:]) else REASON_CAPACITY
            pub.on_changes([Change(pool, REMOVED, keys, reason)])
        removed = removals_of(pub)
    finally:
        pub.close()
    assert removed == [sglang_hashes(keys) for keys in asked]
