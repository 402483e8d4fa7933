"""Dialect V: vLLM's HF3FS connector routes (``/rank/{rank}/initialize``, ``/keys/*``, ``/clear``),
plus kvmeta's operator routes for the rank registry (``/v1/vllm``).

Wire shapes only. Each worker rank is its own pool ``PoolId("v", rank, "", tenant)``, apart from
SGLang's pools of the same rank numbers, and each tenant (``access.tenant_of``: the token's) has
its own registry of ranks; the key-centric view vLLM expects (a key is present when every
worker rank stored it) is ``service.v_exists``. ``ROUTES`` is the route table; each handler is
``handler(service, request, rank)``.

Every body goes through a ``BodyDecoder`` of a typed Struct (the fast path), which is also its
OpenAPI request schema. Only when decoding fails is the body looked at again, to answer in the
reference server's words (``Invalid request format: need 'rank' and 'keys'``, ``Invalid keys
format``) plus the field that is wrong and the fix. The initialize and world-size bodies take
any JSON values (``Any``): the service checks them, in the words the in-process client uses too;
their ``Meta`` annotations only describe the valid values in the document.
"""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter
from typing import Annotated, Any
from urllib.parse import parse_qsl

import msgspec

from kvmeta.errors import InvalidRequest
from kvmeta.server.access import scope_of, tenant_of, vllm_pool
from kvmeta.server.app import (
    NO_CONTENT,
    App,
    BodyDecoder,
    CallerWarning,
    Explain,
    Route,
    add_table,
    json_response,
    nested_error,
    reply,
    unknown_fields_warning,
)
from kvmeta.server.http import Request, Response
from kvmeta.server.metrics import PREFIX_HITS, REFUSED_BATCHES
from kvmeta.service.ops import Service
from kvmeta.service.vllm import (
    INIT_ERROR,
    INIT_FIELDS,
    VALID_INIT,
    WORLD_SIZE_USAGE,
    check_world_size_body,
    completeness,
    remove_message,
)

__all__ = ["ROUTES", "add_routes"]

_second = itemgetter(1)


_RANK = msgspec.Meta(
    description="a rank must fit in a signed 64-bit integer; larger is 400 (422 in a path)",
    extra_json_schema={"format": "int64"},
)
Rank = Annotated[int, _RANK]
_KEY = msgspec.Meta(
    description="a key, or [key, prefix key]; the first key's prefix key, when not empty or null, "
    "names the key before it in its chain (an eviction hint); the others' are not read"
)


class AllocateBody(msgspec.Struct):
    """Keys to allocate a page for on one rank."""

    rank: Rank
    keys: list[Annotated[tuple[str, str | None] | str, _KEY]]


class ConfirmBody(msgspec.Struct):
    """Pages written on one rank (committed) and pages to give back."""

    rank: Rank
    confirmations: list[tuple[str, int]]
    pages_to_release: list[int] = []


class ExistsBody(msgspec.Struct):
    """Keys to look for on every required rank."""

    keys: list[str]


class LocationsBody(msgspec.Struct):
    """Keys to look up on one rank."""

    rank: Rank
    keys: list[str]


_UNSET: Any = msgspec.UNSET


class InitializeBody(msgspec.Struct):
    """Register a worker rank, or acknowledge the scheduler (checked by the service)."""

    # The fields are service.vllm.INIT_FIELDS, in that order (a test checks it).

    role: Annotated[
        Any, msgspec.Meta(extra_json_schema={"enum": ["worker", "scheduler"], "default": "worker"})
    ] = _UNSET
    num_pages: Annotated[Any, msgspec.Meta(extra_json_schema={"type": "integer", "default": 0})] = (
        _UNSET
    )
    world_size: Annotated[
        Any,
        msgspec.Meta(
            description="kvmeta extension: ranks 0..world_size-1 make a key complete; at most "
            "--max-world-size (default 4096)",
            extra_json_schema={"type": "integer", "minimum": 1},
        ),
    ] = _UNSET


class WorldSizeBody(msgspec.Struct):
    """Pin the ranks a block needs to 0..world_size-1, or unpin them (null)."""

    world_size: Annotated[
        Any,
        msgspec.Meta(
            description="null unsets", extra_json_schema={"type": ["integer", "null"], "minimum": 1}
        ),
    ] = _UNSET


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


def _not_json(exc: Exception, usage: str) -> InvalidRequest:
    return InvalidRequest(f"Request body is not valid JSON ({exc}). Expected {usage}")


def _not_valid_json(exc: Exception) -> bool:
    """Malformed JSON, as opposed to JSON of the wrong shape (a subclass of DecodeError)."""
    return isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError)


