"""Requests in the Redis protocol (RESP2 arrays of bulk strings), packed for one ``send``.

redis-py's ``Connection.pack_command`` re-encodes every argument of every call; kvmeta's calls
repeat the same head (``FCALL kvmeta_reserve 10`` and one pool's ten key names) thousands of
times a second, so the head is packed once and cached: a reserve then costs a worker a
fraction of what redis-py's packing does (``benchmarks/micro_costs.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

__all__ = ["Strings", "pack", "pack_many"]


def _bulk(value: Any) -> bytes:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, float):
        data = repr(value).encode()
    else:
        data = str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


@functools.lru_cache(maxsize=16384)
def _head(head: tuple[Any, ...]) -> bytes:
    return b"".join(_bulk(x) for x in head)


class Strings(tuple[str, ...]):
    """Many string arguments (an ``HMGET``'s fields), given as the last element of a command:
    ``pack`` spreads them into the array, packed in a few C-level string operations instead of
    one ``_bulk`` each, several times cheaper when they are ASCII and of one length, as hex
    digests are (``benchmarks/micro_costs.py``)."""

    __slots__ = ()


def _strings(values: Strings) -> bytes:
    if not values:
        return b""
    width = len(values[0])
    text = f"\r\n${width}\r\n".join(values)
    # One length and ASCII: every length in characters is the length in bytes.
    if text.isascii() and len(set(map(len, values))) == 1:
        return f"${width}\r\n{text}\r\n".encode()
    text = "".join([f"${len(v)}\r\n{v}\r\n" for v in values])
    if text.isascii():
        return text.encode()
    return b"".join(_bulk(v) for v in values)


def pack(command: Sequence[Any], head: int = 0) -> bytes:
    """``command`` as one RESP array; its first ``head`` arguments (hashable, repeated across
    calls: command, function name, key names) come from a cache. A last element of type
    ``Strings`` stands for its items."""
    first = tuple(command[:head])
    rest = command[head:]
    if rest and isinstance(rest[-1], Strings):
        many = rest[-1]
        return b"*%d\r\n%s%s%s" % (
            len(command) - 1 + len(many),
            _head(first),
            b"".join(_bulk(x) for x in rest[:-1]),
            _strings(many),
        )
    return b"*%d\r\n%s%s" % (len(command), _head(first), b"".join(_bulk(x) for x in rest))


def pack_many(commands: Sequence[tuple[Sequence[Any], int]]) -> bytes:
    """Several ``(command, head)`` pipelined in one send."""
    return b"".join(pack(command, head) for command, head in commands)
