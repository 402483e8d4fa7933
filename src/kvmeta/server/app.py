"""The request handler: routing, body decoding, and the one error -> response mapping.

Routes come from the route tables of the dialect modules (``server.sglang``, ``server.vllm``)
and the operator routes (``server.ops_routes``): each ``Route`` names a method, a pattern that
may hold one ``{rank}`` segment, a module-level handler ``handler(ctx, request, rank)`` (so a
test can call it alone, with no socket) and the ``BodyDecoder`` of its body, whose Struct is
also the body's OpenAPI schema. Every ``KvmetaError`` becomes ``{"detail": message}`` with the
error's ``status``; anything else is a bug: logged with its traceback and answered 500.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import types
from collections.abc import Callable, Coroutine, Iterable
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec

from kvmeta.errors import (
    InvalidPathParameter,
    InvalidRequest,
    KvmetaError,
    MethodNotAllowed,
    NotFound,
    QuotaExceeded,
    Unauthorized,
)
from kvmeta.server.http import PUBLIC, PublicRoute, Request, Response
from kvmeta.service.limits import INT64_MAX, INT64_MIN, rank_error

__all__ = [
    "CALLER_WARNINGS",
    "NO_CONTENT",
    "WARNING_HEADER",
    "App",
    "BodyDecoder",
    "Route",
    "RouteHandler",
    "CallerWarning",
    "add_table",
    "decode_body",
    "json_response",
    "nested_error",
    "reply",
    "unknown_fields_warning",
]

logger = logging.getLogger(__name__)

RouteHandler = Callable[[Request, int], Coroutine[Any, Any, Response]]
T = TypeVar("T")

NO_CONTENT = Response(204)
_encode = msgspec.json.encode


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, _encode(obj))


def error_response(status: int, detail: str) -> Response:
    return Response(status, _encode({"detail": detail}))


def quota_response(exc: QuotaExceeded) -> Response:
    """429 with ``Retry-After`` in whole seconds, rounded up (RFC 9110 takes no fractions)."""
    seconds = max(1, math.ceil(exc.retry_after))
    return Response(
        429, _encode({"detail": str(exc)}), headers=((b"retry-after", b"%d" % seconds),)
    )


# RFC 9110: a 401 names the schemes it accepts; both work with the same token. One header line
# per scheme: browsers read one challenge per line, and a browser must see Basic to ask for
# the token (the status page, ``GET /ui``).
_CHALLENGE = (
    (b"www-authenticate", b'Basic realm="kvmeta"'),
    (b"www-authenticate", b'Bearer realm="kvmeta"'),
)


def nested_error(usage: str, prefix: str = "") -> InvalidRequest:
    """A body nested deeper than the JSON parser's recursion limit (engines send depth 3)."""
    return InvalidRequest(
        f"{prefix}Request body is nested too deeply for the JSON parser (engines' bodies are "
        f"at most 3 levels deep). Expected {usage}"
    )


# ``explain(body, exc)``: the error for a body the route's decoder refused, ``exc`` being
# msgspec's ValidationError or DecodeError, or a RecursionError (nested too deeply).
Explain = Callable[[bytes, Exception], InvalidRequest]


def decode_body(
    decoder: msgspec.json.Decoder[T],
    body: bytes,
    usage: str,
    explain: Explain | None = None,
) -> T:
    """Decode and validate a JSON body; an empty body means ``{}``.

    Raises:
        InvalidRequest: naming the JSON path that is wrong and the shape expected (``usage``),
        or as ``explain(body, exc)`` words the failure.
    """
    if not body or body.isspace():
        body = b"{}"
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        if explain is not None:
            raise explain(body, exc) from None
        raise default_error(exc, usage) from None


def default_error(exc: Exception, usage: str) -> InvalidRequest:
    """The error for a refused body: msgspec's detail with its JSON path, and ``usage``."""
    if isinstance(exc, RecursionError):
        return nested_error(usage)
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        return InvalidRequest(f"Invalid request body: {text}. Expected {usage}", _field_of(text))
    return InvalidRequest(f"Request body is not valid JSON ({exc}). Expected {usage}")


