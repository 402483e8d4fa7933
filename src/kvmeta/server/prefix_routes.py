"""Router routes: ``POST /v1/prefix_match`` and ``GET /v1/dump``.

A cache-aware router asks which leading pages of a request the storage tier holds, per engine
pool (``prefix_match``: O(request), each pool's walk stops at its first miss), and an indexer
reads a pool's stored keys page by page to bootstrap (``dump``). Both are pure reads: they
refresh no LRU position, grant no read lease and bump no counter, so a router polling them
changes neither what is evicted next nor the engines' hit ratios (docs/protocol.md, "Router
endpoints").

Every ``PoolId`` is built by ``pool_id`` from the request, so a per-request scope (the
tenant of the caller's token) is added in one place.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import parse_qsl

import msgspec

from kvmeta._types import DEFAULT_NAMESPACE, PoolId, normalize_namespace
from kvmeta.core.hash_index import signed64
from kvmeta.errors import InvalidRequest
from kvmeta.server.access import sglang_pool, vllm_pool
from kvmeta.server.app import (
    App,
    BodyDecoder,
    CallerWarning,
    Route,
    add_table,
    json_response,
    reply,
    unknown_fields_warning,
)
from kvmeta.server.http import Request, Response
from kvmeta.service.limits import INT64_MAX, INT64_MIN, rank_error, show_number
from kvmeta.service.ops import Service

__all__ = ["DUMP_DEFAULT_LIMIT", "ROUTES", "add_routes", "pool_id"]

Dialect = Literal["sglang", "vllm"]
DUMP_DEFAULT_LIMIT = 1000
_DUMP_PARAMS = ("rank", "namespace", "dialect", "cursor", "limit")

_DIALECT = msgspec.Meta(
    description="sglang (default): the pool (rank, namespace) of SGLang HiCache; vllm: the "
    "pool of one vLLM worker rank (namespace ignored)"
)
_KEYS = msgspec.Meta(
    description="page keys in prefix order (the first page of the sequence first); give "
    "`keys` or `hashes`"
)
_HASHES = msgspec.Meta(
    description="instead of `keys`, for an SGLang pool on a server run with --hash-index: the "
    "64-bit block hashes the KV event feed publishes (SGLang's hash of a page key: its first "
    "16 hex digits as a signed int64; unsigned values are read modulo 2^64), in prefix order"
)
_U64 = 1 << 64


def pool_id(req: Request, dialect: str, rank: int, namespace: str) -> PoolId:
    """The pool a router request names, in the caller's tenant; ``Forbidden`` when the token's
    scope does not cover it. The one place such a ``PoolId`` is made, so every router read is
    scoped alike."""
    if dialect == "vllm":
        return vllm_pool(req, rank)
    return sglang_pool(req, rank, normalize_namespace(namespace))


class PrefixPool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One pool and the keys to match in it."""

    dialect: Annotated[Dialect, _DIALECT] = "sglang"
    rank: int
    namespace: str = DEFAULT_NAMESPACE
    keys: Annotated[list[str] | None, _KEYS] = None
    hashes: Annotated[list[int] | None, _HASHES] = None


class PrefixMatchBody(msgspec.Struct, kw_only=True):
    """Pools and, for each, ordered page keys: how many leading keys are stored."""

    pools: list[PrefixPool]


_PREFIX_USAGE = (
    '{"pools": [{"rank": 0, "namespace": "kv", "keys": ["<key>", ...]}, '
    '{"dialect": "vllm", "rank": 0, "keys": [...]}]} (or "hashes": [<int64>, ...] in place of '
    '"keys" for an SGLang pool, with --hash-index)'
)


PREFIX_MATCH = BodyDecoder(PrefixMatchBody, _PREFIX_USAGE)


