"""Dialect V: vLLM's HF3FS connector routes (``/rank/{rank}/initialize``, ``/keys/*``, ``/clear``),
plus kvmeta's operator routes for the rank registry (``/v1/vllm``: see ``add_routes``).

Wire shapes only. Each worker rank is its own pool ``PoolId("v", rank, "")``, apart from SGLang's
pools of the same rank numbers; the key-centric view vLLM expects (a key is present when every
worker rank stored it) is ``service.v_exists``.

Bodies are decoded by typed msgspec decoders (the fast path). Only when that fails is the body
looked at again, to answer in the reference server's words (``Invalid request format: need
'rank' and 'keys'``, ``Invalid keys format``) plus the field that is wrong and the fix.
"""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter
from typing import Any, TypeVar

import msgspec

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest
from kvmeta.server.app import NO_CONTENT, App, json_response
from kvmeta.server.http import Request, Response
from kvmeta.service.ops import Service
from kvmeta.service.vllm import (
    INIT_ERROR,
    SCHEDULER_MESSAGE,
    VALID_INIT,
    WORLD_SIZE_USAGE,
    check_initialize,
    check_world_size_body,
    completeness,
    confirm_error,
    remove_message,
    worker_message,
)

__all__ = ["add_routes"]

T = TypeVar("T")


_second = itemgetter(1)


class AllocateBody(msgspec.Struct):
    rank: int
    keys: list[tuple[str, str | None] | str]


class ConfirmBody(msgspec.Struct):
    rank: int
    confirmations: list[tuple[str, int]]
    pages_to_release: list[int] = []


class ExistsBody(msgspec.Struct):
    keys: list[str]


class LocationsBody(msgspec.Struct):
    rank: int
    keys: list[str]


class _Op:
    """What one route requires, for error messages: required fields and the body shape."""

    def __init__(self, required: tuple[str, ...], list_field: str, usage: str) -> None:
        self.required = required
        self.list_field = list_field
        self.usage = usage


_ALLOCATE = _Op(("rank", "keys"), "keys", '{"rank": <int>, "keys": [["<key>", "<prefix>"], ...]}')
_CONFIRM = _Op(
    ("rank", "confirmations"),
    "confirmations",
    '{"rank": <int>, "confirmations": [["<key>", <page>], ...], "pages_to_release": [<page>]}',
)
_EXISTS = _Op(("keys",), "keys", '{"keys": ["<key>", ...]}')
_LOCATIONS = _Op(("rank", "keys"), "keys", '{"rank": <int>, "keys": ["<key>", ...]}')


def _body(raw: bytes) -> bytes:
    return b"{}" if not raw or raw.isspace() else raw


def _not_json(exc: Exception, usage: str) -> InvalidRequest:
    return InvalidRequest(f"Request body is not valid JSON ({exc}). Expected {usage}")


