"""Dialect S: SGLang HiCache's ``POST /{rank}/<op>`` routes, mapped onto the service.

Wire shapes only; the pool logic lives in ``core`` and the shared operations in ``service``.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Annotated

import msgspec

from kvmeta._types import DEFAULT_NAMESPACE, PoolId, normalize_namespace
from kvmeta.server.app import NO_CONTENT, App, decode_body, json_response
from kvmeta.server.http import Request, Response
from kvmeta.service.ops import Service

__all__ = ["add_routes"]

Namespace = str
_first = itemgetter(0)


class NamespaceBody(msgspec.Struct, kw_only=True):
    namespace: Namespace = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        self.namespace = normalize_namespace(self.namespace)


class InitializeBody(NamespaceBody, kw_only=True):
    num_pages: Annotated[int, msgspec.Meta(gt=0)]


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
    init_dec = msgspec.json.Decoder(InitializeBody)
    keys_dec = msgspec.json.Decoder(KeysBody)
    reserve_dec = msgspec.json.Decoder(ReserveBody)
    confirm_dec = msgspec.json.Decoder(ConfirmBody)
    ns_dec = msgspec.json.Decoder(NamespaceBody)

    async def initialize(req: Request, rank: int) -> Response:
        body = decode_body(init_dec, req.body, _USAGE["initialize"])
        await service.initialize(PoolId("s", rank, body.namespace), body.num_pages)
        return NO_CONTENT

    async def exists(req: Request, rank: int) -> Response:
        body = decode_body(keys_dec, req.body, _USAGE["keys"])
        out = await service.exists(PoolId("s", rank, body.namespace), body.keys)
        return json_response({"exists": out})

    async def reserve(req: Request, rank: int) -> Response:
        body = decode_body(reserve_dec, req.body, _USAGE["reserve"])
        keys = list(map(_first, body.keys))
        out = await service.reserve(PoolId("s", rank, body.namespace), keys)
        return json_response({"indices": out})

    async def confirm(req: Request, rank: int) -> Response:
        body = decode_body(confirm_dec, req.body, _USAGE["confirm"])
        await service.confirm(
            PoolId("s", rank, body.namespace), body.written_keys_to_confirm, body.pages_to_release
        )
        return NO_CONTENT

    async def get(req: Request, rank: int) -> Response:
        body = decode_body(keys_dec, req.body, _USAGE["keys"])
        out = await service.get(PoolId("s", rank, body.namespace), body.keys)
        return json_response({"indices": out})

    async def delete(req: Request, rank: int) -> Response:
        body = decode_body(keys_dec, req.body, _USAGE["keys"])
        await service.delete(PoolId("s", rank, body.namespace), body.keys)
        return NO_CONTENT

    async def clear(req: Request, rank: int) -> Response:
        body = decode_body(ns_dec, req.body, _USAGE["clear"])
        await service.clear(PoolId("s", rank, body.namespace))
        return NO_CONTENT

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
