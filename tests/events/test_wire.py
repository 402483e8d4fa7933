"""The SGLang block hash of a page key equals SGLang's own (released) conversion."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvmeta.events.wire import sglang_hash
from tests.compat.stock_clients import sglang_hash_function

KEYS = [
    hashlib.sha256(b"x").hexdigest(),
    "0" * 64,
    "f" * 64,
    "7fffffffffffffff" + "0" * 48,
    "8000000000000000" + "0" * 48,
    "ABCDEF0123456789abcdef",
    "a",
    "0x1234",
    "  ab",
    "-1",
    "+ff",
    "1_2_3",
    "deadbeef" * 8,
]


@pytest.fixture(scope="module")
def engine_hash() -> Any:
    return sglang_hash_function()


@pytest.mark.parametrize("key", KEYS)
def test_same_as_sglang(engine_hash: Any, key: str) -> None:
    assert sglang_hash(key) == engine_hash(key)
    assert -(1 << 63) <= sglang_hash(key) < 1 << 63


@pytest.mark.parametrize("key", ["", "hello", "page-7", "g" * 16, "кл", "12 34"])
def test_keys_sglang_cannot_convert_still_get_a_stable_int64(engine_hash: Any, key: str) -> None:
    with pytest.raises(ValueError):
        engine_hash(key)
    value = sglang_hash(key)
    assert value == sglang_hash(key) and -(1 << 63) <= value < 1 << 63


def test_batch_form_equals_the_per_key_form(engine_hash: Any) -> None:
    from kvmeta.events.wire import sglang_hashes

    hexes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(200)]
    assert sglang_hashes(hexes) == [engine_hash(k) for k in hexes]
    for odd in KEYS:  # any odd key in a batch: still SGLang's value for every key
        batch = [*hexes[:3], odd, *hexes[3:6]]
        assert sglang_hashes(batch) == [engine_hash(k) for k in batch]
    assert sglang_hashes(["0123456789abcde f" + "0" * 8]) == [sglang_hash("0123456789abcde f")]
    assert sglang_hashes([]) == []
    # 64-character keys that are not all hex, or hex only in their head, or spaced.
    head = hexes[0][:16]
    odd64 = [head + "z" * 48, head + " " * 48, "0x" + hexes[1][:62], hexes[2].upper()]
    for batch in ([*hexes[:4], odd] for odd in odd64):
        assert sglang_hashes(batch) == [sglang_hash(k) for k in batch]
