"""Hypothesis strategies and response validation driven by kvmeta's ``/openapi.json``.

A hand-rolled subset of JSON Schema (what the document uses: object, array with items or
prefixItems, string, integer, number, boolean, null, enum, const, anyOf, $ref) rather than
schemathesis: it installs nothing and lets the generator favour values that make requests
interact (a small key set, in-range pages, a few namespaces), which finds more than uniformly
random values would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from hypothesis import strategies as st
from jsonschema import Draft202012Validator

KEYS = [f"k{i}" for i in range(12)] + ["", "ключ", "a" * 80, "x/y?z", "-v"]
NAMESPACES = ["kv", "mamba", "swa", "ns.1:a-b"]
RANKS = ["0", "1", "-1", "007", "2"]
BAD_RANKS = ["abc", "1.5", "", "%20", "99999999999999999999999", "+", "0x1"]


@dataclass(frozen=True)
class Operation:
    method: str
    pattern: str
    spec: dict[str, Any]


@dataclass(frozen=True)
class Call:
    """One request to send; ``op`` is None for paths that must not exist."""

    method: str
    path: str
    body: bytes | None
    op: Operation | None


class Schema:
    """The document, with $ref resolution, strategies and response validation."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.operations = [
            Operation(method.upper(), pattern, spec)
            for pattern, methods in sorted(doc["paths"].items())
            for method, spec in sorted(methods.items())
        ]

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema

    # ---------------------------------------------------------------- generation

    def values(self, schema: dict[str, Any], name: str = "") -> st.SearchStrategy[Any]:
        schema = self.resolve(schema)
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"]) | st.text(max_size=4)
        if "anyOf" in schema:
            return st.one_of([self.values(s, name) for s in schema["anyOf"]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.values({**schema, "type": k}, name) for k in kind])
        if kind == "object":
            props = schema.get("properties", {})
            required = set(schema.get("required", ()))
            return st.fixed_dictionaries(
                {k: self.values(v, k) for k, v in props.items() if k in required},
                optional={k: self.values(v, k) for k, v in props.items() if k not in required},
            )
        if kind == "array":
            if "prefixItems" in schema:
                return st.tuples(*(self.values(s) for s in schema["prefixItems"])).map(list)
            return st.lists(self.values(schema.get("items", {}), name), max_size=10)
        if kind == "string":
            if name == "namespace":
                return st.sampled_from(NAMESPACES) | st.text(max_size=6)
            return st.sampled_from(KEYS) | st.text(max_size=8)
        if kind == "integer":
            if name == "num_pages" or "minimum" in schema:
                return st.integers(1, 64) | st.integers(-5, 5000)
            if name == "rank":
                return st.integers(-1, 3)
            return st.integers(-3, 70) | st.integers(-(2**70), 2**70)
        if kind == "number":
            return st.floats(allow_nan=False, allow_infinity=False)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return junk_json()

    def valid_call(self, op: Operation) -> st.SearchStrategy[Call]:
        """A request shaped as documented (which may still be refused: unknown pool, ...)."""
        content = op.spec.get("requestBody", {}).get("content", {}).get("application/json")
        body = (
            self.values(content["schema"]).map(lambda v: json.dumps(v).encode())
            if content
            else st.just(b"")
        )
        return st.builds(
            lambda rank, query, payload: Call(
                op.method, op.pattern.replace("{rank}", rank) + query, payload, op
            ),
            st.sampled_from(RANKS),
            self.query(op),
            body,
        )

    def query(self, op: Operation) -> st.SearchStrategy[str]:
        """A query string from the operation's documented query parameters (each one present
        or not, a required one usually present), or "" when it has none."""
        params = [p for p in op.spec.get("parameters", ()) if p.get("in") == "query"]
        if not params:
            return st.just("")
        parts = []
        for param in params:
            name = param["name"]
            value = self.values(param["schema"], name).map(
                lambda v, name=name: (name, v if isinstance(v, str) else json.dumps(v))
            )
            present = st.just(True) if param.get("required") else st.booleans()
            parts.append(
                st.tuples(present | st.just(False), value).map(lambda pv: [pv[1]] if pv[0] else [])
            )
        return st.tuples(*parts).map(
            lambda chosen: "?" + urlencode([kv for one in chosen for kv in one])
        )

    def broken_call(self, op: Operation) -> st.SearchStrategy[Call]:
        """The same operation with a malformed body, a bad rank segment or another method."""
        bodies = st.one_of(
            st.binary(max_size=40),
            junk_json().map(lambda v: json.dumps(v).encode()),
            st.sampled_from(
                [b"{", b"[]", b"null", b'{"keys": "k1"}', b'{"keys": [1, 2]}', b"\xff\xfe{}"]
            ),
        )
        ranks = st.sampled_from(BAD_RANKS + RANKS)
        methods = st.sampled_from([op.method, op.method, "GET", "PUT", "DELETE", "PATCH"])
        return st.builds(
            lambda m, rank, body: Call(m, op.pattern.replace("{rank}", rank), body, op),
            methods,
            ranks,
            bodies,
        )

    def calls(self) -> st.SearchStrategy[Call]:
        ops = st.sampled_from(self.operations)
        unknown = st.builds(
            lambda p, b: Call("POST", "/fuzz/" + p, b, None),
            st.text(st.characters(min_codepoint=48, max_codepoint=122), max_size=12),
            st.binary(max_size=10),
        )
        return st.one_of(
            ops.flatmap(self.valid_call),
            ops.flatmap(self.valid_call),
            ops.flatmap(self.broken_call),
            unknown,
        )

    # ---------------------------------------------------------------- validation

    def check(self, call: Call, status: int, content_type: str, body: bytes) -> None:
        """Raise AssertionError if the answer is a 5xx or is not what the document says."""
        where = f"{call.method} {call.path} body={call.body[:200]!r} -> {status} {body[:300]!r}"
        assert status < 500, where
        if call.op is None or not self._path_matches(call):
            assert status in (404, 422), where
            self._validate({"$ref": "#/components/schemas/Error"}, body, where)
            return
        if call.method != call.op.method:
            # the path (its rank included) is parsed before the method is looked at
            assert status == 405 or (status == 422 and b"rank" in body), where
            return
        responses = call.op.spec["responses"]
        assert str(status) in responses, f"undocumented status: {where}"
        content = responses[str(status)].get("content")
        if not content:
            assert body == b"", where
            return
        if "application/json" in content:
            assert content_type.startswith("application/json"), where
            self._validate(content["application/json"]["schema"], body, where)
        else:  # text: /metrics, and the status page's HTML, script and style
            assert content_type.startswith(tuple(content)), where

    def _path_matches(self, call: Call) -> bool:
        assert call.op is not None
        want = call.op.pattern.split("/")
        got = call.path.split("?", 1)[0].split("/")
        return len(want) == len(got) and all(
            w == g or (w == "{rank}" and g != "") for w, g in zip(want, got, strict=True)
        )

    def _validate(self, schema: dict[str, Any], body: bytes, where: str) -> None:
        try:
            value = json.loads(body)
        except ValueError:
            raise AssertionError(f"not JSON: {where}") from None
        root = {**schema, "components": self.doc["components"]}
        errors = list(Draft202012Validator(root).iter_errors(value))
        assert not errors, f"{errors[0].message}: {where}"


def junk_json() -> st.SearchStrategy[Any]:
    scalars = (
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=8,
    )
