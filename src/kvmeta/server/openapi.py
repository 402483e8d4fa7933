"""The OpenAPI 3.1 document served at ``/openapi.json``.

Request bodies are generated from the msgspec Structs the routes decode them with
(``REQUEST_BODIES``), so each body is described once, where it is read. Responses and errors
are written by hand from the wire contract (``docs/protocol.md``): the document says what a
stock client gets back, errors included. ``CATALOGUE`` describes every route kvmeta knows;
``build_document`` publishes the ones the running app really serves, and a test checks that
every served route is described, so the document cannot silently fall behind the server.
The fuzz test (``tests/fuzz``) generates requests from it and validates every answer against it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmeta.server import prefix_routes, sglang, vllm
from kvmeta.service.limits import MAX_DUMP_LIMIT, MAX_PREFIX_POOLS

__all__ = ["CATALOGUE", "REQUEST_BODIES", "SCHEMAS", "build_document", "struct_schema"]

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = False) -> Schema:
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


def _pair(first: Schema, second: Schema) -> Schema:
    return {"type": "array", "prefixItems": [first, second], "minItems": 2, "maxItems": 2}


def _list(items: Schema) -> Schema:
    return {"type": "array", "items": items}


STR: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
BOOL: Schema = {"type": "boolean"}
NUM: Schema = {"type": "number"}
INT_OR_NULL: Schema = {"type": ["integer", "null"]}
KEY_PAGE = _pair(STR, INT)

# Request bodies by schema name: the Structs the routes decode (each route's ``Route.body``).
REQUEST_BODIES: dict[str, type[msgspec.Struct]] = {
    "SInitialize": sglang.InitializeBody,
    "SKeys": sglang.KeysBody,
    "SReserve": sglang.ReserveBody,
    "SConfirm": sglang.ConfirmBody,
    "SNamespace": sglang.NamespaceBody,
    "VInitialize": vllm.InitializeBody,
    "VAllocate": vllm.AllocateBody,
    "VConfirm": vllm.ConfirmBody,
    "VKeys": vllm.ExistsBody,
    "VRankKeys": vllm.LocationsBody,
    "VWorldSize": vllm.WorldSizeBody,
    "PrefixMatch": prefix_routes.PrefixMatchBody,
}


def _plain(node: Any) -> Any:
    """``anyOf`` of bare types as one ``type`` list (``{"type": ["string", "null"]}``), which
    reads better and is what the rest of the document uses."""
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _plain(v) for k, v in node.items()}
    alts = node.get("anyOf")
    if alts and all(set(a) == {"type"} and isinstance(a["type"], str) for a in alts):
        del node["anyOf"]
        node["type"] = [a["type"] for a in alts]
    return node


def struct_schema(struct: type[msgspec.Struct]) -> Schema:
    """The JSON Schema of a body Struct: msgspec's, without the Python class name."""
    # A nested Struct is a reference to its own entry in SCHEMAS, under its class name.
    _, components = msgspec.json.schema_components(
        [struct], ref_template="#/components/schemas/{name}"
    )
    schema = dict(components[struct.__name__])
    schema.pop("title", None)
    if not schema.get("required", True):
        del schema["required"]
    return _plain(schema)  # type: ignore[no-any-return]


