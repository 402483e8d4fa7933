"""``kvmeta bench``: argument parsing and dispatch for the benchmark modes.

Modes: ``run`` (default; one configuration, repeated), ``sweep`` (vary pool size, batch,
clients or request rate; JSON + PNG chart), ``pair`` (two servers, A and B, on identical work
for several rounds: the median and spread of B/A in CPU per request), ``core`` (the pool model
in-process, plus bytes per stored key) and ``noisy`` (two tenants side by side: one over its
request-rate quota, the other's hit rate and latency with and without it).
Returns the text to print; ``kvmeta.cli`` does the printing.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any

from kvmeta.bench.driver import BenchConfig
from kvmeta.bench.launch import LAUNCH_MODES, Launch, run_on, with_launch
from kvmeta.bench.pair import ORDERS
from kvmeta.bench.redisstat import check_backend_url
from kvmeta.bench.report import (
    backend_notes,
    format_table,
    median_result,
    pacing_notes,
    refusal_notes,
    to_json,
)
from kvmeta.bench.workload import HttpClient
from kvmeta.client.urls import with_scheme
from kvmeta.errors import InvalidRequest

__all__ = ["add_arguments", "launch_of", "measure", "run", "server_args"]

logger = logging.getLogger(__name__)

# What a launched server gets unless --server-arg says otherwise: this cycle turns a 64k-page
# pool over in a second or two, faster than serve's 5 s default read lease, so with leases on
# nearly every reserve would be refused and the run would time refusals instead of eviction.
LAUNCH_DEFAULT_ARGS = ("--read-lease=0",)

_DESCRIPTION = """\
Drive a metadata server of either dialect with the engines' request cycle (exists, reserve,
confirm, get) from several client processes, and report requests/s, latency and the server's
CPU per request. Modes: run (one configuration; the default), sweep (vary --sweep over
--values; --out writes JSON and a PNG chart, which needs matplotlib: pip install
'kvmeta[bench]'), pair (servers A and B started fresh side by side each round and driven in
turn with the same keys and request count; the median of the rounds' B/A ratios of CPU per
request, with their min-max), core (the pool model in-process, no HTTP; uses --batch,
--pool-pages, --out, --json only)."""

_EPILOG = """\
examples:
  kvmeta bench --launch                       durable server on a free port, read leases off
  kvmeta bench --launch durable --server-arg=--fsync=always   CPU and journal bytes per request
  kvmeta bench --launch redis --workers 2     private redis-server, 2 workers; its CPU apart
  kvmeta bench --url http://127.0.0.1:18000 --server-pid 1234 --dialect v
  kvmeta bench sweep --sweep pool --launch --repeat 3 --out results/sweep_pool
  kvmeta bench pair --launch memory --b-arg=--events=tcp://127.0.0.1:{port} --subscribe
  kvmeta bench pair --a-src /tmp/old/src --b-src src --launch redis   before/after, one valkey
  kvmeta bench core
  kvmeta bench noisy                          tenant A at 10x its rate quota next to tenant B"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"must be a number of requests per second, 0 or more, got {text} (0: each client "
            "sends its next request as soon as the last is answered)"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "mode",
        nargs="?",
        default="run",
        choices=("run", "sweep", "pair", "core", "noisy"),
        help="what to measure (default: %(default)s)",
    )
    server = parser.add_argument_group("server to measure (run, sweep)")
    server.add_argument(
        "--url",
        help="a running server to drive, e.g. http://127.0.0.1:18000 (HOST:PORT means "
        "http://HOST:PORT; a token may be the password: http://:TOKEN@HOST:PORT) (default: "
        "none; give --url or --launch)",
    )
    server.add_argument(
        "--launch",
        nargs="?",
        const="durable",
        choices=LAUNCH_MODES,
        help="start `kvmeta serve` on a free port and measure it, fresh for every run; "
        "durable: the serve default (journal in a temporary directory; the report adds "
        "journal bytes per request), memory: --in-memory, redis: --backend on a private "
        "redis-server (needs redis-server on PATH; the report adds its CPU per request) "
        "(default: off; --launch alone: durable)",
    )
    server.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="server processes on one port, with --launch redis (they share its state) "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--redis-transport",
        choices=("tcp", "unix"),
        default="tcp",
        help="how the launched server reaches the redis-server of --launch redis: loopback "
        "TCP or a unix socket (default: %(default)s)",
    )
    server.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra `kvmeta serve` flag for --launch, repeatable, e.g. "
        "--server-arg=--fsync=always (default: " + " ".join(LAUNCH_DEFAULT_ARGS) + ", so the "
        "run measures eviction, unless a --server-arg sets --read-lease)",
    )
    server.add_argument(
        "--server-pid",
        type=int,
        help="pid of the --url server, for its CPU per request (default: the launched "
        "server's pid; none with --url, so no CPU numbers)",
    )
    server.add_argument(
        "--backend-pid",
        type=int,
        help="pid of the --url server's shared state process (e.g. its redis-server), for "
        "that process's CPU per request (default: the redis-server of --launch redis; none "
        "otherwise)",
    )
    server.add_argument(
        "--backend-url",
        metavar="URL",
        help="the --url server's Redis, in any form kvmeta serve --backend takes (redis://, "
        "rediss://, unix://, redis+cluster://H:P[,H:P] or redis+sentinel://H:P[,H:P]/MASTER, "
        "read the same way), for redis-server CPU per request from INFO cpu "
        "of every primary, per primary on a cluster; --backend-pid wins when both are given "
        "(default: the Redis the server reports in /v1/pools, when it shows no password)",
    )
    server.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help="send `Authorization: Bearer TOKEN` with every request; a launched server is "
        "started with --auth-token TOKEN; core: the app checks it (default: none)",
    )
    work = parser.add_argument_group("workload (run, sweep; core uses --batch, --pool-pages)")
    work.add_argument(
        "--dialect",
        choices=("s", "v"),
        default="s",
        help="s: SGLang HiCache, v: vLLM HF3FS (default: %(default)s)",
    )
    work.add_argument(
        "--batch", type=_positive_int, default=64, help="keys per request (default: %(default)s)"
    )
    work.add_argument(
        "--pool-pages",
        type=_positive_int,
        default=65536,
        help="pages in the pool (rank 0); an existing pool keeps its size and the report "
        "shows that size (default: %(default)s)",
    )
    work.add_argument(
        "--clients",
        type=_positive_int,
        default=3,
        help="client processes, one connection each (default: %(default)s)",
    )
    work.add_argument(
        "--duration",
        type=_positive_float,
        default=5.0,
        help="measured seconds (default: %(default)s)",
    )
    work.add_argument(
        "--requests",
        type=_non_negative_int,
        default=0,
        help="measure this many requests in total instead of --duration seconds (default: "
        "%(default)s, use --duration)",
    )
    work.add_argument(
        "--rate",
        type=_rate,
        default=0.0,
        metavar="REQ_PER_S",
        help="send this many requests per second in total, at random (Poisson) times, so "
        "servers compared serve the same load; a request sent late because the last answer "
        "was slow counts its latency from its due time (default: %(default)s, each client "
        "sends its next request as soon as the last is answered: the machine's capacity)",
    )
    work.add_argument(
        "--warmup",
        type=_non_negative_float,
        default=1.0,
        help="seconds of load before measuring (default: %(default)s)",
    )
    work.add_argument(
        "--no-prefill",
        action="store_true",
        help="start with an empty pool (default: off, the pool is filled first so every "
        "measured reserve evicts)",
    )
    work.add_argument(
        "--repeat",
        type=_positive_int,
        default=1,
        help="runs, each on a fresh server with --launch; the report is the median (default: "
        "%(default)s)",
    )
    noisy = parser.add_argument_group(
        "noisy (two tenants on a launched server; --launch memory|durable|redis, default memory)"
    )
    noisy.add_argument(
        "--a-quota",
        type=_positive_float,
        default=100.0,
        help="tenant A's requests_per_second in the tokens file (default: %(default)s)",
    )
    noisy.add_argument(
        "--a-factor",
        type=_positive_float,
        default=10.0,
        help="tenant A sends this many times its quota (default: %(default)s)",
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--sweep",
        choices=("pool", "batch", "clients", "rate"),
        default="pool",
        help="the parameter to vary; rate: requests/s in total, as --rate (default: %(default)s)",
    )
    sweep.add_argument(
        "--values",
        help="comma-separated values of --sweep (default: pool 4096,65536,262144,1048576; "
        "batch 64,128,256; clients 1,2,3,4; rate 500,1000,2000,3000)",
    )
    pair = parser.add_argument_group(
        "pair (servers A and B; each side's launch kind defaults to --launch, else memory)"
    )
    for side in ("a", "b"):
        upper = side.upper()
        pair.add_argument(
            f"--{side}-launch",
            choices=LAUNCH_MODES,
            help=f"how server {upper} is started (default: --launch, else memory); both redis: "
            "they share one redis-server, A in database 0, B in 1",
        )
        pair.add_argument(
            f"--{side}-src",
            metavar="PATH",
            help=f"the src directory server {upper} imports kvmeta from, e.g. another checkout's "
            "(default: this kvmeta)",
        )
        pair.add_argument(
            f"--{side}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"extra `kvmeta serve` flag for {upper} only, repeatable, after --server-arg; "
            "{port} in it becomes a free port, e.g. "
            f"--{side}-arg=--events=tcp://127.0.0.1:{{port}} (default: none)",
        )
    pair.add_argument(
        "--rounds",
        type=_positive_int,
        default=5,
        help="rounds; each starts both servers fresh and measures each once (default: %(default)s)",
    )
    pair.add_argument(
        "--order",
        choices=ORDERS,
        default="abba",
        help="abba: A first in odd rounds, B first in even ones; ab: always A first (default: "
        "%(default)s)",
    )
    pair.add_argument(
        "--subscribe",
        action="store_true",
        help="connect a subscriber that receives every event batch to each side serving "
        "--events (needs the events extra) (default: off, batches go to no subscriber)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of a table (default: off, a table)",
    )
    out.add_argument(
        "--out",
        metavar="STEM",
        help="sweep, core: also write STEM.json (sweep: and STEM.png; needs matplotlib) "
        "(default: none, print only)",
    )


