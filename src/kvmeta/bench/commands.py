"""``kvmeta bench``: argument parsing and dispatch for the benchmark modes.

Modes: ``run`` (default; one configuration, repeated), ``sweep`` (vary pool size, batch or
clients; JSON + PNG chart) and ``core`` (the pool model in-process, plus bytes per stored key).
Returns the text to print; ``kvmeta.cli`` does the printing.
"""

from __future__ import annotations

import argparse
import logging

from kvmeta.bench.driver import BenchConfig, run_bench
from kvmeta.bench.launch import LaunchedServer
from kvmeta.bench.report import format_table, median_result, to_json
from kvmeta.errors import InvalidRequest

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode", nargs="?", default="run", choices=("run", "sweep", "core"), help="what to measure"
    )
    parser.add_argument("--url", help="server to drive, e.g. http://127.0.0.1:18000")
    parser.add_argument(
        "--launch",
        nargs="?",
        const="durable",
        choices=("durable", "memory"),
        help="start `kvmeta serve` on a free port (durable: the default mode; memory: "
        "--in-memory) and measure it",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--server-pid", type=int, help="pid of the server, for CPU per request")
    parser.add_argument("--dialect", choices=("s", "v"), default="s", help="s: SGLang, v: vLLM")
    parser.add_argument("--batch", type=int, default=64, help="keys per request")
    parser.add_argument("--pool-pages", type=int, default=65536, help="pages in the pool")
    parser.add_argument("--clients", type=int, default=3, help="client processes")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    parser.add_argument("--requests", type=int, default=0, help="measure this many requests")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    parser.add_argument("--no-prefill", action="store_true", help="start with an empty pool")
    parser.add_argument("--repeat", type=int, default=1, help="runs; the report is the median")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--sweep",
        choices=("pool", "batch", "clients"),
        default="pool",
        help="sweep mode: the parameter to vary",
    )
    parser.add_argument("--values", help="sweep mode: comma-separated values")
    parser.add_argument("--out", help="sweep/core mode: write JSON (and PNG) with this stem")


def _config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        url=args.url or "",
        dialect=args.dialect,
        batch=args.batch,
        pool_pages=args.pool_pages,
        clients=args.clients,
        duration=args.duration,
        requests=args.requests,
        warmup=args.warmup,
        prefill=not args.no_prefill,
        server_pid=args.server_pid,
    )


def measure(cfg: BenchConfig, launch: str | None, server_args: list[str], repeat: int) -> dict:
    """``repeat`` runs of ``cfg``, each on a fresh launched server when ``launch`` is set;
    returns the median result."""
    runs = []
    for i in range(repeat):
        if launch:
            with LaunchedServer(launch, server_args) as server:
                cfg.url, cfg.server_pid, cfg.seed = server.url, server.pid, ""
                runs.append(run_bench(cfg).to_dict())
        else:
            cfg.seed = ""
            runs.append(run_bench(cfg).to_dict())
        logger.info(
            "run %d/%d: %.1f us/request", i + 1, repeat, runs[-1]["cpu_us_per_request"] or 0
        )
    result = median_result(runs)
    result["config"]["launch"] = launch
    if result["refused_keys"]:
        logger.warning(
            "%d keys got no page: every page was busy (read-leased or reserved), so these runs "
            "time refusals, not eviction. Use a larger --pool-pages or start the server with "
            "--read-lease 0 (see benchmarks/README.md, 'Read leases and this workload')",
            result["refused_keys"],
        )
    return result


def run(args: argparse.Namespace) -> str:
    """Run the chosen mode; returns the report text.

    Raises:
        InvalidRequest: neither --url nor --launch was given where a server is needed.
    """
    if args.mode == "core":
        from kvmeta.bench import core_bench

        result = core_bench.run(batch=args.batch, pool_pages=args.pool_pages, out=args.out)
        return to_json(result) if args.json else core_bench.format_report(result)
    if not args.url and not args.launch:
        raise InvalidRequest("give --url URL of a running server, or --launch to start kvmeta")
    cfg = _config(args)
    if args.mode == "sweep":
        from kvmeta.bench import sweep

        results = sweep.run(cfg, args.sweep, args.values, args.launch, args.server_arg, args.repeat)
        if args.out:
            sweep.write(results, args.sweep, args.out)
        return to_json(results) if args.json else format_table(results)
    result = measure(cfg, args.launch, args.server_arg, args.repeat)
    return to_json(result) if args.json else format_table([result])