# Caller mistakes that keep their compatible reply (204/200) but are worth seeing: each adds an
# ``X-Kvmeta-Warning`` header to the reply and counts in ``kvmeta_caller_warnings_total{kind}``.
WARNING_HEADER = b"x-kvmeta-warning"
WARNING_KINDS = ("size_conflict", "unknown_field", "confirm_refused", "batch_refused")
CALLER_WARNINGS: dict[str, int] = dict.fromkeys(WARNING_KINDS, 0)
CallerWarning = tuple[str, str]  # (kind, text)
_MAX_WARNING_CHARS = 512


def _header_value(text: str) -> bytes:
    """ASCII only, no control characters (a caller's field name can hold anything)."""
    safe = json.dumps(text, ensure_ascii=True)[1:-1]
    if len(safe) > _MAX_WARNING_CHARS:
        safe = safe[: _MAX_WARNING_CHARS - 3] + "..."
    return safe.encode("ascii")


def reply(response: Response, warnings: Iterable[CallerWarning] = ()) -> Response:
    """``response`` with one ``X-Kvmeta-Warning`` header per warning (counted per kind)."""
    headers = []
    for kind, text in warnings:
        CALLER_WARNINGS[kind] = CALLER_WARNINGS.get(kind, 0) + 1
        headers.append((WARNING_HEADER, _header_value(f"{kind}: {text}")))
    if not headers:
        return response
    return Response(response.status, response.body, response.content_type, tuple(headers))


def _quoted(name: str) -> str:
    return "`" + (name if len(name) <= 64 else name[:61] + "...") + "`"


def unknown_fields_warning(unknown: list[str], known: tuple[str, ...]) -> CallerWarning:
    """Name each field the route ignored, with the closest known name when there is one."""
    parts = []
    for name in unknown[:3]:
        part = f"unknown field {_quoted(name)} ignored"
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(part + (f"; did you mean {_quoted(close[0])}?" if close else ""))
    if len(unknown) > 3:
        parts.append(f"and {len(unknown) - 3} more unknown field(s)")
    fields = ", ".join(map(_quoted, known))
    return ("unknown_field", "; ".join(parts) + f" (this route reads {fields})")


class BodyDecoder(Generic[T]):
    """Typed decoding that also notices fields the route does not read (a misspelt
    ``nmespace`` would otherwise silently mean the default pool).

    The fast path is one strict decode; only a body that fails it is decoded again leniently
    (raising the real error, if any) and looked at for unknown fields."""

    def __init__(self, struct: type[T], usage: str, explain: Explain | None = None) -> None:
        """``explain(body, exc)`` words a refused body (default: ``default_error``)."""
        self.struct = struct  # also the body's OpenAPI schema (``server.openapi``)
        self.usage = usage
        self._explain = explain
        self.fields: tuple[str, ...] = struct.__struct_fields__  # type: ignore[attr-defined]
        strict = types.new_class(struct.__name__, (struct,), {"forbid_unknown_fields": True})
        self._strict: msgspec.json.Decoder[Any] = msgspec.json.Decoder(strict)
        self._lenient = msgspec.json.Decoder(struct)

    def decode(self, body: bytes) -> tuple[T, list[CallerWarning]]:
        """Raises InvalidRequest naming the wrong JSON path and the shape expected."""
        if not body or body.isspace():
            body = b"{}"
        try:
            return self._strict.decode(body), []
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            pass
        value = decode_body(self._lenient, body, self.usage, self._explain)
        return value, self.unknown(body)

    def unknown(self, body: bytes) -> list[CallerWarning]:
        """The unknown-field warning for a body that decoded (so is a JSON object)."""
        try:
            data = msgspec.json.decode(body)
        except (msgspec.MsgspecError, RecursionError):  # pragma: no cover - decoded above
            return []
        extra = [k for k in data if k not in self.fields] if isinstance(data, dict) else []
        return [unknown_fields_warning(extra, self.fields)] if extra else []


