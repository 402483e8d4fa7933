"""What both in-process clients share: the server's ``Service`` over an in-memory backend, run
synchronously, one lock.

Every operation is the server's own coroutine (``service.ops.Service``), so a mistake raises
the same error class with the same message in-process as over HTTP (but for SGLang's "not
initialized", which its in-process client words its own way: ``client.sglang``). The caller
warnings the server sends as ``X-Kvmeta-Warning`` (a size conflict, refused confirms) come
back with the value and are logged here, on the ``kvmeta.client`` logger, with the header's
text.

``run_now`` drives a coroutine without an event loop: the in-memory backend never waits on
anything, so each operation finishes within its first step; a bare ``yield`` (the backend's
``asyncio.sleep(0)`` between the chunks of a long walk, which lets other requests in on the
server) is stepped over at once, since the lock keeps every other caller out anyway. Should a
backend ever wait on a future (a thread, a timer), the operation is finished on the client's
private event loop: during each step that loop is the thread's running loop, so any future is
made on it, and ``run_until_complete`` then drives the rest. That costs two thread-local
assignments per call, and never blocks a loop the caller may be running in this thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvmeta.lograte import warn_limited
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.service.warnings import Outcome
from kvmeta.store.disk.memory import MemoryBackend, MemoryStore
from kvmeta.store.epoch import new_epoch

__all__ = ["LocalState", "run_now"]

logger = logging.getLogger("kvmeta.client")

T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> T:
    """Run ``coro`` to its end in this thread: stepped directly while it never waits, on
    ``loop`` (which must not be running) from the first future it waits on."""
    outer = asyncio._get_running_loop()
    asyncio._set_running_loop(loop)
    try:
        while True:
            waiting = coro.send(None)
            if waiting is not None:
                break
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        asyncio._set_running_loop(outer)
    asyncio._set_running_loop(None)  # (run_until_complete refuses to nest under a running one)
    try:
        return loop.run_until_complete(_resume(coro, waiting))
    finally:
        asyncio._set_running_loop(outer)


async def _resume(coro: Coroutine[Any, Any, T], waiting: Any) -> T:
    """Finish a coroutine suspended on ``waiting`` (a future of this loop, or None: a bare
    yield). Each future's result or exception is delivered inside ``coro``, where its own
    ``await`` reads it, so the coroutine sees exactly what a task would have given it."""
    while True:
        if waiting is None:
            await asyncio.sleep(0)
        else:
            await asyncio.wait((waiting,))
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


class LocalState:
    """Pools in this process, no server: for a single-node engine.

    Thread-safe (one lock over each whole operation); state is lost when the process exits.
    """

    def __init__(
        self,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        limits: RequestLimits | None = None,
    ) -> None:
        self._store = MemoryStore(reservation_ttl=reservation_ttl, read_lease=read_lease)
        self._service = Service(MemoryBackend(self._store), limits)
        self._lock = threading.Lock()
        self._epoch = new_epoch()
        self._loop = asyncio.new_event_loop()
        weakref.finalize(self, self._loop.close)

    @property
    def epoch(self) -> str:
        """As the HTTP clients' ``epoch``: the state lives and dies with this object, so its
        epoch never changes (there is nothing to re-initialise)."""
        return self._epoch

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            return run_now(coro, self._loop)

    def _warned(self, coro: Coroutine[Any, Any, Outcome[T]]) -> T:
        """Run ``coro`` and log its caller warnings as the server's header would carry them."""
        outcome = self._run(coro)
        for kind, text in outcome.warnings:
            warn_limited(logger, f"client {kind}", "%s: %s", kind, text)
        return outcome.value
