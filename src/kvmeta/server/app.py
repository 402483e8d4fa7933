"""The request handler: routing, body decoding, and the one error -> response mapping.

Routes come from the dialect modules (``server.sglang``, ``server.vllm``) and the operator
routes (``server.ops_routes``); each is ``(method, pattern, handler)`` where a pattern may hold
one ``{rank}`` segment. Every ``KvmetaError`` becomes ``{"detail": message}`` with the error's
``status``; anything else is a bug: logged with its traceback and answered 500.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec

from kvmeta.errors import InvalidRequest, KvmetaError, MethodNotAllowed, NotFound, Unauthorized
from kvmeta.server.http import Request, Response

__all__ = [
    "NO_CONTENT",
    "App",
    "InvalidPathParameter",
    "RouteHandler",
    "decode_body",
    "json_response",
]

logger = logging.getLogger(__name__)

RouteHandler = Callable[[Request, int], Coroutine[Any, Any, Response]]
T = TypeVar("T")

NO_CONTENT = Response(204)
_encode = msgspec.json.encode


class InvalidPathParameter(InvalidRequest):
    """Raised when a path segment that must be an integer rank is not one."""

    status = 422


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, _encode(obj))


def error_response(status: int, detail: str) -> Response:
    return Response(status, _encode({"detail": detail}))


# RFC 9110: a 401 names the schemes it accepts; both work with the same token.
_CHALLENGE = ((b"www-authenticate", b'Bearer realm="kvmeta", Basic realm="kvmeta"'),)


def decode_body(decoder: msgspec.json.Decoder[T], body: bytes, usage: str) -> T:
    """Decode and validate a JSON body; an empty body means ``{}``.

    Raises:
        InvalidRequest: naming the JSON path that is wrong and the shape expected (``usage``).
    """
    if not body or body.isspace():
        body = b"{}"
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise InvalidRequest(
            f"Invalid request body: {text}. Expected {usage}", _field_of(text)
        ) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON ({exc}). Expected {usage}") from None


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
        raise InvalidPathParameter(
            f"Path parameter `rank` must be an integer, got {segment!r}; use e.g. /0/...",
            "rank",
        )
    return int(segment)


class _Route:
    __slots__ = ("segments", "rank_at", "handlers")

    def __init__(self, segments: tuple[str, ...], rank_at: int) -> None:
        self.segments = segments
        self.rank_at = rank_at
        self.handlers: dict[str, RouteHandler] = {}


class App:
    """Maps requests to route handlers. ``public`` routes skip authentication."""

    def __init__(self, authorize: Callable[[Request], None] | None = None) -> None:
        self._static: dict[str, _Route] = {}
        # (segment count, last segment) -> routes with a {rank} segment
        self._ranked: dict[tuple[int, str], list[_Route]] = {}
        self._public: set[str] = set()
        self.authorize = authorize
        # True once the HTTP layer calls ``head_check`` before reading bodies (``kvmeta
        # serve``): then ``__call__`` need not check the token a second time.
        self.auth_in_head = False
        # path -> match, for ranked paths: engines send the same few paths all day.
        self._matched: dict[str, tuple[_Route, int, str]] = {}

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

    def head_check(self, method: bytes, url: bytes, authorization: bytes | None) -> Response | None:
        """The token check, run by the HTTP layer as soon as a request's headers are in, so a
        client without the token never gets ``100 Continue`` nor has its body read. Returns
        the 401 to send, or None to go on. Unknown paths need the token too (a 401, not a 404:
        no route is revealed and no body read without it)."""
        authorize = self.authorize
        if authorize is None:
            return None
        path = url.split(b"?", 1)[0].decode("latin-1")
        try:
            pattern = self._match(path)[2]
        except KvmetaError:
            pattern = None
        if pattern in self._public:
            return None
        try:
            authorize(Request(method.decode("latin-1"), path, "", b"", authorization))
        except Unauthorized as exc:
            return Response(401, _encode({"detail": str(exc)}), headers=_CHALLENGE)
        return None

    async def __call__(self, request: Request) -> Response:
        try:
            route, rank, pattern = self._match(request.path)
            handler = route.handlers.get(request.method)
            if handler is None:
                raise MethodNotAllowed("Method Not Allowed")
            if self.authorize is not None and not self.auth_in_head and pattern not in self._public:
                self.authorize(request)
            return await handler(request, rank)
        except Unauthorized as exc:
            return Response(401, _encode({"detail": str(exc)}), headers=_CHALLENGE)
        except KvmetaError as exc:
            return error_response(exc.status, str(exc))
        except Exception:
            logger.exception("Unhandled error serving %s %s", request.method, request.path)
            return error_response(
                500, "Internal server error (a bug in kvmeta: the server log has the traceback)"
            )
