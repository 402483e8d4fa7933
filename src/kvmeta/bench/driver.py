"""Drive a server with the engines' cycle from several client processes and measure it.

Timeline of one run: initialise the pool, prefill it (so every measured reserve evicts),
start the clients and wait until every one has had its first answer, let them warm up, then
open the measured window: clients record each request's latency while a shared flag is up, and
the server's utime + stime is read from /proc at the window's two edges. Warm-up and prefill
are therefore excluded from every number. Waiting for the clients matters: spawning a process
takes the better part of a second on a small busy machine, and a window opened on clients
still starting would measure fewer of them than asked (or none), without saying so.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from kvmeta.bench import procstat
from kvmeta.bench.pacing import Pacer
from kvmeta.bench.redisstat import RedisCpu, backend_url_of
from kvmeta.bench.workload import (
    BenchHttpError,
    HttpClient,
    KeyChain,
    cycle_for,
    initialize_pool,
    pool_size,
    prefill,
)
from kvmeta.client.urls import split_credentials
from kvmeta.errors import KvmetaError, ServerUnavailable

__all__ = ["BenchConfig", "BenchResult", "run_bench"]

logger = logging.getLogger(__name__)

# Phases of the shared flag the clients watch.
_WARMUP, _MEASURE, _STOP = 0, 1, 2


@dataclass
class BenchConfig:
    """One benchmark run. ``requests`` > 0 ends the window after that many requests in total
    (split across clients) instead of after ``duration`` seconds."""

    url: str = ""
    dialect: str = "s"
    batch: int = 64
    pool_pages: int = 65536
    clients: int = 3
    duration: float = 5.0
    requests: int = 0
    warmup: float = 1.0
    prefill: bool = True
    rank: int = 0
    server_pid: int | None = None
    # The key chains' seed: a run given one sends the same keys as every other run given it
    # (``bench pair`` compares two servers on identical work); "": a new seed for each run.
    seed: str = ""
    # Sent as ``Authorization: Bearer`` with every request (a server run with --auth-token).
    auth_token: str | None = None
    # The process holding the server's shared state (redis-server): its CPU is reported apart.
    backend_pid: int | None = None
    # The server's Redis, for its primaries' CPU from INFO cpu when there is no backend_pid
    # (None: the URL the server reports in /v1/pools, if it is Redis and shows no password).
    backend_url: str | None = None
    # A durable server's data directory: its journal growth over the window is reported.
    data_dir: str | None = None
    # Requests per second in total, sent at random times (``pacing``), so servers compared
    # serve the same load; 0: each client sends its next request as soon as the last is
    # answered (the machine's capacity).
    rate: float = 0.0
    # Seconds for every client to start and get its first answer before the run fails.
    start_timeout: float = 60.0


@dataclass
class BenchResult:
    config: dict[str, Any]
    requests: int
    key_ops: int
    seconds: float
    requests_per_s: float
    key_ops_per_s: float
    latency_p50_us: float
    latency_p99_us: float
    server_cpu_s: float | None = None
    cpu_us_per_request: float | None = None
    cpu_us_per_key: float | None = None
    server_rss_mb: float | None = None
    refused_keys: int = 0
    # Keys the measured cycles asked a page for: refused_keys is out of this many.
    reserved_keys: int = 0
    backend_cpu_s: float | None = None
    backend_cpu_us_per_request: float | None = None
    # Where backend_cpu_s came from: "pid" (/proc of backend_pid) or "info" (INFO cpu).
    backend_cpu_source: str | None = None
    # With "info": each primary's share, "host:port" -> us/request (they sum to the total).
    backend_nodes_cpu_us_per_request: dict[str, float] | None = None
    journal_bytes_per_request: float | None = None
    # Measured requests of each client: a client that measured far less than the others
    # was starved (or started late), and the total alone would not show it.
    client_requests: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _ClientReport:
    latencies: list[float]  # seconds, one per measured request
    keys: int
    refused: int
    reserved: int
    error: str


def _nap(phase: Synchronized[int]) -> Callable[[float], None]:
    """A sleep that ends early when the run stops: at a low ``--rate`` the next request may be
    due long after the window closes, and the client must not keep the run waiting for it."""

    def sleep(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while phase.value != _STOP:
            left = end - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    return sleep


def _client_main(
    cfg: BenchConfig,
    index: int,
    phase: Synchronized[int],
    started: Synchronized[int],
    quota: int,
    out: mp.Queue[_ClientReport],
) -> None:
    client = HttpClient(cfg.url, auth_token=cfg.auth_token)
    chain = KeyChain(f"{cfg.seed}-{index}")
    cycle = cycle_for(cfg.dialect)
    latencies: list[float] = []
    record = latencies.append
    keys = 0
    error = ""
    refused = reserved = 0
    perf = time.perf_counter
    pacer: Pacer | None = None
    answered = False

    def timed(path: str, body: object) -> object:
        nonlocal keys, answered, pacer
        if not answered:
            # The first request shows the client is connected and served; the parent opens
            # the warm-up only once every client's has been answered, so it is never timed,
            # and the pacing schedule starts after it.
            reply = client.call(path, body)
            answered = True
            with started.get_lock():
                started.value += 1
            if cfg.rate:
                pacer = Pacer(cfg.rate / cfg.clients, f"{cfg.seed}-{index}", sleep=_nap(phase))
            return reply
        start = pacer.wait() if pacer is not None else 0.0
        if phase.value != _MEASURE:
            return client.call(path, body)
        t0 = start or perf()
        reply = client.call(path, body)
        record(perf() - t0)
        keys += cfg.batch
        return reply

    try:
        while phase.value != _STOP:
            if quota and len(latencies) >= quota:
                break
            missed = cycle(cfg.rank, timed, chain.batch(cfg.batch))
            if phase.value == _MEASURE:
                refused += missed
                reserved += cfg.batch
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        error = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    out.put(_ClientReport(latencies, keys, refused, reserved, error))


def _collect(out: mp.Queue[_ClientReport], procs: list[Any], timeout: float) -> list[_ClientReport]:
    """Every client's report; fails fast when a client process died without one."""
    results: list[_ClientReport] = []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise KvmetaError(f"a benchmark client process exited with {dead[0]}") from None
            if time.monotonic() > deadline:
                raise KvmetaError(f"benchmark clients did not report within {timeout}s") from None
    return results