def server_args(given: list[str]) -> list[str]:
    """The flags a launched server gets: ``LAUNCH_DEFAULT_ARGS`` unless the caller set that
    option (by flag or by its ``KVMETA_*`` variable, which the server inherits), then theirs."""
    out = []
    for default in LAUNCH_DEFAULT_ARGS:
        flag = default.split("=", 1)[0]
        env = "KVMETA_" + flag.lstrip("-").replace("-", "_").upper()
        if env not in os.environ and not any(a.split("=", 1)[0] == flag for a in given):
            out.append(default)
    return out + list(given)


def _config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        url=with_scheme(args.url) if args.url else "",
        dialect=args.dialect,
        batch=args.batch,
        pool_pages=args.pool_pages,
        clients=args.clients,
        duration=args.duration,
        requests=args.requests,
        warmup=args.warmup,
        prefill=not args.no_prefill,
        server_pid=args.server_pid,
        auth_token=args.auth_token,
        backend_pid=args.backend_pid,
        backend_url=args.backend_url,
        rate=args.rate,
    )


def launch_of(args: argparse.Namespace) -> Launch | None:
    """What ``--launch`` and its companion flags start for each run; None without --launch.

    Raises:
        InvalidRequest: --workers above 1 without --launch redis (the workers of an embedded
            store would not share state).
    """
    if args.workers > 1 and args.launch != "redis":
        raise InvalidRequest(
            f"--workers {args.workers} needs --launch redis: server processes share their "
            "pools only through a shared backend (drop --workers to measure one process)"
        )
    if not args.launch:
        return None
    given = list(args.server_arg)
    if args.auth_token:
        given.append(f"--auth-token={args.auth_token}")
    return Launch(args.launch, server_args(given), args.workers, args.redis_transport)


