"""How the HTTP server steps handlers, alike on every Python: a handler that finishes at once is
answered at once, without a Task; one that waits is finished by a Task; and ``in_task`` puts a
handler inside its Task from its first line on, where ``asyncio.current_task()`` works
(redis-py's timeouts need it)."""

from __future__ import annotations

import asyncio

import pytest

from kvmeta.server.http import HttpServer, Request, Response, bind_sockets, in_task


async def roundtrip(server: HttpServer, path: str) -> bytes:
    (addr,) = await server.listen(bind_sockets("127.0.0.1", 0))
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    await server.shutdown()
    return data


@pytest.mark.parametrize("tasked", [True, False])
@pytest.mark.parametrize("path", ["/now", "/wait"])
def test_first_step_and_task(tasked: bool, path: str) -> None:
    seen: list[bool] = []

    async def handler(request: Request) -> Response:
        seen.append(asyncio.current_task() is not None)  # during the first step
        if request.path == "/wait":
            await asyncio.sleep(0.01)
            seen.append(asyncio.current_task() is not None)  # resumed: always in a Task
        return Response(200, b'{"ok": true}')

    async def main() -> bytes:
        served = in_task(handler) if tasked else handler
        server = HttpServer(served, loop=asyncio.get_running_loop())
        return await roundtrip(server, path)

    data = asyncio.run(main())
    assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b'{"ok": true}')
    assert seen[0] is tasked  # the bare first step runs outside any Task
    assert all(seen[1:])


def test_a_handler_bug_in_the_first_step_is_a_500() -> None:
    async def handler(request: Request) -> Response:
        raise ZeroDivisionError

    async def main() -> bytes:
        return await roundtrip(HttpServer(handler, loop=asyncio.get_running_loop()), "/")

    assert asyncio.run(main()).startswith(b"HTTP/1.1 500")
