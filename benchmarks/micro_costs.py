#!/usr/bin/env python3
"""The small costs behind design choices the code's comments name, timed in one process.

Each line is one choice against its alternative, in microseconds of this process's CPU per
call (``time.process_time``, so that other processes on a shared machine do not count): the
median and min-max of ``--repeat`` rounds (each the mean over ``--number`` calls, the two
sides in alternating order), and of the per-round ratio. No server, no sockets.

- ``resp head``: a 64-key Redis reserve as the backend sends it (the request JSON-encoded)
  packed by ``store.redis.resp.pack`` (its head, the function name and the pool's key names,
  cached) against redis-py's ``pack_command``;
- ``resp strings``: an ``HMGET`` of 256 hex page keys given as one ``resp.Strings`` against
  one argument each;
- ``change``: a ``store.changes.Change`` (a NamedTuple) against the same fields as a frozen
  dataclass;
- ``in-process call``: an in-process ``exists`` of 64 keys stepped by
  ``client._local.run_now`` against the same with a private event loop set as the running
  loop around it.

    PYTHONPATH=src python benchmarks/micro_costs.py [--repeat 7] [--number 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from redis.connection import Connection  # noqa: E402

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.client._local import run_now  # noqa: E402
from kvmeta.service.ops import Service  # noqa: E402
from kvmeta.store.changes import Change  # noqa: E402
from kvmeta.store.disk.local import LocalBackend  # noqa: E402
from kvmeta.store.disk.memory import MemoryStore  # noqa: E402
from kvmeta.store.redis.layout import pool_keys  # noqa: E402
from kvmeta.store.redis.replies import encode  # noqa: E402
from kvmeta.store.redis.resp import Strings, pack  # noqa: E402

KEYS = [f"{i:064x}" for i in range(256)]


@dataclasses.dataclass(frozen=True)
class _FrozenChange:
    pool: PoolId
    kind: str
    keys: tuple[str, ...]
    reason: str = ""


def _pair(ours: Callable[[], Any], other: Callable[[], Any], repeat: int, number: int) -> str:
    """Both timed in alternating order, round by round: the medians (min-max) of each and of
    the per-round ratio other/ours, so that load drifting during the run favours neither."""
    a: list[float] = []
    b: list[float] = []
    for i in range(repeat):
        first, second = (ours, other) if i % 2 == 0 else (other, ours)
        t1 = timeit.Timer(first, timer=time.process_time).timeit(number) / number * 1e6
        t2 = timeit.Timer(second, timer=time.process_time).timeit(number) / number * 1e6
        a.append(t1 if i % 2 == 0 else t2)
        b.append(t2 if i % 2 == 0 else t1)
    ratios = [y / x for x, y in zip(a, b, strict=True)]

    def show(xs: list[float], unit: str = " us") -> str:
        return f"{statistics.median(xs):.2f}{unit} ({min(xs):.2f}-{max(xs):.2f})"

    return f"{show(a)} against {show(b)}; ratio {show(ratios, 'x')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()
    r, n = args.repeat, args.number

    pool = PoolId("s", 0, "kv")
    names = list(pool_keys(pool))
    request = encode((300.0, KEYS[:64], 0))  # as ``RedisBackend.reserve`` sends it
    reserve = ["FCALL", "kvmeta_reserve", len(names), *names, request, 2.0, "1700000000.0"]
    conn = Connection()
    ours = _pair(lambda: pack(reserve, 3 + len(names)), lambda: conn.pack_command(*reserve), r, n)
    print(f"resp head (64-key reserve), cached against redis-py: {ours}")
    many = Strings(KEYS)
    plain = ["HMGET", names[0], *KEYS]
    ours = _pair(lambda: pack(["HMGET", names[0], many], 2), lambda: pack(plain, 2), r, n)
    print(f"resp strings (256-key HMGET), Strings against one argument each: {ours}")
    keys = tuple(KEYS[:64])
    ours = _pair(
        lambda: Change(pool, "stored", keys), lambda: _FrozenChange(pool, "stored", keys), r, n * 5
    )
    print(f"change, NamedTuple against frozen dataclass: {ours}")
    service = Service(LocalBackend(MemoryStore()))
    run_now(service.initialize(pool, 4096))
    probe = KEYS[:64]
    loop = asyncio.new_event_loop()
    set_running = asyncio.events._set_running_loop

    def with_loop() -> Any:
        set_running(loop)
        try:
            return run_now(service.exists(pool, probe))
        finally:
            set_running(None)

    ours = _pair(lambda: run_now(service.exists(pool, probe)), with_loop, r, n)
    print(f"in-process call (64-key exists), run_now against a private running loop: {ours}")
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