SCHEMAS: dict[str, Schema] = {
    **{name: struct_schema(struct) for name, struct in REQUEST_BODIES.items()},
    "PrefixPool": struct_schema(prefix_routes.PrefixPool),  # an item of PrefixMatch.pools
    "Error": _obj({"detail": STR}, ("detail",)),
    # dialect S
    "Exists": _obj({"exists": _list(BOOL)}, ("exists",), closed=True),
    "SReserved": _obj({"indices": _list(_pair(BOOL, INT))}, ("indices",), closed=True),
    "SIndices": _obj({"indices": _list(INT_OR_NULL)}, ("indices",), closed=True),
    # dialect V
    "VMessage": _obj({"message": STR}, ("message",), closed=True),
    "VAllocated": _obj({"rank": INT, "results": _list(KEY_PAGE)}, ("rank", "results"), closed=True),
    "VLocations": _obj({"locations": _list(INT_OR_NULL)}, ("locations",), closed=True),
    # operating the vLLM rank registry
    "VIndex": _obj(
        {
            "world_size": {
                "type": ["integer", "null"],
                "description": "pinned tensor-parallel size; null: not set",
            },
            "ranks": {**_list(INT), "description": "registered worker ranks"},
            "required": {
                **_list(INT),
                "description": "ranks a block must be stored on to be complete: 0..world_size-1, "
                "or without world_size the contiguous registered ranks from 0",
            },
            "ignored": {**_list(INT), "description": "registered but not counted (stray)"},
            "missing": {**_list(INT), "description": "required but not registered"},
        },
        ("world_size", "ranks", "required", "ignored", "missing"),
        closed=True,
    ),
    "VRemoved": _obj(
        {
            "rank": INT,
            "removed": {"type": "boolean", "description": "false: the rank was not registered"},
            "keys_dropped": INT,
            "required": _list(INT),
            "message": STR,
        },
        ("rank", "removed", "keys_dropped", "required", "message"),
        closed=True,
    ),
    "VWorldSizeSet": _obj(
        {"world_size": {"type": ["integer", "null"]}, "required": _list(INT), "message": STR},
        ("world_size", "required", "message"),
        closed=True,
    ),
    # operations
    "Health": _obj(
        {"status": {"const": "ok"}, "version": STR, "uptime_seconds": NUM, "epoch": STR},
        ("status",),
    ),
    "Ready": _obj({"ready": BOOL, "backend": STR}, ("ready",)),
    "NotReady": _obj({"detail": STR, "ready": BOOL}, ("ready",)),
    "Pool": _obj(
        {
            "dialect": {"enum": ["s", "v"]},
            "rank": INT,
            "namespace": STR,
            "num_pages": INT,
            "free": INT,
            "cooling": INT,
            "held_after_restart": INT,
            "reserved": INT,
            "stored": INT,
            "occupancy": NUM,
            "hit_rate": {"type": ["number", "null"]},
            "exists_hit_rate": {"type": ["number", "null"]},
            "size_conflicts": INT,
            "counters": {"type": "object", "additionalProperties": INT},
        },
        ("dialect", "rank", "namespace", "num_pages", "free", "reserved", "stored"),
    ),
    "Pools": _obj(
        {"server": {"type": "object"}, "pools": _list(_ref("Pool")), "vllm": _ref("VIndex")},
        ("pools",),
    ),
    "Status": _obj(
        {
            "server": {"type": "object"},
            "backend": {"type": "object"},
            "uptime_seconds": NUM,
            "time": NUM,
            "pools_at": {"type": ["number", "null"]},
            "pools": _list(_ref("Pool")),
            "history": {"type": "object"},
        },
        ("server", "backend", "pools", "history"),
    ),
    # router reads
    "PrefixMatches": _obj(
        {
            "matches": {
                **_list(
                    _obj(
                        {
                            "dialect": {"enum": ["sglang", "vllm"]},
                            "rank": INT,
                            "namespace": {**STR, "description": '"" for a vLLM pool'},
                            "length": {
                                **INT,
                                "minimum": 0,
                                "description": "how many of the pool's keys, from the first, "
                                "are stored (the walk stops at the first miss)",
                            },
                            "found": {
                                **BOOL,
                                "description": "false: no such pool (not initialised yet, or "
                                "not on this server); length is 0",
                            },
                        },
                        ("dialect", "rank", "namespace", "length", "found"),
                        closed=True,
                    )
                ),
                "description": "one per requested pool, in request order",
            }
        },
        ("matches",),
        closed=True,
    ),
    "Dump": _obj(
        {
            "keys": {**_list(STR), "description": "stored keys of this page (any order)"},
            "cursor": {
                **STR,
                "description": 'pass it as `cursor` for the next page; "": the walk is done',
            },
        },
        ("keys", "cursor"),
        closed=True,
    ),
    "Check": _obj(
        {"ok": BOOL, "checked": INT, "problems": _list(STR), "supported": BOOL},
        ("ok", "problems"),
    ),
}