def _decode(decoder: msgspec.json.Decoder[T], raw: bytes, op: _Op) -> T:
    """Decode a body; on failure raise the reference server's message, made actionable.

    Raises:
        InvalidRequest: naming the missing or wrong field and the shape expected.
    """
    body = _body(raw)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _diagnose(body, op, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise _not_json(exc, op.usage) from None


def _diagnose(body: bytes, op: _Op, detail: str) -> InvalidRequest:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return _not_json(exc, op.usage)
    need = " and ".join(f"'{name}'" for name in op.required)
    if not isinstance(data, dict):
        return InvalidRequest(
            f"Invalid request format: need {need} in a JSON object, got "
            f"{type(data).__name__}. Send {op.usage}"
        )
    missing = [name for name in op.required if data.get(name) is None]
    if missing:
        return InvalidRequest(
            f"Invalid request format: need {need} (missing {', '.join(missing)}). Send {op.usage}",
            missing[0],
        )
    if not isinstance(data[op.list_field], list):
        return InvalidRequest(
            f"Invalid {op.list_field} format: `{op.list_field}` must be a list, got "
            f"{type(data[op.list_field]).__name__}. Send {op.usage}",
            op.list_field,
        )
    return InvalidRequest(f"Invalid request format: {detail}. Send {op.usage}")


def _init_fields(raw: bytes) -> dict[str, Any]:
    body = _body(raw)
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(
            f"{INIT_ERROR}the body is not valid JSON ({exc}); {VALID_INIT}"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest(
            f"{INIT_ERROR}the body must be a JSON object, got {type(data).__name__}; " + VALID_INIT
        )
    return data


def add_routes(app: App, service: Service) -> None:
    """Register every dialect-V route on ``app``."""
    allocate_dec = msgspec.json.Decoder(AllocateBody)
    confirm_dec = msgspec.json.Decoder(ConfirmBody)
    exists_dec = msgspec.json.Decoder(ExistsBody)
    locations_dec = msgspec.json.Decoder(LocationsBody)

    async def initialize(req: Request, rank: int) -> Response:
        data = _init_fields(req.body)
        fields = {k: data[k] for k in ("role", "num_pages", "world_size") if k in data}
        worker = check_initialize(rank, **fields)
        if worker is None:
            return json_response({"message": SCHEDULER_MESSAGE})
        try:
            result = await service.v_register(rank, worker.num_pages, worker.world_size)
        except InvalidRequest as exc:  # a service limit such as --max-pages
            raise InvalidRequest(INIT_ERROR + str(exc), exc.field) from None
        message = worker_message(rank, result.num_pages, result.requested)
        return json_response({"message": message})

    async def batch_allocate(req: Request, _: int) -> Response:
        body = _decode(allocate_dec, req.body, _ALLOCATE)
        keys = body.keys
        if not all(map(isinstance, keys, repeat(str))):  # checked in C: usually plain keys
            keys = [k if isinstance(k, str) else k[0] for k in keys]
        out = await service.reserve(PoolId("v", body.rank, ""), keys)  # type: ignore[arg-type]
        results = list(zip(keys, map(_second, out), strict=True))
        return json_response({"rank": body.rank, "results": results})

    async def confirm_write(req: Request, _: int) -> Response:
        body = _decode(confirm_dec, req.body, _CONFIRM)
        try:
            await service.confirm(
                PoolId("v", body.rank, ""), body.confirmations, body.pages_to_release
            )
        except InvalidRequest as exc:
            raise confirm_error(exc) from None
        return NO_CONTENT

    async def batch_exists(req: Request, _: int) -> Response:
        body = _decode(exists_dec, req.body, _EXISTS)
        return json_response({"exists": await service.v_exists(body.keys)})

    async def get_locations(req: Request, _: int) -> Response:
        body = _decode(locations_dec, req.body, _LOCATIONS)
        out = await service.get(PoolId("v", body.rank, ""), body.keys)
        return json_response({"locations": out})

    async def clear(req: Request, _: int) -> Response:
        # The body is ignored, as in the reference: vLLM's /clear takes no parameters.
        await service.v_clear()
        return NO_CONTENT

    # Operator routes (kvmeta's own, behind --auth-token like every route but /health): see the
    # registry, remove a stray or retired rank, pin or unpin the ranks a block needs.

    async def vllm_index(req: Request, _: int) -> Response:
        return json_response((await service.v_index()).view())

    async def remove_rank(req: Request, rank: int) -> Response:
        # The body is ignored: the rank is in the path.
        dropped = await service.v_remove(rank)
        index = await service.v_index()
        return json_response(
            {
                "rank": rank,
                "removed": dropped is not None,
                "keys_dropped": dropped or 0,
                "required": index.required,
                "message": remove_message(rank, dropped, index),
            }
        )

    async def world_size(req: Request, _: int) -> Response:
        try:
            data = msgspec.json.decode(_body(req.body))
        except msgspec.DecodeError as exc:
            raise InvalidRequest(
                f"Request body is not valid JSON ({exc}). {WORLD_SIZE_USAGE}", "world_size"
            ) from None
        size = check_world_size_body(data)
        await service.v_set_world_size(size)
        index = await service.v_index()
        return json_response(
            {"world_size": size, "required": index.required, "message": completeness(index)}
        )

    app.add("GET", "/v1/vllm", vllm_index)
    app.add("POST", "/v1/vllm/ranks/{rank}/remove", remove_rank)
    app.add("POST", "/v1/vllm/world_size", world_size)
    app.add("POST", "/rank/{rank}/initialize", initialize)
    app.add("POST", "/keys/batch_allocate", batch_allocate)
    app.add("POST", "/keys/confirm_write", confirm_write)
    app.add("POST", "/keys/batch_exists", batch_exists)
    app.add("POST", "/keys/get_locations", get_locations)
    app.add("POST", "/clear", clear)
