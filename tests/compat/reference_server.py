"""SGLang's released reference metadata server, run in-process behind its released client.

FastAPI is not installed for the tests, so the server registers its routes on the stand-in app
of ``stock_clients``, and the hop from client to server is a ``requests`` transport adapter
that calls the route handler the path matches. Each request the stock client makes thus runs
the server's own handler on the server's own state; saving uses the server's own code too.
Only the HTTP framework is replaced, never what decides a pool's name or a key's page.
"""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import BaseAdapter

from tests.compat.stock_clients import HTTPException

__all__ = ["URL", "connect", "reference_server"]

URL = "http://sglang-reference-server"


class _Request:
    """What the handlers read of a request: its body."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def body(self) -> bytes:
        return self._body


def _match(pattern: str, path: str) -> dict[str, int] | None:
    """The path parameters, or None. Every one of the reference servers' is an int rank."""
    want, got = pattern.strip("/").split("/"), path.strip("/").split("/")
    if len(want) != len(got):
        return None
    params: dict[str, int] = {}
    for w, g in zip(want, got, strict=True):
        if w.startswith("{"):
            params[w.strip("{}")] = int(g)
        elif w != g:
            return None
    return params


class _Adapter(BaseAdapter):
    """Answers the stock client's requests with the reference server's route handlers."""

    def __init__(self, app: Any) -> None:
        super().__init__()
        self.app = app

    def _route(self, method: str, path: str) -> tuple[Any, dict[str, int]]:
        for (route_method, pattern), handler in self.app.routes.items():
            params = _match(pattern, path)
            if route_method == method and params is not None:
                return handler, params
        raise AssertionError(f"the reference server has no route {method} {path}")

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> Any:
        handler, params = self._route(request.method or "", urlsplit(request.url).path)
        body = request.body if isinstance(request.body, bytes) else b""
        try:
            answer = asyncio.run(handler(**params, request=_Request(body)))
            status, content = answer.status_code, answer.body
        except HTTPException as exc:
            status, content = exc.status_code, json.dumps({"detail": exc.detail}).encode()
        response = requests.Response()
        response.status_code = status
        response._content = content
        response.url = request.url or ""
        response.request = request
        return response

    def close(self) -> None:
        pass


def reference_server(stock: types.ModuleType, persistence_path: Path) -> Any:
    """A new ``Hf3fsMetadataServer`` of the released module ``stock``, persisting to
    ``persistence_path`` when its ``state.save_to_disk()`` is called."""
    return stock.Hf3fsMetadataServer(persistence_path=str(persistence_path), save_interval=3600)


def connect(stock: types.ModuleType, server: Any) -> Any:
    """The released ``Hf3fsGlobalMetadataClient``, its requests answered by ``server``."""
    client = stock.Hf3fsGlobalMetadataClient(URL)
    client._session.mount(URL, _Adapter(server.app))
    return client
