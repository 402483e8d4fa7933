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
from kvmeta.server.app import (
    NO_CONTENT,
    App,
    BodyDecoder,
    CallerWarning,
    json_response,
    nested_error,
    reply,
    unknown_fields_warning,
)
from kvmeta.server.http import Request, Response
from kvmeta.service.ops import Service
from kvmeta.service.vllm import (
    INIT_ERROR,
    INIT_FIELDS,
    SCHEDULER_MESSAGE,
    VALID_INIT,
    WORLD_SIZE_USAGE,
    check_initialize,
    check_world_size_body,
    completeness,
    remove_message,
    worker_message,
)
from kvmeta.service.warnings import confirm_refused, size_conflict

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


def _decode(decoder: BodyDecoder[T], raw: bytes) -> tuple[T, list[CallerWarning]]:
    """Decode a body; on failure raise the reference server's message, made actionable
    (``_diagnose``).

    Raises:
        InvalidRequest: naming the missing or wrong field and the shape expected.
    """
    return decoder.decode(_body(raw))


def _diagnose(body: bytes, op: _Op, detail: str) -> InvalidRequest:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return _not_json(exc, op.usage)
    except msgspec.ValidationError as exc:  # e.g. an integer of thousands of digits
        return InvalidRequest(f"Invalid request format: {exc}. Send {op.usage}", _at(str(exc)))
    except RecursionError:
        return nested_error(op.usage, "Invalid request format: ")
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
    return InvalidRequest(f"Invalid request format: {detail}. Send {op.usage}", _at(detail))


def _at(detail: str) -> str | None:
    """The top-level field a msgspec error's JSON path names (`$.rank` -> rank)."""
    if "- at `$." not in detail:
        return None
    return detail.rsplit("- at `$.", 1)[1].rstrip("`").split("[", 1)[0].split(".", 1)[0]


def _decoder(struct: type[T], op: _Op) -> BodyDecoder[T]:
    return BodyDecoder(struct, op.usage, lambda body, detail: _diagnose(body, op, detail))


_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _init_fields(raw: bytes) -> dict[str, Any]:
    body = _body(raw)
    try:
        data = msgspec.json.decode(body)
    except msgspec.ValidationError as exc:  # valid JSON, but e.g. an integer of 5000 digits
        raise _out_of_range(body, exc) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(
            f"{INIT_ERROR}the body is not valid JSON ({exc}); {VALID_INIT}"
        ) from None
    except RecursionError:
        raise nested_error(VALID_INIT, INIT_ERROR) from None
    if not isinstance(data, dict):
        raise InvalidRequest(
            f"{INIT_ERROR}the body must be a JSON object, got {type(data).__name__}; " + VALID_INIT
        )
    return data


def _out_of_range(body: bytes, exc: msgspec.ValidationError) -> InvalidRequest:
    """Name the field whose value the untyped decoder refused (the error path only)."""
    try:
        fields = _RAW_FIELDS.decode(body)
    except (msgspec.DecodeError, RecursionError):
        fields = {}
    for name, value in fields.items():
        try:
            msgspec.json.decode(value)
        except msgspec.ValidationError:
            return InvalidRequest(
                f"{INIT_ERROR}`{name}` is out of range ({exc}); {VALID_INIT}", name
            )
    return InvalidRequest(f"{INIT_ERROR}a value is out of range ({exc}); {VALID_INIT}")


def add_routes(app: App, service: Service) -> None:
    """Register every dialect-V route on ``app``."""
    allocate_dec = _decoder(AllocateBody, _ALLOCATE)
    confirm_dec = _decoder(ConfirmBody, _CONFIRM)
    exists_dec = _decoder(ExistsBody, _EXISTS)
    locations_dec = _decoder(LocationsBody, _LOCATIONS)

    async def initialize(req: Request, rank: int) -> Response:
        data = _init_fields(req.body)
        fields = {k: data[k] for k in INIT_FIELDS if k in data}
        warnings: list[CallerWarning] = []
        extra = [k for k in data if k not in INIT_FIELDS]
        if extra:
            warnings.append(unknown_fields_warning(extra, INIT_FIELDS))
        worker = check_initialize(rank, **fields)
        if worker is None:
            return reply(json_response({"message": SCHEDULER_MESSAGE}), warnings)
        try:
            result = await service.v_register(rank, worker.num_pages, worker.world_size)
        except InvalidRequest as exc:  # a service limit such as --max-pages
            raise InvalidRequest(INIT_ERROR + str(exc), exc.field) from None
        if result.conflict:
            warnings.append(size_conflict(PoolId("v", rank, ""), result))
        message = worker_message(rank, result.num_pages, result.requested)
        return reply(json_response({"message": message}), warnings)

    async def batch_allocate(req: Request, _: int) -> Response:
        body, warnings = _decode(allocate_dec, req.body)
        keys = body.keys
        if not all(map(isinstance, keys, repeat(str))):  # checked in C: usually plain keys
            keys = [k if isinstance(k, str) else k[0] for k in keys]
        out = await service.reserve(PoolId("v", body.rank, ""), keys)  # type: ignore[arg-type]
        results = list(zip(keys, map(_second, out), strict=True))
        return reply(json_response({"rank": body.rank, "results": results}), warnings)

    async def confirm_write(req: Request, _: int) -> Response:
        body, warnings = _decode(confirm_dec, req.body)
        refused = await service.confirm(
            PoolId("v", body.rank, ""), body.confirmations, body.pages_to_release
        )
        if refused:
            warnings.append(confirm_refused(refused))
        return reply(NO_CONTENT, warnings)

    async def batch_exists(req: Request, _: int) -> Response:
        body, warnings = _decode(exists_dec, req.body)
        return reply(json_response({"exists": await service.v_exists(body.keys)}), warnings)

    async def get_locations(req: Request, _: int) -> Response:
        body, warnings = _decode(locations_dec, req.body)
        out = await service.get(PoolId("v", body.rank, ""), body.keys)
        return reply(json_response({"locations": out}), warnings)

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
