"""Dialect S: SGLang HiCache's ``POST /{rank}/<op>`` routes, mapped onto the service.

Wire shapes only; the pool logic lives in ``core`` and the shared operations in ``service``.
"""

from __future__ import annotations

from operator import itemgetter

import msgspec

from kvmeta._types import DEFAULT_NAMESPACE, PoolId, normalize_namespace
from kvmeta.server.app import NO_CONTENT, App, BodyDecoder, json_response, reply
from kvmeta.server.http import Request, Response
from kvmeta.service.ops import Service
from kvmeta.service.warnings import confirm_refused, size_conflict

__all__ = ["add_routes"]

Namespace = str
_first = itemgetter(0)


class NamespaceBody(msgspec.Struct, kw_only=True):
    namespace: Namespace = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        self.namespace = normalize_namespace(self.namespace)


class InitializeBody(NamespaceBody, kw_only=True):
    # (range checked by the service, in the words the in-process client uses too)
    num_pages: int


class KeysBody(NamespaceBody, kw_only=True):
    keys: list[str]


class ReserveBody(NamespaceBody, kw_only=True):
    keys: list[tuple[str, str | None]]


class ConfirmBody(NamespaceBody, kw_only=True):
    written_keys_to_confirm: list[tuple[str, int]] = []
    pages_to_release: list[int] = []


_USAGE = {
    "initialize": '{"num_pages": <int > 0>, "namespace": "kv"}',
    "keys": '{"keys": ["<key>", ...], "namespace": "kv"}',
    "reserve": '{"keys": [["<key>", "<prefix_key or null>"], ...], "namespace": "kv"}',
    "confirm": (
        '{"written_keys_to_confirm": [["<key>", <page>], ...], "pages_to_release": [<page>, ...], '
        '"namespace": "kv"}'
    ),
    "clear": '{"namespace": "kv"} or an empty body',
}


def add_routes(app: App, service: Service) -> None:
    """Register every dialect-S route on ``app``."""
    init_dec = BodyDecoder(InitializeBody, _USAGE["initialize"])
    keys_dec = BodyDecoder(KeysBody, _USAGE["keys"])
    reserve_dec = BodyDecoder(ReserveBody, _USAGE["reserve"])
    confirm_dec = BodyDecoder(ConfirmBody, _USAGE["confirm"])
    ns_dec = BodyDecoder(NamespaceBody, _USAGE["clear"])

    async def initialize(req: Request, rank: int) -> Response:
        body, warnings = init_dec.decode(req.body)
        pool = PoolId("s", rank, body.namespace)
        result = await service.initialize(pool, body.num_pages)
        if result.conflict:
            warnings.append(size_conflict(pool, result))
        return reply(NO_CONTENT, warnings)

    async def exists(req: Request, rank: int) -> Response:
        body, warnings = keys_dec.decode(req.body)
        out = await service.exists(PoolId("s", rank, body.namespace), body.keys)
        return reply(json_response({"exists": out}), warnings)

    async def reserve(req: Request, rank: int) -> Response:
        body, warnings = reserve_dec.decode(req.body)
        keys = list(map(_first, body.keys))
        out = await service.reserve(PoolId("s", rank, body.namespace), keys)
        return reply(json_response({"indices": out}), warnings)

    async def confirm(req: Request, rank: int) -> Response:
        body, warnings = confirm_dec.decode(req.body)
        refused = await service.confirm(
            PoolId("s", rank, body.namespace), body.written_keys_to_confirm, body.pages_to_release
        )
        if refused:
            warnings.append(confirm_refused(refused))
        return reply(NO_CONTENT, warnings)

    async def get(req: Request, rank: int) -> Response:
        body, warnings = keys_dec.decode(req.body)
        out = await service.get(PoolId("s", rank, body.namespace), body.keys)
        return reply(json_response({"indices": out}), warnings)

    async def delete(req: Request, rank: int) -> Response:
        body, warnings = keys_dec.decode(req.body)
        await service.delete(PoolId("s", rank, body.namespace), body.keys)
        return reply(NO_CONTENT, warnings)

    async def clear(req: Request, rank: int) -> Response:
        body, warnings = ns_dec.decode(req.body)
        await service.clear(PoolId("s", rank, body.namespace))
        return reply(NO_CONTENT, warnings)

    for op, handler in (
        ("initialize", initialize),
        ("exists", exists),
        ("reserve_and_allocate_page_indices", reserve),
        ("confirm_write", confirm),
        ("get_page_indices", get),
        ("delete_keys", delete),
        ("clear", clear),
    ):
        app.add("POST", f"/{{rank}}/{op}", handler)
