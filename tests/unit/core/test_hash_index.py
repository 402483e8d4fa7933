"""``core.hash_index``: the block hashes of a pool's stored keys, exact under shared heads."""

from __future__ import annotations

import hashlib
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmeta.core.hash_index import HashIndex, hash_field, head_hashes
from kvmeta.events.wire import sglang_hash

SHA = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]


def test_a_hex_head_hashes_as_sglang_hashes_it() -> None:
    assert head_hashes(SHA) == [sglang_hash(k) for k in SHA]
    upper = [k.upper() for k in SHA[:20]]
    assert head_hashes(upper) == [sglang_hash(k) for k in SHA[:20]]
    assert hash_field(sglang_hash(SHA[0])) == SHA[0][:16]
    assert hash_field(-1) == "f" * 16 and hash_field(5) == "0000000000000005"


def test_keys_without_a_hex_head_have_no_hash_and_keep_the_others_in_order() -> None:
    odd = ["short", "0x123456789abcdef0", " 0123456789abcdef", "-123456789abcdef0", "é" * 16]
    mixed = [SHA[0], *odd, SHA[1], "0123456789abcdefG"]
    assert head_hashes(mixed) == [sglang_hash(SHA[0]), sglang_hash(SHA[1]), 0x0123456789ABCDEF]
    assert head_hashes(odd) == [] and head_hashes([]) == []


def test_a_shared_head_stays_present_while_one_holder_is_stored() -> None:
    a, b = "0123456789abcdef-a", "0123456789ABCDEF-b"
    index = HashIndex([a, SHA[0]])
    index.add([b])
    h = 0x0123456789ABCDEF
    assert index.counts() == {h: 2, sglang_hash(SHA[0]): 1} and len(index) == 3
    index.remove([a])
    assert index.leading([h, sglang_hash(SHA[0])]) == 2
    index.remove([b])
    assert index.leading([h]) == 0 and index.leading([sglang_hash(SHA[0])]) == 1


def test_leading_stops_at_the_first_miss() -> None:
    index = HashIndex(SHA[:10])
    hashes = head_hashes(SHA[:12])
    assert index.leading(hashes) == 10
    assert index.leading(hashes[:3] + [hashes[11]] + hashes[3:6]) == 3
    assert index.leading([]) == 0
    index.clear()
    assert index.leading(hashes) == 0 and len(index) == 0


# Keys with few distinct heads, so batches often share one; and keys with no head at all.
HEADS = ["0123456789abcdef", "0123456789ABCDEF", "fedcba9876543210", SHA[0][:16], SHA[1][:16]]
KEYS = st.one_of(
    st.builds(lambda h, s: h + s, st.sampled_from(HEADS), st.sampled_from(["", "x", "y", "zz"])),
    st.sampled_from(["nohead", "0x0123456789abcd", "g123456789abcdef"]),
    st.sampled_from(SHA[:20]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(KEYS, max_size=8, unique=True)), max_size=30))
def test_the_index_counts_exactly_the_stored_keys_heads(
    steps: list[tuple[bool, list[str]]],
) -> None:
    index = HashIndex()
    stored: set[str] = set()
    for adding, keys in steps:
        if adding:
            batch = [k for k in keys if k not in stored]
            index.add(batch)
            stored.update(batch)
        else:
            batch = [k for k in keys if k in stored]
            index.remove(batch)
            stored.difference_update(batch)
        expected = Counter(sglang_hash(k) for k in stored if head_hashes([k]))
        assert index.counts() == dict(expected)
        assert len(index) == sum(expected.values())
        probe = [sglang_hash(k) for k in sorted(stored) if head_hashes([k])] + [42]
        assert index.leading(probe) == len(probe) - 1