def _wait_started(
    started: Synchronized[int],
    procs: list[Any],
    out: mp.Queue[_ClientReport],
    cfg: BenchConfig,
) -> None:
    """Return once every client has had its first answer.

    Raises:
        KvmetaError: a client quit first (its error is in the message), or not every client
            started within ``cfg.start_timeout``; the message says how many did.
    """
    deadline = time.monotonic() + cfg.start_timeout
    while started.value < len(procs):
        quit_early = [p.exitcode for p in procs if p.exitcode is not None]
        if quit_early:
            try:
                error = out.get(timeout=1.0).error
            except queue.Empty:
                error = ""
            raise KvmetaError(
                f"{started.value} of {len(procs)} benchmark clients started: one stopped before "
                f"its first answer from {cfg.url} ({error or f'exit code {quit_early[0]}'})"
            )
        if time.monotonic() > deadline:
            raise KvmetaError(
                f"{started.value} of {len(procs)} benchmark clients started (connected and had "
                f"a first answer from {cfg.url}) within {cfg.start_timeout:g} s: the server is "
                "not answering, or this machine is too busy to start them; try fewer --clients"
            )
        time.sleep(0.01)


def _nothing_measured(cfg: BenchConfig, seconds: float) -> KvmetaError:
    if cfg.rate:
        why = (
            f"at --rate {cfg.rate:g} requests/s none was due in it: raise --rate or lengthen "
            "--duration"
        )
    else:
        why = "the server answered none of the requests in flight: lengthen --duration"
    return KvmetaError(
        f"the measured window ({seconds:.3g} s) saw no request, so there is nothing to report "
        f"({why})"
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    pos = min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))
    return sorted_values[pos]


def _unreachable(url: str, exc: OSError) -> ServerUnavailable:
    reason = exc.strerror or str(exc) or type(exc).__name__
    port = HttpClient(url).port
    return ServerUnavailable(
        f"nothing answers at {url} ({reason.lower()}): start a server there "
        f"(`kvmeta serve --port {port}`), or drop --url and pass --launch to have the "
        "benchmark start its own"
    )


