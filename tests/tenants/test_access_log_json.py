"""``--access-log --log-format json``: each request's parts are fields of its JSON line
(``method``, ``path``, ``status``, ``bytes``, ``duration_ms``, ``remote``, ``tenant``), so a log
pipeline filters on them without parsing ``msg``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import requests

from tests.support import Server
from tests.tenants.conftest import OPERATOR, bearer, token

FIELDS = {"method", "path", "status", "bytes", "duration_ms", "remote", "tenant"}


def _access_records(server: Server, count: int) -> list[dict[str, Any]]:
    """The first ``count`` access-log records, once they are all in the log."""
    deadline = time.monotonic() + 20
    while True:
        records = [json.loads(line) for line in server.lines if line.strip()]
        access = [r for r in records if r["logger"] == "kvmeta.access"]
        if len(access) >= count:
            return access[:count]
        assert time.monotonic() < deadline, server.log
        time.sleep(0.02)


def test_access_records_carry_their_fields(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--access-log", "--log-format", "json")
    assert server.post("/0/initialize", {"num_pages": 4}).status_code == 204
    assert server.post("/nope", {}).status_code == 404
    first, second = _access_records(server, 2)
    assert FIELDS <= set(first)
    assert {k: first[k] for k in ("method", "path", "status", "bytes", "remote", "tenant")} == {
        "method": "POST",
        "path": "/0/initialize",
        "status": 204,
        "bytes": 0,
        "remote": "127.0.0.1",
        "tenant": "",  # no tokens file: the one tenant
    }
    assert isinstance(first["duration_ms"], float) and first["duration_ms"] >= 0
    assert (second["path"], second["status"]) == ("/nope", 404)
    assert second["bytes"] == len(server.post("/nope", {}).content)
    assert first["level"] == "info" and "POST /0/initialize 204" in first["msg"]


def test_the_tenant_is_the_tokens(tenant_app: Callable[..., Server]) -> None:
    server = tenant_app("--in-memory", "--access-log", "--log-format", "json")
    url = server.url
    body = {"num_pages": 4, "namespace": "kv"}
    as_a = requests.post(
        url + "/0/initialize", json=body, headers=bearer(token("a_rw")), timeout=10
    )
    assert as_a.status_code == 204
    assert requests.get(url + "/v1/pools", headers=bearer(OPERATOR), timeout=10).ok
    assert requests.get(url + "/health", timeout=10).ok
    records = _access_records(server, 3)
    assert [(r["path"], r["status"], r["tenant"]) for r in records] == [
        ("/0/initialize", 204, "teamA"),
        ("/v1/pools", 200, ""),  # the all-access --auth-token
        ("/health", 200, None),  # a public route without a token: no tenant
    ]
