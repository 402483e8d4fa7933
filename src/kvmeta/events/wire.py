"""The event wire format: the engines' ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, as their released subscribers decode it.

A batch is a positional msgpack array ``[ts, events]`` in both engines. Events are tagged by
their class name (``type``); the current releases of both engines encode them as maps (field
name -> value), older releases positionally as ``[tag, field, ...]``: ``ENCODINGS`` selects.
Fields an engine declares without a default are always written (its decoder requires them);
kvmeta's own fields (``pool``, ``keys``, ``parent_key``, ``reason``, ``tenant``) come after the
engines' and are ignored by their decoders. ``keys`` (the page keys, in ``BlockStored`` of
SGLang pools) is left out where the hashes already are the keys (vLLM pools) and in removals.
In the positional form they follow the six fields both engines' positional releases share, so
those decoders ignore them as trailing extras.

Block hashes: SGLang pools publish SGLang's own 64-bit form of the page key (``sglang_hash``),
so a router indexing SGLang's events finds the same blocks; vLLM pools publish the key's bytes
(its HF3FS key, an MD5 chain, is not vLLM's block hash; docs/events.md).
"""

from __future__ import annotations

import binascii
import hashlib
from collections.abc import Sequence
from typing import Union

import msgspec

from kvmeta._types import PoolId
from kvmeta.core.hash_index import head_hashes, signed64

__all__ = [
    "ENCODINGS",
    "FORMATS",
    "array_header",
    "hash_array",
    "hash_body",
    "pool_label",
    "sglang_hash",
    "sglang_hashes",
]

ENCODINGS = ("map", "array")
FORMATS = ENCODINGS  # the --events-format choices

BlockHash = Union[int, bytes]  # noqa: UP007 - msgspec reads the annotation at runtime
# What an event's ``block_hashes`` holds: the hashes, or their msgpack array already encoded.
Hashes = Union[Sequence[BlockHash], msgspec.Raw]  # noqa: UP007


def sglang_hash(key: str) -> int:
    """The signed 64-bit block hash SGLang's events carry for a page key: the first 16 hex
    digits of the key (SGLang's keys are SHA-256 hex strings) as an unsigned number, wrapped
    into the signed range.

    Parsing follows Python's ``int(text, 16)`` exactly as SGLang's own conversion does (so
    ``0x`` prefixes, ``_`` separators, surrounding spaces and a sign are accepted the same
    way). A key that does not parse at all (SGLang would fail on it) gets the first 8 bytes of
    its SHA-256 as a signed int64 instead, so every key still has a stable 64-bit hash.
    """
    try:
        value = int(key[:16], 16)
    except ValueError:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
    return signed64(value)


def sglang_hashes(keys: Sequence[str]) -> list[int]:
    """``sglang_hash`` of each key: all at once (``core.hash_index.head_hashes``) when every
    key starts with 16 hex digits (SGLang's SHA-256 keys), else key by key."""
    hashes = head_hashes(keys)
    if len(hashes) == len(keys):
        return hashes
    return [sglang_hash(k) for k in keys]


_BODY_FORMATS: dict[int, str] = {}
_HEADERS: dict[int, bytes] = {}