def _setup(cfg: BenchConfig) -> int:
    """Initialise (and prefill) the pool; returns its size as the server reports it, which
    is not ``cfg.pool_pages`` when the pool already existed with another size.

    Raises:
        ServerUnavailable: nothing answers at ``cfg.url``.
        KvmetaError: the server requires a token and ``cfg.auth_token`` is not it.
    """
    client = HttpClient(cfg.url, auth_token=cfg.auth_token)
    try:
        try:
            reply = initialize_pool(client, cfg.dialect, cfg.rank, cfg.pool_pages)
        except OSError as exc:
            raise _unreachable(cfg.url, exc) from None
        except BenchHttpError as exc:
            if exc.status in (401, 403):
                given = "the token given is not the server's" if cfg.auth_token else "none given"
                raise KvmetaError(
                    f"{cfg.url} answered {exc.status} to {exc.path}: the server requires a token "
                    f"({given}); pass the server's --auth-token value as `kvmeta bench "
                    "--auth-token TOKEN`"
                ) from None
            raise
        pages = pool_size(client, cfg.dialect, cfg.rank, reply)
        if pages is None:
            logger.warning(
                "%s does not report pool sizes (no /v1/pools): the report assumes the pool has "
                "the %d pages of --pool-pages; start that server fresh so it does",
                cfg.url,
                cfg.pool_pages,
            )
            pages = cfg.pool_pages
        elif pages != cfg.pool_pages:
            logger.warning(
                "rank %d's pool (dialect %s) already exists at %s with %d pages, not the %d of "
                "--pool-pages: measuring the %d-page pool (the report says so). To measure %d "
                "pages, start the server fresh",
                cfg.rank,
                cfg.dialect,
                cfg.url,
                pages,
                cfg.pool_pages,
                pages,
                cfg.pool_pages,
            )
        if cfg.prefill:
            prefill(client, cfg.dialect, cfg.rank, pages, KeyChain(f"fill-{cfg.seed}"))
        return pages
    finally:
        client.close()


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Run one benchmark against ``cfg.url`` and return its numbers.

    Raises:
        ServerUnavailable: nothing answers at ``cfg.url``.
        KvmetaError: a client failed (its error is in the message).
    """
    if not cfg.seed:
        cfg.seed = f"{os.getpid()}-{time.time_ns()}"
    # A token in the URL (http://:TOKEN@host:port) is the token; the URL is shown without it.
    target = split_credentials(cfg.url)
    cfg.url = target.url
    cfg.auth_token = cfg.auth_token or target.token
    pages = _setup(cfg)
    redis_cpu = None if cfg.backend_pid else _redis_cpu(cfg)
    try:
        return _measure(cfg, pages, redis_cpu)
    finally:
        if redis_cpu is not None:
            redis_cpu.close()


def _redis_cpu(cfg: BenchConfig) -> RedisCpu | None:
    """The primaries whose INFO cpu is read around the window: ``cfg.backend_url``, else the
    Redis the server says it uses; None when neither names a reachable Redis."""
    url = cfg.backend_url
    if url is None:
        described = _server_backend(cfg)
        if described is None or "://" not in described:
            return None  # not a Redis backend (or a server that does not say)
        url = backend_url_of(described)
        if url is None:
            logger.warning(
                "the server's Redis (%s) needs a password it does not show: pass "
                "`--backend-url` with it (or `--backend-pid` for a local redis-server) to get "
                "redis-server CPU per request",
                described,
            )
            return None
    try:
        return RedisCpu(url)
    except KvmetaError as exc:
        if cfg.backend_url is not None:
            raise
        logger.warning("no redis-server CPU per request: %s", exc)
        return None


def _server_backend(cfg: BenchConfig) -> str | None:
    """The server's backend description from ``/v1/pools`` (kvmeta servers only)."""
    client = HttpClient(cfg.url, auth_token=cfg.auth_token)
    try:
        status, body = client.get("/v1/pools")
    finally:
        client.close()
    if status != 200:
        return None
    try:
        server = json.loads(body).get("server") or {}
    except (ValueError, AttributeError):
        return None
    backend = server.get("backend") if isinstance(server, dict) else None
    return backend if isinstance(backend, str) else None