def _field_of(message: str) -> str | None:
    """`$.keys[3]` -> `keys`; `missing required field `x`` -> `x`."""
    if "- at `$." in message:
        path = message.rsplit("- at `$.", 1)[1].rstrip("`")
        return path.split("[", 1)[0].split(".", 1)[0]
    if "field `" in message:
        return message.split("field `", 1)[1].split("`", 1)[0]
    return None


def parse_rank(segment: str) -> int:
    """A path rank as the reference servers parse it: ``-1`` and ``007`` are ints.

    Raises:
        InvalidPathParameter: the segment is not an integer.
    """
    digits = segment[1:] if segment[:1] in ("-", "+") else segment
    if not (digits.isascii() and digits.isdigit()):
        shown = segment if len(segment) <= 40 else segment[:37] + "..."
        raise InvalidPathParameter(
            f"Path parameter `rank` must be an integer, got {shown!r}; use e.g. /0/...",
            "rank",
        )
    # (int() of thousands of digits is slow and refused past 4300; no int64 has over 19)
    rank = int(segment) if len(digits.lstrip("0")) <= 19 else None
    if rank is None or not INT64_MIN <= rank <= INT64_MAX:
        raise InvalidPathParameter("Path parameter " + rank_error(segment, "rank"), "rank")
    return rank


class Route(NamedTuple):
    """One entry of a route table: ``handler(ctx, request, rank)`` is a module-level coroutine
    function; ``add_table`` binds ``ctx`` (the service, or the operator state)."""

    method: str
    pattern: str
    handler: Callable[[Any, Request, int], Coroutine[Any, Any, Response]]
    body: BodyDecoder[Any] | None = None  # how the handler decodes its body (None: no body)
    public: bool = False  # served without the token


def add_table(app: App, table: Iterable[Route], ctx: Any) -> None:
    """Register every route of ``table`` on ``app``, each handler bound to ``ctx``."""
    for route in table:
        app.add(route.method, route.pattern, partial(route.handler, ctx), route.public)


class _Route:
    __slots__ = ("segments", "rank_at", "handlers")

    def __init__(self, segments: tuple[str, ...], rank_at: int) -> None:
        self.segments = segments
        self.rank_at = rank_at
        self.handlers: dict[str, RouteHandler] = {}


