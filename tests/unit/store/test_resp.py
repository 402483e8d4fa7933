"""``store.redis.resp``: requests packed for one send are byte-for-byte what Redis expects."""

from __future__ import annotations

import pytest

from kvmeta.store.redis.resp import Strings, pack


def _plain(args: list[bytes]) -> bytes:
    """The RESP array of ``args``, written out the slow, obvious way."""
    out = b"*%d\r\n" % len(args)
    for arg in args:
        out += b"$%d\r\n" % len(arg) + arg + b"\r\n"
    return out


@pytest.mark.parametrize(
    "fields",
    [
        [],
        ["a"],
        [f"{i:064x}" for i in range(256)],  # one length, ASCII: the hex digests engines send
        ["a", "bb", "", "ccc"],  # lengths differ
        ["same", "ключ"],  # non-ASCII: bytes, not characters, are counted
        ["ab", "é"],  # one length in characters, not in bytes
        ["line\r\nbreak", "$3\r\n", "*2"],  # protocol characters inside a key
    ],
)
def test_strings_pack_as_their_items(fields: list[str]) -> None:
    expected = _plain([b"HMGET", b"k:{t}:stored", *(f.encode() for f in fields)])
    assert pack(("HMGET", "k:{t}:stored", Strings(fields))) == expected
    assert pack(("HMGET", "k:{t}:stored", *fields)) == expected


def test_strings_after_a_cached_head() -> None:
    fields = ["x" * 5, "y" * 5]
    expected = _plain([b"FCALL", b"f", b"1", b"key", b"arg", b"xxxxx", b"yyyyy"])
    assert pack(("FCALL", "f", 1, "key", "arg", Strings(fields)), 4) == expected