def _measure(cfg: BenchConfig, pages: int, redis_cpu: RedisCpu | None) -> BenchResult:
    ctx = mp.get_context("spawn")
    phase = ctx.Value("i", _WARMUP, lock=False)
    started = ctx.Value("i", 0)
    out: mp.Queue[_ClientReport] = ctx.Queue()
    quota = -(-cfg.requests // cfg.clients) if cfg.requests else 0
    procs = [
        ctx.Process(target=_client_main, args=(cfg, i, phase, started, quota, out), daemon=True)
        for i in range(cfg.clients)
    ]
    for proc in procs:
        proc.start()
    results: list[_ClientReport] = []
    failed = True
    try:
        _wait_started(started, procs, out, cfg)
        time.sleep(cfg.warmup)
        cpu0 = procstat.cpu_seconds(cfg.server_pid) if cfg.server_pid else None
        backend0 = procstat.cpu_seconds(cfg.backend_pid) if cfg.backend_pid else None
        nodes0 = redis_cpu.sample() if redis_cpu is not None else None
        journal0 = _journal_bytes(cfg.data_dir)
        t0 = time.perf_counter()
        phase.value = _MEASURE
        if quota:
            results = _collect(out, procs, 3600.0)
        else:
            time.sleep(cfg.duration)
        phase.value = _STOP
        t1 = time.perf_counter()
        cpu1 = procstat.cpu_seconds(cfg.server_pid) if cfg.server_pid else None
        backend1 = procstat.cpu_seconds(cfg.backend_pid) if cfg.backend_pid else None
        nodes1 = redis_cpu.sample() if redis_cpu is not None else None
        journal1 = _journal_bytes(cfg.data_dir)
        rss = procstat.rss_bytes(cfg.server_pid) if cfg.server_pid else None
        if not quota:
            results = _collect(out, procs, 60.0)
        failed = False
    finally:
        phase.value = _STOP
        for proc in procs:
            if failed:
                proc.kill()  # what a client of a failed run would still send does not matter
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        out.close()
        out.join_thread()
    errors = [r.error for r in results if r.error]
    if errors:
        raise KvmetaError(f"{len(errors)} benchmark client(s) failed, e.g. {errors[0]}")
    result = _summarise(cfg, results, t1 - t0, cpu0, cpu1, rss)
    if not result.requests:
        raise _nothing_measured(cfg, t1 - t0)
    # The report names the pool that was measured; what was asked for stays next to it.
    result.config["pool_pages_requested"] = cfg.pool_pages
    result.config["pool_pages"] = pages
    result.refused_keys = sum(r.refused for r in results)
    result.reserved_keys = sum(r.reserved for r in results)
    if result.requests and backend0 is not None and backend1 is not None:
        result.backend_cpu_s = backend1 - backend0
        result.backend_cpu_us_per_request = result.backend_cpu_s / result.requests * 1e6
        result.backend_cpu_source = "pid"
    elif result.requests and nodes0 is not None and nodes1 is not None:
        spent = {node: nodes1[node] - nodes0[node] for node in nodes0}
        result.backend_cpu_s = sum(spent.values())
        result.backend_cpu_us_per_request = result.backend_cpu_s / result.requests * 1e6
        result.backend_cpu_source = "info"
        result.backend_nodes_cpu_us_per_request = {
            node: cpu / result.requests * 1e6 for node, cpu in spent.items()
        }
    # A snapshot in the window compacts the journal: then its growth says nothing.
    if result.requests and journal0 is not None and journal1 is not None and journal1 >= journal0:
        result.journal_bytes_per_request = (journal1 - journal0) / result.requests
    return result


def _journal_bytes(data_dir: str | None) -> int | None:
    """Bytes in a durable server's journal files; None without a data directory."""
    if not data_dir:
        return None
    total = 0
    for path in Path(data_dir).glob("journal-*.log"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            continue  # removed by a snapshot meanwhile
    return total


def _summarise(
    cfg: BenchConfig,
    results: list[_ClientReport],
    seconds: float,
    cpu0: float | None,
    cpu1: float | None,
    rss: int | None,
) -> BenchResult:
    lat = sorted(x for r in results for x in r.latencies)
    n = len(lat)
    keys = sum(r.keys for r in results)
    config = asdict(cfg)
    if cfg.auth_token:
        config["auth_token"] = "(set)"  # the report may be shared; the token is not
    res = BenchResult(
        config=config,
        requests=n,
        key_ops=keys,
        seconds=seconds,
        requests_per_s=n / seconds if seconds else 0.0,
        key_ops_per_s=keys / seconds if seconds else 0.0,
        latency_p50_us=_percentile(lat, 0.50) * 1e6,
        latency_p99_us=_percentile(lat, 0.99) * 1e6,
        client_requests=[len(r.latencies) for r in results],
        extra={"latency_mean_us": statistics.fmean(lat) * 1e6 if lat else 0.0},
    )
    if cpu0 is not None and cpu1 is not None:
        res.server_cpu_s = cpu1 - cpu0
        res.cpu_us_per_request = res.server_cpu_s / n * 1e6 if n else None
        res.cpu_us_per_key = res.server_cpu_s / keys * 1e6 if keys else None
    if rss is not None:
        res.server_rss_mb = rss / 1e6
    return res
