"""CPU per Redis round trip in this process: redis-py's asyncio connection against kvmeta's
``Link`` (``store/redis/link.py``), on one private valkey-server, under uvloop.

Each side sends the same command (``ECHO`` of a 5,000-byte value: about a 64-key script call
and its reply) from N concurrent tasks: redis-py with one connection per task (it carries one
call at a time), the ``Node`` with its links (concurrent calls share one). Reported: this
process's CPU time per call (``time.process_time``; redis-server's is not counted) and wall
time per call, for each concurrency, sides alternating within each round.

    PYTHONPATH=src python benchmarks/compare_links.py --calls 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import uvloop
from redis.asyncio.connection import Connection

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.store.redis.nodes import Node  # noqa: E402
from kvmeta.store.redis.resp import pack  # noqa: E402
from kvmeta.store.redis.url import parse_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.redis_support import RedisServer  # noqa: E402

VALUE = b"x" * 5000


async def redis_py(port: int, calls: int, tasks: int) -> tuple[float, float]:
    conns = [Connection(host="127.0.0.1", port=port) for _ in range(tasks)]
    for conn in conns:
        await conn.connect()
    command = pack(("ECHO", VALUE))

    async def run(conn: Connection, n: int) -> None:
        for _ in range(n):
            async with asyncio.timeout(2):  # kvmeta bounds every call
                await conn.send_packed_command(command, check_health=False)
                await conn.read_response()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(run(conn, calls // tasks) for conn in conns))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for conn in conns:
        await conn.disconnect()
    return cpu / calls * 1e6, wall / calls * 1e6


async def link(port: int, calls: int, tasks: int) -> tuple[float, float]:
    node = Node(parse_target(f"redis://127.0.0.1:{port}/0"), "", 0, read_timeout=2.0)
    await node.call("PING")
    command = pack(("ECHO", VALUE))

    async def run(n: int) -> None:
        for _ in range(n):
            await node.request(command, 1)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(run(calls // tasks) for _ in range(tasks)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await node.close()
    return cpu / calls * 1e6, wall / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", default="1,3,8", help="concurrencies (default: 1,3,8)")
    args = parser.parse_args()
    server = RedisServer().start()
    port = server.port
    try:
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for i in range(args.rounds):
            for tasks in map(int, args.tasks.split(",")):
                sides = [("redis-py", redis_py), ("Link", link)]
                for name, fn in sides if i % 2 == 0 else sides[::-1]:
                    got = uvloop.run(fn(port, args.calls, tasks))
                    results.setdefault((name, tasks), []).append(got)
        print(f"{args.calls} ECHO calls of {len(VALUE)} bytes, medians of {args.rounds} rounds:")
        print("side       tasks  CPU us/call  wall us/call")
        for (name, tasks), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            cpu = statistics.median(r[0] for r in runs)
            wall = statistics.median(r[1] for r in runs)
            print(f"{name:9s}  {tasks:5d}  {cpu:11.1f}  {wall:12.1f}")
    finally:
        server.close()


if __name__ == "__main__":
    main()
