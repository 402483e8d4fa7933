"""Operator routes: ``/health``, ``/ready``, ``/metrics``, ``/v1/pools``, ``/v1/check`` and
``/openapi.json``, plus ``install``, which also turns on auth, the request guard (Host, Origin,
Content-Type), metrics and the initialize watcher for an app once every dialect's routes are on
it.

``/health`` and ``/ready`` are public, so load balancers and Kubernetes probes (which send no
header) may call them without the token; ``/ready`` then says only ready or not, and why only
to a valid token. Everything here is read-only; ``/v1/check`` is O(pool size) and meant for
diagnostics, not for a probe loop. Neither ``/v1/check`` nor ``/metrics`` may stall request
serving: the check copies each pool in one step on the loop and checks the copies in a thread;
``/metrics`` caps its pool series (``--metrics-max-pools``) and renders in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from kvmeta import __version__
from kvmeta.config import Settings
from kvmeta.errors import KvmetaError, Unauthorized
from kvmeta.server import guard, prefix_routes, status_page
from kvmeta.server.access import Access, scope_of
from kvmeta.server.app import App, Route, add_table, json_response
from kvmeta.server.http import Request, Response
from kvmeta.server.metrics import (
    CONTENT_TYPE,
    RequestMetrics,
    new_snapshot,
    render_metrics_async,
)
from kvmeta.server.openapi import build_document
from kvmeta.server.oplog import InitWatcher, flush_log_summaries
from kvmeta.server.tokens import Scope
from kvmeta.server.views import pool_view, settings_view
from kvmeta.service.ops import Service
from kvmeta.store.base import Backend, PoolStats

__all__ = ["ROUTES", "Drain", "OpsState", "install"]


class Drain:
    """The drain before a stop (``--drain-seconds``): from SIGTERM until the stop, ``/ready``
    answers 503 while every request is still served, so a load balancer or Kubernetes takes the
    server out of rotation before it stops accepting connections. ``server.runner`` begins it;
    readiness reads it."""

    def __init__(self) -> None:
        self.until: float | None = None  # time.monotonic() at which the server stops

    def begin(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    @property
    def active(self) -> bool:
        return self.until is not None

    def reason(self) -> str | None:
        """Why ``/ready`` answers 503 while draining, or None."""
        if self.until is None:
            return None
        left = max(0.0, self.until - time.monotonic())
        return (
            f"draining: the server received SIGTERM and stops in {left:.1f} s (--drain-seconds); "
            "requests are still served meanwhile"
        )


class OpsState:
    """What the operator routes share: the service, settings, counters and start time."""

    def __init__(
        self, app: App, service: Service, settings: Settings, drain: Drain | None = None
    ) -> None:
        self.app = app
        self.drain = drain or Drain()
        self.service = service
        self.backend: Backend = service.backend
        self.settings = settings
        self.metrics = RequestMetrics()
        # The token check (None: auth off): --auth-token as a one-entry table, and the tokens
        # file's scopes when there is one.
        self.auth: Access | None = (
            Access(settings.auth_file, settings.auth_token)
            if settings.auth_file or settings.auth_token
            else None
        )
        # Host, Origin and Content-Type of every request (server.guard)
        self.guard = guard.for_settings(settings.host, settings.allowed_hosts)
        self.started = time.monotonic()
        self._openapi: bytes | None = None
        self.check_lock = asyncio.Lock()

    def failure(self) -> str | None:
        """Why the backend refuses changes right now (a failed journal), or None."""
        return self.backend.failure

    async def ready(self) -> tuple[bool, str]:
        """(ready, reason) without raising: a backend error is a reason, not a 500."""
        draining = self.drain.reason()
        if draining is not None:
            return False, draining
        failure = self.failure()
        if failure is not None:
            return False, failure
        try:
            ok = await self.backend.ready()
        except KvmetaError as exc:  # the backend's own reason (its message names the fix)
            return False, str(exc)
        except Exception as exc:  # noqa: BLE001 - any backend failure means not ready
            return False, f"backend {self.backend.name} failed its readiness check: {exc}"
        if not ok:
            return False, (
                f"backend {self.backend.name} is not ready (still loading its state, or its "
                "store cannot be reached); see the server log"
            )
        return True, ""

    async def durability(self) -> dict[str, float]:
        return self.backend.durability_stats()

    def openapi(self) -> bytes:
        if self._openapi is None:
            doc = build_document(self.app.routes(), __version__, self.auth is not None)
            self._openapi = msgspec.json.encode(doc)
        return self._openapi


async def check_pools(backend: Backend, lock: asyncio.Lock | None = None) -> dict[str, Any]:
    """Run the backend's full invariant check, one at a time under ``lock`` (each check holds
    copies of what it checks, or walks the whole shared state)."""
    async with lock or contextlib.nullcontext():
        report = await backend.check()
    return {
        "ok": report.ok,
        "checked": report.checked,
        "problems": report.problems,
        "supported": True,
    }


async def health(state: OpsState, req: Request, rank: int) -> Response:
    uptime = round(time.monotonic() - state.started, 3)
    body: dict[str, Any] = {
        "status": "ok",
        "version": __version__,
        "uptime_seconds": uptime,
        "epoch": state.backend.epoch,
    }
    failure = state.failure()
    if failure is not None:
        # Still 200: the process is alive and recovers by itself; a liveness probe that
        # restarted it would lose the changes that are only in memory.
        body["status"] = "degraded"
        body["reason"] = failure
    return json_response(body)


def _may_see_why(state: OpsState, req: Request) -> bool:
    """Whether ``/ready`` may name the backend and the reason it is not ready: to a valid token
    (or anyone, with auth off). No header is a probe, not counted as an auth failure; a wrong
    token is counted as on any route."""
    auth = state.auth
    if auth is None:
        return True
    if req.authorization is None:
        return False
    try:
        auth(req)
    except Unauthorized:
        return False
    return True


async def ready(state: OpsState, req: Request, rank: int) -> Response:
    ok, reason = await state.ready()
    if not _may_see_why(state, req):
        return json_response({"ready": ok}, 200 if ok else 503)
    if not ok:
        return json_response({"detail": reason, "ready": False}, 503)
    return json_response({"ready": True, "backend": state.backend.name})


async def visible_stats(state: OpsState, scope: Scope) -> list[PoolStats]:
    """Every pool for the all-access token; a tenant's token sees its own tenant's only."""
    stats = await state.service.stats()
    if scope.all_access:
        return stats
    return [st for st in stats if st.pool.tenant == scope.tenant]


async def metrics(state: OpsState, req: Request, rank: int) -> Response:
    """All series for the all-access token. A tenant's admin token gets its own tenant's pool
    series and 403/429 counters only: request, durability and auth series are server-wide."""
    ok, _ = await state.ready()
    scope = scope_of(req)
    auth = state.auth
    tenant = None if scope.all_access else scope.tenant
    snapshot = new_snapshot(
        pools=await visible_stats(state, scope),
        durability=await state.durability() if tenant is None else {},
        requests=state.metrics.routes if tenant is None else [],
        auth_failures=auth.failures if auth and tenant is None else None,
        refused=state.guard.counters() if tenant is None else None,
        tenant_counters=auth.counters(tenant) if auth and auth.scoped else None,
        info={"version": __version__, "backend": state.backend.name},
        ready=ok,
        max_pools=state.settings.metrics_max_pools,
        server_wide=tenant is None,
        tenant=tenant,
    )
    return Response(200, await render_metrics_async(snapshot), CONTENT_TYPE)


async def pools(state: OpsState, req: Request, rank: int) -> Response:
    scope = scope_of(req)
    stats = await visible_stats(state, scope)
    return json_response(
        {
            "server": settings_view(state.settings, state.backend, scope.all_access),
            "pools": [pool_view(st) for st in stats],
            "vllm": (await state.service.v_index(scope.tenant)).view(),
        }
    )


async def check(state: OpsState, req: Request, rank: int) -> Response:
    return json_response(await check_pools(state.backend, state.check_lock))


async def openapi(state: OpsState, req: Request, rank: int) -> Response:
    return Response(200, state.openapi())


ROUTES = (
    Route("GET", "/health", health, public=True),
    Route("GET", "/ready", ready, public=True),
    Route("GET", "/metrics", metrics),
    Route("GET", "/v1/pools", pools),
    Route("GET", "/v1/check", check),
    Route("GET", "/openapi.json", openapi),
)


def add_routes(app: App, state: OpsState) -> None:
    """Register the operator routes on ``app``."""
    add_table(app, ROUTES, state)


def install(app: App, service: Service, settings: Settings, drain: Drain | None = None) -> OpsState:
    """Add the operator routes, the router routes (``server.prefix_routes``) and the status
    page, then auth, metrics and the initialize watcher to every route.

    Call it last in ``build_app``: handlers added afterwards are not instrumented. ``drain``:
    the server's (``server.runner``), which makes ``/ready`` answer 503 once it begins.
    """
    state = OpsState(app, service, settings, drain)
    add_routes(app, state)
    prefix_routes.add_routes(app, service)
    status = status_page.StatusState(state)
    add_table(app, status_page.ROUTES, status)
    app.background.append(status.run)
    app.background.append(flush_log_summaries)
    app.authorize = state.auth
    app.guard = state.guard
    auth = state.auth
    if auth is not None and auth.scoped:
        # Innermost: the scope is on the request and checked before any handler runs; the
        # metrics wrapper outside it counts the 403s and 429s per route.
        auth.public = app.public_patterns()
        app.wrap_handlers(auth.wrap)
        auth.install_sighup()  # before the server listens (see its docstring)
        app.background.append(auth.watch_sighup)
        service.tenant_caps = auth.caps
    app.wrap_handlers(InitWatcher().wrap)
    app.wrap_handlers(state.metrics.wrap)
    return state
