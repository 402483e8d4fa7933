"""Token access, the one auth mechanism: the all-access ``--auth-token`` and the tokens file
(``--auth-file``: who may call which route on which pools, and each tenant's request rate).

``Access`` is the app's ``authorize`` hook (401 for a missing or unknown token, checked on the
headers). ``--auth-token`` is a one-entry token table (all access, tenant ``""``) looked up
before the file's. With a tokens file, ``wrap`` is also every route's first step: it finds the
token's ``Scope``, puts it on the request (``request.scope``), takes one request from the
tenant's token bucket (429 ``QuotaExceeded`` with ``Retry-After``), and checks the right the
route needs (``ROUTE_RULES``) and a rank in the path, before the handler reads or changes
anything. The pool a body names (SGLang namespace, vLLM rank) is checked by the handler right
after decoding, through ``sglang_pool``/``vllm_pool``, which also put the token's tenant into
the ``PoolId``.

A 403 depends only on the token's scope and the request, never on the state, so it is the same
whether the target exists or not (no existence oracle). One exception: a vLLM initialize whose
``world_size`` would move the tenant's pinned one needs the ``admin`` right, which only the
store can check atomically (``Forbidden.world_size_change``); it reveals the token's own
tenant's world size, nothing of another tenant. Tokens are looked up by SHA-256 digest
(``server.tokens``); the headers of recent good requests are remembered by exact value (a dict
keyed by the header bytes, whose hash is Python's keyed SipHash: a guess learns nothing from
its timing), so a request costs one dict lookup, not a hash of the token.

The tokens file is re-read on SIGHUP: parsed and checked whole, then swapped in at once; a bad
file is logged (without any token) and the old table kept.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvmeta._types import PoolId
from kvmeta.errors import ConfigError, Forbidden, QuotaExceeded, Unauthorized
from kvmeta.server.auth import presented_token
from kvmeta.server.http import Request, Response
from kvmeta.server.tokens import (
    ALL_ACCESS,
    NO_TOKENS,
    Scope,
    TenantQuota,
    digest,
    load_tokens,
    operator_table,
)
from kvmeta.service.limits import TenantCaps

__all__ = [
    "ANY",
    "MAX_RETRY_AFTER",
    "ROUTE_RULES",
    "Access",
    "Rule",
    "TokenBucket",
    "retry_after",
    "scope_of",
    "sglang_pool",
    "tenant_of",
    "vllm_pool",
]

logger = logging.getLogger("kvmeta.server.access")

RouteHandler = Callable[[Request, int], Coroutine[Any, Any, Response]]

ANY = "any"  # any valid token, no right needed (the route reveals nothing about pools)
OPERATOR = "operator"  # the all-access --auth-token only


@dataclass(frozen=True)
class Rule:
    """What a route needs: a right (``read``/``write``/``admin``, ``ANY`` or ``OPERATOR``), and
    whether the ``{rank}`` in its path must be in the token's ranks."""

    right: str
    path_rank: bool = False