def _query_of(i: int, p: PrefixPool) -> tuple[list[str], list[int] | None]:
    """A pool's keys, or its hashes in the signed form the index holds (keys then empty)."""
    if p.hashes is None:
        if p.keys is None:
            raise InvalidRequest(
                f"`pools[{i}]` needs `keys` (its page keys in prefix order) or `hashes` (their "
                f"64-bit block hashes); expected {_PREFIX_USAGE}",
                f"pools[{i}].keys",
            )
        return p.keys, None
    if p.keys is not None:
        raise InvalidRequest(
            f"`pools[{i}]` gives both `keys` and `hashes`: give one of them", f"pools[{i}].hashes"
        )
    hashes = p.hashes
    if hashes and (max(hashes) > INT64_MAX or min(hashes) < INT64_MIN):
        for j, h in enumerate(hashes):
            if not INT64_MIN <= h < _U64:
                raise InvalidRequest(
                    f"`pools[{i}].hashes[{j}]` is {show_number(h)}, not a 64-bit block "
                    "hash: send the signed int64 values the KV event feed publishes",
                    f"pools[{i}].hashes",
                )
        hashes = list(map(signed64, hashes))  # (some in the unsigned form)
    return [], hashes


async def prefix_match(service: Service, req: Request, _: int) -> Response:
    body, warnings = PREFIX_MATCH.decode(req.body)
    pools = [
        (pool_id(req, p.dialect, p.rank, p.namespace), *_query_of(i, p))
        for i, p in enumerate(body.pools)
    ]
    lengths = await service.prefix_match(pools)
    matches = [
        {
            "dialect": p.dialect,
            "rank": p.rank,
            "namespace": pid.namespace,
            "length": length or 0,
            "found": length is not None,
        }
        for p, (pid, _keys, _hashes), length in zip(body.pools, pools, lengths, strict=True)
    ]
    return reply(json_response({"matches": matches}), warnings)


def _query(req: Request) -> tuple[dict[str, str], list[CallerWarning]]:
    """The query parameters of a dump, each at most once; unknown ones are named in a
    warning (as unknown body fields are)."""
    params: dict[str, str] = {}
    try:
        pairs = parse_qsl(req.query, keep_blank_values=True, max_num_fields=32)
    except ValueError:
        raise InvalidRequest(
            "too many query parameters; a dump reads " + ", ".join(_DUMP_PARAMS)
        ) from None
    for name, value in pairs:
        if name in params:
            raise InvalidRequest(
                f"query parameter `{name[:64]}` is given twice; give it once", name[:64]
            )
        params[name] = value
    unknown = [name for name in params if name not in _DUMP_PARAMS]
    return params, [unknown_fields_warning(unknown, _DUMP_PARAMS)] if unknown else []


def _int_param(params: dict[str, str], name: str, default: int | None) -> int:
    text = params.get(name)
    if text is None or text == "":
        if default is None:
            raise InvalidRequest(
                f"query parameter `{name}` is required: e.g. /v1/dump?rank=0&namespace=kv",
                name,
            )
        return default
    digits = text[1:] if text[:1] in "+-" else text
    if not (digits.isascii() and digits.isdigit()) or len(digits.lstrip("0")) > 19:
        shown = show_number(text) if digits.isascii() and digits.isdigit() else repr(text[:40])
        raise InvalidRequest(f"query parameter `{name}` must be an integer, got {shown}", name)
    value = int(text)
    if name == "rank" and not INT64_MIN <= value <= INT64_MAX:
        raise InvalidRequest("query parameter " + rank_error(text, "rank"), "rank")
    return value


async def dump(service: Service, req: Request, _: int) -> Response:
    params, warnings = _query(req)
    dialect = params.get("dialect") or "sglang"
    if dialect not in ("sglang", "vllm"):
        raise InvalidRequest(
            f"query parameter `dialect` must be sglang or vllm, got {dialect[:40]!r}", "dialect"
        )
    rank = _int_param(params, "rank", None)
    limit = _int_param(params, "limit", DUMP_DEFAULT_LIMIT)
    namespace = params.get("namespace") or DEFAULT_NAMESPACE
    pool = pool_id(req, dialect, rank, namespace)
    keys, cursor = await service.dump(pool, params.get("cursor", ""), limit)
    return reply(json_response({"keys": keys, "cursor": cursor}), warnings)


ROUTES = (
    Route("POST", "/v1/prefix_match", prefix_match, PREFIX_MATCH),
    Route("GET", "/v1/dump", dump),
)


def add_routes(app: App, service: Service) -> None:
    """Register the router routes on ``app``."""
    add_table(app, ROUTES, service)