def hash_body(keys: Sequence[str]) -> bytes | None:
    """The elements of the msgpack array of the keys' ``sglang_hash`` values (9 bytes each,
    no array header: ``array_header``); None unless every key starts with 16 hex digits
    (then ``sglang_hashes``).

    One format (``d3%.16s`` a key: each key's first 16 digits behind the int64 marker's two)
    and one strict hex decode make it all: the digits' bytes *are* SGLang's int64 in two's
    complement, so no Python int is made, kept or encoded per key, and only the head of each
    key is read (an evicted key's other bytes are often out of the CPU caches). Being fixed
    size, a body is cut at ``9 * i`` into the bodies of its keys' slices."""
    n = len(keys)
    fmt = _BODY_FORMATS.get(n)
    if fmt is None:
        fmt = "d3%.16s" * n
        if n <= 1024:
            _BODY_FORMATS[n] = fmt
    text = fmt % tuple(keys)
    if len(text) != 18 * n:  # a key shorter than 16 (each "d3%.16s" makes 18)
        return None
    try:  # strict: no whitespace, signs, prefixes, non-ASCII
        return binascii.a2b_hex(text)
    except (binascii.Error, ValueError):
        return None


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` elements."""
    head = _HEADERS.get(n)
    if head is None:
        if n < 16:
            head = bytes((0x90 | n,))
        elif n < 1 << 16:
            head = b"\xdc" + n.to_bytes(2, "big")
        else:
            head = b"\xdd" + n.to_bytes(4, "big")
        if n <= 1024:
            _HEADERS[n] = head
    return head


def hash_array(n: int, body: bytes) -> msgspec.Raw:
    """The msgpack array of ``n`` hashes whose elements are ``body`` (``hash_body``, or cuts
    of bodies joined), ready to be embedded as an event's ``block_hashes``."""
    return msgspec.Raw(array_header(n) + body)


def pool_label(pool: PoolId) -> str:
    """The ``pool`` field: ``s:<rank>:<namespace>`` or ``v:<rank>`` (the tenant is apart)."""
    if pool.dialect == "v":
        return f"v:{pool.rank}"
    return f"s:{pool.rank}:{pool.namespace}"


# ---------------------------------------------------------------------- map form (current)


class MapStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: Hashes
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    pool: str
    keys: Sequence[str] = ()
    parent_key: str | None = None
    reason: str = ""
    tenant: str = ""


class MapRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: Hashes
    medium: str | None
    pool: str
    reason: str = ""
    tenant: str = ""


class MapCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    medium: str | None = None
    pool: str = ""
    reason: str = ""
    tenant: str = ""


# ---------------------------------------------------------------------- positional form


class ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: Hashes
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    keys: Sequence[str]
    pool: str
    parent_key: str | None
    reason: str
    tenant: str


class ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: Hashes
    medium: str | None
    pool: str
    reason: str
    tenant: str


class ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    medium: str | None
    pool: str
    reason: str
    tenant: str


Event = Union[MapStored, MapRemoved, MapCleared, ArrayStored, ArrayRemoved, ArrayCleared]  # noqa: UP007


class Batch(msgspec.Struct, array_like=True, gc=False):
    """``[ts, events]``: ``ts`` is the wall-clock time (seconds) the batch's first change
    reached the publisher."""

    ts: float
    events: Sequence[Event | msgspec.Raw]  # (an event already encoded: ``Encoder.raw``)


class Encoder:
    """Builds events in one encoding; ``batch`` returns the msgpack payload."""

    def __init__(self, encoding: str, medium: str) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.positional = encoding == "array"
        self.medium = medium
        self._encode = msgspec.msgpack.Encoder().encode
        # Each pool's ``pool`` field, made once (two f-string formats per change otherwise).
        self._labels: dict[PoolId, str] = {}

    def _label(self, pool: PoolId) -> str:
        label = self._labels.get(pool)
        if label is None:
            if len(self._labels) >= 4096:  # (pools come and go: a bounded cache)
                self._labels.clear()
            label = self._labels[pool] = pool_label(pool)
        return label

    def stored(
        self,
        pool: PoolId,
        hashes: Hashes,
        parent: BlockHash | None,
        keys: Sequence[str],
        parent_key: str | None,
        reason: str = "",
    ) -> Event:
        if self.positional:
            return ArrayStored(
                hashes, parent, [], 0, None, self.medium, keys, self._label(pool), parent_key,
                reason, pool.tenant,
            )  # fmt: skip
        return MapStored(
            hashes, parent, [], 0, None, self.medium, None, self._label(pool), keys, parent_key,
            reason, pool.tenant,
        )  # fmt: skip

    def removed(self, pool: PoolId, hashes: Hashes, reason: str) -> Event:
        """Hashes only: a subscriber knows each block's key from its ``BlockStored`` (or from
        ``GET /v1/dump``), and a removal names nothing new."""
        if self.positional:
            return ArrayRemoved(hashes, self.medium, self._label(pool), reason, pool.tenant)
        return MapRemoved(hashes, self.medium, self._label(pool), reason, pool.tenant)

    def cleared(self, pool: PoolId | None, reason: str) -> Event:
        """``pool`` None: every pool of this server (the first event after a start)."""
        label = "" if pool is None else pool_label(pool)
        tenant = "" if pool is None else pool.tenant
        if self.positional:
            return ArrayCleared(self.medium, label, reason, tenant)
        return MapCleared(self.medium, label, reason, tenant)

    def raw(self, event: Event) -> msgspec.Raw:
        """The event encoded now, to be sent in a batch later as it is."""
        return msgspec.Raw(self._encode(event))

    def batch(self, ts: float, events: Sequence[Event | msgspec.Raw]) -> bytes:
        return self._encode(Batch(ts, events))
