"""SGLang reference server's JSON state file (``--persistence-path``): import and rollback.

Format (one object; pool names ``"<rank>"`` mean namespace ``kv``)::

    {"<rank>:<namespace>" | "<rank>": {"num_pages": n, "free_pages": [...],
                                       "key_to_index": [[key, page], ...]}}

The reference server files a pool under the namespace text its client sent, which for SGLang
0.5.11 and later is ``PoolName.KV``; kvmeta serves such a request from pool ``kv``
(``normalize_namespace``), so the import files the pool there too.

``key_to_index`` is in LRU order, oldest first (an object mapping key -> page is accepted too).
``free_pages`` is ignored on import: every page not mapped is free, which is what it must say.
Only the default tenant's SGLang pools (dialect S) have a place in this format; vLLM pools and
other tenants' pools are not written (they are in the data directory).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvmeta._types import DEFAULT_NAMESPACE, PoolId, normalize_namespace
from kvmeta.errors import StorageError
from kvmeta.store.disk.journal import write_durably

__all__ = ["LegacyPool", "read_legacy", "write_legacy"]

LegacyPool = tuple[PoolId, int, list[tuple[str, int]]]

logger = logging.getLogger(__name__)


def _bad(path: Path, where: str, problem: str) -> StorageError:
    return StorageError(
        f"{path}: {problem} - at `{where}`. The SGLang persistence file must map "
        '"<rank>" or "<rank>:<namespace>" to {"num_pages": N, "key_to_index": [[key, page], '
        "...]}; fix or move the file (or drop --persistence-path) and start again."
    )


def _pool_id(path: Path, name: str) -> PoolId:
    rank_text, _, namespace = name.partition(":")
    try:
        rank = int(rank_text)
    except ValueError:
        raise _bad(path, name, f"pool name {name!r} does not start with an integer rank") from None
    if rank < 0:
        raise _bad(path, name, f"rank {rank} is negative")
    return PoolId("s", rank, normalize_namespace(namespace or DEFAULT_NAMESPACE))


def _written_by_current_sglang(name: str) -> bool:
    """Whether the pool name holds a namespace as SGLang 0.5.11+ clients send it."""
    namespace = name.partition(":")[2]
    return normalize_namespace(namespace) != namespace


def _entries(path: Path, name: str, raw: Any) -> list[tuple[str, int]]:
    pairs = list(raw.items()) if isinstance(raw, dict) else raw
    if not isinstance(pairs, list):
        raise _bad(path, f"{name}.key_to_index", "expected a list of [key, page] pairs")
    out: list[tuple[str, int]] = []
    for i, pair in enumerate(pairs):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2
        if not ok or not isinstance(pair[0], str) or type(pair[1]) is not int:
            raise _bad(path, f"{name}.key_to_index[{i}]", f"expected [key, page], got {pair!r}")
        out.append((pair[0], pair[1]))
    return out


def read_legacy(path: Path) -> list[LegacyPool]:
    """Pools of an SGLang persistence file.

    Raises:
        StorageError: unreadable JSON or a malformed pool, naming the place and the fix.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _bad(path, "$", f"cannot read it as JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _bad(path, "$", "expected an object of pools")
    found: dict[PoolId, tuple[str, LegacyPool]] = {}
    for name, body in doc.items():
        pid = _pool_id(path, name)
        if not isinstance(body, dict):
            raise _bad(path, name, "expected an object")
        num_pages = body.get("num_pages")
        if type(num_pages) is not int or num_pages <= 0:
            raise _bad(path, f"{name}.num_pages", f"expected a positive integer, got {num_pages!r}")
        named = (name, (pid, num_pages, _entries(path, name, body.get("key_to_index", []))))
        found[pid] = _one_of(path, found[pid], named) if pid in found else named
    return [pool for _, pool in found.values()]


def _one_of(
    path: Path, first: tuple[str, LegacyPool], second: tuple[str, LegacyPool]
) -> tuple[str, LegacyPool]:
    """Two names of one pool, as a reference server that served SGLang before and after 0.5.11
    holds them ("0:kv", then "0:PoolName.KV"): the name today's clients send is kept, being the
    pool they wrote last (else the first name), and the other one is named in a warning."""
    keep, drop = first, second
    if _written_by_current_sglang(second[0]) and not _written_by_current_sglang(first[0]):
        keep, drop = second, first
    logger.warning(
        "%s: pools '%s' and '%s' are both %s; importing '%s' and skipping the %d keys of '%s'",
        path,
        first[0],
        second[0],
        keep[1][0],
        keep[0],
        len(drop[1][2]),
        drop[0],
    )
    return keep


def write_legacy(path: Path, pools: list[LegacyPool]) -> None:
    """Write the file whole or not at all, durably (``journal.write_durably``), SGLang pools
    only."""
    doc: dict[str, Any] = {}
    for pid, num_pages, entries in sorted(pools, key=lambda p: p[0]):
        if pid.dialect != "s" or pid.tenant:
            continue  # the format has no place for vLLM pools or tenants
        name = f"{pid.rank}:{pid.namespace}"
        if pid.namespace == DEFAULT_NAMESPACE:
            name = str(pid.rank)
        used = {page for _, page in entries}
        doc[name] = {
            "num_pages": num_pages,
            "free_pages": [p for p in range(num_pages) if p not in used],
            "key_to_index": [[key, page] for key, page in entries],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(path, lambda fh: fh.write(json.dumps(doc, separators=(",", ":")).encode()))
