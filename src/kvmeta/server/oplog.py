"""What the server tells its operator in the log: one line per start-up fact, a warning when a
second engine seems to share a pool (at a bounded rate: ``kvmeta.lograte``), and the opt-in
access log (one line per request).

No per-request logging happens unless ``--access-log`` is given: at tens of thousands of
requests per second a log line costs more than the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from time import perf_counter
from typing import Any

import msgspec

from kvmeta._types import DEFAULT_NAMESPACE, PoolId, normalize_namespace
from kvmeta.config import Settings
from kvmeta.lograte import LIMITER, warn_limited
from kvmeta.server.access import tenant_of
from kvmeta.server.app import RouteHandler
from kvmeta.server.http import Request, Response

__all__ = ["InitWatcher", "access_logged", "flush_log_summaries", "log_startup"]

logger = logging.getLogger("kvmeta.server")
access_logger = logging.getLogger("kvmeta.access")


class _InitFields(msgspec.Struct):
    namespace: str = DEFAULT_NAMESPACE
    role: str = "worker"


_init_decoder = msgspec.json.Decoder(_InitFields)


class InitWatcher:
    """Remembers which client host first initialised each pool and warns when another host
    initialises it again: two engines on one pool overwrite each other's pages.

    Hosts, not ports: stock clients open a new connection per call. Only successful
    initialisations are remembered, so the table is bounded by the number of pools. The pool is
    named the way the handler named it (in the token's tenant, the namespace normalised:
    ``PoolName.KV`` is ``kv``): two tenants with the same rank and namespace own two pools, and
    their engines may well run on different hosts. It runs after the pool was created, so it
    checks nothing and raises nothing: the handler already checked the scope, and an error here
    would answer a failure for a change that was made.
    """

    def __init__(self) -> None:
        self.first_host: dict[PoolId, str] = {}

    def wrap(self, method: str, pattern: str, handler: RouteHandler) -> RouteHandler:
        if not pattern.endswith("/initialize"):
            return handler
        dialect = "v" if pattern.startswith("/rank/") else "s"

        async def watched(request: Request, rank: int) -> Response:
            response = await handler(request, rank)
            if response.status < 300:
                self.seen(dialect, rank, request)
            return response

        return watched

    def seen(self, dialect: str, rank: int, request: Request) -> None:
        try:
            fields = _init_decoder.decode(request.body or b"{}")
        except msgspec.DecodeError:
            return
        if dialect == "v":
            if fields.role == "scheduler":
                return
            pool = PoolId("v", rank, "", tenant_of(request))
        else:
            pool = PoolId("s", rank, normalize_namespace(fields.namespace), tenant_of(request))
        host = str(request.peer[0]) if request.peer else "unknown"
        first = self.first_host.setdefault(pool, host)
        if first != host:
            # Per pool: each pool shared by two engines is its own problem to fix.
            warn_limited(
                logger,
                f"initialised again: {pool}",
                "%s initialised again from %s (first from %s): if two engines use this pool they "
                "overwrite each other's pages; give each engine its own rank/namespace or server",
                pool,
                host,
                first,
            )


def log_startup(settings: Settings, backend_description: str) -> None:
    """One INFO line per fact an operator checks first; never the token."""
    logger.info("backend: %s", backend_description)
    if settings.backend:
        logger.info("state: shared backend (see the backend line)")
    elif settings.in_memory:
        logger.info("state: in memory only (--in-memory): lost on restart")
    else:
        logger.info("state: data directory %s, fsync %s", settings.data_dir, settings.fsync)
    logger.info(
        "leases: reservation_ttl=%gs read_lease=%gs", settings.reservation_ttl, settings.read_lease
    )
    logger.info(
        "limits: max_body_bytes=%d max_keys=%d max_key_length=%d max_namespace_length=%d "
        "max_pages=%d",
        settings.max_body_bytes,
        settings.max_keys,
        settings.max_key_length,
        settings.max_namespace_length,
        settings.max_pages,
    )
    if settings.hash_index:
        logger.info(
            "hash index: on (--hash-index): SGLang pools are indexed by block hash, so "
            "/v1/prefix_match takes `hashes`"
        )
    if settings.auth_file:
        logger.info(
            "auth: on, tokens file %s (per-tenant scopes and quotas; SIGHUP reloads it)%s; "
            "/health and /ready are open",
            settings.auth_file,
            " plus the all-access --auth-token" if settings.auth_token else "",
        )
    elif settings.auth_token:
        logger.info(
            "auth: on (Bearer token, or the token as the URL password); /health and /ready are open"
        )
    else:
        logger.info("auth: off (set --auth-token / KVMETA_AUTH_TOKEN to require a token)")
        if settings.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning(
                "serving %s without --auth-token: anyone who can reach this port can read and "
                "change the page maps",
                settings.host,
            )
    if settings.ssl_certfile:
        logger.info("tls: on (cert %s)", settings.ssl_certfile)
    else:
        logger.info("tls: off (plain http; engines' stock clients speak only http)")
    if settings.access_log:
        logger.info("access log: on (one line per request, logger kvmeta.access)")


async def flush_log_summaries(every: float = 1.0) -> None:
    """Write the summary lines of rate-limited warnings (``kvmeta.lograte``) as their
    intervals end, not only when the next such warning comes; at shutdown, every count still
    pending, so none is lost (a background task of the server)."""
    try:
        while True:
            await asyncio.sleep(every)
            LIMITER.flush()
    finally:
        LIMITER.flush(final=True)


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def log_access(request: Request, response: Response, ms: float, tenants: bool) -> None:
    """One access-log record (see ``access_logged``)."""
    peer = request.peer[0] if request.peer else "-"
    scope = request.scope
    tenant = scope.tenant if scope is not None else (None if tenants else "")
    fields = {
        "method": request.method,
        "path": request.path,
        "status": response.status,
        "bytes": len(response.body),
        "duration_ms": round(ms, 3),
        "remote": None if peer == "-" else str(peer),
        "tenant": tenant,
    }
    access_logger.info(
        "%s %s %s %d %dB %.3fms",
        peer,
        request.method,
        request.path,
        response.status,
        len(response.body),
        ms,
        extra={"fields": fields},
    )


def access_logged(handler: Handler, tenants: bool = False) -> Handler:
    """Wrap the whole app so every request it answers, unknown routes included, is logged.

    Each record also carries its parts as ``fields`` (the JSON log format puts them at the top
    level of the line). ``tenant``: the token's tenant with a tokens file (``tenants``), None
    where no token was accepted (a 401, a public route); ``""``, the one tenant, without.
    Requests refused at their headers never reach the app: ``refusals_logged`` logs those.
    """

    async def logged(request: Request) -> Response:
        start = perf_counter()
        response = await handler(request)
        log_access(request, response, (perf_counter() - start) * 1000, tenants)
        return response

    return logged


def refusals_logged(tenants: bool = False) -> Callable[[Request, Response], None]:
    """The HTTP server's hook for requests refused at their headers (``App.head_check``): the
    access log has the Host, Origin and Content-Type refusals (403, 415; duration 0), not the
    401s, which a client without the token can send at any rate
    (``kvmeta_auth_failures_total`` counts them)."""

    def refused(request: Request, response: Response) -> None:
        if response.status != 401:
            log_access(request, response, 0.0, tenants)

    return refused