def _explainer(op: _Op) -> Explain:
    """The reference server's message for a body ``op`` refused, made actionable."""

    def explain(body: bytes, exc: Exception) -> InvalidRequest:
        if isinstance(exc, RecursionError):
            return nested_error(op.usage)
        if _not_valid_json(exc):
            return _not_json(exc, op.usage)
        return _diagnose(body, op, str(exc))

    return explain


def _diagnose(body: bytes, op: _Op, detail: str) -> InvalidRequest:
    try:
        data = msgspec.json.decode(body)
    except msgspec.ValidationError as exc:  # e.g. an integer of thousands of digits
        return InvalidRequest(f"Invalid request format: {exc}. Send {op.usage}", _at(str(exc)))
    except msgspec.DecodeError as exc:  # (ValidationError is a DecodeError: checked first)
        return _not_json(exc, op.usage)
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


_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _explain_init(body: bytes, exc: Exception) -> InvalidRequest:
    if isinstance(exc, RecursionError):
        return nested_error(VALID_INIT, INIT_ERROR)
    if _not_valid_json(exc):
        return InvalidRequest(f"{INIT_ERROR}the body is not valid JSON ({exc}); {VALID_INIT}")
    try:
        data = msgspec.json.decode(body)
    except msgspec.ValidationError as err:  # valid JSON, but e.g. an integer of 5000 digits
        return _out_of_range(body, err)
    except msgspec.DecodeError as err:  # the typed decoder stopped first at a wrong shape
        return InvalidRequest(f"{INIT_ERROR}the body is not valid JSON ({err}); {VALID_INIT}")
    return InvalidRequest(
        f"{INIT_ERROR}the body must be a JSON object, got {type(data).__name__}; " + VALID_INIT
    )


def _explain_world_size(body: bytes, exc: Exception) -> InvalidRequest:
    if isinstance(exc, RecursionError):
        return nested_error('{"world_size": <int > 0 or null>}')
    if _not_valid_json(exc):
        return InvalidRequest(
            f"Request body is not valid JSON ({exc}). {WORLD_SIZE_USAGE}", "world_size"
        )
    try:
        check_world_size_body(msgspec.json.decode(body))
    except InvalidRequest as err:  # not an object
        return err
    except msgspec.ValidationError as err:  # e.g. an integer of 5000 digits
        return InvalidRequest(f"`world_size` is out of range ({err}). {WORLD_SIZE_USAGE}")
    except msgspec.DecodeError as err:  # the typed decoder stopped first at a wrong shape
        return InvalidRequest(
            f"Request body is not valid JSON ({err}). {WORLD_SIZE_USAGE}", "world_size"
        )
    return InvalidRequest(f"Invalid request body: {exc}. {WORLD_SIZE_USAGE}", "world_size")


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


ALLOCATE = BodyDecoder(AllocateBody, _ALLOCATE.usage, _explainer(_ALLOCATE))
CONFIRM = BodyDecoder(ConfirmBody, _CONFIRM.usage, _explainer(_CONFIRM))
EXISTS = BodyDecoder(ExistsBody, _EXISTS.usage, _explainer(_EXISTS))
LOCATIONS = BodyDecoder(LocationsBody, _LOCATIONS.usage, _explainer(_LOCATIONS))
INITIALIZE = BodyDecoder(InitializeBody, VALID_INIT, _explain_init)
WORLD_SIZE = BodyDecoder(WorldSizeBody, WORLD_SIZE_USAGE, _explain_world_size)


async def initialize(service: Service, req: Request, rank: int) -> Response:
    body, warnings = INITIALIZE.decode(req.body)
    fields = {k: v for k in INIT_FIELDS if (v := getattr(body, k)) is not _UNSET}
    # Which ranks make a block complete is the tenant's setting: a worker's (write) token may
    # pin the first world size or repeat it, only an admin token may move it.
    change_world = "admin" in scope_of(req).rights
    done = await service.v_initialize(
        rank, **fields, tenant=tenant_of(req), change_world=change_world
    )
    warnings += done.warnings
    return reply(json_response({"message": done.value}), warnings)


async def batch_allocate(service: Service, req: Request, _: int) -> Response:
    body, warnings = ALLOCATE.decode(req.body)
    keys = body.keys
    first = keys[0] if keys else None
    parent = None if first is None or isinstance(first, str) else first[1]
    if not all(map(isinstance, keys, repeat(str))):  # checked in C: usually plain keys
        keys = [k if isinstance(k, str) else k[0] for k in keys]
    done = await service.v_allocate(
        vllm_pool(req, body.rank),
        keys,  # type: ignore[arg-type]
        parent,
    )
    results = list(zip(keys, map(_second, done.value), strict=True))
    if done.warnings:
        REFUSED_BATCHES["v"] += 1
        warnings += done.warnings
    return reply(json_response({"rank": body.rank, "results": results}), warnings)


