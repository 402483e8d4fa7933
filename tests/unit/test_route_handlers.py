"""Each route handler called alone, as a plain function: no socket, no App, no HTTP server.

The route tables list module-level handlers ``handler(ctx, request, rank)``; here each one gets
a Request and its context directly, and every body a route decodes goes through its
``Route.body`` decoder (a bad body is refused there, naming the field)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvmeta.config import Settings
from kvmeta.errors import InvalidRequest, NotInitialized, RankInUse
from kvmeta.server import ops_routes, prefix_routes, sglang, status_page, vllm
from kvmeta.server.app import App, Route
from kvmeta.server.http import Request, Response
from kvmeta.service.ops import Service
from kvmeta.service.vllm import INIT_FIELDS
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore


def call(route: Route, ctx: Any, body: Any = b"", rank: int = 0) -> Response:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    request = Request(route.method, route.pattern, "", raw, None)
    return asyncio.run(route.handler(ctx, request, rank))


def route(table: tuple[Route, ...], pattern: str) -> Route:
    (found,) = [r for r in table if r.pattern == pattern]
    return found


def json_of(response: Response) -> Any:
    return msgspec.json.decode(response.body)


def new_service() -> Service:
    return Service(LocalBackend(MemoryStore()))


def test_sglang_handlers_alone() -> None:
    svc = new_service()
    s = sglang.ROUTES
    assert call(route(s, "/{rank}/initialize"), svc, {"num_pages": 4}).status == 204
    reserve = route(s, "/{rank}/reserve_and_allocate_page_indices")
    reserved = call(reserve, svc, {"keys": [["a", None]]})
    ((stored, page),) = json_of(reserved)["indices"]
    assert stored is False and 0 <= page < 4
    confirm = {"written_keys_to_confirm": [["a", page]]}
    assert call(route(s, "/{rank}/confirm_write"), svc, confirm).status == 204
    assert json_of(call(route(s, "/{rank}/exists"), svc, {"keys": ["a", "b"]})) == {
        "exists": [True, False]
    }
    assert json_of(call(route(s, "/{rank}/get_page_indices"), svc, {"keys": ["a"]})) == {
        "indices": [page]
    }
    assert call(route(s, "/{rank}/delete_keys"), svc, {"keys": ["a"]}).status == 204
    assert call(route(s, "/{rank}/clear"), svc).status == 204
    # The rank comes from the caller (the App parses it from the path): another rank has no pool.
    with pytest.raises(NotInitialized):
        call(route(s, "/{rank}/exists"), svc, {"keys": ["a"]}, rank=1)


def test_vllm_handlers_alone() -> None:
    svc = new_service()
    v = vllm.ROUTES
    init = json_of(call(route(v, "/rank/{rank}/initialize"), svc, {"num_pages": 4}))
    assert init == {"message": "Rank 0 initialized with 4 pages"}
    out = json_of(call(route(v, "/keys/batch_allocate"), svc, {"rank": 0, "keys": ["k"]}))
    ((key, page),) = out["results"]
    assert key == "k" and 0 <= page < 4
    confirm = {"rank": 0, "confirmations": [["k", page]]}
    assert call(route(v, "/keys/confirm_write"), svc, confirm).status == 204
    assert json_of(call(route(v, "/keys/batch_exists"), svc, {"keys": ["k", "x"]})) == {
        "exists": [True, False]
    }
    locations = call(route(v, "/keys/get_locations"), svc, {"rank": 0, "keys": ["k"]})
    assert json_of(locations) == {"locations": [page]}
    assert json_of(call(route(v, "/v1/vllm"), svc))["ranks"] == [0]
    assert json_of(call(route(v, "/v1/vllm/world_size"), svc, {"world_size": 1}))["required"] == [0]
    assert call(route(v, "/clear"), svc).status == 204
    remove = route(v, "/v1/vllm/ranks/{rank}/remove")
    with pytest.raises(RankInUse):  # the page just read is under its read lease
        call(remove, svc, rank=0)
    forced = Request("POST", "/v1/vllm/ranks/0/remove", "force=true", b"", None)
    removed = json_of(asyncio.run(remove.handler(svc, forced, 0)))
    assert removed["removed"] is True


def test_ops_handlers_alone() -> None:
    svc = new_service()
    app = App()
    state = ops_routes.OpsState(app, svc, Settings(in_memory=True))
    o = ops_routes.ROUTES
    assert json_of(call(route(o, "/health"), state))["status"] == "ok"
    assert json_of(call(route(o, "/ready"), state)) == {"ready": True, "backend": svc.backend.name}
    assert json_of(call(route(o, "/v1/pools"), state))["pools"] == []
    assert json_of(call(route(o, "/v1/check"), state))["ok"] is True
    assert b"kvmeta_" in call(route(o, "/metrics"), state).body
    assert json_of(call(route(o, "/openapi.json"), state))["openapi"].startswith("3.1")
    assert [r.pattern for r in o if r.public] == ["/health", "/ready"]


ALL_ROUTES = (
    sglang.ROUTES + vllm.ROUTES + ops_routes.ROUTES + status_page.ROUTES + prefix_routes.ROUTES
)


@pytest.mark.parametrize(
    "r", [r for r in ALL_ROUTES if r.body is not None], ids=lambda r: f"{r.method} {r.pattern}"
)
def test_every_body_is_refused_by_its_route_decoder(r: Route) -> None:
    """A body of the wrong shape is a 400 from the route's own decoder, before the service."""
    svc = new_service()
    bad = b"[1, 2]"
    with pytest.raises(InvalidRequest) as from_route:
        call(r, svc, bad)
    assert r.body is not None
    with pytest.raises(InvalidRequest) as from_decoder:
        r.body.decode(bad)
    assert str(from_route.value) == str(from_decoder.value)


def test_status_handlers_alone() -> None:
    svc = new_service()
    ops = ops_routes.OpsState(App(), svc, Settings(in_memory=True))
    state = status_page.StatusState(ops)
    t = status_page.ROUTES
    doc = json_of(call(route(t, "/v1/status"), state))
    assert doc["pools"] == [] and doc["backend"]["ready"] is True
    assert call(route(t, "/ui"), state).content_type.startswith(b"text/html")


def test_route_tables_are_what_the_app_serves() -> None:
    from kvmeta.server.runner import build_app

    app = build_app(Settings(in_memory=True), new_service())
    assert app.routes() == sorted((r.method, r.pattern) for r in ALL_ROUTES)


def test_vllm_initialize_struct_reads_the_services_fields() -> None:
    assert vllm.InitializeBody.__struct_fields__ == INIT_FIELDS
