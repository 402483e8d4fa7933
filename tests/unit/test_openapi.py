"""The OpenAPI document: every route the server serves is described, every schema is valid
JSON Schema 2020-12, and the dialect routes of docs/protocol.md are all in the catalogue."""

from __future__ import annotations

from jsonschema import Draft202012Validator

from kvmeta.config import Settings
from kvmeta.server.openapi import CATALOGUE, SCHEMAS, build_document
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from kvmeta.store.memory import MemoryBackend, MemoryStore


def served_routes() -> list[tuple[str, str]]:
    app = build_app(Settings(in_memory=True), Service(MemoryBackend(MemoryStore())))
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