def measure(cfg: BenchConfig, launch: Launch | None, repeat: int) -> dict[str, Any]:
    """``repeat`` runs of ``cfg``, each on fresh launched processes when ``launch`` is set;
    returns the median result."""
    runs = []
    for i in range(repeat):
        runs.append(run_on(cfg, launch))
        cpu = runs[-1]["cpu_us_per_request"]
        logger.info(
            "run %d/%d: %s us/request",
            i + 1,
            repeat,
            "-" if cpu is None else f"{cpu:.1f}",
        )
    return with_launch(median_result(runs), launch)


def _report(results: list[dict[str, Any]], as_json: bool, payload: object) -> str:
    """The text to print; refusals are shown where they will be seen (after the table, or on
    stderr when stdout is JSON)."""
    notes = pacing_notes(results) + refusal_notes(results)
    if as_json:
        for note in notes:
            logger.warning("%s", note)
        return to_json(payload)
    return "\n\n".join([format_table(results), *backend_notes(results), *notes])


def _noisy(args: argparse.Namespace) -> str:
    """Two tenants side by side on a launched server (``bench.noisy``)."""
    from kvmeta.bench.noisy import NoisyConfig, format_noisy, run_noisy

    if args.url:
        raise InvalidRequest("noisy launches its own server (with a tokens file): drop --url")
    cfg = NoisyConfig(
        launch=args.launch or "memory",
        pool_pages=args.pool_pages if args.pool_pages != 65536 else NoisyConfig.pool_pages,
        batch=args.batch if args.batch != 64 else NoisyConfig.batch,
        duration=args.duration if args.duration != 5.0 else NoisyConfig.duration,
        warmup=max(args.warmup, 1.0),
        a_quota=args.a_quota,
        a_factor=args.a_factor,
    )
    result = run_noisy(cfg)
    return to_json(result) if args.json else format_noisy(result)


