"""A pool's stored keys by the engines' 64-bit block hash, for ``prefix_match`` by hashes.

A cache-aware router that indexes SGLang's KV events holds signed 64-bit block hashes, not
page keys: SGLang's hash of a page key is its first 16 hex digits read as a two's-complement
int64 (``events.wire.sglang_hash``). A hash cannot be turned back into its key, so answering
"how many of these hashes lead the stored run" needs an index kept as keys come and go.

Only keys whose first 16 characters are hex digits are indexed: SGLang's page keys always are
(SHA-256 hex), and it is the rule every backend can apply alike (a Redis script reads the same
16 characters; Redis's Lua has no SHA-256 for the fallback hash the event feed gives other
keys). Other keys are matched by ``keys`` only.

Two stored keys can share a head (a crafted key, or one in 2^64 by chance): ``_extra`` counts
the holders beyond the first, so removing one of them keeps the hash present while the other
is stored. The common case costs one int in one set: about 80 bytes per stored key.
"""

from __future__ import annotations

import binascii
import struct
from collections.abc import Iterable, Sequence

from kvmeta.core.pool import leading_in

__all__ = ["HashIndex", "HEAD_DIGITS", "hash_field", "head_hashes", "signed64"]

HEAD_DIGITS = 16
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_HEX = frozenset("0123456789abcdefABCDEF")
_FORMATS: dict[int, str] = {}


def head_hashes(keys: Sequence[str]) -> list[int]:
    """The block hashes of the keys that have one (first 16 characters hex), in order.

    One format and one strict hex decode for the whole batch, as SGLang's keys always
    qualify; a batch with any other key is read key by key."""
    n = len(keys)
    fmt = _FORMATS.get(n)
    if fmt is None:
        fmt = "%.16s" * n
        if n <= 1024:
            _FORMATS[n] = fmt
    text = fmt % tuple(keys)
    if len(text) == HEAD_DIGITS * n:
        try:  # strict: hex digits only (no sign, prefix, space or non-ASCII)
            return list(struct.unpack(f">{n}q", binascii.a2b_hex(text)))
        except (binascii.Error, ValueError):
            pass
    return [signed64(int(k[:HEAD_DIGITS], 16)) for k in keys if _has_head(k)]


def _has_head(key: str) -> bool:
    return len(key) >= HEAD_DIGITS and _HEX.issuperset(key[:HEAD_DIGITS])


def signed64(value: int) -> int:
    """An unsigned 64-bit value as the signed int64 of the same bits (SGLang's block hashes
    are signed; a router may hold them unsigned)."""
    return value - _U64 if value > _I64_MAX else value


def hash_field(block_hash: int) -> str:
    """The 16 lowercase hex digits a hash is read from: how a Redis pool's index names it."""
    return format(block_hash % _U64, "016x")


class HashIndex:
    """The block hashes of one pool's stored keys (see the module docstring)."""

    __slots__ = ("_present", "_extra")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._present: set[int] = set()
        self._extra: dict[int, int] = {}  # hash -> stored keys with it beyond the first
        keys = list(keys)
        if keys:
            self.add(keys)

    def __len__(self) -> int:
        """Stored keys indexed (each holder of a shared hash counts)."""
        return len(self._present) + sum(self._extra.values())

    def add(self, keys: Sequence[str]) -> None:
        """Keys just stored (each was not stored before)."""
        hashes = head_hashes(keys)
        present = self._present
        new = set(hashes)
        if len(new) == len(hashes) and present.isdisjoint(new):
            present |= new  # the usual batch: all distinct, none present (in C)
            return
        extra = self._extra
        for h in hashes:
            if h in present:
                extra[h] = extra.get(h, 0) + 1
            else:
                present.add(h)

    def remove(self, keys: Sequence[str]) -> None:
        """Keys no longer stored (each was stored)."""
        hashes = head_hashes(keys)
        extra = self._extra
        if not extra:
            self._present.difference_update(hashes)
            return
        for h in hashes:
            more = extra.get(h)
            if more is None:
                self._present.discard(h)
            elif more == 1:
                del extra[h]
            else:
                extra[h] = more - 1

    def clear(self) -> None:
        self._present.clear()
        self._extra.clear()

    def leading(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, belong to stored keys."""
        return leading_in(hashes, self._present)

    def counts(self) -> dict[int, int]:
        """Hash -> stored keys with it: what an invariant check compares with the pool."""
        out = dict.fromkeys(self._present, 1)
        for h, more in self._extra.items():
            out[h] += more
        return out