# Every route of both dialects and the operator routes. A route missing here is served to the
# all-access token only (fail closed), and the matrix test (tests/tenants) fails until it is
# classified. Engines' workers call initialize themselves at start-up, so initialize is a
# ``write`` right (a worker token needs it; the tenant's page quota bounds what it creates),
# though moving the tenant's vLLM world size through it needs ``admin`` (``server.vllm``);
# clearing a whole pool or registry is ``admin``.
ROUTE_RULES: dict[tuple[str, str], Rule] = {
    # SGLang HiCache
    ("POST", "/{rank}/initialize"): Rule("write", True),
    ("POST", "/{rank}/exists"): Rule("read", True),
    ("POST", "/{rank}/get_page_indices"): Rule("read", True),
    ("POST", "/{rank}/reserve_and_allocate_page_indices"): Rule("write", True),
    ("POST", "/{rank}/confirm_write"): Rule("write", True),
    ("POST", "/{rank}/delete_keys"): Rule("write", True),
    ("POST", "/{rank}/clear"): Rule("admin", True),
    # vLLM HF3FS (the rank of the keys routes is in the body: checked by the handler)
    ("POST", "/rank/{rank}/initialize"): Rule("write", True),
    ("POST", "/keys/batch_allocate"): Rule("write"),
    ("POST", "/keys/confirm_write"): Rule("write"),
    ("POST", "/keys/batch_exists"): Rule("read"),
    ("POST", "/keys/get_locations"): Rule("read"),
    ("POST", "/clear"): Rule("admin"),
    ("GET", "/v1/vllm"): Rule("admin"),
    ("POST", "/v1/vllm/ranks/{rank}/remove"): Rule("admin", True),
    ("POST", "/v1/vllm/world_size"): Rule("admin"),
    # router reads (each pool the request names is checked by the handler, like a body's rank)
    ("POST", "/v1/prefix_match"): Rule("read"),
    ("GET", "/v1/dump"): Rule("read"),
    # operator routes: pools and status show the token's own tenant only (/health and /ready
    # are public: ops_routes)
    ("GET", "/openapi.json"): Rule(ANY),
    ("GET", "/metrics"): Rule("admin"),
    ("GET", "/v1/pools"): Rule("admin"),
    ("GET", "/v1/status"): Rule("admin"),
    ("GET", "/v1/check"): Rule(OPERATOR),  # the whole backend's invariants, every tenant
    # the status page's static files (the data comes from /v1/status)
    ("GET", "/"): Rule(ANY),
    ("GET", "/ui"): Rule(ANY),
    ("GET", "/ui/status.js"): Rule(ANY),
    ("GET", "/ui/status.css"): Rule(ANY),
}
_UNCLASSIFIED = Rule(OPERATOR)


def scope_of(request: Request) -> Scope:
    """The request's scope: all access when the server runs without a tokens file."""
    scope = request.scope
    return ALL_ACCESS if scope is None else scope


def sglang_pool(request: Request, rank: int, namespace: str) -> PoolId:
    """The SGLang pool a request names, in its token's tenant; Forbidden when out of scope."""
    scope = request.scope
    if scope is None:
        return PoolId("s", rank, namespace)
    if scope.all_access:
        return PoolId("s", rank, namespace, scope.tenant)
    scope.check_pool(rank, namespace)
    return PoolId("s", rank, namespace, scope.tenant)


def vllm_pool(request: Request, rank: int) -> PoolId:
    """The vLLM rank pool a request names, in its token's tenant; Forbidden when out of scope."""
    scope = request.scope
    if scope is None:
        return PoolId("v", rank, "")
    if not scope.all_access:
        scope.check_rank(rank, f"vllm rank {rank}")
    return PoolId("v", rank, "", scope.tenant)


def tenant_of(request: Request) -> str:
    """The tenant a request's pools belong to ("" without a tokens file or for --auth-token)."""
    scope = request.scope
    return "" if scope is None else scope.tenant


class TokenBucket:
    """``rate`` requests per second on average, ``burst`` at once; O(1), monotonic time."""

    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last = now

    def take(self, now: float) -> float:
        """0.0 when a request may go now (and takes it), else the seconds until it may."""
        tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return 0.0
        self.tokens = tokens
        return (1.0 - tokens) / self.rate


# The longest Retry-After a 429 of the request rate says (the tokens file's slowest rate, one
# request per 1000 s, waits at most 1000 s).
MAX_RETRY_AFTER = 3600


def retry_after(wait: float) -> int:
    """Whole seconds to wait (rounded up, 1 to ``MAX_RETRY_AFTER``) for a wait of ``wait``
    seconds, whatever ``wait`` is: an infinite or NaN one (a rate near 0) answers the
    longest, never an OverflowError (a 500)."""
    if not wait <= MAX_RETRY_AFTER:  # also NaN
        return MAX_RETRY_AFTER
    return max(1, math.ceil(wait))