# Requests per run of `bench pair` when --requests is not given: every run must do the same work.
PAIR_REQUESTS = 10000


def _pair(args: argparse.Namespace) -> str:
    """Servers A and B on identical work, round after round (``bench.pair``)."""
    from kvmeta.bench.pair import PairPlan, Side, format_pair, run_pair

    if args.url:
        raise InvalidRequest(
            "pair starts both servers itself, fresh every round: drop --url (choose each side "
            "with --a-launch/--b-launch, --a-src/--b-src and --a-arg/--b-arg)",
            "url",
        )
    given = list(args.server_arg)
    if args.auth_token:
        given.append(f"--auth-token={args.auth_token}")
    sides = []
    for label in ("a", "b"):
        mode = getattr(args, f"{label}_launch") or args.launch or "memory"
        extra = server_args(given + getattr(args, f"{label}_arg"))
        sides.append(Side(label, mode, extra, getattr(args, f"{label}_src")))
    if args.workers > 1 and any(s.mode != "redis" for s in sides):
        raise InvalidRequest(
            f"--workers {args.workers} needs both sides on redis (--launch redis): server "
            "processes share their pools only through a shared backend (drop --workers to "
            "measure one process)",
            "workers",
        )
    if args.subscribe:
        from kvmeta.bench.subscriber import _zmq, events_endpoint

        if not any(events_endpoint(s.args) for s in sides):
            raise InvalidRequest(
                "--subscribe needs a side serving KV events: add e.g. "
                "--b-arg=--events=tcp://127.0.0.1:{port}",
                "subscribe",
            )
        for side in sides:
            endpoint = events_endpoint(side.args)
            if endpoint and endpoint.startswith("tcp://") and endpoint.endswith(":0"):
                raise InvalidRequest(
                    f"--subscribe cannot reach {endpoint}: a server binding port 0 publishes on "
                    "a port chosen at start that the subscriber is never told; give the side a "
                    "port of its own, e.g. --b-arg=--events=tcp://127.0.0.1:{port}",
                    "subscribe",
                )
        _zmq()  # a missing events extra fails before anything runs
    for side in sides:
        side.check()
    cfg = _config(args)
    cfg.requests = args.requests or PAIR_REQUESTS
    plan = PairPlan(
        sides[0],
        sides[1],
        rounds=args.rounds,
        order=args.order,
        subscribe=args.subscribe,
        workers=args.workers,
        redis_transport=args.redis_transport,
    )
    result = run_pair(cfg, plan)
    if args.json:
        for note in result["notes"]:
            logger.warning("%s", note)
        return to_json(result)
    return format_pair(result)


def run(args: argparse.Namespace) -> str:
    """Run the chosen mode; returns the report text.

    Raises:
        InvalidRequest: neither --url nor --launch was given where a server is needed, or a
            flag's value is unusable.
        ServerUnavailable: nothing answers at --url.
        KvmetaError: sweep --out without matplotlib (checked before measuring anything).
    """
    if args.mode == "core":
        from kvmeta.bench import core_bench

        result = core_bench.run(
            batch=args.batch, pool_pages=args.pool_pages, out=args.out, auth_token=args.auth_token
        )
        return to_json(result) if args.json else core_bench.format_report(result)
    if args.mode == "noisy":
        return _noisy(args)
    if args.mode == "pair":
        return _pair(args)
    if not args.url and not args.launch:
        raise InvalidRequest("give --url URL of a running server, or --launch to start kvmeta")
    if args.url and args.launch:
        raise InvalidRequest("give either --url (a running server) or --launch, not both")
    cfg = _config(args)
    if cfg.url:
        HttpClient(cfg.url)  # a malformed URL fails here, before anything runs
    if args.backend_url:
        check_backend_url(args.backend_url)
    launch = launch_of(args)
    if args.mode == "sweep":
        from kvmeta.bench import sweep

        sweep.values(args.sweep, args.values)  # bad --values fail before anything runs
        if args.out:
            sweep.require_chart()
        results = sweep.run(cfg, args.sweep, args.values, launch, args.repeat)
        if args.out:
            sweep.write(results, args.sweep, args.out)
        return _report(results, args.json, results)
    result = measure(cfg, launch, args.repeat)
    return _report([result], args.json, result)