def _json(schema: Schema, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": "malformed body (JSON nested too deeply included) or a value out of range: "
    "num_pages above --max-pages or, for a new pool, above what --max-total-pages has left; "
    "world_size above --max-world-size; a rank beyond a signed 64-bit integer. `detail` names "
    "the field and the fix; nothing was changed",
    "401": "--auth-token is set and the request lacks it",
    "404": "pool/rank not initialised (detail says how), or unknown path",
    "409": "the rank's pages are in use (reserved, being read, or a released page's grace): "
    "`detail` says for how long; nothing was changed. Retry once the leases end, or pass "
    "force=true if the rank's workers are gone for good",
    "413": "a size limit (body bytes, keys per request); `detail` names the flag to raise it",
    "403": "the Host header is not accepted (a loopback-bound server answers loopback names "
    "only; --allowed-hosts), a POST came from another origin's web page (its Origin), the "
    "token's scope (--auth-file) does not cover the request, or, on a vLLM initialize, a "
    "world_size that would move the tenant's pinned one from a token without the admin right; "
    "`detail` names which and the fix; nothing was changed",
    "415": "a POST with a Content-Type other than application/json (none is fine): a form or "
    "text body, which another site's web page can make a browser send; nothing was changed",
}


_WARNING = {
    "description": "a caller mistake answered as the reference servers do (one header per "
    "mistake): `<kind>: <what happened and the fix>`, kind one of size_conflict (initialize with "
    "another num_pages: the pool keeps its size), unknown_field (a body field the route does not "
    "read, with the closest known name), confirm_refused (how many pairs were not committed: "
    "page not reserved for that key). Counted in kvmeta_caller_warnings_total{kind}",
    "schema": STR,
}


_EPOCH = {
    "description": "on every reply, errors included: the backend's epoch, an opaque id that "
    "changes exactly when the server's state may have been lost or replaced (in-memory: each "
    "restart; --data-dir: a new data directory; Redis: Redis lost its data). A client that sees "
    "it change initialises its pools again (idempotent)",
    "schema": STR,
}