_MISSING = (
    "Authentication required: send `Authorization: Bearer <token>`, or put the token in the "
    "server URL as the password (http://:TOKEN@host:port); tokens come from the tokens file "
    "(--auth-file) or --auth-token"
)
_WRONG = (
    "Invalid authentication token: the Bearer token or URL password is not in the server's "
    "tokens file (--auth-file) and is not its --auth-token"
)
# The same refusals of a server with --auth-token alone, naming only what it has.
_MISSING_OPERATOR = (
    "Authentication required: send `Authorization: Bearer <token>`, or put the token in the "
    "server URL as the password (http://:TOKEN@host:port); the server's token is set with "
    "--auth-token / KVMETA_AUTH_TOKEN"
)
_WRONG_OPERATOR = (
    "Invalid authentication token: the Bearer token or URL password does not match the "
    "server's --auth-token"
)
_MAX_REMEMBERED = 4096


class Access:
    """The ``App.authorize`` hook, and with a tokens file the per-route scope/rate check.

    One mechanism for both ways of giving tokens: ``--auth-token`` is a one-entry token table
    whose entry is all access (``tokens.operator_table``), looked up before the tokens file's
    table (``path``; None: no file). Without a file every valid token is all access, so the
    routes are not wrapped (``scoped`` is False): requests carry no scope, which reads as all
    access in tenant ``""``, and pay nothing per route."""

    def __init__(self, path: str | None, auth_token: str | None = None) -> None:
        """Raises ConfigError: an unreadable or invalid tokens file, or an empty token
        without one (the server refuses to start)."""
        if path is None and not auth_token:
            raise ConfigError(
                "auth needs --auth-token or --auth-file; leave both unset to turn it off",
                "auth_token",
            )
        self.path = path
        self.operator = operator_table(auth_token) if auth_token else NO_TOKENS
        self.table = load_tokens(path) if path else NO_TOKENS
        self._missing, self._wrong = (
            (_MISSING, _WRONG) if path else (_MISSING_OPERATOR, _WRONG_OPERATOR)
        )
        self._remembered: dict[bytes, Scope] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self.failures = 0  # 401s
        self.forbidden: dict[str, int] = {}  # tenant -> 403s
        self.limited: dict[str, int] = {}  # tenant -> 429s
        self.reloads = 0
        self.reload_failures = 0
        self.public: set[str] = set()
        self._sighup = False  # the running loop reloads on SIGHUP (install_sighup)

    @property
    def scoped(self) -> bool:
        """Whether tokens have scopes and quotas (a tokens file), checked on every route."""
        return self.path is not None

    # ------------------------------------------------------------------ tokens

    def _scope(self, header: bytes | None) -> Scope:
        if header is None:
            self.failures += 1
            raise Unauthorized(self._missing)
        scope = self._remembered.get(header)
        if scope is not None:
            return scope
        token = presented_token(header)
        found: Scope | None = None
        if token:
            d = digest(token)
            found = self.operator.find(d) or self.table.find(d)
        if found is None:
            self.failures += 1
            raise Unauthorized(self._wrong)
        if len(self._remembered) >= _MAX_REMEMBERED:
            self._remembered.clear()
        self._remembered[header] = found
        return found

    def __call__(self, request: Request) -> None:
        """The authorize hook (on the headers): 401 unless the token is known."""
        self._scope(request.authorization)

    def quota(self, tenant: str) -> TenantQuota | None:
        return self.table.tenants.get(tenant)

    def caps(self, tenant: str) -> TenantCaps:
        """``Service.tenant_caps``: the tenant's own quotas from the tokens file, and how many
        tenants the file names (read afresh each time: a SIGHUP may change them)."""
        table = self.table
        quota = table.tenants.get(tenant)
        tenants = len(table.names)
        if quota is None:
            return TenantCaps(tenants=tenants)
        return TenantCaps(quota.max_pages, quota.max_pools, tenants)

    # ------------------------------------------------------------------ reload

    def reload(self) -> bool:
        """Re-read the tokens file; on any error keep the old table. True when swapped."""
        if self.path is None:
            return False
        try:
            table = load_tokens(self.path)
        except ConfigError as exc:
            self.reload_failures += 1
            logger.error("tokens file not reloaded, the previous one stays in force: %s", exc)
            return False
        self.table = table
        self._remembered = {}
        self._buckets = {}  # quotas may have changed; buckets start full again
        self.reloads += 1
        logger.info(
            "tokens file %s reloaded: %d tokens, %d tenants with quotas",
            self.path,
            len(table.scopes),
            len(table.tenants),
        )
        return True

    def install_sighup(self) -> bool:
        """Reload on SIGHUP from now on, when called on the server's running loop: at once,
        in the same step that read the file, so no SIGHUP sent after the server said it
        listens can be missed (or, in a worker, fall to a handler inherited from the parent).
        False without a running loop (an app built for inspection) or signal support."""
        if self._sighup:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        except (NotImplementedError, RuntimeError, ValueError):  # pragma: no cover
            logger.warning("SIGHUP reload of the tokens file is not available here")
            return False
        self._sighup = True
        return True

    async def watch_sighup(self) -> None:
        """Keep the SIGHUP reload while the server runs (a background task); removed at stop."""
        if not self.install_sighup():
            return
        try:
            await asyncio.Event().wait()
        finally:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False

    # ------------------------------------------------------------------ per route

    def _rate(self, scope: Scope, now: float) -> None:
        tenant = scope.tenant
        bucket = self._buckets.get(tenant)
        if bucket is None:
            quota = self.table.tenants.get(tenant)
            if quota is None or quota.requests_per_second is None or scope.all_access:
                return
            burst = quota.burst or quota.requests_per_second
            bucket = self._buckets[tenant] = TokenBucket(quota.requests_per_second, burst, now)
        wait = bucket.take(now)
        if wait:
            self.limited[tenant] = self.limited.get(tenant, 0) + 1
            seconds = retry_after(wait)
            raise QuotaExceeded(
                f"Too many requests: tenant '{tenant}' is over its request rate "
                f"({bucket.rate:g} requests/s, burst {bucket.burst:g}); retry after {seconds} s "
                f"(Retry-After), or raise requests_per_second/burst under [tenants.{tenant}] in "
                "the tokens file (--auth-file) and send SIGHUP to the server",
                seconds,
            )

    def check(self, scope: Scope, rule: Rule, method: str, pattern: str, rank: int) -> None:
        """Raises Forbidden unless ``scope`` may call the route (right and path rank)."""
        if scope.all_access:
            return
        right = rule.right
        if right == OPERATOR:
            raise scope.forbid(f"{method} {pattern} (needs the all-access --auth-token)")
        if right != ANY and right not in scope.rights:
            raise scope.forbid(f"{method} {pattern} (needs the '{right}' right)")
        if rule.path_rank and not scope.has_rank(rank):
            raise scope.forbid(f"rank {rank} ({method} {pattern})")

    def wrap(self, method: str, pattern: str, handler: RouteHandler) -> RouteHandler:
        """``App.wrap_handlers`` hook: the scope on the request, the rate, then the rule."""
        if pattern in self.public:
            return handler
        rule = ROUTE_RULES.get((method, pattern), _UNCLASSIFIED)
        monotonic = time.monotonic

        async def scoped(request: Request, rank: int) -> Response:
            scope = self._scope(request.authorization)
            request.scope = scope
            try:
                self._rate(scope, monotonic())
                self.check(scope, rule, method, pattern, rank)
                return await handler(request, rank)
            except Forbidden:
                self.forbidden[scope.tenant] = self.forbidden.get(scope.tenant, 0) + 1
                raise

        return scoped

    def counters(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """403s and 429s per tenant (one tenant's only when ``tenant`` is given)."""
        out = {"forbidden": dict(self.forbidden), "rate_limited": dict(self.limited)}
        if tenant is not None:
            out = {k: {t: n for t, n in v.items() if t == tenant} for k, v in out.items()}
        return out
