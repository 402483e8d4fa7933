"""Caller mistakes that keep their compatible reply but are worth telling the caller about.

The reference servers answer these 204/200 and so does kvmeta (engines would break otherwise);
the server adds the text as an ``X-Kvmeta-Warning`` header and counts it per kind. Each text
says what happened and what to change.
"""

from __future__ import annotations

from kvmeta._types import PoolId
from kvmeta.store.base import InitResult

__all__ = ["CallerWarning", "confirm_refused", "size_conflict"]

CallerWarning = tuple[str, str]  # (kind, text)


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