def _op(
    summary: str, body: str | None, ok: tuple[str, str | None], errors: tuple[str, ...]
) -> dict[str, Any]:
    """One operation; ``ok`` is (status, response schema name or None for no content)."""
    status, schema = ok
    responses: dict[str, Any] = {
        status: _json(_ref(schema), "success") if schema else {"description": "success, no body"}
    }
    if body is not None:
        responses[status]["headers"] = {"X-Kvmeta-Warning": _WARNING}
    for code in errors:
        responses[code] = _json(_ref("Error"), _ERRORS.get(code, "error"))
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {
            "required": False,
            "description": "JSON object, sent as application/json or with no Content-Type "
            "(another is 415); an empty body means {}",
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return op


_S = ("400", "401", "404", "413", "422")
_V = ("400", "401", "404", "413")
_AUTH = ("401",)

CATALOGUE: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/{rank}/initialize"): _op(
        "SGLang: create the pool (idempotent; another size keeps the pool and warns)",
        "SInitialize",
        ("204", None),
        ("400", "401", "413", "422"),
    ),
    ("POST", "/{rank}/exists"): _op(
        "SGLang: which keys are stored", "SKeys", ("200", "Exists"), _S
    ),
    ("POST", "/{rank}/reserve_and_allocate_page_indices"): _op(
        "SGLang: reserve a page per key ([true, p] stored, [false, p] write, [false, -1] none)",
        "SReserve",
        ("200", "SReserved"),
        _S,
    ),
    ("POST", "/{rank}/confirm_write"): _op(
        "SGLang: commit written pages, release failed ones", "SConfirm", ("204", None), _S
    ),
    ("POST", "/{rank}/get_page_indices"): _op(
        "SGLang: page of each key or null (grants a read lease)", "SKeys", ("200", "SIndices"), _S
    ),
    ("POST", "/{rank}/delete_keys"): _op("SGLang: forget keys", "SKeys", ("204", None), _S),
    ("POST", "/{rank}/clear"): _op(
        "SGLang: empty one pool (reservations in flight stay)", "SNamespace", ("204", None), _S
    ),
    ("POST", "/rank/{rank}/initialize"): _op(
        "vLLM: register a worker rank (or acknowledge the scheduler)",
        "VInitialize",
        ("200", "VMessage"),
        ("400", "401", "403", "413", "422"),
    ),
    ("POST", "/keys/batch_allocate"): _op(
        "vLLM: a page per key on one rank (-1: none)", "VAllocate", ("200", "VAllocated"), _V
    ),
    ("POST", "/keys/confirm_write"): _op(
        "vLLM: commit written pages, release failed ones", "VConfirm", ("204", None), _V
    ),
    ("POST", "/keys/batch_exists"): _op(
        "vLLM: keys confirmed by every registered rank", "VKeys", ("200", "Exists"), _V
    ),
    ("POST", "/keys/get_locations"): _op(
        "vLLM: page of each key on one rank, or null", "VRankKeys", ("200", "VLocations"), _V
    ),
    ("POST", "/clear"): _op(
        "vLLM: drop every key (rank registrations stay)", None, ("204", None), ("401",)
    ),
    ("GET", "/v1/vllm"): _op(
        "vLLM rank registry: world size, registered, required, ignored and missing ranks",
        None,
        ("200", "VIndex"),
        _AUTH,
    ),
    ("POST", "/v1/vllm/ranks/{rank}/remove"): {
        **_op(
            "vLLM: deregister a worker rank and drop its keys, durably (idempotent: an unknown "
            "rank answers removed=false). Refused (409) while its pages are in use, unless "
            "force=true",
            None,
            ("200", "VRemoved"),
            ("400", "401", "409", "422"),
        ),
        "parameters": [
            {
                "name": "force",
                "in": "query",
                "required": False,
                "schema": {"enum": ["true", "false", "1", "0"], "default": "false"},
                "description": "remove the rank even while its pages are reserved or being "
                "read: their writes and reads are dropped, and once the rank registers again "
                "its pages may go to new blocks while those still land. Only for workers that "
                "are gone for good",
            }
        ],
    },
    ("POST", "/v1/vllm/world_size"): _op(
        "vLLM: pin the ranks a block needs to 0..world_size-1, or unpin them (null)",
        "VWorldSize",
        ("200", "VWorldSizeSet"),
        ("400", "401", "413"),
    ),
    ("POST", "/v1/prefix_match"): _op(
        "routers: per pool, how many of the given page keys, from the first, are stored "
        "(O(request), stops at each pool's first miss; a pure read: no LRU touch, no lease, no "
        f"counter). Keys of all pools together <= --max-keys (413), at most {MAX_PREFIX_POOLS} "
        "pools (413); an unknown pool answers found=false, length 0. Each pool gives `keys` or, "
        "for an SGLang pool on a server run with --hash-index, `hashes`: the 64-bit block "
        "hashes of the KV event feed (400 naming `hashes` where the pool keeps no hash index)",
        "PrefixMatch",
        ("200", "PrefixMatches"),
        ("400", "401", "413"),
    ),
    ("GET", "/v1/dump"): {
        **_op(
            'indexers: one page of a pool\'s stored keys; follow `cursor` until it is "". '
            "A key stored for the whole walk is returned at least once (SCAN-like); one "
            "changed meanwhile may or may not be. A pure read",
            None,
            ("200", "Dump"),
            ("400", "401", "404"),
        ),
        "parameters": [
            {
                "name": "rank",
                "in": "query",
                "required": True,
                "schema": {"type": "integer", "format": "int64"},
                "description": "the pool's rank (SGLang) or the vLLM worker rank",
            },
            {
                "name": "namespace",
                "in": "query",
                "required": False,
                "schema": {"type": "string", "default": "kv"},
                "description": "SGLang pool name; ignored with dialect=vllm",
            },
            {
                "name": "dialect",
                "in": "query",
                "required": False,
                "schema": {"enum": ["sglang", "vllm"], "default": "sglang"},
            },
            {
                "name": "cursor",
                "in": "query",
                "required": False,
                "schema": {"type": "string", "default": ""},
                "description": '"" (or absent) to start, then each reply\'s `cursor`',
            },
            {
                "name": "limit",
                "in": "query",
                "required": False,
                "schema": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_DUMP_LIMIT,
                    "default": prefix_routes.DUMP_DEFAULT_LIMIT,
                },
                "description": "about this many keys per page (a Redis backend may return a "
                "few more, or fewer)",
            },
        ],
    },
    ("GET", "/health"): _op("process is up (never needs auth)", None, ("200", "Health"), ()),
    ("GET", "/ready"): _op(
        "backend loaded and reachable. Needs no token (a probe sends none): with auth on, only a "
        'valid token gets `backend` and the 503\'s `detail`, anyone else just {"ready": bool}',
        None,
        ("200", "Ready"),
        (),
    ),
    ("GET", "/metrics"): {
        "summary": "Prometheus text exposition",
        "responses": {
            "200": {"description": "metrics", "content": {"text/plain": {"schema": STR}}},
            "401": _json(_ref("Error"), _ERRORS["401"]),
        },
    },
    ("GET", "/v1/pools"): _op(
        "every pool's size, occupancy, hit rate and counters, and the server settings",
        None,
        ("200", "Pools"),
        _AUTH,
    ),
    ("GET", "/v1/check"): _op(
        "full page-invariant check of every pool: O(pool size), diagnostics only",
        None,
        ("200", "Check"),
        _AUTH,
    ),
    ("GET", "/v1/status"): _op(
        "what the status page shows: pools with per-pool rates, backend and journal state, and "
        "the last ~5 minutes of samples (requests/s by route, p50/p99 latency, hit ratio)",
        None,
        ("200", "Status"),
        _AUTH,
    ),
    **{
        ("GET", path): {
            "summary": summary,
            "responses": {
                "200": {"description": summary, "content": {ctype: {"schema": STR}}},
                "401": _json(_ref("Error"), _ERRORS["401"]),
            },
        }
        for path, ctype, summary in (
            ("/", "text/html", "the status page (same as /ui)"),
            ("/ui", "text/html", "the status page: pools, backend state and live charts"),
            ("/ui/status.js", "text/javascript", "the status page's script"),
            ("/ui/status.css", "text/css", "the status page's style"),
        )
    },
    ("GET", "/openapi.json"): {
        "summary": "this document",
        "responses": {
            "200": _json({"type": "object"}, "OpenAPI 3.1 document"),
            "401": _json(_ref("Error"), _ERRORS["401"]),
        },
    },
}
CATALOGUE[("GET", "/ready")]["responses"]["503"] = _json(_ref("NotReady"), "not ready, and why")
# A removal reads its query: an unknown parameter is named in a warning, as a body's field.
CATALOGUE[("POST", "/v1/vllm/ranks/{rank}/remove")]["responses"]["200"]["headers"] = {
    "X-Kvmeta-Warning": _WARNING
}
# Every request's Host is checked, and a change's Origin and Content-Type (server.guard).
for (_method, _path), _operation in CATALOGUE.items():
    _operation["responses"]["403"] = _json(_ref("Error"), _ERRORS["403"])
    if _method != "GET":
        _operation["responses"]["415"] = _json(_ref("Error"), _ERRORS["415"])
