"""Scale-out benchmark: the SGLang batch-64 cycle on Redis with 1, 2, 4 workers vs embedded.

One cycle = exists, reserve, confirm, get, 64 keys each (4 requests), from several client
processes over keep-alive connections, against one pool of 65,536 pages. For each setup it
prints requests/s and CPU per request from /proc/PID/stat, split between the kvmeta
processes (all workers) and redis-server. Run from the repository root:

    python benchmarks/bench_redis.py [--seconds 5] [--clients 4] [--workers 1 2 4]
        [--transport tcp unix]

Requires ``redis-server`` on PATH (``./scripts/test`` installs it). Prints, never asserts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.redis_support import RedisServer  # noqa: E402
from tests.support import ServerProcess  # noqa: E402

BATCH = 64
PAGES = 65536
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> bytes:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status >= 300:
        raise RuntimeError(f"{path}: {resp.status} {data[:200]!r}")
    return data


WARM_UP = 1.0


def client(url: str, index: int, seconds: float, barrier: Any, out: multiprocessing.Queue) -> None:
    """One engine: the batch-64 cycle for ``seconds`` after a warm-up; reports requests done."""
    try:
        out.put(_cycles(url, index, seconds, barrier))
    except Exception as exc:  # reported by the parent
        out.put(f"client {index}: {exc!r}")


def _cycles(url: str, index: int, seconds: float, barrier: Any) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    conn.connect()
    barrier.wait()  # every client is up: all measure the same window (spawn start-up varies)
    start_at = time.monotonic() + WARM_UP
    stop_at = start_at + seconds
    done = 0
    cycle = 0
    while True:
        now = time.monotonic()
        if now >= stop_at:
            break
        keys = [f"{index:08x}{cycle:016x}{j:040x}" for j in range(BATCH)]
        body = json.dumps({"keys": keys}).encode()
        _post(conn, "/0/exists", body)
        reserve = json.dumps({"keys": [[k, None] for k in keys]}).encode()
        indices = json.loads(_post(conn, "/0/reserve_and_allocate_page_indices", reserve))
        pairs = [[k, p] for k, (hit, p) in zip(keys, indices["indices"], strict=True) if p >= 0]
        _post(conn, "/0/confirm_write", json.dumps({"written_keys_to_confirm": pairs}).encode())
        _post(conn, "/0/get_page_indices", body)
        cycle += 1
        if now >= start_at:
            done += 4
    conn.close()
    return done


def _worker_pids(server: ServerProcess, count: int) -> list[int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pids = [int(p) for p in re.findall(r"listening on \S+ \(pid (\d+)\)", server.log)]
        if len(pids) >= count:
            return sorted(set(pids) | {server.pid})
        time.sleep(0.05)
    raise RuntimeError(f"workers did not start:\n{server.log}")


def run_setup(
    args: list[str], workers: int, redis: RedisServer | None, opts: argparse.Namespace
) -> dict[str, float]:
    if redis is not None:
        redis.flush()
    server = ServerProcess(*args)
    server.start()
    try:
        pids = _worker_pids(server, workers) if workers > 1 else [server.pid]
        conn = http.client.HTTPConnection(server.url.split("//")[1].split(":")[0], server.port)
        _post(conn, "/0/initialize", json.dumps({"num_pages": PAGES}).encode())
        conn.close()
        ctx = multiprocessing.get_context("spawn")
        out: multiprocessing.Queue = ctx.Queue()
        barrier = ctx.Barrier(opts.clients + 1)
        procs = [
            ctx.Process(target=client, args=(server.url, i, opts.seconds, barrier, out))
            for i in range(opts.clients)
        ]
        for proc in procs:
            proc.start()
        barrier.wait(120)
        t0 = time.monotonic() + WARM_UP
        stop = t0 + opts.seconds
        time.sleep(max(0.0, t0 - time.monotonic()))
        k0 = sum(cpu_seconds(p) for p in pids)
        r0 = cpu_seconds(redis.pid) if redis is not None else 0.0
        time.sleep(max(0.0, stop - time.monotonic()))
        k1 = sum(cpu_seconds(p) for p in pids)
        r1 = cpu_seconds(redis.pid) if redis is not None else 0.0
        counts = [out.get(timeout=60) for _ in procs]
        if not all(isinstance(c, int) for c in counts):
            raise RuntimeError(f"clients failed: {counts}")
        requests = sum(counts)
        for proc in procs:
            proc.join(30)
    finally:
        server.stop()
    return {
        "rps": requests / opts.seconds,
        "kvmeta_us": (k1 - k0) / requests * 1e6,
        "redis_us": (r1 - r0) / requests * 1e6,
        "kvmeta_cores": (k1 - k0) / opts.seconds,
        "redis_cores": (r1 - r0) / opts.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--transport", nargs="+", default=["tcp", "unix"], choices=["tcp", "unix"])
    parser.add_argument("--repeat", type=int, default=1, help="runs per setup; medians shown")
    opts = parser.parse_args()
    redis = RedisServer().start()
    setups: list[tuple[str, list[str], int, RedisServer | None]] = [
        ("embedded --in-memory", ["--in-memory", "--read-lease", "0"], 1, None)
    ]
    for n in opts.workers:
        for transport in opts.transport:
            url = redis.url if transport == "tcp" else redis.unix_url
            args = ["--backend", url, "--read-lease", "0", "--workers", str(n)]
            setups.append((f"redis {transport}, {n} worker(s)", args, n, redis))
    try:
        rows = []
        for name, args, workers, red in setups:
            runs = [run_setup(args, workers, red, opts) for _ in range(opts.repeat)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((name, row))
            print(f"{name:24s} done", file=sys.stderr)
    finally:
        redis.close()
    base = rows[0][1]["kvmeta_us"]
    print(
        f"\nSGLang batch-{BATCH} cycle, {opts.clients} client processes, {opts.seconds:g} s, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"{'setup':24s} {'req/s':>8s} {'kvmeta us/req':>14s} {'x embedded':>11s} "
        f"{'redis us/req':>13s} {'kvmeta cores':>13s} {'redis cores':>12s}"
    )
    for name, r in rows:
        print(
            f"{name:24s} {r['rps']:8.0f} {r['kvmeta_us']:14.0f} {r['kvmeta_us'] / base:11.2f} "
            f"{r['redis_us']:13.0f} {r['kvmeta_cores']:13.2f} {r['redis_cores']:12.2f}"
        )


if __name__ == "__main__":
    main()
