"""The OpenAPI document: every route the server serves is described, every schema is valid
JSON Schema 2020-12, and the dialect routes of docs/protocol.md are all in the catalogue."""

from __future__ import annotations

import msgspec
import pytest
from jsonschema import Draft202012Validator

from kvmeta.config import Settings
from kvmeta.server.openapi import CATALOGUE, SCHEMAS, build_document
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore


def served_routes() -> list[tuple[str, str]]:
    app = build_app(Settings(in_memory=True), Service(LocalBackend(MemoryStore())))
    return app.routes()


def test_every_served_route_is_described() -> None:
    routes = served_routes()
    missing = [r for r in routes if r not in CATALOGUE]
    assert not missing, f"describe these routes in server/openapi.py CATALOGUE: {missing}"
    doc = build_document(routes, "0", auth=False)
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == set(routes)


def test_both_dialects_are_catalogued() -> None:
    sglang = ["initialize", "exists", "reserve_and_allocate_page_indices", "confirm_write"]
    sglang += ["get_page_indices", "delete_keys", "clear"]
    for op in sglang:
        assert ("POST", f"/{{rank}}/{op}") in CATALOGUE
    vllm = ["/rank/{rank}/initialize", "/clear"]
    vllm += [f"/keys/{op}" for op in ("batch_allocate", "confirm_write", "batch_exists")]
    vllm += ["/keys/get_locations"]
    for path in vllm:
        assert ("POST", path) in CATALOGUE


def test_schemas_are_valid_json_schema() -> None:
    for name, schema in SCHEMAS.items():
        Draft202012Validator.check_schema({"$comment": name, **schema})
    doc = build_document(served_routes(), "0", auth=True)
    assert doc["openapi"].startswith("3.1")
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["paths"]["/ready"]["get"]["security"] == [{}, {"bearer": []}, {"basic": []}]
    assert "401" not in doc["paths"]["/ready"]["get"]["responses"]
    refs = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    for ref in refs:
        assert ref.removeprefix("#/components/schemas/") in SCHEMAS, ref


def test_request_schemas_are_generated_from_the_structs_the_routes_decode() -> None:
    """One description per body: the document's request schema of every route is the schema
    of the Struct that route's handler decodes its body with."""
    from kvmeta.server import ops_routes, prefix_routes, sglang, vllm
    from kvmeta.server.openapi import REQUEST_BODIES, struct_schema

    seen = set()
    for route in sglang.ROUTES + vllm.ROUTES + ops_routes.ROUTES + prefix_routes.ROUTES:
        spec = CATALOGUE[(route.method, route.pattern)]
        body = spec.get("requestBody")
        if route.body is None:
            assert body is None, f"{route.pattern} reads no body but documents one"
            continue
        ref = body["content"]["application/json"]["schema"]["$ref"]
        name = ref.removeprefix("#/components/schemas/")
        assert REQUEST_BODIES[name] is route.body.struct, route.pattern
        assert SCHEMAS[name] == struct_schema(route.body.struct)
        seen.add(name)
    assert seen == set(REQUEST_BODIES)


# (schema name, a body the Struct decodes, a body it refuses)
EXAMPLES = [
    ("SInitialize", {"num_pages": 8, "namespace": "mamba"}, {"num_pages": "8"}),
    ("SKeys", {"keys": ["a"]}, {"keys": "a"}),
    ("SReserve", {"keys": [["a", None], ["b", "a"]]}, {"keys": [["a"]]}),
    (
        "SConfirm",
        {"written_keys_to_confirm": [["a", 1]], "pages_to_release": [2]},
        {"pages_to_release": ["x"]},
    ),
    ("SNamespace", {}, {"namespace": 1}),
    ("VAllocate", {"rank": 0, "keys": ["a", ["b", None]]}, {"rank": "0", "keys": []}),
    ("VConfirm", {"rank": 1, "confirmations": [["a", 3]]}, {"rank": 1}),
    ("VKeys", {"keys": ["a"]}, {"keys": [1]}),
    ("VRankKeys", {"rank": 2, "keys": []}, {"keys": []}),
]


def test_generated_schemas_accept_and_refuse_what_the_structs_do() -> None:
    from kvmeta.server.openapi import REQUEST_BODIES

    for name, good, bad in EXAMPLES:
        validator = Draft202012Validator(SCHEMAS[name])
        decoder = msgspec.json.Decoder(REQUEST_BODIES[name])
        validator.validate(good)
        decoder.decode(msgspec.json.encode(good))
        assert not validator.is_valid(bad), (name, bad)
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.json.encode(bad))