class App:
    """Maps requests to route handlers. ``public`` routes skip authentication, not ``guard``."""

    def __init__(self, authorize: Callable[[Request], None] | None = None) -> None:
        # Runs on every request's headers after the token (``server.guard``: Host, Origin,
        # Content-Type), raising a KvmetaError to refuse it before any route sees it.
        self.guard: Callable[[Request], None] | None = None
        self._static: dict[str, _Route] = {}
        # (segment count, last segment) -> routes with a {rank} segment
        self._ranked: dict[tuple[int, str], list[_Route]] = {}
        self._public: set[str] = set()
        self.authorize = authorize
        # True once the HTTP layer calls ``head_check`` before reading bodies (``kvmeta
        # serve``); else ``__call__`` runs it first, so an app called directly (in-process
        # tests, benchmarks) refuses exactly what the server refuses.
        self.head_checked = False
        # path -> match, for ranked paths: engines send the same few paths all day.
        self._matched: dict[str, tuple[_Route, int, str]] = {}
        # Coroutine functions the server runs as tasks while it serves (cancelled at shutdown).
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = []

    def add(self, method: str, pattern: str, handler: RouteHandler, public: bool = False) -> None:
        segments = tuple(pattern.strip("/").split("/"))
        if public:
            self._public.add(pattern)
        if "{rank}" not in segments:
            route = self._static.setdefault(pattern, _Route(segments, -1))
        else:
            rank_at = segments.index("{rank}")
            bucket = self._ranked.setdefault((len(segments), segments[-1]), [])
            for route in bucket:
                if route.segments == segments:
                    break
            else:
                route = _Route(segments, rank_at)
                bucket.append(route)
        route.handlers[method] = handler
        self._matched.clear()

    def public_patterns(self) -> set[str]:
        """Patterns served without the token (``/health``)."""
        return set(self._public)

    def routes(self) -> list[tuple[str, str]]:
        """(method, pattern) of every route, for the OpenAPI document and tests."""
        out: list[tuple[str, str]] = []
        for route in list(self._static.values()) + [r for b in self._ranked.values() for r in b]:
            pattern = "/" + "/".join(route.segments)
            out.extend((method, pattern) for method in route.handlers)
        return sorted(out)

    def wrap_handlers(self, wrap: Callable[[str, str, RouteHandler], RouteHandler]) -> None:
        """Replace every handler ``h`` of ``(method, pattern)`` with ``wrap(method, pattern, h)``
        (metrics, access checks); call after all routes are added."""
        for route in list(self._static.values()) + [r for b in self._ranked.values() for r in b]:
            pattern = "/" + "/".join(route.segments)
            for method, handler in route.handlers.items():
                route.handlers[method] = wrap(method, pattern, handler)

    def _match(self, path: str) -> tuple[_Route, int, str]:
        hit = self._matched.get(path)
        if hit is not None:
            return hit
        route = self._static.get(path)
        if route is not None:
            return route, 0, path
        segments = path.strip("/").split("/")
        for route in self._ranked.get((len(segments), segments[-1]), ()):
            ok = all(
                seg == want
                for i, (seg, want) in enumerate(zip(segments, route.segments, strict=True))
                if i != route.rank_at
            )
            if ok:
                rank = parse_rank(segments[route.rank_at])
                hit = route, rank, "/" + "/".join(route.segments)
                if len(self._matched) >= 4096:
                    self._matched.clear()
                self._matched[path] = hit
                return hit
        raise NotFound("Not Found")

    def head_check(self, request: Request) -> Response | PublicRoute | None:
        """Every check a request passes before its route runs: the token, then ``guard``
        (Host, Origin, Content-Type). The HTTP layer runs it as soon as the headers are in
        (the request's body still empty), so a refused request is answered before its body is
        read or ``100 Continue`` is sent, and changes nothing. Returns the refusal to send (401,
        403, 415), None to go on, or ``PUBLIC`` for a route served without the token (which
        takes no body and does not authenticate the connection). Unknown paths need the token
        too (a 401, not a 404: no route is revealed and no body read without it)."""
        verdict: PublicRoute | None = None
        authorize = self.authorize
        if authorize is not None:
            try:
                pattern = self._match(request.path)[2]
            except KvmetaError:
                pattern = None
            if pattern in self._public:
                verdict = PUBLIC
            else:
                try:
                    authorize(request)
                except Unauthorized as exc:
                    return Response(401, _encode({"detail": str(exc)}), headers=_CHALLENGE)
        guard = self.guard
        if guard is not None:
            try:
                guard(request)
            except KvmetaError as exc:
                return error_response(exc.status, str(exc))
        return verdict

    async def __call__(self, request: Request) -> Response:
        if not self.head_checked:  # called directly, not by the HTTP layer
            verdict = self.head_check(request)
            if isinstance(verdict, Response):
                return verdict
        try:
            route, rank, _ = self._match(request.path)
            handler = route.handlers.get(request.method)
            if handler is None:
                raise MethodNotAllowed("Method Not Allowed")
            return await handler(request, rank)
        except Unauthorized as exc:
            return Response(401, _encode({"detail": str(exc)}), headers=_CHALLENGE)
        except QuotaExceeded as exc:
            return quota_response(exc)
        except KvmetaError as exc:
            return error_response(exc.status, str(exc))
        except RecursionError:  # a body nested too deeply for a decoder that did not say so
            return error_response(400, nested_error("a flat JSON object").message)
        except Exception:
            logger.exception("Unhandled error serving %s %s", request.method, request.path)
            return error_response(
                500, "Internal server error (a bug in kvmeta: the server log has the traceback)"
            )