async def confirm_write(service: Service, req: Request, _: int) -> Response:
    body, warnings = CONFIRM.decode(req.body)
    done = await service.confirm(
        vllm_pool(req, body.rank), body.confirmations, body.pages_to_release
    )
    warnings += done.warnings
    return reply(NO_CONTENT, warnings)


async def batch_exists(service: Service, req: Request, _: int) -> Response:
    body, warnings = EXISTS.decode(req.body)
    out = await service.v_exists(body.keys, tenant_of(req))
    PREFIX_HITS.record_vllm(out, tenant_of(req))
    return reply(json_response({"exists": out}), warnings)


async def get_locations(service: Service, req: Request, _: int) -> Response:
    body, warnings = LOCATIONS.decode(req.body)
    out = await service.get(vllm_pool(req, body.rank), body.keys)
    return reply(json_response({"locations": out}), warnings)


async def clear(service: Service, req: Request, _: int) -> Response:
    # The body is ignored, as in the reference: vLLM's /clear takes no parameters.
    await service.v_clear(tenant_of(req))
    return NO_CONTENT


# Operator routes (kvmeta's own, behind --auth-token like every route but /health): see the
# registry, remove a stray or retired rank, pin or unpin the ranks a block needs.


async def vllm_index(service: Service, req: Request, _: int) -> Response:
    return json_response((await service.v_index(tenant_of(req))).view())


_REMOVE_PARAMS = ("force",)
_FLAGS = {"true": True, "1": True, "false": False, "0": False}


def _force(query: str) -> tuple[bool, list[CallerWarning]]:
    """The ``force`` query parameter of a removal (absent: false); other parameters are
    named in a warning."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, max_num_fields=8)
    except ValueError:
        raise InvalidRequest(
            "too many query parameters; a removal reads `force`", "force"
        ) from None
    values = [value for name, value in pairs if name == "force"]
    if len(values) > 1:
        raise InvalidRequest("query parameter `force` is given twice; give it once", "force")
    force = _FLAGS.get(values[0].lower()) if values else False
    if force is None:
        raise InvalidRequest(
            f"query parameter `force` must be true or false (or 1 or 0), got {values[0][:40]!r}",
            "force",
        )
    unknown = [name[:64] for name, _ in pairs if name != "force"]
    return force, [unknown_fields_warning(unknown, _REMOVE_PARAMS)] if unknown else []


async def remove_rank(service: Service, req: Request, rank: int) -> Response:
    # The body is ignored: the rank is in the path, ``force`` in the query.
    force, warnings = _force(req.query)
    tenant = tenant_of(req)
    dropped = await service.v_remove(rank, tenant, force)
    index = await service.v_index(tenant)
    return reply(
        json_response(
            {
                "rank": rank,
                "removed": dropped is not None,
                "keys_dropped": dropped or 0,
                "required": index.required,
                "message": remove_message(rank, dropped, index),
            }
        ),
        warnings,
    )


async def world_size(service: Service, req: Request, _: int) -> Response:
    body, warnings = WORLD_SIZE.decode(req.body)
    tenant = tenant_of(req)
    given = {} if body.world_size is _UNSET else {"world_size": body.world_size}
    size = await service.v_set_world_size(**given, tenant=tenant)
    index = await service.v_index(tenant)
    return reply(
        json_response(
            {"world_size": size, "required": index.required, "message": completeness(index)}
        ),
        warnings,
    )


ROUTES = (
    Route("GET", "/v1/vllm", vllm_index),
    Route("POST", "/v1/vllm/ranks/{rank}/remove", remove_rank),
    Route("POST", "/v1/vllm/world_size", world_size, WORLD_SIZE),
    Route("POST", "/rank/{rank}/initialize", initialize, INITIALIZE),
    Route("POST", "/keys/batch_allocate", batch_allocate, ALLOCATE),
    Route("POST", "/keys/confirm_write", confirm_write, CONFIRM),
    Route("POST", "/keys/batch_exists", batch_exists, EXISTS),
    Route("POST", "/keys/get_locations", get_locations, LOCATIONS),
    Route("POST", "/clear", clear),
)


def add_routes(app: App, service: Service) -> None:
    """Register every dialect-V route on ``app``."""
    add_table(app, ROUTES, service)
