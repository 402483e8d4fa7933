"""How a handler coroutine is run: its first step bare, at once, and a Task only if it waits.

Most handlers finish without ever suspending (no disk or network wait), so the connection
drives the first step itself (``coro.send(None)``) in the ``data_received`` call that completed
the request, and a handler that finishes there is answered without a Task or a loop iteration.
Only a handler that suspends is handed to a Task (``finish``), which carries on from the point
where it yielded, as if it had run the coroutine from the start.

Why this mode and no other, on every Python from 3.10 on: it is the one that needs no Task for
a request that does not wait. A Task per request (``loop.create_task``, the only Task form
before 3.12) adds a loop iteration and a Task to every request, and an eager Task (3.12+,
``eager_start=True``) still allocates and registers a Task; benchmarks/README.md ("Handler
stepping") has the measured cost. What the bare step gives up is ``asyncio.current_task()``
during the first step, which async timeouts need (``asyncio.timeout``, ``wait_for`` on 3.12+,
``async_timeout``, so redis-py): a handler that needs it from its first line on is wrapped in
``in_task``, whose one yield moves it into the Task before it runs, on every Python alike.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

from kvmeta.server.wire import Response, Stamp, error_body, render

__all__ = ["finish", "in_task", "run_now", "task_reply"]

logger = logging.getLogger("kvmeta.server.http")
T = TypeVar("T")
_R = TypeVar("_R")


async def finish(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Drive a coroutine that suspended during its bare first step to completion.

    The Task running this sees what the coroutine yielded and sends or throws what it gets back
    into it (``_resume``), exactly as if the Task had run the coroutine from the start: an
    exception of the awaited future reaches the coroutine, and so do cancellation,
    KeyboardInterrupt and SystemExit, so its cleanup runs and the Task ends cancelled (a
    cancelled request never carries on as if nothing happened).
    """
    return await _resume(coro, yielded)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """``yield from coro``, begun after the coroutine's first step already yielded ``yielded``
    (the generator-based coroutine protocol; no private asyncio state is touched)."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - thrown in by the Task: the handler's own
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


def run_now(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run ``coro``'s first step inside this call and the rest in a Task, returned (None: it
    finished in that first step)."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return loop.create_task(finish(coro, yielded))


def in_task(
    handler: Callable[[_R], Coroutine[Any, Any, T]],
) -> Callable[[_R], Coroutine[Any, Any, T]]:
    """``handler``, run inside its Task from its first line on: for handlers that need
    ``asyncio.current_task()`` at once (a shared backend's timeouts). It costs such a request
    one loop iteration before it starts, which a request that waits on the network anyway
    pays in any mode."""

    async def tasked(request: _R) -> T:
        if asyncio.current_task() is None:
            await asyncio.sleep(0)  # a bare yield: the rest runs in the ``finish`` Task
        return await handler(request)

    return tasked


def task_reply(task: asyncio.Task[Response], keep_alive: bool, stamp: Stamp) -> tuple[bytes, bool]:
    """The bytes to send for a finished handler Task, and whether the connection stays."""
    if task.cancelled():
        return render(Response(503, error_body("Server shutting down")), False, stamp), False
    exc = task.exception()
    if exc is not None:
        logger.error("Unhandled error in request handler", exc_info=exc)
        return render(Response(500, error_body("Internal server error")), False, stamp), False
    return render(task.result(), keep_alive, stamp), keep_alive
