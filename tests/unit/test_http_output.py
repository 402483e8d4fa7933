"""The HTTP server in-process: the server-wide bound on unsent replies, and TLS served by the
standard asyncio loop as well as uvloop (the handshake runs per connection)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from kvmeta.server.http import HttpLimits, HttpServer, Request, Response, bind_sockets
from tests.support import self_signed_cert

REPLY = 8 * 1024 * 1024


async def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _silent_reader(addr: tuple[str, int]) -> socket.socket:
    """A client that sends one request and reads nothing (a tiny receive window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(addr)
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: localhost\r\n\r\n")
    return sock


def _read_whole_reply(addr: tuple[str, int]) -> int:
    with socket.create_connection(addr, timeout=30) as sock:
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(1 << 20):
            data += chunk
    return len(data.partition(b"\r\n\r\n")[2])


def test_unsent_replies_of_all_connections_stay_within_the_server_budget() -> None:
    budget = 3 * REPLY // 2
    served = [0]

    async def handler(request: Request) -> Response:
        served[0] += 1
        return Response(200, b"x" * REPLY, b"application/octet-stream")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        limits = HttpLimits(max_output_bytes=64 * 1024, max_total_output_bytes=budget)
        server = HttpServer(handler, limits, loop)
        (addr,) = await server.listen(bind_sockets("127.0.0.1", 0))
        hoarders = [await loop.run_in_executor(None, _silent_reader, addr) for _ in range(8)]
        await _until(lambda: served[0] == 8)
        held = sum(c.transport.get_write_buffer_size() for c in server.connections if c.transport)
        assert held <= budget, f"{held} bytes of unsent replies, budget {budget}"
        assert server.conns.unsent <= budget
        assert server.conns.shed >= 1
        # A client that reads still gets its whole reply.
        assert await loop.run_in_executor(None, _read_whole_reply, addr) == REPLY
        for sock in hoarders:
            sock.close()
        await server.shutdown()

    asyncio.run(main())


def _tls_get(addr: tuple[str, int], cafile: Path) -> bytes:
    context = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(addr, timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"GET /x HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = b""
            with contextlib.suppress(ssl.SSLError, ConnectionResetError):
                while chunk := tls.recv(65536):
                    data += chunk
    return data


def _silent_is_closed(addr: tuple[str, int]) -> bool:
    with socket.create_connection(addr, timeout=30) as sock:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


def _runners() -> list[Callable[[Coroutine[Any, Any, None]], None]]:
    runners: list[Callable[[Coroutine[Any, Any, None]], None]] = [asyncio.run]
    with contextlib.suppress(ImportError):
        import uvloop

        runners.append(uvloop.run)
    return runners


@pytest.mark.parametrize("run", _runners(), ids=lambda r: r.__module__.split(".")[0])
def test_tls_on_either_loop(
    run: Callable[[Coroutine[Any, Any, None]], None], tmp_path: Path
) -> None:
    cert, key = self_signed_cert(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def handler(request: Request) -> Response:
        return Response(200, b'{"ok": true}')

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = HttpServer(handler, HttpLimits(header_timeout=0.5), loop)
        (addr,) = await server.listen(bind_sockets("127.0.0.1", 0), ssl_context=context)
        reply = await loop.run_in_executor(None, _tls_get, addr, cert)
        assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b'{"ok": true}')
        # No handshake within the header timeout: closed (and uncounted again).
        assert await loop.run_in_executor(None, _silent_is_closed, addr)
        await _until(lambda: not server.connections)
        await server.shutdown()

    run(main())
