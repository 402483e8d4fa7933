"""The SGLang parent links the KV event publisher names in each ``BlockStored``.

The reserve request names each key's prefix key (``Publisher.note_reserve``); it is kept per
pool until the key's confirm is published, within ``_PREFIX_CAP`` keys overall (the oldest are
forgotten first: their events then carry no parent). A reserve whose keys form
one chain (each key's prefix is the key before it: what SGLang sends for a sequence) is kept as
one entry under its first key, and a confirm of exactly those keys takes it back in one lookup;
any other shape (and any confirm not matching a kept chain) goes through a per-key table, into
which the kept chains are first spread, so the newest reserve of a key always names its parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice, repeat
from operator import itemgetter
from typing import Any

from kvmeta._types import PoolId

__all__ = ["Parents"]

# Prefix keys remembered from reserves, all pools together (about 250 bytes each), and how
# many are noted between two compactions of their tables (``Parents._compact``).
_PREFIX_CAP = 1 << 17
_COMPACT_EVERY = 1 << 14
_FIRST = itemgetter(0)
_SECOND = itemgetter(1)


class Parents:
    """Each reserved key's prefix key, per pool, until a confirm takes it as the key's parent."""

    def __init__(self) -> None:
        # Chain-shaped reserves by first key (the keys, the first key's prefix), and per key.
        self.chains: dict[PoolId, dict[str, tuple[tuple[str, ...], str | None]]] = {}
        self.prefixes: dict[PoolId, dict[str, str | None]] = {}
        self._noted = 0

    def __bool__(self) -> bool:
        """Whether any pool has prefix keys kept."""
        return bool(self.chains or self.prefixes)

    def forget(self, pool: PoolId) -> None:
        """Drop ``pool``'s prefix keys (it was cleared: its keys are gone)."""
        self.chains.pop(pool, None)
        self.prefixes.pop(pool, None)

    def clear(self) -> None:
        """Drop every pool's prefix keys (the backend lost its data)."""
        self.chains.clear()
        self.prefixes.clear()

    def note(
        self,
        pool: PoolId,
        pairs: Sequence[tuple[str, str | None]],
        given: Sequence[str] | None,
    ) -> None:
        keys = tuple(map(_FIRST, pairs)) if given is None else tuple(given)
        chains = self.chains.get(pool)
        if tuple(map(_SECOND, islice(pairs, 1, None))) == keys[:-1] and (
            chains is None or keys[0] not in chains
        ):
            if chains is None:
                chains = self.chains[pool] = {}
            chains[keys[0]] = (keys, pairs[0][1])
        else:
            self._spread(pool)  # what is kept by chain is older than this note
            known = self.prefixes.get(pool)
            if known is None:
                known = self.prefixes[pool] = {}
            known.update(pairs)
        self._noted += len(keys)
        if self._noted > _COMPACT_EVERY:
            self._compact()

    def _spread(self, pool: PoolId) -> None:
        """Move the pool's kept chains into its per-key table (oldest first)."""
        chains = self.chains.pop(pool, None)
        if not chains:
            return
        known = self.prefixes.get(pool)
        if known is None:
            known = self.prefixes[pool] = {}
        for keys, parent in chains.values():
            known.update(zip(keys, (parent, *keys[:-1]), strict=True))

    def _compact(self) -> None:
        """Copy the prefix tables (most entries are popped by their confirm soon after: a
        dict that had many keys deleted keeps its size and gets slower to probe; a copy is
        as small as what is left), and forget the oldest half of each table when they hold
        more than ``_PREFIX_CAP`` keys together."""
        total = sum(len(known) for known in self.prefixes.values()) + sum(
            len(keys) for chains in self.chains.values() for keys, _ in chains.values()
        )
        halve = total > _PREFIX_CAP
        self.prefixes = _copied(self.prefixes, halve)
        self.chains = _copied(self.chains, halve)
        self._noted = 0

    def runs(self, pool: PoolId, keys: tuple[str, ...]) -> list[tuple[tuple[str, ...], str | None]]:
        """The runs of a confirm, each with its parent key: one per chain (a key continues
        the run when its prefix key is the key before it; SGLang confirms a sequence's pages in
        order)."""
        chains = self.chains.get(pool)
        if chains:
            kept = chains.get(keys[0])
            if kept is not None and kept[0] == keys:  # the usual confirm of one reserve
                del chains[keys[0]]
                known = self.prefixes.get(pool)
                if known:  # (older notes of these keys: gone with this confirm)
                    for key in keys:
                        known.pop(key, None)
                return [(keys, kept[1])]
            self._spread(pool)
        known = self.prefixes.get(pool)
        if known is None:
            parents: list[str | None] = [None] * len(keys)
        else:
            parents = list(map(known.pop, keys, repeat(None)))
        if parents[1:] == list(keys[:-1]):  # one chain
            return [(keys, parents[0])]
        runs: list[tuple[tuple[str, ...], str | None]] = []
        start = 0
        for i in range(1, len(keys)):
            parent = parents[i]
            if parent is None or parent != keys[i - 1]:
                runs.append((keys[start:i], parents[start]))
                start = i
        runs.append((keys[start:], parents[start]))
        return runs


def _copied(tables: dict[PoolId, dict[str, Any]], halve: bool) -> dict[PoolId, dict[str, Any]]:
    """Fresh copies of the non-empty tables, without their oldest half when ``halve``."""
    fresh: dict[PoolId, dict[str, Any]] = {}
    for pool, table in tables.items():
        if table:
            fresh[pool] = dict(islice(table.items(), len(table) // 2, None) if halve else table)
    return fresh
