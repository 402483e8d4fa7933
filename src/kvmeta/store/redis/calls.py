"""The call loop: one script or command to the node that serves its key, until it succeeds or
``--failover-timeout`` runs out; and a pool operation's call on it (its request as one JSON
argument, its reply's code checked, the change it made handed to the change feed).

Time (reservation and read leases) is Redis ``TIME``, read inside each script, so servers with
skewed clocks still agree, through each pool's lease clock, which a step of Valkey's clock
cannot move (``_lib.lua`` ``pool_now``). Tests that compare this backend with the memory one
step by step give both one clock instead (``RedisBackend(clock=...)``): ``TIMED`` says where a
script takes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import AskError, MovedError, ReadOnlyError, RedisError, ResponseError

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable, NotReplicated
from kvmeta.store.changes import CLEARED, Change
from kvmeta.store.redis.epoch import EPOCH_COMMANDS, RedisEpoch
from kvmeta.store.redis.feed import ChangeSequencer
from kvmeta.store.redis.layout import pool_keys
from kvmeta.store.redis.nodes import Node, Topology, retriable
from kvmeta.store.redis.replies import checked, decode, encode, text
from kvmeta.store.redis.resp import pack, pack_many
from kvmeta.store.redis.scripts import ScriptLibrary
from kvmeta.store.redis.url import RedisTarget

__all__ = ["SCRIPTS", "STEP_BOUND", "TIMED", "ScriptCalls"]

# One logger for the whole Redis backend, whichever module of it speaks.
logger = logging.getLogger("kvmeta.store.redis.backend")

# The scripts the backend runs (``store/redis/lua/<name>.lua``).
SCRIPTS = (
    "initialize",
    "exists",
    "reserve",
    "confirm",
    "get",
    "delete",
    "clear",
    "stats",
    "check",
    "v_register",
    "v_exists",
    "v_remove",
    "v_world",
    "v_index",
    "hidx_fill",
    "hidx_release",
    "hold",
)
# Commands whose head (name, function, key count and keys) repeats and is packed once
# (store.redis.resp).
_SCRIPT_CALLS = frozenset({"FCALL", "EVALSHA"})
# The most one call may advance a pool's lease clock (seconds), and what every lease is written
# longer than asked: a step of Valkey's wall clock, of any size, then ends no lease early
# (``_lib.lua`` ``pool_now``, docs/guarantees.md "Leases when Valkey's clock steps"). Above the
# time between two calls of a pool in use, so its lease clock keeps real time.
STEP_BOUND = 2.0
# Scripts that read the time, and the ARGV index of the clock-step bound every call passes (one
# past their own arguments); the time they take instead of Redis TIME when the backend has a test
# clock comes one after it (absent in production). See _lib.lua ``pool_now``; a static test
# checks each script reads exactly these ARGVs.
TIMED = {
    "reserve": 3,
    "confirm": 3,
    "get": 2,
    "delete": 3,
    "clear": 4,
    "stats": 1,
    "v_remove": 4,
}
# Scripts whose code 1 answers a request with "this pool does not exist" (stats and check skip
# such a pool instead: one listed before it was created, see ``RedisBackend._sadd_pool``).
_ANSWERS_GONE = frozenset({"exists", "reserve", "confirm", "get", "delete", "clear", "hidx_fill"})
# Back-off between retries while a failover or resharding settles: 50 ms doubling to 500 ms.
_FIRST_DELAY = 0.05
_MAX_DELAY = 0.5
_MAX_REDIRECTS = 16  # MOVED/ASK hops for one call before it counts as a failure to retry
_MAX_RECHECKS = 3  # primaries one unacknowledged write may move to (see ``Topology.recheck``)


class ScriptCalls:
    """The part of ``RedisBackend`` that reaches Redis; the other parts call through it
    (``_run``, ``_command``), and tests replace those methods on an instance to watch or
    stall calls. Its state is set by ``RedisBackend.__init__`` and ``start``."""

    target: RedisTarget
    failover_timeout: float
    min_replicas_ack: int
    replica_ack_timeout: float
    _clock: Callable[[], float] | None
    _step_bound: str  # STEP_BOUND as the scripts take it
    _scripts: ScriptLibrary
    _topo: Topology | None
    _ack: tuple[Any, ...] | None  # the WAIT/WAITAOF pipelined after a write
    _epochs: RedisEpoch
    _feed: ChangeSequencer  # the change feed: its listener, calls in flight

    async def _run(self, script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
        """Run one script on the primary of ``keys[0]``'s slot; errors -> 503.

        ``keys`` is every key the script touches (all in one hash slot). A state-changing
        script gets the WAIT of ``--min-replicas-ack`` in the same send.
        """
        if script in TIMED:
            assert len(args) + 1 == TIMED[script], f"{script}: the bound goes after its arguments"
            args = [*args, self._step_bound]
            if self._clock is not None:
                args.append(repr(float(self._clock())))
        command = self._scripts.command(script, keys, args)
        wait = self._ack if self._ack is not None and self._scripts.writes(script) else None
        reply: list[Any] = decode(await self._call(keys[0], command, script, wait))
        if reply[0] == 1 and script in _ANSWERS_GONE:
            await self._epochs.recheck()  # the pool is gone: see ``RedisBackend._gone``
        return reply

    async def _command(self, key: str, *args: Any) -> Any:
        """One plain command (registry, epoch) routed by ``key``, with the same retries."""
        return await self._call(key, args, str(args[0]), None)

    async def _install_on(self, node: Node) -> str:
        return await self._scripts.install(node.call)

    async def _call(
        self, key: str, command: tuple[Any, ...], what: str, wait: tuple[Any, ...] | None
    ) -> Any:
        """Send ``command`` (and ``wait``) to the node serving ``key`` until it succeeds.

        ``MOVED`` -> the new owner at once; ``ASK`` -> ``ASKING`` + the command on the target;
        kvmeta's code missing on the node -> install it there; a failover, lost connection or
        ``TRYAGAIN`` -> re-learn the topology and retry, backing off, until
        ``failover_timeout``; a write too few replicas acknowledged -> ask whether the node is
        still the primary (``Topology.recheck``) and, if another one took over, run it there.
        Every operation is idempotent, so a mutation whose reply was lost (or not
        acknowledged) may run again safely.
        """
        topo = self._topo
        if topo is None:
            raise BackendUnavailable(f"Redis backend {self.target.shown} is not started")
        deadline = 0.0
        delay = _FIRST_DELAY
        asking: Node | None = None
        installed = False
        hops = 0
        rechecks = 0
        where = self.target.shown
        node: Node | None = None
        while True:
            try:
                node = asking or topo.route(key)
                where = node.addr
                reply, acks = await self._send(node, command, wait, asking is not None)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                asking = None
                if isinstance(exc, AskError) and hops < _MAX_REDIRECTS:
                    hops += 1
                    if isinstance(exc, MovedError):
                        topo.moved(exc.slot_id, exc.host, exc.port)
                    else:
                        asking = topo.node(exc.host, exc.port)
                    continue
                if self._scripts.missing(exc) and not installed and node is not None:
                    installed = True
                    self._epochs.doubt()  # (a node that lost its code may have lost its data)
                    logger.warning("Redis %s lacks kvmeta's code (%s): installing", where, exc)
                    await self._install_on(node)
                    continue
                if not (retriable(exc) or isinstance(exc, AskError)):
                    raise BackendUnavailable(
                        f"Redis backend at {where} failed during {what}: {exc}"
                    ) from exc
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.failover_timeout
                elif now >= deadline:
                    why = f"; {topo.last_error}" if topo.last_error else ""
                    raise BackendUnavailable(
                        f"Redis backend at {where} failed during {what} and did not recover "
                        f"within --failover-timeout {self.failover_timeout:g}s: {exc}{why}"
                    ) from exc
                self._epochs.doubt()
                lost = not isinstance(exc, ResponseError) or isinstance(exc, ReadOnlyError)
                if lost and node is not None:  # its idle connections may be half-closed
                    await node.drop()
                await asyncio.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, _MAX_DELAY)
                await topo.refresh()
                hops = 0
                continue
            if wait is not None:
                try:
                    self._check_acks(where, what, acks)
                except NotReplicated:
                    # Its replicas left it: a failover may have promoted one of them while
                    # this node stalled (it still answers as a primary until demoted).
                    rechecks += 1
                    assert node is not None
                    if rechecks <= _MAX_RECHECKS and await topo.recheck(node):
                        self._epochs.doubt()
                        hops = 0
                        continue
                    raise
            epochs = self._epochs
            if epochs.doubts != epochs.read_for and what not in EPOCH_COMMANDS:
                await epochs.settle()
            return reply

    def _check_acks(self, where: str, what: str, acks: Any) -> None:
        assert self._ack is not None
        n = self.min_replicas_ack
        got = int(acks[1]) if isinstance(acks, list) else int(acks)
        local = int(acks[0]) if isinstance(acks, list) else 1
        if got >= n and local >= 1:
            return
        raise NotReplicated(
            f"Redis primary {where}: {got} of {n} replica(s) acknowledged {what} within "
            f"{self.replica_ack_timeout:g}s (--min-replicas-ack {n}, --replica-ack-timeout)"
            + ("" if local >= 1 else " and the primary's AOF fsync did not complete")
            + "; the change may not survive a failover. The request is safe to retry"
        )

    async def _send(
        self, node: Node, command: tuple[Any, ...], wait: tuple[Any, ...] | None, asking: bool
    ) -> tuple[Any, Any]:
        """One write and its replies, on a link of ``node`` (``store.redis.link``), the request
        packed by ``store.redis.resp``: redis-py's client and its connection pool cost well over
        twice the CPU per call (benchmarks/README.md, "Implementation costs")."""
        head = 3 + int(command[2]) if command[0] in _SCRIPT_CALLS else 0
        if wait is None and not asking:
            replies = await node.request(pack(command, head), 1)
        else:
            parts: list[tuple[tuple[Any, ...], int]] = []
            if asking:
                parts.append((("ASKING",), 1))
            parts.append((command, head))
            if wait is not None:
                parts.append((wait, len(wait)))
            replies = await node.request(pack_many(parts), len(parts), wait is not None)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies[int(asking)], replies[-1] if wait is not None else None

    async def _pool_op(self, script: str, pid: PoolId, request: Any) -> list[Any]:
        """Run one pool script with ``request`` as its JSON argument; raise its error code."""
        reply = await self._run(script, pool_keys(pid), [encode(request)])
        return checked(pid, reply, request)

    async def _changing(
        self,
        script: str,
        pid: PoolId,
        keys: tuple[str, ...],
        args: list[Any],
        kind: str,
        reason: str,
    ) -> list[Any]:
        """Run a script that changes stored keys, with the feed flag as its last argument. With
        a listener, its reply ends with ``[change counter, key, ...]`` when it changed any,
        which becomes one ``Change`` (``keys`` empty for CLEARED), delivered in counter order."""
        if self._feed.listener is None:
            return await self._run(script, keys, [*args, "0"])
        ticket = self._feed.begin(pid)
        try:
            reply = await self._run(script, keys, [*args, "1"])
        except BaseException:
            # Sent, perhaps run (a lost reply, a replica wait that fell short, a script error
            # after some writes, a cancelled caller): the pool is reported UNSURE.
            self._feed.end(ticket, unsure=True)
            raise
        if reply and isinstance(reply[-1], list):
            fed = reply.pop()
            changed = () if kind == CLEARED else tuple(text(k) for k in fed[1:])
            self._feed.end(ticket, int(fed[0]), Change(pid, kind, changed, reason))
        else:
            self._feed.end(ticket)
        return reply

    async def _changing_op(
        self, script: str, pid: PoolId, request: Any, kind: str, reason: str
    ) -> list[Any]:
        """``_pool_op`` for a script that changes stored keys (``_changing``)."""
        keys = pool_keys(pid)
        reply = await self._changing(script, pid, keys, [encode(request)], kind, reason)
        return checked(pid, reply, request)
