"""Dialect S: SGLang HiCache's ``POST /{rank}/<op>`` routes, mapped onto the service.

Wire shapes only; every handler names its pool through ``access.sglang_pool``, which checks the
token's scope (before any state is read) and puts the token's tenant into the ``PoolId``. The
pool logic lives in ``core`` and the operations, with their limits and caller warnings, in
``service`` (``Service``): a handler adds the warnings an operation returns to the reply.
``ROUTES`` is the route table; each handler is ``handler(service, request, rank)``. The body
Structs are also the OpenAPI request schemas (``server.openapi``): their ``Meta`` annotations
add to the document only, decoding and its messages are the Struct's types.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Annotated

import msgspec

from kvmeta._types import DEFAULT_NAMESPACE, normalize_namespace
from kvmeta.server.access import sglang_pool
from kvmeta.server.app import NO_CONTENT, App, BodyDecoder, Route, add_table, json_response, reply
from kvmeta.server.http import Request, Response
from kvmeta.server.metrics import PREFIX_HITS
from kvmeta.service.ops import Service

__all__ = ["ROUTES", "add_routes"]

_first = itemgetter(0)

_NAMESPACE = msgspec.Meta(
    description="SGLang pool name (kv, mamba, indexer, swa, ...); clients up to 0.5.10 omit it",
    extra_json_schema={"pattern": "^[A-Za-z0-9_.:-]+$"},
)
_KEY_PAIR = msgspec.Meta(
    description="[key, prefix key]; the first pair's prefix key, when not empty or null, names "
    "the key before it in its chain (an eviction hint); the others' are not read"
)


class NamespaceBody(msgspec.Struct, kw_only=True):
    """Names the pool; an empty body means the default pool."""

    namespace: Annotated[str, _NAMESPACE] = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        self.namespace = normalize_namespace(self.namespace)


class InitializeBody(NamespaceBody, kw_only=True):
    """Create the pool with num_pages pages."""

    # (range checked by the service, in the words the in-process client uses too)
    num_pages: Annotated[int, msgspec.Meta(extra_json_schema={"minimum": 1})]


class KeysBody(NamespaceBody, kw_only=True):
    """Keys of one pool."""

    keys: list[str]


class ReserveBody(NamespaceBody, kw_only=True):
    """Keys to reserve a page for."""

    keys: list[Annotated[tuple[str, str | None], _KEY_PAIR]]


class ConfirmBody(NamespaceBody, kw_only=True):
    """Pages written (committed) and pages to give back."""

    written_keys_to_confirm: list[tuple[str, int]] = []
    pages_to_release: list[int] = []


INITIALIZE = BodyDecoder(InitializeBody, '{"num_pages": <int > 0>, "namespace": "kv"}')
KEYS = BodyDecoder(KeysBody, '{"keys": ["<key>", ...], "namespace": "kv"}')
RESERVE = BodyDecoder(
    ReserveBody, '{"keys": [["<key>", "<prefix_key or null>"], ...], "namespace": "kv"}'
)
CONFIRM = BodyDecoder(
    ConfirmBody,
    '{"written_keys_to_confirm": [["<key>", <page>], ...], "pages_to_release": [<page>, ...], '
    '"namespace": "kv"}',
)
NAMESPACE = BodyDecoder(NamespaceBody, '{"namespace": "kv"} or an empty body')


async def initialize(service: Service, req: Request, rank: int) -> Response:
    body, warnings = INITIALIZE.decode(req.body)
    done = await service.initialize(sglang_pool(req, rank, body.namespace), body.num_pages)
    warnings += done.warnings
    return reply(NO_CONTENT, warnings)


async def exists(service: Service, req: Request, rank: int) -> Response:
    body, warnings = KEYS.decode(req.body)
    pool = sglang_pool(req, rank, body.namespace)
    out = await service.exists(pool, body.keys)
    PREFIX_HITS.record(pool, out)
    return reply(json_response({"exists": out}), warnings)


async def reserve(service: Service, req: Request, rank: int) -> Response:
    body, warnings = RESERVE.decode(req.body)
    keys = list(map(_first, body.keys))
    pool = sglang_pool(req, rank, body.namespace)
    out = await service.reserve(pool, keys, body.keys[0][1] if keys else None)
    if service.reserve_observer is not None:
        service.reserve_observer(pool, body.keys, keys)
    return reply(json_response({"indices": out}), warnings)


async def confirm(service: Service, req: Request, rank: int) -> Response:
    body, warnings = CONFIRM.decode(req.body)
    done = await service.confirm(
        sglang_pool(req, rank, body.namespace),
        body.written_keys_to_confirm,
        body.pages_to_release,
    )
    warnings += done.warnings
    return reply(NO_CONTENT, warnings)


async def get(service: Service, req: Request, rank: int) -> Response:
    body, warnings = KEYS.decode(req.body)
    out = await service.get(sglang_pool(req, rank, body.namespace), body.keys)
    return reply(json_response({"indices": out}), warnings)


async def delete(service: Service, req: Request, rank: int) -> Response:
    body, warnings = KEYS.decode(req.body)
    await service.delete(sglang_pool(req, rank, body.namespace), body.keys)
    return reply(NO_CONTENT, warnings)


async def clear(service: Service, req: Request, rank: int) -> Response:
    body, warnings = NAMESPACE.decode(req.body)
    await service.clear(sglang_pool(req, rank, body.namespace))
    return reply(NO_CONTENT, warnings)


ROUTES = (
    Route("POST", "/{rank}/initialize", initialize, INITIALIZE),
    Route("POST", "/{rank}/exists", exists, KEYS),
    Route("POST", "/{rank}/reserve_and_allocate_page_indices", reserve, RESERVE),
    Route("POST", "/{rank}/confirm_write", confirm, CONFIRM),
    Route("POST", "/{rank}/get_page_indices", get, KEYS),
    Route("POST", "/{rank}/delete_keys", delete, KEYS),
    Route("POST", "/{rank}/clear", clear, NAMESPACE),
)


def add_routes(app: App, service: Service) -> None:
    """Register every dialect-S route on ``app``."""
    add_table(app, ROUTES, service)
