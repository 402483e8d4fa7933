"""``finish`` (the driver of handlers that suspend) never swallows a cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvmeta.server.http import Response
from kvmeta.server.stepping import finish


async def _start(handler: Any) -> tuple[asyncio.Task[Response], list[str]]:
    """Run ``handler`` eagerly as the HTTP layer does, then hand it to ``finish``."""
    log: list[str] = []
    coro = handler(log)
    yielded = coro.send(None)
    task = asyncio.get_running_loop().create_task(finish(coro, yielded))
    await asyncio.sleep(0)  # the task now waits on the handler's future
    return task, log


def test_cancel_after_the_awaited_future_finished_still_cancels() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handler(log: list[str]) -> Response:
            try:
                await fut
                log.append("carried on")
                return Response(204)
            finally:
                log.append("cleaned up")

        task, log = await _start(handler)
        fut.set_result(1)  # done, but the task has not run yet...
        task.cancel()  # ...when the server cancels it (shutdown)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert log == ["cleaned up"]

    asyncio.run(main())


def test_cancel_while_waiting_reaches_the_handler() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handler(log: list[str]) -> Response:
            try:
                await fut
            except asyncio.CancelledError:
                log.append("saw cancel")
                raise
            return Response(204)

        task, log = await _start(handler)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == ["saw cancel"]

    asyncio.run(main())


def test_an_error_of_the_awaited_future_reaches_the_handler() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handler(log: list[str]) -> Response:
            try:
                await fut
            except OSError as exc:
                return Response(503, str(exc).encode())
            return Response(204)

        task, _ = await _start(handler)
        fut.set_exception(OSError("disk"))
        response = await task
        assert response.status == 503 and response.body == b"disk"

    asyncio.run(main())
