"""What travels over the wire: the parsed ``Request``, the ``Response`` a handler returns, the
limits a request is held to, and the bytes of a reply (``render``).

Why a module of its own: the route layer (``server.app`` and the dialects) needs these types
and nothing of the connection machinery, and ``render`` is shared by the connection, the
benchmarks and the in-process tests, which must produce the bytes the server sends.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any

import msgspec

__all__ = [
    "EPOCH_HEADER",
    "NO_STAMP",
    "PUBLIC",
    "HeadCheck",
    "Handler",
    "HttpLimits",
    "PublicRoute",
    "Request",
    "Response",
    "Stamp",
    "error_body",
    "render",
]


class Request:
    """One parsed request. ``path`` excludes the query string; ``peer`` is the client's
    address (host, port) when known, for warnings about two engines on one pool. ``scope`` is
    the authenticated token's scope (``server.tokens.Scope``), set by ``server.access`` when a
    tokens file is in use; None: all access, tenant ``""``. ``host``, ``origin`` and
    ``content_type`` are those headers' raw values (None: not sent), for ``server.guard``."""

    __slots__ = (
        "method",
        "path",
        "query",
        "body",
        "authorization",
        "peer",
        "scope",
        "host",
        "origin",
        "content_type",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        body: bytes,
        authorization: bytes | None,
        peer: Any = None,
        host: bytes | None = None,
        origin: bytes | None = None,
        content_type: bytes | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.authorization = authorization
        self.peer = peer
        self.scope: Any = None
        self.host = host
        self.origin = origin
        self.content_type = content_type


class Response:
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        content_type: bytes = b"application/json",
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class HttpLimits:
    """Sizes and times a request may take, how many connections may be open and how much
    unsent output they may hold; exceeding one is answered 413/431/408 (or a closed
    connection) with the flag to raise.

    ``max_output_bytes``: a connection whose unsent replies exceed it is not read, nor are the
    requests it already sent started, until they drain (to a quarter of it);
    ``max_total_output_bytes``: all connections together, beyond which those holding the most
    are closed; ``public_body_bytes``: the largest body of a route served without the token.
    At most half of ``max_connections`` may be connections that have not yet sent a request
    with a valid token (``server.conn_table``)."""

    __slots__ = (
        "max_body_bytes",
        "max_header_bytes",
        "header_timeout",
        "idle_timeout",
        "max_connections",
        "max_output_bytes",
        "max_total_output_bytes",
        "public_body_bytes",
    )

    def __init__(
        self,
        max_body_bytes: int = 16 * 1024 * 1024,
        max_header_bytes: int = 64 * 1024,
        header_timeout: float = 10.0,
        idle_timeout: float = 300.0,
        max_connections: int = 4096,
        max_output_bytes: int = 256 * 1024,
        max_total_output_bytes: int = 128 * 1024 * 1024,
        public_body_bytes: int = 1024,
    ):
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.max_output_bytes = max_output_bytes
        self.max_total_output_bytes = max_total_output_bytes
        self.public_body_bytes = public_body_bytes


class PublicRoute:
    """What ``head_check`` answers (``PUBLIC``) for a route served without the token: the
    request goes on, but its body may be at most ``HttpLimits.public_body_bytes`` (refused
    413 at the headers, unread, beyond) and it does not make its connection authenticated."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PUBLIC"


PUBLIC = PublicRoute()

# ``head_check(request)``: called once the headers are in, with the request as far as it is
# known (its body still empty); a Response refuses the request (the connection is closed
# without reading the body), None lets it go on as authenticated (or with no token
# configured), ``PUBLIC`` as a public route.
HeadCheck = Callable[[Request], "Response | PublicRoute | None"]
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


EPOCH_HEADER = b"x-kvmeta-epoch"
_EPOCH_UNSAFE = re.compile(rb"[^A-Za-z0-9._:-]")


class Stamp:
    """The headers every reply carries (today: the backend epoch), pre-rendered once per value
    together with the two common replies, so a reply pays no formatting for them."""

    __slots__ = ("value", "extra", "ok_json", "no_content")

    def __init__(self, value: str | None) -> None:
        self.value = value
        extra = b""
        if value:
            safe = _EPOCH_UNSAFE.sub(b"_", value.encode("utf-8", "replace"))[:128]
            extra = EPOCH_HEADER + b": " + safe + b"\r\n"
        self.extra = extra
        self.ok_json = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + extra.replace(b"%", b"%%")
            + b"content-length: %d\r\n\r\n%s"
        )
        self.no_content = b"HTTP/1.1 204 No Content\r\n" + extra + b"\r\n"


NO_STAMP = Stamp(None)


def render(response: Response, keep_alive: bool, stamp: Stamp = NO_STAMP) -> bytes:
    """The bytes of a response (no Date/Server headers: nobody needs them, they cost), with
    the headers of ``stamp``."""
    if keep_alive and not response.headers:
        # The two replies of nearly every request, in one formatting step.
        status = response.status
        if status == 204:
            return stamp.no_content
        if status == 200 and response.content_type == b"application/json":
            return stamp.ok_json % (len(response.body), response.body)
    parts = [_status_line(response.status)]
    if response.status != 204 and response.status >= 200:
        parts.append(
            b"content-type: %s\r\ncontent-length: %d\r\n"
            % (response.content_type, len(response.body))
        )
    parts.append(stamp.extra)
    for name, value in response.headers:
        parts.append(b"%s: %s\r\n" % (name, value))
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    if response.status != 204:
        parts.append(response.body)
    return b"".join(parts)


def error_body(detail: str) -> bytes:
    return msgspec.json.encode({"detail": detail})
