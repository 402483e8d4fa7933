"""Caller mistakes that keep their compatible reply but are worth telling the caller about.

The reference servers answer these 204/200 and so does kvmeta (engines would break otherwise);
the server adds the text as an ``X-Kvmeta-Warning`` header and counts it per kind. Each text
says what happened and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from kvmeta._types import PoolId
from kvmeta.store.base import InitResult

__all__ = ["CallerWarning", "Outcome", "batch_refused", "confirm_refused", "size_conflict"]

T = TypeVar("T")

CallerWarning = tuple[str, str]  # (kind, text)


@dataclass(slots=True)
class Outcome(Generic[T]):
    """An operation's value with the caller warnings it earned, computed once by the
    ``Service``: the server sends each as ``X-Kvmeta-Warning: kind: text``, the in-process
    clients log it. A tuple, so the common case (none) allocates nothing."""

    value: T
    warnings: tuple[CallerWarning, ...] = ()


def size_conflict(pool: PoolId, result: InitResult) -> CallerWarning:
    where = f"rank {pool.rank}" + (f" namespace '{pool.namespace}'" if pool.dialect == "s" else "")
    return (
        "size_conflict",
        f"{where} already has {result.num_pages} pages; the requested {result.requested} is "
        "ignored (resizing would make engines overwrite each other's pages): make the file "
        "sizes agree, or give each engine its own rank"
        + (" or namespace" if pool.dialect == "s" else ""),
    )


def confirm_refused(count: int) -> CallerWarning:
    return (
        "confirm_refused",
        f"{count} confirm(s) refused: the page was not reserved for that key (its reservation "
        "expired after --reservation-ttl, or the page is another key's); the data written there "
        "is not mapped: write it again after a new reserve, or raise --reservation-ttl if "
        "writes take that long",
    )


def batch_refused(refused: int, rank: int) -> CallerWarning:
    """A vLLM batch that did not fit whole (``core.pool.Pool.reserve``): the reply keeps the
    reference shape, -1 per key without a page; the header says nothing was reserved."""
    return (
        "batch_refused",
        f"rank {rank} has no room for all {refused} new key(s) of this batch (free pages plus "
        "pages that can be evicted), so none got a page (-1 each) and nothing was reserved or "
        "evicted; keys already stored kept theirs. Send a smaller batch, give the rank a larger "
        "page file (num_pages), or wait for reservations and read leases to end",
    )
