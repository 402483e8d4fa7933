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
server) is stepped over at once, since the lock keeps every other caller out anyway. An
operation that waits on a future (a thread, a timer, a network reply) is a backend that does
not belong in-process: it is refused with an error that says so, rather than finished on a
private event loop, because that loop would have to be the thread's running loop during every
step (a future binds to the loop running when it is made), which costs every call
(``benchmarks/micro_costs.py``) for a path no operation takes; and in a thread that runs its own
loop (an engine calling from async code) the future would belong to that loop, which this
call blocks, so nothing could finish it anyway.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvmeta.core import EVICTION_POLICIES
from kvmeta.errors import ConfigError, KvmetaError
from kvmeta.lograte import warn_limited
from kvmeta.service.limits import RequestLimits
from kvmeta.service.ops import Service
from kvmeta.service.warnings import Outcome
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.epoch import new_epoch

__all__ = ["LocalState", "run_now"]

logger = logging.getLogger("kvmeta.client")

T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end in this thread, stepping over bare yields.

    Raises:
        KvmetaError: the coroutine waited on a future, which nothing in this thread can
            finish (an internal error: the in-memory backend never does).
    """
    try:
        while True:
            waiting = coro.send(None)
            if waiting is not None:
                break
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except RuntimeError as exc:  # (KvmetaError is one too: its type is not plain RuntimeError)
        if type(exc) is RuntimeError and str(exc) == "no running event loop":
            raise _waited(coro, "an event loop") from exc
        raise
    coro.close()
    raise _waited(coro, f"to wait for {waiting!r}")


def _waited(coro: Coroutine[Any, Any, Any], what: str) -> KvmetaError:
    name = getattr(coro, "__qualname__", "an operation")
    return KvmetaError(
        f"internal error: {name} needed {what} in process, where nothing can wait for it; an "
        "in-process client needs a backend that never waits (the in-memory one): report this "
        "as a bug"
    )


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
        eviction: str = "prefix",
    ) -> None:
        # ``eviction``: as ``kvmeta serve --eviction`` for local state, leaf-first by default
        # (an engine's own host cache sits in front of these pools too).
        policy = EVICTION_POLICIES.get(eviction)
        if policy is None:
            choices = " or ".join(map(repr, EVICTION_POLICIES))
            raise ConfigError(f"eviction={eviction!r} is not a policy; use {choices}", "eviction")
        self._store = MemoryStore(
            reservation_ttl=reservation_ttl, read_lease=read_lease, policy=policy
        )
        self._service = Service(LocalBackend(self._store), limits)
        self._lock = threading.Lock()
        self._epoch = new_epoch()

    @property
    def epoch(self) -> str:
        """As the HTTP clients' ``epoch``: the state lives and dies with this object, so its
        epoch never changes (there is nothing to re-initialise)."""
        return self._epoch

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            return run_now(coro)

    def _warned(self, coro: Coroutine[Any, Any, Outcome[T]]) -> T:
        """Run ``coro`` and log its caller warnings as the server's header would carry them."""
        outcome = self._run(coro)
        for kind, text in outcome.warnings:
            warn_limited(logger, f"client {kind}", "%s: %s", kind, text)
        return outcome.value