for _operation in CATALOGUE.values():  # every reply carries the epoch, errors included
    for _response in _operation["responses"].values():
        _response["headers"] = {**_response.get("headers", {}), "X-Kvmeta-Epoch": _EPOCH}

_RANK_PARAM = {
    "name": "rank",
    "in": "path",
    "required": True,
    "description": "integer rank (-1 and 007 parse as integers) that fits in a signed 64-bit "
    "integer; anything else is 422",
    "schema": {"type": "integer", "format": "int64"},
}


def build_document(routes: list[tuple[str, str]], version: str, auth: bool) -> dict[str, Any]:
    """The document for the (method, pattern) routes an app serves.

    Raises:
        KeyError: a served route has no description in ``CATALOGUE`` (a test catches it).
    """
    paths: dict[str, dict[str, Any]] = {}
    for method, pattern in routes:
        op = dict(CATALOGUE[(method, pattern)])
        if "{rank}" in pattern:
            op["parameters"] = [_RANK_PARAM, *op.get("parameters", ())]
        paths.setdefault(pattern, {})[method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kvmeta",
            "version": version,
            "description": (
                "KV-cache page metadata server speaking SGLang HiCache's and vLLM HF3FS's "
                "metadata protocols on one port, plus operator routes. Errors are "
                '{"detail": "..."}; unknown paths 404, wrong methods 405. Every reply carries '
                "X-Kvmeta-Epoch (see the responses' headers)."
            ),
        },
        "paths": paths,
        "components": {"schemas": SCHEMAS},
    }
    if auth:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "basic": {"type": "http", "scheme": "basic", "description": "token as the password"},
        }
        doc["security"] = [{"bearer": []}, {"basic": []}]
        if "/health" in paths:
            paths["/health"]["get"]["security"] = []
        if "/ready" in paths:  # the token is optional: it adds the detail
            paths["/ready"]["get"]["security"] = [{}, *doc["security"]]
    return doc
