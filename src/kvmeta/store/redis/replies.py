"""What a script's reply means: one JSON array ``[code, ...]``, code 0 for success and every
other code one kvmeta error (``ERRORS``).

A request's keys travel to a script as ONE JSON argument and come back as one JSON value:
packing and parsing one value per key in Python costs more than the whole script takes to run
in Redis. The wording of each refusal lives here, next to the code that the Lua answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvmeta._types import PoolId
from kvmeta.errors import (
    Forbidden,
    InvalidRequest,
    KvmetaError,
    NotInitialized,
    PageOutOfRange,
    PoolDamaged,
)
from kvmeta.store.redis.layout import pool_prefix

__all__ = [
    "ERRORS",
    "IN_USE",
    "WORLD_LOCKED",
    "checked",
    "decode",
    "encode",
    "out_of_range",
    "text",
]

encode = msgspec.json.Encoder().encode
decode = msgspec.json.Decoder().decode


def text(value: Any) -> str:
    """A reply item as text (Redis hands back bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def out_of_range(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    """Code 2 of ``confirm.lua``: ``[2, which list (1 pairs, 2 release), index in it, the
    pool's size]``; the page itself is read back from the request, so the script returns no
    more than it must."""
    in_release, index = int(reply[1]) == 2, int(reply[2])
    pairs, release = request
    page = release[index] if in_release else pairs[index][1]
    return PageOutOfRange(page, int(reply[3]), in_release)


def _bad_size(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    return InvalidRequest(f"num_pages must be a positive integer, got {reply[1]}", "num_pages")


def _damaged(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    prefix = pool_prefix(pid)
    found = ", ".join(text(part) for part in reply[1:])
    return PoolDamaged(
        f"{pid}: its meta key, which says the pool exists, is gone, yet its keys "
        f"{prefix}{{{found}}} are left: part of the pool was evicted or deleted (a "
        "maxmemory-policy that evicts any key, or a manual delete). "
        "Creating it again would hand out pages its stored keys still name, so kvmeta "
        "refuses (nothing was changed). Fix: set "
        "maxmemory-policy noeviction on every Redis primary and replica; stop the engines "
        f"that use this pool (or wait --reservation-ttl), delete its keys (redis-cli --scan "
        f"--pattern '{prefix}*' | xargs redis-cli unlink) and start the engines again: the "
        "pool starts empty"
    )


# Script error code -> the kvmeta error it means (code 0 is success).
IN_USE = 5  # v_remove's refusal: the rank's pages are in use (RankInUse)
WORLD_LOCKED = 10  # v_register's refusal: the world size is not the caller's to change
ERRORS: dict[int, Callable[[PoolId, list[Any], Any], KvmetaError]] = {
    1: lambda pid, reply, request: NotInitialized.for_pool(pid.dialect, pid.rank, pid.namespace),
    2: out_of_range,
    3: _bad_size,
    4: _damaged,
    WORLD_LOCKED: lambda pid, reply, request: Forbidden.world_size_change(
        pid.rank, int(reply[1]), request
    ),
}


def checked(pid: PoolId, reply: list[Any], request: Any) -> list[Any]:
    """``reply`` itself when its code is 0; otherwise raises the error the code means.

    Raises:
        KvmetaError: the ``ERRORS`` entry of the reply's code.
    """
    code = int(reply[0])
    if code:
        raise ERRORS[code](pid, reply, request)
    return reply
